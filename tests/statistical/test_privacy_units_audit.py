"""Monte Carlo privacy audit of privacy units (docs/privacy/units.md#units): one person with many rows.

Neighbouring pair (add/remove one unit): D = 30 ordinary units (1–11 rows each), D′ = D plus one **heavy**
unit with 40 rows (10× ``max_rows`` = 4), every value at the column's largest magnitude (x = 5 on
[−2, 5]), spread over every group. The real mechanisms (``laplace`` count and float sum, ``measures.laplace``
count + sum grouped by a 5-value column) run on both, and the privacy loss is estimated from the two
empirical output distributions as in tests/statistical/test_above_threshold_audit.py and
test_noise_reduction_audit.py: outputs fall into fixed classes (chosen from the two true answers and the
public noise scale before sampling), and each class gets a one-sided lower confidence bound on
|log P_D(class)/P_D′(class)| from Clopper–Pearson intervals, Bonferroni-corrected so that the whole audit
has false-alarm probability ≤ ``FALSE_ALARM``. The estimated ε is the largest lower bound.

Checks, per mechanism:

* soundness: the estimated ε never exceeds the charged ε (the release's ``worst_case`` pure ε);
* tightness (power): the estimated ε is close to the charge (≥ ``TIGHT`` of it; ``TIGHT_MEASURES`` for the
  10-coordinate grouped release), so the audit can see a loss of the charged size;
* broken variants are **caught** (estimated ε above the charge) with the same noise and the same charge:
  ``unbounded`` (the plan's ``unit`` is None: the heavy unit's 40 rows all count), ``trusted_bound``
  (the plan bounds at the heavy unit's 40 rows while the charge is for the declared 4: a declared bound that
  is trusted instead of enforced) and, for the count, ``row_charge`` (rows bounded at 4 but the noise of a
  row-level dataset, k = 1: the sensitivity not multiplied by k).

The mechanism is the real one twice over: (1) ``Laplace.run`` itself runs ``REAL_RUNS`` times on each
dataset from one ``Noise.seeded`` stream and that sample is audited directly (broken variants too, by
patching ``unit_bound`` in ``mechanisms.queries.language`` and ``.measures``); (2) for a sharp estimate,
``run``'s output is shown to be exactly ``γ·(evaluate_units + discrete_laplace(scale, 1))`` under the same
seed, and the large sample draws that noise vectorised (``RUNS`` per dataset) around the real plan's
``evaluate_units``.
The grouped measures use the log-likelihood ratio of the product of discrete Laplace laws (public scales) as
the class statistic, the most powerful test for a product law. The engine path (DuckDB-scanned Parquet)
gives the same answers and, under the same seed, the same releases
(``test_the_engine_path_releases_the_audited_law``).

Measured (seeds as below): count 0.973, sum 0.969, grouped measures 0.797 (charged 1.0; exact loss 1, 0.9992,
0.998); broken: unbounded and trusted_bound 6.94 (count, sum; the Clopper–Pearson bound at 100 000 runs with a
zero count on one side), 4.55 (grouped); row_charge 3.83; ``Laplace.run`` itself 0.76 / 0.68 (3 000 runs),
unbounded 3.35 / 3.26 (1 000 runs). Runtime 10–26 s on 2 cores (idle vs loaded machine).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from scipy import stats

from mechanisms.accounting import DEFAULT_ORDERS
from mechanisms.base import PublicContext, Table
from mechanisms.data.plan import ORDER_COLUMN, UnitBound
from mechanisms.data.schema import DatasetSchema
from mechanisms.noise import Noise
from mechanisms.queries import language, measures
from mechanisms.queries.language import evaluate_units, laplace_plan
from mechanisms.queries.laplace import Laplace, LaplaceParams
from mechanisms.queries.measures import (
    MeasuresLaplace,
    MeasuresLaplaceParams,
    evaluate_blocks,
    laplace_plans,
)
from service.data.ingest import unit_order

pytestmark = pytest.mark.statistical

FALSE_ALARM = 1e-6
"""Per audit (Bonferroni over its classes and the two directions)."""
RUNS = 1_000_000
BROKEN_RUNS = 100_000
MEASURES_RUNS = 200_000
BROKEN_MEASURES_RUNS = 50_000
REAL_RUNS = 3_000
BROKEN_REAL_RUNS = 1_000
TIGHT = 0.9
TIGHT_MEASURES = 0.7
EPSILON = 1.0
K = 4
HEAVY_ROWS = 10 * K
HEAVY_USER = 999
SECRET = 0x5EED_0A0D17

COLUMNS: list[dict[str, Any]] = [
    {"name": "user", "type": "int", "min": 0, "max": 10**6},
    {"name": "x", "type": "float", "min": -2.0, "max": 5.0},
    {"name": "n", "type": "int", "min": 0, "max": 9},
    {"name": "g", "type": "categorical", "values": ["a", "b", "c", "d", "e"]},
]


def _ctx(unit: bool = True) -> PublicContext:
    raw: dict[str, Any] = {"columns": COLUMNS, "neighboring": "add_remove"}
    if unit:
        raw["privacy_unit"] = {"column": "user", "max_rows": K}
    return PublicContext(DatasetSchema.model_validate(raw), None, DEFAULT_ORDERS)


CTX = _ctx()
ROW_CTX = _ctx(unit=False)

Row = tuple[int, float, int, int]


def _table(rows: list[Row]) -> dict[str, np.ndarray]:
    """A NumPy table as the service reads a snapshot: the columns plus ``__order`` (``unit_order``)."""
    columns = {
        "user": np.array([r[0] for r in rows], dtype=np.int64),
        "x": np.array([r[1] for r in rows], dtype=np.float64),
        "n": np.array([r[2] for r in rows], dtype=np.int64),
        "g": np.array([r[3] for r in rows], dtype=np.int64),
    }
    columns[ORDER_COLUMN] = unit_order([pa.array(columns[c["name"]]) for c in COLUMNS], SECRET).to_numpy()
    return columns


def _base_rows() -> list[Row]:
    rng = np.random.default_rng(20261207)
    rows: list[Row] = []
    for user in range(30):
        for _ in range(int(rng.integers(1, 3 * K))):
            rows.append((user, float(rng.uniform(-2, 5)), int(rng.integers(0, 10)), int(rng.integers(0, 5))))
    return rows


def _heavy_rows() -> list[Row]:
    """40 distinct rows ((n, g) all different) at x = 5, the column's largest |value|, over every group."""
    return [(HEAVY_USER, 5.0, (i // 5) % 10, i % 5) for i in range(HEAVY_ROWS)]


D = _table(_base_rows())
D_PRIME = _table(_base_rows() + _heavy_rows())

COUNT = LaplaceParams.model_validate({"query": {"kind": "count"}, "epsilon": EPSILON})
SUM = LaplaceParams.model_validate({"query": {"kind": "sum", "column": "x"}, "epsilon": EPSILON})
MEASURES = MeasuresLaplaceParams.model_validate(
    {"measures": [{"kind": "count"}, {"kind": "sum", "column": "x"}], "group_by": ["g"], "epsilon": EPSILON}
)


# ----- broken variants: the plan's bounding replaced (the charge stays the declared one) -------------------
VARIANTS: dict[str, UnitBound | None] = {"unbounded": None, "trusted_bound": UnitBound("user", HEAVY_ROWS)}


@contextmanager
def _bounding(variant: str | None) -> Iterator[None]:
    """Evaluate plans with the variant's bounding; the grids, scales and charges are unchanged (they are
    computed by ``laplace_plan``/``laplace_plans`` from the public context only)."""
    if variant is None:
        yield
        return
    modules = (language, measures)  # both build plans with their own reference to ``unit_bound``
    originals = [getattr(module, "unit_bound") for module in modules]  # noqa: B009
    for module in modules:
        setattr(module, "unit_bound", lambda ctx: VARIANTS[variant])  # noqa: B010
    try:
        yield
    finally:
        for module, original in zip(modules, originals, strict=True):
            setattr(module, "unit_bound", original)  # noqa: B010


# ----- the estimate ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Estimate:
    lower: np.ndarray  # per class: lower confidence bound on |log P_D/P_D′|
    counts: np.ndarray  # (2, classes)

    @property
    def epsilon(self) -> float:
        """The estimated privacy loss: the largest lower bound over the classes (≥ 0)."""
        return float(max(np.max(self.lower), 0.0))

    def summary(self) -> str:
        worst = int(np.argmax(self.lower))
        return f"estimated ε {self.epsilon:.4f} (class {worst}, counts {self.counts[:, worst].tolist()})"


def estimate_loss(classes_d: np.ndarray, classes_dp: np.ndarray, n_classes: int) -> Estimate:
    """Clopper–Pearson lower bounds on |log P_D(c)/P_D′(c)| for every class c; with probability ≥ 1 −
    FALSE_ALARM none exceeds the true |log ratio| (each of the 4·n_classes one-sided bounds at level
    FALSE_ALARM/(4·n_classes))."""
    runs_d, runs_dp = classes_d.size, classes_dp.size
    counts = np.vstack([np.bincount(c, minlength=n_classes) for c in (classes_d, classes_dp)])
    level = FALSE_ALARM / (4 * n_classes)
    bounds = []
    for row, runs in ((counts[0], runs_d), (counts[1], runs_dp)):
        low = np.where(row > 0, stats.beta.ppf(level, row, runs - row + 1), 0.0)
        high = np.where(row < runs, stats.beta.isf(level, row + 1, runs - row), 1.0)
        bounds.append((low, high))
    (low_d, high_d), (low_dp, high_dp) = bounds
    with np.errstate(divide="ignore"):
        lower = np.maximum(np.log(low_d) - np.log(high_dp), np.log(low_dp) - np.log(high_d))
    return Estimate(lower, counts)


def scalar_edges(a: int, b: int, scale: float, fine: bool = True) -> np.ndarray:
    """Fixed class edges (grid units) for a 1-D release around the true answers a, b; classes are
    (e_{i−1}, e_i] and the two tails. Every class wholly below min(a, b) or above max(a, b) has the law's
    full ratio e^{|a − b|/t}. ``fine``: half-scale steps out to 5 scales beyond both and 4 points between
    (≈ 27 classes); else only the two half-lines and the middle (3 classes: for small samples)."""
    low, high = min(a, b), max(a, b)
    if not fine:
        return np.unique(np.array([low, high], dtype=np.float64))
    steps = np.arange(1, 11) * scale / 2
    inner = np.linspace(low, high, 6)
    return np.unique(np.concatenate([low - steps, inner, high + steps]))


def scalar_classes(units: np.ndarray, edges: np.ndarray) -> np.ndarray:
    result: np.ndarray = np.searchsorted(edges, units, side="left")
    return result


# ----- the 1-D Laplace releases --------------------------------------------------------------------------
def _charge(params: LaplaceParams) -> float:
    return Laplace().worst_case(params, CTX).pure


def _plan(params: LaplaceParams) -> tuple[Any, Fraction]:
    return laplace_plan(params.query, CTX, params.epsilon)


def _units(params: LaplaceParams, table: Table, variant: str | None = None) -> int:
    plan, _scale = _plan(params)
    with _bounding(variant):
        return int(evaluate_units(params.query, CTX, table, plan)[0][0])


def _vectorised_release_units(
    params: LaplaceParams,
    table: dict[str, np.ndarray],
    seed: int,
    variant: str | None = None,
    scale: Fraction | None = None,
    runs: int = RUNS,
) -> np.ndarray:
    """``runs`` releases in grid units: the real plan's answer plus the mechanism's discrete Laplace noise
    (vectorised; ``test_the_real_run_is_the_audited_sampler`` pins the equality with ``Laplace.run``).
    ``scale`` replaces the mechanism's scale (a broken variant)."""
    noise_scale = _plan(params)[1] if scale is None else scale
    result: np.ndarray = _units(params, table, variant) + Noise.seeded(seed).discrete_laplace(
        noise_scale, runs
    )
    return result


def _real_release_units(
    params: LaplaceParams, table: dict[str, np.ndarray], runs: int, seed: int, variant: str | None = None
) -> np.ndarray:
    """``runs`` outputs of ``Laplace.run`` itself (one seeded stream), back in grid units (exact)."""
    plan, scale = _plan(params)
    mechanism = Laplace()
    noise = Noise.seeded(seed)
    values = []
    with _bounding(variant):
        for _ in range(runs):
            output = mechanism.run(params, CTX, table, noise).output
            assert output["noise"]["scale_units"] == float(scale)
            values.append(output["value"])
    units = np.asarray(values) / plan.grid.granularity
    assert np.array_equal(units, np.round(units)), "a release left its grid"
    result: np.ndarray = units.astype(np.int64)
    return result


def _audit_scalar(
    params: LaplaceParams,
    sample: Callable[[dict[str, np.ndarray], int], np.ndarray],
    seed: int,
    variant: str | None,
    fine: bool = True,
) -> Estimate:
    scale = _plan(params)[1]
    a = _units(params, D, variant)
    b = _units(params, D_PRIME, variant)
    edges = scalar_edges(a, b, float(scale), fine)
    classes = [scalar_classes(sample(table, seed + i), edges) for i, table in enumerate((D, D_PRIME))]
    return estimate_loss(classes[0], classes[1], edges.size + 1)


@pytest.mark.parametrize("params", [COUNT, SUM], ids=["count", "sum"])
def test_the_real_run_is_the_audited_sampler(params: LaplaceParams) -> None:
    """``Laplace.run`` under ``Noise.seeded(s)`` releases exactly γ·(evaluate_units + DLap(t)) with the draw
    of a fresh ``Noise.seeded(s)``: the large vectorised sample below is the mechanism's law."""
    plan, scale = _plan(params)
    for table in (D, D_PRIME):
        units = _units(params, table)
        for seed in range(40):
            released = Laplace().run(params, CTX, table, Noise.seeded(seed)).output["value"]
            draw = int(Noise.seeded(seed).discrete_laplace(scale, 1)[0])
            assert released == float(plan.grid.from_units(np.array([units + draw]))[0])


def test_the_pair_differs_by_one_heavy_unit_bounded_to_k_rows() -> None:
    """The pair is the hard case: unbounded, the heavy unit moves the count by 40 and the sum by 200; bounded,
    by exactly k = 4 rows and k·5 = 20 (the charged sensitivity is reached, not only respected)."""
    assert _units(COUNT, D_PRIME) - _units(COUNT, D) == K
    assert _units(COUNT, D_PRIME, "unbounded") - _units(COUNT, D, "unbounded") == HEAVY_ROWS
    plan, _ = _plan(SUM)
    gamma = plan.grid.granularity
    assert (_units(SUM, D_PRIME) - _units(SUM, D)) * gamma == pytest.approx(K * 5.0, abs=gamma)
    unbounded = (_units(SUM, D_PRIME, "unbounded") - _units(SUM, D, "unbounded")) * gamma
    assert unbounded == pytest.approx(HEAVY_ROWS * 5.0, abs=gamma)


@pytest.mark.parametrize(("params", "seed"), [(COUNT, 101), (SUM, 201)], ids=["count", "sum"])
def test_estimated_loss_of_many_releases_stays_within_the_charge(params: LaplaceParams, seed: int) -> None:
    """1 000 000 releases per dataset: estimated ε ≤ charged ε, and ≥ 90 % of it (the audit sees the loss)."""
    charged = _charge(params)
    estimate = _audit_scalar(params, lambda table, s: _vectorised_release_units(params, table, s), seed, None)
    assert estimate.epsilon <= charged, estimate.summary()
    assert estimate.epsilon >= TIGHT * charged, estimate.summary()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize(("params", "seed"), [(COUNT, 301), (SUM, 401)], ids=["count", "sum"])
def test_skipping_the_bound_is_caught(params: LaplaceParams, seed: int, variant: str) -> None:
    """The same noise and charge on a plan that does not enforce the declared k: caught (loss ≈ 10ε)."""
    charged = _charge(params)
    sampler = lambda table, s: _vectorised_release_units(  # noqa: E731
        params, table, s, variant=variant, runs=BROKEN_RUNS
    )
    estimate = _audit_scalar(params, sampler, seed, variant)
    assert estimate.epsilon > charged + 1.0, estimate.summary()


def test_charging_rows_instead_of_units_is_caught() -> None:
    """Rows bounded at k = 4, but the noise of a row-level dataset (t = 1/ε instead of k/ε): caught."""
    _row_plan, row_scale = laplace_plan(COUNT.query, ROW_CTX, EPSILON)
    sampler = lambda table, s: _vectorised_release_units(  # noqa: E731
        COUNT, table, s, scale=row_scale, runs=BROKEN_RUNS
    )
    estimate = _audit_scalar(COUNT, sampler, 501, None)
    assert estimate.epsilon > _charge(COUNT) + 1.0, estimate.summary()


@pytest.mark.parametrize(("params", "seed"), [(COUNT, 601), (SUM, 701)], ids=["count", "sum"])
def test_real_runs_stay_within_the_charge_and_the_unbounded_run_is_caught(
    params: LaplaceParams, seed: int
) -> None:
    """``Laplace.run`` itself, 3 000 times per dataset: estimated ε ≤ charged; 1 000 unbounded runs
    (the plan's ``unit`` None) per dataset: caught."""
    charged = _charge(params)
    real = lambda t, s: _real_release_units(params, t, REAL_RUNS, s)  # noqa: E731
    estimate = _audit_scalar(params, real, seed, None, fine=False)
    assert estimate.epsilon <= charged, estimate.summary()
    assert estimate.epsilon >= 0.6 * charged, estimate.summary()  # a small sample still sees the loss
    unbounded = lambda t, s: _real_release_units(params, t, BROKEN_REAL_RUNS, s, "unbounded")  # noqa: E731
    broken = _audit_scalar(params, unbounded, seed + 50, "unbounded", fine=False)
    assert broken.epsilon > charged, broken.summary()


# ----- grouped measures: count + sum(x) by g (10 released coordinates) -------------------------------------
def _measures_charge() -> float:
    return MeasuresLaplace().worst_case(MEASURES, CTX).pure


def _measures_units(table: Table, variant: str | None) -> np.ndarray:
    plans = [plan for plan, _ in laplace_plans(MEASURES, CTX)]
    with _bounding(variant):
        units, _columns = evaluate_blocks(MEASURES, CTX, table, plans)
    return np.concatenate(units)


def _measures_scales() -> np.ndarray:
    planned = laplace_plans(MEASURES, CTX)
    cells = 5
    scales = [scale for _plan, scale in planned]
    assert all(s is not None for s in scales)
    return np.repeat(np.array([float(s) for s in scales if s is not None]), cells)


def _measures_sample(center: np.ndarray, seed: int, runs: int) -> np.ndarray:
    """``runs`` releases (rows) of every block's cells in grid units, each cell with its block's
    discrete Laplace (the noise ``MeasuresLaplace.run`` adds, drawn vectorised)."""
    noise = Noise.seeded(seed)
    planned = laplace_plans(MEASURES, CTX)
    columns = []
    for plan_scale in planned:
        scale = plan_scale[1]
        assert scale is not None
        columns.append(noise.discrete_laplace(scale, runs * 5).reshape(runs, 5))
    result: np.ndarray = center[None, :] + np.hstack(columns)
    return result


def _audit_measures(seed: int, variant: str | None, runs: int) -> Estimate:
    """Classes: the log-likelihood ratio log P_D(y)/P_D′(y) = Σ_j (|y_j − b_j| − |y_j − a_j|)/t_j cut at
    −0.8·L, 0 and 0.8·L (L = Σ_j |a_j − b_j|/t_j, its largest value): the top class {LLR > 0.8·L} has ratio
    in [e^{0.8·L}, e^L] and, with 6 moving coordinates, ≈ 2.4 % of the mass, so few classes keep the
    Bonferroni cost low (40 bins of width L/20 gave 0.76 instead of 0.80 at this size)."""
    a, b = _measures_units(D, variant), _measures_units(D_PRIME, variant)
    t = _measures_scales()
    top = float(np.sum(np.abs(a - b) / t))
    edges = np.array([-0.8 * top, 0.0, 0.8 * top]) if top > 0 else np.array([0.0])
    classes = []
    for index, center in enumerate((a, b)):
        y = _measures_sample(center, seed + index, runs)
        llr = np.sum((np.abs(y - b) - np.abs(y - a)) / t, axis=1)
        classes.append(np.searchsorted(edges, llr, side="left"))
    return estimate_loss(classes[0], classes[1], edges.size + 1)


def test_grouped_measures_stay_within_the_charge() -> None:
    """The heavy unit's 4 kept rows land in several groups; the block sensitivities (with the rows'
    rounding spread over the cells) cover it: estimated ε ≤ charged ε, and ≥ 70 % of it (the exact loss of
    this pair is 0.998·ε; 200 000 runs per dataset bound it from below at ≈ 0.80)."""
    a, b = _measures_units(D, None), _measures_units(D_PRIME, None)
    assert np.count_nonzero(a[:5] != b[:5]) >= 2, "the kept rows should spread over groups"
    charged = _measures_charge()
    estimate = _audit_measures(801, None, MEASURES_RUNS)
    assert estimate.epsilon <= charged, estimate.summary()
    assert estimate.epsilon >= TIGHT_MEASURES * charged, estimate.summary()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_grouped_measures_without_the_bound_are_caught(variant: str) -> None:
    estimate = _audit_measures(901, variant, BROKEN_MEASURES_RUNS)
    assert estimate.epsilon > _measures_charge() + 1.0, estimate.summary()


def test_the_real_measures_run_adds_the_audited_noise() -> None:
    """``MeasuresLaplace.run`` releases every cell as γ_b·(exact units + DLap(t_b)), t_b as audited."""
    planned = laplace_plans(MEASURES, CTX)
    release = MeasuresLaplace().run(MEASURES, CTX, D_PRIME, Noise.seeded(3))
    for (plan, scale), block in zip(planned, release.output["blocks"], strict=True):
        assert scale is not None
        assert block["scale"] == float(scale * Fraction(plan.grid.granularity))
        assert block["granularity"] == plan.grid.granularity
    assert math.isclose(release.realized.pure, _measures_charge())


# ----- the engine path releases what the audit saw ---------------------------------------------------------
def test_the_engine_path_releases_the_audited_law(tmp_path: Path) -> None:
    """On DuckDB-scanned Parquet snapshots of the pair (``tests/engine_support.py``), every audited answer is
    the NumPy one, and ``Laplace.run``/``MeasuresLaplace.run`` release the same values under the same seed:
    the audit covers the engine path. Unbounded, the engine's answers move by the heavy unit's 40 rows."""
    from tests.engine_support import engine_table

    scanned = {
        name: engine_table(table, CTX.schema, tmp_path, extra={ORDER_COLUMN: table[ORDER_COLUMN]})
        for name, table in (("D", D), ("D′", D_PRIME))
    }
    for name, table in (("D", D), ("D′", D_PRIME)):
        engine = scanned[name]
        for params in (COUNT, SUM):
            assert _units(params, engine) == _units(params, table), (name, params.query.kind)
            for seed in range(5):
                ours = Laplace().run(params, CTX, table, Noise.seeded(seed)).output["value"]
                theirs = Laplace().run(params, CTX, engine, Noise.seeded(seed)).output["value"]
                assert ours == theirs
        assert np.array_equal(_measures_units(engine, None), _measures_units(table, None))
        ours_m = MeasuresLaplace().run(MEASURES, CTX, table, Noise.seeded(9)).output
        theirs_m = MeasuresLaplace().run(MEASURES, CTX, engine, Noise.seeded(9)).output
        assert ours_m == theirs_m
    moved = _units(COUNT, scanned["D′"], "unbounded") - _units(COUNT, scanned["D"], "unbounded")
    assert moved == HEAVY_ROWS
