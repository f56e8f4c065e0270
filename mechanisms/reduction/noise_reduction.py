"""Noise reduction on a public grid: correlated noise paths released from most to least private.

Two families, each with an eager sampler (the whole path, or the walk, at once) and a lazy forward sampler
(JSON state, so a session can step forward). Every draw is exact integer arithmetic over ``Noise``
(``mechanisms.noise``); every release is a multiple of a public grid γ = 2^k. Documentation, proofs and the
numeric checks: docs/mechanisms/noise_reduction.md, docs/privacy/noise_reduction.md#noise-reduction.

**Laplace noise reduction, discrete** (Koufogiannis, Han, Pappas 2016; Ligett, Neel, Roth, Waggoner, Wu 2017
"Accuracy First", Algorithm 1 / Theorem 2.7). A vector value, rounded to the grid (``Grid``), with ℓ1
sensitivity Δ_g in grid units (an upper bound on the integer shift ‖round(v/γ) − round(v′/γ)‖₁), increasing
levels ε_0 < … < ε_{k−1}. Level t has integer noise DLap(q_t), P(z) ∝ q_t^{|z|}, q_t = e^{−x_t} with
x_t = n_t/D, D = 2^48 and n_t = ⌊ε_t·D/Δ_g⌋ (``laplace_nr_rates``), so Δ_g·x_t ≤ ε_t: level t alone is ε_t-DP
(the discrete Laplace ratio at an integer shift of ℓ1 norm ≤ Δ_g is ≤ e^{x_t·Δ_g}). The chain is the exact
discrete analogue of the Koufogiannis decomposition: DLap(q_t) = DLap(q_{t+1}) + W_t with W_t = 0 w.p.
c_{t+1}/c_t (c = q/(1−q)², from the characteristic function 1/(1 + c·2(1 − cos u))) and W_t ~ DLap(q_t)
otherwise, independent, an **independent coin per coordinate** (``mechanisms.noise.reduction``). Releasing the
prefix 0..t is ε_t-DP pointwise (the noisier levels are the level-t release plus data-independent integer
noise), so the ex-post charge of a prefix stopped at t by any rule that reads only the released values is
pure ε_t (``laplace_nr_charge``).

The lazy forward sampler holds the current integer noise and steps with the exact reverse-time kernel of that
chain (``dlap_nr_advance``): the joint law of all levels is the eager one (tested against exact pmfs).

**Brownian noise reduction, grid version** (after Whitehouse, Ramdas, Wu, Rogers 2022). Decreasing variances
t_0 > … > t_{k−1}; r_j = t_j/t_{j−1} (r_0 = 0). Release j, in grid units (γ = ``brownian_grid``):
Y_j = round((1 − r_j)·v/γ + r_j·Y_{j−1}) + Z_j, Z_j ~ N_Z(0, σ_j²) discrete Gaussian, σ_j² ≥ t_j(1 − r_j)/γ²
(the Brownian bridge step with its mean rounded to the grid). Sums of discrete Gaussians are not discrete
Gaussians, so this is **not** the continuous chain's exact analogue and its proof is not optional stopping of
one martingale: it is per-step composition. Conditionally on everything released before, release j is a
discrete Gaussian mechanism with integer mean whose shift between neighbours is at most
Δ_j = (1 − r_j)Δ₂/γ + √d (rounding adds ≤ 1 per coordinate), so its RDP is α·Δ_j²/(2σ_j²) (Canonne, Kamath,
Steinke 2020, Prop. 5 / Thm. 15); the charge of stopping at level S is the sum over j ≤ S (a privacy filter
over the fixed sequence of per-step curves, valid for any stopping rule that reads only released values). With
γ ≤ 2^{−11}·min_j(1 − r_j)·Δ₂/√d this is at most (1 + 1.01·2^{−10})²·α·Δ₂²/(2t_S): the continuous curve
with a 0.2 % rounding term.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction
from functools import lru_cache
from typing import Any

import numpy as np

from mechanisms.accounting import RdpCurve, pad_up
from mechanisms.noise import Grid, Noise, dyadic_scale_up, float_up
from mechanisms.noise.reduction import RATE_DENOMINATOR, dlap_nr_advance, dlap_nr_path

MAX_LEVELS = 10_000
"""Longest grid accepted by the samplers (the service's parameter models use the same limit)."""
MIN_RATE = 1 << 7
"""Smallest rate numerator: the noise scale of a level is at most D/2^7 = 2^41 grid units."""
BROWNIAN_PENALTY = Fraction(1, 1 << 10)
"""Bound on the grid's relative increase of every Brownian step's sensitivity."""
_VARIANCE_BITS = 12


# ----- grid checks -----------------------------------------------------------------------------------------
def _check_dim(dim: int) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int | np.integer) or dim < 1:
        raise ValueError("dim must be a positive integer")
    return int(dim)


