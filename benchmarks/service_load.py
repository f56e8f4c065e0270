"""Service load: requests/s and latency of the real server, on PostgreSQL, with 1 and 2 server processes.

For each process count, ``expost serve --workers N`` runs as a subprocess on a fresh PostgreSQL database
(migrated and keyed with the real CLI). A closed-loop load generator (asyncio + one keep-alive
``httpx.AsyncClient``, ``--clients`` concurrent loops) hits, for ``--warmup`` then ``--duration`` seconds:

  (a) ``GET /healthz``: no authentication, no database: the ceiling of the same app and server stack;
  (b) ``POST /v1/datasets/{id}/requests``: a Laplace count with ε = 1e-6 against a pure budget of ε = 1e6,
      so nothing is refused: authentication, validation, admission + reservation (``SELECT … FOR UPDATE``
      on the one filter row), the worker pool, commit + release (second locked transaction), response.

Only requests completed inside the measured window count. Every (b) response must be 200 and
``committed``; afterwards the budget must show exactly (number of releases) × 1e-6 spent and nothing
reserved, and ``expost ledger verify`` must exit 0. The load generator runs on the same machine as the
server (``cpu_count`` is recorded), so on a small machine the client competes with the server for CPU.

    .venv/bin/python benchmarks/service_load.py [--duration 15] [--warmup 3] [--clients 32]
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
from pg_database import DEFAULT_URL, fresh_database

ROOT = Path(__file__).resolve().parents[1]
EXPOST = str(Path(sys.executable).with_name("expost"))
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
    done = subprocess.run([EXPOST, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=300,
                          check=False)
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

    def __init__(self, env: dict[str, str], workdir: Path, processes: int) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / f"server-{processes}.log"
        self.processes = processes
        with self.log_path.open("wb") as log:
            command = [EXPOST, "serve", "--host", "127.0.0.1", "--port", str(self.port),
                       "--workers", str(processes)]
            self.proc = subprocess.Popen(
                command, env=env, cwd=workdir, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
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
            out = subprocess.run(["ss", "-tnpH", "state", "established", f"( sport = :{self.port} )"],
                                 capture_output=True, text=True, timeout=10, check=False).stdout
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


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list."""
    if not sorted_values:
        return float("nan")
    rank = max(1, min(len(sorted_values), round(q / 100 * len(sorted_values) + 0.5)))
    return sorted_values[rank - 1]


