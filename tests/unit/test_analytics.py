"""Quantiles (report-noisy-max) and grouped measures: sensitivity on adversarial neighbours, charges,
public-domain outputs and refusals.

The sensitivity tests compute the released statistic itself (the quantile scores; the grid units of every
block) on a dataset and on a neighbour and check that it moves by at most what the charge assumes: the
score by ≤ 1 at every candidate, the blocks by ≤ their grid ℓ1 and ℓ2 sensitivities. Neighbours are both
hand-picked adversarial ones (extreme values, a row moving between cells, leaving the selection) and random
ones (hypothesis).
"""

from __future__ import annotations

import math
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from mechanisms.accounting import DEFAULT_ORDERS, RdpCurve
from mechanisms.base import ParamsError, PublicContext
from mechanisms.catalog import MECHANISMS
from mechanisms.data.schema import DatasetSchema
from mechanisms.noise import Noise
from mechanisms.queries.measures import (
    MeasuresGaussian,
    MeasuresGaussianParams,
    MeasuresLaplace,
    MeasuresLaplaceParams,
    evaluate_blocks,
    gaussian_plans,
    laplace_plans,
)
from mechanisms.queries.quantile import (
    Quantile,
    QuantileParams,
    candidate_grid,
    noisy_max_select,
    rank_counts,
    scores,
    selected_rank_counts,
    selection_keys,
)
from tests.engine_support import engine_table

COLUMNS: list[dict[str, Any]] = [
    {"name": "x", "type": "float", "min": -0.1, "max": 0.3},
    {"name": "k", "type": "int", "min": -3, "max": 7},
    {"name": "g", "type": "categorical", "values": ["a", "b", "c"]},
    {"name": "h", "type": "categorical", "values": ["u", "v"]},
]
X_LOW, X_HIGH, K_LOW, K_HIGH = -0.1, 0.3, -3, 7


def ctx(neighboring: str = "replace_one", n_rows: int = 12) -> PublicContext:
    schema = DatasetSchema.model_validate({"columns": COLUMNS, "neighboring": neighboring})
    return PublicContext(schema, n_rows if neighboring == "replace_one" else None, DEFAULT_ORDERS)


Row = tuple[float, int, int, int]


def table(rows: list[Row]) -> dict[str, np.ndarray]:
    return {
        "x": np.array([r[0] for r in rows], dtype=np.float64),
        "k": np.array([r[1] for r in rows], dtype=np.int64),
        "g": np.array([r[2] for r in rows], dtype=np.int64),
        "h": np.array([r[3] for r in rows], dtype=np.int64),
    }


rows_strategy = st.tuples(
    st.floats(X_LOW, X_HIGH, allow_nan=False),
    st.integers(K_LOW, K_HIGH),
    st.integers(0, 2),
    st.integers(0, 1),
)
datasets = st.lists(rows_strategy, min_size=1, max_size=12)

EXTREMES: list[Row] = [(X_LOW, K_LOW, 0, 0), (X_HIGH, K_HIGH, 2, 1), (0.0, 0, 1, 0), (X_HIGH, K_LOW, 0, 1)]
ADVERSARIAL: list[tuple[list[Row], list[Row]]] = [
    # a row jumps from the bottom to the top of both numeric ranges and changes cell
    (
        [(X_LOW, K_LOW, 0, 0)] * 6 + [(X_HIGH, K_HIGH, 1, 1)] * 6,
        [(X_HIGH, K_HIGH, 2, 1)] + [(X_LOW, K_LOW, 0, 0)] * 5 + [(X_HIGH, K_HIGH, 1, 1)] * 6,
    ),
    # same cell, value from min to max
    ([(X_LOW, K_LOW, 0, 0)] * 12, [(X_HIGH, K_HIGH, 0, 0)] + [(X_LOW, K_LOW, 0, 0)] * 11),
    # the row leaves the selection (k ≥ 0) and lands in another cell
    ([(X_HIGH, K_HIGH, 1, 0)] * 12, [(X_LOW, K_LOW, 2, 1)] + [(X_HIGH, K_HIGH, 1, 0)] * 11),
]
WHERES: list[list[dict[str, Any]]] = [[], [{"column": "k", "op": "ge", "value": 0}]]


def replace_one_neighbours(rows: list[Row]) -> list[list[Row]]:
    """Every neighbour replacing one row by an extreme row."""
    return [[*rows[:i], new, *rows[i + 1 :]] for i in range(len(rows)) for new in EXTREMES]


