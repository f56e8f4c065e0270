"""Exact samplers for the learners (``dp_gd``, ``rgm.gd``, ``objpert.logistic``):
docs/privacy/finite_precision.md#finite-precision.

``discrete_gaussian_std(noise, t, size)``: ``size`` draws of the discrete Gaussian N_Z(0, t²) with an
**integer** standard deviation t (1 ≤ t ≤ 2^52), vectorised, int64 arithmetic only.

Canonne, Kamath, Steinke 2020 ("The discrete Gaussian for differential privacy"), Algorithm 3 with the
free parameter of the Laplace proposal set to t = σ (the algorithm is correct for any positive proposal
scale: P(Y = y) ∝ e^{−|y|/t} times the acceptance probability e^{−(|y| − σ²/t)²/(2σ²)} is
∝ e^{−y²/(2σ²)}·e^{−σ²/(2t²)}). With σ = t the acceptance probability is e^{−w²/(2t²)}, w = ||Y| − t|, and
writing w = a·t + b (0 ≤ b < t) it factors as

    e^{−w²/(2t²)} = e^{−a²/2} · e^{−ab/t} · e^{−b²/(2t²)},

three independent Bernoulli trials whose exponents are rationals with denominators 2, t and — for the last
one — the product form γ = (b/t)·(b/(2t)) ∈ [0, 1/2), drawn by CKS Algorithm 1 (K = 1; while
Bernoulli(γ/K): K += 1; accept iff K is odd) with Bernoulli(γ/K) = Bernoulli(b/t) ∧ Bernoulli(b/(2Kt))
(independent, so the product of the probabilities). Every modulus stays ≤ 2^62, so int64 suffices for
t ≤ 2^52 (``Noise.discrete_laplace`` and ``Noise.bernoulli_exp_neg`` need denominators ≤ 2^52).
Compared with ``Noise.discrete_gaussian`` (which takes any rational variance but needs 2·σ²·t² ≤ 2^52 for
its int64 path), this reaches standard deviations up to 2^52 without big integers, which the gradient
learners need (their grid units are fine, so σ in grid units is large).
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np

from mechanisms.noise.exact import Noise

MAX_STD = 1 << 52
_MAX_K = 1 << 9  # K beyond 512 has probability below 1/511! (as in Noise._exp_neg_fraction)


def _exp_neg_product(noise: Noise, b: np.ndarray, t: int) -> np.ndarray:
    """Bernoulli(exp(−b²/(2t²))) per row, 0 ≤ b < t ≤ 2^52 (CKS Algorithm 1 with γ = (b/t)(b/(2t)))."""
    k = np.ones(b.size, dtype=np.int64)
    pending = np.flatnonzero(b > 0)
    while pending.size:
        if int(k[pending].max()) > _MAX_K:
            raise OverflowError("Bernoulli(exp(−γ)) ran past its int64 range")
        bp = b[pending]
        first = noise.uniform_below(t, pending.size) < bp
        second = noise.uniform_below(2 * t * k[pending]) < bp
        success = first & second
        k[pending[success]] += 1
        pending = pending[success]
    accepted: np.ndarray = (k % 2) == 1
    return accepted


def discrete_gaussian_std(noise: Noise, std: int, size: int) -> np.ndarray:
    """``size`` i.i.d. draws of P(z) ∝ exp(−z²/(2·std²)), z ∈ Z, for an integer 1 ≤ std ≤ 2^52 (int64)."""
    t = int(std)
    if t != std or not 1 <= t <= MAX_STD:
        raise ValueError(f"std must be an integer in [1, 2^52], got {std!r}")
    if size < 0:
        raise ValueError("size must be ≥ 0")
    out = np.empty(size, dtype=np.int64)
    pending = np.arange(size)
    scale = Fraction(t)
    while pending.size:
        count = pending.size
        y = noise.discrete_laplace(scale, count).astype(np.int64)
        w = np.abs(np.abs(y) - t)
        a, b = np.divmod(w, t)
        accept = noise.bernoulli_exp_neg(a * a, 2)
        alive = np.flatnonzero(accept & (a > 0) & (b > 0))
        if alive.size:
            accept[alive] = noise.bernoulli_exp_neg(a[alive] * b[alive], t)
        alive = np.flatnonzero(accept & (b > 0))
        if alive.size:
            accept[alive] = _exp_neg_product(noise, b[alive], t)
        out[pending[accept]] = y[accept]
        pending = pending[~accept]
    return out


def discrete_gaussian_pmf(std: int, support: np.ndarray) -> np.ndarray:
    """The exact pmf of N_Z(0, std²) on ``support`` (normalised over |z| ≤ 40·std; the rest is < e^{−800}):
    for tests."""
    t = float(std)
    grid = np.arange(-40 * int(std), 40 * int(std) + 1, dtype=np.float64)
    log_mass = -(grid * grid) / (2.0 * t * t)
    total = np.exp(log_mass).sum()
    values: np.ndarray = np.exp(-(np.asarray(support, dtype=np.float64) ** 2) / (2.0 * t * t)) / total
    return values
