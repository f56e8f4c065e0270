"""Immutable, content-addressed snapshot storage: a local folder or an S3-compatible object store.

A snapshot is one Parquet file; its id is the SHA-256 (hex) of its bytes and it lives under the key
``snapshots/<sha256>.parquet`` below the store's root (a folder, or ``s3://bucket/prefix``). Guarantees:

* ``put`` is idempotent and never exposes a partial snapshot: a local store writes a temporary file in the
  same folder, fsyncs it and renames it into place (``os.replace``); an object store makes an object visible
  only once its upload has completed. A snapshot already present (with the right size) is not written again.
* ``local_path`` gives a file the engine can read. For a local store it is the stored file itself. For an
  object store it is a read-through cache folder of this machine: a snapshot is downloaded (streamed) to a
  temporary file, its SHA-256 is checked against its id, and it is renamed into place. Snapshots never
  change, so a cached copy never goes stale. Threads of one process download a snapshot once (one lock per
  digest); two processes may both download it, and the atomic rename keeps that safe.
* An unreachable store raises ``StorageUnavailable``; a snapshot that is absent (or whose bytes do not match
  its id) raises ``SnapshotMissing``. Their messages name the operation and the digest, never an endpoint,
  a key or a secret.

The object store is reached through ``pyarrow.fs.S3FileSystem`` (no boto3 at run time); credentials default
to the usual AWS environment variables.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Protocol
from urllib.parse import urlsplit

import pyarrow.fs as pafs

from service.data.errors import SnapshotMissing, StorageUnavailable

SNAPSHOT_FOLDER = "snapshots"
CHUNK_BYTES = 8 << 20
"""Bytes read or written at a time when hashing, copying, uploading or downloading."""

_DIGEST = re.compile(r"[0-9a-f]{64}")


def file_sha256(path: Path) -> str:
    """SHA-256 (hex) of a file, read in ``CHUNK_BYTES`` pieces."""
    digest = hashlib.sha256()
    with path.open("rb") as source:
        while chunk := source.read(CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def snapshot_key(digest: str) -> str:
    """The key of a snapshot below the store's root: ``snapshots/<sha256>.parquet``."""
    if not _DIGEST.fullmatch(digest):
        raise ValueError("a snapshot id is 64 lowercase hexadecimal digits")
    return f"{SNAPSHOT_FOLDER}/{digest}.parquet"


def _fsync_folder(folder: Path) -> None:
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _copy_to(source: BinaryIO, target: Path) -> str:
    """Copy ``source`` into a new file ``target`` (fsynced), returning the SHA-256 of what was copied."""
    digest = hashlib.sha256()
    with target.open("xb") as sink:
        while chunk := source.read(CHUNK_BYTES):
            digest.update(chunk)
            sink.write(chunk)
        sink.flush()
        os.fsync(sink.fileno())
    return digest.hexdigest()


def _temporary(folder: Path, digest: str) -> Path:
    return folder / f".{digest}.{uuid.uuid4().hex}.tmp"


class _Backend(Protocol):
    def size(self, digest: str) -> int | None: ...

    def upload(self, local_file: Path, digest: str) -> None: ...

    def local_path(self, digest: str) -> Path: ...


class _LocalBackend:
    """Snapshots in ``root/snapshots/``; writes are tmp + fsync + rename + fsync of the folder."""

    def __init__(self, root: Path) -> None:
        self.root = root.resolve()
        try:
            (self.root / SNAPSHOT_FOLDER).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StorageUnavailable(f"the snapshot folder cannot be created ({exc.strerror})") from None

    def _file(self, digest: str) -> Path:
        return self.root / snapshot_key(digest)

    def _folder(self) -> Path:
        folder = self.root / SNAPSHOT_FOLDER
        if not folder.is_dir():
            raise StorageUnavailable("the snapshot folder is not available")
        return folder

    def size(self, digest: str) -> int | None:
        self._folder()
        try:
            return self._file(digest).stat().st_size
        except FileNotFoundError:
            return None

    def upload(self, local_file: Path, digest: str) -> None:
        folder = self._folder()
        temporary = _temporary(folder, digest)
        try:
            with local_file.open("rb") as source:
                copied = _copy_to(source, temporary)
            if copied != digest:
                raise ValueError(f"{local_file.name} changed while it was being stored")
            os.replace(temporary, self._file(digest))
            _fsync_folder(folder)
        except OSError as exc:
            raise StorageUnavailable(f"snapshot {digest} cannot be written ({exc.strerror})") from None
        finally:
            temporary.unlink(missing_ok=True)

    def local_path(self, digest: str) -> Path:
        if self.size(digest) is None:
            raise SnapshotMissing(f"snapshot {digest} is not in the store")
        return self._file(digest)


