"""The Relative Gaussian Mechanism (RGM) and the relative sensitivity of ridge gradients: pure numerics.

Source: Hendrikx, Mangold, Bellet, "The Relative Gaussian Mechanism and its Application to Private Gradient
Descent", AISTATS 2024 (cited "the paper"); the derivations and corrections are proved in
docs/privacy/gradient_descent.md#gradient-descent. Nothing here is wired into the service; the curves are
ex-ante bounds and the same for every outcome.

Definitions (paper Def. 2 and Def. 3)
-------------------------------------
* **Relative L2 sensitivity** (η, R_rel): ‖R(x) − R(y)‖² ≤ η²‖R(x)‖² + R_rel² for all neighbours x ~ y
  (replace-one, n fixed). By symmetry of ~ this is the same as ≤ η²·min(‖R(x)‖², ‖R(y)‖²) + R_rel².
* **RGM**: RGM_{γ,σ}(R)(x) = R(x) + N(0, v(x)·I_d) with per-coordinate **variance**
  v(x) = γ‖R(x)‖² + σ². ``sigma`` is the baseline standard deviation, ``gamma`` multiplies the squared
  norm; ``rgm_release`` draws ``value + sqrt(v)·Z`` with Z ~ N(0, I_d).

Bounds
------
* ``theorem1_epsilon``: Theorem 1, eq. (5),
  ε_T1(α) = αη²/(2γρ_α) + αdη²(2+η)²(1+η)²/(2ρ_α), ρ_α = 1 − η(α−1)(2+η),
  for 1 ≤ α < α_max = 1 + 1/(η(2+η)) (+∞ at and beyond α_max: the ceiling is real, ε_T1 → ∞ as α → α_max),
  under the σ² condition σ² ≥ γη⁻²[1 − η(α−1)]R_rel².
* ``exact_epsilon``: the exact worst case over all queries with (η, R_rel)-relative sensitivity, under the
  same conditions (Lemma EXACT of docs/privacy/gradient_descent.md#lemma-exact, a **derived** result that is
  not in the paper):
  ε_ex(α) = αη²/(2γρ_α) + (d/(α−1))·[−α log(1+η) − ½ log(1 − αη(2+η)/(1+η)²)] ≤ ε_T1(α),
  evaluated here in the cancellation-free form (d/2)·[(w − log(1+w)) + w(φ(t) − 1)] with w = η(2+η),
  t = (α−1)w and φ(t) = −log(1−t)/t. The service must not rely on it unless the verification in
  tests/unit/test_relative_gaussian.py passes (closed form of the Rényi divergence of two isotropic
  Gaussians with different means and variances, 1-D quadrature, an adversarial search over neighbouring
  outputs, ε_ex ≤ ε_T1) and the Monte Carlo audit in tests/statistical/test_relative_gaussian_audit.py.
* ``rgm_rdp_curve`` puts either bound on an order grid as an ``RdpCurve`` (no pure bound).

Conditions enforced by ``rgm_rdp_curve``
---------------------------------------
* η > 0 needs γ > 0 (γ = 0 with η > 0 is the plain GM without an absolute sensitivity: unbounded loss).
  η = 0 is plain absolute sensitivity: γ must be 0 and the curve is ``RdpCurve.gaussian(R_rel, σ)``.
* σ² below Lemma 1's threshold (γR_rel²/η²)(1+η)/(2+η) is rejected (ValueError): it fails the σ²
  condition at every α < α_max.
* σ² ≥ γR_rel²/η² satisfies the σ² condition at every order (the paper's default, stated below Theorem 1).
  Otherwise the condition holds only for α ≥ α_lo = 1 + (1 − σ²η²/(γR_rel²))/η, and for orders below α_lo
  the curve charges ε(α_lo), which is valid because D_α is nondecreasing in α (van Erven & Harremoës 2014,
  Thm 3). Charging ε(α) there would be wrong: with such σ² the worst-case divergence exceeds ε_ex(α)
  and even ε_T1(α) (0.134 > 0.106 at α = 2, η = 0.01, γ = 1e-3, d = 10, R_rel = 1, σ² = 7.46; unit tests).
* +∞ at every order α ≥ α_max (computed with ρ_α rounded down, so orders within rounding of the ceiling
  are +∞ too). α_max can be small (5.76 at η = 0.1), so standard grids get +∞ entries.

Corrections to the paper, and why (docs/privacy/gradient_descent.md#gradient-descent)
-------------------------------------------------------
1. **Variance, not standard deviation** (eq. (4) and Lemma 2 of the paper vs its code). Eq. (4) and
   Lemma 2 (σ₁²I_d) make γ‖R(x)‖² + σ² the per-coordinate variance. The authors' code draws with *standard
   deviation* γ_c‖g‖ + σ_c, which is a different mechanism that Theorem 1 does not literally cover; here the
   variance convention of eq. (4) is implemented and the noise is applied to all d coordinates.
2. **Eq. (20) has x and y swapped** (proof of Theorem 1, App. A):
   s = ασ₂² + (1−α)σ₁² = σ² + γα‖R(y)‖² − γ(α−1)‖R(x)‖².
   This changes no result; ``exact_epsilon`` relies on the corrected mean-term bound.
3. **The log term of Theorem 1 is not tight**: the paper's factor (1+η)² and the 1/2 lost in eq. (36) are
   what ``exact_epsilon`` removes (Lemma EXACT, docs/privacy/gradient_descent.md#lemma-exact). The A.6 tCDP
   constant (η²d(2+η)²/2) is a typo and is not used.
4. **Eq. (10) scaling** (ridge relative sensitivity, eqs. 9–10 of the paper): the paper's b_i = X_i y_i/n
   makes eq. (10) inconsistent by a factor n. ``ridge_relative_sensitivity`` uses the consistent form with
   unnormalised per-record gradients,
   η² = (3/n²)(‖A₀A⁻¹‖² + ‖A₀′A⁻¹‖²), R_rel² = (3/n²)·sup‖∇ℓ₀(θ*) − ∇ℓ₀′(θ*)‖².
5. **Prop. 1's η** (feature clipping): its proof uses "Ã ⪰ ρC ⇒ Ã⁻² ⪯ ρ⁻²C⁻²", false for a C that does not
   commute with Ã; for a general C the valid constant is η² = 6κ_C R_c⁴/(ρ²n²). This module only uses C = I
   (rows clipped to ‖x_i‖ ≤ X, curvature A ⪰ λI from the public ridge λ, so ρ = λ), where Prop. 1 holds:
   η² = 6X⁴/(λ²n²). Nothing here depends on the data, unlike the paper's experiments (which compute η from
   the data).
6. **Theorem 2's factor d** (utility, Theorem 2 and App. B.1 of the paper), for callers that run gradient
   descent with ``rgm_release``: with per-coordinate variance the noise floor is τdσ²/μ (not τσ²/μ) and the
   step size must satisfy τ ≤ 1/((1+dγ)L) (not (L+γ)⁻¹), because E‖noise‖² = d·v.

Numerics: every value returned by the bound functions is an upper bound on the exact real value (inputs
rounded in the conservative direction, series with tail bounds where the direct formula cancels, then a
relative pad of a few dozen ulps). Composition over steps, (ε, δ) conversion and PTR are not here.
Sampling is exact and grid-valued (``rgm_release_grid``: the mean rounded to a public grid, a discrete
Gaussian with the scale rounded up; docs/privacy/finite_precision_learners.md#fp-learners, Lemma THETA and
Theorem RGM-GRID), and v(x), ‖R(x)‖ and the noise scale are secret: never release or log them.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from mechanisms.accounting.curve import RdpCurve
from mechanisms.accounting.orders import validate_orders
from mechanisms.noise import Grid, Noise
from mechanisms.noise.learners import MAX_STD, discrete_gaussian_std

Bound = Literal["theorem1", "exact"]

_EPS = float(np.finfo(float).eps)
_TINY_PRODUCT = 1e-290  # X·Y below this loses digits to subnormal floats (the gap bound refuses it)
_PAD = 64 * _EPS


# ----- small numerical helpers -------------------------------------------------------------------------
def _up(value: float, rel: float = _PAD) -> float:
    """``value`` raised by ``rel`` relative and one ulp: covers the rounding of a short float computation."""
    if value == 0.0 or not math.isfinite(value):
        return value
    return math.nextafter(value * (1.0 + rel), math.inf)


def _finite_nonnegative(value: float, what: str) -> float:
    value = float(value)
    if not (math.isfinite(value) and value >= 0.0):
        raise ValueError(f"{what} must be finite and ≥ 0, got {value!r}")
    return value


def _check_dimension(d: int) -> int:
    if isinstance(d, bool) or not isinstance(d, int | np.integer) or int(d) < 1:
        raise ValueError(f"the output dimension d must be an integer ≥ 1, got {d!r}")
    return int(d)


def _check_order(alpha: float) -> float:
    alpha = float(alpha)
    if not (math.isfinite(alpha) and alpha >= 1.0):
        raise ValueError(f"the Rényi order must be finite and ≥ 1, got {alpha!r}")
    return alpha


def _check_release(sigma: float, r_rel: float, d: int, bound: str) -> tuple[float, float, int]:
    """(σ, R_rel, d) of one release, checked in that order, and its bound's name."""
    sigma = _finite_nonnegative(sigma, "sigma")
    r_rel = _finite_nonnegative(r_rel, "r_rel")
    d = _check_dimension(d)
    if bound not in ("theorem1", "exact"):
        raise ValueError(f"bound must be 'theorem1' or 'exact', got {bound!r}")
    return sigma, r_rel, d


