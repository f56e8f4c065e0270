"""Noise reduction: correlated noise paths released from most to least private, charged at the last level.

Two families, each with an eager sampler (the whole path at once) and a lazy forward sampler (keeps only the
current noise; JSON state, so a session can step forward without storing the path). Documentation, proofs and
the numeric checks: docs/mechanisms/noise_reduction.md, docs/privacy.md §8.1.

**Laplace noise reduction** (Koufogiannis, Han, Pappas 2016; Ligett, Neel, Roth, Waggoner, Wu 2017
"Accuracy First", Algorithm 1 / Theorem 2.7; notes/seed_001_accuracy_first.md §2.1). A vector value v with
ℓ1 sensitivity Δ, increasing levels ε_0 < … < ε_{k−1}. Per coordinate, with scales b_t = Δ/ε_t (rounded up,
``laplace_scale``), the noise η_t at level t is exactly Lap(b_t); going down a level (t+1 → t) the coordinate
**stays** (η_t = η_{t+1}) with probability (b_{t+1}/b_t)² = (ε_t/ε_{t+1})², else η_t = η_{t+1} + Lap(b_t),
with an **independent coin per coordinate** (a shared coin breaks privacy: note P1, and the audit catches it).
Releasing the prefix of levels 0..t is ε_t-DP, pointwise: the likelihood ratio of the prefix equals that
of level t alone (Theorem 2.7; note §2.1 facts 1–2, T8), so the ex-post charge of a prefix stopped at t by
any rule that reads only the released values is pure ε_t.

The lazy forward kernel (note §2.1, "Lazy forward sampler"): from η_t = x to level t+1, with a = 1/b_t,
c = 1/b_{t+1} (c ≥ a), per coordinate: stay with probability (a/c)·e^{−(c−a)|x|}, else draw y from the
density ∝ e^{−a|x−y| − c|y|}, a three-piece mixture sampled exactly (``_lazy_laplace_move``). This is the
reverse-time kernel of the eager chain, so the joint law of (η_0, …, η_{k−1}) is the same (tested in law).

**Brownian noise reduction** (Whitehouse, Ramdas, Wu, Rogers 2022; note §2.10). Decreasing variances
t_0 > t_1 > … > t_{k−1} > 0; the release at level j is v + B(t_j) with B a standard Brownian motion in
R^dim. Eager: B(t_{k−1}) ~ N(0, t_{k−1}) and B(t_j) = B(t_{j+1}) + N(0, t_j − t_{j+1}) (independent
increments). Lazy: B(t_0) ~ N(0, t_0), then the bridge step
B(t_{j+1}) | B(t_j) = x ~ N((t_{j+1}/t_j)·x, t_{j+1}(t_j − t_{j+1})/t_j). Ex-post charge when the last
released level is j: the RDP curve α·Δ₂²/(2 t_j) at every order (our derivation: the privacy-loss process
is Δ·W_s + Δ²s/2 in inverse time s = 1/t, and optional stopping of the exponential martingale gives the
ex-post RDP inequality; docs/privacy.md §8.1, confirmed by a Monte Carlo audit). No pure
bound.

Limitation (as for ``mechanisms.laplace``): floating-point samplers (Mironov 2012); the accounting is for the
idealised real-valued distributions. The exact-equality "stay" events are part of the mechanism.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from mechanisms.accounting import RdpCurve, laplace_scale
from mechanisms.accounting.curve import _pad_up

MAX_LEVELS = 10_000
"""Longest grid accepted by the samplers (the service's parameter models use the same limit)."""


# ----- grid checks -----------------------------------------------------------------------------------------
def _check_dim(dim: int) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int | np.integer) or dim < 1:
        raise ValueError("dim must be a positive integer")
    return int(dim)


def _increasing_epsilons(epsilons: Sequence[float]) -> np.ndarray:
    eps = np.asarray(epsilons, dtype=float)
    if eps.ndim != 1 or eps.size == 0 or eps.size > MAX_LEVELS:
        raise ValueError(f"the ε-grid must have between 1 and {MAX_LEVELS} levels")
    if not np.all(np.isfinite(eps)) or np.any(eps <= 0.0):
        raise ValueError("every ε of the grid must be finite and > 0")
    if np.any(np.diff(eps) <= 0.0):
        raise ValueError("the ε-grid must be strictly increasing")
    return eps


