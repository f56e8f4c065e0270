"""Data at scale: a real ``expost serve`` process on 10⁸-row Parquet, a 10⁷-row CSV upload, dp_gd on 10⁷ rows,
an isolation probe, and DuckDB against Spark on the same plans.

Everything that has a target is measured **from outside** a real server process (``expost serve --workers
1``: one process, whose in-process executor threads run the engine) on a fresh PostgreSQL database
(``benchmarks/pg_database.py``; ``--sqlite`` for an embedded SQLite database instead), migrated and keyed
with the real CLI. For every timed phase the JSON records the wall time, the load generator's own CPU time
(``time.process_time()`` of this process), the server's CPU time and the whole machine's busy cores, the
load average (``os.getloadavg()``) before and after, and the server's **peak RSS**, measured two ways: the
kernel's high-water mark ``VmHWM`` of the server process, reset at the start of the phase (``echo 5 >
/proc/<pid>/clear_refs``), and ``VmRSS`` of the server's process tree sampled every 50 ms by a thread
(``server_peak_rss_mib`` is the larger of the two; ``server_rss_start_mib`` is the RSS when the phase began).

Sections (``--sections``, all by default, in this order):

1. ``parquet``: a Parquet file of ``--parquet-rows`` (10⁸) rows (``x`` float64 in [0, 100], ``y`` float64 in
   [-1, 1], ``k`` int64 in [0, 1000], ``g4``/``g8`` dictionary-encoded strings with 4 and 8 values; row
   groups of 2²⁰ rows), generated once with NumPy in chunks and cached in ``benchmarks/.data/``, registered
   by reference (``POST /v1/datasets/register``, timed, with the server's peak RSS during the copy), then
   ``--runs`` (5) rounds of: Laplace count, sum(x), mean(x); ``measures.laplace`` count + mean(x) grouped by
   ``g4`` (4 cells) and by ``g4, g8`` (32 cells); ``quantile`` median of x. Each request is timed from the
   POST until its release is available (the POST waits for it: ``EXPOST_WAIT_SECONDS`` is raised to 600;
   a 202 would be polled at ``GET /v1/requests/{id}`` every 20 ms).
2. ``csv``: a CSV of ``--csv-rows`` (10⁷) rows and 5 columns (``a`` float [0, 100], ``b`` float [-1, 1],
   ``c`` int [0, 1000], ``g`` 4 categories, ``label`` no/yes from a logistic model of a and b), written once
   with ``pyarrow.csv``; ``POST /v1/datasets`` (multipart, streamed from the file) timed with the server's
   peak RSS, then the first and a second Laplace count on it.
3. ``dp_gd``: ``--gd-runs`` (3) runs of ``dp_gd`` (logistic, features a, b, label, 20 steps, target ε = 1
   at δ = 1e-6) on the CSV dataset: wall time until the release, server peak RSS.
4. ``isolation``: a probe sends cheap Laplace counts (ε = 1e-3) to a 1000-row dataset one after another
   while ``--probe-scans`` (2) 32-cell group-bys run back to back on section 1's dataset, then for the same
   wall time with no scan; ``--probe-rounds`` (3) alternations. p50/p99/max latency and count of each.
5. ``engines``: in this process, a ``--engine-rows`` (10⁶) snapshot (``parquet_to_snapshot`` of the same
   generator's file) and the aggregation plans the mechanisms build (``query_plan`` for Laplace count / sum /
   mean / histogram with and without ``where``, ``measures_plan`` for two group-bys, the quantile's bucket
   plan captured from ``selected_rank_counts``) run by ``DuckDBEngine`` (2 threads) and ``SparkEngine``
   (``local[2]``), twice each, and by the NumPy reference (``evaluate_numpy``): every integer must agree.

Targets (checked, listed in the JSON and the table): section 1 count, sum, mean p50 ≤ 1.5 s, group-bys and
quantile p50 ≤ 3 s, server peak RSS ≤ 1.5 GB in every phase (registration included); section 2 upload ≤ 15 s
with peak RSS ≤ 1 GB, first count ≤ 1 s; section 3 ≤ 16.9 s and ≤ 1.5 GB; section 4 probe p99 ≤ 100 ms
while scanning; section 5 identical answers. GB = 10⁹ bytes. Exit code 0 only if every section ran
without error (missed targets are reported, not errors).

Inputs are cached in ``benchmarks/.data/`` (ignored by git through its own ``.gitignore``; delete the folder
to regenerate). The run's own directory (the server's snapshots and logs, under ``benchmarks/.data/runs/``)
and the PostgreSQL database are removed at the end unless ``--keep-data``. ``--quick`` is a smoke run:
2²¹-row Parquet and CSV (above the server's default ``EXPOST_MEMORY_MAX_ROWS`` of 10⁶, so the engine path
is still the one measured), 10⁵ rows for the engines, 2 runs, 1 probe round; output
``data_scale_quick.json``.

    .venv/bin/python benchmarks/data_scale.py [--quick] [--sections parquet csv dp_gd isolation engines]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
DATA = BENCH / ".data"
EXPOST = str(Path(sys.executable).with_name("expost"))
DEFAULT_OUTPUT = BENCH / "results" / "data_scale.json"
CLK_TCK = os.sysconf("SC_CLK_TCK")
GB = 10**9
MIB = 1 << 20
ROW_GROUP = 1 << 20
GENERATOR_VERSION = 1  # bump when the generated data changes (cached file names carry it)
SECTIONS = ("parquet", "csv", "dp_gd", "isolation", "engines")

G4 = ["north", "south", "east", "west"]
G8 = ["a", "b", "c", "d", "e", "f", "g", "h"]
G8_P = [0.30, 0.20, 0.15, 0.10, 0.10, 0.07, 0.05, 0.03]
PARQUET_SCHEMA = {
    "columns": [
        {"name": "x", "type": "float", "min": 0, "max": 100},
        {"name": "y", "type": "float", "min": -1, "max": 1},
        {"name": "k", "type": "int", "min": 0, "max": 1000},
        {"name": "g4", "type": "categorical", "values": G4},
        {"name": "g8", "type": "categorical", "values": G8},
    ],
    "neighboring": "replace_one",
}
CSV_SCHEMA = {
    "columns": [
        {"name": "a", "type": "float", "min": 0, "max": 100},
        {"name": "b", "type": "float", "min": -1, "max": 1},
        {"name": "c", "type": "int", "min": 0, "max": 1000},
        {"name": "g", "type": "categorical", "values": G4},
        {"name": "label", "type": "categorical", "values": ["no", "yes"]},
    ],
    "neighboring": "replace_one",
}
SMALL_SCHEMA = {
    "columns": [
        {"name": "age", "type": "float", "min": 18, "max": 90},
        {"name": "income", "type": "float", "min": 0, "max": 100000},
        {"name": "region", "type": "categorical", "values": G4},
    ],
    "neighboring": "replace_one",
}
SMALL_CSV = b"age,income,region\n" + b"".join(
    f"{20 + (i % 60)},{1000 * (i % 97)},{G4[i % 4]}\n".encode() for i in range(1000)
)

# section 1's requests: (name, mechanism, params, target p50 in seconds)
PARQUET_QUERIES: list[tuple[str, str, dict[str, Any], float]] = [
    ("count", "laplace", {"query": {"kind": "count"}, "epsilon": 1.0}, 1.5),
    ("sum(x)", "laplace", {"query": {"kind": "sum", "column": "x"}, "epsilon": 1.0}, 1.5),
    ("mean(x)", "laplace", {"query": {"kind": "mean", "column": "x"}, "epsilon": 1.0}, 1.5),
    (
        "group-by g4 (4 cells)",
        "measures.laplace",
        {
            "measures": [{"kind": "count"}, {"kind": "mean", "column": "x"}],
            "group_by": ["g4"],
            "epsilon": 1.0,
        },
        3.0,
    ),
    (
        "group-by g4,g8 (32 cells)",
        "measures.laplace",
        {
            "measures": [{"kind": "count"}, {"kind": "mean", "column": "x"}],
            "group_by": ["g4", "g8"],
            "epsilon": 1.0,
        },
        3.0,
    ),
    ("quantile median(x)", "quantile", {"column": "x", "quantiles": [0.5], "epsilon": 1.0}, 3.0),
]
SCAN_QUERY = PARQUET_QUERIES[4]  # the isolation probe's background scan
COUNT = {"query": {"kind": "count"}, "epsilon": 1.0}
PROBE = {"query": {"kind": "count"}, "epsilon": 1e-3}
DP_GD = {"features": ["a", "b"], "label": "label", "steps": 20, "target_epsilon": 1.0, "target_delta": 1e-6}


class BenchError(RuntimeError):
    """A failure of the server or of the benchmark, with what is needed to report it."""


# ----- cached inputs ------------------------------------------------------------------------------------


def ensure_data_dir() -> None:
    DATA.mkdir(parents=True, exist_ok=True)
    ignore = DATA / ".gitignore"
    if not ignore.exists():
        ignore.write_text("# generated benchmark inputs and run folders (benchmarks/data_scale.py)\n*\n")


def parquet_source(rows: int) -> tuple[Path, float | None]:
    """The cached Parquet input of ``rows`` rows (generated now if missing) and the seconds it took."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = DATA / f"parquet_{rows}_v{GENERATOR_VERSION}.parquet"
    if path.exists():
        return path, None
    ensure_data_dir()
    print(f"... generating {path.name} ({rows:,} rows)", file=sys.stderr)
    started = time.perf_counter()
    rng = np.random.default_rng(20240601 + rows)
    dictionary = pa.dictionary(pa.int32(), pa.string())
    schema = pa.schema(
        [("x", pa.float64()), ("y", pa.float64()), ("k", pa.int64()), ("g4", dictionary), ("g8", dictionary)]
    )
    g4_values, g8_values = pa.array(G4), pa.array(G8)
    tmp = path.with_suffix(".tmp")
    with pq.ParquetWriter(tmp, schema, compression="snappy") as writer:
        for start in range(0, rows, ROW_GROUP):
            n = min(ROW_GROUP, rows - start)
            g8 = rng.choice(len(G8), size=n, p=G8_P).astype(np.int32)
            table = pa.table(
                {
                    "x": rng.uniform(0.0, 100.0, n),
                    "y": rng.uniform(-1.0, 1.0, n),
                    "k": rng.integers(0, 1001, n, dtype=np.int64),
                    "g4": pa.DictionaryArray.from_arrays(rng.integers(0, 4, n, dtype=np.int32), g4_values),
                    "g8": pa.DictionaryArray.from_arrays(g8, g8_values),
                },
                schema=schema,
            )
            writer.write_table(table, row_group_size=ROW_GROUP)
    os.replace(tmp, path)
    return path, time.perf_counter() - started


