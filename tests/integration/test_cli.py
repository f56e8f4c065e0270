"""The remote ``expost`` commands (request, session, budget, grant) against a real server, on SQLite and
PostgreSQL: in-process through typer's CliRunner, and as a real ``expost`` subprocess.

Exit codes: 0 ok, 2 for a 4xx input error or unusable input, 3 for a budget refusal, 1 otherwise.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel
from typer.testing import CliRunner, Result

from expost_client import ExpostClient
from mechanisms.base import PublicContext, Release, Table
from mechanisms.catalog import MECHANISMS
from mechanisms.noise import Noise
from mechanisms.queries.laplace import Laplace
from service.auth import Role
from service.cli import app
from service.embedded import free_port
from tests.conftest import LiveServer, running_server, server_settings
from tests.integration.helpers import CSV, SCHEMA

EXPOST = Path(sys.executable).with_name("expost")
COUNT = json.dumps({"query": {"kind": "count"}, "epsilon": 0.1})
SESSION = json.dumps({"threshold": 150, "epsilon_threshold": 1.0, "max_query_epsilon": 0.5, "max_queries": 5})
BELOW = json.dumps({"kind": "count", "where": [{"column": "region", "op": "eq", "value": "north"}]})


@dataclass
class Cli:
    """A dataset (pure ε = 1 budget) with admin and analyst keys, and ways to run ``expost``."""

    server: LiveServer
    admin_key: str
    analyst_key: str
    analyst_name: str
    dataset_id: str

    def env(self, key: str) -> dict[str, str]:
        return {"EXPOST_URL": self.server.base_url, "EXPOST_KEY": key}

    def invoke(self, *args: str, key: str | None = None) -> Result:
        """In-process, through typer's CliRunner (stdout and stderr apart)."""
        return CliRunner().invoke(app, list(args), env=self.env(key or self.analyst_key))

    def run(self, *args: str, key: str | None = None) -> subprocess.CompletedProcess[str]:
        """The installed ``expost`` script in a subprocess."""
        env = {**os.environ, **self.env(key or self.analyst_key), "NO_COLOR": "1"}
        return subprocess.run(
            [str(EXPOST), *args], env=env, capture_output=True, text=True, timeout=120, check=False
        )


def make_cli(server: LiveServer) -> Cli:
    _, admin_key = server.create_key(Role.admin)
    with ExpostClient(server.base_url, admin_key) as admin:
        analyst = admin.create_key(f"cli-analyst-{secrets.token_hex(4)}", "analyst")
        assert analyst.key is not None
        dataset = admin.upload_dataset(CSV, SCHEMA, name="cli data")
        admin.grant(dataset.id, analyst.name)
        admin.set_budget(dataset.id, 1.0, 0.0)
    return Cli(server, admin_key, analyst.key, analyst.name, dataset.id)


@pytest.fixture
def cli(live_server: LiveServer) -> Cli:
    return make_cli(live_server)


LOG_LINE = re.compile(r'^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\S* \[|\{").*$')


def output(result: Result | subprocess.CompletedProcess[str]) -> str:
    """The command's stdout. In-process, the test server's log lines land there too (service/logs.py
    writes to whatever sys.stdout is, and CliRunner swaps it): they are dropped."""
    return "".join(line for line in result.stdout.splitlines(keepends=True) if not LOG_LINE.match(line))


def parsed(result: Result | subprocess.CompletedProcess[str]) -> Any:
    stdout = output(result)
    assert result_code(result) == 0, (stdout, result.stderr)
    return json.loads(stdout)


def result_code(result: Result | subprocess.CompletedProcess[str]) -> int:
    return result.exit_code if isinstance(result, Result) else result.returncode


def exhaust(cli: Cli) -> None:
    with ExpostClient(cli.server.base_url, cli.analyst_key) as analyst:
        analyst.submit(cli.dataset_id, "laplace", {"query": {"kind": "count"}, "epsilon": 1.0})


# ----- in-process (CliRunner) -------------------------------------------------------------------------------


