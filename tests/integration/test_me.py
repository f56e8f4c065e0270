"""GET /v1/me names the caller's key and role (every role), over real HTTP on SQLite and PostgreSQL."""

from __future__ import annotations

from expost_client import ExpostClient
from tests.conftest import LiveServer
from tests.integration.helpers import assert_problem, make_world


def test_each_role_reads_its_own_name(live_server: LiveServer) -> None:
    world = make_world(live_server)
    for client, role in ((world.admin, "admin"), (world.analyst, "analyst"), (world.viewer, "viewer")):
        body = client.get("/v1/me").json()
        assert body["role"] == role
    assert world.analyst.get("/v1/me").json()["name"] == world.analyst_name
    assert world.admin.get("/v1/me").json()["name"] == world.admin_name
    assert_problem(live_server.client(None).get("/v1/me"), 401)
    key = str(world.analyst.headers["Authorization"]).removeprefix("Bearer ")
    with ExpostClient(live_server.base_url, key) as client:
        me = client.me()
    assert (me.name, me.role) == (world.analyst_name, "analyst")
