"""The event-loop submit of one-transaction requests (``requests.submit_one_transaction``,
``WriteBatcher.admit_and_run_async``), on real databases with a real runtime (``service.app.build_runtime``):
it applies only where nothing needs a database read before the writer (else None, nothing done); where it
applies, the request is admitted, run and committed with its charge in one writer job, exactly as the
thread-pool ``submit`` would do it; refusals, revoked grants, archived datasets and Idempotency-Key replays
behave as on the sync path; and a caller that stops awaiting either withdraws its job (not yet taken: no
row, no reservation, no charge) or leaves it committed and charged exactly once (already taken).

No pytest-asyncio: each test drives its own event loop (``asyncio.run`` / ``asyncio.Runner``).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import pytest
from sqlalchemy import update
from sqlalchemy.orm import Session, sessionmaker

from mechanisms.accounting import UNITS_PER_EPSILON
from mechanisms.base import Mechanism
from mechanisms.catalog import MECHANISMS
from service.app import build_runtime
from service.auth import Principal
from service.datasets import DatasetArchived, archive, cached_visible_dataset, public_context, visible_dataset
from service.errors import BudgetExhausted, IdempotencyKeyReused, NotAdmissible, NotFound
from service.filter.ledger import verify
from service.runs import admission, requests, settlement
from service.runs.runtime import Runtime
from service.runs.worker import execute
from service.store.models import AnalysisRequest, Dataset
from service.store.repositories import DatasetRepository, FilterRepository
from tests.conftest import server_settings
from tests.integration.helpers import commits_of, totals, world_in_db

COUNT: dict[str, Any] = {"query": {"kind": "count"}, "epsilon": 0.1}
TENTH = UNITS_PER_EPSILON // 10  # the realized (= worst-case) pure charge of COUNT
T = TypeVar("T")


@contextmanager
def running(database_url: str, data_dir: Path, **overrides: object) -> Iterator[Runtime]:
    """A real runtime (engine, executor, writer) as the app builds it, closed afterwards."""
    runtime = build_runtime(server_settings(database_url, data_dir, **overrides))
    try:
        yield runtime
    finally:
        runtime.close()


@pytest.fixture
def runtime(database_url: str, tmp_path: Path) -> Iterator[Runtime]:
    with running(database_url, tmp_path) as built:
        yield built


def warm(runtime: Runtime, principal: Principal, dataset_id: str) -> None:
    """Read the dataset, the grant and the table once (as any request's validation and first run do): the
    process caches them. The event-loop path never loads a table: it declines until the table is cached."""
    with runtime.sessions() as session:
        dataset = visible_dataset(session, principal, dataset_id)
    runtime.tables.get(dataset, public_context(dataset).schema)
    assert cached_visible_dataset(principal, dataset_id) is not None


def fast(
    runtime: Runtime,
    principal: Principal,
    dataset_id: str,
    key: str | None = None,
    params: dict[str, Any] | None = None,
    mechanism: str = "laplace",
    wait_seconds: float | None = None,
) -> Awaitable[AnalysisRequest | None]:
    submission = requests.Submission(principal, dataset_id, mechanism, params or COUNT, key, wait_seconds)
    return requests.submit_one_transaction(runtime, submission)


def run(awaitable: Callable[[], Awaitable[T]]) -> T:
    async def main() -> T:
        return await awaitable()

    return asyncio.run(main())


def rows_of(sessions: sessionmaker[Session], dataset_id: str) -> list[AnalysisRequest]:
    with sessions() as session:
        return list(session.query(AnalysisRequest).filter(AnalysisRequest.dataset_id == dataset_id))


def analyst_totals(sessions: sessionmaker[Session], dataset_id: str, analyst: str) -> tuple[int, int]:
    with sessions() as session:
        flt = FilterRepository(session).get(dataset_id, analyst)
        assert flt is not None
        return flt.spent["finite"][-1], flt.reserved["finite"][-1]


def by_key(sessions: sessionmaker[Session], analyst: str, key: str) -> list[AnalysisRequest]:
    with sessions() as session:
        return list(
            session.query(AnalysisRequest).filter(
                AnalysisRequest.analyst == analyst, AnalysisRequest.idempotency_key == key
            )
        )


def ledger_clean(sessions: sessionmaker[Session]) -> None:
    with sessions() as session:
        assert verify(session).problems == []


def inline_validated(runtime: Runtime, principal: Principal, dataset_id: str) -> admission.Validated:
    with runtime.sessions() as session:
        v = admission.validate(session, principal, dataset_id, "laplace", COUNT)
    return replace(v, inline=True, limits=runtime.limits(), queue=runtime.settings.queue_name)


def held_run(
    runtime: Runtime, v: admission.Validated, started: threading.Event, release: threading.Event
) -> Callable[[], Any]:
    """The real run of ``v``, which first signals ``started`` and then waits for ``release``: while it
    waits, the writer (which runs one-transaction jobs inside its batch) is held."""
    assert isinstance(v.mechanism, Mechanism)
    mechanism = v.mechanism

    def held() -> Any:
        started.set()
        assert release.wait(30), "the test never released the writer"
        return execute(v.dataset, mechanism, v.params, v.context, runtime.tables, v.worst_case)

    return held


def queued_jobs(runtime: Runtime) -> int:
    return runtime.writer._queue.qsize()  # read only: where the writer's jobs are


def wait_for(condition: Callable[[], bool], what: str, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


# ----- (a) where the fast path does not apply: None, nothing done -----------------------------------------


class TestNotApplicable:
    def test_a_cache_miss_returns_none_and_does_nothing(self, runtime: Runtime, tmp_path: Path) -> None:
        dataset_id, (first, second) = world_in_db(runtime.sessions, tmp_path, analysts=2)
        assert cached_visible_dataset(first, dataset_id) is None  # never read in this process
        batches = runtime.writer.batches
        assert run(lambda: fast(runtime, first, dataset_id, key="miss-1")) is None
        warm(runtime, first, dataset_id)  # the dataset is cached now, the second analyst's grant is not
        assert cached_visible_dataset(second, dataset_id) is None
        assert run(lambda: fast(runtime, second, dataset_id, key="miss-2")) is None
        assert runtime.writer.batches == batches  # no writer job at all
        assert rows_of(runtime.sessions, dataset_id) == []
        assert totals(runtime.sessions, dataset_id) == (0, 0)

    def test_a_mechanism_outside_the_one_transaction_set_returns_none(
        self, database_url: str, runtime: Runtime, tmp_path: Path
    ) -> None:
        dataset_id, (analyst,) = world_in_db(runtime.sessions, tmp_path)
        warm(runtime, analyst, dataset_id)
        quantile = {"column": "age", "q": 0.5, "epsilon": 0.1}
        assert run(lambda: fast(runtime, analyst, dataset_id, params=quantile, mechanism="quantile")) is None
        assert run(lambda: fast(runtime, analyst, dataset_id, mechanism="no.such.mechanism")) is None
        # laplace is one-transaction, but this deployment does not run it inline: the sync path's business
        with running(database_url, tmp_path, inline_mechanisms={"gaussian"}) as queued:
            warm(queued, analyst, dataset_id)
            assert run(lambda: fast(queued, analyst, dataset_id)) is None
            assert queued.writer.batches == 0
        v = replace(inline_validated(runtime, analyst, dataset_id), mechanism=MECHANISMS["quantile"])
        with pytest.raises(ValueError, match="does not run in the writer"):  # and the writer refuses it
            run(lambda: runtime.writer.admit_and_run_async(analyst, v, None, 300.0, lambda: None))
        assert rows_of(runtime.sessions, dataset_id) == []
        assert totals(runtime.sessions, dataset_id) == (0, 0)

    def test_back_pressure_returns_none_at_the_cap(self, runtime: Runtime, tmp_path: Path) -> None:
        dataset_id, (analyst,) = world_in_db(runtime.sessions, tmp_path)
        warm(runtime, analyst, dataset_id)
        runtime.writer.async_waiters = requests.MAX_ASYNC_WAITERS  # as if that many were awaiting
        try:
            assert run(lambda: fast(runtime, analyst, dataset_id)) is None
        finally:
            runtime.writer.async_waiters = 0
        assert rows_of(runtime.sessions, dataset_id) == []
        assert totals(runtime.sessions, dataset_id) == (0, 0)
        runtime.writer.async_waiters = requests.MAX_ASYNC_WAITERS - 1  # one below the cap: it applies
        try:
            done = run(lambda: fast(runtime, analyst, dataset_id))
        finally:
            runtime.writer.async_waiters -= requests.MAX_ASYNC_WAITERS - 1
        assert done is not None
        assert done.state == "committed"
        assert runtime.writer.async_waiters == 0  # its own count was released
        assert totals(runtime.sessions, dataset_id) == (TENTH, 0)

    def test_draining_returns_none(self, runtime: Runtime, tmp_path: Path) -> None:
        dataset_id, (analyst,) = world_in_db(runtime.sessions, tmp_path)
        warm(runtime, analyst, dataset_id)
        runtime.drain()
        assert run(lambda: fast(runtime, analyst, dataset_id)) is None
        assert rows_of(runtime.sessions, dataset_id) == []
        assert totals(runtime.sessions, dataset_id) == (0, 0)


# ----- (b), (c) committed with a durable charge --------------------------------------------------------


class TestCommitted:
    def test_after_a_sync_submit_the_fast_path_commits_a_durable_charge(
        self, runtime: Runtime, tmp_path: Path
    ) -> None:
        dataset_id, (analyst,) = world_in_db(runtime.sessions, tmp_path)
        first = requests.submit(
            runtime, requests.Submission(analyst, dataset_id, "laplace", COUNT, None)
        )  # warms the caches
        assert first.state == "committed"
        assert cached_visible_dataset(analyst, dataset_id) is not None
        done = [run(lambda: fast(runtime, analyst, dataset_id)) for _ in range(3)]
        assert all(r is not None for r in done)
        assert runtime.writer.async_waiters == 0
        stored = {row.id: row for row in rows_of(runtime.sessions, dataset_id)}
        assert len(stored) == 4
        for request in done:
            assert request is not None
            assert request.state == "committed"
            assert request.release is not None
            assert request.realized is not None
            row = stored[request.id]
            assert (row.state, row.release, row.realized) == ("committed", request.release, request.realized)
            assert commits_of(runtime.sessions, request.id) == 1
        # spent is exactly the sum of the four realized charges; nothing is left reserved
        assert totals(runtime.sessions, dataset_id) == (4 * TENTH, 0)
        assert analyst_totals(runtime.sessions, dataset_id, analyst.name) == (4 * TENTH, 0)
        ledger_clean(runtime.sessions)

    def test_fifty_concurrent_awaits_commit_fifty_requests_with_one_wake_up_per_batch(
        self, runtime: Runtime, tmp_path: Path
    ) -> None:
        dataset_id, (analyst,) = world_in_db(runtime.sessions, tmp_path, epsilon=5.0)  # 50 × 0.1 exactly
        warm(runtime, analyst, dataset_id)
        wakeups: list[int] = []

        class CountingLoop(asyncio.SelectorEventLoop):
            def call_soon_threadsafe(self, *args: Any, **kwargs: Any) -> Any:
                wakeups.append(1)
                return super().call_soon_threadsafe(*args, **kwargs)

        async def main() -> list[AnalysisRequest | None]:
            return await asyncio.gather(*(fast(runtime, analyst, dataset_id) for _ in range(50)))

        batches = runtime.writer.batches
        with asyncio.Runner(loop_factory=CountingLoop) as runner:
            done = runner.run(main())
            calls = len(wakeups)  # before the runner's own shutdown of its executor
        used = runtime.writer.batches - batches
        assert all(r is not None and r.state == "committed" and r.release is not None for r in done)
        assert len({r.id for r in done if r is not None}) == 50
        assert 1 <= calls <= used  # at most one wake-up of the loop per writer batch
        assert used < 50  # the awaits really shared batches
        assert runtime.writer.async_waiters == 0
        assert totals(runtime.sessions, dataset_id) == (50 * TENTH, 0)
        assert analyst_totals(runtime.sessions, dataset_id, analyst.name) == (50 * TENTH, 0)
        with pytest.raises(BudgetExhausted):  # the budget is spent exactly
            run(lambda: fast(runtime, analyst, dataset_id))
        ledger_clean(runtime.sessions)


# ----- (d), (e) refused under the locks: nothing charged --------------------------------------------------


class TestRefused:
    def test_a_grant_revoked_in_the_database_while_the_cache_is_fresh_is_not_found(
        self, runtime: Runtime, tmp_path: Path
    ) -> None:
        dataset_id, (analyst,) = world_in_db(runtime.sessions, tmp_path)
        warm(runtime, analyst, dataset_id)
        with runtime.sessions() as session, session.begin():  # another process revokes: our cache is stale
            assert DatasetRepository(session).delete_grant(dataset_id, analyst.name)
        assert cached_visible_dataset(analyst, dataset_id) is not None  # still trusted by this process
        with pytest.raises(NotFound):
            run(lambda: fast(runtime, analyst, dataset_id, key="revoked"))
        assert cached_visible_dataset(analyst, dataset_id) is None  # the stale grant was dropped
        assert rows_of(runtime.sessions, dataset_id) == []
        assert totals(runtime.sessions, dataset_id) == (0, 0)
        assert runtime.writer.async_waiters == 0

    def test_a_dataset_archived_by_another_process_is_refused_as_archived(
        self, runtime: Runtime, tmp_path: Path
    ) -> None:
        dataset_id, (analyst,) = world_in_db(runtime.sessions, tmp_path)
        warm(runtime, analyst, dataset_id)
        with runtime.sessions() as session, session.begin():  # not through archive(): our cache keeps it
            session.execute(
                update(Dataset)
                .where(Dataset.id == dataset_id)
                .values(archived_at=datetime.now(UTC), archived_by="elsewhere")
            )
        assert cached_visible_dataset(analyst, dataset_id) is not None
        with pytest.raises(DatasetArchived):
            run(lambda: fast(runtime, analyst, dataset_id))
        assert rows_of(runtime.sessions, dataset_id) == []
        assert totals(runtime.sessions, dataset_id) == (0, 0)

    def test_a_dataset_archived_in_this_process_is_a_cache_miss_then_refused(
        self, runtime: Runtime, tmp_path: Path
    ) -> None:
        dataset_id, (analyst,) = world_in_db(runtime.sessions, tmp_path)
        warm(runtime, analyst, dataset_id)
        with runtime.sessions() as session, session.begin():
            archive(session, dataset_id, "admin")
        assert run(lambda: fast(runtime, analyst, dataset_id)) is None
        with pytest.raises(DatasetArchived):
            requests.submit(runtime, requests.Submission(analyst, dataset_id, "laplace", COUNT, None))
        assert rows_of(runtime.sessions, dataset_id) == []
        assert totals(runtime.sessions, dataset_id) == (0, 0)

    def test_an_exhausted_budget_refuses_with_the_details_and_writes_nothing(
        self, runtime: Runtime, tmp_path: Path
    ) -> None:
        dataset_id, (analyst,) = world_in_db(runtime.sessions, tmp_path, epsilon=0.15)
        warm(runtime, analyst, dataset_id)
        first = run(lambda: fast(runtime, analyst, dataset_id))
        assert first is not None
        assert first.state == "committed"
        with pytest.raises(BudgetExhausted) as refused:
            run(lambda: fast(runtime, analyst, dataset_id, key="too-much"))
        assert type(refused.value) is BudgetExhausted  # affordable when unspent: not NotAdmissible
        problem = refused.value.problem()
        assert problem["requested"]["pure"] == pytest.approx(0.1)
        assert problem["pure"]["requested"] == pytest.approx(0.1)
        assert problem["pure"]["capacity"] == pytest.approx(0.15)
        assert problem["pure"]["spent"] == pytest.approx(0.1)
        assert problem["pure"]["remaining"] == pytest.approx(0.05)
        assert problem["shortfall"] == pytest.approx(0.05)
        assert problem["affordable"] is not None
        assert 0 < problem["affordable"]["value"] <= 0.05 + 1e-12
        assert by_key(runtime.sessions, analyst.name, "too-much") == []
        assert [row.id for row in rows_of(runtime.sessions, dataset_id)] == [first.id]
        assert totals(runtime.sessions, dataset_id) == (TENTH, 0)
        assert runtime.writer.async_waiters == 0
        ledger_clean(runtime.sessions)

    def test_a_request_above_the_whole_budget_is_not_admissible(
        self, runtime: Runtime, tmp_path: Path
    ) -> None:
        dataset_id, (analyst,) = world_in_db(runtime.sessions, tmp_path, epsilon=0.05)
        warm(runtime, analyst, dataset_id)
        with pytest.raises(NotAdmissible) as refused:
            run(lambda: fast(runtime, analyst, dataset_id))
        problem = refused.value.problem()
        assert problem["requested"]["pure"] == pytest.approx(0.1)
        assert problem["pure"]["remaining"] == pytest.approx(0.05)
        assert rows_of(runtime.sessions, dataset_id) == []
        assert totals(runtime.sessions, dataset_id) == (0, 0)


# ----- (f) Idempotency-Key replays ------------------------------------------------------------------------


class TestReplay:
    def test_a_replay_returns_the_same_request_and_charges_once(
        self, runtime: Runtime, tmp_path: Path
    ) -> None:
        dataset_id, (analyst,) = world_in_db(runtime.sessions, tmp_path)
        warm(runtime, analyst, dataset_id)

        async def twice() -> tuple[AnalysisRequest | None, AnalysisRequest | None]:
            return await fast(runtime, analyst, dataset_id, key="k"), await fast(
                runtime, analyst, dataset_id, key="k"
            )

        first, again = run(twice)
        assert first is not None
        assert again is not None
        assert again.id == first.id
        assert again.release == first.release
        concurrent = run(
            lambda: asyncio.gather(*(fast(runtime, analyst, dataset_id, key="c") for _ in range(8)))
        )
        assert len({r.id for r in concurrent if r is not None}) == 1
        assert all(r is not None for r in concurrent)
        # a key first used on the sync path is replayed by the fast path, too
        sync = requests.submit(runtime, requests.Submission(analyst, dataset_id, "laplace", COUNT, "s"))
        replayed = run(lambda: fast(runtime, analyst, dataset_id, key="s"))
        assert replayed is not None
        assert replayed.id == sync.id
        assert replayed.release == sync.release
        for request in (first, concurrent[0], sync):
            assert request is not None
            assert commits_of(runtime.sessions, request.id) == 1
        assert len(rows_of(runtime.sessions, dataset_id)) == 3
        assert totals(runtime.sessions, dataset_id) == (3 * TENTH, 0)
        with pytest.raises(IdempotencyKeyReused):  # the same key for other params
            run(lambda: fast(runtime, analyst, dataset_id, key="k", params={**COUNT, "epsilon": 0.2}))
        assert totals(runtime.sessions, dataset_id) == (3 * TENTH, 0)
        ledger_clean(runtime.sessions)

    def test_a_replay_of_a_running_two_phase_request_waits_and_returns_it(
        self, runtime: Runtime, tmp_path: Path
    ) -> None:
        dataset_id, (analyst,) = world_in_db(runtime.sessions, tmp_path)
        warm(runtime, analyst, dataset_id)
        v = inline_validated(runtime, analyst, dataset_id)
        admitted, created = runtime.writer.admit(analyst, v, "two-phase", 300.0)  # reserved, running
        assert created
        assert admitted.state == "running"
        started = time.monotonic()
        replay = run(lambda: fast(runtime, analyst, dataset_id, key="two-phase", wait_seconds=0.3))
        assert time.monotonic() - started >= 0.25  # it waited its window for the release
        assert replay is not None
        assert replay.id == admitted.id
        assert replay.state == "running"
        assert totals(runtime.sessions, dataset_id) == (0, TENTH)  # still only its reservation
        settled = runtime.writer.settle(settlement.RequestRef.of(admitted), None, None, "test")
        assert settled is not None
        assert totals(runtime.sessions, dataset_id) == (TENTH, 0)


# ----- (g) a caller that stops awaiting -------------------------------------------------------------------


class TestCancelled:
    def test_a_job_cancelled_before_the_writer_took_it_is_withdrawn(
        self, runtime: Runtime, tmp_path: Path
    ) -> None:
        dataset_id, (analyst,) = world_in_db(runtime.sessions, tmp_path)
        warm(runtime, analyst, dataset_id)
        v = inline_validated(runtime, analyst, dataset_id)
        started, release = threading.Event(), threading.Event()
        holder: list[Any] = []
        blocker = threading.Thread(
            target=lambda: holder.append(
                runtime.writer.admit_and_run(
                    analyst, v, "holder", 300.0, held_run(runtime, v, started, release)
                )
            )
        )
        blocker.start()
        try:
            assert started.wait(10)  # the writer is inside the holder's batch

            async def cancel_while_queued() -> None:
                task = asyncio.create_task(fast(runtime, analyst, dataset_id, key="withdrawn"))
                while queued_jobs(runtime) == 0:  # our job is enqueued, behind the held batch
                    await asyncio.sleep(0.005)
                assert runtime.writer.async_waiters == 1
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task

            run(cancel_while_queued)
            assert runtime.writer.async_waiters == 0
        finally:
            release.set()
            blocker.join(30)
        assert holder
        assert holder[0][0].state == "committed"
        wait_for(lambda: queued_jobs(runtime) == 0, "the writer to drop the withdrawn job")
        runtime.writer.settle(settlement.RequestRef.of(holder[0][0]), None, None, "flush")  # one more batch
        assert by_key(runtime.sessions, analyst.name, "withdrawn") == []
        assert [row.id for row in rows_of(runtime.sessions, dataset_id)] == [holder[0][0].id]
        assert totals(runtime.sessions, dataset_id) == (TENTH, 0)  # the holder's charge only
        ledger_clean(runtime.sessions)

    def test_a_job_cancelled_after_the_writer_took_it_commits_and_charges_once(
        self, runtime: Runtime, tmp_path: Path
    ) -> None:
        dataset_id, (analyst,) = world_in_db(runtime.sessions, tmp_path)
        warm(runtime, analyst, dataset_id)
        v = inline_validated(runtime, analyst, dataset_id)
        first_started, first_release = threading.Event(), threading.Event()
        second_started, second_release = threading.Event(), threading.Event()
        outcomes: list[Any] = []

        def hold(key: str, started: threading.Event, release: threading.Event) -> threading.Thread:
            thread = threading.Thread(
                target=lambda: outcomes.append(
                    runtime.writer.admit_and_run(
                        analyst, v, key, 300.0, held_run(runtime, v, started, release)
                    )
                )
            )
            thread.start()
            return thread

        first = hold("first", first_started, first_release)
        threads = [first]
        try:
            assert first_started.wait(10)  # the writer holds batch 1
            threads.append(hold("second", second_started, second_release))
            wait_for(lambda: queued_jobs(runtime) == 1, "the second holder to queue")

            async def cancel_while_applied() -> None:
                task = asyncio.create_task(fast(runtime, analyst, dataset_id, key="taken"))
                while queued_jobs(runtime) < 2:  # queued behind the second holder
                    await asyncio.sleep(0.005)
                first_release.set()  # batch 2 = [second holder, ours]: taken, held inside the second run
                while not second_started.is_set():
                    await asyncio.sleep(0.005)
                assert queued_jobs(runtime) == 0  # the writer took our job with the second holder's
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task

            run(cancel_while_applied)
        finally:
            first_release.set()
            second_release.set()
            for thread in threads:
                thread.join(30)
        assert len(outcomes) == 2
        taken = by_key(runtime.sessions, analyst.name, "taken")
        assert len(taken) == 1
        assert taken[0].state == "committed"
        assert taken[0].release is not None
        assert commits_of(runtime.sessions, taken[0].id) == 1
        assert totals(runtime.sessions, dataset_id) == (3 * TENTH, 0)  # the two holders and ours, once each
        warm(runtime, analyst, dataset_id)
        replay = run(lambda: fast(runtime, analyst, dataset_id, key="taken"))  # retrievable by its key
        assert replay is not None
        assert replay.id == taken[0].id
        assert replay.release == taken[0].release
        assert totals(runtime.sessions, dataset_id) == (3 * TENTH, 0)
        assert runtime.writer.async_waiters == 0
        ledger_clean(runtime.sessions)