def _monotone_grid(values: Sequence[float], grid: str, item: str, increasing: bool) -> np.ndarray:
    """``values`` as a 1-D array of 1..MAX_LEVELS finite positive entries, strictly monotone as asked."""
    array = np.asarray(values, dtype=float)
    if array.ndim != 1 or array.size == 0 or array.size > MAX_LEVELS:
        raise ValueError(f"the {grid} must have between 1 and {MAX_LEVELS} levels")
    if not np.all(np.isfinite(array)) or np.any(array <= 0.0):
        raise ValueError(f"every {item} of the grid must be finite and > 0")
    steps = np.diff(array)
    if np.any(steps <= 0.0) if increasing else np.any(steps >= 0.0):
        raise ValueError(f"the {grid} must be strictly {'increasing' if increasing else 'decreasing'}")
    return array


def _increasing_epsilons(epsilons: Sequence[float]) -> np.ndarray:
    return _monotone_grid(epsilons, "ε-grid", "ε", increasing=True)


def _decreasing_variances(variances: Sequence[float]) -> np.ndarray:
    return _monotone_grid(variances, "variance grid", "variance", increasing=False)


def _check_sensitivity(value: float, what: str) -> float:
    if not (value > 0.0 and math.isfinite(value)):
        raise ValueError(f"the {what} sensitivity must be finite and > 0")
    return float(value)


# ----- Laplace noise reduction -----------------------------------------------------------------------------
def _charged(epsilon: float) -> Fraction:
    """The exact ε a pure charge of ``epsilon`` stands for: the smaller of its binary value and its shortest
    decimal (which the ledger reads; ``mechanisms.queries.language.charged_fraction``)."""
    return min(Fraction(epsilon), Fraction(repr(float(epsilon))))


def laplace_nr_rates(grid_sensitivity: float, epsilons: Sequence[float]) -> list[int]:
    """Per level n_t = ⌊ε_t·D/Δ_g⌋ (exact rational arithmetic): q_t = e^{−n_t/D}, so Δ_g·n_t/D ≤ ε_t.

    Non-decreasing in t (adjacent levels may coincide after flooring: their stay probability is then 1).
    ValueError when a level's scale D/n_t would exceed 2^40 grid units (ε too small for the sensitivity).
    """
    sensitivity = _check_sensitivity(grid_sensitivity, "grid l1")
    rates = list(_level_rates(sensitivity, tuple(_increasing_epsilons(epsilons).tolist())))
    if rates[0] < MIN_RATE:
        raise ValueError(
            "the smallest ε is too small for this sensitivity (noise scale beyond 2^41 grid units)"
        )
    if rates[-1] >= 1 << 55:
        raise ValueError("the largest ε is too large for this sensitivity (ε/Δ_g must be < 128)")
    return rates


@lru_cache(maxsize=256)
def _level_rates(sensitivity: float, epsilons: tuple[float, ...]) -> tuple[int, ...]:
    """⌊ε_t·D/Δ_g⌋ per level, exactly (public; cached: a grid of 1 000 levels is re-used every run)."""
    exact = Fraction(sensitivity)
    return tuple(math.floor(_charged(e) * RATE_DENOMINATOR / exact) for e in epsilons)