def _check_eta_gamma(eta: float, gamma: float) -> tuple[float, float]:
    eta = _finite_nonnegative(eta, "eta")
    gamma = _finite_nonnegative(gamma, "gamma")
    if eta == 0.0:
        raise ValueError("eta must be > 0 for the RGM bounds (eta = 0 is the plain Gaussian mechanism)")
    if gamma == 0.0:
        raise ValueError("gamma must be > 0 when eta > 0 (without it the loss is unbounded)")
    return eta, gamma


def _w_upper(eta: float) -> float:
    """An upper bound on w = η(2+η) = (1+η)² − 1."""
    return _up(eta * (2.0 + eta), 4 * _EPS)


def _t_and_rho(alpha: float, w: float) -> tuple[float, float]:
    """(t, ρ) with t ≥ (α−1)w and ρ = 1 − t ≤ ρ_α (ρ ≤ 0 means: at or beyond the ceiling)."""
    t = _up((alpha - 1.0) * w, 4 * _EPS) if alpha > 1.0 else 0.0
    return t, 1.0 - t


@dataclass(frozen=True)
class _Order:
    """The checked inputs of a per-order bound and the derived w ≥ η(2+η), t ≥ (α−1)w, ρ = 1 − t."""

    alpha: float
    eta: float
    gamma: float
    d: int
    w: float
    t: float
    rho: float


def _order(alpha: float, eta: float, gamma: float, d: int) -> _Order:
    alpha = _check_order(alpha)
    eta, gamma = _check_eta_gamma(eta, gamma)
    d = _check_dimension(d)
    w = _w_upper(eta)
    t, rho = _t_and_rho(alpha, w)
    return _Order(alpha, eta, gamma, d, w, t, rho)


