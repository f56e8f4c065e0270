"""Lifecycle administration over HTTP on both backends: revoking API keys (and the key cache), revoking
grants (a ``revoke`` ledger event that replays), archiving datasets (no new admissions, nothing deleted),
and ``expost keys revoke``."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from sqlalchemy import func, select

from expost_client import ExpostClient
from expost_client.errors import ExpostError
from service.auth import Role, create_key, revoke_key
from service.errors import Conflict
from service.filter.ledger import VerifyReport, verify_dataset
from service.store.models import ApiKey, LedgerEntry
from tests.conftest import LiveServer, running_server, server_settings
from tests.integration.helpers import (
    BIG,
    World,
    assert_problem,
    db_session,
    fresh_database,
    get_budget,
    ledger_items,
    make_world,
)
from tests.integration.scale_out_support import run_cli

COUNT = {"query": {"kind": "count"}, "epsilon": 0.1}
SESSION = {
    "mechanism": "above_threshold",
    "params": {"threshold": 10**9, "epsilon_threshold": 0.01, "max_query_epsilon": 0.5, "max_queries": 10},
}


def verify_green(world: World) -> None:
    """The dataset's ledger replays to exactly its filter rows (what ``expost ledger verify`` checks)."""
    report = VerifyReport()
    with db_session(world.server.settings.database_url) as session:
        verify_dataset(session, world.dataset_id, _slots(world), report)
    assert report.ok, report.problems
    assert report.entries > 0


def _slots(world: World) -> int:
    return len(world.admin.get(f"/v1/datasets/{world.dataset_id}").json()["orders"]) + 1


def ledger_rows(world: World) -> int:
    with db_session(world.server.settings.database_url) as session:
        query = select(func.count()).select_from(LedgerEntry)
        return int(session.scalar(query.where(LedgerEntry.dataset_id == world.dataset_id)) or 0)


# ----- API keys ---------------------------------------------------------------------------------------------


def test_a_revoked_key_is_refused_at_once_by_this_process(live_server: LiveServer) -> None:
    world = make_world(live_server)
    done = world.request(world.analyst, COUNT)
    assert done.status_code == 200, done.text
    assert world.analyst.get("/v1/datasets").status_code == 200  # now in the server's key cache

    revoked = world.admin.delete(f"/v1/keys/{world.analyst_name}")
    assert revoked.status_code == 200, revoked.text
    body = revoked.json()
    assert (body["name"], body["role"]) == (world.analyst_name, "analyst")
    assert_problem(world.analyst.get("/v1/datasets"), 401, "/problems/unauthenticated")
    assert_problem(world.request(world.analyst, COUNT), 401, "/problems/unauthenticated")

    again = world.admin.delete(f"/v1/keys/{world.analyst_name}")  # idempotent: the first time is kept
    assert again.status_code == 200, again.text
    assert again.json()["revoked_at"] == body["revoked_at"]
    listed = {k["name"]: k for k in world.admin.get("/v1/keys").json()}
    assert world.analyst_name in listed  # listed still: the name stays taken, and marked revoked
    assert listed[world.analyst_name]["revoked_at"] == body["revoked_at"]
    assert listed[world.admin_name]["revoked_at"] is None
    reused = world.admin.post("/v1/keys", json={"name": world.analyst_name, "role": "analyst"})
    assert_problem(reused, 409, "/problems/conflict")
    # their history and the ledger stay
    entries = ledger_items(world.admin, world.dataset_id)
    mine = [e for e in entries if e.get("request_id") == done.json()["id"]]
    assert [e["event"] for e in mine] == ["reserve", "commit"]
    assert get_budget(world.admin, world.dataset_id, world.analyst_name)["epsilon_spent"] > 0
    verify_green(world)


