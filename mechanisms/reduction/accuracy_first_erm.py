"""Accuracy-first ERM: the most private ridge / logistic model whose excess empirical risk is ≤ α.

Ligett, Neel, Roth, Waggoner, Wu, "Accuracy First: Selecting a Differential Privacy Level for
Accuracy-Constrained ERM" (NeurIPS 2017; cited "the paper"). Documentation:
docs/mechanisms/accuracy_first_erm.md; soundness argument, errata and their corrections:
docs/privacy/accuracy_first_erm.md#accuracy-first-erm.

Objective (the paper's §3, eq. (3.1)): L(θ, D) = (1/n) Σ_i ℓ(θ, x_i, y_i) + (λ/2)‖θ‖², with θ* = argmin L
(secret).

``ridge`` (CovNR, Algorithm 3 / Theorem 3.2)
    ℓ = ½(y − θᵀx)². Rows need ‖x‖₁ ≤ 1 and |y| ≤ 1. The statistic S(D) = (XᵀX, Xᵀy) ∈ R^{p²+p} has joint
    ℓ1 sensitivity 4 under replace-one (Lemma A.6: 2 for each part, ‖xxᵀ‖₁ = ‖x‖₁²). Noise reduction runs on
    S with per-entry coins (one chain on the concatenation has the law of the paper's two chains at ε_t/2
    with Δ = 2 each: per-entry noise Lap(4/ε_t)). θ^t is the exact minimiser of (3.1) over the ball
    ‖θ‖₂ ≤ M = 1/√λ (a trust-region subproblem, Moré & Sorensen 1983). Query sensitivity Δ_q = (M+1)²/n (Claim
    A.5).
``logistic`` (OutputNR, Algorithm 5 / Theorem 3.4 **with two errata**,
docs/privacy/accuracy_first_erm.md#accuracy-first-erm-proof)
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
``reference_code``  the authors' code (with the paper's Δ_q;
docs/privacy/accuracy_first_erm.md#accuracy-first-erm-calibration):
                    b = α/(4·ln(1.5^{3/4}√T/γ)), threshold noise Lap(b), query noise Lap(2b), accept iff
                    excess ≤ s + noise with s = α/4 + (3/4)·b·ln 1.5 − ½·b·ln T; ε_A = 2Δ_q/b. Its
                    worst-case failure rate is 0.0152 at T = 1000, γ = 0.1
                    (docs/privacy/accuracy_first_erm.md#accuracy-first-erm-calibration), not a
                    theorem for every (T, γ).
``exact_bound``     ours: W = −α/2 and the smallest ε_A whose *exact* failure probability is ≤ γ (the event
                    Theorem A.1 union-bounds is {max_t ν_t − ρ > W + α}; its probability is a 1-D integral,
                    ``iat_failure_probability``). Proven, and about 2.3× cheaper than paper_theorem.

Baselines (library functions, for the benchmark): ``doubling`` (Algorithm 4 / Theorem A.2, charged by
pure composition ℰ(k) = k·ε_test + (2^k − 1)ε_1) and ``theory_epsilon`` (ε from the inverted utility
theorems, e.g. Theorem 3.2's E[excess] bound).

Numerical exactness (docs/privacy/accuracy_first_erm.md#accuracy-first-erm-exactness): θ* comes from a solver
whose result carries a certificate from strong convexity, ‖∇L(θ̂)‖ ≤ g_tol ⇒ ‖θ̂ − θ*‖ ≤ g_tol/λ and L(θ̂) −
L(θ*) ≤ g_tol²/(2λ); the sensitivities used are inflated by a public relative slack (``SLACK``) that covers
these and float rounding by orders of magnitude. A solver that cannot certify raises (the service then commits
the worst case).

Finite precision (docs/privacy/finite_precision.md#finite-precision): every draw is exact and integer, through
``Noise`` (OS CSPRNG in the service). The statistic is rounded (exactly, half-up) to a public grid γ_S = 2^k
chosen from Δ_S, its dimension, ε_1 and a public magnitude bound (``statistic_plan``); its ℓ1 sensitivity in
grid units is the integer Δ_g = ⌊Δ_S/γ_S + d/64⌋ + d (each coordinate's rounded value moves by ≤ |change|/γ_S
+ 1; Δ_S already covers the float error of the computed statistic, d/64 is a further per-coordinate float
allowance), and discrete Laplace noise reduction (``LazyLaplaceNR``, pure Δ_g·x_t ≤ ε_t per level) releases
γ_S·(U + η_t). The models θ^t are post-processing of those grid vectors, and the released coefficients are
truncated toward zero onto a public model grid (``coefficient_grid``: γ_S for logistic, where θ^t is the noisy
statistic itself; 2^⌊log2 M⌋−40 for ridge), so every released number is a multiple of the published
granularity. The test is the grid InteractiveAboveThreshold (``mechanisms.threshold.interactive``; only
the level is released). Charges are unchanged (pure ε_A + ε_t). Timing is not claimed (rejection samplers run
variable time).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, ClassVar, Self

import numpy as np
from pydantic import BaseModel, Field, StrictFloat, StrictInt, model_validator

from mechanisms.accounting import RdpCurve, pad_up, sum_up
from mechanisms.base import ParamsChecked, ParamsError, ProgressFn, PublicContext, Release, Table, no_progress
from mechanisms.learners.features import FeatureSpec, check_features, column_names, design_matrix, dimension
from mechanisms.noise import Grid, Noise, dyadic_scale_up, laplace_grid
from mechanisms.queries.language import charged_fraction, unit_shift
from mechanisms.reduction.erm_calibration import (
    CHUNK,
    LEARNING_TASK,
    MAX_DIMENSION,
    MAX_EPSILON,
    MAX_LEVELS,
    MAX_ROWS,
    MAX_WORST_CASE,
    MIN_EPSILON,
    Calibration,
    StatisticPlan,
    Task,
    coefficient_grid,
    doubling_test,
    geometric_grid,
    iat_calibration,
    query_sensitivity,
    radius,
    smallest_level_epsilon,
    snap,
    statistic_plan,
    statistic_sensitivity,
    theory_epsilon,
)
from mechanisms.reduction.erm_solvers import (
    ErmData,
    LogisticData,
    RidgeData,
    hypotheses,
)
from mechanisms.reduction.noise_reduction import LazyLaplaceNR, laplace_nr_rates
from mechanisms.threshold.interactive import (
    IatCalibration,
    InteractiveAboveThreshold,
    iat_charge,
)


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
    """ε_A + ε_level (1-based level) as a pure curve (Lemma 2.8 with Theorem 2.7;
    docs/privacy/accuracy_first_erm.md#accuracy-first-erm-proof)."""
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
