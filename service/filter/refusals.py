"""Refusals: a record of every request or session the budget refused (409), for the dashboard.

Recorded best-effort, in a short transaction of its own, after the refusal was decided and its locks were
released. Recording never changes the answer: a failure is logged and the caller re-raises the 409. Only
what the public problem body says is stored (no release, no secret state).
"""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime
from typing import Any

import structlog
from sqlalchemy.orm import Session, sessionmaker

from mechanisms.accounting import json_loss
from service.auth import Principal
from service.errors import BudgetExhausted
from service.filter.ledger import canonical_json
from service.logs import failure_fields
from service.store import unit
from service.store.models import Refusal
from service.store.repositories import RefusalRepository

log = structlog.get_logger("expost.refusals")

MAX_PARAMS_CHARS = 16_000


def _float(value: Any) -> float | None:
    if value == "inf":
        return math.inf
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _params(params: Any) -> dict[str, Any] | None:
    """The params as sent (they passed validation), or None when they cannot be stored as plain JSON."""
    try:
        text = canonical_json(params)
    except (TypeError, ValueError):
        return None
    if len(text) > MAX_PARAMS_CHARS:
        return {"truncated": True}
    loaded = json.loads(text)
    return loaded if isinstance(loaded, dict) else None


def refusal_row(
    principal: Principal, dataset_id: str, kind: str, mechanism: str, params: Any, problem: BudgetExhausted
) -> Refusal:
    body = problem.problem()
    requested = body.get("requested")
    binding = "delta" if body.get("binding") == "delta" else body.get("binding_alpha")  # δ share, or an order
    return Refusal(
        dataset_id=dataset_id,
        analyst=principal.name,
        kind=kind,
        mechanism=mechanism[:50],
        params=_params(params),
        requested_pure=_float(requested.get("pure")) if isinstance(requested, dict) else None,
        binding_alpha=None if binding is None else str(binding)[:20],
        shortfall=_float(body.get("shortfall")),
        filter=str(body.get("filter", ""))[:120],
        problem_type=str(body["type"])[:80],
        detail=problem.detail,
        created_at=datetime.now(UTC),
    )


def record_refusal(
    sessions: sessionmaker[Session],
    principal: Principal,
    dataset_id: str,
    kind: str,
    mechanism: str,
    params: Any,
    problem: BudgetExhausted,
) -> None:
    """Store one refusal in its own transaction; never raises (the 409 stands whatever happens here)."""
    try:
        row = refusal_row(principal, dataset_id, kind, mechanism, params, problem)
        with unit.transaction(sessions) as session:
            RefusalRepository(session).add(row)
    except Exception as exc:
        log.error("could not record a refusal", dataset_id=dataset_id, **failure_fields(exc))


def refusal_out(row: Refusal) -> dict[str, Any]:
    binding: float | str | None = row.binding_alpha
    if binding is not None and binding not in ("pure", "delta"):
        try:
            binding = float(binding)
        except ValueError:
            pass
    pure = row.requested_pure
    return {
        "id": row.id,
        "dataset_id": row.dataset_id,
        "analyst": row.analyst,
        "kind": row.kind,
        "mechanism": row.mechanism,
        "params": row.params,
        "problem_type": row.problem_type,
        "filter": row.filter,
        "binding_alpha": binding,
        "requested_pure": None if pure is None else json_loss(pure),
        "shortfall": row.shortfall if row.shortfall is None or math.isfinite(row.shortfall) else None,
        "detail": row.detail,
        "created_at": row.created_at,
    }
