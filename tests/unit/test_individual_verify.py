"""``expost ledger verify`` rebuilds the unit filters of an individual dataset by replaying its committed
releases in ledger order (service.filter.ledger.UnitReplay; docs/privacy/individual.md#unit-state): the
replay of what the mechanisms' runs charged gives back exactly their state, a wrong budget or a wrong
released level does not, and anything that cannot be replayed is said, never passed over."""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from mechanisms.accounting import DEFAULT_ORDERS
from mechanisms.accounting.conversion import capacity_units
from mechanisms.accounting.individual import UnitCharges, UnitFilter, UnitLedger
from mechanisms.base import PublicContext
from mechanisms.catalog import MECHANISMS
from mechanisms.data.schema import ORDER_COLUMN, DatasetSchema
from mechanisms.noise import Noise
from mechanisms.queries.individual import IndividualTable
from service.filter.ledger import Output, StepFn, UnitReplay, differing_units, release_step
from service.store.models import DATASET_SCOPE

SCHEMA = DatasetSchema.model_validate(
    {
        "columns": [
            {"name": "user_id", "type": "int", "min": 0, "max": 10_000},
            {"name": "g", "type": "categorical", "values": ["a", "b", "c"]},
            {"name": "x", "type": "float", "min": 0.0, "max": 10.0},
        ],
        "neighboring": "add_remove",
        "privacy_unit": {"column": "user_id", "max_rows": 2},
        "accounting": "individual",
    }
)
CTX = PublicContext(SCHEMA, None, DEFAULT_ORDERS)
RNG = np.random.default_rng(7)
USERS = 200
ROWS = RNG.integers(1, 4, USERS)
TABLE: dict[str, np.ndarray] = {
    "user_id": np.repeat(np.arange(USERS), ROWS),
    "g": RNG.integers(0, 3, int(ROWS.sum())),
    "x": RNG.uniform(0.0, 10.0, int(ROWS.sum())),
    ORDER_COLUMN: RNG.permutation(int(ROWS.sum())).astype(np.int64),
}
BUDGET = capacity_units(2.0, 1e-6, DEFAULT_ORDERS)
SMALLER = capacity_units(1.5, 1e-6, DEFAULT_ORDERS)
COUNT_A = {"kind": "count", "where": [{"column": "g", "op": "eq", "value": "a"}]}
REQUESTS: list[tuple[str, dict[str, Any]]] = [
    ("laplace", {"query": COUNT_A, "epsilon": 0.7}),
    ("gaussian", {"query": {"kind": "sum", "column": "x"}, "sigma": 15.0}),
    (
        "measures.laplace",
        {"measures": [{"kind": "count"}, {"kind": "sum", "column": "x"}], "group_by": ["g"], "epsilon": 0.5},
    ),
    ("accuracy_first.laplace", {"query": COUNT_A, "target": {"relative": 0.1}, "epsilons": [0.05, 0.2, 0.4]}),
    ("laplace", {"query": {"kind": "count"}, "epsilon": 0.9}),  # by now some units cannot afford it
]


def ran(capacity: tuple[int | None, ...]) -> tuple[list[dict[str, Any]], dict[str, Any], UnitLedger, int]:
    """The requests run as the worker runs them, in order: (ledger bodies, stored releases by request id,
    the units' state, how many admissions were refused)."""
    ledger, refused = UnitLedger.empty(), 0
    bodies: list[dict[str, Any]] = []
    outputs: dict[str, Any] = {}
    for i, (name, raw) in enumerate(REQUESTS):
        mechanism = MECHANISMS[name]
        params = mechanism.params_model.model_validate(raw)
        table = IndividualTable(TABLE, UnitFilter(CTX.orders, capacity, ledger))
        release = mechanism.run(params, CTX, table, Noise.seeded(i))
        assert release.units is not None
        refused += USERS - len(release.units) if name == "laplace" and i == 4 else 0
        ledger = ledger.charged(release.units)
        request_id = f"rq{i}"
        bodies.append({"event": "reserve", "request_id": request_id, "mechanism": name, "params": raw})
        commit = {"event": "commit", "request_id": request_id, "outcome": "released"}
        bodies.append({**commit, "unit_filters_version": i + 1})
        outputs[request_id] = json.loads(json.dumps(release.output))  # as stored
    return bodies, outputs, ledger, refused


def replay(
    bodies: list[dict[str, Any]],
    outputs: dict[str, Any],
    capacity: tuple[int | None, ...] | None = BUDGET,
    step: StepFn | None = None,
) -> UnitReplay:
    units = UnitReplay("ds", CTX.orders, lambda: step or release_step(CTX, TABLE), outputs.get)
    for seq, body in enumerate(bodies, 1):
        units.observe(f"ds#{seq}", body, capacity)
    return units