def _s3_failure(exc: OSError) -> str:
    """What went wrong, in a few words taken from pyarrow's message (which names the endpoint: not shown)."""
    text = str(exc).upper()
    kinds = (
        (("NETWORK_CONNECTION", "COULDN'T CONNECT", "CURLCODE: 7"), "connection failed"),
        (("TIMEOUT", "TIMED OUT", "CURLCODE: 28"), "timed out"),
        (("ACCESS_DENIED", "ACCESSDENIED", "FORBIDDEN", "INVALIDACCESSKEYID", "SIGNATURE"), "access denied"),
        (("NO_SUCH_BUCKET", "NOSUCHBUCKET", "BUCKET DOES NOT EXIST"), "bucket not found"),
    )
    return next((kind for words, kind in kinds if any(w in text for w in words)), "request failed")


@contextmanager
def _s3_errors(operation: str, digest: str) -> Iterator[None]:
    """Map pyarrow's S3 errors: a missing object → SnapshotMissing; anything else → StorageUnavailable."""
    try:
        yield
    except FileNotFoundError:
        raise SnapshotMissing(f"snapshot {digest} is not in the store") from None
    except OSError as exc:
        reason = _s3_failure(exc)
        raise StorageUnavailable(
            f"the object store is unavailable ({operation} {digest}: {reason})"
        ) from None


class _S3Backend:
    """Snapshots under ``bucket/prefix/snapshots/``, with a local read-through cache folder."""

    def __init__(self, filesystem: pafs.S3FileSystem, root: str, cache_dir: Path) -> None:
        self.filesystem = filesystem
        self.root = root
        self.cache_dir = cache_dir
        self._locks: dict[str, threading.Lock] = {}
        self._locks_guard = threading.Lock()

    def _object(self, digest: str) -> str:
        return f"{self.root}/{snapshot_key(digest)}"

    def size(self, digest: str) -> int | None:
        with _s3_errors("looking up", digest):
            info = self.filesystem.get_file_info(self._object(digest))
        return None if info.type == pafs.FileType.NotFound else int(info.size)

    def upload(self, local_file: Path, digest: str) -> None:
        with _s3_errors("uploading", digest):
            pafs.copy_files(
                str(local_file.resolve()),
                self._object(digest),
                source_filesystem=pafs.LocalFileSystem(),
                destination_filesystem=self.filesystem,
                chunk_size=CHUNK_BYTES,
            )
        if self.size(digest) != local_file.stat().st_size:
            raise StorageUnavailable(f"the object store is unavailable (uploading {digest}: size mismatch)")

    def _lock(self, digest: str) -> threading.Lock:
        with self._locks_guard:
            return self._locks.setdefault(digest, threading.Lock())

    def local_path(self, digest: str) -> Path:
        cached = self.cache_dir / f"{digest}.parquet"
        if cached.is_file():
            return cached
        with self._lock(digest):
            if not cached.is_file():
                self._download(digest, cached)
        return cached

    def _download(self, digest: str, cached: Path) -> None:
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        temporary = _temporary(self.cache_dir, digest)
        try:
            with (
                _s3_errors("downloading", digest),
                self.filesystem.open_input_stream(self._object(digest)) as src,
            ):
                copied = _copy_to(src, temporary)
            if copied != digest:
                raise SnapshotMissing(f"snapshot {digest} in the store is corrupt (its SHA-256 differs)")
            os.replace(temporary, cached)
        finally:
            temporary.unlink(missing_ok=True)


