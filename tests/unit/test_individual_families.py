"""Individual accounting for noise reduction (``accuracy_first.laplace|gaussian``) and grouped measures
(``measures.laplace|gaussian``): each unit pays from its own shift, the units that cannot afford their
worst case are left out before anything is computed, and the answer is the dataset-level computation on
the data without them (docs/privacy/individual.md#individual-noise-reduction-proof,
docs/privacy/individual.md#individual-measures-proof)."""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

import numpy as np
import pytest

from mechanisms.accounting import DEFAULT_ORDERS, UNITS_PER_EPSILON, RdpCurve
from mechanisms.accounting.individual import UnitCharges, UnitFilter, UnitLedger
from mechanisms.base import ParamsError, PublicContext
from mechanisms.catalog import MECHANISMS, WITH_INDIVIDUAL
from mechanisms.data.schema import ORDER_COLUMN, DatasetSchema
from mechanisms.noise import Noise
from mechanisms.noise.reduction import RATE_DENOMINATOR
from mechanisms.queries.individual import IndividualMechanism, IndividualTable, ReleaseDependentUnits
from mechanisms.queries.language import evaluate_units
from mechanisms.queries.measures import (
    MeasuresGaussian,
    MeasuresLaplace,
    evaluate_blocks,
    gaussian_measures_curve,
    gaussian_plans,
    laplace_measures_curve,
    laplace_plans,
)
from mechanisms.reduction.accuracy_first import ACCURACY_FIRST_GAUSSIAN, ACCURACY_FIRST_LAPLACE, AccuracyFirst
from mechanisms.reduction.noise_reduction import brownian_cumulative_costs, laplace_nr_rates

MAX_ROWS = 3
SCHEMA = DatasetSchema.model_validate(
    {
        "columns": [
            {"name": "user_id", "type": "int", "min": 0, "max": 10_000},
            {"name": "g", "type": "categorical", "values": ["a", "b", "c"]},
            {"name": "x", "type": "float", "min": 0.0, "max": 10.0},
            {"name": "n", "type": "int", "min": 0, "max": 5},
        ],
        "neighboring": "add_remove",
        "privacy_unit": {"column": "user_id", "max_rows": MAX_ROWS},
        "accounting": "individual",
    }
)
CTX = PublicContext(SCHEMA, None, DEFAULT_ORDERS)
USERS = 300
RNG = np.random.default_rng(37)
ROWS_PER_USER = RNG.integers(1, 5, USERS)  # some users have more rows than max_rows (bounded to 3)
TABLE: dict[str, np.ndarray] = {
    "user_id": np.repeat(np.arange(USERS), ROWS_PER_USER),
    "g": RNG.integers(0, 3, int(ROWS_PER_USER.sum())),
    "x": RNG.uniform(0.0, 10.0, int(ROWS_PER_USER.sum())),
    "n": RNG.integers(0, 6, int(ROWS_PER_USER.sum())),
    ORDER_COLUMN: RNG.permutation(int(ROWS_PER_USER.sum())).astype(np.int64),  # the secret row order
}
OUTSIDE_A, ONLY_A = 207, 208
TABLE["g"][TABLE["user_id"] == OUTSIDE_A] = 2  # only in cell "c": outside a where g == "a"
TABLE["g"][TABLE["user_id"] == ONLY_A] = 0  # only in cell "a"
BUDGET = UNITS_PER_EPSILON  # ε = 1 per unit, every slot (pure and each order)
SPENT_USERS = np.arange(0, 40)  # these users have spent their whole budget
COUNT_A = {"kind": "count", "where": [{"column": "g", "op": "eq", "value": "a"}]}
SUM_X = {"kind": "sum", "column": "x"}


def unit_filter(spent: dict[int, tuple[int, int]] | None = None) -> UnitFilter:
    """Every slot's capacity ε = 1; ``SPENT_USERS`` full on the pure and slope sides; ``spent`` more."""
    state = {int(u): (BUDGET, BUDGET) for u in SPENT_USERS}
    state.update(spent or {})
    units = np.array(sorted(state), dtype=np.int64)
    pure = np.array([state[int(u)][0] for u in units], dtype=np.int64)
    slope = np.array([state[int(u)][1] for u in units], dtype=np.int64)
    capacity = (BUDGET,) * (len(DEFAULT_ORDERS) + 1)
    return UnitFilter(DEFAULT_ORDERS, capacity, UnitLedger(UnitCharges(units, pure, slope)))


