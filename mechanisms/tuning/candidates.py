"""Base learners as tuning candidates: each is a DP mechanism (training + private score) with its own ε.

A candidate of ``tuning.select`` is (learner, hyperparameters, ε). As a mechanism of the whole dataset it

1. splits the rows by a data-independent random permutation into a training part (n − m rows) and a
   held-out part (m = ⌊h·n⌋ rows; n is public under ``replace_one``),
2. trains on the training part with a DP guarantee of level ε,
3. scores the model on the held-out part with noise of level ε (accuracy for classification, sensitivity
   1/m; −MSE with predictions clipped to [−1, 1] for regression, per-row squared error ≤ 4, sensitivity 4/m),

and releases (model, noisy score). **Why the candidate is ε-DP (pure) or (α, ε)-RDP although both parts
use ε:** fix the permutation π (data-independent, shared by all candidates of a request, never released).
Under replace-one the replaced row lies in exactly one part; the other part's computation is identically
distributed (or a post-processing of the private part with independent noise), so M_i^π's divergence is
that of one part, for every π: the curve is max(train, score) pointwise. Theorems 11/13 then hold
conditionally on π with the same charges, and the ex-post inequalities survive the data-independent mixture
over π (pure: linear; RDP: (p, q) ↦ p^α q^{1−α} is jointly convex). Details:
docs/privacy/tuning.md#tuning-candidates.

There is no notion of a public validation set in the dataset model, so every score is a noisy score on a
held-out split (a variant scoring on public validation data is not implemented).

Learners
--------
``output_perturbation.logistic`` / ``output_perturbation.ridge`` (pure ε-DP; valid in both modes)
    θ* = argmin (1/n_t)Σ ℓ(θ; x_i, y_i) + (λ/2)‖θ‖² on the training part, rows ‖x_i‖ ≤ 1. The loss is
    L-Lipschitz on the set where both neighbours' minimisers lie: L = 1 (logistic); squared loss
    ½(xᵀθ − y)² with |y| ≤ 1 has ‖θ*‖ ≤ 1/√λ (F(θ*) ≤ F(0) ≤ ½), so L = 1 + 1/√λ. The ℓ2 sensitivity of
    the exact minimiser is 2L/(n_t λ) (Chaudhuri, Monteleoni, Sarwate 2011, Corollary 8, replace-one). The
    solver (ridge: a linear solve; logistic: damped Newton) must end with ‖∇F(θ̂)‖ ≤ g = 0.01·L/n_t, so
    ‖θ̂ − θ*‖ ≤ g/λ by λ-strong convexity, and Δ₂(θ̂) ≤ 2(L/n_t + g)/λ; if it does not, the candidate raises
    (the service then charges the worst case). θ̂ is released on a public grid γ = 2^k ≤ 2^{−10}·Δ₁/d
    (Δ₁ = √d·Δ₂ rounded up) with discrete Laplace noise of scale t ≥ (Δ₁/γ + d)/ε grid units (Lemma GRID
    and Theorem DLAP of docs/privacy/finite_precision.md#theorem-dlap): ε-DP. The minimiser is noise-free and
    depends on λ only, so ``prepare`` solves it once per λ **before** the latent is drawn; each candidate then
    only adds its noise and scores (padding costs almost nothing).

Held-out scores (every learner) are integer statistics with integer noise: the number of correct signs
(classification; sensitivity 1, no rounding), or the correctly rounded sum S of clipped squared errors on a
grid γ ≤ 2^{−10}·Δ_S (regression; Δ_S = 4 + m·2^{−50} covers fsum's rounding, grid sensitivity Δ_S/γ + 1).
Pure learners add discrete Laplace noise of scale ≥ sensitivity/ε; RDP learners a discrete Gaussian whose
α*·Δ²/(2σ²) ≤ ε (Canonne, Kamath, Steinke 2020), and the candidate's curve uses that very (Δ, σ). The
released score (count/m, or −γ·units/m) is a deterministic post-processing of the noisy integer.

``dp_gd.logistic`` / ``dp_gd.ridge`` (RDP only; refused in pure mode)
    Clipped full-batch Gaussian gradient descent (``mechanisms.learners.dp_gd``): T steps at noise multiplier
    z are (α, Tα/(2z²))-RDP. The drop parameter c = ε is matched at the **calibration order** α*: z is the
    smallest value with ``dp_gd_curve(...)(α*) ≤ ε``, and the score's discrete Gaussian σ = Δ·√(α*/(2ε))
    (slightly raised). Both curves are linear in α, so the candidate is (α, ≤ ε)-RDP exactly for α ≤ α*; at
    higher orders its RDP exceeds its drop parameter and the tuning charge is +∞ there.

``objpert.logistic`` (RDP only; refused in pure mode)
    Objective perturbation with output noise (``mechanisms.learners.objective_perturbation``, its
    replace-one curve: Thm 4.3.2 with L → 2L plus the AMP term), σ chosen by bisection as the smallest
    value whose curve at α* is ≤ ε (refused if −log(1 − β/λ) + AMP alone exceeds ε). ``regularization`` is
    the sum-scale λ > 1/4.
    Its curve is not linear in α, so validity is checked order by order (``rdp_charges``' mask).
    The solver tolerance is τ = max(1e-6, 2 × ``minimum_tolerance``) at the public bounds (n̄ = the public
    training-row count, R = 1, the public dimension d): the stand-alone mechanism's failure-channel guard,
    so the certified stop is reachable on every dataset. ``objpert_candidate_config`` computes it from
    public values only, and both ``curve`` and ``fit_and_score`` use its result (same τ, same σ_out).

Further learners (RGM, …) plug in by implementing ``BaseLearner`` (``curve`` for the guarantee from public
parameters, ``prepare`` for noise-free work shared by candidates, ``fit_and_score`` for the model and its
noisy score) and adding themselves to ``LEARNERS``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction
from functools import lru_cache
from typing import Any, ClassVar, Literal, Protocol

import numpy as np

from mechanisms.accounting import RdpCurve
from mechanisms.base import ProgressFn, no_progress
from mechanisms.learners.dp_gd import DpGdConfig, dp_gd_curve, dp_gd_train
from mechanisms.learners.features import Task
from mechanisms.learners.objective_perturbation import (
    ObjPertConfig,
    fit_objpert,
    minimum_tolerance,
    objpert_curve,
)
from mechanisms.noise import (
    Grid,
    Noise,
    dyadic_scale_up,
    gaussian_grid,
    grid_l1_sensitivity,
    grid_l2_sensitivity,
    laplace_grid,
    laplace_on_grid,
)
from mechanisms.noise.tuning import discrete_laplace_rows

LearnerName = Literal[
    "output_perturbation.logistic",
    "output_perturbation.ridge",
    "dp_gd.logistic",
    "dp_gd.ridge",
    "objpert.logistic",
]

SOLVER_TOLERANCE = 0.01
"""The solver must reach ‖∇F‖ ≤ SOLVER_TOLERANCE·L/n_t; this adds 1% to the output-perturbation Δ₂."""
NEWTON_CAP = 100
"""Newton iterations of the logistic ERM solver before it gives up (measured need: ≤ 14 evaluations)."""


@dataclass(frozen=True)
class PublicShape:
    """Public sizes of a request's data: training rows n_t, held-out rows m, design-matrix columns d."""

    n_train: int
    n_hold: int
    d: int


