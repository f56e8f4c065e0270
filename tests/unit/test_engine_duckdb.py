"""DuckDB returns exactly ``evaluate_numpy``'s integers, for hand-written adversarial tables and plans and for
random ones (hypothesis); plus the table wrapper (``ParquetTable``) and the compiler's literal discipline.

The adversarial table holds values at and beyond the bounds (the plan clips them again), ±0.0, subnormals,
every bucket candidate and its two neighbouring doubles, exact round-half-up ties of the grid, int values
at ±2^53; the plans use every predicate op on float, int and categorical columns, several keys, buckets on
float and int columns, grid sums with centers, squares and exponents from −45 to far past the subnormal
range. The builders (``adversarial_table``, ``ADVERSARIAL_PLANS``, ``write_parquet``) are shared with
tests/integration/test_engine_spark.py.
"""

from __future__ import annotations

import itertools
import math
import threading
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import sqlglot
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlglot import exp

from mechanisms.data.plan import Aggregation, Bucket, Key, Op, Predicate, Sum, evaluate_numpy
from mechanisms.data.schema import DatasetSchema
from service.engines import DuckDBEngine, ParquetTable, RowLimitExceeded
from service.engines.compile import Corrections, bucket_corrections, compile_plan

X_LOW, X_HIGH = -4.0, 4.0
N_LOW, N_HIGH = -1000, 1000
BOUNDS = (("x", X_LOW, X_HIGH), ("n", float(N_LOW), float(N_HIGH)))

X_BUCKET = Bucket(low=X_LOW, inverse=2.0, candidates=tuple(X_LOW + 0.5 * j for j in range(17)))
"""Exact doubles, width 0.5, but the first candidate is ``low`` itself, so the approximate index is one short
for every value that is not a candidate: the upper correction does the work on most rows."""
THIRDS_BUCKET = Bucket(low=-1.0, inverse=3.0, candidates=tuple(-1.0 + j / 3 for j in range(7)))
"""Spacing 1/3: neither the candidates nor the products are exact doubles."""
ROUGH_BUCKET = Bucket(low=-4.0, inverse=1.0, candidates=(-3.5, -0.0, 1e-300, 0.1, 0.2, 3.9999999999999996))
"""Uneven candidates (the approximate index is off by more than one): still a function of the row."""
N_BUCKET = Bucket(low=float(N_LOW), inverse=0.02, candidates=tuple(N_LOW + 50.0 * j + 0.5 for j in range(40)))

SCHEMA = DatasetSchema.model_validate(
    {
        "columns": [
            {"name": "x", "type": "float", "min": X_LOW, "max": X_HIGH},
            {"name": "n", "type": "int", "min": N_LOW, "max": N_HIGH},
            {"name": "g", "type": "categorical", "values": ["a", "b", "c", "d"]},
            {"name": "h", "type": "categorical", "values": [str(i) for i in range(8)]},
        ],
        "neighboring": "add_remove",
    }
)


# ----- tables ---------------------------------------------------------------------------------------------
def write_parquet(
    directory: Path, columns: Mapping[str, np.ndarray], row_group_size: int | None = None
) -> Path:
    """``columns`` as one Parquet snapshot file in ``directory`` (a fresh name per call)."""
    path = directory / f"{uuid.uuid4().hex}.parquet"
    pq.write_table(pa.table(dict(columns)), path, row_group_size=row_group_size)
    return path


def _neighbours(values: np.ndarray) -> np.ndarray:
    """Each value and the doubles just below and above it."""
    return np.concatenate([values, np.nextafter(values, -np.inf), np.nextafter(values, np.inf)])


def adversarial_x(rng: np.random.Generator) -> np.ndarray:
    inside = [X_LOW, X_HIGH, -0.0, 0.0, 5e-324, -5e-324, 2.2250738585072014e-308, -1e-310, 0.5, -0.5, 1e-300]
    outside = [-4.5, 4.5, -1e300, 1e300, -5.0, 100.0]  # the plan clips them
    specials = np.array(inside + outside)
    candidates = np.concatenate(
        [X_BUCKET.candidates, THIRDS_BUCKET.candidates, ROUGH_BUCKET.candidates, [X_LOW, X_HIGH]]
    )
    # exact round-half-up ties of (x − center)·2^-e for the centers and exponents of the plans
    ties = [
        center + (k + 0.5) * 2.0**e
        for center in (0.0, 0.5, -1.25)
        for e in (-20, -3, 0)
        for k in (-3, -2, -1, 0, 1, 2)
    ]
    values = np.concatenate(
        [_neighbours(specials), _neighbours(candidates), _neighbours(np.array(ties)), rng.uniform(-5, 5, 800)]
    )
    return rng.permutation(values)


