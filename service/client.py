"""A typed Python client for the expost HTTP API, sync (:class:`ExpostClient`) and async
(:class:`AsyncExpostClient`), with the same methods.

It imports only httpx and pydantic (never FastAPI or SQLAlchemy), so it can be used from any process that
can reach the server. ``service.schemas`` pulls in SQLAlchemy through ``service.auth``, so the response
models here are the client's own, lenient (unknown fields are kept) copies of the server's.

* problem+json responses become exceptions: :class:`ExpostError` and its subclasses
  (:class:`BudgetExhaustedError` for ``/problems/budget-exhausted`` and ``/problems/not-admissible``,
  :class:`InvalidInputError`, :class:`NotFoundError`, :class:`AuthError`, :class:`ConflictError`,
  :class:`ServerError`).
* ``submit``, ``open_session``, ``ask`` and ``next`` send an ``Idempotency-Key`` (generated unless given)
  and, on a connection error or a 5xx, retry with the same key, so a lost response never charges twice.
  Other calls are retried only when they are safe to repeat (GET, PUT, grants, estimates, closing a
  session); key and dataset creation only when the connection could not even be opened. 4xx responses are
  never retried.
* ``submit`` follows a ``202 Accepted`` by polling ``GET /v1/requests/{id}`` until the request leaves
  ``running`` (calling ``progress(request_dict)`` with the 202 body and after each poll; the dict carries
  ``progress``, the fraction done, when the mechanism's progress is public), up to a timeout.
* Each endpoint is written once (``_Endpoints``, a sans-IO generator of HTTP calls, sleeps and progress
  reports); the two clients only drive those generators, blocking or awaiting.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import inspect
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Generator, Iterator, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any, Concatenate, Generic, ParamSpec, Self, TypeVar, overload

import httpx
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

__all__ = [
    "DEFAULT_URL",
    "AnalysisRequest",
    "Answer",
    "ApiKey",
    "AsyncExpostClient",
    "AuthError",
    "Budget",
    "BudgetExhaustedError",
    "BudgetSlot",
    "ConflictError",
    "Curve",
    "Dataset",
    "Estimate",
    "ExpostClient",
    "ExpostError",
    "ExpostTimeoutError",
    "Grant",
    "InvalidInputError",
    "LedgerPage",
    "LimitExceededError",
    "Limits",
    "MechanismFailedError",
    "MechanismInfo",
    "NotFoundError",
    "PrivacyReport",
    "RetryPolicy",
    "ServerError",
    "Session",
]

DEFAULT_URL = "http://127.0.0.1:8000"
USER_AGENT = "expost-client/0.1.0"

Loss = float | str  # a loss in ε units: a number, or "inf"
Slot = float | str  # an order α, or "pure"
Progress = Callable[[dict[str, Any]], object]  # the async client awaits an awaitable result


# ----- models (lenient copies of service/schemas.py and the dict bodies of the routers) -------------------


class ApiModel(BaseModel):
    """A response body; unknown fields are kept, and ``raw`` is the JSON exactly as received."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)
    _raw: dict[str, Any] = PrivateAttr(default_factory=dict)

    @classmethod
    def from_json(cls: type[M], data: Any) -> M:
        model = cls.model_validate(data)
        model._raw = data if isinstance(data, dict) else {}
        return model

    @property
    def raw(self) -> dict[str, Any]:
        return self._raw


M = TypeVar("M", bound=ApiModel)
T = TypeVar("T")
R = TypeVar("R")


class ApiKey(ApiModel):
    name: str
    role: str
    prefix: str
    key: str | None = None


class Dataset(ApiModel):
    id: str
    name: str
    schema_: dict[str, Any] = Field(alias="schema")
    n_rows: int | None = None
    content_sha256: str | None = None  # admins only
    orders: list[float]
    clipped: dict[str, int] | None = None
    created_at: datetime


class Grant(ApiModel):
    dataset_id: str
    analyst: str
    created: bool


class Curve(ApiModel):
    """A Rényi curve in ε units: ``values[i]`` at ``orders[i]``, and the pure (α = ∞) bound."""

    orders: list[float]
    values: list[Loss]
    pure: Loss


class BudgetSlot(ApiModel):
    alpha: Slot
    capacity: float | None
    spent: Loss
    reserved: Loss
    remaining: float | None


class Budget(ApiModel):
    dataset_id: str
    scope: str
    analyst: str | None = None
    epsilon: float | None = None
    delta: float | None = None
    orders: list[BudgetSlot]
    pure: BudgetSlot
    epsilon_spent: Loss
    epsilon_remaining: float | None = None
    binding_alpha: Slot | None = None
    budget_set: bool
    etag: str | None = Field(default=None, exclude=True, description="the response's ETag")