class TestRequestCommands:
    def test_submit_json_then_get(self, cli: Cli) -> None:
        body = parsed(cli.invoke("request", "submit", cli.dataset_id, "--params", COUNT, "--json"))
        assert body["state"] == "committed"
        assert body["mechanism"] == "laplace"
        assert isinstance(body["release"]["value"], float)
        assert body["realized"]["pure"] == 0.1

        again = parsed(cli.invoke("request", "get", body["id"], "--json"))
        assert again["id"] == body["id"]
        assert again["release"] == body["release"]

        table = cli.invoke("request", "get", body["id"])
        assert table.exit_code == 0, table.stderr
        assert body["id"] in output(table)
        assert "committed" in output(table)
        assert "pure ε 0.1" in output(table)

    def test_submit_human_output_and_an_explicit_idempotency_key(self, cli: Cli) -> None:
        args = ("request", "submit", cli.dataset_id, "--mechanism", "laplace", "--params", COUNT)
        first = cli.invoke(*args, "--idempotency-key", "cli-1", "--json")
        second = cli.invoke(*args, "--idempotency-key", "cli-1", "--json")
        assert parsed(first)["id"] == parsed(second)["id"]  # replayed, charged once
        human = cli.invoke(*args)
        assert human.exit_code == 0, human.stderr
        assert "value" in output(human)
        assert "committed" in output(human)
        with ExpostClient(cli.server.base_url, cli.admin_key) as admin:
            budget = admin.get_budget(cli.dataset_id)
        assert budget is not None
        assert budget.pure.spent == pytest.approx(0.2)

    def test_params_from_a_file_and_estimate(self, cli: Cli, tmp_path: Path) -> None:
        params = tmp_path / "params.json"
        params.write_text(COUNT)
        estimate = parsed(
            cli.invoke("request", "estimate", cli.dataset_id, "--params", f"@{params}", "--json")
        )
        assert estimate["admitted"] is True
        human = cli.invoke("request", "estimate", cli.dataset_id, "--params", f"@{params}")
        assert human.exit_code == 0, human.stderr
        assert "admitted now" in output(human)

    def test_a_refusal_exits_3_with_the_summary_on_stderr(self, cli: Cli) -> None:
        exhaust(cli)
        refused = cli.invoke("request", "submit", cli.dataset_id, "--params", COUNT)
        assert refused.exit_code == 3, (output(refused), refused.stderr)
        assert "Privacy budget exhausted (409)" in refused.stderr
        assert "binding order pure (α=∞): requested 0.1, remaining 0" in refused.stderr
        assert "affordable: nothing now" in refused.stderr
        assert output(refused) == ""

        as_json = cli.invoke("request", "submit", cli.dataset_id, "--params", COUNT, "--json")
        assert as_json.exit_code == 3
        assert json.loads(output(as_json))["type"] == "/problems/budget-exhausted"  # the problem, for scripts

    def test_a_partial_refusal_names_the_affordable_epsilon(self, cli: Cli) -> None:
        big = json.dumps({"query": {"kind": "count"}, "epsilon": 0.75})
        assert cli.invoke("request", "submit", cli.dataset_id, "--params", big).exit_code == 0
        refused = cli.invoke("request", "submit", cli.dataset_id, "--params", big)
        assert refused.exit_code == 3
        assert "affordable: epsilon = 0.25" in refused.stderr

    @pytest.mark.parametrize(
        ("params", "message"),
        [
            ("{not json", "--params: not valid JSON"),
            ("[1, 2]", "--params: must be a JSON object"),
            ("@/nonexistent/params.json", "--params: cannot read"),
        ],
    )
    def test_bad_json_params_exit_2(self, cli: Cli, params: str, message: str) -> None:
        result = cli.invoke("request", "submit", cli.dataset_id, "--params", params)
        assert result.exit_code == 2, (result.stdout, result.stderr)
        assert message in result.stderr

    def test_invalid_params_exit_2_naming_the_field(self, cli: Cli) -> None:
        bad = json.dumps({"query": {"kind": "count"}, "epsilon": -1})
        result = cli.invoke("request", "submit", cli.dataset_id, "--params", bad)
        assert result.exit_code == 2
        assert "Invalid input (422)" in result.stderr
        assert "params.epsilon" in result.stderr

    def test_not_found_and_bad_keys_exit_2(self, cli: Cli) -> None:
        missing = cli.invoke("request", "get", "rq_doesnotexist")
        assert missing.exit_code == 2
        assert "Not found (404)" in missing.stderr
        unauthenticated = cli.invoke("request", "get", "rq_doesnotexist", key="xp_wrong")
        assert unauthenticated.exit_code == 2
        assert "(401)" in unauthenticated.stderr

    def test_an_unreachable_server_exits_1(self, cli: Cli) -> None:
        result = cli.invoke("request", "get", "rq_x", "--url", f"http://127.0.0.1:{free_port()}")
        assert result.exit_code == 1
        assert "cannot talk to" in result.stderr


