"""The query language: validation against the schema, sensitivities from public bounds, true values."""

from __future__ import annotations

import math
from collections.abc import Callable
from fractions import Fraction
from typing import Any

import numpy as np
import pytest
from pydantic import TypeAdapter, ValidationError

from mechanisms.accounting import DEFAULT_ORDERS
from mechanisms.base import ParamsError, PublicContext
from mechanisms.data.schema import DatasetSchema, FloatColumn
from mechanisms.data.table import LoadedTable
from mechanisms.queries.language import (
    MEAN_REFUSAL,
    AnyQuery,
    CountQuery,
    HistogramQuery,
    Query,
    check_query,
    evaluate,
    l1,
    l2,
    shifts,
)

QUERY = TypeAdapter(Query)
MakeCtx = Callable[..., PublicContext]


def q(**fields: Any) -> AnyQuery:
    return QUERY.validate_python(fields)


def where(*conditions: tuple[str, str, Any]) -> list[dict[str, Any]]:
    return [{"column": c, "op": op, "value": v} for c, op, v in conditions]


def ctx_for(columns: list[dict[str, Any]], neighboring: str, n_rows: int = 4) -> PublicContext:
    schema = DatasetSchema.model_validate({"columns": columns, "neighboring": neighboring})
    return PublicContext(schema, n_rows if neighboring == "replace_one" else None, DEFAULT_ORDERS)


def x_column(low: float, high: float) -> list[dict[str, Any]]:
    return [
        {"name": "x", "type": "float", "min": low, "max": high},
        {"name": "k", "type": "int", "min": 0, "max": 1},
    ]


# ----- parsing -----------------------------------------------------------------------------------------
def test_parses_each_kind() -> None:
    assert isinstance(q(kind="count"), CountQuery)
    hist = q(kind="histogram", column="group", where=where(("age", "in", [1, 2.5])))
    assert isinstance(hist, HistogramQuery)
    assert hist.where[0].values == (1, 2.5)
    assert {type(q(kind=k, column="age")).__name__ for k in ("sum", "mean")} == {"SumQuery", "MeanQuery"}


@pytest.mark.parametrize(
    "fields",
    [
        {"kind": "median", "column": "age"},
        {"kind": "count", "column": "age"},
        {"kind": "sum"},
        {"kind": "count", "where": where(("age", "in", 3))},
        {"kind": "count", "where": where(("age", "in", []))},
        {"kind": "count", "where": where(("age", "eq", [3]))},
        {"kind": "count", "where": where(("age", "like", 3))},
        {"kind": "count", "where": where(("age", "eq", True))},
        {"kind": "count", "where": where(("age", "eq", float("nan")))},
        {"kind": "count", "where": where(("age", "eq", None))},
        {"kind": "count", "where": [{"column": "age", "op": "eq", "value": 1, "or": True}]},
        {"kind": "count", "where": where(*[("age", "gt", i) for i in range(21)])},
    ],
)
def test_rejects_malformed_queries(fields: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        QUERY.validate_python(fields)


def test_twenty_conditions_are_allowed() -> None:
    assert len(q(kind="count", where=where(*[("age", "gt", i) for i in range(20)])).where) == 20


# ----- check_query -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("fields", "field", "reason"),
    [
        ({"kind": "sum", "column": "zip"}, "query.column", "unknown column 'zip'"),
        ({"kind": "sum", "column": "group"}, "query.column", "categorical"),
        (
            {"kind": "histogram", "column": "age"},
            "query.bins",
            "needs bins",
        ),  # float: equal-width bins (issue 35 item 9)
        ({"kind": "count", "where": where(("zip", "eq", 1))}, "query.where.0.column", "unknown column"),
        (
            {"kind": "count", "where": where(("age", "gt", 1), ("group", "lt", "b"))},
            "query.where.1.op",
            "categorical",
        ),
        (
            {"kind": "count", "where": where(("group", "eq", "z"))},
            "query.where.0.value",
            "'z' is not a declared",
        ),
        ({"kind": "count", "where": where(("group", "in", ["a", "y"]))}, "query.where.0.value", "'y'"),
        ({"kind": "count", "where": where(("group", "eq", 1))}, "query.where.0.value", "not a declared"),
        ({"kind": "count", "where": where(("age", "ge", "30"))}, "query.where.0.value", "numeric"),
        ({"kind": "count", "where": where(("n", "in", [1, "2"]))}, "query.where.0.value", "numeric"),
    ],
)
def test_check_query_errors(ctx: PublicContext, fields: dict[str, Any], field: str, reason: str) -> None:
    with pytest.raises(ParamsError) as caught:
        check_query(q(**fields), ctx)
    assert caught.value.field == field
    assert reason in caught.value.reason


