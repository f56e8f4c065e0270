"""Clipped Gaussian DP gradient descent (full batch): the standard baseline, pure numerics.

Algorithm (Abadi et al. 2016 with the full batch; Song, Chaudhuri, Sarwate 2013), on a design matrix X
(rows ‖x_i‖ ≤ 1 by ``mechanisms.learners.features.design_matrix``; not needed for privacy) and labels y:

    θ₀ = 0;  for t = 0 … T−1:
        g_t = Σ_i clip(∇ℓ_i(θ_t), C) + N(0, (z·Δ)² I_d),   clip(v, C) = v·min(1, C/‖v‖)
        θ_{t+1} = Π_K(θ_t − τ·(g_t / n_norm + λθ_t))      (K = {‖θ‖ ≤ r}, only if ``radius`` is set)

with ℓ_i the **unregularised** per-record loss (logistic log(1 + e^{−y_i x_iᵀθ}) with y_i = ±1, or squared
½(x_iᵀθ − y_i)²), ridge λ applied outside the clipped sum (it does not depend on the data), z the noise
multiplier and Δ the ℓ2 sensitivity of the clipped sum: **2C under replace_one** (one clipped vector
replaced by another) and **C under add_remove** (one clipped vector added or removed).

Privacy (Mironov 2017, Prop. 7 and Prop. 1): each step is a Gaussian mechanism with sensitivity Δ and
standard deviation zΔ on a query chosen from the previous (public) iterate, so it is (α, α/(2z²))-RDP at
every order; T adaptive steps compose to (α, T·α/(2z²)). The division by ``n_norm`` and the ridge term are
post-processing, so the guarantee holds for any public ``n_norm`` and does not need ‖x_i‖ ≤ 1 or bounded
labels: clipping alone bounds the sensitivity. ``n_norm`` must be public: the row count under replace_one
(``PublicContext.n_rows``); under add_remove the row count is private, so the caller passes a public
estimate (the service mechanism asks for an ``n_hint`` parameter); a wrong hint only rescales the step.

Adaptive clipping (``AdaptiveClip``, ``adaptive_dp_gd_train``; Andrew, Thakkar, McMahan, Ramaswamy 2021;
Theorem DPGD-ADAPT, docs/privacy/gradient_descent.md#theorem-dpgd-adapt): C follows a privately estimated
quantile of the gradient norms through a noisy clipped count released each step; the count and the gradient
share the per-step RDP α/(2z²), so the charge is unchanged.

Finite precision (docs/privacy/finite_precision_learners.md#theorem-dpgd-grid, Theorem DPGD-GRID): each
record's clipped term is rounded to a public unit ω with its norm checked below C in integers, the step's sum
is an exact integer vector (order-free), and the noise is an exact discrete Gaussian of ⌈zΔ/ω⌉ units; the
iterates are post-processing.

Streaming and memory. ``DpGdMechanism.run`` never builds the n×d design matrix of the whole table: the
feature and label columns come in record batches (``features.table_batches``: ``ParquetTable.batches`` for a
Parquet snapshot, slices of in-memory columns otherwise), each batch's design columns
(``features.design_columns``, bit for bit ``design_matrix``) are mapped to compact ``GridRecords`` (int32 û,
float64 ν, k̄, y: 4d + 24 bytes per record; ``grid_records_from_batches``), and each step passes over the
records in blocks of ``BLOCK_ROWS`` with per-thread buffers, on up to ``MAX_WORKERS`` threads. None of this
changes a bit of the release: every per-record value is an elementwise function of its own record (no
reduction mixes records; row norms are summed across columns in numpy's own row order), and every sum is an
exact integer (partial BLAS sums < 2^52, then int64 or Python integers), so batches, blocks, threads and
their order are invisible. The same ``Noise`` gives the same iterates on a dict of columns and on a
``ParquetTable`` (tests/unit/test_dp_gd_streaming.py), as the privacy argument (Theorem DPGD-GRID: each
record's clipped term is a function of that record, sums are exact) requires. Adaptive clipping evaluates
each record's margin and scalar once per step for both the clipped sum and the count, and derives k̄_i at
C_t from √N_i computed once per run, instead of re-gridding the rows and evaluating the gradients twice.

Privacy units (user-level DP-GD; Theorem DPGD-UNIT, docs/privacy/units_learners.md#theorem-dpgd-unit). On a
dataset with a ``privacy_unit`` each unit keeps its first ``max_rows`` records in the engines' keyed-hash
order (``bound_units``, ``mechanisms.data.plan.kept_rows``), and each step sums every unit's row terms
(``np.add.reduceat`` over records sorted by unit, exact integers) and clips that sum to C exactly
(``clip_unit_sums``) before adding the units: one unit with all its rows moves the sum by < C (add/remove)
or < 2C (replace), so the charge T·α/(2z²) is unchanged and now protects a whole unit. Memory: the unit ids
and bounding order (16 bytes per row) and, while bounding, a second copy of the kept records. Measured (n =
10⁶ rows, d = 10, 10⁵ units, k = 8, a shared 2-core machine at load 15): bounding 3.7 s once, a step 0.47 s
against 0.36 s per row.

Individual accounting (Feldman & Zrnic 2021; docs/privacy/individual.md#individual-dp-gd-proof). On a
dataset with ``accounting: individual`` the table is an ``IndividualTable`` carrying the units' filters, and
at every step each unit takes part only if its filter — its charges of earlier releases and of the earlier
steps of this run (``UnitFilter.after``) — affords its own charge α‖W_u‖²/(2t²) at θ_t (W_u its clipped
summed gradient in term units, t the noise scale in term units; ``unit_step_charges``, ``IndividualStep``);
otherwise W_u is left out of that step's sum. The noise is unchanged, the release's ``units`` are each unit's
total over the run, and its ``realized`` stays the public worst case T·α/(2z²); admission asks only that one
step fits a unit with nothing spent (``individual_worst_case``), so a run may outlast every unit's budget.

``DpGdConfig.neighboring`` fixes the Δ the noise is calibrated to; ``dp_gd_curve`` charges the relation
asked for against the noise actually used, T·α·Δ_asked²/(2(zΔ_noise)²), so a mismatch can only over-charge
(replace_one noise is valid for both relations) and never under-charge.

Floating point (docs/privacy/gradient_descent.md#theorem-dpgd). ``clipped_gradient_sum`` computes every
per-record term as a deterministic function of (θ, x_i, y_i) alone whose exact norm is ≤ C, for **every** θ
(also huge or non-finite θ) and every finite or non-finite record: the scalar s_i is clipped as a coefficient
c_i = sign(s_i)·min(|s_i|, C(1 − (d+8)·2⁻⁵²)/‖x_i‖) (the shrink covers the rounding of ‖x_i‖, of the
division and of c_i·x_i, so the computed vector's exact norm is ≤ C, not only |s_i|·‖x_i‖), with ‖x_i‖
computed on a power-of-two rescaled row (no overflow/underflow); s_i = ±∞ gives c_i = ±C'/‖x_i‖ (the limit
of clipping), and a NaN s_i, a zero or non-finite row norm gives the zero term. Before, a residual that
overflowed to ∞ at a huge θ met a clip factor 0 and produced NaN for D and a finite sum for D′.
``radius`` (the service sets it, ``default_radius`` or the public ``max_norm``) projects the iterates onto
a public ball — post-processing of the released noisy sum — and ``finiteness_problem`` checks from public
values that no update can overflow. The float sum of the n terms and the float Gaussian sampler (as in
``mechanisms.queries.gaussian``) remain the usual floating-point caveats.
"""

from __future__ import annotations

import math
import os
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, replace
from fractions import Fraction
from itertools import pairwise
from typing import Any, ClassVar, Literal, Self, TypeVar

import numpy as np
from pydantic import BaseModel, Field, StrictBool, StrictFloat, StrictInt, model_validator

from mechanisms.accounting import UNITS_PER_EPSILON
from mechanisms.accounting.curve import RdpCurve, pad_up
from mechanisms.accounting.individual import UnitCharges, UnitFilter, UnitLedger, slope_units
from mechanisms.accounting.orders import validate_orders
from mechanisms.base import ParamsChecked, ParamsError, ProgressFn, PublicContext, Release, Table, no_progress
from mechanisms.data.plan import ORDER_COLUMN, clip_bounds, kept_rows, unit_starts
from mechanisms.data.schema import DatasetSchema
from mechanisms.learners.features import (
    BatchedTable,
    FeatureSpec,
    check_features,
    column_names,
    column_row_norms,
    design_columns,
    dimension,
    learner_task,
    table_batches,
)
from mechanisms.learners.relative_gaussian import project_to_ball, ridge_theta_bound
from mechanisms.noise import Noise, float_up
from mechanisms.noise.learners import MAX_STD, discrete_gaussian_std
from mechanisms.queries.individual import individual_table

Loss = Literal["logistic", "squared"]
Neighboring = Literal["replace_one", "add_remove"]

_EPS = float(np.finfo(float).eps)
FLOAT_CEILING = 1e300  # public bounds must stay below this: 1e8 of headroom under the float maximum
Z_MAX = 1026.0  # |Z|·ω ≤ 513·t·ω ≤ 1026·zΔ: the exact sampler never returns |Z| > 513·t (t·ω ≤ 2zΔ)
ROWS_MAX = 2.0**63  # no in-memory dataset has more rows: bounds the clipped sum when n is private
LABEL_BOUND = 1.0  # Y of the design matrix (labels scaled to [−1, 1] or mapped to ±1)
ROW_BITS = 14
"""Rows are quantised once to integer vectors û_i ≈ 2^ROW_BITS·x_i/‖x_i‖ (entries ≤ 2^ROW_BITS)."""
TERM_BITS = 37
"""At most: the term unit ω is the largest power of two ≤ C·2^−B, B = ``term_bits(z)`` ≤ 37 (a clipped term is
< 2^(B+1) units; the per-term resolution is ≈ C·2^(14−B))."""
_INT64_ROWS = 1 << 24  # above this many rows the chunk sums are added as Python integers (no int64 overflow)
MAX_NOISE_MULTIPLIER = float(1 << 20)
"""z ≤ 2^20 keeps the noise standard deviation in term units ≤ 2^52 (the exact sampler's range)."""


ADAPTIVE_CLIP_MIN = 1e-6
ADAPTIVE_CLIP_MAX = 1e6
"""Public range the adaptive clip norm C_t is kept in (a clamp: post-processing of the released counts)."""


@dataclass(frozen=True)
class AdaptiveClip:
    """Private adaptive clipping (Andrew, Thakkar, McMahan, Ramaswamy 2021), all public.

    At step t the clip norm is C_t; besides the noisy clipped-gradient sum, the step releases the noisy count
    b̃_t = #{i : ‖∇ℓ_i(θ_t)‖ ≤ C_t} + N_Z(0, t_b²) and sets C_{t+1} = clamp(C_t·exp(−η(b̃_t/n_norm − γ)))
    (a geometric step towards the γ-quantile of the gradient norms). The effective noise multiplier z is
    split: a share φ of the per-step RDP 1/z² goes to the count (std σ_b = z/√φ, count sensitivity 1) and
    1 − φ to the gradient (multiplier z_g = z/√(1 − φ)), so one step costs α/(2z²) as without adaptation
    (Theorem DPGD-ADAPT, docs/privacy/gradient_descent.md#theorem-dpgd-adapt).
    """

    target_quantile: float = 0.9  # the service defaults (benchmarks/learners_robustness.py; the paper's
    learning_rate: float = 1.0  # federated choice, median with η = 0.2, missed its target there on logistic)
    count_share: float = 0.05
    clip_min: float = ADAPTIVE_CLIP_MIN
    clip_max: float = ADAPTIVE_CLIP_MAX

    def __post_init__(self) -> None:
        if not 0.0 < self.target_quantile < 1.0:
            raise ValueError(f"target_quantile must be in (0, 1), got {self.target_quantile!r}")
        if not (math.isfinite(self.learning_rate) and 0.0 < self.learning_rate <= 10.0):
            raise ValueError(f"learning_rate must be in (0, 10], got {self.learning_rate!r}")
        if not 0.0 < self.count_share < 1.0:
            raise ValueError(f"count_share must be in (0, 1), got {self.count_share!r}")
        if not (0.0 < self.clip_min <= self.clip_max and math.isfinite(self.clip_max)):
            raise ValueError("need 0 < clip_min ≤ clip_max < ∞")


