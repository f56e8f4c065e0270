"""The administrators' writes that the API offers, each one transaction of the unit of work
(``service.store.unit``): keys, datasets and grants, budgets, execution limits. The routers call these and
never open a transaction themselves."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from mechanisms.data.schema import DatasetSchema
from service import auth, datasets
from service.auth import Principal, Role
from service.data.ingest import Ingested
from service.errors import Conflict
from service.filter import budget
from service.runs import limits
from service.store import unit
from service.store.models import Dataset


def create_key(sessions: sessionmaker[Session], name: str, role: Role) -> str:
    """A new API key, returned in clear once; a name already taken is a 409."""
    try:
        with unit.transaction(sessions) as session:
            return auth.create_key(session, name, role)
    except IntegrityError:  # a concurrent request created the same name first
        raise Conflict(f"a key named {name!r} already exists") from None


def record_dataset(
    sessions: sessionmaker[Session], name: str, schema: DatasetSchema, ingested: Ingested, actor: str
) -> Dataset:
    """Record an ingested snapshot as a dataset (``datasets.record_dataset``)."""
    with unit.transaction(sessions) as session:
        return datasets.record_dataset(session, name, schema, ingested, actor)


def grant(sessions: sessionmaker[Session], admin: Principal, dataset_id: str, analyst: str) -> bool:
    """Grant ``analyst`` the dataset; False when the grant existed already."""
    with unit.transaction(sessions) as session:
        dataset = datasets.visible_dataset(session, admin, dataset_id)
        return datasets.grant(session, dataset, analyst, admin.name)


def revoke_grant(sessions: sessionmaker[Session], admin: Principal, dataset_id: str, analyst: str) -> bool:
    """End ``analyst``'s grant on the dataset; False when there was none."""
    with unit.transaction(sessions) as session:
        dataset = datasets.visible_dataset(session, admin, dataset_id)
        return datasets.revoke_grant(session, dataset, analyst, admin.name)


def archive(sessions: sessionmaker[Session], admin: Principal, dataset_id: str) -> Dataset:
    """Archive the dataset: no new requests or sessions."""
    with unit.transaction(sessions) as session:
        datasets.visible_dataset(session, admin, dataset_id)
        return datasets.archive(session, dataset_id, admin.name)


def set_budget(
    sessions: sessionmaker[Session],
    admin: Principal,
    dataset_id: str,
    scope: str,
    target: BudgetTarget,
) -> dict[str, Any]:
    """Set the budget of the dataset's filter or of an analyst's sub-filter; returns its view."""
    with unit.transaction(sessions) as session:
        dataset = datasets.visible_dataset(session, admin, dataset_id)
        flt = budget.set_budget(
            session,
            dataset,
            scope,
            target.epsilon,
            target.delta,
            admin.name,
            target.delta_share,
            confirm_below_spent=target.confirm_below_spent,
        )
        return budget.budget_view(flt, dataset.orders)


@dataclass(frozen=True)
class BudgetTarget:
    """What an admin asks of a budget: (ε, δ), the δ share for approximate-DP mechanisms, and whether a
    capacity below what is spent is meant."""

    epsilon: float
    delta: float
    delta_share: float | None = None
    confirm_below_spent: bool = False


def set_limits(
    sessions: sessionmaker[Session],
    admin: Principal,
    analyst: str,
    max_running_requests: int | None,
    max_open_sessions: int | None,
) -> None:
    """Set ``analyst``'s execution limits (None: the default)."""
    with unit.transaction(sessions) as session:
        limits.set_limits(session, admin, analyst, max_running_requests, max_open_sessions)
