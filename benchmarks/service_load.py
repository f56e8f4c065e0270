"""Service load and scale-out: throughput and latency of the real server and queue workers, on PostgreSQL.

Three sections, each on a fresh PostgreSQL database (migrated and keyed with the real CLI), with a
closed-loop load generator (asyncio, one keep-alive ``httpx.AsyncClient`` per loop, ``--clients``
concurrent loops) running for ``--warmup`` then ``--duration`` seconds:

1. **API processes** (``--processes``, default 1 2 4): ``expost serve --workers N``, in-process executor.
   (a) ``GET /healthz``: no authentication, no database: the ceiling of the same app and server stack;
   (b) ``POST /v1/datasets/{id}/requests``: a cheap Laplace count (ε = 1e-6, against a pure budget of
       ε = 1e6, so nothing is refused), run inline: authentication, validation, then one group-commit
       transaction (``SELECT … FOR UPDATE`` on the filter rows, admission + reservation, the run, commit +
       release, both ledger entries).
2. **Queue workers** (``--workers``, default 1 2 4): one API process with ``EXPOST_EXECUTOR=queue`` and N
   ``expost worker --queue --threads 1`` processes (Dramatiq on Redis). Heavy requests: ``bench.busy_count``
   burns ``--busy`` seconds of one core (CPU-bound; pure Python, holds the GIL) and ``bench.sleepy_count``
   waits ``--busy`` seconds (I/O-bound), then releases a Laplace count. Clients: ``--heavy-clients``, each
   POSTs and gets the release in the same response (the API waits for the worker's commit).
3. **One filter row vs many** (at the smallest and the largest ``--processes``): cheap requests all on one
   dataset vs spread over ``--datasets`` datasets (client i uses dataset i mod D): how far one filter row
   goes; then the same filter row without HTTP (``run_filter_row``: ``--clients`` tasks on the event loops
   of one process, then of max(``--processes``) processes, call the API's cheap-request path,
   ``service.runs.requests.submit_one_transaction``), reported as ``filter_rows`` with the processes' CPU.

Scaling efficiency = throughput(k) / (k · throughput(1)). Only requests completed inside the measured window
count. Every request response must be 200 and ``committed``; afterwards every dataset's budget must show
exactly (number of releases) × 1e-6 spent and nothing reserved, and ``expost ledger verify`` must exit 0.
The load generator, PostgreSQL, Redis and the workers share the machine (``cpu_count`` and the load
average are recorded), so on a small machine they compete for CPU. Rate limits are off for the run.

    .venv/bin/python benchmarks/service_load.py [--duration 10] [--warmup 3] [--clients 32] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import platform
import re
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
EXPOST = str(Path(sys.executable).with_name("expost"))
# Server and worker processes run the real CLI through this script, which first adds the two benchmark
# mechanisms (bench.busy_count, bench.sleepy_count) to the catalog of that process only.
EXPOST_CMD = [sys.executable, str(Path(__file__).resolve()), "--as-expost"]
REDIS_URL = os.environ.get("EXPOST_BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")
DEFAULT_OUTPUT = ROOT / "benchmarks" / "results" / "service_load.json"
CLK_TCK = os.sysconf("SC_CLK_TCK")
REQUEST_EPSILON = 1e-6
TLS = ssl.create_default_context()  # unused on http://, but httpx builds one per client unless given (~30 ms)
UNITS_PER_EPSILON = 10**12  # the ledger's fixed point (mechanisms.accounting.UNITS_PER_EPSILON)
REQUEST_UNITS = 10**6  # 1e-6 ε in units: exact

SCHEMA = {
    "columns": [
        {"name": "age", "type": "float", "min": 18, "max": 90},
        {"name": "income", "type": "float", "min": 0, "max": 100000},
        {"name": "region", "type": "categorical", "values": ["north", "south", "east", "west"]},
    ],
    "neighboring": "replace_one",
}
CSV = b"age,income,region\n" + b"".join(
    f"{20 + (i % 60)},{1000 * (i % 97)},{['north', 'south', 'east', 'west'][i % 4]}\n".encode()
    for i in range(1000)
)


# ----- the server process ----------------------------------------------------------------------------


def cli(env: dict[str, str], cwd: Path, *args: str) -> str:
    done = subprocess.run(
        [EXPOST, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=300, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"expost {' '.join(args)} exited {done.returncode}: {done.stderr or done.stdout}")
    return done.stdout


def create_key(env: dict[str, str], cwd: Path, role: str) -> str:
    """``expost keys create`` prints the new key once, on its last line."""
    return cli(env, cwd, "keys", "create", "--role", role, "--name", f"load-{role}").split()[-1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def machine_busy_seconds() -> float:
    """CPU seconds spent not idle by the whole machine (all processes, PostgreSQL included)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / CLK_TCK


