"""One request layer for both clients: every endpoint of the HTTP API, written once as a sans-IO generator.

Every endpoint is written once, below in ``_Endpoints``, as a generator: it yields effects and returns the
parsed result. ``_Call`` sends one HTTP attempt (the driver resumes the generator with the response, or
throws the transport error in); ``_Sleep`` waits; ``_Report`` calls a progress callback; ``_Emit`` hands
one item to a streaming caller. Retries, status handling, parsing, 202 polling and the ETag cache
therefore exist once; ``ExpostClient`` (expost_client.sync_client) and ``AsyncExpostClient``
(expost_client.async_client) only perform the effects, blocking or awaiting, and the ``@_endpoint``
descriptor exposes each generator as a typed method of both.
"""

from __future__ import annotations

import functools
import inspect
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar, Concatenate, Generic, Literal, ParamSpec, Protocol, Self, TypeVar, overload

import httpx

from expost_client._version import __version__
from expost_client.errors import MechanismFailedError, error_from_response
from expost_client.models import (
    AnalysisRequest,
    Answer,
    ApiKey,
    ApiModel,
    Budget,
    Dataset,
    Estimate,
    ExpostTimeoutError,
    Grant,
    LedgerPage,
    Limits,
    Me,
    MechanismInfo,
    PrivacyReport,
    RequestPage,
    Session,
    SessionPage,
)
from expost_client.retry import Retry, RetryPolicy, should_retry_exception, should_retry_response


class _SyncClient(Protocol):
    """What the descriptors below see of ``ExpostClient`` (told apart from the async one by its flag)."""

    @property
    def _asynchronous(self) -> Literal[False]: ...


class _AsyncClient(Protocol):
    """What the descriptors below see of ``AsyncExpostClient``."""

    @property
    def _asynchronous(self) -> Literal[True]: ...


DEFAULT_URL = "http://127.0.0.1:8000"
USER_AGENT = f"expost-client/{__version__}"

Progress = Callable[[dict[str, Any]], object]  # the async client awaits an awaitable result

M = TypeVar("M", bound=ApiModel)
T = TypeVar("T")
R = TypeVar("R")
E = TypeVar("E")  # the type of a stream's items
A = TypeVar("A")  # a listing's position (the ``after`` of its next page)
E_co = TypeVar("E_co", covariant=True)
A_co = TypeVar("A_co", covariant=True)


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


_Item = dict[str, Any]  # one item of an untyped paged listing (a ledger entry)


@dataclass(frozen=True)
class _Emit(Generic[E]):
    item: E


_Effect = _Call | _Sleep | _Report | _Emit[Any]
_Op = Generator[_Effect, Any, T]  # resumed with a _Call's response, else with None
_Stream = Generator[_Effect, Any, None]  # emits its items
_StreamOf = Generator[_Call | _Sleep | _Report | _Emit[E], Any, None]  # emits items of type E
P = ParamSpec("P")


class _Page(Protocol[E_co, A_co]):
    """One page of a listing: its items and the ``after`` of the next page (None: the last page)."""

    @property
    def items(self) -> Sequence[E_co]: ...

    @property
    def next_after(self) -> A_co | None: ...


def _every_item(page_at: Callable[[A], _Op[_Page[E, A]]], after: A) -> _StreamOf[E]:
    """Every item of every page, from the page after ``after`` on, walking ``next_after``."""
    while True:
        page = yield from page_at(after)
        for item in page.items:
            yield _Emit(item)
        if page.next_after is None:
            return
        after = page.next_after


def _get(path: str, **params: Any) -> _Call:
    return _Call("GET", path, Retry.SAFE, params=params or None)


def _keyed_post(path: str, body: Any, key: str | None) -> _Call:
    """A POST that may charge: retried with one Idempotency-Key, so the server replays, never re-runs."""
    return _Call("POST", path, Retry.SAFE, body, headers={"Idempotency-Key": key or f"expost-{uuid.uuid4()}"})


def _present(**params: str | None) -> dict[str, str]:
    """The query parameters that were given (httpx would send a None as an empty value)."""
    return {name: value for name, value in params.items() if value is not None}


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
    def __get__(self, client: _SyncClient, owner: type[Any]) -> Callable[P, T]: ...
    @overload
    def __get__(self, client: _AsyncClient, owner: type[Any]) -> Callable[P, Coroutine[Any, Any, T]]: ...
    def __get__(self, client: object, owner: type[Any]) -> Any:
        if client is None:
            return self
        assert isinstance(client, _Endpoints)
        op = self.op
        if client._asynchronous:

            async def run_async(*args: Any, **kwargs: Any) -> Any:
                return await client._execute(op(client, *args, **kwargs))

            return self._as_method(run_async)

        def run(*args: Any, **kwargs: Any) -> Any:
            return client._execute(op(client, *args, **kwargs))

        return self._as_method(run)


