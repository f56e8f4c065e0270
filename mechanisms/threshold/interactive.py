"""Ligett et al.'s InteractiveAboveThreshold: the accuracy-first stopping rule (one noisy threshold, a fresh
noisy comparison per level), exact on the public grid of ``ThresholdGrid``."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from mechanisms.accounting import DEFAULT_ORDERS, RdpCurve, pad_up
from mechanisms.noise import Noise, dyadic_scale_up
from mechanisms.threshold.above_threshold import ThresholdGrid, draw_units, pure_charge

# ----- Ligett et al.'s InteractiveAboveThreshold (accuracy-first stopping) ---------------------------------
# API (used by mechanisms.reduction.accuracy_first and the accuracy-first ERM learners):
#
#   iat_paper_calibration(query_sensitivity, width, failure, levels, target=0.0) -> IatCalibration
#   iat_reference_calibration(query_sensitivity, width, failure, levels, target=0.0) -> IatCalibration
#   InteractiveAboveThreshold(threshold, epsilon_a, query_sensitivity, noise)  # draws Ŵ once
#       .test(value: float, noise) -> bool                                     # fresh noise per call
#       .to_state() -> dict / InteractiveAboveThreshold.from_state(dict)     # secret JSON state
#   interactive_above_threshold(query, level_epsilons, threshold, epsilon_a, query_sensitivity, noise,
#                               orders=DEFAULT_ORDERS) -> IatOutcome(level | None, epsilon, charge)
#       query(t) -> f_t(D) is called for t = 0, 1, … in order until the first pass (lazily, so a learner
#       computes hypothesis t only when needed).
#   iat_charge(epsilon_a, level_epsilons, level | None, orders) -> RdpCurve   # ε_A + ε_t, or ε_A + ε_{T−1}
#
# Ligett, Neel, Roth, Waggoner, Wu, "Accuracy First" (NeurIPS 2017), Algorithm 2 and Lemma 2.8 (soundness:
# docs/privacy/noise_reduction.md#interactive-above-threshold; calibrations:
# docs/privacy/accuracy_first_erm.md#accuracy-first-erm-calibration): Ŵ = W + Lap(2Δ/ε_A) drawn once; at level
# t the query value f_t(D) (a function of the released prefix, sensitivity ≤ Δ for every fixed prefix) is
# compared as f_t(D) + Lap(4Δ/ε_A) ≥ Ŵ; the first pass halts. When the levels come from an (ε_0, …,
# ε_{T−1})-prefix-private generator (Laplace noise reduction), the outcome (t, prefix up to t) is ex-post (ε_A
# + ε_t)-DP (Lemma 2.8); "no pass" after the last level costs ε_A + ε_{T−1}
# (docs/privacy/noise_reduction.md#theorem-iat-1; the paper charges ∞ only because it then releases θ*, which
# this never does). Finite precision (docs/privacy/finite_precision.md#finite-precision): the comparison is
# exact on the public grid of ``ThresholdGrid`` (γ = the largest 2^k ≤ 2^-10·Δ, M = ⌊Δ/γ + 1/64⌋ + 1):
# round(W/γ) + ρ and round(f_t/γ) + ν_t with ρ, ν_t discrete Laplace of scales t₁ ≥ 2M/ε_A, t₂ ≥ 4M/ε_A (grid
# units). The coupling of Lemma 2.8 shifts ρ by M and ν_t by 2M (integers), costing M/t₁ + 2M/t₂ ≤ ε_A, so the
# charge ε_A holds exactly as given. The caller's f_t must have sensitivity ≤ Δ as computed (float error ≤
# 2^-7·γ per value, see FLOAT_SLACK).
#
# Calibrations (both give the same privacy, ε_A; they differ in ε_A and W, i.e. in accuracy):
# * paper-theorem (Theorem A.1 / Theorem 3.2): accepted only if f_t(D) ≥ W − 8Δ·ln(2T/γ)/ε_A, except with
#   probability γ. With a target f ≥ L and a width α: W = L + α/2 and ε_A = 16Δ·ln(2T/γ)/α.
# * reference-code (the authors' code, github.com/steven7woo/Accuracy-First-Differential-Privacy, with the
#   factor 2 its plots apply to ε_A; docs/privacy/accuracy_first_erm.md#accuracy-first-erm-calibration): b =
#   α/(4·ln(1.5^{3/4}·√T/γ)), ε_A = 2Δ/b = 8Δ·ln(1.5^{3/4}√T/γ)/α, threshold on the excess s = α/4 +
#   (3/4)·b·ln 1.5 − (1/2)·b·ln T, i.e. W = L + α − s for a target f ≥ L (the excess form of the code, f =
#   −excess, L = −α). Its accuracy is verified numerically
#   (docs/privacy/accuracy_first_erm.md#accuracy-first-erm-calibration: failure 0.0152 ≤ γ = 0.1 at T = 1000),
#   not proven in general; label it.


@dataclass(frozen=True)
class IatCalibration:
    """ε_A and the public threshold W of one InteractiveAboveThreshold instance, and how they were chosen."""

    epsilon_a: float
    threshold: float
    calibration: str


def _check_calibration_inputs(query_sensitivity: float, width: float, failure: float, levels: int) -> None:
    if not (query_sensitivity > 0.0 and math.isfinite(query_sensitivity)):
        raise ValueError("the query sensitivity must be finite and > 0")
    if not (width > 0.0 and math.isfinite(width)):
        raise ValueError("the width α must be finite and > 0")
    if not 0.0 < failure < 1.0:
        raise ValueError("the failure probability γ must be in (0, 1)")
    if isinstance(levels, bool) or not isinstance(levels, int) or levels < 1:
        raise ValueError("levels must be a positive integer")


def iat_paper_calibration(
    query_sensitivity: float, width: float, failure: float, levels: int, target: float = 0.0
) -> IatCalibration:
    """Paper-theorem calibration: ε_A = 16Δ·ln(2T/γ)/α, W = target + α/2 (Ligett et al. Thm A.1, 3.2).

    Guarantee (Theorem A.1 with α_IAT = α/2): except with probability γ, a level is accepted only if
    f_t(D) ≥ target. With f = −excess risk and target −α this is the ERM setting of Algorithms 3 and 5.
    """
    _check_calibration_inputs(query_sensitivity, width, failure, levels)
    epsilon_a = pad_up(16.0 * query_sensitivity * math.log(2.0 * levels / failure) / width)
    return IatCalibration(epsilon_a, target + width / 2.0, "paper-theorem")


def iat_reference_calibration(
    query_sensitivity: float, width: float, failure: float, levels: int, target: float = 0.0
) -> IatCalibration:
    """Reference-code calibration of Ligett et al.'s code, with its plots' factor 2 applied to ε_A
    (docs/privacy/accuracy_first_erm.md#accuracy-first-erm-calibration).

    b = α/(4·ln(1.5^{3/4}·√T/γ)), ε_A = 2Δ/b, W = target + α − s with s = α/4 + (3/4)·b·ln 1.5 − ½·b·ln T.
    Privacy is the same theorem (ε_A + ε_t); the accuracy is only verified numerically
    (docs/privacy/accuracy_first_erm.md#accuracy-first-erm-calibration).
    """
    _check_calibration_inputs(query_sensitivity, width, failure, levels)
    log_term = math.log(1.5**0.75 * math.sqrt(levels) / failure)
    if log_term <= 0.0:
        raise ValueError("the reference calibration needs 1.5^{3/4}·√T > γ")
    b = width / (4.0 * log_term)
    s = width / 4.0 + 0.75 * b * math.log(1.5) - 0.5 * b * math.log(levels)
    epsilon_a = pad_up(2.0 * query_sensitivity / b)
    return IatCalibration(epsilon_a, target + width - s, "reference-code")


def iat_scales(epsilon_a: float, query_sensitivity: float) -> tuple[float, float]:
    """(threshold scale ≥ 2Δ/ε_A, query scale ≥ 4Δ/ε_A) of Ligett et al. Algorithm 2, in value units: the
    discrete Laplace scales of ``ThresholdGrid`` times γ (exact floats)."""
    return ThresholdGrid.build(query_sensitivity, epsilon_a).scales()


class InteractiveAboveThreshold:
    """One IAT instance: the noisy threshold Ŵ is drawn once at construction (secret), never re-drawn.

    Ŵ is round(W/γ) + ρ in grid units (an int, ``ThresholdGrid``). ``test(value, noise)`` draws fresh query
    noise and returns whether round(f_t/γ) + ν_t ≥ Ŵ. After the first pass the instance is closed (Algorithm 2
    halts at its first pass):
    further tests raise. ``to_state``/``from_state`` persist it as JSON.
    """

    def __init__(
        self,
        threshold: float,
        epsilon_a: float,
        query_sensitivity: float,
        noise: Noise | None = None,
        *,
        noisy_threshold: int | None = None,
        halted: bool = False,
    ) -> None:
        if not math.isfinite(threshold):
            raise ValueError("the threshold must be finite")
        if not (query_sensitivity > 0.0 and math.isfinite(query_sensitivity)):
            raise ValueError("the query sensitivity must be finite and > 0")
        if not (epsilon_a > 0.0 and math.isfinite(epsilon_a)):
            raise ValueError("epsilon_a must be finite and > 0")
        self._grid = ThresholdGrid.build(query_sensitivity, epsilon_a)
        self.threshold = float(threshold)
        self.epsilon_a = float(epsilon_a)
        self.query_sensitivity = float(query_sensitivity)
        self._query_units = self._grid.query_scale
        if noisy_threshold is None:
            if noise is None:
                raise ValueError("a new instance needs a Noise (the rng) to draw its noisy threshold")
            noisy_threshold = self._grid.threshold_units(threshold) + draw_units(
                noise, self._grid.threshold_scale
            )
        if isinstance(noisy_threshold, bool) or not isinstance(noisy_threshold, int):
            raise ValueError("the noisy threshold must be an integer number of grid units")
        self._noisy_threshold = noisy_threshold
        self.halted = bool(halted)

    @property
    def granularity(self) -> float:
        """γ: the public grid on which values and the threshold are compared."""
        return self._grid.grid.granularity

    @property
    def query_scale(self) -> float:
        """The query noise scale in value units (t₂·γ ≥ 4Δ/ε_A)."""
        return float(self._query_units * Fraction(self._grid.grid.granularity))

    @query_scale.setter
    def query_scale(self, value: float) -> None:
        """For audits of broken variants only: the query noise becomes ⌈value/γ⌉ (dyadic) grid units."""
        self._query_units = dyadic_scale_up(Fraction(value) / Fraction(self._grid.grid.granularity))

    def test(self, value: float, noise: Noise) -> bool:
        """One query: True (and the instance halts) iff round(f/γ) + ν ≥ round(W/γ) + ρ, exactly."""
        if self.halted:
            raise ValueError("this InteractiveAboveThreshold instance has halted; start a new one")
        if not math.isfinite(value):
            raise ValueError("a query value must be finite")
        passed = self._grid.value_units(value) + draw_units(noise, self._query_units) >= self._noisy_threshold
        self.halted = passed
        return passed

    def to_state(self) -> dict[str, Any]:
        """Secret JSON state (contains Ŵ in grid units): store it only in the secret-state table."""
        return {
            "threshold": self.threshold,
            "epsilon_a": self.epsilon_a,
            "query_sensitivity": self.query_sensitivity,
            "noisy_threshold": self._noisy_threshold,
            "halted": self.halted,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> InteractiveAboveThreshold:
        expected = {"threshold", "epsilon_a", "query_sensitivity", "noisy_threshold", "halted"}
        if not isinstance(state, dict) or set(state) != expected or not isinstance(state["halted"], bool):
            raise ValueError("not an InteractiveAboveThreshold state")
        secret = state["noisy_threshold"]
        if isinstance(secret, bool) or not isinstance(secret, int):  # an old float state is refused
            raise ValueError("not an InteractiveAboveThreshold state")
        return cls(
            float(state["threshold"]),
            float(state["epsilon_a"]),
            float(state["query_sensitivity"]),
            noisy_threshold=secret,
            halted=state["halted"],
        )

    def __repr__(self) -> str:  # never show Ŵ
        return f"InteractiveAboveThreshold(threshold={self.threshold!r}, epsilon_a={self.epsilon_a!r})"


def iat_charge(
    epsilon_a: float, level_epsilons: Sequence[float], level: int | None, orders: Sequence[float]
) -> RdpCurve:
    """Lemma 2.8: pure ε_A + ε_t for a pass at level t; ε_A + ε_{T−1} when no level passed (⊥)."""
    if not level_epsilons:
        raise ValueError("the level grid is empty")
    index = len(level_epsilons) - 1 if level is None else level
    if not 0 <= index < len(level_epsilons):
        raise ValueError(f"level {level} is outside the grid")
    return pure_charge((epsilon_a, float(level_epsilons[index])), orders)


@dataclass(frozen=True)
class IatOutcome:
    """The first level that passed (None: no level passed), its pure ex-post ε and the charge curve."""

    level: int | None
    epsilon: float
    charge: RdpCurve


def interactive_above_threshold(
    query: Callable[[int], float],
    level_epsilons: Sequence[float],
    threshold: float,
    epsilon_a: float,
    query_sensitivity: float,
    noise: Noise,
    orders: Sequence[float] = DEFAULT_ORDERS,
) -> IatOutcome:
    """Run Ligett et al. Algorithm 2 over the levels of a prefix-private generator (Lemma 2.8).

    ``query(t)`` returns f_t(D) for level t (a function of the generator's released prefix up to t, with
    sensitivity ≤ ``query_sensitivity`` for every fixed prefix); it is called in order t = 0, 1, … and not
    beyond the first pass. ``level_epsilons[t]`` is the prefix-privacy level ε_t of the generator.
    """
    iat = InteractiveAboveThreshold(threshold, epsilon_a, query_sensitivity, noise)
    for t in range(len(level_epsilons)):
        if iat.test(float(query(t)), noise):
            charge = iat_charge(epsilon_a, level_epsilons, t, orders)
            return IatOutcome(t, charge.pure, charge)
    charge = iat_charge(epsilon_a, level_epsilons, None, orders)
    return IatOutcome(None, charge.pure, charge)