def adaptive_split(noise_multiplier: float, count_share: float) -> tuple[float, float]:
    """(z_g, σ_b): the gradient's noise multiplier z/√(1 − φ) and the count's std z/√φ (sensitivity 1),
    so 1/z_g² + 1/σ_b² = 1/z² (rounded so that the sum is ≤ 1/z²: both raised by one ulp-scale factor)."""
    z_g = noise_multiplier / math.sqrt(1.0 - count_share) * (1.0 + 1e-12)
    sigma_b = noise_multiplier / math.sqrt(count_share) * (1.0 + 1e-12)
    return z_g, sigma_b


def count_noise_units(noise_multiplier: float, count_share: float) -> int:
    """The integer std t_b = ⌈σ_b⌉ ≥ σ_b of the discrete Gaussian on the count (exact)."""
    units = max(1, math.ceil(adaptive_split(noise_multiplier, count_share)[1]))
    if units > MAX_STD:
        raise ValueError("the count noise standard deviation exceeds 2^52: raise count_share")
    return units


@dataclass(frozen=True)
class DpGdConfig:
    """Public hyper-parameters of clipped DP-GD (all checked in ``__post_init__``)."""

    loss: Loss
    reg: float
    steps: int
    step_size: float
    clip: float
    noise_multiplier: float
    neighboring: Neighboring = "replace_one"
    radius: float | None = None  # projection radius r (public); None: no projection (library use)
    adaptive: AdaptiveClip | None = None  # private adaptive clipping (``clip`` is then the initial C₀)

    def __post_init__(self) -> None:
        if self.loss not in ("logistic", "squared"):
            raise ValueError(f"loss must be 'logistic' or 'squared', got {self.loss!r}")
        if self.neighboring not in ("replace_one", "add_remove"):
            raise ValueError(f"neighboring must be 'replace_one' or 'add_remove', got {self.neighboring!r}")
        if isinstance(self.steps, bool) or int(self.steps) != self.steps or self.steps < 1:
            raise ValueError(f"steps must be an integer ≥ 1, got {self.steps!r}")
        for name in ("reg", "step_size", "clip", "noise_multiplier"):
            value = float(getattr(self, name))
            low_ok = value >= 0.0 if name == "reg" else value > 0.0
            if not (math.isfinite(value) and low_ok):
                raise ValueError(
                    f"{name} must be finite and {'≥' if name == 'reg' else '>'} 0, got {value!r}"
                )
        if self.radius is not None and not (math.isfinite(self.radius) and self.radius > 0.0):
            raise ValueError(f"radius must be finite and > 0 (or None), got {self.radius!r}")
        if self.noise_multiplier > MAX_NOISE_MULTIPLIER:
            raise ValueError(
                f"noise_multiplier must be ≤ 2^20 (the exact sampler's range), got {self.noise_multiplier!r}"
            )
        if self.adaptive is not None:
            if not self.adaptive.clip_min <= self.clip <= self.adaptive.clip_max:
                raise ValueError(
                    f"the initial clip must be in [{self.adaptive.clip_min}, {self.adaptive.clip_max}]"
                )
            if gradient_multiplier(self) > MAX_NOISE_MULTIPLIER:
                raise ValueError("the gradient noise multiplier z/√(1 − count_share) exceeds 2^20")


def sensitivity(clip: float, neighboring: Neighboring) -> float:
    """ℓ2 sensitivity of Σ_i clip(v_i, C): 2C under replace_one, C under add_remove."""
    if neighboring == "replace_one":
        return 2.0 * clip
    if neighboring == "add_remove":
        return clip
    raise ValueError(f"unknown neighbouring relation {neighboring!r}")


def gradient_multiplier(config: DpGdConfig) -> float:
    """The noise multiplier on the clipped gradient sum: z, or z_g = z/√(1 − φ) with adaptive clipping."""
    if config.adaptive is None:
        return config.noise_multiplier
    return adaptive_split(config.noise_multiplier, config.adaptive.count_share)[0]


def largest_clip(config: DpGdConfig) -> float:
    """The largest clip norm any step can use: C, or the adaptive range's upper end."""
    return config.clip if config.adaptive is None else config.adaptive.clip_max


def noise_std(config: DpGdConfig, clip: float | None = None) -> float:
    """Standard deviation z_g·Δ of the noise on the clipped gradient sum at clip norm ``clip`` (default C;
    Δ from ``config.neighboring``)."""
    used = config.clip if clip is None else clip
    return gradient_multiplier(config) * sensitivity(used, config.neighboring)


def dp_gd_curve(config: DpGdConfig, neighboring: Neighboring, orders: Sequence[float]) -> RdpCurve:
    """RDP of the whole run under ``neighboring``: T·α·Δ²/(2s²), s = ``noise_std(config)``; no pure bound.

    With ``neighboring == config.neighboring`` this is T·α/(2z²) (Mironov 2017, Prop. 7, composed T times
    by Prop. 1). Values are padded upwards so rounding can only over-charge. With adaptive clipping each step
    adds the count's α·1²/(2σ_b²) (sensitivity 1 under both relations) to the gradient's α·Δ²/(2(z_gΔ')²),
    Δ/Δ' the same for every C_t (Theorem DPGD-ADAPT, docs/privacy/gradient_descent.md#theorem-dpgd-adapt).
    """
    grid = validate_orders(orders)
    one_step = RdpCurve.gaussian(sensitivity(config.clip, neighboring), noise_std(config), grid)
    per_step = list(one_step.values)
    if config.adaptive is not None:
        sigma_b = adaptive_split(config.noise_multiplier, config.adaptive.count_share)[1]
        count = RdpCurve.gaussian(1.0, sigma_b, grid)
        per_step = [pad_up(a + b) for a, b in zip(per_step, count.values, strict=True)]
    values = tuple(pad_up(config.steps * v) for v in per_step)
    return RdpCurve(grid, values)


def noise_multiplier_for(target_epsilon: float, delta: float, steps: int, orders: Sequence[float]) -> float:
    """The smallest z (on the grid) with min_α [T·α/(2z²) + log(1/δ)/(α−1)] ≤ ε (Mironov 2017, Prop. 3).

    Per order the closed form is z² = Tα/(2(ε − log(1/δ)/(α−1))) where ε > log(1/δ)/(α−1); the result is
    raised slightly and re-checked so that ``epsilon_at_delta(dp_gd_curve(...), δ) ≤ ε`` holds in floats.
    Raises ValueError if no order of the grid can reach ε at δ.
    """
    grid = validate_orders(orders)
    if not (math.isfinite(target_epsilon) and target_epsilon > 0.0):
        raise ValueError(f"target_epsilon must be finite and > 0, got {target_epsilon!r}")
    if not (math.isfinite(delta) and 0.0 < delta < 1.0):
        raise ValueError(f"delta must be in (0, 1), got {delta!r}")
    if isinstance(steps, bool) or int(steps) != steps or steps < 1:
        raise ValueError(f"steps must be an integer ≥ 1, got {steps!r}")
    log_term = math.log(1.0 / delta)
    best = math.inf
    for alpha in grid:
        room = target_epsilon - log_term / (alpha - 1.0)
        if room > 0.0:
            best = min(best, math.sqrt(steps * alpha / (2.0 * room)))
    if not math.isfinite(best):
        raise ValueError(f"no order of the grid reaches epsilon {target_epsilon!r} at delta {delta!r}")
    z = best * (1.0 + 1e-12)
    while _converted(z, steps, grid, log_term) > target_epsilon:  # float safety; at most a few rounds
        z = z * (1.0 + 1e-9)
    return z


def _converted(z: float, steps: int, grid: tuple[float, ...], log_term: float) -> float:
    """min_α [padded T·α/(2z²) + padded log(1/δ)/(α−1)]: the ε the charged curve converts to."""
    return min(pad_up(steps * pad_up(a / (2.0 * z * z))) + pad_up(log_term / (a - 1.0)) for a in grid)


def default_radius(
    loss: Loss, reg: float, feature_bound: float, clip: float, label_bound: float = LABEL_BOUND
) -> float | None:
    """A public r bounding both the unclipped optimum θ* and the fixed point θ_c of clipped DP-GD (with
    n_norm = n), over all datasets with ‖x_i‖ ≤ X, |y_i| ≤ Y; ``None`` when λ = 0 (no bound exists).

    * logistic: X·Y/λ (λθ = −(1/n)Σ∇ℓ_i or Σclip(∇ℓ_i), and both have norm ≤ XY);
    * squared: max(B, min(Y/√λ, C/λ)), B = ``ridge_theta_bound`` for θ*; θ_c minimises the Huber objective
      (1/n)Σh_i + (λ/2)‖θ‖² (h_i ≤ ½r², h_i' = clipped residual), so (λ/2)‖θ_c‖² ≤ h(0) ≤ Y²/2 and
      λ‖θ_c‖ ≤ C.
    Rounded up; +∞ if it overflows (``finiteness_problem`` then refuses).
    """
    if not (math.isfinite(reg) and reg >= 0.0):
        raise ValueError(f"reg must be finite and ≥ 0, got {reg!r}")
    if reg == 0.0:
        return None
    if loss == "logistic":
        return pad_up(feature_bound * label_bound / reg)
    clipped = min(label_bound / math.sqrt(reg), clip / reg)
    return pad_up(max(ridge_theta_bound(reg, feature_bound, label_bound), clipped))


def finiteness_problem(config: DpGdConfig, d: int, n_norm: float) -> tuple[str, str] | None:
    """With ``config.radius`` set: ``None`` if no update of any run can overflow, whatever the data; else
    (service field to blame, message). Public inputs only.

    Each clipped term has norm ≤ C, so the sum is ≤ ROWS_MAX·C (n may be private); the noisy sum is
    ≤ ROWS_MAX·C + Z_MAX·zΔ per coordinate (the exact sampler's support is bounded, |Z| ≤ 513t); the
    update's coordinates are ≤ r + τ(that/n_norm + λr); the
    vector norms (d·(2·coordinate)²) must stay ≤ ``FLOAT_CEILING``.
    """
    if config.radius is None:
        return None
    radius = config.radius
    if not d * (2.0 * radius) * (2.0 * radius) <= FLOAT_CEILING:
        return "regularization", (
            f"the iterate ball radius {radius!r} is too large for finite floating point: raise "
            "regularization or give a smaller max_norm"
        )
    noisy = ROWS_MAX * largest_clip(config) + Z_MAX * noise_std(config, largest_clip(config))
    if not noisy <= FLOAT_CEILING:
        return "clip", "the noisy gradient sum could overflow: lower clip or noise_multiplier"
    coordinate = radius + config.step_size * (noisy / n_norm + config.reg * radius)
    if not d * (2.0 * coordinate) * (2.0 * coordinate) <= FLOAT_CEILING:
        return "step_size", f"the update could overflow with step_size {config.step_size!r}: lower it"
    return None


