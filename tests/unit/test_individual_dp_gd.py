"""``dp_gd`` under individual accounting (docs/privacy/individual.md#individual-dp-gd).

At every step t each unit u takes part only if its filter (its charges of earlier releases and of the steps
before t) affords its own charge α‖W_u(θ_t)‖²/(2t²), W_u its clipped summed gradient in term units and t
the discrete Gaussian's integer std; otherwise W_u is left out of the step's sum. Checked here against an
independent reconstruction: each unit's W_u computed from that unit's rows alone, the charges in exact
rationals, the Feldman–Zrnic rule in exact integers, the iterates from the same seeded draws. A variant
that never excludes anyone releases a different θ (the comparison has power), and the service's admission
test asks for one step, not the run.
"""

from __future__ import annotations

import math
from dataclasses import replace
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from mechanisms.accounting import DEFAULT_ORDERS, UNITS_PER_EPSILON, UnitsVector
from mechanisms.accounting.conversion import capacity_units
from mechanisms.accounting.individual import UnitCharges, UnitFilter, UnitLedger
from mechanisms.base import PublicContext, Release
from mechanisms.data.plan import ORDER_COLUMN
from mechanisms.data.schema import DatasetSchema
from mechanisms.learners.dp_gd import (
    DpGdConfig,
    DpGdMechanism,
    DpGdParams,
    clip_unit_sums,
    clipped_sum_units,
    dp_gd_curve,
    grid_records,
    individual_dp_gd_train,
    noise_units,
)
from mechanisms.learners.features import design_matrix, learner_task
from mechanisms.learners.relative_gaussian import project_to_ball
from mechanisms.noise import Noise
from mechanisms.noise.learners import discrete_gaussian_std
from mechanisms.queries.individual import IndividualTable
from service.data.ingest import unit_order
from service.filter.batch import admits_state
from service.filter.state import FilterState
from service.store.models import DATASET_SCOPE
from tests.engine_support import engine_table

K = 3
COLUMNS: list[dict[str, Any]] = [
    {"name": "user", "type": "int", "min": 0, "max": 10**6},
    {"name": "a", "type": "float", "min": -1.0, "max": 1.0},
    {"name": "b", "type": "float", "min": -1.0, "max": 1.0},
    {"name": "y", "type": "categorical", "values": ["no", "yes"]},
]


def _ctx(max_rows: int = K) -> PublicContext:
    schema = DatasetSchema.model_validate(
        {
            "columns": COLUMNS,
            "neighboring": "add_remove",
            "privacy_unit": {"column": "user", "max_rows": max_rows},
            "accounting": "individual",
        }
    )
    return PublicContext(schema, None, DEFAULT_ORDERS)


def _table(n: int, units: int, seed: int) -> dict[str, np.ndarray]:
    """Rows of ``units`` users (ids spread up to 10⁶, some with more than K rows); each user has a typical
    direction, so that gradient norms differ between users."""
    rng = np.random.default_rng(seed)
    ids = rng.choice(10**6, units, replace=False)
    user = ids if n == units else ids[rng.integers(0, units, n)]  # n == units: one row each
    centre = rng.uniform(-1, 1, (units, 2))
    index = np.searchsorted(np.sort(ids), user)
    where = centre[np.argsort(ids)][index]
    columns = {
        "user": user.astype(np.int64),
        "a": np.clip(where[:, 0] + rng.normal(0, 0.2, n), -1, 1),
        "b": np.clip(where[:, 1] + rng.normal(0, 0.2, n), -1, 1),
        "y": rng.integers(0, 2, n),
    }
    columns[ORDER_COLUMN] = unit_order([pa.array(columns[c["name"]]) for c in COLUMNS], 0x3A).to_numpy()
    return columns


def _params(**changes: Any) -> DpGdParams:
    raw: dict[str, Any] = {"features": ["a", "b"], "label": "y", "steps": 8, "noise_multiplier": 2.0,
                           "n_hint": 300, "clip": 0.5, "return_iterates": True}  # fmt: skip
    raw.update(changes)
    return DpGdParams.model_validate(raw)


def _budget(ctx: PublicContext, epsilon: float) -> tuple[int | None, ...]:
    return capacity_units(epsilon, 1e-6, ctx.orders)


def _run(
    params: DpGdParams,
    ctx: PublicContext,
    table: Any,
    capacity: tuple[int | None, ...],
    ledger: UnitLedger,
    seed: int,
) -> Release:
    unit_filter = UnitFilter(ctx.orders, capacity, ledger)
    return DpGdMechanism().run(params, ctx, IndividualTable(table, unit_filter), Noise.seeded(seed))


