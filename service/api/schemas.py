"""HTTP request and response bodies (pydantic v2)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from service.auth import Role
from service.errors import PROBLEM_JSON


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class InputError(BaseModel):
    field: str = Field(description="the offending field, dotted (e.g. params.epsilon)")
    reason: str


class Problem(BaseModel):
    """Every error: an RFC 9457 problem (``application/problem+json``), with extension members."""

    type: str = Field(examples=["/problems/invalid-input"])
    title: str
    status: int
    detail: str
    instance: str | None = None
    errors: list[InputError] | None = Field(None, description="input errors: each field and its reason")
    model_config = ConfigDict(extra="allow")


def problem_doc(description: str) -> dict[str, Any]:
    """An OpenAPI response whose body is a Problem (the schema is registered by service.app)."""
    return {"description": description,
            "content": {PROBLEM_JSON: {"schema": {"$ref": "#/components/schemas/Problem"}}}}


# Every error is a problem+json (service.app's handlers), documented as such on every operation in place of
# FastAPI's default 422 HTTPValidationError, which this service never sends.
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    "4XX": problem_doc("Client error: bad input, no or wrong key, not found, conflict or refusal"),
    "5XX": problem_doc("Server error"),
}


class BudgetIn(StrictModel):
    # strict: JSON numbers only (an integer is a number), never a string or a boolean, as in mechanism params
    epsilon: float = Field(strict=True, ge=0, le=1e6, description="target ε of the filter")
    delta: float = Field(strict=True, ge=0, lt=1, description="target δ; 0 makes a pure filter")
    delta_share: float | None = Field(
        default=None, strict=True, gt=0, lt=1,
        description="part of δ set aside for approximate-DP mechanisms (propose-test-release), < delta; "
        "the RDP slots then use delta − delta_share. Once set it may only grow, and delta − delta_share "
        "may never shrink (docs/privacy.md §11)",
    )
    confirm_below_spent: bool = Field(
        default=False, strict=True,
        description="required (true) to set a capacity below what is already spent and reserved in every "
        "slot, which leaves the filter unable to admit anything; otherwise such a budget is refused (409)",
    )


class GrantIn(StrictModel):
    analyst: str = Field(min_length=1, max_length=100, description="name of an analyst key")


class KeyIn(StrictModel):
    name: str = Field(min_length=1, max_length=100)
    role: Role


class KeyOut(BaseModel):
    name: str
    role: Role
    prefix: str
    key: str | None = Field(None, description="shown once, at creation")


class RequestIn(StrictModel):
    mechanism: str = Field(min_length=1, max_length=50, examples=["laplace"])
    params: dict[str, Any] = Field(examples=[{"query": {"kind": "count"}, "epsilon": 0.1}])


class DatasetOut(BaseModel):
    id: str
    name: str
    schema_: dict[str, Any] = Field(alias="schema")
    n_rows: int | None = Field(description="public only under replace_one neighbouring")
    content_sha256: str | None = Field(
        None, description="hash of the uploaded file (admins only: it is a function of the data)"
    )
    orders: list[float]
    clipped: dict[str, int] | None = Field(None, description="values clipped on load (admins only)")
    created_at: datetime
    model_config = ConfigDict(populate_by_name=True)


class SessionIn(StrictModel):
    mechanism: str = Field(min_length=1, max_length=50, examples=["above_threshold"])
    params: dict[str, Any] = Field(
        examples=[{"threshold": 100, "epsilon_threshold": 0.1, "max_query_epsilon": 0.1, "max_queries": 20}]
    )


class SessionOut(BaseModel):
    id: str
    request_id: str = Field(
        description="the id of the session's reservation: its ledger entries carry this request_id"
    )
    dataset_id: str
    analyst: str
    mechanism: str
    params: dict[str, Any]
    state: str = Field(description="open or closed")
    close_reason: str | None = Field(description="halted, max_queries, closed, expired or failed")
    asked: int
    steps: list[dict[str, Any]] = Field(description="the public transcript: each query and its answer")
    worst_case: dict[str, Any] = Field(description="reserved while open")
    realized: dict[str, Any] | None = Field(description="the charge of the actual outcome, once closed")
    created_at: datetime
    expires_at: datetime


class AnswerOut(BaseModel):
    answer: dict[str, Any]
    session: SessionOut


class RequestOut(BaseModel):
    id: str
    dataset_id: str
    analyst: str
    mechanism: str
    params: dict[str, Any]
    state: str
    worst_case: dict[str, Any]
    realized: dict[str, Any] | None
    release: dict[str, Any] | None
    error: str | None
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None = Field(None, description="when a worker started running it")
    elapsed_seconds: float = Field(
        description="seconds since submission, until now while running, else until it was settled"
    )
    progress: float | None = Field(
        None,
        description="fraction done of a long-running mechanism, only when its progress is public "
        "(otherwise only the state and the elapsed time are shown)",
    )
    phase: str | None = Field(
        None,
        description="while state is running: 'queued' (reserved, waiting for a worker; cancelling costs "
        "nothing) or 'running' (a worker started it); null once settled",
    )
    eta_seconds: float | None = Field(
        None,
        description="estimated seconds left, from public quantities only (time since the worker started "
        "it and the public fraction done); null when the progress is not public",
    )
    queue_position: int | None = Field(
        None, description="while queued: how many of your own queued requests are ahead of it"
    )
    cancelled_by: str | None = Field(None, description="who cancelled it (the owner or an admin)")


class LimitsIn(StrictModel):
    max_running_requests: int | None = Field(
        None, ge=1, le=100_000,
        description="requests queued or running on workers at once (null: the service default)",
    )
    max_open_sessions: int | None = Field(
        None, ge=1, le=100_000, description="open interactive sessions at once (null: the service default)"
    )


class LimitsOut(BaseModel):
    analyst: str
    max_running_requests: int = Field(description="the effective limit")
    max_open_sessions: int = Field(description="the effective limit")
    running_requests: int = Field(description="requests queued or running on workers now")
    open_sessions: int
    custom: bool = Field(description="whether an admin set limits for this analyst (else the defaults)")


class RequestPage(BaseModel):
    """One page of ``GET /v1/requests``, newest first."""

    items: list[RequestOut] = Field(description="each as GET /v1/requests/{id} shows it")
    next_after: str | None = Field(
        description="the id to pass as `after` for the next page; null on the last page"
    )


class SessionPage(BaseModel):
    """One page of ``GET /v1/sessions``, newest first."""

    items: list[SessionOut] = Field(description="each as GET /v1/sessions/{id} shows it")
    next_after: str | None = Field(
        description="the id to pass as `after` for the next page; null on the last page"
    )


class KeyRevokedOut(BaseModel):
    """``DELETE /v1/keys/{name}``: the key is refused from now on (other processes: within the key cache)."""

    name: str
    role: str
    revoked_at: datetime = Field(description="when it was first revoked (revoking again changes nothing)")


class GrantRevokedOut(BaseModel):
    """``DELETE /v1/datasets/{id}/grants/{analyst}``."""

    dataset_id: str
    analyst: str
    revoked: bool = Field(description="false when the analyst had no grant (nothing changed)")


class DatasetArchivedOut(BaseModel):
    """``POST /v1/datasets/{id}/archive``: no new requests or sessions; history and ledger stay."""

    dataset_id: str
    archived_at: datetime = Field(description="when it was first archived (archiving again changes nothing)")
    archived_by: str


class MeOut(BaseModel):
    """The caller: the name and role of the API key that authenticated the request."""

    name: str
    role: Role
