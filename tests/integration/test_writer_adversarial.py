"""Adversarial checks of the group-commit writer (issue 21's batch path), on real databases.

* **Equivalence**: one writer batch holding a hostile mix of jobs in a fixed arrival order (inline and
  queued requests, an Idempotency-Key repeated and reused within the batch, an analyst sub-budget, the
  δ-ledger of approximate requests, the running-request limit, a revoked grant, an archived dataset) gives
  exactly the outcomes, filter totals and ledger events of the ORM path applying them one at a time.
* **Nothing escapes its charge**: a release that is not strict JSON is charged its worst case and never
  stored on every settlement path (the batch's retry on the two-phase path included, where PostgreSQL
  used to refuse the row and leave the reservation to the reaper with a 500); a run that raises even a
  ``BaseException`` inside the batch is charged its worst case and leaves the writer thread alive.
"""

from __future__ import annotations

import math
import multiprocessing
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.orm import Session, sessionmaker

from mechanisms.accounting import UNITS_PER_EPSILON
from mechanisms.base import Mechanism
from service.auth import Principal, Role, create_key
from service.datasets import TableCache, archive, create_dataset, grant, revoke_grant
from service.errors import BudgetExhausted, ServiceError
from service.filter import budget
from service.filter.ledger import verify
from service.runs import admission, settlement, writer
from service.runs.worker import execute
from service.store.engine import make_engine, make_sessionmaker
from service.store.models import DATASET_SCOPE, LedgerEntry
from service.store.repositories import DatasetRepository, FilterRepository
from tests.integration.helpers import CSV, SCHEMA

LIMITS = admission.Limits(running_requests=3, open_sessions=5, inline=frozenset({"laplace", "gaussian"}))
OPS = {"features": {"features": ["age"], "label": "income"}, "lam": 50.0, "epsilon": 0.01, "delta": 1e-7}
LEASE = 300.0


def laplace(epsilon: float) -> dict[str, Any]:
    return {"query": {"kind": "count"}, "epsilon": epsilon}


@dataclass
class World:
    dataset_id: str
    archived_id: str
    analysts: list[Principal]  # a0 (sub-budget), a1 (none), a2 (revoked after validation)


@dataclass(frozen=True)
class Step:
    who: int
    mechanism: str
    params: dict[str, Any]
    key: str | None = None
    inline: bool = False
    archived: bool = False  # on the archived dataset


# Arrival order of the batch. Comments: what the one-by-one rule decides.
STEPS = [
    Step(0, "laplace", laplace(0.2), "k1", inline=True),  # committed 0.2 (a0 sub-budget 0.35)
    Step(0, "laplace", laplace(0.2), "k1", inline=True),  # replay within the batch
    Step(0, "laplace", laplace(0.3), "k1", inline=True),  # key reused for other params: 422
    Step(0, "laplace", laplace(0.2)),  # queued: a0 would reach 0.4 > 0.35: refused by the sub-filter
    Step(0, "laplace", laplace(0.1), "k2"),  # queued, fits a0 (0.3)
    Step(1, "ptr.ops_linear", OPS),  # approximate: δ share fits three
    Step(1, "ptr.ops_linear", OPS),
    Step(1, "ptr.ops_linear", OPS),
    Step(1, "ptr.ops_linear", OPS),  # a1 has 3 queued: the limit (429)
    Step(0, "ptr.ops_linear", OPS),  # δ share exhausted
    Step(2, "laplace", laplace(0.1), inline=True),  # grant revoked: 404
    Step(0, "laplace", laplace(0.1), inline=True, archived=True),  # archived: 409
    *[Step(1, "laplace", laplace(0.15), inline=True) for _ in range(6)],  # until the dataset is full
    Step(0, "laplace", laplace(0.1), "k2"),  # replay of a queued request across the batch
    Step(1, "gaussian", {"query": {"kind": "count"}, "sigma": 25.0}, inline=True),
]


