"""What the API reads for its responses, on the request's session: datasets, grants, budgets, the ledger,
activity, refusals, keys, a request's queue position. The routers call these (and the lifecycle
functions) and never a repository; the stored rows' types they show are named here."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy.orm import Session

from service.auth import Principal, Role
from service.datasets import visible_dataset
from service.store.models import DATASET_SCOPE as DATASET_SCOPE
from service.store.models import AnalysisRequest as AnalysisRequest
from service.store.models import AnalysisSession as AnalysisSession
from service.store.models import ApiKey as ApiKey
from service.store.models import Dataset as Dataset
from service.store.models import LedgerEntry as LedgerEntry
from service.store.models import PrivacyFilter as PrivacyFilter
from service.store.models import Refusal as Refusal
from service.store.models import RequestState as RequestState
from service.store.repositories import (
    ActivityRepository,
    DatasetRepository,
    FilterRepository,
    KeyRepository,
    LedgerRepository,
    RefusalRepository,
    RequestRepository,
)


def own(who: Principal) -> str | None:
    """Whose rows a listing shows: an analyst's own, everyone's (None) for the other roles."""
    return who.name if who.role is Role.analyst else None


def visible_datasets(session: Session, who: Principal) -> Sequence[Dataset]:
    return DatasetRepository(session).visible(own(who))


def grants(session: Session, admin: Principal, dataset_id: str) -> list[str]:
    visible_dataset(session, admin, dataset_id)
    return list(DatasetRepository(session).grants(dataset_id))


def filter_of(session: Session, dataset_id: str, scope: str = DATASET_SCOPE) -> PrivacyFilter | None:
    return FilterRepository(session).get(dataset_id, scope)


def ledger_page(
    session: Session, who: Principal, dataset_id: str, after: int, limit: int
) -> Sequence[LedgerEntry]:
    """Entries with seq > ``after`` of a dataset visible to ``who`` (analysts: their own requests')."""
    visible_dataset(session, who, dataset_id)
    return LedgerRepository(session).page(dataset_id, after, limit, own(who))


def running_requests(session: Session, who: Principal, dataset_id: str, limit: int) -> Sequence[Any]:
    return ActivityRepository(session).running_requests(dataset_id, own(who), limit)


def open_sessions(session: Session, who: Principal, dataset_id: str, limit: int) -> Sequence[Any]:
    return ActivityRepository(session).open_sessions(dataset_id, own(who), limit)


def refusals_page(
    session: Session, who: Principal, dataset_id: str, after: int, limit: int
) -> Sequence[Refusal]:
    visible_dataset(session, who, dataset_id)
    return RefusalRepository(session).page(dataset_id, after, limit, own(who))


def keys(session: Session) -> Sequence[ApiKey]:
    return KeyRepository(session).all()


def queue_position(session: Session, request: AnalysisRequest) -> int | None:
    """How many queued requests are ahead of a queued one; None for any other."""
    return RequestRepository(session).queue_position(request) if request.queued else None


def request_of(session: Session, request_id: str) -> AnalysisRequest | None:
    return RequestRepository(session).get(request_id)
