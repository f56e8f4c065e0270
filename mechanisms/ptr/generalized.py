"""The generalized propose-test-release core (Redberg, Zhu & Wang 2023;
docs/privacy/approximate.md#gen-ptr-and-ops-ptr).

Gen-PTR (Alg 4): release an (ε̂, δ̂)-DP test T(X); if it passes run M_φ(X), else return ⊥. If P[T(X) = 1] ≤ δ′
whenever the data-dependent loss ε_φ(X) exceeds ε (both directions of the pair, Def 3.5.1), the pair
(T, output) is (ε + ε̂, δ + δ̂ + δ′)-DP (Thm 3.5.3); the released-bound form (Thm 3.5.7 / B.2.4) releases a
private upper bound on ε_φ(X) and chooses φ from it by post-processing.

Tests here are built from one-sided confidence bounds on integers released with discrete Laplace noise
(``Noise.discrete_laplace``, exact): ``lower_bound_release`` / ``upper_bound_release`` subtract / add the
margin k = ⌈t·log(1/δ′)⌉ (grid units), so that P[bound on the wrong side] ≤ P[Z > k] ≤ e^{−(k+1)/t} ≤ δ′.

Also here, as checked helpers:
* ``liu_talwar_total`` / ``liu_talwar_per_call``: Alg 5's budget (Liu & Talwar 2019, Thm 3.4 as quoted in
  Thm 3.5.6) and the per-call budget of the thesis's experiment;
* ``printed_rdp_bound`` (Thm B.2.5 as printed: unsound), ``holder_rdp_bound`` (the Hölder-corrected RDP
  bound) and ``joint_renyi_two_point`` (the exact divergence of the joint (test bit, release) on the
  counterexample), for docs/privacy/approximate.md#rdp-gen-ptr-not-used.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import TypeVar

from mechanisms.noise import Noise, dyadic_scale_up

_PAD = 1.0 + 1e-12
_T = TypeVar("_T")


@dataclass(frozen=True)
class GenPtrBudget:
    """The public budget of one Gen-PTR call: test (ε̂, δ̂), false-positive rate δ′, mechanism (ε, δ)."""

    test_epsilon: float
    test_delta: float
    false_positive: float
    mechanism_epsilon: float
    mechanism_delta: float

    def __post_init__(self) -> None:
        for name in ("test_epsilon", "mechanism_epsilon"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0.0):
                raise ValueError(f"{name} must be finite and > 0")
        for name in ("test_delta", "false_positive", "mechanism_delta"):
            value = getattr(self, name)
            if not (math.isfinite(value) and 0.0 <= value < 1.0):
                raise ValueError(f"{name} must be in [0, 1)")

    @property
    def epsilon(self) -> float:
        """ε + ε̂, rounded up."""
        return math.nextafter(self.test_epsilon + self.mechanism_epsilon, math.inf)

    @property
    def delta(self) -> float:
        """δ + δ̂ + δ′, rounded up (Thm 3.5.3: the three add, no e^ε factor;
        docs/privacy/approximate.md#gen-ptr-and-ops-ptr)."""
        exact = Fraction(self.mechanism_delta) + Fraction(self.test_delta) + Fraction(self.false_positive)
        result = float(exact)
        return result if Fraction(result) >= exact else math.nextafter(result, math.inf)


def gen_ptr(test_passes: bool, mechanism: _T | None) -> _T | None:
    """Alg 4's output given the test bit: the mechanism's release if the test passed, else ⊥ (None).
    The caller runs the mechanism only when the test passed (the release is a post-processing choice)."""
    return mechanism if test_passes else None


def margin_units(scale: Fraction, false_positive: float) -> int:
    """k = ⌈t·log(1/δ′)⌉ (padded up): P[Z > k] ≤ e^{−(k+1)/t} ≤ δ′ for Z ~ DLap(t), P(z) ∝ e^{−|z|/t}."""
    if not (0.0 < false_positive < 1.0):
        raise ValueError("the false-positive rate must be in (0, 1)")
    return math.ceil(float(scale) * math.log(1.0 / false_positive) * _PAD)


def laplace_scale_units(sensitivity_units: int, epsilon: float) -> Fraction:
    """A dyadic scale t ≥ m/ε (grid units) for an integer sensitivity m ≥ 1: (m/t ≤ ε)-DP (Theorem DLAP)."""
    if sensitivity_units < 1:
        raise ValueError("the sensitivity in grid units must be ≥ 1")
    exact_epsilon = min(Fraction(epsilon), Fraction(repr(float(epsilon))))
    return dyadic_scale_up(Fraction(sensitivity_units) / exact_epsilon)


def lower_bound_release(noise: Noise, units: int, scale: Fraction, false_positive: float) -> int:
    """units + Z − k: below ``units`` except with probability ≤ δ′ (pure (m/t)-DP as a function of units)."""
    z = int(noise.discrete_laplace(scale, 1)[0])
    return units + z - margin_units(scale, false_positive)


def upper_bound_release(noise: Noise, units: int, scale: Fraction, false_positive: float) -> int:
    """units + Z + k: above ``units`` except with probability ≤ δ′."""
    z = int(noise.discrete_laplace(scale, 1)[0])
    return units + z + margin_units(scale, false_positive)


# ----- Alg 5: Liu–Talwar random stopping ------------------------------------------------------------------


def liu_talwar_total(eps_star: float, delta_star: float, tau: float, delta2: float) -> tuple[float, float]:
    """(3ε* + 3√(2δ*), √(2δ*)·T + δ₂) with T = log(1/δ₂)/τ (Liu & Talwar 2019, Thm 3.4; thesis Thm 3.5.6)."""
    cutoff = math.log(1.0 / delta2) / tau
    root = math.sqrt(2.0 * delta_star)
    return 3.0 * eps_star + 3.0 * root, root * cutoff + delta2


def liu_talwar_per_call(epsilon: float, delta: float, k: int) -> dict[str, float]:
    """The thesis's experiment recipe (Fig 3.1): τ = 0.05/k, δ₂ = δ/2, T = log(1/δ₂)/τ,
    δ* = ((δ − δ₂)/T)²/2, ε* = (ε − 3√(2δ*))/3, then per call ε_OPS = ε̂ = ε*/2, δ_OPS = δ*/6, δ′ = δ*/2,
    δ̂ = δ*/3."""
    tau = 0.05 / k
    delta2 = delta / 2.0
    cutoff = math.log(1.0 / delta2) / tau
    delta_star = ((delta - delta2) / cutoff) ** 2 / 2.0
    eps_star = (epsilon - 3.0 * math.sqrt(2.0 * delta_star)) / 3.0
    return {
        "tau": tau,
        "delta2": delta2,
        "cutoff": cutoff,
        "delta_star": delta_star,
        "eps_star": eps_star,
        "eps_ops": eps_star / 2.0,
        "eps_test": eps_star / 2.0,
        "delta_ops": delta_star / 6.0,
        "delta_prime": delta_star / 2.0,
        "delta_test": delta_star / 3.0,
    }


# ----- RDP Gen-PTR (route (b), not admitted; docs/privacy/approximate.md#rdp-gen-ptr-not-used) --------------


def printed_rdp_bound(alpha: float, test_rdp: float, worst_rdp: float, good_rdp: float, fp: float) -> float:
    """Thm B.2.5 as printed: ε̂(α) + log(δ′e^{(α−1)ε̃(α)} + (1−δ′)e^{(α−1)ε(α)})/(α−1). **Unsound.**"""
    a = alpha - 1.0
    return test_rdp + math.log(fp * math.exp(a * worst_rdp) + (1.0 - fp) * math.exp(a * good_rdp)) / a


def holder_rdp_bound(
    alpha: float,
    test_rdp: float,
    worst_rdp: float,
    good_rdp: float,
    fp: float,
    *,
    alpha_prime: float | None = None,
    test_rdp_prime: float | None = None,
    test_pure: float | None = None,
) -> float:
    """The Hölder-corrected RDP bound of Gen-PTR at order α.

    (1/(α−1))·log max{e^{(α−1)(ε̂(α)+ε(α))}, e^{(α−1)ε̂(α)} + c·(e^{(α−1)ε̃(α)} − 1)} with
    c = δ′^{(α′−α)/(α′−1)}·e^{(α−1)ε̂(α′)} for a test RDP at α′ > α, or c = δ′·e^{(α−1)ε̂_∞} for a pure test
    (the smaller of the two when both are given). Needs a finite data-independent ε̃(α).
    """
    a = alpha - 1.0
    candidates: list[float] = []
    if alpha_prime is not None and test_rdp_prime is not None:
        if alpha_prime <= alpha:
            raise ValueError("the Hölder order α′ must exceed α")
        exponent = (alpha_prime - alpha) / (alpha_prime - 1.0)
        candidates.append(exponent * math.log(fp) + a * test_rdp_prime)
    if test_pure is not None:
        candidates.append(math.log(fp) + a * test_pure)
    if not candidates:
        raise ValueError("give a test order α′ > α with its RDP, or the test's pure ε")
    log_c = min(candidates)
    good = a * (test_rdp + good_rdp)
    bad = _log_add(a * test_rdp, log_c + a * worst_rdp + math.log1p(-math.exp(-a * worst_rdp)))
    return max(good, bad) / a * _PAD


def joint_renyi_two_point(alpha: float, p: float, p_prime: float, release_rdp: float) -> float:
    """Exact D_α of (test bit, release) when the release is run only on T = 1, P[T = 1] = p vs p′, and the
    release's divergence is ``release_rdp``: log((1−p)^α(1−p′)^{1−α} + p^α p′^{1−α} e^{(α−1)D})/(α−1)."""
    a = alpha - 1.0
    first = alpha * math.log1p(-p) - a * math.log1p(-p_prime)
    second = alpha * math.log(p) - a * math.log(p_prime) + a * release_rdp
    return _log_add(first, second) / a


def bernoulli_renyi(alpha: float, p: float, p_prime: float) -> float:
    """D_α(Bernoulli(p) ‖ Bernoulli(p′)): the RDP of a test bit at order α on one pair."""
    return joint_renyi_two_point(alpha, p, p_prime, 0.0)


def _log_add(a: float, b: float) -> float:
    high, low = (a, b) if a >= b else (b, a)
    return high + math.log1p(math.exp(low - high))