def csv_source(rows: int) -> tuple[Path, float | None]:
    """The cached CSV input of ``rows`` rows (generated now if missing) and the seconds it took."""
    import pyarrow as pa
    import pyarrow.csv as pcsv

    path = DATA / f"csv_{rows}_v{GENERATOR_VERSION}.csv"
    if path.exists():
        return path, None
    ensure_data_dir()
    print(f"... generating {path.name} ({rows:,} rows)", file=sys.stderr)
    started = time.perf_counter()
    rng = np.random.default_rng(20240602 + rows)
    schema = pa.schema(
        [
            ("a", pa.float64()),
            ("b", pa.float64()),
            ("c", pa.int64()),
            ("g", pa.string()),
            ("label", pa.string()),
        ]
    )
    g_values, labels = np.array(G4, dtype=object), np.array(["no", "yes"], dtype=object)
    tmp = path.with_suffix(".tmp")
    options = pcsv.WriteOptions(quoting_style="none")
    with pcsv.CSVWriter(tmp, schema, write_options=options) as writer:
        for start in range(0, rows, ROW_GROUP):
            n = min(ROW_GROUP, rows - start)
            a = np.round(rng.uniform(0.0, 100.0, n), 3)
            b = np.round(rng.uniform(-1.0, 1.0, n), 4)
            p = 1.0 / (1.0 + np.exp(-(0.05 * (a - 50.0) + 2.0 * b)))
            writer.write_table(
                pa.table(
                    {
                        "a": a,
                        "b": b,
                        "c": rng.integers(0, 1001, n, dtype=np.int64),
                        "g": g_values[rng.integers(0, 4, n)],
                        "label": labels[(rng.random(n) < p).astype(np.int64)],
                    },
                    schema=schema,
                )
            )
    os.replace(tmp, path)
    return path, time.perf_counter() - started


