# expost: two commands on a fresh machine: `make run` and `make test`.
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
PYTEST_ARGS ?=

.PHONY: run test install install-test lint typecheck unit integration postgres redis browser bench clean

$(VENV)/.created:
	@$(PYTHON) -c 'import sys; assert sys.version_info[:2] == (3, 11), "expost needs Python 3.11, found " + sys.version.split()[0]'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	@touch $@

# The analysts' client (clients/python, a distribution of its own) is installed from the clone in the same
# pip command, which satisfies the server's expost-client requirement without any package index.
$(VENV)/.installed-run: $(VENV)/.created pyproject.toml clients/python/pyproject.toml
	$(BIN)/pip install -q -e ./clients/python -e .
	@touch $@

$(VENV)/.installed-test: $(VENV)/.created pyproject.toml clients/python/pyproject.toml
	$(BIN)/pip install -q -e ./clients/python -e '.[test]'
	@touch $@ $(VENV)/.installed-run

install: $(VENV)/.installed-run
install-test: $(VENV)/.installed-test

## run: set up, migrate the embedded SQLite database, create the demo datasets and keys (printing them with
## URLs on PORT), serve on 127.0.0.1:PORT (default 8000; `make run PORT=8123`)
PORT ?= 8000
run: install
	$(BIN)/expost migrate
	$(BIN)/expost demo --host 127.0.0.1 --port $(PORT)
	$(BIN)/expost serve --host 127.0.0.1 --port $(PORT)

## test: set up, lint, type-check and run the whole suite (SQLite and PostgreSQL, Redis for the queue)
test: install-test postgres redis browser lint typecheck
	$(BIN)/pytest -n 2 --dist loadfile -p no:cacheprovider $(PYTEST_ARGS)

lint: install-test
	$(BIN)/ruff check mechanisms service tests benchmarks migrations clients/python
	$(BIN)/ruff format --check mechanisms service tests benchmarks migrations clients/python

typecheck: install-test
	$(BIN)/mypy clients/python/src mechanisms service

## unit: the quick unit layer (the tests marked slow and the full-size Hypothesis profile run in `make test`)
unit: install-test
	$(BIN)/pytest tests/unit -q -n 2 -m "not slow" -p no:cacheprovider $(PYTEST_ARGS)

integration: install-test postgres
	$(BIN)/pytest tests/integration -q

## browser: Chromium for the dashboard's browser tests (tests/e2e); installed from Debian when root.
## Without it the e2e tests skip with the reason, and fail when CI=true.
browser:
	@command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] \
	  && (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver); } \
	  || echo "make browser: chromium is not installed (needs root: apt-get install chromium); the e2e tests will skip, or fail under CI=true"

## redis: make sure the local Redis answers on 127.0.0.1:6379 (starts it if it is down)
redis:
	@bash .ci/ensure-redis

## postgres: make sure the local PostgreSQL answers on 127.0.0.1:5432 (starts the cluster if it is down)
postgres:
	@bash .ci/ensure-postgres

bench: install-test postgres
	$(BIN)/python benchmarks/service_load.py

clean:
	rm -rf $(VENV) var .pytest_cache .mypy_cache .ruff_cache .hypothesis

## compose-check: validate docker-compose.yml without a Docker engine (Debian's docker-compose parses it)
.PHONY: compose-check compose-tools
compose-check: compose-tools
	docker-compose -f docker-compose.yml config --quiet

# tests/integration/test_containers.py validates the compose file with `docker-compose config`; install
# it when missing (needs root and Debian's apt; otherwise that test fails in CI with this explanation).
compose-tools:
	@command -v docker-compose >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  { DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends docker-compose >/dev/null || \
	    { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
	      --no-install-recommends docker-compose >/dev/null; }; }; } || \
	  echo "warning: docker-compose is not installed (apt-get install docker-compose as root);" \
	       "tests/integration/test_containers.py cannot validate docker-compose.yml" >&2
test: compose-tools