def _w_minus_log1p(w: float) -> float:
    """An upper bound on w − log(1+w) ≥ 0, without cancellation for small w."""
    if w >= 0.125:
        return _up(w - math.log1p(w), 256 * _EPS)
    # Alternating series Σ_{k≥2} (−1)^k w^k/k with decreasing terms: adding the first omitted term
    # (positive when the last kept one is negative) gives an upper bound.
    total = 0.0
    power = w * w
    k = 2
    while True:
        term = power / k
        total += term if k % 2 == 0 else -term
        if k % 2 == 1 and term < _EPS * total * 1e-3:
            total += power * w / (k + 1)  # first omitted term (k+1 even, positive)
            break
        power *= w
        k += 1
    return _up(total)


def _phi_minus_one(t: float, rho: float) -> float:
    """An upper bound on φ(t) − 1 = −log(1−t)/t − 1 = Σ_{k≥1} t^k/(k+1), for 0 ≤ t < 1 (ρ = 1 − t)."""
    if t == 0.0:
        return 0.0
    if t > 0.5:
        # −log(1−t) − t ≥ 0.19 t here, so the subtraction loses at most a few ulps.
        return _up((-math.log(rho) - t) / t, 256 * _EPS)
    total = 0.0
    power = t
    k = 1
    while True:
        term = power / (k + 1)
        total += term
        power *= t
        k += 1
        tail = power / ((k + 1) * (1.0 - t))  # Σ_{j≥k} t^j/(j+1) ≤ t^k/((k+1)(1−t))
        if tail < _EPS * total * 1e-3:
            return _up(total + tail)


# ----- the α domain and the σ² condition -----------------------------------------------------------------
def alpha_max(eta: float) -> float:
    """The ceiling α_max = (1+η)²/(η(2+η)) = 1 + 1/(η(2+η)): bounds are +∞ at and beyond it (∞ for η = 0)."""
    eta = _finite_nonnegative(eta, "eta")
    if eta == 0.0:
        return math.inf
    return 1.0 + 1.0 / (eta * (2.0 + eta))


def sigma2_lemma1_threshold(eta: float, gamma: float, r_rel: float) -> float:
    """Lemma 1's σ² threshold (γR_rel²/η²)(1+η)/(2+η): below it no order < α_max satisfies Theorem 1."""
    eta, gamma = _check_eta_gamma(eta, gamma)
    r_rel = _finite_nonnegative(r_rel, "r_rel")
    return gamma * r_rel**2 / eta**2 * (1.0 + eta) / (2.0 + eta)


def sigma2_required(alpha: float, eta: float, gamma: float, r_rel: float) -> float:
    """Theorem 1's σ² condition at order α: σ² ≥ γη⁻²[1 − η(α−1)]R_rel² (decreasing in α)."""
    alpha = _check_order(alpha)
    eta, gamma = _check_eta_gamma(eta, gamma)
    r_rel = _finite_nonnegative(r_rel, "r_rel")
    return max(0.0, gamma * r_rel**2 / eta**2 * (1.0 - eta * (alpha - 1.0)))


def alpha_lo(eta: float, gamma: float, sigma: float, r_rel: float) -> float:
    """The smallest order at which σ² satisfies Theorem 1's condition (rounded up); 1 if it holds for all.

    Raises ValueError if σ² is below Lemma 1's threshold. A result ≥ ``alpha_max(eta)`` means the condition
    holds at no admissible order (σ² exactly at Lemma 1's threshold).
    """
    eta, gamma = _check_eta_gamma(eta, gamma)
    sigma = _finite_nonnegative(sigma, "sigma")
    r_rel = _finite_nonnegative(r_rel, "r_rel")
    if r_rel == 0.0:
        return 1.0
    ratio = (sigma * sigma * eta * eta) / (gamma * r_rel * r_rel)  # σ²η²/(γR²); condition: 1−η(α−1) ≤ ratio
    if ratio >= 1.0:
        return 1.0
    if ratio < (1.0 + eta) / (2.0 + eta):
        raise ValueError(
            "sigma² is below Lemma 1's threshold γR_rel²(1+η)/(η²(2+η)); use sigma² ≥ γR_rel²/η² "
            f"(= {gamma * r_rel**2 / eta**2!r}) to satisfy Theorem 1 at every order"
        )
    ratio_lo = ratio * (1.0 - 8 * _EPS)
    return _up(1.0 + (1.0 - ratio_lo) / eta, 8 * _EPS)


# ----- the two RDP bounds ----------------------------------------------------------------------------------
def _mean_term(alpha: float, eta: float, gamma: float, rho: float) -> float:
    """αη²/(2γρ_α): the bound on α‖R(x)−R(y)‖²/(2s), common to both curves."""
    return _up(alpha * eta * eta / (2.0 * gamma * rho))


def theorem1_epsilon(alpha: float, eta: float, gamma: float, d: int) -> float:
    """Theorem 1, eq. (5): αη²/(2γρ_α) + αdη²(2+η)²(1+η)²/(2ρ_α); +∞ for α ≥ α_max.

    Valid for the RGM on any query with (η, R_rel)-relative L2 sensitivity **provided** σ² satisfies the
    condition at α (``sigma2_required``); ``rgm_rdp_curve`` enforces that. α = 1 gives the KL bound.
    """
    o = _order(alpha, eta, gamma, d)
    if o.rho <= 0.0:
        return math.inf
    # η²(2+η)²(1+η)² = w²(1+w)
    noise_term = _up(o.alpha * o.d * o.w * o.w * (1.0 + o.w) / (2.0 * o.rho))
    return _up(_mean_term(o.alpha, o.eta, o.gamma, o.rho) + noise_term, 4 * _EPS)