# ----- quantile: the score moves by at most 1 ----------------------------------------------------------
def score_vector(
    rows: list[Row], column: str, q: float, where: list[dict[str, Any]], folder: Path | None = None
) -> np.ndarray:
    context = ctx("add_remove")
    params = QuantileParams.model_validate(
        {"column": column, "quantiles": [q], "epsilon": 1.0, "candidates": 64, "where": where}
    )
    data = table(rows) if folder is None else engine_table(table(rows), context.schema, folder)
    _candidates, counts, selected = selected_rank_counts(params, context, data)
    values, index = scores(counts, selected, q)
    return np.array([float(values[i]) for i in index])


def assert_score_moves_by_at_most_one(a: list[Row], b: list[Row], folder: Path | None = None) -> None:
    for column in ("x", "k"):
        for q in (0.0, 0.1, 0.5, 0.9, 1.0):
            for where in WHERES:
                moved = np.abs(
                    score_vector(a, column, q, where, folder) - score_vector(b, column, q, where, folder)
                )
                assert moved.max() <= 1.0 + 1e-12, (column, q, where, moved.max())


@pytest.mark.parametrize("engine", ["numpy", "duckdb"])
@pytest.mark.parametrize(("a", "b"), ADVERSARIAL)
def test_quantile_score_sensitivity_adversarial(
    a: list[Row], b: list[Row], engine: str, tmp_path: Path
) -> None:
    folder = tmp_path if engine == "duckdb" else None
    assert_score_moves_by_at_most_one(a, b, folder)
    assert_score_moves_by_at_most_one(a, a[1:], folder)  # add/remove: one row fewer
    assert_score_moves_by_at_most_one(a, [*a, (X_HIGH, K_HIGH, 2, 1)], folder)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=datasets, new=rows_strategy, at=st.integers(0, 11))
def test_quantile_score_sensitivity_random(rows: list[Row], new: Row, at: int) -> None:
    i = at % len(rows)
    assert_score_moves_by_at_most_one(rows, [*rows[:i], new, *rows[i + 1 :]])
    assert_score_moves_by_at_most_one(rows, [*rows, new])


def test_candidate_grids_are_public_sorted_and_within_bounds() -> None:
    context = ctx()
    x, k = context.schema.column("x"), context.schema.column("k")
    grid = candidate_grid(x, 100)  # type: ignore[arg-type]
    assert grid[0] == X_LOW
    assert grid[-1] == X_HIGH
    assert np.all(np.diff(grid) > 0)
    assert candidate_grid(k, 100).tolist() == list(range(K_LOW, K_HIGH + 1))  # type: ignore[arg-type]
    assert candidate_grid(k, 3).tolist() == [-3, 2, 7]  # type: ignore[arg-type]


def noisy_max_law(score_values: list[float], rate: float) -> np.ndarray:
    """The exact law of argmax_j (G_j − s_j) (ties to the lowest index), G_j i.i.d. P(G ≥ m) = e^{−rate·m},
    by summing over G_c (truncated where e^{−rate·g} < 1e-30)."""
    s = np.asarray(score_values, dtype=float)
    g = np.arange(int(70 / rate) + int(s.max()) + 2)
    out = np.zeros(s.size)
    for c in range(s.size):
        prob = (1 - math.exp(-rate)) * np.exp(-rate * g)
        for j in range(s.size):
            if j != c:  # P(G_j − s_j < value) before c, ≤ after c: G_j ≤ bound
                x = g - s[c] + s[j]
                bound = np.ceil(x - 1e-9) - 1 if j < c else np.floor(x + 1e-9)
                prob = prob * np.where(bound >= 0, 1 - np.exp(-rate * (bound + 1)), 0.0)
        out[c] = prob.sum()
    return out


@pytest.mark.parametrize(
    ("counts", "n", "q"),
    [
        ([0, 1, 3, 3, 4, 6], 6, 0.5),  # q·n = 3: ties between equal scores, f = 0
        ([0, 1, 2, 2, 3, 5], 5, 0.5),  # q·n = 2.5: f = ½, scores 0.5 on both sides tie
        ([0, 2, 2, 4, 5, 6], 6, 0.3),  # f ∈ (0, ½)
        ([0, 2, 2, 4, 5, 6], 6, 0.9),  # f ∈ (½, 1)
    ],
)
def test_noisy_max_select_matches_the_exact_law(counts: list[int], n: int, q: float) -> None:
    rate = Fraction(3, 4)
    counts_array = np.array(counts, dtype=np.int64)
    draws = noisy_max_select(Noise.seeded(7), counts_array, n, q, rate, 100_000)
    values, index = scores(counts_array, n, q)
    expected = noisy_max_law([float(values[i]) for i in index], float(rate))
    assert expected.sum() == pytest.approx(1.0, abs=1e-9)
    observed = np.bincount(draws, minlength=len(counts)) / draws.size
    assert np.all(np.abs(observed - expected) < 5 * np.sqrt(expected * (1 - expected) / draws.size) + 1e-9)


