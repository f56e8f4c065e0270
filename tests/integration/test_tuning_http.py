"""``tuning.select`` over HTTP on SQLite and PostgreSQL: 202, secret progress, release and charge; a crash.

* A tuning request is long-running: with ``wait_seconds = 0`` the POST answers 202 with a Location; polling
  ``GET /v1/requests/{rid}`` shows the state and the request's times only (``progress`` stays null: the
  amount of work would reveal the latent k, docs/privacy/tuning.md#tuning-secrets; every candidate always
  runs, so the times do not, and ``pad_to_worst_case_time: false`` is refused with 422 before anything is
  reserved); the final body carries the release (selected configuration, model, private score, charge, or ⊥)
  and the realized charge, which is ≤ the worst case and is exactly what the budget shows as spent.
* Worker crash mid-tuning (real ``expost serve`` processes): the server is SIGKILLed while the request is
  running; a restarted server's reaper commits the worst case once the lease expires, and nothing is
  released.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.embedded import free_port
from tests.conftest import LiveServer, fresh_postgres_database, running_server, server_settings
from tests.integration.helpers import get_budget, make_world, upload
from tests.integration.scale_out_support import (
    EXPOST,
    cli_create_key,
    cli_keys_from,
    run_cli,
    stop_server,
    wait_ready,
)

RDP_BUDGET = {"epsilon": 10.0, "delta": 1e-5}
PURE_BUDGET = {"epsilon": 5.0, "delta": 0.0}
FEATURES = {"features": ["age", "region"], "label": "income"}

RDP_PARAMS: dict[str, Any] = {
    "learner": "dp_gd.ridge",
    "features": FEATURES,
    "epsilons": [0.3, 1.0],
    "regularization": [0.01],
    "steps": [1500],
    "step_size": [0.5],
    "clip": [1.0],
    "repeats": 4,
    "epsilon_prime": 0.1,
    "utility_bar": -0.5,
    "mode": "rdp",
    "order": 16.0,
    "pad_to_worst_case_time": True,
}
PURE_PARAMS: dict[str, Any] = {
    "learner": "output_perturbation.ridge",
    "features": FEATURES,
    "epsilons": [0.2, 0.5, 1.0],
    "regularization": [0.1, 1.0],
    "repeats": 2,
    "epsilon_prime": 0.1,
    "utility_bar": -0.5,
    "mode": "pure",
}
REQUEST_FIELDS = {
    "phase",
    "queue_position",
    "eta_seconds",
    "cancelled_by",
    "id",
    "dataset_id",
    "analyst",
    "mechanism",
    "params",
    "state",
    "worst_case",
    "realized",
    "release",
    "error",
    "created_at",
    "updated_at",
    "started_at",
    "elapsed_seconds",
    "progress",
}


@pytest.fixture(scope="module")
def tuning_server(database_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """A live server that never waits for a release (every long request answers 202)."""
    settings = server_settings(database_url, tmp_path_factory.mktemp("tuning-data"), wait_seconds=0)
    with running_server(settings) as server:
        yield server


def _poll_until_settled(
    client: httpx.Client, rid: str, timeout: float = 240
) -> tuple[dict[str, Any], list[Any]]:
    """Poll until the request leaves ``running``; returns the final body and every body seen meanwhile."""
    seen: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        response = client.get(f"/v1/requests/{rid}")
        assert response.status_code == 200, response.text
        body: dict[str, Any] = response.json()
        if body["state"] not in ("reserved", "running"):
            return body, seen
        seen.append(body)
        time.sleep(0.1)
    raise AssertionError(f"request {rid} did not settle in {timeout} s")


def _curve_le(a: dict[str, Any], b: dict[str, Any]) -> bool:
    def value(v: float | str) -> float:
        return math.inf if v == "inf" else float(v)

    return value(a["pure"]) <= value(b["pure"]) and all(
        value(x) <= value(y) for x, y in zip(a["values"], b["values"], strict=True)
    )


def _check_release(body: dict[str, Any], params: dict[str, Any]) -> None:
    release, realized = body["release"], body["realized"]
    assert body["state"] == "committed", body
    assert body["error"] is None
    assert _curve_le(realized, body["worst_case"])
    assert release["charge"] == realized  # the release states its own charge
    if release["outcome"] == "none":
        assert set(release) == {"outcome", "charge"}
        return
    assert release["outcome"] == "selected"
    assert set(release) == {"outcome", "selected", "model", "score", "charge"}  # nothing about k or the runs
    selected = release["selected"]
    assert selected["learner"] == params["learner"]
    assert selected["epsilon"] in params["epsilons"]
    assert (
        0 <= selected["index"] < len(params["epsilons"]) * len(params["regularization"]) * params["repeats"]
    )
    assert release["model"]["columns"] == [
        "age",
        "region=north",
        "region=south",
        "region=east",
        "region=west",
        "(intercept)",
    ]
    assert len(release["model"]["coefficients"]) == 6
    assert release["score"]["metric"] == "negative_mse"
    if params["mode"] == "pure":
        assert realized["pure"] == pytest.approx(2 * selected["epsilon"] + params["epsilon_prime"], rel=1e-8)


class TestTuningOverHttp:
    def test_rdp_request_is_202_with_secret_progress_then_release_and_charge(
        self, tuning_server: LiveServer
    ) -> None:
        world = make_world(tuning_server, RDP_BUDGET)
        catalog = {m["name"]: m for m in world.viewer.get("/v1/mechanisms").json()}
        assert "tuning.select" in catalog
        response = world.request(world.analyst, RDP_PARAMS, mechanism="tuning.select")
        assert response.status_code == 202, response.text
        rid = response.json()["id"]
        assert response.headers["location"].endswith(f"/v1/requests/{rid}")
        final, seen = _poll_until_settled(world.analyst, rid)
        assert seen, "the request was never observed running"
        for body in seen:
            assert set(body) == REQUEST_FIELDS
            assert body["progress"] is None  # state and elapsed time only
            assert body["release"] is None
            assert body["realized"] is None
            assert body["elapsed_seconds"] >= 0
        assert final["progress"] is None
        _check_release(final, RDP_PARAMS)
        worst = final["worst_case"]
        by_order = dict(zip(worst["orders"], worst["values"], strict=True))
        assert all(by_order[a] == "inf" for a in worst["orders"] if a > 16.0)  # RDP above α* > drop
        assert all(by_order[a] != "inf" for a in worst["orders"] if a <= 16.0)
        realized = dict(zip(final["realized"]["orders"], final["realized"]["values"], strict=True))
        budget = get_budget(world.viewer, world.dataset_id)
        for row in budget["orders"]:
            spent = realized[row["alpha"]]
            if spent == "inf":
                assert row["spent"] in ("inf", None) or math.isinf(float(row["spent"]))
            else:
                assert row["spent"] == pytest.approx(spent, abs=2e-12)
                assert row["spent"] >= spent - 1e-15
        assert budget["pure"]["reserved"] == 0.0

    def test_pure_request_charges_two_epsilon_plus_eps_prime_or_nothing(
        self, tuning_server: LiveServer
    ) -> None:
        world = make_world(tuning_server, PURE_BUDGET)
        outcomes = []
        total = 0.0
        for _ in range(3):
            response = world.request(world.analyst, PURE_PARAMS, mechanism="tuning.select")
            assert response.status_code in (200, 202), response.text
            final, _ = _poll_until_settled(world.analyst, response.json()["id"])
            _check_release(final, PURE_PARAMS)
            assert final["worst_case"]["pure"] == pytest.approx(2.1, rel=1e-8)
            total += float(final["realized"]["pure"])
            outcomes.append(final["release"]["outcome"])
            if final["release"]["outcome"] == "none":
                assert final["realized"]["pure"] == 0.0
        budget = get_budget(world.viewer, world.dataset_id)
        assert budget["pure"]["spent"] == pytest.approx(total, abs=1e-11)

    def test_pure_mode_with_dp_gd_is_refused_before_anything_is_reserved(
        self, tuning_server: LiveServer
    ) -> None:
        world = make_world(tuning_server, PURE_BUDGET)
        response = world.request(world.analyst, {**RDP_PARAMS, "mode": "pure"}, mechanism="tuning.select")
        assert response.status_code == 422, response.text
        assert "pure" in response.text
        assert get_budget(world.viewer, world.dataset_id)["pure"]["reserved"] == 0.0

    def test_turning_padding_off_is_refused_before_anything_is_reserved(
        self, tuning_server: LiveServer
    ) -> None:
        """Padding is always on: the run count (a function of the secret k) would show in the times."""
        world = make_world(tuning_server, PURE_BUDGET)
        params = {**PURE_PARAMS, "pad_to_worst_case_time": False}
        response = world.request(world.analyst, params, mechanism="tuning.select")
        assert response.status_code == 422, response.text
        fields = [error["field"] for error in response.json().get("errors", [])]
        assert fields == ["params.pad_to_worst_case_time"], response.text
        assert "latent" in response.text
        budget = get_budget(world.viewer, world.dataset_id)
        assert budget["pure"]["reserved"] == 0.0
        assert budget["pure"]["spent"] == 0.0


# ----- a worker crash mid-tuning (real server processes) ---------------------------------------------------
CRASH_PARAMS: dict[str, Any] = {**RDP_PARAMS, "steps": [10000], "repeats": 20}


def _start(env: dict[str, str], workdir: Path, log_name: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    log_path = workdir / log_name
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [EXPOST, "serve", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
            env=env,
            cwd=workdir,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    wait_ready(proc, base_url, log_path, 1)
    return proc, base_url


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_worker_crash_mid_tuning_commits_the_worst_case_and_releases_nothing(
    backend: str, tmp_path: Path
) -> None:
    fresh = fresh_postgres_database() if backend == "postgres" else None
    url = fresh.url if fresh is not None else f"sqlite:///{tmp_path / 'expost.db'}"
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("EXPOST_")},
        "EXPOST_DATABASE_URL": url,
        "EXPOST_DATA_DIR": str(tmp_path / "data"),
        "EXPOST_WAIT_SECONDS": "0",
        "EXPOST_LEASE_SECONDS": "3",
        "EXPOST_HEARTBEAT_SECONDS": "0.2",
        "EXPOST_REAPER_INTERVAL_SECONDS": "0.5",
        "EXPOST_LOG_LEVEL": "INFO",
    }
    procs: list[subprocess.Popen[bytes]] = []
    try:
        assert run_cli(env, tmp_path, "migrate").returncode == 0
        admin_key, analyst_key = cli_keys_from(
            cli_create_key(env, tmp_path, "admin", "crash-admin"),
            cli_create_key(env, tmp_path, "analyst", "crash-a"),
        )
        proc, base_url = _start(env, tmp_path, "first.log")
        procs.append(proc)
        admin = httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {admin_key}"}, timeout=60)
        analyst = httpx.Client(
            base_url=base_url, headers={"Authorization": f"Bearer {analyst_key}"}, timeout=60
        )
        created = upload(admin)
        assert created.status_code == 201, created.text
        dataset_id = created.json()["id"]
        assert admin.post(f"/v1/datasets/{dataset_id}/grants", json={"analyst": "crash-a"}).status_code == 201
        assert admin.put(f"/v1/datasets/{dataset_id}/budget", json=RDP_BUDGET).status_code == 200
        response = analyst.post(
            f"/v1/datasets/{dataset_id}/requests", json={"mechanism": "tuning.select", "params": CRASH_PARAMS}
        )
        assert response.status_code == 202, response.text
        rid = response.json()["id"]
        worst = response.json()["worst_case"]
        deadline = time.monotonic() + 60
        while True:  # wait until a worker has claimed it and is computing (the data was read)
            body = analyst.get(f"/v1/requests/{rid}").json()
            assert body["state"] == "running", body  # the padded run takes far longer than this wait
            if body["started_at"] is not None and body["elapsed_seconds"] > 2.0:
                break
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert body["progress"] is None
        os.killpg(proc.pid, signal.SIGKILL)  # the whole server, worker thread included, mid-run
        proc.wait(timeout=15)
        admin.close()
        analyst.close()

        proc2, base_url2 = _start(env, tmp_path, "second.log")
        procs.append(proc2)
        with httpx.Client(
            base_url=base_url2, headers={"Authorization": f"Bearer {analyst_key}"}, timeout=60
        ) as analyst2:
            final, _ = _poll_until_settled(analyst2, rid, timeout=120)
            assert final["state"] == "failed_charged", final
            assert final["release"] is None  # nothing released
            assert final["realized"] == worst  # the worst case was committed
            assert final["progress"] is None
            budget = analyst2.get(f"/v1/datasets/{dataset_id}/budget").json()
            by_order = dict(zip(worst["orders"], worst["values"], strict=True))
            for row in budget["orders"]:
                if by_order[row["alpha"]] != "inf":
                    assert row["spent"] == pytest.approx(by_order[row["alpha"]], abs=2e-12)
                    assert row["spent"] >= by_order[row["alpha"]] - 1e-15
            assert budget["pure"]["reserved"] == 0.0
        verified = run_cli(env, tmp_path, "ledger", "verify")
        assert verified.returncode == 0, verified.stdout + verified.stderr
    finally:
        for proc in procs:
            with contextlib.suppress(Exception):
                stop_server(proc)
        if fresh is not None:
            fresh.drop()