def exact_epsilon(alpha: float, eta: float, gamma: float, d: int) -> float:
    """The exact worst-case D_α of the RGM over relative-sensitivity queries (Lemma EXACT,
    docs/privacy/gradient_descent.md#lemma-exact).

    αη²/(2γρ_α) + (d/(α−1))·[−α log(1+η) − ½ log(1 − αη(2+η)/(1+η)²)], computed as
    αη²/(2γρ_α) + (d/2)·[(w − log(1+w)) + w(φ(t) − 1)], w = η(2+η), t = (α−1)w, φ(t) = −log(1−t)/t.
    Same conditions as ``theorem1_epsilon``; ≤ it; +∞ for α ≥ α_max; α = 1 gives the KL limit
    η²/(2γ) + (d/2)(w − log(1+w)). The supremum is approached (not attained) by R(x) = p·e,
    R(y) = R(x)/(1+η), p → ∞.
    """
    o = _order(alpha, eta, gamma, d)
    if o.rho <= 0.0:
        return math.inf
    log_term = _up(0.5 * o.d * (_w_minus_log1p(o.w) + _up(o.w * _phi_minus_one(o.t, o.rho))))
    return _up(_mean_term(o.alpha, o.eta, o.gamma, o.rho) + log_term, 4 * _EPS)


def rgm_rdp_curve(
    orders: Sequence[float],
    *,
    eta: float,
    gamma: float,
    sigma: float,
    r_rel: float,
    d: int,
    bound: Bound = "theorem1",
) -> RdpCurve:
    """The RDP curve of one RGM_{γ,σ} release of a d-dimensional query with (η, R_rel)-relative sensitivity.

    ``bound="theorem1"`` (default) is the paper's eq. (5); ``bound="exact"`` is the derived exact worst case
    of Lemma EXACT (docs/privacy/gradient_descent.md#lemma-exact). Orders below α_lo are charged ε(α_lo);
    orders ≥ α_max are +∞; no pure bound. Raises ValueError on invalid parameters or σ² below Lemma 1's
    threshold (see the module docstring).
    """
    grid = validate_orders(orders)
    eta = _finite_nonnegative(eta, "eta")
    gamma = _finite_nonnegative(gamma, "gamma")
    sigma, r_rel, d = _check_release(sigma, r_rel, d, bound)
    if eta == 0.0:
        if gamma != 0.0:
            raise ValueError("eta = 0 is absolute sensitivity: gamma must be 0 (plain Gaussian mechanism)")
        return RdpCurve.gaussian(r_rel, sigma, grid)
    _check_eta_gamma(eta, gamma)
    lowest = alpha_lo(eta, gamma, sigma, r_rel)
    epsilon = theorem1_epsilon if bound == "theorem1" else exact_epsilon
    values = tuple(epsilon(max(alpha, lowest), eta, gamma, d) for alpha in grid)
    return RdpCurve(grid, values)


# ----- the RGM on a public grid (docs/privacy/finite_precision_learners.md#theorem-rgm-grid) ---------------
GRID_BITS = 24
"""The release grid γ_g is the largest power of two ≤ σ·2^−GRID_BITS/√d: σ/γ_g ≥ 2^GRID_BITS·√d grid units."""
_SCALE_SLACK = 2.0**-30  # relative margin on the computed variance (float error ≤ (d + 8)·2^−53, d ≤ 2^20)


def rgm_grid(sigma: float, d: int) -> Grid:
    """γ_g = the largest power of two ≤ σ·2^−24/√d (public: σ and d only)."""
    sigma = _finite_nonnegative(sigma, "sigma")
    d = _check_dimension(d)
    if sigma == 0.0:
        raise ValueError("the grid RGM needs sigma > 0")
    size = sigma * 2.0**-GRID_BITS / math.sqrt(d) * (1.0 - 4 * _EPS)
    return Grid(math.frexp(size)[1] - 1)


def _grid_floor_units(d: int) -> float:
    """A lower bound on σ/γ_g for every σ: 2^24·√d (rounded down)."""
    return math.ldexp(math.sqrt(d), GRID_BITS) * (1.0 - 4 * _EPS)


def _theta_tail(x: float) -> float:
    """E(x) = 2e^{−2π²x}/(1 − e^{−2π²x}) ≥ 2Σ_{k≥1} e^{−2π²xk²}: the Poisson-summation bound on the relative
    error of the discrete Gaussian normaliser of variance x (rounded up; 0 when it underflows, < 1e−300)."""
    tail = math.exp(-2.0 * math.pi * math.pi * x)
    if tail == 0.0:
        return 0.0
    return _up(2.0 * tail / -math.expm1(-2.0 * math.pi * math.pi * x), 16 * _EPS)


def _discrete_correction(alpha: float, units: float) -> float:
    """Per coordinate: D_α(N_Z(μ, s²)‖N_Z(μ′, s′²)) − D_α(N(μ, s²)‖N(μ′, s′²)) ≤
    [log(1 + E(units²/α)) + (α−1)·log(1 + E(units²)) − α·log(1 − E(units²))]/(α−1), for s, s′ ≥ units and
    the combined variance v = s²s′²/(αs′² − (α−1)s²) ≥ s²/α
    (docs/privacy/finite_precision_learners.md#lemma-theta, Lemma THETA)."""
    e_v = _theta_tail(units * units / alpha)
    e_s = _theta_tail(units * units)
    if e_v == 0.0 and e_s == 0.0:
        return 0.0
    if not e_s < 1.0:
        return math.inf
    total = math.log1p(e_v) + (alpha - 1.0) * math.log1p(e_s) - alpha * math.log1p(-e_s)
    return _up(total / (alpha - 1.0), 64 * _EPS)


