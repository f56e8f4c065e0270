"""The errors of the data layer: plain exceptions, each with the HTTP status the service maps it to.

* ``StorageUnavailable`` (503): the snapshot store cannot be reached (connection refused, timeout, access
  denied, missing bucket). Nothing was read, so a request that meets it must not be charged.
* ``SnapshotMissing`` (503): the store answers but a snapshot is gone or does not match its digest. The
  data is not there, so the request must not be charged either.
* ``SourceError`` (422): a dataset source given by reference (a Parquet file or folder, a PostgreSQL table
  or query) is missing, unreadable or does not match the schema. ``field`` names the request field to fix.

Messages never contain credentials, connection strings or signed URLs: the code raising them builds the
message from parts it knows are safe (column names, row numbers, digests, scrubbed driver messages).
"""

from __future__ import annotations


class DataError(Exception):
    """Base class of the data layer's errors; ``http_status`` is what the service answers with."""

    http_status: int = 500


class StorageUnavailable(DataError):
    """The snapshot store cannot be reached; retry later."""

    http_status = 503


class SnapshotMissing(DataError):
    """A snapshot is not in the store (deleted, or corrupt: its bytes do not match its digest)."""

    http_status = 503


class SourceError(DataError):
    """A bad dataset source: ``field`` is the request field at fault, ``reason`` says what is wrong."""

    http_status = 422

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason
