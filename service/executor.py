"""Executors run admitted requests. The in-process one is a thread pool inside the API process.

An executor never decides budget: admission and commit happen in database transactions
(``service.requests``); the executor only calls ``run_request(request_id)`` somewhere.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

from service import metrics


class Executor(Protocol):
    def submit(self, request_id: str) -> Future[None]: ...

    def shutdown(self) -> None: ...


class InProcessExecutor:
    def __init__(self, run: Callable[[str], None], threads: int) -> None:
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