def grid_scale_ratio(d: int) -> float:
    """q ≥ t²/v: the integer standard deviation t = ⌈√v̂·(1 + 2^−30)⌉ ≥ √v over-shoots the variance by at most
    (1 + 2^−29 + 1/σ_u)², σ_u = σ/γ_g ≥ 2^24√d (v ≥ σ_u²)."""
    return _up((1.0 + 2.0**-29 + 1.0 / _grid_floor_units(d)) ** 2, 16 * _EPS)


def grid_rgm_bound(
    alpha: float, eta: float, gamma: float, d: int, *, units: float, ratio: float, bound: Bound = "exact"
) -> float:
    """Theorem RGM-GRID (docs/privacy/finite_precision_learners.md#theorem-rgm-grid): D_α of the grid RGM for
    any neighbours, when every standard deviation s (grid units) satisfies v ≤ s² ≤ ``ratio``·v, v ≥
    ``units``² the per-coordinate variance γ‖R‖² + σ² in grid units, σ² ≥ γR_rel²/η², and the means are R/γ_g
    rounded to integers.

    w_q = ratio·(1+η)² − 1, ρ_q = 1 − (α−1)w_q (+∞ if ≤ 0), p = √(d(1+w_q))·√γ/(η·units):
    αη²(1+p)²/(2γρ_q) + log term (``exact_epsilon``'s or Theorem 1's with w → w_q) + d·Poisson correction.
    """
    alpha = _check_order(alpha)
    eta, gamma = _check_eta_gamma(eta, gamma)
    d = _check_dimension(d)
    if alpha <= 1.0:
        raise ValueError("the grid RGM bound is stated for orders α > 1")
    if not (units >= 1.0 and ratio >= 1.0 and math.isfinite(ratio)):
        raise ValueError("units must be ≥ 1 and ratio ≥ 1")
    w = _up(ratio * (1.0 + eta) * (1.0 + eta) - 1.0, 8 * _EPS)
    t, rho = _t_and_rho(alpha, w)
    if rho <= 0.0:
        return math.inf
    penalty = _up(math.sqrt(d * (1.0 + w)) * math.sqrt(gamma) / (eta * units), 16 * _EPS)
    mean = _up(_mean_term(alpha, eta, gamma, rho) * (1.0 + penalty) * (1.0 + penalty), 8 * _EPS)
    if bound == "theorem1":
        log_term = _up(alpha * d * w * w * (1.0 + w) / (2.0 * rho))
    else:
        log_term = _up(0.5 * d * (_w_minus_log1p(w) + _up(w * _phi_minus_one(t, rho))))
    correction = d * _discrete_correction(alpha, units)
    return _up(mean + log_term + correction, 8 * _EPS)


def grid_rgm_epsilon(alpha: float, eta: float, gamma: float, d: int, bound: Bound = "exact") -> float:
    """Per-step RDP of ``rgm_release_grid`` on the default grid at order α, for any σ ≥ √γ·R_rel/η: the bound
    of ``grid_rgm_bound`` at units = 2^24√d (σ/γ_g is at least that) and ratio = ``grid_scale_ratio(d)``.
    A function of (α, η, γ, d) only (the σ-dependence is bounded by its worst case over σ's mantissa)."""
    d = _check_dimension(d)
    return grid_rgm_bound(
        alpha, eta, gamma, d, units=_grid_floor_units(d), ratio=grid_scale_ratio(d), bound=bound
    )


def rgm_grid_curve(
    orders: Sequence[float],
    *,
    eta: float,
    gamma: float,
    sigma: float,
    r_rel: float,
    d: int,
    bound: Bound = "exact",
) -> RdpCurve:
    """The RDP curve of one ``rgm_release_grid`` release (``grid_rgm_epsilon`` at each order; no pure bound).

    Needs η > 0, γ > 0 and σ² ≥ γR_rel²/η² (the baseline of ``rgm_gd.baseline_sigma``; ValueError
    otherwise: the grid theorem is proved under that condition only). +∞ where ρ_q ≤ 0.
    """
    grid = validate_orders(orders)
    eta, gamma = _check_eta_gamma(eta, gamma)
    sigma, r_rel, d = _check_release(sigma, r_rel, d, bound)
    if not sigma * sigma * eta * eta * (1.0 - 8 * _EPS) >= gamma * r_rel * r_rel:
        raise ValueError("the grid RGM needs sigma² ≥ γR_rel²/η² (use rgm_gd.baseline_sigma)")
    if any(alpha <= 1.0 for alpha in grid):
        raise ValueError("the grid RGM curve needs orders > 1")
    return RdpCurve(grid, tuple(grid_rgm_epsilon(alpha, eta, gamma, d, bound) for alpha in grid))


def grid_noise_units(value: np.ndarray, gamma: float, sigma: float, grid: Grid) -> int:
    """t = ⌈√v̂·(1 + 2^−30)⌉, v̂ = (γ‖value‖² + σ²)/γ_g² in floats (relative error ≤ (d + 8)·2^−53): an
    integer ≥ √v over-shooting by at most the factor of ``grid_scale_ratio``. SECRET (never released)."""
    vector = np.asarray(value, dtype=float)
    peak = float(np.max(np.abs(vector))) if vector.size else 0.0
    scaled = np.ldexp(vector, -grid.exponent)  # exact: the value in grid units
    with np.errstate(over="ignore"):
        variance = gamma * float(np.dot(scaled, scaled)) + math.ldexp(sigma, -grid.exponent) ** 2
    if not math.isfinite(variance) or not math.isfinite(peak):
        raise ValueError("the noise variance overflows: bound the query output (e.g. by clipping)")
    units = math.ceil(math.sqrt(variance) * (1.0 + _SCALE_SLACK))
    if units > MAX_STD:
        raise ValueError("the RGM noise scale exceeds 2^52 grid units")
    return max(units, 1)