class AnalysisRequest(ApiModel):
    id: str
    dataset_id: str
    analyst: str
    mechanism: str
    params: dict[str, Any]
    state: str
    worst_case: Curve
    realized: Curve | None = None
    release: dict[str, Any] | None = None
    error: str | None = None
    created_at: datetime
    updated_at: datetime
    # Newer servers: the fraction done (only when the mechanism's progress is public) and the timing.
    progress: float | None = None
    elapsed_seconds: float | None = None  # since submission: until now while running, else until settled
    started_at: datetime | None = None
    # Newer servers: queued (waiting for a worker, cancellable for free) or running; ETA from public data.
    phase: str | None = None
    eta_seconds: float | None = None
    queue_position: int | None = None
    cancelled_by: str | None = None


class Limits(ApiModel):
    analyst: str
    max_running_requests: int
    max_open_sessions: int
    running_requests: int
    open_sessions: int
    custom: bool


class Estimate(ApiModel):
    admitted: bool
    worst_case: Curve
    refusal: dict[str, Any] | None = None
    reason: str | None = None

    @property
    def refusal_error(self) -> BudgetExhaustedError | None:
        """The refusal the request would get now, as the exception ``submit`` would raise."""
        if self.refusal is None:
            return None
        error = error_from_problem(int(self.refusal.get("status", 409)), self.refusal)
        return error if isinstance(error, BudgetExhaustedError) else None


class Session(ApiModel):
    id: str
    dataset_id: str
    analyst: str
    mechanism: str
    params: dict[str, Any]
    state: str
    close_reason: str | None = None
    asked: int
    steps: list[dict[str, Any]]
    worst_case: Curve
    realized: Curve | None = None
    created_at: datetime
    expires_at: datetime


class Answer(ApiModel):
    answer: dict[str, Any]
    session: Session

    @property
    def above(self) -> bool:
        return bool(self.answer.get("above"))


class MechanismInfo(ApiModel):
    name: str
    kind: str
    summary: str
    cost_parameter: str | None = None
    params_schema: dict[str, Any]
    query_schema: dict[str, Any] | None = None


class PrivacyReport(ApiModel):
    """A release's per-instance privacy report evaluated on the caller's own record (charged nothing):
    a bound on that record's ex-post loss holding with probability ≥ ``confidence``, and its Rényi curve."""

    request_id: str
    mechanism: str
    report_kind: str
    charged: float
    ex_post_epsilon_upper: Loss
    confidence: float
    terms: dict[str, Loss]
    personalized_rdp: Curve


class LedgerPage(ApiModel):
    items: list[dict[str, Any]]
    next_after: int | None = None


# ----- errors -------------------------------------------------------------------------------------------


class ExpostError(Exception):
    """An RFC 9457 problem answered by the server (or a non-problem error response)."""

    def __init__(self, status: int, type: str, title: str, detail: str, body: dict[str, Any]) -> None:
        super().__init__(f"{status} {title}: {detail}")
        self.status = status
        self.type = type
        self.title = title
        self.detail = detail
        self.body = body


class InvalidInputError(ExpostError):
    """400/413/422: ``errors`` lists ``{"field", "reason"}`` (e.g. ``params.epsilon``)."""

    @property
    def errors(self) -> list[dict[str, str]]:
        errors = self.body.get("errors")
        return list(errors) if isinstance(errors, list) else []

    @property
    def fields(self) -> list[str]:
        return [str(e.get("field")) for e in self.errors]


class AuthError(ExpostError):
    """401 (missing or invalid key) or 403 (not allowed for this role)."""


class NotFoundError(ExpostError):
    """404."""


class ConflictError(ExpostError):
    """409 other than a budget refusal (e.g. no budget set yet, a closed session, a duplicate key name)."""


