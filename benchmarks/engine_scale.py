"""Engines at scale: DuckDB on a 10⁸-row Parquet snapshot, Spark local[2] on a 10⁶-row one (not a test).

Data (generated once, reused from ``benchmarks/.data/``, gitignored): columns ``a`` (float64, normal
clipped to [−4, 4]), ``b`` (float64, uniform on [0, 100]), ``n`` (int64 in [0, 1000]), ``g4`` and ``g8``
(int32 categorical codes, 4 and 8 values); written in chunks of 1,048,576 rows with a ``ParquetWriter``
(one row group each; the generator holds one chunk at a time).

Plans (the public-parameter aggregations mechanisms issue):

* ``count``: rows with a < 1 (a filter, so it is a scan, not the footer's row count);
* ``int_sum``: Σ n; ``grid_sum``: Σ round_half_up(a·2^20);
* ``groupby4``: cells g4 × g8 × bucket(a, 7 candidates) × bucket(b, 9 candidates) = 2,560 cells,
  count + grid sum of b;
* ``bucket1024``: a quantile-like histogram of a over 1,024 evenly spaced candidates (1,025 cells).

Each plan runs ``--runs`` (5) times; recorded: wall p50 (and min, first), the process's CPU seconds p50
(all DuckDB threads: on a shared machine the wall time depends on the other load, recorded as the 1-minute
load average before and after), DuckDB with ``threads=2``, ``memory_limit=1GB``. ``--alternatives`` runs the
same plans in other exact forms (see :func:`alternatives`) and checks their answers equal the engine's.
Peak RSS: this process's (``resource.getrusage``) after the DuckDB runs; Spark's JVM is a child process,
its peak (VmHWM) is read from /proc before it stops.

Targets (2 cores, 10⁸ rows): count and sums ≤ 1.5 s, group-by ≤ 3 s, bucket ≤ 3 s, RSS ≤ 1.5 GB.

    .venv/bin/python benchmarks/engine_scale.py [--rows 100000000] [--runs 5] [--alternatives] [--no-spark]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import statistics
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any
from unittest.mock import patch

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from mechanisms.data.plan import Aggregation, Answer, Bucket, Key, Predicate, Sum
from service.engines import DuckDBEngine
from service.engines import compile as compile_module
from service.engines.compile import CompiledPlan, Corrections, compile_plan, snapshot_kinds

ROOT = Path(__file__).resolve().parent
DATA = ROOT / ".data"
RESULTS = ROOT / "results" / "engine_scale.json"
CHUNK = 1 << 20
BOUNDS = (("a", -4.0, 4.0), ("b", 0.0, 100.0), ("n", 0.0, 1000.0))
TARGETS = {"count": 1.5, "int_sum": 1.5, "grid_sum": 1.5, "groupby4": 3.0, "bucket1024": 3.0}
RSS_TARGET_MB = 1536


# ----- data -----------------------------------------------------------------------------------------------
def dataset(rows: int) -> Path:
    """The ``rows``-row snapshot, generated on first use (seeded: the same file every time)."""
    DATA.mkdir(parents=True, exist_ok=True)
    path = DATA / f"engine_scale_{rows}.parquet"
    if path.exists() and pq.ParquetFile(path).metadata.num_rows == rows:
        return path
    schema = pa.schema(
        [("a", pa.float64()), ("b", pa.float64()), ("n", pa.int64()), ("g4", pa.int32()), ("g8", pa.int32())]
    )
    partial = path.with_suffix(".partial")
    started = time.perf_counter()
    rng = np.random.default_rng(20261207)
    with pq.ParquetWriter(partial, schema) as writer:
        for start in range(0, rows, CHUNK):
            size = min(CHUNK, rows - start)
            chunk = pa.table(
                {
                    "a": np.clip(rng.standard_normal(size), -4.0, 4.0),
                    "b": rng.uniform(0.0, 100.0, size),
                    "n": rng.integers(0, 1001, size),
                    "g4": rng.integers(0, 4, size, dtype=np.int32),
                    "g8": rng.integers(0, 8, size, dtype=np.int32),
                },
                schema=schema,
            )
            writer.write_table(chunk, row_group_size=CHUNK)
    partial.rename(path)
    size_mb = path.stat().st_size / 2**20
    print(
        f"generated {path.name}: {rows:,} rows, {size_mb:,.0f} MiB in {time.perf_counter() - started:.1f} s"
    )
    return path


# ----- plans ----------------------------------------------------------------------------------------------
def even_bucket(low: float, high: float, k: int) -> Bucket:
    """k candidates low + (j + 1)·w (j < k), w = (high − low)/(k + 1): #{c < x} = ⌈(x − low)/w⌉ − 1, so
    the approximate index uses low' = low + w."""
    width = (high - low) / (k + 1)
    first = low + width
    return Bucket(low=first, inverse=1 / width, candidates=tuple(first + j * width for j in range(k)))