# ----- the server process and what it uses ----------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def cli(env: dict[str, str], cwd: Path, *args: str) -> str:
    done = subprocess.run(
        [EXPOST, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=300, check=False
    )
    if done.returncode != 0:
        raise BenchError(f"expost {' '.join(args)} exited {done.returncode}: {done.stderr or done.stdout}")
    return done.stdout


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (children of every thread: a JVM started by a worker thread counts)."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        try:
            tasks = os.listdir(f"/proc/{current}/task")
        except OSError:
            continue
        for tid in tasks:
            with contextlib.suppress(OSError, ValueError):
                todo += [int(c) for c in Path(f"/proc/{current}/task/{tid}/children").read_text().split()]
    return found


def status_kib(pid: int, key: str) -> int:
    """A ``kB`` field of /proc/<pid>/status (0 if the process is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def machine_busy_seconds() -> float:
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / CLK_TCK


class Server:
    """``expost serve --workers 1`` (one process: the API and its executor threads) in its own process
    group; ``stop()`` sends SIGTERM to the group, then SIGKILL."""

    def __init__(self, env: dict[str, str], workdir: Path, tag: str) -> None:
        self.port = free_port()
        self.tag = tag
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / f"server-{tag}.log"
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [EXPOST, "serve", "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1"],
                env=env,
                cwd=workdir,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.pid = self.proc.pid

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BenchError(f"expost serve exited {self.proc.returncode}: {self.log_tail()}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{self.base_url}/readyz", timeout=2).status_code == 200:
                    return
            time.sleep(0.1)
        raise BenchError(f"expost serve not ready after {timeout} s: {self.log_tail()}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def errors(self) -> list[str]:
        """Log lines that show a failure (tracebacks are logged as JSON lines with an ``exception`` field)."""
        lines = self.log_path.read_text(errors="replace").splitlines()
        marks = (
            "Traceback",
            '"level": "error"',
            '"level": "critical"',
            "mechanism failed",
            "unhandled error",
        )
        return [line[:4000] for line in lines if any(mark in line for mark in marks)][:20]

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.pid, signal.SIGKILL)
                self.proc.wait(timeout=20)


class RssMonitor:
    """Samples the RSS of the server's process tree every ``interval`` seconds on a thread; per phase, also
    resets and reads the kernel's high-water mark of the server process (VmHWM)."""

    def __init__(self, server: Server, interval: float = 0.05) -> None:
        self.server, self.interval = server, interval
        self.peak_kib = 0  # over the server's life (every sample and every phase's VmHWM)
        self._phase_peak = 0
        self._phase_anon_peak = 0
        self._phase_samples = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-monitor", daemon=True)
        self.hwm_reset_works = True

    def __enter__(self) -> RssMonitor:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def tree_rss_kib(self, key: str = "VmRSS") -> int:
        return sum(status_kib(pid, key) for pid in process_tree(self.server.pid))

    def _run(self) -> None:
        while not self._stop.is_set():
            rss, anon = self.tree_rss_kib(), self.tree_rss_kib("RssAnon")
            with self._lock:
                self.peak_kib = max(self.peak_kib, rss)
                self._phase_peak = max(self._phase_peak, rss)
                self._phase_anon_peak = max(self._phase_anon_peak, anon)
                self._phase_samples += 1
            self._stop.wait(self.interval)

    def begin(self) -> int:
        """Start a phase: reset VmHWM of every process of the tree; returns the RSS now (KiB)."""
        for pid in process_tree(self.server.pid):
            try:
                Path(f"/proc/{pid}/clear_refs").write_text("5")
            except OSError:
                self.hwm_reset_works = False
        rss = self.tree_rss_kib()
        with self._lock:
            self._phase_peak, self._phase_samples = rss, 0
            self._phase_anon_peak = self.tree_rss_kib("RssAnon")
        return rss

    def end(self) -> dict[str, Any]:
        rss = self.tree_rss_kib()
        hwm = sum(status_kib(pid, "VmHWM") for pid in process_tree(self.server.pid))
        with self._lock:
            sampled, samples = max(self._phase_peak, rss), self._phase_samples
            anon = self._phase_anon_peak
            self.peak_kib = max(self.peak_kib, hwm if self.hwm_reset_works else 0, sampled)
        peak = max(sampled, hwm) if self.hwm_reset_works else sampled
        return {
            "server_peak_rss_mib": peak / 1024,
            "server_vmhwm_mib": hwm / 1024,
            "server_sampled_peak_rss_mib": sampled / 1024,
            "rss_samples": samples,
            "server_sampled_peak_anon_mib": anon / 1024,
            "server_rss_end_mib": rss / 1024,
            "vmhwm_reset": self.hwm_reset_works,
        }


class Meter:
    """Phases: wall time, this process's CPU, the server's CPU, the machine's busy cores, load averages,
    and the server's RSS (start and peak), for the server ``current()`` returns."""

    def __init__(self, current: Callable[[], tuple[Server, RssMonitor]]) -> None:
        self.current = current
        self.phases: list[dict[str, Any]] = []

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[dict[str, Any]]:
        server, monitor = self.current()
        record: dict[str, Any] = {"phase": name, "server": server.tag}
        pids = process_tree(server.pid)
        server_cpu0 = {pid: cpu_seconds(pid) for pid in pids}
        load0 = os.getloadavg()
        rss0 = monitor.begin()
        machine0, client0, t0 = machine_busy_seconds(), time.process_time(), time.perf_counter()
        try:
            yield record
        finally:
            wall = time.perf_counter() - t0
            client = time.process_time() - client0
            machine = machine_busy_seconds() - machine0
            rss = monitor.end()
            pids_after = process_tree(server.pid)
            server_cpu = sum(cpu_seconds(p) - server_cpu0.get(p, 0.0) for p in set(pids) | set(pids_after))
            record.update(
                {
                    "wall_s": wall,
                    "client_cpu_s": client,
                    "server_cpu_s": server_cpu,
                    "machine_busy_cores": machine / wall if wall > 0 else None,
                    # everything else that ran meanwhile (PostgreSQL, other users' jobs), in cores
                    "other_cpu_cores": (machine - server_cpu - client) / wall if wall > 0 else None,
                    "loadavg_before": list(load0),
                    "loadavg_after": list(os.getloadavg()),
                    "server_rss_start_mib": rss0 / 1024,
                    **rss,
                }
            )
            self.phases.append(record)


# ----- HTTP helpers -----------------------------------------------------------------------------------


def client_for(base_url: str, key: str | None = None, timeout: float = 3600) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=base_url, headers=headers, timeout=timeout)


def checked(response: httpx.Response, *ok: int) -> Any:
    if response.status_code not in ok:
        raise BenchError(
            f"{response.request.method} {response.request.url.path} answered "
            f"{response.status_code}: {response.text[:3000]}"
        )
    return response.json() if response.content else None


def submit(
    client: httpx.Client, dataset_id: str, mechanism: str, params: dict[str, Any], poll: float = 0.02
) -> tuple[float, dict[str, Any]]:
    """POST a request and wait for its release: (seconds from the POST to the release, the request)."""
    started = time.perf_counter()
    response = client.post(
        f"/v1/datasets/{dataset_id}/requests", json={"mechanism": mechanism, "params": params}
    )
    body = checked(response, 200, 202)
    if response.status_code == 202:
        location = response.headers.get("location") or f"/v1/requests/{body['id']}"
        while body["state"] == "running":
            time.sleep(poll)
            body = checked(client.get(location), 200)
    elapsed = time.perf_counter() - started
    if body.get("state") != "committed" or body.get("release") is None:
        raise BenchError(
            f"{mechanism} on {dataset_id} ended {body.get('state')!r}: error={body.get('error')!r}"
        )
    return elapsed, body


def server_side(body: dict[str, Any]) -> dict[str, Any]:
    """The server's own view of a request: seconds queued (created → started) and elapsed in all."""
    queued = None
    if body.get("started_at") and body.get("created_at"):
        queued = (
            datetime.fromisoformat(body["started_at"]) - datetime.fromisoformat(body["created_at"])
        ).total_seconds()
    return {"server_elapsed_s": body.get("elapsed_seconds"), "server_queued_s": queued}


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


def median(values: list[float]) -> float | None:
    return float(np.median(values)) if values else None


# ----- the run: a server, its database and its datasets ------------------------------------------------


