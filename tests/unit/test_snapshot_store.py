"""SnapshotStore on a local folder: content addressing, idempotent atomic puts, and its two 503 errors."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from service.data.errors import DataError, SnapshotMissing, SourceError, StorageUnavailable
from service.data.storage import SnapshotStore, snapshot_key


def snapshot_file(folder: Path, content: bytes = b"PAR1 some parquet bytes PAR1") -> Path:
    path = folder / "snapshot.parquet"
    path.write_bytes(content)
    return path


@pytest.mark.parametrize("form", ["path", "uri"])
def test_put_stores_under_the_sha256(tmp_path: Path, form: str) -> None:
    root = tmp_path / "store"
    store = SnapshotStore(str(root) if form == "path" else root.as_uri())
    source = snapshot_file(tmp_path)
    digest = store.put(source)
    assert digest == hashlib.sha256(source.read_bytes()).hexdigest()
    stored = root / "snapshots" / f"{digest}.parquet"
    assert store.local_path(digest) == stored
    assert stored.read_bytes() == source.read_bytes()
    assert store.exists(digest)
    assert store.size(digest) == source.stat().st_size
    assert source.exists(), "put copies; the caller removes its temporary file"
    assert sorted(p.name for p in (root / "snapshots").iterdir()) == [f"{digest}.parquet"], (
        "no temporary left"
    )


def test_put_is_idempotent(tmp_path: Path) -> None:
    store = SnapshotStore(str(tmp_path / "store"))
    source = snapshot_file(tmp_path)
    digest = store.put(source)
    stored = store.local_path(digest)
    before = stored.stat().st_mtime_ns
    os.utime(stored, ns=(before - 10**9, before - 10**9))
    assert store.put(source) == digest
    assert stored.stat().st_mtime_ns == before - 10**9, "an existing snapshot is not written again"


def test_a_truncated_copy_is_replaced(tmp_path: Path) -> None:
    store = SnapshotStore(str(tmp_path / "store"))
    source = snapshot_file(tmp_path)
    digest = store.put(source)
    store.local_path(digest).write_bytes(b"PAR1")
    store.put(source)
    assert store.local_path(digest).read_bytes() == source.read_bytes()


def test_missing_snapshot(tmp_path: Path) -> None:
    store = SnapshotStore(str(tmp_path / "store"))
    digest = "0" * 64
    assert not store.exists(digest)
    with pytest.raises(SnapshotMissing, match=digest):
        store.local_path(digest)
    with pytest.raises(SnapshotMissing):
        store.size(digest)


def test_unavailable_folder(tmp_path: Path) -> None:
    root = tmp_path / "store"
    store = SnapshotStore(str(root))
    (root / "snapshots").rmdir()  # e.g. an unmounted volume
    with pytest.raises(StorageUnavailable):
        store.exists("0" * 64)
    with pytest.raises(StorageUnavailable):
        store.put(snapshot_file(tmp_path))
    blocker = tmp_path / "file-not-folder"
    blocker.write_bytes(b"")
    with pytest.raises(StorageUnavailable):
        SnapshotStore(str(blocker / "store"))


@pytest.mark.parametrize("digest", ["", "abc", "../" + "0" * 61, "0" * 63 + "G", "A" * 64])
def test_digests_are_validated(tmp_path: Path, digest: str) -> None:
    store = SnapshotStore(str(tmp_path / "store"))
    with pytest.raises(ValueError, match="hexadecimal"):
        store.local_path(digest)
    with pytest.raises(ValueError, match="hexadecimal"):
        snapshot_key(digest)


def test_configuration_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cache_dir"):
        SnapshotStore("s3://bucket/prefix")
    with pytest.raises(ValueError, match="scheme"):
        SnapshotStore("gs://bucket/prefix")
    assert repr(SnapshotStore(str(tmp_path))) == f"SnapshotStore({tmp_path.as_uri()!r})"


def test_error_statuses() -> None:
    assert StorageUnavailable.http_status == SnapshotMissing.http_status == 503
    assert SourceError.http_status == 422
    error = SourceError("source", "column 'x' is not in data.parquet")
    assert isinstance(error, DataError)
    assert (error.field, error.reason, str(error)) == (
        "source",
        "column 'x' is not in data.parquet",
        "source: column 'x' is not in data.parquet",
    )
