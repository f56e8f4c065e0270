"""Observability (docs/operations.md, Observability): metrics, JSON logs with request ids, and no secret in
any of them.

A dedicated server with ``log_json=True`` (its log lines go to stdout, captured with ``capfd``) runs a
session of every interactive mechanism, ordinary requests and refusals. Each session's secret state is
read from the database while the session is open; then no log line, no ``/metrics`` line and no response
body may contain a secret (neither its field name nor its value as a token), and no log line or metric may
contain an API key or a released value. The metrics added for operations must move, with route templates
as labels and the request id echoed.

A second test runs ``expost serve --workers 2`` with ``PROMETHEUS_MULTIPROC_DIR`` and checks that
``/metrics`` reports the sum over both processes, whichever one answers.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mechanisms.catalog import INTERACTIVE
from service.auth import Role
from service.embedded import free_port
from service.store.models import AnalysisSession
from service.store.repositories import SessionRepository
from tests.conftest import LiveServer, running_server, server_settings
from tests.integration.helpers import db_session, key_of, make_world, upload

PUBLIC_STATE = {"mechanism", "asked", "released", "halted"}
REQUESTS_ROUTE = "/v1/datasets/{dataset_id}/requests"
QUERIES_ROUTE = "/v1/sessions/{session_id}/queries"
NORTH = {"kind": "count", "where": [{"column": "region", "op": "eq", "value": "north"}]}  # 50 of 200 rows

# One session per interactive mechanism, with a distinctive secret: ε′ = 1e-9 makes k ≈ 1e9 (geometric and
# dropping: with ε_i·k ≈ 1e8 no candidate is ever kept, and 50 − 150 + y − k < 0, so every answer is
# "below"; P(k < 1000) = 1e-6); ε = 1e-6 spreads the Laplace noisy threshold over millions (a float with
# many digits).
SESSIONS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "above_threshold": (
        {"threshold": 150, "epsilon_threshold": 1e-9, "max_query_epsilon": 0.1, "max_queries": 5},
        {"query": NORTH, "epsilon": 0.1},
    ),
    "above_threshold.dropping": (
        {"threshold": 150.0, "epsilon_threshold": 1e-9, "max_query_epsilon": 0.1, "max_queries": 5},
        {"query": NORTH, "epsilon": 0.1},
    ),
    "above_threshold.laplace": (
        {"threshold": 150.0, "epsilon": 1e-6, "max_sensitivity": 1.0, "max_queries": 5},
        {"query": NORTH},
    ),
    # Noise reduction: the secret is the chain's current noise, of scale 1e9 here (ε = 1e-9, t = 1e18).
    "noise_reduction.laplace": ({"query": NORTH, "epsilons": [1e-9, 2e-9]}, {}),
    "noise_reduction.gaussian": ({"query": NORTH, "variances": [1e18, 1e17]}, {}),
}


# ----- helpers ------------------------------------------------------------------------------------------


@dataclass
class Recorder:
    """Every response the test's clients received (status, headers, body)."""

    responses: list[httpx.Response] = field(default_factory=list)

    def attach(self, *clients: httpx.Client) -> None:
        for client in clients:
            client.event_hooks = {"response": [self._record]}

    def _record(self, response: httpx.Response) -> None:
        response.read()
        self.responses.append(response)

    def texts(self) -> list[str]:
        return ["\n".join([*(f"{k}: {v}" for k, v in r.headers.items()), r.text]) for r in self.responses]


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} of a Prometheus text exposition."""
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(metrics: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return metrics.get((name, tuple(sorted(labels.items()))), 0.0)


def scrape(client: httpx.Client) -> tuple[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]]:
    response = client.get("/metrics/")
    assert response.status_code == 200, response.text
    return response.text, samples(response.text)


def number_token(number: float) -> re.Pattern[str]:
    """``number`` as a JSON/Prometheus token (not a digit run inside a longer number, id or timestamp)."""
    text = json.dumps(number)
    return re.compile(rf"(?<![\w.\-+]){re.escape(text)}(?![\w.])")


def walk(value_: Any) -> Iterator[tuple[str | None, Any]]:
    """(key, value) of every member and element of a JSON value, recursively."""
    if isinstance(value_, dict):
        for key, item in value_.items():
            yield key, item
            yield from walk(item)
    elif isinstance(value_, list):
        for item in value_:
            yield None, item
            yield from walk(item)


def json_lines(text: str) -> list[dict[str, Any]]:
    lines = []
    for line in text.splitlines():
        if line.startswith("{"):
            with contextlib.suppress(json.JSONDecodeError):
                lines.append(json.loads(line))
    return lines


def secret_of(database_url: str, session_id: str) -> dict[str, Any]:
    """The session's secret state as stored (read straight from its table while the session is open)."""
    with db_session(database_url) as session:
        row = session.get(AnalysisSession, session_id)
        assert row is not None
        secret = SessionRepository(session).secret(row.request_id)
        assert secret is not None, "an open session has its secret state"
        state: dict[str, Any] = json.loads(secret.state)
    assert set(state) - PUBLIC_STATE, state
    return state


