"""Datasets: immutable uploads with a public schema, their filters, grants and the loaded-table cache."""

from __future__ import annotations

import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import pyarrow.parquet as pq
import structlog
from pydantic import ValidationError
from sqlalchemy.orm import Session

from mechanisms.accounting import DEFAULT_ORDERS
from mechanisms.base import PublicContext, Table
from mechanisms.catalog import IN_ENGINE, WITH_INDIVIDUAL, WITH_UNITS
from mechanisms.data.plan import ORDER_COLUMN
from mechanisms.data.schema import CategoricalColumn, DatasetSchema
from mechanisms.data.table import TableError, content_hash, load_csv
from service.auth import Principal, Role, validate_name
from service.config import Settings
from service.data.errors import DataError, SourceError
from service.data.ingest import Ingested, csv_to_parquet
from service.data.storage import SnapshotStore
from service.engines.duckdb_engine import DuckDBEngine
from service.engines.table import Engine, ParquetTable
from service.errors import Conflict, InvalidInput, NotFound, PayloadTooLarge, ServiceUnavailable
from service.filter import budget, ledger
from service.filter.ledger import LedgerEvent
from service.store.models import DATASET_SCOPE, Dataset, Grant
from service.store.repositories import DatasetRepository, FilterRepository, KeyRepository


def parse_schema(raw: Any) -> DatasetSchema:
    try:
        schema = DatasetSchema.model_validate(raw)
    except ValidationError as exc:
        raise InvalidInput.from_validation("schema", exc) from None
    for i, column in enumerate(schema.columns):  # PostgreSQL text and jsonb cannot hold a NUL
        values = column.values if isinstance(column, CategoricalColumn) else ()
        named = [("name", column.name), *((f"values.{j}", v) for j, v in enumerate(values))]
        for where, text in named:
            if "\x00" in text:
                raise InvalidInput(f"schema.columns.{i}.{where}", "must not contain a NUL character")
    return schema


def check_name(name: str) -> None:
    if not name.strip() or len(name) > 200:
        raise InvalidInput("name", "must be 1-200 characters")
    if "\x00" in name:  # PostgreSQL text cannot hold it
        raise InvalidInput("name", "must not contain a NUL character")


def ingest(make: Callable[[], Ingested], store: SnapshotStore) -> Ingested:
    """Run one ingestion (CSV, Parquet or PostgreSQL to a local Parquet file; long, outside any database
    transaction) and put its snapshot in the store (content-addressed: a second copy is not uploaded)."""
    try:
        ingested = make()
    except TableError as exc:
        raise InvalidInput(exc.field, exc.reason) from None
    except SourceError as exc:
        raise InvalidInput(exc.field, exc.reason) from None
    try:
        digest = store.put(ingested.path)
    except DataError as exc:
        raise ServiceUnavailable(f"the snapshot store cannot be written now: {exc}") from None
    finally:
        ingested.path.unlink(missing_ok=True)
    if digest != ingested.sha256:
        raise RuntimeError("the stored snapshot does not match its digest")
    return ingested


class IngestProgress:
    """The ``progress`` callback of an ingestion: logs the rows written so far (``expost.datasets``,
    ``ingesting``) at most every ``interval`` seconds, and how long the whole took."""

    def __init__(self, name: str, interval: float = 2.0) -> None:
        self.name, self.interval = name, interval
        self.started = self._last = time.monotonic()

    def __call__(self, rows: int) -> None:
        now = time.monotonic()
        if now - self._last >= self.interval:
            self._last = now
            log.info("ingesting", dataset=self.name, rows=rows, seconds=round(now - self.started, 1))


def upload_csv(source: BinaryIO, limit: int, work_dir: Path) -> Path:
    """Spool an uploaded CSV to a local file in chunks, refusing more than ``limit`` bytes."""
    work_dir.mkdir(parents=True, exist_ok=True)
    target = work_dir / f"{uuid.uuid4().hex}.csv"
    written = 0
    try:
        with open(target, "wb") as out:
            while chunk := source.read(UPLOAD_CHUNK):
                written += len(chunk)
                if written > limit:
                    raise PayloadTooLarge("file", f"larger than the limit of {limit} bytes")
                out.write(chunk)
    except BaseException:
        target.unlink(missing_ok=True)
        raise
    return target


UPLOAD_CHUNK = 1 << 20