def test_the_replay_gives_back_exactly_what_the_runs_charged() -> None:
    bodies, outputs, ledger, refused = ran(BUDGET)
    assert refused > 0  # the last count left some units out: the replay must reproduce the exclusions
    rebuilt = replay(bodies, outputs)
    assert rebuilt.problems == []
    assert rebuilt.unchecked is None
    assert rebuilt.version == len(REQUESTS)
    assert len(rebuilt.ledger) == len(ledger) > 0
    assert differing_units(rebuilt.ledger, ledger) == 0


def test_a_wrong_budget_or_a_wrong_released_level_gives_another_state() -> None:
    bodies, outputs, ledger, _ = ran(BUDGET)
    assert differing_units(replay(bodies, outputs, SMALLER).ledger, ledger) > 0  # other exclusions
    level = outputs["rq3"]["level"]
    other = {**outputs, "rq3": {**outputs["rq3"], "level": 2 if level != 2 else 0}}
    assert differing_units(replay(bodies, other).ledger, ledger) > 0  # noise reduction pays its level


def test_the_version_numbers_must_run_1_2_3_with_their_reservations() -> None:
    bodies, outputs, _, _ = ran(BUDGET)
    skipped = [b if b.get("unit_filters_version") != 3 else {**b, "unit_filters_version": 4} for b in bodies]
    assert any("unit filters version 4, expected 3" in p for p in replay(skipped, outputs).problems)
    orphan = replay(bodies[1:], outputs)  # the first commit without its reserve entry
    assert any("without its reserve entry" in p for p in orphan.problems)
    uncharged = [{k: v for k, v in b.items() if k != "unit_filters_version"} for b in bodies[:2]]
    assert any("without charging the unit filters" in p for p in replay(uncharged, outputs).problems)
    failed = [bodies[0], {"event": "commit", "request_id": "rq0", "outcome": "failed"}]
    assert replay(failed, outputs).problems == []  # a failed run charges no unit


def test_a_budget_set_while_a_release_ran_is_replayed_only_if_it_cannot_matter() -> None:
    bodies, outputs, _, _ = ran(BUDGET)
    budget = {"event": "budget", "scope": DATASET_SCOPE}
    with_change = [*bodies[:-1], budget, bodies[-1]]  # set while the last count ran

    def observed(capacities: list[tuple[int | None, ...]]) -> UnitReplay:
        units = UnitReplay("ds", CTX.orders, lambda: release_step(CTX, TABLE), outputs.get)
        kept = iter(capacities)
        capacity = next(kept)
        for seq, body in enumerate(with_change, 1):
            if body is budget:
                capacity = next(kept)
            units.observe(f"ds#{seq}", body, capacity)
        return units

    assert observed([BUDGET, BUDGET]).problems == []
    ambiguous = observed([BUDGET, SMALLER])  # the last count excludes other units under each budget
    assert any("budget changed while this release ran" in p for p in ambiguous.problems)


def test_what_cannot_be_replayed_is_reported_unchecked_and_a_failure_names_no_data() -> None:
    bodies, outputs, _, _ = ran(BUDGET)
    renamed = [{**b, "mechanism": "quantile"} if b["event"] == "reserve" else b for b in bodies]
    unreplayable = replay(renamed, outputs)
    assert unreplayable.problems == []
    assert unreplayable.unchecked is not None
    assert "quantile has no deterministic per-unit step" in unreplayable.unchecked

    without_data = UnitReplay("ds", CTX.orders, None)  # only the version numbers are checked
    for seq, body in enumerate(bodies, 1):
        without_data.observe(f"ds#{seq}", body, BUDGET)
    assert without_data.problems == []
    assert without_data.version == len(REQUESTS)
    assert len(without_data.ledger) == 0

    def broken(name: str, raw: dict[str, Any], output: Output, unit_filter: UnitFilter) -> UnitCharges:
        raise KeyError(f"unit {int(TABLE['user_id'][0])} spent {int(TABLE['g'][0])}")  # would leak

    failing = replay(bodies, outputs, step=broken)
    assert failing.problems == ["ds#2: cannot replay the release on the data (KeyError)"]


def test_differing_units_counts_units_absent_on_one_side_as_spent_zero() -> None:
    _, _, ledger, _ = ran(BUDGET)
    extra = UnitLedger(UnitCharges(np.array([USERS + 5]), np.array([0]), np.array([0])))
    assert differing_units(ledger.charged(extra.spent), ledger) == 0  # a unit charged 0 has spent 0
    more = UnitCharges(np.array([USERS + 6]), np.array([1]), np.array([0]))
    assert differing_units(ledger.charged(more), ledger) == 1
