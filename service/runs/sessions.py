"""Interactive sessions (docs/privacy/rules.md#rule-sessions-interleave,
docs/privacy/noise_reduction.md#noise-reduction-sessions): open → queries → close, each transition one
transaction.

* **Open** reserves the session's worst case exactly like a request (its ``requests`` row, kind
  "session") and draws the secret state with ``start`` (no data is read), in one transaction.
* **Each query** locks the dataset's filters and the session row, so concurrent queries to one session
  are serialized; it reads the secret state, runs one ``step`` on the data with fresh noise, appends the
  public (query, answer) to the transcript and stores the new secret state.
* **Close** (halt, ``max_queries``, explicit by the analyst or an admin, expiry, the key's revocation, or
  a failure) commits the realized charge of the public transcript (``realized``), or the worst case if the
  mechanism failed after reading the data, and deletes the secret state. The secret state never leaves the
  ``secret_states`` table.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

import structlog
from pydantic import BaseModel, ValidationError
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from mechanisms.base import InteractiveMechanism, ParamsError, PublicContext
from mechanisms.catalog import INTERACTIVE
from mechanisms.noise import Noise
from service import auth, metrics
from service.auth import Principal, Role, validate_name
from service.datasets import dataset_by_id, public_context, visible_dataset
from service.errors import (
    Conflict,
    IdempotencyKeyReused,
    InvalidInput,
    MechanismFailed,
    NoBudget,
    NotFound,
)
from service.filter.batch import FilterRow, Refused
from service.logs import failure_fields
from service.runs.admission import (
    BatchReads,
    RequestBatch,
    Validated,
    admission_reads,
    admit_batched,
    filters_of,
    refusal,
    transact,
    validated_for,
)
from service.runs.requests import HistoryPage, HistoryQuery, history_owner, history_page
from service.runs.runtime import Runtime
from service.runs.settlement import settle_batched
from service.store.models import AnalysisRequest, AnalysisSession, ApiKey, SecretState
from service.store.repositories import FilterRepository, RequestRepository, SessionRepository
from service.store.repositories.base import HistoryFilter

log = structlog.get_logger("expost.sessions")

T = TypeVar("T")


class SessionClosed(Conflict):
    type_slug = "session-closed"
    title = "The session is closed"


def _mechanism(name: str) -> InteractiveMechanism[Any, Any]:
    mechanism = INTERACTIVE.get(name)
    if mechanism is None:
        raise InvalidInput("mechanism", f"unknown interactive mechanism {name!r}; see GET /v1/mechanisms")
    return mechanism


def validate_open(session: Session, principal: Principal, dataset_id: str, name: str, raw: Any) -> Validated:
    return validated_for(
        visible_dataset(session, principal, dataset_id), _mechanism(name), raw, kind="session"
    )


def open_session(
    sessions: sessionmaker[Session], principal: Principal, v: Validated, key: str | None, ttl: float
) -> AnalysisSession:
    """Reserve the worst case and draw the secret state, in one transaction."""
    mechanism = v.mechanism
    assert isinstance(mechanism, InteractiveMechanism)

    def apply(batch: RequestBatch) -> AnalysisSession:
        filters = filters_of(batch, v.dataset.id, principal.name)
        request, created = admit_batched(batch, filters, principal, v, key, ttl)
        outcome = "admitted" if created else "replayed"
        metrics.after_commit(batch.session, lambda: metrics.REQUESTS.labels(mechanism.name, outcome).inc())
        repository = SessionRepository(batch.session)
        if not created:
            existing = repository.by_request(request.id)
            if existing is None:
                raise IdempotencyKeyReused("this Idempotency-Key was used for a request, not a session")
            return existing
        noise = Noise.system()
        state = mechanism.start(v.params, v.context, noise)
        now = datetime.now(UTC)
        row = AnalysisSession(
            id="ss_" + uuid.uuid4().hex[:20],
            request_id=request.id,
            dataset_id=v.dataset.id,
            analyst=principal.name,
            mechanism=mechanism.name,
            params=request.params,
            state="open",
            close_reason=None,
            steps=[],
            created_at=now,
            updated_at=now,
            expires_at=now + timedelta(seconds=ttl),
        )
        batch.write()  # the request row, before the rows that refer to it
        repository.add(row)
        batch.session.flush()
        repository.add_secret(SecretState(request_id=request.id, state=_encode(state), updated_at=now))
        return row

    try:
        with sessions() as session:
            return transact(session, admission_reads(principal, v, key), apply)
    except Refused as refused:
        problem = refusal(v, refused)
        metrics.REQUESTS.labels(v.mechanism.name, "refused").inc()
        metrics.refused(problem, "session")
        raise problem from None
    except NoBudget as exc:
        metrics.REQUESTS.labels(v.mechanism.name, "refused").inc()
        metrics.refused(exc, "session")
        raise
    except IntegrityError:
        return _replayed_open(sessions, principal, v, key)


def _replayed_open(
    sessions: sessionmaker[Session], principal: Principal, v: Validated, key: str | None
) -> AnalysisSession:
    """A concurrent open with the same Idempotency-Key (on another dataset) won the race."""
    with sessions() as session:
        request = RequestRepository(session).by_idempotency_key(principal.name, key or "")
        row = None if request is None else SessionRepository(session).by_request(request.id)
        same = request is not None and request.fingerprint == v.fingerprint
        if row is None or not same:
            raise IdempotencyKeyReused("this Idempotency-Key was used for a different request") from None
        return row


def _encode(state: dict[str, Any]) -> bytes:
    return json.dumps(state, sort_keys=True).encode()


def visible_session(session: Session, principal: Principal, session_id: str) -> AnalysisSession:
    row = SessionRepository(session).get(session_id)
    if row is None or (principal.role is not Role.admin and row.analyst != principal.name):
        raise NotFound(f"no session {session_id!r}")
    return row


def history(
    session: Session, principal: Principal, query: HistoryQuery
) -> HistoryPage[tuple[AnalysisSession, AnalysisRequest]]:
    """The caller's sessions (admins: everyone's, or ``analyst``'s) with their reservation's request row,
    newest first, optionally of one dataset or in one state; ``after`` is the id of the previous page's
    last item. The same role rules as the requests' history."""
    owner = history_owner(principal, query.analyst)
    repository = SessionRepository(session)
    before = None
    if query.after is not None:
        cursor = repository.get(query.after)
        if cursor is None or (principal.role is not Role.admin and cursor.analyst != principal.name):
            raise InvalidInput("query.after", f"no session {query.after!r} in this listing to continue after")
        before = (cursor.created_at, cursor.id)
    rows = repository.history(HistoryFilter(owner, query.dataset_id, query.state, before, query.limit + 1))
    return history_page(rows, query.limit, lambda pair: pair[0].id)


