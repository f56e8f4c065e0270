"""Spark (local[2], ANSI mode) returns exactly DuckDB's and NumPy's integers for the adversarial plans, on the
small adversarial table and on a 10⁶-row table built from the same special values; wall times are printed
(run with ``-s`` to see them).

Needs pyspark and Java 17; nothing here skips (under ``CI=true`` a missing Spark is a failure).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from mechanisms.data.plan import Aggregation, evaluate_numpy
from service.engines import DuckDBEngine
from service.engines.spark_engine import SparkEngine
from tests.unit.test_engine_duckdb import ADVERSARIAL_PLANS, adversarial_table, write_parquet

pytestmark = pytest.mark.slow

BIG_ROWS = 1_000_000
TIMES: list[tuple[str, str, float, float, float]] = []


@pytest.fixture(scope="module")
def spark() -> Iterator[SparkEngine]:
    engine = SparkEngine("local[2]")
    started = time.perf_counter()
    assert engine.session.conf.get("spark.sql.ansi.enabled") == "true"
    print(f"\nSpark session started in {time.perf_counter() - started:.1f} s")
    yield engine
    engine.close()
    if TIMES:
        print(f"\n{'table':<6} {'plan':<32} {'numpy s':>8} {'duckdb s':>9} {'spark s':>8}")
        for table, name, numpy_s, duck_s, spark_s in TIMES:
            print(f"{table:<6} {name:<32} {numpy_s:>8.3f} {duck_s:>9.3f} {spark_s:>8.3f}")


@pytest.fixture(scope="module")
def duckdb(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DuckDBEngine]:
    engine = DuckDBEngine(threads=2, memory_limit="1GB", temp_dir=tmp_path_factory.mktemp("duckdb-spill"))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def tables(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict[str, np.ndarray]]]:
    directory = tmp_path_factory.mktemp("spark-tables")
    small = adversarial_table(np.random.default_rng(20261207))
    big = adversarial_table(np.random.default_rng(7), n_rows=BIG_ROWS)
    return {
        "small": (write_parquet(directory, small, row_group_size=500), small),
        "big": (write_parquet(directory, big, row_group_size=131_072), big),
    }


def _timed(run: object, *args: object) -> tuple[object, float]:
    started = time.perf_counter()
    result = run(*args)  # type: ignore[operator]
    return result, time.perf_counter() - started


@pytest.mark.parametrize("table", ["small", "big"])
@pytest.mark.parametrize("name", list(ADVERSARIAL_PLANS))
def test_spark_equals_duckdb_equals_numpy(
    name: str,
    table: str,
    spark: SparkEngine,
    duckdb: DuckDBEngine,
    tables: dict[str, tuple[Path, dict[str, np.ndarray]]],
) -> None:
    path, columns = tables[table]
    plan: Aggregation = ADVERSARIAL_PLANS[name]
    expected, numpy_s = _timed(evaluate_numpy, plan, columns)
    from_duckdb, duck_s = _timed(duckdb.aggregate, path, plan)
    from_spark, spark_s = _timed(spark.aggregate, path, plan)
    TIMES.append((table, name, numpy_s, duck_s, spark_s))
    assert from_duckdb == expected
    assert from_spark == expected


def test_spark_sums_beyond_two_to_the_63(spark: SparkEngine, tmp_path: Path) -> None:
    """DECIMAL(38, 0) sums: exact past int64 (ANSI would raise on a BIGINT overflow, never wrap)."""
    from mechanisms.data.plan import Key, Sum

    rows = 100_000
    values = np.full(rows, 2**53, dtype=np.int64)
    table: dict[str, np.ndarray] = {"w": values, "g": np.zeros(rows, dtype=np.int32)}
    path = write_parquet(tmp_path, table)
    plan = Aggregation(
        keys=(Key("g", 2),), sums=(Sum("count"), Sum("int_sum", "w")), bounds=(("w", -(2.0**53), 2.0**53),)
    )
    answer = spark.aggregate(path, plan)
    assert answer == ((rows, 0), (rows * 2**53, 0)) == evaluate_numpy(plan, table)


def test_spark_bounds_privacy_units_as_numpy(spark: SparkEngine, tmp_path: Path) -> None:
    """The unit bounding (ROW_NUMBER over the unit, ordered by __order then the plan's columns) keeps the
    same rows in Spark as in the NumPy reference: counts, sums and grouped sums on unit pairs agree."""
    from mechanisms.queries.language import laplace_plan, query_plan
    from tests.unit.test_privacy_units import QUERIES, WHERES, ctx, neighbours, query, table

    context = ctx("add_remove")
    for seed in range(2):
        for rows in neighbours(seed, 40, "add_remove"):
            columns = table(rows)
            path = write_parquet(tmp_path, {**columns, "g": columns["g"].astype(np.int32)})
            for raw in QUERIES:
                for where in WHERES:
                    q = query(raw, where)
                    plan, _ = query_plan(q, context, laplace_plan(q, context, 0.5)[0].grid)
                    assert plan.unit is not None
                    assert spark.aggregate(path, plan) == evaluate_numpy(plan, columns), (raw, where)