class TestSessionCommands:
    def test_open_ask_get_close(self, cli: Cli) -> None:
        with ExpostClient(cli.server.base_url, cli.admin_key) as admin:
            admin.set_budget(cli.dataset_id, 10.0, 0.0)
        opened = parsed(cli.invoke("session", "open", cli.dataset_id, "--params", SESSION, "--json"))
        assert opened["state"] == "open"
        sid = opened["id"]
        asked = parsed(cli.invoke("session", "ask", sid, "--query", BELOW, "--epsilon", "0.5", "--json"))
        assert asked["answer"] == {"above": False, "index": 0}
        whole_step = json.dumps({"query": json.loads(BELOW), "epsilon": 0.5})
        human = cli.invoke("session", "ask", sid, "--query", whole_step)
        assert human.exit_code == 0, human.stderr
        assert "below" in output(human)
        shown = cli.invoke("session", "get", sid)
        assert shown.exit_code == 0, shown.stderr
        assert "transcript" in output(shown)
        closed = parsed(cli.invoke("session", "close", sid, "--json"))
        assert closed["state"] == "closed"
        assert closed["close_reason"] == "closed"
        assert closed["asked"] == 2
        after = cli.invoke("session", "ask", sid, "--query", BELOW)
        assert after.exit_code == 2  # 409 session closed: not a budget refusal
        assert "closed" in after.stderr

    def test_a_session_that_does_not_fit_exits_3(self, cli: Cli) -> None:
        huge = json.dumps({**json.loads(SESSION), "epsilon_threshold": 5.0})
        result = cli.invoke("session", "open", cli.dataset_id, "--params", huge)
        assert result.exit_code == 3, (result.stdout, result.stderr)
        assert "filter dataset" in result.stderr

    def test_bad_query_json_exits_2(self, cli: Cli) -> None:
        result = cli.invoke("session", "ask", "ss_x", "--query", "{oops")
        assert result.exit_code == 2
        assert "--query: not valid JSON" in result.stderr


class TestAdminCommands:
    def test_budget_set_and_show(self, cli: Cli) -> None:
        updated = parsed(
            cli.invoke(
                "budget",
                "set",
                cli.dataset_id,
                "--epsilon",
                "2",
                "--delta",
                "1e-6",
                "--json",
                key=cli.admin_key,
            )
        )
        assert updated["epsilon"] == 2.0
        assert updated["delta"] == 1e-6
        shown = parsed(cli.invoke("budget", "show", cli.dataset_id, "--json"))
        assert shown["epsilon"] == 2.0
        assert len(shown["orders"]) == 20

        sub = parsed(
            cli.invoke(
                "budget",
                "set",
                cli.dataset_id,
                "--epsilon",
                "0.5",
                "--delta",
                "0",
                "--analyst",
                cli.analyst_name,
                "--json",
                key=cli.admin_key,
            )
        )
        assert sub["scope"] == "analyst"
        mine = cli.invoke("budget", "show", cli.dataset_id, "--analyst", cli.analyst_name)
        assert mine.exit_code == 0, mine.stderr
        assert "per order" in output(mine)
        assert cli.analyst_name in output(mine)
        assert "pure" in output(mine)

    def test_lowering_a_budget_below_spent_needs_confirmation(self, cli: Cli) -> None:
        with ExpostClient(cli.server.base_url, cli.analyst_key) as analyst:
            analyst.submit(cli.dataset_id, "laplace", {"query": {"kind": "count"}, "epsilon": 0.5})
        lower = ("budget", "set", cli.dataset_id, "--epsilon", "0.2", "--delta", "0")
        refused = cli.invoke(*lower, key=cli.admin_key)
        assert refused.exit_code == 2
        assert "confirm_below_spent" in refused.stderr
        confirmed = parsed(cli.invoke(*lower, "--confirm-below-spent", "--json", key=cli.admin_key))
        assert confirmed["epsilon"] == 0.2

    def test_budget_set_with_a_delta_share(self, cli: Cli) -> None:
        args = ("budget", "set", cli.dataset_id, "--epsilon", "2", "--delta", "1e-6", "--delta-share", "2e-7")
        updated = parsed(cli.invoke(*args, "--json", key=cli.admin_key))
        assert updated["delta_share"] == pytest.approx(2e-7, rel=1e-12)
        assert updated["delta_spent"] == 0.0
        shown = cli.invoke("budget", "show", cli.dataset_id)
        assert shown.exit_code == 0, shown.stderr
        assert "δ share used" in output(shown)
        shrink = ("budget", "set", cli.dataset_id, "--epsilon", "2", "--delta", "1e-6")
        shrink = (*shrink, "--delta-share", "1e-7")
        refused = cli.invoke(*shrink, key=cli.admin_key)
        assert refused.exit_code == 2
        assert "delta_share" in refused.stderr

    def test_budget_set_needs_an_admin_and_valid_values(self, cli: Cli) -> None:
        forbidden = cli.invoke("budget", "set", cli.dataset_id, "--epsilon", "2", "--delta", "0")
        assert forbidden.exit_code == 2
        assert "(403)" in forbidden.stderr
        invalid = cli.invoke(
            "budget", "set", cli.dataset_id, "--epsilon", "2", "--delta", "1.5", key=cli.admin_key
        )
        assert invalid.exit_code == 2
        assert "delta" in invalid.stderr

    def test_grant(self, cli: Cli) -> None:
        with ExpostClient(cli.server.base_url, cli.admin_key) as admin:
            other = admin.create_key(f"cli-other-{secrets.token_hex(4)}", "analyst")
        first = cli.invoke("grant", cli.dataset_id, other.name, key=cli.admin_key)
        assert first.exit_code == 0, first.stderr
        assert output(first).startswith("granted:")
        second = parsed(cli.invoke("grant", cli.dataset_id, other.name, "--json", key=cli.admin_key))
        assert second == {"dataset_id": cli.dataset_id, "analyst": other.name, "created": False}