async def run_load(
    server: Server, endpoint: str, method: str, path: str, headers: dict[str, str], body: Any | None,
    check: Callable[[httpx.Response], bool], clients: int, warmup: float, duration: float,
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
        async with httpx.AsyncClient(base_url=server.base_url, headers=headers, limits=limits,
                                     timeout=30, verify=TLS) as client:
            while (begin := time.perf_counter()) < window_end:  # bounded by the clock
                response = await client.request(method, path, json=body)
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
        await asyncio.sleep(max(0.0, window_start - time.perf_counter()))
        cpu["before"] = [cpu_seconds(p) for p in pids], time.process_time(), time.perf_counter()
        cpu["machine_before"] = machine_busy_seconds()
        cpu["connections"] = server.connections_per_process()
        await asyncio.sleep(max(0.0, window_end - time.perf_counter()))
        cpu["after"] = [cpu_seconds(p) for p in pids], time.process_time(), time.perf_counter()
        cpu["machine_after"] = machine_busy_seconds()
        cpu["loadavg"] = os.getloadavg()[0]

    await asyncio.gather(sample_cpu(), *(loop(i) for i in range(clients)))
    (server_before, client_before, t0), (server_after, client_after, t1) = cpu["before"], cpu["after"]
    wall = t1 - t0
    per_process = [(b - a) / wall for a, b in zip(server_before, server_after, strict=True)]
    latencies.sort()
    return Measurement(
        endpoint=endpoint, processes=server.processes, clients=clients, duration_s=duration,
        requests=len(latencies), requests_per_s=len(latencies) / duration,
        p50_ms=1000 * percentile(latencies, 50), p99_ms=1000 * percentile(latencies, 99),
        mean_ms=1000 * sum(latencies) / max(1, len(latencies)),
        max_ms=1000 * (latencies[-1] if latencies else 0.0),
        total_sent=sent, failures=failures, failure_examples=examples,
        server_cpu_cores=sum(per_process), server_cpu_cores_per_process=per_process,
        client_cpu_cores=(client_after - client_before) / wall, loadavg_1min_after=cpu["loadavg"],
        connections_per_process=cpu["connections"],
        machine_cpu_cores=(cpu["machine_after"] - cpu["machine_before"]) / wall,
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
        created = admin.post("/v1/datasets", files={"file": ("load.csv", CSV, "text/csv")},
                             data={"schema": json.dumps(SCHEMA), "name": "load benchmark"})
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
    return {"ok": ok, "pure_spent": view["pure"]["spent"], "expected_spent": expected,
            "pure_reserved": view["pure"]["reserved"]}


def run_configuration(
    env: dict[str, str], workdir: Path, processes: int, keys: dict[str, str], args: argparse.Namespace,
) -> tuple[list[Measurement], dict[str, Any]]:
    server = Server(env, workdir, processes)
    try:
        server.wait_ready()
        dataset_id = setup_dataset(server.base_url, keys["admin"], "load-analyst")
        ceiling = asyncio.run(run_load(
            server, "GET /healthz", "GET", "/healthz", {}, None, lambda r: r.status_code == 200,
            args.clients, args.warmup, args.duration,
        ))
        requests = asyncio.run(run_load(
            server, "POST /v1/datasets/{id}/requests", "POST", f"/v1/datasets/{dataset_id}/requests",
            {"Authorization": f"Bearer {keys['analyst']}"},
            {"mechanism": "laplace", "params": {"query": {"kind": "count"}, "epsilon": REQUEST_EPSILON}},
            committed, args.clients, args.warmup, args.duration,
        ))
        releases = requests.total_sent - requests.failures
        budget = check_budget(server.base_url, keys["admin"], dataset_id, releases)
        log = server.log_tail(100_000)
        errors = [line for line in log.splitlines() if "Traceback" in line or "unhandled error" in line]
        check = {"processes": processes, "releases": releases, "budget": budget,
                 "server_log_errors": errors[:20]}
        return [ceiling, requests], check
    finally:
        server.stop()


def source_digest(package: Path) -> str:
    """A digest of the service's source, to tell which version of the code was measured."""
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(package).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def print_table(results: list[Measurement]) -> None:
    header = (f"{'endpoint':34} {'procs':>5} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'failures':>8} "
              f"{'server cpu (per process)':>24} {'client cpu':>10} {'machine cpu':>11} "
              f"{'conns/process':>13}")
    print(header)
    print("-" * len(header))
    for m in results:
        split = "+".join(f"{c:.2f}" for c in m.server_cpu_cores_per_process)
        conns = "/".join(str(c) for c in m.connections_per_process.values()) or "?"
        print(f"{m.endpoint:34} {m.processes:>5} {m.requests_per_s:>9.1f} {m.p50_ms:>8.2f} {m.p99_ms:>8.2f} "
              f"{m.failures:>8} {split:>24} {m.client_cpu_cores:>10.2f} {m.machine_cpu_cores:>11.2f} "
              f"{conns:>13}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=15.0, help="measured seconds per endpoint")
    parser.add_argument("--warmup", type=float, default=3.0, help="unmeasured seconds before each window")
    parser.add_argument("--clients", type=int, default=32, help="concurrent closed-loop clients")
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2], help="server process counts")
    parser.add_argument("--postgres-url", default=DEFAULT_URL, help="server to create the database on")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="JSON results")
    args = parser.parse_args(argv)
    if args.duration <= 0 or args.warmup < 0 or args.clients < 1 or min(args.processes) < 1:
        parser.error("need --duration > 0, --warmup ≥ 0, --clients ≥ 1 and --processes ≥ 1")

    results: list[Measurement] = []
    checks: list[dict[str, Any]] = []
    loadavg_before = os.getloadavg()[0]
    digest_before = source_digest(ROOT / "service")
    if loadavg_before > 0.5 * (os.cpu_count() or 1):
        print(f"warning: 1-min load average is {loadavg_before:.2f} on {os.cpu_count()} CPUs before the run; "
              "other work on this machine will distort the numbers", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="expost-load-") as tmp, fresh_database(args.postgres_url) as url:
        workdir = Path(tmp)
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("EXPOST_")},
            "EXPOST_DATABASE_URL": url,
            "EXPOST_DATA_DIR": str(workdir / "data"),
            "EXPOST_LOG_LEVEL": "INFO",  # the default; wait_ready needs the startup lines
        }
        cli(env, workdir, "migrate")
        keys = {role: create_key(env, workdir, role) for role in ("admin", "analyst")}
        for processes in args.processes:
            measured, check = run_configuration(env, workdir, processes, keys, args)
            results += measured
            checks.append(check)
            print(f"... {processes} process(es) done", file=sys.stderr)
        verify = subprocess.run([EXPOST, "ledger", "verify"], env=env, cwd=workdir, capture_output=True,
                                text=True, timeout=600, check=False)

    ratios = {}
    for processes in args.processes:
        by_endpoint = {m.endpoint: m for m in results if m.processes == processes}
        ceiling, real = by_endpoint["GET /healthz"], by_endpoint["POST /v1/datasets/{id}/requests"]
        ratios[str(processes)] = (real.requests_per_s / ceiling.requests_per_s
                                  if ceiling.requests_per_s else None)
    ok = (all(m.failures == 0 for m in results) and all(c["budget"]["ok"] for c in checks)
          and not any(c["server_log_errors"] for c in checks) and verify.returncode == 0)
    report = {
        "benchmark": "service_load",
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version(), "loadavg_1min_before": loadavg_before},
        "service_sha256": digest_before,
        "service_changed_during_run": source_digest(ROOT / "service") != digest_before,
        "note": "load generator and server share the machine; cpu figures are cores used (CPU s / wall s)",
        "settings": {"duration_s": args.duration, "warmup_s": args.warmup, "clients": args.clients,
                     "processes": args.processes, "database": "postgresql",
                     "request_epsilon": REQUEST_EPSILON, "budget_epsilon": 1e6},
        "results": [asdict(m) for m in results],
        "ratio_requests_to_healthz": ratios,
        "checks": checks,
        "ledger_verify": {"exit_code": verify.returncode, "output": verify.stdout.strip()[-500:]},
        "ok": ok,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")

    print(f"cpu_count={os.cpu_count()}  clients={args.clients}  duration={args.duration}s "
          f"(+{args.warmup}s warm-up)  database=PostgreSQL")
    print_table(results)
    for processes, ratio in ratios.items():
        print(f"ratio requests/healthz at {processes} process(es): "
              + ("n/a" if ratio is None else f"{ratio:.3f}"))
    output = verify.stdout.strip()
    verdict = output.splitlines()[-1] if output else verify.stderr.strip()[-200:]
    print(f"budget checks: {[c['budget']['ok'] for c in checks]}  ledger verify: exit {verify.returncode} "
          f"({verdict})")
    if report["service_changed_during_run"]:
        print("warning: service/ changed during the run: rows may measure different code", file=sys.stderr)
    print(f"written: {args.output}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
