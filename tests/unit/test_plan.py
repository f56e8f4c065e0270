"""The aggregation plan's reference engine (mechanisms/data/plan.py): exact semantics, checked against
independent computations (Python integers and rationals, NumPy's searchsorted), on random and adversarial
data, and the sensitivity of the real sums built on it (docs/privacy/engines.md#lemma-engine)."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mechanisms.base import PublicContext
from mechanisms.data.plan import (
    Aggregation,
    Bucket,
    Key,
    Sum,
    evaluate_numpy,
    grid_bits,
    normalise,
    round_half_up,
)
from mechanisms.data.schema import DatasetSchema, FloatColumn, IntColumn
from mechanisms.noise import Grid
from mechanisms.queries.language import (
    SumQuery,
    clamped_units,
    real_sum_terms,
    real_sum_value,
    true_answer,
)
from mechanisms.queries.quantile import candidate_bucket, candidate_grid

FLOAT = FloatColumn(name="x", type="float", min=-2.5, max=1e3)
INT = IntColumn(name="k", type="int", min=-7, max=40)


def exact_compare(op: str, x: Fraction, v: Fraction) -> bool:
    return {
        "eq": x == v, "ne": x != v, "lt": x < v, "le": x <= v, "gt": x > v, "ge": x >= v,
    }[op]  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(
    op=st.sampled_from(["eq", "ne", "lt", "le", "gt", "ge"]),
    value=st.one_of(
        st.integers(-(10**20), 10**20),
        st.floats(-1e6, 1e6, allow_nan=False),
        st.sampled_from([-7, 40, -2.5, 1e3, 0.5, -6.5, 39.999999]),
    ),
    data=st.lists(st.integers(-10, 45), min_size=1, max_size=30),
)
def test_normalised_int_predicates_are_exact_comparisons(
    op: str, value: int | float, data: list[int]
) -> None:
    predicate = normalise(INT, op, [value])
    clipped = np.clip(np.asarray(data, dtype=np.int64), INT.min, INT.max)
    plan = Aggregation(where=(predicate,), bounds=(("k", float(INT.min), float(INT.max)),))
    count = evaluate_numpy(plan, {"k": np.asarray(data, dtype=np.int64)})[0][0]
    expected = sum(exact_compare(op, Fraction(int(x)), Fraction(value)) for x in clipped)
    assert count == expected


@settings(max_examples=300, deadline=None)
@given(
    op=st.sampled_from(["eq", "ne", "lt", "le", "gt", "ge", "in"]),
    value=st.one_of(st.integers(-(10**30), 10**30), st.floats(-1e4, 1e4, allow_nan=False)),
    data=st.lists(st.floats(-10, 2e3, allow_nan=False), min_size=1, max_size=30),
)
def test_normalised_float_predicates_are_exact_comparisons(
    op: str, value: int | float, data: list[float]
) -> None:
    predicate = normalise(FLOAT, op, [value])
    plan = Aggregation(where=(predicate,), bounds=(("x", FLOAT.min, FLOAT.max),))
    count = evaluate_numpy(plan, {"x": np.asarray(data)})[0][0]
    clipped = np.clip(np.asarray(data), FLOAT.min, FLOAT.max)
    test_op = "eq" if op == "in" else op
    expected = sum(exact_compare(test_op, Fraction(float(x)), Fraction(value)) for x in clipped)
    assert count == expected


@pytest.mark.parametrize(
    "column",
    [
        FloatColumn(name="x", type="float", min=-0.1, max=0.3),
        FloatColumn(name="x", type="float", min=1e14, max=1e15),
        FloatColumn(name="x", type="float", min=-3.0, max=-1.0),
        IntColumn(name="x", type="int", min=-3, max=7),
        IntColumn(name="x", type="int", min=0, max=10**6),
    ],
)
@pytest.mark.parametrize("size", [2, 3, 64, 1024])
def test_bucket_counts_equal_searchsorted_on_adversarial_values(
    column: FloatColumn | IntColumn, size: int
) -> None:
    candidates = candidate_grid(column, size)
    bucket = candidate_bucket(column, candidates)
    c = candidates.astype(np.float64)
    near = np.concatenate([c, np.nextafter(c, np.inf), np.nextafter(c, -np.inf)])
    rng = np.random.default_rng(7)
    values = np.concatenate([near, rng.uniform(float(column.min), float(column.max), 5000)])
    values = np.clip(values, float(column.min), float(column.max))
    if isinstance(column, IntColumn):
        values = np.round(values)
    plan = Aggregation(
        keys=(Key("x", bucket.size, bucket=bucket),), bounds=(("x", *map(float, (column.min, column.max))),)
    )
    counts = np.asarray(evaluate_numpy(plan, {"x": values})[0])
    expected = np.bincount(np.searchsorted(c, values, side="left"), minlength=bucket.size)
    assert np.array_equal(counts, expected)


def test_grid_sums_are_exact_beyond_int64() -> None:
    values = np.full(4096, 2**53 - 1, dtype=np.int64)
    plan = Aggregation(sums=(Sum("int_sum", "k"),))
    assert evaluate_numpy(plan, {"k": values})[0][0] == 4096 * (2**53 - 1)
    grouped = Aggregation(keys=(Key("g", 3),), sums=(Sum("int_sum", "k"), Sum("count")))
    codes = np.arange(4096) % 3
    answer = evaluate_numpy(grouped, {"k": -values, "g": codes})
    assert answer[0] == tuple(-(2**53 - 1) * int((codes == g).sum()) for g in range(3))
    assert answer[1] == tuple(int((codes == g).sum()) for g in range(3))


@settings(max_examples=200, deadline=None)
@given(st.floats(-(2.0**51), 2.0**51, allow_nan=False))
def test_round_half_up_is_exact(s: float) -> None:
    got = int(round_half_up(np.array([s]))[0])
    assert got == math.floor(Fraction(s) + Fraction(1, 2))


def test_grid_bits_keeps_rows_fine_and_below_2_52() -> None:
    for magnitude, unit in [(Fraction(1000), Fraction(1, 4)), (Fraction(10**15), Fraction(2) ** 40),
                            (Fraction(1, 10**9), Fraction(2) ** -40)]:  # fmt: skip
        e = grid_bits(magnitude, unit)
        assert Fraction(2) ** e <= unit / 128
        assert magnitude < Fraction(2) ** (e + 52)
    with pytest.raises(ValueError, match="too wide"):
        grid_bits(Fraction(2) ** 60, Fraction(1))


@settings(max_examples=150, deadline=None)
@given(
    data=st.lists(st.floats(-2.5, 1e3, allow_nan=False), min_size=1, max_size=40),
    extra=st.floats(-2.5, 1e3, allow_nan=False),
    exponent=st.integers(-30, 8),
)
def test_real_sums_move_by_at_most_the_shift_plus_the_slack(
    data: list[float], extra: float, exponent: int
) -> None:
    """Lemma ENGINE (iii): adding one row moves the release-unit value by ≤ |x|/γ + 2^-7 + 2^-40, and the
    value stays within 2^-7 units of the exact sum (independent computation with Fractions)."""
    grid = Grid(exponent)
    gamma = Fraction(grid.granularity)
    terms = real_sum_terms(FLOAT, gamma)
    plan = Aggregation(sums=terms, bounds=(("x", FLOAT.min, FLOAT.max),))

    def value(rows: list[float]) -> Fraction:
        answer = evaluate_numpy(plan, {"x": np.asarray(rows, dtype=np.float64)})
        return real_sum_value(terms, tuple(a[0] for a in answer)) / gamma

    exact = sum((Fraction(x) for x in data), Fraction(0)) / gamma
    assert abs(value(data) - exact) <= len(data) * (Fraction(1, 2**7) + Fraction(1, 2**40))
    moved = abs(value([*data, extra]) - value(data))
    assert moved <= abs(Fraction(extra)) / gamma + Fraction(1, 2**7) + Fraction(1, 2**40)


def test_true_answer_of_a_float_sum_uses_the_plan() -> None:
    schema = DatasetSchema.model_validate({"columns": [FLOAT.model_dump()], "neighboring": "add_remove"})
    ctx = PublicContext(schema=schema, n_rows=None, orders=(2.0,))
    rows = np.array([-2.5, 0.1, 999.9, 1e3, 1e4], dtype=np.float64)
    grid = Grid(-12)
    values, labels = true_answer(SumQuery(kind="sum", column="x"), ctx, {"x": rows}, grid)
    exact = sum((Fraction(float(x)) for x in np.clip(rows, -2.5, 1e3)), Fraction(0))
    assert labels is None
    assert abs(values[0] - exact) <= Fraction(grid.granularity) * len(rows) / 2**7
    assert clamped_units(values[0], grid) == math.floor(
        values[0] / Fraction(grid.granularity) + Fraction(1, 2)
    )


def test_a_bucket_of_one_candidate_splits_at_it() -> None:
    bucket = Bucket(0.0, 0.0, (1.5,))
    plan = Aggregation(keys=(Key("x", bucket.size, bucket=bucket),))
    answer = evaluate_numpy(plan, {"x": np.array([0.0, 1.5, 1.6, 3.0])})
    assert answer[0] == (2, 2)
