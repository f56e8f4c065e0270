from __future__ import annotations

from dataclasses import replace
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query
from sqlalchemy.orm import Session

from service.api.deps import AdminOrAnalyst, AnyRole, RuntimeDep, SessionDep
from service.api.deps import Analyst as AnalystRole
from service.api.routers.requests import (
    AnalystFilter,
    DatasetFilter,
    HistoryAfter,
    HistoryLimit,
    IdempotencyKey,
)
from service.api.schemas import AnswerOut, SessionIn, SessionOut, SessionPage
from service.errors import BudgetExhausted, Forbidden
from service.filter.refusals import record_refusal
from service.runs import sessions as domain
from service.runs import views
from service.runs.requests import HistoryQuery
from service.runs.views import AnalysisSession

router = APIRouter(tags=["sessions"])

SessionState = Literal["open", "closed"]


def session_out(
    row: AnalysisSession, worst_case: dict[str, Any], realized: dict[str, Any] | None
) -> SessionOut:
    return SessionOut(
        id=row.id,
        request_id=row.request_id,
        dataset_id=row.dataset_id,
        analyst=row.analyst,
        mechanism=row.mechanism,
        params=row.params,
        state=row.state,
        close_reason=row.close_reason,
        asked=len(row.steps),
        steps=[{"query": s["query"], "answer": s["answer"]} for s in row.steps],
        worst_case=worst_case,
        realized=realized,
        created_at=row.created_at,
        expires_at=row.expires_at,
    )


def _out_with(session: Session, row: AnalysisSession) -> SessionOut:
    request = views.request_of(session, row.request_id)
    assert request is not None
    realized = request.realized["curve"] if request.realized else None
    return session_out(row, request.worst_case["curve"], realized)


def _out(runtime: RuntimeDep, row: AnalysisSession) -> SessionOut:
    """In a session of its own: call only when the route holds no other (SQLite locks per session)."""
    with runtime.sessions() as session:
        return _out_with(session, row)


@router.post(
    "/v1/datasets/{dataset_id}/sessions",
    status_code=201,
    operation_id="openSession",
    summary="Open an interactive session: reserves its worst case and draws its secret state",
)
def open_session(
    dataset_id: str,
    body: SessionIn,
    runtime: RuntimeDep,
    analyst: AnalystRole,
    idempotency_key: IdempotencyKey = None,
) -> SessionOut:
    with runtime.sessions() as session:
        validated = domain.validate_open(session, analyst, dataset_id, body.mechanism, body.params)
    try:
        row = domain.open_session(
            runtime.sessions,
            analyst,
            replace(validated, limits=runtime.limits()),
            idempotency_key,
            runtime.settings.session_ttl_seconds,
        )
    except BudgetExhausted as refused:  # recorded after the admission transaction, best-effort
        record_refusal(runtime.sessions, analyst, dataset_id, "session", body.mechanism, body.params, refused)
        raise
    return _out(runtime, row)


@router.get(
    "/v1/sessions",
    operation_id="listSessions",
    summary="Your sessions, newest first (admins: everyone's); filter by dataset, state or analyst",
)
def list_sessions(
    session: SessionDep,
    who: AnyRole,
    dataset_id: DatasetFilter = None,
    state: Annotated[SessionState | None, Query(description="only sessions in this state")] = None,
    analyst: AnalystFilter = None,
    after: HistoryAfter = None,
    limit: HistoryLimit = 100,
) -> SessionPage:
    query = HistoryQuery(analyst, dataset_id, state, after, limit)
    page = domain.history(session, who, query)
    # each session's request row was loaded with it: _out_with finds it in the session's identity map
    return SessionPage(items=[_out_with(session, row) for row, _ in page.items], next_after=page.next_after)


@router.get(
    "/v1/sessions/{session_id}", operation_id="getSession", summary="A session's state and public transcript"
)
def get_session(session_id: str, session: SessionDep, who: AnyRole) -> SessionOut:
    if who.role.value == "viewer":
        raise Forbidden("viewers cannot read session answers")
    return _out_with(session, domain.visible_session(session, who, session_id))


@router.post(
    "/v1/sessions/{session_id}/queries",
    operation_id="askSessionQuery",
    summary="Ask one query; the session closes itself when it halts or reaches max_queries",
)
def ask(
    session_id: str,
    body: dict[str, Any],
    runtime: RuntimeDep,
    analyst: AnalystRole,
    idempotency_key: IdempotencyKey = None,
) -> AnswerOut:
    row, answer = domain.ask(runtime, analyst, session_id, body, idempotency_key)
    return AnswerOut(answer=answer, session=_out(runtime, row))


@router.post(
    "/v1/sessions/{session_id}/next",
    operation_id="nextSessionRelease",
    summary="Noise-reduction sessions: release the next, less noisy level (a query with an empty body)",
)
def next_release(
    session_id: str, runtime: RuntimeDep, analyst: AnalystRole, idempotency_key: IdempotencyKey = None
) -> AnswerOut:
    row, answer = domain.ask(runtime, analyst, session_id, {}, idempotency_key)
    return AnswerOut(answer=answer, session=_out(runtime, row))


@router.post(
    "/v1/sessions/{session_id}/close",
    operation_id="closeSession",
    summary="Close now and commit the charge of the outcome (its analyst, or an admin: anyone's session)",
)
def close(session_id: str, runtime: RuntimeDep, who: AdminOrAnalyst) -> SessionOut:
    return _out(runtime, domain.close(runtime, who, session_id))