def cpu_seconds(pid: int) -> float:
    """utime + stime of one process (0 if it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


class Server:
    """``expost serve`` in its own process group; ``stop()`` terminates the group, then kills it."""

    def __init__(self, env: dict[str, str], workdir: Path, processes: int, tag: str = "") -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / f"server-{tag}{processes}.log"
        self.processes = processes
        with self.log_path.open("wb") as log:
            command = [
                *EXPOST_CMD,
                "serve",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--workers",
                str(processes),
            ]
            self.proc = subprocess.Popen(
                command,
                env=env,
                cwd=workdir,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def wait_ready(self, timeout: float = 60) -> None:
        """/readyz answers and every server process has logged its startup ("expost started", INFO).

        Clients keep their connections for the whole run, so a connection accepted while only one process
        listens stays on that process: starting the load before all are up would measure one process.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"expost serve exited {self.proc.returncode}: {self.log_tail()}")
            with contextlib.suppress(httpx.TransportError):
                ready = httpx.get(f"{self.base_url}/readyz", timeout=2).status_code == 200
                started = self.log_path.read_text(errors="replace").count("expost started")
                if ready and started >= self.processes and len(self.server_pids()) >= self.processes:
                    return
            time.sleep(0.1)
        raise RuntimeError(f"expost serve not ready after {timeout} s: {self.log_tail()}")

    def connections_per_process(self) -> dict[str, int]:
        """Established client connections held by each server process (from ``ss``; empty if missing)."""
        try:
            out = subprocess.run(
                ["ss", "-tnpH", "state", "established", f"( sport = :{self.port} )"],
                capture_output=True,
                text=True,
                timeout=10,
                check=False,
            ).stdout
        except (OSError, subprocess.TimeoutExpired):
            return {}
        counts = {str(pid): 0 for pid in self.server_pids()}
        for pid in re.findall(r"pid=(\d+)", out):
            if pid in counts:
                counts[pid] += 1
        return counts

    def server_pids(self) -> list[int]:
        """The processes that serve requests: the workers under a supervisor, or the process itself."""
        if self.processes == 1:
            return [self.proc.pid]
        return [pid for pid in children(self.proc.pid) if _is_server(pid)]

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def stop(self) -> None:
        workers = children(self.proc.pid)
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=20)
        for pid in workers:  # only stragglers still in this server's process group
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if os.getpgid(pid) == self.proc.pid:
                    os.kill(pid, signal.SIGKILL)


class Worker:
    """``expost worker --queue --threads 1`` in its own process group."""

    def __init__(self, env: dict[str, str], workdir: Path, index: int) -> None:
        self.log_path = workdir / f"worker-{index}.log"
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [*EXPOST_CMD, "worker", "--queue", "--threads", "1", "--interval", "5"],
                env=env,
                cwd=workdir,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while "worker consuming queue" not in self.log_path.read_text(errors="replace"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"worker not ready: {self.log_path.read_text(errors='replace')[-3000:]}")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=20)


def _is_server(pid: int) -> bool:
    """Skip multiprocessing helpers (e.g. the resource tracker) among the supervisor's children."""
    try:
        return b"resource_tracker" not in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


# ----- the load generator ----------------------------------------------------------------------------