class Run:
    """The server of sections 1–4 (a fresh process per section unless ``--one-server``), its keys and the
    datasets created so far (each created once, on demand; they stay in the database and the data folder
    from one server process to the next)."""

    def __init__(self, args: argparse.Namespace, env: dict[str, str], workdir: Path) -> None:
        self.args, self.env, self.workdir = args, env, workdir
        self.server: Server | None = None
        self.monitor: RssMonitor | None = None
        self.meter = Meter(self.current)
        self.keys: dict[str, str] = {}
        self.datasets: dict[str, str] = {}
        self.records: dict[str, Any] = {}  # what creating each dataset measured
        self.servers: list[dict[str, Any]] = []  # per server process: idle RSS after start, peak, log errors

    def current(self) -> tuple[Server, RssMonitor]:
        if self.server is None or self.monitor is None:
            raise BenchError("no server is running")
        return self.server, self.monitor

    def start(self, tag: str) -> None:
        """Stop the running server (if any) and start a fresh one."""
        self.stop()
        self.server = Server(self.env, self.workdir, tag)
        self.server.wait_ready()
        self.monitor = RssMonitor(self.server)
        self.monitor.__enter__()
        self.servers.append(
            {"tag": tag, "pid": self.server.pid, "idle_rss_mib": self.monitor.tree_rss_kib() / 1024}
        )

    def stop(self) -> None:
        if self.server is None or self.monitor is None:
            return
        self.monitor.__exit__()
        self.server.stop()
        self.servers[-1].update(
            {
                "peak_rss_mib": self.monitor.peak_kib / 1024,
                "log_errors": self.server.errors(),
                "vmhwm_reset": self.monitor.hwm_reset_works,
            }
        )
        self.server = self.monitor = None

    def admin(self) -> httpx.Client:
        return client_for(self.current()[0].base_url, self.keys["admin"])

    def analyst(self, timeout: float = 3600) -> httpx.Client:
        return client_for(self.current()[0].base_url, self.keys["analyst"], timeout)

    def setup(self, dataset_id: str, epsilon: float, delta: float) -> None:
        with self.admin() as admin:
            checked(admin.post(f"/v1/datasets/{dataset_id}/grants", json={"analyst": "scale-analyst"}), 201)
            checked(
                admin.put(f"/v1/datasets/{dataset_id}/budget", json={"epsilon": epsilon, "delta": delta}), 200
            )

    def parquet_dataset(self) -> str:
        """Section 1's dataset: the 10⁸-row Parquet registered by reference (timed)."""
        if "parquet" not in self.datasets:
            source, generated = parquet_source(self.args.parquet_rows)
            body = {
                "name": f"scale-parquet-{self.args.parquet_rows}",
                "schema": PARQUET_SCHEMA,
                "source": {"kind": "parquet", "path": str(source)},
            }
            with self.admin() as admin, self.meter.phase("parquet: register") as phase:
                out = checked(admin.post("/v1/datasets/register", json=body), 201)
            phase.update(
                {
                    "rows": out["n_rows"],
                    "source_bytes": source.stat().st_size,
                    "generated_s": generated,
                    "clipped": out.get("clipped"),
                }
            )
            self.records["register"] = phase
            self.datasets["parquet"] = out["id"]
            self.setup(out["id"], 1e6, 1e-6)
        return self.datasets["parquet"]

    def csv_dataset(self) -> str:
        """Section 2's dataset: the 10⁷-row CSV uploaded (timed)."""
        if "csv" not in self.datasets:
            source, generated = csv_source(self.args.csv_rows)
            with self.admin() as admin, source.open("rb") as handle, self.meter.phase("csv: upload") as phase:
                out = checked(
                    admin.post(
                        "/v1/datasets",
                        files={"file": (source.name, handle, "text/csv")},
                        data={"schema": json.dumps(CSV_SCHEMA), "name": source.stem},
                    ),
                    201,
                )
            phase.update(
                {
                    "rows": out["n_rows"],
                    "source_bytes": source.stat().st_size,
                    "generated_s": generated,
                    "clipped": out.get("clipped"),
                }
            )
            self.records["upload"] = phase
            self.datasets["csv"] = out["id"]
            self.setup(out["id"], 1e6, 1e-6)
        return self.datasets["csv"]

    def small_dataset(self) -> str:
        if "small" not in self.datasets:
            with self.admin() as admin:
                out = checked(
                    admin.post(
                        "/v1/datasets",
                        files={"file": ("probe.csv", SMALL_CSV, "text/csv")},
                        data={"schema": json.dumps(SMALL_SCHEMA), "name": "probe"},
                    ),
                    201,
                )
            self.datasets["small"] = out["id"]
            self.setup(out["id"], 1e6, 0.0)
        return self.datasets["small"]


def timed_request(
    run: Run, client: httpx.Client, name: str, dataset_id: str, mechanism: str, params: dict[str, Any]
) -> dict[str, Any]:
    with run.meter.phase(name) as phase:
        seconds, body = submit(client, dataset_id, mechanism, params)
    phase.update({"latency_s": seconds, **server_side(body)})
    return phase


# ----- section 1 -----------------------------------------------------------------------------------------


def section_parquet(run: Run) -> dict[str, Any]:
    dataset_id = run.parquet_dataset()
    register = run.records["register"]
    per_query: dict[str, list[dict[str, Any]]] = {name: [] for name, *_ in PARQUET_QUERIES}
    with run.analyst() as analyst:
        for i in range(run.args.runs):  # rounds: each query once per round (the machine drifts)
            for name, mechanism, params, _ in PARQUET_QUERIES:
                per_query[name].append(
                    timed_request(run, analyst, f"parquet: {name} #{i + 1}", dataset_id, mechanism, params)
                )
    queries = []
    for name, mechanism, params, target in PARQUET_QUERIES:
        runs = per_query[name]
        latencies = [r["latency_s"] for r in runs]
        queries.append(
            {
                "name": name,
                "mechanism": mechanism,
                "params": params,
                "target_p50_s": target,
                "runs_s": latencies,
                "p50_s": median(latencies),
                "server_elapsed_s": [r["server_elapsed_s"] for r in runs],
                "server_queued_s": [r["server_queued_s"] for r in runs],
                "peak_rss_mib": max(r["server_peak_rss_mib"] for r in runs),
                "client_cpu_s": [r["client_cpu_s"] for r in runs],
                "server_cpu_s": [r["server_cpu_s"] for r in runs],
                "loadavg_1min": [r["loadavg_before"][0] for r in runs],
            }
        )
    peak = max([register["server_peak_rss_mib"], *(q["peak_rss_mib"] for q in queries)])
    return {
        "dataset_id": dataset_id,
        "rows": register["rows"],
        "register": register,
        "queries": queries,
        "peak_rss_mib": peak,
    }


# ----- section 2 ------------------------------------------------------------------------------------------