def rgm_release_grid(
    value: np.ndarray,
    gamma: float,
    sigma: float,
    noise: Noise,
    *,
    grid: Grid | None = None,
    draws: int | None = None,
) -> np.ndarray:
    """The RGM on a public grid: γ_g·(round(value/γ_g) + Z), Z ~ N_Z(0, t²)^d i.i.d., t = ``grid_noise_units``
    (the per-coordinate variance γ‖value‖² + σ², in grid units, rounded up to an integer standard deviation).

    Every released number is an exact multiple of γ_g = ``grid`` (default ``rgm_grid(σ, d)``).
    ``draws=k`` returns k independent releases of the same value, shape (k, d) (audits); else shape (d,).
    """
    vector = np.asarray(value, dtype=float)
    if vector.ndim != 1 or vector.size == 0:
        raise ValueError("value must be a non-empty 1-D array (the query output R(x) in R^d)")
    if not np.all(np.isfinite(vector)):
        raise ValueError("value must be finite")
    gamma = _finite_nonnegative(gamma, "gamma")
    sigma = _finite_nonnegative(sigma, "sigma")
    chosen = grid if grid is not None else rgm_grid(sigma, vector.size)
    units = grid_noise_units(vector, gamma, sigma, chosen)
    mean = chosen.to_units(vector)
    count = 1 if draws is None else int(draws)
    if draws is not None and (isinstance(draws, bool) or int(draws) != draws or draws < 1):
        raise ValueError(f"draws must be an integer ≥ 1, got {draws!r}")
    z = discrete_gaussian_std(noise, units, count * vector.size).reshape(count, vector.size)
    released = chosen.from_units(mean[None, :] + z)
    result: np.ndarray = released[0] if draws is None else released
    return result


# ----- projection onto a public ball (for gradient-descent callers) -------------------------------------
def project_to_ball(theta: np.ndarray, radius: float) -> np.ndarray:
    """Π(θ) = θ·min(1, r/‖θ‖), the Euclidean projection onto {‖θ‖ ≤ r}, for a finite 1-D θ.

    The norm is computed on θ rescaled by a power of two (exact), so no intermediate overflows or
    underflows: the result is finite for every finite θ, and its norm is ≤ r·(1 + (d + 4)·2⁻⁵²) (rounding
    of the rescaled norm and of one product per coordinate). θ is **public** wherever this is used (a
    released iterate), so the projection is post-processing. Raises ValueError on a non-finite θ or radius.
    """
    vector = np.asarray(theta, dtype=float)
    if vector.ndim != 1:
        raise ValueError("theta must be a 1-D array")
    radius = _finite_nonnegative(radius, "radius")
    if not np.all(np.isfinite(vector)):
        raise ValueError("theta must be finite")
    peak = float(np.max(np.abs(vector))) if vector.size else 0.0
    if peak == 0.0:
        return vector.copy()
    scale = math.ldexp(1.0, math.frexp(peak)[1] - 1)  # a power of two in (peak/2, peak]: exact division
    unit = vector / scale  # entries in [−2, 2], the largest ≥ 1
    scaled_norm = float(np.linalg.norm(unit))  # in [1, 2√d]: ‖θ‖ = scale·scaled_norm
    if scaled_norm * scale <= radius:  # (may be +inf > radius: then projected)
        return vector.copy()
    projected: np.ndarray = unit * (radius / scaled_norm)
    return projected


# ----- relative sensitivity of the ridge least-squares gradient ------------------------------------------
@dataclass(frozen=True)
class RelativeSensitivity:
    """(η, R_rel) of Def. 2: ‖R(x) − R(y)‖² ≤ η²‖R(x)‖² + R_rel² for all neighbours."""

    eta: float
    r_rel: float


def clip_rows(features: np.ndarray, bound: float) -> np.ndarray:
    """Rows (records, last axis = features) rescaled to Euclidean norm ≤ ``bound``; short rows unchanged."""
    bound = _finite_nonnegative(bound, "bound")
    x = np.asarray(features, dtype=float)
    norms = np.linalg.norm(x, axis=-1, keepdims=True)
    scale = np.minimum(1.0, bound / np.maximum(norms, np.finfo(float).tiny))
    clipped: np.ndarray = x * scale
    return clipped


def ridge_gradient(theta: np.ndarray, features: np.ndarray, labels: np.ndarray, reg: float) -> np.ndarray:
    """∇f(θ) = (1/n)Xᵀ(Xθ − y) + λθ for f(θ) = (1/n)Σ ½(x_iᵀθ − y_i)² + (λ/2)‖θ‖² (paper eq. 9).

    ``features`` has shape (..., n, d) (rows are records), ``labels`` (..., n), ``theta`` (..., d); leading
    axes broadcast, so a batch of datasets and/or parameters is one call.
    """
    x = np.asarray(features, dtype=float)
    y = np.asarray(labels, dtype=float)
    th = np.asarray(theta, dtype=float)
    n = x.shape[-2]
    residual = np.einsum("...nd,...d->...n", x, th) - y
    gradient: np.ndarray = np.einsum("...nd,...n->...d", x, residual) / n + reg * th
    return gradient


