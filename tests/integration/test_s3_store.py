"""SnapshotStore on a real S3-compatible server (moto, in this process, no network): uploads, read-through
caches that verify what they download, and the two 503 errors (server down, snapshot gone or corrupt).

Two stores with separate local cache folders share one bucket, as two API processes on two machines do.
Each test works under its own key prefix of the session's bucket.
"""

from __future__ import annotations

import hashlib
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
from moto.server import ThreadedMotoServer

from mechanisms.data.schema import DatasetSchema
from service.data import storage
from service.data.errors import SnapshotMissing, SourceError, StorageUnavailable
from service.data.ingest import parquet_to_snapshot
from service.data.storage import SnapshotStore
from tests.conftest import S3Server


@pytest.fixture
def prefix() -> str:
    return f"t-{uuid.uuid4().hex[:12]}"


def make_store(s3: S3Server, url: str, cache: Path, **overrides: Any) -> SnapshotStore:
    options: dict[str, Any] = {
        "cache_dir": cache,
        "endpoint_url": s3.endpoint_url,
        "region": s3.region,
        "access_key": s3.access_key,
        "secret_key": s3.secret_key,
        **overrides,
    }
    return SnapshotStore(url, **options)


def client(s3: S3Server) -> Any:
    return boto3.client(
        "s3",
        endpoint_url=s3.endpoint_url,
        aws_access_key_id=s3.access_key,
        aws_secret_access_key=s3.secret_key,
        region_name=s3.region,
    )


@pytest.fixture
def snapshot(tmp_path: Path) -> Path:
    path = tmp_path / "upload" / "snapshot.parquet"
    path.parent.mkdir()
    pq.write_table(pa.table({"x": list(range(50_000))}), path)
    return path


def test_two_stores_share_a_bucket_with_their_own_caches(
    s3_server: S3Server, prefix: str, tmp_path: Path, snapshot: Path
) -> None:
    url = f"s3://{s3_server.bucket}/{prefix}"
    writer = make_store(s3_server, url, tmp_path / "cache-a")
    reader = make_store(s3_server, url, tmp_path / "cache-b")
    digest = writer.put(snapshot)
    assert digest == hashlib.sha256(snapshot.read_bytes()).hexdigest()
    stored = client(s3_server).get_object(Bucket=s3_server.bucket, Key=f"{prefix}/snapshots/{digest}.parquet")
    assert stored["Body"].read() == snapshot.read_bytes()
    assert reader.exists(digest)
    assert reader.size(digest) == snapshot.stat().st_size
    local = reader.local_path(digest)
    assert local == tmp_path / "cache-b" / f"{digest}.parquet"
    assert local.read_bytes() == snapshot.read_bytes()
    assert pq.read_table(local).num_rows == 50_000
    assert writer.local_path(digest).parent == tmp_path / "cache-a"
    assert sorted(p.name for p in (tmp_path / "cache-b").iterdir()) == [f"{digest}.parquet"], (
        "no temporary left"
    )


def test_put_is_idempotent(s3_server: S3Server, prefix: str, tmp_path: Path, snapshot: Path) -> None:
    store = make_store(s3_server, f"s3://{s3_server.bucket}/{prefix}", tmp_path / "cache")
    digest = store.put(snapshot)
    key = f"{prefix}/snapshots/{digest}.parquet"
    first = client(s3_server).head_object(Bucket=s3_server.bucket, Key=key)
    assert store.put(snapshot) == digest
    again = client(s3_server).head_object(Bucket=s3_server.bucket, Key=key)
    assert again["LastModified"] == first["LastModified"]
    assert again["ETag"] == first["ETag"]


def test_credentials_default_to_the_environment(
    s3_server: S3Server, prefix: str, tmp_path: Path, snapshot: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret_key)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint_url)
    monkeypatch.setenv("AWS_REGION", s3_server.region)
    store = SnapshotStore(f"s3://{s3_server.bucket}/{prefix}", cache_dir=tmp_path / "cache")
    digest = store.put(snapshot)
    assert store.local_path(digest).read_bytes() == snapshot.read_bytes()