def without(units: np.ndarray) -> dict[str, np.ndarray]:
    keep = ~np.isin(TABLE["user_id"], units)
    return {name: values[keep] for name, values in TABLE.items()}


def charge_at(charges: UnitCharges, unit: int) -> tuple[int, int]:
    """(pure, slope) of ``unit`` (0, 0 when it pays nothing)."""
    where = np.flatnonzero(charges.units == unit)
    return (0, 0) if where.size == 0 else (int(charges.pure[where[0]]), int(charges.slope[where[0]]))


def selected_users(where_g: int | None) -> np.ndarray:
    rows = np.ones(TABLE["user_id"].size, dtype=bool) if where_g is None else TABLE["g"] == where_g
    return np.unique(TABLE["user_id"][rows])


def edge_states(
    unit: int, pure: int, slope: int
) -> tuple[dict[int, tuple[int, int]], dict[int, tuple[int, int]]]:
    """Spent states where ``unit``'s charge (pure, slope) just fits, and just does not (10 ledger units
    either side of the capacity; the smallest order leaves a slope charge the most room)."""
    if slope == 0:
        return {unit: (BUDGET - pure - 10, 0)}, {unit: (BUDGET - pure + 10, 0)}
    alpha = min(DEFAULT_ORDERS)
    room = int(BUDGET / alpha)
    return {unit: (0, room - slope - 10)}, {unit: (0, room - slope + 10)}


def assert_within_worst(charges: UnitCharges, worst: RdpCurve) -> None:
    """Every unit's charge at most the request's worst case (1 ledger unit per α of rounding slack): a pure
    charge against the pure slot (a unit's state keeps pure charges as pure: D_α ≤ D_∞, never the
    dataset's smaller pure_product curve), a curve pure + α·slope against every order."""
    assert charges.units.size > 0
    pure_only = not np.any(charges.slope > 0)
    if pure_only:
        assert np.all(charges.pure <= worst.pure * UNITS_PER_EPSILON + 1)
        return
    assert math.isinf(worst.pure)
    for alpha, value in zip(worst.orders, worst.values, strict=True):
        allowed = value * UNITS_PER_EPSILON + alpha + 1
        assert np.all(charges.pure + alpha * charges.slope.astype(float) <= allowed)


def test_the_families_are_declared_individual() -> None:
    names = {"accuracy_first.laplace", "accuracy_first.gaussian", "measures.laplace", "measures.gaussian"}
    assert names <= WITH_INDIVIDUAL
    assert "noise_reduction.laplace" not in WITH_INDIVIDUAL  # sessions stay refused
    for name in names:
        assert isinstance(MECHANISMS[name], IndividualMechanism)
    assert not isinstance(MECHANISMS["measures.laplace"], ReleaseDependentUnits)  # its charge is fixed


# ----- noise reduction ------------------------------------------------------------------------------------
LAPLACE_GRID = (0.05, 0.1, 0.2, 0.4)
GAUSSIAN_GRID = (400.0, 100.0, 40.0)


def nr_params(mechanism: AccuracyFirst, query: dict[str, Any], **fields: Any) -> Any:
    """A request whose worst case a fresh unit affords (Gaussian variances scaled by the query's Δ²)."""
    scale = 100.0 if query is SUM_X else 1.0  # Δ₂ = 30 vs 3
    variances = tuple(v * scale for v in GAUSSIAN_GRID)
    grid = {"epsilons": LAPLACE_GRID} if mechanism is ACCURACY_FIRST_LAPLACE else {"variances": variances}
    target = fields.pop("target", {"relative": 0.1})
    return mechanism.params_model.model_validate({"query": query, "target": target, **grid, **fields})


NR = [ACCURACY_FIRST_LAPLACE, ACCURACY_FIRST_GAUSSIAN]


