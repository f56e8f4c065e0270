"""Executors run admitted requests: threads in the API process, or ``expost worker`` processes.

An executor never decides budget: admission and commit happen in database transactions
(``service.runs.requests``). The queue is the database: an admitted request waits there (``running`` with no
``lease_owner``) until a worker thread **claims** it in the fair order of ``requests.claim_next``
(per-analyst round-robin) with one conditional UPDATE. The executor only wakes worker threads:

* :class:`InProcessExecutor` (the embedded default): a :class:`FairRunner` of daemon threads inside each
  API process; ``submit`` wakes one.
* ``service.runs.queue.QueueExecutor``: ``submit`` sends a wake-up through the Dramatiq/Redis queue to the
  ``expost worker`` processes, each of which runs a :class:`FairRunner` too.

Idle runner threads also look for queued work every ``poll_seconds``, so a request queued by a process
that died, or whose wake-up was lost, is still picked up. Because every worker takes the fairest request
when it becomes free, a burst from one analyst delays another analyst's request by at most the remainder
of one run per worker (docs/operations.md, "Fair scheduling").

Shutdown (:meth:`FairRunner.shutdown`): stop claiming, let the runs in flight finish until the deadline,
then settle those still running with their worst case (their data was read;
docs/privacy/rules.md#rule-reserve-before-read) so that
their heartbeats fail and they stop; queued requests stay queued for the other or the next workers.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Protocol

import structlog

from service import metrics
from service.logs import failure_fields

log = structlog.get_logger("expost.executor")

# run_next(on_claim) -> (request id, outcome) or None when nothing is queued
RunNext = Callable[[Callable[[str, str], None]], "tuple[str, str] | None"]
# stop(claimed [(request id, owner)]) -> how many were stopped
StopRuns = Callable[[list[tuple[str, str]]], int]


class Executor(Protocol):
    def submit(self, request_id: str) -> None:
        """Wake a worker for a newly queued request; raises RuntimeError when it cannot (shutting down,
        broker down)."""
        ...

    def drain(self) -> None:
        """Stop starting new runs (runs in flight go on)."""
        ...

    def shutdown(self, deadline: float | None = None) -> None:
        """Stop; runs in flight may finish until ``deadline`` (``time.monotonic()``), then are stopped."""
        ...

    def in_flight(self) -> int:
        """How many runs this process's threads are running now."""
        ...