def test_revoking_keys_is_for_admins_and_names_must_exist(live_server: LiveServer) -> None:
    world = make_world(live_server)
    assert_problem(world.analyst.delete(f"/v1/keys/{world.analyst_name}"), 403, "/problems/forbidden")
    assert_problem(world.viewer.delete(f"/v1/keys/{world.analyst_name}"), 403, "/problems/forbidden")
    assert_problem(world.admin.delete("/v1/keys/nobody-by-this-name"), 404, "/problems/not-found")
    assert_problem(world.admin.delete("/v1/keys/%00"), 422, "/problems/invalid-input")
    assert world.analyst.get("/v1/datasets").status_code == 200  # nothing was revoked


def test_other_processes_refuse_a_revoked_key_within_their_cache_time(live_server: LiveServer) -> None:
    """A second server on the same database, with its own key cache (0.5 s): it keeps accepting the key at
    most that long after the revocation, then refuses it."""
    world = make_world(live_server)
    ttl = 0.5
    same = live_server.settings  # the same database and data directory, its own key cache
    settings = server_settings(same.database_url, same.data_dir, auth_cache_seconds=ttl)
    with running_server(settings) as other:
        key = world.analyst.headers["Authorization"].removeprefix("Bearer ")
        with other.client(key) as analyst_there:
            assert analyst_there.get("/v1/datasets").status_code == 200  # cached there now
            assert world.admin.delete(f"/v1/keys/{world.analyst_name}").status_code == 200
            revoked_at = time.monotonic()
            while analyst_there.get("/v1/datasets").status_code == 200:
                assert time.monotonic() - revoked_at < ttl + 2.0, "still accepted long after the cache time"
                time.sleep(0.05)
            assert time.monotonic() - revoked_at <= ttl + 2.0
            assert_problem(analyst_there.get("/v1/datasets"), 401, "/problems/unauthenticated")


def test_the_last_active_admin_key_cannot_be_revoked(database_url: str, tmp_path: Path) -> None:
    with fresh_database(database_url, tmp_path) as url, db_session(url) as session:
        with session.begin():
            create_key(session, "only-admin", Role.admin)
            create_key(session, "an-analyst", Role.analyst)
        with pytest.raises(Conflict, match="last active admin"), session.begin():
            revoke_key(session, "only-admin")
        with session.begin():
            create_key(session, "second-admin", Role.admin)
            assert revoke_key(session, "only-admin").revoked_at is not None
            assert revoke_key(session, "an-analyst").revoked_at is not None
        with pytest.raises(Conflict), session.begin():
            revoke_key(session, "second-admin")


def test_expost_keys_revoke(live_server: LiveServer, tmp_path: Path) -> None:
    world = make_world(live_server)
    env = {**os.environ, "EXPOST_DATABASE_URL": live_server.settings.database_url, "NO_COLOR": "1"}
    done = run_cli(env, tmp_path, "keys", "revoke", world.analyst_name)
    assert done.returncode == 0, done.stderr
    assert f"revoked: {world.analyst_name}" in done.stdout
    with db_session(live_server.settings.database_url) as session:
        row = session.scalar(select(ApiKey).where(ApiKey.name == world.analyst_name))
        assert row is not None
        assert row.revoked_at is not None
    unknown = run_cli(env, tmp_path, "keys", "revoke", "nobody-by-this-name")
    assert unknown.returncode == 1
    assert "no API key named" in unknown.stderr
    # the server refuses the key once its cache entry (EXPOST_AUTH_CACHE_SECONDS) has expired
    deadline = time.monotonic() + live_server.settings.auth_cache_seconds + 2.0
    while world.analyst.get("/v1/datasets").status_code == 200:
        assert time.monotonic() < deadline, "a key revoked by the CLI was still accepted"
        time.sleep(0.1)


# ----- grants -----------------------------------------------------------------------------------------------


