"""The persistent ex-post Rényi filter on its database rows (docs/privacy/filter.md#filter): budgets, the
transitions of ``service.filter.state`` applied to stored filters, and the public budget views.

Slots are the dataset's orders followed by the pure slot (α = ∞). The rule and its transitions are
``service.filter.state``; ``service.filter.batch`` applies them to locked rows. The caller holds the
filter's row lock for every mutation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from fractions import Fraction
from typing import Any

from sqlalchemy.orm import Session

from mechanisms.accounting import (
    UnitsVector,
    capacity_units,
    filter_epsilon,
    json_loss,
    units_to_epsilon,
)
from mechanisms.accounting.approximate import DELTA_UNITS, delta_units_down, remainder_delta
from service.errors import Conflict, InvalidInput, NotFound
from service.filter import ledger
from service.filter.ledger import LedgerEvent
from service.filter.state import FilterLike, read
from service.store.models import DATASET_SCOPE, Dataset, PrivacyFilter
from service.store.repositories import FilterRepository, LedgerRepository

PURE = "pure"  # the name of the pure slot (α = ∞) in API bodies
Slot = float | str


def new_filter(dataset_id: str, scope: str, slots: int) -> PrivacyFilter:
    zeros = UnitsVector.zeros(slots).to_json()
    return PrivacyFilter(
        dataset_id=dataset_id,
        scope=scope,
        capacity=None,
        spent=zeros,
        reserved=dict(zeros),
        last_seq=0,
        last_hash="",
        updated_at=datetime.now(UTC),
    )


def totals(flt: FilterLike) -> tuple[UnitsVector, UnitsVector]:
    state = read(flt)
    return state.spent, state.reserved


def ever_admissible(flt: FilterLike, charge: UnitsVector, delta: int = 0) -> bool:
    """Would an unspent filter with this capacity (and δ share) admit the charge?"""
    return read(flt).ever_admits(charge, delta)


def validate_budget(epsilon: float, delta: float, delta_share: float | None = None) -> None:
    if not (0.0 <= epsilon <= 1e6):
        raise InvalidInput("epsilon", "must be between 0 and 1e6")
    if not (0.0 <= delta < 1.0):
        raise InvalidInput("delta", "must be in [0, 1)")
    if delta_share is not None and not (0.0 < delta_share < delta):
        raise InvalidInput(
            "delta_share", "must be > 0 and < delta: the share of δ set aside for approximate-DP mechanisms"
        )


def written(value: float) -> Fraction:
    """A float read as the decimal the admin wrote (its shortest round-trip form, exactly): ``2e-06`` is
    2·10⁻⁶, not the binary float nearest to it. Budget *validations* compare these; capacities never do."""
    return Fraction(Decimal(repr(float(value))))


@dataclass(frozen=True)
class DeltaSplit:
    """What a budget's guarantee actually uses of δ: δ_R, the Ville/union-bound parameter of the Rényi
    slots (a float, exactly what ``capacity_units`` receives), and δ_A, the δ-ledger's capacity in units;
    ``rdp_written`` is δ − δ_A as the admin wrote the two decimals (exact), for ``check_share_change``."""

    rdp: float
    share_units: int
    rdp_written: Fraction

    @classmethod
    def of(cls, delta: float, delta_share: float | None) -> DeltaSplit:
        if delta_share is None:
            return cls(delta, 0, written(delta))
        remainder = written(delta) - written(delta_share)
        return cls(remainder_delta(delta, delta_share), delta_units_down(delta_share), remainder)


def check_share_change(session: Session, target: PrivacyFilter, new: DeltaSplit) -> None:
    """A dataset's guarantee is sup_t δ_R + sup_t δ_A over every budget ever set
    (docs/privacy/approximate.md#theorem-approx-filter,
    budget changes). Once a share is set or added, each new budget must keep both at least at their
    largest past values (read from the ledger, exactly), so that the guarantee is the current δ.
    Budgets that never had a share keep the rule of docs/privacy/filter.md#filter-remarks (the largest δ ever
    set).

    δ − δ_A is compared as the admin wrote the decimals (``rdp_written``: 2e-6 − 1e-6 ≥ 1e-6 holds), not
    as the rounded-down floats the capacities use, which would refuse it. This only validates: every
    capacity is still computed from ``rdp`` and ``share_units``, which never exceed the written values
    (``remainder_delta`` and ``delta_units_down`` round down; a budget without a share uses its float δ,
    within half an ulp of the decimal, and ``capacity_units`` pads the union-bound term up by far more), so
    sup δ_R + sup δ_A stays ≤ the δ written now."""
    bodies = LedgerRepository(session).bodies_of(target.dataset_id, LedgerEvent.BUDGET)
    past = [body for body in map(json.loads, bodies) if body["scope"] == target.scope]
    splits = [DeltaSplit.of(body["delta"], body.get("delta_share")) for body in past]
    if not splits or (new.share_units == 0 and all(s.share_units == 0 for s in splits)):
        return
    rdp_max, share_max = max(s.rdp_written for s in splits), max(s.share_units for s in splits)
    if new.share_units < share_max or new.rdp_written < rdp_max:
        raise InvalidInput(
            "delta_share",
            f"with a δ share the budget can only grow: the share must stay ≥ {_delta(share_max):g} and "
            f"δ − share ≥ {float(rdp_max):g} (the largest ever set: the guarantee is their sum)",
        )


def check_not_below_spent(target: PrivacyFilter, capacity: list[int | None]) -> None:
    """Refuse (409) a capacity that is below spent + reserved in every slot while something is spent or
    reserved: no request could be admitted any more. The caller confirms with ``confirm_below_spent``."""
    spent, reserved = totals(target)
    used = spent + reserved
    if used == UnitsVector.zeros(len(used)) or any(used.fits(capacity)):
        return
    raise Conflict(
        "the new capacity is below what is already spent and reserved in every slot, so no request could "
        "be admitted; send confirm_below_spent: true to set it anyway",
        errors=[
            {
                "field": "confirm_below_spent",
                "reason": "required to set a capacity below what is already spent and reserved",
            }
        ],
    )


def set_budget(
    session: Session,
    dataset: Dataset,
    scope: str,
    epsilon: float,
    delta: float,
    actor: str,
    delta_share: float | None = None,
    confirm_below_spent: bool = False,
) -> PrivacyFilter:
    """Set the (ε, δ) target of the dataset filter or of an analyst's sub-filter (one transaction).

    ``delta_share`` δ_A sets part of δ aside for approximate-DP mechanisms
    (docs/privacy/approximate.md#approximate-dp): the
    RDP slots' capacity then uses δ_R = δ − δ_A, and the δ-ledger's capacity is δ_A. A capacity below
    what is spent and reserved in every slot (the filter could admit nothing more) needs
    ``confirm_below_spent``."""
    validate_budget(epsilon, delta, delta_share)
    filters = FilterRepository(session)
    head = filters.lock(dataset.id)
    assert head is not None, "every dataset has its filter row"
    target = head if scope == DATASET_SCOPE else filters.lock(dataset.id, scope)
    if target is None:
        raise NotFound(f"analyst {scope!r} has no grant on dataset {dataset.id}; grant access first")
    split = DeltaSplit.of(delta, delta_share)
    check_share_change(session, target, split)
    capacity = list(capacity_units(epsilon, split.rdp, dataset.orders))
    # an individual dataset's own totals are a public record, not a budget: each unit's filter binds
    record_only = scope == DATASET_SCOPE and dataset.schema_json.get("accounting") == "individual"
    if not confirm_below_spent and not record_only:
        check_not_below_spent(target, capacity)
    delta_capacity = None if delta_share is None else split.share_units
    target.epsilon, target.delta, target.capacity = epsilon, delta, capacity
    target.delta_share = delta_share
    target.delta_capacity = None if delta_capacity is None else str(delta_capacity)
    target.updated_at = datetime.now(UTC)
    payload: dict[str, Any] = {"scope": scope, "epsilon": epsilon, "delta": delta, "capacity": capacity}
    if delta_share is not None:
        payload |= {"delta_share": delta_share, "delta_capacity": delta_capacity}
    ledger.append(session, head, LedgerEvent.BUDGET, actor, payload)
    return target


# ----- views (all values in ε units; public information only) ------------------------------------


def slot_names(orders: list[float]) -> list[Slot]:
    return [*orders, PURE]


def _slot_row(alpha: float | str, cap: int | None, spent: float, reserved: float) -> dict[str, Any]:
    capacity = None if cap is None else units_to_epsilon(cap)
    remaining = None if capacity is None else max(0.0, capacity - spent - reserved)
    return {
        "alpha": alpha,
        "capacity": capacity,
        "spent": json_loss(spent),
        "reserved": json_loss(reserved),
        "remaining": remaining,
    }


def budget_view(flt: PrivacyFilter, orders: list[float]) -> dict[str, Any]:
    spent, reserved = totals(flt)
    capacity = flt.capacity or [None] * len(spent)
    rows = [
        _slot_row(alpha, capacity[j], spent.epsilon(j), reserved.epsilon(j))
        for j, alpha in enumerate(slot_names(orders))
    ]
    usable = [r for r in rows if r["remaining"] is not None]
    best = max(usable, key=lambda r: r["remaining"], default=None)
    delta = flt.delta if flt.delta is not None else 0.0
    if flt.delta_share is not None:  # the RDP slots' union bound uses δ_R = δ − δ_A
        delta = remainder_delta(delta, flt.delta_share)
    return {
        "dataset_id": flt.dataset_id,
        "scope": "dataset" if flt.scope == DATASET_SCOPE else "analyst",
        "analyst": None if flt.scope == DATASET_SCOPE else flt.scope,
        "epsilon": flt.epsilon,
        "delta": flt.delta,
        "orders": rows[:-1],
        "pure": rows[-1],
        "epsilon_spent": json_loss(filter_epsilon(spent + reserved, delta, orders)),
        "epsilon_remaining": best["remaining"] if best else None,
        "binding_alpha": best["alpha"] if best else None,
        "budget_set": flt.capacity is not None,
        **delta_view(flt),
    }


def delta_view(flt: FilterLike) -> dict[str, Any]:
    """The δ-ledger of approximate-DP requests (docs/privacy/approximate.md#approximate-dp): share δ_A, spent,
    reserved, left."""
    state = read(flt)
    if state.delta_capacity is None:
        return {
            "delta_share": None,
            "delta_spent": _delta(state.delta_spent),
            "delta_reserved": _delta(state.delta_reserved),
            "delta_remaining": None,
        }
    left = max(0, state.delta_capacity - state.delta_spent - state.delta_reserved)
    return {
        "delta_share": _delta(state.delta_capacity),
        "delta_spent": _delta(state.delta_spent),
        "delta_reserved": _delta(state.delta_reserved),
        "delta_remaining": _delta(left),
    }


def _delta(units: int) -> float:
    return float(Fraction(units, DELTA_UNITS))


def refusal_details(
    flt: FilterLike, orders: list[float], charge: UnitsVector, delta: int = 0, unspent: bool = False
) -> dict[str, Any]:
    """Requested vs spent vs reserved vs capacity per slot, and the slot closest to fitting; for an
    approximate-DP request also its δ against the δ-ledger. ``unspent``: against the filter with nothing
    spent or reserved (an individual dataset's filter, which refuses only what a fresh unit could not
    afford; its totals are a record, not a budget)."""
    spent, reserved = totals(flt)
    if unspent:
        spent, reserved = UnitsVector.zeros(len(charge)), UnitsVector.zeros(len(charge))
    capacity = flt.capacity or [None] * len(charge)
    rows, best = [], None
    for j, alpha in enumerate(slot_names(orders)):
        row = _slot_row(alpha, capacity[j], spent.epsilon(j), reserved.epsilon(j))
        row["requested"] = json_loss(charge.epsilon(j))
        usable = capacity[j] is not None and not (spent + reserved + charge).is_infinite(j)
        if usable:
            row["shortfall"] = units_to_epsilon(
                spent.finite[j] + reserved.finite[j] + charge.finite[j] - int(capacity[j] or 0)
            )
            if best is None or row["shortfall"] < best["shortfall"]:
                best = row
        rows.append(row)
    epsilon_fits = best is not None and best["shortfall"] <= 0
    delta_binds = bool(delta) and epsilon_fits and not read(flt).delta_fits(delta)
    details: dict[str, Any] = {
        "filter": "dataset" if flt.scope == DATASET_SCOPE else f"analyst:{flt.scope}",
        "orders": rows[:-1],
        "pure": rows[-1],
        # what refuses: the Rényi/pure slots (ε) or, for an approximate-DP request whose ε fits, its δ share
        "binding": "delta" if delta_binds else "epsilon",
        "binding_alpha": None if delta_binds or best is None else best["alpha"],
        "shortfall": None if delta_binds or best is None else best["shortfall"],
    }
    if delta:
        view = delta_view(flt)
        details["delta"] = {"requested": _delta(delta), **view}
        if delta_binds:
            left = view["delta_remaining"] or 0.0
            details["delta"]["shortfall"] = _delta(delta) - left
    return details