@dataclass(frozen=True)
class CandidateConfig:
    """One list entry (public): the learner's hyperparameters and the candidate's ε (its drop parameter)."""

    epsilon: float
    reg: float
    steps: int = 0
    step_size: float = 0.0
    clip: float = 0.0

    def as_dict(self, learner: str) -> dict[str, Any]:
        out: dict[str, Any] = {"learner": learner, "epsilon": self.epsilon, "regularization": self.reg}
        if learner.startswith("dp_gd"):
            out.update(steps=self.steps, step_size=self.step_size, clip=self.clip)
        return out


def score_sensitivity(task: Task, m: int) -> float:
    """ℓ1 = ℓ2 sensitivity of the held-out utility under replace-one: 1/m (accuracy) or 4/m (−MSE)."""
    return (1.0 if task == "classification" else 4.0) / m


def utility(theta: np.ndarray, x: np.ndarray, y: np.ndarray, task: Task) -> float:
    """Non-private held-out utility: accuracy, or −mean((clip(xᵀθ, ±1) − y)²) (each term ≤ 4)."""
    margin = x @ theta
    if task == "classification":
        return float(np.mean(np.where(margin >= 0.0, 1.0, -1.0) == y))
    residual = np.clip(margin, -1.0, 1.0) - y
    return -float(np.mean(residual * residual))


# ----- the held-out score on a public grid -----------------------------------------------------------------
def _sum_sensitivity(m: int) -> float:
    """ℓ1 = ℓ2 sensitivity of the float sum of squared errors S = fsum(r_i²), r_i = clip(xᵀθ, ±1) − y.

    Each r_i² ∈ [0, 4] is a function of one row (and the released θ), so the exact sums differ by ≤ 4;
    ``math.fsum`` is correctly rounded (|fl(S) − S| ≤ 2^{−53}·4m), so |fl(S) − fl(S′)| ≤ 4 + m·2^{−50}.
    """
    return math.nextafter(4.0 + m * 2.0**-50, math.inf)


