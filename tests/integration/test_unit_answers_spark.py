"""Per-(unit, cell) contributions on Spark (local[2], ANSI mode) equal NumPy's and DuckDB's exactly, and their
cell totals equal ``evaluate_numpy``'s answer; plus the DuckDB timing of ``aggregate_units`` against
``aggregate`` on a 10⁶-row snapshot with 10⁵ … 10⁶ units (printed, run with ``-s``; nothing is asserted on
time).

Needs pyspark and Java 17, as tests/integration/test_engine_spark.py (marked slow like it).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from mechanisms.data.plan import (
    ORDER_COLUMN,
    Aggregation,
    Key,
    Predicate,
    Sum,
    UnitBound,
    evaluate_numpy,
    evaluate_units_numpy,
)
from service.engines import DuckDBEngine
from service.engines.spark_engine import SparkEngine
from tests.unit.test_engine_duckdb import write_parquet
from tests.unit.test_unit_answers import UNIT_PLANS, overflow_table, unit_table

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def spark() -> Iterator[SparkEngine]:
    engine = SparkEngine("local[2]")
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def duckdb(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DuckDBEngine]:
    engine = DuckDBEngine(threads=2, memory_limit="1GB", temp_dir=tmp_path_factory.mktemp("duckdb-spill"))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    table = unit_table(np.random.default_rng(20261209), n_units=300)
    return write_parquet(tmp_path_factory.mktemp("spark-units"), table, row_group_size=1000), table


@pytest.mark.parametrize("name", list(UNIT_PLANS))
def test_spark_unit_answers_equal_duckdb_and_numpy(
    name: str, spark: SparkEngine, duckdb: DuckDBEngine, snapshot: tuple[Path, dict[str, np.ndarray]]
) -> None:
    path, table = snapshot
    plan = UNIT_PLANS[name]
    expected = evaluate_units_numpy(plan, table)
    assert duckdb.aggregate_units(path, plan) == expected
    assert spark.aggregate_units(path, plan) == expected
    assert expected.cell_totals(plan.n_cells) == evaluate_numpy(plan, table) == spark.aggregate(path, plan)


def test_spark_unit_sums_beyond_int64(spark: SparkEngine, tmp_path: Path) -> None:
    """DECIMAL(38, 0) per-unit sums past 2^63 come back as the same Python ints as NumPy's."""
    table = overflow_table(5000)
    plan = Aggregation(
        keys=(Key("g", 2),),
        sums=(Sum("count"), Sum("grid_sum", "x", exponent=-50), Sum("int_sum", "n")),
        bounds=(("x", -4.0, 4.0), ("n", -(2.0**62), 2.0**62)),
        unit=UnitBound("user", 4096),
    )
    expected = evaluate_units_numpy(plan, table)
    assert expected.sums[1].dtype == object
    assert expected.sums[2].dtype == object
    assert spark.aggregate_units(write_parquet(tmp_path, table), plan) == expected


def test_spark_refuses_a_plan_without_a_unit(
    spark: SparkEngine, snapshot: tuple[Path, dict[str, np.ndarray]]
) -> None:
    with pytest.raises(ValueError, match="privacy unit"):
        spark.aggregate_units(snapshot[0], Aggregation())


ROWS = 1_000_000


@pytest.mark.parametrize("n_units", [ROWS // 10, ROWS // 4, ROWS // 2, ROWS])
def test_duckdb_unit_answers_at_a_million_rows(n_units: int, duckdb: DuckDBEngine, tmp_path: Path) -> None:
    """A count plan with a where and one key, per unit and per cell, on 10⁶ rows: the per-unit answer is
    exact (its totals are the per-cell answer, NumPy agrees) and the wall times are printed."""
    rng = np.random.default_rng(n_units)
    table = {
        "user": rng.permutation(np.arange(ROWS, dtype=np.int64) % n_units),
        "x": rng.uniform(-4.0, 4.0, ROWS),
        "g": rng.integers(0, 8, ROWS).astype(np.int32),
        ORDER_COLUMN: rng.integers(-(2**63), 2**63 - 1, ROWS, dtype=np.int64),
    }
    path = write_parquet(tmp_path, table, row_group_size=131_072)
    plan = Aggregation(
        where=(Predicate("x", "ge", (-2.0,)),),
        keys=(Key("g", 8),),
        sums=(Sum("count"),),
        bounds=(("x", -4.0, 4.0),),
        unit=UnitBound("user", 10),
    )
    duckdb.aggregate(path, plan)  # warm the compile cache and the file cache
    duckdb.aggregate_units(path, plan)
    times: dict[str, list[float]] = {"aggregate": [], "aggregate_units": []}
    for _ in range(3):
        started = time.perf_counter()
        answer = duckdb.aggregate(path, plan)
        times["aggregate"].append(time.perf_counter() - started)
        started = time.perf_counter()
        units = duckdb.aggregate_units(path, plan)
        times["aggregate_units"].append(time.perf_counter() - started)
    started = time.perf_counter()
    reference = evaluate_units_numpy(plan, table)
    numpy_s = time.perf_counter() - started
    print(
        f"\n{ROWS} rows, {n_units} units, {len(units)} (unit, cell) rows: "
        f"aggregate {min(times['aggregate']):.3f} s, aggregate_units {min(times['aggregate_units']):.3f} s "
        f"(best of 3), NumPy evaluate_units_numpy {numpy_s:.3f} s"
    )
    assert units == reference
    assert units.cell_totals(plan.n_cells) == answer