# ----- a long request: 202, polled with a spinner ---------------------------------------------------------


class SlowLaplace(Laplace):
    name = "cli_slow_laplace"

    def run(self, params: BaseModel, ctx: PublicContext, table: Table, noise: Noise) -> Release:
        time.sleep(1.0)
        return super().run(params, ctx, table, noise)


@pytest.fixture
def slow_cli(database_url: str, tmp_path: Path) -> Iterator[Cli]:
    MECHANISMS[SlowLaplace.name] = SlowLaplace()
    try:
        settings = server_settings(database_url, tmp_path, wait_seconds=0, inline_mechanisms=set())
        with running_server(settings) as server:
            yield make_cli(server)
    finally:
        del MECHANISMS[SlowLaplace.name]


def test_a_long_request_shows_progress_and_prints_the_release(slow_cli: Cli) -> None:
    args = ("request", "submit", slow_cli.dataset_id, "--mechanism", SlowLaplace.name, "--params", COUNT)
    result = slow_cli.invoke(*args, "--progress", "--json")
    body = parsed(result)
    assert body["state"] == "committed"
    assert body["release"] is not None
    assert "running (poll" in result.stderr  # the spinner's line, on stderr only
    quiet = slow_cli.invoke(*args, "--no-progress", "--timeout", "0.2")
    assert quiet.exit_code == 1
    assert "still running" in quiet.stderr
    assert "expost request get rq_" in quiet.stderr


# ----- the installed script, in a subprocess ---------------------------------------------------------------