@pytest.mark.parametrize("mechanism", NR, ids=lambda m: m.name)
@pytest.mark.parametrize("query", [COUNT_A, SUM_X], ids=["count", "sum"])
def test_nr_answer_is_the_dataset_answer_without_the_excluded_units(
    mechanism: AccuracyFirst, query: dict[str, Any]
) -> None:
    p = nr_params(mechanism, query)
    step = mechanism.unit_step(p, CTX, IndividualTable(TABLE, unit_filter()))
    plan = mechanism._plan(p, CTX)
    expected, _ = evaluate_units(p.query, CTX, without(SPENT_USERS), plan.grid_plan)
    everyone, _ = evaluate_units(p.query, CTX, TABLE, plan.grid_plan)
    assert np.array_equal(step.answer_units, expected)
    assert not np.array_equal(step.answer_units, everyone)  # power: the spent users were really left out
    where_g = 0 if query is COUNT_A else None
    assert np.array_equal(step.charges.units, np.setdiff1d(selected_users(where_g), SPENT_USERS))
    assert step.excluded == np.intersect1d(selected_users(where_g), SPENT_USERS).size


@pytest.mark.parametrize("mechanism", NR, ids=lambda m: m.name)
def test_nr_charges_grow_with_the_level_and_stay_below_the_worst_cases(mechanism: AccuracyFirst) -> None:
    p = nr_params(mechanism, SUM_X)
    table = IndividualTable(TABLE, unit_filter())
    worst_units = mechanism.unit_step(p, CTX, table).charges
    levels = len(LAPLACE_GRID if mechanism is ACCURACY_FIRST_LAPLACE else GAUSSIAN_GRID)
    previous = None
    for level in range(levels):
        charges = mechanism.unit_step(p, CTX, table, level).charges
        assert np.array_equal(charges.units, worst_units.units)
        assert np.all(charges.pure <= worst_units.pure)
        assert np.all(charges.slope <= worst_units.slope)
        assert_within_worst(charges, mechanism.family.charge(mechanism._plan(p, CTX), level, CTX.orders))
        if previous is not None:
            assert np.all(charges.pure + charges.slope >= previous.pure + previous.slope)
        previous = charges
    assert previous is not None
    assert np.array_equal(previous.pure, worst_units.pure)
    assert_within_worst(worst_units, mechanism.worst_case(p, CTX))
    # a real sum: units pay from their own x (spread), not all the public bound
    amounts = worst_units.pure + worst_units.slope
    assert amounts.min() < 0.5 * amounts.max()


def test_laplace_nr_unit_charge_is_its_rows_times_the_level_rate() -> None:
    p = nr_params(ACCURACY_FIRST_LAPLACE, COUNT_A)
    table = IndividualTable(TABLE, unit_filter())
    plan = ACCURACY_FIRST_LAPLACE._plan(p, CTX)
    rates = laplace_nr_rates(plan.sensitivity, LAPLACE_GRID)
    kept = np.minimum(np.bincount(TABLE["user_id"][TABLE["g"] == 0], minlength=USERS), MAX_ROWS)
    for level in (0, len(LAPLACE_GRID) - 1):
        charges = ACCURACY_FIRST_LAPLACE.unit_step(p, CTX, table, level).charges
        exact = [
            Fraction(int(kept[u]) * rates[level] * UNITS_PER_EPSILON, RATE_DENOMINATOR) for u in charges.units
        ]
        assert all(
            exact_u <= c <= exact_u + 2 for exact_u, c in zip(exact, charges.pure.tolist(), strict=True)
        )
        assert {int(kept[u]) for u in charges.units} == {1, 2, 3}  # the rows do vary
    assert charge_at(charges, OUTSIDE_A) == (0, 0)  # user 7 has no row with g == "a": it pays nothing
    assert charge_at(charges, ONLY_A)[0] > 0