def test_concurrent_readers_download_once(
    s3_server: S3Server, prefix: str, tmp_path: Path, snapshot: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"s3://{s3_server.bucket}/{prefix}"
    digest = make_store(s3_server, url, tmp_path / "cache-a").put(snapshot)
    reader = make_store(s3_server, url, tmp_path / "cache-b")
    downloads: list[str] = []
    original = storage._S3Backend._download

    def counted(self: Any, digest: str, cached: Path) -> None:
        downloads.append(digest)
        original(self, digest, cached)

    monkeypatch.setattr(storage._S3Backend, "_download", counted)
    start = threading.Barrier(8)
    paths: list[Path] = []

    def read() -> None:
        start.wait()
        paths.append(reader.local_path(digest))

    threads = [threading.Thread(target=read) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert downloads == [digest]
    assert len(set(paths)) == 1
    assert len(paths) == 8


def test_deleted_snapshot_is_missing(
    s3_server: S3Server, prefix: str, tmp_path: Path, snapshot: Path
) -> None:
    url = f"s3://{s3_server.bucket}/{prefix}"
    digest = make_store(s3_server, url, tmp_path / "cache-a").put(snapshot)
    client(s3_server).delete_object(Bucket=s3_server.bucket, Key=f"{prefix}/snapshots/{digest}.parquet")
    reader = make_store(s3_server, url, tmp_path / "cache-b")
    assert not reader.exists(digest)
    with pytest.raises(SnapshotMissing, match=digest):
        reader.local_path(digest)
    with pytest.raises(SnapshotMissing):
        reader.size(digest)
    assert not list((tmp_path / "cache-b").glob("*")), "nothing is cached"


def test_corrupt_snapshot_is_refused(
    s3_server: S3Server, prefix: str, tmp_path: Path, snapshot: Path
) -> None:
    url = f"s3://{s3_server.bucket}/{prefix}"
    digest = make_store(s3_server, url, tmp_path / "cache-a").put(snapshot)
    key = f"{prefix}/snapshots/{digest}.parquet"
    client(s3_server).put_object(Bucket=s3_server.bucket, Key=key, Body=snapshot.read_bytes()[:-1] + b"!")
    reader = make_store(s3_server, url, tmp_path / "cache-b")
    with pytest.raises(SnapshotMissing, match="corrupt"):
        reader.local_path(digest)
    assert not list((tmp_path / "cache-b").glob("*")), "the bad download is not kept"


def test_missing_bucket_is_unavailable(s3_server: S3Server, tmp_path: Path, snapshot: Path) -> None:
    store = make_store(s3_server, "s3://no-such-bucket/x", tmp_path / "cache")
    with pytest.raises(StorageUnavailable) as caught:
        store.put(snapshot)
    assert s3_server.secret_key not in str(caught.value)
    assert s3_server.endpoint_url not in str(caught.value)


@dataclass
class OwnServer:
    """A moto server of one test alone, which the test may stop."""

    s3: S3Server
    server: ThreadedMotoServer

    def stop(self) -> None:
        self.server.stop()
        listening = getattr(self.server, "_server", None)  # moto leaves the socket open: close it
        if listening is not None:
            listening.server_close()


@pytest.fixture
def own_server() -> Iterator[OwnServer]:
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    s3 = S3Server(f"http://{host}:{port}", "own-bucket", "own-key", "own-secret-value", "us-east-1")
    client(s3).create_bucket(Bucket=s3.bucket)
    own = OwnServer(s3, server)
    yield own
    own.stop()


def test_stopped_server_is_unavailable(own_server: OwnServer, tmp_path: Path, snapshot: Path) -> None:
    s3 = own_server.s3
    url = f"s3://{s3.bucket}/p"
    store = make_store(s3, url, tmp_path / "cache-a", connect_timeout=1, request_timeout=2)
    digest = store.put(snapshot)
    reader = make_store(s3, url, tmp_path / "cache-b", connect_timeout=1, request_timeout=2)
    own_server.stop()
    calls = (lambda: reader.local_path(digest), lambda: reader.exists(digest), lambda: store.put(snapshot))
    for call in calls:
        with pytest.raises(StorageUnavailable, match="object store is unavailable") as caught:
            call()
        message = str(caught.value)
        assert s3.secret_key not in message
        assert s3.access_key not in message
        assert s3.endpoint_url not in message
    assert not (tmp_path / "cache-b").exists() or not list((tmp_path / "cache-b").glob("*"))


def test_parquet_source_on_s3(s3_server: S3Server, prefix: str, tmp_path: Path) -> None:
    filesystem = pafs.S3FileSystem(
        access_key=s3_server.access_key,
        secret_key=s3_server.secret_key,
        endpoint_override=s3_server.endpoint_url,
        scheme="http",
        region=s3_server.region,
    )
    for index in range(3):
        table = pa.table({"x": [float(index), 99.0], "g": ["a", "b"]})
        pq.write_table(table, f"{s3_server.bucket}/{prefix}/lake/part-{index}.parquet", filesystem=filesystem)
    schema = DatasetSchema.model_validate(
        {
            "columns": [
                {"name": "x", "type": "float", "min": 0, "max": 10},
                {"name": "g", "type": "categorical", "values": ["a", "b"]},
            ],
            "neighboring": "add_remove",
        }
    )
    result = parquet_to_snapshot(
        f"s3://{s3_server.bucket}/{prefix}/lake", schema, tmp_path, filesystem=filesystem
    )
    assert result.n_rows == 6
    assert result.clipped == {"x": 3, "g": 0}
    assert pq.read_table(result.path).column("x").to_pylist() == [0.0, 10.0, 1.0, 10.0, 2.0, 10.0]
    with pytest.raises(SourceError, match="does not exist"):
        parquet_to_snapshot(
            f"s3://{s3_server.bucket}/{prefix}/nothing", schema, tmp_path, filesystem=filesystem
        )