def secret_values(state: dict[str, Any]) -> list[tuple[str | None, float]]:
    """(field name, value) of each secret number of a session state.

    The name is None when it is an ordinary word of answers too (the noise-reduction chain's ``noise``):
    only the value is checked then."""
    found: list[tuple[str | None, float]] = []
    for name, item in state.items():
        if name in PUBLIC_STATE:
            continue
        if name == "sampler":  # the grid Brownian chain stores no noise (its last value is released)
            found.extend((None, float(v)) for v in item.get("noise", []))
        else:
            assert isinstance(item, int | float), (name, item)
            found.append((name, item))
    return found


def assert_absent(name: str | None, secret: Any, where: str, text: str, parsed: list[Any]) -> None:
    """Neither the secret's field name (when it has a distinctive one) nor its value, as a token or as a
    parsed JSON value."""
    assert name is None or f'"{name}"' not in text, f"secret field {name!r} in {where}"
    assert not number_token(secret).search(text), f"secret {name}={secret!r} in {where}"
    for document in parsed:
        for key, item in walk(document):
            assert name is None or key != name, f"secret field {name!r} in {where}"
            if isinstance(item, int | float) and not isinstance(item, bool):
                assert not (math.isfinite(item) and item == secret), f"secret {name}={secret!r} in {where}"


# ----- the in-process server with JSON logs -------------------------------------------------------------


@pytest.fixture
def json_server(database_url: str, tmp_path: Path) -> Iterator[LiveServer]:
    with running_server(server_settings(database_url, tmp_path / "data", log_json=True)) as server:
        yield server


