"""All SQL of the service, one module per table. Repositories never begin or commit: ``service.store.unit``
(the unit of work) does."""

from __future__ import annotations

from service.store.repositories.activity import ActivityRepository
from service.store.repositories.datasets import DatasetRepository
from service.store.repositories.filters import FilterRepository
from service.store.repositories.keys import KeyRepository
from service.store.repositories.ledger import LedgerRepository
from service.store.repositories.limits import LimitRepository
from service.store.repositories.refusals import RefusalRepository
from service.store.repositories.requests import RequestRepository
from service.store.repositories.sessions import SessionRepository
from service.store.repositories.unit_filters import UnitFilterRepository

__all__ = [
    "ActivityRepository",
    "DatasetRepository",
    "FilterRepository",
    "KeyRepository",
    "LedgerRepository",
    "LimitRepository",
    "RefusalRepository",
    "RequestRepository",
    "SessionRepository",
    "UnitFilterRepository",
]