def score_units(theta: np.ndarray, x: np.ndarray, y: np.ndarray, task: Task, grid: Grid) -> int:
    """The held-out utility's integer statistic: the number of correct signs (classification, γ = 1), or
    round(S/γ) for the sum S of clipped squared errors (regression). Sensitivity: 1, or ⌈Δ_S/γ⌉."""
    return int(score_units_batch(theta[np.newaxis, :], x, y, task, grid)[0])


def score_units_batch(thetas: np.ndarray, x: np.ndarray, y: np.ndarray, task: Task, grid: Grid) -> np.ndarray:
    """``score_units`` of every row of ``thetas`` (one matrix product). Entry (i, k) of the product depends
    on row i and θ_k only, so each statistic keeps its one-row sensitivity."""
    margins = x @ thetas.T
    if task == "classification":
        correct = np.where(margins >= 0.0, 1.0, -1.0) == y[:, np.newaxis]
        counts: np.ndarray = np.count_nonzero(correct, axis=0).astype(np.int64)
        return counts
    residual = np.clip(margins, -1.0, 1.0) - y[:, np.newaxis]
    totals = [math.fsum(column) for column in (residual * residual).T.tolist()]
    units: np.ndarray = grid.to_units(np.array(totals))
    return units


def score_from_units(units: int, task: Task, grid: Grid, m: int) -> float:
    """Accuracy (count/m) or −MSE (−γ·units/m): a deterministic post-processing of the noisy integer."""
    if task == "classification":
        return units / m
    return -float(grid.from_units(np.array([units]))[0]) / m


@dataclass(frozen=True)
class ScoreNoise:
    """The public noise plan of a held-out score: its grid, its sensitivity in grid units, and the noise
    (discrete Laplace scale or discrete Gaussian σ, in grid units)."""

    grid: Grid
    sensitivity: float
    laplace_scale: Fraction | None = None
    sigma: float | None = None

    def describe(self, m: int) -> dict[str, Any]:
        """Public description in the score's own units (÷ m, × γ): what ``noise_sd`` reads."""
        unit = self.grid.granularity / m
        if self.laplace_scale is not None:
            return {
                "distribution": "laplace",
                "scale": float(self.laplace_scale) * unit,
                "discrete": True,
                "granularity": unit,
            }
        assert self.sigma is not None
        return {"distribution": "gaussian", "sigma": self.sigma * unit, "discrete": True, "granularity": unit}


def _score_grid(task: Task, m: int, gaussian: bool) -> tuple[Grid, float]:
    """(grid, sensitivity in grid units): γ = 1 and 1 for the correct count; for the squared-error sum a
    grid γ ≤ 2^{−10}·Δ_S and Δ_S/γ + 1 (Lemma GRID, docs/privacy/finite_precision.md#lemma-grid)."""
    if task == "classification":
        return Grid(0), 1.0
    delta = _sum_sensitivity(m)
    if gaussian:
        grid = gaussian_grid(delta, 1, False)
        return grid, grid_l2_sensitivity(delta, 1, grid, False)
    grid = laplace_grid(delta, 1, False)
    return grid, grid_l1_sensitivity(delta, 1, grid, False)


@lru_cache(maxsize=4096)
def laplace_score_noise(task: Task, m: int, epsilon: float) -> ScoreNoise:
    """Discrete Laplace of scale t ≥ Δ/ε (grid units, a dyadic rational rounded up): ε-DP (pure)."""
    grid, sens = _score_grid(task, m, gaussian=False)
    return ScoreNoise(grid, sens, laplace_scale=dyadic_scale_up(Fraction(sens) / Fraction(epsilon)))


@lru_cache(maxsize=4096)
def gaussian_score_noise(task: Task, m: int, epsilon: float, order: float) -> ScoreNoise:
    """Discrete Gaussian with σ such that α*·Δ²/(2σ²) ≤ ε at the calibration order (grid units)."""
    grid, sens = _score_grid(task, m, gaussian=True)
    return ScoreNoise(grid, sens, sigma=_gaussian_sigma(sens, epsilon, order, (order,)))