@dataclass
class Measurement:
    endpoint: str
    processes: int
    clients: int
    duration_s: float
    requests: int  # completed inside the measured window
    requests_per_s: float
    p50_ms: float
    p99_ms: float
    mean_ms: float
    max_ms: float
    total_sent: int  # warm-up included
    failures: int  # responses that failed the endpoint's check (all, warm-up included)
    failure_examples: list[str] = field(default_factory=list)
    server_cpu_cores: float = 0.0  # server CPU seconds per wall second, over the measured window
    server_cpu_cores_per_process: list[float] = field(default_factory=list)
    client_cpu_cores: float = 0.0
    loadavg_1min_after: float = 0.0  # other work on the machine shows up here
    connections_per_process: dict[str, int] = field(default_factory=dict)  # pid -> client connections
    machine_cpu_cores: float = 0.0  # busy cores of the whole machine (server, client, PostgreSQL, others)
    section: str = "api"  # api | queue | datasets
    workers: int = 0  # queue workers (section queue)
    datasets: int = 1  # datasets the clients spread over
    worker_cpu_cores_per_process: list[float] = field(default_factory=list)


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list."""
    if not sorted_values:
        return float("nan")
    rank = max(1, min(len(sorted_values), round(q / 100 * len(sorted_values) + 0.5)))
    return sorted_values[rank - 1]


async def run_load(
    server: Server,
    endpoint: str,
    method: str,
    path: str | Callable[[int], str],
    headers: dict[str, str],
    body: Any | None,
    check: Callable[[httpx.Response], bool],
    clients: int,
    warmup: float,
    duration: float,
    extra_pids: list[int] | None = None,
) -> Measurement:
    latencies: list[float] = []
    sent = failures = 0
    examples: list[str] = []
    cpu: dict[str, Any] = {}
    start = time.perf_counter()
    window_start, window_end = start + warmup, start + warmup + duration

    async def loop(i: int) -> None:
        """One client: its own keep-alive connection (a shared httpcore pool costs O(n) per request).

        Clients connect one by one (staggered over the first part of the warm-up): a burst of connects is
        accepted by whichever server process wakes first (asyncio accepts a whole backlog per wake-up),
        which can leave another process without connections for the whole run.
        """
        nonlocal sent, failures
        await asyncio.sleep(i * min(0.05, warmup / (2 * clients)))
        limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
        target = path(i) if callable(path) else path
        async with httpx.AsyncClient(
            base_url=server.base_url, headers=headers, limits=limits, timeout=120, verify=TLS
        ) as client:
            while (begin := time.perf_counter()) < window_end:  # bounded by the clock
                response = await client.request(method, target, json=body)
                end = time.perf_counter()
                sent += 1
                if not check(response):
                    failures += 1
                    if len(examples) < 5:
                        examples.append(f"{response.status_code} {response.text[:300]}")
                elif window_start <= end <= window_end:
                    latencies.append(end - begin)

    async def sample_cpu() -> None:
        pids = server.server_pids()
        others = extra_pids or []
        await asyncio.sleep(max(0.0, window_start - time.perf_counter()))
        cpu["before"] = [cpu_seconds(p) for p in pids], time.process_time(), time.perf_counter()
        cpu["workers_before"] = [cpu_seconds(p) for p in others]
        cpu["machine_before"] = machine_busy_seconds()
        cpu["connections"] = server.connections_per_process()
        await asyncio.sleep(max(0.0, window_end - time.perf_counter()))
        cpu["after"] = [cpu_seconds(p) for p in pids], time.process_time(), time.perf_counter()
        cpu["workers_after"] = [cpu_seconds(p) for p in others]
        cpu["machine_after"] = machine_busy_seconds()
        cpu["loadavg"] = os.getloadavg()[0]

    await asyncio.gather(sample_cpu(), *(loop(i) for i in range(clients)))
    (server_before, client_before, t0), (server_after, client_after, t1) = cpu["before"], cpu["after"]
    wall = t1 - t0
    per_process = [(b - a) / wall for a, b in zip(server_before, server_after, strict=True)]
    latencies.sort()
    return Measurement(
        endpoint=endpoint,
        processes=server.processes,
        clients=clients,
        duration_s=duration,
        requests=len(latencies),
        requests_per_s=len(latencies) / duration,
        p50_ms=1000 * percentile(latencies, 50),
        p99_ms=1000 * percentile(latencies, 99),
        mean_ms=1000 * sum(latencies) / max(1, len(latencies)),
        max_ms=1000 * (latencies[-1] if latencies else 0.0),
        total_sent=sent,
        failures=failures,
        failure_examples=examples,
        server_cpu_cores=sum(per_process),
        server_cpu_cores_per_process=per_process,
        client_cpu_cores=(client_after - client_before) / wall,
        loadavg_1min_after=cpu["loadavg"],
        connections_per_process=cpu["connections"],
        machine_cpu_cores=(cpu["machine_after"] - cpu["machine_before"]) / wall,
        worker_cpu_cores_per_process=[
            (b - a) / wall for a, b in zip(cpu["workers_before"], cpu["workers_after"], strict=True)
        ],
    )


def committed(response: httpx.Response) -> bool:
    if response.status_code != 200:
        return False
    body = response.json()
    return bool(body.get("state") == "committed" and body.get("release") is not None)


# ----- one configuration -------------------------------------------------------------------------------


def client_for(base_url: str, key: str) -> httpx.Client:
    return httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def setup_dataset(base_url: str, admin_key: str, analyst: str) -> str:
    with client_for(base_url, admin_key) as admin:
        created = admin.post(
            "/v1/datasets",
            files={"file": ("load.csv", CSV, "text/csv")},
            data={"schema": json.dumps(SCHEMA), "name": "load benchmark"},
        )
        created.raise_for_status()
        dataset_id: str = created.json()["id"]
        admin.post(f"/v1/datasets/{dataset_id}/grants", json={"analyst": analyst}).raise_for_status()
        admin.put(f"/v1/datasets/{dataset_id}/budget", json={"epsilon": 1e6, "delta": 0.0}).raise_for_status()
    return dataset_id


def check_budget(base_url: str, admin_key: str, dataset_id: str, releases: int) -> dict[str, Any]:
    """The filter's pure slot must hold exactly ``releases`` × 1e-6 and nothing reserved."""
    with client_for(base_url, admin_key) as admin:
        view = admin.get(f"/v1/datasets/{dataset_id}/budget").json()
    expected = releases * REQUEST_UNITS / UNITS_PER_EPSILON
    ok = view["pure"]["spent"] == expected and view["pure"]["reserved"] == 0.0
    return {
        "ok": ok,
        "pure_spent": view["pure"]["spent"],
        "expected_spent": expected,
        "pure_reserved": view["pure"]["reserved"],
    }


def request_body(mechanism: str) -> dict[str, Any]:
    return {"mechanism": mechanism, "params": {"query": {"kind": "count"}, "epsilon": REQUEST_EPSILON}}


def server_errors(*logs: Path) -> list[str]:
    lines = [
        line
        for log in logs
        for line in log.read_text(errors="replace").splitlines()
        if "Traceback" in line or "unhandled error" in line or "mechanism failed" in line
    ]
    return lines[:20]