class TestSubprocess:
    def test_submit_get_and_budget_as_json(self, cli: Cli) -> None:
        submitted = parsed(
            cli.run(
                "request", "submit", cli.dataset_id, "--mechanism", "laplace", "--params", COUNT, "--json"
            )
        )
        assert submitted["state"] == "committed"
        got = parsed(cli.run("request", "get", submitted["id"], "--json"))
        assert got["id"] == submitted["id"]
        budget = parsed(cli.run("budget", "show", cli.dataset_id, "--json"))
        assert budget["pure"]["spent"] == 0.1
        human = cli.run("budget", "show", cli.dataset_id)
        assert human.returncode == 0, human.stderr
        assert "per order" in output(human)

    def test_refusal_exits_3_and_bad_json_exits_2(self, cli: Cli) -> None:
        exhaust(cli)
        refused = cli.run("request", "submit", cli.dataset_id, "--params", COUNT)
        assert refused.returncode == 3, (output(refused), refused.stderr)
        assert "Privacy budget exhausted" in refused.stderr
        assert "requested 0.1, remaining 0" in refused.stderr
        assert "affordable: nothing now" in refused.stderr
        bad = cli.run("request", "submit", cli.dataset_id, "--params", "{nope")
        assert bad.returncode == 2
        assert "not valid JSON" in bad.stderr

    def test_sessions_and_grants(self, cli: Cli) -> None:
        with ExpostClient(cli.server.base_url, cli.admin_key) as admin:
            admin.set_budget(cli.dataset_id, 10.0, 0.0)
        opened = parsed(cli.run("session", "open", cli.dataset_id, "--params", SESSION, "--json"))
        asked = parsed(cli.run("session", "ask", opened["id"], "--query", BELOW, "--json"))
        assert asked["session"]["asked"] == 1
        closed = parsed(cli.run("session", "close", opened["id"], "--json"))
        assert closed["state"] == "closed"
        granted = cli.run("grant", cli.dataset_id, cli.analyst_name, key=cli.admin_key)
        assert granted.returncode == 0, granted.stderr
        assert "already granted" in output(granted)

    def test_the_local_commands_still_work(self, cli: Cli) -> None:
        env = {**os.environ, "EXPOST_DATABASE_URL": cli.server.settings.database_url}
        name = f"cli-local-{secrets.token_hex(4)}"
        created = subprocess.run(
            [str(EXPOST), "keys", "create", "--role", "viewer", "--name", name],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert created.returncode == 0, created.stderr
        assert created.stdout.strip().startswith("xp_")
        helped = subprocess.run(
            [str(EXPOST), "--help"], env=env, capture_output=True, text=True, timeout=120, check=False
        )
        for command in (
            "serve",
            "migrate",
            "worker",
            "keys",
            "datasets",
            "ledger",
            "demo",
            "request",
            "session",
            "budget",
            "grant",
        ):
            assert command in helped.stdout


def test_budget_show_tells_an_analyst_which_budget_binds(cli: Cli) -> None:
    """An analyst's `budget show` adds their own sub-budget when one is set, and says which one binds."""
    with ExpostClient(cli.server.base_url, cli.admin_key) as admin:
        admin.set_budget(cli.dataset_id, 5.0, 0.0)
        admin.set_budget(cli.dataset_id, 2.0, 0.0, analyst=cli.analyst_name)
        viewer = admin.create_key(f"cli-viewer-{secrets.token_hex(4)}", "viewer")
    assert viewer.key is not None

    before = cli.invoke("budget", "show", cli.dataset_id)
    assert before.exit_code == 0, before.stderr
    assert "what binds you" in output(before)  # GET /v1/me names the analyst from the start

    submitted = parsed(cli.invoke("request", "submit", cli.dataset_id, "--params", COUNT, "--json"))
    assert submitted["state"] == "committed"
    with ExpostClient(cli.server.base_url, cli.admin_key) as admin:
        left = admin.get_budget(cli.dataset_id)
        mine = admin.get_budget(cli.dataset_id, cli.analyst_name)
    assert left is not None
    assert mine is not None
    assert (mine.epsilon_remaining, left.epsilon_remaining) == (pytest.approx(1.9), pytest.approx(4.9))

    shown = output(cli.invoke("budget", "show", cli.dataset_id))
    assert "what binds you" in shown
    binding = next(line for line in shown.splitlines() if line.startswith("binding "))
    assert binding.split()[1:] == ["your", "sub-budget"], shown
    admissible = next(line for line in shown.splitlines() if line.startswith("largest ε admissible"))
    assert admissible.split()[-1] == "1.9", shown
    assert f"budget of {cli.dataset_id} (analyst {cli.analyst_name})" in shown
    assert f"budget of {cli.dataset_id} (dataset)" in shown
    as_json = parsed(cli.invoke("budget", "show", cli.dataset_id, "--json"))
    assert as_json["scope"] == "dataset"  # --json prints only the view asked for, unchanged

    with ExpostClient(cli.server.base_url, cli.admin_key) as admin:
        admin.set_budget(cli.dataset_id, 10.0, 0.0, analyst=cli.analyst_name)
    raised = output(cli.invoke("budget", "show", cli.dataset_id))
    binding = next(line for line in raised.splitlines() if line.startswith("binding "))
    assert binding.split()[-1] == "dataset", raised
    for other in (cli.admin_key, viewer.key):  # no sub-budget of their own
        plain = cli.invoke("budget", "show", cli.dataset_id, key=other)
        assert plain.exit_code == 0, plain.stderr
        assert "what binds you" not in output(plain)
        assert "(dataset)" in output(plain)
