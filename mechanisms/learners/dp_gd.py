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
Theorem DPGD-ADAPT, docs/privacy.md §8.3.6.1): C follows a privately estimated quantile of the gradient norms
through a noisy clipped count released each step; the count and the gradient share the per-step RDP
α/(2z²), so the charge is unchanged.

Finite precision (docs/privacy.md §10.4.4, Theorem DPGD-GRID): each record's clipped term is rounded to a
public unit ω with its norm checked below C in integers, the step's sum is an exact integer vector (order-
free), and the noise is an exact discrete Gaussian of ⌈zΔ/ω⌉ units; the iterates are post-processing.

``DpGdConfig.neighboring`` fixes the Δ the noise is calibrated to; ``dp_gd_curve`` charges the relation
asked for against the noise actually used, T·α·Δ_asked²/(2(zΔ_noise)²), so a mismatch can only over-charge
(replace_one noise is valid for both relations) and never under-charge.

Floating point (docs/privacy.md §8.3.6). ``clipped_gradient_sum`` computes every per-record term as a
deterministic function of (θ, x_i, y_i) alone whose exact norm is ≤ C, for **every** θ (also huge or
non-finite θ) and every finite or non-finite record: the scalar s_i is clipped as a coefficient
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
from collections.abc import Sequence
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Any, ClassVar, Literal, Self

import numpy as np
from pydantic import BaseModel, Field, StrictBool, StrictFloat, StrictInt, model_validator

from mechanisms.accounting.curve import RdpCurve, pad_up
from mechanisms.accounting.orders import validate_orders
from mechanisms.base import ParamsChecked, ParamsError, ProgressFn, PublicContext, Release, Table, no_progress
from mechanisms.learners.features import (
    FeatureSpec,
    check_features,
    column_names,
    design_matrix,
    dimension,
    learner_task,
)
from mechanisms.learners.relative_gaussian import project_to_ball, ridge_theta_bound
from mechanisms.noise import Noise
from mechanisms.noise.learners import MAX_STD, discrete_gaussian_std

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
    (Theorem DPGD-ADAPT, docs/privacy.md §8.3.6.1).
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
    Δ/Δ' the same for every C_t (Theorem DPGD-ADAPT, docs/privacy.md §8.3.6.1).
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


@dataclass(frozen=True)
class GridRecords:
    """The data prepared once by per-record maps (neighbours stay neighbours; every entry below depends on
    its own record only, never on its position):

    * ``rows``: û_i = rint(2^ROW_BITS·x_i/‖x_i‖) as float64 integers (|entries| ≤ 2^ROW_BITS), 0 for a row
      with a non-finite entry or a norm outside (0, float max];
    * ``scale``: ν_i = ‖x_i‖·2^−ROW_BITS, so the row the gradient sees is x̂_i = ν_i·û_i;
    * ``cap``: k̄_i = ⌊F/√N_i·(1 − 2⁻⁴⁰)⌋, F = C/ω, N_i = ‖û_i‖² (exact integer): any integer |k| ≤ k̄_i
      has k²N_i < F², i.e. ‖ω·k·û_i‖ < C **exactly**;
    * ``labels``: non-finite labels set to 0.
    """

    rows: np.ndarray
    scale: np.ndarray
    cap: np.ndarray
    labels: np.ndarray
    unit: float
    chunk: int  # rows per exact BLAS sum: chunk·F ≤ 2^51, so every partial sum is an integer < 2^52