def create_dataset(
    session: Session,
    data_dir: Path,
    name: str,
    csv_bytes: bytes,
    schema_raw: Any,
    actor: str,
    store: SnapshotStore | None = None,
) -> Dataset:
    """Validate a small CSV given in memory, store its snapshot (in ``store``, default the local store of
    ``data_dir``) and record the dataset: for the CLI's demo and tests. The HTTP upload streams instead
    (``upload_csv``)."""
    check_name(name)
    schema = parse_schema(schema_raw)
    store = store or default_store(data_dir)
    work = data_dir / "work"
    work.mkdir(parents=True, exist_ok=True)
    source = work / f"{uuid.uuid4().hex}.csv"
    source.write_bytes(csv_bytes)
    try:
        ingested = ingest(lambda: csv_to_parquet(source, schema, work), store)
    finally:
        source.unlink(missing_ok=True)
    return record_dataset(session, name, schema, ingested, actor)


def default_store(data_dir: Path) -> SnapshotStore:
    """The embedded default: snapshots in ``<data_dir>/snapshots``."""
    return SnapshotStore(str((data_dir / "snapshots").resolve()))


def record_dataset(
    session: Session, name: str, schema: DatasetSchema, ingested: Ingested, actor: str
) -> Dataset:
    """Record a stored snapshot as a dataset, create its filter (no budget yet) and the first ledger entry
    (a short transaction: the snapshot was written before, by ``ingest``)."""
    dataset = Dataset(
        id="ds_" + uuid.uuid4().hex[:16],
        name=name,
        schema_json=schema.model_dump(mode="json", exclude_none=True),
        neighboring=schema.neighboring,
        n_rows=ingested.n_rows,
        content_sha256=ingested.sha256,
        file_name=f"{ingested.sha256}{SNAPSHOT_SUFFIX}",
        orders=list(DEFAULT_ORDERS),
        clipped=dict(ingested.clipped),
        created_by=actor,
        created_at=datetime.now(UTC),
    )
    DatasetRepository(session).add(dataset)
    head = budget.new_filter(dataset.id, DATASET_SCOPE, len(DEFAULT_ORDERS) + 1)
    FilterRepository(session).add(head)
    session.flush()
    ledger.append(
        session,
        head,
        LedgerEvent.DATASET,
        actor,
        # Only public facts: the ledger (and its hashes) is readable by viewers, so it must carry no
        # function of the data such as the file's hash or, under add_remove, the row count.
        {"name": name, "orders": dataset.orders, "schema": dataset.schema_json},
    )
    return dataset


GRANT_CACHE_SECONDS = 5.0
"""How long a process trusts a grant it has seen; a grant revoked in another process is still seen that
long by reads. Admission re-reads the grant under the filter locks (``check_admissible``)."""


class _ImmutableCache:
    """A dataset's public facts never change, so rows and contexts are cached once seen (only
    ``archived_at`` changes, and admission reads it from the database). Grants can be revoked, so each is
    trusted for ``GRANT_CACHE_SECONDS``. Ids are random, so one cache serves any database.
    """

    def __init__(self) -> None:
        self.datasets: dict[str, Dataset] = {}
        self.contexts: dict[str, PublicContext] = {}
        self.granted: dict[tuple[str, str], float] = {}  # → monotonic expiry


_cache = _ImmutableCache()


def dataset_by_id(session: Session, dataset_id: str) -> Dataset | None:
    """The dataset row, cached once read (datasets are immutable)."""
    dataset = _cache.datasets.get(dataset_id)
    if dataset is None:
        dataset = DatasetRepository(session).get(dataset_id)
        if dataset is not None:
            session.expunge(dataset)
            _cache.datasets[dataset_id] = dataset
    return dataset


def _grant_seen(dataset_id: str, analyst: str, now: float) -> bool:
    """Whether this process saw the grant less than ``GRANT_CACHE_SECONDS`` ago."""
    return _cache.granted.get((dataset_id, analyst), 0.0) > now


def _is_granted(session: Session, dataset_id: str, analyst: str) -> bool:
    now = time.monotonic()
    if _grant_seen(dataset_id, analyst, now):
        return True
    granted = DatasetRepository(session).is_granted(dataset_id, analyst)
    if granted:
        if len(_cache.granted) > 10_000:
            _cache.granted.clear()
        _cache.granted[(dataset_id, analyst)] = now + GRANT_CACHE_SECONDS
    return granted


