"""Per-analyst execution limits (issue: fair execution): requests queued or running on workers at once,
and open interactive sessions. Defaults come from the settings; admins set per-analyst values. The
limits are checked at admission (``requests.check_limits``); over a limit the answer is 429."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy.orm import Session

from service.auth import Principal, Role
from service.errors import Forbidden, NotFound
from service.runs.admission import Limits, effective_limits
from service.store.models import AnalystLimit
from service.store.repositories import KeyRepository, LimitRepository, RequestRepository


def _analyst(session: Session, name: str) -> None:
    key = KeyRepository(session).by_name(name)
    if key is None or key.role != Role.analyst.value:
        raise NotFound(f"no analyst {name!r}")


def view(session: Session, principal: Principal, analyst: str, defaults: Limits) -> dict[str, Any]:
    """The effective limits of ``analyst`` and what is in use now (admins, or the analyst itself)."""
    if principal.role is not Role.admin and principal.name != analyst:
        raise Forbidden("only admins and the analyst itself can see these limits")
    _analyst(session, analyst)
    max_requests, max_sessions = effective_limits(session, analyst, defaults)
    running, open_sessions = RequestRepository(session).active_counts(analyst, sorted(defaults.inline))
    return {
        "analyst": analyst,
        "max_running_requests": max_requests,
        "max_open_sessions": max_sessions,
        "running_requests": running,
        "open_sessions": open_sessions,
        "custom": LimitRepository(session).get(analyst) is not None,
    }


def set_limits(
    session: Session,
    admin: Principal,
    analyst: str,
    max_running_requests: int | None,
    max_open_sessions: int | None,
) -> None:
    """Set (or with both None, reset to the defaults) an analyst's limits. Lowering a limit below what is
    in use cancels nothing: new work is refused until the analyst is under it again."""
    _analyst(session, analyst)
    repository = LimitRepository(session)
    row = repository.get(analyst)
    now = datetime.now(UTC)
    if row is None:
        row = AnalystLimit(analyst=analyst, updated_by=admin.name, updated_at=now)
        repository.add(row)
    row.max_running_requests, row.max_open_sessions = max_running_requests, max_open_sessions
    row.updated_by, row.updated_at = admin.name, now