class _stream_endpoint(_Wrapped[P, _StreamOf[E]]):
    """``@_stream_endpoint``: for a generator that emits items; an iterator of them on ``ExpostClient``, an
    async iterator on ``AsyncExpostClient``."""

    @overload
    def __get__(self, client: None, owner: type[Any]) -> Self: ...
    @overload
    def __get__(self, client: _SyncClient, owner: type[Any]) -> Callable[P, Iterator[E]]: ...
    @overload
    def __get__(self, client: _AsyncClient, owner: type[Any]) -> Callable[P, AsyncIterator[E]]: ...
    def __get__(self, client: object, owner: type[Any]) -> Any:
        if client is None:
            return self
        assert isinstance(client, _Endpoints)
        op = self.op

        def stream(*args: Any, **kwargs: Any) -> Any:
            return client._stream(op(client, *args, **kwargs))

        return self._as_method(stream)


class _Endpoints:
    """Every endpoint, written once (the comment above); both clients inherit them."""

    # The driver's part: True when endpoint methods are coroutine functions (AsyncExpostClient), and how
    # an operation's effects are performed: ``_execute`` returns its result (or a coroutine of it),
    # ``_stream`` an iterator (or async iterator) of the items it emits.
    _asynchronous: ClassVar[bool] = False  # narrowed to Literal in each client

    def _execute(self, op: _Op[T]) -> Any:
        raise NotImplementedError

    def _stream(self, op: _Stream) -> Any:
        raise NotImplementedError

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
                if attempt + 1 >= policy.attempts or not should_retry_exception(call.retry, exc):
                    raise
                yield _Sleep(policy.delay(attempt))
                attempt += 1
                continue
            if response.status_code in call.ok:
                return response
            if attempt + 1 >= policy.attempts or not should_retry_response(call.retry, response):
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
    def me(self) -> _Op[Me]:
        """The caller: this key's name and role."""
        return self._fetch(_get("/v1/me"), Me.from_json)

    @_endpoint
    def list_keys(self) -> _Op[list[ApiKey]]:
        return self._fetch(_get("/v1/keys"), _list_of(ApiKey))

    @_endpoint
    def revoke_key(self, name: str) -> _Op[dict[str, Any]]:
        """Revoke an API key (admin; idempotent): ``{name, role, revoked_at}``."""
        return self._fetch(_Call("DELETE", f"/v1/keys/{name}", Retry.SAFE), dict)

    # -- datasets

    @_endpoint
    def upload_dataset(
        self,
        file: str | Path | bytes,
        schema: Mapping[str, Any] | str,
        name: str | None = None,
        *,
        filename: str | None = None,
        privacy_unit: Mapping[str, Any] | None = None,
        accounting: Literal["dataset", "individual"] | None = None,
    ) -> _Op[Dataset]:
        """Upload a CSV (a path, or its bytes) with its public schema (admin). ``privacy_unit``
        (``{"column": …, "max_rows": k}``) declares who ε protects: each unit with all its rows, at most k
        of them used per release (the schema's ``privacy_unit``; a bad declaration is a 422 naming it).
        ``accounting="individual"`` gives each unit its own budget (the dataset's): a release leaves out the
        units that cannot afford it (the schema's ``accounting``; it needs a privacy unit and ``add_remove``
        neighbours, else a 422 naming ``schema``)."""
        if isinstance(file, bytes):
            content, default_name = file, "data.csv"
        else:
            content, default_name = Path(file).read_bytes(), Path(file).name
        declared: Any = json.loads(schema) if isinstance(schema, str) else dict(schema)
        if privacy_unit is not None:
            declared = {**declared, "privacy_unit": dict(privacy_unit)}
        if accounting is not None:
            declared = {**declared, "accounting": accounting}
        data = {"schema": json.dumps(declared)}
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

    @_endpoint
    def revoke_grant(self, dataset_id: str, analyst: str) -> _Op[dict[str, Any]]:
        """Revoke an analyst's grant (admin; idempotent): ``{dataset_id, analyst, revoked}``."""
        call = _Call("DELETE", f"/v1/datasets/{dataset_id}/grants/{analyst}", Retry.SAFE)
        return self._fetch(call, dict)

    @_endpoint
    def archive_dataset(self, dataset_id: str) -> _Op[dict[str, Any]]:
        """Archive a dataset (admin; idempotent): no new requests or sessions; history and ledger stay."""
        return self._fetch(_Call("POST", f"/v1/datasets/{dataset_id}/archive", Retry.SAFE), dict)

    # -- budgets

    @_endpoint
    def set_budget(
        self,
        dataset_id: str,
        epsilon: float,
        delta: float,
        analyst: str | None = None,
        *,
        delta_share: float | None = None,
        confirm_below_spent: bool = False,
    ) -> _Op[Budget]:
        """Set the dataset's (or an analyst's) (ε, δ) budget (admin); δ = 0 makes a pure filter.
        ``delta_share`` sets part of δ aside for approximate-DP (``ptr.*``) mechanisms;
        ``confirm_below_spent`` allows a capacity below what is already spent (it refuses everything new)."""
        body: dict[str, Any] = {"epsilon": epsilon, "delta": delta}
        if delta_share is not None:
            body["delta_share"] = delta_share
        if confirm_below_spent:
            body["confirm_below_spent"] = True
        call = _Call("PUT", _budget_path(dataset_id, analyst), Retry.SAFE, body)
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
    def sql(
        self,
        dataset_id: str,
        statement: str,
        *,
        epsilon: float | None = None,
        noise: str = "laplace",
        noise_multiplier: float | None = None,
        candidates: int | None = None,
        idempotency_key: str | None = None,
        timeout: float = 300.0,
        poll_interval: float = 0.25,
    ) -> _Op[AnalysisRequest]:
        """Answer one ``SELECT agg(col) … FROM dataset WHERE … GROUP BY …`` (``POST …/sql``): the server maps
        it onto ``quantile`` / ``measures.*`` and charges it like any request; a clause it cannot bound is an
        ``InvalidInput`` naming it (``sql.where``, …). Waits for the release like ``submit``."""
        body: dict[str, Any] = {"sql": statement, "noise": noise}
        for name, value in (
            ("epsilon", epsilon),
            ("noise_multiplier", noise_multiplier),
            ("candidates", candidates),
        ):
            if value is not None:
                body[name] = value
        call = replace(_keyed_post(f"/v1/datasets/{dataset_id}/sql", body, idempotency_key), ok=(200, 202))
        started = time.monotonic()
        response = yield from self._exchange(call)
        request = AnalysisRequest.from_json(response.json())
        if response.status_code == 200 or request.state != "running":
            return _settled(request)
        return (
            yield from _Endpoints.wait_request(
                self,
                request.id,
                timeout=max(0.0, timeout - (time.monotonic() - started)),
                poll_interval=poll_interval,
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

    # -- history: your requests and sessions (admins: everyone's), newest first

    @_endpoint
    def requests_page(
        self,
        *,
        dataset_id: str | None = None,
        state: str | None = None,
        analyst: str | None = None,
        after: str | None = None,
        limit: int = 100,
    ) -> _Op[RequestPage]:
        """One page of ``GET /v1/requests`` (``items`` and ``next_after``, the ``after`` of the next page)."""
        filters = _present(dataset_id=dataset_id, state=state, analyst=analyst, after=after)
        return self._fetch(_get("/v1/requests", **filters, limit=limit), RequestPage.from_json)

    @_stream_endpoint
    def list_requests(
        self,
        *,
        dataset_id: str | None = None,
        state: str | None = None,
        analyst: str | None = None,
        after: str | None = None,
        page_size: int = 100,
    ) -> _StreamOf[AnalysisRequest]:
        """Your requests (admins: everyone's, or ``analyst``'s), newest first, each as ``get_request``
        shows it, optionally of one dataset or in one state; walks all pages (``after``: start after
        that request)."""

        def page_at(position: str | None) -> _Op[RequestPage]:
            return _Endpoints.requests_page(
                self, dataset_id=dataset_id, state=state, analyst=analyst, after=position, limit=page_size
            )

        yield from _every_item(page_at, after)

    @_endpoint
    def sessions_page(
        self,
        *,
        dataset_id: str | None = None,
        state: str | None = None,
        analyst: str | None = None,
        after: str | None = None,
        limit: int = 100,
    ) -> _Op[SessionPage]:
        """One page of ``GET /v1/sessions`` (``items`` and ``next_after``, the ``after`` of the next page)."""
        filters = _present(dataset_id=dataset_id, state=state, analyst=analyst, after=after)
        return self._fetch(_get("/v1/sessions", **filters, limit=limit), SessionPage.from_json)

    @_stream_endpoint
    def list_sessions(
        self,
        *,
        dataset_id: str | None = None,
        state: str | None = None,
        analyst: str | None = None,
        after: str | None = None,
        page_size: int = 100,
    ) -> _StreamOf[Session]:
        """Your sessions (admins: everyone's, or ``analyst``'s), newest first, each as ``get_session``
        shows it (``request_id`` names its ledger entries), optionally of one dataset or in one state
        (``open``, ``closed``); walks all pages (``after``: start after that session)."""

        def page_at(position: str | None) -> _Op[SessionPage]:
            return _Endpoints.sessions_page(
                self, dataset_id=dataset_id, state=state, analyst=analyst, after=position, limit=page_size
            )

        yield from _every_item(page_at, after)

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
    def ledger(self, dataset_id: str, *, after: int = 0, page_size: int = 100) -> _StreamOf[_Item]:
        """Every ledger entry the caller may see, in order, walking all pages."""

        def page_at(position: int) -> _Op[LedgerPage]:
            return _Endpoints.ledger_page(self, dataset_id, after=position, limit=page_size)

        yield from _every_item(page_at, after)


def _advance(op: Generator[_Effect, Any, Any], reply: Any, error: BaseException | None) -> _Effect:
    """Resume ``op`` with the last effect's result, or throw its error in (StopIteration when done)."""
    return op.throw(error) if error is not None else op.send(reply)


def _returning(op: _Op[T], into: list[T]) -> _Stream:
    """``op`` as a stream that emits nothing and stores its result in ``into`` (one loop per driver)."""
    into.append((yield from op))
