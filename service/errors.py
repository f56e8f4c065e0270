"""One error base class carrying its HTTP status, rendered as RFC 9457 application/problem+json."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

PROBLEM_JSON = "application/problem+json"


class ServiceError(Exception):
    status: int = 500
    type_slug: str = "internal-error"
    title: str = "Internal error"

    headers: dict[str, str] | None = None

    def __init__(self, detail: str, **extensions: Any) -> None:
        super().__init__(detail)
        self.detail = detail
        self.extensions = extensions

    def problem(self, instance: str | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "type": f"/problems/{self.type_slug}",
            "title": self.title,
            "status": self.status,
            "detail": self.detail,
        }
        if instance:
            body["instance"] = instance
        body.update(self.extensions)
        return body


class InvalidInput(ServiceError):
    """Bad input: names the field and the reason."""

    status = 422
    type_slug = "invalid-input"
    title = "Invalid input"

    def __init__(self, field: str, reason: str, status: int = 422) -> None:
        super().__init__(f"{field}: {reason}", errors=[{"field": field, "reason": reason}])
        self.status = status

    @classmethod
    def from_validation(cls, prefix: str, exc: ValidationError) -> InvalidInput:
        """The first pydantic error, naming the field under ``prefix`` (e.g. ``params.epsilon``)."""
        first = exc.errors()[0]
        return cls(".".join(str(p) for p in (prefix, *first["loc"])), first["msg"])


class PayloadTooLarge(InvalidInput):
    type_slug = "payload-too-large"
    title = "Payload too large"

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(field, reason, status=413)


class Unauthenticated(ServiceError):
    status = 401
    type_slug = "unauthenticated"
    title = "Missing or invalid API key"
    headers = {"WWW-Authenticate": 'Bearer realm="expost"'}  # noqa: RUF012 (read-only)


class Forbidden(ServiceError):
    status = 403
    type_slug = "forbidden"
    title = "Not allowed for this role"


class NotFound(ServiceError):
    status = 404
    type_slug = "not-found"
    title = "Not found"


class Conflict(ServiceError):
    status = 409
    type_slug = "conflict"
    title = "Conflict"


class BudgetExhausted(Conflict):
    """Refusal: requested vs remaining vs the difference (Tumult style), all public information."""

    type_slug = "budget-exhausted"
    title = "Privacy budget exhausted"


class NotAdmissible(BudgetExhausted):
    """The request exceeds the filter's capacity even with nothing spent."""

    type_slug = "not-admissible"
    title = "Request can never be admitted under this budget"


class NoBudget(Conflict):
    type_slug = "no-budget"
    title = "No privacy budget set"


class IdempotencyKeyReused(ServiceError):
    status = 422
    type_slug = "idempotency-key-reused"
    title = "Idempotency-Key reused with a different request"


class LimitExceeded(ServiceError):
    """A per-analyst execution limit (running requests, open sessions): retry when one has finished."""

    status = 429
    type_slug = "limit-exceeded"
    title = "Per-analyst limit exceeded"
    headers = {"Retry-After": "5"}  # noqa: RUF012 (read-only)


class NotCancellable(Conflict):
    type_slug = "not-cancellable"
    title = "The request has already finished"


class MechanismFailed(ServiceError):
    status = 500
    type_slug = "mechanism-failed"
    title = "The mechanism failed after reading the data; its worst case was charged"


class ServiceUnavailable(ServiceError):
    status = 503
    type_slug = "unavailable"
    title = "Service unavailable"


class NotReady(ServiceError):
    status = 503
    type_slug = "not-ready"
    title = "Service not ready"