def test_a_revoked_grant_hides_the_dataset_and_keeps_history_and_ledger(live_server: LiveServer) -> None:
    world = make_world(live_server)
    path = f"/v1/datasets/{world.dataset_id}"
    done = world.request(world.analyst, COUNT)
    assert done.status_code == 200, done.text
    spent = get_budget(world.admin, world.dataset_id, world.analyst_name)["epsilon_spent"]
    assert spent > 0
    assert world.analyst.get(path).status_code == 200  # the grant is cached in the server now
    rows = ledger_rows(world)

    revoked = world.admin.delete(f"{path}/grants/{world.analyst_name}")
    assert revoked.status_code == 200, revoked.text
    assert revoked.json() == {"dataset_id": world.dataset_id, "analyst": world.analyst_name, "revoked": True}
    assert_problem(world.analyst.get(path), 404, "/problems/not-found")
    assert world.dataset_id not in [d["id"] for d in world.analyst.get("/v1/datasets").json()]
    assert_problem(world.request(world.analyst, COUNT), 404, "/problems/not-found")
    assert_problem(world.analyst.post(f"{path}/sessions", json=SESSION), 404, "/problems/not-found")
    assert world.analyst_name not in world.admin.get(f"{path}/grants").json()
    # history stays: their own requests, and the ledger with a revoke entry (one more row, none deleted)
    history = world.analyst.get("/v1/requests").json()["items"]
    assert done.json()["id"] in [r["id"] for r in history]
    assert world.analyst.get(f"/v1/requests/{done.json()['id']}").status_code == 200
    assert ledger_rows(world) == rows + 1
    last = ledger_items(world.admin, world.dataset_id)[-1]
    assert (last["event"], last["analyst"], last["actor"]) == ("revoke", world.analyst_name, world.admin_name)
    assert get_budget(world.admin, world.dataset_id, world.analyst_name)["epsilon_spent"] == spent
    verify_green(world)

    again = world.admin.delete(f"{path}/grants/{world.analyst_name}")
    assert again.status_code == 200, again.text
    assert again.json()["revoked"] is False
    assert ledger_rows(world) == rows + 1

    # granted again: the sub-filter is the old one (what they spent still counts)
    regranted = world.admin.post(f"{path}/grants", json={"analyst": world.analyst_name})
    assert regranted.status_code == 201, regranted.text
    assert regranted.json()["created"] is True
    assert get_budget(world.admin, world.dataset_id, world.analyst_name)["epsilon_spent"] == spent
    assert world.request(world.analyst, COUNT).status_code == 200
    verify_green(world)


def test_revoking_a_grant_is_for_admins(live_server: LiveServer) -> None:
    world = make_world(live_server)
    path = f"/v1/datasets/{world.dataset_id}/grants/{world.analyst_name}"
    assert_problem(world.analyst.delete(path), 403, "/problems/forbidden")
    assert_problem(world.viewer.delete(path), 403, "/problems/forbidden")
    assert_problem(world.admin.delete(f"/v1/datasets/ds_nothing/grants/{world.analyst_name}"), 404)
    assert_problem(world.admin.delete(f"/v1/datasets/{world.dataset_id}/grants/%00"), 422)
    assert world.request(world.analyst, COUNT).status_code == 200


def test_an_open_session_of_a_revoked_analyst_still_settles(live_server: LiveServer) -> None:
    world = make_world(live_server, budget=BIG)
    opened = world.analyst.post(f"/v1/datasets/{world.dataset_id}/sessions", json=SESSION)
    assert opened.status_code == 201, opened.text
    revoked = world.admin.delete(f"/v1/datasets/{world.dataset_id}/grants/{world.analyst_name}")
    assert revoked.status_code == 200, revoked.text
    closed = world.analyst.post(f"/v1/sessions/{opened.json()['id']}/close")
    assert closed.status_code == 200, closed.text
    assert get_budget(world.admin, world.dataset_id)["orders"][0]["reserved"] == 0
    verify_green(world)


# ----- archiving --------------------------------------------------------------------------------------------


