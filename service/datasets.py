"""Datasets: immutable uploads with a public schema, their filters, grants and the loaded-table cache."""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections import OrderedDict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import ValidationError
from sqlalchemy.orm import Session

from mechanisms.accounting import DEFAULT_ORDERS
from mechanisms.base import PublicContext
from mechanisms.data.schema import CategoricalColumn, DatasetSchema
from mechanisms.data.table import TableError, content_hash, load_csv
from service.auth import Principal, Role, validate_name
from service.errors import Conflict, InvalidInput, NotFound
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


def create_dataset(
    session: Session, data_dir: Path, name: str, csv_bytes: bytes, schema_raw: Any, actor: str
) -> Dataset:
    """Validate and store an upload, create its filter (no budget yet) and the first ledger entry."""
    if not name.strip() or len(name) > 200:
        raise InvalidInput("name", "must be 1-200 characters")
    if "\x00" in name:  # PostgreSQL text cannot hold it
        raise InvalidInput("name", "must not contain a NUL character")
    schema = parse_schema(schema_raw)
    try:
        loaded = load_csv(csv_bytes, schema)
    except TableError as exc:
        raise InvalidInput(exc.field, exc.reason) from None
    digest = content_hash(csv_bytes)
    file_name = f"{digest}.csv"
    _store(data_dir / file_name, csv_bytes)
    dataset = Dataset(
        id="ds_" + uuid.uuid4().hex[:16],
        name=name,
        schema_json=schema.model_dump(mode="json"),
        neighboring=schema.neighboring,
        n_rows=loaded.n_rows,
        content_sha256=digest,
        file_name=file_name,
        orders=list(DEFAULT_ORDERS),
        clipped=dict(loaded.clipped),
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


def _store(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        return
    tmp = path.with_suffix(f".{uuid.uuid4().hex}.tmp")
    with open(tmp, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


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


def public_context(dataset: Dataset) -> PublicContext:
    """What mechanisms may know without reading the data (cached: datasets are immutable)."""
    context = _cache.contexts.get(dataset.id)
    if context is None:
        schema = DatasetSchema.model_validate(dataset.schema_json)
        n_rows = dataset.n_rows if dataset.neighboring == "replace_one" else None
        context = PublicContext(schema=schema, n_rows=n_rows, orders=tuple(dataset.orders))
        _cache.contexts[dataset.id] = context
    return context


class TableCache:
    """Loaded tables by dataset id, least recently used evicted.

    Keyed by dataset, never by file content: two datasets may share a CSV but clip it to different
    declared bounds, and each table must be clipped to its own dataset's schema.
    """

    def __init__(self, data_dir: Path, capacity: int = 16) -> None:
        self.data_dir = data_dir
        self.capacity = capacity
        self._tables: OrderedDict[str, dict[str, np.ndarray]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, dataset: Dataset, schema: DatasetSchema) -> dict[str, np.ndarray]:
        with self._lock:
            if dataset.id in self._tables:
                self._tables.move_to_end(dataset.id)
                return self._tables[dataset.id]
        data = (self.data_dir / dataset.file_name).read_bytes()
        if content_hash(data) != dataset.content_sha256:
            raise RuntimeError(f"stored file of dataset {dataset.id} does not match its hash")
        columns = load_csv(data, schema).columns
        with self._lock:
            self._tables[dataset.id] = columns
            while len(self._tables) > self.capacity:
                self._tables.popitem(last=False)
        return columns
