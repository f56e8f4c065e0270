"""Issue 35, "the first hour of a new user", against the demo exactly as `make run` starts it.

The fixture runs the ``expost`` commands of the Makefile's ``run`` target (read with ``make -n run PORT=P``)
in an empty directory: ``expost migrate``, ``expost demo … --port P`` and a real ``expost serve`` process on
that free port (the embedded SQLite database of `make run`, and the same on a fresh PostgreSQL database).
The tests read the keys and ids from what the demo *printed*, then, as the analyst and with no admin step:

* run the demo's printed ``curl`` lines, the README's tour (its shell block, its Python block, its
  ``expost request submit`` line) and one example of every catalog mechanism from docs/examples.md, in
  sequence: every request is admitted (item 1 and the acceptance point); a catalog mechanism without an
  example there fails the test, so the page cannot fall behind the catalog;
* check the printed URLs carry the port, the analyst's name is printed (item 2), and a quantile at the
  ε = 8.5e-6 of the issue warns (item 1).

Further tests: the CLI names ``--url``/``EXPOST_URL`` when it cannot connect (item 2), the Python client
reads an ``adaops.ridge`` privacy report (item 4), and a δ share written as decimals is compared as
decimals (item 8).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from expost_client import (
    AnalysisRequest,
    BudgetExhaustedError,
    ExpostClient,
    InvalidInputError,
    PrivacyReport,
)
from mechanisms.accounting import capacity_units
from mechanisms.accounting.approximate import remainder_delta
from service.auth import Role
from service.cli import DEMO_BUDGET, DEMO_LEARNING_SCHEMA, app, demo_learning_csv
from service.embedded import free_port
from tests.conftest import LiveServer, fresh_postgres_database
from tests.integration.helpers import CSV, SCHEMA

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
EXAMPLES = ROOT / "docs" / "examples.md"
EXPOST = Path(sys.executable).with_name("expost")


# ----- the demo, as `make run` starts it --------------------------------------------------------------------


@dataclass(frozen=True)
class Demo:
    """What `make run` printed, and where its server listens."""

    url: str
    printed: str
    workdir: Path
    env: dict[str, str]

    def printed_value(self, pattern: str) -> str:
        match = re.search(pattern, self.printed, re.M)
        assert match is not None, f"the demo did not print {pattern!r}:\n{self.printed}"
        return match.group(1)

    @property
    def analyst_key(self) -> str:
        return self.printed_value(r"^  analyst key: +(xp_\S+)")

    @property
    def analyst_name(self) -> str:
        return self.printed_value(r"^  analyst key: +xp_\S+ +\(name ([^:)\s]+)")

    @property
    def viewer_key(self) -> str:
        return self.printed_value(r"^  viewer key: +(xp_\S+)")

    @property
    def census(self) -> str:
        return self.printed_value(r"^Demo dataset: (ds_\w+)")

    @property
    def customers(self) -> str:
        return self.printed_value(r"^Learning demo dataset: (ds_\w+)")

    def analyst(self) -> ExpostClient:
        return ExpostClient(self.url, self.analyst_key)


def _run(args: list[str], cwd: Path, env: dict[str, str], timeout: float = 300) -> str:
    done = subprocess.run(
        args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert done.returncode == 0, (args, done.stdout, done.stderr)
    return done.stdout


def _wait_ready(url: str, server: subprocess.Popen[bytes], log: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert server.poll() is None, f"expost serve exited:\n{log.read_text()[-3000:]}"
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"expost serve did not answer on {url} within {timeout} s")


def make_run_commands(port: int) -> list[list[str]]:
    """The ``expost`` commands of the Makefile's ``run`` target for ``PORT=port`` (``make -n``: printed, not
    run), with the venv's ``expost`` named absolutely: migrate, demo, serve."""
    recipe = _run(["make", "-n", "-s", "run", f"PORT={port}"], ROOT, {**os.environ, "MAKEFLAGS": ""})
    commands = [
        shlex.split(line)
        for line in recipe.splitlines()
        if re.search(r"\bexpost (migrate|demo|serve)\b", line)
    ]
    assert [command[1] for command in commands] == ["migrate", "demo", "serve"], recipe
    return [[str(EXPOST), *command[1:]] for command in commands]


