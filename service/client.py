"""A typed Python client for the expost HTTP API, sync (:class:`ExpostClient`) and async
(:class:`AsyncExpostClient`), with the same methods.

It imports only httpx and pydantic (never FastAPI or SQLAlchemy), so it can be used from any process that
can reach the server. ``service.schemas`` pulls in SQLAlchemy through ``service.auth``, so the response
models here are the client's own, lenient (unknown fields are kept) copies of the server's.

* problem+json responses become exceptions: :class:`ExpostError` and its subclasses
  (:class:`BudgetExhaustedError` for ``/problems/budget-exhausted`` and ``/problems/not-admissible``,
  :class:`InvalidInputError`, :class:`NotFoundError`, :class:`AuthError`, :class:`ConflictError`,
  :class:`ServerError`).
* ``submit``, ``open_session`` and ``ask`` send an ``Idempotency-Key`` (generated unless given) and, on a
  connection error or a 5xx, retry with the same key, so a lost response never charges twice. Other calls
  are retried only when they are safe to repeat (GET, PUT, grants, estimates, closing a session); key and
  dataset creation only when the connection could not even be opened. 4xx responses are never retried.
* ``submit`` follows a ``202 Accepted`` by polling ``GET /v1/requests/{id}`` until the request leaves
  ``running`` (calling ``progress(request_dict)`` with the 202 body and after each poll), up to a timeout.
"""

from __future__ import annotations

import asyncio
import enum
import inspect
import json
import random
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

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
    "MechanismFailedError",
    "MechanismInfo",
    "NotFoundError",
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
        return base * (0.5 + random.random() / 2)  # jitter, not cryptography


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


@dataclass
class _Call:
    method: str
    path: str
    retry: Retry
    json: Any = None
    params: dict[str, Any] | None = None
    headers: dict[str, str] = field(default_factory=dict)
    data: dict[str, str] | None = None
    files: dict[str, tuple[str, bytes, str]] | None = None


def _new_key() -> str:
    return f"expost-{uuid.uuid4()}"


def _budget_path(dataset_id: str, analyst: str | None) -> str:
    if analyst is None:
        return f"/v1/datasets/{dataset_id}/budget"
    return f"/v1/datasets/{dataset_id}/analysts/{analyst}/budget"


def _upload_call(
    file: str | Path | bytes, schema: Mapping[str, Any] | str, name: str | None, filename: str | None
) -> _Call:
    if isinstance(file, bytes):
        content, default_name = file, "data.csv"
    else:
        path = Path(file)
        content, default_name = path.read_bytes(), path.name
    data = {"schema": schema if isinstance(schema, str) else json.dumps(dict(schema))}
    if name is not None:
        data["name"] = name
    return _Call(
        "POST",
        "/v1/datasets",
        Retry.CONNECT,
        data=data,
        files={"file": (filename or default_name, content, "text/csv")},
    )


def _request_body(mechanism: str, params: Mapping[str, Any]) -> dict[str, Any]:
    return {"mechanism": mechanism, "params": dict(params)}


def _ask_body(query: Mapping[str, Any], epsilon: float | None) -> dict[str, Any]:
    body: dict[str, Any] = {"query": dict(query)}
    if epsilon is not None:
        body["epsilon"] = epsilon
    return body


def _parse_list(model: type[M], data: Any) -> list[M]:
    return [model.from_json(item) for item in data]


def _budget(response: httpx.Response) -> Budget:
    budget = Budget.from_json(response.json())
    budget.etag = response.headers.get("etag")
    return budget


def _failed(request: AnalysisRequest) -> MechanismFailedError:
    type_ = "/problems/mechanism-failed"
    title = "The mechanism failed after reading the data; its worst case was charged"
    detail = request.error or "failed"
    body = {
        "type": type_,
        "title": title,
        "status": 500,
        "detail": detail,
        "request_id": request.id,
        "charged": request.raw.get("realized"),
    }
    return MechanismFailedError(500, type_, title, detail, body)


def _settled(request: AnalysisRequest) -> AnalysisRequest:
    if request.state == "failed_charged":
        raise _failed(request)
    return request