class _PublicParts:
    """The public pieces a session's transitions need (no data)."""

    def __init__(self, session: Session, row: AnalysisSession) -> None:
        dataset = dataset_by_id(session, row.dataset_id)
        assert dataset is not None
        self.dataset = dataset
        self.mechanism = _mechanism(row.mechanism)
        self.params: BaseModel = self.mechanism.params_model.model_validate(row.params)
        self.public: PublicContext = public_context(dataset)


@dataclass
class _Locked:
    """A session's transition in a batch of one: its batch, its filters, its row (locked) and its
    reservation's request."""

    batch: RequestBatch
    filters: list[FilterRow]
    row: AnalysisSession
    request: AnalysisRequest


def _locked(batch: RequestBatch, row: AnalysisSession) -> _Locked:
    """Under the batch's filter locks: the session row re-read and locked, and its request."""
    fresh = SessionRepository(batch.session).fresh(row.id)
    assert fresh is not None
    request = batch.request(fresh.request_id)
    assert request is not None
    return _Locked(batch, filters_of(batch, fresh.dataset_id, fresh.analyst), fresh, request)


def _transact(session: Session, row: AnalysisSession, apply: Callable[[_Locked], T]) -> T:
    """A batch of one for a transition of the session ``row``: its filters and rows locked."""
    reads = BatchReads.of([row.dataset_id], row.analyst, settles=[row.request_id])
    return transact(session, reads, lambda batch: apply(_locked(batch, row)))


