"""Monte Carlo audit of individual accounting (docs/privacy/individual.md#theorem-individual): a unit's
privacy loss stays within its own filter when it sits at the exclusion edge.

Setting: the real ``Laplace``/``Gaussian`` of an ``accounting: individual`` dataset (privacy unit ``user``,
``max_rows`` 4, add/remove), run on an :class:`IndividualTable` of NumPy columns with a :class:`UnitFilter`
whose state is set directly (``UnitLedger``) or reached by earlier releases. D has the target unit u (3
rows: two in group a, one in b); D′ = D without u, with the same prior state for every other unit (some of
them spent, a few excluded in both worlds) and no entry for u.

Every audited release is ``γ·(unit_step answer + noise)``: ``test_the_real_runs_are_the_audited_sampler``
pins that ``Laplace.run``/``Gaussian.run`` under ``Noise.seeded(s)`` release exactly that with the draw of a
fresh ``Noise.seeded(s)``, and charge exactly ``unit_step``'s charges; the large samples then draw the
mechanism's noise vectorised around the real ``unit_step`` answers. The loss is estimated as in
tests/statistical/test_privacy_units_audit.py (whose ``estimate_loss``, ``scalar_edges`` and
``scalar_classes`` are reused): outputs fall into classes fixed before sampling, and each class gets a
Clopper–Pearson lower bound on |log P_D/P_D′|, Bonferroni-corrected to a false-alarm probability ≤ 1e-6 per
audit. For Gaussian releases (Rényi charges, no pure bound) the estimate is a lower bound on the unit's
ρ (D_α ≤ α·ρ) from Rényi probability preservation, P(S) ≤ (e^{D_α} Q(S))^{(α−1)/α} (Mironov 2017, Prop. 10),
on tail events, with the same Clopper–Pearson bounds.

Checks:

1. u cannot afford the release (pure slot: spent = capacity − charge + 1 ledger unit; Gaussian: one ledger
   unit of slope above the largest admitted one): the outputs on D and D′ are indistinguishable (estimate 0);
2. u can just afford it (spent = capacity − charge; the Gaussian edge): estimate ≤ u's own charge, and close
   to it (power);
3. an adaptive sequence of six Laplace counts (each query chosen from the previous noisy answer) from a
   fresh filter: the whole transcript's estimated loss ≤ u's largest total charge over the paths ≤ its budget;
4. the broken variant, **exclusion after the computation** (the answer over every unit, only the admitted
   ones charged; a test-local filter whose ``admits`` is all-true for the aggregate), is caught: at the edge
   the outputs differ (estimate > 0), with a quarter of u's charge left its estimate exceeds that remaining
   budget, over the sequence its transcript loss exceeds u's budget.

Measured (seeds as below, 400 000 runs per dataset): Laplace at the edge 0.716 (charge 0.75), excluded 0,
broken 0.716 (at the edge and with 0.19 ε left); Gaussian at the order edge ρ 0.330 (charge 0.5), excluded 0,
broken ρ 0.330 (class estimate 2.53); the sequence 0.815 (u's largest total charge 0.875), broken 2.01
(largest loss 2.25); the slow real-run sequence 0.428 (5 000 transcripts). Runtime 15–30 s (the slow test
20–60 s; idle vs loaded machine).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from scipy import stats

from mechanisms.accounting import DEFAULT_ORDERS, UNITS_PER_EPSILON, capacity_units
from mechanisms.accounting.individual import UnitCharges, UnitFilter, UnitLedger
from mechanisms.base import PublicContext
from mechanisms.data.plan import ORDER_COLUMN
from mechanisms.data.schema import DatasetSchema
from mechanisms.noise import Noise
from mechanisms.queries.gaussian import Gaussian, GaussianParams, gaussian_plan
from mechanisms.queries.individual import IndividualTable, UnitStep
from mechanisms.queries.language import laplace_plan
from mechanisms.queries.laplace import Laplace, LaplaceParams
from service.data.ingest import unit_order
from tests.statistical.test_privacy_units_audit import (
    FALSE_ALARM,
    Estimate,
    estimate_loss,
    scalar_classes,
    scalar_edges,
)

pytestmark = pytest.mark.statistical

RUNS = 400_000
TIGHT = 0.9
TIGHT_SEQUENCE = 0.8
K = 4
TARGET = 999
SECRET = 0x1D1F_A0D17
DELTA = 1e-6
LAPLACE_BUDGET = 1.0
GAUSSIAN_BUDGET = 10.0
"""The Gaussian audit's dataset budget: at ε = 1 a fresh unit could only afford ρ ≈ 0.014 (too small to see);
at ε = 10 the orders allow ρ up to ≈ 1.16 (α = 5)."""

SCHEMA = DatasetSchema.model_validate(
    {
        "columns": [
            {"name": "user", "type": "int", "min": 0, "max": 10**6},
            {"name": "g", "type": "categorical", "values": ["a", "b", "c", "d"]},
            {"name": "v", "type": "int", "min": 0, "max": 9},
        ],
        "neighboring": "add_remove",
        "privacy_unit": {"column": "user", "max_rows": K},
        "accounting": "individual",
    }
)
CTX = PublicContext(SCHEMA, None, DEFAULT_ORDERS)

COUNT = LaplaceParams.model_validate({"query": {"kind": "count"}, "epsilon": 1.0})
GAUSS_COUNT = GaussianParams.model_validate({"query": {"kind": "count"}, "sigma": 3.0})
STEP_EPSILON = 0.5
SEQUENCE_QUERIES = (
    LaplaceParams.model_validate({"query": {"kind": "count"}, "epsilon": STEP_EPSILON}),
    LaplaceParams.model_validate(
        {
            "query": {"kind": "count", "where": [{"column": "g", "op": "eq", "value": "a"}]},
            "epsilon": STEP_EPSILON,
        }
    ),
)
"""The adaptive sequence's two queries: u pays 3/8 ε for the count and 2/8 ε for its two rows in a."""
SEQUENCE_STEPS = 6