class TestObservability:
    def test_sessions_requests_and_refusals_leave_no_secret_behind(
        self, json_server: LiveServer, capfd: pytest.CaptureFixture[str]
    ) -> None:
        assert set(SESSIONS) == set(INTERACTIVE), "a session of every interactive mechanism"
        server = json_server
        world = make_world(server, {"epsilon": 5.0, "delta": 1e-6})
        recorder = Recorder()
        recorder.attach(world.admin, world.analyst, world.viewer)
        keys = [key_of(client) for client in (world.admin, world.analyst, world.viewer)]
        _, before = scrape(world.viewer)

        # Interactive sessions: open all three, read each secret while open, ask, read again, close.
        secrets: dict[str, dict[str, Any]] = {}
        opened: dict[str, str] = {}
        for mechanism, (params, _) in SESSIONS.items():
            response = world.analyst.post(
                f"/v1/datasets/{world.dataset_id}/sessions", json={"mechanism": mechanism, "params": params}
            )
            assert response.status_code == 201, response.text
            opened[mechanism] = response.json()["id"]
            secrets[mechanism] = secret_of(server.settings.database_url, opened[mechanism])
        _, during = scrape(world.viewer)
        assert value(during, "expost_reservations_held", dataset=world.dataset_id, kind="session") == len(
            SESSIONS
        )
        for mechanism in SESSIONS:
            assert value(during, "expost_sessions_open", mechanism=mechanism) >= 1
        for mechanism, (_, ask) in SESSIONS.items():
            sid = opened[mechanism]
            answered = world.analyst.post(
                f"/v1/sessions/{sid}/queries", json=ask, headers={"X-Request-ID": f"obs-ask-{mechanism}"}
            )
            assert answered.status_code == 200, answered.text
            assert answered.headers["X-Request-ID"] == f"obs-ask-{mechanism}"
            if answered.json()["session"]["state"] == "open":
                progress = {"released": 1} if mechanism.startswith("noise_reduction") else {"asked": 1}
                expected = {**secrets[mechanism], **progress, "halted": False}
                actual = secret_of(server.settings.database_url, sid)
                if mechanism == "noise_reduction.gaussian":
                    # the grid Brownian chain keeps the last released value (public) and its level, and
                    # draws each step's noise fresh
                    # (docs/privacy/finite_precision_reduction.md#fp-noise-reduction)
                    sampler = actual["sampler"]
                    assert sampler["level"] == 1
                    assert isinstance(sampler["previous"], list)
                    expected["sampler"] = {**expected["sampler"], "level": 1, "previous": sampler["previous"]}
                assert actual == expected
                closed = world.analyst.post(f"/v1/sessions/{sid}/close")
                assert closed.status_code == 200, closed.text
                assert closed.json()["state"] == "closed"

        # Ordinary requests, whose released values must stay out of logs and metrics. A sum of incomes (about
        # 4.9 million): a count (about 200) could equal a request counter in /metrics by coincidence.
        laplace = world.request(world.analyst, {"query": {"kind": "sum", "column": "income"}, "epsilon": 0.5})
        assert laplace.status_code == 200, laplace.text
        gaussian = world.request(
            world.analyst, {"query": {"kind": "mean", "column": "age"}, "sigma": 5.0}, mechanism="gaussian"
        )
        assert gaussian.status_code == 200, gaussian.text
        released = [laplace.json()["release"]["value"], gaussian.json()["release"]["value"]]
        assert all(isinstance(v, float) for v in released), released

        # Refusals: not admissible (dataset filter), exhausted (an analyst's sub-budget), no budget at all.
        own_id = "obs-refusal-1"
        too_big = world.analyst.post(
            f"/v1/datasets/{world.dataset_id}/requests",
            json={"mechanism": "laplace", "params": {"query": {"kind": "count"}, "epsilon": 50.0}},
            headers={"X-Request-ID": own_id},
        )
        assert too_big.status_code == 409
        assert too_big.json()["type"] == "/problems/not-admissible"
        assert too_big.headers["X-Request-ID"] == own_id
        bob_name, bob = world.new_key(Role.analyst)
        recorder.attach(bob)
        keys.append(key_of(bob))
        grants = f"/v1/datasets/{world.dataset_id}/grants"
        assert world.admin.post(grants, json={"analyst": bob_name}).is_success
        assert world.admin.put(
            f"/v1/datasets/{world.dataset_id}/analysts/{bob_name}/budget", json={"epsilon": 0.3, "delta": 0.0}
        ).is_success
        assert world.request(bob, {"query": {"kind": "count"}, "epsilon": 0.2}).status_code == 200
        exhausted = world.request(bob, {"query": {"kind": "count"}, "epsilon": 0.2})
        assert exhausted.status_code == 409
        assert exhausted.json()["type"] == "/problems/budget-exhausted"
        assert exhausted.json()["filter"] == f"analyst:{bob_name}"
        unbudgeted = upload(world.admin)
        assert unbudgeted.status_code == 201, unbudgeted.text
        other = unbudgeted.json()["id"]
        assert world.admin.post(f"/v1/datasets/{other}/grants", json={"analyst": world.analyst_name})
        no_budget = world.request(
            world.analyst, {"query": {"kind": "count"}, "epsilon": 0.1}, dataset_id=other
        )
        assert no_budget.status_code == 409
        assert no_budget.json()["type"] == "/problems/no-budget"
        session_refused = world.analyst.post(
            f"/v1/datasets/{world.dataset_id}/sessions",
            json={
                "mechanism": "above_threshold.laplace",
                "params": {"threshold": 1.0, "epsilon": 60.0, "max_sensitivity": 1.0, "max_queries": 2},
            },
        )
        assert session_refused.status_code == 409
        assert session_refused.json()["type"] == "/problems/not-admissible"
        generated = world.viewer.get(f"/v1/datasets/{world.dataset_id}/budget").headers["X-Request-ID"]
        assert re.fullmatch(r"[0-9a-f]{32}", generated), generated
        bad_id = world.viewer.get("/healthz", headers={"X-Request-ID": "no spaces\tor tabs"})
        assert bad_id.headers["X-Request-ID"] != "no spaces\tor tabs"

        metrics_text, after = scrape(world.viewer)
        logs = capfd.readouterr().out

        # ----- the metrics moved --------------------------------------------------------------------
        def delta(name: str, **labels: str) -> float:
            return value(after, name, **labels) - value(before, name, **labels)

        refusals = "expost_refusals_total"
        assert delta(refusals, reason="not-admissible", filter="dataset", kind="request") == 1
        assert delta(refusals, reason="budget-exhausted", filter="analyst", kind="request") == 1
        assert delta(refusals, reason="no-budget", filter="dataset", kind="request") == 1
        assert delta(refusals, reason="not-admissible", filter="dataset", kind="session") == 1
        assert delta("expost_requests_total", mechanism="laplace", outcome="refused") == 3
        assert delta("expost_requests_total", mechanism="laplace", outcome="admitted") == 2
        assert delta("expost_requests_total", mechanism="above_threshold.laplace", outcome="refused") == 1
        for mechanism in SESSIONS:
            assert delta("expost_requests_total", mechanism=mechanism, outcome="admitted") == 1
        # Laplace 0.5 and 0.2 (Bob), a Gaussian (no finite pure charge), and the sessions: ε′ = 1e-9 each for
        # the two closed below, ε/2 = 5e-7 or ε = 1e-6 for the Laplace one (closed or halted).
        commits, ds = "expost_commits_total", world.dataset_id
        assert delta(commits, dataset=ds, kind="request", outcome="released") == 3
        assert delta(commits, dataset=ds, kind="session", outcome="released") == len(SESSIONS)
        charged = delta("expost_charged_epsilon_total", dataset=world.dataset_id)
        # + 1e-9 for the Laplace noise-reduction session's one released level (the Brownian one has no pure
        # charge).
        assert 0.7 + 5e-7 + 1e-9 - 1e-12 <= charged <= 0.7 + 1e-6 + 2e-9 + 2e-9 + 1e-9, charged
        closed = sum(
            delta("expost_sessions_closed_total", mechanism=m, reason=r)
            for m in SESSIONS
            for r in ("closed", "halted")
        )
        assert closed == len(SESSIONS)
        assert value(after, "expost_reservations_held", dataset=world.dataset_id, kind="session") == 0
        assert (
            delta(
                "expost_http_request_duration_seconds_count",
                route=REQUESTS_ROUTE,
                method="POST",
                status="4xx",
            )
            >= 3
        )
        assert (
            delta(
                "expost_http_request_duration_seconds_count",
                route=REQUESTS_ROUTE,
                method="POST",
                status="2xx",
            )
            >= 3
        )
        assert delta(
            "expost_http_request_duration_seconds_count", route=QUERIES_ROUTE, method="POST", status="2xx"
        ) == len(SESSIONS)
        for gauge in ("writer_queue_depth", "executor_queued_jobs", "executor_running_jobs"):
            assert (f"expost_{gauge}", ()) in after, gauge
        assert delta("expost_writer_batch_size_count") > 0
        routes = {dict(labels).get("route") for (name, labels) in after if name.startswith("expost_http_")}
        assert REQUESTS_ROUTE in routes
        ids = [world.dataset_id, other, *opened.values()]
        assert not [r for r in routes if r and any(i in r for i in ids)], routes  # templates, never raw paths

        # ----- the logs: JSON, one access line per request, with its id and route ------------------------
        lines = json_lines(logs)
        access = [line for line in lines if line.get("event") == "http request"]
        assert len(access) >= 20, logs[-2000:]
        mine = [line for line in access if line.get("http_request_id") == own_id]
        assert len(mine) == 1, mine
        assert mine[0]["route"] == REQUESTS_ROUTE
        assert (mine[0]["method"], mine[0]["status"], mine[0]["level"]) == ("POST", 409, "info")
        assert isinstance(mine[0]["duration_ms"], float)
        asked_lines = [line for line in access if str(line.get("http_request_id", "")).startswith("obs-ask-")]
        assert {line["route"] for line in asked_lines} == {QUERIES_ROUTE}
        admitted = [line for line in lines if line.get("event") == "admitted"]
        assert admitted
        assert all(line["route"] == REQUESTS_ROUTE and line.get("http_request_id") for line in admitted)

        # ----- no secret, key or release anywhere ---------------------------------------------------------
        log_docs: list[Any] = lines
        metric_docs: list[Any] = []
        response_texts = recorder.texts()
        response_docs: list[Any] = []
        for r in recorder.responses:
            with contextlib.suppress(json.JSONDecodeError):
                response_docs.append(r.json())
        for mechanism, state in secrets.items():
            for name, secret in secret_values(state):
                assert abs(secret) >= 1000, (mechanism, name, secret)  # distinctive
                assert secret not in [v for (n, _), v in after.items()], f"secret {name} as a metric value"
                assert_absent(name, secret, "the logs", logs, log_docs)
                assert_absent(name, secret, "/metrics", metrics_text, metric_docs)
                for text in response_texts:
                    assert_absent(name, secret, "a response", text, [])
                assert_absent(name, secret, "a response body", "", response_docs)
                if name is not None:
                    assert not re.search(rf'[{{,]{re.escape(name)}="', metrics_text), f"label {name}"
        for key in keys:
            assert key not in logs, "an API key in the logs"
            assert key not in metrics_text, "an API key in /metrics"
        assert "authorization" not in logs.lower()
        assert "bearer" not in logs.lower()
        for number in released:
            assert not number_token(number).search(logs), f"released value {number!r} in the logs"
            assert not number_token(number).search(metrics_text), f"released value {number!r} in /metrics"
            for document in log_docs:
                assert number not in [v for _, v in walk(document) if isinstance(v, float)], number