def adversarial_table(rng: np.random.Generator, n_rows: int | None = None) -> dict[str, np.ndarray]:
    """x (float64), n (int64), g (4 codes), h (8 codes), with the special values above; ``n_rows`` repeats
    them (shuffled) to that length."""
    x = adversarial_x(rng)
    size = x.size if n_rows is None else n_rows
    if n_rows is not None:
        x = rng.permutation(np.resize(x, size))
    int_specials = np.array(
        [N_LOW, N_HIGH, N_LOW - 1, N_HIGH + 1, 0, -1, 1, 2**53, -(2**53), 2**62, -(2**62), 25, 26, 24]
        + [N_LOW + 50 * j for j in range(40)],
        dtype=np.int64,
    )
    n = np.where(
        rng.random(size) < 0.2, rng.choice(int_specials, size), rng.integers(N_LOW - 100, N_HIGH + 100, size)
    ).astype(np.int64)
    return {
        "x": x,
        "n": n,
        "g": rng.integers(0, 4, size).astype(np.int32),
        "h": rng.integers(0, 8, size).astype(np.int32),
    }


# ----- plans ----------------------------------------------------------------------------------------------
def _plan(
    where: tuple[Predicate, ...] = (), keys: tuple[Key, ...] = (), sums: tuple[Sum, ...] = (Sum("count"),)
) -> Aggregation:
    return Aggregation(where=where, keys=keys, sums=sums, bounds=BOUNDS)


def _predicates() -> list[Predicate]:
    out = [Predicate("x", "true"), Predicate("x", "false"), Predicate("g", "true")]
    ops: tuple[Op, ...] = ("eq", "ne", "lt", "le", "gt", "ge")
    for op in ops:
        out += [
            Predicate("x", op, (0.5,)),
            Predicate("x", op, (-0.0,)),
            Predicate("x", op, (X_HIGH,)),
            Predicate("x", op, (5e-324,)),
            Predicate("x", op, (1,)),  # an int against a float column
            Predicate("n", op, (25,)),
            Predicate("n", op, (N_LOW,)),
            Predicate("n", op, (2.5,)),  # a float against an int column
            Predicate("g", op, (2,)),
        ]
    out += [
        Predicate("x", "in", (0.5, -0.0, 4.0, 1e-300)),
        Predicate("x", "in", ()),
        Predicate("n", "in", (N_LOW, 0, 25, N_HIGH)),
        Predicate("n", "in", (25, 26.0)),  # mixed: NumPy compares in float64
        Predicate("g", "in", (0, 3)),
    ]
    return out


GRID_SUMS = tuple(
    Sum("grid_sum", "x", center=center, square=square, exponent=exponent)
    for center, square, exponent in [
        (0.0, False, -45),
        (0.0, False, -20),
        (0.5, False, -20),
        (-1.25, False, -3),
        (0.0, False, 0),
        (0.5, False, 3),
        (0.0, True, -45),
        (0.5, True, -20),
        (-1.25, True, 0),
        (0.0, False, 30),
        (0.0, False, 1074),
        (0.0, False, 1075),
        (-0.0, True, 5000),
    ]
)
N_GRID = (
    Sum("grid_sum", "n", center=0.5, exponent=-3),
    Sum("grid_sum", "n", center=-3.0, square=True, exponent=0),
)