def _s3_filesystem(
    endpoint_url: str | None,
    region: str | None,
    access_key: str | None,
    secret_key: str | None,
    timeouts: tuple[float, float],
) -> pafs.S3FileSystem:
    env = os.environ.get
    endpoint = endpoint_url or env("AWS_ENDPOINT_URL_S3") or env("AWS_ENDPOINT_URL")
    options: dict[str, object] = {
        "region": region or env("AWS_REGION") or env("AWS_DEFAULT_REGION") or "us-east-1",
        "connect_timeout": timeouts[0],
        "request_timeout": timeouts[1],
        "retry_strategy": pafs.AwsStandardS3RetryStrategy(max_attempts=3),
    }
    access_key = access_key or env("AWS_ACCESS_KEY_ID")
    secret_key = secret_key or env("AWS_SECRET_ACCESS_KEY")
    if access_key and secret_key:
        options.update(access_key=access_key, secret_key=secret_key, session_token=env("AWS_SESSION_TOKEN"))
    if endpoint:
        options.update(endpoint_override=endpoint, scheme=urlsplit(endpoint).scheme or "https")
    return pafs.S3FileSystem(**options)


class SnapshotStore:
    """Where snapshots live. ``url``: ``file:///abs/path``, a plain folder path, or ``s3://bucket/prefix``.

    For ``s3://`` give ``cache_dir`` (e.g. ``<data_dir>/cache``); ``endpoint_url`` (an S3-compatible
    server, ``http://`` or ``https://``), ``region``, ``access_key`` and ``secret_key`` default to
    ``AWS_ENDPOINT_URL``, ``AWS_REGION``/``AWS_DEFAULT_REGION``, ``AWS_ACCESS_KEY_ID`` and
    ``AWS_SECRET_ACCESS_KEY``.
    """

    def __init__(
        self,
        url: str,
        *,
        cache_dir: Path | None = None,
        endpoint_url: str | None = None,
        region: str | None = None,
        access_key: str | None = None,
        secret_key: str | None = None,
        connect_timeout: float = 5.0,
        request_timeout: float = 30.0,
    ) -> None:
        parts = urlsplit(url)
        self._backend: _Backend
        if parts.scheme == "s3":
            if cache_dir is None:
                raise ValueError("an s3:// snapshot store needs a local cache_dir")
            if not parts.netloc:
                raise ValueError("an s3:// snapshot store URL names a bucket: s3://bucket/prefix")
            root = "/".join(p for p in (parts.netloc, parts.path.strip("/")) if p)
            timeouts = (connect_timeout, request_timeout)
            filesystem = _s3_filesystem(endpoint_url, region, access_key, secret_key, timeouts)
            self._backend = _S3Backend(filesystem, root, cache_dir)
            self.url = f"s3://{root}"
        elif parts.scheme in ("file", ""):
            folder = Path(parts.path if parts.scheme == "file" else url)
            self._backend = _LocalBackend(folder)
            self.url = folder.resolve().as_uri()
        else:
            raise ValueError(f"unsupported snapshot store scheme {parts.scheme!r}: use file:// or s3://")

    def __repr__(self) -> str:
        return f"SnapshotStore({self.url!r})"

    def put(self, local_file: Path) -> str:
        """Store ``local_file`` (unless already stored) and return its SHA-256, the snapshot's id."""
        digest = file_sha256(local_file)
        if self._backend.size(digest) != local_file.stat().st_size:
            self._backend.upload(local_file, digest)
        return digest

    def exists(self, digest: str) -> bool:
        snapshot_key(digest)
        return self._backend.size(digest) is not None

    def size(self, digest: str) -> int:
        """The snapshot's size in bytes; ``SnapshotMissing`` when it is not stored."""
        snapshot_key(digest)
        size = self._backend.size(digest)
        if size is None:
            raise SnapshotMissing(f"snapshot {digest} is not in the store")
        return size

    def local_path(self, digest: str) -> Path:
        """A local file holding the snapshot (the stored file, or a verified cached copy)."""
        snapshot_key(digest)
        return self._backend.local_path(digest)


def s3_filesystem(
    endpoint_url: str | None = None,
    region: str | None = None,
    access_key: str | None = None,
    secret_key: str | None = None,
) -> pafs.S3FileSystem:
    """An S3 filesystem with the store's conventions (the ``AWS_*`` variables as defaults, bounded
    timeouts): for reading a Parquet source registered as ``s3://…``."""
    return _s3_filesystem(endpoint_url, region, access_key, secret_key, (5.0, 30.0))