def test_private_check_adds_epsilon_a_to_units_that_move_the_answer() -> None:
    private = {"epsilon_a": 0.05, "threshold": 0.0}
    p = nr_params(ACCURACY_FIRST_LAPLACE, COUNT_A, check="private", private=private)
    q = nr_params(ACCURACY_FIRST_LAPLACE, COUNT_A)
    table = IndividualTable(TABLE, unit_filter())
    with_iat = ACCURACY_FIRST_LAPLACE.unit_step(p, CTX, table, 1).charges
    without_iat = ACCURACY_FIRST_LAPLACE.unit_step(q, CTX, table, 1).charges
    assert np.array_equal(with_iat.units, without_iat.units)
    assert np.array_equal(with_iat.pure - without_iat.pure, np.full(with_iat.units.size, 5 * 10**10))
    assert_within_worst(
        ACCURACY_FIRST_LAPLACE.unit_step(p, CTX, table).charges, ACCURACY_FIRST_LAPLACE.worst_case(p, CTX)
    )


@pytest.mark.parametrize("mechanism", NR, ids=lambda m: m.name)
def test_nr_exclusion_at_the_edge_uses_the_worst_case(mechanism: AccuracyFirst) -> None:
    p = nr_params(mechanism, COUNT_A)
    worst = mechanism.unit_step(p, CTX, IndividualTable(TABLE, unit_filter())).charges
    pure, slope = charge_at(worst, ONLY_A)
    fits, over = edge_states(ONLY_A, pure, slope)
    admitted = mechanism.unit_step(p, CTX, IndividualTable(TABLE, unit_filter(fits))).charges
    excluded = mechanism.unit_step(p, CTX, IndividualTable(TABLE, unit_filter(over))).charges
    assert charge_at(admitted, ONLY_A) == (pure, slope)
    assert charge_at(excluded, ONLY_A) == (0, 0)
    assert np.array_equal(np.setdiff1d(admitted.units, excluded.units), [ONLY_A])


@pytest.mark.parametrize("mechanism", NR, ids=lambda m: m.name)
def test_nr_run_releases_the_level_charges_of_the_admitted_units(mechanism: AccuracyFirst) -> None:
    p = nr_params(mechanism, COUNT_A, target={"relative": 0.5})
    table = IndividualTable(TABLE, unit_filter())
    release = mechanism.run(p, CTX, table, Noise.seeded(5))
    assert release.units is not None
    replay = mechanism.released_unit_step(p, CTX, table, release.output).charges  # the ledger's replay
    assert isinstance(mechanism, ReleaseDependentUnits)
    assert np.array_equal(release.units.units, replay.units)
    assert np.array_equal(release.units.pure, replay.pure)
    assert np.array_equal(release.units.slope, replay.slope)
    worst = mechanism.unit_step(p, CTX, table).charges
    assert np.all(replay.pure + replay.slope <= worst.pure + worst.slope)
    if release.output["level"] < release.output["levels"] - 1:  # stopped early: the units keep the rest
        assert int((replay.pure + replay.slope).sum()) < int((worst.pure + worst.slope).sum())
    truth = float(np.count_nonzero(without(SPENT_USERS)["g"] == 0))  # kept rows: ≤ 3 per user
    assert abs(release.output["value"] - truth) < 0.5 * truth


def test_nr_refuses_a_mean_on_an_individual_dataset() -> None:
    p = nr_params(ACCURACY_FIRST_LAPLACE, {"kind": "mean", "column": "x"})
    with pytest.raises(ParamsError) as raised:
        ACCURACY_FIRST_LAPLACE.check(p, CTX)
    assert raised.value.field == "query.kind"


def test_coarse_grid_count_charges_the_rounding_unit() -> None:
    """γ > 1 (large units coarsen the Brownian grid of a count): a unit with one row can move round(c/γ) by
    one unit, so it must pay, not round |Δ|/γ = 1/2 down to 0."""
    assert SCHEMA.privacy_unit is not None
    unit = SCHEMA.privacy_unit.model_copy(update={"max_rows": 10_000})
    schema = SCHEMA.model_copy(update={"privacy_unit": unit})
    ctx = PublicContext(schema, None, DEFAULT_ORDERS)
    p: Any = ACCURACY_FIRST_GAUSSIAN.params_model.model_validate(
        {"query": COUNT_A, "target": {"relative": 0.1}, "variances": (4e9, 2e9)}
    )
    plan = ACCURACY_FIRST_GAUSSIAN._plan(p, ctx)
    assert plan.grid.granularity > 1
    assert not plan.grid_plan.exact
    charges = ACCURACY_FIRST_GAUSSIAN.unit_step(p, ctx, IndividualTable(TABLE, unit_filter())).charges
    assert charges.units.size > 100
    assert np.all(charges.slope > 0)


