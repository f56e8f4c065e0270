"""The direct submit route against the FastAPI route, on two real servers at once, in alternation.

Two ``expost serve`` processes (one process each) on one fresh PostgreSQL database, the same code, one with
``EXPOST_DIRECT_SUBMIT=true`` (the default: ``service/api/direct.py`` answers valid submissions) and one
with ``false`` (every submission through the FastAPI route). ``--rounds`` times, each server in turn (the
order alternating) gets ``--window`` seconds of cheap Laplace ``POST``s from ``--clients`` closed-loop
clients (``service_load.run_load``). Both servers see the same stretch of the machine's drifting speed,
so the paired differences are what to read: server CPU per request and request rate.

Checked afterwards: every response 200 and committed, the dataset's pure slot holds exactly releases × 1e-6
ε in units with nothing reserved, and ``expost ledger verify`` exits 0.

    .venv/bin/python benchmarks/direct_submit_ab.py [--rounds 8] [--window 4] [--output FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUTPUT = ROOT / "benchmarks" / "results" / "direct_submit_ab.json"
ROUTES = {"direct": "true", "fastapi": "false"}


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import service_load as load
    from pg_database import DEFAULT_URL, fresh_database

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=8, help="windows per server, alternated")
    parser.add_argument("--window", type=float, default=4.0, help="measured seconds per window")
    parser.add_argument("--clients", type=int, default=32, help="concurrent closed-loop clients")
    parser.add_argument("--postgres-url", default=DEFAULT_URL, help="server to create the database on")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="JSON results")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.window <= 0 or args.clients < 1:
        parser.error("need --rounds ≥ 1, --window > 0 and --clients ≥ 1")

    windows: dict[str, list[dict[str, Any]]] = {route: [] for route in ROUTES}
    with tempfile.TemporaryDirectory(prefix="expost-ab-") as tmp, fresh_database(args.postgres_url) as url:
        workdir = Path(tmp)
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("EXPOST_")},
            "PYTHONPATH": str(ROOT),
            "EXPOST_DATABASE_URL": url,
            "EXPOST_DATA_DIR": str(workdir / "data"),
            "EXPOST_LOG_LEVEL": "INFO",
            "EXPOST_LOG_JSON": "true",
            "EXPOST_RATE_LIMIT": "",
            "EXPOST_RATE_LIMIT_REPORTS": "",
        }
        load.cli(env, workdir, "migrate")
        keys = {role: load.create_key(env, workdir, role) for role in ("admin", "analyst")}
        servers = {
            route: load.Server({**env, "EXPOST_DIRECT_SUBMIT": flag}, workdir, 1, tag=route)
            for route, flag in ROUTES.items()
        }
        try:
            for server in servers.values():
                server.wait_ready()
            dataset_id = load.setup_dataset(servers["direct"].base_url, keys["admin"], "load-analyst")
            headers = {"Authorization": f"Bearer {keys['analyst']}"}
            releases = 0
            for i in range(args.rounds):
                for route in ROUTES if i % 2 == 0 else reversed(ROUTES):
                    m = asyncio.run(
                        load.run_load(
                            servers[route],
                            "POST /v1/datasets/{id}/requests",
                            "POST",
                            f"/v1/datasets/{dataset_id}/requests",
                            headers,
                            load.request_body("laplace"),
                            load.committed,
                            args.clients,
                            1.0,
                            args.window,
                        )
                    )
                    releases += m.total_sent - m.failures
                    windows[route].append(
                        {
                            "requests_per_s": m.requests_per_s,
                            "p50_ms": m.p50_ms,
                            "p99_ms": m.p99_ms,
                            "server_cpu_ms_per_request": 1000 * m.server_cpu_cores / m.requests_per_s,
                            "client_cpu_cores": m.client_cpu_cores,
                            "machine_cpu_cores": m.machine_cpu_cores,
                            "failures": m.failures,
                        }
                    )
            budget = load.check_budget(servers["direct"].base_url, keys["admin"], dataset_id, releases)
            log_errors = load.server_errors(*(s.log_path for s in servers.values()))
        finally:
            for server in servers.values():
                server.stop()
        verify = subprocess.run(
            [load.EXPOST, "ledger", "verify"],
            env=env,
            cwd=workdir,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )

    def paired(key: str, op: Any) -> list[float]:
        return [op(d[key], f[key]) for d, f in zip(windows["direct"], windows["fastapi"], strict=True)]

    cpu_diff = paired("server_cpu_ms_per_request", lambda d, f: d - f)
    rate_ratio = paired("requests_per_s", lambda d, f: d / f)
    summary = {
        route: {
            key: statistics.median(w[key] for w in rows)
            for key in ("requests_per_s", "server_cpu_ms_per_request", "p50_ms", "p99_ms")
        }
        for route, rows in windows.items()
    }
    ok = (
        budget["ok"]
        and verify.returncode == 0
        and not log_errors
        and all(w["failures"] == 0 for rows in windows.values() for w in rows)
    )
    report = {
        "benchmark": "direct_submit_ab",
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {"cpu_count": os.cpu_count(), "python": platform.python_version()},
        "service_sha256": load.source_digest(ROOT / "service"),
        "settings": {"rounds": args.rounds, "window_s": args.window, "clients": args.clients},
        "windows": windows,
        "medians": summary,
        "paired_cpu_ms_difference": {
            "values": cpu_diff,
            "median": statistics.median(cpu_diff),
            "direct_lower": sum(x < 0 for x in cpu_diff),
        },
        "paired_rate_ratio": {"values": rate_ratio, "median": statistics.median(rate_ratio)},
        "budget": budget,
        "server_log_errors": log_errors,
        "ledger_verify": {"exit_code": verify.returncode, "output": verify.stdout.strip()[-300:]},
        "ok": ok,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    for route, medians in summary.items():
        print(
            f"{route:8} POST {medians['requests_per_s']:6.1f}/s  server CPU "
            f"{medians['server_cpu_ms_per_request']:.2f} ms/request  p50 {medians['p50_ms']:.0f} ms  "
            f"p99 {medians['p99_ms']:.0f} ms  (medians of {args.rounds} windows)"
        )
    lower = sum(x < 0 for x in cpu_diff)
    print(
        f"paired, direct - fastapi: CPU {statistics.median(cpu_diff):+.2f} ms/request (lower in "
        f"{lower}/{len(cpu_diff)} pairs), rate × {statistics.median(rate_ratio):.3f}"
    )
    print(f"spent = releases × charge: {budget['ok']}  ledger verify: exit {verify.returncode}  ok: {ok}")
    print(f"written: {args.output}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