# ----- the learning numerics -------------------------------------------------------------------------------
def _check_data(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    features = np.asarray(x, dtype=float)
    labels = np.asarray(y, dtype=float)
    if features.ndim != 2 or labels.shape != (features.shape[0],):
        raise ValueError("x must be (n, d) and y must be (n,)")
    return features, labels


def _scalar_grad(margin: np.ndarray, labels: np.ndarray, loss: Loss) -> np.ndarray:
    """s_i with ∇ℓ_i(θ) = s_i·x_i: −y_i·sigmoid(−y_i x_iᵀθ) (logistic) or x_iᵀθ − y_i (squared)."""
    if loss == "logistic":
        # sigmoid(−m) = exp(−logaddexp(0, m)), stable for both signs of m.
        result: np.ndarray = -labels * np.exp(-np.logaddexp(0.0, labels * margin))
        return result
    residual: np.ndarray = margin - labels
    return residual


def _power_of_two_exponents(peak: np.ndarray) -> np.ndarray:
    """e with 2^e in (peak/2, peak] (e = −1 for a zero peak): dividing by 2^e is exact."""
    exponent: np.ndarray = np.frexp(peak)[1] - 1
    return exponent


def safe_row_norms(features: np.ndarray) -> np.ndarray:
    """‖x_i‖ per row, computed on the row divided by a power of two near its largest entry (exact), so squares
    neither overflow nor underflow: relative error ≤ (d/2 + 2)·2⁻⁵³. +∞ if the true norm exceeds the float
    range, NaN or +∞ for a row with a non-finite entry, 0 for a zero row."""
    with np.errstate(all="ignore"):
        peak = np.max(np.abs(features), axis=1) if features.shape[1] else np.zeros(features.shape[0])
        exponent = _power_of_two_exponents(np.where(np.isfinite(peak), peak, 0.0))
        unit = np.ldexp(features, -exponent[:, None])
        norms: np.ndarray = np.ldexp(np.linalg.norm(unit, axis=1), exponent)
    return norms


def term_bits(noise_multiplier: float | None = None) -> int:
    """B = min(37, 49 − ⌈log2 z⌉): the noise std zΔ ≤ 2zC is then ≤ 2^52 units ω (the sampler's range)."""
    if noise_multiplier is None or noise_multiplier <= 1.0:
        return TERM_BITS
    return min(TERM_BITS, 49 - math.ceil(math.log2(noise_multiplier)))


def term_unit(clip: float, noise_multiplier: float | None = None) -> float:
    """ω: the largest power of two ≤ C·2^−B (B = ``term_bits(z)``, public): each clipped term is an integer
    vector times ω."""
    if not (math.isfinite(clip) and clip > 0.0):
        raise ValueError(f"clip must be finite and > 0, got {clip!r}")
    return math.ldexp(1.0, math.frexp(clip)[1] - 1 - term_bits(noise_multiplier))


def noise_units(config: DpGdConfig, clip: float | None = None) -> int:
    """The integer standard deviation t = ⌈z_gΔ/ω⌉ of the discrete Gaussian, in term units ω (exact), at
    clip norm ``clip`` (default C)."""
    used = config.clip if clip is None else clip
    exact = Fraction(noise_std(config, used)) / Fraction(term_unit(used, gradient_multiplier(config)))
    units = max(1, math.ceil(exact))
    if units > MAX_STD:
        raise ValueError("the noise standard deviation exceeds 2^52 term units: lower noise_multiplier")
    return units


def released_noise_std(config: DpGdConfig, clip: float | None = None) -> float:
    """The standard deviation t·ω ≥ z_gΔ of the noise actually added to each coordinate of the clipped sum."""
    used = config.clip if clip is None else clip
    return float(noise_units(config, used)) * term_unit(used, gradient_multiplier(config))


BLOCK_ROWS = 1 << 15
"""Rows per block of the per-step pass. Its float64 vectors (256 KiB each) live in a per-thread workspace
reused for every block, so a step allocates nothing of size n (fresh whole-table temporaries cost more in
page faults than in arithmetic) and stays in the CPU cache."""
GRID_ROWS = 1 << 13
"""Rows per piece of the per-record preparation (``design_columns``, ``_grid_columns``): small temporaries
(64 KiB) that the allocator recycles and the cache holds."""
MAX_WORKERS = 4
"""At most this many threads run the per-batch and per-block work (numpy and BLAS release the GIL in their
loops). Every block's result is an exact integer vector (or count) and blocks are added as integers, so the
output is the same for any number of threads and any completion order."""


def _workers() -> int:
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(MAX_WORKERS, cpus))


@contextmanager
def _thread_pool() -> Iterator[ThreadPoolExecutor | None]:
    """A pool of ``_workers()`` threads for one run, or None on one core (the work then runs inline)."""
    workers = _workers()
    if workers == 1:
        yield None
        return
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="dp-gd") as pool:
        yield pool


_T = TypeVar("_T")
_R = TypeVar("_R")


def _ordered_map(
    function: Callable[[_T], _R], items: Iterable[_T], pool: ThreadPoolExecutor | None
) -> Iterator[_R]:
    """``map(function, items)`` in order, on ``pool`` with at most 2·MAX_WORKERS items in flight (bounded
    memory while ``items`` streams)."""
    if pool is None:
        yield from map(function, items)
        return
    pending: deque[Future[_R]] = deque()
    for item in items:
        pending.append(pool.submit(function, item))
        if len(pending) >= 2 * MAX_WORKERS:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


@dataclass(frozen=True)
class GridRecords:
    """The data prepared once by per-record maps (neighbours stay neighbours; every entry below depends on
    its own record only, never on its position or on the batch it was read in):

    * ``rows``: û_i = rint(2^ROW_BITS·x_i/‖x_i‖) as **int32** integers (|entries| ≤ 2^ROW_BITS, so exact),
      shape (n, d), stored column by column (``rows.T`` is C-contiguous: the per-step pass reads one
      column block at a time); 0 for a row with a non-finite entry or a norm outside (0, float max];
    * ``scale``: ν_i = ‖x_i‖·2^−ROW_BITS, so the row the gradient sees is x̂_i = ν_i·û_i;
    * ``cap``: k̄_i = ⌊F/√N_i·(1 − 2⁻⁴⁰)⌋, F = C/ω, N_i = ‖û_i‖² (exact integer): any integer |k| ≤ k̄_i
      has k²N_i < F², i.e. ‖ω·k·û_i‖ < C **exactly**;
    * ``labels``: non-finite labels set to 0.

    Memory: 4d + 24 bytes per record (no n×d float64 array is kept; ``grid_records_from_batches`` never
    builds one either).
    """

    rows: np.ndarray
    scale: np.ndarray
    cap: np.ndarray
    labels: np.ndarray
    unit: float
    chunk: int  # rows per exact BLAS sum: chunk·F ≤ 2^51, so every partial sum is an integer < 2^52


@dataclass(frozen=True)
class _GridBatch:
    """``grid_records``' per-record results for one batch of m records: û as int32 columns (d, m), ν, k̄, y."""

    columns: np.ndarray
    scale: np.ndarray
    cap: np.ndarray
    labels: np.ndarray


def _term_chunk(budget: float) -> int:
    """Rows per exact partial sum for F = ``budget``: chunk·F ≤ 2^51 (each term's entries are ≤ F)."""
    return 1 << (50 - math.frexp(budget)[1] + 1)


def _column_peak(columns: Sequence[np.ndarray], n: int) -> np.ndarray:
    """max_j |x_ij| per row, NaN for a row with a NaN: ``np.max(np.abs(X), axis=1)`` in value (the maximum of
    non-negative numbers is exact and order-free; only a NaN's payload may differ, and NaN peaks are
    discarded by every caller)."""
    if not columns:
        return np.zeros(n)
    peak: np.ndarray = np.abs(columns[0])
    for column in columns[1:]:
        peak = np.maximum(peak, np.abs(column))
    return peak


def _grid_columns(
    columns: Sequence[np.ndarray], labels: np.ndarray, budget: float, row_norms: np.ndarray | None = None
) -> _GridBatch:
    """The per-record maps of ``grid_records`` on one piece of the table given by its design columns.

    The same elementwise IEEE operations as the row-major formulas (documented in ``grid_records``) in the
    same order, with the row norms summed across columns in numpy's row order (``column_row_norms``), so
    the entries are bit for bit those of the whole-matrix computation: every result for record i is a
    function of record i alone (no reduction mixes records), which is what Theorem DPGD-GRID needs and
    why a table read in batches gives the same records as the table read at once. N_i = Σ_j û_ij² is
    accumulated in float64, exact (d·2^28 < 2^53).

    Shortcut (same values): when every row of the piece is usable (finite, norm in (0, float max]), zeroing
    the unusable rows changes nothing, so the second peak, exponent, unit rows and their norm are the ones
    ``safe_row_norms`` already computed; they are reused instead of recomputed. A row is entirely finite
    iff its peak max_j|x_ij| is (NaN and ±∞ propagate through the maximum).
    """
    n = labels.shape[0]
    with np.errstate(all="ignore"):
        unit_norms: np.ndarray | None = None
        if row_norms is None:  # safe_row_norms, keeping its intermediate results
            peak = _column_peak(columns, n)
            finite = np.isfinite(peak)
            exponent = _power_of_two_exponents(np.where(finite, peak, 0.0))
            unit_columns = [np.ldexp(column, -exponent) for column in columns]
            unit_norms = column_row_norms(unit_columns, n)
            norms = np.ldexp(unit_norms, exponent)
            usable = np.isfinite(norms) & (norms > 0.0) & finite
        else:
            norms = np.asarray(row_norms, dtype=float)
            usable = np.isfinite(norms) & (norms > 0.0)
            for column in columns:
                usable &= np.isfinite(column)
        everywhere = bool(np.all(usable))
        labels = np.where(np.isfinite(labels), labels, 0.0)
        if everywhere and unit_norms is not None:
            lengths = unit_norms  # the norms of the unit rows below, already computed
        else:
            kept = [np.where(usable, column, 0.0) for column in columns]
            norms = np.where(usable, norms, 0.0)
            exponent = _power_of_two_exponents(_column_peak(kept, n))
            unit_columns = [np.ldexp(column, -exponent) for column in kept]  # exact; entries in [−2, 2]
            lengths = column_row_norms(unit_columns, n)
        divisor = lengths if everywhere else np.where(usable, lengths, 1.0)
        rows = np.empty((len(columns), n), dtype=np.int32)
        squared = np.zeros(n)
        for j, column in enumerate(unit_columns):
            entry = np.rint(np.ldexp(column / divisor, ROW_BITS))
            if not everywhere:
                entry = np.where(usable, entry, 0.0)
            rows[j] = entry  # integers |·| ≤ 2^ROW_BITS: exact in int32
            squared += entry * entry
        cap = np.floor(budget / np.sqrt(squared) * (1.0 - 2.0**-40))
        cap = np.where(squared > 0, cap, 0.0)
    return _GridBatch(rows, np.ldexp(norms, -ROW_BITS), cap, labels)


Job = tuple[int, Callable[[], list[_GridBatch]]]
"""(rows m, producer): the producer returns the ``_GridBatch`` pieces of those m rows, in order."""


def _collect(jobs: Iterable[Job], d: int, capacity: int, unit: float, budget: float) -> GridRecords:
    """Run the jobs (on a thread pool, in row order) and gather their pieces into one ``GridRecords``.

    The records are allocated once for ``capacity`` rows and each piece is copied into its place by the
    worker that made it, so the pieces' memory is recycled at once and nothing is concatenated: the peak is
    the records (4d + 24 bytes per row) plus a few batches in flight. Rows beyond ``capacity`` (a wrong or
    missing hint) are kept as pieces and concatenated at the end. The hint only sizes memory; values and
    their order do not depend on it."""
    rows = np.empty((d, capacity), dtype=np.int32)
    scale, cap, labels = np.empty(capacity), np.empty(capacity), np.empty(capacity)
    filled = 0  # rows of the jobs that fit, in order; every later job spills

    def scheduled() -> Iterator[tuple[int, int, Callable[[], list[_GridBatch]]]]:
        nonlocal filled
        offset = 0
        for m, producer in jobs:
            yield offset, m, producer
            offset += m
            if offset <= capacity:
                filled = offset

    def run(job: tuple[int, int, Callable[[], list[_GridBatch]]]) -> list[_GridBatch]:
        offset, m, producer = job
        pieces = producer()
        if sum(piece.labels.shape[0] for piece in pieces) != m:
            raise ValueError("the design matrix of a batch does not have one row per record")
        for piece in pieces:
            if piece.columns.shape[0] != d:
                raise ValueError(f"the design matrix has {piece.columns.shape[0]} columns, expected {d}")
        if offset + m > capacity:
            return pieces  # spilled: joined after the others
        for piece in pieces:
            stop = offset + piece.labels.shape[0]
            rows[:, offset:stop] = piece.columns
            scale[offset:stop], cap[offset:stop], labels[offset:stop] = piece.scale, piece.cap, piece.labels
            offset = stop
        return []

    spilled: list[_GridBatch] = []
    with _thread_pool() as pool:
        for rest in _ordered_map(run, scheduled(), pool):
            spilled.extend(rest)
    if spilled:
        rows_all = np.concatenate([rows[:, :filled], *(p.columns for p in spilled)], axis=1)
        del rows
        scale = np.concatenate([scale[:filled], *(p.scale for p in spilled)])
        cap = np.concatenate([cap[:filled], *(p.cap for p in spilled)])
        labels = np.concatenate([labels[:filled], *(p.labels for p in spilled)])
        return GridRecords(rows_all.T, scale, cap, labels, unit, _term_chunk(budget))
    return GridRecords(
        rows[:, :filled].T, scale[:filled], cap[:filled], labels[:filled], unit, _term_chunk(budget)
    )