def noisy_score(
    theta: np.ndarray, split: Split, task: Task, plan: ScoreNoise, noise: Noise, drawn: int | None = None
) -> float:
    """The held-out utility released through integer noise on its grid (then divided by m); ``drawn`` is
    that noise when it was pre-drawn (``predraw``)."""
    m = split.x_hold.shape[0]
    units = score_units(theta, split.x_hold, split.y_hold, task, plan.grid)
    if drawn is not None:
        z = drawn
    elif plan.laplace_scale is not None:
        z = int(noise.discrete_laplace(plan.laplace_scale, 1)[0])
    else:
        assert plan.sigma is not None
        z = int(noise.discrete_gaussian(Fraction(plan.sigma) ** 2, 1)[0])
    return score_from_units(units + z, task, plan.grid, m)


class BaseLearner(Protocol):
    """A candidate's training algorithm and its privacy guarantee (for the whole candidate)."""

    name: ClassVar[str]
    task: ClassVar[Task]
    has_pure_guarantee: ClassVar[bool]

    def curve(
        self, config: CandidateConfig, orders: tuple[float, ...], order: float | None, shape: PublicShape
    ) -> RdpCurve:
        """The candidate's RDP curve (training and score), from public parameters only."""
        ...

    def prepare(
        self, configs: list[CandidateConfig], split: Split, progress: ProgressFn = no_progress
    ) -> None:
        """Noise-free work shared by candidates (e.g. ERM minimisers), done before the latent is drawn."""
        ...

    def predraw(self, candidates: list[CandidateConfig], split: Split, noise: Noise) -> None:
        """Optionally compute every entry's output in one batch before the latent (``Split.predrawn``)."""
        ...

    def fit_and_score(
        self,
        config: CandidateConfig,
        split: Split,
        order: float | None,
        noise: Noise,
        progress: ProgressFn = no_progress,
    ) -> tuple[np.ndarray, float, dict[str, Any]]:
        """(noisy model θ, noisy held-out utility, public description of the score noise)."""
        ...


@dataclass(frozen=True)
class Split:
    """The training and held-out parts (SECRET data; their sizes are public).

    ``solutions`` caches deterministic, noise-free intermediate results (the ERM minimiser per λ) shared by
    candidates of one request: reusing θ* and adding fresh noise has the same law as recomputing it.
    """

    x_train: np.ndarray
    y_train: np.ndarray
    x_hold: np.ndarray
    y_hold: np.ndarray
    solutions: dict[tuple[str, float], np.ndarray] = field(default_factory=dict, compare=False, repr=False)
    predrawn: dict[CandidateConfig, list[tuple[np.ndarray, float, dict[str, Any]]]] = field(
        default_factory=dict, compare=False, repr=False
    )
    """Every entry's (noisy model, noisy score, score noise), computed in one batch (``predraw``) with
    fresh noise per entry and consumed once each: i.i.d. given the data and independent of the latent, so
    the same law as computing each in its candidate (and the same work whatever the latent: all are done)."""


def split_rows(x: np.ndarray, y: np.ndarray, holdout: int, noise: Noise) -> Split:
    """A data-independent random split: the first ``holdout`` positions of a uniform permutation
    (``Noise.permutation``; the proof needs only that π is independent of the data,
    docs/privacy/tuning.md#tuning-candidates)."""
    perm = noise.permutation(x.shape[0])
    hold, train = perm[:holdout], perm[holdout:]
    return Split(x[train], y[train], x[hold], y[hold])


# ----- output perturbation (pure) -------------------------------------------------------------------------
def _logistic_grad_hess(
    theta: np.ndarray, x: np.ndarray, y: np.ndarray, reg: float
) -> tuple[np.ndarray, np.ndarray]:
    margin = y * (x @ theta)
    s = np.exp(-np.logaddexp(0.0, margin))  # sigmoid(−m)
    n = x.shape[0]
    grad: np.ndarray = -(x.T @ (y * s)) / n + reg * theta
    weights = s * (1.0 - s)
    hess: np.ndarray = (x.T * weights) @ x / n + reg * np.eye(x.shape[1])
    return grad, hess


def _logistic_objective(theta: np.ndarray, x: np.ndarray, y: np.ndarray, reg: float) -> float:
    return float(np.mean(np.logaddexp(0.0, -y * (x @ theta)))) + 0.5 * reg * float(theta @ theta)


