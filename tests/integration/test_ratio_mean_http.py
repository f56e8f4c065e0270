"""Issue 35 item 9 over real HTTP (SQLite and PostgreSQL): a mean on add/remove data, or with a ``where``,
is released as a noisy sum over a noisy count, charged exactly the requested ε, with its interval and both
parts in the release (mechanisms/queries/ratio_mean.py)."""

from __future__ import annotations

import pytest

from tests.conftest import LiveServer
from tests.integration.helpers import BIG, SCHEMA, make_world


@pytest.mark.parametrize("neighboring", ["add_remove", "replace_one"])
def test_a_mean_with_a_private_size_is_released_and_charged_epsilon(
    live_server: LiveServer, neighboring: str
) -> None:
    world = make_world(live_server, BIG, {**SCHEMA, "neighboring": neighboring})
    query = {"kind": "mean", "column": "age", "where": [{"column": "age", "op": "gt", "value": 30}]}
    released = world.request(world.analyst, {"query": query, "epsilon": 50.0})
    assert released.status_code == 200, released.text
    body = released.json()
    release = body["release"]
    assert release["parts"]["count"] > 0
    assert release["value"] == pytest.approx(release["parts"]["sum"] / release["parts"]["count"])
    assert release["interval"]["lower"] <= release["value"] <= release["interval"]["upper"]
    assert 30 <= release["interval"]["lower"]  # clamped within the bounds, not below the where
    assert body["realized"]["pure"] == 50.0