LEVELS = [0.0, 5e-324, 0.1, 0.25, 1 / 3, 0.5, 0.6, 0.75, 0.9, 1.0]


@settings(max_examples=300, deadline=None)
@given(
    n=st.integers(0, 40),
    q=st.sampled_from(LEVELS),
    counts=st.lists(st.integers(0, 40), min_size=1, max_size=12),
    draws=st.lists(st.integers(0, 60), min_size=12, max_size=12),
)
def test_selection_keys_order_the_values_exactly(
    n: int, q: float, counts: list[int], draws: list[int]
) -> None:
    """key_i < key_j ⇔ G_i − s_i < G_j − s_j and key_i = key_j ⇔ equal values, in exact rationals."""
    k = np.minimum(np.array(counts, dtype=np.int64), n)
    g = np.array(draws[: k.size], dtype=np.int64)
    keys = selection_keys(k, n, q, g).tolist()
    exact = [g_i - abs(k_i - Fraction(q) * n) for g_i, k_i in zip(g.tolist(), k.tolist(), strict=True)]
    for i in range(k.size):
        for j in range(k.size):
            assert (keys[i] < keys[j]) == (exact[i] < exact[j])
            assert (keys[i] == keys[j]) == (exact[i] == exact[j])


def test_quantile_selection_work_does_not_depend_on_the_data() -> None:
    """The same seed gives the same number of random words consumed on very different datasets."""
    grid = np.arange(64)
    used = []
    for data in (
        np.zeros(50, dtype=np.int64),
        np.arange(50, dtype=np.int64),
        np.full(50, 63, dtype=np.int64),
    ):
        noise = Noise.seeded(11)
        noisy_max_select(noise, rank_counts(data, grid), 50, 0.5, Fraction(1, 4))
        used.append(noise.words(1)[0])  # the next word: equal iff the same number of words was consumed
    assert used[0] == used[1] == used[2]


def test_quantile_charge_and_release() -> None:
    params = QuantileParams(column="x", quantiles=(0.25, 0.5, 0.75), epsilon=0.9, candidates=64)
    mechanism = Quantile()
    mechanism.check(params, ctx())
    worst = mechanism.worst_case(params, ctx())
    assert worst.pure == 0.9
    assert worst <= RdpCurve.from_pure(0.9, DEFAULT_ORDERS)
    rows = [(X_LOW + 0.4 * i / 11, 0, 0, 0) for i in range(12)]
    release = mechanism.run(params, ctx(), table(rows), Noise.seeded(1))
    assert release.realized == worst
    grid = candidate_grid(ctx().schema.column("x"), 64).tolist()  # type: ignore[arg-type]
    assert set(release.output["values"]) == {"0.25", "0.5", "0.75"}
    assert all(v in grid for v in release.output["values"].values())  # only public candidates


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"column": "g", "quantiles": [0.5], "epsilon": 1.0}, "column"),
        ({"column": "nope", "quantiles": [0.5], "epsilon": 1.0}, "column"),
        (
            {
                "column": "x",
                "quantiles": [0.5],
                "epsilon": 1.0,
                "where": [{"column": "g", "op": "lt", "value": 1}],
            },
            "where.0.op",
        ),
    ],
)
def test_quantile_refuses_unboundable(params: dict[str, Any], field: str) -> None:
    with pytest.raises(ParamsError) as refused:
        Quantile().check(QuantileParams.model_validate(params), ctx())
    assert refused.value.field == field


def test_quantile_params_validation() -> None:
    for bad in ({"quantiles": [1.5]}, {"quantiles": []}, {"quantiles": [0.5, 0.5]}, {"candidates": 1}):
        with pytest.raises(ValidationError):
            QuantileParams.model_validate({"column": "x", "quantiles": [0.5], "epsilon": 1.0, **bad})


