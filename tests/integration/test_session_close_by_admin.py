"""Admins close any session, and revoking a key closes its sessions (issue 35, hole 12), over real HTTP on
SQLite and PostgreSQL.

A revoked key's open sessions used to keep their worst-case reservation until their TTL (an hour), and an
admin's close got a 403. Now an admin's ``POST /v1/sessions/{id}/close`` settles another analyst's session
exactly as the analyst's own close does, and ``DELETE /v1/keys/{name}`` (and ``expost keys revoke``)
closes every open session of the key in the revocation's transaction: each reservation is replaced by the
charge of the session's public transcript, as a close, never less. The ledger replays to the filter rows.

The sessions here are AboveThreshold sessions far below their threshold (every answer is "below"), so two
sessions asked the same queries have the same public transcript and the same close charge.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import select

from mechanisms.accounting import UnitsVector
from service.auth import Role
from service.filter.ledger import VerifyReport, verify_dataset
from service.store.models import DATASET_SCOPE, AnalysisRequest, AnalysisSession, LedgerEntry, PrivacyFilter
from tests.conftest import LiveServer
from tests.integration.helpers import BIG, World, add_dataset, assert_problem, db_session, make_world
from tests.integration.scale_out_support import run_cli

SESSION = {
    "mechanism": "above_threshold",
    "params": {"threshold": 10**9, "epsilon_threshold": 0.2, "max_query_epsilon": 0.5, "max_queries": 10},
}
QUERIES = [({"kind": "count"}, 0.1), ({"kind": "count"}, 0.3)]


def open_and_ask(world: World, client: httpx.Client, dataset_id: str | None = None) -> str:
    """Open a session and ask it ``QUERIES`` (every answer "below"); returns its id."""
    opened = client.post(f"/v1/datasets/{dataset_id or world.dataset_id}/sessions", json=SESSION)
    assert opened.status_code == 201, opened.text
    session_id: str = opened.json()["id"]
    for query, epsilon in QUERIES:
        asked = client.post(f"/v1/sessions/{session_id}/queries", json={"query": query, "epsilon": epsilon})
        assert asked.status_code == 200, asked.text
        assert asked.json()["answer"]["above"] is False
    return session_id


def rows(world: World, session_id: str) -> tuple[AnalysisSession, AnalysisRequest, list[str]]:
    """The session's row, its request row and the events of its ledger entries, read from the database."""
    with db_session(world.server.settings.database_url) as session:
        row = session.get(AnalysisSession, session_id)
        assert row is not None
        request = session.get(AnalysisRequest, row.request_id)
        assert request is not None
        events = session.scalars(
            select(LedgerEntry.event)
            .where(LedgerEntry.request_id == row.request_id)
            .order_by(LedgerEntry.seq)
        ).all()
        return row, request, list(events)


def charge(request: AnalysisRequest) -> UnitsVector:
    assert request.realized is not None, request.id
    return UnitsVector.from_json(request.realized["units"])


def filters(world: World, dataset_id: str) -> dict[str, PrivacyFilter]:
    with db_session(world.server.settings.database_url) as session:
        found = session.scalars(select(PrivacyFilter).where(PrivacyFilter.dataset_id == dataset_id))
        return {f.scope: f for f in found}


def assert_settled_books(world: World, dataset_id: str, spent_by: dict[str, UnitsVector]) -> None:
    """Nothing reserved on the dataset's filters, each spent total exactly ``spent_by`` its scope, and the
    ledger replays to the filter rows (what ``expost ledger verify`` checks)."""
    found = filters(world, dataset_id)
    for scope, expected in spent_by.items():
        flt = found[scope]
        assert UnitsVector.from_json(flt.reserved) == UnitsVector.zeros(len(expected)), (scope, flt.reserved)
        assert UnitsVector.from_json(flt.spent) == expected, scope
    report = VerifyReport()
    slots = len(world.admin.get(f"/v1/datasets/{dataset_id}").json()["orders"]) + 1
    with db_session(world.server.settings.database_url) as session:
        verify_dataset(session, dataset_id, slots, report)
    assert report.ok, report.problems
    assert report.entries > 0


def test_an_admin_closes_an_analysts_session_at_the_charge_of_the_analysts_close(
    live_server: LiveServer,
) -> None:
    world = make_world(live_server, budget=BIG)
    own, by_admin = open_and_ask(world, world.analyst), open_and_ask(world, world.analyst)

    closed_own = world.analyst.post(f"/v1/sessions/{own}/close")
    assert closed_own.status_code == 200, closed_own.text
    closed = world.admin.post(f"/v1/sessions/{by_admin}/close")
    assert closed.status_code == 200, closed.text
    body = closed.json()
    assert (body["state"], body["close_reason"], body["analyst"]) == (
        "closed",
        "closed_by_admin",
        world.analyst_name,
    )
    assert body["realized"] == closed_own.json()["realized"]
    assert body["realized"]["pure"] > 0

    _, own_request, own_events = rows(world, own)
    row, request, events = rows(world, by_admin)
    assert (row.state, request.state) == ("closed", "committed")
    assert charge(request) == charge(own_request)  # exactly what the analyst's close charges
    assert charge(request) != UnitsVector.from_json(request.worst_case["units"])  # the outcome, not w
    assert events == own_events == ["reserve", "commit"]
    both = charge(request) + charge(own_request)
    assert_settled_books(world, world.dataset_id, {DATASET_SCOPE: both, world.analyst_name: both})

    again = world.admin.post(f"/v1/sessions/{by_admin}/close")  # idempotent: nothing more is charged
    assert again.status_code == 200, again.text
    assert again.json()["close_reason"] == "closed_by_admin"
    assert rows(world, by_admin)[2] == ["reserve", "commit"]