class BudgetExhaustedError(ConflictError):
    """409 ``/problems/budget-exhausted`` or ``/problems/not-admissible``: the filter refused the request.

    ``orders`` (and ``pure``) hold per-slot rows with ``alpha``, ``requested``, ``spent``, ``reserved``,
    ``capacity``, ``remaining`` and ``shortfall``; ``requested`` is the request's worst-case curve;
    ``affordable`` is ``{"parameter", "value"}`` (the largest ε / smallest σ admissible now) or None.
    """

    @property
    def not_admissible(self) -> bool:
        return self.type.endswith("/not-admissible")

    @property
    def requested(self) -> dict[str, Any] | None:
        value = self.body.get("requested")
        return value if isinstance(value, dict) else None

    @property
    def orders(self) -> list[dict[str, Any]]:
        rows = self.body.get("orders")
        return list(rows) if isinstance(rows, list) else []

    @property
    def pure(self) -> dict[str, Any] | None:
        value = self.body.get("pure")
        return value if isinstance(value, dict) else None

    @property
    def binding_alpha(self) -> Slot | None:
        value = self.body.get("binding_alpha")
        return value if isinstance(value, float | int | str) else None

    @property
    def affordable(self) -> dict[str, Any] | None:
        value = self.body.get("affordable")
        return value if isinstance(value, dict) else None

    @property
    def filter(self) -> str | None:
        value = self.body.get("filter")
        return value if isinstance(value, str) else None

    @property
    def binding_row(self) -> dict[str, Any] | None:
        """The per-slot row of the binding order (the one closest to fitting)."""
        rows = [*self.orders, *([self.pure] if self.pure else [])]
        return next((r for r in rows if r.get("alpha") == self.binding_alpha), None)

    def summary(self) -> str:
        """One human line: requested vs remaining at the binding order, and what is affordable."""
        row = self.binding_row
        parts = [f"filter {self.filter or '?'}"]
        if row is not None:
            alpha = "pure (α=∞)" if row.get("alpha") == "pure" else f"α={row.get('alpha')}"
            parts.append(
                f"binding order {alpha}: requested {_num(row.get('requested'))}, "
                f"remaining {_num(row.get('remaining'))} "
                f"(spent {_num(row.get('spent'))}, reserved {_num(row.get('reserved'))}, "
                f"capacity {_num(row.get('capacity'))})"
            )
        affordable = self.affordable
        if affordable is None:
            parts.append("affordable: nothing now")
        else:
            parts.append(f"affordable: {affordable.get('parameter')} = {_num(affordable.get('value'))}")
        return "; ".join(parts)


class LimitExceededError(ExpostError):
    """429: a per-analyst limit (requests queued or running, open sessions); the body names it."""

    @property
    def limit(self) -> str | None:
        value = self.body.get("limit")
        return value if isinstance(value, str) else None

    @property
    def maximum(self) -> int | None:
        value = self.body.get("max")
        return value if isinstance(value, int) else None


class ServerError(ExpostError):
    """5xx."""


class MechanismFailedError(ServerError):
    """500 ``/problems/mechanism-failed`` (or a polled request that ended ``failed_charged``): the
    mechanism failed after reading the data and its worst case was charged. Never retried."""


class ExpostTimeoutError(TimeoutError):
    """A 202-accepted request was still running when the client stopped waiting (it keeps running)."""

    def __init__(self, request: AnalysisRequest, waited: float) -> None:
        super().__init__(f"request {request.id} still {request.state} after {waited:.1f}s")
        self.request = request
        self.request_id = request.id