def grid_records(
    features: np.ndarray,
    labels: np.ndarray,
    clip: float,
    row_norms: np.ndarray | None = None,
    noise_multiplier: float | None = None,
) -> GridRecords:
    norms = safe_row_norms(features) if row_norms is None else np.asarray(row_norms, dtype=float)
    usable = np.isfinite(norms) & (norms > 0.0) & np.all(np.isfinite(features), axis=1)
    features = np.where(usable[:, None], features, 0.0)
    norms = np.where(usable, norms, 0.0)
    labels = np.where(np.isfinite(labels), labels, 0.0)
    peak = np.max(np.abs(features), axis=1) if features.shape[1] else np.zeros(features.shape[0])
    exponent = _power_of_two_exponents(peak)
    unit_rows = np.ldexp(features, -exponent[:, None])  # exact; entries in [−2, 2], the largest ≥ 1
    with np.errstate(all="ignore"):
        lengths = np.linalg.norm(unit_rows, axis=1)
        directions = unit_rows / np.where(usable, lengths, 1.0)[:, None]
    rows = np.where(usable[:, None], np.rint(np.ldexp(directions, ROW_BITS)), 0.0)
    squared = np.sum(rows.astype(np.int64) ** 2, axis=1)  # exact: d·2^36 < 2^63
    unit = term_unit(clip, noise_multiplier)
    budget = clip / unit  # F = C/ω ∈ [2^B, 2^(B+1)), exact
    with np.errstate(divide="ignore"):
        cap = np.floor(budget / np.sqrt(squared.astype(np.float64)) * (1.0 - 2.0**-40))
    cap = np.where(squared > 0, cap, 0.0)
    scale = np.ldexp(norms, -ROW_BITS)
    chunk = 1 << (50 - math.frexp(budget)[1] + 1)
    return GridRecords(rows, scale, cap, labels, unit, chunk)


def regrid(records: GridRecords, clip: float, noise_multiplier: float | None = None) -> GridRecords:
    """``records`` on the term grid of another clip norm: the same ``grid_records`` formulas for ω, k̄_i and
    the chunk (rows, scales and labels do not depend on C), without redoing the per-row work."""
    squared = np.sum(records.rows * records.rows, axis=1)  # exact: integers < 2^53
    unit = term_unit(clip, noise_multiplier)
    budget = clip / unit
    with np.errstate(divide="ignore"):
        cap = np.floor(budget / np.sqrt(squared) * (1.0 - 2.0**-40))
    cap = np.where(squared > 0, cap, 0.0)
    chunk = 1 << (50 - math.frexp(budget)[1] + 1)
    return replace(records, cap=cap, unit=unit, chunk=chunk)


def _dot_bits(d: int) -> int:
    """r with d·2^(ROW_BITS + r) ≤ 2^52: û_i·θ_int is then an exact integer in float64 (any order, FMA)."""
    return 52 - ROW_BITS - max(0, math.ceil(math.log2(max(d, 1))))


def _margins(theta: np.ndarray, records: GridRecords) -> np.ndarray:
    """x̂_iᵀθ̂ with θ̂ = θ rounded to 2^(e−r) (θ is public, e its exponent): û_iᵀθ_int is an exact integer
    (BLAS, any summation order), then scaled by powers of two and ν_i — elementwise, so each margin is a
    function of its own record only, whatever its position (numpy's BLAS matrix-vector product is not: the
    last bits of a row's dot product depend on where the row sits). θ must be finite."""
    peak = float(np.max(np.abs(theta))) if theta.size else 0.0
    if peak == 0.0:
        return np.zeros(records.rows.shape[0])
    shift = math.frexp(peak)[1] - _dot_bits(records.rows.shape[1])
    theta_int = np.rint(np.ldexp(theta, -shift))  # |entries| ≤ 2^r
    dots = records.rows @ theta_int  # exact integers < 2^52
    with np.errstate(over="ignore", invalid="ignore"):
        margins: np.ndarray = records.scale * np.ldexp(dots, shift)
    return margins