def run_api_configuration(
    env: dict[str, str],
    workdir: Path,
    processes: int,
    keys: dict[str, str],
    args: argparse.Namespace,
) -> tuple[list[Measurement], dict[str, Any]]:
    """Section 1: the healthz ceiling and cheap requests with ``processes`` API processes."""
    server = Server(env, workdir, processes)
    try:
        server.wait_ready()
        dataset_id = setup_dataset(server.base_url, keys["admin"], "load-analyst")
        # (a) the no-op ceiling, (b) the cheap request: run_load's endpoint arguments
        endpoints: list[tuple[str, str, str, dict[str, str], Any, Callable[[httpx.Response], bool]]] = [
            ("GET /healthz", "GET", "/healthz", {}, None, lambda r: r.status_code == 200),
            (
                "POST /v1/datasets/{id}/requests",
                "POST",
                f"/v1/datasets/{dataset_id}/requests",
                {"Authorization": f"Bearer {keys['analyst']}"},
                request_body("laplace"),
                committed,
            ),
        ]

        def windows(warmup: float, duration: float) -> list[Measurement]:
            return [
                asyncio.run(run_load(server, *endpoint, args.clients, warmup, duration))
                for endpoint in endpoints
            ]

        ceiling, requests = windows(args.warmup, args.duration)
        releases = requests.total_sent - requests.failures
        interleaved = []
        for _ in range(args.ratio_rounds):  # short windows, alternated: both see the same machine speed
            pair = windows(1.0, args.ratio_window)
            releases += pair[1].total_sent - pair[1].failures
            interleaved.append(
                {
                    "healthz_per_s": pair[0].requests_per_s,
                    "requests_per_s": pair[1].requests_per_s,
                    "failures": pair[0].failures + pair[1].failures,
                }
            )
        budget = check_budget(server.base_url, keys["admin"], dataset_id, releases)
        ceilings, reals = (sum(r[key] for r in interleaved) for key in ("healthz_per_s", "requests_per_s"))
        check = {
            "section": "api",
            "processes": processes,
            "releases": releases,
            "budget": budget,
            "server_log_errors": server_errors(server.log_path),
            "interleaved_rounds": interleaved,
            "interleaved_ratio": reals / ceilings if ceilings else None,
        }
        return [ceiling, requests], check
    finally:
        server.stop()


def run_datasets_configuration(
    env: dict[str, str],
    workdir: Path,
    processes: int,
    datasets: int,
    keys: dict[str, str],
    args: argparse.Namespace,
) -> tuple[Measurement, dict[str, Any]]:
    """Section 3: cheap requests spread over ``datasets`` filter rows."""
    server = Server(env, workdir, processes, tag=f"datasets{datasets}-")
    try:
        server.wait_ready()
        ids = [setup_dataset(server.base_url, keys["admin"], "load-analyst") for _ in range(datasets)]
        measured = asyncio.run(
            run_load(
                server,
                f"POST requests over {datasets} dataset(s)",
                "POST",
                lambda i: f"/v1/datasets/{ids[i % datasets]}/requests",
                {"Authorization": f"Bearer {keys['analyst']}"},
                request_body("laplace"),
                committed,
                args.clients,
                args.warmup,
                args.duration,
            )
        )
        measured.section, measured.datasets = "datasets", datasets
        with client_for(server.base_url, keys["admin"]) as admin:
            spent = sum(admin.get(f"/v1/datasets/{d}/budget").json()["pure"]["spent"] for d in ids)
        releases = measured.total_sent - measured.failures
        expected = releases * REQUEST_UNITS / UNITS_PER_EPSILON
        budget = {
            "ok": abs(spent - expected) < 1e-12 * max(1, releases),
            "pure_spent": spent,
            "expected_spent": expected,
        }
        check = {
            "section": "datasets",
            "datasets": datasets,
            "releases": releases,
            "budget": budget,
            "server_log_errors": server_errors(server.log_path),
        }
        return measured, check
    finally:
        server.stop()


