"""Privacy units (docs/privacy/units.md#units): neighbouring datasets differ by one unit with all its rows,
every plan keeps at most ``max_rows`` of a unit's selected rows, and the charged sensitivities bound the
change.

The fuzz builds pairs that differ by one unit with many rows (up to 10× the bound), values at the column
bounds, spread over many groups, and checks for every query family that the largest change of every
aggregate, in grid units, never exceeds the charged sensitivity — and reaches it."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from mechanisms.accounting import DEFAULT_ORDERS
from mechanisms.base import ParamsError, PublicContext
from mechanisms.data.plan import ORDER_COLUMN
from mechanisms.data.schema import DatasetSchema
from mechanisms.queries.gaussian import GaussianParams, gaussian_plan
from mechanisms.queries.language import AnyQuery, check_query, evaluate_units, laplace_plan, shifts
from mechanisms.queries.measures import (
    MeasuresGaussianParams,
    MeasuresLaplaceParams,
    evaluate_blocks,
    gaussian_plans,
    laplace_plans,
)
from mechanisms.queries.quantile import QuantileParams, scores, selected_rank_counts
from service.data.ingest import unit_order

K = 4  # max_rows
COLUMNS: list[dict[str, Any]] = [
    {"name": "user", "type": "int", "min": 0, "max": 10**6},
    {"name": "x", "type": "float", "min": -2.0, "max": 5.0},
    {"name": "n", "type": "int", "min": 0, "max": 9},
    {"name": "g", "type": "categorical", "values": ["a", "b", "c", "d", "e"]},
]
SECRET = 0x5EED


def ctx(neighboring: str = "add_remove", k: int = K) -> PublicContext:
    schema = DatasetSchema.model_validate(
        {"columns": COLUMNS, "neighboring": neighboring, "privacy_unit": {"column": "user", "max_rows": k}}
    )
    return PublicContext(schema, None, DEFAULT_ORDERS)


Row = tuple[int, float, int, int]


def table(rows: list[Row]) -> dict[str, np.ndarray]:
    columns = {
        "user": np.array([r[0] for r in rows], dtype=np.int64),
        "x": np.array([r[1] for r in rows], dtype=np.float64),
        "n": np.array([r[2] for r in rows], dtype=np.int64),
        "g": np.array([r[3] for r in rows], dtype=np.int64),
    }
    arrays = [pa.array(columns[c["name"]]) for c in COLUMNS]
    columns[ORDER_COLUMN] = unit_order(arrays, SECRET).to_numpy()
    return columns


def base_rows(seed: int, units: int = 30) -> list[Row]:
    rng = np.random.default_rng(seed)
    rows: list[Row] = []
    for user in range(units):
        for _ in range(int(rng.integers(1, 3 * K))):
            rows.append((user, float(rng.uniform(-2, 5)), int(rng.integers(0, 10)), int(rng.integers(0, 5))))
    return rows


def extreme_unit(user: int, count: int, seed: int) -> list[Row]:
    """A heavy unit: ``count`` rows (up to 10× the bound) at the column bounds, over every group."""
    rng = np.random.default_rng(seed)
    xs = rng.choice([-2.0, 5.0], size=count)
    return [(user, float(xs[i]), int(rng.choice([0, 9])), i % 5) for i in range(count)]


WHERES: list[list[dict[str, Any]]] = [[], [{"column": "x", "op": "gt", "value": 0.0}]]
QUERIES: list[dict[str, Any]] = [
    {"kind": "count"},
    {"kind": "sum", "column": "x"},
    {"kind": "sum", "column": "n"},
    {"kind": "histogram", "column": "g"},
    {"kind": "histogram", "column": "n"},
]


def query(raw: dict[str, Any], where: list[dict[str, Any]]) -> AnyQuery:
    return GaussianParams.model_validate({"query": {**raw, "where": where}, "sigma": 1.0}).query


def grid_moves(q: AnyQuery, context: PublicContext, a: list[Row], b: list[Row]) -> tuple[int, float, Any]:
    plan = laplace_plan(q, context, 0.5)[0]
    ua, _ = evaluate_units(q, context, table(a), plan)
    ub, _ = evaluate_units(q, context, table(b), plan)
    moved = np.abs(ua.astype(np.int64) - ub.astype(np.int64))
    return int(moved.sum()), math.sqrt(float((moved.astype(float) ** 2).sum())), plan


def neighbours(seed: int, heavy: int, neighboring: str) -> tuple[list[Row], list[Row]]:
    rows = base_rows(seed)
    if neighboring == "add_remove":
        return rows, rows + extreme_unit(999, heavy, seed)
    victim = 3
    others = [r for r in rows if r[0] != victim]
    return others + extreme_unit(victim, heavy, seed), others + extreme_unit(victim, heavy, seed + 1)[::-1]


@pytest.mark.parametrize("neighboring", ["add_remove", "replace_one"])
@pytest.mark.parametrize("heavy", [1, K, 10 * K])
def test_query_changes_stay_within_the_charged_sensitivity(neighboring: str, heavy: int) -> None:
    context = ctx(neighboring)
    reached: dict[str, int] = {}
    for seed in range(6):
        a, b = neighbours(seed, heavy, neighboring)
        for raw in QUERIES:
            for where in WHERES:
                q = query(raw, where)
                moved_l1, moved_l2, plan = grid_moves(q, context, a, b)
                assert moved_l1 <= plan.l1_units, (raw, where, neighboring, heavy)
                assert moved_l2 <= plan.l2_units + 1e-9, (raw, where, neighboring, heavy)
                key = f"{raw['kind']}-{raw.get('column')}"
                reached[key] = max(reached.get(key, 0), moved_l1)
    if neighboring == "add_remove" and heavy >= K:  # a heavy unit at the bounds reaches the bound
        assert reached["count-None"] == K
        assert reached["histogram-g"] == K


def test_the_sensitivity_scales_with_the_bound_not_with_the_units_rows() -> None:
    row_level = DatasetSchema.model_validate({"columns": COLUMNS, "neighboring": "add_remove"})
    plain = PublicContext(row_level, None, DEFAULT_ORDERS)
    for raw in QUERIES:
        q = query(raw, [])
        assert shifts(q, ctx()) == tuple(K * s for s in shifts(q, plain)), raw


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10**6),
    heavy=st.integers(1, 10 * K),
    k=st.integers(1, 6),
    neighboring=st.sampled_from(["add_remove", "replace_one"]),
)
def test_random_unit_pairs_stay_within_the_sensitivity(
    seed: int, heavy: int, k: int, neighboring: str
) -> None:
    context = ctx(neighboring, k)
    a, b = neighbours(seed, heavy, neighboring)
    for raw in QUERIES:
        for where in WHERES:
            moved_l1, moved_l2, plan = grid_moves(query(raw, where), context, a, b)
            assert moved_l1 <= plan.l1_units
            assert moved_l2 <= plan.l2_units + 1e-9


MEASURES: list[list[dict[str, Any]]] = [
    [{"kind": "count"}, {"kind": "sum", "column": "x"}, {"kind": "sum", "column": "n"}],
    [{"kind": "mean", "column": "x"}, {"kind": "variance", "column": "n"}, {"kind": "std", "column": "x"}],
]


@pytest.mark.parametrize("neighboring", ["add_remove", "replace_one"])
@pytest.mark.parametrize("heavy", [1, K, 10 * K])
def test_measure_blocks_stay_within_their_sensitivity(neighboring: str, heavy: int) -> None:
    context = ctx(neighboring)
    for seed in range(4):
        a, b = neighbours(seed, heavy, neighboring)
        for measures in MEASURES:
            for group_by in ([], ["g"]):
                for where in WHERES:
                    base = {"measures": measures, "group_by": group_by, "where": where}
                    laplace = MeasuresLaplaceParams.model_validate({**base, "epsilon": 0.7})
                    gaussian = MeasuresGaussianParams.model_validate({**base, "noise_multiplier": 2.0})
                    plans = [plan for plan, _ in laplace_plans(laplace, context)]
                    plans_g = [entry[0] for entry in gaussian_plans(gaussian, context)]
                    for params, block_plans in ((laplace, plans), (gaussian, plans_g)):
                        ua, _ = evaluate_blocks(params, context, table(a), block_plans)
                        ub, _ = evaluate_blocks(params, context, table(b), block_plans)
                        for plan, x, y in zip(block_plans, ua, ub, strict=True):
                            moved = np.abs(x.astype(np.int64) - y.astype(np.int64))
                            label = (plan.block.label, group_by, where, neighboring, heavy)
                            assert int(moved.sum()) <= plan.l1_units, label
                            assert math.sqrt(float((moved.astype(float) ** 2).sum())) <= plan.l2_units, label


@pytest.mark.parametrize("neighboring", ["add_remove", "replace_one"])
def test_quantile_scores_move_by_at_most_the_bound(neighboring: str) -> None:
    context = ctx(neighboring)
    for seed in range(4):
        a, b = neighbours(seed, 10 * K, neighboring)
        for column in ("x", "n"):
            for q in (0.0, 0.25, 0.5, 0.9, 1.0):
                for where in WHERES:
                    params = QuantileParams.model_validate(
                        {"column": column, "quantiles": [q], "epsilon": 1.0, "candidates": 32, "where": where}
                    )
                    vectors = []
                    for rows in (a, b):
                        _c, counts, selected = selected_rank_counts(params, context, table(rows))
                        values, index = scores(counts, selected, q)
                        vectors.append(np.array([float(values[i]) for i in index]))
                    assert np.abs(vectors[0] - vectors[1]).max() <= K + 1e-12


def test_bounding_keeps_at_most_max_rows_per_unit_whatever_the_where() -> None:
    context = ctx()
    rows = extreme_unit(1, 50, 0) + extreme_unit(2, 3, 1)
    count = query({"kind": "count"}, [])
    plan = laplace_plan(count, context, 1.0)[0]
    assert int(evaluate_units(count, context, table(rows), plan)[0][0]) == K + 3
    positive = query({"kind": "count"}, [{"column": "x", "op": "gt", "value": 0.0}])
    kept = int(evaluate_units(positive, context, table(rows), plan)[0][0])
    assert kept == min(K, sum(1 for r in rows if r[0] == 1 and r[1] > 0)) + sum(
        1 for r in rows if r[0] == 2 and r[1] > 0
    )


@pytest.mark.parametrize(
    ("unit", "message"),
    [
        ({"column": "nobody", "max_rows": 3}, "no column named"),
        ({"column": "x", "max_rows": 3}, "float column"),
        ({"column": "user", "max_rows": 0}, "greater than or equal to 1"),
    ],
)
def test_bad_declarations_are_refused(unit: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        DatasetSchema.model_validate({"columns": COLUMNS, "neighboring": "add_remove", "privacy_unit": unit})


def test_the_unit_column_is_not_a_measure_and_means_need_a_noisy_count() -> None:
    context = ctx()
    with pytest.raises(ParamsError, match="identifies the privacy unit"):
        check_query(query({"kind": "sum", "column": "user"}, []), context)
    with pytest.raises(ParamsError, match="release sum and count separately"):
        check_query(query({"kind": "mean", "column": "x"}, []), ctx("replace_one"))
    params = MeasuresLaplaceParams.model_validate(
        {"measures": [{"kind": "sum", "column": "user"}], "epsilon": 1.0}
    )
    with pytest.raises(ParamsError, match="identifies the privacy unit"):
        laplace_plans(params, context)


def test_gaussian_release_plan_uses_the_unit_sensitivity() -> None:
    q = GaussianParams.model_validate({"query": {"kind": "count"}, "sigma": 8.0})
    plan = gaussian_plan(q, ctx())[0]
    assert plan.l2_units == K


@pytest.mark.parametrize("neighboring", ["add_remove", "replace_one"])
def test_duckdb_bounds_units_exactly_as_numpy(neighboring: str, tmp_path: Path) -> None:
    """The engine path keeps the same rows per unit: every plan's integers equal the NumPy reference's."""
    from tests.engine_support import engine_table

    context = ctx(neighboring)
    for seed in range(3):
        a, b = neighbours(seed, 10 * K, neighboring)
        for rows in (a, b):
            columns = table(rows)
            scanned = engine_table(
                columns, context.schema, tmp_path, extra={ORDER_COLUMN: columns[ORDER_COLUMN]}
            )
            for raw in QUERIES:
                for where in WHERES:
                    q = query(raw, where)
                    plan = laplace_plan(q, context, 0.5)[0]
                    expected, _ = evaluate_units(q, context, columns, plan)
                    got, _ = evaluate_units(q, context, scanned, plan)
                    assert np.array_equal(expected, got), (raw, where)
            params = MeasuresLaplaceParams.model_validate(
                {"measures": MEASURES[1], "group_by": ["g"], "epsilon": 1.0}
            )
            plans = [plan for plan, _ in laplace_plans(params, context)]
            for x, y in zip(
                evaluate_blocks(params, context, columns, plans)[0],
                evaluate_blocks(params, context, scanned, plans)[0],
                strict=True,
            ):
                assert np.array_equal(x, y)


# ----- regressions from the adversarial review -----------------------------------------------------------
def test_identifiers_outside_their_bounds_are_refused_not_clipped(tmp_path: Path) -> None:
    """Clipping two identifiers to one bound would merge two people into one unit (a neighbour step would
    then move 2k rows): ingestion refuses them instead."""
    from mechanisms.data.table import TableError
    from service.data.ingest import csv_to_parquet

    schema = ctx().schema.model_copy(
        update={
            "columns": (ctx().schema.columns[0].model_copy(update={"max": 100}), *ctx().schema.columns[1:])
        }
    )
    source = tmp_path / "events.csv"
    source.write_text("user,x,n,g\n5,1.0,1,a\n500,1.0,1,a\n600,2.0,1,b\n")
    with pytest.raises(TableError, match="identifies the privacy unit"):
        csv_to_parquet(source, schema, tmp_path / "work")


def test_a_unit_histogram_on_a_coarse_grid_is_refused() -> None:
    """k rows may move k bins, each rounded on a grid γ > 1: refused instead of under-charged."""
    from mechanisms.catalog import MECHANISMS

    histogram = query({"kind": "histogram", "column": "n"}, [])
    with pytest.raises(ParamsError, match="unit grid"):
        laplace_plan(histogram, ctx(k=1000), 1e-9)
    mechanism = MECHANISMS["accuracy_first.laplace"]
    params = mechanism.params_model.model_validate(
        {
            "query": {"kind": "histogram", "column": "n"},
            "epsilons": [1e-9, 1e-3, 1.0],
            "target": {"relative": 0.5},
        }
    )
    with pytest.raises(ParamsError, match="unit grid"):
        mechanism.check(params, ctx(k=1000))


def test_degenerate_quantile_ranges_are_refused_or_served_alike(tmp_path: Path) -> None:
    """A range too narrow for the candidates is refused before any reservation; a constant column is
    answered alike by NumPy and the engine."""
    from mechanisms.noise import Noise
    from mechanisms.queries.quantile import Quantile
    from tests.engine_support import engine_table

    narrow = DatasetSchema.model_validate(
        {"columns": [{"name": "x", "type": "float", "min": 0.0, "max": 5e-324}], "neighboring": "add_remove"}
    )
    params = QuantileParams.model_validate({"column": "x", "quantiles": [0.5], "epsilon": 1.0})
    with pytest.raises(ParamsError, match="too narrow"):
        Quantile().check(params, PublicContext(narrow, None, DEFAULT_ORDERS))
    constant = DatasetSchema.model_validate(
        {"columns": [{"name": "x", "type": "float", "min": 2.0, "max": 2.0}], "neighboring": "add_remove"}
    )
    context = PublicContext(constant, None, DEFAULT_ORDERS)
    columns = {"x": np.full(10, 2.0)}
    answers = [
        Quantile().run(params, context, data, Noise.seeded(1)).output["values"]
        for data in (columns, engine_table(columns, constant, tmp_path))
    ]
    assert answers[0] == answers[1] == {"0.5": 2.0}