def section_csv(run: Run) -> dict[str, Any]:
    dataset_id = run.csv_dataset()
    upload = run.records["upload"]
    with run.analyst() as analyst:
        first = timed_request(run, analyst, "csv: first count", dataset_id, "laplace", COUNT)
        second = timed_request(run, analyst, "csv: second count", dataset_id, "laplace", COUNT)
    return {
        "dataset_id": dataset_id,
        "rows": upload["rows"],
        "upload": upload,
        "first_count": first,
        "second_count": second,
    }


# ----- section 3 ------------------------------------------------------------------------------------------


def section_dp_gd(run: Run) -> dict[str, Any]:
    dataset_id = run.csv_dataset()
    runs = []
    with run.analyst() as analyst:
        for i in range(run.args.gd_runs):
            phase = timed_request(run, analyst, f"dp_gd #{i + 1}", dataset_id, "dp_gd", DP_GD)
            runs.append(phase)
    latencies = [r["latency_s"] for r in runs]
    return {
        "dataset_id": dataset_id,
        "rows": run.args.csv_rows,
        "params": DP_GD,
        "runs": runs,
        "runs_s": latencies,
        "p50_s": median(latencies),
        "peak_rss_mib": max(r["server_peak_rss_mib"] for r in runs),
    }


# ----- section 4 -----------------------------------------------------------------------------------------


def probe_loop(
    client: httpx.Client, dataset_id: str, until: Callable[[], bool]
) -> tuple[list[float], list[str]]:
    """Cheap counts one after another until ``until()``: their latencies and failures."""
    latencies: list[float] = []
    failures: list[str] = []
    while not until():
        try:
            seconds, _ = submit(client, dataset_id, "laplace", PROBE)
            latencies.append(seconds)
        except (BenchError, httpx.HTTPError) as exc:
            failures.append(repr(exc)[:500])
            if len(failures) > 20:
                break
    return latencies, failures


def past(deadline: float) -> Callable[[], bool]:
    return lambda: time.perf_counter() >= deadline


def scan_loop(
    client: httpx.Client,
    dataset_id: str,
    mechanism: str,
    params: dict[str, Any],
    count: int,
    scans: list[float],
    errors: list[str],
    done: threading.Event,
) -> None:
    """``count`` scans one after another (a thread of the isolation probe); ``done`` is set at the end."""
    try:
        for _ in range(count):
            seconds, _ = submit(client, dataset_id, mechanism, params)
            scans.append(seconds)
    except Exception as exc:  # reported with the round
        errors.append(repr(exc)[:2000])
    finally:
        done.set()


def latency_summary(latencies: list[float]) -> dict[str, Any]:
    return {
        "count": len(latencies),
        "p50_ms": 1000 * (percentile(latencies, 50) or float("nan")),
        "p99_ms": 1000 * (percentile(latencies, 99) or float("nan")),
        "max_ms": 1000 * max(latencies, default=float("nan")),
    }


def section_isolation(run: Run) -> dict[str, Any]:
    big = run.parquet_dataset()
    small = run.small_dataset()
    name, mechanism, params, _ = SCAN_QUERY
    rounds = []
    all_scanning: list[float] = []
    all_idle: list[float] = []
    with run.analyst() as probe_client, run.analyst() as scan_client:
        submit(probe_client, small, "laplace", PROBE)  # the table is loaded once, before measuring
        for i in range(run.args.probe_rounds):
            done = threading.Event()
            scans: list[float] = []
            scan_errors: list[str] = []
            with run.meter.phase(f"isolation: probe during scans #{i + 1}") as busy:
                thread = threading.Thread(
                    target=scan_loop,
                    name="scan",
                    args=(
                        scan_client,
                        big,
                        mechanism,
                        params,
                        run.args.probe_scans,
                        scans,
                        scan_errors,
                        done,
                    ),
                )
                thread.start()
                time.sleep(0.05)  # the scan's POST is admitted and running first
                scanning, failures = probe_loop(probe_client, small, done.is_set)
                thread.join()
            window = busy["wall_s"]
            with run.meter.phase(f"isolation: probe alone #{i + 1}") as idle:
                deadline = time.perf_counter() + window
                alone, failures_alone = probe_loop(probe_client, small, past(deadline))
            all_scanning += scanning
            all_idle += alone
            busy.update(
                {
                    "probe": latency_summary(scanning),
                    "scan_s": scans,
                    "scan_errors": scan_errors,
                    "probe_failures": failures,
                }
            )
            idle.update({"probe": latency_summary(alone), "probe_failures": failures_alone})
            rounds.append({"scanning": busy, "alone": idle})
            if scan_errors:
                raise BenchError(f"the scan failed: {scan_errors[0]}")
    return {
        "scan": name,
        "scans_per_round": run.args.probe_scans,
        "rounds": rounds,
        "scanning": latency_summary(all_scanning),
        "alone": latency_summary(all_idle),
        "probe_params": PROBE,
        "small_dataset_rows": 1000,
    }


# ----- section 5 -------------------------------------------------------------------------------------------


def engine_plans(ctx: Any, columns: dict[str, np.ndarray]) -> list[tuple[str, Any]]:
    """(name, Aggregation) of the plans the mechanisms build on this dataset (public parameters only)."""
    from mechanisms.data.plan import evaluate_numpy
    from mechanisms.queries.language import laplace_plan, query_plan
    from mechanisms.queries.laplace import LaplaceParams
    from mechanisms.queries.measures import MeasuresLaplaceParams, laplace_plans, measures_plan
    from mechanisms.queries.quantile import QuantileParams, selected_rank_counts

    plans: list[tuple[str, Any]] = []
    where = [
        {"column": "x", "op": "ge", "value": 50},
        {"column": "g4", "op": "in", "value": ["north", "west"]},
    ]
    laplace = {
        "count": {"kind": "count"},
        "count where x ≥ 50 and g4 in (north, west)": {"kind": "count", "where": where},
        "sum(x)": {"kind": "sum", "column": "x"},
        "sum(y) where k < 500": {
            "kind": "sum",
            "column": "y",
            "where": [{"column": "k", "op": "lt", "value": 500}],
        },
        "sum(k) (int)": {"kind": "sum", "column": "k"},
        "mean(x)": {"kind": "mean", "column": "x"},
        "mean(y)": {"kind": "mean", "column": "y"},
        "histogram(g8)": {"kind": "histogram", "column": "g8"},
    }
    for name, query in laplace.items():
        p = LaplaceParams.model_validate({"query": query, "epsilon": 1.0})
        grid_plan, _ = laplace_plan(p.query, ctx, p.epsilon)
        plans.append((f"laplace {name}", query_plan(p.query, ctx, grid_plan.grid)[0]))
    measures = {
        "group-by g4: count, mean(x)": {
            "measures": [{"kind": "count"}, {"kind": "mean", "column": "x"}],
            "group_by": ["g4"],
            "epsilon": 1.0,
        },
        "group-by g4,g8: count, sum(x), variance(y)": {
            "measures": [
                {"kind": "count"},
                {"kind": "sum", "column": "x"},
                {"kind": "variance", "column": "y"},
            ],
            "group_by": ["g4", "g8"],
            "epsilon": 1.0,
        },
    }
    for name, raw in measures.items():
        mp = MeasuresLaplaceParams.model_validate(raw)
        block_plans = [plan for plan, _ in laplace_plans(mp, ctx)]
        plans.append((f"measures {name}", measures_plan(mp, ctx, block_plans)[0]))

    class Recorder:
        """A Scanner that keeps the plans a mechanism asks for (answered by the NumPy reference)."""

        def __init__(self) -> None:
            self.plans: list[Any] = []

        def aggregate(self, plan: Any) -> Any:
            self.plans.append(plan)
            return evaluate_numpy(plan, columns)

    quantiles = {
        "quantile median(x), 1024 candidates": {"column": "x", "quantiles": [0.5], "epsilon": 1.0},
        "quantile q(y) 0.1/0.9 where g8 = a": {
            "column": "y",
            "quantiles": [0.1, 0.9],
            "epsilon": 1.0,
            "where": [{"column": "g8", "op": "eq", "value": "a"}],
        },
    }
    for name, raw in quantiles.items():
        recorder = Recorder()
        selected_rank_counts(QuantileParams.model_validate(raw), ctx, recorder)  # type: ignore[arg-type]
        plans += [(name, plan) for plan in recorder.plans]
    return plans