def test_only_the_owner_and_admins_close_a_session(live_server: LiveServer) -> None:
    world = make_world(live_server, budget=BIG)
    session_id = open_and_ask(world, world.analyst)
    _, other = world.new_key(Role.analyst)
    assert_problem(other.post(f"/v1/sessions/{session_id}/close"), 404, "/problems/not-found")
    assert_problem(world.viewer.post(f"/v1/sessions/{session_id}/close"), 403, "/problems/forbidden")
    assert_problem(world.admin.post("/v1/sessions/ss_nothing/close"), 404, "/problems/not-found")
    assert rows(world, session_id)[0].state == "open"
    closed = world.analyst.post(f"/v1/sessions/{session_id}/close")  # the owner's close is a plain close
    assert closed.status_code == 200, closed.text
    assert closed.json()["close_reason"] == "closed"
    other.close()


def test_revoking_a_key_closes_its_sessions_at_their_close_charge(live_server: LiveServer) -> None:
    world = make_world(live_server, budget=BIG)
    second = add_dataset(world, _csv(), _schema(), BIG)
    reference = open_and_ask(world, world.analyst)  # closed by its analyst: the close charge of QUERIES
    closed = world.analyst.post(f"/v1/sessions/{reference}/close")
    assert closed.status_code == 200, closed.text
    first_open, second_open = open_and_ask(world, world.analyst), open_and_ask(world, world.analyst, second)
    fresh = world.analyst.post(f"/v1/datasets/{world.dataset_id}/sessions", json=SESSION)  # nothing asked
    assert fresh.status_code == 201, fresh.text
    bystander_name, bystander = world.new_key(Role.analyst)  # another analyst's session stays open
    granted = world.admin.post(f"/v1/datasets/{world.dataset_id}/grants", json={"analyst": bystander_name})
    assert granted.status_code == 201, granted.text
    theirs = open_and_ask(world, bystander)

    revoked = world.admin.delete(f"/v1/keys/{world.analyst_name}")
    assert revoked.status_code == 200, revoked.text

    expected = charge(rows(world, reference)[1])
    for session_id in (first_open, second_open):
        row, request, events = rows(world, session_id)
        assert (row.state, row.close_reason, request.state) == ("closed", "key_revoked", "committed")
        assert charge(request) == expected  # as the analyst's close: never less, and not the worst case
        assert events == ["reserve", "commit"]
        shown = world.admin.get(f"/v1/sessions/{session_id}").json()
        assert (shown["state"], shown["close_reason"]) == ("closed", "key_revoked")
    row, request, events = rows(world, fresh.json()["id"])
    assert (row.state, row.close_reason, events) == ("closed", "key_revoked", ["reserve", "commit"])
    nothing_asked = charge(request)
    assert rows(world, theirs)[0].state == "open"

    mine = expected + expected + nothing_asked  # reference and first_open, and the fresh one
    theirs_request = rows(world, theirs)[1]
    theirs_reserved = UnitsVector.from_json(theirs_request.worst_case["units"])
    assert_settled_books(world, second, {DATASET_SCOPE: expected, world.analyst_name: expected})
    found = filters(world, world.dataset_id)
    assert UnitsVector.from_json(found[DATASET_SCOPE].reserved) == theirs_reserved  # the bystander's only
    assert UnitsVector.from_json(found[DATASET_SCOPE].spent) == mine
    assert UnitsVector.from_json(found[world.analyst_name].reserved) == UnitsVector.zeros(len(mine))
    assert UnitsVector.from_json(found[world.analyst_name].spent) == mine
    assert world.admin.post(f"/v1/sessions/{theirs}/close").status_code == 200
    assert_settled_books(
        world,
        world.dataset_id,
        {
            DATASET_SCOPE: mine + charge(rows(world, theirs)[1]),
            world.analyst_name: mine,
        },
    )
    # revoking again changes nothing (the sessions are closed, the first revoked_at stays)
    again = world.admin.delete(f"/v1/keys/{world.analyst_name}")
    assert again.json()["revoked_at"] == revoked.json()["revoked_at"]
    assert rows(world, first_open)[2] == ["reserve", "commit"]
    bystander.close()


def test_expost_keys_revoke_closes_the_keys_sessions(live_server: LiveServer, tmp_path: Path) -> None:
    world = make_world(live_server, budget=BIG)
    session_id = open_and_ask(world, world.analyst)
    env = {**os.environ, "EXPOST_DATABASE_URL": live_server.settings.database_url, "NO_COLOR": "1"}
    done = run_cli(env, tmp_path, "keys", "revoke", world.analyst_name)
    assert done.returncode == 0, done.stderr
    assert f"revoked: {world.analyst_name}" in done.stdout
    assert "1 open session closed" in done.stdout
    row, request, events = rows(world, session_id)
    assert (row.state, row.close_reason, events) == ("closed", "key_revoked", ["reserve", "commit"])
    spent = charge(request)
    assert_settled_books(world, world.dataset_id, {DATASET_SCOPE: spent, world.analyst_name: spent})


def _schema() -> dict[str, Any]:
    return {"columns": [{"name": "x", "type": "float", "min": 0, "max": 1}], "neighboring": "replace_one"}


def _csv() -> bytes:
    return b"x\n" + b"0.5\n" * 20
