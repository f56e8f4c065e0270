from __future__ import annotations

import math
from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, Header, Query, Request, Response
from pydantic import AfterValidator

from service.api.deps import AdminOrAnalyst, Analyst, AnyRole, RuntimeDep, SessionDep, runtime_of
from service.api.schemas import CurveOut, EstimateOut, RequestIn, RequestOut, RequestPage, problem_doc
from service.auth import NAME_PATTERN, Principal
from service.datasets import check_admissible
from service.errors import MechanismFailed
from service.runs import requests as lifecycle
from service.runs import views
from service.runs.requests import HistoryQuery, Submission
from service.runs.runtime import Runtime
from service.runs.views import AnalysisRequest, RequestState

router = APIRouter(tags=["requests"])


def printable_key(value: str | None) -> str | None:
    """An Idempotency-Key is printable ASCII (no control characters): it is stored, logged and compared."""
    if value is not None and not all(" " <= c <= "~" for c in value):
        raise ValueError("must be printable ASCII, without control characters")
    return value


IdempotencyKey = Annotated[
    str | None,
    Header(
        alias="Idempotency-Key",
        min_length=1,
        max_length=200,
        description="retry-safe key: same key, same release",
    ),
    AfterValidator(printable_key),
]


Prefer = Annotated[
    str | None,
    Header(
        max_length=200,
        description="`respond-async`: answer 202 at once instead of waiting for the release (RFC 7240)",
    ),
]


def _out(request: AnalysisRequest, queue_position: int | None = None) -> RequestOut:
    """The public view of a stored request. Built without validation (every value comes from the row the
    service wrote; validating the curves would cost more than the rest of a cheap request's response)."""
    end = datetime.now(UTC) if request.state == RequestState.RUNNING else request.updated_at
    return RequestOut.model_construct(
        id=request.id,
        dataset_id=request.dataset_id,
        analyst=request.analyst,
        mechanism=request.mechanism,
        params=request.params,
        state=str(request.state),
        worst_case=CurveOut.stored(request.worst_case["curve"]),
        realized=CurveOut.stored(request.realized["curve"]) if request.realized else None,
        release=request.release,
        error=request.error,
        created_at=request.created_at,
        updated_at=request.updated_at,
        started_at=request.started_at,
        elapsed_seconds=round(max(0.0, (end - request.created_at).total_seconds()), 3),
        progress=lifecycle.public_progress(request),
        phase=lifecycle.phase(request),
        eta_seconds=lifecycle.eta_seconds(request),
        queue_position=queue_position,
        cancelled_by=request.cancelled_by,
    )


def _retry_after(request: AnalysisRequest) -> str:
    """When to poll again: the ETA when known (1–10 s), else 1 s."""
    eta = lifecycle.eta_seconds(request)
    return str(1 if eta is None else min(10, max(1, math.ceil(eta))))


@router.post(
    "/v1/datasets/{dataset_id}/requests:estimate",
    operation_id="estimateRequest",
    response_model=EstimateOut,
    summary="Dry run: the worst-case charge and whether it would be admitted now (no charge)",
    responses={
        409: problem_doc("the dataset is archived: it admits nothing, so there is nothing to estimate")
    },
)
def estimate(
    dataset_id: str, body: RequestIn, session: SessionDep, who: AdminOrAnalyst, runtime: RuntimeDep
) -> dict[str, Any]:
    check_admissible(session, who, dataset_id)  # archived (409) or no longer granted (404), as submit
    return lifecycle.dry_run(session, who, dataset_id, body.mechanism, body.params, runtime.tables)


#: Also bound directly (service/api/direct.py), for the submissions that need none of this route's errors.
SUBMIT_PATH = "/v1/datasets/{dataset_id}/requests"