def _decreasing_variances(variances: Sequence[float]) -> np.ndarray:
    var = np.asarray(variances, dtype=float)
    if var.ndim != 1 or var.size == 0 or var.size > MAX_LEVELS:
        raise ValueError(f"the variance grid must have between 1 and {MAX_LEVELS} levels")
    if not np.all(np.isfinite(var)) or np.any(var <= 0.0):
        raise ValueError("every variance of the grid must be finite and > 0")
    if np.any(np.diff(var) >= 0.0):
        raise ValueError("the variance grid must be strictly decreasing")
    return var


def laplace_nr_scales(l1_sensitivity: float, epsilons: Sequence[float]) -> np.ndarray:
    """Per-level Laplace scales b_t = ``laplace_scale(Δ, ε_t)`` ≥ Δ/ε_t (non-increasing in t)."""
    if not (l1_sensitivity > 0.0 and math.isfinite(l1_sensitivity)):
        raise ValueError("the l1 sensitivity must be finite and > 0")
    eps = _increasing_epsilons(epsilons)
    scales = np.array([laplace_scale(l1_sensitivity, float(e)) for e in eps])
    # laplace_scale is monotone in ε: rounding can make adjacent scales equal (stay probability 1), never
    # increasing. Checked, never "fixed" (lowering a scale would under-noise a level).
    if np.any(np.diff(scales) > 0.0):
        raise ValueError("the Laplace scales of the grid are not non-increasing")
    return scales


# ----- Laplace noise reduction -----------------------------------------------------------------------------
def laplace_nr_path(
    l1_sensitivity: float, epsilons: Sequence[float], dim: int, rng: np.random.Generator
) -> np.ndarray:
    """Eager Laplace noise reduction (Ligett et al. Algorithm 1, per-coordinate coins): the NOISE path.

    Returns an array of shape (k, dim); row t is η_t, the noise at level ``epsilons[t]`` (increasing), so
    the release at level t is ``value + path[t]``. Drawn from the least private level down:
    η_{k−1} ~ Lap(b_{k−1});
    η_t = η_{t+1} + [coin_t]·Lap(b_t) where each coordinate's coin is 1 with probability 1 − (b_{t+1}/b_t)².
    """
    dim = _check_dim(dim)
    scales = laplace_nr_scales(l1_sensitivity, epsilons)
    k = scales.size
    top = rng.laplace(0.0, scales[-1], size=dim)
    if k == 1:
        return top[None, :]
    stay = (scales[1:] / scales[:-1]) ** 2  # stay probability from level t+1 down to t, t = 0..k−2
    moves = rng.random((k - 1, dim)) >= stay[:, None]
    increments = rng.laplace(0.0, 1.0, size=(k - 1, dim)) * scales[:-1, None] * moves
    # η_t = η_{k−1} + Σ_{j=t}^{k−2} increment_j: a reversed cumulative sum.
    below = np.cumsum(increments[::-1], axis=0)[::-1]
    path: np.ndarray = np.vstack([top[None, :] + below, top[None, :]])
    return path


def _lazy_laplace_move(x: np.ndarray, a: float, c: float, rng: np.random.Generator) -> np.ndarray:
    """One reverse-time step of the Laplace chain, per coordinate (note §2.1, "Lazy forward sampler").

    Given η_t = x (Lap(1/a) marginal), returns η_{t+1} (Lap(1/c) marginal, c ≥ a): stay with probability
    (a/c)·e^{−(c−a)|x|}; otherwise draw y from ∝ e^{−a|x−y| − c|y|}. For x ≥ 0, after factoring e^{−a x}:
    y < 0 has mass 1/(a+c) (y = −E/(a+c)); 0 ≤ y ≤ x has mass −expm1(−(c−a)x)/(c−a) (truncated exponential of
    rate c−a on [0, x]); y > x has mass e^{−(c−a)x}/(a+c) (y = x + E/(a+c)). x < 0 is the mirror image.
    """
    sign = np.where(x < 0.0, -1.0, 1.0)
    ax = np.abs(x)
    gap = c - a
    n = x.shape
    decay = np.exp(-gap * ax)  # e^{−(c−a)|x|} ∈ (0, 1]
    stay = rng.random(n) < (a / c) * decay
    if gap > 0.0:
        middle_mass = -np.expm1(-gap * ax) / gap
    else:
        middle_mass = ax
    low_mass = np.full(n, 1.0 / (a + c))
    high_mass = decay / (a + c)
    total = low_mass + middle_mass + high_mass
    u = rng.random(n) * total
    e = rng.standard_exponential(n) / (a + c)
    v = rng.random(n)
    if gap > 0.0:
        middle = -np.log1p(-v * -np.expm1(-gap * ax)) / gap
    else:
        middle = v * ax
    middle = np.minimum(middle, ax)  # rounding guard: stay inside [0, |x|]
    y = np.where(u < low_mass, -e, np.where(u < low_mass + middle_mass, middle, ax + e))
    moved = sign * y
    result: np.ndarray = np.where(stay, x, moved)
    return result


