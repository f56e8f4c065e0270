"""Parameters that just work (issue 19): for every learner, a refused request names the real reason and offers
the nearest admissible setting (``affordable``), the dry run (``:estimate``) offers the same, and that value,
resubmitted, is admitted. On SQLite and PostgreSQL (the ``live_server`` fixture's backends).

The dataset is the demo learning dataset (2 000 rows, replace-one) with the demo budget (ε, δ) = (1, 1e-6).
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest

from service.cli import DEMO_LEARNING_SCHEMA, demo_learning_csv
from tests.conftest import LiveServer
from tests.integration.helpers import World, make_world

BUDGET = {"epsilon": 1.0, "delta": 1e-6}
FEATURES = ["age", "tenure", "visits"]
LOGISTIC = {"features": FEATURES, "label": "churn"}
RIDGE = {"features": FEATURES, "label": "spend"}

# Each request costs more than the whole budget; the field its ``affordable`` names.
TOO_DEAR: dict[str, tuple[str, dict[str, Any], str]] = {
    "dp_gd target": (
        "dp_gd",
        LOGISTIC | {"model": "logistic", "steps": 20, "target_epsilon": 5.0, "target_delta": 1e-6},
        "target_epsilon",
    ),
    "dp_gd noise": (
        "dp_gd",
        LOGISTIC | {"model": "logistic", "steps": 20, "noise_multiplier": 2.0},
        "noise_multiplier",
    ),
    "dp_gd adaptive": (
        "dp_gd",
        RIDGE | {"model": "ridge", "steps": 20, "noise_multiplier": 2.0, "clipping": "adaptive", "clip": 0.1},
        "noise_multiplier",
    ),
    "rgm.gd gamma": ("rgm.gd", RIDGE | {"regularization": 1.0, "steps": 10, "gamma": 1e-6}, "gamma"),
    "rgm.gd target": (
        "rgm.gd",
        RIDGE | {"regularization": 1.0, "steps": 10, "target_epsilon": 3.0, "target_delta": 1e-6},
        "target_epsilon",
    ),
    "objpert.logistic": ("objpert.logistic", LOGISTIC | {"regularization": 5.0, "sigma": 0.5}, "sigma"),
    "accuracy_first.ridge": (
        "accuracy_first.ridge",
        RIDGE | {"regularization": 0.05, "target_excess_risk": 5.0, "levels": 50, "epsilon_max": 50.0},
        "epsilon_max",
    ),
}


@pytest.fixture
def world(live_server: LiveServer) -> World:
    return make_world(live_server, BUDGET, DEMO_LEARNING_SCHEMA, demo_learning_csv(rows=2000))


def estimate(world: World, mechanism: str, params: dict[str, Any]) -> dict[str, Any]:
    response = world.analyst.post(
        f"/v1/datasets/{world.dataset_id}/requests:estimate", json={"mechanism": mechanism, "params": params}
    )
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def settled(client: httpx.Client, response: httpx.Response, timeout: float = 180) -> dict[str, Any]:
    assert response.status_code in (200, 202), response.text
    body: dict[str, Any] = response.json()
    deadline = time.monotonic() + timeout
    while body["state"] == "running":
        assert time.monotonic() < deadline, "the learner did not finish"
        time.sleep(0.2)
        body = client.get(f"/v1/requests/{body['id']}").json()
    return body


@pytest.mark.parametrize("case", sorted(TOO_DEAR))
def test_a_refused_learner_offers_a_setting_that_is_admitted(world: World, case: str) -> None:
    mechanism, params, knob = TOO_DEAR[case]
    dry = estimate(world, mechanism, params)
    assert dry["admitted"] is False, dry
    offered = dry["refusal"]["affordable"]
    assert offered is not None, dry["refusal"]
    assert offered["parameter"] == knob
    refused = world.request(world.analyst, params, mechanism)
    assert refused.status_code == 409, refused.text
    problem = refused.json()
    assert problem["affordable"] == offered  # the dry run and the refusal agree
    assert "pure budget" not in problem["detail"]  # δ = 1e-6: Rényi accounting, not a pure budget
    assert f"largest affordable {knob}" in problem["detail"]
    for alternative in offered.get("alternatives", []):  # e.g. the most steps that fit
        fitted = params | {alternative["parameter"]: alternative["value"]}
        assert estimate(world, mechanism, fitted)["admitted"] is True, (case, alternative)
    fitted = params | {knob: offered["value"]}
    assert estimate(world, mechanism, fitted)["admitted"] is True
    body = settled(world.analyst, world.request(world.analyst, fitted, mechanism))
    assert body["state"] == "committed", body
    release = body["release"]
    assert release["columns"] == [*params["features"], "(intercept)"], release


def test_an_infeasible_rgm_target_explains_the_feasible_range(world: World) -> None:
    params = RIDGE | {"regularization": 0.01, "steps": 10, "target_epsilon": 0.01, "target_alpha": 2.0}
    response = world.request(world.analyst, params, "rgm.gd")
    assert response.status_code == 422, response.text
    errors = response.json()["errors"]
    reason = next(e["reason"] for e in errors if e["field"] == "params.target_epsilon")
    assert "Feasible range" in reason or "no target_epsilon is reachable" in reason
    assert "regularization ≥" in reason