# ----- measures: every block moves by at most its grid sensitivity -------------------------------------
MEASURE_SETS: list[list[dict[str, Any]]] = [
    [{"kind": "count"}, {"kind": "sum", "column": "x"}, {"kind": "sum", "column": "k"}],
    [{"kind": "mean", "column": "x"}, {"kind": "variance", "column": "k"}, {"kind": "std", "column": "x"}],
]
GROUPINGS: list[list[str]] = [[], ["g"], ["g", "h"]]


def _plans(params: MeasuresLaplaceParams | MeasuresGaussianParams, context: PublicContext) -> list[Any]:
    if isinstance(params, MeasuresLaplaceParams):
        return [plan for plan, _ in laplace_plans(params, context)]
    return [entry[0] for entry in gaussian_plans(params, context)]


def assert_blocks_within_sensitivity(
    a: list[Row], b: list[Row], neighboring: str, folder: Path | None = None
) -> None:
    """Every block of every measure set moves by at most its grid sensitivity; with ``folder`` the tables
    are DuckDB-scanned Parquet snapshots there (the engine path), else NumPy columns."""
    n = len(a) if neighboring == "replace_one" else None
    context = ctx(neighboring, n or 12)
    table_a, table_b = (
        (table(a), table(b))
        if folder is None
        else (engine_table(table(a), context.schema, folder), engine_table(table(b), context.schema, folder))
    )
    for measures in MEASURE_SETS:
        for group_by in GROUPINGS:
            for where in WHERES:
                base = {"measures": measures, "group_by": group_by, "where": where}
                for params in (
                    MeasuresLaplaceParams.model_validate({**base, "epsilon": 0.7}),
                    MeasuresGaussianParams.model_validate({**base, "noise_multiplier": 3.0}),
                ):
                    plans = _plans(params, context)
                    units_a, _ = evaluate_blocks(params, context, table_a, plans)
                    units_b, _ = evaluate_blocks(params, context, table_b, plans)
                    for plan, ua, ub in zip(plans, units_a, units_b, strict=True):
                        moved = np.abs(ua.astype(np.int64) - ub.astype(np.int64))
                        label = (plan.block.label, group_by, where, neighboring)
                        assert int(moved.sum()) <= plan.l1_units, label
                        assert math.sqrt(float((moved.astype(float) ** 2).sum())) <= plan.l2_units, label


@pytest.mark.parametrize("engine", ["numpy", "duckdb"])
@pytest.mark.parametrize(("a", "b"), ADVERSARIAL)
def test_measures_sensitivity_adversarial(a: list[Row], b: list[Row], engine: str, tmp_path: Path) -> None:
    folder = tmp_path if engine == "duckdb" else None
    assert_blocks_within_sensitivity(a, b, "replace_one", folder)
    assert_blocks_within_sensitivity(a, a[1:], "add_remove", folder)
    assert_blocks_within_sensitivity(a, [*a, (X_HIGH, K_HIGH, 2, 1)], "add_remove", folder)


def test_measures_sensitivity_is_attained() -> None:
    """The grouped count's ℓ1 of 2 (a row moving between cells) is tight: not an over-charge by accident."""
    a, b = ADVERSARIAL[0]
    params = MeasuresLaplaceParams.model_validate(
        {"measures": [{"kind": "count"}], "group_by": ["g"], "epsilon": 1.0}
    )
    plans = _plans(params, ctx())
    ua, ub = (evaluate_blocks(params, ctx(), table(t), plans)[0][0] for t in (a, b))
    assert int(np.abs(ua - ub).sum()) == plans[0].l1_units == 2


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.lists(rows_strategy, min_size=12, max_size=12), new=rows_strategy, at=st.integers(0, 11))
def test_measures_sensitivity_random(rows: list[Row], new: Row, at: int) -> None:
    assert_blocks_within_sensitivity(rows, [*rows[:at], new, *rows[at + 1 :]], "replace_one")
    assert_blocks_within_sensitivity(rows, rows[:at] + rows[at + 1 :], "add_remove")


def test_measures_laplace_charge_composes_to_epsilon() -> None:
    params = MeasuresLaplaceParams.model_validate(
        {"measures": MEASURE_SETS[1], "group_by": ["g"], "epsilon": 0.6}
    )
    planned = laplace_plans(params, ctx())
    total = sum((Fraction(plan.l1_units) / t for plan, t in planned if t is not None), Fraction(0))
    assert total <= Fraction(0.6)
    worst = MeasuresLaplace().worst_case(params, ctx())
    assert worst.pure == 0.6
    assert worst <= RdpCurve.from_pure(0.6, DEFAULT_ORDERS)