def _close(locked: _Locked, parts: _PublicParts, reason: str, failed: bool = False) -> None:
    """Commit the realized charge of the public transcript (the worst case on failure); drop the secret."""
    batch, row, request = locked.batch, locked.row, locked.request
    transcript = [(step["query"], step["answer"]) for step in row.steps]
    realized = (
        None
        if failed
        else parts.mechanism.realized(parts.params, parts.public, transcript, reason == "halted")
    )
    error = "the mechanism failed; its worst case was charged" if failed else None
    settle_batched(batch, locked.filters, request, realized, {"steps": transcript}, error)
    row.state, row.close_reason, row.updated_at = "closed", reason, datetime.now(UTC)
    SessionRepository(batch.session).drop_secret(request.id)
    metrics.session_closed(batch.session, row.mechanism, reason)


def ask(
    runtime: Runtime, principal: Principal, session_id: str, raw_query: Any, key: str | None
) -> tuple[AnalysisSession, dict[str, Any]]:
    """Answer one query of an open session (serialized per session by the filter locks)."""
    with runtime.sessions() as session:
        row = visible_session(session, principal, session_id)
        parts = _PublicParts(session, row)
    try:
        query = parts.mechanism.query_model.model_validate(raw_query)
    except ValidationError as exc:
        raise InvalidInput.from_validation("query", exc) from None
    query_json = query.model_dump(mode="json")

    def apply(locked: _Locked) -> tuple[AnalysisSession, dict[str, Any]] | SessionClosed:
        row = locked.row
        replay = _replay(row, key, query_json)
        if replay is not None:
            return row, replay
        if row.state == "open" and datetime.now(UTC) >= row.expires_at:
            _close(locked, parts, "expired")
        if row.state != "open":
            return SessionClosed(
                f"session {session_id} is closed ({row.close_reason}); open a new one",
                close_reason=row.close_reason,
            )
        return _step(runtime, locked, parts, query, query_json, key)

    with runtime.sessions() as session:
        outcome = _transact(session, row, apply)
    if isinstance(outcome, Exception):
        raise outcome
    if outcome[1].get("failed"):
        raise MechanismFailed("the mechanism failed; its worst case was charged", session_id=session_id)
    return outcome


def _replay(row: AnalysisSession, key: str | None, query_json: dict[str, Any]) -> dict[str, Any] | None:
    """A retried query with the same Idempotency-Key gets the stored answer (no fresh noise)."""
    if key is None:
        return None
    for step in row.steps:
        if step.get("key") == key:
            if step["query"] != query_json:
                raise IdempotencyKeyReused("this Idempotency-Key was used for a different query")
            answer: dict[str, Any] = step["answer"]
            return answer
    return None


def _step(
    runtime: Runtime,
    locked: _Locked,
    parts: _PublicParts,
    query: BaseModel,
    query_json: dict[str, Any],
    key: str | None,
) -> tuple[AnalysisSession, dict[str, Any]]:
    row, request = locked.row, locked.request
    try:
        parts.mechanism.check_query(parts.params, parts.public, query, len(row.steps))
    except ParamsError as exc:
        raise InvalidInput(f"query.{exc.field}", exc.reason) from None
    secret = SessionRepository(locked.batch.session).secret(request.id)
    assert secret is not None, "an open session has its secret state"
    try:
        table = runtime.tables.get(parts.dataset, parts.public.schema)
        noise = Noise.system()
        state = json.loads(secret.state)
        result = parts.mechanism.step(parts.params, parts.public, state, query, table, noise)
    except Exception as exc:
        log.error(
            "session step failed after reading data; charging the worst case",
            session_id=row.id,
            **failure_fields(exc),
        )
        _close(locked, parts, "failed", failed=True)
        return row, {"failed": True}
    row.steps = [*row.steps, {"query": query_json, "answer": result.answer, "key": key}]
    now = datetime.now(UTC)
    row.updated_at = secret.updated_at = now
    # Expiry is for idle sessions: every answered query pushes it back by the session TTL.
    row.expires_at = now + timedelta(seconds=runtime.settings.session_ttl_seconds)
    locked.batch.settled(request, {"lease_expires_at": row.expires_at})
    secret.state = _encode(result.state)
    max_queries = getattr(parts.params, "max_queries", None)
    exhausted = max_queries is not None and len(row.steps) >= max_queries
    if result.halted or exhausted:
        # "halted": the session stopped on an answer; "max_queries": its last allowed query was answered.
        reason = "max_queries" if exhausted and not result.answer.get("above", False) else "halted"
        _close(locked, parts, reason)
    return row, result.answer


