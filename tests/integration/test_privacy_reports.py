"""objpert.logistic over HTTP and POST /v1/requests/{rid}/privacy-report (SQLite and PostgreSQL).

The endpoint evaluates the release's reporting function on the caller's record: no data access, no charge.
It cannot return true per-record losses: its answer is reproduced exactly, in this process, from the
stored release and the public parameters alone (``mechanisms.per_instance.reports.evaluate_report``), with no
access to the dataset; and the budget and the ledger do not move.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import numpy as np
import pytest

from mechanisms.accounting import DEFAULT_ORDERS
from mechanisms.learners.objective_perturbation import ObjPertLogisticParams
from mechanisms.per_instance.reports import evaluate_report
from service.auth import Role
from tests.conftest import LiveServer
from tests.integration.helpers import (
    World,
    add_dataset,
    assert_problem,
    get_budget,
    ledger_items,
    make_world,
)

RDP_BUDGET = {"epsilon": 50.0, "delta": 1e-5}
SCHEMA: dict[str, Any] = {
    "columns": [
        {"name": "x1", "type": "float", "min": -1, "max": 1},
        {"name": "x2", "type": "float", "min": -1, "max": 1},
        {"name": "group", "type": "categorical", "values": ["a", "b"]},
        {"name": "label", "type": "categorical", "values": ["no", "yes"]},
    ],
    "neighboring": "add_remove",
}


def _csv(n: int = 300, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    x1, x2 = rng.uniform(-1, 1, n), rng.uniform(-1, 1, n)
    group = rng.integers(0, 2, n)
    label = (x1 - 0.5 * x2 + 0.3 * rng.normal(size=n)) > 0
    rows = [
        f"{a:.6f},{b:.6f},{'ab'[g]},{'yes' if lbl else 'no'}"
        for a, b, g, lbl in zip(x1, x2, group, label, strict=True)
    ]
    return ("x1,x2,group,label\n" + "\n".join(rows) + "\n").encode()


def _world(live_server: LiveServer) -> tuple[World, str]:
    world = make_world(live_server, RDP_BUDGET)
    return world, add_dataset(world, _csv(), SCHEMA, RDP_BUDGET)


def _params(**extra: Any) -> dict[str, Any]:
    base = {"features": ["x1", "x2", "group"], "label": "label", "regularization": 2.0, "sigma": 3.0}
    return {**base, "max_rows": 1000, **extra}  # add_remove: a public row bound is required


def _committed(world: World, client: httpx.Client, dataset_id: str, params: dict[str, Any]) -> dict[str, Any]:
    response = world.request(client, params, mechanism="objpert.logistic", dataset_id=dataset_id)
    assert response.status_code in (200, 202), response.text
    body: dict[str, Any] = response.json()
    deadline = time.monotonic() + 60
    while body["state"] == "running" and time.monotonic() < deadline:
        time.sleep(0.1)
        body = client.get(f"/v1/requests/{body['id']}").json()
    assert body["state"] == "committed", body
    return body


RECORD = {"x1": 0.4, "x2": -0.2, "group": "b", "label": "yes"}


def _report(client: httpx.Client, rid: str, record: dict[str, Any]) -> httpx.Response:
    return client.post(f"/v1/requests/{rid}/privacy-report", json={"record": record})


def test_public_report_is_free_and_a_function_of_the_release(live_server: LiveServer) -> None:
    world, dataset_id = _world(live_server)
    catalog = {m["name"]: m for m in world.viewer.get("/v1/mechanisms").json()}
    entry = catalog["objpert.logistic"]
    assert entry["cost_parameter"] == "sigma"
    assert entry["params_schema"]["additionalProperties"] is False
    assert {"regularization", "sigma", "report"} <= set(entry["params_schema"]["properties"])
    committed = _committed(world, world.analyst, dataset_id, _params())
    release = committed["release"]
    assert committed["realized"] == committed["worst_case"]
    assert len(release["theta"]) == 5  # x1, x2, one-hot group (2), intercept
    assert release["report"]["kind"] == "public"
    for leaky in ("iterations", "gradient_norm", "objective", "b", "approx_minimizer"):
        assert leaky not in release

    budget_before = get_budget(world.viewer, dataset_id)
    ledger_before = ledger_items(world.admin, dataset_id)
    first = _report(world.analyst, committed["id"], RECORD)
    assert first.status_code == 200, first.text
    body = first.json()
    assert body["charged"] == 0.0
    assert body["report_kind"] == "public"
    assert 0 < body["ex_post_epsilon_upper"] < 50
    assert set(body) == {
        "request_id",
        "mechanism",
        "report_kind",
        "charged",
        "ex_post_epsilon_upper",
        "confidence",
        "terms",
        "personalized_rdp",
    }
    # no data access: the same answer is recomputed here from the release and the public parameters only
    params = ObjPertLogisticParams.model_validate(committed["params"])
    x = np.array([[0.4, -0.2, 0.0, 1.0, 1.0]])
    x = x / max(1.0, float(np.linalg.norm(x)))
    local = evaluate_report(params, release, x, np.array([1.0]), DEFAULT_ORDERS)[0]
    assert {k: body[k] for k in local} == local
    # deterministic, free, and the admin may ask too
    assert _report(world.analyst, committed["id"], RECORD).json() == body
    assert _report(world.admin, committed["id"], RECORD).json() == body
    assert get_budget(world.viewer, dataset_id) == budget_before
    assert ledger_items(world.admin, dataset_id) == ledger_before
    # out-of-bounds values are clipped to the declared bounds, exactly as training clips the data
    clipped = _report(world.analyst, committed["id"], {**RECORD, "x1": 40.0}).json()
    assert clipped == _report(world.analyst, committed["id"], {**RECORD, "x1": 1.0}).json()


def test_data_dependent_report_is_charged_once_at_release(live_server: LiveServer) -> None:
    world, dataset_id = _world(live_server)
    plain = _committed(world, world.analyst, dataset_id, _params(regularization=80.0))
    dep = _committed(
        world,
        world.analyst,
        dataset_id,
        _params(
            regularization=80.0, report="data_dependent", report_gradient_sigma=2.0, report_hessian_sigma=1.0
        ),
    )
    assert all(b > a for a, b in zip(plain["worst_case"]["values"], dep["worst_case"]["values"], strict=True))
    assert np.asarray(dep["release"]["report"]["hessian"]).shape == (5, 5)
    spent = get_budget(world.viewer, dataset_id)
    response = _report(world.analyst, dep["id"], RECORD)
    assert response.status_code == 200, response.text
    assert response.json()["report_kind"] == "data_dependent"
    assert get_budget(world.viewer, dataset_id) == spent


def test_errors(live_server: LiveServer) -> None:
    world, dataset_id = _world(live_server)
    committed = _committed(world, world.analyst, dataset_id, _params())
    rid = committed["id"]
    assert_problem(_report(world.analyst, rid, {**RECORD, "age": 3}), 422, "/problems/invalid-input")
    missing = {k: v for k, v in RECORD.items() if k != "label"}
    problem = assert_problem(_report(world.analyst, rid, missing), 422, "/problems/invalid-input")
    assert problem["errors"][0]["field"] == "record.label"
    assert_problem(_report(world.analyst, rid, {**RECORD, "group": "zzz"}), 422, "/problems/invalid-input")
    assert_problem(_report(world.analyst, rid, {**RECORD, "x1": "high"}), 422, "/problems/invalid-input")
    assert_problem(world.analyst.post(f"/v1/requests/{rid}/privacy-report", json={"rec": RECORD}), 422)
    assert_problem(_report(world.viewer, rid, RECORD), 403)
    _, other = world.new_key(Role.analyst)
    assert_problem(_report(other, rid, RECORD), 404)
    assert_problem(_report(world.analyst, "nope", RECORD), 404)
    none = _committed(world, world.analyst, dataset_id, _params(report="none"))
    assert "report" not in none["release"]
    assert_problem(_report(world.analyst, none["id"], RECORD), 409)
    laplace = world.request(
        world.analyst, {"query": {"kind": "count"}, "epsilon": 0.5}, dataset_id=dataset_id
    )
    assert laplace.status_code == 200, laplace.text
    assert_problem(_report(world.analyst, laplace.json()["id"], RECORD), 409)


@pytest.mark.parametrize(
    "bad",
    [
        {"regularization": 0.2},
        {"report": "data_dependent"},
        {"features": ["nope"]},
        {"max_rows": None},  # required on add_remove
        {"tolerance": 1e-12},  # below 10× the public rounding slack: ⊥ would depend on the data
    ],
)
def test_invalid_params_are_refused_before_any_charge(live_server: LiveServer, bad: dict[str, Any]) -> None:
    world, dataset_id = _world(live_server)
    before = get_budget(world.viewer, dataset_id)
    params = {k: v for k, v in _params(**bad).items() if v is not None}
    response = world.request(world.analyst, params, mechanism="objpert.logistic", dataset_id=dataset_id)
    problem = assert_problem(response, 422)
    if "max_rows" in bad or "tolerance" in bad:
        field = "max_rows" if "max_rows" in bad else "tolerance"
        assert field in str(problem)
    assert get_budget(world.viewer, dataset_id) == before