def build_world(sessions: sessionmaker[Session], data_dir: Path, tag: str) -> World:
    with sessions() as session, session.begin():
        dataset = create_dataset(session, data_dir, f"{tag}-d", CSV, SCHEMA, "admin")
        other = create_dataset(session, data_dir, f"{tag}-e", CSV, SCHEMA, "admin")
        principals = []
        for i in range(3):
            name = f"{tag}-a{i}-{dataset.id[-6:]}"
            create_key(session, name, Role.analyst)
            grant(session, dataset, name, "admin")
            grant(session, other, name, "admin")
            principals.append(Principal(name, Role.analyst))
        budget.set_budget(session, dataset, DATASET_SCOPE, 1.0, 1e-5, "admin", delta_share=3.5e-7)
        budget.set_budget(session, other, DATASET_SCOPE, 1.0, 1e-5, "admin")
        budget.set_budget(session, dataset, principals[0].name, 0.35, 0.0, "admin")
    return World(dataset.id, other.id, principals)


def validate_all(sessions: sessionmaker[Session], world: World) -> list[admission.Validated]:
    validated = []
    with sessions() as session:
        for step in STEPS:
            dataset_id = world.archived_id if step.archived else world.dataset_id
            v = admission.validate(session, world.analysts[step.who], dataset_id, step.mechanism, step.params)
            validated.append(replace(v, inline=step.inline, limits=LIMITS))
    return validated


def lock_out(sessions: sessionmaker[Session], world: World) -> None:
    """After validation: revoke a2's grant and archive the second dataset (both read under the locks)."""
    with sessions() as session, session.begin():
        dataset = DatasetRepository(session).get(world.dataset_id)
        assert dataset is not None
        assert revoke_grant(session, dataset, world.analysts[2].name, "admin")
        archive(session, world.archived_id, "admin")


def fixed_run(v: admission.Validated) -> writer.RunFn:
    return lambda: (v.worst_case, {"value": 7}, None)


def outcome(call: Callable[[], tuple[Any, bool]]) -> str:
    try:
        request, created = call()
    except ServiceError as exc:
        return type(exc).__name__
    return f"{'created' if created else 'replayed'}:{request.state}"


def one_by_one(
    sessions: sessionmaker[Session], world: World, validated: list[admission.Validated]
) -> list[str]:
    """The reference: the ORM path, one transaction per admission (and per settlement), in order."""
    results = []
    for step, v in zip(STEPS, validated, strict=True):
        principal = world.analysts[step.who]

        def call(step: Step = step, v: admission.Validated = v, principal: Principal = principal) -> Any:
            with sessions() as session:
                request, created = admission.admit(session, principal, v, step.key, LEASE)
            if created and step.inline:
                realized, output, error = fixed_run(v)()
                with sessions() as session:
                    settled = settlement.settle(
                        session, settlement.RequestRef.of(request), realized, output, error
                    )
                assert settled is not None
                return settled, True
            return request, created

        results.append(outcome(call))
    return results


def in_one_batch(
    batcher: writer.WriteBatcher, world: World, validated: list[admission.Validated]
) -> list[str]:
    """Every step queued behind a blocked batch, in arrival order, so that they form one batch."""
    release = threading.Event()

    def block(_batch: Any, _filters: Any) -> None:
        release.wait(60)

    blocker = threading.Thread(
        target=batcher._run,
        args=(writer.Job(world.dataset_id, world.analysts[1].name, block, lambda: None),),
    )
    blocker.start()
    while batcher._queue.qsize():  # the writer took the blocker
        time.sleep(0.01)
    results: list[str | None] = [None] * len(STEPS)
    threads = []
    for i, (step, v) in enumerate(zip(STEPS, validated, strict=True)):
        principal = world.analysts[step.who]

        def call(
            i: int = i, step: Step = step, v: admission.Validated = v, principal: Principal = principal
        ) -> None:
            if step.inline:
                results[i] = outcome(
                    lambda: batcher.admit_and_run(principal, v, step.key, LEASE, fixed_run(v))
                )
            else:
                results[i] = outcome(lambda: batcher.admit(principal, v, step.key, LEASE))

        thread = threading.Thread(target=call)
        thread.start()
        threads.append(thread)
        deadline = time.monotonic() + 10
        while batcher._queue.qsize() < i + 1:  # queued in this order
            assert time.monotonic() < deadline
            time.sleep(0.002)
    before = batcher.batches
    release.set()
    for thread in [*threads, blocker]:
        thread.join(60)
    assert batcher.batches == before + 1, "the steps did not share one batch"
    assert all(r is not None for r in results)
    return [r for r in results if r is not None]


