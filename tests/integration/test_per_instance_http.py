"""adaops.ridge over HTTP and its per-instance reports (SQLite and PostgreSQL).

AdaOPS is an (ε, δ) mechanism, admitted through the δ-ledger; its reports (public and data-dependent
families) are served by POST /v1/requests/{rid}/privacy-report. The report never reads the data: its answer
is recomputed here from the stored release and the public parameters alone, and the budget and the ledger do
not move. Who may call it: whoever may read the release (the admin and the requesting analyst); a viewer
gets 403 and another analyst 404, as for reading the release itself (the report reveals the model).
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import numpy as np
import pytest

from mechanisms.accounting import DEFAULT_ORDERS
from mechanisms.base import PublicContext
from mechanisms.data.schema import DatasetSchema
from mechanisms.per_instance import adaops
from service.auth import Role
from tests.conftest import LiveServer
from tests.integration.helpers import World, add_dataset, assert_problem, get_budget, ledger_items, make_world

BUDGET = {"epsilon": 50.0, "delta": 1e-5, "delta_share": 5e-6}
SCHEMA: dict[str, Any] = {
    "columns": [
        {"name": "x1", "type": "float", "min": -1, "max": 1},
        {"name": "x2", "type": "float", "min": -1, "max": 1},
        {"name": "y", "type": "float", "min": -1, "max": 1},
    ],
    "neighboring": "add_remove",
}
RECORD = {"x1": 0.3, "x2": -0.5, "y": 0.2}


def _csv(n: int = 300, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    x1, x2 = rng.uniform(-1, 1, n), rng.uniform(-1, 1, n)
    y = np.clip(0.5 * x1 - 0.3 * x2 + 0.1 * rng.normal(size=n), -1, 1)
    rows = [f"{a:.6f},{b:.6f},{c:.6f}" for a, b, c in zip(x1, x2, y, strict=True)]
    return ("x1,x2,y\n" + "\n".join(rows) + "\n").encode()


def _world(live_server: LiveServer) -> tuple[World, str]:
    world = make_world(live_server, BUDGET)
    return world, add_dataset(world, _csv(), SCHEMA, BUDGET)


def _params(**extra: Any) -> dict[str, Any]:
    base = {
        "features": {"features": ["x1", "x2"], "label": "y"},
        "epsilon": 2.0,
        "delta": 1e-7,
        "kappa": 5.0,
    }
    return {**base, **extra}


def _committed(world: World, dataset_id: str, params: dict[str, Any]) -> dict[str, Any]:
    response = world.request(world.analyst, params, mechanism="adaops.ridge", dataset_id=dataset_id)
    assert response.status_code in (200, 202), response.text
    body: dict[str, Any] = response.json()
    deadline = time.monotonic() + 60
    while body["state"] == "running" and time.monotonic() < deadline:
        time.sleep(0.1)
        body = world.analyst.get(f"/v1/requests/{body['id']}").json()
    assert body["state"] == "committed", body
    return body


def _report(client: httpx.Client, rid: str, record: dict[str, Any]) -> httpx.Response:
    return client.post(f"/v1/requests/{rid}/privacy-report", json={"record": record})


def _local(params: dict[str, Any], release: dict[str, Any], record: dict[str, Any]) -> dict[str, Any]:
    """The report recomputed from the release and public parameters only (x: features / 1, intercept 1)."""
    p = adaops.AdaOpsRidgeParams.model_validate(params)
    ctx = PublicContext(DatasetSchema.model_validate(SCHEMA), None, DEFAULT_ORDERS)
    pl = adaops.ADAOPS_RIDGE.plan_for(p, ctx)
    x = np.array([[record["x1"], record["x2"], 1.0]])
    x = x / max(1.0, float(np.linalg.norm(x)))
    return adaops.evaluate_report(pl, release, x, np.array([record["y"]]), p.report_rho)[0]


def test_release_charge_and_public_report(live_server: LiveServer) -> None:
    world, dataset_id = _world(live_server)
    catalog = {m["name"]: m for m in world.viewer.get("/v1/mechanisms").json()}
    assert {"kappa", "report", "report_rho"} <= set(catalog["adaops.ridge"]["params_schema"]["properties"])
    committed = _committed(world, dataset_id, _params())
    release = committed["release"]
    assert committed["realized"] == committed["worst_case"]
    assert 2.0 <= committed["worst_case"]["pure"] <= 2.0 * (1 + 1e-11)  # the charge is exactly (ε, δ)
    assert release["released"] is True
    assert len(release["coefficients"]) == 3
    assert release["lambda"] >= 1.0
    assert "lambda_min_noisy" in release
    assert release["rows_upper"] >= release["rows_floor"]  # add_remove: n released only as ñ
    assert "rows_noisy" in release
    for leaky in ("lambda_min", "theta_hat", "leverage", "residuals", "pdp", "gram"):
        assert leaky not in release
    entries = [e for e in ledger_items(world.admin, dataset_id) if e.get("request_id") == committed["id"]]
    assert entries
    assert any(float(e.get("delta") or 0.0) >= 1e-7 for e in entries)

    budget_before = get_budget(world.viewer, dataset_id)
    ledger_before = ledger_items(world.admin, dataset_id)
    first = _report(world.analyst, committed["id"], RECORD)
    assert first.status_code == 200, first.text
    body = first.json()
    assert body["charged"] == 0.0
    assert body["report_kind"] == "public"
    assert set(body) == {
        "request_id",
        "mechanism",
        "report_kind",
        "charged",
        "member",
        "outsider",
        "confidence",
        "pdp_delta",
        "lambda_release_loss",
    }
    for side in ("member", "outsider"):
        assert 0 < body[side]["ex_post"] < 50
        assert 0 < body[side]["pdp_epsilon"] < 50
    local = _local(committed["params"], release, RECORD)
    assert {k: body[k] for k in local} == local
    assert _report(world.analyst, committed["id"], RECORD).json() == body
    assert _report(world.admin, committed["id"], RECORD).json() == body
    assert get_budget(world.viewer, dataset_id) == budget_before
    assert ledger_items(world.admin, dataset_id) == ledger_before
    clipped = _report(world.analyst, committed["id"], {**RECORD, "y": 40.0}).json()
    assert clipped == _report(world.analyst, committed["id"], {**RECORD, "y": 1.0}).json()


def test_data_dependent_report(live_server: LiveServer) -> None:
    world, dataset_id = _world(live_server)
    plain = _committed(world, dataset_id, _params())
    dep = _committed(world, dataset_id, _params(report="data_dependent", report_sigma=5.0, report_delta=1e-7))
    assert dep["worst_case"]["pure"] > plain["worst_case"]["pure"]
    assert np.asarray(dep["release"]["gram"]["matrix"]).shape == (3, 3)
    spent = get_budget(world.viewer, dataset_id)
    response = _report(world.analyst, dep["id"], RECORD)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["report_kind"] == "data_dependent"
    assert {k: body[k] for k in ("member", "outsider")} == {
        k: v for k, v in _local(dep["params"], dep["release"], RECORD).items() if k in ("member", "outsider")
    }
    assert get_budget(world.viewer, dataset_id) == spent


def test_who_may_call_and_errors(live_server: LiveServer) -> None:
    world, dataset_id = _world(live_server)
    rid = _committed(world, dataset_id, _params())["id"]
    assert_problem(_report(world.viewer, rid, RECORD), 403)  # viewers cannot read releases, nor reports
    _, other = world.new_key(Role.analyst)
    assert_problem(_report(other, rid, RECORD), 404)
    problem = assert_problem(
        _report(world.analyst, rid, {"x1": 0.1, "x2": 0.2}), 422, "/problems/invalid-input"
    )
    assert problem["errors"][0]["field"] == "record.y"
    assert_problem(_report(world.analyst, rid, {**RECORD, "x3": 1.0}), 422, "/problems/invalid-input")
    assert_problem(_report(world.analyst, rid, {**RECORD, "x1": "high"}), 422, "/problems/invalid-input")


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        ({"kappa": 0.0}, "kappa"),
        ({"max_rows": 1000}, "max_rows"),  # a declared row bound is never checked against the private n
        ({"report": "data_dependent"}, "report_sigma"),
        ({"epsilon": -1.0}, "epsilon"),
    ],
)
def test_invalid_params_are_refused_before_any_charge(
    live_server: LiveServer, bad: dict[str, Any], field: str
) -> None:
    world, dataset_id = _world(live_server)
    before = get_budget(world.viewer, dataset_id)
    params = {k: v for k, v in _params(**bad).items() if v is not None}
    response = world.request(world.analyst, params, mechanism="adaops.ridge", dataset_id=dataset_id)
    problem = assert_problem(response, 422)
    assert field in str(problem)
    assert get_budget(world.viewer, dataset_id) == before
