"""The SQL front shows each row's intervals (issue 35 item 3): a COUNT(*) row with its [lower, upper], at
the release's level, free; a count released below 0 is named as noise in ``warnings``."""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import LiveServer
from tests.integration.helpers import BIG, get_budget, make_world

LEVEL = 0.999999


def _sql(world: Any, statement: str, **extra: Any) -> Any:
    return world.analyst.post(f"/v1/datasets/{world.dataset_id}/sql", json={"sql": statement, **extra})


def test_count_rows_carry_their_intervals(live_server: LiveServer) -> None:
    world = make_world(live_server, budget=BIG)
    # no row has age > 85: every true count is 0, so some released counts are likely negative
    statement = (
        "SELECT region, COUNT(*) AS n, AVG(age) FROM dataset WHERE age > 85 GROUP BY region ORDER BY region"
    )
    response = _sql(world, statement, epsilon=0.2, confidence=LEVEL)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["params"]["confidence"] == LEVEL
    assert body["interval_level"] == LEVEL
    assert len(body["intervals"]) == len(body["rows"]) == 4
    groups = {g["key"]["region"]: g for g in body["release"]["groups"]}
    for row, interval in zip(body["rows"], body["intervals"], strict=True):
        assert set(interval) == {"n", "AVG(age)"}
        lower, upper = interval["n"]
        assert lower <= row["n"] <= upper
        assert [lower, upper] == [
            groups[row["region"]]["interval"]["lower"]["count"],
            groups[row["region"]]["interval"]["upper"]["count"],
        ]
        assert lower <= 0.0 <= upper  # the true count (0) is inside: misses with probability ≤ 1e-6
        low, high = interval["AVG(age)"]
        assert 18.0 <= low <= high <= 90.0  # an empty cell: nothing claimed beyond the declared range
    negative = [row for row in body["rows"] if row["n"] < 0]
    assert bool(negative) == any("is negative" in w for w in body["warnings"])
    assert body["release"]["interval"]["union_bound"] == ["mean(age)"]
    # the intervals are post-processing: the charge is the ε asked for, whatever the level
    assert get_budget(world.admin, world.dataset_id)["pure"]["spent"] == pytest.approx(0.2, abs=1e-9)


def test_ungrouped_statement_has_one_interval_row(live_server: LiveServer) -> None:
    world = make_world(live_server, budget=BIG)
    response = _sql(world, "SELECT COUNT(*), SUM(income) FROM dataset", epsilon=1.0)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["interval_level"] == 0.95
    (row,), (interval,) = body["rows"], body["intervals"]
    for column in ("COUNT(*)", "SUM(income)"):
        lower, upper = interval[column]
        assert lower <= row[column] <= upper
    assert body["warnings"] == [] or row["COUNT(*)"] < 0


def test_session_steps_and_accuracy_first_carry_intervals(live_server: LiveServer) -> None:
    """Noise-reduction answers over HTTP carry the union-bound interval; the charge is unchanged."""
    world = make_world(live_server, {"epsilon": 5.0, "delta": 0.0})
    params = {"query": {"kind": "count"}, "epsilons": [0.1, 0.2, 0.4, 0.8], "confidence": 0.9}
    opened = world.analyst.post(
        f"/v1/datasets/{world.dataset_id}/sessions",
        json={"mechanism": "noise_reduction.laplace", "params": params},
    )
    assert opened.status_code == 201, opened.text
    widths = []
    for _ in range(2):
        step = world.analyst.post(f"/v1/sessions/{opened.json()['id']}/next")
        assert step.status_code == 200, step.text
        answer = step.json()["answer"]
        interval = answer["interval"]
        assert interval["level"] == 0.9
        assert interval["union_over_levels"] == 4
        assert interval["lower"] == answer["value"] - interval["half_width"]
        assert interval["upper"] == answer["value"] + interval["half_width"]
        widths.append(interval["half_width"])
    assert widths[1] < widths[0]  # less noise at the next level, a narrower interval
    closed = world.analyst.post(f"/v1/sessions/{opened.json()['id']}/close")
    assert closed.json()["realized"]["pure"] == pytest.approx(0.2, abs=1e-12)
    one_shot = world.request(
        world.analyst,
        {"query": {"kind": "count"}, "epsilons": [0.5, 1.0], "target": {"relative": 0.1}},
        mechanism="accuracy_first.laplace",
    )
    assert one_shot.status_code == 200, one_shot.text
    release = one_shot.json()["release"]
    assert release["interval"]["lower"] <= release["value"] <= release["interval"]["upper"]
    assert release["interval"]["union_over_levels"] == 2