class _Base:
    def __init__(
        self,
        base_url: str,
        key: str | None,
        retry: RetryPolicy | None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.retry_policy = retry or RetryPolicy()
        self._headers = {"User-Agent": USER_AGENT, "Accept": "application/json, application/problem+json"}
        if key:
            self._headers["Authorization"] = f"Bearer {key}"
        self._budget_cache: dict[str, Budget] = {}


# ----- the sync client ----------------------------------------------------------------------------------


class ExpostClient(_Base):
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

    # -- transport

    def _send(self, call: _Call, ok: tuple[int, ...] = (200, 201)) -> httpx.Response:
        attempt = 0
        while True:
            try:
                response = self._http.request(
                    call.method,
                    call.path,
                    json=call.json,
                    params=call.params,
                    headers=call.headers,
                    data=call.data,
                    files=call.files,
                )
            except httpx.TransportError as exc:
                if attempt + 1 >= self.retry_policy.attempts or not _should_retry_exception(call.retry, exc):
                    raise
                time.sleep(self.retry_policy.delay(attempt))
                attempt += 1
                continue
            if response.status_code in ok:
                return response
            if attempt + 1 < self.retry_policy.attempts and _should_retry_response(call.retry, response):
                time.sleep(self.retry_policy.delay(attempt, response))
                attempt += 1
                continue
            raise error_from_response(response)

    def _json(self, call: _Call) -> Any:
        return self._send(call).json()

    # -- health

    def health(self) -> dict[str, str]:
        """``GET /healthz``: the process answers."""
        return dict(self._json(_Call("GET", "/healthz", Retry.SAFE)))

    def ready(self) -> dict[str, str]:
        """``GET /readyz``: the database answers."""
        return dict(self._json(_Call("GET", "/readyz", Retry.SAFE)))

    # -- keys (admin)

    def create_key(self, name: str, role: str) -> ApiKey:
        """Create an API key; ``.key`` is shown only in this response."""
        return ApiKey.from_json(
            self._json(_Call("POST", "/v1/keys", Retry.CONNECT, {"name": name, "role": role}))
        )

    def list_keys(self) -> list[ApiKey]:
        return _parse_list(ApiKey, self._json(_Call("GET", "/v1/keys", Retry.SAFE)))

    # -- datasets

    def upload_dataset(
        self,
        file: str | Path | bytes,
        schema: Mapping[str, Any] | str,
        name: str | None = None,
        *,
        filename: str | None = None,
    ) -> Dataset:
        """Upload a CSV (a path, or its bytes) with its public schema (admin)."""
        return Dataset.from_json(self._json(_upload_call(file, schema, name, filename)))

    def list_datasets(self) -> list[Dataset]:
        return _parse_list(Dataset, self._json(_Call("GET", "/v1/datasets", Retry.SAFE)))

    def get_dataset(self, dataset_id: str) -> Dataset:
        return Dataset.from_json(self._json(_Call("GET", f"/v1/datasets/{dataset_id}", Retry.SAFE)))

    def grant(self, dataset_id: str, analyst: str) -> Grant:
        """Grant an analyst key access (admin; idempotent: ``created`` is False the second time)."""
        call = _Call("POST", f"/v1/datasets/{dataset_id}/grants", Retry.SAFE, {"analyst": analyst})
        return Grant.from_json(self._json(call))

    def grants(self, dataset_id: str) -> list[str]:
        return list(self._json(_Call("GET", f"/v1/datasets/{dataset_id}/grants", Retry.SAFE)))

    # -- budgets

    def set_budget(self, dataset_id: str, epsilon: float, delta: float, analyst: str | None = None) -> Budget:
        """Set the dataset's (or an analyst's) (ε, δ) budget (admin); δ = 0 makes a pure filter."""
        call = _Call(
            "PUT", _budget_path(dataset_id, analyst), Retry.SAFE, {"epsilon": epsilon, "delta": delta}
        )
        return _budget(self._send(call))

    def get_budget(
        self, dataset_id: str, analyst: str | None = None, *, etag: str | None = None
    ) -> Budget | None:
        """The budget view; with ``etag`` (a previous ``Budget.etag``), None when nothing changed (304)."""
        headers = {"If-None-Match": etag} if etag else {}
        call = _Call("GET", _budget_path(dataset_id, analyst), Retry.SAFE, headers=headers)
        response = self._send(call, ok=(200, 304))
        return None if response.status_code == 304 else _budget(response)

    def get_budget_cached(self, dataset_id: str, analyst: str | None = None) -> Budget:
        """The budget view, revalidated with ``If-None-Match``: the cached object itself when unchanged."""
        path = _budget_path(dataset_id, analyst)
        cached = self._budget_cache.get(path)
        fresh = self.get_budget(dataset_id, analyst, etag=cached.etag if cached else None)
        if fresh is None:
            assert cached is not None
            return cached
        self._budget_cache[path] = fresh
        return fresh

    # -- requests

    def estimate(self, dataset_id: str, mechanism: str, params: Mapping[str, Any]) -> Estimate:
        """Dry run: the worst case and whether it would be admitted now (nothing is charged)."""
        call = _Call(
            "POST",
            f"/v1/datasets/{dataset_id}/requests:estimate",
            Retry.SAFE,
            _request_body(mechanism, params),
        )
        return Estimate.from_json(self._json(call))

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
    ) -> AnalysisRequest:
        """Run a mechanism. Retries reuse one Idempotency-Key (generated unless given). On 202, polls until
        the request leaves ``running`` (unless ``wait=False``), calling ``progress(request_dict)``."""
        key = idempotency_key or _new_key()
        call = _Call(
            "POST",
            f"/v1/datasets/{dataset_id}/requests",
            Retry.SAFE,
            _request_body(mechanism, params),
            headers={"Idempotency-Key": key},
        )
        started = time.monotonic()
        response = self._send(call, ok=(200, 202))
        request = AnalysisRequest.from_json(response.json())
        if response.status_code == 200 or request.state != "running" or not wait:
            return _settled(request) if request.state != "running" else request
        if progress is not None:
            progress(request.raw)
        return self.wait_request(
            request.id,
            timeout=max(0.0, timeout - (time.monotonic() - started)),
            poll_interval=poll_interval,
            progress=progress,
        )

    def wait_request(
        self,
        request_id: str,
        *,
        timeout: float = 300.0,
        poll_interval: float = 0.25,
        progress: Progress | None = None,
    ) -> AnalysisRequest:
        """Poll ``GET /v1/requests/{id}`` until it leaves ``running`` (ExpostTimeoutError at timeout)."""
        deadline = time.monotonic() + timeout
        while True:
            request = self.get_request(request_id)
            if progress is not None:
                progress(request.raw)
            if request.state != "running":
                return _settled(request)
            if time.monotonic() >= deadline:
                raise ExpostTimeoutError(request, timeout)
            time.sleep(min(poll_interval, max(0.0, deadline - time.monotonic())))

    def get_request(self, request_id: str) -> AnalysisRequest:
        return AnalysisRequest.from_json(self._json(_Call("GET", f"/v1/requests/{request_id}", Retry.SAFE)))

    # -- sessions

    def open_session(
        self,
        dataset_id: str,
        mechanism: str,
        params: Mapping[str, Any],
        *,
        idempotency_key: str | None = None,
    ) -> Session:
        """Open an interactive session (reserves its worst case); retries reuse one Idempotency-Key."""
        call = _Call(
            "POST",
            f"/v1/datasets/{dataset_id}/sessions",
            Retry.SAFE,
            _request_body(mechanism, params),
            headers={"Idempotency-Key": idempotency_key or _new_key()},
        )
        return Session.from_json(self._json(call))

    def ask(
        self,
        session_id: str,
        query: Mapping[str, Any],
        epsilon: float | None = None,
        *,
        idempotency_key: str | None = None,
    ) -> Answer:
        """Ask one query of an open session; retries reuse one Idempotency-Key."""
        call = _Call(
            "POST",
            f"/v1/sessions/{session_id}/queries",
            Retry.SAFE,
            _ask_body(query, epsilon),
            headers={"Idempotency-Key": idempotency_key or _new_key()},
        )
        return Answer.from_json(self._json(call))

    def close_session(self, session_id: str) -> Session:
        """Close now and commit the charge of the outcome (idempotent)."""
        return Session.from_json(self._json(_Call("POST", f"/v1/sessions/{session_id}/close", Retry.SAFE)))

    def get_session(self, session_id: str) -> Session:
        return Session.from_json(self._json(_Call("GET", f"/v1/sessions/{session_id}", Retry.SAFE)))

    # -- catalog and ledger

    def mechanisms(self) -> list[MechanismInfo]:
        return _parse_list(MechanismInfo, self._json(_Call("GET", "/v1/mechanisms", Retry.SAFE)))

    def ledger_page(self, dataset_id: str, *, after: int = 0, limit: int = 100) -> LedgerPage:
        call = _Call(
            "GET", f"/v1/datasets/{dataset_id}/ledger", Retry.SAFE, params={"after": after, "limit": limit}
        )
        return LedgerPage.from_json(self._json(call))

    def activity(self, dataset_id: str) -> dict[str, Any]:
        """Running requests and open sessions (public facts only: no answers, no secret state)."""
        return dict(self._json(_Call("GET", f"/v1/datasets/{dataset_id}/activity", Retry.SAFE)))

    def refusals_page(self, dataset_id: str, *, after: int = 0, limit: int = 100) -> LedgerPage:
        """One page of recorded refusals (``items`` and ``next_after``, like the ledger)."""
        call = _Call(
            "GET", f"/v1/datasets/{dataset_id}/refusals", Retry.SAFE, params={"after": after, "limit": limit}
        )
        return LedgerPage.from_json(self._json(call))

    def ledger(self, dataset_id: str, *, after: int = 0, page_size: int = 100) -> Iterator[dict[str, Any]]:
        """Every ledger entry the caller may see, in order, walking all pages."""
        while True:
            page = self.ledger_page(dataset_id, after=after, limit=page_size)
            yield from page.items
            if page.next_after is None:
                return
            after = page.next_after


