"""How the group-commit writer answers callers that await it on an event loop (``WriteBatcher._run_async``),
when a batch transaction fails (every job is retried alone, one after another) and when an outcome cannot
be handed to asyncio. The database is not involved: the batch transaction is made to fail at ``_apply``,
the retry of each job is a plain function, so what is tested is only the writer's own hand-over."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from service.errors import ServiceUnavailable
from service.runs.writer import Job, WriteBatcher


class FailingBatches(WriteBatcher):
    """A writer whose batch transaction always fails, so each job is retried alone."""

    def __init__(self, timeout: float) -> None:
        super().__init__(sessions=None, timeout=timeout)  # type: ignore[arg-type]  # never used

    def _apply(self, batch: list[Job]) -> list[tuple[Any, BaseException | None]]:
        raise RuntimeError("the database went away")


def job(outcome: Any, gate: threading.Event | None = None, seconds: float = 0.0) -> Job:
    def alone() -> Any:
        if gate is not None:
            gate.wait(10)
        time.sleep(seconds)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    return Job("ds", "analyst", lambda batch, filters: None, alone, settled=True)


async def await_all(writer: WriteBatcher, jobs: list[Job]) -> list[tuple[Any, float]]:
    """Hold the writer until every job is queued (one batch), then await them; (outcome, seconds)."""
    gate = threading.Event()
    writer._enqueue(job("holder", gate))  # the writer takes this one first and waits on the gate
    started = time.monotonic()

    async def one(j: Job) -> tuple[Any, float]:
        try:
            result = await writer._run_async(j)
        except ServiceUnavailable as exc:
            result = f"503 {exc.detail}"
        return result, time.monotonic() - started

    tasks = [asyncio.create_task(one(j)) for j in jobs]
    await asyncio.sleep(0.05)
    gate.set()
    return await asyncio.gather(*tasks)


def test_after_a_failed_batch_each_caller_is_answered_when_its_own_retry_is_done() -> None:
    writer = FailingBatches(timeout=10.0)
    try:
        answers = asyncio.run(await_all(writer, [job(i, seconds=0.3) for i in range(4)]))
    finally:
        writer.stop()
    assert [result for result, _ in answers] == [0, 1, 2, 3]
    times = [seconds for _, seconds in answers]
    assert times == sorted(times), times
    # woken one by one (≈ 0.3 s apart), not all together after the last retry
    assert times[3] - times[0] > 0.6, times
    assert writer.async_waiters == 0


def test_an_outcome_asyncio_refuses_does_not_strand_the_other_callers() -> None:
    writer = FailingBatches(timeout=10.0)
    try:
        answers = asyncio.run(await_all(writer, [job(StopIteration()), job("kept")]))
    finally:
        writer.stop()
    first, second = (result for result, _ in answers)
    assert isinstance(first, str), first
    assert first.startswith("503"), first
    assert second == "kept"
