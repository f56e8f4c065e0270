"""Accuracy-first ERM, the public side: constants, sensitivities, grids and the test's calibrations.

Every value here is a function of public parameters only (n, p, λ, the ε-grid, α, γ): what the worst case,
the charges and the grids of ``mechanisms.reduction.accuracy_first_erm`` are computed from. The theorems and
their conditions are in that module's docstring.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal

import numpy as np
from scipy import integrate, optimize

from mechanisms.accounting import pad_up
from mechanisms.learners.features import Task as LearningTask
from mechanisms.noise import Grid, laplace_grid
from mechanisms.threshold.above_threshold import ThresholdGrid
from mechanisms.threshold.interactive import IatCalibration, iat_paper_calibration, iat_reference_calibration

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


# ----- the public grids (docs/privacy/finite_precision.md#finite-precision) ---------------------------------
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


# ----- the test: InteractiveAboveThreshold (Algorithm 2; mechanisms.threshold.interactive) -----------------
def iat_calibration(
    calibration: Calibration, delta_q: float, alpha: float, gamma: float, levels: int
) -> IatCalibration:
    """ε_A and the threshold W on f = L(θ*) − L(θ) (target f ≥ −α, i.e. excess ≤ α).

    paper_theorem: ε_A = 16Δ_q ln(2T/γ)/α and W = −α/2 (Theorem 3.2 / 3.4, Alg. 5 erratum: −α/2);
    reference_code: the authors' code, docs/privacy/accuracy_first_erm.md#accuracy-first-erm-calibration (W =
    −s). Both are pure ε_A-DP (Lemma 2.8).
    """
    if calibration == "exact_bound":
        return iat_exact_calibration(delta_q, alpha, gamma, levels)
    calibrate = iat_paper_calibration if calibration == "paper_theorem" else iat_reference_calibration
    return calibrate(delta_q, alpha, gamma, levels, target=-alpha)


# The exact-bound calibration (ours; an adapter on top of mechanisms.threshold.interactive). Theorem A.1
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
    (exact; docs/privacy/accuracy_first_erm.md#accuracy-first-erm-calibration)."""
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