def test_measures_gaussian_charge_is_alpha_blocks_over_2z2() -> None:
    params = MeasuresGaussianParams.model_validate(
        {"measures": MEASURE_SETS[1], "group_by": ["g", "h"], "noise_multiplier": 2.0}
    )
    worst = MeasuresGaussian().worst_case(params, ctx())
    noisy = sum(1 for entry in gaussian_plans(params, ctx()) if entry[1] is not None)
    assert noisy == 5  # count, csum(x), csumsq(x), csum(k), csumsq(k)
    for alpha, value in zip(worst.orders, worst.values, strict=True):
        assert value == pytest.approx(alpha * noisy / (2 * 4.0), rel=1e-9)
        assert value >= alpha * noisy / (2 * 4.0)


def test_public_count_is_released_exactly_and_free() -> None:
    """replace-one, no where, no group-by: the count is the public n (it cannot move), so it costs nothing."""
    params = MeasuresLaplaceParams.model_validate({"measures": [{"kind": "count"}], "epsilon": 1.0})
    rows = [EXTREMES[0]] * 12
    release = MeasuresLaplace().run(params, ctx(), table(rows), Noise.seeded(3))
    assert release.output["values"]["count"] == 12.0


def test_groups_are_the_declared_domain_even_when_empty() -> None:
    params = MeasuresLaplaceParams.model_validate(
        {
            "measures": [{"kind": "count"}, {"kind": "mean", "column": "x"}],
            "group_by": ["g", "h"],
            "epsilon": 1.0,
        }
    )
    rows = [(0.1, 0, 0, 0)] * 12  # a single non-empty cell
    release = MeasuresLaplace().run(params, ctx(), table(rows), Noise.seeded(4))
    keys = [tuple(group["key"].values()) for group in release.output["groups"]]
    assert keys == [(g, h) for g in "abc" for h in "uv"]
    for group in release.output["groups"]:
        assert X_LOW <= group["mean(x)"] <= X_HIGH  # clamped post-processing, even for empty cells


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"measures": [{"kind": "mean", "column": "g"}]}, "measures.0.column"),
        ({"measures": [{"kind": "count"}], "group_by": ["x"]}, "group_by.0"),
        ({"measures": [{"kind": "count"}], "group_by": ["zz"]}, "group_by.0"),
    ],
)
def test_measures_refuse_unboundable(params: dict[str, Any], field: str) -> None:
    with pytest.raises(ParamsError) as refused:
        MeasuresLaplace().check(MeasuresLaplaceParams.model_validate({**params, "epsilon": 1.0}), ctx())
    assert refused.value.field == field


def test_measure_model_validation() -> None:
    for bad in (
        [{"kind": "count", "column": "x"}],
        [{"kind": "sum"}],
        [{"kind": "count"}, {"kind": "count"}],
    ):
        with pytest.raises(ValidationError):
            MeasuresLaplaceParams.model_validate({"measures": bad, "epsilon": 1.0})


def test_registered_in_the_catalog() -> None:
    assert isinstance(MECHANISMS["quantile"], Quantile)
    assert isinstance(MECHANISMS["measures.laplace"], MeasuresLaplace)
    assert isinstance(MECHANISMS["measures.gaussian"], MeasuresGaussian)


# ----- the SQL front: every statement is a translation onto the query model or a 422 naming a clause -------
SQL_FRAGMENTS = (
    "SELECT | COUNT(*) | SUM(x) | AVG(k) | STDDEV(x) | MEDIAN(x) | QUANTILE(x, 'a') | "
    "QUANTILE(x, 0.3) | PERCENTILE_CONT(0.5) WITHIN GROUP (ORDER BY x) | MAX(x) | x | g | * | , | "
    "FROM | dataset | ds | other | AS | t | WHERE | x > 1 | k = -2 | g = 'a' | g IN ('a', 'b') | "
    "x BETWEEN 0 AND 1 | BETWEEN SYMMETRIC | AND | OR | NOT | GROUP BY | ROLLUP(g) | ALL | "
    "WITH ROLLUP | HAVING | ORDER BY | LIMIT 1 | DISTINCT | ( | ) | SELECT 1 | ; | -- | /* | */ | "
    "CASE WHEN x > 0 THEN 1e9 END | x * 1000 | 1e999 | 1e-400 | TABLESAMPLE (5 PERCENT) | INTO t | "
    "FOR UPDATE | UNION | JOIN | ON | OVER () | FILTER (WHERE x > 0) | COUNT(DISTINCT g) | ::int | "
    "? | $1 | NULL | TRUE"
).split(" | ")
TRANSLATED_KEYS = {
    "quantile": {"column", "quantiles", "epsilon", "where"},
    "measures.laplace": {"measures", "group_by", "where", "epsilon"},
}


