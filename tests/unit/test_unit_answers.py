"""Per-(unit, cell) contributions (``UnitAnswer``): NumPy (``evaluate_units_numpy``) and DuckDB
(``DuckDBEngine.aggregate_units``) return identical answers, and summing a ``UnitAnswer``'s rows per cell
gives ``evaluate_numpy``'s answer exactly (the key invariant: the rows partition the kept rows).

Tables have a privacy unit with up to 10× ``max_rows`` rows per unit and bounding-order ties (so the tie
columns decide); their values are within the declared bounds, as in every snapshot (NumPy breaks ties on
the stored values, SQL on the clipped ones: they agree on clipped data only). Plans cover where filters,
code and bucket keys, counts, int sums, grid sums (plain and squared) and distinct units. An independent
oracle runs ``evaluate_numpy`` on each unit's rows alone (bounding depends on a unit's rows only), and sums
beyond int64 (object arrays) are checked against Python integers. Spark's identity (and the DuckDB timing
on 10⁶ rows) is in tests/integration/test_unit_answers_spark.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mechanisms.data.plan import (
    ORDER_COLUMN,
    Aggregation,
    Key,
    Predicate,
    Sum,
    UnitAnswer,
    UnitBound,
    aggregate_units,
    evaluate_numpy,
    evaluate_units_numpy,
)
from mechanisms.data.schema import DatasetSchema
from service.engines import DuckDBEngine, ParquetTable
from service.engines.compile import compile_plan, exact_int_array
from tests.unit.test_engine_duckdb import (
    BOUNDS,
    GRID_SUMS,
    N_BUCKET,
    N_GRID,
    THIRDS_BUCKET,
    X_BUCKET,
    adversarial_table,
    plans,
    tables,
    write_parquet,
)

MAX_ROWS = 3
UNIT = UnitBound("user", MAX_ROWS)
SCHEMA = DatasetSchema.model_validate(
    {
        "columns": [
            {"name": "user", "type": "int", "min": 0, "max": 10**6},
            {"name": "x", "type": "float", "min": -4.0, "max": 4.0},
            {"name": "n", "type": "int", "min": -1000, "max": 1000},
            {"name": "g", "type": "categorical", "values": ["a", "b", "c", "d"]},
            {"name": "h", "type": "categorical", "values": [str(i) for i in range(8)]},
        ],
        "neighboring": "add_remove",
        "privacy_unit": {"column": "user", "max_rows": MAX_ROWS},
    }
)


def unit_table(rng: np.random.Generator, n_units: int) -> dict[str, np.ndarray]:
    """The adversarial columns (x, n, g, h) with a ``user`` column (1 to 10× ``MAX_ROWS`` rows per unit,
    ids spread over [0, 10^6]) and a bounding order with many ties (so the tie columns matter); values
    clipped to the bounds as a snapshot's are."""
    sizes = rng.integers(1, 10 * MAX_ROWS + 1, n_units)
    ids = rng.choice(10**6, n_units, replace=False).astype(np.int64)
    users = rng.permutation(np.repeat(ids, sizes))
    table = clipped(adversarial_table(rng, n_rows=users.size))
    table["user"] = users
    table[ORDER_COLUMN] = rng.integers(-3, 3, users.size).astype(np.int64)
    return table