def close(runtime: Runtime, principal: Principal, session_id: str) -> AnalysisSession:
    """Close an open session now and commit the realized charge of its transcript (idempotent). Its analyst
    closes it (``closed``), or an admin closes anyone's (``closed_by_admin``): the same settlement, the
    charge of the public transcript, whoever asks."""
    reason = "closed_by_admin" if principal.role is Role.admin else "closed"
    with runtime.sessions() as session:
        row = visible_session(session, principal, session_id)
        parts = _PublicParts(session, row)

    def apply(locked: _Locked) -> AnalysisSession:
        if locked.row.state == "open":
            _close(locked, parts, reason)
        return locked.row

    with runtime.sessions() as session:
        return _transact(session, row, apply)


def expire_sessions(sessions: sessionmaker[Session]) -> int:
    """Close every open session past its expiry, charging the realized outcome of its transcript."""
    with sessions() as session:
        expired = RequestRepository(session).expired_running(datetime.now(UTC), kind="session")
        rows = [SessionRepository(session).by_request(r.id) for r in expired]
        contexts = [(row, _PublicParts(session, row)) for row in rows if row is not None]
    closed = 0
    for row, parts in contexts:

        def apply(locked: _Locked, parts: _PublicParts = parts) -> bool:
            if locked.row.state != "open":
                return False
            _close(locked, parts, "expired")
            return True

        with sessions() as session:
            closed += _transact(session, row, apply)
    return closed


def revoke_key(sessions: sessionmaker[Session], name: str) -> tuple[ApiKey, int]:
    """Revoke the API key ``name`` and close its open sessions, in one transaction; returns the key and how
    many sessions were closed.

    The transaction first locks the key's filters: on every dataset where the key has a sub-filter (each
    admission of the key locks it in its batch), that one and the dataset's, datasets in id
    order (the global lock order). So every admission of the key, through any process whatever its key
    cache says, either committed before the revocation or reads the key revoked under the locks and is
    refused (``admission.check_admissible_now``); nothing is reserved or charged for it. Then every open
    session of the key is closed as a close by its analyst is (``key_revoked``: the charge of its public
    transcript, never less; no session holds its worst case until it expires), and the key is marked
    revoked. Idempotent: revoking again keeps the first ``revoked_at`` (and closes nothing more).

    Not covered: a grant of the key to a new dataset that commits while this transaction runs (its
    sub-filter is created after the locks were taken); an admission there may commit just after the
    revocation. Both are admin actions: grant, then revoke, not both at once."""
    validate_name(name)
    with sessions() as session:
        datasets = FilterRepository(session).datasets_of_scope(name)
        opened = [row.request_id for row in SessionRepository(session).open_of(name)]

    def apply(batch: RequestBatch) -> tuple[ApiKey, int]:
        closed = 0
        for row in SessionRepository(batch.session).open_of(name):
            assert row.dataset_id in datasets, "a session was admitted under its analyst's filter"
            _close(_locked(batch, row), _PublicParts(batch.session, row), "key_revoked")
            closed += 1
        return auth.revoke_key(batch.session, name), closed

    with sessions() as session:
        return transact(session, BatchReads.of(datasets, name, settles=opened), apply)