def cached_visible_dataset(principal: Principal, dataset_id: str) -> Dataset | None:
    """:func:`visible_dataset` from this process's caches only (no database read): the dataset if it is
    cached and, for an analyst, a grant seen less than ``GRANT_CACHE_SECONDS`` ago; else None (then
    ask :func:`visible_dataset`). Admission re-reads the grant and ``archived_at`` under the locks."""
    dataset = _cache.datasets.get(dataset_id)
    if dataset is None or principal.role is not Role.analyst:
        return dataset
    return dataset if _grant_seen(dataset_id, principal.name, time.monotonic()) else None


def not_visible(principal: Principal, dataset_id: str) -> NotFound:
    """The 404 for a dataset the principal may not see. For an analyst it reads the same whether the dataset
    does not exist or is not granted to them (which one is not revealed)."""
    if principal.role is Role.analyst:
        return NotFound(f"dataset {dataset_id!r} not found or not granted to you")
    return NotFound(f"no dataset {dataset_id!r}")


def visible_dataset(session: Session, principal: Principal, dataset_id: str) -> Dataset:
    """The dataset if this principal may see it; analysts only see datasets they are granted (else 404)."""
    dataset = dataset_by_id(session, dataset_id)
    if dataset is None or (
        principal.role is Role.analyst and not _is_granted(session, dataset_id, principal.name)
    ):
        raise not_visible(principal, dataset_id)
    return dataset


def grant(session: Session, dataset: Dataset, analyst: str, actor: str) -> bool:
    """Grant an analyst key access; creates its tracking sub-filter. Returns False if already granted."""
    validate_name(analyst, "analyst")
    key = KeyRepository(session).by_name(analyst)
    if key is None or key.role != Role.analyst.value:
        raise InvalidInput("analyst", f"no analyst key named {analyst!r}")
    filters = FilterRepository(session)
    head = filters.lock(dataset.id)
    assert head is not None
    datasets = DatasetRepository(session)
    if datasets.is_granted(dataset.id, analyst):
        return False
    datasets.add_grant(Grant(dataset_id=dataset.id, analyst=analyst, created_at=datetime.now(UTC)))
    if filters.get(dataset.id, analyst) is None:  # granted again after a revoke: the sub-filter stays
        filters.add(budget.new_filter(dataset.id, analyst, len(dataset.orders) + 1))
    ledger.append(session, head, LedgerEvent.GRANT, actor, {"analyst": analyst})
    return True


def revoke_grant(session: Session, dataset: Dataset, analyst: str, actor: str) -> bool:
    """Revoke an analyst's grant: they no longer see the dataset and no new request or session of theirs
    is admitted. Their sub-filter (what they spent), their history and the ledger stay; runs already
    admitted finish and settle. Returns False if there was no grant."""
    validate_name(analyst, "analyst")
    head = FilterRepository(session).lock(dataset.id)
    assert head is not None
    if not DatasetRepository(session).delete_grant(dataset.id, analyst):
        return False
    ledger.append(session, head, LedgerEvent.REVOKE, actor, {"analyst": analyst})
    _cache.granted.pop((dataset.id, analyst), None)
    return True


def archive(session: Session, dataset_id: str, actor: str) -> Dataset:
    """Archive a dataset (idempotent): no new requests or sessions are admitted; admitted runs finish,
    and history, budget views and the ledger stay readable. Nothing is deleted."""
    head = FilterRepository(session).lock(dataset_id)  # admissions hold it: none is half-way through
    row = DatasetRepository(session).get(dataset_id)
    if head is None or row is None:
        raise NotFound(f"no dataset {dataset_id!r}")
    if row.archived_at is None:
        row.archived_at, row.archived_by = datetime.now(UTC), actor
    _cache.datasets.pop(dataset_id, None)
    return row


class DatasetArchived(Conflict):
    type_slug = "dataset-archived"
    title = "The dataset is archived"


def check_admissible(session: Session, principal: Principal, dataset_id: str) -> None:
    """Under the dataset's filter lock, before admitting: the dataset is not archived and an analyst is
    still granted, both read from the database now (not from a process cache)."""
    archived_at = DatasetRepository(session).archived_at(dataset_id)
    if archived_at is not None:
        raise DatasetArchived(
            f"dataset {dataset_id} was archived at {archived_at.isoformat()}: it admits no new requests "
            "or sessions (its history, budget and ledger stay readable)"
        )
    analyst = principal.role is Role.analyst
    if analyst and not DatasetRepository(session).is_granted(dataset_id, principal.name):
        _cache.granted.pop((dataset_id, principal.name), None)
        raise not_visible(principal, dataset_id)