# ----- the independent reconstruction -----------------------------------------------------------------------
def _design(
    params: DpGdParams, ctx: PublicContext, table: dict[str, np.ndarray]
) -> tuple[np.ndarray, np.ndarray]:
    """The design matrix (features scaled, intercept, rows clipped to norm 1) and labels ±1."""
    return design_matrix(params, ctx, table, learner_task(params.model, params.task), params.row_norm)


def _kept(table: dict[str, np.ndarray], unit: int, max_rows: int) -> np.ndarray:
    """The unit's rows with the ``max_rows`` smallest ``__order`` (distinct keys here: no ties)."""
    rows = np.flatnonzero(table["user"] == unit)
    return rows[np.argsort(table[ORDER_COLUMN][rows])[:max_rows]]


def _vector(theta: np.ndarray, x: np.ndarray, y: np.ndarray, clip: float, z: float) -> list[int]:
    """W_u from the unit's rows alone: its row-level clipped terms summed exactly, clipped to F."""
    records = grid_records(x, y, clip, noise_multiplier=z)
    total = clipped_sum_units(theta, records, "logistic")
    return [int(v) for v in clip_unit_sums(total[:, None], clip / records.unit)[:, 0]]


def _fits(spent: int, charge: int, orders: tuple[float, ...], capacity: tuple[int | None, ...]) -> bool:
    """The Feldman–Zrnic rule in exact arithmetic (slope charges only: the pure slot is never usable)."""
    return any(
        cap is not None and Fraction(alpha) * (spent + charge) <= cap
        for alpha, cap in zip(orders, capacity[:-1], strict=True)
    )


def _reconstruct(
    params: DpGdParams,
    ctx: PublicContext,
    table: dict[str, np.ndarray],
    capacity: tuple[int | None, ...],
    spent: dict[int, int],
    seed: int,
    exclude: bool = True,
) -> tuple[np.ndarray, dict[int, int], list[set[int]]]:
    """(iterates, each unit's exact total slope charge Σ⌈‖W_u‖²·10¹²/(2t²)⌉ over its admitted steps, the
    excluded units per step)."""
    config: DpGdConfig = DpGdMechanism()._config(params, ctx)
    x, y = _design(params, ctx, table)
    units = sorted({int(u) for u in table["user"]})
    kept = {u: _kept(table, u, ctx.schema.unit_rows) for u in units}
    t_units = noise_units(config)
    d = x.shape[1]
    draws = discrete_gaussian_std(Noise.seeded(seed), t_units, config.steps * d).reshape(config.steps, d)
    theta = np.zeros(d)
    paid = dict.fromkeys(units, 0)
    iterates, excluded = [], []
    omega = grid_records(x[:1], y[:1], config.clip, noise_multiplier=config.noise_multiplier).unit
    for step in range(config.steps):
        total = [0] * d
        left_out = set()
        for u in units:
            w = _vector(theta, x[kept[u]], y[kept[u]], config.clip, config.noise_multiplier)
            charge = math.ceil(Fraction(sum(v * v for v in w) * UNITS_PER_EPSILON, 2 * t_units * t_units))
            if exclude and not _fits(spent.get(u, 0) + paid[u], charge, ctx.orders, capacity):
                left_out.add(u)
                continue
            paid[u] += charge
            total = [a + b for a, b in zip(total, w, strict=True)]
        noisy = (np.array(total, dtype=np.int64) + draws[step]).astype(np.float64) * omega
        theta = theta - config.step_size * (noisy / float(params.n_hint or 1) + config.reg * theta)
        assert config.radius is not None
        theta = project_to_ball(theta, config.radius)
        iterates.append(theta)
        excluded.append(left_out)
    return np.array(iterates), {u: c for u, c in paid.items() if c > 0}, excluded


def _charges(release: Release) -> dict[int, int]:
    assert release.units is not None
    assert release.units.units.dtype == np.int64
    assert np.all(release.units.pure == 0)
    return {int(u): int(s) for u, s in zip(release.units.units, release.units.slope, strict=True)}


def _close(found: dict[int, int], exact: dict[int, int], steps: int) -> None:
    """The run's charges are the exact ones rounded up, at most one ledger unit more per step."""
    assert found.keys() == exact.keys()
    for unit, charge in exact.items():
        assert charge <= found[unit] <= charge + steps, unit