def adversarial_plans() -> dict[str, Aggregation]:
    plans: dict[str, Aggregation] = {"count": _plan()}
    for i, predicate in enumerate(_predicates()):
        plans[f"where-{i}-{predicate.column}-{predicate.op}"] = _plan(
            where=(predicate,), sums=(Sum("count"), Sum("int_sum", "n"), GRID_SUMS[1])
        )
    plans["where-all"] = _plan(
        where=(Predicate("x", "ge", (-3.0,)), Predicate("n", "ne", (25,)), Predicate("g", "in", (0, 1, 3))),
        keys=(Key("h", 8),),
        sums=(Sum("count"),),
    )
    for i, grid in enumerate(GRID_SUMS + N_GRID):
        plans[f"grid-{i}"] = _plan(sums=(grid,), keys=(Key("g", 4),))
    plans["int-sums"] = _plan(keys=(Key("g", 4),), sums=(Sum("count"), Sum("int_sum", "n")))
    plans["int-sum-of-float"] = _plan(sums=(Sum("int_sum", "x"),), keys=(Key("g", 4),))
    plans["distinct-units"] = _plan(sums=(Sum("count"), Sum("distinct_units", "n")))
    plans["distinct-units-grouped"] = _plan(
        where=(Predicate("x", "ge", (-3.0,)),),
        keys=(Key("g", 4), Key("h", 8)),
        sums=(Sum("distinct_units", "n"),),
    )
    plans["code-key-offset"] = _plan(keys=(Key("n", N_HIGH - N_LOW + 1, offset=N_LOW),))
    plans["float-code-key"] = _plan(keys=(Key("x", 9, offset=-4),), sums=(Sum("count"), GRID_SUMS[2]))
    plans["two-codes"] = _plan(keys=(Key("g", 4), Key("h", 8)), sums=(Sum("count"), Sum("int_sum", "n")))
    for name, bucket in [("x", X_BUCKET), ("thirds", THIRDS_BUCKET), ("rough", ROUGH_BUCKET)]:
        plans[f"bucket-{name}"] = _plan(keys=(Key("x", bucket.size, bucket=bucket),))
    plans["bucket-n"] = _plan(
        keys=(Key("n", N_BUCKET.size, bucket=N_BUCKET),), sums=(Sum("count"), N_GRID[0])
    )
    plans["bucket-one-candidate"] = _plan(keys=(Key("x", 2, bucket=Bucket(0.0, 1.0, (0.0,))),))
    plans["three-keys"] = _plan(
        where=(Predicate("x", "lt", (3.5,)),),
        keys=(
            Key("x", X_BUCKET.size, bucket=X_BUCKET),
            Key("n", N_BUCKET.size, bucket=N_BUCKET),
            Key("g", 4),
        ),
        sums=(Sum("count"), Sum("int_sum", "n"), GRID_SUMS[7], GRID_SUMS[3]),
    )
    plans["empty-false"] = _plan(
        where=(Predicate("x", "false"),), keys=(Key("g", 4),), sums=(Sum("count"), Sum("int_sum", "n"))
    )
    plans["empty-false-no-keys"] = _plan(
        where=(Predicate("x", "false"),), sums=(Sum("count"), Sum("int_sum", "n"), GRID_SUMS[0])
    )
    plans["empty-clipped"] = _plan(  # clipped x ≤ 4, so nothing is above it
        where=(Predicate("x", "gt", (X_HIGH,)),), sums=(Sum("count"), GRID_SUMS[4])
    )
    plans["empty-with-bucket"] = _plan(
        where=(Predicate("n", "gt", (N_HIGH,)),), keys=(Key("x", X_BUCKET.size, bucket=X_BUCKET), Key("g", 4))
    )
    return plans


ADVERSARIAL_PLANS = adversarial_plans()


# ----- fixtures -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DuckDBEngine]:
    duck = DuckDBEngine(threads=2, memory_limit="1GB", temp_dir=tmp_path_factory.mktemp("duckdb-spill"))
    yield duck
    duck.close()