def solve_erm(
    x: np.ndarray,
    y: np.ndarray,
    reg: float,
    task: Task,
    tolerance: float,
    progress: ProgressFn = no_progress,
) -> np.ndarray:
    """The regularised ERM minimiser to gradient norm ≤ ``tolerance`` (raises RuntimeError otherwise).

    The check is on the float64 gradient, not a certified bound (unlike ``objective_perturbation``): the
    worst-case rounding error of the logistic gradient (≈ n_t·u) is ≥ 90× below the target 0.01/n_t for
    n_t ≤ 10⁶, but not near n_t ≈ 10⁷ (a certified check is future work). ``progress`` is a heartbeat
    (called with 0.0 once per Newton iteration; the service throttles it to one write a second). Failure is
    argued, not proven, data-independent: on the hardest measured inputs (separable, λ = 1e-6) the logistic
    solver needs 12–14 gradient/Hessian evaluations against a cap of ``NEWTON_CAP`` = 100
    (docs/privacy/tuning.md#tuning-candidates).
    """
    n, d = x.shape
    if task == "regression":
        # ∇F = (XᵀX/n + λI)θ − Xᵀy/n for F = (1/n)Σ ½(xᵀθ − y)² + (λ/2)‖θ‖².
        a = x.T @ x / n + reg * np.eye(d)
        b = x.T @ y / n
        theta = np.linalg.solve(a, b)
        for _ in range(3):  # iterative refinement
            if np.linalg.norm(a @ theta - b) <= tolerance:
                break
            theta = theta + np.linalg.solve(a, b - a @ theta)
        grad = a @ theta - b
    else:
        theta = np.zeros(d)
        for _ in range(NEWTON_CAP):
            progress(0.0)
            grad, hess = _logistic_grad_hess(theta, x, y, reg)
            if np.linalg.norm(grad) <= tolerance:
                break
            direction = np.linalg.solve(hess, grad)
            step, current = 1.0, _logistic_objective(theta, x, y, reg)
            while step > 1e-10 and _logistic_objective(theta - step * direction, x, y, reg) > current:
                step *= 0.5
            theta = theta - step * direction
        grad, _ = _logistic_grad_hess(theta, x, y, reg)
    if not (np.all(np.isfinite(theta)) and float(np.linalg.norm(grad)) <= tolerance):
        raise RuntimeError("the ERM solver did not reach its gradient tolerance")
    return np.asarray(theta, dtype=float)


def lipschitz(task: Task, reg: float) -> float:
    """L of the per-row loss on the ball holding both minimisers: 1 (logistic), 1 + 1/√λ (squared)."""
    return 1.0 if task == "classification" else 1.0 + 1.0 / math.sqrt(reg)


def output_perturbation_l2(task: Task, reg: float, n_train: int) -> float:
    """Δ₂(θ̂) ≤ 2(L/n_t + g)/λ with g = SOLVER_TOLERANCE·L/n_t (rounded up)."""
    lip = lipschitz(task, reg)
    value = 2.0 * (lip / n_train) * (1.0 + SOLVER_TOLERANCE) / reg
    return math.nextafter(value * (1.0 + 1e-12), math.inf)


@lru_cache(maxsize=4096)
def output_perturbation_noise(
    task: Task, reg: float, n_train: int, d: int, epsilon: float
) -> tuple[Grid, Fraction]:
    """(grid γ, discrete Laplace scale t in grid units) for θ̂: Δ₁ ≤ √d·Δ₂ (rounded up), γ ≤ 2^{−10}·Δ₁/d,
    grid sensitivity Δ₁/γ + d (Lemma GRID), t ≥ that/ε (dyadic, rounded up): ε-DP (pure)."""
    delta2 = output_perturbation_l2(task, reg, n_train)
    delta1 = math.nextafter(math.sqrt(d) * delta2 * (1.0 + 2.0**-50), math.inf)
    grid = laplace_grid(delta1, d, False)
    sens = grid_l1_sensitivity(delta1, d, grid, False)
    return grid, dyadic_scale_up(Fraction(sens) / Fraction(epsilon))


