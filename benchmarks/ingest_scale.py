"""CSV upload → Parquet snapshot at scale: wall time and peak memory of ``csv_to_parquet`` (service.data).

Generates a CSV of ``--rows`` rows (default 10⁷, about 380 MB) with five columns (two float, one int, two
categorical; some values outside the declared bounds, so clipping runs) with NumPy and
``pyarrow.csv.CSVWriter``, then converts it in a fresh subprocess and reports that process's wall time and
peak RSS (``ru_maxrss``), the snapshot's size, row groups and id, and a DuckDB count over the snapshot as a
check. Each conversion runs ``--repeat`` times in a fresh process (the median is reported, every run in
``runs``; the snapshot must be the same bytes every time); the machine's load average is recorded, since
other work on the machine stretches wall times. Targets: ≤ 10 s and ≤ 1 GB peak RSS for 10⁷ rows, 2 cores.

    .venv/bin/python benchmarks/ingest_scale.py [--rows 10000000] [--repeat 3] [--work-dir D] [--output F]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUTPUT = ROOT / "benchmarks" / "results" / "ingest_scale.json"
CHUNK_ROWS = 1_000_000
SCHEMA: dict[str, Any] = {
    "columns": [
        {"name": "age", "type": "float", "min": 0, "max": 100},
        {"name": "income", "type": "float", "min": 0, "max": 250000},
        {"name": "visits", "type": "int", "min": 0, "max": 20},
        {"name": "group", "type": "categorical", "values": ["alpha", "beta", "gamma", "delta"]},
        {"name": "region", "type": "categorical", "values": ["north", "south", "east", "west", "centre"]},
    ],
    "neighboring": "replace_one",
}


def _categories(rng: np.random.Generator, values: list[str], n: int) -> pa.Array:
    codes = pa.array(rng.integers(0, len(values), n).astype(np.int32))
    return pa.DictionaryArray.from_arrays(codes, pa.array(values)).dictionary_decode()


def generate(path: Path, rows: int, seed: int = 0) -> None:
    """Write the CSV chunk by chunk (vectorised; CSVWriter quotes the strings)."""
    rng = np.random.default_rng(seed)
    columns = SCHEMA["columns"]
    types = [pa.float64(), pa.float64(), pa.int64(), pa.string(), pa.string()]
    arrow = pa.schema([(c["name"], t) for c, t in zip(columns, types, strict=True)])
    with pcsv.CSVWriter(path, arrow) as writer:
        for start in range(0, rows, CHUNK_ROWS):
            n = min(CHUNK_ROWS, rows - start)
            arrays = [
                pa.array(np.round(rng.uniform(-10, 110, n), 4)),
                pa.array(np.round(rng.lognormal(10, 1, n), 5)),
                pa.array(rng.integers(-2, 25, n)),
                _categories(rng, list(columns[3]["values"]), n),
                _categories(rng, list(columns[4]["values"]), n),
            ]
            writer.write_batch(pa.record_batch(arrays, schema=arrow))


def child(csv_path: Path, work_dir: Path) -> None:
    """Run in the measured subprocess: convert and print the result as JSON."""
    sys.path.insert(0, str(ROOT))
    from mechanisms.data.schema import DatasetSchema
    from service.data.ingest import csv_to_parquet

    started = time.perf_counter()
    result = csv_to_parquet(csv_path, DatasetSchema.model_validate(SCHEMA), work_dir)
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    report = {"seconds_in_process": seconds, "peak_rss_mib": peak, "n_rows": result.n_rows}
    print(
        json.dumps({**report, "clipped": result.clipped, "sha256": result.sha256, "path": str(result.path)})
    )


def check(path: Path) -> dict[str, Any]:
    """Row groups (pyarrow) and a count and sums (DuckDB) of the snapshot."""
    import duckdb
    import pyarrow.parquet as pq

    metadata = pq.ParquetFile(path).metadata
    count, visits, groups = duckdb.sql(
        f"SELECT count(*), sum(visits), count(DISTINCT \"group\") FROM read_parquet('{path}')"
    ).fetchall()[0]
    return {
        "row_groups": metadata.num_row_groups,
        "rows_in_first_group": metadata.row_group(0).num_rows,
        "duckdb_count": count,
        "duckdb_sum_visits": int(visits),
        "duckdb_distinct_groups": groups,
    }


def measure(csv_path: Path, work_dir: Path) -> dict[str, Any]:
    """One conversion in a fresh subprocess: its wall time, CPU time and peak RSS."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, __file__, "--child", str(csv_path), str(work_dir)],
        check=True,
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    result = json.loads(done.stdout)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return {
        "wall_seconds": round(wall, 3),
        "seconds_in_process": round(result.pop("seconds_in_process"), 3),
        "cpu_seconds": round(cpu, 3),
        "peak_rss_mib": round(result.pop("peak_rss_mib"), 1),
        **result,
    }


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The median run's times, the largest peak RSS, the snapshot (the same bytes every run) and checks."""
    assert len({r["sha256"] for r in runs}) == 1, "every run gives the same snapshot"
    median = sorted(runs, key=lambda r: r["wall_seconds"])[len(runs) // 2]
    snapshot = Path(median["path"])
    return {
        "wall_seconds": median["wall_seconds"],
        "seconds_in_process": median["seconds_in_process"],
        "cpu_seconds": median["cpu_seconds"],
        "peak_rss_mib": max(r["peak_rss_mib"] for r in runs),
        "peak_rss_mib_rusage_children": round(
            resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, 1
        ),
        "snapshot_bytes": snapshot.stat().st_size,
        "n_rows": median["n_rows"],
        "clipped": median["clipped"],
        "sha256": median["sha256"],
        **check(snapshot),
        "runs": [
            {
                k: v
                for k, v in r.items()
                if k in ("wall_seconds", "seconds_in_process", "cpu_seconds", "peak_rss_mib")
            }
            for r in runs
        ],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--work-dir", type=Path, default=None)
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    parser.add_argument("--repeat", type=int, default=3, help="conversions measured (median reported)")
    parser.add_argument("--child", nargs=2, type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(*args.child)
        return 0
    with tempfile.TemporaryDirectory(dir=args.work_dir) as folder:
        work = Path(folder)
        csv_path = work / "upload.csv"
        started = time.perf_counter()
        generate(csv_path, args.rows)
        generated = time.perf_counter() - started
        report = {
            "benchmark": "ingest_scale",
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "machine": {
                "cpus": os.cpu_count(),
                "python": platform.python_version(),
                "pyarrow": pa.__version__,
                "load_average_1min_before": round(os.getloadavg()[0], 2),
            },
            "rows": args.rows,
            "csv_bytes": csv_path.stat().st_size,
            "generate_seconds": round(generated, 3),
            **summary([measure(csv_path, work) for _ in range(args.repeat)]),
        }
    report["machine"]["load_average_1min_after"] = round(os.getloadavg()[0], 2)
    report["csv_mb_per_second"] = round(report["csv_bytes"] / 1e6 / report["wall_seconds"], 1)
    report["targets_met"] = report["wall_seconds"] <= 10 and report["peak_rss_mib"] <= 1024
    print(json.dumps(report, indent=2))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
