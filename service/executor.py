"""Executors run admitted requests: a thread pool in the API process, or a distributed task queue.

An executor never decides budget: admission and commit happen in database transactions
(``service.requests``); the executor only gets ``run_request(request_id)`` called somewhere. The queue
executor (``service.queue``) sends just the request id to a Dramatiq queue; ``expost worker`` processes
claim the request in the database (a lease), run it and settle it once.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

from service import metrics


class Executor(Protocol):
    def submit(self, request_id: str) -> Future[None]:
        """Hand the request over; raises RuntimeError when it cannot (shutting down, broker down)."""
        ...

    def shutdown(self) -> None: ...


class InProcessExecutor:
    def __init__(self, run: Callable[[str], object], threads: int) -> None:
        self._run = run
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="expost-worker")

    def submit(self, request_id: str) -> Future[None]:
        metrics.EXECUTOR_QUEUED.inc()
        try:
            return self._pool.submit(self._running, request_id)
        except BaseException:
            metrics.EXECUTOR_QUEUED.dec()
            raise

    def _running(self, request_id: str) -> None:
        metrics.EXECUTOR_QUEUED.dec()
        metrics.EXECUTOR_RUNNING.inc()
        try:
            self._run(request_id)
        finally:
            metrics.EXECUTOR_RUNNING.dec()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