def laplace_nr_scales(grid_sensitivity: float, epsilons: Sequence[float]) -> np.ndarray:
    """Per-level scale D/n_t in grid units (P(z) ∝ e^{−|z|/scale}); ≥ Δ_g/ε_t; non-increasing in t."""
    rates = laplace_nr_rates(grid_sensitivity, epsilons)
    result: np.ndarray = np.array([RATE_DENOMINATOR / n for n in rates], dtype=float)
    return result


def laplace_nr_level_epsilons(grid_sensitivity: float, epsilons: Sequence[float]) -> list[float]:
    """The pure ε each level actually has, Δ_g·n_t/D rounded up (≤ the requested ε_t; informational)."""
    rates = laplace_nr_rates(grid_sensitivity, epsilons)
    return [float_up(Fraction(grid_sensitivity) * n / RATE_DENOMINATOR) for n in rates]


def laplace_nr_path(grid_sensitivity: float, epsilons: Sequence[float], dim: int, noise: Noise) -> np.ndarray:
    """Eager discrete Laplace noise reduction: the integer NOISE path in grid units, shape (k, dim).

    Row t is η_t at level ``epsilons[t]`` (increasing), so the release at level t is γ·(round(v/γ) + η_t).
    Drawn from the least private level down (``mechanisms.noise.reduction.dlap_nr_path``).
    """
    dim = _check_dim(dim)
    return dlap_nr_path(noise, laplace_nr_rates(grid_sensitivity, epsilons), dim)


def _state_array(state: dict[str, Any], key: str, sampler: str) -> tuple[list[int], int]:
    if not isinstance(state, dict) or state.get("sampler") != sampler:
        raise ValueError(f"not a {sampler} sampler state")
    level = state.get("level")
    values = state.get(key)
    if isinstance(level, bool) or not isinstance(level, int) or level < 0 or not isinstance(values, list):
        raise ValueError(f"not a {sampler} sampler state")
    if not values or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ValueError(f"not a {sampler} sampler state")
    return values, level


class LazyLaplaceNR:
    """Forward (most → least private) discrete Laplace noise reduction keeping only the current noise.

    State (JSON): ``{"sampler": "laplace_nr", "grid_sensitivity": Δ_g, "epsilons": [...], "level": t,
    "noise": [η_t per coordinate, integers in grid units]}``. The noise is **secret**: never released or
    logged. The release at level t is γ·(round(v/γ) + η_t).
    """

    SAMPLER = "laplace_nr"

    @staticmethod
    def start(grid_sensitivity: float, epsilons: Sequence[float], dim: int, noise: Noise) -> dict[str, Any]:
        """The state after level 0: η_0 ~ DLap(q_0) per coordinate."""
        dim = _check_dim(dim)
        rates = laplace_nr_rates(grid_sensitivity, epsilons)
        first = dlap_nr_path(noise, rates[:1], dim)[0]
        return {
            "sampler": LazyLaplaceNR.SAMPLER,
            "grid_sensitivity": float(grid_sensitivity),
            "epsilons": [float(e) for e in epsilons],
            "level": 0,
            "noise": [int(v) for v in first],
        }

    @staticmethod
    def advance(state: dict[str, Any], noise: Noise) -> dict[str, Any]:
        """The state at the next level (exact reverse-time kernel); ValueError at the last level."""
        values, level = _state_array(state, "noise", LazyLaplaceNR.SAMPLER)
        rates = laplace_nr_rates(float(state["grid_sensitivity"]), state["epsilons"])
        if not 0 <= level < len(rates) - 1:
            raise ValueError("the sampler is at the last level of its grid")
        moved = dlap_nr_advance(noise, np.asarray(values, dtype=np.int64), rates[level], rates[level + 1])
        return {**state, "level": level + 1, "noise": [int(v) for v in moved]}

    @staticmethod
    def noise(state: dict[str, Any]) -> np.ndarray:
        values, _ = _state_array(state, "noise", LazyLaplaceNR.SAMPLER)
        return np.asarray(values, dtype=np.int64)

    @staticmethod
    def level(state: dict[str, Any]) -> int:
        return _state_array(state, "noise", LazyLaplaceNR.SAMPLER)[1]