# ----- the pair ------------------------------------------------------------------------------------------
def _table(user: np.ndarray, g: np.ndarray, v: np.ndarray) -> dict[str, np.ndarray]:
    columns = {"user": user.astype(np.int64), "g": g.astype(np.int64), "v": v.astype(np.int64)}
    columns[ORDER_COLUMN] = unit_order([pa.array(columns[n]) for n in ("user", "g", "v")], SECRET).to_numpy()
    return columns


def _pair() -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """D: 30 ordinary units of 1–4 rows and u (3 rows: a, a, b); D′: the same rows without u's."""
    rng = np.random.default_rng(20261208)
    sizes = rng.integers(1, K + 1, 30)
    user = np.concatenate([np.repeat(np.arange(30), sizes), np.full(3, TARGET)])
    g = np.concatenate([rng.integers(0, 4, sizes.sum()), [0, 0, 1]])
    v = np.concatenate([rng.integers(0, 10, sizes.sum()), [9, 9, 9]])
    with_u = _table(user, g, v)
    keep = user != TARGET
    return with_u, {name: column[keep] for name, column in with_u.items()}


D, D_PRIME = _pair()


def _capacity(budget: float) -> tuple[int | None, ...]:
    return capacity_units(budget, DELTA, DEFAULT_ORDERS)