def test_mean_refused_under_add_remove(add_remove_ctx: PublicContext) -> None:
    with pytest.raises(ParamsError) as caught:
        check_query(q(kind="mean", column="age"), add_remove_ctx)
    assert (caught.value.field, caught.value.reason) == ("query.kind", MEAN_REFUSAL)


def test_mean_refused_with_where(replace_ctx: PublicContext) -> None:
    with pytest.raises(ParamsError, match="public selection size") as caught:
        check_query(q(kind="mean", column="age", where=where(("n", "gt", 2))), replace_ctx)
    assert caught.value.field == "query.kind"


def test_mean_refused_without_public_row_count(replace_ctx: PublicContext) -> None:
    hidden = PublicContext(replace_ctx.schema, None, replace_ctx.orders)
    with pytest.raises(ParamsError, match="public selection size"):
        check_query(q(kind="mean", column="age"), hidden)
    with pytest.raises(ParamsError, match="public selection size"):
        shifts(q(kind="mean", column="age"), hidden)


def test_histogram_bin_limit() -> None:
    wide = ctx_for([{"name": "k", "type": "int", "min": 0, "max": 10_000}], "add_remove")
    with pytest.raises(ParamsError, match="more than 10000 integer bins"):
        check_query(q(kind="histogram", column="k"), wide)
    just_fits = ctx_for([{"name": "k", "type": "int", "min": 1, "max": 10_000}], "add_remove")
    check_query(q(kind="histogram", column="k"), just_fits)


@pytest.mark.parametrize(
    "fields",
    [
        {"kind": "count"},
        {"kind": "sum", "column": "age", "where": where(("group", "in", ["a", "c"]), ("n", "le", 4.5))},
        {"kind": "histogram", "column": "group"},
        {"kind": "histogram", "column": "n", "where": where(("group", "ne", "b"))},
    ],
)
def test_check_query_accepts(ctx: PublicContext, fields: dict[str, Any]) -> None:
    check_query(q(**fields), ctx)
    assert shifts(q(**fields), ctx)


def test_mean_accepted_under_replace_one(replace_ctx: PublicContext) -> None:
    check_query(q(kind="mean", column="n"), replace_ctx)
    assert shifts(q(kind="mean", column="n"), replace_ctx) == (2.0,)


# ----- sensitivities -----------------------------------------------------------------------------------
@pytest.mark.parametrize("neighboring", ["replace_one", "add_remove"])
def test_count_shift(make_ctx: MakeCtx, neighboring: str) -> None:
    ctx = make_ctx(neighboring)
    assert shifts(q(kind="count"), ctx) == (1.0,)
    assert shifts(q(kind="count", where=where(("age", "gt", 3))), ctx) == (1.0,)


@pytest.mark.parametrize(
    ("low", "high", "add_remove", "replace_one", "replace_one_where"),
    [
        (0.0, 100.0, 100.0, 100.0, 100.0),
        (10.0, 30.0, 30.0, 20.0, 30.0),
        (-5.0, 3.0, 5.0, 8.0, 8.0),
        (-30.0, -10.0, 30.0, 20.0, 30.0),
        (2.0, 2.0, 2.0, 0.0, 2.0),
    ],
)
def test_sum_shift(
    low: float, high: float, add_remove: float, replace_one: float, replace_one_where: float
) -> None:
    columns = x_column(low, high)
    selected = where(("k", "eq", 1))
    assert shifts(q(kind="sum", column="x"), ctx_for(columns, "add_remove")) == (add_remove,)
    assert shifts(q(kind="sum", column="x", where=selected), ctx_for(columns, "add_remove")) == (add_remove,)
    assert shifts(q(kind="sum", column="x"), ctx_for(columns, "replace_one")) == (replace_one,)
    assert shifts(q(kind="sum", column="x", where=selected), ctx_for(columns, "replace_one")) == (
        replace_one_where,
    )


