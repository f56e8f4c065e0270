"""A key revoked through one server process is refused at once by another (issue 35, hole 11), with real
processes on SQLite and PostgreSQL.

Each process caches the keys it has verified (``EXPOST_AUTH_CACHE_SECONDS``, 60 s here), so process B keeps
authenticating a key that process A revoked. That cache must decide nothing about budget: admission reads
the key's revocation from the database under the filter locks (as it reads the grant and the archive mark),
and a revocation takes the key's filter locks, so every admission commits before the revocation or is
refused. Here B's cache is warmed on every admission path (an inline count admitted, run and settled in the
writer's transaction; a worker request on the writer's two-phase path; a session open on the ORM path), two
threads keep submitting to B while A revokes, and then:

* every request sent to B after the ``DELETE`` returned is refused with the 401 problem of a revoked key;
* the database holds no request of the key created at or after its ``revoked_at``, and exactly one row per
  submission that B answered as admitted (none admitted that the client saw refused, or the reverse);
* the session the key had open on B was closed by the revocation; the books balance (``ledger verify``
  clean, one reserve and one commit per request, spent = the charges, nothing reserved).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import select

from service.store.engine import make_engine, make_sessionmaker
from service.store.models import AnalysisRequest, AnalysisSession, ApiKey
from tests.integration.helpers import assert_problem
from tests.integration.scale_out_support import Cluster, assert_books_balance, wait_until_settled

pytestmark = pytest.mark.slow

COUNT = {"query": {"kind": "count"}, "epsilon": 0.01}
INLINE = {"mechanism": "laplace", "params": COUNT}  # admitted, run and settled in one writer transaction
WORKER = {"mechanism": "test.busy_count", "params": COUNT}  # the writer's two-phase path, then a worker
SESSION = {
    "mechanism": "above_threshold",
    "params": {"threshold": 10**9, "epsilon_threshold": 0.01, "max_query_epsilon": 0.01, "max_queries": 5},
}
ADMITTED = (200, 201, 202)
AFTER_REVOKE_SECONDS = 1.0  # how long the threads keep submitting once the revocation returned


@dataclass(frozen=True)
class Sent:
    at: float  # time.monotonic() when the request was sent
    status: int
    body: Any


class Hammer:
    """A thread submitting ``body`` to ``…/requests`` over and over until stopped, recording each answer."""

    def __init__(self, base: str, key: str, dataset_id: str, body: dict[str, Any]) -> None:
        self.client = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=60)
        self.path, self.body = f"/v1/datasets/{dataset_id}/requests", body
        self.sent: list[Sent] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            at = time.monotonic()
            response = self.client.post(self.path, json=self.body)
            self.sent.append(Sent(at, response.status_code, response.json()))

    def join(self) -> list[Sent]:
        self.stop.set()
        self.thread.join(90)
        assert not self.thread.is_alive()
        self.client.close()
        return self.sent


def analyst_rows(
    database_url: str, analyst: str
) -> tuple[list[AnalysisRequest], ApiKey, list[AnalysisSession]]:
    engine = make_engine(database_url)
    try:
        with make_sessionmaker(engine)() as session:
            requests = list(
                session.scalars(select(AnalysisRequest).where(AnalysisRequest.analyst == analyst))
            )
            key = session.scalar(select(ApiKey).where(ApiKey.name == analyst))
            assert key is not None
            sessions = list(
                session.scalars(select(AnalysisSession).where(AnalysisSession.analyst == analyst))
            )
            return requests, key, sessions
    finally:
        engine.dispose()


def test_a_key_revoked_through_one_process_is_refused_by_another_at_once(
    database: str, tmp_path: Path
) -> None:
    c = Cluster.create(
        tmp_path,
        database,
        executor="inprocess",
        auth_cache_seconds="60",
        inline_mechanisms='["laplace"]',
        wait_seconds="5",
        test_busy="0",
    )
    try:
        _, base_a = c.api()
        _, base_b = c.api()
        world = c.setup_world(base_a, epsilon=1000.0)
        dataset_id, key = world.dataset_id, world.analyst_key
        admitted = 0
        with (
            world.client(base_b) as b,
            httpx.Client(
                base_url=base_a, headers={"Authorization": f"Bearer {c.admin_key}"}, timeout=60
            ) as admin_a,
        ):
            # B verifies the key (and caches it for 60 s) on every admission path
            for body in (INLINE, WORKER, INLINE, WORKER):
                done = b.post(f"/v1/datasets/{dataset_id}/requests", json=body)
                assert done.status_code in ADMITTED, done.text
                admitted += 1
            opened = b.post(f"/v1/datasets/{dataset_id}/sessions", json=SESSION)
            assert opened.status_code == 201, opened.text
            admitted += 1
            hammers = [Hammer(base_b, key, dataset_id, body) for body in (INLINE, WORKER)]
            time.sleep(0.5)  # the threads are admitted on B meanwhile

            revoked = admin_a.delete(f"/v1/keys/{world.analyst}")
            returned = time.monotonic()
            assert revoked.status_code == 200, revoked.text

            # at once, on B, whose cache still holds the key: every admission path refuses it
            for body in (INLINE, WORKER):
                assert_problem(
                    b.post(f"/v1/datasets/{dataset_id}/requests", json=body), 401, "/problems/unauthenticated"
                )
            assert_problem(
                b.post(f"/v1/datasets/{dataset_id}/sessions", json=SESSION), 401, "/problems/unauthenticated"
            )
            time.sleep(AFTER_REVOKE_SECONDS)
            sent = [s for hammer in hammers for s in hammer.join()]

        before = [s for s in sent if s.at < returned]
        after = [s for s in sent if s.at >= returned]
        assert sum(s.status in ADMITTED for s in before) >= 2, [s.status for s in before]
        assert len(after) >= 4, len(after)  # the threads kept submitting after the revocation
        late = [(s.at - returned, s.status, s.body) for s in after if s.status != 401]
        assert late == [], f"admitted or failed after the revocation returned: {late[:3]}"
        assert all(s.body["type"] == "/problems/unauthenticated" for s in after)
        admitted += sum(s.status in ADMITTED for s in sent)

        wait_until_settled(database, [dataset_id], timeout=60)
        requests, key_row, sessions = analyst_rows(database, world.analyst)
        assert key_row.revoked_at is not None
        created_late = [r.id for r in requests if r.created_at >= key_row.revoked_at]
        assert created_late == [], "admitted at or after the revocation"
        assert len(requests) == admitted  # one row per admission B answered, none B refused
        assert [(s.state, s.close_reason) for s in sessions] == [("closed", "key_revoked")]
        states = assert_books_balance(c, [dataset_id], cli=False)
        assert states["committed"] == admitted, states
    finally:
        c.close()