# ----- grouped measures -----------------------------------------------------------------------------------
MEASURES = [MeasuresLaplace(), MeasuresGaussian()]
GROUPED = {"measures": [{"kind": "count"}, {"kind": "mean", "column": "x"}, {"kind": "sum", "column": "n"}]}


def measures_params(mechanism: Any, **fields: Any) -> Any:
    cost = {"epsilon": 0.5} if isinstance(mechanism, MeasuresLaplace) else {"noise_multiplier": 3.0}
    return mechanism.params_model.model_validate({**GROUPED, "group_by": ["g"], **cost, **fields})


def measures_plans(mechanism: Any, p: Any) -> list[Any]:
    if isinstance(mechanism, MeasuresLaplace):
        return [plan for plan, _ in laplace_plans(p, CTX)]
    return [entry[0] for entry in gaussian_plans(p, CTX)]


def measures_worst(mechanism: Any, p: Any) -> RdpCurve:
    return (
        laplace_measures_curve(p, CTX)
        if isinstance(mechanism, MeasuresLaplace)
        else gaussian_measures_curve(p, CTX)
    )


@pytest.mark.parametrize("mechanism", MEASURES, ids=lambda m: m.name)
@pytest.mark.parametrize("where", [(), ({"column": "n", "op": "ge", "value": 2},)], ids=["all", "where"])
def test_measures_blocks_are_the_dataset_blocks_without_the_excluded_units(
    mechanism: Any, where: Any
) -> None:
    p = measures_params(mechanism, where=list(where))
    step = mechanism.unit_step(p, CTX, IndividualTable(TABLE, unit_filter()))
    plans = measures_plans(mechanism, p)
    expected, _ = evaluate_blocks(p, CTX, without(SPENT_USERS), plans)
    everyone, _ = evaluate_blocks(p, CTX, TABLE, plans)
    assert [b.block.label for b in plans] == ["count", "sum(n)", "csum(x)"]
    for got, want, full in zip(step.blocks, expected, everyone, strict=True):
        assert np.array_equal(got, want)
        assert not np.array_equal(got, full)
    assert step.excluded > 0
    assert np.intersect1d(step.charges.units, SPENT_USERS).size == 0
    assert_within_worst(step.charges, measures_worst(mechanism, p))


@pytest.mark.parametrize("mechanism", MEASURES, ids=lambda m: m.name)
def test_measures_unit_pays_for_its_own_cells_only(mechanism: Any) -> None:
    """A count grouped by g: a unit's charge is its own kept row count (whatever cells they are in) times the
    block's rate; a unit outside the where pays nothing."""
    count_only = {"measures": [{"kind": "count"}]}
    p = measures_params(mechanism, **count_only, where=[{"column": "g", "op": "ne", "value": "c"}])
    charges = mechanism.unit_step(p, CTX, IndividualTable(TABLE, unit_filter())).charges
    assert charge_at(charges, OUTSIDE_A) == (0, 0)  # all of its rows are in "c"
    selected = TABLE["g"] != 2
    kept = np.minimum(np.bincount(TABLE["user_id"][selected], minlength=USERS), MAX_ROWS)
    if isinstance(mechanism, MeasuresLaplace):
        _, scale = laplace_plans(p, CTX)[0]
        assert scale is not None
        amounts, per = charges.pure, Fraction(UNITS_PER_EPSILON) / scale
        exact = [per * int(kept[u]) for u in charges.units]  # ℓ1 = the unit's rows
    else:
        _plan, sigma, _ = gaussian_plans(p, CTX)[0]
        assert sigma is not None
        amounts, per = charges.slope, Fraction(UNITS_PER_EPSILON) / (2 * Fraction(sigma) ** 2)
        # ℓ2² = Σ over the unit's cells of (its rows there)²: the unit's own cells, not the public k²
        rows = TABLE["user_id"][selected] * 3 + TABLE["g"][selected]
        per_cell = np.bincount(rows, minlength=USERS * 3).reshape(USERS, 3)
        exact = [per * int((per_cell[u] ** 2).sum()) for u in charges.units if kept[u] == per_cell[u].sum()]
        amounts = np.array(
            [a for a, u in zip(amounts, charges.units, strict=True) if kept[u] == per_cell[u].sum()]
        )
    assert len(exact) > 100
    assert all(e <= a <= e + 2 for e, a in zip(exact, amounts.tolist(), strict=True))
    assert len(set(amounts.tolist())) >= 3  # the charges really vary with the unit's data