def test_sum_shift_of_int_column(make_ctx: MakeCtx) -> None:
    assert shifts(q(kind="sum", column="n"), make_ctx("replace_one")) == (10.0,)
    assert shifts(q(kind="sum", column="n"), make_ctx("add_remove")) == (10.0,)


def test_mean_shift_divides_by_public_n(make_ctx: MakeCtx) -> None:
    assert shifts(q(kind="mean", column="age"), make_ctx("replace_one", n_rows=5)) == (20.0,)
    third = shifts(q(kind="mean", column="age"), make_ctx("replace_one", n_rows=3))[0]
    assert Fraction(third) >= Fraction(100, 3)
    assert Fraction(math.nextafter(third, 0.0)) < Fraction(100, 3)


def test_inexact_differences_round_up() -> None:
    (shift,) = shifts(q(kind="sum", column="x"), ctx_for(x_column(0.1, 0.3), "replace_one"))
    exact = Fraction(0.3) - Fraction(0.1)
    assert Fraction(shift) >= exact
    assert Fraction(math.nextafter(shift, 0.0)) < exact


@pytest.mark.parametrize(("neighboring", "expected"), [("add_remove", (1.0,)), ("replace_one", (1.0, 1.0))])
def test_histogram_shifts(make_ctx: MakeCtx, neighboring: str, expected: tuple[float, ...]) -> None:
    ctx = make_ctx(neighboring)
    assert shifts(q(kind="histogram", column="group"), ctx) == expected
    assert shifts(q(kind="histogram", column="n", where=where(("age", "lt", 50))), ctx) == expected


def test_overflowing_bounds_are_refused() -> None:
    # The schema refuses such bounds; a schema built without validation must still not yield inf noise.
    column = FloatColumn.model_construct(name="x", type="float", min=-1.7e308, max=1.7e308)
    schema = DatasetSchema.model_construct(columns=(column,), neighboring="replace_one")
    ctx = PublicContext(schema, 4, DEFAULT_ORDERS)
    assert shifts(q(kind="sum", column="x"), ctx) == (math.inf,)
    with pytest.raises(ParamsError, match="too wide") as caught:
        check_query(q(kind="sum", column="x"), ctx)
    assert caught.value.field == "query.column"


def test_l1_and_l2() -> None:
    assert l1((1.0, 1.0)) == 2.0
    assert l2((3.0, 4.0)) == 5.0
    assert l2((1.0,)) == 1.0
    root_two = l2((1.0, 1.0))
    assert Fraction(root_two) ** 2 >= 2
    assert Fraction(math.nextafter(root_two, 0.0)) ** 2 < 2
    assert l1((0.1, 0.2)) >= 0.3
    assert Fraction(l1((0.1, 0.2))) >= Fraction(0.1) + Fraction(0.2)


# ----- evaluation --------------------------------------------------------------------------------------
# Clipped rows: (age, n, group) = (20, 1, a), (35.5, 4, b), (100, 3, a), (0, 10, c), (60, 7, b).
@pytest.mark.parametrize(
    ("conditions", "expected"),
    [
        ([], 5),
        ([("age", "eq", 100)], 1),
        ([("age", "eq", 150)], 0),
        ([("age", "ne", 20)], 4),
        ([("age", "lt", 35.5)], 2),
        ([("age", "le", 35.5)], 3),
        ([("age", "gt", 60)], 1),
        ([("age", "ge", 60)], 2),
        ([("age", "in", [0, 60, 61])], 2),
        ([("n", "in", [1, 10, 5])], 2),
        ([("n", "lt", 3.5)], 2),
        ([("n", "eq", 10)], 1),
        ([("group", "eq", "a")], 2),
        ([("group", "ne", "a")], 3),
        ([("group", "in", ["a", "c"])], 3),
        ([("group", "eq", "b"), ("age", "gt", 40)], 1),
        ([("group", "in", ["a", "b"]), ("n", "ge", 3), ("age", "lt", 100)], 2),
    ],
)
def test_where_filters_count(
    replace_ctx: PublicContext, table: LoadedTable, conditions: list[tuple[str, str, Any]], expected: int
) -> None:
    values, labels = evaluate(q(kind="count", where=where(*conditions)), replace_ctx, table.columns)
    assert labels is None
    np.testing.assert_array_equal(values, [float(expected)])


