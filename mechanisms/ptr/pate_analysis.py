"""The data-dependent analysis of PATE's noisy arg-max and its Gen-PTR test (docs/privacy/pate.md).

GNMax (Papernot et al. 2018): each of T public queries gets the arg-max of the teachers' vote histogram
n ∈ ℕ^C plus i.i.d. discrete Gaussian noise N_Z(0, σ²) per class. A neighbour changes at most ``m``
teachers (m = 1 for add/remove, 2 for replace-one with content-hash partitions), so every histogram moves by
≤ m votes out of one class and into another: ℓ2-sensitivity √2·m, data-independent RDP α·m²/σ² per query
(Lemma GNMAX-DI), written α/s² with s = σ/m.

Data-dependent part (Lemma GNMAX-DD): with i* the top class at X and g the gap between the two largest
counts, P[GNMax(Y) ≠ i*] ≤ (C−1)·exp(−(g − 2m)₊²/(4σ²)) for X and every neighbour Y (sub-Gaussian tail of a
difference of two discrete Gaussians), and Papernot et al.'s Theorem 6 turns such a q̃ into an RDP bound
at order α in both directions. ``envelope`` makes the per-query bound a non-increasing function of the
effective gap e (a suffix maximum over e), which the distance argument needs.

Gen-PTR test (Lemma PATE-DIST): F(X, k) = min_α Σ_i b_α((g_i − 2m(k+1))₊) + log(1/δ_m)/(α−1) is the
data-dependent ε at X after k further teacher changes; h(X) = min{k: F(X, k) > ε_m} (capped at a public H)
has sensitivity 1 and h(X) = 0 exactly when the data-dependent bound at X exceeds ε_m. The test releases
1[h(X) + DLap(t) ≥ K].

Nothing here is released or stored: callers keep gaps, q̃, F and h inside the run.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

ORDERS: tuple[float, ...] = tuple(float(a) for a in np.round(np.geomspace(1.125, 4096.0, 96), 6))
"""The public orders α at which the data-dependent RDP is converted to (ε, δ) (Mironov 2017, Prop. 3)."""
_PAD = 1.0 + 1e-9


def data_independent_rdp(orders: np.ndarray, s: float) -> np.ndarray:
    """α/s² per query (s = σ/m): the Gaussian mechanism on a histogram of ℓ2-sensitivity √2·m."""
    values: np.ndarray = orders / (s * s)
    return values


def log_q_bound(effective_gap: np.ndarray, sigma: float, classes: int) -> np.ndarray:
    """log q̃(e) = log(C−1) − e²/(4σ²) (≥ 0 means no data-dependent information): an upper bound on
    P[arg-max ≠ i*] when every other count trails the count of i* by ≥ e."""
    e = np.asarray(effective_gap, dtype=np.float64)
    bound: np.ndarray = math.log(classes - 1) - e * e / (4.0 * sigma * sigma)
    return bound


def theorem6_rdp(log_q: float, s: float, orders: np.ndarray) -> np.ndarray:
    """Papernot et al. 2018, Thm 6 with Prop. 10's μ₂ = s·√(−log q̃), μ₁ = μ₂ + 1 and ε_i = μ_i/s²; the
    data-independent α/s² where the theorem's conditions fail (μ₁ ≤ α, μ₂ ≤ 1, q̃e^{ε₂} ≥ 1, or q̃ above
    e^{(μ₂−1)ε₂}/(μ₁/(μ₁−1)·μ₂/(μ₂−1))^{μ₂}); the minimum of the two otherwise."""
    independent = data_independent_rdp(orders, s)
    if log_q >= 0.0:
        return independent
    if math.isinf(log_q):
        return np.zeros_like(orders)
    mu2 = s * math.sqrt(-log_q)
    mu1 = mu2 + 1.0
    eps1, eps2 = mu1 / (s * s), mu2 / (s * s)
    if mu2 <= 1.0 or -log_q <= eps2:
        return independent
    limit = (mu2 - 1.0) * eps2 - mu2 * (math.log1p(1.0 / (mu1 - 1.0)) + math.log1p(1.0 / (mu2 - 1.0)))
    if log_q > limit:
        return independent
    log_1q = _log1mexp(log_q)
    log_a = log_1q - _log1mexp((log_q + eps2) * (1.0 - 1.0 / mu2))
    log_b = eps1 - log_q / (mu1 - 1.0)
    a = orders - 1.0
    dependent = np.logaddexp(log_1q + a * log_a, log_q + a * log_b) / a
    applies = orders < mu1
    return np.where(applies, np.minimum(independent, dependent * _PAD), independent)


def _log1mexp(x: float) -> float:
    """log(1 − e^x) for x < 0."""
    return math.log(-math.expm1(x)) if x > -0.693 else math.log1p(-math.exp(x))


@dataclass(frozen=True)
class GapTable:
    """b[e, j]: a per-query RDP bound at order ORDERS[j] valid whenever the effective gap is ≥ e,
    non-increasing in e (suffix maximum), for e = 0 … max_gap."""

    table: np.ndarray
    orders: np.ndarray

    def at(self, effective_gaps: np.ndarray) -> np.ndarray:
        index = np.clip(effective_gaps, 0, self.table.shape[0] - 1)
        rows: np.ndarray = self.table[index]
        return rows


@functools.lru_cache(maxsize=64)
def envelope(max_gap: int, sigma: float, sensitivity: int, classes: int) -> GapTable:
    """The per-query table b[e] = max_{e' ≥ e} min(α/s², Thm 6 at q̃(e')) for e = 0 … max_gap (a function
    of public parameters only: cached, read-only)."""
    orders = np.asarray(ORDERS)
    s = sigma / sensitivity
    log_q = log_q_bound(np.arange(max_gap + 1), sigma, classes)
    raw = np.stack([theorem6_rdp(float(lq), s, orders) for lq in log_q])
    suffix = np.ascontiguousarray(np.maximum.accumulate(raw[::-1], axis=0)[::-1])
    suffix.flags.writeable = False
    orders.flags.writeable = False
    return GapTable(suffix, orders)


def top_two_gaps(votes: np.ndarray) -> np.ndarray:
    """g_i = (largest count) − (second largest count) of each row of a (T, C) vote histogram."""
    ordered = np.sort(votes, axis=1)
    gaps: np.ndarray = (ordered[:, -1] - ordered[:, -2]).astype(np.int64)
    return gaps


def converted_epsilon(rdp_sum: np.ndarray, orders: np.ndarray, delta: float) -> float:
    """min_α ε(α) + log(1/δ)/(α−1) (Mironov 2017, Prop. 3), padded up."""
    return float(np.min(rdp_sum + math.log(1.0 / delta) / (orders - 1.0))) * _PAD


def dependent_epsilon(table: GapTable, gaps: np.ndarray, shift: int, delta: float) -> float:
    """F at effective gaps (g − shift)₊: the data-dependent ε (at δ) of all T answers."""
    effective = np.maximum(gaps - shift, 0)
    return converted_epsilon(table.at(effective).sum(axis=0), table.orders, delta)


def independent_epsilon(queries: int, sigma: float, sensitivity: int, delta: float) -> float:
    """The data-independent ε (at δ) of T answers: T·α·m²/σ² converted (the baseline analysis)."""
    orders = np.asarray(ORDERS)
    return converted_epsilon(queries * data_independent_rdp(orders, sigma / sensitivity), orders, delta)


def instability_distance(
    table: GapTable, gaps: np.ndarray, sensitivity: int, budget: float, delta: float, cap: int
) -> int:
    """h(X) = min{k ≥ 0: F(X, k) > ε_m}, F(X, k) = ε at gaps shifted by 2m(k+1); ``cap`` if none below it.
    F is non-decreasing in k, so bisection finds h."""

    def unstable(k: int) -> bool:
        return dependent_epsilon(table, gaps, 2 * sensitivity * (k + 1), delta) > budget

    if not unstable(cap - 1):
        return cap
    low, high = -1, cap - 1  # stable at low (vacuously), unstable at high
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if unstable(mid) else (mid, high)
    return high


def distance_cap(max_gap: int, sensitivity: int) -> int:
    """H: beyond k = ⌈max_gap/(2m)⌉ every effective gap is 0 and F is constant."""
    return -(-max_gap // (2 * sensitivity)) + 1


def noisy_argmax(votes: np.ndarray, noise: np.ndarray) -> np.ndarray:
    """arg-max of votes + noise per row; ties go to the smallest class index (post-processing)."""
    winners: np.ndarray = np.argmax(votes + noise, axis=1)
    return winners


def vote_histogram(predictions: Sequence[np.ndarray], classes: int) -> np.ndarray:
    """(T, C) counts from each teacher's T predicted class indices."""
    stacked = np.stack(list(predictions))
    counts: np.ndarray = np.stack([(stacked == c).sum(axis=0) for c in range(classes)], axis=1)
    return counts.astype(np.int64)