def _num(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return "n/a" if value is None else str(value)


def error_from_problem(status: int, body: dict[str, Any], reason: str = "") -> ExpostError:
    type_ = str(body.get("type") or "about:blank")
    title = str(body.get("title") or reason or f"HTTP {status}")
    detail = str(body.get("detail") or title)
    cls: type[ExpostError]
    if type_.endswith(("/budget-exhausted", "/not-admissible")):
        cls = BudgetExhaustedError
    elif type_.endswith("/mechanism-failed"):
        cls = MechanismFailedError
    elif type_.endswith("/limit-exceeded"):
        cls = LimitExceededError
    elif status in (400, 413, 422):
        cls = InvalidInputError
    elif status in (401, 403):
        cls = AuthError
    elif status == 404:
        cls = NotFoundError
    elif status == 409:
        cls = ConflictError
    elif status >= 500:
        cls = ServerError
    else:
        cls = ExpostError
    return cls(status, type_, title, detail, body)


def error_from_response(response: httpx.Response) -> ExpostError:
    body: dict[str, Any] = {}
    try:
        parsed = response.json()
        if isinstance(parsed, dict):
            body = parsed
    except (ValueError, UnicodeDecodeError):
        text = response.text.strip()
        if text:
            body = {"detail": text[:500]}
    return error_from_problem(response.status_code, body, response.reason_phrase)


# ----- retries ------------------------------------------------------------------------------------------


class Retry(enum.Enum):
    NEVER = "never"
    CONNECT = "connect"  # only when the connection could not be opened (the request was never sent)
    SAFE = "safe"  # on any transport error and 5xx: the call is idempotent (or carries an Idempotency-Key)


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded retries with exponential backoff and jitter (``attempts`` counts the first one)."""

    attempts: int = 4
    backoff: float = 0.25
    max_backoff: float = 5.0

    def delay(self, attempt: int, response: httpx.Response | None = None) -> float:
        if response is not None:
            retry_after = response.headers.get("retry-after", "")
            if retry_after.replace(".", "", 1).isdigit():
                return min(float(retry_after), self.max_backoff)
        base = min(self.backoff * 2.0**attempt, self.max_backoff)
        return base * (0.5 + secrets.randbelow(1 << 20) / (1 << 21))  # jitter in [0.5, 1)·base


def _should_retry_exception(retry: Retry, exc: httpx.TransportError) -> bool:
    if retry is Retry.SAFE:
        return True
    if retry is Retry.CONNECT:
        return isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout)
    return False


def _should_retry_response(retry: Retry, response: httpx.Response) -> bool:
    if retry is not Retry.SAFE or response.status_code < 500:
        return False
    if response.status_code == 500 and "mechanism-failed" in response.text:
        return False  # a definite outcome (charged); a retry would only replay it
    return True


# ----- one request layer for both clients ---------------------------------------------------------------
#
# Every endpoint is written once, below in ``_Endpoints``, as a sans-IO generator: it yields effects and
# returns the parsed result. ``_Call`` sends one HTTP attempt (the driver resumes the generator with the
# response, or throws the transport error in); ``_Sleep`` waits; ``_Report`` calls a progress callback;
# ``_Emit`` hands one item to a streaming caller. Retries, status handling, parsing, 202 polling and the
# ETag cache therefore exist once; ``ExpostClient`` and ``AsyncExpostClient`` only perform the effects,
# blocking or awaiting, and the ``@_endpoint`` descriptor exposes each generator as a typed method of both.


@dataclass(frozen=True)
class _Call:
    """One HTTP exchange: what to send, how it may be retried, and which statuses are a success."""

    method: str
    path: str
    retry: Retry
    json: Any = None
    params: dict[str, Any] | None = None
    headers: dict[str, str] = field(default_factory=dict)
    data: dict[str, str] | None = None
    files: dict[str, tuple[str, bytes, str]] | None = None
    ok: tuple[int, ...] = (200, 201)

    def request_args(self) -> dict[str, Any]:
        """The keyword arguments of ``httpx.Client.request`` (and of ``httpx.AsyncClient.request``)."""
        sent = ("json", "params", "headers", "data", "files")
        return {"method": self.method, "url": self.path, **{name: getattr(self, name) for name in sent}}


@dataclass(frozen=True)
class _Sleep:
    seconds: float


@dataclass(frozen=True)
class _Report:
    progress: Progress
    body: dict[str, Any]


_Item = dict[str, Any]  # one item of a paged listing (a ledger entry)


@dataclass(frozen=True)
class _Emit:
    item: _Item


_Effect = _Call | _Sleep | _Report | _Emit
_Op = Generator[_Effect, Any, T]  # resumed with a _Call's response, else with None
_Stream = Generator[_Effect, Any, None]  # emits its items
P = ParamSpec("P")


def _get(path: str, **params: Any) -> _Call:
    return _Call("GET", path, Retry.SAFE, params=params or None)


def _keyed_post(path: str, body: Any, key: str | None) -> _Call:
    """A POST that may charge: retried with one Idempotency-Key, so the server replays, never re-runs."""
    return _Call("POST", path, Retry.SAFE, body, headers={"Idempotency-Key": key or f"expost-{uuid.uuid4()}"})


def _budget_path(dataset_id: str, analyst: str | None) -> str:
    if analyst is None:
        return f"/v1/datasets/{dataset_id}/budget"
    return f"/v1/datasets/{dataset_id}/analysts/{analyst}/budget"


def _request_body(mechanism: str, params: Mapping[str, Any]) -> dict[str, Any]:
    return {"mechanism": mechanism, "params": dict(params)}


def _list_of(model: type[M]) -> Callable[[Any], list[M]]:
    return lambda data: [model.from_json(item) for item in data]


def _budget(response: httpx.Response) -> Budget:
    budget = Budget.from_json(response.json())
    budget.etag = response.headers.get("etag")
    return budget


def _settled(request: AnalysisRequest) -> AnalysisRequest:
    """The request, or MechanismFailedError when it ended ``failed_charged``."""
    if request.state != "failed_charged":
        return request
    type_ = "/problems/mechanism-failed"
    title = "The mechanism failed after reading the data; its worst case was charged"
    detail = request.error or "failed"
    body = {"type": type_, "title": title, "status": 500, "detail": detail, "request_id": request.id}
    body["charged"] = request.raw.get("realized")
    raise MechanismFailedError(500, type_, title, detail, body)


class _Wrapped(Generic[P, R]):
    """An ``_Endpoints`` generator function; on the class it is that function (``_Endpoints.f(self, ...)``
    composes endpoints), on a client instance its ``__get__`` gives the client's typed method."""

    def __init__(self, op: Callable[Concatenate[_Endpoints, P], R]) -> None:
        self.op = op
        functools.update_wrapper(self, op)
        signature = inspect.signature(op)  # as the client's method: no self, no generator type
        parameters = list(signature.parameters.values())[1:]
        self.signature = signature.replace(parameters=parameters, return_annotation=inspect.Signature.empty)

    def __call__(self, client: _Endpoints, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return self.op(client, *args, **kwargs)

    def _as_method(self, method: Callable[..., Any]) -> Callable[..., Any]:
        """``method`` with the endpoint's name, docstring and signature (without ``self``)."""
        functools.update_wrapper(method, self.op)
        method.__signature__ = self.signature  # type: ignore[attr-defined]
        return method


class _endpoint(_Wrapped[P, _Op[T]]):
    """``@_endpoint``: ``ExpostClient.f(...)`` runs the generator blocking and returns T;
    ``AsyncExpostClient.f(...)`` is a coroutine that returns T."""

    @overload
    def __get__(self, client: None, owner: type[Any]) -> Self: ...
    @overload
    def __get__(self, client: ExpostClient, owner: type[Any]) -> Callable[P, T]: ...
    @overload
    def __get__(self, client: AsyncExpostClient, owner: type[Any]) -> Callable[P, Coroutine[Any, Any, T]]: ...
    def __get__(self, client: _Endpoints | None, owner: type[Any]) -> Any:
        if client is None:
            return self
        op = self.op
        if isinstance(client, AsyncExpostClient):

            async def run_async(*args: Any, **kwargs: Any) -> Any:
                return await client._execute(op(client, *args, **kwargs))

            return self._as_method(run_async)
        assert isinstance(client, ExpostClient)

        def run(*args: Any, **kwargs: Any) -> Any:
            return client._execute(op(client, *args, **kwargs))

        return self._as_method(run)


class _stream_endpoint(_Wrapped[P, _Stream]):
    """``@_stream_endpoint``: for a generator that emits items; an iterator of them on ``ExpostClient``, an
    async iterator on ``AsyncExpostClient``."""

    @overload
    def __get__(self, client: None, owner: type[Any]) -> Self: ...
    @overload
    def __get__(self, client: ExpostClient, owner: type[Any]) -> Callable[P, Iterator[_Item]]: ...
    @overload
    def __get__(self, client: AsyncExpostClient, owner: type[Any]) -> Callable[P, AsyncIterator[_Item]]: ...
    def __get__(self, client: _Endpoints | None, owner: type[Any]) -> Any:
        if client is None:
            return self
        assert isinstance(client, ExpostClient | AsyncExpostClient)
        op = self.op

        def stream(*args: Any, **kwargs: Any) -> Any:
            return client._stream(op(client, *args, **kwargs))

        return self._as_method(stream)


class _Endpoints:
    """Every endpoint, written once (the comment above); both clients inherit them."""

    def __init__(self, base_url: str, key: str | None, retry: RetryPolicy | None) -> None:
        self.base_url = base_url.rstrip("/")
        self.retry_policy = retry or RetryPolicy()
        self._headers = {"User-Agent": USER_AGENT, "Accept": "application/json, application/problem+json"}
        if key:
            self._headers["Authorization"] = f"Bearer {key}"
        self._budget_cache: dict[str, Budget] = {}

    # -- the exchange: retries and status handling

    def _exchange(self, call: _Call) -> _Op[httpx.Response]:
        """Send ``call``, retrying per ``call.retry`` with bounded backoff; a status not in ``ok`` raises."""
        policy, attempt = self.retry_policy, 0
        while True:
            try:
                response: httpx.Response = yield call
            except httpx.TransportError as exc:
                if attempt + 1 >= policy.attempts or not _should_retry_exception(call.retry, exc):
                    raise
                yield _Sleep(policy.delay(attempt))
                attempt += 1
                continue
            if response.status_code in call.ok:
                return response
            if attempt + 1 >= policy.attempts or not _should_retry_response(call.retry, response):
                raise error_from_response(response)
            yield _Sleep(policy.delay(attempt, response))
            attempt += 1

    def _fetch(self, call: _Call, parse: Callable[[Any], T]) -> _Op[T]:
        response = yield from self._exchange(call)
        return parse(response.json())

    # -- health

    @_endpoint
    def health(self) -> _Op[dict[str, str]]:
        """``GET /healthz``: the process answers."""
        return self._fetch(_get("/healthz"), dict)

    @_endpoint
    def ready(self) -> _Op[dict[str, str]]:
        """``GET /readyz``: the database answers."""
        return self._fetch(_get("/readyz"), dict)

    # -- keys (admin)

    @_endpoint
    def create_key(self, name: str, role: str) -> _Op[ApiKey]:
        """Create an API key; ``.key`` is shown only in this response."""
        call = _Call("POST", "/v1/keys", Retry.CONNECT, {"name": name, "role": role})
        return self._fetch(call, ApiKey.from_json)

    @_endpoint
    def list_keys(self) -> _Op[list[ApiKey]]:
        return self._fetch(_get("/v1/keys"), _list_of(ApiKey))

    # -- datasets

    @_endpoint
    def upload_dataset(
        self,
        file: str | Path | bytes,
        schema: Mapping[str, Any] | str,
        name: str | None = None,
        *,
        filename: str | None = None,
    ) -> _Op[Dataset]:
        """Upload a CSV (a path, or its bytes) with its public schema (admin)."""
        if isinstance(file, bytes):
            content, default_name = file, "data.csv"
        else:
            content, default_name = Path(file).read_bytes(), Path(file).name
        data = {"schema": schema if isinstance(schema, str) else json.dumps(dict(schema))}
        if name is not None:
            data["name"] = name
        files = {"file": (filename or default_name, content, "text/csv")}
        call = _Call("POST", "/v1/datasets", Retry.CONNECT, data=data, files=files)
        return self._fetch(call, Dataset.from_json)

    @_endpoint
    def list_datasets(self) -> _Op[list[Dataset]]:
        return self._fetch(_get("/v1/datasets"), _list_of(Dataset))

    @_endpoint
    def get_dataset(self, dataset_id: str) -> _Op[Dataset]:
        return self._fetch(_get(f"/v1/datasets/{dataset_id}"), Dataset.from_json)

    @_endpoint
    def grant(self, dataset_id: str, analyst: str) -> _Op[Grant]:
        """Grant an analyst key access (admin; idempotent: ``created`` is False the second time)."""
        call = _Call("POST", f"/v1/datasets/{dataset_id}/grants", Retry.SAFE, {"analyst": analyst})
        return self._fetch(call, Grant.from_json)

    @_endpoint
    def grants(self, dataset_id: str) -> _Op[list[str]]:
        return self._fetch(_get(f"/v1/datasets/{dataset_id}/grants"), list)

    # -- budgets

    @_endpoint
    def set_budget(
        self, dataset_id: str, epsilon: float, delta: float, analyst: str | None = None
    ) -> _Op[Budget]:
        """Set the dataset's (or an analyst's) (ε, δ) budget (admin); δ = 0 makes a pure filter."""
        call = _Call(
            "PUT", _budget_path(dataset_id, analyst), Retry.SAFE, {"epsilon": epsilon, "delta": delta}
        )
        return _budget((yield from self._exchange(call)))

    @_endpoint
    def get_budget(
        self, dataset_id: str, analyst: str | None = None, *, etag: str | None = None
    ) -> _Op[Budget | None]:
        """The budget view; with ``etag`` (a previous ``Budget.etag``), None when nothing changed (304)."""
        headers = {"If-None-Match": etag} if etag else {}
        call = _Call("GET", _budget_path(dataset_id, analyst), Retry.SAFE, headers=headers, ok=(200, 304))
        response = yield from self._exchange(call)
        return None if response.status_code == 304 else _budget(response)

    @_endpoint
    def get_budget_cached(self, dataset_id: str, analyst: str | None = None) -> _Op[Budget]:
        """The budget view, revalidated with ``If-None-Match``: the cached object itself when unchanged."""
        path = _budget_path(dataset_id, analyst)
        cached = self._budget_cache.get(path)
        etag = cached.etag if cached else None
        fresh = yield from _Endpoints.get_budget(self, dataset_id, analyst, etag=etag)
        if fresh is None:
            assert cached is not None
            return cached
        self._budget_cache[path] = fresh
        return fresh

    # -- requests

    @_endpoint
    def estimate(self, dataset_id: str, mechanism: str, params: Mapping[str, Any]) -> _Op[Estimate]:
        """Dry run: the worst case and whether it would be admitted now (nothing is charged)."""
        path, body = f"/v1/datasets/{dataset_id}/requests:estimate", _request_body(mechanism, params)
        return self._fetch(_Call("POST", path, Retry.SAFE, body), Estimate.from_json)

    @_endpoint
    def submit(
        self,
        dataset_id: str,
        mechanism: str,
        params: Mapping[str, Any],
        *,
        idempotency_key: str | None = None,
        wait: bool = True,
        timeout: float = 300.0,
        poll_interval: float = 0.25,
        progress: Progress | None = None,
    ) -> _Op[AnalysisRequest]:
        """Run a mechanism. Retries reuse one Idempotency-Key (generated unless given). On 202, polls until
        the request leaves ``running`` (unless ``wait=False``), calling ``progress(request_dict)`` with the
        202 body and after each poll; the dict has ``progress`` (fraction done) when the server shows it."""
        path, body = f"/v1/datasets/{dataset_id}/requests", _request_body(mechanism, params)
        call = replace(_keyed_post(path, body, idempotency_key), ok=(200, 202))
        if not wait:  # answer 202 at once rather than after the server's wait window
            call = replace(call, headers={**call.headers, "Prefer": "respond-async"})
        started = time.monotonic()
        response = yield from self._exchange(call)
        request = AnalysisRequest.from_json(response.json())
        if response.status_code == 200 or request.state != "running" or not wait:
            return _settled(request)
        if progress is not None:
            yield _Report(progress, request.raw)
        return (
            yield from _Endpoints.wait_request(
                self,
                request.id,
                timeout=max(0.0, timeout - (time.monotonic() - started)),
                poll_interval=poll_interval,
                progress=progress,
            )
        )

    @_endpoint
    def wait_request(
        self,
        request_id: str,
        *,
        timeout: float = 300.0,
        poll_interval: float = 0.25,
        progress: Progress | None = None,
    ) -> _Op[AnalysisRequest]:
        """Poll ``GET /v1/requests/{id}`` until it leaves ``running`` (ExpostTimeoutError at timeout),
        calling ``progress(request_dict)`` after each poll."""
        deadline = time.monotonic() + timeout
        while True:
            request = yield from _Endpoints.get_request(self, request_id)
            if progress is not None:
                yield _Report(progress, request.raw)
            if request.state != "running":
                return _settled(request)
            if time.monotonic() >= deadline:
                raise ExpostTimeoutError(request, timeout)
            yield _Sleep(min(poll_interval, max(0.0, deadline - time.monotonic())))

    @_endpoint
    def get_request(self, request_id: str) -> _Op[AnalysisRequest]:
        return self._fetch(_get(f"/v1/requests/{request_id}"), AnalysisRequest.from_json)

    @_endpoint
    def cancel(self, request_id: str) -> _Op[AnalysisRequest]:
        """Cancel a request (yours, or any as an admin): still queued, it is aborted and charged nothing;
        already running, it is charged its worst case and stopped. Retried safely: cancelling a cancelled
        request returns it; a request that already finished is a ConflictError (409)."""
        call = _Call("POST", f"/v1/requests/{request_id}/cancel", Retry.SAFE, ok=(200,))
        return self._fetch(call, AnalysisRequest.from_json)

    @_endpoint
    def get_limits(self, analyst: str) -> _Op[Limits]:
        """An analyst's execution limits and what is in use now (admins, or the analyst itself)."""
        return self._fetch(_get(f"/v1/analysts/{analyst}/limits"), Limits.from_json)

    @_endpoint
    def set_limits(
        self, analyst: str, *, max_running_requests: int | None = None, max_open_sessions: int | None = None
    ) -> _Op[Limits]:
        """Admins: set an analyst's limits (None: the service default)."""
        body = {"max_running_requests": max_running_requests, "max_open_sessions": max_open_sessions}
        call = _Call("PUT", f"/v1/analysts/{analyst}/limits", Retry.SAFE, body, ok=(200,))
        return self._fetch(call, Limits.from_json)

    @_endpoint
    def privacy_report(self, request_id: str, record: Mapping[str, Any]) -> _Op[PrivacyReport]:
        """Evaluate a committed release's per-instance privacy report on ``record`` (your own row: feature
        values and the label by column name). Reads no data and charges nothing, so it is retried safely;
        the server rate-limits it per key (a 429 is an ExpostError, not retried)."""
        body = {"record": dict(record)}
        call = _Call("POST", f"/v1/requests/{request_id}/privacy-report", Retry.SAFE, body, ok=(200,))
        return self._fetch(call, PrivacyReport.from_json)

    # -- sessions

    @_endpoint
    def open_session(
        self,
        dataset_id: str,
        mechanism: str,
        params: Mapping[str, Any],
        *,
        idempotency_key: str | None = None,
    ) -> _Op[Session]:
        """Open an interactive session (reserves its worst case); retries reuse one Idempotency-Key."""
        path, body = f"/v1/datasets/{dataset_id}/sessions", _request_body(mechanism, params)
        return self._fetch(_keyed_post(path, body, idempotency_key), Session.from_json)

    @_endpoint
    def ask(
        self,
        session_id: str,
        query: Mapping[str, Any],
        epsilon: float | None = None,
        *,
        idempotency_key: str | None = None,
    ) -> _Op[Answer]:
        """Ask one query of an open session; retries reuse one Idempotency-Key."""
        body: dict[str, Any] = {"query": dict(query)} | ({} if epsilon is None else {"epsilon": epsilon})
        call = _keyed_post(f"/v1/sessions/{session_id}/queries", body, idempotency_key)
        return self._fetch(call, Answer.from_json)

    @_endpoint
    def next(self, session_id: str, *, idempotency_key: str | None = None) -> _Op[Answer]:
        """Noise-reduction sessions: release the next, less noisy level (``POST /v1/sessions/{id}/next``).
        Retries reuse one Idempotency-Key, so a lost answer is replayed rather than a level skipped."""
        call = _keyed_post(f"/v1/sessions/{session_id}/next", None, idempotency_key)
        return self._fetch(call, Answer.from_json)

    @_endpoint
    def close_session(self, session_id: str) -> _Op[Session]:
        """Close now and commit the charge of the outcome (idempotent)."""
        return self._fetch(_Call("POST", f"/v1/sessions/{session_id}/close", Retry.SAFE), Session.from_json)

    @_endpoint
    def get_session(self, session_id: str) -> _Op[Session]:
        return self._fetch(_get(f"/v1/sessions/{session_id}"), Session.from_json)

    # -- catalog, ledger and dashboard

    @_endpoint
    def mechanisms(self) -> _Op[list[MechanismInfo]]:
        return self._fetch(_get("/v1/mechanisms"), _list_of(MechanismInfo))

    @_endpoint
    def ledger_page(self, dataset_id: str, *, after: int = 0, limit: int = 100) -> _Op[LedgerPage]:
        call = _get(f"/v1/datasets/{dataset_id}/ledger", after=after, limit=limit)
        return self._fetch(call, LedgerPage.from_json)

    @_endpoint
    def activity(self, dataset_id: str) -> _Op[dict[str, Any]]:
        """Running requests and open sessions (public facts only: no answers, no secret state)."""
        return self._fetch(_get(f"/v1/datasets/{dataset_id}/activity"), dict)

    @_endpoint
    def refusals_page(self, dataset_id: str, *, after: int = 0, limit: int = 100) -> _Op[LedgerPage]:
        """One page of recorded refusals (``items`` and ``next_after``, like the ledger)."""
        call = _get(f"/v1/datasets/{dataset_id}/refusals", after=after, limit=limit)
        return self._fetch(call, LedgerPage.from_json)

    @_stream_endpoint
    def ledger(self, dataset_id: str, *, after: int = 0, page_size: int = 100) -> _Stream:
        """Every ledger entry the caller may see, in order, walking all pages."""
        while True:
            page = yield from _Endpoints.ledger_page(self, dataset_id, after=after, limit=page_size)
            for item in page.items:
                yield _Emit(item)
            if page.next_after is None:
                return
            after = page.next_after


def _advance(op: Generator[_Effect, Any, Any], reply: Any, error: BaseException | None) -> _Effect:
    """Resume ``op`` with the last effect's result, or throw its error in (StopIteration when done)."""
    return op.throw(error) if error is not None else op.send(reply)


def _returning(op: _Op[T], into: list[T]) -> _Stream:
    """``op`` as a stream that emits nothing and stores its result in ``into`` (one loop per driver)."""
    into.append((yield from op))


# ----- the drivers --------------------------------------------------------------------------------------


class ExpostClient(_Endpoints):
    """Blocking client. Use as a context manager, or call :meth:`close`."""

    def __init__(
        self,
        base_url: str = DEFAULT_URL,
        key: str | None = None,
        *,
        timeout: float = 30.0,
        retry: RetryPolicy | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        super().__init__(base_url, key, retry)
        self._http = httpx.Client(
            base_url=self.base_url, headers=self._headers, timeout=timeout, transport=transport
        )

    def __enter__(self) -> ExpostClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _stream(self, op: _Stream) -> Iterator[_Item]:
        reply, error = None, None
        while True:
            try:
                effect = _advance(op, reply, error)
            except StopIteration:
                return
            reply, error = None, None
            if isinstance(effect, _Call):
                try:
                    reply = self._http.request(**effect.request_args())
                except httpx.TransportError as exc:
                    error = exc
            elif isinstance(effect, _Sleep):
                time.sleep(effect.seconds)
            elif isinstance(effect, _Report):
                effect.progress(effect.body)
            else:
                yield effect.item

    def _execute(self, op: _Op[T]) -> T:
        result: list[T] = []
        for _ in self._stream(_returning(op, result)):
            pass
        return result[0]


class AsyncExpostClient(_Endpoints):
    """The asyncio twin of :class:`ExpostClient`: the same methods, awaited (``ledger`` is an async
    iterator, and a ``progress`` callback may be a coroutine function)."""

    def __init__(
        self,
        base_url: str = DEFAULT_URL,
        key: str | None = None,
        *,
        timeout: float = 30.0,
        retry: RetryPolicy | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        super().__init__(base_url, key, retry)
        self._http = httpx.AsyncClient(
            base_url=self.base_url, headers=self._headers, timeout=timeout, transport=transport
        )

    async def __aenter__(self) -> AsyncExpostClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._http.aclose()

    async def _stream(self, op: _Stream) -> AsyncIterator[_Item]:
        reply, error = None, None
        while True:
            try:
                effect = _advance(op, reply, error)
            except StopIteration:
                return
            reply, error = None, None
            if isinstance(effect, _Call):
                try:
                    reply = await self._http.request(**effect.request_args())
                except httpx.TransportError as exc:
                    error = exc
            elif isinstance(effect, _Sleep):
                await asyncio.sleep(effect.seconds)
            elif isinstance(effect, _Report):
                result = effect.progress(effect.body)
                if inspect.isawaitable(result):
                    await result
            else:
                yield effect.item

    async def _execute(self, op: _Op[T]) -> T:
        result: list[T] = []
        async for _ in self._stream(_returning(op, result)):
            pass
        return result[0]