# ----- several server processes: multiprocess metrics -------------------------------------------------------

EXPOST = str(Path(sys.executable).with_name("expost"))


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=20)


@pytest.mark.slow
def test_multiprocess_metrics_add_up_over_server_processes(tmp_path: Path) -> None:
    metrics_dir = tmp_path / "metrics"
    metrics_dir.mkdir()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("EXPOST_")},
        "EXPOST_DATABASE_URL": f"sqlite:///{tmp_path / 'expost.db'}",
        "EXPOST_DATA_DIR": str(tmp_path / "data"),
        "EXPOST_LOG_JSON": "true",
        "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir),
    }
    migrated = subprocess.run(
        [EXPOST, "migrate"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False
    )
    assert migrated.returncode == 0, migrated.stderr
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "server.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [EXPOST, "serve", "--port", str(port), "--workers", "2"],
            env=env,
            cwd=tmp_path,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 60
        while log_path.read_text(errors="replace").count('"expost started"') < 2:
            assert proc.poll() is None, log_path.read_text()[-4000:]
            assert time.monotonic() < deadline, log_path.read_text()[-4000:]
            time.sleep(0.1)
        pids: set[str] = set()
        total = 0
        while len(pids) < 2 or total < 20:  # new connections until both processes have served some
            assert total < 500, f"every connection went to the same server process {pids}"
            with httpx.Client(base_url=base, timeout=10) as client:
                assert client.get("/healthz").status_code == 200
            total += 1
            if total % 10 == 0:
                pids = {
                    str(line["pid"])
                    for line in json_lines(log_path.read_text())
                    if line.get("event") == "http request" and line.get("route") == "/healthz"
                }
        healthz = [
            value(
                samples(httpx.get(f"{base}/metrics/", timeout=10).text),
                "expost_http_request_duration_seconds_count",
                route="/healthz",
                method="GET",
                status="2xx",
            )
            for _ in range(6)  # several scrapes: whichever process answers reports the same sum
        ]
        assert healthz == [float(total)] * 6, healthz
        assert any(metrics_dir.iterdir()), "the processes keep their values in PROMETHEUS_MULTIPROC_DIR"
        lines = [line for line in log_path.read_text().splitlines() if line.strip()]
        assert [line for line in lines if not line.startswith("{")] == [], "every log line is JSON"
    finally:
        _stop(proc)
