"""Real processes for the scale-out and crash tests: API servers, queue workers, a private PostgreSQL.

``python -m tests.integration.scale_out_support <expost args>`` is the real ``expost`` CLI with three test
mechanisms added to the catalog of *that* process (never of the installed service):

* ``test.sleepy_count``: a Laplace count (same worst case and realized curve) that is long-running with
  public progress: it works for ``EXPOST_TEST_SLEEP`` seconds in 0.1 s slices, calling ``progress`` after
  each, so a worker can be killed mid-run;
* ``test.busy_count``: a Laplace count that first burns ``EXPOST_TEST_BUSY`` seconds of one CPU core
  (the heavy, CPU-bound request of the scale-out benchmark);
* ``test.steps_count``: a Laplace count with a public ``steps`` parameter, working ``steps`` slices of
  ``EXPOST_TEST_STEP`` seconds with public progress (long and short runs side by side).

``test.sleepy_count``, ``test.steps_count`` and ``test.gated_count`` (a run held by an event, for the
in-process tests of test_fair_execution.py, which put an instance in their own catalog) are the one
:class:`WorkingCount` skeleton: a long-running Laplace count with public progress.

After every scenario :func:`assert_books_balance` checks, straight in the database: ``expost ledger
verify`` is clean; no request is left running and nothing is reserved; every request has exactly one
reserve and one commit (or abort) in the ledger; a committed request has its release, a failed one has
none and was charged its worst case; and each filter's spent total equals the sum of the charges of its
settled requests, i.e. exactly what the released outputs (and the lost runs' worst cases) justify.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import httpx
from pydantic import BaseModel, Field
from sqlalchemy import select

from mechanisms.accounting import UnitsVector
from mechanisms.base import ProgressFn, PublicContext, Release, Table, no_progress
from mechanisms.noise import Noise
from mechanisms.queries.laplace import Laplace, LaplaceParams
from service.embedded import free_port

ROOT = Path(__file__).resolve().parents[2]
REDIS_URL = os.environ.get("EXPOST_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
IN_CI = os.environ.get("CI", "").lower() == "true"
COUNT = {"query": {"kind": "count"}, "epsilon": 0.01}


class WorkingCount(Laplace):
    """A Laplace count (same worst case and realized curve) that is long-running with public progress: its
    run first does :meth:`work`, which calls ``progress`` (the worker's heartbeat) as it goes, then releases
    the count (Laplace's run reads only ``query`` and ``epsilon`` of a subclass's params)."""

    long_running: ClassVar[bool] = True
    progress_is_public: ClassVar[bool] = True

    def work(self, params: BaseModel, progress: ProgressFn) -> None:
        raise NotImplementedError

    def run(  # type: ignore[override]
        self,
        params: BaseModel,
        ctx: PublicContext,
        table: Table,
        noise: Noise,
        progress: ProgressFn = no_progress,
    ) -> Release:
        self.work(params, progress)
        return super().run(params, ctx, table, noise)


class SleepyCount(WorkingCount):
    name: ClassVar[str] = "test.sleepy_count"

    def work(self, params: BaseModel, progress: ProgressFn) -> None:
        seconds = float(os.environ.get("EXPOST_TEST_SLEEP", "1.0"))
        slices = max(1, round(seconds / 0.1))
        for i in range(slices):
            time.sleep(seconds / slices)
            progress((i + 1) / slices)


class StepsParams(LaplaceParams):
    steps: int = Field(10, ge=1, le=100_000, description="slices of EXPOST_TEST_STEP seconds of 'work'")


class StepsCount(WorkingCount):
    """A Laplace count whose run takes ``steps`` (a public parameter) slices of ``EXPOST_TEST_STEP``
    seconds, with public progress after each: a long learner in miniature (steps done of steps
    admitted), so one analyst can flood long runs and another submit a short one."""

    name: ClassVar[str] = "test.steps_count"
    params_model: ClassVar[type[BaseModel]] = StepsParams

    def work(self, params: BaseModel, progress: ProgressFn) -> None:
        assert isinstance(params, StepsParams)
        pause = float(os.environ.get("EXPOST_TEST_STEP", "0.1"))
        for i in range(params.steps):
            time.sleep(pause)
            progress((i + 1) / params.steps)


class GatedCount(WorkingCount):
    """Works (in 20 ms slices, each with a heartbeat) until its gate opens, then releases; ``started`` is
    set when its run begins and ``stopped`` when it ends either way (released, or stopped by a cancel).
    One instance per test, put in the catalog of the test process only."""

    name: ClassVar[str] = "test.gated_count"

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.started = threading.Event()
        self.stopped = threading.Event()
        self.slices = 0

    def work(self, params: BaseModel, progress: ProgressFn) -> None:
        for i in range(3000):  # at most a minute
            if self.gate.is_set():
                break
            time.sleep(0.02)
            self.slices += 1
            progress(min(0.99, (i + 1) / 100))

    def run(  # type: ignore[override]
        self,
        params: BaseModel,
        ctx: PublicContext,
        table: Table,
        noise: Noise,
        progress: ProgressFn = no_progress,
    ) -> Release:
        self.started.set()
        try:
            return super().run(params, ctx, table, noise, progress)
        finally:
            self.stopped.set()


class BusyCount(Laplace):
    name: ClassVar[str] = "test.busy_count"

    def run(self, params: BaseModel, ctx: PublicContext, table: Table, noise: Noise) -> Release:
        burn(float(os.environ.get("EXPOST_TEST_BUSY", "0.2")))
        return super().run(params, ctx, table, noise)


def burn(seconds: float) -> None:
    """Keep one core busy for about ``seconds`` (pure Python: holds the GIL, like much real work)."""
    end = time.thread_time() + seconds
    x = 0
    while time.thread_time() < end:
        for i in range(10_000):
            x ^= i * i


def register() -> None:
    from mechanisms.catalog import MECHANISMS

    MECHANISMS.setdefault(SleepyCount.name, SleepyCount())
    MECHANISMS.setdefault(BusyCount.name, BusyCount())
    MECHANISMS.setdefault(StepsCount.name, StepsCount())


# ----- processes -----------------------------------------------------------------------------------------


def redis_available() -> bool:
    import redis

    try:
        return bool(redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2).ping())
    except redis.RedisError:
        return False


def require_redis() -> None:
    import pytest

    if not redis_available():
        message = f"Redis is not reachable at {REDIS_URL}"
        if IN_CI:
            pytest.fail(f"{message} (CI=true: queue tests must run)", pytrace=False)
        pytest.skip(message)


@dataclass
class Proc:
    popen: subprocess.Popen[bytes]
    log: Path
    kind: str

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def kill9(self) -> None:
        """SIGKILL the whole process group (uvicorn supervisor and its workers, or one worker)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        self.popen.wait(15)

    def stop(self) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(20)
            except subprocess.TimeoutExpired:
                self.kill9()


@dataclass
class Cluster:
    """API processes and queue workers sharing one database and one (per-test) queue."""

    workdir: Path
    database_url: str
    env: dict[str, str]
    procs: list[Proc] = field(default_factory=list)
    admin_key: str = ""

    @classmethod
    def create(cls, workdir: Path, database_url: str, **settings: str) -> Cluster:
        queue = f"t{uuid.uuid4().hex[:12]}"
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "EXPOST_DATABASE_URL": database_url,
            "EXPOST_DATA_DIR": str(workdir / "data"),
            "EXPOST_EXECUTOR": "queue",
            "EXPOST_BROKER_URL": REDIS_URL,
            "EXPOST_QUEUE_NAME": queue,
            "EXPOST_INLINE_MECHANISMS": "[]",
            "EXPOST_LEASE_SECONDS": "4",
            "EXPOST_REAPER_INTERVAL_SECONDS": "0.5",
            "EXPOST_HEARTBEAT_SECONDS": "0.5",
            "EXPOST_WAIT_SECONDS": "0.5",
            "EXPOST_RATE_LIMIT": "",
            "EXPOST_RATE_LIMIT_FAILED_AUTH": "",
            "EXPOST_POLL_SECONDS": "0.5",
            "EXPOST_SHUTDOWN_GRACE_SECONDS": "5",
            "EXPOST_MAX_RUNNING_REQUESTS_PER_ANALYST": "100000",  # bursts here test crashes, not limits
            "EXPOST_LOG_LEVEL": "INFO",
            "OPENBLAS_NUM_THREADS": "1",
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
            "dramatiq_restart_delay": "500",
            **{f"EXPOST_{k.upper()}": v for k, v in settings.items()},
        }
        from service.store.migrate import upgrade

        upgrade(database_url)  # in this process: a CLI start costs seconds on a loaded 2-core machine
        return cls(workdir, database_url, env)

    def cli(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "tests.integration.scale_out_support", *args],
            env=self.env,
            cwd=self.workdir,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def _spawn(self, kind: str, args: list[str], env: dict[str, str] | None = None) -> Proc:
        log = self.workdir / f"{kind}-{len(self.procs)}.log"
        with log.open("wb") as out:
            popen = subprocess.Popen(
                [sys.executable, "-m", "tests.integration.scale_out_support", *args],
                env=env or self.env,
                cwd=self.workdir,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        proc = Proc(popen, log, kind)
        self.procs.append(proc)
        return proc

    def api(self, processes: int = 1, port: int | None = None, wait: bool = True) -> tuple[Proc, str]:
        port = port or free_port()
        proc = self._spawn("api", ["serve", "--port", str(port), "--workers", str(processes)])
        base = f"http://127.0.0.1:{port}"
        if wait:
            self.wait_api(proc, base, processes)
        return proc, base

    def wait_api(self, proc: Proc, base: str, processes: int = 1) -> None:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            assert proc.alive(), proc.text()[-3000:]
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{base}/readyz", timeout=2).status_code == 200 and (
                    proc.text().count("expost started") >= processes
                ):
                    return
            time.sleep(0.1)
        raise AssertionError(f"the API did not start:\n{proc.text()[-3000:]}")

    def worker(self, threads: int = 1, wait: bool = True, **env: str) -> Proc:
        extra = {**self.env, **env}
        proc = self._spawn(
            "worker", ["worker", "--queue", "--threads", str(threads), "--interval", "0.5"], extra
        )
        if wait:
            self.wait_worker(proc)
        return proc

    def wait_worker(self, proc: Proc) -> None:
        deadline = time.monotonic() + 90
        while "worker consuming queue" not in proc.text():
            assert proc.alive(), proc.text()[-3000:]
            assert time.monotonic() < deadline, proc.text()[-3000:]
            time.sleep(0.05)

    def start(self, workers: int, threads: int = 1, processes: int = 1) -> tuple[Proc, str, list[Proc]]:
        """An API and ``workers`` queue workers, started together."""
        api, base = self.api(processes, wait=False)
        started = [self.worker(threads, wait=False) for _ in range(workers)]
        for proc in started:
            self.wait_worker(proc)
        self.wait_api(api, base, processes)
        return api, base, started

    def setup_world(self, base: str, epsilon: float = 1000.0, datasets: int = 1) -> World:
        from service.auth import Role, create_key
        from service.store.engine import make_engine, make_sessionmaker

        engine = make_engine(self.database_url)
        try:
            with make_sessionmaker(engine)() as session, session.begin():
                self.admin_key = create_key(session, f"admin-{uuid.uuid4().hex[:6]}", Role.admin)
        finally:
            engine.dispose()
        admin = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {self.admin_key}"}, timeout=60)
        key = admin.post("/v1/keys", json={"name": f"analyst-{uuid.uuid4().hex[:6]}", "role": "analyst"})
        assert key.status_code == 201, key.text
        analyst_name, analyst_key = key.json()["name"], key.json()["key"]
        from tests.integration.helpers import upload

        ids = []
        for _ in range(datasets):
            up = upload(admin)
            assert up.status_code == 201, up.text
            dataset_id = up.json()["id"]
            granted = admin.post(f"/v1/datasets/{dataset_id}/grants", json={"analyst": analyst_name})
            assert granted.status_code == 201, granted.text
            put = admin.put(f"/v1/datasets/{dataset_id}/budget", json={"epsilon": epsilon, "delta": 0.0})
            assert put.status_code == 200, put.text
            ids.append(dataset_id)
        admin.close()
        return World(ids, analyst_name, analyst_key)

    def close(self) -> None:
        for proc in self.procs:  # SIGTERM all at once, then wait for each
            if proc.alive():
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            proc.stop()
        purge_queue(self.env["EXPOST_QUEUE_NAME"])


