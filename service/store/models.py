"""SQLAlchemy 2 models. The schema is created and changed only by Alembic migrations (migrations/)."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, ClassVar

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, configure_mappers, mapped_column
from sqlalchemy.orm.attributes import manager_of_class
from sqlalchemy.types import TypeDecorator

NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class UTCDateTime(TypeDecorator[datetime]):
    """Timezone-aware UTC timestamps on every backend (SQLite stores them naive)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is not None and value.tzinfo is None:
            raise ValueError("naive datetime")
        return value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        return value.replace(tzinfo=UTC) if value is not None and value.tzinfo is None else value


DATASET_SCOPE = "*"


class RequestState(StrEnum):
    """A request's stored state: ``running`` (queued or claimed, its worst case reserved) until it ends
    ``committed`` (realized charge), ``failed_charged`` (worst case charged) or ``aborted`` (no charge)."""

    RUNNING = "running"
    COMMITTED = "committed"
    FAILED_CHARGED = "failed_charged"
    ABORTED = "aborted"


"""Scope of the dataset-level filter; analyst sub-filters use the analyst's key name."""


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)
    type_annotation_map: ClassVar[dict[Any, Any]] = {dict[str, Any]: JSON, list[Any]: JSON}


class ApiKey(Base):
    __tablename__ = "api_keys"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(100), unique=True)
    role: Mapped[str] = mapped_column(String(20))
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    prefix: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)


class Dataset(Base):
    __tablename__ = "datasets"
    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    schema_json: Mapped[dict[str, Any]] = mapped_column(JSON)
    neighboring: Mapped[str] = mapped_column(String(20))
    n_rows: Mapped[int] = mapped_column(Integer)
    content_sha256: Mapped[str] = mapped_column(String(64))
    file_name: Mapped[str] = mapped_column(String(200))
    orders: Mapped[list[Any]] = mapped_column(JSON)
    clipped: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_by: Mapped[str] = mapped_column(String(100))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    # Archived: no new requests or sessions are admitted; history, budgets and the ledger stay readable.
    archived_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    archived_by: Mapped[str | None] = mapped_column(String(100), nullable=True)


class Grant(Base):
    __tablename__ = "grants"
    __table_args__ = (UniqueConstraint("dataset_id", "analyst"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    dataset_id: Mapped[str] = mapped_column(ForeignKey("datasets.id"))
    analyst: Mapped[str] = mapped_column(String(100))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())


class PrivacyFilter(Base):
    """One ex-post RDP filter: the dataset's (scope "*") or an analyst's sub-filter on that dataset.

    ``capacity`` is per slot (orders, then the pure slot) in units, ``None`` when unusable or unset.
    ``spent``/``reserved`` are ``UnitsVector`` JSON; they are a cache rebuilt by ``expost ledger verify``.
    """

    __tablename__ = "filters"
    __table_args__ = (UniqueConstraint("dataset_id", "scope"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    dataset_id: Mapped[str] = mapped_column(ForeignKey("datasets.id"))
    scope: Mapped[str] = mapped_column(String(100))
    epsilon: Mapped[float | None] = mapped_column(Float, nullable=True)
    delta: Mapped[float | None] = mapped_column(Float, nullable=True)
    capacity: Mapped[list[Any] | None] = mapped_column(JSON, nullable=True)
    spent: Mapped[dict[str, Any]] = mapped_column(JSON)
    reserved: Mapped[dict[str, Any]] = mapped_column(JSON)
    # The δ-ledger of approximate-DP requests (docs/privacy/approximate.md#approximate-dp): δ_A and exact
    # units of 10⁻³⁰ as decimal strings (they exceed 64 bits); ``delta_capacity`` is NULL while no share is
    # set.
    delta_share: Mapped[float | None] = mapped_column(Float, nullable=True)
    delta_capacity: Mapped[str | None] = mapped_column(String(40), nullable=True)
    delta_spent: Mapped[str] = mapped_column(String(40), default="0", server_default="0")
    delta_reserved: Mapped[str] = mapped_column(String(40), default="0", server_default="0")
    last_seq: Mapped[int] = mapped_column(BigInteger, default=0)
    last_hash: Mapped[str] = mapped_column(String(64), default="")
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime())


class LedgerEntry(Base):
    """Append-only, hash-chained per dataset: hash = sha256(prev_hash ‖ body), body = canonical JSON."""

    __tablename__ = "ledger"
    dataset_id: Mapped[str] = mapped_column(ForeignKey("datasets.id"), primary_key=True)
    seq: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    event: Mapped[str] = mapped_column(String(20))
    request_id: Mapped[str | None] = mapped_column(String(40), nullable=True, index=True)
    actor: Mapped[str] = mapped_column(String(100))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    body: Mapped[str] = mapped_column(Text)
    prev_hash: Mapped[str] = mapped_column(String(64))
    hash: Mapped[str] = mapped_column(String(64))


class AnalysisRequest(Base):
    __tablename__ = "requests"
    __table_args__ = (
        UniqueConstraint("analyst", "idempotency_key"),
        Index("ix_requests_state_lease", "state", "lease_expires_at"),
        Index("ix_requests_dataset_analyst", "dataset_id", "analyst"),
        Index("ix_requests_analyst_state", "analyst", "state"),
        Index("ix_requests_analyst_started", "analyst", "started_at"),
    )
    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    kind: Mapped[str] = mapped_column(String(20), default="request", server_default="request")
    dataset_id: Mapped[str] = mapped_column(ForeignKey("datasets.id"))
    analyst: Mapped[str] = mapped_column(String(100))
    mechanism: Mapped[str] = mapped_column(String(50))
    params: Mapped[dict[str, Any]] = mapped_column(JSON)
    fingerprint: Mapped[str] = mapped_column(String(64))
    idempotency_key: Mapped[str | None] = mapped_column(String(200), nullable=True)
    state: Mapped[str] = mapped_column(String(20))
    scopes: Mapped[list[Any]] = mapped_column(JSON)
    worst_case: Mapped[dict[str, Any]] = mapped_column(JSON)
    realized: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    release: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime())
    lease_expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    # Set by the worker that claimed the request (atomic conditional update); NULL while queued.
    lease_owner: Mapped[str | None] = mapped_column(String(64), nullable=True)
    # When the run started (claim, or admission for inline runs); elapsed time is measured from it.
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    # Fraction done of a long-running mechanism, stored only when its progress is public.
    progress: Mapped[float | None] = mapped_column(Float, nullable=True)
    # Who cancelled it (the owner or an admin), when it was cancelled.
    cancelled_by: Mapped[str | None] = mapped_column(String(100), nullable=True)
    # The deployment's queue (EXPOST_QUEUE_NAME) whose workers may claim it; NULL: only claimed by id.
    queue: Mapped[str | None] = mapped_column(String(64), nullable=True)

    @property
    def queued(self) -> bool:
        """Admitted and reserved, waiting for a worker: no worker has claimed it, so no data was read."""
        return self.kind == "request" and self.state == RequestState.RUNNING and self.lease_owner is None


def detached_request(values: Mapping[Any, Any]) -> AnalysisRequest:
    """An ``AnalysisRequest`` holding ``values`` (every column), built as SQLAlchemy builds a loaded
    object: its attributes set at once, without the constructor's per-attribute events (≈ 1 µs instead of
    ≈ 40 µs on the writer's hot path). For objects never added to a session: the writer's batch writes its
    rows with plain statements (``service.runs.admission.RequestBatch``)."""
    if not AnalysisRequest.__mapper__.configured:  # checked here: configure_mappers() itself costs ≈ 2 µs
        configure_mappers()
    request: AnalysisRequest = manager_of_class(AnalysisRequest).new_instance()
    request.__dict__.update(values)
    return request


class AnalystLimit(Base):
    """Per-analyst execution limits set by admins; NULL means the default from the settings."""

    __tablename__ = "analyst_limits"
    analyst: Mapped[str] = mapped_column(String(100), primary_key=True)
    max_running_requests: Mapped[int | None] = mapped_column(Integer, nullable=True)
    max_open_sessions: Mapped[int | None] = mapped_column(Integer, nullable=True)
    updated_by: Mapped[str] = mapped_column(String(100))
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime())