def grid_records(
    features: np.ndarray,
    labels: np.ndarray,
    clip: float,
    row_norms: np.ndarray | None = None,
    noise_multiplier: float | None = None,
) -> GridRecords:
    """The ``GridRecords`` of a design matrix in memory (rows x_i, labels y_i), for clip norm C on the term
    grid ω = ``term_unit(C, z)``. Per record i, with ‖x_i‖ from ``safe_row_norms`` (or ``row_norms``):
    usable_i = ‖x_i‖ finite and > 0 and x_i finite (else x_i = 0); e_i with 2^e_i ≤ max_j|x_ij| < 2^(e_i+1);
    û_i = rint(2^ROW_BITS·(x_i/2^e_i)/‖x_i/2^e_i‖) (0 if not usable); ν_i, k̄_i as in ``GridRecords``.
    Computed by ``_grid_columns`` on pieces of ``GRID_ROWS`` rows (each entry depends on its own record
    only, so the pieces change nothing)."""
    matrix = np.asarray(features, dtype=float)
    unit = term_unit(clip, noise_multiplier)
    budget = clip / unit  # F = C/ω ∈ [2^B, 2^(B+1)), exact
    columns = np.ascontiguousarray(matrix.T)
    values = np.asarray(labels, dtype=float)
    norms = None if row_norms is None else np.asarray(row_norms, dtype=float)
    n = values.shape[0]

    def job(lo: int) -> Job:
        hi = min(lo + GRID_ROWS, n)

        def produce() -> list[_GridBatch]:
            piece_norms = None if norms is None else norms[lo:hi]
            return [_grid_columns(list(columns[:, lo:hi]), values[lo:hi], budget, piece_norms)]

        return hi - lo, produce

    return _collect(map(job, range(0, n, GRID_ROWS)), matrix.shape[1], n, unit, budget)


DesignBatch = Callable[[Mapping[str, np.ndarray]], tuple[Sequence[np.ndarray], np.ndarray]]
"""Maps one record batch to its design columns and labels (``features.design_columns``): row-wise."""


def _batch_rows(batch: Mapping[str, np.ndarray]) -> int:
    return len(next(iter(batch.values()))) if batch else 0


def grid_records_from_batches(
    batches: Iterable[Mapping[str, np.ndarray]],
    design: DesignBatch,
    d: int,
    clip: float,
    noise_multiplier: float | None = None,
    n_rows: int | None = None,
) -> GridRecords:
    """``grid_records`` of a table read in record batches (``features.table_batches``: a Parquet snapshot
    streams them), in bounded memory: each batch's design columns (``design``, on pieces of ``GRID_ROWS``
    rows) are mapped to their compact per-record results (int32 û, float64 ν, k̄, y: ``_grid_columns``) and
    only those are kept, so no n×d float64 array of the whole table exists. ``n_rows``: how many rows to
    allocate the records for (``_collect``; without it, or if wrong, the pieces are concatenated: more
    memory, the same values).

    **Exactness.** The design columns and every entry of ``GridRecords`` are elementwise functions of each
    record alone (``features.design_columns``, ``_grid_columns``), so the result does not depend on how the
    table is cut into batches: it equals ``grid_records(*design_matrix(...))`` bit for bit (tested in
    tests/unit/test_dp_gd_streaming.py), and Theorem DPGD-GRID's per-record argument is unchanged. Batches
    run on a few threads; every piece lands at its row's position."""
    unit = term_unit(clip, noise_multiplier)
    budget = clip / unit

    def job(batch: Mapping[str, np.ndarray]) -> Job:
        m = _batch_rows(batch)

        def produce() -> list[_GridBatch]:
            pieces = []
            for lo in range(0, m, GRID_ROWS):
                columns, labels = design(
                    {name: column[lo : lo + GRID_ROWS] for name, column in batch.items()}
                )
                pieces.append(_grid_columns(columns, np.asarray(labels, dtype=float), budget))
            return pieces

        return m, produce

    return _collect(map(job, batches), d, n_rows or 0, unit, budget)


def _row_roots(records: GridRecords, pool: ThreadPoolExecutor | None = None) -> np.ndarray:
    """√N_i = ‖û_i‖ per record (N_i = Σ_j û_ij² is an exact integer < 2^53 in float64), block by block."""
    n = records.rows.shape[0]
    roots = np.empty(n)

    def block(span: tuple[int, int]) -> None:
        rows = records.rows.T[:, span[0] : span[1]].astype(np.float64)
        squared = np.zeros(span[1] - span[0])
        for column in rows:
            squared += column * column
        np.sqrt(squared, out=roots[span[0] : span[1]])

    spans = [(lo, min(lo + BLOCK_ROWS, n)) for lo in range(0, n, BLOCK_ROWS)]
    for _ in _ordered_map(block, spans, pool if len(spans) > 1 else None):
        pass
    return roots


def _caps(budget: float, roots: np.ndarray) -> np.ndarray:
    """k̄_i = ⌊F/√N_i·(1 − 2⁻⁴⁰)⌋ (0 for N_i = 0): the formula of ``grid_records``, from precomputed √N_i."""
    with np.errstate(divide="ignore"):
        cap = np.floor(budget / roots * (1.0 - 2.0**-40))
    caps: np.ndarray = np.where(roots > 0, cap, 0.0)
    return caps


def regrid(records: GridRecords, clip: float, noise_multiplier: float | None = None) -> GridRecords:
    """``records`` on the term grid of another clip norm: the same ``grid_records`` formulas for ω, k̄_i and
    the chunk (rows, scales and labels do not depend on C), without redoing the per-row work."""
    unit = term_unit(clip, noise_multiplier)
    budget = clip / unit
    cap = _caps(budget, _row_roots(records))
    return replace(records, cap=cap, unit=unit, chunk=_term_chunk(budget))


def _dot_bits(d: int) -> int:
    """r with d·2^(ROW_BITS + r) ≤ 2^52: û_i·θ_int is then an exact integer in float64 (any order, FMA)."""
    return 52 - ROW_BITS - max(0, math.ceil(math.log2(max(d, 1))))


@dataclass(frozen=True)
class _Probe:
    """One step's public inputs to the per-record pass: θ̂ = θ_int·2^shift (θ_int None when θ = 0), the
    loss, the term grid (ω, F, chunk), whether k̄ comes from √N_i at this F (adaptive clipping) and the clip
    norm to count at (None: no count)."""

    theta_int: np.ndarray | None
    shift: int
    loss: Loss
    unit: float
    budget: float
    chunk: int
    caps_from_roots: bool
    count_clip: float | None


@dataclass(frozen=True)
class _Workspace:
    """One thread's buffers for ``_block_pass`` (blocks of at most ``size`` rows): the block's rows in
    float64 and eight vectors, reused for every block of a run, so the per-step pass allocates (almost)
    nothing."""

    size: int
    block: np.ndarray
    dots: np.ndarray
    work: np.ndarray
    margins: np.ndarray
    scalars: np.ndarray
    magnitude: np.ndarray
    caps: np.ndarray
    coefficient: np.ndarray
    norms: np.ndarray

    @classmethod
    def new(cls, d: int, size: int) -> _Workspace:
        return cls(size, np.empty((d, size)), *(np.empty(size) for _ in range(8)))


Workspaces = dict[int, _Workspace]
"""Per-thread workspaces of one run (keyed by ``threading.get_ident()``)."""


def _scalar_grad_into(
    margins: np.ndarray, labels: np.ndarray, loss: Loss, out: np.ndarray, work: np.ndarray
) -> np.ndarray:
    """``_scalar_grad`` into ``out``: the same ufuncs on the same operands in the same order (only the
    destination buffers differ), so the same values."""
    if loss == "logistic":
        np.multiply(labels, margins, out=out)
        np.logaddexp(0.0, out, out=out)
        np.negative(out, out=out)
        np.exp(out, out=out)
        np.negative(labels, out=work)
        np.multiply(work, out, out=out)
        return out
    np.subtract(margins, labels, out=out)
    return out


def _block_pass(
    records: GridRecords,
    probe: _Probe,
    roots: np.ndarray | None,
    spaces: Workspaces,
    span: tuple[int, int],
) -> tuple[np.ndarray, int]:
    """(Σ_{i in block} k_i·û_i as an exact int64 vector, #{i in block : ‖∇ℓ_i(θ̂)‖ ≤ count_clip}).

    Per record, all elementwise (a function of the record and the public probe only): the margin
    x̂_iᵀθ̂ = ν_i·2^shift·(û_i·θ_int), where û_i·θ_int = Σ_j û_ij·θ_int,j is accumulated column by column
    in float64 — every product and partial sum is an integer < 2^52, so it is exact and the same as any
    BLAS order; s_i (``_scalar_grad``), κ_i = s_i·ν_i, k_i = sign(κ_i)·min(rint(|κ_i|/ω), k̄_i), NaN → 0.
    The block's sum is taken ``chunk`` rows at a time by BLAS (each |k_i·û_ij| ≤ F, so every partial sum is
    an integer < 2^52: exact in any order) and the chunks are added in int64 (|block sum| ≤ m·F < 2^54).
    The count uses ‖∇ℓ_i‖ = |s_i|·√N_i·ν_i, as ``clip_count`` defines it. Every operation writes into the
    thread's workspace (``out=``): the same ufuncs on the same operands as the whole-array formulas.
    """
    lo, hi = span
    m = hi - lo
    d = records.rows.shape[1]
    space = _workspace(spaces, d, m)
    block, scalars, coefficient = _block_coefficients(records, probe, roots, space, span)
    with np.errstate(all="ignore"):
        total = np.zeros(d, dtype=np.int64)
        for start in range(0, m, probe.chunk):
            stop = min(start + probe.chunk, m)
            total += (block[:, start:stop] @ coefficient[start:stop]).astype(np.int64)
        count = 0
        if probe.count_clip is not None:
            assert roots is not None
            lengths, norms = space.work[:m], space.norms[:m]
            np.multiply(roots[lo:hi], records.scale[lo:hi], out=lengths)
            np.abs(scalars, out=norms)
            np.multiply(norms, lengths, out=norms)
            count = int(np.count_nonzero(norms <= probe.count_clip))
    return total, count


def _workspace(spaces: Workspaces, d: int, m: int) -> _Workspace:
    """This thread's workspace, (re)allocated for blocks of at least ``m`` rows of dimension ``d``."""
    ident = threading.get_ident()
    space = spaces.get(ident)
    if space is None or space.size < m or space.block.shape[0] != d:
        space = spaces[ident] = _Workspace.new(d, max(m, BLOCK_ROWS))
    return space