@dataclass
class World:
    dataset_ids: list[str]
    analyst: str
    analyst_key: str

    @property
    def dataset_id(self) -> str:
        return self.dataset_ids[0]

    def client(self, base: str) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.analyst_key}"}
        return httpx.Client(base_url=base, headers=headers, timeout=60)


def purge_queue(queue: str) -> None:
    import redis

    with contextlib.suppress(redis.RedisError):
        client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2)
        keys = list(client.scan_iter(f"expost-tasks:{queue}*"))
        if keys:
            client.delete(*keys)


@contextlib.contextmanager
def cluster(workdir: Path, database_url: str, **settings: str) -> Iterator[Cluster]:
    require_redis()
    made = Cluster.create(workdir, database_url, **settings)
    try:
        yield made
    finally:
        made.close()


# ----- the installed ``expost`` CLI, one server process tree -------------------------------------------

EXPOST = str(Path(sys.executable).with_name("expost"))


def run_cli(env: dict[str, str], cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The installed ``expost`` CLI, run to completion."""
    return subprocess.run(
        [EXPOST, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=120, check=False
    )


def _children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the server's process group (supervisor and workers), then SIGKILL whatever is left."""
    workers = _children(proc.pid)
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=15)
    for pid in workers:  # workers of a supervisor that died first: only those still in our group
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if os.getpgid(pid) == proc.pid:
                os.kill(pid, signal.SIGKILL)


