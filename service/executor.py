"""Executors run admitted requests. The in-process one is a thread pool inside the API process.

An executor never decides budget: admission and commit happen in database transactions
(``service.requests``); the executor only calls ``run_request(request_id)`` somewhere.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol


class Executor(Protocol):
    def submit(self, request_id: str) -> Future[None]: ...

    def shutdown(self) -> None: ...


class InProcessExecutor:
    def __init__(self, run: Callable[[str], None], threads: int) -> None:
        self._run = run
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="expost-worker")

    def submit(self, request_id: str) -> Future[None]:
        return self._pool.submit(self._run, request_id)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