@pytest.fixture(scope="module", params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def demo(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Demo]:
    """`make run` in an empty directory: migrate, demo (printing URLs on the port), serve on the port."""
    workdir = tmp_path_factory.mktemp("make-run")
    env = {k: v for k, v in os.environ.items() if not k.startswith("EXPOST_")}
    env["NO_COLOR"] = "1"
    fresh = None
    if request.param == "postgres":
        fresh = fresh_postgres_database()
        env["EXPOST_DATABASE_URL"] = fresh.url
    port = free_port()
    migrate, demo_command, serve = make_run_commands(port)
    _run(migrate, workdir, env)
    printed = _run(demo_command, workdir, env)
    log = workdir / "serve.log"
    with log.open("wb") as sink:
        server = subprocess.Popen(
            serve,
            cwd=workdir,
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_ready(url, server, log)
        yield Demo(url, printed, workdir, env)
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        if fresh is not None:
            fresh.drop()


# ----- item 2: what the demo prints -------------------------------------------------------------------------


def test_the_demo_prints_its_port_and_the_analysts_name(demo: Demo) -> None:
    port = demo.url.rsplit(":", 1)[1]
    assert f"127.0.0.1:{port}/v1/datasets/" in demo.printed
    ports = set(re.findall(r"127\.0\.0\.1:(\d+)", demo.printed))
    assert ports == {port}  # every URL, curl line and link names the port it serves (never 8000)
    assert f"export EXPOST_URL={demo.url} EXPOST_KEY={demo.analyst_key}" in demo.printed
    with demo.analyst() as analyst:
        assert analyst.me().name == demo.analyst_name  # the name grants and sub-budgets need
    assert "not a production one" in demo.printed
    again = _run([str(EXPOST), "demo", "--port", port], demo.workdir, demo.env)  # idempotent, same keys
    assert demo.analyst_key in again
    assert f"{demo.url}/dashboard" in again


def test_the_cli_names_the_url_setting_when_it_cannot_connect() -> None:
    nowhere = f"http://127.0.0.1:{free_port()}"
    params = json.dumps({"query": {"kind": "count"}, "epsilon": 0.1})
    result = CliRunner().invoke(
        app,
        ["request", "submit", "ds_nothing", "--params", params],
        env={"EXPOST_URL": nowhere, "EXPOST_KEY": "xp_nothing"},
    )
    assert result.exit_code == 1
    assert f"cannot talk to {nowhere}" in result.stderr
    assert "--url" in result.stderr
    assert "EXPOST_URL" in result.stderr


# ----- item 1 and the acceptance point: the README tour and every mechanism, as the analyst ----------------


def _curl_lines(printed: str) -> list[str]:
    """The demo's printed curl commands, each joined across its backslash continuations."""
    joined = re.sub(r"\\\n\s*", "", printed)
    return [line.strip() for line in joined.splitlines() if line.strip().startswith("curl ")]


def _readme_tour() -> str:
    text = README.read_text()
    start = text.index("## A five-minute tour")
    return text[start : text.index("\n## ", start + 1)]


def _fenced(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, re.S)


def _json_answer(output: str) -> dict[str, Any]:
    body = json.loads(output)
    assert isinstance(body, dict)
    assert "type" not in body or not str(body["type"]).startswith("/problems/"), body
    return body


def run_printed_curl_lines(demo: Demo) -> None:
    lines = _curl_lines(demo.printed)
    assert len(lines) == 3, lines
    for line in lines:
        answer = _json_answer(_run(["bash", "-c", line], demo.workdir, demo.env))
        assert answer.get("state", "committed") in ("committed", "running"), answer


def run_readme_tour(demo: Demo) -> None:
    tour = _readme_tour()
    [shell] = _fenced(tour, "bash")
    shell = shell.replace("KEY=xp_…", f"KEY={demo.analyst_key}").replace("DS=ds_…", f"DS={demo.census}")
    shell = shell.replace("http://127.0.0.1:8000", demo.url)
    assert _json_answer(_run(["bash", "-c", shell], demo.workdir, demo.env))["state"] == "committed"

    [python] = _fenced(tour, "python")
    namespace: dict[str, Any] = {"KEY": demo.analyst_key, "DS": demo.census}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(python.replace("http://127.0.0.1:8000", demo.url), "README.md", "exec"), namespace)
    assert isinstance(namespace["release"], AnalysisRequest)
    assert namespace["release"].state == "committed"
    refusal = printed.getvalue().splitlines()[-1]  # the tour's refusal, as it says: its summary() line
    assert "requested 100" in refusal
    assert "affordable: epsilon = " in refusal

    [command] = re.findall(r"`(expost request submit \$DS --params '[^`]+')`", tour)
    url, key = demo.printed_value(r"export EXPOST_URL=(\S+) EXPOST_KEY=\S+"), demo.analyst_key
    env = {**demo.env, "EXPOST_URL": url, "EXPOST_KEY": key, "DS": demo.census, "PATH": f"{EXPOST.parent}:"}
    env["PATH"] += demo.env.get("PATH", "")
    assert "committed" in _run(["bash", "-c", command + " --json"], demo.workdir, env)


@dataclass(frozen=True)
class Call:
    """One HTTP call of docs/examples.md: ``METHOD path`` and an optional JSON body."""

    mechanism: str
    method: str
    path: str
    body: dict[str, Any] | None


def example_calls() -> list[Call]:
    """Every ```http block of docs/examples.md, in order, under its ``### `mechanism` `` heading."""
    calls = []
    for mechanism, section in re.findall(
        r"^### `([^`]+)`\n(.*?)(?=^##|\Z)", EXAMPLES.read_text(), re.S | re.M
    ):
        for block in _fenced(section, "http"):
            request_line, _, body = block.partition("\n")
            method, path = request_line.split()
            calls.append(Call(mechanism, method, path, json.loads(body) if body.strip() else None))
    return calls


def test_every_example_names_its_own_mechanism() -> None:
    """Each section's request body is for the mechanism in its heading (the headings are what the
    catalog check below counts)."""
    for call in example_calls():
        if call.path.endswith(("/requests", "/sessions")):
            assert call.body is not None
            assert call.body["mechanism"] == call.mechanism, call


def run_example(client: ExpostClient, call: Call, ids: dict[str, str]) -> Any:
    """One call through the analysts' Python client; ``ids`` maps $CENSUS, $CUSTOMERS, $SID and $RID."""
    path = re.sub(r"\$(\w+)", lambda m: ids[m.group(1)], call.path)
    body = call.body or {}
    if match := re.fullmatch(r"/v1/datasets/(ds_\w+)/requests", path):
        request = client.submit(match[1], body["mechanism"], body["params"], timeout=600)
        assert request.state == "committed", request.raw
        ids["RID"] = request.id
        return request
    if match := re.fullmatch(r"/v1/datasets/(ds_\w+)/sessions", path):
        session = client.open_session(match[1], body["mechanism"], body["params"])
        assert session.state == "open", session.raw
        ids["SID"] = session.id
        return session
    if match := re.fullmatch(r"/v1/sessions/(ss_\w+)/queries", path):
        return client.ask(match[1], body["query"], body.get("epsilon"))
    if match := re.fullmatch(r"/v1/sessions/(ss_\w+)/next", path):
        return client.next(match[1])
    if match := re.fullmatch(r"/v1/sessions/(ss_\w+)/close", path):
        closed = client.close_session(match[1])
        assert closed.state == "closed", closed.raw
        return closed
    if match := re.fullmatch(r"/v1/requests/(rq_\w+)/privacy-report", path):
        report = client.privacy_report(match[1], body["record"])
        assert report.charged == 0.0
        assert report.epsilon_upper is not None
        return report
    raise AssertionError(f"docs/examples.md: no runner for {call.method} {call.path}")


def test_the_tour_and_every_mechanism_as_the_analyst_without_an_admin(demo: Demo) -> None:
    run_printed_curl_lines(demo)
    run_readme_tour(demo)
    calls = example_calls()
    with demo.analyst() as analyst:
        catalog = {mechanism.name for mechanism in analyst.mechanisms()}
        missing = catalog - {call.mechanism for call in calls}
        assert not missing, f"docs/examples.md has no example of {sorted(missing)}"
        assert {call.mechanism for call in calls} <= catalog
        ids = {"CENSUS": demo.census, "CUSTOMERS": demo.customers}
        for call in calls:
            try:
                run_example(analyst, call, ids)
            except BudgetExhaustedError as refused:  # pragma: no cover - the failure's message
                pytest.fail(f"{call.mechanism}: refused on the demo ({refused.summary()})")

        # Room to spare: what is left still buys useful requests (no "affordable" ε of 10⁻⁶).
        for dataset in (demo.census, demo.customers):
            left = analyst.get_budget(dataset)
            assert left is not None
            assert float(left.epsilon_remaining or 0.0) > DEMO_BUDGET["epsilon"] / 3, left.raw
            assert float(left.delta_remaining or 0.0) > DEMO_BUDGET["delta_share"] / 2, left.raw

        # A quantile at the ε says that its values are noise (item 1).
        tiny = analyst.submit(
            demo.census, "quantile", {"column": "age", "quantiles": [0.25, 0.5, 0.75], "epsilon": 8.5e-6}
        )
        assert tiny.release is not None
        assert tiny.release["mechanism"]["rank_error_95"] > 1e6
        assert any("rank_error_95" in warning for warning in tiny.release["warnings"])


# ----- item 4: the client reads both families of privacy reports -------------------------------------------


def test_the_client_reads_an_adaops_privacy_report(live_server: LiveServer) -> None:
    _, admin_key = live_server.create_key(Role.admin)
    with ExpostClient(live_server.base_url, admin_key) as admin:
        analyst_key = admin.create_key(f"first-hour-{os.urandom(4).hex()}", "analyst")
        dataset = admin.upload_dataset(demo_learning_csv(rows=2000), DEMO_LEARNING_SCHEMA, name="customers")
        admin.grant(dataset.id, analyst_key.name)
        admin.set_budget(dataset.id, 10.0, 1e-6, delta_share=2e-7)
    assert analyst_key.key is not None
    features = {"features": ["age", "tenure", "visits"], "label": "spend"}
    with ExpostClient(live_server.base_url, analyst_key.key) as analyst:
        ridge = analyst.submit(
            dataset.id, "adaops.ridge", {"features": features, "epsilon": 2.0, "delta": 1e-8, "kappa": 5.0}
        )
        assert ridge.release is not None
        assert ridge.release["released"], ridge.raw
        record = {"age": 42.0, "tenure": 3.5, "visits": 12, "spend": 80.0}
        report = analyst.privacy_report(ridge.id, record)  # a pydantic ValidationError before the fix
        assert isinstance(report, PrivacyReport)
        assert report.mechanism == "adaops.ridge"
        assert report.member is not None
        assert report.outsider is not None
        assert report.raw["member"]["ex_post"] == report.member.ex_post
        assert report.epsilon_upper == max(float(report.member.ex_post), float(report.outsider.ex_post))
        assert report.pdp_delta is not None
        assert 0 < report.pdp_delta < 1

        logistic = analyst.submit(
            dataset.id,
            "objpert.logistic",
            {"features": ["age", "tenure", "visits"], "label": "churn", "regularization": 3.0, "sigma": 7.5},
        )
        other = analyst.privacy_report(
            logistic.id, {"age": 42.0, "tenure": 3.5, "visits": 12, "churn": "yes"}
        )
        assert other.personalized_rdp is not None
        assert other.ex_post_epsilon_upper is not None
        assert other.epsilon_upper == other.ex_post_epsilon_upper
        assert other.member is None


# ----- item 8: a δ share written as decimals ----------------------------------------------------------------


def test_a_share_is_compared_as_the_decimals_written(live_server: LiveServer) -> None:
    _, admin_key = live_server.create_key(Role.admin)
    with ExpostClient(live_server.base_url, admin_key) as admin:
        dataset = admin.upload_dataset(CSV, SCHEMA, name="shares")
        admin.set_budget(dataset.id, 1.0, 1e-6)
        # δ − share = 2e-6 − 1e-6 = 1e-6 ≥ 1e-6, the δ set before: refused before ("δ − share ≥ 1e-06")
        grown = admin.set_budget(dataset.id, 10.0, 2e-6, delta_share=1e-6)
        assert (grown.delta, grown.delta_share) == (2e-6, 1e-6)
        # The capacities still come from the floats rounded down, as before: only the check is decimal.
        expected = capacity_units(10.0, remainder_delta(2e-6, 1e-6), dataset.orders)
        capacities = [row.capacity for row in grown.orders]
        assert capacities == [None if c is None else c / 10**12 for c in expected[:-1]]
        # A real shrink of δ − share is still refused, naming the field.
        with pytest.raises(InvalidInputError) as shrunk:
            admin.set_budget(dataset.id, 10.0, 1.9e-6, delta_share=1e-6)
        assert shrunk.value.fields == ["delta_share"]
        assert "δ − share ≥ 1e-06" in shrunk.value.detail
        with pytest.raises(InvalidInputError):  # and so is a smaller share
            admin.set_budget(dataset.id, 10.0, 2e-6, delta_share=0.9e-6)
        # Decimals that are not exact in binary, on a budget that had a share from the start.
        fresh = admin.upload_dataset(CSV, SCHEMA, name="shares, decimal")
        admin.set_budget(fresh.id, 1.0, 3e-7, delta_share=1e-7)
        admin.set_budget(fresh.id, 1.0, 3e-7, delta_share=1e-7)  # the same budget again
        moved = admin.set_budget(fresh.id, 1.0, 4e-7, delta_share=2e-7)  # 4e-7 − 2e-7 = 2e-7 ≥ 3e-7 − 1e-7
        assert moved.delta_share == 2e-7