def wait_ready(
    proc: subprocess.Popen[bytes], base_url: str, log_path: Path, workers: int, timeout: float = 60
) -> None:
    """/readyz answers and every server process has finished its startup (one "expost started" each),
    so that a race really spreads over all of them."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"expost serve exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
        with contextlib.suppress(httpx.TransportError):
            ready = httpx.get(f"{base_url}/readyz", timeout=2).status_code == 200
            if ready and log_path.read_text(errors="replace").count("expost started") >= workers:
                return
        time.sleep(0.1)
    raise RuntimeError(
        f"expost serve: /readyz or {workers} startup lines missing after {timeout} s:\n"
        f"{log_path.read_text()[-4000:]}"
    )


def cli_create_key(env: dict[str, str], cwd: Path, role: str, name: str) -> subprocess.Popen[str]:
    """``expost keys create`` started (several may run at once); :func:`cli_keys_from` collects the keys."""
    return subprocess.Popen(
        [EXPOST, "keys", "create", "--role", role, "--name", name],
        env=env,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def cli_keys_from(*procs: subprocess.Popen[str]) -> list[str]:
    """The keys printed by :func:`cli_create_key` processes, in their order."""
    outputs = [proc.communicate(timeout=120) for proc in procs]
    for proc, (_, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, err
    return [out.strip().splitlines()[-1] for out, _ in outputs]


# ----- the books --------------------------------------------------------------------------------------


def wait_until_settled(database_url: str, dataset_ids: list[str], timeout: float) -> None:
    from service.store.engine import make_engine, make_sessionmaker
    from service.store.models import AnalysisRequest

    engine = make_engine(database_url)
    try:
        deadline = time.monotonic() + timeout
        while True:
            with make_sessionmaker(engine)() as session:
                running = session.scalars(
                    select(AnalysisRequest.id).where(
                        AnalysisRequest.dataset_id.in_(dataset_ids), AnalysisRequest.state == "running"
                    )
                ).all()
            if not running:
                return
            assert time.monotonic() < deadline, f"{len(running)} requests still running"
            time.sleep(0.2)
    finally:
        engine.dispose()


def assert_books_balance(cluster: Cluster, dataset_ids: list[str], cli: bool = True) -> Counter[str]:
    """The checks of the module docstring; returns the count of requests per final state. ``cli=False``
    runs the verification of ``expost ledger verify`` (``service.filter.ledger.verify``) in this process
    instead of starting the CLI (which takes seconds on a loaded machine)."""
    from service.filter.ledger import verify
    from service.store.engine import make_engine, make_sessionmaker
    from service.store.models import AnalysisRequest, LedgerEntry, PrivacyFilter

    if cli:
        verified = cluster.cli("ledger", "verify")
        assert verified.returncode == 0, verified.stdout + verified.stderr
        assert verified.stdout.strip().endswith("ok"), verified.stdout
    engine = make_engine(cluster.database_url)
    states: Counter[str] = Counter()
    try:
        with make_sessionmaker(engine)() as session:
            if not cli:
                assert verify(session).problems == []
            for dataset_id in dataset_ids:
                requests = session.scalars(
                    select(AnalysisRequest).where(AnalysisRequest.dataset_id == dataset_id)
                ).all()
                events: dict[str, Counter[str]] = {}
                for request_id, event in session.execute(
                    select(LedgerEntry.request_id, LedgerEntry.event).where(
                        LedgerEntry.dataset_id == dataset_id, LedgerEntry.request_id.is_not(None)
                    )
                ):
                    events.setdefault(request_id, Counter())[event] += 1
                rows = session.scalars(select(PrivacyFilter).where(PrivacyFilter.dataset_id == dataset_id))
                filters = {f.scope: f for f in rows}
                slots = len(UnitsVector.from_json(filters["*"].spent))
                spent: dict[str, UnitsVector] = {scope: UnitsVector.zeros(slots) for scope in filters}
                for request in requests:
                    states[request.state] += 1
                    assert request.state in ("committed", "failed_charged", "aborted"), request.state
                    seen = events.get(request.id, Counter())
                    ended = "abort" if request.state == "aborted" else "commit"
                    assert seen == Counter({"reserve": 1, ended: 1}), (request.id, seen)
                    if request.state == "aborted":
                        assert request.release is None
                        continue
                    assert request.realized is not None
                    charge = UnitsVector.from_json(request.realized["units"])
                    if request.state == "committed":
                        assert request.release is not None, request.id
                    else:
                        assert request.release is None, request.id
                        assert request.realized == request.worst_case  # a lost run costs its worst case
                    for scope in request.scopes:
                        spent[scope] = spent[scope] + charge
                for scope, flt in filters.items():
                    reserved = UnitsVector.from_json(flt.reserved)
                    assert reserved == UnitsVector.zeros(slots), (scope, flt.reserved)
                    assert UnitsVector.from_json(flt.spent) == spent[scope], scope
    finally:
        engine.dispose()
    return states


# ----- a private, throw-away PostgreSQL cluster (for restart tests) ------------------------------------


@dataclass
class PrivatePostgres:
    directory: Path
    port: int
    bin: Path
    user: str | None

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/expost"

    def _run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        command = [str(self.bin / args[0]), *args[1:]]
        if self.user is not None:
            command = ["runuser", "-u", self.user, "--", *command]
        return subprocess.run(command, capture_output=True, text=True, timeout=120, check=check)

    def start(self) -> None:
        self._run(
            "pg_ctl",
            "-D",
            str(self.directory / "data"),
            "-l",
            str(self.directory / "pg.log"),
            "-o",
            f"-p {self.port} -k {self.directory} -c listen_addresses=127.0.0.1",
            "-w",
            "start",
        )

    def stop(self, mode: str = "fast") -> None:
        self._run("pg_ctl", "-D", str(self.directory / "data"), "-m", mode, "-w", "stop", check=False)

    def restart(self) -> None:
        self.stop("immediate")  # like a crash: no checkpoint, recovery on start
        self.start()


def postgres_bin() -> Path | None:
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
    return found[-1].parent if found else None


@contextlib.contextmanager
def private_postgres() -> Iterator[PrivatePostgres]:
    """initdb + pg_ctl on a free port in ``tmp`` (as the ``postgres`` OS user when running as root)."""
    import psycopg
    import pytest

    bin_dir = postgres_bin()
    if bin_dir is None:
        message = "PostgreSQL server binaries (initdb, pg_ctl) are not installed"
        if IN_CI:
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    user = "postgres" if os.geteuid() == 0 else None
    # under /tmp (world-traversable), not pytest's 0700 tmp_path: the server may run as another user
    directory = Path(tempfile.mkdtemp(prefix="expost-pg-", dir="/tmp"))
    if user is not None:
        shutil.chown(directory, user, user)
        directory.chmod(0o700)
    pg = PrivatePostgres(directory, free_port(), bin_dir, user)
    pg._run(
        "initdb", "-D", str(directory / "data"), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync"
    )
    pg.start()
    try:
        with psycopg.connect(f"postgresql://postgres@127.0.0.1:{pg.port}/postgres", autocommit=True) as conn:
            conn.execute("CREATE DATABASE expost")
        yield pg
    finally:
        pg.stop("immediate")
        shutil.rmtree(directory, ignore_errors=True)


def main() -> None:
    register()
    from service.cli import app

    app(prog_name="expost")


if __name__ == "__main__":
    main()
