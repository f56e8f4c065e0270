"""Datasets as immutable, content-addressed Parquet snapshots: making them (``ingest``) and keeping them
(``storage``). Nothing here imports the API, the runs, the filter or the database layers."""

from service.data.errors import DataError, SnapshotMissing, SourceError, StorageUnavailable
from service.data.ingest import (
    ROW_GROUP_ROWS,
    Ingested,
    csv_to_parquet,
    encode_batch,
    parquet_to_snapshot,
    postgres_to_snapshot,
    snapshot_schema,
)
from service.data.storage import SnapshotStore, file_sha256, snapshot_key

__all__ = [
    "ROW_GROUP_ROWS",
    "DataError",
    "Ingested",
    "SnapshotMissing",
    "SnapshotStore",
    "SourceError",
    "StorageUnavailable",
    "csv_to_parquet",
    "encode_batch",
    "file_sha256",
    "parquet_to_snapshot",
    "postgres_to_snapshot",
    "snapshot_key",
    "snapshot_schema",
]
