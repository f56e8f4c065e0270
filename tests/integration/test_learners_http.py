"""The learners over real HTTP on SQLite and PostgreSQL: each trains on the demo customers dataset, is
charged exactly its realized curve (never more than it reserved), and leaves nothing reserved.

Long-running learners may answer 202; the test then polls ``GET /v1/requests/{rid}`` like a client would.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import numpy as np
import pytest

from service.cli import DEMO_LEARNING_SCHEMA, demo_learning_csv
from tests.conftest import LiveServer
from tests.integration.helpers import World, assert_problem, get_budget, make_world

BUDGET = {"epsilon": 50.0, "delta": 1e-6}
FEATURES = ["age", "tenure", "visits"]

LEARNERS: dict[str, dict[str, Any]] = {
    "dp_gd": {
        "features": FEATURES,
        "label": "churn",
        "model": "logistic",
        "regularization": 0.01,
        "steps": 20,
        "clip": 1.0,
        "target_epsilon": 2.0,
        "target_delta": 1e-6,
    },
    "rgm.gd": {
        "features": FEATURES,
        "label": "spend",
        "model": "ridge",
        "regularization": 0.05,
        "steps": 20,
        "target_epsilon": 0.05,
        "target_alpha": 2.0,
    },
}


@pytest.fixture
def world(live_server: LiveServer) -> World:
    return make_world(live_server, BUDGET, DEMO_LEARNING_SCHEMA, demo_learning_csv(rows=2000))


def settled(client: httpx.Client, response: httpx.Response, timeout: float = 120) -> dict[str, Any]:
    """The request's final state: the response itself (200) or polled to completion (202)."""
    assert response.status_code in (200, 202), response.text
    body: dict[str, Any] = response.json()
    deadline = time.monotonic() + timeout
    while body["state"] == "running":
        assert time.monotonic() < deadline, "the learner did not finish"
        time.sleep(0.2)
        polled = client.get(f"/v1/requests/{body['id']}")
        assert polled.status_code == 200, polled.text
        body = polled.json()
    return body


def curve_at_most(realized: dict[str, Any], worst: dict[str, Any]) -> bool:
    pairs = zip(realized["values"], worst["values"], strict=True)
    return all(float(r) <= float(w) for r, w in pairs)


@pytest.mark.parametrize("mechanism", sorted(LEARNERS))
def test_a_learner_trains_and_is_charged_its_realized_curve(world: World, mechanism: str) -> None:
    submitted = world.request(world.analyst, LEARNERS[mechanism], mechanism)
    body = settled(world.analyst, submitted)
    assert body["state"] == "committed", body
    release = body["release"]
    theta = np.asarray(release["theta"], dtype=float)
    assert theta.shape == (len(FEATURES) + 1,)  # the features and the intercept
    assert np.all(np.isfinite(theta))
    assert curve_at_most(body["realized"], body["worst_case"])
    budget = get_budget(world.viewer, world.dataset_id)
    assert all(slot["reserved"] == 0.0 for slot in budget["orders"])
    spent = np.array([float(slot["spent"]) for slot in budget["orders"]])
    realized = np.array([float(v) for v in body["realized"]["values"]])
    assert np.array_equal(np.isinf(spent), np.isinf(realized))  # +∞ where no bound is proven (α ceiling)
    finite = np.isfinite(realized)
    assert np.allclose(spent[finite], realized[finite], rtol=1e-9, atol=1e-12)


def test_the_logistic_learner_finds_the_signal(world: World) -> None:
    """Churn falls with tenure in the demo data (coefficient −0.35 per year): the sign must come through."""
    body = settled(world.analyst, world.request(world.analyst, LEARNERS["dp_gd"], "dp_gd"))
    tenure = body["release"]["theta"][FEATURES.index("tenure")]
    assert tenure < 0


@pytest.mark.parametrize(
    ("mechanism", "change", "field"),
    [
        ("dp_gd", {"features": ["age", "nope"]}, "params.features[1]"),
        ("dp_gd", {"label": "spend"}, "params.label"),  # logistic needs a two-valued label
        ("rgm.gd", {"label": "churn"}, "params.label"),  # ridge needs a numeric label
        ("rgm.gd", {"steps": 0}, "params.steps"),
    ],
)
def test_bad_learner_params_name_the_field(
    world: World, mechanism: str, change: dict[str, Any], field: str
) -> None:
    response = world.request(world.analyst, {**LEARNERS[mechanism], **change}, mechanism)
    problem = assert_problem(response, 422)
    assert field in [error["field"] for error in problem["errors"]], problem
    budget = get_budget(world.viewer, world.dataset_id)
    assert all(slot["spent"] == 0.0 and slot["reserved"] == 0.0 for slot in budget["orders"])
