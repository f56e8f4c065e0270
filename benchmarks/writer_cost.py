"""The group-commit writer's own cost per cheap request, on PostgreSQL: CPU and wall time per job.

A filter row's throughput is bounded by what the writer does per job while it holds the row's lock, and
the end-to-end benchmarks (``service_load.py``) vary by 10–40 % between runs on a shared machine. This one
isolates the writer: batches of ``--batch-sizes`` one-transaction jobs (the API's cheap Laplace count:
admit + reserve, the run, commit + release, both ledger entries, the batch's statements and its commit),
built by ``WriteBatcher._one_transaction`` and applied by ``WriteBatcher._apply`` in this thread, with no
event loop and no HTTP. It reports this thread's CPU and the wall time per job. To compare two revisions,
run the script from both checkouts in alternation (the machine's speed drifts within minutes; compare
runs made next to each other).

Checked afterwards: every job committed, the dataset's pure slot holds exactly (jobs) × 1e-6 ε in units
with nothing reserved, and ``expost ledger verify`` exits 0.

    .venv/bin/python benchmarks/writer_cost.py [--batches 200] [--batch-sizes 1 8 20] [--output FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUTPUT = ROOT / "benchmarks" / "results" / "writer_cost.json"


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.path.insert(0, str(ROOT))
    import service_load as load
    from pg_database import DEFAULT_URL, fresh_database

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", type=int, default=200, help="measured batches per batch size")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 20], help="jobs per batch")
    parser.add_argument("--postgres-url", default=DEFAULT_URL, help="server to create the database on")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="JSON results")
    args = parser.parse_args(argv)
    if args.batches < 1 or min(args.batch_sizes) < 1:
        parser.error("need --batches ≥ 1 and batch sizes ≥ 1")

    scratch = tempfile.TemporaryDirectory(prefix="expost-writer-")
    with scratch as tmp, fresh_database(args.postgres_url) as url:
        workdir = Path(tmp)
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("EXPOST_")},
            "PYTHONPATH": str(ROOT),
            "EXPOST_DATABASE_URL": url,
            "EXPOST_DATA_DIR": str(workdir / "data"),
            "EXPOST_LOG_LEVEL": "INFO",
            "EXPOST_LOG_JSON": "true",
            "EXPOST_RATE_LIMIT": "",
        }
        load.cli(env, workdir, "migrate")
        admin_key = load.create_key(env, workdir, "admin")
        load.create_key(env, workdir, "analyst")  # "load-analyst", granted below
        server = load.Server(env, workdir, 1, tag="writer-cost-")
        try:
            server.wait_ready()
            dataset_id = load.setup_dataset(server.base_url, admin_key, "load-analyst")
        finally:
            server.stop()
        rows, budget = measure(url, workdir / "data", dataset_id, args)
        verify = subprocess.run(
            [load.EXPOST, "ledger", "verify"],
            env=env,
            cwd=workdir,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )

    result = {
        "benchmark": "writer_cost",
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "source_digest": load.source_digest(ROOT / "service"),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "batches": args.batches,
        "rows": rows,
        "budget": budget,
        "ledger_verify": {"exit": verify.returncode, "output": verify.stdout.strip()[-300:]},
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    for row in rows:
        print(
            f"batch {row['batch_size']:3d}: writer CPU {row['cpu_us_per_job']:7.0f} µs/job, "
            f"wall {row['wall_us_per_job']:7.0f} µs/job"
        )
    print(f"spent = jobs × charge: {budget['ok']}  ledger verify: exit {verify.returncode}")
    print(f"written: {args.output}")
    return 0 if budget["ok"] and verify.returncode == 0 else 1


def measure(
    url: str, data_dir: Path, dataset_id: str, args: argparse.Namespace
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Apply the batches in this thread; per batch size, this thread's CPU and the wall time per job."""
    import service_load as load

    from mechanisms.accounting import UnitsVector
    from service.app import build_runtime
    from service.auth import Principal, Role
    from service.config import Settings
    from service.logs import configure_logging
    from service.runs import requests
    from service.store.repositories import FilterRepository

    configure_logging("WARNING", True)
    runtime = build_runtime(Settings(database_url=url, data_dir=data_dir))
    analyst = Principal("load-analyst", Role.analyst)
    params = load.request_body("laplace")["params"]
    try:
        # one request through the API's path fills the process caches (dataset row, grant, table)
        submission = requests.Submission(analyst, dataset_id, "laplace", params, None)
        cheap = requests.submit_one_transaction(runtime, submission)
        first = asyncio.run(cheap)
        if first is None:
            requests.submit(runtime, submission)
        validated = requests._cached_validation(runtime, analyst, dataset_id, "laplace", params)
        assert validated is not None, "the cheap path did not apply"
        writer = runtime.writer

        def batch(size: int) -> list[Any]:
            run = requests._inline_run(runtime, validated)
            return [writer._one_transaction(analyst, validated, None, 30.0, run) for _ in range(size)]

        jobs, rows = 1, []
        for size in args.batch_sizes:
            for _ in range(5):  # warm-up: statement caches, prepared statements
                writer._apply(batch(size))
            cpu = wall = 0.0
            for _ in range(args.batches):
                jobs_of_batch = batch(size)
                cpu0, wall0 = time.thread_time(), time.perf_counter()
                outcomes = writer._apply(jobs_of_batch)
                cpu += time.thread_time() - cpu0
                wall += time.perf_counter() - wall0
                failed = [error for _, error in outcomes if error is not None]
                assert not failed, failed[:3]
            jobs += size * (args.batches + 5)
            measured = size * args.batches
            rows.append(
                {
                    "batch_size": size,
                    "jobs": measured,
                    "cpu_us_per_job": 1e6 * cpu / measured,
                    "wall_us_per_job": 1e6 * wall / measured,
                }
            )
        with runtime.sessions() as session:
            row = FilterRepository(session).get(dataset_id)
            assert row is not None
            spent, reserved = UnitsVector.from_json(row.spent), UnitsVector.from_json(row.reserved)
    finally:
        runtime.close()
    spent_units = spent.finite[len(spent) - 1]
    ok = spent_units == jobs * load.REQUEST_UNITS and not any(reserved.finite)
    return rows, {
        "ok": ok,
        "pure_spent_units": spent_units,
        "expected_units": jobs * load.REQUEST_UNITS,
        "jobs": jobs,
    }


if __name__ == "__main__":
    raise SystemExit(main())
