"""Retries: which calls may be repeated (:class:`Retry`) and how long to wait between attempts
(:class:`RetryPolicy`, exponential backoff with jitter, honouring ``Retry-After``)."""

from __future__ import annotations

import enum
import secrets
from dataclasses import dataclass

import httpx

__all__ = ["Retry", "RetryPolicy", "should_retry_exception", "should_retry_response"]


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


def should_retry_exception(retry: Retry, exc: httpx.TransportError) -> bool:
    if retry is Retry.SAFE:
        return True
    if retry is Retry.CONNECT:
        return isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout)
    return False


def should_retry_response(retry: Retry, response: httpx.Response) -> bool:
    if retry is not Retry.SAFE or response.status_code < 500:
        return False
    if response.status_code == 500 and "mechanism-failed" in response.text:
        return False  # a definite outcome (charged); a retry would only replay it
    return True