# ----- the async client ---------------------------------------------------------------------------------


class AsyncExpostClient(_Base):
    """The asyncio twin of :class:`ExpostClient` (same methods, awaited; ``ledger`` is an async iterator)."""

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

    async def _send(self, call: _Call, ok: tuple[int, ...] = (200, 201)) -> httpx.Response:
        attempt = 0
        while True:
            try:
                response = await self._http.request(
                    call.method,
                    call.path,
                    json=call.json,
                    params=call.params,
                    headers=call.headers,
                    data=call.data,
                    files=call.files,
                )
            except httpx.TransportError as exc:
                if attempt + 1 >= self.retry_policy.attempts or not _should_retry_exception(call.retry, exc):
                    raise
                await asyncio.sleep(self.retry_policy.delay(attempt))
                attempt += 1
                continue
            if response.status_code in ok:
                return response
            if attempt + 1 < self.retry_policy.attempts and _should_retry_response(call.retry, response):
                await asyncio.sleep(self.retry_policy.delay(attempt, response))
                attempt += 1
                continue
            raise error_from_response(response)

    async def _json(self, call: _Call) -> Any:
        return (await self._send(call)).json()

    @staticmethod
    async def _report(progress: Progress | None, body: dict[str, Any]) -> None:
        if progress is not None:
            result = progress(body)
            if inspect.isawaitable(result):
                await result

    async def health(self) -> dict[str, str]:
        return dict(await self._json(_Call("GET", "/healthz", Retry.SAFE)))

    async def ready(self) -> dict[str, str]:
        return dict(await self._json(_Call("GET", "/readyz", Retry.SAFE)))

    async def create_key(self, name: str, role: str) -> ApiKey:
        call = _Call("POST", "/v1/keys", Retry.CONNECT, {"name": name, "role": role})
        return ApiKey.from_json(await self._json(call))

    async def list_keys(self) -> list[ApiKey]:
        return _parse_list(ApiKey, await self._json(_Call("GET", "/v1/keys", Retry.SAFE)))

    async def upload_dataset(
        self,
        file: str | Path | bytes,
        schema: Mapping[str, Any] | str,
        name: str | None = None,
        *,
        filename: str | None = None,
    ) -> Dataset:
        return Dataset.from_json(await self._json(_upload_call(file, schema, name, filename)))

    async def list_datasets(self) -> list[Dataset]:
        return _parse_list(Dataset, await self._json(_Call("GET", "/v1/datasets", Retry.SAFE)))

    async def get_dataset(self, dataset_id: str) -> Dataset:
        return Dataset.from_json(await self._json(_Call("GET", f"/v1/datasets/{dataset_id}", Retry.SAFE)))

    async def grant(self, dataset_id: str, analyst: str) -> Grant:
        call = _Call("POST", f"/v1/datasets/{dataset_id}/grants", Retry.SAFE, {"analyst": analyst})
        return Grant.from_json(await self._json(call))

    async def grants(self, dataset_id: str) -> list[str]:
        return list(await self._json(_Call("GET", f"/v1/datasets/{dataset_id}/grants", Retry.SAFE)))

    async def set_budget(
        self, dataset_id: str, epsilon: float, delta: float, analyst: str | None = None
    ) -> Budget:
        call = _Call(
            "PUT", _budget_path(dataset_id, analyst), Retry.SAFE, {"epsilon": epsilon, "delta": delta}
        )
        return _budget(await self._send(call))

    async def get_budget(
        self, dataset_id: str, analyst: str | None = None, *, etag: str | None = None
    ) -> Budget | None:
        headers = {"If-None-Match": etag} if etag else {}
        call = _Call("GET", _budget_path(dataset_id, analyst), Retry.SAFE, headers=headers)
        response = await self._send(call, ok=(200, 304))
        return None if response.status_code == 304 else _budget(response)

    async def get_budget_cached(self, dataset_id: str, analyst: str | None = None) -> Budget:
        path = _budget_path(dataset_id, analyst)
        cached = self._budget_cache.get(path)
        fresh = await self.get_budget(dataset_id, analyst, etag=cached.etag if cached else None)
        if fresh is None:
            assert cached is not None
            return cached
        self._budget_cache[path] = fresh
        return fresh

    async def estimate(self, dataset_id: str, mechanism: str, params: Mapping[str, Any]) -> Estimate:
        call = _Call(
            "POST",
            f"/v1/datasets/{dataset_id}/requests:estimate",
            Retry.SAFE,
            _request_body(mechanism, params),
        )
        return Estimate.from_json(await self._json(call))

    async def submit(
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
    ) -> AnalysisRequest:
        key = idempotency_key or _new_key()
        call = _Call(
            "POST",
            f"/v1/datasets/{dataset_id}/requests",
            Retry.SAFE,
            _request_body(mechanism, params),
            headers={"Idempotency-Key": key},
        )
        started = time.monotonic()
        response = await self._send(call, ok=(200, 202))
        request = AnalysisRequest.from_json(response.json())
        if response.status_code == 200 or request.state != "running" or not wait:
            return _settled(request) if request.state != "running" else request
        await self._report(progress, request.raw)
        return await self.wait_request(
            request.id,
            timeout=max(0.0, timeout - (time.monotonic() - started)),
            poll_interval=poll_interval,
            progress=progress,
        )

    async def wait_request(
        self,
        request_id: str,
        *,
        timeout: float = 300.0,
        poll_interval: float = 0.25,
        progress: Progress | None = None,
    ) -> AnalysisRequest:
        deadline = time.monotonic() + timeout
        while True:
            request = await self.get_request(request_id)
            await self._report(progress, request.raw)
            if request.state != "running":
                return _settled(request)
            if time.monotonic() >= deadline:
                raise ExpostTimeoutError(request, timeout)
            await asyncio.sleep(min(poll_interval, max(0.0, deadline - time.monotonic())))

    async def get_request(self, request_id: str) -> AnalysisRequest:
        call = _Call("GET", f"/v1/requests/{request_id}", Retry.SAFE)
        return AnalysisRequest.from_json(await self._json(call))

    async def open_session(
        self,
        dataset_id: str,
        mechanism: str,
        params: Mapping[str, Any],
        *,
        idempotency_key: str | None = None,
    ) -> Session:
        call = _Call(
            "POST",
            f"/v1/datasets/{dataset_id}/sessions",
            Retry.SAFE,
            _request_body(mechanism, params),
            headers={"Idempotency-Key": idempotency_key or _new_key()},
        )
        return Session.from_json(await self._json(call))

    async def ask(
        self,
        session_id: str,
        query: Mapping[str, Any],
        epsilon: float | None = None,
        *,
        idempotency_key: str | None = None,
    ) -> Answer:
        call = _Call(
            "POST",
            f"/v1/sessions/{session_id}/queries",
            Retry.SAFE,
            _ask_body(query, epsilon),
            headers={"Idempotency-Key": idempotency_key or _new_key()},
        )
        return Answer.from_json(await self._json(call))

    async def close_session(self, session_id: str) -> Session:
        call = _Call("POST", f"/v1/sessions/{session_id}/close", Retry.SAFE)
        return Session.from_json(await self._json(call))

    async def get_session(self, session_id: str) -> Session:
        return Session.from_json(await self._json(_Call("GET", f"/v1/sessions/{session_id}", Retry.SAFE)))

    async def mechanisms(self) -> list[MechanismInfo]:
        return _parse_list(MechanismInfo, await self._json(_Call("GET", "/v1/mechanisms", Retry.SAFE)))

    async def ledger_page(self, dataset_id: str, *, after: int = 0, limit: int = 100) -> LedgerPage:
        call = _Call(
            "GET", f"/v1/datasets/{dataset_id}/ledger", Retry.SAFE, params={"after": after, "limit": limit}
        )
        return LedgerPage.from_json(await self._json(call))

    async def activity(self, dataset_id: str) -> dict[str, Any]:
        return dict(await self._json(_Call("GET", f"/v1/datasets/{dataset_id}/activity", Retry.SAFE)))

    async def refusals_page(self, dataset_id: str, *, after: int = 0, limit: int = 100) -> LedgerPage:
        call = _Call(
            "GET", f"/v1/datasets/{dataset_id}/refusals", Retry.SAFE, params={"after": after, "limit": limit}
        )
        return LedgerPage.from_json(await self._json(call))

    async def ledger(
        self, dataset_id: str, *, after: int = 0, page_size: int = 100
    ) -> AsyncIterator[dict[str, Any]]:
        while True:
            page = await self.ledger_page(dataset_id, after=after, limit=page_size)
            for item in page.items:
                yield item
            if page.next_after is None:
                return
            after = page.next_after
