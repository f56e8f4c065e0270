"""Data where it lives, over real HTTP (docs/operations.md "Data and engines"): datasets registered by
reference from Parquet files and folders and from PostgreSQL tables and queries, every dataset an immutable
content-addressed Parquet snapshot; two server processes with separate local folders sharing one real
S3-compatible store (moto) answer the same dataset; a source or a store that fails answers a problem, stores
nothing and charges nothing."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from service.auth import Role
from tests.conftest import LiveServer, S3Server, _libpq, fresh_postgres_database
from tests.integration.helpers import BIG, SCHEMA, upload
from tests.integration.scale_out_support import Cluster

ROOT = Path(__file__).resolve().parents[2]
REGIONS = ["north", "south", "east", "west"]
N = 300


def rows() -> dict[str, list[Any]]:
    """The rows of ``tests.integration.helpers.SCHEMA``, some ages outside [18, 90] (clipped on ingestion)."""
    return {
        "age": [float(10 + (i * 7) % 90) for i in range(N)],
        "income": [float(1000 * (i % 50)) for i in range(N)],
        "region": [REGIONS[i % 4] for i in range(N)],
    }


def csv_of(data: dict[str, list[Any]]) -> bytes:
    lines = ["age,income,region"] + [
        f"{a!r},{b!r},{r}" for a, b, r in zip(data["age"], data["income"], data["region"], strict=True)
    ]
    return ("\n".join(lines) + "\n").encode()


def register(
    admin: httpx.Client, source: dict[str, Any], schema: dict[str, Any] | None = None
) -> httpx.Response:
    body = {"name": f"ref-{uuid.uuid4().hex[:6]}", "schema": schema or SCHEMA, "source": source}
    return admin.post("/v1/datasets/register", json=body, timeout=120)


def admin_of(server: LiveServer) -> httpx.Client:
    return server.client(server.create_key(Role.admin)[1])


def dataset_count(admin: httpx.Client) -> int:
    return len(admin.get("/v1/datasets").json())


def exact_count(
    server: LiveServer, admin: httpx.Client, dataset_id: str, where: list[dict[str, Any]]
) -> float:
    """A count at ε = 100 (noise scale 0.01: the true count, rounded) by a new analyst granted the dataset."""
    name, key = server.create_key(Role.analyst)
    assert admin.post(f"/v1/datasets/{dataset_id}/grants", json={"analyst": name}).status_code == 201
    assert admin.put(f"/v1/datasets/{dataset_id}/budget", json=BIG).status_code == 200
    body = {"mechanism": "laplace", "params": {"query": {"kind": "count", "where": where}, "epsilon": 100.0}}
    analyst = httpx.Client(
        base_url=str(admin.base_url), headers={"Authorization": f"Bearer {key}"}, timeout=60
    )
    response = analyst.post(f"/v1/datasets/{dataset_id}/requests", json=body)
    assert response.status_code == 200, response.text
    return float(response.json()["release"]["value"])


class TestParquetByReference:
    def test_a_parquet_file_and_a_folder_give_the_csv_uploads_snapshot(
        self, live_server: LiveServer, tmp_path: Path
    ) -> None:
        admin = admin_of(live_server)
        data = rows()
        table = pa.table(data)
        single = tmp_path / "one.parquet"
        pq.write_table(table, single)
        folder = tmp_path / "parts"
        folder.mkdir()
        pq.write_table(table.slice(0, 100), folder / "a.parquet")
        pq.write_table(table.slice(100), folder / "b.parquet")
        uploaded = upload(admin, csv_of(data))
        assert uploaded.status_code == 201, uploaded.text
        by_file = register(admin, {"kind": "parquet", "path": str(single)})
        by_folder = register(admin, {"kind": "parquet", "path": str(folder)})
        for response in (by_file, by_folder):
            assert response.status_code == 201, response.text
            body = response.json()
            # the same rows, validated and clipped the same way: the same content-addressed snapshot
            assert body["content_sha256"] == uploaded.json()["content_sha256"]
            outside = sum(not 18 <= a <= 90 for a in data["age"])
            assert body["clipped"] == uploaded.json()["clipped"] == {"age": outside, "income": 0, "region": 0}
            assert body["n_rows"] == N
        north = [{"column": "region", "op": "eq", "value": "north"}]
        assert abs(exact_count(live_server, admin, by_file.json()["id"], north) - N / 4) <= 1

    @pytest.mark.parametrize(
        ("source", "field"),
        [
            ({"kind": "parquet", "path": "/nonexistent/expost/data.parquet"}, "source"),
            ({"kind": "parquet", "path": ""}, "source.parquet.path"),
            ({"kind": "postgres", "dsn": "host=127.0.0.1", "table": "t", "query": "select 1"}, "source"),
        ],
    )
    def test_a_bad_source_is_a_422_naming_it_and_stores_nothing(
        self, live_server: LiveServer, source: dict[str, Any], field: str
    ) -> None:
        admin = admin_of(live_server)
        before = dataset_count(admin)
        response = register(admin, source)
        assert response.status_code == 422, response.text
        assert response.headers["content-type"].startswith("application/problem+json")
        assert any(
            error.get("field", "").startswith(field) for error in response.json().get("errors", [])
        ) or (field in response.text)
        assert dataset_count(admin) == before

    def test_a_missing_column_and_a_null_are_named(self, live_server: LiveServer, tmp_path: Path) -> None:
        admin = admin_of(live_server)
        data = rows()
        no_income = tmp_path / "no_income.parquet"
        pq.write_table(pa.table({"age": data["age"], "region": data["region"]}), no_income)
        with_null = tmp_path / "null.parquet"
        ages: list[float | None] = [*data["age"][:-1], None]
        pq.write_table(pa.table({**data, "age": ages}), with_null)
        before = dataset_count(admin)
        missing = register(admin, {"kind": "parquet", "path": str(no_income)})
        assert missing.status_code == 422, missing.text
        assert "income" in missing.text
        null = register(admin, {"kind": "parquet", "path": str(with_null)})
        assert null.status_code == 422, null.text
        assert "age" in null.text
        assert dataset_count(admin) == before

    def test_only_admins_register(self, live_server: LiveServer, tmp_path: Path) -> None:
        path = tmp_path / "t.parquet"
        pq.write_table(pa.table(rows()), path)
        analyst = live_server.client(live_server.create_key(Role.analyst)[1])
        assert register(analyst, {"kind": "parquet", "path": str(path)}).status_code == 403


@pytest.mark.postgres
class TestPostgresByReference:
    def test_a_table_and_a_query_snapshot_and_the_dsn_is_never_echoed(self, live_server: LiveServer) -> None:
        admin = admin_of(live_server)
        source_db = fresh_postgres_database()
        try:
            with psycopg.connect(_libpq(source_db.url), autocommit=True) as conn:
                conn.execute("CREATE SCHEMA sales")
                conn.execute(
                    "CREATE TABLE sales.people (age double precision, income double precision, region text)"
                )
                data = rows()
                with conn.cursor().copy("COPY sales.people (age, income, region) FROM STDIN") as copy:
                    for row in zip(data["age"], data["income"], data["region"], strict=True):
                        copy.write_row(row)
            dsn = _libpq(source_db.url)
            uploaded = upload(admin, csv_of(rows())).json()
            table = register(admin, {"kind": "postgres", "dsn": dsn, "table": "sales.people"})
            query = register(
                admin,
                {"kind": "postgres", "dsn": dsn, "query": "SELECT age, income, region FROM sales.people"},
            )
            for response in (table, query):
                assert response.status_code == 201, response.text
                assert response.json()["content_sha256"] == uploaded["content_sha256"]
                assert dsn not in response.text
            shown = admin.get(f"/v1/datasets/{table.json()['id']}").text + json.dumps(
                admin.get(f"/v1/datasets/{table.json()['id']}/ledger").json()
            )
            assert dsn not in shown
            assert "dbname" not in shown
            secret = "pw-" + uuid.uuid4().hex
            bad = register(
                admin,
                {"kind": "postgres", "dsn": f"host=127.0.0.1 user=nobody password={secret} dbname=none",
                 "table": "sales.people"},
            )  # fmt: skip
            assert bad.status_code == 422, bad.text
            assert secret not in bad.text
            injected = register(
                admin, {"kind": "postgres", "dsn": dsn, "table": "sales.people; DROP TABLE x"}
            )
            assert injected.status_code == 422, injected.text
        finally:
            source_db.drop()


# ----- two real server processes sharing an S3-compatible store --------------------------------------------
@pytest.fixture
def two_servers(
    database_url: str, tmp_path: Path, s3_server: S3Server
) -> Iterator[tuple[LiveServer, str, str, str]]:
    """Two ``expost serve`` processes on one database, each with its own local folder, sharing one S3
    bucket prefix: (a LiveServer handle for keys, base A, base B, the prefix)."""
    prefix = f"p{uuid.uuid4().hex[:10]}"
    store = {
        "executor": "inprocess",
        "storage_url": f"s3://{s3_server.bucket}/{prefix}",
        "s3_endpoint_url": s3_server.endpoint_url,
        "s3_region": s3_server.region,
        "s3_access_key": s3_server.access_key,
        "s3_secret_key": s3_server.secret_key,
    }
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    clusters = [Cluster.create(tmp_path / name, database_url, **store) for name in ("a", "b")]
    try:
        bases = [cluster.api()[1] for cluster in clusters]
        from service.config import Settings

        handle = LiveServer(
            bases[0], Settings.model_validate({"database_url": database_url, "data_dir": tmp_path})
        )
        yield handle, bases[0], bases[1], prefix
    finally:
        for cluster in clusters:
            for proc in cluster.procs:
                proc.stop()


@pytest.mark.slow
class TestSharedObjectStore:
    def test_two_processes_with_separate_folders_answer_the_same_dataset(
        self, two_servers: tuple[LiveServer, str, str, str], tmp_path: Path
    ) -> None:
        handle, base_a, base_b, _prefix = two_servers
        key = handle.create_key(Role.admin)[1]
        on_a = httpx.Client(base_url=base_a, headers={"Authorization": f"Bearer {key}"}, timeout=60)
        on_b = httpx.Client(base_url=base_b, headers={"Authorization": f"Bearer {key}"}, timeout=60)
        created = upload(on_a, csv_of(rows()))
        assert created.status_code == 201, created.text
        dataset_id = created.json()["id"]
        north = [{"column": "region", "op": "eq", "value": "north"}]
        assert abs(exact_count(handle, on_b, dataset_id, north) - N / 4) <= 1  # B reads the shared store
        assert not list((tmp_path / "a" / "data").rglob("*.csv"))  # the upload left no copy behind
        cached = list((tmp_path / "b" / "data" / "cache").rglob("*.parquet"))
        assert len(cached) == 1
        assert created.json()["content_sha256"] in cached[0].name

    def test_a_lost_snapshot_is_a_503_that_charges_nothing(
        self, two_servers: tuple[LiveServer, str, str, str], s3_server: S3Server
    ) -> None:
        import boto3

        handle, base_a, base_b, prefix = two_servers
        key = handle.create_key(Role.admin)[1]
        on_a = httpx.Client(base_url=base_a, headers={"Authorization": f"Bearer {key}"}, timeout=60)
        on_b = httpx.Client(base_url=base_b, headers={"Authorization": f"Bearer {key}"}, timeout=60)
        created = upload(on_a, csv_of(rows()) + f"20.0,{uuid.uuid4().int % 1000}.0,east\n".encode())
        assert created.status_code == 201, created.text
        dataset_id, digest = created.json()["id"], created.json()["content_sha256"]
        assert on_a.put(f"/v1/datasets/{dataset_id}/budget", json=BIG).status_code == 200
        s3 = boto3.client(
            "s3", endpoint_url=s3_server.endpoint_url, aws_access_key_id=s3_server.access_key,
            aws_secret_access_key=s3_server.secret_key, region_name=s3_server.region,
        )  # fmt: skip
        s3.delete_object(Bucket=s3_server.bucket, Key=f"{prefix}/snapshots/{digest}.parquet")
        name, analyst_key = handle.create_key(Role.analyst)
        assert on_a.post(f"/v1/datasets/{dataset_id}/grants", json={"analyst": name}).status_code == 201
        analyst_b = httpx.Client(
            base_url=base_b, headers={"Authorization": f"Bearer {analyst_key}"}, timeout=60
        )
        body = {"mechanism": "laplace", "params": {"query": {"kind": "count"}, "epsilon": 1.0}}
        refused = analyst_b.post(f"/v1/datasets/{dataset_id}/requests", json=body)
        assert refused.status_code == 503, refused.text
        assert refused.headers["content-type"].startswith("application/problem+json")
        budget = on_b.get(f"/v1/datasets/{dataset_id}/budget").json()
        assert budget["epsilon_spent"] == 0, budget
        assert budget["epsilon_remaining"] == pytest.approx(BIG["epsilon"]), budget
        assert not [e for e in on_b.get(f"/v1/datasets/{dataset_id}/ledger").json()["items"]
                    if e["event"] in ("reserve", "commit")]  # fmt: skip

    def test_a_parquet_source_in_the_object_store_is_registered_by_reference(
        self, two_servers: tuple[LiveServer, str, str, str], s3_server: S3Server, tmp_path: Path
    ) -> None:
        import boto3

        handle, base_a, _base_b, prefix = two_servers
        key = handle.create_key(Role.admin)[1]
        on_a = httpx.Client(base_url=base_a, headers={"Authorization": f"Bearer {key}"}, timeout=60)
        local = tmp_path / "lake.parquet"
        pq.write_table(pa.table(rows()), local)
        s3 = boto3.client(
            "s3", endpoint_url=s3_server.endpoint_url, aws_access_key_id=s3_server.access_key,
            aws_secret_access_key=s3_server.secret_key, region_name=s3_server.region,
        )  # fmt: skip
        s3.upload_file(str(local), s3_server.bucket, f"{prefix}-lake/events.parquet")
        registered = register(
            on_a, {"kind": "parquet", "path": f"s3://{s3_server.bucket}/{prefix}-lake/events.parquet"}
        )
        assert registered.status_code == 201, registered.text
        uploaded = upload(on_a, csv_of(rows()))
        assert registered.json()["content_sha256"] == uploaded.json()["content_sha256"]
        missing = register(on_a, {"kind": "parquet", "path": f"s3://{s3_server.bucket}/{prefix}-lake/none/"})
        assert missing.status_code == 422, missing.text


def test_ingestion_reports_its_progress_in_the_log(tmp_path: Path) -> None:
    """A long ingestion logs the rows written so far (at most every ``interval`` seconds)."""
    from structlog.testing import capture_logs

    from mechanisms.data.schema import DatasetSchema
    from service.data.ingest import csv_to_parquet
    from service.datasets import IngestProgress

    source = tmp_path / "people.csv"
    source.write_bytes(csv_of(rows()))
    with capture_logs() as logs:
        csv_to_parquet(
            source, DatasetSchema.model_validate(SCHEMA), tmp_path / "work", IngestProgress("p", 0.0)
        )
    reported = [entry for entry in logs if entry["event"] == "ingesting"]
    assert reported
    assert reported[-1]["rows"] == N
    assert reported[-1]["dataset"] == "p"