def _state_array(state: dict[str, Any], key: str, sampler: str) -> tuple[np.ndarray, int]:
    if not isinstance(state, dict) or state.get("sampler") != sampler:
        raise ValueError(f"not a {sampler} sampler state")
    level = state.get("level")
    noise = state.get(key)
    if isinstance(level, bool) or not isinstance(level, int) or level < 0 or not isinstance(noise, list):
        raise ValueError(f"not a {sampler} sampler state")
    array = np.asarray(noise, dtype=float)
    if array.ndim != 1 or array.size == 0 or not np.all(np.isfinite(array)):
        raise ValueError(f"not a {sampler} sampler state")
    return array, level


class LazyLaplaceNR:
    """Forward (most → least private) Laplace noise reduction keeping only the current noise.

    State (JSON): ``{"sampler": "laplace_nr", "l1_sensitivity": Δ, "epsilons": [...], "level": t,
    "noise": [η_t per coordinate]}``. The noise is **secret**: it must never be released or logged.
    """

    SAMPLER = "laplace_nr"

    @staticmethod
    def start(
        l1_sensitivity: float, epsilons: Sequence[float], dim: int, rng: np.random.Generator
    ) -> dict[str, Any]:
        """The state after level 0: η_0 ~ Lap(b_0) per coordinate."""
        dim = _check_dim(dim)
        scales = laplace_nr_scales(l1_sensitivity, epsilons)
        noise = rng.laplace(0.0, scales[0], size=dim)
        return {
            "sampler": LazyLaplaceNR.SAMPLER,
            "l1_sensitivity": float(l1_sensitivity),
            "epsilons": [float(e) for e in epsilons],
            "level": 0,
            "noise": noise.tolist(),
        }

    @staticmethod
    def advance(state: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
        """The state at the next level (exact reverse-time kernel); ValueError at the last level."""
        noise, level = _state_array(state, "noise", LazyLaplaceNR.SAMPLER)
        scales = laplace_nr_scales(float(state["l1_sensitivity"]), state["epsilons"])
        if not 0 <= level < scales.size - 1:
            raise ValueError("the sampler is at the last level of its grid")
        moved = _lazy_laplace_move(noise, 1.0 / scales[level], 1.0 / scales[level + 1], rng)
        return {**state, "level": level + 1, "noise": moved.tolist()}

    @staticmethod
    def noise(state: dict[str, Any]) -> np.ndarray:
        return _state_array(state, "noise", LazyLaplaceNR.SAMPLER)[0]

    @staticmethod
    def level(state: dict[str, Any]) -> int:
        return _state_array(state, "noise", LazyLaplaceNR.SAMPLER)[1]


# ----- Brownian noise reduction ----------------------------------------------------------------------------
def brownian_nr_path(variances: Sequence[float], dim: int, rng: np.random.Generator) -> np.ndarray:
    """Eager Brownian noise reduction: shape (k, dim), row j = B(t_j) for decreasing t_0 > … > t_{k−1}.

    B(t_{k−1}) ~ N(0, t_{k−1}); B(t_j) = B(t_{j+1}) + N(0, t_j − t_{j+1}) with independent increments.
    """
    dim = _check_dim(dim)
    var = _decreasing_variances(variances)
    steps = np.concatenate([-np.diff(var), var[-1:]])  # t_j − t_{j+1} for j < k−1, then t_{k−1}
    increments = rng.standard_normal((var.size, dim)) * np.sqrt(steps)[:, None]
    path: np.ndarray = np.cumsum(increments[::-1], axis=0)[::-1]
    return path


class LazyBrownianNR:
    """Forward Brownian noise reduction (bridge step to the next smaller variance), current value only.

    State (JSON): ``{"sampler": "brownian_nr", "variances": [...], "level": j, "noise": [B(t_j)]}``; secret.
    """

    SAMPLER = "brownian_nr"

    @staticmethod
    def start(variances: Sequence[float], dim: int, rng: np.random.Generator) -> dict[str, Any]:
        """The state after level 0: B(t_0) ~ N(0, t_0 I)."""
        dim = _check_dim(dim)
        var = _decreasing_variances(variances)
        noise = rng.standard_normal(dim) * math.sqrt(var[0])
        return {
            "sampler": LazyBrownianNR.SAMPLER,
            "variances": [float(v) for v in variances],
            "level": 0,
            "noise": noise.tolist(),
        }

    @staticmethod
    def advance(state: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
        """Bridge step: B(t_{j+1}) | B(t_j)=x ~ N((t_{j+1}/t_j)x, t_{j+1}(t_j − t_{j+1})/t_j)."""
        noise, level = _state_array(state, "noise", LazyBrownianNR.SAMPLER)
        var = _decreasing_variances(state["variances"])
        if not 0 <= level < var.size - 1:
            raise ValueError("the sampler is at the last level of its grid")
        t_now, t_next = float(var[level]), float(var[level + 1])
        mean = (t_next / t_now) * noise
        std = math.sqrt(t_next * (t_now - t_next) / t_now)
        moved = mean + std * rng.standard_normal(noise.size)
        return {**state, "level": level + 1, "noise": moved.tolist()}

    @staticmethod
    def noise(state: dict[str, Any]) -> np.ndarray:
        return _state_array(state, "noise", LazyBrownianNR.SAMPLER)[0]

    @staticmethod
    def level(state: dict[str, Any]) -> int:
        return _state_array(state, "noise", LazyBrownianNR.SAMPLER)[1]


# ----- charges ---------------------------------------------------------------------------------------------
def _level_index(stopped_level: int, size: int) -> int:
    if isinstance(stopped_level, bool) or not isinstance(stopped_level, int | np.integer):
        raise ValueError("stopped_level must be an integer level index")
    if not 0 <= stopped_level < size:
        raise ValueError(f"stopped_level {stopped_level} is outside the grid of {size} levels")
    return int(stopped_level)


def laplace_nr_charge(epsilons: Sequence[float], stopped_level: int, orders: Sequence[float]) -> RdpCurve:
    """Ex-post charge of a Laplace NR prefix whose last released level is ``stopped_level``: pure ε_t.

    Theorem 2.7 of Ligett et al. (prefix privacy), pointwise (note §2.1, T8), so it holds for any stopping
    rule that reads only released values; a pure ex-post ε is the constant curve (Ghazi et al. Lemma 7(i)).
    """
    eps = _increasing_epsilons(epsilons)
    return RdpCurve.from_pure(float(eps[_level_index(stopped_level, eps.size)]), orders)


def brownian_rdp_values(l2_sensitivity: float, variance: float, orders: Sequence[float]) -> tuple[float, ...]:
    """α·Δ₂²/(2t) at each order, rounded up (a positive loss is never charged 0)."""
    if not (l2_sensitivity >= 0.0 and math.isfinite(l2_sensitivity)):
        raise ValueError("the l2 sensitivity must be finite and ≥ 0")
    if not (variance > 0.0 and math.isfinite(variance)):
        raise ValueError("the variance must be finite and > 0")
    values = []
    for alpha in orders:
        value = _pad_up(_pad_up(alpha * _pad_up(l2_sensitivity * l2_sensitivity)) / (2.0 * variance))
        if l2_sensitivity > 0.0:
            value = max(value, math.nextafter(0.0, 1.0))
        values.append(value)
    return tuple(values)


def brownian_nr_charge(
    l2_sensitivity: float, variances: Sequence[float], stopped_level: int, orders: Sequence[float]
) -> RdpCurve:
    """Ex-post RDP charge of Brownian NR whose last released level is t = variances[stopped_level].

    ε(α) = α·Δ₂²/(2t) at every order, no pure bound. Valid for any stopping rule adapted to the released
    values (exponential martingale in inverse time + optional stopping;
    docs/privacy.md §8.1).
    """
    var = _decreasing_variances(variances)
    t = float(var[_level_index(stopped_level, var.size)])
    return RdpCurve(tuple(orders), brownian_rdp_values(l2_sensitivity, t, orders))