def plans() -> dict[str, Aggregation]:
    a7, b9, a1024 = even_bucket(-4.0, 4.0, 7), even_bucket(0.0, 100.0, 9), even_bucket(-4.0, 4.0, 1024)
    return {
        "count": Aggregation(where=(Predicate("a", "lt", (1.0,)),), bounds=BOUNDS),
        "int_sum": Aggregation(sums=(Sum("int_sum", "n"),), bounds=BOUNDS),
        "grid_sum": Aggregation(sums=(Sum("grid_sum", "a", exponent=-20),), bounds=BOUNDS),
        "groupby4": Aggregation(
            keys=(Key("g4", 4), Key("g8", 8), Key("a", a7.size, bucket=a7), Key("b", b9.size, bucket=b9)),
            sums=(Sum("count"), Sum("grid_sum", "b", center=50.0, exponent=-20)),
            bounds=BOUNDS,
        ),
        "bucket1024": Aggregation(keys=(Key("a", a1024.size, bucket=a1024),), bounds=BOUNDS),
    }


# ----- timing ---------------------------------------------------------------------------------------------
def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def timed(run: Callable[[], Answer], runs: int) -> tuple[dict[str, Any], Answer]:
    """Wall and process CPU seconds (all of DuckDB's threads) of ``runs`` calls; the machine's load."""
    walls, cpus, answer = [], [], None
    load_before = os.getloadavg()[0]
    for _ in range(runs):
        started, cpu = time.perf_counter(), cpu_seconds()
        answer = run()
        walls.append(time.perf_counter() - started)
        cpus.append(cpu_seconds() - cpu)
    assert answer is not None
    timing = {
        "p50_s": statistics.median(walls),
        "min_s": min(walls),
        "first_s": walls[0],
        "cpu_p50_s": statistics.median(cpus),
        "load_1min": [load_before, os.getloadavg()[0]],
    }
    return timing, answer


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


# ----- alternatives (DuckDB) ------------------------------------------------------------------------------
def run_sql(
    connection: duckdb.DuckDBPyConnection, compiled: CompiledPlan, sql: str, parameters: dict[str, Any]
) -> Answer:
    cursor = connection.cursor()
    try:
        for candidates in compiled.candidates:
            cursor.register(candidates.name, candidates.table)
        answer: Answer = compiled.answer(cursor.execute(sql, parameters).fetchall())
        return answer
    finally:
        cursor.close()