class OutputPerturbation:
    """Regularised ERM + discrete Laplace output perturbation on a grid; discrete-Laplace score. Pure ε-DP."""

    has_pure_guarantee: ClassVar[bool] = True

    def __init__(self, name: str, task: Task) -> None:
        self.name = name
        self.task = task

    def curve(
        self, config: CandidateConfig, orders: tuple[float, ...], order: float | None, shape: PublicShape
    ) -> RdpCurve:
        # ε-DP (both parts are ε-DP; max rule) ⇒ (α, ε)-RDP at every α (Ghazi et al. Lemma 7(i)).
        return RdpCurve.from_pure(config.epsilon, orders)

    def _solution(self, reg: float, split: Split, progress: ProgressFn = no_progress) -> np.ndarray:
        key = (self.task, reg)
        if key not in split.solutions:
            tolerance = SOLVER_TOLERANCE * lipschitz(self.task, reg) / split.x_train.shape[0]
            split.solutions[key] = solve_erm(
                split.x_train, split.y_train, reg, self.task, tolerance, progress
            )
        return split.solutions[key]

    def prepare(
        self, configs: list[CandidateConfig], split: Split, progress: ProgressFn = no_progress
    ) -> None:
        """Solve the ERM once per distinct λ of the list (noise-free; before the latent is drawn)."""
        for reg in sorted({config.reg for config in configs}):
            self._solution(reg, split, progress)

    def fit_and_score(
        self,
        config: CandidateConfig,
        split: Split,
        order: float | None,
        noise: Noise,
        progress: ProgressFn = no_progress,
    ) -> tuple[np.ndarray, float, dict[str, Any]]:
        pool = split.predrawn.get(config)
        if pool:  # this entry's output, computed in the batch
            noisy_theta, score, description = pool.pop()
            return noisy_theta, score, dict(description)
        n_train, d = split.x_train.shape
        theta = self._solution(config.reg, split, progress)
        grid, scale = output_perturbation_noise(self.task, config.reg, n_train, d, config.epsilon)
        plan = laplace_score_noise(self.task, split.x_hold.shape[0], config.epsilon)
        noisy_theta = laplace_on_grid(noise, theta, grid, scale)
        score = noisy_score(noisy_theta, split, self.task, plan, noise)
        return noisy_theta, score, plan.describe(split.x_hold.shape[0])

    def predraw(self, candidates: list[CandidateConfig], split: Split, noise: Noise) -> None:
        """Every entry's noisy model and noisy score in one vectorised batch, before the latent is drawn:
        the discrete Laplace noise of every entry (θ's d coordinates and the score, one
        ``discrete_laplace_rows``), then one grid rounding per configuration and one matrix product for
        every held-out score."""
        n_train, d = split.x_train.shape
        m = split.x_hold.shape[0]
        configs = list(dict.fromkeys(candidates))  # the distinct configurations, in list order
        slot_of = {config: slot for slot, config in enumerate(configs)}
        slots = np.array([slot_of[config] for config in candidates], dtype=np.intp)
        noise_plans = [output_perturbation_noise(self.task, c.reg, n_train, d, c.epsilon) for c in configs]
        score_plans = [laplace_score_noise(self.task, m, c.epsilon) for c in configs]
        row_scales: list[list[Fraction]] = []
        for (_grid, scale), plan in zip(noise_plans, score_plans, strict=True):
            assert plan.laplace_scale is not None
            row_scales.append([scale] * d + [plan.laplace_scale])
        scales = [t for slot in slots.tolist() for t in row_scales[slot]]
        draws = discrete_laplace_rows(noise, scales).reshape(len(candidates), d + 1)
        thetas = np.empty((len(candidates), d))
        for slot, config in enumerate(configs):
            rows = np.flatnonzero(slots == slot)
            grid = noise_plans[slot][0]
            base = grid.to_units(self._solution(config.reg, split))
            thetas[rows] = grid.from_units(base[np.newaxis, :] + draws[rows, :d])
        score_grid = _score_grid(self.task, m, gaussian=False)[0]  # the same grid for every ε
        units = score_units_batch(thetas, split.x_hold, split.y_hold, self.task, score_grid) + draws[:, d]
        descriptions = [plan.describe(m) for plan in score_plans]
        outputs: list[list[tuple[np.ndarray, float, dict[str, Any]]]] = [[] for _ in configs]
        for index, slot in enumerate(slots.tolist()):
            score = score_from_units(int(units[index]), self.task, score_grid, m)
            outputs[slot].append((thetas[index], score, descriptions[slot]))
        split.predrawn.clear()
        split.predrawn.update(zip(configs, outputs, strict=True))


# ----- DP gradient descent (RDP) -------------------------------------------------------------------------
def _gaussian_sigma(sensitivity: float, epsilon: float, order: float, orders: tuple[float, ...]) -> float:
    """σ with RdpCurve.gaussian(Δ, σ)(α*) ≤ ε: Δ·√(α*/(2ε)), raised until the padded curve agrees."""
    sigma = sensitivity * math.sqrt(order / (2.0 * epsilon)) * (1.0 + 1e-9)
    while RdpCurve.gaussian(sensitivity, sigma, orders).at(order) > epsilon:
        sigma *= 1.0 + 1e-9
    return sigma


def dp_gd_config(task: Task, config: CandidateConfig, order: float, orders: tuple[float, ...]) -> DpGdConfig:
    """The DP-GD configuration whose RDP at the calibration order α* is ≤ ε (z = √(Tα*/(2ε)), raised)."""
    loss: Literal["logistic", "squared"] = "logistic" if task == "classification" else "squared"
    z = math.sqrt(config.steps * order / (2.0 * config.epsilon)) * (1.0 + 1e-9)
    while True:
        gd = DpGdConfig(loss, config.reg, config.steps, config.step_size, config.clip, z, "replace_one")
        if dp_gd_curve(gd, "replace_one", orders).at(order) <= config.epsilon:
            return gd
        z *= 1.0 + 1e-9