def run_filter_row(
    env: dict[str, str],
    workdir: Path,
    keys: dict[str, str],
    args: argparse.Namespace,
    processes: int = 1,
) -> dict[str, Any]:
    """Section 3b: how many requests one filter row admits and commits per second, without HTTP.

    ``processes`` processes (each its own runtime: engine, group-commit writer) run ``args.clients`` tasks
    in all, split between their event loops, on the same dataset; each task calls the API's path for a
    cheap request, ``service.runs.requests.submit_one_transaction`` (validation, the group-commit
    writer's one-transaction path: admit + reserve, run the Laplace count, commit + release, ledger append)
    for ``--duration`` seconds against the same PostgreSQL database. This is the capacity of one dataset's
    filter row (its lock, its ledger chain) that a shard of the scale-out plan must carry, as API processes
    share it in production; the HTTP stack in front of it is measured by the other rows. Checked
    afterwards: the filter's pure slot holds exactly releases × 1e-6 ε in units and nothing reserved
    (``ledger verify`` runs on the whole database at the end).
    """
    import multiprocessing

    from mechanisms.accounting import UnitsVector
    from service.app import build_runtime
    from service.config import Settings
    from service.store.repositories import FilterRepository

    server = Server(env, workdir, 1, tag="filter-row-")
    try:
        server.wait_ready()
        dataset_id = setup_dataset(server.base_url, keys["admin"], "load-analyst")
    finally:
        server.stop()
    shares = [args.clients // processes + (i < args.clients % processes) for i in range(processes)]
    start = time.time() + 3.0  # every process starts its clients at this moment (after its imports)
    jobs = [
        (
            env["EXPOST_DATABASE_URL"],
            env["EXPOST_DATA_DIR"],
            dataset_id,
            share,
            args.warmup,
            args.duration,
            start,
        )
        for share in shares
    ]
    with multiprocessing.get_context("spawn").Pool(processes) as pool:
        pending = pool.starmap_async(_filter_row_process, jobs)
        time.sleep(max(0.0, start + args.warmup - time.time()))
        machine0, t0 = machine_busy_seconds(), time.perf_counter()
        time.sleep(max(0.0, start + args.warmup + args.duration - time.time()))
        machine_cores = (machine_busy_seconds() - machine0) / (time.perf_counter() - t0)
        parts = pending.get(timeout=600)
    settings = Settings(database_url=env["EXPOST_DATABASE_URL"], data_dir=Path(env["EXPOST_DATA_DIR"]))
    runtime = build_runtime(settings)
    with runtime.sessions() as session:
        row = FilterRepository(session).get(dataset_id)
        assert row is not None
        spent, reserved = UnitsVector.from_json(row.spent), UnitsVector.from_json(row.reserved)
    runtime.close()
    releases = sum(part["sent"] - part["failures"] for part in parts)
    latencies = sorted(x for part in parts for x in part["latencies"])
    pure = len(spent) - 1
    spent_units = spent.finite[pure]
    rate = len(latencies) / args.duration
    process_cores = sum(part["cpu_seconds"] for part in parts) / args.duration
    return {
        "section": "datasets",
        "endpoint": "filter row (in process, no HTTP)",
        "processes": processes,
        "tasks": args.clients,
        "duration_s": args.duration,
        "requests": len(latencies),
        "requests_per_s": rate,
        "requests_per_process": [len(p["latencies"]) / args.duration for p in parts],
        "p50_ms": 1000 * percentile(latencies, 50),
        "p99_ms": 1000 * percentile(latencies, 99),
        "failures": sum(p["failures"] for p in parts),
        "failure_examples": [e for p in parts for e in p["examples"]][:5],
        "process_cpu_cores": process_cores,
        "machine_cpu_cores": machine_cores,
        "requests_per_process_core_s": rate / process_cores if process_cores else None,
        "writer_batches_per_s": sum(p["batches"] for p in parts) / args.duration,
        "loadavg_1min_after": os.getloadavg()[0],
        "budget": {
            "ok": spent_units == releases * REQUEST_UNITS and not any(reserved.finite),
            "pure_spent_units": spent_units,
            "expected_units": releases * REQUEST_UNITS,
            "releases": releases,
        },
    }


def _filter_row_process(
    database_url: str,
    data_dir: str,
    dataset_id: str,
    clients: int,
    warmup: float,
    duration: float,
    start: float,
) -> dict[str, Any]:
    """One process of :func:`run_filter_row`: ``clients`` tasks on its event loop from ``start`` on."""
    from service.app import build_runtime, freeze_startup_heap
    from service.auth import Principal, Role
    from service.config import Settings
    from service.logs import configure_logging
    from service.runs.requests import Submission, submit, submit_one_transaction

    configure_logging("WARNING", True)
    freeze_startup_heap()  # as every API process does at start-up, before its runtime (service.app)
    runtime = build_runtime(
        Settings(database_url=database_url, data_dir=Path(data_dir), pool_size=max(10, clients))
    )
    analyst = Principal("load-analyst", Role.analyst)
    params = request_body("laplace")["params"]
    out: dict[str, Any] = {"sent": 0, "failures": 0, "examples": [], "latencies": []}
    begin_at = time.perf_counter() + max(0.0, start - time.time())
    window_start, window_end = begin_at + warmup, begin_at + warmup + duration

    async def one() -> Any:
        """As the API runs a cheap request: on the event loop, or (a cache miss) in a thread."""
        submission = Submission(analyst, dataset_id, "laplace", params, None)
        request = await submit_one_transaction(runtime, submission)
        if request is None:
            request = await asyncio.to_thread(submit, runtime, submission)
        return request

    async def client() -> None:
        while (begin := time.perf_counter()) < window_end:
            try:
                request = await one()
                ok, why = request.state == "committed" and request.release is not None, request.state
            except Exception as exc:  # counted and shown, never hidden
                ok, why = False, repr(exc)[:300]
            end = time.perf_counter()
            out["sent"] += 1
            if not ok:
                out["failures"] += 1
                if len(out["examples"]) < 5:
                    out["examples"].append(why)
            elif window_start <= end <= window_end:
                out["latencies"].append(end - begin)

    async def measure() -> None:
        await asyncio.sleep(max(0.0, begin_at - time.perf_counter()))
        clients_ = [asyncio.create_task(client()) for _ in range(clients)]
        await asyncio.sleep(max(0.0, window_start - time.perf_counter()))
        cpu0, batches0 = time.process_time(), runtime.writer.batches
        await asyncio.sleep(max(0.0, window_end - time.perf_counter()))
        out["cpu_seconds"], out["batches"] = time.process_time() - cpu0, runtime.writer.batches - batches0
        await asyncio.gather(*clients_)

    asyncio.run(measure())
    runtime.close()
    return out


def run_queue_configuration(
    env: dict[str, str],
    workdir: Path,
    workers: int,
    mechanism: str,
    keys: dict[str, str],
    args: argparse.Namespace,
) -> tuple[Measurement, dict[str, Any]]:
    """Section 2: heavy requests through the Dramatiq queue with ``workers`` worker processes."""
    queue_env = {
        **env,
        "EXPOST_EXECUTOR": "queue",
        "EXPOST_BROKER_URL": REDIS_URL,
        "EXPOST_QUEUE_NAME": f"bench-{os.getpid()}-{mechanism}-{workers}",
        "EXPOST_WAIT_SECONDS": "120",
        "EXPOST_LEASE_SECONDS": "300",
    }
    server = Server(queue_env, workdir, 1, tag=f"queue-{mechanism}-{workers}-")
    pool = [Worker(queue_env, workdir, i) for i in range(workers)]
    try:
        server.wait_ready()
        for worker in pool:
            worker.wait_ready()
        dataset_id = setup_dataset(server.base_url, keys["admin"], "load-analyst")
        measured = asyncio.run(
            run_load(
                server,
                f"POST {mechanism}",
                "POST",
                f"/v1/datasets/{dataset_id}/requests",
                {"Authorization": f"Bearer {keys['analyst']}"},
                request_body(mechanism),
                committed,
                args.heavy_clients,
                args.warmup,
                args.duration,
                extra_pids=[w.proc.pid for w in pool],
            )
        )
        measured.section, measured.workers = "queue", workers
        releases = measured.total_sent - measured.failures
        budget = check_budget(server.base_url, keys["admin"], dataset_id, releases)
        check = {
            "section": "queue",
            "mechanism": mechanism,
            "workers": workers,
            "releases": releases,
            "budget": budget,
            "server_log_errors": server_errors(server.log_path, *(w.log_path for w in pool)),
        }
        return measured, check
    finally:
        for worker in pool:
            worker.stop()
        server.stop()
        purge_queue(queue_env["EXPOST_QUEUE_NAME"])


def purge_queue(queue: str) -> None:
    import redis

    with contextlib.suppress(redis.RedisError):
        client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2)
        keys = list(client.scan_iter(f"expost-tasks:{queue}*"))
        if keys:
            client.delete(*keys)