def totals(sessions: sessionmaker[Session], world: World) -> list[tuple[str, Any, Any, str, str]]:
    names = {DATASET_SCOPE: DATASET_SCOPE} | {p.name: f"a{i}" for i, p in enumerate(world.analysts)}
    with sessions() as session:
        rows = FilterRepository(session).for_dataset(world.dataset_id)
        return sorted((names[f.scope], f.spent, f.reserved, f.delta_spent, f.delta_reserved) for f in rows)


def events(sessions: sessionmaker[Session], dataset_id: str) -> list[str]:
    with sessions() as session:
        rows = (
            session.query(LedgerEntry).filter(LedgerEntry.dataset_id == dataset_id).order_by(LedgerEntry.seq)
        )
        return [row.event for row in rows]


class TestBatchEqualsOneByOne:
    def test_a_hostile_batch_decides_exactly_as_the_one_by_one_path(
        self, sessions: sessionmaker[Session], batcher: writer.WriteBatcher, tmp_path: Path
    ) -> None:
        reference, batched = build_world(sessions, tmp_path, "ref"), build_world(sessions, tmp_path, "bat")
        v_reference, v_batched = validate_all(sessions, reference), validate_all(sessions, batched)
        lock_out(sessions, reference)
        lock_out(sessions, batched)

        expected = one_by_one(sessions, reference, v_reference)
        got = in_one_batch(batcher, batched, v_batched)

        # The scenario really exercises every rule (else the comparison proves little).
        kinds = Counter(expected)
        assert {"IdempotencyKeyReused", "LimitExceeded", "NotFound", "DatasetArchived"} <= set(kinds), kinds
        assert kinds["BudgetExhausted"] + kinds["NotAdmissible"] >= 3, kinds
        assert kinds["replayed:committed"] == 1, kinds
        assert kinds["replayed:running"] == 1, kinds
        assert got == expected
        assert totals(sessions, batched) == totals(sessions, reference)
        assert events(sessions, batched.dataset_id) == events(sessions, reference.dataset_id)
        with sessions() as session:
            assert verify(session).problems == []