def _check_translation(statement: str) -> None:
    from service.api.routers.sql import SqlIn, translate
    from service.errors import InvalidInput

    refused: InvalidInput | None = None
    try:
        translation = translate(statement, "ds", SqlIn(sql=statement, epsilon=1.0))
    except InvalidInput as error:  # anything else (a 500) fails the test
        refused = error
    if refused is not None:
        assert refused.extensions["errors"][0]["field"].startswith("sql."), (statement, refused.detail)
        return
    # only column names, literals, the measures' kinds and the body's ε reach a mechanism: nothing a
    # mechanism could read as a bound or a sensitivity
    assert set(translation.params) == TRANSLATED_KEYS[translation.mechanism], (statement, translation)
    assert translation.params["epsilon"] == 1.0
    for condition in translation.params["where"]:
        assert set(condition) == {"column", "op", "value"}
    for measure in translation.params.get("measures", []):
        assert set(measure) <= {"kind", "column"}


NASTY_SQL = [
    "SELECT COUNT(*) FROM dataset GROUP BY ROLLUP(g)",
    "SELECT COUNT(*) FROM dataset GROUP BY g WITH ROLLUP",
    "SELECT COUNT(*) FROM dataset GROUP BY ALL",
    "SELECT COUNT(*) FROM dataset GROUP BY GROUPING SETS ((g), ())",
    "SELECT COUNT(*) FROM dataset TABLESAMPLE (10 PERCENT)",
    "SELECT COUNT(*) INTO t2 FROM dataset FOR UPDATE",
    "SELECT SUM(x) FROM dataset CLUSTER BY g",
    "SELECT SUM(x) FROM dataset DISTRIBUTE BY g SORT BY g",
    "SELECT SUM(x) FROM dataset CONNECT BY PRIOR x = k",
    "SELECT QUANTILE(x, 'abc') FROM dataset",
    "SELECT PERCENTILE_CONT('a') WITHIN GROUP (ORDER BY x) FROM dataset",
    "SELECT SUM(x) FROM dataset WHERE x BETWEEN SYMMETRIC 5 AND 1",
    "SELECT SUM(x) FROM dataset WHERE x = 1e-400",
    "SELECT SUM(CASE WHEN x > 0 THEN 1e9 ELSE 0 END) FROM dataset",
    "SELECT AVG(x) OVER () FROM dataset",
    "SELECT MEDIAN(x) FILTER (WHERE k > 0) FROM dataset",
    "SELECT SUM(x) FROM dataset, other",
    "SELECT SUM(x) FROM dataset UNION SELECT SUM(x) FROM dataset",
    "SELECT COUNT(DISTINCT g, k) FROM dataset",  # COUNT(DISTINCT unit) takes one column
    "SELECT COUNT(DISTINCT (g)) FROM dataset",
    "SELECT SUM(x) FROM dataset WHERE x > ALL (",  # sqlglot's parser raised AttributeError (a 500)
    "SELECT SUM(x::int) FROM dataset",
    "SELECT SUM(x) FROM dataset WHERE x = $1",
]


@pytest.mark.parametrize("statement", NASTY_SQL)
def test_sql_nasty_statements_are_refused_naming_a_clause(statement: str) -> None:
    from service.api.routers.sql import SqlIn, translate
    from service.errors import InvalidInput

    with pytest.raises(InvalidInput) as refused:
        translate(statement, "ds", SqlIn(sql=statement, epsilon=1.0))
    assert refused.value.extensions["errors"][0]["field"].startswith("sql."), refused.value.detail


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(SQL_FRAGMENTS), min_size=1, max_size=14))
def test_sql_fuzz_translates_or_refuses(fragments: list[str]) -> None:
    _check_translation(" ".join(fragments))
    _check_translation("SELECT " + " ".join(fragments))
    _check_translation("SELECT SUM(x) FROM dataset " + " ".join(fragments))