def check_individual(context: PublicContext, mechanism: str, kind: str = "request") -> None:
    """Refuse (422, before anything is reserved) a mechanism without an individual analysis on a dataset
    that keeps one filter per unit, and every interactive session there: it would be charged per dataset,
    not per unit."""
    if not context.schema.individual:
        return
    if kind == "session":
        raise InvalidInput(
            "mechanism",
            "interactive sessions have no individual analysis yet: this dataset keeps one privacy filter "
            "per unit; use one-shot requests of: " + ", ".join(sorted(WITH_INDIVIDUAL)),
        )
    if mechanism in WITH_INDIVIDUAL:
        return
    unit = context.schema.privacy_unit
    raise InvalidInput(
        "mechanism",
        f"{mechanism} has no individual analysis yet: this dataset keeps one privacy filter per "
        f"{unit.column if unit else 'unit'!r} and charges each its own loss, which {mechanism} cannot "
        "compute. Mechanisms with individual accounting: " + ", ".join(sorted(WITH_INDIVIDUAL)),
    )


def public_context(dataset: Dataset) -> PublicContext:
    """What mechanisms may know without reading the data (cached: datasets are immutable)."""
    context = _cache.contexts.get(dataset.id)
    if context is None:
        schema = DatasetSchema.model_validate(dataset.schema_json)
        # the row count is public only when neighbours have the same rows count: replace one row (under
        # replace-one-unit a unit's row count may change)
        row_level = schema.privacy_unit is None
        n_rows = dataset.n_rows if dataset.neighboring == "replace_one" and row_level else None
        context = PublicContext(schema=schema, n_rows=n_rows, orders=tuple(dataset.orders))
        _cache.contexts[dataset.id] = context
    return context


log = structlog.get_logger("expost.datasets")

SNAPSHOT_SUFFIX = ".parquet"
"""A dataset's ``file_name`` is ``<sha256>.parquet``: a snapshot in the store. Datasets uploaded before
snapshots existed keep ``<sha256>.csv`` in ``data_dir`` and are read as before."""