def test_sum_and_mean(replace_ctx: PublicContext, table: LoadedTable) -> None:
    assert evaluate(q(kind="sum", column="age"), replace_ctx, table.columns)[0].tolist() == [215.5]
    filtered = q(kind="sum", column="age", where=where(("group", "eq", "a")))
    assert evaluate(filtered, replace_ctx, table.columns)[0].tolist() == [120.0]
    assert evaluate(q(kind="sum", column="n"), replace_ctx, table.columns)[0].tolist() == [25.0]
    mean, labels = evaluate(q(kind="mean", column="age"), replace_ctx, table.columns)
    assert labels is None
    assert mean.tolist() == pytest.approx([43.1])


def test_categorical_histogram(ctx: PublicContext, table: LoadedTable) -> None:
    values, labels = evaluate(q(kind="histogram", column="group"), ctx, table.columns)
    assert labels == ["a", "b", "c"]
    assert values.tolist() == [2.0, 2.0, 1.0]
    filtered = q(kind="histogram", column="group", where=where(("age", "ge", 35.5)))
    assert evaluate(filtered, ctx, table.columns)[0].tolist() == [1.0, 2.0, 0.0]


def test_int_histogram(ctx: PublicContext, table: LoadedTable) -> None:
    values, labels = evaluate(q(kind="histogram", column="n"), ctx, table.columns)
    assert labels == [str(i) for i in range(11)]
    expected = np.zeros(11)
    expected[[1, 3, 4, 7, 10]] = 1.0
    np.testing.assert_array_equal(values, expected)


def test_int_histogram_with_negative_bounds() -> None:
    ctx = ctx_for([{"name": "t", "type": "int", "min": -2, "max": 1}], "add_remove")
    table = {"t": np.array([-2, 1, 1, 0], dtype=np.int64)}
    values, labels = evaluate(q(kind="histogram", column="t"), ctx, table)
    assert labels == ["-2", "-1", "0", "1"]
    assert values.tolist() == [1.0, 0.0, 1.0, 2.0]


def test_mean_refuses_a_table_of_the_wrong_size(make_ctx: MakeCtx, table: LoadedTable) -> None:
    with pytest.raises(ValueError, match="public row count"):
        evaluate(q(kind="mean", column="age"), make_ctx("replace_one", n_rows=6), table.columns)


# ----- confidence intervals of releases (mechanisms/queries/intervals.py) ---------------------------------
def _exact_abs_cdf(log_weight: Callable[[Any], Any], top: int) -> list[Any]:
    """P(|Z| ≤ k), k = 0..top, for P(z) ∝ exp(log_weight(|z|)), summed in 60-digit arithmetic (mpmath) over
    |z| ≤ 40·top (the rest of the mass is below 10^-60 for the parameters used here)."""
    import mpmath

    mpmath.mp.dps = 60
    weights = [mpmath.e ** log_weight(mpmath.mpf(z)) for z in range(40 * top + 40)]
    total = weights[0] + 2 * mpmath.fsum(weights[1:])
    out, running = [], weights[0]
    for k in range(top + 1):
        if k:
            running += 2 * weights[k]
        out.append(running / total)
    return out


LEVELS = (0.5, 0.8, 0.9, 0.95, 0.99, 0.999)


@pytest.mark.parametrize("scale", [Fraction(1, 3), Fraction(1), Fraction(7, 2), Fraction(25)])
def test_discrete_laplace_quantile_is_exact(scale: Fraction) -> None:
    from mechanisms.queries.intervals import discrete_laplace_quantile

    cdf = _exact_abs_cdf(lambda z: -z / (scale.numerator / scale.denominator), int(8 * scale) + 10)
    for level in LEVELS:
        q = discrete_laplace_quantile(scale, level)
        assert q.exact
        assert cdf[q.units] >= level  # coverage ≥ level ...
        assert q.units == 0 or cdf[q.units - 1] < level  # ... and one grid step less falls short


