"""The append-only, hash-chained ledger and its verifier.

Every change of a filter is one ledger entry, appended while the dataset filter row is locked, so each
dataset's chain is linear: hash_n = sha256(hash_{n−1} ‖ body_n) with body_n the canonical JSON of the
entry. The per-filter totals on the ``filters`` rows are a cache: ``verify`` rebuilds them from the
ledger alone and reports every mismatch (``expost ledger verify`` exits non-zero on any).

On a dataset with ``accounting: individual`` it also rebuilds the secret per-unit filters: every committed
release (a ``commit`` entry with ``unit_filters_version``) is replayed on the data, in ledger order, with the
parameters of its ``reserve`` entry and the dataset's budget of that point of the ledger, through the
mechanism's deterministic ``unit_step``; the result must equal the stored state
(docs/privacy/individual.md#unit-state). Problems name counts only, never a unit's amounts.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, Protocol

import numpy as np
from sqlalchemy.orm import Session

from mechanisms.accounting import UnitsVector
from mechanisms.accounting.individual import UnitCharges, UnitFilter, UnitLedger
from mechanisms.base import PublicContext, Table
from mechanisms.catalog import MECHANISMS
from mechanisms.data.schema import DatasetSchema
from mechanisms.queries.individual import IndividualMechanism, IndividualTable, ReleaseDependentUnits
from service.filter.individual import read_state
from service.filter.state import FilterState
from service.store.models import DATASET_SCOPE, Dataset, LedgerEntry, PrivacyFilter
from service.store.repositories import (
    DatasetRepository,
    FilterRepository,
    LedgerRepository,
    RequestRepository,
    UnitFilterRepository,
)

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
    """What :func:`verify` found: ``problems`` (mismatches) and ``unchecked`` (individual datasets whose
    unit filters were not rebuilt, or not to the end: no data access was given, or a committed release
    cannot be replayed offline; their version numbers were still checked). ``ok`` is about problems alone;
    a complete verification also has nothing unchecked."""

    datasets: int = 0
    entries: int = 0
    problems: list[str] = field(default_factory=list)
    unchecked: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def complete(self) -> bool:
        return not self.unchecked


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


def verify_dataset(
    session: Session, dataset_id: str, slots: int, report: VerifyReport, units: UnitReplay | None = None
) -> None:
    """Check one dataset's chain and rebuild its filters; ``units`` (individual datasets) follows the replay
    and rebuilds the unit filters."""
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
            if units is not None:
                budget = filters.get(DATASET_SCOPE)
                units.observe(where, body, None if budget is None else budget.state.capacity)
            elif "unit_filters_version" in body:
                report.problems.append(
                    f"{where}: unit filters version on a dataset without individual accounting"
                )
            prev, expected_seq = entry.hash, entry.seq + 1
    rows = list(FilterRepository(session).for_dataset(dataset_id))
    head = next((r for r in rows if r.scope == DATASET_SCOPE), None)
    if head is not None and (head.last_seq, head.last_hash or GENESIS) != (expected_seq - 1, prev):
        report.problems.append(f"{dataset_id}: chain head on the filter row differs from the ledger")
    report.problems += _compare(dataset_id, filters, rows)
    if units is not None:
        units.finish(session, report)
    elif UnitFilterRepository(session).version(dataset_id) != 0:
        report.problems.append(
            f"{dataset_id}: unit filters stored for a dataset without individual accounting"
        )


UnitData = Callable[[Dataset], tuple[PublicContext, Table]]
"""Read access to a dataset's data for the unit filters' replay: its public context and its table (the
CLI's ``TableCache``)."""

Output = Callable[[], dict[str, Any] | None]
"""A committed request's stored release (read only when the mechanism's charges depend on it)."""

StepFn = Callable[[str, dict[str, Any], Output, UnitFilter], UnitCharges]
"""(mechanism, parameters of the reserve entry, its release, the unit filters before it) → the admitted
units' charges."""


class NotReplayable(Exception):
    """A committed release whose units' charges cannot be recomputed offline (its mechanism has no
    deterministic per-unit step): the unit filters are reported unchecked from there on, not wrong."""


def release_step(context: PublicContext, table: Table) -> StepFn:
    """The deterministic per-unit part of a release on ``table``: the mechanism's ``unit_step`` with the
    parameters validated by its model, as the worker ran it (``IndividualMechanism``; with the stored
    release for a ``ReleaseDependentUnits`` one)."""

    def step(name: str, raw: dict[str, Any], output: Output, unit_filter: UnitFilter) -> UnitCharges:
        mechanism = MECHANISMS.get(name)
        if mechanism is None:
            raise NotReplayable(f"{name} is not a mechanism of this version")
        table_with_units = IndividualTable(table, unit_filter)
        if isinstance(mechanism, ReleaseDependentUnits):
            release = output()
            if release is None:
                raise ValueError("the committed release is not stored")
            params = mechanism.params_model.model_validate(raw)
            return mechanism.released_unit_step(params, context, table_with_units, release).charges
        if isinstance(mechanism, IndividualMechanism):
            params = mechanism.params_model.model_validate(raw)
            return mechanism.unit_step(params, context, table_with_units).charges
        raise NotReplayable(f"{name} has no deterministic per-unit step to replay")

    return step


@dataclass
class _Pending:
    """A reserved request of an individual dataset: what it asked, and every dataset budget in force while
    it may have run (its run reads the capacity once, between its reserve and its commit)."""

    request_id: str
    mechanism: str
    params: dict[str, Any]
    capacities: list[tuple[int | None, ...] | None]


@dataclass
class UnitReplay:
    """The rebuild of an individual dataset's unit filters, fed every entry in ledger order.

    ``load`` gives the replay function (None: no data access, so only the version numbers are checked and
    the dataset is reported unchecked). A release whose charges depend on which of several budgets, set
    while it ran, it read cannot be replayed unambiguously: reported, and the replay stops there."""

    dataset_id: str
    orders: tuple[float, ...]
    load: Callable[[], StepFn] | None
    outputs: Callable[[str], dict[str, Any] | None] = lambda _: None
    ledger: UnitLedger = field(default_factory=UnitLedger.empty)
    version: int = 0
    problems: list[str] = field(default_factory=list)
    pending: dict[str, _Pending] = field(default_factory=dict)
    step: StepFn | None = None
    stopped: bool = False
    unchecked: str | None = None

    def observe(self, where: str, body: dict[str, Any], capacity: tuple[int | None, ...] | None) -> None:
        event, request_id = body.get("event"), body.get("request_id")
        if event == LedgerEvent.RESERVE and request_id is not None and "mechanism" in body:
            params = body.get("params") or {}
            self.pending[request_id] = _Pending(request_id, body["mechanism"], params, [capacity])
        elif event == LedgerEvent.BUDGET and body.get("scope") == DATASET_SCOPE:
            for waiting in self.pending.values():
                waiting.capacities.append(capacity)
        elif event in (LedgerEvent.COMMIT, LedgerEvent.ABORT) and request_id is not None:
            self._settled(where, body, self.pending.pop(request_id, None))

    def _settled(self, where: str, body: dict[str, Any], reserved: _Pending | None) -> None:
        version = body.get("unit_filters_version")
        if version is None:
            if body.get("event") == LedgerEvent.COMMIT and body.get("outcome") == "released":
                self.problems.append(f"{where}: a release committed without charging the unit filters")
            return
        if version != self.version + 1:
            self.problems.append(f"{where}: unit filters version {version}, expected {self.version + 1}")
        self.version = version if type(version) is int else self.version + 1
        if reserved is None:
            self.problems.append(f"{where}: a unit filters update without its reserve entry")
            self.stopped = True
            return
        if self.stopped or self.load is None:
            return
        try:
            self._replay(where, reserved)
        except NotReplayable as exc:
            self.unchecked, self.stopped = f"not rebuilt past {where} ({exc})", True
        except Exception as exc:  # the replay failed: say so, without any detail that could carry data
            self.problems.append(f"{where}: cannot replay the release on the data ({type(exc).__name__})")
            self.stopped = True

    def _replay(self, where: str, reserved: _Pending) -> None:
        if self.step is None:
            assert self.load is not None
            self.step = self.load()
        unit_filters = [
            UnitFilter(self.orders, capacity or (None,) * (len(self.orders) + 1), self.ledger)
            for capacity in dict.fromkeys(reserved.capacities)
        ]
        request_id = reserved.request_id

        def output() -> dict[str, Any] | None:
            return self.outputs(request_id)

        charges = [self.step(reserved.mechanism, reserved.params, output, f) for f in unit_filters]
        if any(differing_units(UnitLedger(c), UnitLedger(charges[0])) for c in charges[1:]):
            self.problems.append(
                f"{where}: the dataset budget changed while this release ran and its unit charges depend on "
                "which budget it read: the unit filters cannot be replayed past it"
            )
            self.stopped = True
            return
        self.ledger = self.ledger.charged(charges[0])

    def finish(self, session: Session, report: VerifyReport) -> None:
        """Compare with the stored state; add the problems (counts only) to ``report``."""
        report.problems += [f"{self.dataset_id}: {problem}" for problem in self.problems]
        try:
            version, stored = read_state(session, self.dataset_id)
        except Exception as exc:  # an unreadable state is a problem to report, never a detail to print
            name = type(exc).__name__
            report.problems.append(f"{self.dataset_id}: stored unit filters cannot be read ({name})")
            return
        if version != self.version:
            report.problems.append(
                f"{self.dataset_id}: unit filters are at version {version}; the ledger's last is "
                f"{self.version}"
            )
        if self.load is None:
            report.unchecked.append(f"{self.dataset_id}: unit filters not rebuilt (no access to the data)")
            return
        if self.unchecked is not None:
            report.unchecked.append(f"{self.dataset_id}: unit filters {self.unchecked}")
        if self.stopped:
            return
        differ = differing_units(stored, self.ledger)
        if differ:
            report.problems.append(
                f"{self.dataset_id}: unit filters differ from the replay for {differ} units"
            )


def differing_units(a: UnitLedger, b: UnitLedger) -> int:
    """How many units have different spent amounts in ``a`` and ``b`` (a unit absent from one has spent 0)."""
    units = np.union1d(a.spent.units, b.spent.units)
    pure_a, slope_a = a.of(units)
    pure_b, slope_b = b.of(units)
    return int(np.count_nonzero((pure_a != pure_b) | (slope_a != slope_b)))


def unit_replay(session: Session, dataset: Dataset, data: UnitData | None) -> UnitReplay | None:
    """The unit filters' rebuild of ``dataset`` (None: it keeps no unit filters)."""
    if not DatasetSchema.model_validate(dataset.schema_json).individual:
        return None
    orders = tuple(float(order) for order in dataset.orders)
    if data is None:
        return UnitReplay(dataset.id, orders, None)
    requests = RequestRepository(session)

    def load() -> StepFn:
        return release_step(*data(dataset))

    def output(request_id: str) -> dict[str, Any] | None:
        request = requests.get(request_id)
        return None if request is None else request.release

    return UnitReplay(dataset.id, orders, load, output)


def verify(session: Session, data: UnitData | None = None) -> VerifyReport:
    """Check every chain and rebuild every filter; with ``data``, also rebuild the unit filters of
    individual datasets (without it, they are listed in ``unchecked``)."""
    report = VerifyReport()
    datasets = DatasetRepository(session)
    for dataset_id in LedgerRepository(session).dataset_ids():
        dataset = datasets.get(dataset_id)
        assert dataset is not None
        report.datasets += 1
        units = unit_replay(session, dataset, data)
        verify_dataset(session, dataset_id, len(dataset.orders) + 1, report, units)
    return report