def source_digest(package: Path) -> str:
    """A digest of the service's source, to tell which version of the code was measured."""
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(package).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def print_table(results: list[Measurement]) -> None:
    header = (
        f"{'endpoint':38} {'procs':>5} {'wkrs':>4} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} "
        f"{'fail':>5} {'api cpu (per process)':>22} {'worker cpu':>16} {'machine cpu':>11}"
    )
    print(header)
    print("-" * len(header))
    for m in results:
        split = "+".join(f"{c:.2f}" for c in m.server_cpu_cores_per_process)
        workers = "+".join(f"{c:.2f}" for c in m.worker_cpu_cores_per_process) or "-"
        print(
            f"{m.endpoint:38} {m.processes:>5} {m.workers:>4} {m.requests_per_s:>9.1f} {m.p50_ms:>8.2f} "
            f"{m.p99_ms:>8.2f} {m.failures:>5} {split:>22} {workers:>16} {m.machine_cpu_cores:>11.2f}"
        )


def efficiency(rates: dict[int, float]) -> dict[str, float | None]:
    """throughput(k) / (k · throughput(1)) for every k measured (None without a k = 1 baseline)."""
    base = rates.get(1)
    return {str(k): (rate / (k * base) if base else None) for k, rate in sorted(rates.items())}


def per_worker_core(results: list[Measurement], endpoint: str) -> dict[str, float | None]:
    """Requests per worker CPU-second at k workers, relative to k = 1: how much of the CPU the workers got
    turned into requests. Unlike throughput efficiency it does not depend on how many cores other
    processes left to the workers (on a shared machine, the dominant effect)."""
    rate = {
        m.workers: m.requests_per_s / sum(m.worker_cpu_cores_per_process)
        for m in results
        if m.endpoint == endpoint and sum(m.worker_cpu_cores_per_process) > 0
    }
    base = rate.get(1)
    return {str(k): (r / base if base else None) for k, r in sorted(rate.items())}