def _ridge_inputs(
    n_rows: int, reg: float, feature_bound: float, label_bound: float
) -> tuple[float, float, float, float]:
    """(n, λ, X, Y) of a ridge relative-sensitivity bound, validated: n ≥ 1 an integer, λ > 0, X, Y ≥ 0."""
    if isinstance(n_rows, bool) or int(n_rows) != n_rows or n_rows < 1:
        raise ValueError(f"n_rows must be an integer ≥ 1, got {n_rows!r}")
    reg = _finite_nonnegative(reg, "reg")
    if reg == 0.0:
        raise ValueError("reg must be > 0: the ridge term is the public curvature lower bound")
    x_max = _finite_nonnegative(feature_bound, "feature_bound")
    y_max = _finite_nonnegative(label_bound, "label_bound")
    return float(n_rows), reg, x_max, y_max


def ridge_relative_sensitivity(
    n_rows: int, reg: float, feature_bound: float, label_bound: float
) -> RelativeSensitivity:
    """(η, R_rel) of the full-batch ridge gradient θ ↦ ∇f(θ; D), uniformly in θ, from public parameters.

    Setting (paper eqs. 9–11 with the corrected scaling of item 4 above): replace-one neighbours with n
    public, every record clipped to ‖x_i‖ ≤ X = ``feature_bound`` and |y_i| ≤ Y = ``label_bound``, ridge λ =
    ``reg`` > 0, so A = (1/n)Σ x_i x_iᵀ + λI ⪰ λI for every dataset. With A₀ = x₀x₀ᵀ, θ* = A⁻¹b,
    n(∇f − ∇f′)(θ) = (A₀ − A₀′)A⁻¹∇f(θ) + [∇ℓ₀(θ*) − ∇ℓ₀′(θ*)] and (a+b+c)² ≤ 3(a²+b²+c²) give

    * η² = (3/n²)(‖A₀A⁻¹‖² + ‖A₀′A⁻¹‖²) ≤ 6X⁴/(λ²n²)  (‖x₀x₀ᵀA⁻¹‖ ≤ ‖x₀‖²/λ),
    * R_rel² = (3/n²)·sup‖x₀r₀ − x₀′r₀′‖² ≤ 12X²(X·B + Y)²/n², residual r₀ = x₀ᵀθ* − y₀, where
      ‖θ*‖ ≤ B = Y·min(X/λ, 1/√λ) (‖b‖ ≤ XY, and (λ/2)‖θ*‖² ≤ f(θ*) ≤ f(0) ≤ Y²/2).

    The bound holds for θ that is public (e.g. the previous noisy iterate); it is C = I in Prop. 1.
    """
    n, reg, x_max, y_max = _ridge_inputs(n_rows, reg, feature_bound, label_bound)
    eta = _up(math.sqrt(6.0) * x_max * x_max / (reg * n))
    theta_bound = y_max * min(x_max / reg, 1.0 / math.sqrt(reg))
    r_rel = _up(math.sqrt(12.0) * x_max * (x_max * theta_bound + y_max) / n)
    return RelativeSensitivity(eta=eta, r_rel=r_rel)


def ridge_theta_bound(reg: float, feature_bound: float, label_bound: float) -> float:
    """sup ‖θ*‖ over datasets with ‖x_i‖ ≤ X, |y_i| ≤ Y: Y/(2√λ) if X ≥ √λ, else XY/(X² + λ) (rounded up).

    θ* = (MᵀM + λI)⁻¹Mᵀỹ with M = X_data/√n, ỹ = y/√n (‖ỹ‖ ≤ Y); the singular values of
    (MᵀM + λI)⁻¹Mᵀ are s/(s² + λ) for the singular values s ∈ [0, X] of M, maximal at s = min(√λ, X).
    """
    reg = _finite_nonnegative(reg, "reg")
    if reg == 0.0:
        raise ValueError("reg must be > 0")
    x_max = _finite_nonnegative(feature_bound, "feature_bound")
    y_max = _finite_nonnegative(label_bound, "label_bound")
    root = math.sqrt(reg)
    if x_max >= root:
        return _up(y_max / (2.0 * root))
    return _up(x_max * y_max / (x_max * x_max + reg))