def test_an_archived_dataset_admits_nothing_new_and_keeps_everything(live_server: LiveServer) -> None:
    world = make_world(live_server, budget=BIG)
    path = f"/v1/datasets/{world.dataset_id}"
    done = world.request(world.analyst, COUNT)
    assert done.status_code == 200, done.text
    opened = world.analyst.post(f"{path}/sessions", json=SESSION)
    assert opened.status_code == 201, opened.text
    rows = ledger_rows(world)

    archived = world.admin.post(f"{path}/archive")
    assert archived.status_code == 200, archived.text
    body = archived.json()
    assert (body["dataset_id"], body["archived_by"]) == (world.dataset_id, world.admin_name)

    refused = assert_problem(world.request(world.analyst, COUNT), 409, "/problems/dataset-archived")
    assert "archived" in refused["detail"]
    assert_problem(world.analyst.post(f"{path}/sessions", json=SESSION), 409, "/problems/dataset-archived")
    # the open session finishes; history, budgets and the ledger stay readable; no ledger row is deleted
    session_path = f"/v1/sessions/{opened.json()['id']}"
    asked = world.analyst.post(f"{session_path}/queries", json={"query": {"kind": "count"}})
    assert asked.status_code == 200, asked.text
    assert world.analyst.post(f"{session_path}/close").status_code == 200
    assert world.analyst.get(f"/v1/requests/{done.json()['id']}").status_code == 200
    assert world.analyst.get(path).status_code == 200
    assert get_budget(world.viewer, world.dataset_id)["epsilon_spent"] > 0  # the request's charge stays
    assert world.viewer.get(f"{path}/ledger").status_code == 200
    assert world.analyst.get(f"{path}/activity").status_code == 200
    assert ledger_rows(world) >= rows  # the session's close appended; nothing was removed
    verify_green(world)

    again = world.admin.post(f"{path}/archive")
    assert again.status_code == 200, again.text
    assert again.json()["archived_at"] == body["archived_at"]


def test_archiving_is_for_admins(live_server: LiveServer) -> None:
    world = make_world(live_server)
    path = f"/v1/datasets/{world.dataset_id}/archive"
    assert_problem(world.analyst.post(path), 403, "/problems/forbidden")
    assert_problem(world.viewer.post(path), 403, "/problems/forbidden")
    assert_problem(world.admin.post("/v1/datasets/ds_nothing/archive"), 404, "/problems/not-found")
    assert world.request(world.analyst, COUNT).status_code == 200


def test_another_process_refuses_at_once_after_an_archive(live_server: LiveServer) -> None:
    """Admission reads the archive mark under the filter lock, not from a process cache."""
    world = make_world(live_server)
    settings = server_settings(live_server.settings.database_url, live_server.settings.data_dir)
    with running_server(settings) as other:
        key = world.analyst.headers["Authorization"].removeprefix("Bearer ")
        with other.client(key) as analyst_there:
            url = f"/v1/datasets/{world.dataset_id}/requests"
            first = analyst_there.post(url, json={"mechanism": "laplace", "params": COUNT})
            assert first.status_code == 200, first.text
            assert world.admin.post(f"/v1/datasets/{world.dataset_id}/archive").status_code == 200
            refused = analyst_there.post(url, json={"mechanism": "laplace", "params": COUNT})
            assert_problem(refused, 409, "/problems/dataset-archived")


# ----- the Python client ------------------------------------------------------------------------------------


def test_the_client_revokes_and_archives(live_server: LiveServer) -> None:
    world = make_world(live_server)
    admin_key = world.admin.headers["Authorization"].removeprefix("Bearer ")
    with ExpostClient(live_server.base_url, admin_key) as admin:
        other = admin.create_key(f"client-gone-{world.dataset_id[-6:]}", "analyst")
        assert admin.revoke_grant(world.dataset_id, world.analyst_name)["revoked"] is True
        assert admin.revoke_grant(world.dataset_id, world.analyst_name)["revoked"] is False
        assert admin.revoke_key(other.name)["name"] == other.name
        archived = admin.archive_dataset(world.dataset_id)
        assert archived["archived_by"] == world.admin_name
        with pytest.raises(ExpostError) as raised:
            admin.revoke_key("nobody-by-this-name")
        assert raised.value.status == 404