class TestNothingEscapesItsCharge:
    def world(self, sessions: sessionmaker[Session], data_dir: Path) -> tuple[str, Principal]:
        with sessions() as session, session.begin():
            dataset = create_dataset(session, data_dir, "d", CSV, SCHEMA, "admin")
            name = f"x-{dataset.id}"
            create_key(session, name, Role.analyst)
            grant(session, dataset, name, "admin")
            budget.set_budget(session, dataset, DATASET_SCOPE, 1.0, 0.0, "admin")
        return dataset.id, Principal(name, Role.analyst)

    def inline(
        self, sessions: sessionmaker[Session], principal: Principal, dataset_id: str
    ) -> admission.Validated:
        with sessions() as session:
            v = admission.validate(session, principal, dataset_id, "laplace", laplace(0.1))
        return replace(v, inline=True)

    def pure_totals(self, sessions: sessionmaker[Session], dataset_id: str) -> tuple[int, int]:
        with sessions() as session:
            flt = FilterRepository(session).get(dataset_id)
            assert flt is not None
            return flt.spent["finite"][-1], flt.reserved["finite"][-1]

    @pytest.mark.parametrize("bad", [math.nan, math.inf])
    def test_a_non_json_release_on_the_retry_path_is_charged_and_never_stored(
        self,
        sessions: sessionmaker[Session],
        batcher: writer.WriteBatcher,
        tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch,
        bad: float,
    ) -> None:
        """The batch fails (data-independently), so the request is retried on the two-phase path, and that
        run's release is not strict JSON: charged w, failed, nothing reserved, no 500, no hung request."""
        dataset_id, principal = self.world(sessions, tmp_path)
        v = self.inline(sessions, principal, dataset_id)
        original = writer.RequestBatch.send  # the batch's writes, sent before its COMMIT

        def failing_send(self: writer.RequestBatch) -> None:
            original(self)
            if self.pipeline:  # the writer's batch; its retry (a batch of one) goes through
                raise RuntimeError("the connection dropped before the commit")

        monkeypatch.setattr(writer.RequestBatch, "send", failing_send)
        request, created = batcher.admit_and_run(
            principal, v, "key", LEASE, lambda: (v.worst_case, {"value": bad}, None)
        )
        assert created
        assert request.state == "failed_charged"
        assert request.release is None
        assert self.pure_totals(sessions, dataset_id) == (UNITS_PER_EPSILON // 10, 0)
        with sessions() as session:
            assert verify(session).problems == []

    def test_a_non_json_release_settled_by_a_worker_is_charged_and_never_stored(
        self, sessions: sessionmaker[Session], tmp_path: Path
    ) -> None:
        dataset_id, principal = self.world(sessions, tmp_path)
        v = replace(self.inline(sessions, principal, dataset_id), inline=False)
        with sessions() as session:
            request, _ = admission.admit(session, principal, v, None, LEASE)
        with sessions() as session:
            settled = settlement.settle(
                session, settlement.RequestRef.of(request), v.worst_case, {"value": [1.0, math.nan]}, None
            )
        assert settled is not None
        assert settled.state == "failed_charged"
        assert settled.release is None
        assert self.pure_totals(sessions, dataset_id) == (UNITS_PER_EPSILON // 10, 0)

    def test_a_run_raising_a_base_exception_in_the_batch_is_charged_and_the_writer_survives(
        self, sessions: sessionmaker[Session], batcher: writer.WriteBatcher, tmp_path: Path
    ) -> None:
        dataset_id, principal = self.world(sessions, tmp_path)
        v = self.inline(sessions, principal, dataset_id)

        def dies() -> Any:
            raise SystemExit(3)  # read the data, then ended its thread: not caught by worker.execute

        request, created = batcher.admit_and_run(principal, v, None, LEASE, dies)
        assert created
        assert request.state == "failed_charged"
        assert request.release is None
        assert self.pure_totals(sessions, dataset_id) == (UNITS_PER_EPSILON // 10, 0)
        again, _ = batcher.admit_and_run(principal, v, None, LEASE, fixed_run(v))  # the writer still runs
        assert again.state == "committed"
        assert again.release == {"value": 7}
        assert self.pure_totals(sessions, dataset_id) == (2 * UNITS_PER_EPSILON // 10, 0)
        with sessions() as session:
            assert verify(session).problems == []

    def test_an_inline_mechanism_outside_the_one_transaction_list_reserves_durably_before_its_run(
        self,
        sessions: sessionmaker[Session],
        batcher: writer.WriteBatcher,
        tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        """An operator may list any quick mechanism in EXPOST_INLINE_MECHANISMS; only the ones known to be
        microseconds of arithmetic with realized = worst case run inside the writer's transaction. Any other
        keeps the two-phase order: its reservation is committed (visible to another connection) before the
        run reads the data, so a crash during the run still leaves w to charge."""
        monkeypatch.setattr(writer, "ONE_TRANSACTION", frozenset())
        dataset_id, principal = self.world(sessions, tmp_path)
        v = self.inline(sessions, principal, dataset_id)
        seen: list[tuple[int, int]] = []

        def run() -> Any:
            seen.append(self.pure_totals(sessions, dataset_id))  # another connection, during the run
            return fixed_run(v)()

        request, created = batcher.admit_and_run(principal, v, None, LEASE, run)
        assert created
        assert request.state == "committed"
        assert seen == [(0, UNITS_PER_EPSILON // 10)]  # reserved and durable before the read
        assert self.pure_totals(sessions, dataset_id) == (UNITS_PER_EPSILON // 10, 0)
        with sessions() as session:
            assert verify(session).problems == []


# ----- two writer processes (two API processes) on one dataset ------------------------------------------

PER_PROCESS = 30


def hammer(url: str, data_dir: str, dataset_id: str, names: list[str], out: Any, start: Any) -> None:
    """A child process: its own engine and writer; PER_PROCESS concurrent one-transaction requests."""
    engine = make_engine(url)
    sessions = make_sessionmaker(engine)
    batcher = writer.WriteBatcher(sessions)
    tables = TableCache(Path(data_dir))
    failed: list[BaseException] = []
    apply = batcher._apply

    def counted(batch: list[writer.Job]) -> Any:  # a batch that failed (then retried job by job)
        try:
            return apply(batch)
        except BaseException as exc:
            failed.append(exc)
            raise

    batcher._apply = counted  # type: ignore[method-assign]
    try:
        principals = [Principal(name, Role.analyst) for name in names]
        with sessions() as session:
            validated = [
                replace(admission.validate(session, p, dataset_id, "laplace", laplace(0.1)), inline=True)
                for p in principals
            ]

        def one(i: int) -> str:
            v = validated[i % len(validated)]
            mechanism = v.mechanism
            assert isinstance(mechanism, Mechanism)

            def run() -> Any:
                return execute(v.dataset, mechanism, v.params, v.context, tables, v.worst_case)

            try:
                request, _ = batcher.admit_and_run(principals[i % len(principals)], v, None, LEASE, run)
            except BudgetExhausted:
                return "refused"
            return f"{request.state}:{request.release is not None}"

        with sessions() as session:  # warm: connections open, table loaded, before the start line
            FilterRepository(session).get(dataset_id)
        tables.get(validated[0].dataset, validated[0].context.schema)
        start.wait(120)  # both processes set up: race from here
        with ThreadPoolExecutor(16) as pool:
            counts = Counter(pool.map(one, range(PER_PROCESS)))
        out.put(counts + Counter({"failed batches": len(failed)}))
    finally:
        batcher.stop()
        engine.dispose()


class TestTwoWriterProcesses:
    def test_two_processes_on_one_dataset_admit_exactly_what_fits(
        self, sessions: sessionmaker[Session], database_url: str, tmp_path: Path
    ) -> None:
        """Two processes, each with its own group-commit writer (SQLite: BEGIN IMMEDIATE across processes;
        PostgreSQL: FOR UPDATE), race 60 one-transaction requests of ε = 0.1 for a pure budget of 1: exactly
        ten are committed with their release, spent is exactly 1, nothing is reserved, and the ledger's
        chain (appended by both processes) verifies. No batch may fail: without the row locks the chain's
        primary key (dataset, seq) would still refuse the second of two racing appends, and the retry on the
        ORM path would hide the missing lock; a failed batch is how that shows."""
        with sessions() as session, session.begin():
            dataset = create_dataset(session, tmp_path, "d", CSV, SCHEMA, "admin")
            names = [f"p{i}-{dataset.id}" for i in range(4)]
            for name in names:
                create_key(session, name, Role.analyst)
                grant(session, dataset, name, "admin")
            budget.set_budget(session, dataset, DATASET_SCOPE, 1.0, 0.0, "admin")
        context = multiprocessing.get_context("spawn")
        out, start = context.Queue(), context.Barrier(2)
        children = [
            context.Process(
                target=hammer, args=(database_url, str(tmp_path), dataset.id, names[i::2], out, start)
            )
            for i in range(2)
        ]
        for child in children:
            child.start()
        counts: Counter[str] = Counter()
        for _ in children:
            counts += out.get(timeout=300)
        for child in children:
            child.join(60)
            assert child.exitcode == 0
        assert counts == Counter({"committed:True": 10, "refused": 2 * PER_PROCESS - 10}), counts
        with sessions() as session:
            flt = FilterRepository(session).get(dataset.id)
            assert flt is not None
            assert (flt.spent["finite"][-1], flt.reserved["finite"][-1]) == (UNITS_PER_EPSILON, 0)
            assert verify(session).problems == []
        assert events(sessions, dataset.id).count("commit") == 10