@pytest.mark.parametrize(
    "variance", [Fraction(1, 10), Fraction(1), Fraction(9), Fraction(1001, 8), Fraction(400)]
)
def test_discrete_gaussian_quantile_is_exact(variance: Fraction) -> None:
    from mechanisms.queries.intervals import discrete_gaussian_quantile

    v = variance.numerator / variance.denominator
    cdf = _exact_abs_cdf(lambda z: -z * z / (2 * v), int(5 * math.sqrt(v)) + 5)
    for level in LEVELS:
        q = discrete_gaussian_quantile(variance, level)
        assert q.exact
        assert cdf[q.units] >= level
        assert q.units == 0 or cdf[q.units - 1] < level


def test_discrete_gaussian_quantile_beyond_direct_summation() -> None:
    """s > 2^12 takes the Euler–Maclaurin path: compare with the pmf summed term by term (fsum, float64)."""
    from mechanisms.queries.intervals import DIRECT_LIMIT, discrete_gaussian_quantile

    variance = Fraction(5000**2)
    assert math.sqrt(variance) > DIRECT_LIMIT
    z = np.arange(0, 13 * 5000)
    weights = np.exp(-(z.astype(np.float64) ** 2) / (2.0 * 5000**2))
    total = weights[0] + 2 * math.fsum(weights[1:])
    for level in (0.5, 0.9, 0.95, 0.99):
        q = discrete_gaussian_quantile(variance, level)
        assert q.exact
        covered = (weights[0] + 2 * math.fsum(weights[1 : q.units + 1])) / total
        below = (weights[0] + 2 * math.fsum(weights[1 : q.units])) / total
        assert covered >= level > below


def test_quantiles_are_deterministic_and_refuse_bad_levels() -> None:
    from mechanisms.queries.intervals import discrete_gaussian_quantile, discrete_laplace_quantile

    assert discrete_laplace_quantile(Fraction(10), 0.95).units == 30  # ⌈t·ln(2/((1−L)(1+e^{−1/t})))⌉ − 1
    assert discrete_gaussian_quantile(Fraction(100), 0.95).units == 20
    for level in (0.0, 1.0, -0.5, 1.5):
        with pytest.raises(ValueError, match="confidence level"):
            discrete_laplace_quantile(Fraction(1), level)
        with pytest.raises(ValueError, match="confidence level"):
            discrete_gaussian_quantile(Fraction(1), level)
    # huge scales: always a valid (covering) bound, computed fast
    assert discrete_laplace_quantile(Fraction(1 << 40), 0.95).units > 0
    assert discrete_gaussian_quantile(Fraction(1 << 80), 0.95).units > 0


def _interval_schema() -> DatasetSchema:
    return DatasetSchema.model_validate(
        {
            "neighboring": "replace_one",
            "columns": [
                {"name": "x", "type": "float", "min": 0.0, "max": 10.0},
                {"name": "g", "type": "categorical", "values": ["a", "b", "c"]},
            ],
        }
    )