# ----- Brownian noise reduction (grid version) ------------------------------------------------------------
def _ratios(variances: Sequence[float]) -> list[Fraction]:
    """r_j = t_j/t_{j−1} exactly (r_0 = 0)."""
    var = [Fraction(float(v)) for v in _decreasing_variances(variances)]
    return [Fraction(0)] + [var[j] / var[j - 1] for j in range(1, len(var))]


def brownian_grid(l2_sensitivity: float, variances: Sequence[float], dim: int) -> Grid:
    """γ = the largest 2^k ≤ 2^{−11}·min_j(1 − r_j)·Δ₂/√d (public: sensitivity, variance grid, dimension).

    Every step's sensitivity in grid units, (1 − r_j)‖m‖₂ + √d with ‖m‖₂ ≤ Δ₂/γ + (1 + 1/64)√d, is then at
    most (1 + 1.01·2^{−10})·(1 − r_j)·Δ₂/γ.
    """
    delta = Fraction(_check_sensitivity(l2_sensitivity, "l2"))
    dim = _check_dim(dim)
    smallest = min(1 - r for r in _ratios(variances))
    bound = BROWNIAN_PENALTY / 2 * smallest * delta / _sqrt_up(dim)
    exponent = bound.numerator.bit_length() - bound.denominator.bit_length()
    while Fraction(2) ** exponent > bound:
        exponent -= 1
    while Fraction(2) ** (exponent + 1) <= bound:
        exponent += 1
    return Grid(exponent)


def _sqrt_up(value: int) -> Fraction:
    """A rational ≥ √value (40 fractional bits)."""
    scaled = math.isqrt(value << 80)
    return Fraction(scaled + 1, 1 << 40)


def brownian_step_variances(variances: Sequence[float], grid: Grid) -> list[Fraction]:
    """σ_j² in grid units: t_j(1 − r_j)/γ², rounded UP to a short dyadic (more noise, never less)."""
    var = [Fraction(float(v)) for v in _decreasing_variances(variances)]
    gamma2 = Fraction(2) ** (2 * grid.exponent)
    return [
        dyadic_scale_up(t * (1 - r) / gamma2, _VARIANCE_BITS)
        for t, r in zip(var, _ratios(variances), strict=True)
    ]


def brownian_step_costs(unit_l2: float, variances: Sequence[float], dim: int, grid: Grid) -> list[float]:
    """Per level c_j ≥ Δ_j²/(2σ_j²), so step j's RDP is α·c_j (CKS 2020 Thm. 15 at integer means).

    ``unit_l2`` bounds ‖round(v/γ) − round(v′/γ)‖₂ (grid units). Step 0's mean is round(v/γ) itself
    (Δ_0 = unit_l2); step j ≥ 1 rounds (1 − r_j)·V + r_j·Y_{j−1}, so Δ_j = (1 − r_j)·unit_l2 + √d.
    """
    delta = Fraction(_check_sensitivity(unit_l2, "grid l2"))
    root = _sqrt_up(_check_dim(dim))
    costs = []
    for j, (r, s2) in enumerate(
        zip(_ratios(variances), brownian_step_variances(variances, grid), strict=True)
    ):
        shift = delta if j == 0 else (1 - r) * delta + root
        costs.append(float_up(shift * shift / (2 * s2)))
    return costs


def brownian_cumulative_costs(
    unit_l2: float, variances: Sequence[float], dim: int, grid: Grid
) -> list[float]:
    """C_S = Σ_{j ≤ S} c_j, rounded up (exact rational prefix sums of the floats c_j)."""
    total = Fraction(0)
    result = []
    for cost in brownian_step_costs(unit_l2, variances, dim, grid):
        total += Fraction(cost)
        result.append(float_up(total))
    return result