def _block_coefficients(
    records: GridRecords,
    probe: _Probe,
    roots: np.ndarray | None,
    space: _Workspace,
    span: tuple[int, int],
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(the block's rows û_i as float64 (d, m), the scalars s_i, the coefficients k_i) of the records in
    ``span``, each an elementwise function of its record and the public probe (``_block_pass``'s formulas),
    written into ``space``."""
    lo, hi = span
    m = hi - lo
    d = records.rows.shape[1]
    with np.errstate(all="ignore"):
        block = space.block[:, :m]
        np.copyto(block, records.rows.T[:, lo:hi])  # int32 → float64: exact integers
        scale = records.scale[lo:hi]
        margins = space.margins[:m]
        if probe.theta_int is None:
            margins[...] = 0.0
        else:
            dots, work = space.dots[:m], space.work[:m]
            np.multiply(block[0], probe.theta_int[0], out=dots)
            for j in range(1, d):
                np.multiply(block[j], probe.theta_int[j], out=work)
                np.add(dots, work, out=dots)
            np.ldexp(dots, probe.shift, out=margins)
            np.multiply(scale, margins, out=margins)
        labels = records.labels[lo:hi]
        scalars = _scalar_grad_into(margins, labels, probe.loss, space.scalars[:m], space.work[:m])
        magnitude = space.magnitude[:m]
        np.multiply(scalars, scale, out=magnitude)
        np.abs(magnitude, out=magnitude)
        np.divide(magnitude, probe.unit, out=magnitude)
        if probe.caps_from_roots:  # _caps(budget, roots), in place
            assert roots is not None
            root = roots[lo:hi]
            cap = space.caps[:m]
            np.divide(probe.budget, root, out=cap)
            np.multiply(cap, 1.0 - 2.0**-40, out=cap)
            np.floor(cap, out=cap)
            np.copyto(cap, 0.0, where=root <= 0.0)  # √N_i ≥ 0 and never NaN: "not > 0" is "≤ 0"
        else:
            cap = records.cap[lo:hi]
        np.rint(magnitude, out=magnitude)
        np.minimum(magnitude, cap, out=magnitude)
        coefficient = space.coefficient[:m]
        np.sign(scalars, out=coefficient)
        np.multiply(coefficient, magnitude, out=coefficient)
        np.copyto(coefficient, 0.0, where=np.isnan(coefficient))  # never ±∞: k̄_i is finite
    return block, scalars, coefficient


def _probe(
    theta: np.ndarray,
    records: GridRecords,
    loss: Loss,
    clip: float | None = None,
    noise_multiplier: float | None = None,
    count_clip: float | None = None,
) -> _Probe:
    """A step's public probe at a finite θ: θ̂ = θ_int·2^shift (|θ_int| ≤ 2^r, ``_dot_bits``) and the term
    grid of ``clip`` (or of ``records``)."""
    d = records.rows.shape[1]
    peak = float(np.max(np.abs(theta))) if theta.size else 0.0
    theta_int: np.ndarray | None = None
    shift = 0
    if peak != 0.0:
        shift = math.frexp(peak)[1] - _dot_bits(d)
        theta_int = np.rint(np.ldexp(theta, -shift))  # |entries| ≤ 2^r
    if clip is None:
        unit, budget, chunk = records.unit, 0.0, records.chunk
    else:
        unit = term_unit(clip, noise_multiplier)
        budget = clip / unit
        chunk = _term_chunk(budget)
    return _Probe(theta_int, shift, loss, unit, budget, chunk, clip is not None, count_clip)


def _grid_pass(
    theta: np.ndarray,
    records: GridRecords,
    loss: Loss,
    pool: ThreadPoolExecutor | None = None,
    *,
    clip: float | None = None,
    noise_multiplier: float | None = None,
    roots: np.ndarray | None = None,
    count_clip: float | None = None,
    spaces: Workspaces | None = None,
) -> tuple[np.ndarray, int]:
    """One step's per-record pass over all records, block by block: (S = Σ_i k_i·û_i exact, the clipped
    count). With ``clip`` the terms are on the grid of that clip norm (ω = ``term_unit(clip, z)``, k̄_i from
    ``roots`` = √N_i: what ``regrid`` would give, without materialising it); else on ``records``' own grid.
    ``count_clip``: also #{i : ‖∇ℓ_i(θ̂)‖ ≤ count_clip} (needs ``roots``), else the count is 0. Margins and
    scalars are computed once per record for both outputs. S is int64 up to 2^24 rows
    (|S| ≤ n·2^(B+1) ≤ 2^62), else Python integers (object array). A non-finite (public) θ gives (0, 0)."""
    n, d = records.rows.shape
    if not np.all(np.isfinite(theta)):
        return np.zeros(d, dtype=np.int64), 0
    probe = _probe(theta, records, loss, clip, noise_multiplier, count_clip)
    spans = [(lo, min(lo + BLOCK_ROWS, n)) for lo in range(0, n, BLOCK_ROWS)]
    spaces = {} if spaces is None else spaces
    results = _ordered_map(
        lambda span: _block_pass(records, probe, roots, spaces, span), spans, pool if len(spans) > 1 else None
    )
    counted = 0
    if n <= _INT64_ROWS:
        total = np.zeros(d, dtype=np.int64)
        for block_sum, block_count in results:
            total += block_sum
            counted += block_count
        return total, counted
    exact = [0] * d  # Python integers: no overflow
    for block_sum, block_count in results:
        exact = [a + int(b) for a, b in zip(exact, block_sum, strict=True)]
        counted += block_count
    return np.array(exact, dtype=object), counted


def clipped_sum_units(theta: np.ndarray, records: GridRecords, loss: Loss) -> np.ndarray:
    """Σ_i k_i·û_i as an exact int64 vector (units ω): the clipped gradient sum on the term grid.

    κ_i = s_i·ν_i is the coefficient of û_i in ∇ℓ_i(θ̂) = s_i·x̂_i; k_i = sign(κ_i)·min(rint(|κ_i|/ω), k̄_i)
    (κ_i = ±∞ gives ±k̄_i, the limit of clipping; NaN gives 0). Every term ω·k_i·û_i has exact norm < C, so
    the integer sums of neighbours differ by at most Δ/ω in ℓ2 (2C/ω replace-one, C/ω add/remove). The sum is
    exact: each partial sum of a chunk of ``records.chunk`` rows is an integer below 2^52 (BLAS, any order),
    and chunks are added in int64 (Python integers beyond 2^24 rows). A non-finite (public) θ gives 0.
    Computed block by block (``_block_pass``): no n×d float64 temporary.
    """
    return _grid_pass(theta, records, loss)[0]


def clipped_gradient_sum(
    theta: np.ndarray,
    x: np.ndarray,
    y: np.ndarray,
    loss: Loss,
    clip: float,
    row_norms: np.ndarray | None = None,
) -> np.ndarray:
    """Σ_i clip(∇ℓ_i(θ), C) on the term grid ω = ``term_unit(C)``, as float64 (ω × the exact integer sum).

    Each term is the clipped gradient of record i at the rows and θ rounded as in ``grid_records`` /
    ``_block_pass`` (relative error ≲ 2^−12 of C per term), a function of (θ, x_i, y_i) alone, a multiple of ω
    in every coordinate, with exact norm < C, for every θ and every record: ‖S(D) − S(D′)‖ ≤ 2C
    (replace-one) / C (add/remove) holds exactly for the computed sums. ``row_norms`` (‖x_i‖,
    ``safe_row_norms`` when omitted) lets a caller compute them once.
    """
    features, labels = _check_data(x, y)
    records = grid_records(features, labels, clip, row_norms)
    units = clipped_sum_units(np.asarray(theta, dtype=float), records, loss)
    result: np.ndarray = units.astype(np.float64) * records.unit
    return result


# ----- privacy units: each unit's summed gradient is clipped (user-level DP-GD) ----------------------------
@dataclass(frozen=True)
class UnitRecords:
    """The records of a run on a privacy-unit dataset: each unit's kept rows (at most ``max_rows``, chosen by
    the engines' keyed-hash order, ``mechanisms.data.plan.kept_rows``), sorted by unit, as ``GridRecords``;
    ``starts[j]`` is the first record of the j-th unit; ``budget`` is F = C/ω (the clip in term units)."""

    records: GridRecords
    starts: np.ndarray
    budget: float
    ids: np.ndarray | None = None  # the j-th unit's id (int64, increasing); set by ``bound_units``


def bound_units(
    records: GridRecords, units: np.ndarray, order_key: np.ndarray, max_rows: int, clip: float
) -> UnitRecords:
    """Keep each unit's first ``max_rows`` records in the order of ``order_key`` (``ORDER_COLUMN``), ties
    broken by the records' content (label, ν_i, û_i: records equal in all of them give equal terms, so which
    of them is kept changes nothing), and sort the kept records by unit. Which records a unit keeps depends on
    that unit's records only (docs/privacy/units_learners.md#theorem-dpgd-unit)."""
    n = records.rows.shape[0]
    ids, keys = np.asarray(units), np.asarray(order_key)
    if ids.shape != (n,) or keys.shape != (n,):
        raise ValueError("the unit and order columns must have one entry per record")
    ties = [records.labels, records.scale, *records.rows.T]
    kept = kept_rows(ids, keys, ties, max_rows)
    bounded = replace(
        records,
        rows=np.ascontiguousarray(records.rows.T[:, kept]).T,
        scale=records.scale[kept],
        cap=records.cap[kept],
        labels=records.labels[kept],
    )
    starts = unit_starts(ids[kept])
    return UnitRecords(bounded, starts, clip / records.unit, ids[kept][starts].astype(np.int64))


def clip_unit_sums(sums: np.ndarray, budget: float) -> np.ndarray:
    """Each column v of the int64 (d, u) array ``sums`` (a unit's exact gradient sum in term units) clipped
    to ℓ2 norm < F = ``budget`` **exactly**, as int64: v itself when its computed norm is ≤ F' = F(1 − 2(d +
    8)·2⁻⁵³), else trunc(fl(fl(F'/‖v‖_fl)·fl(v_j))) per coordinate (rounding toward zero only shrinks).
    ‖v‖_fl is the square root of the squares summed over the coordinates in order, the same for every unit:
    relative error ≤ (d/2 + 3)·2⁻⁵³, which the shrink covers (docs/privacy/units_learners.md#lemma-unit-clip).
    Every column depends on its own unit alone."""
    d = sums.shape[0]
    values = sums.astype(np.float64)
    squared = np.zeros(sums.shape[1])
    for coordinate in values:  # over the d coordinates: the same order for every unit
        squared += coordinate * coordinate
    norms = np.sqrt(squared)
    limit = budget * (1.0 - (d + 8) * 2.0**-52)
    over = norms > limit
    factor = np.where(over, limit / np.where(over, norms, 1.0), 1.0)
    shrunk = np.trunc(values * factor).astype(np.int64)
    clipped: np.ndarray = np.where(over, shrunk, sums)
    return clipped


def _unit_spans(starts: np.ndarray, n: int) -> list[tuple[int, int, int, int]]:
    """Blocks of whole units, about ``BLOCK_ROWS`` records each: (first unit, end unit, first row, end
    row)."""
    count = starts.size
    if count == 0:
        return []
    targets = np.arange(BLOCK_ROWS, n, BLOCK_ROWS)
    cuts = np.unique(np.concatenate([[0], np.searchsorted(starts, targets, side="left"), [count]]))
    ends = np.append(starts, n)
    return [(int(a), int(b), int(ends[a]), int(ends[b])) for a, b in pairwise(cuts.tolist())]


def _unit_block_vectors(
    bounded: UnitRecords, probe: _Probe, spaces: Workspaces, span: tuple[int, int, int, int]
) -> np.ndarray:
    """W_u = clip(Σ_{i in unit} k_i·û_i, F) for each unit of the block, an exact int64 (d, units) array: the
    per-record terms (``_block_coefficients``, |k_i·û_ij| < F, exact integers in float64) summed per unit
    with ``np.add.reduceat`` in int64 (exact: |unit sum| ≤ max_rows·F < 2^59), clipped (``clip_unit_sums``).
    Column j depends on the block's j-th unit's records and θ alone."""
    first, end, lo, hi = span
    records = bounded.records
    d = records.rows.shape[1]
    space = _workspace(spaces, d, hi - lo)
    block, _, coefficient = _block_coefficients(records, probe, None, space, (lo, hi))
    terms = (block * coefficient).astype(np.int64)
    sums = np.add.reduceat(terms, bounded.starts[first:end] - lo, axis=1)
    return clip_unit_sums(sums, bounded.budget)


def _unit_block_pass(
    bounded: UnitRecords, probe: _Probe, spaces: Workspaces, span: tuple[int, int, int, int]
) -> np.ndarray:
    """Σ over the block's units of W_u (``_unit_block_vectors``), an exact int64 vector (|block sum| ≤
    records·F < 2^63)."""
    total: np.ndarray = _unit_block_vectors(bounded, probe, spaces, span).sum(axis=1, dtype=np.int64)
    return total


def unit_clipped_sum_units(
    theta: np.ndarray,
    bounded: UnitRecords,
    loss: Loss,
    pool: ThreadPoolExecutor | None = None,
    spaces: Workspaces | None = None,
) -> np.ndarray:
    """Σ_u clip(Σ_{i kept in u} k_i·û_i, F) in term units ω, exact: each record's term is the row-level one
    (``clipped_sum_units``: a function of the record and θ, exact norm < C), each unit's sum of its ≤ k
    kept terms is clipped to norm < C exactly (``clip_unit_sums``), and the units' vectors are added as
    integers (int64 up to 2^24 units, else Python integers). So neighbours that differ by one unit differ
    by one vector of norm < C/ω (add/remove), or in one (replace: < 2C/ω). A non-finite θ gives 0."""
    d = bounded.records.rows.shape[1]
    results = _over_unit_blocks(theta, bounded, loss, _unit_block_pass, pool, spaces)
    return np.zeros(d, dtype=np.int64) if results is None else _added(results, d, bounded.starts.size)


def _over_unit_blocks(
    theta: np.ndarray,
    bounded: UnitRecords,
    loss: Loss,
    block_pass: Callable[[UnitRecords, _Probe, Workspaces, tuple[int, int, int, int]], _R],
    pool: ThreadPoolExecutor | None,
    spaces: Workspaces | None,
) -> Iterator[_R] | None:
    """``block_pass`` over the blocks of whole units at θ (the public probe of θ), in block order, on
    ``pool`` when there is more than one block; None for a non-finite θ (every W_u is then 0)."""
    records = bounded.records
    if not np.all(np.isfinite(theta)):
        return None
    probe = _probe(np.asarray(theta, dtype=float), records, loss)
    spans = _unit_spans(bounded.starts, records.rows.shape[0])
    work = {} if spaces is None else spaces
    return _ordered_map(
        lambda span: block_pass(bounded, probe, work, span), spans, pool if len(spans) > 1 else None
    )


def _added(block_sums: Iterable[np.ndarray], d: int, units: int) -> np.ndarray:
    """The exact sum of the blocks' int64 vectors: int64 up to 2^24 units (|sum| < 2^24·F ≤ 2^62), else
    Python integers (object array)."""
    if units <= _INT64_ROWS:
        total = np.zeros(d, dtype=np.int64)
        for block_sum in block_sums:
            total += block_sum
        return total
    exact = [0] * d
    for block_sum in block_sums:
        exact = [a + int(b) for a, b in zip(exact, block_sum, strict=True)]
    return np.array(exact, dtype=object)


def unit_clipped_gradient_sum(
    theta: np.ndarray,
    x: np.ndarray,
    y: np.ndarray,
    units: np.ndarray,
    order_key: np.ndarray,
    max_rows: int,
    loss: Loss,
    clip: float,
) -> np.ndarray:
    """Σ_u clip(Σ_{i kept in u} clip(∇ℓ_i(θ), C), C) as float64 (ω × the exact integer sum): the noiseless
    step of user-level DP-GD on a design matrix in memory, unit ids ``units`` and the bounding order
    ``order_key`` (``bound_units``, ``unit_clipped_sum_units``)."""
    features, labels = _check_data(x, y)
    records = grid_records(features, labels, clip)
    bounded = bound_units(records, units, order_key, max_rows, clip)
    result: np.ndarray = (
        unit_clipped_sum_units(np.asarray(theta, dtype=float), bounded, loss).astype(np.float64)
        * records.unit
    )
    return result


# ----- individual accounting: each unit pays for its own clipped vector, step by step -----------------------
@dataclass(frozen=True)
class IndividualStep:
    """One step's secret inputs under individual accounting (docs/privacy/individual.md#individual-dp-gd):
    the units' filters as they stand before the step (earlier releases and earlier steps of this run) and
    the ledger units per squared term unit, ``per_square`` ≥ 1e12/(2t²) (t = ``noise_units``)."""

    unit_filter: UnitFilter
    per_square: float


def square_charge(config: DpGdConfig) -> float:
    """``per_square`` of ``IndividualStep``: float_up(1e12/(2t²)) with t the discrete Gaussian's integer
    std in term units, so that a unit whose clipped vector is W pays α‖W‖²/(2t²) (ledger units)."""
    t = noise_units(config)
    return float_up(Fraction(UNITS_PER_EPSILON, 2 * t * t))


def unit_step_charges(vectors: np.ndarray, ids: np.ndarray, per_square: float) -> UnitCharges:
    """Each unit's α-slope ⌈‖W_u‖²·per_square⌉ in ledger units (``slope_units``), from its clipped vector
    W_u, a column of the exact int64 (d, u) ``vectors`` (|entries| < F < 2^39: exact in doubles). ‖W_u‖²
    is summed over the coordinates in doubles (d roundings, each ≥ −2⁻⁵³ relative, on non-negative terms)
    and raised by (d + 2)·2⁻⁵², so the value passed on is ≥ the exact integer ‖W_u‖²: rounding can only
    over-charge. Each charge reads its own unit's vector alone."""
    d = vectors.shape[0]
    values = vectors.astype(np.float64)
    squared = np.zeros(values.shape[1])
    for coordinate in values:  # over the d coordinates: the same order for every unit
        squared += coordinate * coordinate
    padded = squared * (1.0 + (d + 2) * 2.0**-52)
    return UnitCharges(ids, np.zeros(ids.size, dtype=np.int64), slope_units(padded, per_square))


def _individual_block_pass(
    bounded: UnitRecords,
    probe: _Probe,
    spaces: Workspaces,
    span: tuple[int, int, int, int],
    step: IndividualStep,
) -> tuple[np.ndarray, UnitCharges]:
    """(Σ W_u over the block's units whose filter affords their own charge, the charges of those units
    that pay something). The Feldman–Zrnic rule (``UnitFilter.admits``) is applied before anything of the
    step is released; an excluded unit's W_u is left out of the sum and it pays nothing."""
    first, end, _, _ = span
    assert bounded.ids is not None
    vectors = _unit_block_vectors(bounded, probe, spaces, span)
    charges = unit_step_charges(vectors, bounded.ids[first:end], step.per_square)
    admitted = step.unit_filter.admits(charges)
    total: np.ndarray = vectors[:, admitted].sum(axis=1, dtype=np.int64)
    return total, charges.subset(admitted & (charges.slope > 0))


def _joined(parts: Sequence[UnitCharges]) -> UnitCharges:
    """Charges of disjoint blocks of units given in increasing unit order, as one ``UnitCharges``."""
    if not parts:
        return UnitCharges.empty()
    return UnitCharges(
        np.concatenate([c.units for c in parts]),
        np.concatenate([c.pure for c in parts]),
        np.concatenate([c.slope for c in parts]),
    )


def individual_clipped_sum_units(
    theta: np.ndarray,
    bounded: UnitRecords,
    loss: Loss,
    step: IndividualStep,
    pool: ThreadPoolExecutor | None = None,
    spaces: Workspaces | None = None,
) -> tuple[np.ndarray, UnitCharges]:
    """(Σ_{u admitted} W_u exact in term units, the admitted units' charges): ``unit_clipped_sum_units``
    over the units whose filter affords α‖W_u‖²/(2t²) at this θ (``_individual_block_pass``). A non-finite
    θ gives the zero sum and charges nobody (every W_u is then 0)."""
    d = bounded.records.rows.shape[1]

    def block_pass(
        bounded: UnitRecords, probe: _Probe, work: Workspaces, span: tuple[int, int, int, int]
    ) -> tuple[np.ndarray, UnitCharges]:
        return _individual_block_pass(bounded, probe, work, span, step)

    results = _over_unit_blocks(theta, bounded, loss, block_pass, pool, spaces)
    if results is None:
        return np.zeros(d, dtype=np.int64), UnitCharges.empty()
    found = list(results)
    total = _added((block_sum for block_sum, _ in found), d, bounded.starts.size)
    return total, _joined([charges for _, charges in found])


def _individual_run(
    config: DpGdConfig,
    d: int,
    build: Callable[[float, float | None], GridRecords | UnitRecords],
    n_norm: float,
    noise: Noise,
    progress: ProgressFn,
    unit_filter: UnitFilter,
) -> tuple[np.ndarray, UnitCharges]:
    """``_fixed_run`` under individual accounting: (the iterates θ₁…θ_T, what each unit paid over the T
    steps). The same draws, made first; at step t each unit takes part iff its filter, updated by its
    charges of the steps before (``UnitFilter.after``), affords its own charge at θ_t."""
    if config.neighboring != "add_remove" or config.adaptive is not None:
        raise ValueError("individual accounting is for add/remove datasets with a fixed clip")
    draws = discrete_gaussian_std(noise, noise_units(config), config.steps * d).reshape(config.steps, d)
    built = build(config.clip, config.noise_multiplier)
    if not isinstance(built, UnitRecords):
        raise ValueError("individual accounting needs a privacy unit")
    per_square = square_charge(config)
    current, paid = unit_filter, UnitLedger.empty()
    theta = np.zeros(d)
    iterates = np.empty((config.steps, d))
    spaces: Workspaces = {}
    with _thread_pool() as pool:
        for t in range(config.steps):
            step = IndividualStep(current, per_square)
            units, charges = individual_clipped_sum_units(theta, built, config.loss, step, pool, spaces)
            current, paid = current.after(charges), paid.charged(charges)
            theta = _next_iterate(config, theta, _noisy_sum(units, draws[t], built.records.unit), n_norm)
            iterates[t] = theta
            progress((t + 1) / config.steps)
    return iterates, paid.spent


def individual_dp_gd_train(
    config: DpGdConfig,
    x: np.ndarray,
    y: np.ndarray,
    units: np.ndarray,
    order_key: np.ndarray,
    max_rows: int,
    n_norm: float,
    noise: Noise,
    unit_filter: UnitFilter,
    progress: ProgressFn = no_progress,
) -> tuple[np.ndarray, UnitCharges]:
    """User-level DP-GD under individual accounting on a design matrix in memory (unit ids ``units``
    (int64), bounding order ``order_key``): (the iterates, shape (T, d); each unit's total charge over the
    run, sorted by unit). ``dp_gd_train``'s noise draws, so the same ``Noise`` gives the run of
    ``unit_clipped_sum_units`` without the excluded units' vectors
    (docs/privacy/individual.md#individual-dp-gd)."""
    features, labels = _check_data(x, y)
    _check_normaliser(n_norm)
    d = features.shape[1]
    _check_finite(config, d, n_norm)

    def build(clip: float, noise_multiplier: float | None) -> UnitRecords:
        records = grid_records(features, labels, clip, noise_multiplier=noise_multiplier)
        return bound_units(records, np.asarray(units, dtype=np.int64), order_key, max_rows, clip)

    return _individual_run(config, d, build, n_norm, noise, progress, unit_filter)


def reported_unit_ids(schema: DatasetSchema, values: np.ndarray) -> np.ndarray:
    """A batch's unit ids as ``aggregate_units`` reports them (int64; an int column clipped to its public
    bounds, which changes nothing on a snapshot: ingest refuses ids outside them), so that a unit's
    charges from ``dp_gd`` and from the queries land on the same filter."""
    unit = schema.privacy_unit
    assert unit is not None
    data = np.asarray(values)
    for _, low, high in clip_bounds(schema, [unit.column]):
        data = np.clip(data.astype(np.int64), int(low), int(high))
    return data.astype(np.int64)


def objective(theta: np.ndarray, x: np.ndarray, y: np.ndarray, loss: Loss, reg: float) -> float:
    """Regularised empirical risk (1/n)Σ ℓ_i(θ) + (λ/2)‖θ‖² (non-private; for evaluation and tests)."""
    features, labels = _check_data(x, y)
    th = np.asarray(theta, dtype=float)
    margin = features @ th
    if loss == "logistic":
        risk = float(np.mean(np.logaddexp(0.0, -labels * margin)))
    elif loss == "squared":
        risk = float(np.mean(0.5 * (margin - labels) ** 2))
    else:
        raise ValueError(f"loss must be 'logistic' or 'squared', got {loss!r}")
    return risk + 0.5 * reg * float(th @ th)


RecordsBuilder = Callable[[float, float | None], GridRecords]
"""(clip norm C, noise multiplier z) ↦ the run's ``GridRecords`` on the grid of (C, z); reads the data."""


def _check_normaliser(n_norm: float) -> None:
    if not (math.isfinite(n_norm) and n_norm > 0.0):
        raise ValueError(f"n_norm must be finite and > 0, got {n_norm!r}")


def _check_finite(config: DpGdConfig, d: int, n_norm: float) -> None:
    problem = finiteness_problem(config, d, n_norm)
    if problem is not None:
        raise ValueError(f"{problem[0]}: {problem[1]}")


def _noisy_sum(units: np.ndarray, draw: np.ndarray, unit: float) -> np.ndarray:
    """ω·(S_t + Z_t) as float64: the exact integer release, rounded to float once (post-processing)."""
    if units.dtype == object:  # more than 2^24 rows: Python integers
        return np.array([float(u) for u in units + draw.astype(object)]) * unit
    # |S| ≤ 2^62 − 2^61 and |Z| ≤ 513·2^52: the int64 sum is exact, then rounded to float once
    result: np.ndarray = (units + draw).astype(np.float64) * unit
    return result


def _step_sum(
    theta: np.ndarray,
    built: GridRecords | UnitRecords,
    loss: Loss,
    pool: ThreadPoolExecutor | None,
    spaces: Workspaces,
) -> tuple[np.ndarray, float]:
    """One step's exact clipped sum in term units and the unit ω: per record, or per unit (user level)."""
    if isinstance(built, UnitRecords):
        return unit_clipped_sum_units(theta, built, loss, pool, spaces), built.records.unit
    return _grid_pass(theta, built, loss, pool, spaces=spaces)[0], built.unit


def _next_iterate(config: DpGdConfig, theta: np.ndarray, noisy_sum: np.ndarray, n_norm: float) -> np.ndarray:
    """θ_{t+1} = Π_K(θ_t − τ(noisy sum/n_norm + λθ_t)): post-processing of the released noisy sum."""
    theta = theta - config.step_size * (noisy_sum / n_norm + config.reg * theta)
    if config.radius is not None:
        theta = project_to_ball(theta, config.radius)
    return theta


def _fixed_run(
    config: DpGdConfig,
    d: int,
    build: Callable[[float, float | None], GridRecords | UnitRecords],
    n_norm: float,
    noise: Noise,
    progress: ProgressFn,
) -> np.ndarray:
    """Clipped DP-GD at the fixed clip norm: the iterates θ₁…θ_T, shape (T, d). All T·d noise draws are made
    before ``build`` reads the data; each step is one exact integer clipped sum (``_step_sum``: per record,
    or per unit on a privacy-unit dataset) plus its draw."""
    draws = discrete_gaussian_std(noise, noise_units(config), config.steps * d).reshape(config.steps, d)
    theta = np.zeros(d)
    iterates = np.empty((config.steps, d))
    built = build(config.clip, config.noise_multiplier)
    spaces: Workspaces = {}
    with _thread_pool() as pool:
        for t in range(config.steps):
            units, unit = _step_sum(theta, built, config.loss, pool, spaces)
            theta = _next_iterate(config, theta, _noisy_sum(units, draws[t], unit), n_norm)
            iterates[t] = theta
            progress((t + 1) / config.steps)
    return iterates


def _adaptive_run(
    config: DpGdConfig, d: int, build: RecordsBuilder, n_norm: float, noise: Noise, progress: ProgressFn
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Adaptive-clipping DP-GD: (iterates, clip norms C₀…C_{T−1}, noisy counts b̃₀…b̃_{T−1}).

    Per step, one ``_grid_pass`` computes each record's margin and scalar once and from them both the exact
    clipped sum on the grid of C_t (k̄_i from √N_i, computed once per run: the ``regrid`` formulas) and the
    clipped count; before, each step re-gridded all rows and evaluated the per-record gradients twice. The
    values are the same (the same elementwise formulas), and so are the noise draws and their order: the
    T count draws first, then per step the gradient draw after the sum."""
    assert config.adaptive is not None
    z_g = gradient_multiplier(config)
    count_units = count_noise_units(config.noise_multiplier, config.adaptive.count_share)
    count_draws = discrete_gaussian_std(noise, count_units, config.steps)
    records = build(config.clip, z_g)
    theta = np.zeros(d)
    iterates = np.empty((config.steps, d))
    clips = np.empty(config.steps)
    counts = np.empty(config.steps, dtype=np.int64)
    clip = config.clip
    spaces: Workspaces = {}
    with _thread_pool() as pool:
        roots = _row_roots(records, pool)
        for t in range(config.steps):
            units, count = _grid_pass(
                theta,
                records,
                config.loss,
                pool,
                clip=clip,
                noise_multiplier=z_g,
                roots=roots,
                count_clip=clip,
                spaces=spaces,
            )
            draw = discrete_gaussian_std(noise, noise_units(config, clip), d)
            noisy_sum = _noisy_sum(units, draw, term_unit(clip, z_g))
            noisy_count = count + int(count_draws[t])
            clips[t], counts[t] = clip, noisy_count
            theta = theta - config.step_size * (noisy_sum / n_norm + config.reg * theta)
            if config.radius is not None:
                theta = project_to_ball(theta, config.radius)
            iterates[t] = theta
            clip = next_clip(config, clip, noisy_count, n_norm)
            progress((t + 1) / config.steps)
    return iterates, clips, counts


def _in_memory(features: np.ndarray, labels: np.ndarray) -> RecordsBuilder:
    def build(clip: float, noise_multiplier: float | None) -> GridRecords:
        return grid_records(features, labels, clip, noise_multiplier=noise_multiplier)

    return build


def dp_gd_train(
    config: DpGdConfig,
    x: np.ndarray,
    y: np.ndarray,
    n_norm: float,
    noise: Noise,
    progress: ProgressFn = no_progress,
    *,
    return_iterates: bool = False,
) -> np.ndarray:
    """Run clipped DP-GD from θ₀ = 0 and return the final θ (shape (d,)).

    Each step's noisy sum is ω·(S_t + Z_t): S_t the exact integer clipped sum on the term grid ω
    (``clipped_sum_units``) and Z_t ~ N_Z(0, t²)^d, t = ``noise_units(config)`` (exact discrete Gaussian,
    ``mechanisms.noise.learners``). The noise does not depend on the data, so all T·d draws are made in one
    vectorised call before the data is read. The iterates are a deterministic function of the grid-valued
    noisy sums and public parameters (post-processing, docs/privacy/finite_precision.md#finite-precision).

    ``n_norm`` is a **public** normaliser (see the module docstring). With ``return_iterates=True`` the
    result is every released iterate θ₁ … θ_T, shape (T, d) (all are post-processing of the noisy sums).
    With ``config.radius`` set, every iterate is projected onto {‖θ‖ ≤ r} (post-processing) and
    ``finiteness_problem`` (public) must pass first, else ValueError.
    ``progress((t+1)/T)`` is called after every step.
    """
    features, labels = _check_data(x, y)
    _check_normaliser(n_norm)
    d = features.shape[1]
    _check_finite(config, d, n_norm)
    if config.adaptive is not None:
        return _adaptive_train(config, features, labels, n_norm, noise, progress, return_iterates)
    path = _fixed_run(config, d, _in_memory(features, labels), n_norm, noise, progress)
    return path if return_iterates else path[-1].copy()


def clip_count(theta: np.ndarray, records: GridRecords, loss: Loss, clip: float) -> int:
    """#{i : ‖∇ℓ_i(θ)‖ ≤ C} on the grid rows x̂_i (each indicator a function of its own record and the public
    θ, C only, so one record moves the count by at most 1). A NaN norm counts as above C. ‖∇ℓ_i‖ is
    |s_i|·(√N_i·ν_i), s_i at the grid margin (as in ``clipped_sum_units``)."""
    return _grid_pass(theta, records, loss, roots=_row_roots(records), count_clip=clip)[1]


def next_clip(config: DpGdConfig, clip: float, noisy_count: int, n_norm: float) -> float:
    """C_{t+1} = clamp(C_t·exp(−η(b̃_t/n_norm − γ)), [clip_min, clip_max]): post-processing of b̃_t."""
    assert config.adaptive is not None
    a = config.adaptive
    exponent = -a.learning_rate * (noisy_count / n_norm - a.target_quantile)
    exponent = min(max(exponent, -50.0), 50.0)
    return float(min(max(clip * math.exp(exponent), a.clip_min), a.clip_max))


def _adaptive_train(
    config: DpGdConfig,
    features: np.ndarray,
    labels: np.ndarray,
    n_norm: float,
    noise: Noise,
    progress: ProgressFn,
    return_iterates: bool,
) -> np.ndarray:
    """``dp_gd_train`` with private adaptive clipping: per step the noisy clipped sum at C_t (exact discrete
    Gaussian of ⌈z_gΔ(C_t)/ω_t⌉ units) and the noisy count b̃_t (N_Z(0, t_b²), t_b = ⌈σ_b⌉); C_{t+1} from
    b̃_t (``next_clip``). Returns the iterates (or the final θ); ``adaptive_dp_gd_train`` also returns the
    clip path and the noisy counts."""
    path, _, _ = adaptive_dp_gd_train(config, features, labels, n_norm, noise, progress)
    return path if return_iterates else path[-1].copy()


def adaptive_dp_gd_train(
    config: DpGdConfig,
    x: np.ndarray,
    y: np.ndarray,
    n_norm: float,
    noise: Noise,
    progress: ProgressFn = no_progress,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Adaptive-clipping DP-GD: (iterates θ₁…θ_T of shape (T, d), clip norms C₀…C_{T−1}, noisy counts
    b̃₀…b̃_{T−1}). All three are released (post-processing of the noisy sums and counts)."""
    assert config.adaptive is not None
    features, labels = _check_data(x, y)
    d = features.shape[1]
    _check_finite(config, d, n_norm)
    return _adaptive_run(config, d, _in_memory(features, labels), n_norm, noise, progress)


def _rows_hint(table: Table, label: str) -> int | None:
    """How many rows to allocate the records for: the table's ``n_rows`` when it states one (a Parquet
    snapshot's footer), else the in-memory label column's length. It only sizes memory (a wrong hint costs a
    copy, never a value) and is never released: under add_remove the row count is private."""
    if isinstance(table, BatchedTable):
        hint = getattr(table, "n_rows", None)
        return hint if isinstance(hint, int) and hint >= 0 else None
    return int(np.asarray(table[label]).size)


# ----- the service mechanism "dp_gd" ------------------------------------------------------------------------
class DpGdParams(FeatureSpec):
    """Public parameters of clipped DP-GD (the columns come from ``FeatureSpec``)."""

    model: Literal["logistic", "ridge"] = Field(
        default="logistic",
        description="logistic regression (labels ±1) or ridge least squares (squared loss)",
    )
    task: Literal["regression", "classification"] | None = Field(
        default=None,
        description="label handling (mechanisms.learners.features); default: classification for logistic, "
        "regression for ridge. Logistic needs classification.",
    )
    regularization: StrictFloat = Field(
        default=0.01, ge=0, le=1e6, allow_inf_nan=False, description="ridge λ ≥ 0"
    )
    steps: StrictInt = Field(ge=1, le=10_000, description="number of gradient steps T")
    step_size: StrictFloat | None = Field(
        default=None,
        gt=0,
        le=1e6,
        allow_inf_nan=False,
        description="step τ; default 1/L, public smoothness bound L = X² + λ (ridge), X²/4 + λ (logistic)",
    )
    clip: StrictFloat = Field(
        default=1.0, ge=1e-9, le=1e6, allow_inf_nan=False, description="per-example gradient norm bound C"
    )
    noise_multiplier: StrictFloat | None = Field(
        default=None,
        gt=0,
        le=1e6,
        allow_inf_nan=False,
        description="z: noise std z·Δ on the clipped sum (Δ = 2C replace-one, C add/remove). "
        "Give it, or target_epsilon and target_delta.",
    )
    target_epsilon: StrictFloat | None = Field(
        default=None,
        gt=0,
        le=1e4,
        allow_inf_nan=False,
        description="total ε at target_delta (Mironov conversion)",
    )
    target_delta: StrictFloat | None = Field(
        default=None, gt=0, lt=1, allow_inf_nan=False, description="δ of the total (ε, δ) target"
    )
    row_norm: StrictFloat = Field(
        default=1.0,
        ge=1e-6,
        le=1e6,
        allow_inf_nan=False,
        description="rows of the design matrix clipped to this ℓ2 norm",
    )
    max_norm: StrictFloat | None = Field(
        default=None,
        gt=0,
        le=1e12,
        allow_inf_nan=False,
        description="radius r of the public ball the iterates are projected onto (post-processing). Default: "
        "a bound on the norm of the optimum, X/λ (logistic) or max(B, min(1/√λ, C/λ)) (ridge); required when "
        "regularization = 0",
    )
    n_hint: StrictInt | None = Field(
        default=None,
        ge=1,
        le=10**12,
        description="required on add_remove datasets and on every privacy-unit dataset (refused on "
        "row-level replace_one datasets): a PUBLIC row-count estimate that normalises the gradient sum (the "
        "true count is private); affects utility only",
    )
    return_iterates: StrictBool = Field(
        default=False, description="release every noisy iterate, not only the final one"
    )
    clipping: Literal["fixed", "adaptive"] = Field(
        default="fixed",
        description="fixed: clip norm C throughout; adaptive: C is the initial norm and follows a privately "
        "estimated target_quantile of the gradient norms (Andrew et al. 2021), at the same privacy cost",
    )
    target_quantile: StrictFloat = Field(
        default=0.9, gt=0, lt=1, allow_inf_nan=False, description="adaptive: the gradient-norm quantile γ"
    )
    clip_learning_rate: StrictFloat = Field(
        default=1.0, gt=0, le=10, allow_inf_nan=False, description="adaptive: geometric step η of the clip"
    )
    count_noise_share: StrictFloat = Field(
        default=0.05,
        gt=0,
        lt=1,
        allow_inf_nan=False,
        description="adaptive: share φ of the per-step privacy spent on the clipped count (count noise std "
        "z/√φ, gradient multiplier z/√(1 − φ))",
    )

    @model_validator(mode="after")
    def _one_noise_spec(self) -> Self:
        target = self.target_epsilon is not None or self.target_delta is not None
        if (self.noise_multiplier is None) == (not target):
            raise ValueError("give exactly one of: noise_multiplier, or target_epsilon with target_delta")
        if target and (self.target_epsilon is None or self.target_delta is None):
            raise ValueError("target_epsilon and target_delta go together")
        return self


class DpGdMechanism(ParamsChecked):
    """Clipped Gaussian DP gradient descent (full batch), the baseline ``rgm.gd`` is measured against
    (docs/mechanisms/rgm_gd.md; Theorem DPGD, docs/privacy/gradient_descent.md#theorem-dpgd). On a
    privacy-unit dataset each unit's summed gradient is clipped instead
    (docs/privacy/units_learners.md#theorem-dpgd-unit); under individual accounting each unit pays its own
    clipped gradient's charge per step and is left out of the steps it cannot afford
    (docs/privacy/individual.md#individual-dp-gd-proof)."""

    name: ClassVar[str] = "dp_gd"
    summary: ClassVar[str] = (
        "Logistic or ridge regression by full-batch gradient descent with per-example clipping and Gaussian "
        "noise (Rényi DP, T·α/(2z²))."
    )
    params_model: ClassVar[type[BaseModel]] = DpGdParams
    cost_parameter: ClassVar[str] = "noise_multiplier"
    cost_increases_with_parameter: ClassVar[bool] = False
    long_running: ClassVar[bool] = True
    progress_is_public: ClassVar[bool] = True

    def cost_knob(self, p: DpGdParams) -> tuple[str, bool]:
        """What a refusal's ``affordable`` searches: the largest target_epsilon that fits when the request
        gives a target, else the smallest noise_multiplier."""
        return ("target_epsilon", True) if p.target_epsilon is not None else ("noise_multiplier", False)

    def check(self, p: DpGdParams, ctx: PublicContext) -> None:
        check_features(p, ctx, learner_task(p.model, p.task))
        if ctx.schema.privacy_unit is not None:
            self._check_unit(p, ctx.schema.privacy_unit.column)
        elif ctx.schema.neighboring == "replace_one":
            if p.n_hint is not None:
                raise ParamsError("n_hint", "only for add_remove datasets (the row count is public here)")
        elif p.n_hint is None:
            raise ParamsError(
                "n_hint", "required on add_remove datasets: a public row-count estimate (n is private)"
            )
        self._config(p, ctx)

    @staticmethod
    def _check_unit(p: DpGdParams, column: str) -> None:
        """On a privacy-unit dataset: per-unit clipping needs a fixed clip, the unit's id is not a feature,
        and the normaliser is a public hint (the row count is private whatever the relation)."""
        if column in p.features:
            field = f"features[{p.features.index(column)}]"
            raise ParamsError(field, f"{column!r} identifies the privacy unit; it is not a feature")
        if column == p.label:
            raise ParamsError("label", f"{column!r} identifies the privacy unit; it is not a label")
        if p.clipping == "adaptive":
            raise ParamsError(
                "clipping",
                "adaptive clipping has no analysis for privacy units yet (its clipped count is per row); use "
                "clipping 'fixed': each unit's summed gradient is clipped to clip",
            )
        if p.n_hint is None:
            raise ParamsError(
                "n_hint",
                "required on a privacy-unit dataset: a public estimate of the rows the gradient sums over "
                "(the row count is private)",
            )

    def _config(self, p: DpGdParams, ctx: PublicContext) -> DpGdConfig:
        if p.noise_multiplier is not None:
            z = p.noise_multiplier
        else:
            assert p.target_epsilon is not None
            assert p.target_delta is not None
            try:
                z = noise_multiplier_for(p.target_epsilon, p.target_delta, p.steps, ctx.orders)
            except ValueError as error:
                raise ParamsError("target_epsilon", str(error)) from error
        curvature = p.row_norm**2 if p.model == "ridge" else p.row_norm**2 / 4.0
        tau = p.step_size if p.step_size is not None else 1.0 / (curvature + p.regularization)
        loss: Loss = "squared" if p.model == "ridge" else "logistic"
        radius = p.max_norm
        if radius is None:
            top = p.clip if p.clipping == "fixed" else ADAPTIVE_CLIP_MAX
            radius = default_radius(loss, p.regularization, p.row_norm, top)
        if radius is None:
            raise ParamsError(
                "max_norm",
                "required when regularization = 0: the iterates are projected onto a public ball, and "
                "without a ridge term no public bound on the optimum's norm exists",
            )
        if not math.isfinite(radius):
            raise ParamsError("regularization", "the default iterate radius overflows: raise regularization")
        adaptive = None
        if p.clipping == "adaptive":
            adaptive = AdaptiveClip(p.target_quantile, p.clip_learning_rate, p.count_noise_share)
            if not adaptive.clip_min <= p.clip <= adaptive.clip_max:
                raise ParamsError(
                    "clip", f"the initial clip must be in [{adaptive.clip_min}, {adaptive.clip_max}]"
                )
            if adaptive_split(z, p.count_noise_share)[0] > MAX_NOISE_MULTIPLIER:
                raise ParamsError("noise_multiplier", "z/√(1 − count_noise_share) exceeds 2^20")
            try:
                count_noise_units(z, p.count_noise_share)
            except ValueError as error:  # z/√φ beyond the exact sampler's range: refused before the run
                raise ParamsError("count_noise_share", str(error)) from error
        config = DpGdConfig(
            loss, p.regularization, p.steps, tau, p.clip, z, ctx.schema.neighboring, radius, adaptive
        )
        n_norm = float(ctx.n_rows) if ctx.n_rows is not None else float(p.n_hint or 1)
        problem = finiteness_problem(config, dimension(p, ctx), n_norm)
        if problem is not None:
            field, reason = problem
            if field == "regularization" and p.max_norm is not None:
                field = "max_norm"
            raise ParamsError(field, reason)
        return config

    def worst_case(self, p: DpGdParams, ctx: PublicContext) -> RdpCurve:
        return dp_gd_curve(self._config(p, ctx), ctx.schema.neighboring, ctx.orders)

    def individual_worst_case(self, p: DpGdParams, ctx: PublicContext) -> RdpCurve:
        """The most one unit can pay at one step: the curve of one step, α/(2z²) (a unit's charge
        α‖W_u‖²/(2t²) ≤ αF²/(2t²) ≤ α/(2z²), t = ⌈zF⌉). Under individual accounting a run may have more
        steps than one unit can afford (units stop taking part when their filter is spent), so admission
        only asks that a unit with nothing spent could take one step
        (docs/privacy/individual.md#individual-dp-gd-proof)."""
        return dp_gd_curve(replace(self._config(p, ctx), steps=1), ctx.schema.neighboring, ctx.orders)

    def run(
        self,
        p: DpGdParams,
        ctx: PublicContext,
        table: Table,
        noise: Noise,
        progress: ProgressFn = no_progress,
    ) -> Release:
        self.check(p, ctx)
        config = self._config(p, ctx)
        worst = dp_gd_curve(config, ctx.schema.neighboring, ctx.orders)
        public_n = ctx.n_rows if ctx.n_rows is not None else p.n_hint
        if public_n is None:
            raise ParamsError("n_hint", "a public row count is needed to normalise the gradient")
        n_norm = float(public_n)
        task = learner_task(p.model, p.task)
        d = dimension(p, ctx)

        unit = ctx.schema.privacy_unit
        individual = individual_table(ctx, table)  # with the units' filters on an individual dataset (secret)
        unit_filter = None if individual is None else individual.filter
        source = table if individual is None else individual.table
        ids: list[np.ndarray] = []
        keys: list[np.ndarray] = []

        def batches() -> Iterator[Mapping[str, np.ndarray]]:
            extra = () if unit is None else (unit.column, ORDER_COLUMN)
            for batch in table_batches(p, source, extra=extra):
                if unit is not None:  # each record's unit and bounding order, in record order
                    raw = np.asarray(batch[unit.column])
                    ids.append(raw if unit_filter is None else reported_unit_ids(ctx.schema, raw))
                    keys.append(np.asarray(batch[ORDER_COLUMN]))
                yield batch

        def build_rows(clip: float, noise_multiplier: float | None) -> GridRecords:
            # the design matrix batch by batch (a Parquet snapshot streams; a dict is sliced): the records
            # are bit for bit those of grid_records(*design_matrix(...)), in bounded memory
            return grid_records_from_batches(
                batches(),
                lambda batch: design_columns(p, ctx, batch, task, p.row_norm),
                d,
                clip,
                noise_multiplier,
                _rows_hint(source, p.label),
            )

        def build(clip: float, noise_multiplier: float | None) -> GridRecords | UnitRecords:
            records = build_rows(clip, noise_multiplier)
            if unit is None:
                return records
            units = np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)
            order_key = np.concatenate(keys) if keys else np.zeros(0, dtype=np.int64)
            return bound_units(records, units, order_key, unit.max_rows, clip)

        clips: np.ndarray | None = None
        counts: np.ndarray | None = None
        charges: UnitCharges | None = None
        _check_finite(config, d, n_norm)
        if unit_filter is not None:
            _check_normaliser(n_norm)
            path, charges = _individual_run(config, d, build, n_norm, noise, progress, unit_filter)
        elif config.adaptive is None:
            _check_normaliser(n_norm)
            path = _fixed_run(config, d, build, n_norm, noise, progress)
        else:
            path, clips, counts = _adaptive_run(config, d, build_rows, n_norm, noise, progress)
        output: dict[str, Any] = {
            "model": p.model,
            "columns": column_names(p, ctx),
            "theta": path[-1].tolist(),
            "steps_run": config.steps,
            "step_size": config.step_size,
            "radius": config.radius,
            "noise_multiplier": config.noise_multiplier,
            "noise_std": released_noise_std(config),
            "noisy_sum_grid": {
                "granularity": term_unit(config.clip, gradient_multiplier(config)),  # the grid really used
                "noise": "discrete Gaussian N_Z(0, t²) in grid units, t = noise_std/granularity",
                "note": "each step's noisy clipped-gradient sum is a multiple of the granularity; theta and "
                "the iterates are deterministic post-processing of those sums",
            },
            "normaliser": n_norm,
            "scale": "coefficients are on the design matrix of mechanisms.learners.features "
            "(features divided by their declared magnitude, rows clipped to row_norm)",
        }
        if unit is not None:
            output["privacy_unit"] = {
                "column": unit.column,
                "max_rows": unit.max_rows,
                "clipping": "per unit: each step sums the gradients of each unit's at most max_rows rows "
                "(chosen by the dataset's secret keyed-hash order) and clips that sum to clip; epsilon "
                "protects a whole unit",
            }
            if unit_filter is not None:
                output["privacy_unit"]["accounting"] = (
                    "individual: in every step a unit's clipped gradient takes part only if the unit's own "
                    "remaining budget affords that step's charge alpha*|clipped gradient|^2/(2*noise_std^2); "
                    "which units took part is not released"
                )
        if clips is not None and counts is not None:
            output["clipping"] = {
                "mode": "adaptive",
                "clip_path": clips.tolist(),
                "noisy_counts": counts.tolist(),
                "count_noise_std": count_noise_units(config.noise_multiplier, p.count_noise_share),
                "gradient_noise_multiplier": gradient_multiplier(config),
                "note": "C_t follows the noisy clipped count (Andrew et al. 2021); noise_std and the grid "
                "granularity below are at the initial clip and scale with C_t",
            }
        if p.return_iterates:
            output["iterates"] = path.tolist()
        # realized = worst case by theorem, not by comparison: every run releases all T noisy sums, so the
        # charge is the composed T·α/(2z²) curve whatever the output (Theorem DPGD,
        # docs/privacy/gradient_descent.md#theorem-dpgd); on an individual dataset it is the public record
        # and ``units`` what each unit paid (docs/privacy/individual.md#individual-dp-gd)
        return Release(output=output, realized=worst, units=charges)
