"""The append-only, hash-chained ledger and its verifier.

Every change of a filter is one ledger entry, appended while the dataset filter row is locked, so each
dataset's chain is linear: hash_n = sha256(hash_{n−1} ‖ body_n) with body_n the canonical JSON of the
entry. The per-filter totals on the ``filters`` rows are a cache: ``verify`` rebuilds them from the
ledger alone and reports every mismatch (``expost ledger verify`` exits non-zero on any).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, Protocol

from sqlalchemy.orm import Session

from mechanisms.accounting import UnitsVector
from service.filter.state import FilterState
from service.store.models import DATASET_SCOPE, LedgerEntry, PrivacyFilter
from service.store.repositories import DatasetRepository, FilterRepository, LedgerRepository

GENESIS = "0" * 64


class LedgerEvent(StrEnum):
    """What a ledger entry records. ``reserve``/``commit``/``abort`` are the filter transitions of
    ``service.filter.state``; ``dataset``/``grant`` create filters, ``budget`` sets a capacity;
    ``revoke`` ends a grant and changes no filter (the analyst's sub-filter keeps what was spent)."""

    DATASET = "dataset"
    GRANT = "grant"
    REVOKE = "revoke"
    BUDGET = "budget"
    RESERVE = "reserve"
    COMMIT = "commit"
    ABORT = "abort"


def canonical_json(data: Any) -> str:
    """The hashed body's text: ``json.dumps`` with sorted keys, no spaces, UTF-8 and no NaN. A public
    recipe: clients verify the chain from ``GET …/ledger`` by re-encoding each parsed body this way, so
    the form must not change (orjson, several times faster, writes floats differently: ``1e-6``, not
    ``1e-06``)."""
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def chain_hash(prev_hash: str, body: str) -> str:
    return hashlib.sha256((prev_hash + body).encode()).hexdigest()


def append(
    session: Session,
    dataset_filter: PrivacyFilter,
    event: LedgerEvent,
    actor: str,
    payload: dict[str, Any],
    request_id: str | None = None,
) -> LedgerEntry:
    """Append one entry to the dataset's chain (an admin's: a dataset, a grant, a budget); the caller
    holds the lock on ``dataset_filter``. Requests' entries are chained by their batch
    (``service.filter.batch``)."""
    entry = LedgerEntry(**entry_values(dataset_filter, event, payload, Entry(request_id, actor, payload)))
    LedgerRepository(session).add(entry)
    dataset_filter.last_seq = entry.seq
    dataset_filter.last_hash = entry.hash
    return entry


@dataclass(frozen=True)
class Entry:
    """What a ledger entry says besides its event and amounts: the request (None for an admin's entry), who
    acted, the details (mechanism and parameters, or the outcome) and when (None: now)."""

    request_id: str | None
    actor: str
    details: dict[str, Any]
    at: datetime | None = None


class ChainHead(Protocol):
    """The head of a dataset's chain, as its dataset filter row holds it."""

    @property
    def dataset_id(self) -> str: ...
    @property
    def last_seq(self) -> int: ...
    @property
    def last_hash(self) -> str: ...


def entry_values(
    head: ChainHead, event: LedgerEvent, payload: dict[str, Any], about: Entry
) -> dict[str, Any]:
    """The columns of the entry that follows ``head`` on a dataset's chain: the one place the hashed body is
    built (a batch's transitions and :func:`append` both use it)."""
    now, dataset_id, actor, request_id = (
        about.at or datetime.now(UTC),
        head.dataset_id,
        about.actor,
        about.request_id,
    )
    seq = head.last_seq + 1
    prev = head.last_hash or GENESIS
    body = canonical_json(
        {
            "dataset_id": dataset_id,
            "seq": seq,
            "event": str(event),
            "actor": actor,
            "request_id": request_id,
            "at": now.isoformat(),
            **payload,
        }
    )
    return {
        "dataset_id": dataset_id,
        "seq": seq,
        "event": str(event),
        "request_id": request_id,
        "actor": actor,
        "created_at": now,
        "body": body,
        "prev_hash": prev,
        "hash": chain_hash(prev, body),
    }


# ----- verification ---------------------------------------------------------------------------------


@dataclass
class RebuiltFilter:
    """A filter as the ledger alone describes it: its budget target and its pure state."""

    state: FilterState
    epsilon: float | None = None
    delta: float | None = None
    delta_share: float | None = None


@dataclass
class VerifyReport:
    datasets: int = 0
    entries: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _apply(filters: dict[str, RebuiltFilter], body: dict[str, Any], slots: int) -> None:
    """Replay one entry with the same transitions the database path applies (``FilterState``)."""
    event = LedgerEvent(body["event"])
    if event is LedgerEvent.DATASET:
        filters[DATASET_SCOPE] = RebuiltFilter(FilterState.empty(slots))
    elif event is LedgerEvent.GRANT:
        filters.setdefault(body["analyst"], RebuiltFilter(FilterState.empty(slots)))
    elif event is LedgerEvent.REVOKE:
        if body["analyst"] not in filters:  # only a granted analyst can be revoked; no filter changes
            raise KeyError(body["analyst"])
    elif event is LedgerEvent.BUDGET:
        target = filters[body["scope"]]
        target.epsilon, target.delta = body["epsilon"], body["delta"]
        target.delta_share = body.get("delta_share")
        target.state = target.state.with_capacity(body["capacity"], _units(body.get("delta_capacity")))
    else:
        worst = UnitsVector.from_json(body["worst_case"])
        delta = _units(body.get("delta", 0)) or 0
        for scope in body["scopes"]:
            target = filters[scope]
            if event is LedgerEvent.RESERVE:
                target.state = target.state.reserve(worst, delta)
            else:
                realized = UnitsVector.from_json(body["realized"]) if event is LedgerEvent.COMMIT else None
                target.state = target.state.settle(worst, realized, delta)


def _units(value: Any) -> int | None:
    """A δ amount of a ledger body: an exact int (never a float that would have been rounded)."""
    if value is None:
        return None
    if type(value) is not int or value < 0:
        raise ValueError(f"δ units must be a non-negative integer, got {value!r}")
    return value


def _compare(dataset_id: str, rebuilt: dict[str, RebuiltFilter], rows: list[PrivacyFilter]) -> list[str]:
    problems = []
    by_scope = {row.scope: row for row in rows}
    for scope in sorted(set(rebuilt) | set(by_scope)):
        row, want = by_scope.get(scope), rebuilt.get(scope)
        if row is None or want is None:
            problems.append(f"{dataset_id}/{scope}: filter row and ledger disagree on existence")
            continue
        capacity = None if want.state.capacity is None else list(want.state.capacity)
        checks = {
            "spent": (UnitsVector.from_json(row.spent), want.state.spent),
            "reserved": (UnitsVector.from_json(row.reserved), want.state.reserved),
            "capacity": (row.capacity, capacity),
            "epsilon": (row.epsilon, want.epsilon),
            "delta": (row.delta, want.delta),
            "delta_share": (row.delta_share, want.delta_share),
            "delta_capacity": (row.delta_capacity, _text(want.state.delta_capacity)),
            "delta_spent": (row.delta_spent, str(want.state.delta_spent)),
            "delta_reserved": (row.delta_reserved, str(want.state.delta_reserved)),
        }
        problems += [
            f"{dataset_id}/{scope}: {name} is {have} in the filter but {need} from the ledger"
            for name, (have, need) in checks.items()
            if have != need
        ]
    return problems


def _text(units: int | None) -> str | None:
    return None if units is None else str(units)


def verify_dataset(session: Session, dataset_id: str, slots: int, report: VerifyReport) -> None:
    ledger, prev, expected_seq = LedgerRepository(session), GENESIS, 1
    filters: dict[str, RebuiltFilter] = {}
    while True:
        page = ledger.chain(dataset_id, expected_seq - 1, 1000)
        if not page:
            break
        for entry in page:
            report.entries += 1
            where = f"{dataset_id}#{entry.seq}"
            if entry.seq != expected_seq:
                report.problems.append(f"{where}: expected sequence number {expected_seq}")
            if entry.prev_hash != prev or entry.hash != chain_hash(prev, entry.body):
                report.problems.append(f"{where}: hash chain broken")
            body = json.loads(entry.body)
            if (body.get("seq"), body.get("event"), body.get("dataset_id")) != (
                entry.seq,
                entry.event,
                entry.dataset_id,
            ):
                report.problems.append(f"{where}: row columns differ from the hashed body")
            try:
                _apply(filters, body, slots)
            except (KeyError, ValueError, TypeError) as exc:
                report.problems.append(f"{where}: cannot replay entry ({exc})")
            prev, expected_seq = entry.hash, entry.seq + 1
    rows = list(FilterRepository(session).for_dataset(dataset_id))
    head = next((r for r in rows if r.scope == DATASET_SCOPE), None)
    if head is not None and (head.last_seq, head.last_hash or GENESIS) != (expected_seq - 1, prev):
        report.problems.append(f"{dataset_id}: chain head on the filter row differs from the ledger")
    report.problems += _compare(dataset_id, filters, rows)


def verify(session: Session) -> VerifyReport:
    report = VerifyReport()
    datasets = DatasetRepository(session)
    for dataset_id in LedgerRepository(session).dataset_ids():
        dataset = datasets.get(dataset_id)
        assert dataset is not None
        report.datasets += 1
        verify_dataset(session, dataset_id, len(dataset.orders) + 1, report)
    return report