class AnalysisSession(Base):
    """An interactive session. Its reservation and charge live on its ``requests`` row (kind "session");
    this row holds the public transcript. The secret state is in ``secret_states`` only."""

    __tablename__ = "sessions"
    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    request_id: Mapped[str] = mapped_column(ForeignKey("requests.id"), unique=True)
    dataset_id: Mapped[str] = mapped_column(ForeignKey("datasets.id"), index=True)
    analyst: Mapped[str] = mapped_column(String(100))
    mechanism: Mapped[str] = mapped_column(String(50))
    params: Mapped[dict[str, Any]] = mapped_column(JSON)
    state: Mapped[str] = mapped_column(String(20))
    close_reason: Mapped[str | None] = mapped_column(String(20), nullable=True)
    steps: Mapped[list[Any]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime())
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime())


class SecretState(Base):
    """Secret mechanism state (noise paths, noisy thresholds): never serialised into responses or logs."""

    __tablename__ = "secret_states"
    request_id: Mapped[str] = mapped_column(ForeignKey("requests.id"), primary_key=True)
    state: Mapped[bytes] = mapped_column(LargeBinary)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime())


class UnitFilterState(Base):
    """The head of an individually accounted dataset's per-unit filters: ``version`` counts the releases
    that charged units (public; docs/privacy/individual.md#unit-state)."""

    __tablename__ = "unit_filters"
    dataset_id: Mapped[str] = mapped_column(ForeignKey("datasets.id"), primary_key=True)
    version: Mapped[int] = mapped_column(Integer)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime())


class UnitFilterBlock(Base):
    """One block of the per-unit filters: a release's charges, or (``base``) the whole state at that version.
    Secret like ``SecretState``."""

    __tablename__ = "unit_filter_blocks"
    dataset_id: Mapped[str] = mapped_column(ForeignKey("datasets.id"), primary_key=True)
    version: Mapped[int] = mapped_column(Integer, primary_key=True)
    base: Mapped[bool] = mapped_column(Boolean)
    state: Mapped[bytes] = mapped_column(LargeBinary)


class Refusal(Base):
    """A request or session the budget refused (409): only what its public problem body said."""

    __tablename__ = "refusals"
    __table_args__ = (Index("ix_refusals_dataset_id_id", "dataset_id", "id"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    dataset_id: Mapped[str] = mapped_column(ForeignKey("datasets.id"))
    analyst: Mapped[str] = mapped_column(String(100))
    kind: Mapped[str] = mapped_column(String(20))
    mechanism: Mapped[str] = mapped_column(String(50))
    params: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    requested_pure: Mapped[float | None] = mapped_column(Float, nullable=True)
    binding_alpha: Mapped[str | None] = mapped_column(String(20), nullable=True)
    shortfall: Mapped[float | None] = mapped_column(Float, nullable=True)
    filter: Mapped[str] = mapped_column(String(120))
    problem_type: Mapped[str] = mapped_column(String(80))
    detail: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