def section_engines(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from mechanisms.accounting import DEFAULT_ORDERS
    from mechanisms.base import PublicContext
    from mechanisms.data.plan import evaluate_numpy
    from service.data.ingest import parquet_to_snapshot
    from service.datasets import parse_schema, read_columns
    from service.engines.duckdb_engine import DuckDBEngine
    from service.engines.spark_engine import SparkEngine

    source, generated = parquet_source(args.engine_rows)
    schema = parse_schema(PARQUET_SCHEMA)
    folder = workdir / "engines"
    folder.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    ingested = parquet_to_snapshot(str(source), schema, folder)
    snapshot_s = time.perf_counter() - started
    path = ingested.path
    columns = read_columns(path, schema)
    ctx = PublicContext(schema=schema, n_rows=ingested.n_rows, orders=tuple(DEFAULT_ORDERS))
    plans = engine_plans(ctx, columns)
    duck = DuckDBEngine(2, "1GB", folder / "duckdb-tmp")
    spark = SparkEngine("local[2]")
    rows = []
    try:
        load0, client0, t0 = os.getloadavg(), time.process_time(), time.perf_counter()
        spark_session = spark.session  # the JVM and SparkContext start here, timed apart from the plans
        spark_startup = time.perf_counter() - t0
        del spark_session
        for name, plan in plans:
            row: dict[str, Any] = {"plan": name, "cells": plan.n_cells, "sums": len(plan.sums)}
            answers: dict[str, Any] = {}
            calls: list[tuple[str, Callable[[], Any]]] = [
                ("numpy", partial(evaluate_numpy, plan, columns)),
                ("duckdb", partial(duck.aggregate, path, plan)),
                ("spark", partial(spark.aggregate, path, plan)),
            ]
            for engine_name, call in calls:
                times = []
                for _ in range(2):
                    begin = time.perf_counter()
                    answer = call()
                    times.append(time.perf_counter() - begin)
                    if engine_name in answers and answers[engine_name] != answer:
                        raise BenchError(f"{engine_name} gave two different answers to {name}")
                    answers[engine_name] = answer
                row[f"{engine_name}_s"] = times
            row["identical"] = answers["numpy"] == answers["duckdb"] == answers["spark"]
            row["answer_digest"] = hashlib.sha256(repr(answers["duckdb"]).encode()).hexdigest()[:16]
            if not row["identical"]:
                row["answers"] = {k: [list(map(str, s)) for s in v] for k, v in answers.items()}
            rows.append(row)
        totals = {engine: sum(r[f"{engine}_s"][1] for r in rows) for engine in ("numpy", "duckdb", "spark")}
        measured = {
            "wall_s": time.perf_counter() - t0,
            "client_cpu_s": time.process_time() - client0,
            "loadavg_before": list(load0),
            "loadavg_after": list(os.getloadavg()),
        }
    finally:
        duck.close()
        spark.close()
    return {
        "rows": ingested.n_rows,
        "snapshot_s": snapshot_s,
        "generated_s": generated,
        "spark_master": "local[2]",
        "duckdb_threads": 2,
        "spark_startup_s": spark_startup,
        "plans": rows,
        "all_identical": all(r["identical"] for r in rows),
        "second_call_totals_s": totals,
        **measured,
        "note": "times per plan: first and second call; the CPU figure is this process's (Spark's JVM "
        "and DuckDB's threads: DuckDB's count, the JVM's does not)",
    }


# ----- targets, table, main ---------------------------------------------------------------------------------


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []

    def check(name: str, value: float | None, limit: float, unit: str) -> None:
        out.append(
            {
                "target": name,
                "measured": value,
                "limit": limit,
                "unit": unit,
                "met": value is not None and value <= limit,
            }
        )

    gb_mib = GB / MIB
    if "parquet" in results and "error" not in results["parquet"]:
        section = results["parquet"]
        for q in section["queries"]:
            check(f"parquet {q['name']} p50", q["p50_s"], q["target_p50_s"], "s")
        check("parquet peak RSS (registration and queries)", section["peak_rss_mib"], 1.5 * gb_mib, "MiB")
    if "csv" in results and "error" not in results["csv"]:
        section = results["csv"]
        check("csv upload", section["upload"]["wall_s"], 15.0, "s")
        check("csv upload peak RSS", section["upload"]["server_peak_rss_mib"], 1.0 * gb_mib, "MiB")
        check("csv first count", section["first_count"]["latency_s"], 1.0, "s")
    if "dp_gd" in results and "error" not in results["dp_gd"]:
        section = results["dp_gd"]
        check("dp_gd 20 steps (p50)", section["p50_s"], 16.9, "s")
        check("dp_gd peak RSS", section["peak_rss_mib"], 1.5 * gb_mib, "MiB")
    if "isolation" in results and "error" not in results["isolation"]:
        check("probe p99 during scans", results["isolation"]["scanning"]["p99_ms"], 100.0, "ms")
    if "engines" in results and "error" not in results["engines"]:
        out.append(
            {
                "target": "engines: identical integers",
                "measured": results["engines"]["all_identical"],
                "limit": True,
                "unit": "",
                "met": results["engines"]["all_identical"],
            }
        )
    return out


def fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def print_report(results: dict[str, Any], checks: list[dict[str, Any]]) -> None:
    """The table: per measurement its p50 (or value), every run, the server's CPU seconds (median per run),
    the server's RSS at the start and its peak (MiB), the load generator's CPU seconds (all runs) and the
    1-minute load average before → after (or its range over the runs)."""
    header = (
        f"{'measurement':42} {'p50/value':>10} {'runs (s)':>30} {'srv cpu s':>9} "
        f"{'RSS start→peak':>15} {'client cpu':>10} {'load 1m':>9}"
    )
    print(header)
    print("-" * len(header))

    def line(name: str, value: str, runs: str, phases: list[dict[str, Any]]) -> None:
        cpu = median([p["server_cpu_s"] for p in phases])
        rss = (
            f"{min(p['server_rss_start_mib'] for p in phases):.0f}→"
            f"{max(p['server_peak_rss_mib'] for p in phases):.0f}"
        )
        client = sum(p["client_cpu_s"] for p in phases)
        loads = [p["loadavg_before"][0] for p in phases] + [p["loadavg_after"][0] for p in phases]
        load = f"{min(loads):.1f}-{max(loads):.1f}"
        if len(phases) == 1:
            load = f"{phases[0]['loadavg_before'][0]:.1f}→{phases[0]['loadavg_after'][0]:.1f}"
        print(f"{name:42} {value:>10} {runs:>30} {fmt(cpu, 2):>9} {rss:>15} {client:>10.3f} {load:>9}")

    phases_by_name: dict[str, dict[str, Any]] = {}
    for phase in results.get("server", {}).get("phases", []):
        phases_by_name[phase["phase"]] = phase
    if "parquet" in results and "error" not in results["parquet"]:
        s = results["parquet"]
        reg = s["register"]
        line(f"register {s['rows']:,}-row Parquet", f"{reg['wall_s']:.1f} s", "", [reg])
        for q in s["queries"]:
            runs = " ".join(f"{x:.2f}" for x in q["runs_s"])
            phases = [phases_by_name[f"parquet: {q['name']} #{i + 1}"] for i in range(len(q["runs_s"]))]
            line(f"  {q['name']}", f"{q['p50_s']:.2f} s", runs, phases)
    if "csv" in results and "error" not in results["csv"]:
        s = results["csv"]
        up = s["upload"]
        line(
            f"upload {s['rows']:,}-row CSV ({up['source_bytes'] / 1e6:.0f} MB)",
            f"{up['wall_s']:.1f} s",
            "",
            [up],
        )
        for key in ("first_count", "second_count"):
            line(f"  {key.replace('_', ' ')}", f"{s[key]['latency_s']:.3f} s", "", [s[key]])
    if "dp_gd" in results and "error" not in results["dp_gd"]:
        s = results["dp_gd"]
        runs = " ".join(f"{x:.1f}" for x in s["runs_s"])
        line(f"dp_gd 20 steps on {s['rows']:,} rows", f"{s['p50_s']:.1f} s", runs, s["runs"])
    if "isolation" in results and "error" not in results["isolation"]:
        s = results["isolation"]
        for key in ("scanning", "alone"):
            summary = s[key]
            line(
                f"probe {key}, n={summary['count']} (p99)",
                f"{summary['p99_ms']:.0f} ms",
                f"ms p50 {summary['p50_ms']:.1f} p99 {summary['p99_ms']:.1f} max {summary['max_ms']:.0f}",
                [r[key] for r in s["rounds"]],
            )
    if "engines" in results and "error" not in results["engines"]:
        s = results["engines"]
        load = f"{s['loadavg_before'][0]:.1f}→{s['loadavg_after'][0]:.1f}"
        print(
            f"\nengines on {s['rows']:,} rows (seconds, first/second call; Spark startup "
            f"{s['spark_startup_s']:.1f} s; load {load}; client cpu {s['client_cpu_s']:.1f} s):"
        )
        for row in s["plans"]:
            times = "  ".join(
                f"{e} {row[f'{e}_s'][0]:.3f}/{row[f'{e}_s'][1]:.3f}" for e in ("numpy", "duckdb", "spark")
            )
            print(f"  {row['plan'][:56]:56} cells {row['cells']:>5}  {times}  identical={row['identical']}")
    print()
    for c in checks:
        measured = c["measured"]
        shown = f"{measured:.3g}" if isinstance(measured, float) else str(measured)
        limit = c["limit"]
        limit_shown = f"{limit:.4g}" if isinstance(limit, float) else str(limit)
        print(
            f"target {c['target']:50} {shown:>10} {c['unit']:3} ≤ {limit_shown:8} "
            f"{'met' if c['met'] else 'MISSED'}"
        )
    for name, section in results.items():
        if isinstance(section, dict) and "error" in section:
            print(f"section {name} FAILED: {section['error'].splitlines()[0][:300]}")


def source_digest(package: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(package).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def server_settings(env: dict[str, str]) -> dict[str, Any]:
    """The engine settings the server runs with (its environment over the defaults of service.config)."""
    from service.config import Settings

    fields = (
        "engine",
        "engine_threads",
        "engine_memory_limit",
        "memory_max_rows",
        "learner_max_rows",
        "worker_threads",
        "wait_seconds",
        "storage_url",
    )
    defaults = {name: Settings.model_fields[name].default for name in fields}
    overrides = {k: v for k, v in env.items() if k.startswith("EXPOST_") and k != "EXPOST_DATABASE_URL"}
    return {"defaults": defaults, "environment": overrides}


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(BENCH))
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=SECTIONS)
    parser.add_argument("--quick", action="store_true", help="a smoke run (small sizes, few runs)")
    parser.add_argument("--parquet-rows", type=int, default=None, help="section 1 (default 10^8)")
    parser.add_argument("--csv-rows", type=int, default=None, help="sections 2 and 3 (default 10^7)")
    parser.add_argument("--engine-rows", type=int, default=None, help="section 5 (default 10^6)")
    parser.add_argument("--runs", type=int, default=None, help="section 1 rounds (default 5)")
    parser.add_argument("--gd-runs", type=int, default=None, help="section 3 runs (default 3)")
    parser.add_argument("--probe-rounds", type=int, default=None, help="section 4 alternations (default 3)")
    parser.add_argument("--probe-scans", type=int, default=2, help="back-to-back scans per probe round")
    parser.add_argument("--sqlite", action="store_true", help="an embedded SQLite database, not PostgreSQL")
    parser.add_argument("--postgres-url", default=None, help="server on which a throw-away database is made")
    parser.add_argument(
        "--server-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="extra EXPOST_* setting for the server (e.g. EXPOST_ENGINE_THREADS=1)",
    )
    parser.add_argument(
        "--one-server",
        action="store_true",
        help="one server process for sections 1-4 (default: a fresh one per section, so each "
        "section's RSS is its own)",
    )
    parser.add_argument(
        "--keep-data",
        action="store_true",
        help="keep the run's folder (server snapshots, logs) and its database afterwards",
    )
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    quick = args.quick
    defaults = {
        "parquet_rows": (1 << 21, 10**8),
        "csv_rows": (1 << 21, 10**7),
        "engine_rows": (10**5, 10**6),
        "runs": (2, 5),
        "gd_runs": (1, 3),
        "probe_rounds": (1, 3),
    }
    for name, (small, full) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, small if quick else full)
    if args.output is None:
        args.output = DEFAULT_OUTPUT.with_name("data_scale_quick.json") if quick else DEFAULT_OUTPUT
    counts = (args.parquet_rows, args.csv_rows, args.engine_rows, args.runs, args.gd_runs, args.probe_rounds)
    if min(counts) < 1:
        parser.error("sizes and counts must be positive")
    extra_env = {}
    for item in args.server_env:
        name, sep, value = item.partition("=")
        if not sep or not name.startswith("EXPOST_"):
            parser.error(f"--server-env needs EXPOST_NAME=VALUE, got {item!r}")
        extra_env[name] = value

    signal.signal(signal.SIGTERM, _interrupted)  # SIGTERM cleans up as Ctrl-C does (finally blocks run)
    ensure_data_dir()
    started = datetime.now(UTC)
    loadavg_before = os.getloadavg()
    digest = source_digest(ROOT / "service")
    mechanisms_digest = source_digest(ROOT / "mechanisms")
    results: dict[str, Any] = {}
    run_dir = DATA / "runs" / f"{started.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
    run_dir.mkdir(parents=True)
    server_log_errors: list[str] = []
    env: dict[str, str] = {}
    database: str | None = None
    with contextlib.ExitStack() as stack:
        if not args.keep_data:
            stack.callback(shutil.rmtree, run_dir, True)
        server_sections = [s for s in args.sections if s != "engines"]
        if server_sections:
            if args.sqlite:
                url = f"sqlite:///{run_dir / 'expost.db'}"
            else:
                from pg_database import DEFAULT_URL, create_database, drop_database

                database = f"expost_scale_{os.getpid()}_{int(time.time())}"
                url = create_database(args.postgres_url or DEFAULT_URL, database)
                if not args.keep_data:
                    stack.callback(drop_database, args.postgres_url or DEFAULT_URL, database)
            env = {
                **{k: v for k, v in os.environ.items() if not k.startswith("EXPOST_")},
                "PYTHONPATH": str(ROOT),
                "EXPOST_DATABASE_URL": url,
                "EXPOST_DATA_DIR": str(run_dir / "data"),
                "EXPOST_LOG_LEVEL": "INFO",
                "EXPOST_LOG_JSON": "true",
                "EXPOST_RATE_LIMIT": "",
                "EXPOST_RATE_LIMIT_REPORTS": "",
                "EXPOST_WAIT_SECONDS": "600",  # the POST waits for the release (a 202 is polled anyway)
                **extra_env,
            }
            cli(env, run_dir, "migrate")
            run = Run(args, env, run_dir)
            stack.callback(run.stop)  # also on an error or Ctrl-C: the server's process group goes
            run.keys["admin"] = cli(
                env, run_dir, "keys", "create", "--role", "admin", "--name", "scale-admin"
            ).split()[-1]
            run.keys["analyst"] = cli(
                env, run_dir, "keys", "create", "--role", "analyst", "--name", "scale-analyst"
            ).split()[-1]
            sections: dict[str, Callable[[Run], dict[str, Any]]] = {
                "parquet": section_parquet,
                "csv": section_csv,
                "dp_gd": section_dp_gd,
                "isolation": section_isolation,
            }
            for name in server_sections:
                print(f"... section {name}", file=sys.stderr)
                try:
                    if run.server is None or not args.one_server:
                        run.start("main" if args.one_server else name)
                    results[name] = sections[name](run)
                except Exception as exc:  # recorded with the server's log; the other sections still run
                    server = run.server
                    results[name] = {
                        "error": f"{type(exc).__name__}: {exc}",
                        "traceback": traceback.format_exc()[-4000:],
                        "server_alive": server is not None and server.alive(),
                        "server_log_tail": server.log_tail(6000) if server else None,
                    }
                    print(f"section {name} failed: {exc}", file=sys.stderr)
                    if server is not None and not server.alive() and args.one_server:
                        print("the server died; later sections are skipped", file=sys.stderr)
                        break
            run.stop()
            server_log_errors = [line for server in run.servers for line in server.get("log_errors", [])]
            results["server"] = {
                "peak_rss_mib": max((s.get("peak_rss_mib", 0.0) for s in run.servers), default=None),
                "processes": run.servers,
                "phases": run.meter.phases,
                "run_dir": str(run_dir) if args.keep_data else None,
            }
        if "engines" in args.sections:
            print("... section engines", file=sys.stderr)
            try:
                results["engines"] = section_engines(args, run_dir)
            except Exception as exc:
                results["engines"] = {
                    "error": f"{type(exc).__name__}: {exc}",
                    "traceback": traceback.format_exc()[-4000:],
                }

    checks = targets(results)
    failed = [name for name, section in results.items() if isinstance(section, dict) and "error" in section]
    report = {
        "benchmark": "data_scale",
        "when": started.isoformat(timespec="seconds"),
        "finished": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "loadavg_before": list(loadavg_before),
            "loadavg_after": list(os.getloadavg()),
            "memory_total_mib": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / MIB,
        },
        "service_sha256": digest,
        "service_changed_during_run": source_digest(ROOT / "service") != digest,
        "mechanisms_sha256": mechanisms_digest,
        "mechanisms_changed_during_run": source_digest(ROOT / "mechanisms") != mechanisms_digest,
        "settings": {
            "quick": quick,
            "sections": args.sections,
            "parquet_rows": args.parquet_rows,
            "csv_rows": args.csv_rows,
            "engine_rows": args.engine_rows,
            "runs": args.runs,
            "gd_runs": args.gd_runs,
            "probe_rounds": args.probe_rounds,
            "probe_scans": args.probe_scans,
            "one_server": args.one_server,
            "database": "sqlite" if args.sqlite else "postgresql",
            "server": server_settings(env) if env else None,
        },
        "note": "`expost serve --workers 1` (the API and its executor threads in one process; a fresh "
        "one per section unless one_server); "
        "the load generator, PostgreSQL and the server share this machine; client_cpu_s is the load "
        "generator's CPU time per phase; RSS in MiB (2^20 bytes), targets in GB (10^9 bytes)",
        "results": results,
        "targets": checks,
        "failed_sections": failed,
        "ok": not failed,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(
        f"cpu_count={os.cpu_count()}  database={'SQLite' if args.sqlite else 'PostgreSQL'}  "
        f"loadavg before={loadavg_before[0]:.2f} after={os.getloadavg()[0]:.2f}  "
        f"server peak RSS over the run: {fmt(results.get('server', {}).get('peak_rss_mib'), 0)} MiB"
    )
    print_report(results, checks)
    if server_log_errors:
        print(f"server log shows {len(server_log_errors)} error line(s); first: {server_log_errors[0][:500]}")
    if report["service_changed_during_run"] or report["mechanisms_changed_during_run"]:
        print(
            "warning: service/ or mechanisms/ changed during the run: phases may measure different code",
            file=sys.stderr,
        )
    if args.keep_data:
        kept = f"; database {database} (drop it with: psql -c 'DROP DATABASE {database}')" if database else ""
        print(f"kept (--keep-data): run folder {run_dir}{kept}")
    print(f"written: {args.output}")
    return 0 if not failed else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt as interrupted:
        print(
            f"interrupted ({interrupted or 'Ctrl-C'}): server processes stopped, run folder and database "
            "removed (unless --keep-data)",
            file=sys.stderr,
        )
        sys.exit(130)