def _others(capacity: tuple[int | None, ...]) -> UnitCharges:
    """The other units' prior state (the same in both worlds): units 0–9 spent, 0 and 1 past their budget."""
    pure_cap = capacity[-1]
    assert pure_cap is not None
    pure = np.array([pure_cap, pure_cap] + [pure_cap // (i + 2) for i in range(8)], dtype=np.int64)
    return UnitCharges(np.arange(10), pure, np.zeros(10, dtype=np.int64))


def _filters(budget: float, u_pure: int, u_slope: int) -> tuple[UnitFilter, UnitFilter]:
    """(the filter of world D, with u's spent (pure, slope); that of world D′, without an entry for u)."""
    capacity = _capacity(budget)
    others = _others(capacity)
    target = UnitCharges(np.array([TARGET]), np.array([u_pure]), np.array([u_slope]))
    with_u = UnitFilter(DEFAULT_ORDERS, capacity, UnitLedger(others).charged(target))
    return with_u, UnitFilter(DEFAULT_ORDERS, capacity, UnitLedger(others))


# ----- the broken variant: exclusion after the computation -----------------------------------------------
class AdmitAll(UnitFilter):
    """A filter that lets every unit into the aggregate (the answer over all units)."""

    def admits(self, step: UnitCharges) -> np.ndarray:
        return np.ones(len(step), dtype=bool)


Stepper = Callable[[Any, IndividualTable], UnitStep]


def real_step(params: LaplaceParams | GaussianParams, table: IndividualTable) -> UnitStep:
    if isinstance(params, LaplaceParams):
        return Laplace().unit_step(params, CTX, table)
    return Gaussian().unit_step(params, CTX, table)


def broken_step(params: LaplaceParams | GaussianParams, table: IndividualTable) -> UnitStep:
    """The answer computed over every unit; the charges (and the state) those of the real rule: only the
    units it admits are charged, the others still move the answer."""
    charged = real_step(params, table)
    everyone = AdmitAll(table.filter.orders, table.filter.capacity, table.filter.ledger)
    unfiltered = real_step(params, IndividualTable(table.table, everyone))
    return UnitStep(unfiltered.answer_units, unfiltered.labels, charged.charges, charged.excluded)


# ----- charges and edges ---------------------------------------------------------------------------------
def _u_charge(params: LaplaceParams | GaussianParams, budget: float) -> tuple[int, int]:
    """u's (pure, slope) charge for ``params`` from a fresh filter (its own rows and public parameters)."""
    fresh = UnitFilter(DEFAULT_ORDERS, _capacity(budget), UnitLedger.empty())
    charges = real_step(params, IndividualTable(D, fresh)).charges
    where = np.flatnonzero(charges.units == TARGET)
    assert where.size == 1, "a fresh u must afford the audited release"
    return int(charges.pure[where[0]]), int(charges.slope[where[0]])


def _largest_admitted_slope(budget: float) -> int:
    """The largest total slope (pure 0) the filter admits at some order (bisection on ``admits``)."""
    unit_filter = UnitFilter(DEFAULT_ORDERS, _capacity(budget), UnitLedger.empty())

    def fits(total: int) -> bool:
        step = UnitCharges(np.array([TARGET]), np.array([0]), np.array([total]))
        return bool(unit_filter.admits(step)[0])

    low, high = 0, 10**15
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def _answers(
    params: LaplaceParams | GaussianParams, filters: tuple[UnitFilter, UnitFilter], stepper: Stepper
) -> tuple[int, int, UnitStep]:
    """(answer on D, answer on D′ in grid units, the step on D) of one release."""
    on_d = stepper(params, IndividualTable(D, filters[0]))
    on_dp = stepper(params, IndividualTable(D_PRIME, filters[1]))
    return int(on_d.answer_units[0]), int(on_dp.answer_units[0]), on_d


# ----- samplers ------------------------------------------------------------------------------------------
def _laplace_scale(params: LaplaceParams) -> Fraction:
    return laplace_plan(params.query, CTX, params.epsilon)[1]


def _laplace_sample(center: int, params: LaplaceParams, seed: int, runs: int = RUNS) -> np.ndarray:
    result: np.ndarray = center + Noise.seeded(seed).discrete_laplace(_laplace_scale(params), runs)
    return result


def _gaussian_sample(center: int, params: GaussianParams, seed: int, runs: int = RUNS) -> np.ndarray:
    variance = gaussian_plan(params, CTX)[2]
    result: np.ndarray = center + Noise.seeded(seed).discrete_gaussian(variance, runs)
    return result


def _audit_laplace(a: int, b: int, params: LaplaceParams, seed: int) -> Estimate:
    edges = scalar_edges(a, b, float(_laplace_scale(params)))
    classes = [scalar_classes(_laplace_sample(c, params, seed + i), edges) for i, c in enumerate((a, b))]
    return estimate_loss(classes[0], classes[1], edges.size + 1)


def _audit_gaussian_classes(a: int, b: int, params: GaussianParams, seed: int) -> Estimate:
    sigma = math.sqrt(float(gaussian_plan(params, CTX)[2]))
    edges = scalar_edges(a, b, sigma)
    classes = [scalar_classes(_gaussian_sample(c, params, seed + i), edges) for i, c in enumerate((a, b))]
    return estimate_loss(classes[0], classes[1], edges.size + 1)


# ----- the Rényi estimate of a Gaussian release -----------------------------------------------------------
RENYI_ORDERS = (1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 16.0, 32.0)


@dataclass(frozen=True)
class RenyiEstimate:
    rho: float  # lower confidence bound on the smallest ρ with D_α ≤ α·ρ at every α (both directions)
    event: str

    def summary(self) -> str:
        return f"estimated ρ {self.rho:.4f} ({self.event})"


def estimate_rho(sample_d: np.ndarray, sample_dp: np.ndarray, thresholds: np.ndarray) -> RenyiEstimate:
    """For every tail event S ({y ≥ c} and {y < c}) and both directions (P, Q) ∈ {(D, D′), (D′, D)}:
    D_α(P‖Q) ≥ α/(α−1)·log P(S) − log Q(S) (probability preservation), so ρ ≥ that / α. P(S) from below and
    Q(S) from above by Clopper–Pearson, all 4·(2·|thresholds|) bounds at FALSE_ALARM/(that many)."""
    counts = []
    for sample in (sample_d, sample_dp):
        upper = sample.size - np.searchsorted(np.sort(sample), thresholds, side="left")
        counts.append(np.concatenate([upper, sample.size - upper]))  # {y ≥ c}, then {y < c}
    level = FALSE_ALARM / (4 * counts[0].size)
    best = RenyiEstimate(0.0, "none")
    for p_counts, p_runs, q_counts, q_runs, name in (
        (counts[0], sample_d.size, counts[1], sample_dp.size, "D‖D′"),
        (counts[1], sample_dp.size, counts[0], sample_d.size, "D′‖D"),
    ):
        p_low = np.where(p_counts > 0, stats.beta.ppf(level, p_counts, p_runs - p_counts + 1), 0.0)
        q_high = np.where(q_counts < q_runs, stats.beta.isf(level, q_counts + 1, q_runs - q_counts), 1.0)
        with np.errstate(divide="ignore"):
            for alpha in RENYI_ORDERS:
                bound = (alpha / (alpha - 1) * np.log(p_low) - np.log(q_high)) / alpha
                index = int(np.argmax(bound))
                if bound[index] > best.rho:
                    best = RenyiEstimate(float(bound[index]), f"{name}, α={alpha}, event {index}")
    return best


def _audit_gaussian_rho(a: int, b: int, params: GaussianParams, seed: int) -> RenyiEstimate:
    sigma = math.sqrt(float(gaussian_plan(params, CTX)[2]))
    low, high = min(a, b), max(a, b)
    thresholds = np.unique(np.round(np.arange(low - 5 * sigma, high + 5 * sigma, sigma / 2)))
    samples = [_gaussian_sample(c, params, seed + i) for i, c in enumerate((a, b))]
    return estimate_rho(samples[0], samples[1], thresholds)


# ----- the real runs are the audited sampler --------------------------------------------------------------
def test_the_real_runs_are_the_audited_sampler() -> None:
    """``Laplace.run``/``Gaussian.run`` on an ``IndividualTable`` release γ·(unit_step answer + the draw of a
    fresh ``Noise.seeded(s)``) and charge exactly ``unit_step``'s charges (u's included or not)."""
    pure, _ = _u_charge(COUNT, LAPLACE_BUDGET)
    _, slope = _u_charge(GAUSS_COUNT, GAUSSIAN_BUDGET)
    pure_cap = _capacity(LAPLACE_BUDGET)[-1]
    assert pure_cap is not None
    edge = _largest_admitted_slope(GAUSSIAN_BUDGET)
    cases: list[tuple[LaplaceParams | GaussianParams, tuple[UnitFilter, UnitFilter]]] = [
        (COUNT, _filters(LAPLACE_BUDGET, pure_cap - pure, 0)),
        (COUNT, _filters(LAPLACE_BUDGET, pure_cap - pure + 1, 0)),
        (GAUSS_COUNT, _filters(GAUSSIAN_BUDGET, 0, edge - slope)),
        (GAUSS_COUNT, _filters(GAUSSIAN_BUDGET, 0, edge - slope + 1)),
    ]
    for params, filters in cases:
        for table, unit_filter in ((D, filters[0]), (D_PRIME, filters[1])):
            individual = IndividualTable(table, unit_filter)
            step = real_step(params, individual)
            for seed in range(10):
                if isinstance(params, LaplaceParams):
                    plan = laplace_plan(params.query, CTX, params.epsilon)[0]
                    release = Laplace().run(params, CTX, individual, Noise.seeded(seed))
                    draw = _laplace_sample(0, params, seed, 1)[0]
                else:
                    plan = gaussian_plan(params, CTX)[0]
                    release = Gaussian().run(params, CTX, individual, Noise.seeded(seed))
                    draw = _gaussian_sample(0, params, seed, 1)[0]
                expected = plan.grid.from_units(np.array([int(step.answer_units[0]) + int(draw)]))[0]
                assert release.output["value"] == float(expected)
                assert release.units is not None
                assert np.array_equal(release.units.units, step.charges.units)
                assert np.array_equal(release.units.pure, step.charges.pure)
                assert np.array_equal(release.units.slope, step.charges.slope)


# ----- 1, 2 and 4 at the pure edge (Laplace) ----------------------------------------------------------------
def test_a_unit_that_cannot_afford_the_release_is_invisible_and_the_late_exclusion_is_caught() -> None:
    """u has spent capacity − charge + 1: the real release's outputs on D and D′ are indistinguishable
    (estimate 0 at false-alarm 1e-6); the broken variant (u's rows in the answer, u not charged) is caught
    at the same size (its outputs differ by u's 3 rows: true loss 0.75)."""
    pure, _ = _u_charge(COUNT, LAPLACE_BUDGET)
    pure_cap = _capacity(LAPLACE_BUDGET)[-1]
    assert pure_cap is not None
    filters = _filters(LAPLACE_BUDGET, pure_cap - pure + 1, 0)
    a, b, step = _answers(COUNT, filters, real_step)
    assert TARGET not in step.charges.units
    assert a == b
    estimate = _audit_laplace(a, b, COUNT, 1001)
    assert estimate.epsilon == 0.0, estimate.summary()
    a, b, step = _answers(COUNT, filters, broken_step)
    assert TARGET not in step.charges.units
    broken = _audit_laplace(a, b, COUNT, 1101)
    assert broken.epsilon > 0.5, broken.summary()


def test_a_unit_that_can_just_afford_the_release_loses_at_most_its_charge() -> None:
    """u has spent capacity − charge: it is admitted, its spent reaches the capacity exactly, and the
    estimated loss is ≤ its charge (3/t = 0.75 ε) and ≥ 90 % of it."""
    pure, _ = _u_charge(COUNT, LAPLACE_BUDGET)
    pure_cap = _capacity(LAPLACE_BUDGET)[-1]
    assert pure_cap is not None
    filters = _filters(LAPLACE_BUDGET, pure_cap - pure, 0)
    a, b, step = _answers(COUNT, filters, real_step)
    after = filters[0].after(step.charges).ledger.of(np.array([TARGET]))[0]
    assert int(after[0]) == pure_cap
    assert a - b == 3
    charged = pure / UNITS_PER_EPSILON
    estimate = _audit_laplace(a, b, COUNT, 1201)
    assert estimate.epsilon <= charged, estimate.summary()
    assert estimate.epsilon >= TIGHT * charged, estimate.summary()


def test_the_late_exclusion_loses_more_than_the_remaining_budget() -> None:
    """u has a quarter of the count's charge left (0.19 ε): the real release leaves it out (estimate 0);
    the broken variant's estimated loss exceeds the remaining budget (power)."""
    pure, _ = _u_charge(COUNT, LAPLACE_BUDGET)
    pure_cap = _capacity(LAPLACE_BUDGET)[-1]
    assert pure_cap is not None
    remaining = pure // 4
    filters = _filters(LAPLACE_BUDGET, pure_cap - remaining, 0)
    a, b, _step = _answers(COUNT, filters, real_step)
    assert _audit_laplace(a, b, COUNT, 1301).epsilon == 0.0
    a, b, _step = _answers(COUNT, filters, broken_step)
    broken = _audit_laplace(a, b, COUNT, 1401)
    assert broken.epsilon > remaining / UNITS_PER_EPSILON, broken.summary()


# ----- 1, 2 and 4 at the order edge (Gaussian) ------------------------------------------------------------
def test_at_the_order_edge_an_excluded_unit_is_invisible_and_the_late_exclusion_is_caught() -> None:
    """u's slope is one ledger unit above the largest the orders admit with this release's charge: the
    outputs are indistinguishable; the broken variant is caught (true ρ = 0.5)."""
    _, slope = _u_charge(GAUSS_COUNT, GAUSSIAN_BUDGET)
    filters = _filters(GAUSSIAN_BUDGET, 0, _largest_admitted_slope(GAUSSIAN_BUDGET) - slope + 1)
    a, b, step = _answers(GAUSS_COUNT, filters, real_step)
    assert TARGET not in step.charges.units
    assert a == b
    estimate = _audit_gaussian_classes(a, b, GAUSS_COUNT, 2001)
    assert estimate.epsilon == 0.0, estimate.summary()
    assert _audit_gaussian_rho(a, b, GAUSS_COUNT, 2101).rho == 0.0
    a, b, _step = _answers(GAUSS_COUNT, filters, broken_step)
    assert _audit_gaussian_classes(a, b, GAUSS_COUNT, 2201).epsilon > 0.3
    broken = _audit_gaussian_rho(a, b, GAUSS_COUNT, 2301)
    assert broken.rho > 0.2, broken.summary()


def test_at_the_order_edge_an_admitted_unit_loses_at_most_its_charge() -> None:
    """u's slope is the largest the orders admit with this charge: it takes part, and its estimated ρ is
    ≤ its own slope charge ‖m‖²/(2(σ/γ)²) = 0.5 (and sees a good part of it)."""
    _, slope = _u_charge(GAUSS_COUNT, GAUSSIAN_BUDGET)
    filters = _filters(GAUSSIAN_BUDGET, 0, _largest_admitted_slope(GAUSSIAN_BUDGET) - slope)
    a, b, step = _answers(GAUSS_COUNT, filters, real_step)
    assert TARGET in step.charges.units
    assert a - b == 3
    charged = slope / UNITS_PER_EPSILON
    estimate = _audit_gaussian_rho(a, b, GAUSS_COUNT, 2401)
    assert estimate.rho <= charged, estimate.summary()
    assert estimate.rho >= 0.5 * charged, estimate.summary()


# ----- 3 and 4 over an adaptive sequence ------------------------------------------------------------------
@dataclass(frozen=True)
class Tree:
    """Every path of the adaptive sequence in one world: ``answers[s][c]`` is step s's answer (grid units)
    after the choices coded by c (bit i = the query of step i + 1, 0 the count, 1 the count in a; step 0 is
    always the count), ``spent[c]`` u's total pure charge after the last step of the full path c."""

    answers: tuple[np.ndarray, ...]
    spent: np.ndarray


def _tree(table: dict[str, np.ndarray], unit_filter: UnitFilter, stepper: Stepper) -> Tree:
    """Run the real ``unit_step`` chain of every path (63 releases; each release's charges go to the filter
    the next one sees, as the service stores them)."""
    answers: list[list[int]] = [[] for _ in range(SEQUENCE_STEPS)]
    spent: list[int] = []
    level = [unit_filter]
    for s in range(SEQUENCE_STEPS):
        following = []
        for code, state in enumerate(level):
            query = SEQUENCE_QUERIES[code & 1 if s > 0 else 0]
            step = stepper(query, IndividualTable(table, state))
            answers[s].append(int(step.answer_units[0]))
            following.extend([state.after(step.charges)] * 2)
        if s == SEQUENCE_STEPS - 1:
            spent = [int(state.ledger.of(np.array([TARGET]))[0][0]) for state in following[::2]]
        level = following
    return Tree(tuple(np.array(a, dtype=np.int64) for a in answers), np.array(spent, dtype=np.int64))


def _sequence_filters() -> tuple[UnitFilter, UnitFilter]:
    return _filters(LAPLACE_BUDGET, 0, 0)  # u fresh: its budget is reached inside the sequence


def _sequence_llr(tree_d: Tree, tree_dp: Tree, world: Tree, seed: int, runs: int) -> np.ndarray:
    """``runs`` transcripts drawn in ``world`` (vectorised over runs, one step at a time: the analyst asks
    the count again when the last answer is ≥ its D′ answer, else the count in a), reduced to their
    log-likelihood ratio log P_D/P_D′ = Σ_s (|y_s − b_s| − |y_s − a_s|)/t along the path taken."""
    scale = _laplace_scale(SEQUENCE_QUERIES[0])
    noise = Noise.seeded(seed)
    code = np.zeros(runs, dtype=np.int64)
    llr = np.zeros(runs)
    for s in range(SEQUENCE_STEPS):
        a, b = tree_d.answers[s][code], tree_dp.answers[s][code]
        y = world.answers[s][code] + noise.discrete_laplace(scale, runs)
        llr += (np.abs(y - b) - np.abs(y - a)) / float(scale)
        code = code * 2 + (y < b) if s < SEQUENCE_STEPS - 1 else code
    return llr


def _largest_path_loss(tree_d: Tree, tree_dp: Tree) -> float:
    """max over the full paths of Σ_s |a_s − b_s|/t: the transcript's largest log-likelihood ratio."""
    scale = float(_laplace_scale(SEQUENCE_QUERIES[0]))
    leaves = np.arange(2 ** (SEQUENCE_STEPS - 1))
    total = np.zeros(leaves.size)
    for s in range(SEQUENCE_STEPS):
        prefix = leaves >> (SEQUENCE_STEPS - 1 - s)
        total += np.abs(tree_d.answers[s][prefix] - tree_dp.answers[s][prefix]) / scale
    return float(total.max())


def _audit_sequence(stepper: Stepper, seed: int) -> tuple[Estimate, Tree, float]:
    with_u, without_u = _sequence_filters()
    tree_d, tree_dp = _tree(D, with_u, stepper), _tree(D_PRIME, without_u, stepper)
    top = _largest_path_loss(tree_d, tree_dp)
    edges = top * np.array([-0.9, -0.75, -0.6, -0.45, -0.3, 0.0, 0.3, 0.45, 0.6, 0.75, 0.9])
    classes = [
        np.searchsorted(edges, _sequence_llr(tree_d, tree_dp, world, seed + i, RUNS), side="left")
        for i, world in enumerate((tree_d, tree_dp))
    ]
    return estimate_loss(classes[0], classes[1], edges.size + 1), tree_d, top


def test_the_queries_of_the_sequence_share_one_scale() -> None:
    """The sequence's LLR uses one t: both queries are counts of ℓ1 bound k at the same ε (t = 8)."""
    scales = {_laplace_scale(q) for q in SEQUENCE_QUERIES}
    assert scales == {Fraction(8)}


def test_an_adaptive_sequence_keeps_the_units_transcript_loss_within_its_budget() -> None:
    """Six counts, each chosen from the previous noisy answer, u starting fresh (count 3/8 ε, count in a
    2/8 ε): u takes part until the next charge would overflow its budget, on every path its total charge is
    ≤ ε, and the whole transcript's estimated loss is ≤ u's largest total charge over the paths (≤ ε) and
    sees most of it."""
    estimate, tree_d, top = _audit_sequence(real_step, 3001)
    pure_cap = _capacity(LAPLACE_BUDGET)[-1]
    assert pure_cap is not None
    assert int(tree_d.spent.max()) <= pure_cap
    spent = float(tree_d.spent.max()) / UNITS_PER_EPSILON
    assert top <= spent  # the transcript's largest LLR is u's charge on the most expensive path
    assert 0.8 < spent <= LAPLACE_BUDGET
    assert estimate.epsilon <= spent, estimate.summary()
    assert estimate.epsilon >= TIGHT_SEQUENCE * spent, estimate.summary()


def test_an_adaptive_sequence_with_the_late_exclusion_is_caught() -> None:
    """The same sequence with u's rows always in the answer (charges and exclusion as the rule says): its
    transcript loss (6 counts: 1.5–2.25 ε) is estimated above u's budget."""
    estimate, tree_d, top = _audit_sequence(broken_step, 3101)
    assert top > 1.5 * LAPLACE_BUDGET
    pure_cap = _capacity(LAPLACE_BUDGET)[-1]
    assert pure_cap is not None
    assert int(tree_d.spent.max()) <= pure_cap  # the broken variant charges as the rule does
    assert estimate.epsilon > LAPLACE_BUDGET, estimate.summary()


REAL_SEQUENCE_RUNS = 5_000


def _real_sequence_llr(
    table: dict[str, np.ndarray], unit_filter: UnitFilter, trees: tuple[Tree, Tree], seed: int
) -> np.ndarray:
    """``REAL_SEQUENCE_RUNS`` transcripts of ``Laplace.run`` itself, the filter updated from each
    ``Release.units`` as the service stores it; each transcript's LLR as in ``_sequence_llr``. Every run's
    final state of u must be the tree's for the path taken (the vectorised audit's states are the real
    ones)."""
    tree_d, tree_dp = trees
    scale = float(_laplace_scale(SEQUENCE_QUERIES[0]))
    noise = Noise.seeded(seed)
    mechanism = Laplace()
    llr = np.zeros(REAL_SEQUENCE_RUNS)
    for run in range(REAL_SEQUENCE_RUNS):
        state, code = unit_filter, 0
        for s in range(SEQUENCE_STEPS):
            query = SEQUENCE_QUERIES[code & 1 if s > 0 else 0]
            release = mechanism.run(query, CTX, IndividualTable(table, state), noise)
            assert release.units is not None
            state = state.after(release.units)
            y = float(release.output["value"])  # γ = 1: grid units
            a, b = tree_d.answers[s][code], tree_dp.answers[s][code]
            llr[run] += (abs(y - b) - abs(y - a)) / scale
            code = code * 2 + int(y < b) if s < SEQUENCE_STEPS - 1 else code
        if table is D:
            assert int(state.ledger.of(np.array([TARGET]))[0][0]) == int(tree_d.spent[code])
    return llr


@pytest.mark.slow
def test_the_real_adaptive_sequence_keeps_the_units_loss_within_its_budget() -> None:
    """The adaptive sequence with ``Laplace.run`` itself (5 000 transcripts per world, the filter state
    carried from release to release): estimated transcript loss ≤ u's largest total charge (≤ ε) and > 0."""
    with_u, without_u = _sequence_filters()
    trees = (_tree(D, with_u, real_step), _tree(D_PRIME, without_u, real_step))
    top = _largest_path_loss(*trees)
    edges = top * np.array([-0.75, -0.5, 0.0, 0.5, 0.75])
    classes = [
        np.searchsorted(edges, _real_sequence_llr(table, state, trees, 3201 + i), side="left")
        for i, (table, state) in enumerate(((D, with_u), (D_PRIME, without_u)))
    ]
    estimate = estimate_loss(classes[0], classes[1], edges.size + 1)
    spent = float(trees[0].spent.max()) / UNITS_PER_EPSILON
    assert spent <= LAPLACE_BUDGET
    assert estimate.epsilon <= spent, estimate.summary()
    assert estimate.epsilon >= 0.3 * spent, estimate.summary()
