"""Friction and hardening found by a new user (issue 20, items 7 and 8), over HTTP on both backends:
``-F schema=@schema.json`` uploads, clipping reported per column (API and ``expost datasets add``), the 404
of a dataset not granted, ``:estimate`` on an archived dataset, ``archived_at`` in the dataset view, what
viewers see of refusals, and where an ``Idempotency-Key`` with control characters is answered."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest

from expost_client import ExpostClient
from service.auth import Role
from tests.conftest import LiveServer
from tests.integration.helpers import SCHEMA, World, assert_problem, make_world

COUNT = {"query": {"kind": "count"}, "epsilon": 0.1}
EXPOST = Path(sys.executable).with_name("expost")

# 6 rows: ages 10 and 95 lie outside [18, 90], incomes -5 and 200000 and 300000 outside [0, 100000]
OUT_OF_BOUNDS_CSV = (
    b"age,income,region\n10,1000,north\n30,-5,south\n95,200000,east\n40,300000,west\n50,500,north\n"
    b"60,600,south\n"
)
CLIPPED = {"age": 2, "income": 3, "region": 0}


def upload_parts(
    admin: httpx.Client, schema_part: tuple[str, bytes, str] | str, csv: bytes
) -> httpx.Response:
    files: dict[str, tuple[str, bytes, str]] = {"file": ("data.csv", csv, "text/csv")}
    data: dict[str, str] = {"name": "parts"}
    if isinstance(schema_part, str):
        data["schema"] = schema_part
    else:
        files["schema"] = schema_part
    return admin.post("/v1/datasets", files=files, data=data)


# ----- uploads (item 7) ------------------------------------------------------------------------------------


class TestUploads:
    def test_a_schema_sent_as_a_file_part_works_like_a_text_field(self, live_server: LiveServer) -> None:
        world = make_world(live_server)
        text = json.dumps(SCHEMA)
        as_field = upload_parts(world.admin, text, OUT_OF_BOUNDS_CSV)
        as_file = upload_parts(
            world.admin, ("schema.json", text.encode(), "application/json"), OUT_OF_BOUNDS_CSV
        )
        as_octets = upload_parts(
            world.admin, ("schema.json", text.encode(), "application/octet-stream"), OUT_OF_BOUNDS_CSV
        )
        for response in (as_field, as_file, as_octets):
            assert response.status_code == 201, response.text
        bodies = [r.json() for r in (as_field, as_file, as_octets)]
        assert bodies[0]["schema"] == bodies[1]["schema"] == bodies[2]["schema"]
        assert len({b["id"] for b in bodies}) == 3

    def test_a_bad_schema_file_is_a_problem_naming_the_schema(self, live_server: LiveServer) -> None:
        world = make_world(live_server)
        for content, word in ((b"\xff\xfe{}", "UTF-8"), (b"{not json", "JSON"), (b"[" * 100_000, "nested")):
            response = upload_parts(
                world.admin, ("schema.json", content, "application/json"), OUT_OF_BOUNDS_CSV
            )
            problem = assert_problem(response, 422, "/problems/invalid-input")
            assert problem["errors"][0]["field"] == "schema", problem
            assert word in problem["errors"][0]["reason"], problem

    def test_the_upload_reports_how_many_values_each_column_clipped(self, live_server: LiveServer) -> None:
        world = make_world(live_server)
        created = upload_parts(world.admin, json.dumps(SCHEMA), OUT_OF_BOUNDS_CSV)
        assert created.status_code == 201, created.text
        body = created.json()
        assert body["clipped"] == CLIPPED
        dataset_id = body["id"]
        assert world.admin.get(f"/v1/datasets/{dataset_id}").json()["clipped"] == CLIPPED
        # a function of the data: only admins see it
        granted = world.admin.post(f"/v1/datasets/{dataset_id}/grants", json={"analyst": world.analyst_name})
        assert granted.status_code == 201
        assert world.analyst.get(f"/v1/datasets/{dataset_id}").json()["clipped"] is None
        assert world.viewer.get(f"/v1/datasets/{dataset_id}").json()["clipped"] is None
        # the power check: a file inside the bounds clips nothing
        inside = upload_parts(world.admin, json.dumps(SCHEMA), b"age,income,region\n20,5,north\n")
        assert inside.json()["clipped"] == {"age": 0, "income": 0, "region": 0}

    def test_cli_datasets_add_reports_the_clipped_values(
        self, live_server: LiveServer, tmp_path: Path
    ) -> None:
        (tmp_path / "data.csv").write_bytes(OUT_OF_BOUNDS_CSV)
        (tmp_path / "schema.json").write_text(json.dumps(SCHEMA))
        env = {
            **os.environ,
            "EXPOST_DATABASE_URL": live_server.settings.database_url,
            "EXPOST_DATA_DIR": str(live_server.settings.data_dir),
            "NO_COLOR": "1",
        }
        done = subprocess.run(
            [
                str(EXPOST),
                "datasets",
                "add",
                "--file",
                str(tmp_path / "data.csv"),
                "--schema",
                str(tmp_path / "schema.json"),
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        dataset_id = done.stdout.strip()
        assert dataset_id.startswith("ds_"), done.stdout  # stdout: the id alone, for scripts
        assert "values clipped to the declared bounds, per column: age 2, income 3, region 0" in done.stderr
        _, admin_key = live_server.create_key(Role.admin)
        with live_server.client(admin_key) as admin:
            assert admin.get(f"/v1/datasets/{dataset_id}").json()["clipped"] == CLIPPED


# ----- visibility and archived datasets (items 7, 8) -----------------------------------------------------


class TestVisibility:
    def test_a_dataset_not_granted_reads_not_found_or_not_granted(self, live_server: LiveServer) -> None:
        world = make_world(live_server)
        _, stranger = world.new_key(Role.analyst)
        missing = "ds_" + "0" * 16
        paths = ["", "/budget", "/ledger", "/refusals", "/activity"]
        for path in paths:
            for dataset_id in (world.dataset_id, missing):
                problem = assert_problem(
                    stranger.get(f"/v1/datasets/{dataset_id}{path}"), 404, "/problems/not-found"
                )
                assert problem["detail"] == f"dataset {dataset_id!r} not found or not granted to you"
        submitted = stranger.post(
            f"/v1/datasets/{world.dataset_id}/requests", json={"mechanism": "laplace", "params": COUNT}
        )
        assert "not found or not granted" in assert_problem(submitted, 404)["detail"]
        # admins see every dataset: theirs is a plain "no dataset"
        assert assert_problem(world.admin.get(f"/v1/datasets/{missing}"), 404)["detail"] == (
            f"no dataset {missing!r}"
        )

    def test_estimate_refuses_an_archived_dataset_like_submit(self, live_server: LiveServer) -> None:
        world = make_world(live_server)
        url = f"/v1/datasets/{world.dataset_id}"
        before = world.analyst.post(
            f"{url}/requests:estimate", json={"mechanism": "laplace", "params": COUNT}
        )
        assert before.status_code == 200, before.text
        assert before.json()["admitted"] is True
        assert world.admin.get(url).json()["archived_at"] is None
        archived = world.admin.post(f"{url}/archive")
        assert archived.status_code == 200, archived.text
        for client in (world.analyst, world.admin):
            dry = client.post(f"{url}/requests:estimate", json={"mechanism": "laplace", "params": COUNT})
            assert_problem(dry, 409, "/problems/dataset-archived")
        submit = world.request(world.analyst, COUNT)
        assert_problem(submit, 409, "/problems/dataset-archived")
        shown = world.admin.get(url).json()["archived_at"]
        assert shown is not None
        assert shown.replace("Z", "+00:00")[:19] == archived.json()["archived_at"].replace("Z", "+00:00")[:19]
        assert world.analyst.get(url).json()["archived_at"] == shown
        listed = {d["id"]: d for d in world.admin.get("/v1/datasets").json()}
        assert listed[world.dataset_id]["archived_at"] == shown
        token = world.admin.headers["Authorization"].split()[1]
        with ExpostClient(world.server.base_url, token) as client:
            dataset = client.get_dataset(world.dataset_id)
            assert dataset.archived_at is not None
            assert client.get_dataset(world.dataset_id).archived_at == dataset.archived_at

    def test_viewers_see_refusals_without_parameters(self, live_server: LiveServer) -> None:
        world = make_world(live_server)
        too_much = {"query": {"kind": "sum", "column": "income"}, "epsilon": 0.6}
        assert world.request(world.analyst, too_much).status_code == 200  # 0.6 of 1 spent: 0.4 left
        assert_problem(world.request(world.analyst, too_much), 409, "/problems/budget-exhausted")
        url = f"/v1/datasets/{world.dataset_id}/refusals"
        [as_viewer] = world.viewer.get(url).json()["items"]
        [as_admin] = world.admin.get(url).json()["items"]
        [as_owner] = world.analyst.get(url).json()["items"]
        assert as_viewer["params"] is None
        assert as_admin["params"] == as_owner["params"] == too_much
        assert as_viewer == {**as_admin, "params": None}
        assert "income" not in json.dumps(as_viewer)


# ----- Idempotency-Key with control characters (item 8) ---------------------------------------------------


def raw_post(world: World, key_bytes: bytes, token: str) -> bytes:
    """A POST of a Laplace count with ``Idempotency-Key: <key_bytes>``, written byte for byte."""
    url = urlparse(world.server.base_url)
    body = json.dumps({"mechanism": "laplace", "params": COUNT}).encode()
    head = (
        f"POST /v1/datasets/{world.dataset_id}/requests HTTP/1.1\r\nHost: {url.hostname}\r\n"
        f"Authorization: Bearer {token}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n"
    ).encode()
    with socket.create_connection((url.hostname or "127.0.0.1", url.port or 80), timeout=30) as conn:
        conn.sendall(head + b"Idempotency-Key: " + key_bytes + b"\r\n\r\n" + body)
        chunks = []
        while chunk := conn.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


class TestIdempotencyKeyCharacters:
    """What the app can see it answers with a problem naming the header. C0 control characters and DEL are
    refused by the HTTP parser of the server (uvicorn's httptools or h11: RFC 9110 field values allow
    neither) before any application code runs; the server's protocol class (``service.api.wire``) writes
    that 400 as a problem document too."""

    @pytest.mark.parametrize("key", [b"a\tb", b"caf\xe9", b"\xff\xfe"], ids=["tab", "latin-1", "high-bytes"])
    def test_keys_the_app_receives_are_a_problem_naming_the_header(
        self, live_server: LiveServer, key: bytes
    ) -> None:
        world = make_world(live_server)
        token = world.analyst.headers["Authorization"].split()[1]
        response = raw_post(world, key, token)
        head, _, body = response.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 422"), response[:300]
        assert b"content-type: application/problem+json" in head.lower()
        problem = json.loads(body)
        assert problem["type"] == "/problems/invalid-input"
        assert problem["errors"][0]["field"] == "header.Idempotency-Key", problem
        assert "control characters" in problem["errors"][0]["reason"]
        assert world.analyst.get("/v1/requests").json()["items"] == []  # nothing was admitted

    @pytest.mark.parametrize(
        "key", [b"a\x01b", b"a\x00b", b"a\x1bb", b"a\x7fb"], ids=["SOH", "NUL", "ESC", "DEL"]
    )
    def test_control_characters_are_refused_before_the_app(self, live_server: LiveServer, key: bytes) -> None:
        world = make_world(live_server)
        token = world.analyst.headers["Authorization"].split()[1]
        response = raw_post(world, key, token)
        head, _, body = response.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400 "), response[:300]
        assert b"content-type: application/problem+json" in head.lower(), response[:300]
        problem = json.loads(body)
        assert problem["status"] == 400, problem
        assert problem["type"] == "/problems/malformed-request", problem
        assert "control characters" in problem["detail"]
        assert key not in body, "the client's bytes are not echoed"
        assert b"x-request-id" not in response.lower(), "no application code ran (its middleware sets this)"
        assert world.analyst.get("/v1/requests").json()["items"] == []
        # the power check: the same request with a printable key is admitted
        ok = raw_post(world, b"printable-key-1", token)
        assert ok.startswith(b"HTTP/1.1 200 "), ok[:300]
        assert len(world.analyst.get("/v1/requests").json()["items"]) == 1