def register_bench_mechanisms() -> None:
    """Add the two heavy benchmark mechanisms to this process's catalog (Laplace counts that first burn
    CPU or wait; same worst case and realized curve as ``laplace``)."""
    from typing import ClassVar

    from pydantic import BaseModel

    from mechanisms.base import PublicContext, Release, Table
    from mechanisms.catalog import MECHANISMS
    from mechanisms.noise import Noise
    from mechanisms.queries.laplace import Laplace

    seconds = float(os.environ.get("EXPOST_BENCH_BUSY", "0.2"))

    class BusyCount(Laplace):
        name: ClassVar[str] = "bench.busy_count"

        def run(self, params: BaseModel, ctx: PublicContext, table: Table, noise: Noise) -> Release:
            end, x = time.thread_time() + seconds, 0
            while time.thread_time() < end:
                for i in range(10_000):
                    x ^= i * i
            return super().run(params, ctx, table, noise)

    class SleepyCount(Laplace):
        name: ClassVar[str] = "bench.sleepy_count"

        def run(self, params: BaseModel, ctx: PublicContext, table: Table, noise: Noise) -> Release:
            time.sleep(seconds)
            return super().run(params, ctx, table, noise)

    MECHANISMS.setdefault(BusyCount.name, BusyCount())
    MECHANISMS.setdefault(SleepyCount.name, SleepyCount())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--as-expost"]:  # a server or worker process of the benchmark
        sys.path.insert(0, str(ROOT))
        register_bench_mechanisms()
        from service.cli import app

        app(args=argv[1:], prog_name="expost")
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from latency_proxy import LatencyProxy, proxied_url
    from pg_database import DEFAULT_URL, fresh_database
    from sqlalchemy import make_url

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration", type=float, default=10.0, help="measured seconds per configuration")
    parser.add_argument("--warmup", type=float, default=3.0, help="unmeasured seconds before each window")
    parser.add_argument("--clients", type=int, default=32, help="concurrent closed-loop clients (cheap)")
    parser.add_argument("--heavy-clients", type=int, default=8, help="concurrent clients (heavy requests)")
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4], help="API process counts")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4], help="queue worker counts")
    parser.add_argument("--busy", type=float, default=0.2, help="seconds of work per heavy request")
    parser.add_argument("--datasets", type=int, default=16, help="datasets for the many-filters run")
    parser.add_argument(
        "--sections",
        nargs="+",
        default=["api", "queue", "datasets"],
        choices=["api", "queue", "datasets", "filter_row"],
        help="filter_row: only the in-process filter-row runs of the datasets section",
    )
    parser.add_argument(
        "--filter-row-runs",
        type=int,
        default=1,
        help="filter-row runs per process count (alternated: 1 process, then the most)",
    )
    parser.add_argument(
        "--db-latency-ms",
        type=float,
        default=0.0,
        help="delay every byte between the services and PostgreSQL by this much each way "
        "(latency_proxy.py): a database on another host",
    )
    parser.add_argument(
        "--ratio-rounds",
        type=int,
        default=5,
        help="after the api section's windows: this many short healthz/request window pairs, "
        "alternated (the machine's speed drifts between two long windows)",
    )
    parser.add_argument("--ratio-window", type=float, default=3.0, help="seconds per interleaved window")
    parser.add_argument("--quick", action="store_true", help="a fast smoke run (seconds, not minutes)")
    parser.add_argument("--postgres-url", default=DEFAULT_URL, help="server to create the database on")
    parser.add_argument("--output", type=Path, default=None, help="JSON results")
    args = parser.parse_args(argv)
    if args.quick:
        args.duration, args.warmup, args.clients, args.heavy_clients = 1.0, 0.5, 4, 2
        args.processes, args.workers, args.busy, args.datasets = [1], [1], 0.05, 2
        args.ratio_rounds, args.ratio_window = 1, 0.5
    if args.output is None:
        args.output = DEFAULT_OUTPUT.with_name("service_load_quick.json") if args.quick else DEFAULT_OUTPUT
    if args.duration <= 0 or args.warmup < 0 or args.clients < 1 or min(args.processes) < 1:
        parser.error("need --duration > 0, --warmup ≥ 0, --clients ≥ 1 and --processes ≥ 1")
    if args.filter_row_runs < 1 or args.db_latency_ms < 0:
        parser.error("need --filter-row-runs ≥ 1 and --db-latency-ms ≥ 0")

    results: list[Measurement] = []
    checks: list[dict[str, Any]] = []
    filter_rows: list[dict[str, Any]] = []  # one process, then max(--processes) on the same filter row
    loadavg_before = os.getloadavg()[0]
    digest_before = source_digest(ROOT / "service")
    if loadavg_before > 0.5 * (os.cpu_count() or 1):
        print(
            f"warning: 1-min load average is {loadavg_before:.2f} on {os.cpu_count()} CPUs before the run; "
            "other work on this machine will distort the numbers",
            file=sys.stderr,
        )
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="expost-load-"))
        url = stack.enter_context(fresh_database(args.postgres_url))
        if args.db_latency_ms:
            target = make_url(url)
            proxy = stack.enter_context(
                LatencyProxy(target.host or "127.0.0.1", target.port or 5432, args.db_latency_ms / 1000)
            )
            url = proxied_url(url, proxy.port)
        workdir = Path(tmp)
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("EXPOST_")},
            "PYTHONPATH": str(ROOT),
            "EXPOST_DATABASE_URL": url,
            "EXPOST_DATA_DIR": str(workdir / "data"),
            "EXPOST_LOG_LEVEL": "INFO",  # the default; wait_ready needs the startup lines
            "EXPOST_LOG_JSON": "true",  # the production format (docs/operations.md), one access line each
            "EXPOST_RATE_LIMIT": "",  # measure the service, not the limiter
            "EXPOST_RATE_LIMIT_REPORTS": "",
            "EXPOST_BENCH_BUSY": str(args.busy),
            "OPENBLAS_NUM_THREADS": "1",
            "OMP_NUM_THREADS": "1",
        }
        cli(env, workdir, "migrate")
        keys = {role: create_key(env, workdir, role) for role in ("admin", "analyst")}
        if "api" in args.sections:
            for processes in args.processes:
                measured, check = run_api_configuration(env, workdir, processes, keys, args)
                results += measured
                checks.append(check)
                print(f"... {processes} API process(es) done", file=sys.stderr)
        if "queue" in args.sections:
            for mechanism in ("bench.busy_count", "bench.sleepy_count"):
                for workers in args.workers:
                    measured_q, check = run_queue_configuration(env, workdir, workers, mechanism, keys, args)
                    results.append(measured_q)
                    checks.append(check)
                    print(f"... {mechanism} with {workers} worker(s) done", file=sys.stderr)
        if "datasets" in args.sections:
            for processes in sorted({min(args.processes), max(args.processes)}):
                for datasets in sorted({1, args.datasets}):
                    measured_d, check = run_datasets_configuration(
                        env, workdir, processes, datasets, keys, args
                    )
                    results.append(measured_d)
                    checks.append(check)
                    print(f"... {datasets} dataset(s) on {processes} process(es) done", file=sys.stderr)
        if "datasets" in args.sections or "filter_row" in args.sections:
            for _ in range(args.filter_row_runs):
                for processes in sorted({1, max(args.processes)}):
                    filter_rows.append(run_filter_row(env, workdir, keys, args, processes))
                    print(f"... one filter row from {processes} process(es) done", file=sys.stderr)
        verify = subprocess.run(
            [EXPOST, "ledger", "verify"],
            env=env,
            cwd=workdir,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )

    def rates(endpoint: str, key: str) -> dict[int, float]:
        return {getattr(m, key): m.requests_per_s for m in results if m.endpoint == endpoint}

    scaling = {
        "api_cheap_requests": efficiency(rates("POST /v1/datasets/{id}/requests", "processes")),
        "api_healthz": efficiency(rates("GET /healthz", "processes")),
        "queue_cpu_bound": efficiency(rates("POST bench.busy_count", "workers")),
        "queue_io_bound": efficiency(rates("POST bench.sleepy_count", "workers")),
        "queue_cpu_bound_requests_per_worker_core": per_worker_core(results, "POST bench.busy_count"),
    }
    ratios = {}
    for processes in args.processes:
        by_endpoint = {m.endpoint: m for m in results if m.processes == processes and m.section == "api"}
        if {"GET /healthz", "POST /v1/datasets/{id}/requests"} <= set(by_endpoint):
            ceiling, real = by_endpoint["GET /healthz"], by_endpoint["POST /v1/datasets/{id}/requests"]
            ratios[str(processes)] = (
                real.requests_per_s / ceiling.requests_per_s if ceiling.requests_per_s else None
            )
    api_checks = [c for c in checks if c["section"] == "api" and c["interleaved_ratio"] is not None]
    interleaved = {str(c["processes"]): c["interleaved_ratio"] for c in api_checks}
    ok = (
        all(m.failures == 0 for m in results)
        and all(c["budget"]["ok"] for c in checks)
        and all(r["failures"] == 0 for c in checks for r in c.get("interleaved_rounds", ()))
        and not any(c["server_log_errors"] for c in checks)
        and verify.returncode == 0
        and all(row["failures"] == 0 and row["budget"]["ok"] for row in filter_rows)
    )
    report = {
        "benchmark": "service_load",
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "loadavg_1min_before": loadavg_before,
        },
        "service_sha256": digest_before,
        "service_changed_during_run": source_digest(ROOT / "service") != digest_before,
        "note": "load generator, server, workers, PostgreSQL and Redis share the machine; cpu figures are "
        "cores used (CPU s / wall s)",
        "settings": {
            "duration_s": args.duration,
            "warmup_s": args.warmup,
            "clients": args.clients,
            "heavy_clients": args.heavy_clients,
            "processes": args.processes,
            "workers": args.workers,
            "busy_s": args.busy,
            "datasets": args.datasets,
            "quick": args.quick,
            "database": "postgresql",
            "db_latency_ms": args.db_latency_ms,
            "filter_row_runs": args.filter_row_runs,
            "request_epsilon": REQUEST_EPSILON,
            "budget_epsilon": 1e6,
        },
        "results": [asdict(m) for m in results],
        "scaling_efficiency": scaling,
        "ratio_requests_to_healthz": ratios,
        "ratio_requests_to_healthz_interleaved": interleaved,
        "filter_row": filter_rows[0] if filter_rows else None,  # one process (as in earlier results)
        "filter_rows": filter_rows,
        "checks": checks,
        "ledger_verify": {"exit_code": verify.returncode, "output": verify.stdout.strip()[-500:]},
        "ok": ok,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")

    print(
        f"cpu_count={os.cpu_count()}  clients={args.clients}/{args.heavy_clients}  "
        f"duration={args.duration}s (+{args.warmup}s warm-up)  database=PostgreSQL  "
        f"loadavg before={loadavg_before:.2f}"
    )
    print_table(results)
    for name, values in scaling.items():
        if values:
            shown = "  ".join(f"k={k}: {'n/a' if v is None else f'{v:.2f}'}" for k, v in values.items())
            print(f"scaling efficiency {name:20} {shown}")
    for c in api_checks:
        rounds = c["interleaved_rounds"]
        shown = "  ".join(f"{r['requests_per_s']:.0f}/{r['healthz_per_s']:.0f}" for r in rounds)
        print(
            f"requests/healthz, {c['processes']} process(es), {len(rounds)} interleaved "
            f"{args.ratio_window:g} s pairs: {c['interleaved_ratio']:.2f}  ({shown})"
        )
    for row in filter_rows:
        print(
            f"one filter row, {row['processes']} process(es), {row['tasks']} tasks, no HTTP: "
            f"{row['requests_per_s']:.1f} committed/s  p99 {row['p99_ms']:.1f} ms  "
            f"processes' cpu {row['process_cpu_cores']:.2f} cores  "
            f"({row['requests_per_process_core_s'] or 0:.0f}/core-s)  "
            f"machine {row['machine_cpu_cores']:.2f}  "
            f"spent = releases x charge: {row['budget']['ok']}"
        )
    output = verify.stdout.strip()
    verdict = output.splitlines()[-1] if output else verify.stderr.strip()[-200:]
    print(
        f"budget checks: {[c['budget']['ok'] for c in checks]}  ledger verify: exit {verify.returncode} "
        f"({verdict})"
    )
    if report["service_changed_during_run"]:
        print("warning: service/ changed during the run: rows may measure different code", file=sys.stderr)
    print(f"written: {args.output}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