def alternatives(plan: Aggregation, path: Path) -> dict[str, tuple[CompiledPlan, str, dict[str, Any]]]:
    """Other exact forms of the same plan: the candidate **join** instead of ``list_extract``; every
    correction looked up on every row (**unguarded**, no static analysis); ``SUM(CAST(v AS DECIMAL(38,
    0)))`` instead of ``SUM(BIGINT)`` (**decimal_sum**); ``LEAST(GREATEST(x, low), high)`` instead of the
    CASE clip (**least_greatest**)."""
    compiled = compile_plan(plan, snapshot_kinds(path))
    parameters: dict[str, Any] = compiled.duckdb_parameters(path)
    out: dict[str, tuple[CompiledPlan, str, dict[str, Any]]] = {
        "join": (compiled, compiled.duckdb_join_sql, {"path": str(path)}),
        "decimal_sum": (
            compiled,
            re.sub(r"SUM\((.*?)\) AS (s\d+)", r"SUM(CAST(\1 AS DECIMAL(38, 0))) AS \2", compiled.duckdb_sql),
            parameters,
        ),
        "least_greatest": (
            compiled,
            re.sub(
                r"CASE WHEN (\"\w+\") < (CAST\('[^']+' AS DOUBLE\)) THEN \2 "
                r"WHEN \1 > (CAST\('[^']+' AS DOUBLE\)) THEN \3 ELSE \1 END",
                r"LEAST(GREATEST(\1, \2), \3)",
                compiled.duckdb_sql,
            ),
            parameters,
        ),
    }
    if plan.keys and any(key.bucket is not None for key in plan.keys):
        unguarded = Corrections(True, None, True, None)
        with patch("service.engines.compile.bucket_corrections", lambda *args: unguarded):
            compile_module._compile.cache_clear()
            plain = compile_plan(plan, snapshot_kinds(path))
        compile_module._compile.cache_clear()
        out["unguarded"] = (plain, plain.duckdb_sql, plain.duckdb_parameters(path))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=100_000_000)
    parser.add_argument("--spark-rows", type=int, default=1_000_000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--alternatives", action="store_true")
    parser.add_argument("--no-spark", action="store_true")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()

    big = dataset(args.rows)
    small = dataset(args.spark_rows)
    result: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "versions": {"duckdb": duckdb.__version__, "pyarrow": pa.__version__, "numpy": np.__version__},
        "settings": {
            "rows": args.rows,
            "spark_rows": args.spark_rows,
            "runs": args.runs,
            "threads": args.threads,
            "memory_limit": "1GB",
            "file_mib": round(big.stat().st_size / 2**20),
        },
        "targets_s": TARGETS,
        "rss_target_mb": RSS_TARGET_MB,
        "rss_after_generation_mb": peak_rss_mb(),
        "duckdb": {},
        "alternatives": {},
        "spark": {},
    }
    answers: dict[str, Answer] = {}
    with tempfile.TemporaryDirectory() as spill:
        engine = DuckDBEngine(threads=args.threads, memory_limit="1GB", temp_dir=Path(spill))
        for name, plan in plans().items():
            timing, answers[name] = timed(partial(engine.aggregate, big, plan), args.runs)
            timing["target_s"] = TARGETS[name]
            timing["met"] = timing["p50_s"] <= TARGETS[name]
            result["duckdb"][name] = timing
            print(f"duckdb {name:<11} p50 {timing['p50_s']:.3f} s, cpu {timing['cpu_p50_s']:.3f} s "
                  f"(load {timing['load_1min'][0]:.1f})", flush=True)  # fmt: skip
        result["duckdb_peak_rss_mb"] = peak_rss_mb()
        if args.alternatives:
            connection = engine._connection  # the same database and settings
            for name, plan in plans().items():
                for variant, (compiled, sql, parameters) in alternatives(plan, big).items():
                    if variant == "join" and not compiled.candidates:
                        continue  # no lookup in this plan
                    timing, answer = timed(partial(run_sql, connection, compiled, sql, parameters), args.runs)
                    timing["equal"] = answer == answers[name]
                    result["alternatives"][f"{name}/{variant}"] = timing
                    label = f"{name}/{variant}"
                    print(f"alt    {label:<26} p50 {timing['p50_s']:.3f} s, cpu {timing['cpu_p50_s']:.3f} s "
                          f"equal={timing['equal']}", flush=True)  # fmt: skip
            result["peak_rss_with_alternatives_mb"] = peak_rss_mb()
        engine.close()
    result["rss_met"] = result["duckdb_peak_rss_mb"] <= RSS_TARGET_MB

    if not args.no_spark:
        from service.engines.spark_engine import SparkEngine

        spark = SparkEngine("local[2]")
        started = time.perf_counter()
        session = spark.session
        result["spark"]["startup_s"] = time.perf_counter() - started
        with tempfile.TemporaryDirectory() as spill:
            duck_small = DuckDBEngine(threads=args.threads, memory_limit="1GB", temp_dir=Path(spill))
            for name, plan in plans().items():
                timing, answer = timed(partial(spark.aggregate, small, plan), args.runs)
                timing["equal_duckdb"] = answer == duck_small.aggregate(small, plan)
                del timing["cpu_p50_s"]  # the work is in the JVM, not this process
                result["spark"][name] = timing
                print(f"spark  {name:<11} p50 {timing['p50_s']:.3f} s (first {timing['first_s']:.3f} s) "
                      f"equal={timing['equal_duckdb']}", flush=True)  # fmt: skip
            duck_small.close()
        gateway = session.sparkContext._gateway
        process = getattr(gateway, "proc", None)
        if process is not None:
            status = Path(f"/proc/{process.pid}/status").read_text()
            match = re.search(r"VmHWM:\s+(\d+) kB", status)
            result["spark"]["jvm_peak_rss_mb"] = int(match.group(1)) / 1024 if match else None
        spark.close()

    print()
    print(f"{'plan':<12} {'duckdb p50 s':>12} {'cpu s':>7} {'target s':>9} {'met':>4} {'spark p50 s':>12}")
    for name in plans():
        duck = result["duckdb"][name]
        spark_p50 = result["spark"].get(name, {}).get("p50_s")
        spark_text = f"{spark_p50:>12.3f}" if spark_p50 is not None else f"{'-':>12}"
        met = "yes" if duck["met"] else "NO"
        wall, cpu, target = duck["p50_s"], duck["cpu_p50_s"], duck["target_s"]
        print(f"{name:<12} {wall:>12.3f} {cpu:>7.2f} {target:>9.1f} {met:>4} {spark_text}")
    print(f"peak RSS after DuckDB: {result['duckdb_peak_rss_mb']:.0f} MiB (target {RSS_TARGET_MB})")
    if result["spark"].get("jvm_peak_rss_mb") is not None:
        print(f"Spark JVM peak RSS: {result['spark']['jvm_peak_rss_mb']:.0f} MiB")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