@pytest.fixture(scope="module")
def adversarial(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    table = adversarial_table(np.random.default_rng(20261207))
    # small row groups: DuckDB's threads each take some of them
    return write_parquet(tmp_path_factory.mktemp("adversarial"), table, row_group_size=500), table


# ----- adversarial plans ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(ADVERSARIAL_PLANS))
def test_adversarial_plan_is_exact(
    name: str, engine: DuckDBEngine, adversarial: tuple[Path, dict[str, np.ndarray]]
) -> None:
    path, table = adversarial
    plan = ADVERSARIAL_PLANS[name]
    assert engine.aggregate(path, plan) == evaluate_numpy(plan, table)


def test_the_adversarial_table_is_adversarial(adversarial: tuple[Path, dict[str, np.ndarray]]) -> None:
    """The special values survive the Parquet round trip (−0.0 and subnormals included)."""
    path, table = adversarial
    x = pq.read_table(path).column("x").to_numpy()
    assert np.array_equal(x.view(np.int64), table["x"].view(np.int64))
    assert (np.signbit(x) & (x == 0)).any()
    assert ((np.abs(x) < 2.3e-308) & (x != 0)).any()


def test_scaling_up_beyond_the_largest_power_of_two(engine: DuckDBEngine, tmp_path: Path) -> None:
    """An exponent below −1023 needs 2^-e > the largest double: the scale is split into exact factors."""
    tiny = np.array(
        [5e-324, -5e-324, 1.5e-323, 2.2e-320, 1e-316, -3e-318, 0.0, -0.0, 7e-322]
    )  # |y|·2^1100 < 2^52
    table = {"x": _neighbours(tiny)}
    path = write_parquet(tmp_path, table)
    for exponent in (-1024, -1100, -1074):
        plan = Aggregation(
            sums=(Sum("count"), Sum("grid_sum", "x", exponent=exponent)), bounds=(("x", -1.0, 1.0),)
        )
        assert engine.aggregate(path, plan) == evaluate_numpy(plan, table)


def test_infinite_bounds_leave_values_unclipped(engine: DuckDBEngine, tmp_path: Path) -> None:
    table = {"x": np.array([-1e15, -1e6, -1.0, 0.0, 3.0, 1e6])}
    path = write_parquet(tmp_path, table)
    plan = Aggregation(
        where=(Predicate("x", "gt", (-1e7,)),),
        sums=(Sum("count"), Sum("grid_sum", "x", exponent=0)),
        bounds=(("x", -math.inf, 10.0),),
    )
    assert engine.aggregate(path, plan) == evaluate_numpy(plan, table)


# ----- exact sums beyond 64 bits ----------------------------------------------------------------------------
def test_int_sum_beyond_two_to_the_63_is_exact(engine: DuckDBEngine, tmp_path: Path) -> None:
    """2·10^5 rows of 2^53 (and some of −2^53 + 1) in one cell: the sum is about 2^70.6, far past int64."""
    rows = 200_000
    values = np.full(rows, 2**53, dtype=np.int64)
    values[::7] = -(2**53) + 1
    table: dict[str, np.ndarray] = {"w": values, "g": np.zeros(rows, dtype=np.int32)}
    path = write_parquet(tmp_path, table, row_group_size=16_384)
    plan = Aggregation(
        keys=(Key("g", 2),), sums=(Sum("count"), Sum("int_sum", "w")), bounds=(("w", -(2.0**53), 2.0**53),)
    )
    answer = engine.aggregate(path, plan)
    n_negative = len(range(0, rows, 7))
    exact = (rows - n_negative) * 2**53 + n_negative * (-(2**53) + 1)
    assert answer == ((rows, 0), (exact, 0)) == evaluate_numpy(plan, table)
    assert exact > 2**63


def test_grid_sum_beyond_two_to_the_63_is_exact(engine: DuckDBEngine, tmp_path: Path) -> None:
    """Row units just below 2^52 (the largest the plan allows), 10^5 rows in one cell: ≈ 2^68.6."""
    rows = 100_000
    table = {"x": np.full(rows, 4.0) - np.arange(rows) % 3 * 2.0**-50}
    path = write_parquet(tmp_path, table)
    plan = Aggregation(sums=(Sum("count"), Sum("grid_sum", "x", exponent=-50)), bounds=(("x", -4.0, 4.0),))
    answer = engine.aggregate(path, plan)
    assert answer == evaluate_numpy(plan, table)
    assert answer[1][0] > 2**63


def test_a_million_rows_in_one_cell(engine: DuckDBEngine, tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    rows = 1_000_000
    table: dict[str, np.ndarray] = {
        "g": np.full(rows, 2, dtype=np.int32),
        "n": rng.integers(-(2**40), 2**40, rows),
    }
    path = write_parquet(tmp_path, table, row_group_size=100_000)
    plan = Aggregation(
        keys=(Key("g", 4),), sums=(Sum("count"), Sum("int_sum", "n")), bounds=(("n", -(2.0**40), 2.0**40),)
    )
    answer = engine.aggregate(path, plan)
    assert answer == evaluate_numpy(plan, table)
    assert answer[0] == (0, 0, rows, 0)


# ----- random tables and plans ----------------------------------------------------------------------------
SPECIAL_FLOATS = [
    X_LOW, X_HIGH, -0.0, 0.0, 5e-324, -5e-324, 0.5, -0.5, 1.5, -2.5, 1e-300, 4.5, -1e300,
    *X_BUCKET.candidates, *THIRDS_BUCKET.candidates,
]  # fmt: skip
floats = st.one_of(
    st.sampled_from(SPECIAL_FLOATS),
    st.sampled_from(SPECIAL_FLOATS).map(lambda v: float(np.nextafter(v, np.inf))),
    st.sampled_from(SPECIAL_FLOATS).map(lambda v: float(np.nextafter(v, -np.inf))),
    st.floats(-6.0, 6.0, allow_nan=False),
)
ints = st.one_of(st.sampled_from([N_LOW, N_HIGH, 0, 25, 2**53, -(2**53)]), st.integers(-1200, 1200))


@st.composite
def tables(draw: st.DrawFn) -> dict[str, np.ndarray]:
    n_rows = draw(st.integers(0, 60))
    return {
        "x": np.array(draw(st.lists(floats, min_size=n_rows, max_size=n_rows)), dtype=np.float64),
        "n": np.array(draw(st.lists(ints, min_size=n_rows, max_size=n_rows)), dtype=np.int64),
        "g": np.array(draw(st.lists(st.integers(0, 3), min_size=n_rows, max_size=n_rows)), dtype=np.int32),
    }


@st.composite
def predicates(draw: st.DrawFn) -> Predicate:
    column = draw(st.sampled_from(["x", "n", "g"]))
    op: Op = draw(st.sampled_from(["eq", "ne", "lt", "le", "gt", "ge", "in", "true", "false"]))
    if op in ("true", "false"):
        return Predicate(column, op)
    values = {"x": floats, "n": st.one_of(ints, floats), "g": st.integers(0, 3)}[column]
    count = draw(st.integers(0 if op == "in" else 1, 4))
    return Predicate(column, op, tuple(draw(st.lists(values, min_size=count, max_size=count))))


@st.composite
def sums(draw: st.DrawFn) -> Sum:
    kind = draw(st.sampled_from(["count", "int_sum", "grid_sum"]))
    if kind == "count":
        return Sum("count")
    if kind == "int_sum":
        return Sum("int_sum", draw(st.sampled_from(["n", "g"])))
    column = draw(st.sampled_from(["x", "n"]))
    square = draw(st.booleans())
    center = draw(st.sampled_from([0.0, 0.5, -1.25, 3.0, 1 / 3]))
    # |y| ≤ 8 (x) or ≤ 2001 (n); squared ≤ 64 or ≤ 2^22: keep |s| < 2^52
    magnitude_bits = (6 if square else 3) if column == "x" else (22 if square else 11)
    exponent = draw(st.integers(magnitude_bits - 52, 80))
    return Sum("grid_sum", column, center=center, square=square, exponent=exponent)


@st.composite
def buckets(draw: st.DrawFn) -> Bucket:
    """Evenly spaced (inexact) candidates, or arbitrary ones (unsorted, repeated, ±inf), with a positive or
    negative inverse: the static correction analysis must hold for all of them."""
    if draw(st.booleans()):
        low = draw(st.floats(-5.0, 0.0))
        width = draw(st.floats(1e-3, 2.0))
        k = draw(st.integers(1, 60))
        first = low + width * draw(st.sampled_from([0.0, 1.0, 0.5]))
        return Bucket(low=first, inverse=1 / width, candidates=tuple(first + j * width for j in range(k)))
    candidates = draw(
        st.lists(st.one_of(floats, st.sampled_from([-math.inf, math.inf])), min_size=1, max_size=12)
    )
    if draw(st.booleans()):
        candidates.sort()
    low = draw(st.one_of(floats, st.just(X_LOW)))
    inverse = draw(
        st.one_of(st.floats(0.01, 100.0), st.floats(-10.0, -0.01), st.sampled_from([1.0, 3.0, 1e300]))
    )
    return Bucket(low=low, inverse=inverse, candidates=tuple(candidates))


@st.composite
def keys(draw: st.DrawFn) -> tuple[Key, ...]:
    options = [
        st.just(Key("g", 4)),
        st.sampled_from([X_BUCKET, THIRDS_BUCKET, ROUGH_BUCKET, N_BUCKET]).map(
            lambda b: Key("n" if b is N_BUCKET else "x", b.size, bucket=b)
        ),
        buckets().flatmap(
            lambda b: st.sampled_from([Key("x", b.size, bucket=b), Key("n", b.size, bucket=b)])
        ),
    ]
    chosen = draw(st.lists(st.one_of(*options), max_size=3))
    return tuple(chosen)


@st.composite
def plans(draw: st.DrawFn) -> Aggregation:
    return Aggregation(
        where=tuple(draw(st.lists(predicates(), max_size=3))),
        keys=draw(keys()),
        sums=tuple(draw(st.lists(sums(), min_size=1, max_size=3))),
        bounds=BOUNDS,
    )


@settings(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(table=tables(), plan=plans())
def test_random_plans_are_exact(
    table: dict[str, np.ndarray], plan: Aggregation, engine: DuckDBEngine, tmp_path: Path
) -> None:
    path = write_parquet(tmp_path, table)
    assert engine.aggregate(path, plan) == evaluate_numpy(plan, table)


@settings(deadline=None, max_examples=300)
@given(
    bucket=buckets(),
    domain=st.sampled_from([(X_LOW, X_HIGH), (-1.0, 0.5), (-math.inf, math.inf), (0.0, 0.0)]),
)
def test_bucket_corrections_are_sound(bucket: Bucket, domain: tuple[float, float]) -> None:
    """Wherever a correction fires (NumPy's definition), the analysis says it can, and its guard holds: on
    every candidate, its two neighbouring doubles, the domain's ends and a dense random sample."""
    lo, hi = domain
    corrections = bucket_corrections(bucket, lo, hi)
    c = np.asarray(bucket.candidates)
    finite_lo, finite_hi = max(lo, -1e6), min(hi, 1e6)
    x = np.concatenate([c, np.nextafter(c, -np.inf), np.nextafter(c, np.inf), [lo, hi]])
    x = np.concatenate([x, np.random.default_rng(0).uniform(finite_lo, finite_hi, 20_000)])
    x = x[np.isfinite(x) & (x >= lo) & (x <= hi)]
    with np.errstate(all="ignore"):
        t = (x - bucket.low) * bucket.inverse
        j0 = np.clip(np.ceil(t), 0, c.size).astype(np.int64)
        below = np.concatenate([[-np.inf], c])[j0]
        at = np.concatenate([c, [np.inf]])[j0]
        lower, upper = x <= below, at < x
        if lower.any():
            assert corrections.lower
            if corrections.lower_guard is not None:
                assert (t[lower] - (j0[lower] - 1).astype(np.float64) <= corrections.lower_guard).all()
        if upper.any():
            assert corrections.upper
            if corrections.upper_guard is not None:
                assert (j0[upper].astype(np.float64) - t[upper] <= corrections.upper_guard).all()


def test_evenly_spaced_small_buckets_need_few_lookups() -> None:
    """The analysis is not vacuous: exact spacing needs no lookup at all, and the guards are tight."""
    exact = Bucket(low=4.0, inverse=0.25, candidates=tuple(4.0 * j for j in range(1, 25)))
    assert bucket_corrections(exact, 0.0, 100.0) == Corrections(False, None, False, None)
    width = 8 / 1025
    inexact = Bucket(
        low=-4 + width, inverse=1 / width, candidates=tuple(-4 + width * (j + 1) for j in range(1024))
    )
    corrections = bucket_corrections(inexact, -4.0, 4.0)
    assert corrections.lower_guard is not None
    assert corrections.lower_guard < 1e-9
    assert corrections.upper_guard is not None
    assert corrections.upper_guard < 1e-9


# ----- concurrency ----------------------------------------------------------------------------------------
def test_concurrent_scans_each_get_their_answer(
    engine: DuckDBEngine, adversarial: tuple[Path, dict[str, np.ndarray]]
) -> None:
    """Several threads at once, each with bucket plans registering their own candidate tables."""
    path, table = adversarial
    names = ["bucket-x", "bucket-thirds", "bucket-rough", "three-keys", "grid-3", "where-all"]
    expected = {name: evaluate_numpy(ADVERSARIAL_PLANS[name], table) for name in names}
    results: dict[tuple[str, int], object] = {}
    errors: list[BaseException] = []

    def run(name: str, i: int) -> None:
        try:
            results[name, i] = engine.aggregate(path, ADVERSARIAL_PLANS[name])
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=job) for job in itertools.product(names, range(3))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert all(results[name, i] == expected[name] for name, i in results)
    assert len(results) == len(threads)


# ----- the compiler ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("dialect", ["duckdb", "spark"])
def test_no_decimal_literal_reaches_an_engine(dialect: str) -> None:
    """Every non-integer number in the SQL is a string cast to DOUBLE (a bare 0.5 is DECIMAL in DuckDB)."""
    kinds = {"x": "float", "n": "int", "g": "int", "h": "int"}
    for plan in ADVERSARIAL_PLANS.values():
        compiled = compile_plan(plan, kinds)  # type: ignore[arg-type]
        tree = sqlglot.parse_one(compiled.sql(dialect), read=dialect)  # type: ignore[arg-type]
        for literal in tree.find_all(exp.Literal):
            if literal.is_string:
                if literal.parent is not None and isinstance(literal.parent, exp.Cast):
                    assert literal.parent.to.is_type("double")
                    assert float(literal.this) == float(literal.this)  # parses as a float
            else:
                assert literal.this.lstrip("-").isdigit(), literal.this


def test_compiled_once_per_plan() -> None:
    plan = ADVERSARIAL_PLANS["three-keys"]
    kinds = {"x": "float", "n": "int", "g": "int", "h": "int"}
    first = compile_plan(plan, kinds)  # type: ignore[arg-type]
    assert compile_plan(plan, kinds) is first  # type: ignore[arg-type]
    assert first.sql("duckdb") is first.sql("duckdb")
    assert "READ_PARQUET($path)" in first.sql("duckdb")
    assert "DECIMAL(38, 0)" in first.sql("spark")


@pytest.mark.parametrize(
    "plan",
    [
        Aggregation(where=(Predicate("x", "lt", (math.nan,)),), bounds=BOUNDS),
        Aggregation(keys=(Key("x", 2, bucket=Bucket(0.0, 1.0, (math.nan,))),), bounds=BOUNDS),
        Aggregation(sums=(Sum("grid_sum", "x", center=math.inf),), bounds=BOUNDS),
        Aggregation(where=(Predicate("x", "lt", ()),), bounds=BOUNDS),
        Aggregation(sums=(Sum("int_sum"),), bounds=BOUNDS),
        Aggregation(where=(Predicate("nope", "eq", (1,)),)),
    ],
)
def test_plans_without_an_exact_meaning_are_refused(
    plan: Aggregation, engine: DuckDBEngine, adversarial: tuple[Path, dict[str, np.ndarray]]
) -> None:
    with pytest.raises(ValueError):  # noqa: PT011 - the reasons differ
        engine.aggregate(adversarial[0], plan)


# ----- ParquetTable ---------------------------------------------------------------------------------------
def test_parquet_table(engine: DuckDBEngine, adversarial: tuple[Path, dict[str, np.ndarray]]) -> None:
    path, table = adversarial
    parquet = ParquetTable(path, SCHEMA, engine, max_memory_rows=10**6)
    assert list(parquet) == ["x", "n", "g", "h"]
    assert len(parquet) == 4
    assert "x" in parquet
    assert parquet.n_rows == table["x"].size
    assert np.array_equal(parquet["x"].view(np.int64), table["x"].view(np.int64))
    assert np.array_equal(parquet["g"], table["g"])
    with pytest.raises(KeyError):
        parquet["nope"]
    plan = ADVERSARIAL_PLANS["three-keys"]
    assert parquet.aggregate(plan) == evaluate_numpy(plan, table)
    batches = list(parquet.batches(["n", "x"], rows_per_batch=700))
    assert [len(b["n"]) for b in batches[:-1]] == [700] * (len(batches) - 1)
    assert np.array_equal(np.concatenate([b["n"] for b in batches]), table["n"])
    # a mechanism's aggregate() goes to the engine, not to NumPy
    from mechanisms.data.plan import aggregate

    assert aggregate(parquet, plan) == evaluate_numpy(plan, table)


def test_parquet_table_refuses_large_columns_in_memory(
    engine: DuckDBEngine, adversarial: tuple[Path, dict[str, np.ndarray]]
) -> None:
    path, table = adversarial
    parquet = ParquetTable(path, SCHEMA, engine, max_memory_rows=100)
    with pytest.raises(RowLimitExceeded) as caught:
        parquet["x"]
    assert caught.value.limit == 100
    assert caught.value.n_rows == table["x"].size
    assert str(table["x"].size) not in str(caught.value)  # the row count is private
    assert sum(len(b["x"]) for b in parquet.batches(["x"], 64)) == table["x"].size  # streaming still works