def brownian_step(
    noise: Noise,
    units: Sequence[int] | np.ndarray,
    previous: Sequence[int] | None,
    level: int,
    variances: Sequence[float],
    grid: Grid,
) -> list[int]:
    """Release ``level`` in grid units: round((1 − r)·V + r·Y_prev) + N_Z(0, σ²), exactly (Fractions).

    ``units`` is V = round(v/γ) (integers); ``previous`` the released Y of level − 1 (None at level 0,
    where the mean is V itself). Python integers of any size.
    """
    r = _ratios(variances)[level]
    step_variance = brownian_step_variances(variances, grid)[level]
    answer = np.array([int(u) for u in np.asarray(units).ravel()], dtype=object)
    if (previous is None) != (level == 0):
        raise ValueError("the previous release is needed exactly for levels ≥ 1")
    if previous is None:
        means = answer
    else:
        if len(previous) != answer.size:
            raise ValueError("the previous release has the wrong dimension")
        prev = np.array([int(p) for p in previous], dtype=object)
        # ⌊(1 − r)V + rY + ½⌋ with r = p/q: ⌊(2((q − p)V + pY) + q) / 2q⌋ in exact (Python) integers.
        p, q = r.numerator, r.denominator
        means = (2 * ((q - p) * answer + p * prev) + q) // (2 * q)
    draws = noise.discrete_gaussian(step_variance, int(means.size))
    return [int(m) + int(z) for m, z in zip(means, draws, strict=True)]


def units_to_values(units: Sequence[int], grid: Grid) -> np.ndarray:
    """γ·units as float64: exact below 2^53 units; beyond, the nearest float, itself a multiple of γ (a
    deterministic post-processing of the grid value)."""
    result: np.ndarray = np.array([math.ldexp(float(int(u)), grid.exponent) for u in units], dtype=float)
    return result


def _int_list(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)


class LazyBrownianNR:
    """Forward grid Brownian noise reduction: each step draws fresh discrete Gaussian noise.

    State (JSON): ``{"sampler": "brownian_nr", "variances": [...], "unit_l2": ‖m‖₂, "dim": d,
    "grid_exponent": k, "level": j (the next level to release), "previous": [Y_{j−1}] or null}``.
    ``previous`` is the last released value in grid units (public), kept so the next step can centre its
    bridge mean; no unreleased noise is stored (every step's noise is fresh).
    """

    SAMPLER = "brownian_nr"

    @staticmethod
    def start(unit_l2: float, variances: Sequence[float], dim: int, grid: Grid) -> dict[str, Any]:
        dim = _check_dim(dim)
        brownian_step_costs(unit_l2, variances, dim, grid)  # validates
        return {
            "sampler": LazyBrownianNR.SAMPLER,
            "variances": [float(v) for v in variances],
            "unit_l2": float(unit_l2),
            "dim": dim,
            "grid_exponent": grid.exponent,
            "level": 0,
            "previous": None,
        }

    @staticmethod
    def step(state: dict[str, Any], units: np.ndarray, noise: Noise) -> tuple[list[int], dict[str, Any]]:
        """Release the next level (grid units) and the new state; ValueError past the last level."""
        if not isinstance(state, dict) or state.get("sampler") != LazyBrownianNR.SAMPLER:
            raise ValueError("not a brownian_nr sampler state")
        level, previous, exponent = state.get("level"), state.get("previous"), state.get("grid_exponent")
        if (
            isinstance(level, bool)
            or not isinstance(level, int)
            or level < 0
            or not isinstance(exponent, int)
        ):
            raise ValueError("not a brownian_nr sampler state")
        variances = state["variances"]
        if level >= len(variances):
            raise ValueError("the sampler is past the last level of its grid")
        if previous is not None and not _int_list(previous):
            raise ValueError("not a brownian_nr sampler state")
        released = brownian_step(noise, units, previous, level, variances, Grid(exponent))
        return released, {**state, "level": level + 1, "previous": released}


# ----- charges ---------------------------------------------------------------------------------------------
def _level_index(stopped_level: int, size: int) -> int:
    if isinstance(stopped_level, bool) or not isinstance(stopped_level, int | np.integer):
        raise ValueError("stopped_level must be an integer level index")
    if not 0 <= stopped_level < size:
        raise ValueError(f"stopped_level {stopped_level} is outside the grid of {size} levels")
    return int(stopped_level)