class TableCache:
    """Where a request's table comes from (docs/operations.md "Data and engines").

    * A snapshot of at most ``memory_max_rows`` rows is read once into NumPy columns (the reference engine,
      ``mechanisms.data.plan.evaluate_numpy``) and kept, least recently used evicted.
    * A larger snapshot is a ``ParquetTable``: every aggregate runs in the engine (DuckDB or Spark) on the
      file, out of core; a learner's columns are read on demand, refused beyond ``learner_max_rows``.
    * A legacy CSV dataset is parsed as before.

    Keyed by dataset, never by file content: two datasets may share a file but clip it to different
    declared bounds, and each table must be clipped to its own dataset's schema.
    """

    def __init__(
        self,
        data_dir: Path,
        store: SnapshotStore | None = None,
        engine: Engine | None = None,
        memory_max_rows: int = 1_000_000,
        learner_max_rows: int = 20_000_000,
        capacity: int = 16,
    ) -> None:
        self.data_dir = data_dir
        self.store = store or default_store(data_dir)
        self.engine = engine
        self.memory_max_rows, self.learner_max_rows = memory_max_rows, learner_max_rows
        self.capacity = capacity
        self._tables: OrderedDict[str, Table] = OrderedDict()
        self._lock = threading.Lock()

    def close(self) -> None:
        """Forget the tables and close the engine (the process is stopping)."""
        with self._lock:
            self._tables.clear()
        if self.engine is not None:
            self.engine.close()

    def in_memory(self, dataset: Dataset) -> bool:
        """Whether the dataset's table is served from memory: cheap to scan, may run inline."""
        return dataset.file_name.endswith(".csv") or dataset.n_rows <= self.memory_max_rows

    def loaded(self, dataset: Dataset) -> bool:
        """Whether the dataset's table is in this process's memory already."""
        return dataset.id in self._tables

    def check_fits(self, dataset: Dataset, mechanism: str) -> None:
        """Refuse (422, before anything is reserved) a mechanism that holds its columns in memory on a table
        of more than ``learner_max_rows`` rows. The answer is a function of the row count, which is private
        under add/remove and on unit datasets: a size-class channel outside the proofs
        (docs/privacy/engines.md#engine-placement), closed by a limit at or above the largest snapshot."""
        unit = public_context(dataset).schema.privacy_unit
        if unit is not None and mechanism not in WITH_UNITS:
            raise InvalidInput(
                "mechanism",
                f"{mechanism} has no analysis for privacy units yet: this dataset protects each "
                f"{unit.column!r} with all its rows (at most {unit.max_rows} of them used per release), and "
                f"{mechanism} would charge per row. Mechanisms that support privacy units: "
                + ", ".join(sorted(WITH_UNITS)),
            )
        if mechanism not in IN_ENGINE and dataset.n_rows > self.learner_max_rows:
            raise InvalidInput(
                "mechanism",
                f"{mechanism} holds the columns it reads in memory and takes tables of at most "
                f"{self.learner_max_rows} rows (EXPOST_LEARNER_MAX_ROWS); this dataset is larger. Mechanisms "
                "that run in the engine on tables of any size: " + ", ".join(sorted(IN_ENGINE)),
            )

    def check_available(self, dataset: Dataset) -> None:
        """Raise ``StorageUnavailable``/``SnapshotMissing`` (503) unless the snapshot can be read here: run
        before a request is admitted, so a store that is down or a lost snapshot charges nothing."""
        if dataset.file_name.endswith(SNAPSHOT_SUFFIX) and dataset.id not in self._tables:
            try:
                self.store.local_path(dataset.content_sha256)
            except DataError as exc:  # nothing was read or reserved: a 503, charged nothing
                raise ServiceUnavailable(
                    f"the data of dataset {dataset.id} cannot be read now: {exc}"
                ) from None

    def get(self, dataset: Dataset, schema: DatasetSchema) -> Table:
        with self._lock:
            if dataset.id in self._tables:
                self._tables.move_to_end(dataset.id)
                return self._tables[dataset.id]
        table = self._load(dataset, schema)
        if not self.in_memory(dataset):
            return table
        with self._lock:
            self._tables[dataset.id] = table
            while len(self._tables) > self.capacity:
                self._tables.popitem(last=False)
        return table

    def _load(self, dataset: Dataset, schema: DatasetSchema) -> Table:
        if dataset.file_name.endswith(".csv"):
            data = (self.data_dir / dataset.file_name).read_bytes()
            if content_hash(data) != dataset.content_sha256:
                raise RuntimeError(f"stored file of dataset {dataset.id} does not match its hash")
            return load_csv(data, schema).columns
        path = self.store.local_path(dataset.content_sha256)
        if self.in_memory(dataset):
            return read_columns(path, schema)
        if self.engine is None:
            raise RuntimeError("no engine is configured for tables above memory_max_rows")
        return ParquetTable(path, schema, self.engine, self.learner_max_rows)


def read_columns(path: Path, schema: DatasetSchema) -> dict[str, np.ndarray]:
    """A small snapshot's columns in memory, typed as the CSV loader types them (float64, int64, int64
    codes)."""
    names = [*schema.names, *([ORDER_COLUMN] if schema.privacy_unit is not None else [])]
    table = pq.read_table(path, columns=names)
    columns: dict[str, np.ndarray] = {}
    for column in schema.columns:
        values = table.column(column.name).to_numpy()
        columns[column.name] = values.astype(np.float64 if column.type == "float" else np.int64)
    if schema.privacy_unit is not None:
        columns[ORDER_COLUMN] = table.column(ORDER_COLUMN).to_numpy()
    return columns


def snapshot_store(settings: Settings) -> SnapshotStore:
    """The deployment's snapshot store (``EXPOST_STORAGE_URL``; the local default under ``data_dir``)."""
    if not settings.storage_url:
        return default_store(settings.data_dir)
    return SnapshotStore(
        settings.storage_url,
        cache_dir=settings.data_dir / "cache",
        endpoint_url=settings.s3_endpoint_url,
        region=settings.s3_region,
        access_key=settings.s3_access_key,
        secret_key=settings.s3_secret_key,
    )


def build_tables(settings: Settings) -> TableCache:
    """The process's tables: its snapshot store and its engine (created on first use)."""
    engine: Engine
    if settings.engine == "spark":
        from service.engines.spark_engine import (
            SparkEngine,  # pyspark is optional: `pip install expost[spark]`
        )

        engine = SparkEngine(settings.spark_master)
    else:
        engine = DuckDBEngine(
            settings.engine_threads, settings.engine_memory_limit, settings.data_dir / "engine-tmp"
        )
    return TableCache(
        settings.data_dir,
        snapshot_store(settings),
        engine,
        settings.memory_max_rows,
        settings.learner_max_rows,
    )
