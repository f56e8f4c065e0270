"""``COUNT(DISTINCT unit)`` (measure ``count_distinct``; docs/privacy/units_learners.md#count-distinct-unit).

Per cell, the number of distinct units among the selected, bounded rows: one unit with all its rows adds 1
to at most min(k, cells) cells (add/remove), or moves at most min(2k, cells) cells by 1 (replace). Checked
on pairs with heavy units (up to 10× the bound, over every group), with and without ``where`` and
``group_by``, for the Laplace and Gaussian plans; the bound is reached; without the unit bounding the
grouped count would move by more than charged (so the bounding is what makes the charge right); DuckDB
and the NumPy reference return the same integers; refusals name the field; the SQL front translates it.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mechanisms.base import ParamsError
from mechanisms.data.plan import ORDER_COLUMN
from mechanisms.data.schema import DatasetSchema
from mechanisms.queries import measures as measures_module
from mechanisms.queries.measures import (
    MeasuresGaussianParams,
    MeasuresLaplaceParams,
    evaluate_blocks,
    gaussian_plans,
    laplace_plans,
)
from tests.unit.test_privacy_units import COLUMNS, WHERES, K, ctx, neighbours, table

MEASURES: list[list[dict[str, Any]]] = [
    [{"kind": "count_distinct", "column": "user"}],
    [{"kind": "count"}, {"kind": "count_distinct", "column": "user"}, {"kind": "sum", "column": "x"}],
]


def _moves(neighboring: str, heavy: int, seed: int, base: dict[str, Any]) -> list[tuple[int, float, Any]]:
    """Per noise and per units block: (ℓ1, ℓ2 of the change in grid units, the block's plan)."""
    context = ctx(neighboring)
    a, b = neighbours(seed, heavy, neighboring)
    laplace = MeasuresLaplaceParams.model_validate({**base, "epsilon": 0.7})
    gaussian = MeasuresGaussianParams.model_validate({**base, "noise_multiplier": 2.0})
    found = []
    for params, plans in (
        (laplace, [plan for plan, _ in laplace_plans(laplace, context)]),
        (gaussian, [entry[0] for entry in gaussian_plans(gaussian, context)]),
    ):
        ua, _ = evaluate_blocks(params, context, table(a), plans)
        ub, _ = evaluate_blocks(params, context, table(b), plans)
        for plan, x, y in zip(plans, ua, ub, strict=True):
            if plan.block.kind == "units":
                moved = np.abs(x.astype(np.int64) - y.astype(np.int64))
                found.append((int(moved.sum()), math.sqrt(float((moved.astype(float) ** 2).sum())), plan))
    return found


@pytest.mark.parametrize("neighboring", ["add_remove", "replace_one"])
@pytest.mark.parametrize("heavy", [1, K, 10 * K])
def test_distinct_units_stay_within_their_sensitivity(neighboring: str, heavy: int) -> None:
    reached = {(): 0, ("g",): 0}
    for seed in range(4):
        for measures in MEASURES:
            for group_by in ([], ["g"]):
                for where in WHERES:
                    base = {"measures": measures, "group_by": group_by, "where": where}
                    for l1_moved, l2_moved, plan in _moves(neighboring, heavy, seed, base):
                        label = (group_by, where, neighboring, heavy, seed)
                        assert l1_moved <= plan.l1_units, label
                        assert l2_moved <= plan.l2_units + 1e-12, label
                        reached[tuple(group_by)] = max(reached[tuple(group_by)], l1_moved)
    if neighboring == "add_remove":
        assert reached[()] == 1  # the ungrouped count moves by exactly one unit
        if heavy == K:  # the heavy unit's k rows in k different groups: min(k, 5 groups) = 4 cells
            assert reached[("g",)] == min(K, 5)
    elif heavy >= K:  # the replaced unit's kept rows leave some groups and enter others
        assert reached[("g",)] >= 2


def test_the_charge_is_min_k_cells_per_unit() -> None:
    """ℓ1 = min(k, G) add/remove, min(2k, G) replace (one per moved cell, exact on γ = 1); ℓ2 = √ℓ1."""
    for neighboring, expected in (("add_remove", min(K, 5)), ("replace_one", min(2 * K, 5))):
        params = MeasuresLaplaceParams.model_validate(
            {"measures": MEASURES[0], "group_by": ["g"], "epsilon": 1.0}
        )
        ((plan, _scale),) = laplace_plans(params, ctx(neighboring))
        assert plan.exact, neighboring
        assert plan.l1_units == expected, neighboring
        gaussian = MeasuresGaussianParams.model_validate(
            {"measures": MEASURES[0], "group_by": ["g"], "noise_multiplier": 1.0}
        )
        ((g_plan, _, _),) = gaussian_plans(gaussian, ctx(neighboring))
        assert g_plan.l2_units == pytest.approx(math.sqrt(expected))
    ungrouped = MeasuresLaplaceParams.model_validate({"measures": MEASURES[0], "epsilon": 1.0})
    assert laplace_plans(ungrouped, ctx())[0][0].l1_units == 1


def test_without_the_unit_bound_the_grouped_count_exceeds_the_charge(monkeypatch: pytest.MonkeyPatch) -> None:
    """The mutation the test above must catch: with k = 1 a unit is charged 1 cell, but its unbounded rows
    reach every group it has rows in."""
    monkeypatch.setattr(measures_module, "unit_bound", lambda context: None)
    context = ctx("add_remove", k=1)
    a, b = neighbours(0, 10, "add_remove")
    params = MeasuresLaplaceParams.model_validate(
        {"measures": MEASURES[0], "group_by": ["g"], "epsilon": 1.0}
    )
    plans = [plan for plan, _ in laplace_plans(params, context)]
    ua, _ = evaluate_blocks(params, context, table(a), plans)
    ub, _ = evaluate_blocks(params, context, table(b), plans)
    assert int(np.abs(ua[0] - ub[0]).sum()) > plans[0].l1_units


@pytest.mark.parametrize("neighboring", ["add_remove", "replace_one"])
def test_duckdb_counts_distinct_units_as_numpy(neighboring: str, tmp_path: Path) -> None:
    from tests.engine_support import engine_table

    context = ctx(neighboring)
    for seed in range(3):
        for rows in neighbours(seed, 10 * K, neighboring):
            columns = table(rows)
            scanned = engine_table(
                columns, context.schema, tmp_path, extra={ORDER_COLUMN: columns[ORDER_COLUMN]}
            )
            for group_by in ([], ["g"]):
                for where in WHERES:
                    params = MeasuresLaplaceParams.model_validate(
                        {"measures": MEASURES[1], "group_by": group_by, "where": where, "epsilon": 1.0}
                    )
                    plans = [plan for plan, _ in laplace_plans(params, context)]
                    expected, _ = evaluate_blocks(params, context, columns, plans)
                    got, _ = evaluate_blocks(params, context, scanned, plans)
                    for x, y in zip(expected, got, strict=True):
                        assert np.array_equal(x, y), (group_by, where)


def test_count_distinct_is_only_of_the_unit_column() -> None:
    from mechanisms.accounting import DEFAULT_ORDERS
    from mechanisms.base import PublicContext

    other = MeasuresLaplaceParams.model_validate(
        {"measures": [{"kind": "count_distinct", "column": "n"}], "epsilon": 1.0}
    )
    with pytest.raises(ParamsError) as refused:
        laplace_plans(other, ctx())
    assert refused.value.field == "measures.0.column"
    row_level = PublicContext(
        DatasetSchema.model_validate({"columns": COLUMNS, "neighboring": "add_remove"}), None, DEFAULT_ORDERS
    )
    units = MeasuresLaplaceParams.model_validate(
        {"measures": [{"kind": "count_distinct", "column": "user"}], "epsilon": 1.0}
    )
    with pytest.raises(ParamsError) as refused:
        laplace_plans(units, row_level)
    assert refused.value.field == "measures.0.column"
    assert "declares none" in refused.value.reason


def test_the_sql_front_translates_count_distinct() -> None:
    from service.api.routers.sql import SqlIn, translate

    statement = "SELECT g, COUNT(DISTINCT user), COUNT(*) FROM dataset WHERE x > 0 GROUP BY g"
    translation = translate(statement, "ds", SqlIn(sql=statement, epsilon=1.0))
    assert translation.mechanism == "measures.laplace"
    assert translation.params["measures"] == [{"kind": "count_distinct", "column": "user"}, {"kind": "count"}]
    assert translation.params["group_by"] == ["g"]