# ----- the tests --------------------------------------------------------------------------------------------
def test_charges_are_the_sum_of_the_units_own_step_charges() -> None:
    """A budget no unit exhausts: every unit takes part in every step and pays Σ_t ⌈‖W_u(θ_t)‖²/(2t²)⌉,
    recomputed from each unit's rows alone at the released iterates; the output is the reconstruction's."""
    ctx, table, params = _ctx(), _table(300, 60, 1), _params()
    capacity = _budget(ctx, 1000.0)
    release = _run(params, ctx, table, capacity, UnitLedger.empty(), 5)
    iterates, exact, excluded = _reconstruct(params, ctx, table, capacity, {}, 5)
    assert not any(excluded)
    assert np.array_equal(np.array(release.output["iterates"]), iterates)
    _close(_charges(release), exact, params.steps)
    assert len(exact) == 60
    charges = np.array(list(exact.values()), dtype=float)
    assert charges.max() > 2.0 * charges.min()  # the units really pay different amounts


def test_an_exhausted_unit_is_left_out_of_every_later_step() -> None:
    """One row per unit and a clip far below every gradient norm: each unit pays the same full step each
    time, so with room for exactly 3 steps every unit takes part in steps 1–3 and in no later one."""
    ctx, table, params = _ctx(max_rows=1), _table(40, 40, 2), _params(clip=0.01, steps=7)
    config = DpGdMechanism()._config(params, ctx)
    t_units = noise_units(config)
    full = Fraction(UNITS_PER_EPSILON, 2 * t_units * t_units) * (config.clip / _omega(config)) ** 2
    alpha = 2.0
    slots: list[int | None] = [None] * (len(ctx.orders) + 1)
    slots[ctx.orders.index(alpha)] = int(alpha * 3.5 * full)
    capacity = tuple(slots)
    release = _run(params, ctx, table, capacity, UnitLedger.empty(), 3)
    iterates, exact, excluded = _reconstruct(params, ctx, table, capacity, {}, 3)
    assert [len(e) for e in excluded] == [0, 0, 0, 40, 40, 40, 40]
    assert np.array_equal(np.array(release.output["iterates"]), iterates)
    _close(_charges(release), exact, params.steps)
    assert release.units is not None
    unit_filter = UnitFilter(ctx.orders, capacity, UnitLedger(release.units))
    smaller = np.full(40, int(0.99 * full))  # even a step 1 % cheaper than the last ones does not fit
    one_more = UnitCharges(release.units.units, np.zeros(40, np.int64), smaller)
    assert not unit_filter.admits(one_more).any()


def _omega(config: DpGdConfig) -> float:
    x = np.array([[1.0]])
    return grid_records(x, np.ones(1), config.clip, noise_multiplier=config.noise_multiplier).unit


