"""A worker's claim cannot slip between an abort's check and its release of the reservation.

``abort(unclaimed_only=True)`` (a batch of one) locks the filters, re-reads the request and releases
the reservation only if no worker holds it. The claim is one UPDATE of the request row alone, so the
re-read must lock that row (PostgreSQL: ``SELECT … FOR UPDATE``; SQLite serializes every writer):
otherwise a worker could claim (and read the data) after the check, and the abort would release the
reservation of a request that runs.
"""

from __future__ import annotations

import threading

from service.auth import Principal, Role
from service.filter.batch import FilterRow
from service.runs import admission, settlement, worker
from service.store.engine import make_engine, make_sessionmaker
from service.store.models import AnalysisRequest
from tests.conftest import LiveServer
from tests.integration.helpers import make_world


def test_a_claim_waits_for_an_abort_that_has_checked_the_lease(live_server: LiveServer) -> None:
    world = make_world(live_server, {"epsilon": 1.0, "delta": 0.0})
    engine = make_engine(live_server.settings.database_url)
    sessions = make_sessionmaker(engine)
    try:
        analyst = Principal(world.analyst_name, Role.analyst)
        with sessions() as session:
            validated = admission.validate(
                session, analyst, world.dataset_id, "laplace", {"query": {"kind": "count"}, "epsilon": 0.1}
            )
        with sessions() as session:
            request, _ = admission.admit(session, analyst, validated, None, 60)
        ref = settlement.RequestRef.of(request)
        claimed: list[bool] = []
        claimers: list[threading.Thread] = []

        def abort_while_a_worker_claims(
            batch: admission.RequestBatch, filters: list[FilterRow], row: AnalysisRequest
        ) -> bool:  # the abort's check, holding its locks
            assert row.lease_owner is None
            claimer = threading.Thread(
                target=lambda: claimed.append(worker.claim(sessions, request.id, "racing-worker", 60))
            )
            claimers.append(claimer)
            claimer.start()
            claimer.join(1.0)
            assert claimer.is_alive(), "the claim did not wait for the abort's transaction"
            settlement.release_batched(batch, filters, row, "test")
            return True

        with sessions() as session:
            locked = settlement.transition(session, ref, abort_while_a_worker_claims)
        assert locked is not None
        (claimer,) = claimers
        claimer.join(30)
        assert claimed == [False], "a claim after the abort must fail: the request never runs"
    finally:
        engine.dispose()
