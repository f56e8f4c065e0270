"""The adaptive per-instance report of ``objpert.logistic`` over HTTP (Redberg 2023, Alg 8/9;
docs/privacy/objective_perturbation.md#objpert-adaptive-report), on SQLite and PostgreSQL.

A request with ``report_lambda_min_sigma`` (σ₄) is admitted at a regularization the former requirement
λ ≥ 2σ₃τ_GOE refuses; its charge is the data-dependent report's plus one Gaussian release (λ̂_min); the
privacy-report endpoint evaluates the adaptive reporting function without touching the data or the budget.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from mechanisms.accounting import DEFAULT_ORDERS
from mechanisms.learners.objective_perturbation import ObjPertLogisticParams
from mechanisms.per_instance.reports import ADAPTIVE_EVENTS, evaluate_report
from tests.conftest import LiveServer
from tests.integration.helpers import assert_problem, get_budget, ledger_items
from tests.integration.test_privacy_reports import RECORD, _committed, _params, _report, _world

ADAPTIVE = {
    "regularization": 2.0,
    "report": "data_dependent",
    "report_gradient_sigma": 2.0,
    "report_hessian_sigma": 1.0,
    "report_lambda_min_sigma": 1.0,
    "report_rho": 1e-3,
}


def test_adaptive_report_is_admitted_charged_and_evaluated(live_server: LiveServer) -> None:
    world, dataset_id = _world(live_server)
    catalog = {m["name"]: m for m in world.analyst.get("/v1/mechanisms").json()}
    assert "report_lambda_min_sigma" in catalog["objpert.logistic"]["params_schema"]["properties"]
    committed = _committed(world, world.analyst, dataset_id, _params(**ADAPTIVE))
    assert committed["realized"] == committed["worst_case"]
    plain = _committed(world, world.analyst, dataset_id, _params(regularization=2.0))
    alphas = np.asarray(DEFAULT_ORDERS)
    added = np.asarray(committed["worst_case"]["values"]) - np.asarray(plain["worst_case"]["values"])
    # ĝ (sensitivity 1 + 2τ), Ĥ's GOE vector (β/√2 = 1/(4√2)), λ̂_min (β = 1/4): Gaussian RDP, grid ≈ 2^-20
    gaussian = alphas * ((1 + 2e-6) ** 2 / (2 * 4.0) + (0.25 / np.sqrt(2)) ** 2 / 2 + 0.25**2 / 2)
    assert np.all(added >= gaussian * (1 - 1e-9))
    assert np.allclose(added, gaussian, rtol=1e-4)
    report = committed["release"]["report"]
    assert report["events"] == ADAPTIVE_EVENTS
    assert report["lambda_lo"] >= 2.0
    assert {"lambda_min", "lambda_min_grid", "lambda_min_margin", "gradient", "hessian"} <= set(report)

    budget_before = get_budget(world.analyst, dataset_id)
    ledger_before = ledger_items(world.admin, dataset_id)
    response = _report(world.analyst, committed["id"], RECORD)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["charged"] == 0.0
    assert body["report_kind"] == "data_dependent"
    assert body["confidence"] == pytest.approx(1 - 1e-3)
    assert body["terms"]["report_lambda_min"] > 0
    # recomputed here from the release and the public parameters only
    params = ObjPertLogisticParams.model_validate(committed["params"])
    x = np.array([[0.4, -0.2, 0.0, 1.0, 1.0]])
    x = x / max(1.0, float(np.linalg.norm(x)))
    local = evaluate_report(params, committed["release"], x, np.array([1.0]), DEFAULT_ORDERS)[0]
    assert {k: body[k] for k in local} == local
    assert get_budget(world.analyst, dataset_id) == budget_before
    assert ledger_items(world.admin, dataset_id) == ledger_before


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        ({**ADAPTIVE, "report_lambda_min_sigma": None}, "report_hessian_sigma"),  # the former requirement
        ({"report_lambda_min_sigma": 1.0}, "report_lambda_min_sigma"),  # only with data_dependent
        ({**ADAPTIVE, "report_lambda_min_sigma": -1.0}, "report_lambda_min_sigma"),
    ],
)
def test_invalid_adaptive_params_are_refused_before_any_charge(
    live_server: LiveServer, bad: dict[str, Any], field: str
) -> None:
    world, dataset_id = _world(live_server)
    before = get_budget(world.analyst, dataset_id)
    params = {k: v for k, v in _params(**bad).items() if v is not None}
    response = world.request(world.analyst, params, mechanism="objpert.logistic", dataset_id=dataset_id)
    problem = assert_problem(response, 422)
    assert field in str(problem)
    assert get_budget(world.analyst, dataset_id) == before