@pytest.mark.parametrize("seed", [7, 8])
def test_the_release_is_dp_gd_without_the_excluded_units_and_within_every_budget(seed: int) -> None:
    """Units with an earlier release's charges, a budget that some exhaust mid-run: the output equals the
    reconstruction (the same draws, the excluded units' W_u left out step by step), every unit's total is
    within its budget, and a variant that never excludes releases another θ (the check has power)."""
    ctx, table = _ctx(), _table(400, 80, seed)
    params = _params(steps=10, clip=1.0, noise_multiplier=8.0)
    capacity = _budget(ctx, 2.0)
    rng = np.random.default_rng(seed)
    earlier_units = np.sort(rng.choice(np.unique(table["user"]), 30, replace=False))
    room = int(capacity[ctx.orders.index(48.0)] or 0) // 48  # slope units one unit can spend
    earlier = rng.integers(0, room // 2, 30)  # spent by an earlier release
    ledger = UnitLedger(UnitCharges(earlier_units, np.zeros(30, np.int64), earlier))
    release = _run(params, ctx, table, capacity, ledger, seed)
    spent = {int(u): int(s) for u, s in zip(earlier_units, earlier, strict=True)}
    iterates, exact, excluded = _reconstruct(params, ctx, table, capacity, spent, seed)
    assert 0 < sum(len(e) for e in excluded) < 80 * params.steps
    assert excluded[0] != excluded[-1]  # units drop out while the run goes on
    assert np.array_equal(np.array(release.output["iterates"]), iterates)
    found = _charges(release)
    _close(found, exact, params.steps)
    after = ledger.charged(release.units or UnitCharges.empty())
    for unit in np.unique(table["user"]):
        total = int(after.of(np.array([unit]))[1][0])
        assert _fits(total, 0, ctx.orders, capacity), unit
    everyone, _, _ = _reconstruct(params, ctx, table, capacity, spent, seed, exclude=False)
    assert not np.allclose(everyone[-1], iterates[-1], rtol=0, atol=1e-9)


def test_a_streamed_snapshot_gives_the_same_release_and_charges(tmp_path: Path) -> None:
    """The DuckDB-scanned Parquet snapshot (streamed record batches) and the dict give the same iterates
    and the same per-unit charges (unit ids int64, as ``aggregate_units`` reports them)."""
    ctx, table, params = _ctx(), _table(500, 90, 4), _params(steps=6)
    capacity = _budget(ctx, 0.5)
    in_memory = _run(params, ctx, table, capacity, UnitLedger.empty(), 9)
    scanned = engine_table(table, ctx.schema, tmp_path, extra={ORDER_COLUMN: table[ORDER_COLUMN]})
    streamed = _run(params, ctx, scanned, capacity, UnitLedger.empty(), 9)
    assert streamed.output == in_memory.output
    assert _charges(streamed) == _charges(in_memory)
    assert set(_charges(in_memory)) <= {int(u) for u in table["user"]}


def test_a_unit_pays_at_most_one_step_of_the_worst_case_per_step() -> None:
    """``individual_worst_case`` is one step of the run's curve, α/(2z²), and every unit's charge per step
    is below it (the totals of a run of T steps are ≤ T·α/(2z²) in slope units, up to rounding)."""
    ctx, table, params = _ctx(), _table(300, 60, 6), _params(steps=5)
    step = DpGdMechanism().individual_worst_case(params, ctx)
    config = DpGdMechanism()._config(params, ctx)
    one = dp_gd_curve(replace(config, steps=1), "add_remove", ctx.orders)
    assert step.values == one.values
    for alpha, value in zip(ctx.orders, step.values, strict=True):
        assert value == pytest.approx(alpha / (2 * 2.0**2), rel=1e-9)
    release = _run(params, ctx, table, _budget(ctx, 1000.0), UnitLedger.empty(), 1)
    per_step = Fraction(UNITS_PER_EPSILON, 2 * 4)  # slope units of α/(2z²), z = 2
    assert max(_charges(release).values()) <= params.steps * per_step + params.steps


def test_admission_on_an_individual_dataset_asks_for_one_step() -> None:
    """The dataset filter admits a dp_gd run whose T steps exceed the whole budget when one step fits a
    unit with nothing spent (``unit_charge``), and still refuses when even one step does not."""
    ctx = _ctx()
    slots = len(ctx.orders) + 1
    state = FilterState.empty(slots).with_capacity(_budget(ctx, 1.0))
    params = _params(steps=400, noise_multiplier=10.0)
    mechanism = DpGdMechanism()
    run = UnitsVector.charge(mechanism.worst_case(params, ctx))
    step = UnitsVector.charge(mechanism.individual_worst_case(params, ctx))
    assert not admits_state(DATASET_SCOPE, state, run, individual=True)
    assert admits_state(DATASET_SCOPE, state, run, individual=True, unit_charge=step)
    tight = _params(steps=400, noise_multiplier=2.0)
    too_much = UnitsVector.charge(mechanism.individual_worst_case(tight, ctx))
    assert not admits_state(
        DATASET_SCOPE, state, UnitsVector.charge(mechanism.worst_case(tight, ctx)), individual=True,
        unit_charge=too_much,
    )  # fmt: skip
    assert not admits_state("analyst:x", state, run, individual=True, unit_charge=step)


def test_the_library_function_is_the_mechanism_on_a_design_matrix() -> None:
    """``individual_dp_gd_train`` on the design matrix, unit ids and bounding order releases the service
    mechanism's iterates and charges (the same seeded draws)."""
    ctx, table, params = _ctx(), _table(300, 50, 11), _params(steps=6)
    capacity = _budget(ctx, 0.5)
    release = _run(params, ctx, table, capacity, UnitLedger.empty(), 2)
    x, y = _design(params, ctx, table)
    config = DpGdMechanism()._config(params, ctx)
    unit_filter = UnitFilter(ctx.orders, capacity, UnitLedger.empty())
    iterates, charges = individual_dp_gd_train(
        config, x, y, table["user"], table[ORDER_COLUMN], K, 300.0, Noise.seeded(2), unit_filter
    )
    assert np.array_equal(iterates, np.array(release.output["iterates"]))
    assert _charges(Release(release.output, release.realized, charges)) == _charges(release)