def clipped_sum_units(theta: np.ndarray, records: GridRecords, loss: Loss) -> np.ndarray:
    """Σ_i k_i·û_i as an exact int64 vector (units ω): the clipped gradient sum on the term grid.

    κ_i = s_i·ν_i is the coefficient of û_i in ∇ℓ_i(θ̂) = s_i·x̂_i; k_i = sign(κ_i)·min(rint(|κ_i|/ω), k̄_i)
    (κ_i = ±∞ gives ±k̄_i, the limit of clipping; NaN gives 0). Every term ω·k_i·û_i has exact norm < C, so
    the integer sums of neighbours differ by at most Δ/ω in ℓ2 (2C/ω replace-one, C/ω add/remove). The sum is
    exact: each partial sum of a chunk of ``records.chunk`` rows is an integer below 2^52 (BLAS, any order),
    and chunks are added in int64 (Python integers beyond 2^24 rows). A non-finite (public) θ gives 0.
    """
    d = records.rows.shape[1]
    if not np.all(np.isfinite(theta)):
        return np.zeros(d, dtype=np.int64)
    with np.errstate(all="ignore"):
        scalars = _scalar_grad(_margins(theta, records), records.labels, loss)
        magnitude = np.abs(scalars * records.scale) / records.unit
        steps = np.minimum(np.rint(magnitude), records.cap)
        coefficient = np.sign(scalars) * steps
    coefficient = np.where(np.isfinite(coefficient), coefficient, 0.0)
    n, chunk = records.rows.shape[0], records.chunk
    if n <= chunk:
        total: np.ndarray = (records.rows.T @ coefficient).astype(np.int64)
        return total
    blocks = [
        (records.rows[start : start + chunk].T @ coefficient[start : start + chunk]).astype(np.int64)
        for start in range(0, n, chunk)
    ]
    if n <= _INT64_ROWS:  # |total| ≤ n·2^(B+1) ≤ 2^62
        summed: np.ndarray = np.asarray(np.sum(np.stack(blocks), axis=0, dtype=np.int64))
        return summed
    exact = [sum(int(block[j]) for block in blocks) for j in range(d)]  # Python integers: no overflow
    return np.array(exact, dtype=object)


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
    ``_margins`` (relative error ≲ 2^−12 of C per term), a function of (θ, x_i, y_i) alone, a multiple of ω
    in every coordinate, with exact norm < C, for every θ and every record: ‖S(D) − S(D′)‖ ≤ 2C
    (replace-one) / C (add/remove) holds exactly for the computed sums. ``row_norms`` (‖x_i‖,
    ``safe_row_norms`` when omitted) lets a caller compute them once.
    """
    features, labels = _check_data(x, y)
    records = grid_records(features, labels, clip, row_norms)
    units = clipped_sum_units(np.asarray(theta, dtype=float), records, loss)
    result: np.ndarray = units.astype(np.float64) * records.unit
    return result


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
    noisy sums and public parameters (post-processing, docs/privacy.md §10).

    ``n_norm`` is a **public** normaliser (see the module docstring). With ``return_iterates=True`` the
    result is every released iterate θ₁ … θ_T, shape (T, d) (all are post-processing of the noisy sums).
    With ``config.radius`` set, every iterate is projected onto {‖θ‖ ≤ r} (post-processing) and
    ``finiteness_problem`` (public) must pass first, else ValueError.
    ``progress((t+1)/T)`` is called after every step.
    """
    features, labels = _check_data(x, y)
    if not (math.isfinite(n_norm) and n_norm > 0.0):
        raise ValueError(f"n_norm must be finite and > 0, got {n_norm!r}")
    d = features.shape[1]
    problem = finiteness_problem(config, d, n_norm)
    if problem is not None:
        raise ValueError(f"{problem[0]}: {problem[1]}")
    if config.adaptive is not None:
        return _adaptive_train(config, features, labels, n_norm, noise, progress, return_iterates)
    draws = discrete_gaussian_std(noise, noise_units(config), config.steps * d).reshape(config.steps, d)
    theta = np.zeros(d)
    iterates = np.empty((config.steps, d)) if return_iterates else None
    records = grid_records(features, labels, config.clip, noise_multiplier=config.noise_multiplier)
    unit = records.unit
    for t in range(config.steps):
        units = clipped_sum_units(theta, records, config.loss)
        if units.dtype == object:  # more than 2^24 rows: Python integers
            noisy_sum = np.array([float(u) for u in units + draws[t].astype(object)]) * unit
        else:  # |S| ≤ 2^62 − 2^61 and |Z| ≤ 513·2^52: the int64 sum is exact, then rounded to float once
            noisy_sum = (units + draws[t]).astype(np.float64) * unit
        theta = theta - config.step_size * (noisy_sum / n_norm + config.reg * theta)
        if config.radius is not None:
            theta = project_to_ball(theta, config.radius)
        if iterates is not None:
            iterates[t] = theta
        progress((t + 1) / config.steps)
    return iterates if iterates is not None else theta