@functools.lru_cache(maxsize=256)
def ridge_gradient_gap_bound(reg: float, feature_bound: float, label_bound: float, grid: int = 2048) -> float:
    """D ≥ ‖x₀r₀ − x₀′r₀′‖, r = xᵀθ* − y, for any two records (‖x‖ ≤ X, |y| ≤ Y) and any ‖θ*‖ ≤ B
    (B = ``ridge_theta_bound``): the diameter of the per-record gradient set S(θ) = {x(xᵀθ − y)},
    maximised over the ball (derived; proof in docs/privacy/gradient_descent.md#lemma-ridge-split, Lemma
    RIDGE-SPLIT step 4′).

    * S(θ) is a body of revolution about θ: a record with ‖x‖ = s whose gradient g makes the angle
      ψ ∈ [0, π] with θ has ‖g‖ ≤ s·(Y + s‖θ‖cos ψ)₊ (x is ±s times the direction of g), so
      ‖g‖ ≤ R(ψ) = max_{0≤s≤X} s(Y + s‖θ‖cos ψ)₊: X(Y + X‖θ‖cos ψ)₊, or Y²/(4‖θ‖·|cos ψ|) where
      cos ψ < −Y/(2X‖θ‖) (the maximiser s = Y/(2‖θ‖·|cos ψ|) is then inside [0, X]).
    * For two such points, ‖g − g′‖² ≤ R₁² + R₂² − 2R₁R₂cos(ψ₁ + ψ₂) (the perpendicular parts point in
      opposite directions at worst), and the maximum over R₁ ∈ [0, R(ψ₁)] sits at an end of the interval
      (convex in R₁); the end 0 is dominated (take ψ₁ = π − ψ₂). So diam S(θ) ≤ max over ψ₁, ψ₂ of the
      distance Φ between P(ψ₁) = R(ψ₁)(cos ψ₁, sin ψ₁) and the reflection of P(ψ₂).
    * The width of S(tθ̂) in any direction is a sup of functions affine in t minus an inf of such, so
      diam S(tθ̂) is convex in t and its maximum over t ∈ [0, B] is at t = 0 (2XY) or t = B.
    * Φ is Lipschitz in each angle with constant L = X(Y + XB) + X²B ≥ R + |R′| ≥ ‖P′(ψ)‖ (R ≤ X(Y + XB),
      and R is a max of functions of ψ with derivatives ≤ s²B ≤ X²B), so its maximum is at most
      the maximum on a grid of spacing h = π/``grid`` plus L·h.

    Returns min(2X(XB + Y), max(2XY, grid maximum + L·h)), rounded up. Cached (public inputs only).
    4.389 at λ = 0.03, X = Y = 1 (the triangle inequality gives 7.774, the explicit neighbours of
    ``mechanisms.learners.rgm_calibration.ridge_r_rel_floor`` reach 4.378).
    """
    reg = _finite_nonnegative(reg, "reg")
    x_max = _finite_nonnegative(feature_bound, "feature_bound")
    y_max = _finite_nonnegative(label_bound, "label_bound")
    if isinstance(grid, bool) or not isinstance(grid, int | np.integer) or grid < 16:
        raise ValueError(f"grid must be an integer ≥ 16, got {grid!r}")
    if x_max > 0.0 and y_max > 0.0 and not x_max * y_max >= _TINY_PRODUCT:
        raise ValueError("feature_bound·label_bound is below the normal float range: rescale the data")
    radius = ridge_theta_bound(reg, x_max, y_max)
    triangle = _up(2.0 * x_max * (x_max * radius + y_max))
    psi = np.linspace(0.0, math.pi, int(grid) + 1)
    largest = 0.0
    with np.errstate(over="ignore", invalid="ignore"):
        cos = np.cos(psi)
        length = x_max * np.maximum(y_max + x_max * radius * cos, 0.0)  # s = X
        pull = radius * np.maximum(-cos, 0.0)  # ‖θ‖·|cos ψ| where cos ψ < 0
        inside = 2.0 * pull * x_max > y_max  # the maximiser s = Y/(2‖θ‖|cos ψ|) is below X
        interior = np.divide(y_max * y_max, 4.0 * pull, out=np.zeros_like(pull), where=inside)
        length = np.maximum(length, interior)
        px, py = length * cos, length * np.sin(psi)
        for start in range(0, psi.size, 256):  # blocks of rows: bounded memory
            dx = px[start : start + 256, None] - px[None, :]
            dy = py[start : start + 256, None] + py[None, :]
            block = float(np.max(dx * dx + dy * dy))
            if not math.isfinite(block):  # overflow (huge X·B): the triangle inequality is the bound
                return triangle
            largest = max(largest, block)
    lipschitz = x_max * (y_max + x_max * radius) + x_max * x_max * radius
    certified = _up(math.sqrt(largest), 256 * _EPS) + _up(lipschitz * math.pi / int(grid))
    return min(triangle, max(_up(2.0 * x_max * y_max), _up(certified)))


def ridge_relative_sensitivity_split(
    n_rows: int, reg: float, feature_bound: float, label_bound: float, split: float = 3.0
) -> RelativeSensitivity:
    """A tighter (η, R_rel) for the full-batch ridge gradient, uniformly in θ (derived; replace-one).

    Same identity as ``ridge_relative_sensitivity``: n(∇f − ∇f′)(θ) = (A₀ − A₀′)A⁻¹∇f(θ) + c with
    c = ∇ℓ₀(θ*) − ∇ℓ₀′(θ*). Three refinements (proofs in docs/privacy/gradient_descent.md#lemma-ridge-split):

    * ‖A₀ − A₀′‖ ≤ max(‖x₀‖², ‖x₀′‖²) ≤ X² (x₀x₀ᵀ − x₀′x₀′ᵀ has one eigenvalue in [0, ‖x₀‖²], one in
      [−‖x₀′‖², 0], the rest 0) and ‖A⁻¹‖ ≤ 1/λ;
    * Young's inequality ‖a + c‖² ≤ (1 + κ)‖a‖² + (1 + 1/κ)‖c‖² with the public ``split`` κ > 0, instead of
      (a + b + c)² ≤ 3(a² + b² + c²);
    * ‖θ*‖ ≤ B = ``ridge_theta_bound`` (Y/(2√λ) instead of Y/√λ), and ‖c‖ ≤ D = ``ridge_gradient_gap_bound``
      (the diameter of the per-record gradient set over the ball; ≤ 2X(XB + Y), the triangle inequality).

    Hence η² = (1 + κ)X⁴/(λ²n²) and R_rel² = (1 + 1/κ)·D²/n². With κ = 3: η = 2X²/(λn)
    (vs √6X²/(λn)) and R_rel = (2/√3)·D/n (vs √12·X(XB′ + Y)/n with a larger B′).
    """
    n, reg, x_max, y_max = _ridge_inputs(n_rows, reg, feature_bound, label_bound)
    split = float(split)
    if not (math.isfinite(split) and split > 0.0):
        raise ValueError(f"split must be finite and > 0, got {split!r}")
    eta = _up(math.sqrt(1.0 + split) * x_max * x_max / (reg * n))
    gap = ridge_gradient_gap_bound(reg, x_max, y_max)
    r_rel = _up(math.sqrt(1.0 + 1.0 / split) * gap / n)
    return RelativeSensitivity(eta=eta, r_rel=r_rel)