class _GaussianScored:
    """An RDP-only candidate calibrated at the order α*: a training run plus a discrete-Gaussian held-out
    score, each with RDP ≤ ε at α*; the candidate's curve is the maximum of the two (they touch disjoint
    rows of the replace-one split). Subclasses give the training run's curve and the run itself."""

    has_pure_guarantee: ClassVar[bool] = False
    kind: ClassVar[str]

    def __init__(self, name: str, task: Task) -> None:
        self.name = name
        self.task = task

    def _train_curve(
        self, config: CandidateConfig, orders: tuple[float, ...], order: float, shape: PublicShape
    ) -> RdpCurve:
        raise NotImplementedError

    def _train(
        self,
        config: CandidateConfig,
        split: Split,
        order: float,
        noise: Noise,
        progress: ProgressFn,
    ) -> np.ndarray:
        raise NotImplementedError

    def curve(
        self, config: CandidateConfig, orders: tuple[float, ...], order: float | None, shape: PublicShape
    ) -> RdpCurve:
        if order is None:
            raise ValueError(f"{self.kind} candidates need a calibration order")
        train = self._train_curve(config, orders, order, shape)
        plan = gaussian_score_noise(self.task, shape.n_hold, config.epsilon, order)
        assert plan.sigma is not None
        score = RdpCurve.gaussian(plan.sensitivity, plan.sigma, orders)  # CKS 2020: integer shifts ≤ Δ
        return train.maximum(score)

    def prepare(
        self, configs: list[CandidateConfig], split: Split, progress: ProgressFn = no_progress
    ) -> None:
        """Nothing to share: every training run draws its own noise."""

    def predraw(self, candidates: list[CandidateConfig], split: Split, noise: Noise) -> None:
        """Nothing pre-drawn: training dominates, and its noise belongs to the training modules."""

    def fit_and_score(
        self,
        config: CandidateConfig,
        split: Split,
        order: float | None,
        noise: Noise,
        progress: ProgressFn = no_progress,
    ) -> tuple[np.ndarray, float, dict[str, Any]]:
        assert order is not None
        theta = np.asarray(self._train(config, split, order, noise, progress), dtype=float)
        m = split.x_hold.shape[0]
        plan = gaussian_score_noise(self.task, m, config.epsilon, order)
        score = noisy_score(theta, split, self.task, plan, noise)
        return theta, score, plan.describe(m)


class DpGd(_GaussianScored):
    """Clipped Gaussian DP-GD on the training part; discrete-Gaussian held-out score. RDP only."""

    kind: ClassVar[str] = "DP-GD"

    def _train_curve(
        self, config: CandidateConfig, orders: tuple[float, ...], order: float, shape: PublicShape
    ) -> RdpCurve:
        return dp_gd_curve(dp_gd_config(self.task, config, order, (order,)), "replace_one", orders)

    def _train(
        self,
        config: CandidateConfig,
        split: Split,
        order: float,
        noise: Noise,
        progress: ProgressFn,
    ) -> np.ndarray:
        gd = dp_gd_config(self.task, config, order, (order,))
        n_train = split.x_train.shape[0]
        return dp_gd_train(gd, split.x_train, split.y_train, float(n_train), noise, progress)


# ----- objective perturbation (RDP) -------------------------------------------------------------------------
@lru_cache(maxsize=4096)
def objpert_sigma(epsilon: float, reg: float, order: float) -> float:
    """A small σ with ``objpert_curve``(α*) ≤ ε (public values only), or ValueError.

    The curve is −log(1−β/λ) + αL²/(2σ²) + log(2Φ((α−1)L/σ))/(α−1) + the AMP term (Redberg, Koskela, Wang
    2023, Thm 4.3.2; docs/privacy/objective_perturbation.md#objpert-rdp-charge), with L → 2L under
    replace_one. It need not be monotone in σ (the grid-safe output noise adds terms that grow with σ), so σ
    is the first point of a 301-point log grid on [1e-6, 1e9] where the curve is ≤ ε, refined by 200 bisection
    steps (in log space) between it and the grid point before; the result always satisfies the inequality (the
    upper end of the bracket does). Any σ that does is valid: the charge is the curve evaluated at the
    configuration that runs (``objpert_candidate_config``).
    """

    def at(sigma: float) -> float:
        config = ObjPertConfig(lam=reg, sigma=sigma, neighboring="replace_one")
        return objpert_curve(config, (order,)).at(order)

    grid = np.geomspace(1e-6, 1e9, 301)
    feasible = [i for i, sigma in enumerate(grid) if at(float(sigma)) <= epsilon]
    if not feasible:
        raise ValueError(
            f"objective perturbation cannot reach RDP ε = {epsilon!r} at order {order!r} with λ = {reg!r}"
        )
    first = feasible[0]
    if first == 0:
        return float(grid[0])
    lo, hi = math.log(float(grid[first - 1])), math.log(float(grid[first]))
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if at(math.exp(mid)) <= epsilon:
            hi = mid
        else:
            lo = mid
    return math.exp(hi)