@router.post(
    SUBMIT_PATH,
    operation_id="submitRequest",
    summary="Run a mechanism: 200 with the release and its realized charge, or 202 while running",
    responses={
        202: {"description": "queued or still running; poll the Location after Retry-After seconds"},
        409: problem_doc("refused"),
        429: problem_doc("too many of your requests are queued or running (the limit is in the body)"),
    },
)
async def submit(
    dataset_id: str,
    body: RequestIn,
    http: Request,
    analyst: Analyst,
    response: Response,
    idempotency_key: IdempotencyKey = None,
    prefer: Prefer = None,
) -> RequestOut:
    runtime = runtime_of(http)  # not a dependency: the busiest route resolves one less per request
    return await submit_request(runtime, analyst, dataset_id, body, response, idempotency_key, prefer)


async def submit_request(
    runtime: Runtime,
    analyst: Principal,
    dataset_id: str,
    body: RequestIn,
    response: Response,
    idempotency_key: str | None,
    prefer: str | None,
) -> RequestOut:
    """Submit ``body`` (``POST …/requests``, and ``POST …/sql`` once translated)."""
    wait = 0.0 if prefer is not None and "respond-async" in prefer.lower() else None
    submission = Submission(analyst, dataset_id, body.mechanism, body.params, idempotency_key, wait)
    request = await lifecycle.submit_async(runtime, submission)
    if request.state == RequestState.FAILED_CHARGED:
        raise MechanismFailed(
            request.error or "failed",
            request_id=request.id,
            charged=request.realized["curve"] if request.realized else None,
        )
    if request.state == RequestState.RUNNING:
        response.status_code = 202
        response.headers["Location"] = f"/v1/requests/{request.id}"
        response.headers["Retry-After"] = _retry_after(request)
    return _out(request)


# The history's filters and cursor (GET /v1/requests and GET /v1/sessions): ids are letters, digits, _ and -.
DatasetFilter = Annotated[
    str | None,
    Query(min_length=1, max_length=40, pattern=r"^[A-Za-z0-9_-]+$", description="only this dataset's"),
]
AnalystFilter = Annotated[
    str | None,
    Query(pattern=NAME_PATTERN.pattern, description="admins: only this analyst's (analysts: their own name)"),
]
HistoryAfter = Annotated[
    str | None,
    Query(
        min_length=1,
        max_length=40,
        pattern=r"^[A-Za-z0-9_-]+$",
        description="the previous page's `next_after` (the id of its last item): continue after it",
    ),
]
HistoryLimit = Annotated[int, Query(ge=1, le=1000, description="at most this many items")]


@router.get(
    "/v1/requests",
    operation_id="listRequests",
    summary="Your requests, newest first (admins: everyone's); filter by dataset, state or analyst",
)
def list_requests(
    session: SessionDep,
    who: AnyRole,
    dataset_id: DatasetFilter = None,
    state: Annotated[RequestState | None, Query(description="only requests in this state")] = None,
    analyst: AnalystFilter = None,
    after: HistoryAfter = None,
    limit: HistoryLimit = 100,
) -> RequestPage:
    query = HistoryQuery(analyst, dataset_id, state, after, limit)
    page = lifecycle.history(session, who, query)
    items = [_out(r, views.queue_position(session, r)) for r in page.items]
    return RequestPage(items=items, next_after=page.next_after)


@router.get(
    "/v1/requests/{request_id}",
    operation_id="getRequest",
    summary="A request, its state and (when committed) its release",
)
def get_request(request_id: str, session: SessionDep, who: AnyRole, response: Response) -> RequestOut:
    request = lifecycle.get_visible(session, who, request_id)
    position = views.queue_position(session, request)
    if request.state == RequestState.RUNNING:
        response.headers["Retry-After"] = _retry_after(request)
    return _out(request, position)


@router.post(
    "/v1/requests/{request_id}/cancel",
    operation_id="cancelRequest",
    summary="Cancel: a queued request is aborted without charge; a running one is charged its worst case",
    responses={409: problem_doc("the request has already finished")},
)
def cancel(request_id: str, runtime: RuntimeDep, who: AdminOrAnalyst) -> RequestOut:
    return _out(lifecycle.cancel(runtime.sessions, who, request_id))