class FairRunner:
    """``threads`` daemon threads, each claiming and running the next queued request until none is left,
    then sleeping until woken or ``poll_seconds`` pass."""

    def __init__(
        self, run_next: RunNext, stop_runs: StopRuns, threads: int, poll_seconds: float, name: str
    ) -> None:
        self._run_next, self._stop_runs = run_next, stop_runs
        self.poll_seconds = poll_seconds
        self._cond = threading.Condition()
        self._wakeups = 0
        self._idle = 0
        self._draining = threading.Event()
        self._active: dict[str, tuple[str, str]] = {}  # thread name -> (request id, owner)
        self.outcomes: dict[str, int] = {}
        self._threads = [
            threading.Thread(target=self._loop, name=f"{name}-{i}", daemon=True) for i in range(threads)
        ]
        self._started = False

    def start(self) -> None:
        if not self._started:
            self._started = True
            for thread in self._threads:
                thread.start()

    @property
    def draining(self) -> bool:
        return self._draining.is_set()

    def wake(self, wait_idle: float = 0.0) -> bool:
        """Wake one idle thread (or have the next free one look again); with ``wait_idle``, first wait up
        to that long for an idle thread. Returns whether a thread was idle."""
        if self._draining.is_set():
            raise RuntimeError("the executor is shutting down")
        deadline = time.monotonic() + wait_idle
        with self._cond:
            while self._idle - self._wakeups <= 0 and time.monotonic() < deadline:
                self._cond.wait(min(0.05, max(0.0, deadline - time.monotonic())))
            idle = self._idle - self._wakeups > 0
            self._wakeups = min(self._wakeups + 1, len(self._threads))
            metrics.EXECUTOR_QUEUED.set(self._wakeups)
            self._cond.notify()
        return idle

    def _loop(self) -> None:
        me = threading.current_thread().name

        def on_claim(request_id: str, owner: str) -> None:
            metrics.EXECUTOR_RUNNING.inc()
            with self._cond:
                self._active[me] = (request_id, owner)

        while not self._draining.is_set():
            done = None
            try:
                done = self._run_next(on_claim)
            except Exception as exc:  # e.g. the database restarting: try again after a pause
                log.error("worker thread failed; retrying", **failure_fields(exc))
                self._draining.wait(min(1.0, self.poll_seconds))
            finally:
                with self._cond:
                    if self._active.pop(me, None) is not None:
                        metrics.EXECUTOR_RUNNING.dec()
                    self._cond.notify_all()
            if done is not None:
                request_id, outcome = done
                with self._cond:
                    self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
                log.info("task done", request_id=request_id, outcome=outcome)
                continue
            with self._cond:
                if self._wakeups > 0:
                    self._wakeups -= 1
                    metrics.EXECUTOR_QUEUED.set(self._wakeups)
                    continue
                self._idle += 1
                self._cond.notify_all()
                deadline = time.monotonic() + self.poll_seconds
                try:
                    # Sleep until a wake-up, the drain or the poll time: other threads' notify_all (sent so
                    # that ``wake``/``drain`` waiters re-check) must not make idle threads query the database
                    # again, or idle threads wake each other in a loop that competes with the writer.
                    while self._wakeups == 0 and not self._draining.is_set():
                        remaining = deadline - time.monotonic()
                        if remaining <= 0:
                            break
                        self._cond.wait(remaining)
                finally:
                    self._idle -= 1
                if self._wakeups > 0:
                    self._wakeups -= 1
                    metrics.EXECUTOR_QUEUED.set(self._wakeups)

    def running(self) -> list[tuple[str, str]]:
        with self._cond:
            return list(self._active.values())

    def drain(self) -> None:
        self._draining.set()
        with self._cond:
            self._cond.notify_all()

    def shutdown(self, deadline: float | None = None) -> None:
        """Stop claiming; wait for the runs in flight until ``deadline``; stop those still running."""
        self.drain()
        if not self._started:
            return
        deadline = time.monotonic() if deadline is None else deadline
        with self._cond:
            while self._active and time.monotonic() < deadline:
                self._cond.wait(min(0.1, max(0.0, deadline - time.monotonic())))
            left = list(self._active.values())
        if left:
            log.warning("grace period over; stopping runs in flight", count=len(left))
            try:
                self._stop_runs(left)
            except Exception as exc:  # the reaper of another process charges them once their lease ends
                log.error("could not stop the runs in flight", **failure_fields(exc))
            # Their heartbeats now fail (LeaseLost): give them a moment to unwind. Threads that do not
            # heartbeat are daemons and end with the process; their settlement could only be a no-op.
            with self._cond:
                end = time.monotonic() + 2.0
                while self._active and time.monotonic() < end:
                    self._cond.wait(0.1)
        self._join_idle_threads()

    def _join_idle_threads(self) -> None:
        """Wait (briefly) for the threads that are not running anything to end, so that none of them drops
        the last reference to the runtime (its engine's native connection) after the interpreter began to
        finalise: DuckDB's connection, destroyed then, aborts the process."""
        with self._cond:
            busy = set(self._active)
        for thread in self._threads:
            if thread.name not in busy and thread is not threading.current_thread():
                thread.join(2.0)


class InProcessExecutor:
    """A :class:`FairRunner` inside the API process."""

    def __init__(self, run_next: RunNext, stop_runs: StopRuns, threads: int, poll_seconds: float) -> None:
        self.runner = FairRunner(run_next, stop_runs, threads, poll_seconds, "expost-worker")
        self.runner.start()

    def submit(self, request_id: str) -> None:
        self.runner.wake()

    def drain(self) -> None:
        self.runner.drain()

    def shutdown(self, deadline: float | None = None) -> None:
        self.runner.shutdown(deadline)

    def in_flight(self) -> int:
        return len(self.runner.running())