OBJPERT_TOLERANCE = 1e-6
"""τ of an objpert candidate when the public float-rounding guard allows it (``ObjPertConfig``'s default)."""
OBJPERT_TOLERANCE_MARGIN = 2.0
"""An objpert candidate's τ is at least this multiple of ``minimum_tolerance`` at the public bounds."""


@lru_cache(maxsize=4096)
def objpert_candidate_config(epsilon: float, reg: float, order: float, d: int, n_train: int) -> ObjPertConfig:
    """The ObjPert run of a candidate, from public values only; ``curve`` and ``fit_and_score`` both use it.

    σ from ``objpert_sigma`` (the AMP term 2α/1000² does not depend on τ because σ_out = 1000·τ/λ). τ is
    max(1e-6, 2 × ``minimum_tolerance``(λ, σ, R = 1, d, n̄ = n_t)): the stand-alone mechanism's guard
    (0.99τ ≥ 10 × the public rounding slack), so the certified stop is reachable on every dataset of this
    shape and failure does not depend on the data (docs/privacy/tuning.md#tuning-candidates). The curve is
    re-evaluated with the final τ and σ raised by 1e-9 relative steps until it is ≤ ε at α* again (τ
    recomputed with it), so the validity mask of Theorem 13 sees exactly the configuration that runs.
    ValueError if no τ works (``minimum_tolerance`` infinite: n_t·d/λ beyond float64 precision) or ε is
    unreachable.
    """
    sigma = objpert_sigma(epsilon, reg, order)
    for _ in range(1000):
        needed = minimum_tolerance(reg, sigma, 1.0, d, n_train)
        if not math.isfinite(needed):
            raise ValueError(
                f"objective perturbation with λ = {reg!r} on {n_train} training rows of dimension {d} has no "
                "solver tolerance above its float64 rounding slack: raise regularization"
            )
        tau = max(OBJPERT_TOLERANCE, OBJPERT_TOLERANCE_MARGIN * needed)
        op = ObjPertConfig(lam=reg, sigma=sigma, tau=tau, neighboring="replace_one", max_rows=n_train)
        if objpert_curve(op, (order,)).at(order) <= epsilon:
            return op
        sigma *= 1.0 + 1e-9
    raise ValueError(f"objective perturbation cannot reach RDP ε = {epsilon!r} at order {order!r}")


class ObjPert(_GaussianScored):
    """Objective perturbation (``mechanisms.learners.objective_perturbation``, AMP variant) for logistic
    regression, calibrated so its RDP at α* is ≤ ε; discrete-Gaussian held-out score. RDP only.

    ``regularization`` is λ of the **sum-scale** objective Σ f + (λ/2)‖θ‖², and must exceed β = 1/4.
    """

    kind: ClassVar[str] = "objective-perturbation"

    def _train_curve(
        self, config: CandidateConfig, orders: tuple[float, ...], order: float, shape: PublicShape
    ) -> RdpCurve:
        return objpert_curve(
            objpert_candidate_config(config.epsilon, config.reg, order, shape.d, shape.n_train), orders
        )

    def _train(
        self,
        config: CandidateConfig,
        split: Split,
        order: float,
        noise: Noise,
        progress: ProgressFn,
    ) -> np.ndarray:
        n_train, d = split.x_train.shape  # the public shape: equal to the plan's (asserted in the service)
        op = objpert_candidate_config(config.epsilon, config.reg, order, d, n_train)
        theta: np.ndarray = fit_objpert(split.x_train, split.y_train, op, noise, progress).released
        return theta


LEARNERS: dict[str, OutputPerturbation | DpGd | ObjPert] = {
    "output_perturbation.logistic": OutputPerturbation("output_perturbation.logistic", "classification"),
    "output_perturbation.ridge": OutputPerturbation("output_perturbation.ridge", "regression"),
    "dp_gd.logistic": DpGd("dp_gd.logistic", "classification"),
    "dp_gd.ridge": DpGd("dp_gd.ridge", "regression"),
    "objpert.logistic": ObjPert("objpert.logistic", "classification"),
}