def clip_count(theta: np.ndarray, records: GridRecords, loss: Loss, clip: float) -> int:
    """#{i : ‖∇ℓ_i(θ)‖ ≤ C} on the grid rows x̂_i (each indicator a function of its own record and the public
    θ, C only, so one record moves the count by at most 1). A NaN norm counts as above C."""
    if not np.all(np.isfinite(theta)):
        return 0
    with np.errstate(all="ignore"):
        scalars = _scalar_grad(_margins(theta, records), records.labels, loss)
        lengths = np.sqrt(np.sum(records.rows * records.rows, axis=1)) * records.scale
        norms = np.abs(scalars) * lengths
    return int(np.count_nonzero(norms <= clip))


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
    return path if return_iterates else path[-1]


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
    problem = finiteness_problem(config, d, n_norm)
    if problem is not None:
        raise ValueError(f"{problem[0]}: {problem[1]}")
    z_g = gradient_multiplier(config)
    count_units = count_noise_units(config.noise_multiplier, config.adaptive.count_share)
    count_draws = discrete_gaussian_std(noise, count_units, config.steps)
    base = grid_records(features, labels, config.clip, noise_multiplier=z_g)
    theta = np.zeros(d)
    iterates = np.empty((config.steps, d))
    clips = np.empty(config.steps)
    counts = np.empty(config.steps, dtype=np.int64)
    clip = config.clip
    for t in range(config.steps):
        records = base if t == 0 else regrid(base, clip, z_g)
        units = clipped_sum_units(theta, records, config.loss)
        draw = discrete_gaussian_std(noise, noise_units(config, clip), d)
        if units.dtype == object:
            noisy_sum = np.array([float(u) for u in units + draw.astype(object)]) * records.unit
        else:
            noisy_sum = (units + draw).astype(np.float64) * records.unit
        noisy_count = clip_count(theta, records, config.loss, clip) + int(count_draws[t])
        clips[t], counts[t] = clip, noisy_count
        theta = theta - config.step_size * (noisy_sum / n_norm + config.reg * theta)
        if config.radius is not None:
            theta = project_to_ball(theta, config.radius)
        iterates[t] = theta
        clip = next_clip(config, clip, noisy_count, n_norm)
        progress((t + 1) / config.steps)
    return iterates, clips, counts


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
        description="add_remove datasets only: a PUBLIC row-count estimate that normalises the gradient "
        "sum (the true count is private); affects utility only",
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
    (docs/mechanisms/rgm_gd.md; Theorem DPGD, docs/privacy.md §8.3.6)."""

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
        if ctx.schema.neighboring == "replace_one":
            if p.n_hint is not None:
                raise ParamsError("n_hint", "only for add_remove datasets (the row count is public here)")
        elif p.n_hint is None:
            raise ParamsError(
                "n_hint", "required on add_remove datasets: a public row-count estimate (n is private)"
            )
        self._config(p, ctx)

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
        public_n = ctx.n_rows if ctx.schema.neighboring == "replace_one" else p.n_hint
        if public_n is None:
            raise ParamsError("n_hint", "a public row count is needed to normalise the gradient")
        n_norm = float(public_n)
        x, y = design_matrix(p, ctx, table, learner_task(p.model, p.task), p.row_norm)
        clips: np.ndarray | None = None
        counts: np.ndarray | None = None
        if config.adaptive is None:
            path = dp_gd_train(config, x, y, n_norm, noise, progress, return_iterates=True)
        else:
            path, clips, counts = adaptive_dp_gd_train(config, x, y, n_norm, noise, progress)
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
        # charge is the composed T·α/(2z²) curve whatever the output (Theorem DPGD, docs/privacy.md §8.3.6)
        return Release(output=output, realized=worst)
