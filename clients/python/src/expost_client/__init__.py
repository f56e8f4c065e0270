"""A typed Python client for the expost HTTP API, sync (:class:`ExpostClient`) and async
(:class:`AsyncExpostClient`), with the same methods.

It depends only on httpx and pydantic, so it can be used from any process that can reach the server
(``pip install ./clients/python``). The response models are the client's own, lenient (unknown fields are
kept) copies of the server's.

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
* Each endpoint is written once (``expost_client._endpoints``, a sans-IO generator of HTTP calls, sleeps
  and progress reports); the two clients only drive those generators, blocking
  (``expost_client.sync_client``) or awaiting (``expost_client.async_client``).

Modules: ``errors`` (the exceptions), ``models`` (the response bodies), ``retry`` (what is retried, and
the backoff), ``sync_client`` and ``async_client`` (the two drivers).
"""

from expost_client._endpoints import DEFAULT_URL, USER_AGENT, Progress
from expost_client._version import __version__ as __version__
from expost_client.async_client import AsyncExpostClient
from expost_client.errors import (
    AuthError,
    BudgetExhaustedError,
    ConflictError,
    ExpostError,
    InvalidInputError,
    LimitExceededError,
    MechanismFailedError,
    NotFoundError,
    ServerError,
    error_from_problem,
    error_from_response,
)
from expost_client.models import (
    AnalysisRequest,
    Answer,
    ApiKey,
    ApiModel,
    Budget,
    BudgetSlot,
    Curve,
    Dataset,
    Estimate,
    ExpostTimeoutError,
    Grant,
    LedgerPage,
    Limits,
    Loss,
    Me,
    MechanismInfo,
    PrivacyReport,
    RecordBound,
    RequestPage,
    Session,
    SessionPage,
    Slot,
)
from expost_client.retry import Retry, RetryPolicy
from expost_client.sync_client import ExpostClient

__all__ = [
    "DEFAULT_URL",
    "USER_AGENT",
    "AnalysisRequest",
    "Answer",
    "ApiKey",
    "ApiModel",
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
    "Loss",
    "Me",
    "MechanismFailedError",
    "MechanismInfo",
    "NotFoundError",
    "PrivacyReport",
    "Progress",
    "RecordBound",
    "RequestPage",
    "Retry",
    "RetryPolicy",
    "ServerError",
    "Session",
    "SessionPage",
    "Slot",
    "error_from_problem",
    "error_from_response",
]