def laplace_nr_charge(epsilons: Sequence[float], stopped_level: int, orders: Sequence[float]) -> RdpCurve:
    """Ex-post charge of a Laplace NR prefix whose last released level is ``stopped_level``: pure ε_t.

    The level's discrete Laplace has pure ε ≤ Δ_g·x_t ≤ ε_t and the prefix's likelihood ratio is that of
    level t alone (Theorem 2.7 of Ligett et al., pointwise), so it holds for any stopping rule that reads
    only released values; a pure ex-post ε is the constant curve (Ghazi et al. Lemma 7(i)), not Mironov's
    continuous-Laplace curve.
    """
    eps = _increasing_epsilons(epsilons)
    return RdpCurve.from_pure(float(eps[_level_index(stopped_level, eps.size)]), orders)


def brownian_rdp_values(cost: float, orders: Sequence[float]) -> tuple[float, ...]:
    """α·cost at each order, rounded up (a positive loss is never charged 0)."""
    values = []
    for alpha in orders:
        value = pad_up(alpha * cost)
        if cost > 0.0:
            value = max(value, math.nextafter(0.0, 1.0))
        values.append(value)
    return tuple(values)


def brownian_nr_charge(
    unit_l2: float,
    variances: Sequence[float],
    dim: int,
    grid: Grid,
    stopped_level: int,
    orders: Sequence[float],
) -> RdpCurve:
    """Ex-post RDP charge of grid Brownian NR whose last released level is S = ``stopped_level``.

    ε(α) = α·Σ_{j≤S} Δ_j²/(2σ_j²) ≤ (1 + 1.01·2^{−10})²·α·Δ₂²/(2t_S), no pure bound: per-step discrete
    Gaussian RDP (CKS 2020) composed over the released steps, valid for any stopping rule adapted to the
    released values (docs/privacy/noise_reduction.md#brownian-noise-reduction).
    """
    var = _decreasing_variances(variances)
    level = _level_index(stopped_level, var.size)
    cost = brownian_cumulative_costs(unit_l2, variances, dim, grid)[level]
    return RdpCurve(tuple(orders), brownian_rdp_values(cost, orders))


# ----- per-unit charges (individual accounting) ------------------------------------------------------------
def laplace_nr_unit_rate(grid_sensitivity: float, epsilons: Sequence[float], stopped_level: int) -> Fraction:
    """x_t = n_t/D of the level: a unit whose removal moves the grid answer by δ (integers) has prefix loss
    x_t·‖δ‖₁ ≤ x_t·Δ_g ≤ ε_t at every outcome (Theorem D-2 at the unit's own shift;
    docs/privacy/individual.md#individual-noise-reduction-proof)."""
    rates = laplace_nr_rates(grid_sensitivity, epsilons)
    return Fraction(rates[_level_index(stopped_level, len(rates))], RATE_DENOMINATOR)


def brownian_unit_coefficients(
    variances: Sequence[float], grid: Grid, stopped_level: int
) -> tuple[Fraction, Fraction, Fraction]:
    """(P_S, Q_S, R_S), exact, with C_S(δ) ≤ P_S·‖δ‖₂² + Q_S·‖δ‖₁ + R_S·#{δ_i ≠ 0} for a unit whose removal
    moves the grid answer by the integer vector δ: step j's mean moves by ≤ (1 − r_j)|δ_i| + 1[δ_i ≠ 0] per
    coordinate (and by δ itself at j = 0), so its squared shift is ≤ (1 − r_j)²‖δ‖₂² + 2(1 − r_j)‖δ‖₁ +
    #{δ_i ≠ 0}; P_S = Σ_{j≤S} (1 − r_j)²/(2σ_j²), Q_S = Σ_{1≤j≤S} 2(1 − r_j)/(2σ_j²), R_S = Σ_{1≤j≤S}
    1/(2σ_j²) (docs/privacy/individual.md#individual-noise-reduction-proof)."""
    step_variances = brownian_step_variances(variances, grid)
    level = _level_index(stopped_level, len(step_variances))
    squares, linear, cells = Fraction(0), Fraction(0), Fraction(0)
    for j, (r, s2) in enumerate(zip(_ratios(variances), step_variances[: level + 1], strict=False)):
        squares += (1 - r) ** 2 / (2 * s2)
        if j > 0:
            linear += (1 - r) / s2
            cells += 1 / (2 * s2)
    return squares, linear, cells
