# expost: two commands on a fresh machine: `make run` and `make test`.
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
PYTEST_ARGS ?=

.PHONY: run test install install-test lint typecheck unit integration postgres bench clean

$(VENV)/.created:
	@$(PYTHON) -c 'import sys; assert sys.version_info[:2] == (3, 11), "expost needs Python 3.11, found " + sys.version.split()[0]'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	@touch $@

$(VENV)/.installed-run: $(VENV)/.created pyproject.toml
	$(BIN)/pip install -q -e .
	@touch $@

$(VENV)/.installed-test: $(VENV)/.created pyproject.toml
	$(BIN)/pip install -q -e '.[test]'
	@touch $@ $(VENV)/.installed-run

install: $(VENV)/.installed-run
install-test: $(VENV)/.installed-test

## run: set up, migrate the embedded SQLite database, create a demo dataset and keys, serve on :8000
run: install
	$(BIN)/expost migrate
	$(BIN)/expost demo
	$(BIN)/expost serve --host 127.0.0.1 --port 8000

## test: set up, lint, type-check and run the whole suite (SQLite and PostgreSQL)
test: install-test postgres lint typecheck
	$(BIN)/pytest -n 2 --dist loadfile -p no:cacheprovider $(PYTEST_ARGS)

lint: install-test
	$(BIN)/ruff check mechanisms service tests benchmarks migrations

typecheck: install-test
	$(BIN)/mypy mechanisms service

unit: install-test
	$(BIN)/pytest tests/unit -q

integration: install-test postgres
	$(BIN)/pytest tests/integration -q

## postgres: make sure the local PostgreSQL answers on 127.0.0.1:5432 (starts the cluster if it is down)
postgres:
	@bash .ci/ensure-postgres

bench: install-test postgres
	$(BIN)/python benchmarks/service_load.py

clean:
	rm -rf $(VENV) var .pytest_cache .mypy_cache .ruff_cache .hypothesis
