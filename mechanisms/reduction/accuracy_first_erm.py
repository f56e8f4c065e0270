"""Accuracy-first ERM: the most private ridge / logistic model whose excess empirical risk is ≤ α.

Ligett, Neel, Roth, Waggoner, Wu, "Accuracy First: Selecting a Differential Privacy Level for
Accuracy-Constrained ERM" (NeurIPS 2017; cited "the paper"). Documentation:
docs/mechanisms/accuracy_first_erm.md; soundness argument, errata and their corrections: docs/privacy.md §8.2.

Objective (the paper's §3, eq. (3.1)): L(θ, D) = (1/n) Σ_i ℓ(θ, x_i, y_i) + (λ/2)‖θ‖², with θ* = argmin L
(secret).

``ridge`` (CovNR, Algorithm 3 / Theorem 3.2)
    ℓ = ½(y − θᵀx)². Rows need ‖x‖₁ ≤ 1 and |y| ≤ 1. The statistic S(D) = (XᵀX, Xᵀy) ∈ R^{p²+p} has joint
    ℓ1 sensitivity 4 under replace-one (Lemma A.6: 2 for each part, ‖xxᵀ‖₁ = ‖x‖₁²). Noise reduction runs on
    S with per-entry coins (one chain on the concatenation has the law of the paper's two chains at ε_t/2
    with Δ = 2 each: per-entry noise Lap(4/ε_t)). θ^t is the exact minimiser of (3.1) over the ball
    ‖θ‖₂ ≤ M = 1/√λ (a trust-region subproblem, Moré & Sorensen 1983). Query sensitivity Δ_q = (M+1)²/n (Claim
    A.5).
``logistic`` (OutputNR, Algorithm 5 / Theorem 3.4 **with two errata**, docs/privacy.md §8.2.3)
    ℓ = log(1 + e^{−y θᵀx}). Rows need ‖x‖₂ ≤ 1 (weaker than the paper's ‖x‖₁ ≤ 1; every step of the proof
    uses only the ℓ2 norm: 1-Lipschitz loss, |θᵀx| ≤ M) and y = ±1. Noise reduction on θ* with ℓ1 sensitivity
    2√p/(nλ) (Chaudhuri–Monteleoni–Sarwate 2011 Cor. 8 gives ℓ2 sensitivity 2/(nλ)). θ^t is projected onto
    ‖θ‖₂ ≤ M = √(2 ln 2/λ) when ‖θ^t‖ **>** M (erratum: Alg. 5 prints "≤"); the IAT threshold is **−α/2**
    (erratum: Alg. 5 prints "α/2"). Query sensitivity Δ_q = 2M/n (Claim A.12: (2/n)·ln((1+e^M)/(1+e^{−M}))).

Both run InteractiveAboveThreshold (Algorithm 2, Lemma 2.8) on f_t(D) = L(θ*, D) − L(θ^t, D) and release
(t, θ^t) at the first acceptance: the ex-post loss is pure **ε_A + ε_t** (Lemma 2.8 with Theorem 2.7 for
the prefix privacy of noise reduction). If no level passes, θ^T is released with ``target_reached = False``
and charged ε_A + ε_T (the no-halt outcome of Lemma 2.8 is t = T; the paper's ∞ is for releasing θ*); θ* is
never released.

Calibrations of the test (all are pure ε_A-DP for any α; they differ only in the accuracy guarantee):
``paper_theorem``   ε_A = 16·Δ_q·ln(2T/γ)/α, threshold −α/2 (Theorem A.1 ⇒ excess ≤ α w.p. ≥ 1−γ).
``reference_code``  the authors' code (with the paper's Δ_q; docs/privacy.md §8.2.4):
                    b = α/(4·ln(1.5^{3/4}√T/γ)), threshold noise Lap(b), query noise Lap(2b), accept iff
                    excess ≤ s + noise with s = α/4 + (3/4)·b·ln 1.5 − ½·b·ln T; ε_A = 2Δ_q/b. Its
                    worst-case failure rate is 0.0152 at T = 1000, γ = 0.1 (docs/privacy.md §8.2.4), not a
                    theorem for every (T, γ).
``exact_bound``     ours: W = −α/2 and the smallest ε_A whose *exact* failure probability is ≤ γ (the event
                    Theorem A.1 union-bounds is {max_t ν_t − ρ > W + α}; its probability is a 1-D integral,
                    ``iat_failure_probability``). Proven, and about 2.3× cheaper than paper_theorem.

Baselines (library functions, for the benchmark): ``doubling`` (Algorithm 4 / Theorem A.2, charged by
pure composition ℰ(k) = k·ε_test + (2^k − 1)ε_1) and ``theory_epsilon`` (ε from the inverted utility
theorems, e.g. Theorem 3.2's E[excess] bound).

Numerical exactness (docs/privacy.md §8.2.5): θ* comes from a solver whose result carries a certificate from
strong convexity, ‖∇L(θ̂)‖ ≤ g_tol ⇒ ‖θ̂ − θ*‖ ≤ g_tol/λ and L(θ̂) − L(θ*) ≤ g_tol²/(2λ); the sensitivities used
are inflated by a public relative slack (``SLACK``) that covers these and float rounding by orders of
magnitude. A solver that cannot certify raises (the service then commits the worst case).

Finite precision (docs/privacy.md §10): every draw is exact and integer, through ``Noise`` (OS CSPRNG in the
service). The statistic is rounded (exactly, half-up) to a public grid γ_S = 2^k chosen from Δ_S, its
dimension, ε_1 and a public magnitude bound (``statistic_plan``); its ℓ1 sensitivity in grid units is the
integer Δ_g = ⌊Δ_S/γ_S + d/64⌋ + d (each coordinate's rounded value moves by ≤ |change|/γ_S + 1; Δ_S already
covers the float error of the computed statistic, d/64 is a further per-coordinate float allowance), and
discrete Laplace noise reduction (``LazyLaplaceNR``, pure Δ_g·x_t ≤ ε_t per level) releases γ_S·(U + η_t).
The models θ^t are post-processing of those grid vectors, and the released coefficients are truncated toward
zero onto a public model grid (``coefficient_grid``: γ_S for logistic, where θ^t is the noisy statistic
itself; 2^⌊log2 M⌋−40 for ridge), so every released number is a multiple of the published granularity. The
test is the grid InteractiveAboveThreshold (``mechanisms.threshold.above_threshold``; only the level is
released). Charges are unchanged (pure ε_A + ε_t). Timing is not claimed (rejection samplers run variable
time).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, ClassVar, Literal, Self

import numpy as np
from pydantic import BaseModel, Field, StrictFloat, StrictInt, model_validator
from scipy import integrate, optimize

from mechanisms.accounting import RdpCurve, pad_up, sum_up
from mechanisms.base import ParamsChecked, ParamsError, ProgressFn, PublicContext, Release, Table, no_progress
from mechanisms.learners.features import FeatureSpec, check_features, column_names, design_matrix, dimension
from mechanisms.learners.features import Task as LearningTask
from mechanisms.noise import Grid, Noise, dyadic_scale_up, laplace_grid
from mechanisms.queries.language import charged_fraction, unit_shift
from mechanisms.reduction.noise_reduction import LazyLaplaceNR, laplace_nr_rates
from mechanisms.threshold.above_threshold import (
    IatCalibration,
    InteractiveAboveThreshold,
    ThresholdGrid,
    iat_charge,
    iat_paper_calibration,
    iat_reference_calibration,
)

Task = Literal["ridge", "logistic"]
Calibration = Literal["paper_theorem", "reference_code", "exact_bound"]
MAX_ROWS = 2_000_000
"""Largest dataset: the block-summed XᵀX/Xᵀy rounding bound of the slack holds up to this n."""

SLACK = 1e-6
"""Public relative slack on every sensitivity that depends on data sums or θ* (certificate and rounding)."""
ABSOLUTE_SLACK = 1e-9
"""Public absolute slack on Δ_q: covers float rounding in evaluating L (≤ ~1e−10 even in the naive model)."""
ROW_BLOCK = 4096
"""Rows per block when summing XᵀX and Xᵀy (blocked sums keep the rounding error inside SLACK)."""
MAX_DIMENSION = 300
MAX_LEVELS = 10_000
MAX_EPSILON = 100.0
MAX_WORST_CASE = 1e4
"""Largest ``epsilon_max`` (a cap on ε_A + ε_T; the grid's own top ε_T stays ≤ MAX_EPSILON)."""
MIN_EPSILON = 1e-9
LEARNING_TASK: dict[Task, LearningTask] = {"ridge": "regression", "logistic": "classification"}
CHUNK = 32
"""Levels evaluated per batch (one matrix product); decisions are still taken one level at a time."""
SCALE_BITS = 40
"""The statistic grid is coarsened until the noisiest level's scale, Δ_S/(γ_S·ε_1), is ≤ 2^40 grid units."""
RANGE_BITS = 44
"""... and until the public magnitude bound of the statistic is ≤ 2^44·γ_S (exact float arithmetic)."""
COEFFICIENT_BITS = 40
"""Ridge coefficients are released on 2^(⌊log2 M⌋ − 40): a change of ≤ √p·2^−40·M, far below any α."""
FLOAT_ALLOWANCE = Fraction(1, 64)
"""Per-coordinate float allowance (grid units) on top of Δ_S's relative slack, as ``queries.unit_shift``."""


# ----- public constants of the problem (the paper's §3: Algorithms 3 and 5, Claims A.5 and A.12) ----------
def radius(task: Task, lam: float) -> float:
    """M with ‖θ*‖₂ ≤ M: 1/√λ for ridge (Lemma A.4), √(2 ln 2/λ) for logistic (Claim A.11)."""
    return 1.0 / math.sqrt(lam) if task == "ridge" else math.sqrt(2.0 * math.log(2.0) / lam)


def query_sensitivity(task: Task, n: int, lam: float) -> float:
    """Δ_q of f(D) = L(θ*, D) − L(θ, D) over θ ∈ C, replace-one (Claim A.5 / A.12), with the slack.

    Each point's loss lies in an interval of length (M+1)²/2 (ridge, |θᵀx| ≤ M, |y| ≤ 1) or M (logistic);
    L(θ, ·) and min_C L(·, ·) each move by at most that over n, hence twice the range over n (Claims A.5,
    A.12).
    """
    m = radius(task, lam)
    exact = (m + 1.0) ** 2 / n if task == "ridge" else 2.0 * m / n
    return pad_up(exact * (1.0 + SLACK) + ABSOLUTE_SLACK)


def statistic_sensitivity(task: Task, n: int, lam: float, p: int) -> float:
    """ℓ1 sensitivity of the noised statistic, times (1 + slack): 4 for (XᵀX, Xᵀy) (Lemma A.6, ‖x‖₁ ≤ 1,
    |y| ≤ 1); 2√p/(nλ) for θ* (Lemma A.10 / CMS 2011 Cor. 8 with ‖x‖₂ ≤ 1, and ‖·‖₁ ≤ √p‖·‖₂)."""
    if task == "ridge":
        return pad_up(4.0 * (1.0 + SLACK))
    return pad_up(2.0 * math.sqrt(p) / (n * lam) * (1.0 + SLACK))


def gradient_tolerance(n: int, lam: float) -> float:
    """g_tol of the θ* certificate: 2·g_tol/λ = 0.1·SLACK·2/(nλ), i.e. 10× inside the slack."""
    return 0.1 * SLACK / n


def theory_epsilon(task: Task, n: int, p: int, lam: float, alpha: float) -> float:
    """ε of the one-shot mechanism whose *expected* excess risk is ≤ α by the utility theorem (Theorems 3.2,
    3.4).

    ridge: E_cov = 4√2(2√p·M + p·M²)/(nα) (Theorem 3.1); logistic: E_log = 2√2·p/(nλα) (Theorem 3.3,
    first term, as the reference code; the exact quadratic differs by ~1e−4 relative).
    """
    if task == "ridge":
        m = radius(task, lam)
        return 4.0 * math.sqrt(2.0) * (2.0 * math.sqrt(p) * m + p * m * m) / (n * alpha)
    return 2.0 * math.sqrt(2.0) * p / (n * lam * alpha)


def geometric_grid(epsilon_min: float, epsilon_max: float, levels: int) -> np.ndarray:
    """Strictly increasing geometric grid with both ends included (one level: just ε_max)."""
    if levels == 1:
        return np.array([epsilon_max])
    grid = np.geomspace(epsilon_min, epsilon_max, levels)
    grid[-1] = epsilon_max
    if not np.all(np.diff(grid) > 0):
        raise ValueError("the grid is not strictly increasing (ε_min too close to ε_max for this size)")
    return grid


# ----- the public grids (docs/privacy.md §10) ---------------------------------------------------------------
def statistic_dimension(task: Task, p: int) -> int:
    """d of the noised statistic: p² + p for (XᵀX, Xᵀy), p for θ*."""
    return p * p + p if task == "ridge" else p


def statistic_magnitude(task: Task, n: int, lam: float) -> float:
    """A public bound on every coordinate of the computed statistic: n for (XᵀX, Xᵀy) (|Σ_i x_ij x_ik| ≤
    Σ_i ‖x_i‖₁² ≤ n and |Σ_i x_ij y_i| ≤ n), 2M for θ* (‖θ*‖₂ ≤ M, doubled for the solver's tolerance)."""
    return float(n) if task == "ridge" else 2.0 * radius(task, lam)


def _grid_at_least(size: float) -> Grid:
    """The smallest power-of-two grid ≥ ``size`` (> 0)."""
    mantissa, exponent = math.frexp(size)  # size = mantissa·2^exponent, mantissa ∈ [0.5, 1)
    return Grid(exponent - 1 if mantissa == 0.5 else exponent)


@dataclass(frozen=True)
class StatisticPlan:
    """The public grid of the noised statistic and its ℓ1 sensitivity ``units`` (Δ_g, an integer) there."""

    grid: Grid
    dim: int
    units: int

    def to_units(self, values: np.ndarray) -> np.ndarray:
        """⌊v/γ + ½⌋ exactly (int64): v/γ is a power-of-two scaling (exact), and so are v/γ − ⌊v/γ⌋ and the
        comparison with ½ below 2^52. A public map, so |U_j(D) − U_j(D′)| ≤ ⌊|v_j(D) − v_j(D′)|/γ⌋ + 1."""
        scaled = np.ldexp(np.asarray(values, dtype=np.float64), -self.grid.exponent)
        if not np.all(np.isfinite(scaled)) or np.any(np.abs(scaled) >= float(1 << 52)):
            raise ValueError("a statistic is too large for its grid (|value/γ| ≥ 2^52)")
        low = np.floor(scaled)
        units: np.ndarray = low.astype(np.int64) + (scaled - low >= 0.5).astype(np.int64)
        return units

    def from_units(self, units: np.ndarray) -> np.ndarray:
        """γ·units, exact (checked below 2^53)."""
        return self.grid.from_units(units)


def statistic_plan(task: Task, n: int, p: int, lam: float, epsilon_min: float) -> StatisticPlan:
    """γ_S from public values only: ``laplace_grid``'s largest 2^k ≤ 2^−10·Δ_S/d, coarsened until the
    noisiest level's scale Δ_S/(γ_S·ε_1) ≤ 2^40 units and the magnitude bound ≤ 2^44·γ_S.

    Δ_g = ⌊Δ_S/γ_S + d/64⌋ + d bounds ‖U(D) − U(D′)‖₁: coordinate-wise ⌊|a − b|⌋ + 1 ≤ |a − b| + 1, summed
    with ‖Ŝ(D) − Ŝ(D′)‖₁ ≤ Δ_S (the computed statistics, SLACK included), plus a 1/64-unit allowance per
    coordinate; an integer, so the floor is exact. Relative cost: ≤ (1 + 1/64)·2^−10 unless coarsened.
    """
    delta = statistic_sensitivity(task, n, lam, p)
    dim = statistic_dimension(task, p)
    grid = laplace_grid(delta, dim, integer_valued=False)
    floors = (delta / (epsilon_min * 2.0**SCALE_BITS), statistic_magnitude(task, n, lam) * 2.0**-RANGE_BITS)
    for floor in floors:
        if floor > grid.granularity:
            grid = _grid_at_least(floor)
    units = math.floor(Fraction(delta) / Fraction(grid.granularity) + FLOAT_ALLOWANCE * dim) + dim
    return StatisticPlan(grid, dim, units)


def smallest_level_epsilon(task: Task, p: int) -> float:
    """(2d + 2)·2^−40: from this ε_1 up, ``statistic_plan``'s coarsening keeps the noisiest scale Δ_g/ε_1 ≤
    2^40 + (65d/64 + 1)/ε_1 < 2^41 grid units, the largest the exact noise reduction takes (Δ_g ≥ d)."""
    return (2.0 * statistic_dimension(task, p) + 2.0) * 2.0**-40


def coefficient_grid(task: Task, lam: float, plan: StatisticPlan) -> Grid:
    """The public grid of the released coefficients: γ_S for logistic (θ^t is the noisy statistic, projected),
    2^(⌊log2 M⌋ − 40) for ridge (θ^t solves a problem in the noisy statistic)."""
    if task == "logistic":
        return plan.grid
    return Grid(math.frexp(radius(task, lam))[1] - 1 - COEFFICIENT_BITS)


def snap(thetas: np.ndarray, grid: Grid) -> np.ndarray:
    """Each coefficient truncated toward zero to a multiple of γ (exact; |snap(c)| ≤ |c|: ‖θ‖₂ ≤ M stays)."""
    units = np.trunc(np.ldexp(np.asarray(thetas, dtype=np.float64), -grid.exponent))
    if np.any(np.abs(units) >= float(1 << 53)):
        raise OverflowError("a coefficient is too large for its grid")
    result: np.ndarray = np.ldexp(units, grid.exponent)
    return result


# ----- the test: InteractiveAboveThreshold (Algorithm 2; mechanisms.threshold.above_threshold) -------------
def iat_calibration(
    calibration: Calibration, delta_q: float, alpha: float, gamma: float, levels: int
) -> IatCalibration:
    """ε_A and the threshold W on f = L(θ*) − L(θ) (target f ≥ −α, i.e. excess ≤ α).

    paper_theorem: ε_A = 16Δ_q ln(2T/γ)/α and W = −α/2 (Theorem 3.2 / 3.4, Alg. 5 erratum: −α/2);
    reference_code: the authors' code, docs/privacy.md §8.2.4 (W = −s). Both are pure ε_A-DP (Lemma 2.8).
    """
    if calibration == "exact_bound":
        return iat_exact_calibration(delta_q, alpha, gamma, levels)
    calibrate = iat_paper_calibration if calibration == "paper_theorem" else iat_reference_calibration
    return calibrate(delta_q, alpha, gamma, levels, target=-alpha)


# The exact-bound calibration (ours; an adapter on top of mechanisms.threshold.above_threshold). Theorem A.1
# bounds the failure by a union bound over the threshold and the T query noises. The exact probability of the
# event it controls is a one-dimensional integral: if a level with excess > α is accepted at t, then
# f_t < −α and f_t + ν_t ≥ W + ρ, so ν_t − ρ > W + α =: c. Pre-drawing ν_1..ν_T (same law),
#   P[an accepted level has excess > α] ≤ P[max_{t≤T} ν_t − ρ > c] = 1 − E_ρ[F_ν(c + ρ)^T],
# for every data set and every hypothesis sequence. In units of the query-noise scale 4Δ/ε_A, ρ ~ Lap(1/2),
# ν ~ Lap(1) and c becomes u = c·ε_A/(4Δ), so the failure is a function φ_T(u), decreasing in u.
def _failure_in_units(u: float, levels: int) -> float:
    """Upper bound on φ_T(u) = P[max_{t≤T} ν_t − ρ > u], ρ ~ Lap(1/2), ν_t ~ Lap(1): quadrature value plus
    its error estimate plus the truncated tails (|ρ| > 40 has probability e^{−80})."""

    def integrand(r: float) -> float:
        x = u + r
        log_cdf = math.log1p(-0.5 * math.exp(-x)) if x >= 0 else math.log(0.5) + x
        return math.exp(-2.0 * abs(r)) * -math.expm1(levels * log_cdf)  # density of Lap(1/2) is e^{−2|r|}

    total = math.exp(-80.0)
    for low, high in ((-40.0, min(-u, 0.0)), (min(-u, 0.0), 0.0), (0.0, 40.0)):
        if high > low:
            value, error = integrate.quad(integrand, low, high, limit=200, epsabs=1e-13, epsrel=1e-10)
            total += value + abs(error)
    return min(1.0, total)


def iat_failure_probability(epsilon_a: float, delta_q: float, margin: float, levels: int) -> float:
    """Upper bound on P[some accepted level has excess > α] when W + α = ``margin``
    (exact; docs/privacy.md §8.2.4)."""
    return _failure_in_units(margin * epsilon_a / (4.0 * delta_q), levels)


def _dlap_cdf(m: np.ndarray, q: float) -> np.ndarray:
    """P(Z ≤ m) for Z ~ DLap(q), P(z) = (1−q)/(1+q)·q^|z|: 1 − q^(m+1)/(1+q) for m ≥ 0, q^(−m)/(1+q) else."""
    m = np.asarray(m, dtype=np.float64)
    log_q = math.log(q)
    upper = -np.expm1((np.maximum(m, 0.0) + 1.0) * log_q - math.log1p(q))
    lower = np.exp(-np.minimum(m, 0.0) * log_q - math.log1p(q))
    result: np.ndarray = np.where(m >= 0, upper, lower)
    return result


def iat_discrete_failure_probability(
    epsilon_a: float, delta_q: float, threshold: float, alpha: float, levels: int
) -> float:
    """Upper bound on P[some accepted level has excess > α] for the grid IAT actually run.

    Acceptance at f_t < −α needs R(f_t) + ν_t ≥ R(W) + ρ (R = round to the IAT grid γ_A; |R(x) − x/γ_A| ≤ ½,
    and the ±2^44 clamp only helps), so ν_t − ρ > (W + α)/γ_A − 1, i.e. ν_t − ρ ≥ k = ⌊(W + α)/γ_A⌋ (an
    integer). Pre-drawing the ν's: failure ≤ Σ_r P(ρ = r)·h(r), h(r) = 1 − P(ν ≤ k + r − 1)^T, h decreasing.
    Summed over blocks of ρ (exact block probabilities, h at the block's left end: an upper bound), ρ beyond
    ±60 scales counted as failure, plus 10⁻¹² for float rounding.
    """
    grid = ThresholdGrid.build(delta_q, epsilon_a)
    t1, t2 = float(grid.threshold_scale), float(grid.query_scale)
    q1, q2 = math.exp(-1.0 / t1), math.exp(-1.0 / t2)
    k = math.floor((Fraction(threshold) + Fraction(alpha)) / Fraction(grid.grid.granularity))
    reach = math.ceil(60.0 * t1)
    width = max(1, math.ceil(t1 / 4000.0))
    starts = np.arange(-reach, reach + 1, width, dtype=np.float64)
    block = _dlap_cdf(starts + (width - 1), q1) - _dlap_cdf(starts - 1, q1)
    log_cdf = np.log(np.maximum(_dlap_cdf(k + starts - 1, q2), 1e-300))
    h = -np.expm1(levels * log_cdf)
    tails = float(_dlap_cdf(np.array([-reach - 1.0]), q1)[0]) + float(
        1.0 - _dlap_cdf(np.array([starts[-1] + width - 1]), q1)[0]
    )
    return min(1.0, float(np.sum(np.maximum(block, 0.0) * h)) + tails + 1e-12)


@functools.lru_cache(maxsize=256)
def iat_exact_calibration(delta_q: float, alpha: float, gamma: float, levels: int) -> IatCalibration:
    """W = −α/2 (as the paper) and the smallest ε_A with exact failure bound ≤ γ (ours, see above).

    Solves φ_T(u) = γ·(1 − 10⁻⁶) by Brent's method for continuous Laplace noise, then certifies the grid IAT
    that actually runs (discrete Laplace, scales ~0.1 % larger, rounded comparisons) with
    ``iat_discrete_failure_probability``, raising ε_A by 0.05 % steps until the bound is ≤ γ.
    """
    target = gamma * (1.0 - 1e-6)
    u = optimize.brentq(lambda v: _failure_in_units(v, levels) - target, 1e-9, 200.0, xtol=1e-12, rtol=1e-12)
    u *= 1.0 + 1e-9
    margin = alpha / 2.0
    epsilon_a = pad_up(4.0 * delta_q * u / margin)
    threshold = -alpha / 2.0
    for _ in range(200):
        if iat_discrete_failure_probability(epsilon_a, delta_q, threshold, alpha, levels) <= target:
            return IatCalibration(epsilon_a, threshold, "exact-bound")
        epsilon_a = pad_up(epsilon_a * (1.0 + 5e-4))
    raise ArithmeticError("the exact-bound calibration could not be certified")


def doubling_test(calibration: Calibration, delta_q: float, alpha: float, gamma: float, levels: int) -> float:
    """Noise scale of one Doubling test (accept iff f + Lap ≥ −α/2); ε_test = Δ_q/scale.

    paper_theorem: Lap(α/(2 ln(T/γ))) (Algorithm 4); reference_code: Lap((α/2)/ln(T/(2γ))) (the authors'
    code); exact_bound: the exact failure 1 − (1 − ½e^{−(α/2)/s})^T = γ,
    i.e. s = (α/2)/(−ln(2(1 − (1−γ)^{1/T}))).
    """
    if calibration == "paper_theorem":
        log_term = math.log(levels / gamma)
    elif calibration == "reference_code":
        log_term = math.log(levels / (2 * gamma))
    else:
        log_term = -math.log(2.0 * -math.expm1(math.log1p(-gamma * (1.0 - 1e-9)) / levels))
    if log_term <= 0:
        raise ValueError("ln(T/γ) must be > 0")
    return alpha / (2.0 * log_term)


# ----- losses and solvers ----------------------------------------------------------------------------------
def project(thetas: np.ndarray, m: float) -> np.ndarray:
    """Rows θ with ‖θ‖₂ > M scaled onto the sphere (the corrected Alg. 5 step), a hair inside for rounding."""
    norms = np.linalg.norm(thetas, axis=-1, keepdims=True)
    target = m * (1.0 - 1e-12)
    scale = np.where(norms > target, target / np.maximum(norms, np.finfo(float).tiny), 1.0)
    result: np.ndarray = thetas * scale
    return result


@dataclass(frozen=True)
class RidgeData:
    """Sufficient statistics of ridge (secret): XᵀX, Xᵀy, yᵀy, n."""

    xtx: np.ndarray
    xty: np.ndarray
    yty: float
    n: int

    @classmethod
    def from_arrays(cls, x: np.ndarray, y: np.ndarray) -> RidgeData:
        """Blocked sums: the rounding error of XᵀX is ≤ (B + n/B)·u·Σ‖x_i‖₁² (B = ROW_BLOCK, u = 2⁻⁵³),
        i.e. ≤ 1e−6 relative to the sensitivity 4 for n ≤ 2·10⁶ even in the worst-case model."""
        n, p = x.shape
        xtx, xty = np.zeros((p, p)), np.zeros(p)
        for start in range(0, n, ROW_BLOCK):
            block, labels = x[start : start + ROW_BLOCK], y[start : start + ROW_BLOCK]
            xtx += block.T @ block
            xty += block.T @ labels
        return cls(xtx, xty, float(y @ y), int(n))

    def statistic(self) -> np.ndarray:
        """S(D) = (XᵀX row-major, Xᵀy), the vector noise reduction runs on."""
        return np.concatenate([self.xtx.ravel(), self.xty])

    def losses(self, thetas: np.ndarray, lam: float) -> np.ndarray:
        """L(θ) = (yᵀy − 2θᵀXᵀy + θᵀXᵀXθ)/(2n) + (λ/2)‖θ‖² for each row θ."""
        quad = np.einsum("ij,jk,ik->i", thetas, self.xtx, thetas)
        data_term = (self.yty - 2.0 * thetas @ self.xty + quad) / (2.0 * self.n)
        result: np.ndarray = data_term + 0.5 * lam * np.sum(thetas * thetas, axis=1)
        return result

    def minimizer(self, lam: float) -> np.ndarray:
        """θ* = (XᵀX + nλI)⁻¹Xᵀy (closed form, Cholesky), checked by the gradient certificate."""
        p = self.xty.shape[0]
        hessian = self.xtx / self.n + lam * np.eye(p)
        factor = np.linalg.cholesky(hessian)
        theta = np.linalg.solve(factor.T, np.linalg.solve(factor, self.xty / self.n))
        for _ in range(3):  # iterative refinement
            grad = hessian @ theta - self.xty / self.n
            if np.linalg.norm(grad) <= gradient_tolerance(self.n, lam):
                return np.asarray(theta)
            theta = theta - np.linalg.solve(factor.T, np.linalg.solve(factor, grad))
        raise RuntimeError("the ridge solver could not certify its minimiser")


@dataclass(frozen=True)
class LogisticData:
    """Design matrix and ±1 labels (secret)."""

    x: np.ndarray
    y: np.ndarray

    @property
    def n(self) -> int:
        return int(self.x.shape[0])

    def losses(self, thetas: np.ndarray, lam: float) -> np.ndarray:
        """L(θ) = mean log(1 + e^{−y θᵀx}) + (λ/2)‖θ‖² for each row θ (logaddexp: no overflow)."""
        # (k, n): the mean runs along the contiguous axis, where numpy sums pairwise (error O(log n · u)).
        margins = (thetas @ self.x.T) * self.y[None, :]
        result: np.ndarray = np.logaddexp(0.0, -margins).mean(axis=1) + 0.5 * lam * np.sum(thetas * thetas, 1)
        return result

    def minimizer(self, lam: float) -> np.ndarray:
        """θ* by damped Newton; returns only once ‖∇L‖ ≤ g_tol (certificate, docs/privacy.md §8.2.5)."""
        n, p = self.x.shape
        theta = np.zeros(p)
        tol = gradient_tolerance(n, lam)
        for _ in range(100):
            margins = self.y * (self.x @ theta)
            sig = 0.5 * (1.0 - np.tanh(0.5 * margins))  # σ(−m), stable
            grad = -(self.x.T @ (sig * self.y)) / n + lam * theta
            if np.linalg.norm(grad) <= tol:
                return theta
            weights = sig * (1.0 - sig)
            hessian = (self.x.T * weights) @ self.x / n + lam * np.eye(p)
            step = np.linalg.solve(hessian, grad)
            current = float(self.losses(theta[None, :], lam)[0])
            # Armijo backtracking; decreases below float resolution count as sufficient (the result is
            # certified by the gradient alone, so the line search cannot affect soundness).
            size, slope = 1.0, float(grad @ step)
            resolution = 8.0 * np.finfo(float).eps * abs(current)
            while size > 1e-10:
                candidate = theta - size * step
                loss = float(self.losses(candidate[None, :], lam)[0])
                if loss <= current - 1e-4 * size * slope + resolution:
                    break
                size /= 2.0
            theta = theta - size * step
        raise RuntimeError("the logistic solver could not certify its minimiser")


ErmData = RidgeData | LogisticData


def trust_region_minimizer(a: np.ndarray, z: np.ndarray, m: float) -> np.ndarray:
    """argmin_{‖θ‖₂ ≤ M} ½θᵀAθ − zᵀθ for symmetric A (Moré & Sorensen 1983).

    With A = QΛQᵀ and z̃ = Qᵀz: the unconstrained solution if A ≻ 0 and ‖A⁻¹z‖ ≤ M; otherwise
    θ(μ) = Q(Λ + μI)⁻¹z̃ with μ > max(0, −λ_min) solving ‖θ(μ)‖ = M (bisection on a monotone function), and
    the hard case (z̃ ⊥ the bottom eigenspace) completes with a bottom eigenvector. Always returns ‖θ‖ ≤ M.
    """
    w, q = np.linalg.eigh(a)
    zt = q.T @ z
    if w[0] > 0:
        theta0 = zt / w
        if np.linalg.norm(theta0) <= m:
            return np.asarray(q @ theta0)
    low = max(0.0, -float(w[0]))
    spread = float(np.max(np.abs(w))) + 1.0
    bottom = w <= w[0] + 1e-12 * spread

    def norm(mu: float) -> float:
        with np.errstate(divide="ignore"):
            return float(np.linalg.norm(zt / (w + mu)))

    eps_mu = 1e-13 * spread
    if norm(low + eps_mu) <= m:  # hard case: the secular equation has no root right of −λ_min
        coeffs = np.where(bottom, 0.0, zt / np.where(bottom, 1.0, w + low))
        tail = math.sqrt(max(m * m - float(coeffs @ coeffs), 0.0))
        coeffs = coeffs + tail * bottom / math.sqrt(float(np.sum(bottom)))
        return np.asarray(project((q @ coeffs)[None, :], m)[0])
    lo, hi = low + eps_mu, low + float(np.linalg.norm(z)) / m + spread
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if norm(mid) > m:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-13 * hi:
            break
    return np.asarray(project((q @ (zt / (w + hi)))[None, :], m)[0])


def ridge_hypothesis(noisy: np.ndarray, p: int, n: int, lam: float) -> np.ndarray:
    """θ^t = argmin_{‖θ‖ ≤ 1/√λ} (1/2n)(θᵀZθ − 2zᵀθ) + (λ/2)‖θ‖² for the noisy (Z, z) (equation 3.1)."""
    z_mat = noisy[: p * p].reshape(p, p)
    a = 0.5 * (z_mat + z_mat.T) + n * lam * np.eye(p)
    return trust_region_minimizer(a, noisy[p * p :], radius("ridge", lam))


def hypotheses(task: Task, noisy: np.ndarray, p: int, n: int, lam: float) -> np.ndarray:
    """The models θ^t ∈ C of a batch of noisy statistics (rows): post-processing of the released levels."""
    if task == "ridge":
        return np.stack([ridge_hypothesis(row, p, n, lam) for row in noisy])
    return project(noisy, radius(task, lam))


# ----- the accuracy-first walk (the paper's §3: noise reduction + Algorithm 2) ----------------------------
@dataclass(frozen=True)
class WalkResult:
    """Public outcome: the released level (1-based), its model (on the grid ``granularity``) and ε's.
    ``excess`` is a non-private diagnostic (for benchmarks only, never returned by the service: it reads the
    data);
    ``statistic`` is the level's noisy statistic (a multiple of ``statistic_granularity``; for logistic it
    is the unprojected model, for ridge it stays internal)."""

    level: int
    theta: np.ndarray
    reached: bool
    epsilon_level: float
    epsilon_test: float
    excess: float
    granularity: float = 0.0
    statistic: np.ndarray | None = None
    statistic_granularity: float = 0.0

    @property
    def epsilon(self) -> float:
        return sum_up([self.epsilon_test, self.epsilon_level])


@dataclass(frozen=True)
class Problem:
    """Public constants of one accuracy-first request."""

    task: Task
    n: int
    p: int
    lam: float
    alpha: float
    gamma: float
    calibration: Calibration

    @property
    def delta_q(self) -> float:
        return query_sensitivity(self.task, self.n, self.lam)

    @property
    def delta_s(self) -> float:
        return statistic_sensitivity(self.task, self.n, self.lam, self.p)

    def test(self, levels: int) -> IatCalibration:
        return iat_calibration(self.calibration, self.delta_q, self.alpha, self.gamma, levels)

    def plan(self, epsilon_min: float) -> StatisticPlan:
        return statistic_plan(self.task, self.n, self.p, self.lam, epsilon_min)

    def coefficient_grid(self, plan: StatisticPlan) -> Grid:
        return coefficient_grid(self.task, self.lam, plan)

    def statistic(self, data: ErmData, theta_star: np.ndarray) -> np.ndarray:
        return data.statistic() if isinstance(data, RidgeData) else theta_star


def make_data(task: Task, x: np.ndarray, y: np.ndarray) -> ErmData:
    return RidgeData.from_arrays(x, y) if task == "ridge" else LogisticData(x, y)


def released_models(problem: Problem, noisy: np.ndarray, model_grid: Grid) -> np.ndarray:
    """θ^t of grid-valued noisy statistics (rows), truncated onto the model grid (post-processing)."""
    return snap(hypotheses(problem.task, noisy, problem.p, problem.n, problem.lam), model_grid)


def accuracy_first(
    problem: Problem,
    data: ErmData,
    epsilons: np.ndarray,
    noise: Noise,
    progress: ProgressFn = no_progress,
) -> WalkResult:
    """Noise reduction + InteractiveAboveThreshold (Algorithms 2, 3, 5), on the grid.

    The levels are walked from the most private with the lazy forward sampler (Algorithm 1, Koufogiannis et
    al. 2015), which holds one level's noise at a time (integers in grid units). Level t's noisy statistic is
    γ_S·(U + η_t), U the exactly rounded statistic and Δ_g its ℓ1 sensitivity in grid units
    (``statistic_plan``). Models and queries are computed in chunks of levels (one matrix product), but each
    test uses only its own level's query and fresh noise, in order, and stops at the first pass, so the law is
    that of the sequential algorithm; values of levels past the stop are discarded unreleased. Levels are
    1-based in the result.
    """
    lam, levels = problem.lam, len(epsilons)
    calibration = problem.test(levels)
    plan = problem.plan(float(epsilons[0]))
    model_grid = problem.coefficient_grid(plan)
    theta_star = data.minimizer(lam)
    best = float(data.losses(theta_star[None, :], lam)[0])
    units = plan.to_units(problem.statistic(data, theta_star))
    iat = InteractiveAboveThreshold(calibration.threshold, calibration.epsilon_a, problem.delta_q, noise)
    state = LazyLaplaceNR.start(float(plan.units), [float(e) for e in epsilons], plan.dim, noise)
    start = 0
    while True:
        stop = min(start + CHUNK, levels)
        rows = []
        for t in range(start, stop):
            if t > 0:
                state = LazyLaplaceNR.advance(state, noise)
            rows.append(plan.from_units(units + LazyLaplaceNR.noise(state)))
        noisy = np.stack(rows)
        thetas = released_models(problem, noisy, model_grid)
        queries = best - data.losses(thetas, lam)
        for j, value in enumerate(queries):
            if iat.test(float(value), noise):
                index, reached = start + j, True
                break
        else:
            if stop < levels:
                start = stop
                progress(start / levels)
                continue
            index, reached, j = levels - 1, False, len(queries) - 1
        return WalkResult(
            index + 1,
            thetas[j],
            reached,
            float(epsilons[index]),
            calibration.epsilon_a,
            -float(queries[j]),
            model_grid.granularity,
            noisy[j],
            plan.grid.granularity,
        )


# ----- baselines -------------------------------------------------------------------------------------------
def doubling_grid(epsilon_min: float, epsilon_max: float) -> np.ndarray:
    """ε_1·2^i for i = 0..K with K = ⌈log2(ε_max/ε_1)⌉, so the last level is ≥ ε_max (Algorithm 4)."""
    k = max(0, math.ceil(math.log2(epsilon_max / epsilon_min)))
    return epsilon_min * 2.0 ** np.arange(k + 1)


def doubling_charge(test_epsilon: float, epsilons: Sequence[float] | np.ndarray, rounds: int) -> float:
    """ℰ(k) = k·ε_test + Σ_{i≤k} ε_i (Theorem A.2; pure odometer, Rogers et al. 2016 Thm 3.6)."""
    return sum_up([test_epsilon] * rounds + [float(e) for e in epsilons[:rounds]])


def grid_release(plan: StatisticPlan, units: np.ndarray, epsilon: float, noise: Noise) -> np.ndarray:
    """γ_S·(U + Z), Z ~ DLap(t) per coordinate with t = ``dyadic_scale_up``(Δ_g/ε) ≥ Δ_g/ε: pure ε-DP
    (the discrete Laplace ratio at an integer shift of ℓ1 norm ≤ Δ_g is ≤ e^{Δ_g/t})."""
    scale = dyadic_scale_up(Fraction(plan.units) / charged_fraction(epsilon))
    return plan.from_units(units + noise.discrete_laplace(scale, units.size))


@dataclass(frozen=True)
class GridTest:
    """One noisy comparison f + noise ≥ W on a grid: accept iff R(f) + Z ≥ R(W), Z ~ DLap(t) (grid units).
    R(f) moves by ≤ M = ``unit_shift``(Δ_q) units, so the accept bit is pure M/t ≤ ε-DP."""

    grid: Grid
    threshold_units: int
    scale: Fraction

    @classmethod
    def build(cls, delta_q: float, epsilon: float, threshold: float) -> GridTest:
        grid = laplace_grid(delta_q, 1, integer_valued=False)
        shift = unit_shift(delta_q, grid, exact=False)
        scale = dyadic_scale_up(Fraction(shift) / charged_fraction(epsilon))
        return cls(grid, round(Fraction(threshold) / Fraction(grid.granularity)), scale)

    def passes(self, value: float, noise: Noise) -> bool:
        units = round(Fraction(value) / Fraction(self.grid.granularity))
        return units + int(noise.discrete_laplace(self.scale, 1)[0]) >= self.threshold_units


def doubling(problem: Problem, data: ErmData, epsilons: np.ndarray, noise: Noise) -> WalkResult:
    """DoublingMethod (Algorithm 4): independent ε_i-DP grid models, each tested with fresh grid noise."""
    lam, levels = problem.lam, len(epsilons)
    scale = doubling_test(problem.calibration, problem.delta_q, problem.alpha, problem.gamma, levels)
    eps_test = pad_up(problem.delta_q / scale)
    test = GridTest.build(problem.delta_q, eps_test, -problem.alpha / 2.0)
    plan = problem.plan(float(epsilons[0]))
    model_grid = problem.coefficient_grid(plan)
    theta_star = data.minimizer(lam)
    best = float(data.losses(theta_star[None, :], lam)[0])
    units = plan.to_units(problem.statistic(data, theta_star))
    theta = theta_star
    excess = 0.0
    for i, eps in enumerate(epsilons):
        noisy = grid_release(plan, units, float(eps), noise)
        theta = released_models(problem, noisy[None, :], model_grid)[0]
        query = best - float(data.losses(theta[None, :], lam)[0])
        excess = -query
        if test.passes(query, noise):
            charge = doubling_charge(eps_test, epsilons, i + 1)
            rounds = i + 1
            return WalkResult(
                rounds,
                theta,
                True,
                charge - rounds * eps_test,
                rounds * eps_test,
                excess,
                model_grid.granularity,
                noisy,
                plan.grid.granularity,
            )
    charge = doubling_charge(eps_test, epsilons, levels)
    return WalkResult(
        levels, theta, False, charge - levels * eps_test, levels * eps_test, excess, model_grid.granularity
    )


def one_shot(problem: Problem, data: ErmData, epsilon: float, noise: Noise) -> WalkResult:
    """The theory-inversion baseline: one ε-DP grid model (Theorem 3.1 / 3.3), no test."""
    lam = problem.lam
    plan = problem.plan(epsilon)
    model_grid = problem.coefficient_grid(plan)
    theta_star = data.minimizer(lam)
    noisy = grid_release(plan, plan.to_units(problem.statistic(data, theta_star)), epsilon, noise)
    theta = released_models(problem, noisy[None, :], model_grid)[0]
    excess = float(data.losses(theta[None, :], lam)[0] - data.losses(theta_star[None, :], lam)[0])
    return WalkResult(
        1, theta, True, epsilon, 0.0, excess, model_grid.granularity, noisy, plan.grid.granularity
    )


# ----- the service-facing mechanisms ------------------------------------------------------------------------
class AccuracyFirstParams(FeatureSpec):
    """Public parameters of an accuracy-first ERM request (FeatureSpec fields + the target and the grid)."""

    regularization: StrictFloat = Field(
        ge=1e-6, le=1e3, allow_inf_nan=False, description="λ of the ℓ2 regulariser (λ/2)‖θ‖²"
    )
    target_excess_risk: StrictFloat = Field(
        gt=0, le=10, allow_inf_nan=False, description="α: target excess empirical risk L(θ) − L(θ*)"
    )
    failure_probability: StrictFloat = Field(
        default=0.1, gt=0, le=0.5, allow_inf_nan=False, description="γ: the accuracy test may fail w.p. ≤ γ"
    )
    epsilon_max: StrictFloat | None = Field(
        default=None,
        ge=MIN_EPSILON,
        le=MAX_WORST_CASE,
        allow_inf_nan=False,
        description="cap on the worst case ε_A + ε_T: the grid's largest level is ε_T = epsilon_max − ε_A "
        "(refused, with the feasible range, when the test's ε_A alone reaches it); default: ε_T = 4× the "
        "theory-inverted ε, as the authors' code (the worst case is then ε_A + ε_T)",
    )
    epsilon_min: StrictFloat | None = Field(
        default=None,
        ge=MIN_EPSILON,
        le=MAX_EPSILON,
        allow_inf_nan=False,
        description="smallest level ε_1 of the geometric grid (default min(1/n, ε_max/1000))",
    )
    levels: StrictInt = Field(default=1000, ge=1, le=MAX_LEVELS, description="T: number of grid levels")
    calibration: Calibration = Field(
        default="paper_theorem",
        description=(
            "test calibration: paper_theorem (Thm 3.2/3.4), reference_code (the authors' code) or "
            "exact_bound (W = −α/2, smallest ε_A whose exact failure bound is ≤ γ)"
        ),
    )

    @model_validator(mode="after")
    def _grid_ordered(self) -> Self:
        low, high = self.epsilon_min, self.epsilon_max
        if low is not None and high is not None and low >= high:
            raise ValueError("epsilon_min must be < epsilon_max")
        return self


class AccuracyFirstErm(ParamsChecked):
    """Shared implementation of ``accuracy_first.ridge`` and ``accuracy_first.logistic``."""

    name: ClassVar[str]
    summary: ClassVar[str]
    task: ClassVar[Task]
    params_model: ClassVar[type[BaseModel]] = AccuracyFirstParams
    cost_parameter: ClassVar[str] = "epsilon_max"
    cost_increases_with_parameter: ClassVar[bool] = True
    long_running: ClassVar[bool] = True
    progress_is_public: ClassVar[bool] = True

    def __init_subclass__(cls, task: Task, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.task = task

    def problem(self, p: AccuracyFirstParams, ctx: PublicContext) -> tuple[Problem, np.ndarray]:
        """Schema checks, then the public problem constants and the ε grid (raises ParamsError)."""
        check_features(p, ctx, LEARNING_TASK[self.task])
        if ctx.n_rows is None or ctx.schema.neighboring != "replace_one":
            reason = "needs a replace_one dataset: n must be public (bounded DP, the paper's §2)"
            raise ValueError(reason)  # not a field: the service reports it on "params"
        if ctx.n_rows < 2:
            raise ValueError("needs at least 2 rows")
        if ctx.n_rows > MAX_ROWS:
            raise ValueError(f"at most {MAX_ROWS} rows: the rounding slack of the sums is proven up to there")
        dim = dimension(p, ctx)
        if dim > MAX_DIMENSION:
            reason = f"the design matrix has {dim} columns, more than {MAX_DIMENSION}"
            raise ParamsError("features", reason)
        n, lam, alpha = ctx.n_rows, p.regularization, p.target_excess_risk
        problem = Problem(self.task, n, dim, lam, alpha, p.failure_probability, p.calibration)
        eps_max = p.epsilon_max
        if eps_max is not None:  # a cap on the whole worst case ε_A + ε_T: the grid ends at ε_T = cap − ε_A
            test_epsilon = problem.test(p.levels).epsilon_a
            eps_max = (eps_max - test_epsilon) * (1.0 - 1e-12)
            if not eps_max >= MIN_EPSILON:
                reason = (
                    "caps the worst case ε_A + ε_T, and the accuracy test alone costs ε_A = "
                    f"{test_epsilon:.6g} (pure) at target_excess_risk {alpha:g}, failure_probability "
                    f"{p.failure_probability:g}, {p.levels} levels and n = {n}: feasible range epsilon_max > "
                    f"{test_epsilon:.6g} (or raise target_excess_risk or failure_probability, or use fewer "
                    "levels, to lower ε_A)"
                )
                raise ParamsError("epsilon_max", reason)
            if eps_max > MAX_EPSILON:
                reason = (
                    f"leaves a top level ε_T = epsilon_max − ε_A = {eps_max:.6g} above {MAX_EPSILON:g}; "
                    f"feasible range: epsilon_max ≤ {test_epsilon + MAX_EPSILON:.6g}"
                )
                raise ParamsError("epsilon_max", reason)
        if eps_max is None:
            eps_max = 4.0 * theory_epsilon(self.task, n, dim, lam, alpha)
            if eps_max > MAX_EPSILON:
                reason = f"the default 4× theory ε is {eps_max:.4g} > {MAX_EPSILON:g}: set epsilon_max"
                raise ParamsError("epsilon_max", reason)
        # default min(1/n, ε_T/1000): 1/n as the paper's App. B.1, and still a valid grid for a tiny ε_T;
        # never below the smallest ε an exact grid release supports (``smallest_level_epsilon``)
        eps_min = p.epsilon_min
        if eps_min is None:
            eps_min = max(min(1.0 / n, eps_max / 1000.0), smallest_level_epsilon(self.task, dim))
        if p.levels > 1 and eps_min >= eps_max:
            raise ParamsError("epsilon_min", f"must be < the top level ε_T ({eps_max:.6g})")
        try:
            grid = geometric_grid(eps_min, eps_max, p.levels)
        except ValueError as error:
            raise ParamsError("levels", str(error)) from None
        try:  # the discrete noise reduction refuses scales beyond 2^41 grid units (Δ_g ≥ d, so ε_1 ≳ d·2^−41)
            laplace_nr_rates(float(problem.plan(float(grid[0])).units), [float(e) for e in grid])
        except ValueError as error:
            field = "epsilon_max" if p.epsilon_min is None else "epsilon_min"
            raise ParamsError(field, f"too small for an exact grid release: {error}") from None
        return problem, grid

    def check(self, p: AccuracyFirstParams, ctx: PublicContext) -> None:
        self.problem(p, ctx)

    def cost_floor(self, p: AccuracyFirstParams, ctx: PublicContext) -> float:
        """The smallest epsilon_max ``check`` can accept: a little above the test's ε_A (public), so that a
        refusal's affordable search starts inside the feasible range."""
        dim = dimension(p, ctx)
        n = ctx.n_rows if ctx.n_rows is not None else 2
        problem = Problem(
            self.task, n, dim, p.regularization, p.target_excess_risk, p.failure_probability, p.calibration
        )
        test_epsilon = problem.test(p.levels).epsilon_a
        return float(test_epsilon + max(1e-6, 1e-9 * test_epsilon))

    def worst_case(self, p: AccuracyFirstParams, ctx: PublicContext) -> RdpCurve:
        problem, grid = self.problem(p, ctx)
        return _charge(problem, grid, len(grid), ctx.orders)

    def run(
        self,
        p: AccuracyFirstParams,
        ctx: PublicContext,
        table: Table,
        noise: Noise,
        progress: ProgressFn = no_progress,
    ) -> Release:
        problem, grid = self.problem(p, ctx)
        worst = _charge(problem, grid, len(grid), ctx.orders)
        x, y = design_matrix(p, ctx, table, LEARNING_TASK[self.task])
        if self.task == "ridge":
            x = clip_l1(x)
        if x.shape[0] != problem.n:
            raise RuntimeError("the table does not have the public row count")
        result = accuracy_first(problem, make_data(self.task, x, y), grid, noise, progress)
        realized = _charge(problem, grid, result.level, ctx.orders)
        assert realized <= worst
        progress(1.0)
        output = {
            "columns": column_names(p, ctx),
            "coefficients": [float(v) for v in result.theta],
            "level": result.level - 1,  # 0-based, as every accuracy-first release (0: the most private ε_1)
            "levels": len(grid),
            "target_reached": result.reached,
            "epsilon_level": result.epsilon_level,
            "epsilon_test": result.epsilon_test,
            "epsilon": realized.pure,
            "calibration": problem.calibration,
            "norm_bound": radius(self.task, problem.lam),
            "granularity": result.granularity,
            "grid_exponent": math.frexp(result.granularity)[1] - 1,
            "noise": {
                "distribution": "discrete_laplace_noise_reduction",
                "statistic_granularity": result.statistic_granularity,
            },
        }
        return Release(output=output, realized=realized)


def _charge(problem: Problem, grid: np.ndarray, level: int, orders: Sequence[float]) -> RdpCurve:
    """ε_A + ε_level (1-based level) as a pure curve (Lemma 2.8 with Theorem 2.7; docs/privacy.md §8.2.3)."""
    epsilon_a = problem.test(len(grid)).epsilon_a
    return iat_charge(epsilon_a, [float(e) for e in grid], level - 1, orders)


def clip_l1(x: np.ndarray) -> np.ndarray:
    """Scale each row down to ‖x‖₁ ≤ 1 (per-row, from no data but the row: neighbours stay neighbours)."""
    norms = np.abs(x).sum(axis=1)
    scale = np.minimum(1.0, 1.0 / np.maximum(norms, np.finfo(float).tiny))
    clipped: np.ndarray = x * scale[:, None] * (1.0 - 1e-15)
    return clipped


class AccuracyFirstRidge(AccuracyFirstErm, task="ridge"):
    name: ClassVar[str] = "accuracy_first.ridge"
    summary: ClassVar[str] = (
        "Ridge regression with a target excess risk: covariance perturbation + noise reduction, checked by "
        "InteractiveAboveThreshold (Ligett et al. Alg. 3); pure ex-post ε_A + ε_t."
    )


class AccuracyFirstLogistic(AccuracyFirstErm, task="logistic"):
    name: ClassVar[str] = "accuracy_first.logistic"
    summary: ClassVar[str] = (
        "Logistic regression with a target excess risk: output perturbation + noise reduction, checked by "
        "InteractiveAboveThreshold (Ligett et al. Alg. 5, corrected); pure ex-post ε_A + ε_t."
    )