def clipped(table: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``table`` with x and n clipped to ``BOUNDS`` (the snapshot invariant)."""
    for name, low, high in BOUNDS:
        table[name] = np.clip(table[name], low, high).astype(table[name].dtype)
    return table


def unit_plans() -> dict[str, Aggregation]:
    def plan(
        where: tuple[Predicate, ...] = (), keys: tuple[Key, ...] = (), sums: tuple[Sum, ...] = (Sum("count"),)
    ) -> Aggregation:
        return Aggregation(where=where, keys=keys, sums=sums, bounds=BOUNDS, unit=UNIT)

    every_sum = (Sum("count"), Sum("int_sum", "n"), *GRID_SUMS[:9], *N_GRID, Sum("distinct_units", "user"))
    return {
        "count": plan(),
        "count-where-key": plan(where=(Predicate("x", "ge", (-1.0,)),), keys=(Key("g", 4),)),
        "every-sum-no-keys": plan(sums=every_sum),
        "every-sum-two-codes": plan(keys=(Key("g", 4), Key("h", 8)), sums=every_sum),
        "where-all": plan(
            where=(
                Predicate("x", "lt", (3.5,)),
                Predicate("n", "ne", (25,)),
                Predicate("g", "in", (0, 1, 3)),
            ),
            keys=(Key("h", 8),),
            sums=(Sum("count"), Sum("int_sum", "n"), GRID_SUMS[7], Sum("distinct_units", "user")),
        ),
        "buckets": plan(
            keys=(Key("x", X_BUCKET.size, bucket=X_BUCKET), Key("n", N_BUCKET.size, bucket=N_BUCKET)),
            sums=(Sum("count"), GRID_SUMS[2], GRID_SUMS[6], N_GRID[1]),
        ),
        "bucket-thirds-squares": plan(
            where=(Predicate("n", "gt", (-500,)),),
            keys=(Key("x", THIRDS_BUCKET.size, bucket=THIRDS_BUCKET), Key("g", 4)),
            sums=(Sum("count"), GRID_SUMS[8], Sum("int_sum", "x")),
        ),
        "code-key-offset": plan(
            keys=(Key("n", 2001, offset=-1000),), sums=(Sum("count"), Sum("int_sum", "n"))
        ),
        "empty": plan(
            where=(Predicate("x", "false"),), keys=(Key("g", 4),), sums=(Sum("count"), GRID_SUMS[0])
        ),
        "empty-no-keys": plan(where=(Predicate("x", "false"),), sums=(Sum("count"), Sum("int_sum", "n"))),
    }


UNIT_PLANS = unit_plans()


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DuckDBEngine]:
    duck = DuckDBEngine(threads=2, memory_limit="1GB", temp_dir=tmp_path_factory.mktemp("duckdb-spill"))
    yield duck
    duck.close()


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    table = unit_table(np.random.default_rng(20261208), n_units=400)
    return write_parquet(tmp_path_factory.mktemp("units"), table, row_group_size=1000), table


def by_unit_oracle(plan: Aggregation, table: dict[str, np.ndarray]) -> UnitAnswer:
    """Independent of ``evaluate_units_numpy``: ``evaluate_numpy`` on each unit's rows alone (which rows a
    unit keeps depends on its rows only), one row per cell its count reaches, with Python-int sums."""
    counted = dataclasses.replace(plan, sums=(Sum("count"), *plan.sums))
    units, cells, sums = [], [], [[] for _ in plan.sums]  # type: list[int], list[int], list[list[int]]
    for unit in np.unique(table["user"]).tolist():
        rows = {name: values[table["user"] == unit] for name, values in table.items()}
        answer = evaluate_numpy(counted, rows)
        for cell in np.flatnonzero(np.asarray(answer[0]) > 0).tolist():
            units.append(unit)
            cells.append(cell)
            for i in range(len(plan.sums)):
                sums[i].append(answer[i + 1][cell])
    as_sums = tuple(np.array(values, dtype=object) for values in sums)
    return UnitAnswer(np.array(units, dtype=np.int64), np.array(cells, dtype=np.int64), as_sums)


# ----- identity and the key invariant ---------------------------------------------------------------------
@pytest.mark.parametrize("name", list(UNIT_PLANS))
def test_numpy_and_duckdb_unit_answers_are_identical(
    name: str, engine: DuckDBEngine, snapshot: tuple[Path, dict[str, np.ndarray]]
) -> None:
    path, table = snapshot
    plan = UNIT_PLANS[name]
    expected = evaluate_units_numpy(plan, table)
    assert engine.aggregate_units(path, plan) == expected
    assert expected.cell_totals(plan.n_cells) == evaluate_numpy(plan, table)
    if not name.startswith("empty"):
        assert len(expected) > 0
        assert np.unique(expected.units).size < len(expected) or not plan.keys  # units reach several cells


@pytest.mark.parametrize("name", ["count-where-key", "every-sum-two-codes", "where-all", "buckets"])
def test_unit_answers_match_the_per_unit_oracle(
    name: str, snapshot: tuple[Path, dict[str, np.ndarray]]
) -> None:
    _, table = snapshot
    small = {
        column: values[np.isin(table["user"], np.unique(table["user"])[:60])]
        for column, values in table.items()
    }
    plan = UNIT_PLANS[name]
    assert evaluate_units_numpy(plan, small) == by_unit_oracle(plan, small)


def test_bounding_is_applied(snapshot: tuple[Path, dict[str, np.ndarray]]) -> None:
    """Power check: units have up to 10× max_rows rows, yet no unit keeps more than max_rows, and some
    unit keeps exactly max_rows while having more rows (a plan without bounding would be caught)."""
    _, table = snapshot
    answer = evaluate_units_numpy(UNIT_PLANS["count"], table)
    assert answer.sums[0].max() == MAX_ROWS
    _, rows_per_unit = np.unique(table["user"], return_counts=True)
    assert rows_per_unit.max() > 5 * MAX_ROWS
    unbounded = dataclasses.replace(UNIT_PLANS["count"], unit=UnitBound("user", 10**6))
    assert evaluate_units_numpy(unbounded, table) != answer


@st.composite
def unit_tables(draw: st.DrawFn) -> dict[str, np.ndarray]:
    table = clipped(draw(tables()))
    n_rows = table["x"].size
    table["user"] = np.array(
        draw(st.lists(st.integers(0, 5), min_size=n_rows, max_size=n_rows)), dtype=np.int64
    )
    order = st.lists(st.integers(-2, 2), min_size=n_rows, max_size=n_rows)
    table[ORDER_COLUMN] = np.array(draw(order), dtype=np.int64)
    return table


@settings(deadline=None, max_examples=150, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    table=unit_tables(),
    plan=plans().map(lambda p: dataclasses.replace(p, unit=UnitBound("user", 2))),
    distinct=st.booleans(),
)
def test_random_unit_plans_are_identical(
    table: dict[str, np.ndarray], plan: Aggregation, distinct: bool, engine: DuckDBEngine, tmp_path: Path
) -> None:
    if distinct:
        plan = dataclasses.replace(plan, sums=(*plan.sums, Sum("distinct_units", "user")))
    path = write_parquet(tmp_path, table)
    expected = evaluate_units_numpy(plan, table)
    assert engine.aggregate_units(path, plan) == expected
    assert expected.cell_totals(plan.n_cells) == evaluate_numpy(plan, table)


# ----- sums beyond int64 ----------------------------------------------------------------------------------
def overflow_table(rows_per_unit: int) -> dict[str, np.ndarray]:
    """Unit 7: ``rows_per_unit`` rows with x just below 4 (row units just below 2^52) and n = ±2^62; unit 9:
    one small row. Per-unit grid and int sums pass 2^63 (positive and negative) for unit 7 only."""
    n = np.full(rows_per_unit, -(2**62), dtype=np.int64)
    n[::4] = 2**62  # three of four rows negative
    return {
        "user": np.concatenate([np.full(rows_per_unit, 7), [9]]).astype(np.int64),
        "x": np.concatenate([4.0 - np.arange(rows_per_unit) % 3 * 2.0**-50, [0.5]]),
        "n": np.concatenate([n, [5]]).astype(np.int64),
        "g": np.zeros(rows_per_unit + 1, dtype=np.int32),
        ORDER_COLUMN: np.arange(rows_per_unit + 1, dtype=np.int64),
    }


def test_sums_beyond_int64_are_exact_python_ints(engine: DuckDBEngine, tmp_path: Path) -> None:
    rows = 5000
    table = overflow_table(rows)
    plan = Aggregation(
        keys=(Key("g", 2),),
        sums=(Sum("count"), Sum("grid_sum", "x", exponent=-50), Sum("int_sum", "n")),
        bounds=(("x", -4.0, 4.0), ("n", -(2.0**62), 2.0**62)),
        unit=UnitBound("user", 4096),
    )
    answer = evaluate_units_numpy(plan, table)
    assert answer.units.tolist() == [7, 9]
    assert answer.sums[0].dtype == np.int64
    assert answer.sums[1].dtype == object
    assert answer.sums[2].dtype == object
    kept = slice(0, 4096)  # ORDER_COLUMN is increasing: unit 7 keeps its first 4096 rows
    grid = sum(int(v * 2.0**50) for v in table["x"][kept].tolist())  # exact units: x·2^50 is an integer
    assert answer.sums[1].tolist() == [grid, 2**49]
    assert answer.sums[2].tolist() == [sum(table["n"][kept].tolist()), 5]
    assert grid > 2**63
    assert answer.sums[2][0] < -(2**63)
    assert answer == by_unit_oracle(plan, table)
    assert engine.aggregate_units(write_parquet(tmp_path, table), plan) == answer
    assert answer.cell_totals(plan.n_cells) == evaluate_numpy(plan, table)


def test_exact_int_array_reads_decimals_exactly() -> None:
    from decimal import Decimal

    values = [0, 1, -1, 2**63 - 1, -(2**63), 2**63, -(2**63) - 1, 10**37, -(10**37) + 3]
    array = pa.array([Decimal(v) for v in values], type=pa.decimal128(38, 0))
    converted = exact_int_array(array)
    assert converted.dtype == object
    assert converted.tolist() == values
    fits = exact_int_array(pa.chunked_array([array.slice(0, 3), array.slice(3, 2)]))
    assert fits.dtype == np.int64
    assert fits.tolist() == values[:5]
    assert exact_int_array(array.slice(1, 2)).tolist() == [1, -1]


# ----- the API --------------------------------------------------------------------------------------------
def test_a_plan_without_a_unit_is_refused(
    engine: DuckDBEngine, snapshot: tuple[Path, dict[str, np.ndarray]]
) -> None:
    path, table = snapshot
    plan = dataclasses.replace(UNIT_PLANS["count-where-key"], unit=None)
    with pytest.raises(ValueError, match="privacy unit"):
        evaluate_units_numpy(plan, table)
    with pytest.raises(ValueError, match="privacy unit"):
        aggregate_units(table, plan)
    with pytest.raises(ValueError, match="privacy unit"):
        engine.aggregate_units(path, plan)
    with pytest.raises(ValueError, match="privacy unit"):
        compile_plan(plan, {"x": "float", "g": "int"}, by_unit=True)
    other = dataclasses.replace(UNIT_PLANS["count"], sums=(Sum("distinct_units", "n"),))
    with pytest.raises(ValueError, match="distinct_units"):
        evaluate_units_numpy(other, table)
    with pytest.raises(ValueError, match="distinct_units"):
        engine.aggregate_units(path, other)


def test_parquet_table_dispatches_to_its_engine(
    engine: DuckDBEngine, snapshot: tuple[Path, dict[str, np.ndarray]]
) -> None:
    path, table = snapshot
    parquet = ParquetTable(path, SCHEMA, engine, max_memory_rows=10)  # NumPy could not load its columns
    plan = UNIT_PLANS["where-all"]
    assert aggregate_units(parquet, plan) == evaluate_units_numpy(plan, table)
    assert aggregate_units(table, plan) == evaluate_units_numpy(plan, table)


def test_per_unit_plans_compile_separately() -> None:
    plan = UNIT_PLANS["every-sum-two-codes"]
    kinds = {"user": "int", "x": "float", "n": "int", "g": "int", "h": "int", ORDER_COLUMN: "int"}
    per_cell = compile_plan(plan, kinds)  # type: ignore[arg-type]
    per_unit = compile_plan(plan, kinds, by_unit=True)  # type: ignore[arg-type]
    assert per_unit is compile_plan(plan, kinds, by_unit=True)  # type: ignore[arg-type]
    assert per_unit is not per_cell
    assert 'GROUP BY "unit_id", "cell"' in per_unit.sql("duckdb")
    assert "unit_id" not in per_cell.query.sql()[: per_cell.query.sql().index("FROM")]
    assert "DECIMAL(38, 0)" in per_unit.sql("spark")


def test_unit_answer_is_validated() -> None:
    ids = np.array([1, 1, 2], dtype=np.int64)
    with pytest.raises(ValueError, match="sorted"):
        UnitAnswer(ids, np.array([0, 0, 1], dtype=np.int64), ())
    with pytest.raises(ValueError, match="aligned"):
        UnitAnswer(ids, np.array([0, 1, 0], dtype=np.int64), (np.zeros(2, dtype=np.int64),))
    small = UnitAnswer(ids, np.array([0, 1, 0], dtype=np.int64), (np.array([1, 2**40, 3], dtype=object),))
    assert small.sums[0].dtype == np.int64  # canonical: int64 whenever every value fits
    assert small.cell_totals(2) == ((4, 2**40),)