@pytest.mark.parametrize("mechanism", ["laplace", "gaussian"])
@pytest.mark.parametrize("kind", ["count", "sum", "mean", "histogram"])
def test_release_carries_the_interval(mechanism: str, kind: str) -> None:
    from mechanisms.catalog import MECHANISMS
    from mechanisms.noise import Noise

    schema = _interval_schema()
    rows = 50
    table = {"x": np.linspace(0.0, 10.0, rows), "g": np.arange(rows) % 3}
    ctx = PublicContext(schema=schema, orders=DEFAULT_ORDERS, n_rows=rows)
    query: dict[str, Any] = {"kind": kind}
    if kind in ("sum", "mean"):
        query["column"] = "x"
    if kind == "histogram":
        query["column"] = "g"
    cost = {"epsilon": 1.0} if mechanism == "laplace" else {"sigma": 2.0}
    model = MECHANISMS[mechanism]
    params = model.params_model.model_validate({"query": query, **cost, "confidence": 0.9})
    release = model.run(params, ctx, table, Noise.seeded(3))
    default = model.run(
        model.params_model.model_validate({"query": query, **cost}), ctx, table, Noise.seeded(3)
    )
    interval = release.output["interval"]
    assert set(interval) == {"level", "half_width", "lower", "upper"}
    assert interval["level"] == 0.9
    assert default.output["interval"]["level"] == 0.95
    assert default.output["interval"]["half_width"] >= interval["half_width"]
    assert release.output["noise"] == default.output["noise"]  # nothing else changes with the level
    assert release.realized == default.realized == model.worst_case(params, ctx)
    gamma = release.output["noise"]["granularity"]
    h = interval["half_width"]
    assert h > 0
    assert (h / gamma).is_integer()
    values = release.output.get("values", {"_": release.output.get("value")})
    lowers = interval["lower"] if isinstance(interval["lower"], dict) else {"_": interval["lower"]}
    uppers = interval["upper"] if isinstance(interval["upper"], dict) else {"_": interval["upper"]}
    assert list(lowers) == list(values) == list(uppers)
    for label, value in values.items():
        assert (lowers[label], uppers[label]) == (value - h, value + h)
    # the half-width is a function of public parameters only: another table gives the same one
    other = {"x": np.zeros(rows), "g": np.zeros(rows, dtype=np.int64)}
    assert model.run(params, ctx, other, Noise.seeded(4)).output["interval"]["half_width"] == h


@pytest.mark.parametrize("mechanism", ["laplace", "gaussian"])
def test_interval_coverage_monte_carlo(mechanism: str) -> None:
    """Coverage of the published interval over 4000 seeded releases (count and real-valued mean).

    Nominal 0.9. The count's observed coverage, and that of the interval one grid step narrower (the power
    check: its exact coverage is < 0.9), must each lie within 4.5 standard errors of the exact pmf's value
    (false alarm < 10^-5 each); the coverage itself must be ≥ 0.88 (Binomial(4000, ≥ 0.9): < 10^-5)."""
    from mechanisms.catalog import MECHANISMS
    from mechanisms.noise import Noise

    schema = _interval_schema()
    rows = 40
    table = {"x": np.linspace(0.0, 10.0, rows), "g": np.arange(rows) % 3}
    ctx = PublicContext(schema=schema, orders=DEFAULT_ORDERS, n_rows=rows)
    model = MECHANISMS[mechanism]
    cost = {"epsilon": 0.5} if mechanism == "laplace" else {"sigma": 1.5}
    count_params = model.params_model.model_validate({"query": {"kind": "count"}, **cost, "confidence": 0.9})
    truth = float(rows)
    covered = narrower = 0
    trials = 4000
    noise = Noise.seeded(20240611)
    for _ in range(trials):
        out = model.run(count_params, ctx, table, noise).output
        error = abs(out["value"] - truth)
        covered += error <= out["interval"]["half_width"]
        narrower += error <= out["interval"]["half_width"] - 1.0
    assert covered / trials >= 0.88
    if mechanism == "laplace":
        cdf = _exact_abs_cdf(lambda z: -z / 2, 40)  # t = Δ/ε = 2 grid units
    else:
        cdf = _exact_abs_cdf(lambda z: -z * z / (2 * 2.25), 40)  # s² = 1.5²
    k = int(out["interval"]["half_width"])
    assert float(cdf[k - 1]) < 0.9 <= float(cdf[k])
    for observed, exact in ((covered, float(cdf[k])), (narrower, float(cdf[k - 1]))):
        standard_error = math.sqrt(exact * (1 - exact) / trials)
        assert abs(observed / trials - exact) <= 4.5 * standard_error
    mean_params = model.params_model.model_validate(
        {"query": {"kind": "mean", "column": "x"}, **cost, "confidence": 0.9}
    )
    exact_mean = float(np.mean(table["x"]))
    hits = 0
    for _ in range(1000):
        out = model.run(mean_params, ctx, table, noise).output
        hits += out["interval"]["lower"] <= exact_mean <= out["interval"]["upper"]
    assert hits / 1000 >= 0.87  # Binomial(1000, ≥ 0.9) below 0.87: probability < 10^-3
