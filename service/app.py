"""The composition root: builds the runtime (engine, sessions, executor, writer, reaper) and the FastAPI
application around it. Nothing imports this module except the entry points (CLI, embedded server, tests);
everything below receives what it needs as arguments.
"""

from __future__ import annotations

import functools
import gc
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from types import FrameType
from typing import Any

import structlog
from fastapi import FastAPI

from service import metrics
from service.api.direct import DirectSubmitRoute
from service.api.middleware import ObservabilityMiddleware
from service.api.openapi import operation_id
from service.api.problems import install_error_handlers, install_openapi
from service.api.ratelimit import GuardMiddleware
from service.api.routers import (
    dashboard,
    datasets,
    docs,
    health,
    keys,
    limits,
    me,
    mechanisms,
    requests,
    sessions,
    sql,
)
from service.api.routers.reports import router as reports_router
from service.api.schemas import ERROR_RESPONSES
from service.auth import KeyCache
from service.config import Settings, get_settings
from service.datasets import build_tables
from service.logs import configure_logging, failure_fields
from service.runs.executor import Executor, InProcessExecutor
from service.runs.queue import QueueExecutor
from service.runs.runtime import Runtime
from service.runs.sessions import expire_sessions
from service.runs.worker import SHUTDOWN_REASON, reap_expired, run_next, stop_runs
from service.runs.writer import WriteBatcher
from service.store.engine import make_engine, make_sessionmaker
from service.store.migrate import ensure_migrated

log = structlog.get_logger("expost")


def build_runtime(settings: Settings) -> Runtime:
    """Engine, sessions, table cache, the executor of ``settings.executor`` and the group-commit writer."""
    engine = make_engine(settings.database_url, settings.pool_size)
    sessions = make_sessionmaker(engine)
    tables = build_tables(settings)
    executor: Executor
    if settings.executor == "queue":
        executor = QueueExecutor(settings)
    else:
        executor = InProcessExecutor(
            lambda on_claim: run_next(
                sessions,
                tables,
                settings.lease_seconds,
                settings.heartbeat_seconds,
                on_claim=on_claim,
                queue=settings.queue_name,
                max_claimed_per_analyst=settings.max_claimed_per_analyst,
            ),
            lambda claimed: stop_runs(sessions, claimed, SHUTDOWN_REASON),
            settings.worker_threads,
            settings.poll_seconds,
        )
    return Runtime(settings, engine, sessions, tables, executor, WriteBatcher(sessions))


def start_reaper(runtime: Runtime) -> threading.Thread:
    """Every ``reaper_interval_seconds``: charge runs whose worker was lost, close expired sessions."""

    def loop() -> None:
        while not runtime.stop.is_set():
            try:
                reap_expired(runtime.sessions, runtime.settings.max_queue_seconds)
                expire_sessions(runtime.sessions)
            except Exception as exc:
                log.error("reaper pass failed", **failure_fields(exc))
            runtime.stop.wait(runtime.settings.reaper_interval_seconds)

    thread = threading.Thread(target=loop, name="expost-reaper", daemon=True)
    thread.start()
    return thread


def install_signal_handlers(runtime: Runtime) -> None:
    """SIGTERM/SIGINT: :meth:`Runtime.drain` at once (the grace period starts at the signal), and uvicorn's
    own handler (which closes the listening socket) only once this process runs nothing or the grace period
    is over: until then the server goes on answering, so a new submission gets its ``503`` and clients can
    still read their requests' state. A second signal stops at once. Only possible in the main thread
    (``expost serve``)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGTERM, signal.SIGINT):
        previous = signal.getsignal(sig)

        def handler(signum: int, frame: FrameType | None, previous: Any = previous) -> None:
            first = not runtime.draining.is_set()
            runtime.drain()
            if not callable(previous):
                return
            if not first:
                previous(signum, frame)
                return
            stop_server = functools.partial(previous, signum, frame)
            threading.Thread(
                target=stop_when_idle, args=(runtime, stop_server), name="expost-drain", daemon=True
            ).start()

        signal.signal(sig, handler)


def stop_when_idle(runtime: Runtime, stop_server: Callable[[], None], poll: float = 0.05) -> None:
    """Call ``stop_server`` once no run is in flight here, or when the grace period is over."""
    deadline = runtime.grace_deadline()
    while runtime.executor.in_flight() and time.monotonic() < deadline:
        time.sleep(poll)
    stop_server()


#: Allocations (net, of objects the cycle collector tracks) between young-generation collections;
#: CPython's default is 700. Requests free almost everything by reference counting.
YOUNG_COLLECTION_THRESHOLD = 5000
_heap_frozen = threading.Lock()


def freeze_startup_heap() -> None:
    """Once per process, at start-up: move the ≈ 250 000 objects of the imported modules into the
    collector's permanent generation (``gc.freeze``), and collect the young generation less often. Called
    before the runtime is built, so a runtime (its engine, caches and threads, which hold reference
    cycles) is never frozen: a process that starts several apps (tests) frees each one's runtime.

    Measured under cheap-request load (benchmarks/service_load.py, 1 process): without it each full
    collection walked the whole start-up heap (150-210 ms, one every ≈ 1.6 s of CPU, 12-14 % of the
    process's CPU and its p99); with it, 1.6 %. Frozen objects are still freed by reference counting, never
    by the cycle collector, so a process freezes once: where many apps start in one process (tests), only
    the first start freezes.
    """
    if not _heap_frozen.acquire(blocking=False):
        return
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_COLLECTION_THRESHOLD, middle, old)


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    configure_logging(settings.log_level, settings.log_json)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        freeze_startup_heap()  # before the runtime and its threads: those stay collectable
        runtime = build_runtime(settings)
        ensure_migrated(runtime.engine, settings.database_url)
        app.state.runtime = runtime
        app.state.keys = KeyCache(runtime.sessions, settings.auth_cache_seconds)
        runtime.reaper = start_reaper(runtime)
        install_signal_handlers(runtime)  # SIGTERM: drain at once, then uvicorn stops; close() ends the runs
        log.info("expost started", database=runtime.engine.url.render_as_string(hide_password=True))
        try:
            yield
        finally:
            runtime.close()
            del app.state.runtime, app.state.keys  # an app frozen at start-up must not pin its runtime

    app = FastAPI(
        title="expost",
        version="0.1.0",
        summary="Privacy budgets as a persistent ex-post Rényi-DP filter",
        lifespan=lifespan,
        generate_unique_id_function=operation_id,  # camelCase operationIds (service/api/openapi.py)
        docs_url=None,  # /docs and /redoc: service/api/routers/docs.py, with assets served by the app
        redoc_url=None,
        telemetry=None if settings.opentelemetry else {"tracing": False, "metrics": False, "logs": False},
    )
    install_error_handlers(app)
    install_openapi(app)
    for module in (health, keys, me, datasets, requests, sql, sessions, limits, mechanisms, dashboard):
        app.include_router(module.router, responses=ERROR_RESPONSES)
    app.include_router(reports_router, responses=ERROR_RESPONSES)
    app.include_router(docs.router)
    if settings.direct_submit and not settings.opentelemetry:  # FastAPI's spans need its own route
        app.router.routes.insert(0, DirectSubmitRoute(app))  # first: the busiest route, matched by one regex
    app.mount("/metrics", metrics.asgi_app(app))  # with PROMETHEUS_MULTIPROC_DIR: every process
    app.add_middleware(GuardMiddleware, settings=settings)  # per-key rate limits, body size limits
    app.add_middleware(ObservabilityMiddleware)  # request id, access log, HTTP latency
    return app