@pytest.mark.parametrize("mechanism", MEASURES, ids=lambda m: m.name)
def test_measures_exclusion_at_the_edge(mechanism: Any) -> None:
    p = measures_params(mechanism)
    worst = mechanism.unit_step(p, CTX, IndividualTable(TABLE, unit_filter())).charges
    pure, slope = charge_at(worst, ONLY_A)
    fits, over = edge_states(ONLY_A, pure, slope)
    admitted = mechanism.unit_step(p, CTX, IndividualTable(TABLE, unit_filter(fits))).charges
    excluded = mechanism.unit_step(p, CTX, IndividualTable(TABLE, unit_filter(over))).charges
    assert charge_at(admitted, ONLY_A) == (pure, slope)
    assert pure + slope > 0
    assert charge_at(excluded, ONLY_A) == (0, 0)


@pytest.mark.parametrize("mechanism", MEASURES, ids=lambda m: m.name)
def test_measures_run_carries_the_unit_step_charges(mechanism: Any) -> None:
    p = measures_params(mechanism)
    table = IndividualTable(TABLE, unit_filter())
    release = mechanism.run(p, CTX, table, Noise.seeded(3))
    replay = mechanism.unit_step(p, CTX, table).charges
    assert release.units is not None
    assert np.array_equal(release.units.units, replay.units)
    assert np.array_equal(release.units.pure, replay.pure)
    assert np.array_equal(release.units.slope, replay.slope)
    assert [group["key"]["g"] for group in release.output["groups"]] == ["a", "b", "c"]


def test_brownian_unit_charge_covers_the_per_step_composition_at_the_unit_shift() -> None:
    """A count unit with k rows moves one coordinate by δ = k/γ grid units: its charge must cover Theorem
    B-1's C_S at that shift (``brownian_cumulative_costs`` with ‖m‖₂ = δ and d = 1: the same rounding term)
    and be far below the dataset's C_S at the public k = 3 when it has one row."""
    p = nr_params(ACCURACY_FIRST_GAUSSIAN, COUNT_A)
    plan = ACCURACY_FIRST_GAUSSIAN._plan(p, CTX)
    table = IndividualTable(TABLE, unit_filter())
    kept = np.minimum(np.bincount(TABLE["user_id"][TABLE["g"] == 0], minlength=USERS), MAX_ROWS)
    for level in range(len(GAUSSIAN_GRID)):
        charges = ACCURACY_FIRST_GAUSSIAN.unit_step(p, CTX, table, level).charges
        for rows in (1, 2, 3):
            shift = rows / plan.grid.granularity
            exact = brownian_cumulative_costs(shift, GAUSSIAN_GRID, 1, plan.grid)[level] * UNITS_PER_EPSILON
            paid = charges.slope[kept[charges.units] == rows]
            assert paid.size > 0
            assert np.all(paid >= exact)
            assert np.all(paid <= exact * (1 + 1e-9) + 3)  # the same bound, three roundings up
        dataset = brownian_cumulative_costs(plan.sensitivity, GAUSSIAN_GRID, 1, plan.grid)[level]
        assert charges.slope[kept[charges.units] == 1].max() < 0.2 * dataset * UNITS_PER_EPSILON
