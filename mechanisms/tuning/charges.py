"""Ex-post tuning, the public side: the closed forms of the latent's law and the charge of every outcome
(Ghazi et al. Theorems 11 and 13), computed from the drop parameters and ε′ only. The algorithms and the
mechanism: ``mechanisms.tuning.select`` (its docstring states the theorems and their conditions)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

Latent = Literal["geometric", "exponential"]

_PAD = 1e-9
"""Relative upward pad on computed charges: covers the float error of sums over ≤ 10⁶ terms."""


def _up(values: np.ndarray) -> np.ndarray:
    """Raise finite positive values by a relative pad and one ulp (rounding may only over-charge)."""
    padded = np.where(np.isfinite(values) & (values > 0), np.nextafter(values * (1.0 + _PAD), np.inf), values)
    result: np.ndarray = padded
    return result


def check_drop(drop: Sequence[float] | np.ndarray) -> np.ndarray:
    array = np.asarray(drop, dtype=float)
    if array.ndim != 1 or array.size == 0:
        raise ValueError("the drop parameters must be a non-empty 1-d list")
    if not np.all(np.isfinite(array)) or np.any(array < 0):
        raise ValueError("drop parameters must be finite and ≥ 0")
    return array


def check_eps_prime(eps_prime: float) -> float:
    value = float(eps_prime)
    if not (math.isfinite(value) and value > 0.0):
        raise ValueError("ε′ must be finite and > 0")
    return value


def _check_orders(orders: Sequence[float] | np.ndarray) -> np.ndarray:
    array = np.asarray(orders, dtype=float)
    if array.ndim != 1 or array.size == 0 or not np.all(np.isfinite(array)) or np.any(array <= 1.0):
        raise ValueError("orders must be finite and > 1")
    return array


# ----- closed forms (public; tests, docs and benchmarks) -----------------------------------------------
def expected_runs(drop: Sequence[float] | np.ndarray, eps_prime: float, latent: Latent) -> np.ndarray:
    """τ_i = E_k[e^{−c_i k}] per entry: entry i's expected number of runs (τ_i of Ghazi et al. Theorem 13).

    Geometric latent: (1−e^{−ε′})/(1−e^{−(ε′+c_i)}); exponential latent: ε′/(ε′+c_i).
    """
    c = check_drop(drop)
    eps_prime = check_eps_prime(eps_prime)
    if latent == "geometric":
        result: np.ndarray = np.expm1(-eps_prime) / np.expm1(-(eps_prime + c))
        return result
    if latent == "exponential":
        exp_result: np.ndarray = eps_prime / (eps_prime + c)
        return exp_result
    raise ValueError(f"unknown latent {latent!r}")


def _log_all_dropped(c_unique: np.ndarray, counts: np.ndarray, k: np.ndarray) -> np.ndarray:
    """log Π_j (1 − e^{−c_j k}) for each k (−∞ where some entry is surely kept)."""
    with np.errstate(divide="ignore"):
        terms = np.log1p(-np.exp(-np.outer(k, c_unique)))
    result: np.ndarray = terms @ counts.astype(float)
    return result


def probability_bottom(drop: Sequence[float] | np.ndarray, eps_prime: float, latent: Latent) -> float:
    """P(⊥) = E_k[Π_j (1 − e^{−c_j k})]: ⊥ iff every entry is dropped, so data-independent (Ghazi et al. §4).

    Geometric: the series over k truncated where e^{−ε′k} < 1e-17 (tail below that). Exponential: with
    u = e^{−ε′x}, ∫₀¹ Π_j (1 − u^{c_j/ε′}) du by adaptive quadrature.
    """
    c = check_drop(drop)
    eps_prime = check_eps_prime(eps_prime)
    values, counts = np.unique(c, return_counts=True)
    if values[0] == 0.0:
        return 0.0
    if latent == "geometric":
        top = math.ceil(40.0 / eps_prime) + 1
        total = 0.0
        for start in range(0, top, 200_000):
            k = np.arange(start, min(top, start + 200_000), dtype=float)
            log_terms = np.log(-np.expm1(-eps_prime)) - eps_prime * k + _log_all_dropped(values, counts, k)
            total += float(np.exp(log_terms).sum())
        return total
    if latent == "exponential":
        from scipy.integrate import quad

        def integrand(u: float) -> float:
            if u <= 0.0:
                return 1.0
            return float(np.exp(counts @ np.log1p(-np.power(u, values / eps_prime))))

        value, _ = quad(integrand, 0.0, 1.0, limit=400, epsabs=1e-13, epsrel=1e-11)
        return float(value)
    raise ValueError(f"unknown latent {latent!r}")


# ----- charges -----------------------------------------------------------------------------------------
def pure_charges(drop: Sequence[float] | np.ndarray, eps_prime: float) -> np.ndarray:
    """Theorem 11 / Theorem 10: ε̃(o, i) = 2c_i + ε′ per entry (valid when M_j is c_j-DP for every j)."""
    c = check_drop(drop)
    return _up(2.0 * c + check_eps_prime(eps_prime))


def pure_worst_case(drop: Sequence[float] | np.ndarray, eps_prime: float, algorithm: int = 3) -> float:
    """sup ε̃ for pure Algorithm 3 (⊥ = 0) or Algorithm 2 (⊥ = ε′): max_i (2c_i + ε′)."""
    if algorithm not in (2, 3):
        raise ValueError("algorithm must be 2 or 3")
    return float(pure_charges(drop, eps_prime).max())


@dataclass(frozen=True)
class RdpCharges:
    """Theorem 13 at every order: ``per_drop[a, u]`` is ε̃_α(o, i) for an entry with drop ``drops[u]``.

    ``ell[a, u]`` is the ℓ used, ``bottom[a]`` is ε̃_α(⊥), ``valid[a]`` says whether every candidate's RDP
    at order a is ≤ its drop parameter (else every charge at that order is +∞).
    """

    orders: tuple[float, ...]
    drops: np.ndarray
    per_drop: np.ndarray
    ell: np.ndarray
    bottom: np.ndarray
    valid: np.ndarray
    tau: float

    def for_drop(self, c: float) -> np.ndarray:
        """ε̃(o, i) at every order for an entry with drop parameter ``c`` (must be one of the list's)."""
        where = np.flatnonzero(self.drops == c)
        if where.size != 1:
            raise KeyError(f"{c!r} is not a drop parameter of this list")
        result: np.ndarray = self.per_drop[:, int(where[0])]
        return result

    def worst(self) -> np.ndarray:
        """max(ε̃(⊥), max_i ε̃(o, i)) at every order (docs/privacy/tuning.md#tuning-filter-needs)."""
        result: np.ndarray = np.maximum(self.bottom, self.per_drop.max(axis=1))
        return result


def theorem13_value(
    ell: np.ndarray,
    c_i: np.ndarray,
    alpha: np.ndarray,
    eps_prime: float,
    log_tau1: float,
    values: np.ndarray,
    counts_minus_own: np.ndarray,
) -> np.ndarray:
    """(2+ℓ)c_i + (1+ℓ)ε′ + [log(1+τ) + Σ_u m_u e^{−u(1+αℓ)}]/(α−1), broadcast over (orders, drops).

    ``counts_minus_own[u_i, u]`` is the number of entries j ≠ i with drop ``values[u]``.
    """
    exponent = -values[None, None, :] * (1.0 + alpha[:, None, None] * ell[:, :, None])
    sums = np.einsum("aiu,iu->ai", np.exp(exponent), counts_minus_own)
    result: np.ndarray = (
        (2.0 + ell) * c_i[None, :] + (1.0 + ell) * eps_prime + (log_tau1 + sums) / (alpha[:, None] - 1.0)
    )
    return result


def _derivative(
    ell: np.ndarray, c_i: np.ndarray, alpha: np.ndarray, eps_prime: float, values: np.ndarray, cmo: np.ndarray
) -> np.ndarray:
    exponent = -values[None, None, :] * (1.0 + alpha[:, None, None] * ell[:, :, None])
    weighted = np.einsum("aiu,iu->ai", np.exp(exponent) * values[None, None, :], cmo)
    result: np.ndarray = c_i[None, :] + eps_prime - alpha[:, None] / (alpha[:, None] - 1.0) * weighted
    return result


def _optimise_exact(
    values: np.ndarray,
    counts: np.ndarray,
    alpha: np.ndarray,
    eps_prime: float,
    log_tau1: float,
    iterations: int,
) -> tuple[np.ndarray, np.ndarray]:
    """(ℓ, ε̃) per (order, distinct drop): bisection on the derivative, sums excluding one own copy exactly."""
    n = float(counts.sum())
    per_drop = np.empty((alpha.size, values.size))
    ell = np.empty((alpha.size, values.size))
    block_size = max(1, 2_000_000 // (alpha.size * values.size))
    for start in range(0, values.size, block_size):
        block = values[start : start + block_size]
        cmo = np.broadcast_to(counts.astype(float), (block.size, values.size)).copy()
        cmo[np.arange(block.size), np.arange(start, start + block.size)] -= 1.0
        zero = np.zeros((alpha.size, block.size))
        at_zero = _derivative(zero, block, alpha, eps_prime, values, cmo)
        lo = zero.copy()
        hi = n / (math.e * (alpha[:, None] - 1.0) * (block[None, :] + eps_prime)) + 1.0
        hi = np.where(at_zero >= 0.0, 0.0, hi)
        for _ in range(iterations):
            mid = 0.5 * (lo + hi)
            positive = _derivative(mid, block, alpha, eps_prime, values, cmo) >= 0.0
            hi = np.where(positive, mid, hi)
            lo = np.where(positive, lo, mid)
        chosen = hi  # the derivative is ≥ 0 there (or ℓ = 0); any ℓ ≥ 0 is valid
        ell[:, start : start + block.size] = chosen
        per_drop[:, start : start + block.size] = theorem13_value(
            chosen, block, alpha, eps_prime, log_tau1, values, cmo
        )
    return ell, per_drop


def _optimise_grid(
    values: np.ndarray, counts: np.ndarray, alpha: np.ndarray, eps_prime: float, log_tau1: float
) -> tuple[np.ndarray, np.ndarray]:
    """(ℓ, ε̃) for very many distinct drops: ℓ on a fixed log grid, Σ_{j≠i} = Σ_all − own copy.

    Σ_all is a sum of m positive terms (relative float error ≤ m·u) and the subtraction adds ≤ u·Σ_all,
    so (m + 4)·u·Σ_all/(α−1) is added to each value: the result stays an upper bound at the ℓ used.
    """
    n = float(counts.sum())
    top = n / (math.e * (float(alpha.min()) - 1.0) * (float(values.min()) + eps_prime)) + 1.0
    grid = np.concatenate([[0.0], np.geomspace(1e-6, top, 511)])
    exponent_base = 1.0 + alpha[:, None] * grid[None, :]  # (A, G)
    s_all = np.zeros((alpha.size, grid.size))
    chunk = max(1, 2_000_000 // (alpha.size * grid.size))
    for start in range(0, values.size, chunk):
        part = values[start : start + chunk]
        terms = np.exp(-exponent_base[:, :, None] * part)
        s_all += np.einsum("agu,u->ag", terms, counts[start : start + chunk].astype(float))
    margin = (values.size + 4) * np.finfo(float).eps * s_all / (alpha[:, None] - 1.0)
    per_drop = np.empty((alpha.size, values.size))
    ell = np.empty((alpha.size, values.size))
    block_size = max(1, 2_000_000 // (alpha.size * grid.size))
    for start in range(0, values.size, block_size):
        block = values[start : start + block_size]
        own = np.exp(-exponent_base[:, None, :] * block[None, :, None])  # (A, b, G)
        others = np.maximum(s_all[:, None, :] - own, 0.0)
        f = (
            (2.0 + grid) * block[None, :, None]
            + (1.0 + grid) * eps_prime
            + (log_tau1 + others) / (alpha[:, None, None] - 1.0)
            + margin[:, None, :]
        )
        best = np.argmin(f, axis=2)
        ell[:, start : start + block.size] = grid[best]
        per_drop[:, start : start + block.size] = np.take_along_axis(f, best[:, :, None], axis=2)[:, :, 0]
    return ell, per_drop


EXACT_DISTINCT = 256
"""Up to this many distinct drop values ℓ is optimised exactly (bisection); beyond, on a fixed grid."""


def rdp_charges(
    drop: Sequence[float] | np.ndarray,
    eps_prime: float,
    orders: Sequence[float] | np.ndarray,
    candidate_rdp: np.ndarray | None = None,
    iterations: int = 64,
) -> RdpCharges:
    """Theorem 13 (exponential latent) at every order, with ℓ_i optimised per (order, drop value).

    ``candidate_rdp[j, a]`` (optional) is candidate j's own RDP at order a, from its calibration; at an
    order where some candidate exceeds its drop parameter, every charge is +∞. Optimisation: ℓ* = 0 when
    the derivative at 0 is ≥ 0, else bisection on [0, n/(e(α−1)(c_i+ε′)) + 1] (there the derivative is
    > 0 because c·e^{−cαℓ} ≤ 1/(eαℓ)); for more than ``EXACT_DISTINCT`` distinct drops, a 512-point ℓ grid.
    Any ℓ ≥ 0 gives a valid bound; the value is evaluated at the ℓ used.
    """
    c = check_drop(drop)
    eps_prime = check_eps_prime(eps_prime)
    alpha = _check_orders(orders)
    values, counts = np.unique(c, return_counts=True)
    n = c.size
    tau = math.fsum((eps_prime / (eps_prime + values)) * counts)
    log_tau1 = math.log1p(tau)
    if values.size <= EXACT_DISTINCT:
        ell, per_drop = _optimise_exact(values, counts, alpha, eps_prime, log_tau1, iterations)
    else:
        ell, per_drop = _optimise_grid(values, counts, alpha, eps_prime, log_tau1)
    bottom = log_tau1 / (alpha - 1.0)
    if candidate_rdp is None:
        valid = np.ones(alpha.size, dtype=bool)
    else:
        rdp = np.asarray(candidate_rdp, dtype=float)
        if rdp.shape != (n, alpha.size):
            raise ValueError(f"candidate_rdp must have shape {(n, alpha.size)}, got {rdp.shape}")
        valid = np.all(rdp <= c[:, None], axis=0)
    per_drop = np.where(valid[:, None], _up(per_drop), np.inf)
    bottom = np.where(valid, _up(bottom), np.inf)
    return RdpCharges(tuple(float(a) for a in alpha), values, per_drop, ell, bottom, valid, tau)
