"""The exceptions: every problem+json (RFC 9457) answer of the server becomes an :class:`ExpostError`.

:func:`error_from_problem` picks the subclass from the problem ``type`` and the HTTP status:
:class:`BudgetExhaustedError` (``/problems/budget-exhausted`` and ``/problems/not-admissible``),
:class:`MechanismFailedError`, :class:`LimitExceededError`, :class:`InvalidInputError`,
:class:`AuthError`, :class:`NotFoundError`, :class:`ConflictError`, :class:`ServerError`.
``ExpostTimeoutError`` (a request still running when the client stopped waiting) lives with the
request model in ``expost_client.models``.
"""

from __future__ import annotations

from typing import Any

import httpx

__all__ = [
    "AuthError",
    "BudgetExhaustedError",
    "ConflictError",
    "ExpostError",
    "InvalidInputError",
    "LimitExceededError",
    "MechanismFailedError",
    "NotFoundError",
    "ServerError",
    "error_from_problem",
    "error_from_response",
]


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
    def binding_alpha(self) -> float | str | None:
        """The binding order α, or \"pure\"."""
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
    def accounting(self) -> str:
        """``"individual"`` when each privacy unit of the dataset has its own budget (the dataset's totals,
        shown per slot, are then a public record, not a budget), else ``"dataset"``."""
        value = self.body.get("accounting")
        return value if isinstance(value, str) else "dataset"

    @property
    def binding(self) -> str:
        """What refuses: ``"epsilon"`` (the Rényi/pure slots) or ``"delta"`` (an approximate-DP request's
        δ share; its ε fits)."""
        value = self.body.get("binding")
        return value if isinstance(value, str) else "epsilon"

    @property
    def binding_row(self) -> dict[str, Any] | None:
        """The per-slot row of the binding order (the one closest to fitting)."""
        rows = [*self.orders, *([self.pure] if self.pure else [])]
        return next((r for r in rows if r.get("alpha") == self.binding_alpha), None)

    def summary(self) -> str:
        """One human line: requested vs remaining at the binding order, and what is affordable."""
        row = self.binding_row
        parts = [f"filter {self.filter or '?'}"]
        delta = self.body.get("delta")
        if self.binding == "delta" and isinstance(delta, dict):
            parts.append(
                f"δ binds: requested δ {_num(delta.get('requested'))}, remaining "
                f"{_num(delta.get('delta_remaining'))} of the share {_num(delta.get('delta_share'))} (ε fits)"
            )
        elif row is not None:
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
        if self.accounting == "individual":
            parts.append(str(self.body.get("accounting_meaning") or "individual accounting"))
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
