"""Ex-post private hyperparameter tuning, including choosing ε itself: the selection numerics.

Source: Ghazi, Kamath, Knop, Kumar, Manurangsi, Zhang, "Private hyperparameter tuning with ex-post
guarantee" (2025; cited "Ghazi et al." with the paper's own section, algorithm and theorem numbers). The
service mechanism ``tuning.select`` built on these functions lives in ``mechanisms.tuning.candidates`` (base
learners) and at the bottom of this module (``TuningSelect``). Docs: docs/mechanisms/tuning.md,
docs/privacy.md §8.5.

Algorithm 3 (best-of with random dropping, Ghazi et al. §4)
-----------------------------------------------------------
Candidates M_1 … M_n (a fixed list, repeats allowed), **drop parameters** c_1 … c_n fixed before running,
ε′ > 0, and a data-independent total order on outputs with ⊥ minimal::

    k ← latent (Geom_{e^{−ε′}} on {0,1,…} for pure DP; Exp with rate ε′ for RDP)      # SECRET
    for i = 1..n: keep i with probability e^{−c_i·k}                                   # SECRET
                  if kept: o_i ← M_i(D)
    return max over kept (o_i, i), or ⊥ if nothing was kept

* **Pure (Theorem 11)**: if every M_j is c_j-DP (pure), the output (o, i) is ex-post (2c_i + ε′)-DP and ⊥
  is 0 (P(⊥) does not depend on the data). The charge does not depend on n or on the other candidates.
* **RDP (Theorem 13)**, at one order α: if every M_j is (α, c_j)-RDP (i.e. its RDP at α is ≤ c_j), then
  with τ = Σ_j ε′/(ε′ + c_j) (the expected number of runs, repeats included) and any ℓ_i ≥ 0::

      ε̃_α(o, i) = (2 + ℓ_i)c_i + (1 + ℓ_i)ε′ + [log(1 + τ) + Σ_{j≠i} e^{−c_j(1 + αℓ_i)}]/(α − 1)
      ε̃_α(⊥)    = log(1 + τ)/(α − 1)

  ℓ_i is analysis-only slack, optimised per (α, c_i) by bisection on the derivative (the objective is
  convex, docs/privacy.md §8.5.2); the charge is always **evaluated at the ℓ actually used**. A mechanism
  that is (α, ε_i(α))-RDP with ε_i(α) ≤ c_i is (α, c_i)-RDP, so the paper's statement applies with c_i in
  every place. At an order where some candidate's RDP exceeds its drop parameter nothing is proven: every
  outcome is charged +∞ there (docs/privacy.md §6 rule 5).

Algorithm 2 (known threshold, Ghazi et al. §3.2, Theorem 10): the first kept candidate whose output passes a
data-independent threshold is released; charge 2c_i + ε′ for it and ε′ for ⊥ (geometric latent).

The worst case is max(ε̃(⊥), max_i ε̃(o, i)) order by order, computed from the public list before the data
is touched (docs/privacy.md §8.5.1).

Secrets (docs/privacy.md §8.5.4): the latent k, the keep bits, which and how many candidates ran, their
outputs and timings. Nothing here returns them except ``sample_kept`` (a sampler for tests and simulations;
the service never calls it directly and never exposes its result). The service mechanism always pads:
every candidate runs whatever k is (dropped ones are discarded), and noise-free shared work (the ERM
minimiser per λ) is done before k is drawn, so the amount of work does not depend on k;
``pad_to_worst_case_time`` must be true (docs/privacy.md §8.5.4: the run count voids Theorem 11, and what
remains of the timing channel).

Numerics (docs/privacy.md §10.4.5). The latent and the keep bits are exact (``mechanisms/noise/tuning.py``,
docs/privacy.md §10): k ~ Geom_{e^{−ε′}} by exact inversion of one uniform real revealed 64 bits at a time
(k = max{m : U < e^{−ε′m}}, each comparison decided by a rigorous integer enclosure of e^{−ε′m}); given k,
candidate i is kept iff a fresh uniform V_i < e^{−c_i k} (same exact comparison). The exponential latent of
Theorem 13 is never materialised: its keep mask is the set of clocks still running when X ~ Exp(ε′) rings in
an exact race against T_i ~ Exp(c_i) (rational rates, one ``randbelow`` per event), which has exactly the
law of keeping i with probability e^{−c_i x} given x. ε′ and the c_i are read as the exact binary values of
their floats, the very numbers the charges use. The Theorem 13 charge is computed per distinct drop value
(thousands of candidates with a few distinct ε cost nothing extra), in blocks to bound memory, and padded
upwards.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from itertools import product
from typing import Annotated, Any, ClassVar, Literal, Self

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, model_validator

from mechanisms.accounting import RdpCurve
from mechanisms.base import (
    ParamsChecked,
    ParamsError,
    ProgressFn,
    PublicContext,
    Release,
    Table,
    no_progress,
)
from mechanisms.learners.features import FeatureSpec, check_features, column_names, design_matrix, dimension
from mechanisms.noise import Noise
from mechanisms.noise.tuning import exponential_race, geometric_latent, keep_given_latent
from mechanisms.tuning.candidates import (
    LEARNERS,
    CandidateConfig,
    LearnerName,
    PublicShape,
    objpert_candidate_config,
    objpert_sigma,
    split_rows,
)

Latent = Literal["geometric", "exponential"]

_PAD = 1e-9
"""Relative upward pad on computed charges: covers the float error of sums over ≤ 10⁶ terms."""


def _up(values: np.ndarray) -> np.ndarray:
    """Raise finite positive values by a relative pad and one ulp (rounding may only over-charge)."""
    padded = np.where(np.isfinite(values) & (values > 0), np.nextafter(values * (1.0 + _PAD), np.inf), values)
    result: np.ndarray = padded
    return result


def _check_drop(drop: Sequence[float] | np.ndarray) -> np.ndarray:
    array = np.asarray(drop, dtype=float)
    if array.ndim != 1 or array.size == 0:
        raise ValueError("the drop parameters must be a non-empty 1-d list")
    if not np.all(np.isfinite(array)) or np.any(array < 0):
        raise ValueError("drop parameters must be finite and ≥ 0")
    return array


def _check_eps_prime(eps_prime: float) -> float:
    value = float(eps_prime)
    if not (math.isfinite(value) and value > 0.0):
        raise ValueError("ε′ must be finite and > 0")
    return value


def _check_orders(orders: Sequence[float] | np.ndarray) -> np.ndarray:
    array = np.asarray(orders, dtype=float)
    if array.ndim != 1 or array.size == 0 or not np.all(np.isfinite(array)) or np.any(array <= 1.0):
        raise ValueError("orders must be finite and > 1")
    return array


# ----- samplers (exact: mechanisms/noise/tuning.py) ----------------------------------------------------
def draw_latent(noise: Noise, latent: Latent, eps_prime: float, size: int | None = None) -> Any:
    """k ~ Geom_{e^{−ε′}} on {0,1,…} (P(k ≥ m) = e^{−ε′m} exactly, for the float ε′ read exactly).

    Exact inversion of one uniform real per draw (``geometric_latent``). The exponential latent of
    Theorem 13 is never materialised: ``sample_kept`` draws its keep mask from the exact law by an
    exponential race, so asking for x itself is an error.
    """
    eps_prime = _check_eps_prime(eps_prime)
    if latent == "geometric":
        k = geometric_latent(noise, eps_prime, 1 if size is None else size)
        return int(k[0]) if size is None else k
    if latent == "exponential":
        raise ValueError("the exponential latent is not materialised; use sample_kept (exact race)")
    raise ValueError(f"unknown latent {latent!r}")


def sample_kept(
    drop: Sequence[float] | np.ndarray,
    latent: Latent,
    eps_prime: float,
    noise: Noise,
    size: int | None = None,
) -> np.ndarray:
    """The drop step with **one** shared latent: a boolean keep mask, shape (n,) or (size, n).

    Geometric latent: k by exact inversion, then entry i kept iff V_i < e^{−c_i k} (exact lazy comparison
    of a uniform with an enclosure of e^{−c_i k}). Exponential latent: the kept set {i : T_i > X} of an
    exact race of T_i ~ Exp(c_i) against X ~ Exp(ε′) (same law as keeping i w.p. e^{−c_i x} given x).
    The result is SECRET (it reveals k); only simulations and ``algorithm3``/``algorithm2`` use it.
    """
    c = _check_drop(drop)
    eps_prime = _check_eps_prime(eps_prime)
    values, index = _exact_drop(tuple(c.tolist()))
    runs = 1 if size is None else size
    if latent == "geometric":
        k = geometric_latent(noise, eps_prime, runs)
        batch = keep_given_latent(noise, values, index, k)
    elif latent == "exponential":
        batch = exponential_race(noise, values, index, Fraction(eps_prime), runs)
    else:
        raise ValueError(f"unknown latent {latent!r}")
    result: np.ndarray = batch[0] if size is None else batch
    return result


@lru_cache(maxsize=256)
def _exact_drop(drop: tuple[float, ...]) -> tuple[list[Fraction], np.ndarray]:
    """The distinct drop values as exact rationals (the floats' binary values) and each entry's index."""
    distinct, index = np.unique(np.array(drop), return_inverse=True)
    index.flags.writeable = False  # shared by every call with this list
    return [Fraction(float(v)) for v in distinct], index


# ----- closed forms (public; tests, docs and benchmarks) -----------------------------------------------
def expected_runs(drop: Sequence[float] | np.ndarray, eps_prime: float, latent: Latent) -> np.ndarray:
    """τ_i = E_k[e^{−c_i k}] per entry: entry i's expected number of runs (τ_i of Ghazi et al. Theorem 13).

    Geometric latent: (1−e^{−ε′})/(1−e^{−(ε′+c_i)}); exponential latent: ε′/(ε′+c_i).
    """
    c = _check_drop(drop)
    eps_prime = _check_eps_prime(eps_prime)
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
    c = _check_drop(drop)
    eps_prime = _check_eps_prime(eps_prime)
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
    c = _check_drop(drop)
    return _up(2.0 * c + _check_eps_prime(eps_prime))


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
        """max(ε̃(⊥), max_i ε̃(o, i)) at every order (docs/privacy.md §8.5.1)."""
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
    c = _check_drop(drop)
    eps_prime = _check_eps_prime(eps_prime)
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


# ----- the algorithms ---------------------------------------------------------------------------------------
ScoreKey = tuple[float, ...]
"""A candidate's position in the public total order: compared lexicographically, then by list index."""


def total_key(key: Sequence[float]) -> ScoreKey:
    """Make a key total: NaN (and anything non-float) becomes −∞, so a failed score is the minimum."""
    out = []
    for value in key:
        v = float(value)
        out.append(-math.inf if math.isnan(v) else v)
    return tuple(out)


@dataclass(frozen=True)
class Selection:
    """The released outcome only: the winning list index (None for ⊥) and that candidate's output."""

    index: int | None
    output: Any


def algorithm3(
    drop: Sequence[float] | np.ndarray,
    eps_prime: float,
    latent: Latent,
    run_candidate: Callable[[int], tuple[Sequence[float], Any]],
    noise: Noise,
    *,
    pad: bool = False,
    progress: ProgressFn = no_progress,
) -> Selection:
    """Algorithm 3: run the kept candidates in list order and return the maximum under (key, index).

    ``run_candidate(i)`` returns (key, output): the key must be a data-independent function of M_i's DP
    output (docs/privacy.md §8.5.2, "The order"). With ``pad`` every dropped candidate is run too and its
    result discarded, so the amount of work does not depend on the latent (closes the gross timing channel;
    docs/privacy.md §8.5.4). ``TuningSelect`` always pads; ``pad=False`` is for simulations, where nobody
    observes the time. ``progress`` is called after every candidate (a heartbeat; the fraction is secret
    and must not be shown).
    """
    c = _check_drop(drop)
    mask = sample_kept(c, latent, eps_prime, noise)
    best: tuple[ScoreKey, int] | None = None
    best_output: Any = None
    for i in range(c.size):
        if mask[i] or pad:
            key, output = run_candidate(i)
            if mask[i]:
                ranked = (total_key(key), i)
                if best is None or ranked > best:
                    best, best_output = ranked, output
        progress((i + 1) / c.size)
    if best is None:
        return Selection(None, None)
    return Selection(best[1], best_output)


def algorithm2(
    drop: Sequence[float] | np.ndarray,
    eps_prime: float,
    run_candidate: Callable[[int], tuple[bool, Any]],
    noise: Noise,
    *,
    progress: ProgressFn = no_progress,
) -> Selection:
    """Algorithm 2 (known threshold, geometric latent): the first kept candidate whose output passes.

    ``run_candidate(i)`` returns (passes, output), ``passes`` a data-independent function of the DP output
    (e.g. o_i ≥ thr). Charges: ``pure_charges`` for (o, i), ε′ for ⊥ (Theorem 10).
    """
    c = _check_drop(drop)
    mask = sample_kept(c, "geometric", eps_prime, noise)
    for i in range(c.size):
        if mask[i]:
            passes, output = run_candidate(i)
            if passes:
                progress(1.0)
                return Selection(i, output)
        progress((i + 1) / c.size)
    return Selection(None, None)


# ----- the service mechanism ``tuning.select`` ------------------------------------------------------------
MAX_CANDIDATES = 10_000
MAX_TOTAL_STEPS = 5_000_000
"""Compute limit: gradient steps summed over every DP-GD candidate of a request (padding runs them all)."""
GridEpsilon = Annotated[float, Field(strict=True, ge=1e-6, le=100, allow_inf_nan=False)]
Regularization = Annotated[float, Field(strict=True, ge=1e-6, le=1e3, allow_inf_nan=False)]
Steps = Annotated[int, Field(strict=True, ge=1, le=10_000)]
StepSize = Annotated[float, Field(strict=True, gt=0, le=1e3, allow_inf_nan=False)]
Clip = Annotated[float, Field(strict=True, gt=0, le=1e6, allow_inf_nan=False)]


class TuningParams(BaseModel):
    """Public parameters of ``tuning.select`` (the candidate list is fixed by them, before k is drawn)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    learner: LearnerName = Field(description="base learner of every candidate")
    features: FeatureSpec = Field(description="feature and label columns")
    epsilons: tuple[GridEpsilon, ...] = Field(
        min_length=1, max_length=200, description="grid of candidate ε (each candidate's drop parameter)"
    )
    regularization: tuple[Regularization, ...] = Field(
        default=(0.01,), min_length=1, max_length=50, description="grid of ridge λ"
    )
    steps: tuple[Steps, ...] | None = Field(
        default=None, min_length=1, max_length=20, description="DP-GD only: grid of step counts"
    )
    step_size: tuple[StepSize, ...] | None = Field(
        default=None, min_length=1, max_length=20, description="DP-GD only: grid of step sizes"
    )
    clip: tuple[Clip, ...] | None = Field(
        default=None, min_length=1, max_length=20, description="DP-GD only: grid of clipping norms"
    )
    repeats: int = Field(default=1, strict=True, ge=1, le=1000, description="copies of each configuration")
    epsilon_prime: StrictFloat = Field(
        ge=1e-6, le=10, allow_inf_nan=False, description="ε′ of the latent (Geom or Exp with rate ε′)"
    )
    utility_bar: StrictFloat = Field(
        ge=-4,
        le=1,
        allow_inf_nan=False,
        description="a candidate passes if its noisy held-out utility (accuracy, or −MSE) is ≥ this",
    )
    pass_margin: StrictFloat = Field(
        default=0.0,
        ge=0,
        le=10,
        allow_inf_nan=False,
        description="a candidate passes iff score − pass_margin × (sd of the score noise) ≥ utility_bar",
    )
    mode: Literal["pure", "rdp"] = Field(description="pure: Theorem 11 (geometric); rdp: Theorem 13 (exp)")
    order: StrictFloat | None = Field(
        default=None,
        gt=1,
        le=1e6,
        allow_inf_nan=False,
        description="rdp + DP-GD/objpert: the calibration order α* (a dataset order); candidates' RDP "
        "is ≤ their ε at orders where the curve says so (DP-GD: exactly α ≤ α*), +∞ elsewhere",
    )
    holdout_fraction: StrictFloat = Field(
        default=0.2, ge=0.01, le=0.9, allow_inf_nan=False, description="share of rows held out for scoring"
    )
    pad_to_worst_case_time: StrictBool = Field(
        default=True,
        description="must be true (the default): every candidate runs, dropped ones are discarded, so the "
        "work does not reveal the secret latent k; false is refused (the run count voids the charge)",
    )

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        gd = self.learner.startswith("dp_gd")
        calibrated = gd or self.learner == "objpert.logistic"  # RDP-only learners, calibrated at α*
        for name in ("steps", "step_size", "clip"):
            if not gd and getattr(self, name) is not None:
                raise ValueError(f"{name} applies to DP-GD learners only")
        if calibrated and self.mode == "pure":
            raise ValueError(f"{self.learner} has no pure ε guarantee: use mode 'rdp' or output_perturbation")
        if calibrated and self.order is None:
            raise ValueError(f"{self.learner} candidates need the calibration order 'order'")
        if not calibrated and self.order is not None:
            raise ValueError("order applies to DP-GD and objpert learners only")
        if self.learner == "objpert.logistic" and min(self.regularization) <= 0.25:
            raise ValueError("objpert.logistic needs every regularization (sum-scale λ) > β = 1/4")
        if len(self.grid()) * self.repeats > MAX_CANDIDATES:
            raise ValueError(f"at most {MAX_CANDIDATES} candidates (grid size × repeats)")
        if gd and sum(c.steps for c in self.grid()) * self.repeats > MAX_TOTAL_STEPS:
            raise ValueError(f"at most {MAX_TOTAL_STEPS} DP-GD steps over the whole list (compute limit)")
        return self

    def grid(self) -> list[CandidateConfig]:
        """The configurations in list order (ε outermost), without repeats."""
        if self.learner.startswith("dp_gd"):
            return [
                CandidateConfig(e, r, s, t, c)
                for e, r, s, t, c in product(
                    self.epsilons,
                    self.regularization,
                    self.steps or (100,),
                    self.step_size or (1.0,),
                    self.clip or (1.0,),
                )
            ]
        return [CandidateConfig(e, r) for e, r in product(self.epsilons, self.regularization)]

    def candidates(self) -> list[CandidateConfig]:
        """The full list: each configuration repeated ``repeats`` times (each copy its own index)."""
        return [config for config in self.grid() for _ in range(self.repeats)]


def noise_sd(noise: dict[str, Any]) -> float:
    """Standard deviation of the score noise from its public description (Laplace: √2·scale)."""
    if noise["distribution"] == "laplace":
        return math.sqrt(2.0) * float(noise["scale"])
    return float(noise["sigma"])


@dataclass(frozen=True)
class TuningPlan:
    """Everything public about one request: the list, the drop parameters and the charges per outcome."""

    candidates: list[CandidateConfig]
    drop: np.ndarray
    charges: np.ndarray
    """(n, |A|): ε̃(o, i) at every order (pure mode: the constant 2c_i + ε′)."""
    bottom: np.ndarray
    worst: RdpCurve
    holdout: int
    shape: PublicShape


PAD_REFUSAL = (
    "must be true: the number of candidates that ran is a function of the secret latent k, and the elapsed "
    "time reveals it; revealing it voids the charge of Theorem 11 (2ε + ε′ becomes up to n·ε), so every "
    "candidate always runs"
)


class TuningSelect(ParamsChecked):
    """``tuning.select``: ex-post private selection of a model **and its ε** (Ghazi et al. Alg. 3)."""

    name: ClassVar[str] = "tuning.select"
    summary: ClassVar[str] = (
        "Hyperparameter tuning incl. choosing ε (ex-post, Ghazi et al. Algorithm 3); pure: 2ε_i + ε′ of the "
        "selected candidate, 0 for none; rdp: Theorem 13."
    )
    params_model: ClassVar[type[BaseModel]] = TuningParams
    cost_parameter: ClassVar[str] = "epsilon_prime"
    cost_increases_with_parameter: ClassVar[bool] = True
    long_running: ClassVar[bool] = True
    progress_is_public: ClassVar[bool] = False

    def check(self, p: TuningParams, ctx: PublicContext) -> None:
        learner = LEARNERS[p.learner]
        check_features(p.features, ctx, learner.task, "features")
        if ctx.n_rows is None or ctx.schema.neighboring != "replace_one":
            raise ParamsError("learner", "tuning needs a replace_one dataset (public row count)")
        holdout = math.floor(p.holdout_fraction * ctx.n_rows)
        if holdout < 1 or ctx.n_rows - holdout < 1:
            raise ParamsError("holdout_fraction", "the split leaves an empty training or held-out part")
        if p.mode == "pure" and not learner.has_pure_guarantee:
            raise ParamsError("learner", "pure mode needs candidates with a pure ε guarantee")
        if p.order is not None and p.order not in ctx.orders:
            raise ParamsError("order", f"must be one of the dataset's orders {list(ctx.orders)}")
        if not p.pad_to_worst_case_time:
            raise ParamsError("pad_to_worst_case_time", PAD_REFUSAL)
        if p.learner == "objpert.logistic":
            assert p.order is not None
            shape = self.shape(p, ctx)
            for config in p.grid():
                try:
                    objpert_sigma(config.epsilon, config.reg, p.order)
                except ValueError as exc:
                    raise ParamsError("epsilons", str(exc)) from exc
                try:  # τ = max(1e-6, 2 × the public minimum): the certified stop is always reachable
                    objpert_candidate_config(config.epsilon, config.reg, p.order, shape.d, shape.n_train)
                except ValueError as exc:
                    raise ParamsError("regularization", str(exc)) from exc

    @staticmethod
    def shape(p: TuningParams, ctx: PublicContext) -> PublicShape:
        """The public sizes: n_t = n − ⌊h·n⌋ training rows, m = ⌊h·n⌋ held-out rows, d design columns."""
        assert ctx.n_rows is not None
        holdout = math.floor(p.holdout_fraction * ctx.n_rows)
        return PublicShape(ctx.n_rows - holdout, holdout, dimension(p.features, ctx))

    def plan(self, p: TuningParams, ctx: PublicContext) -> TuningPlan:
        """The public plan (list, drop parameters, every outcome's charge); no data is read."""
        self.check(p, ctx)
        assert ctx.n_rows is not None
        learner = LEARNERS[p.learner]
        candidates = p.candidates()
        drop = np.array([config.epsilon for config in candidates])
        shape = self.shape(p, ctx)
        holdout = shape.n_hold
        orders = tuple(ctx.orders)
        if p.mode == "pure":
            per = pure_charges(drop, p.epsilon_prime)
            charges = np.repeat(per[:, None], len(orders), axis=1)
            bottom = np.zeros(len(orders))
            worst = RdpCurve.from_pure(float(per.max()), orders)
            return TuningPlan(candidates, drop, charges, bottom, worst, holdout, shape)
        try:
            curves = {config: learner.curve(config, orders, p.order, shape) for config in p.grid()}
        except ValueError as exc:
            raise ParamsError("epsilons", str(exc)) from exc
        rdp = np.array([curves[config].values for config in candidates])
        table = rdp_charges(drop, p.epsilon_prime, orders, rdp)
        index = {float(v): u for u, v in enumerate(table.drops)}
        charges = table.per_drop[:, [index[float(c)] for c in drop]].T
        worst_values = np.maximum(table.bottom, charges.max(axis=0))
        worst = RdpCurve(orders, tuple(float(v) for v in worst_values))
        return TuningPlan(candidates, drop, charges, table.bottom, worst, holdout, shape)

    def worst_case(self, p: TuningParams, ctx: PublicContext) -> RdpCurve:
        return self.plan(p, ctx).worst

    def realized(self, p: TuningParams, plan: TuningPlan, index: int | None) -> RdpCurve:
        """The ex-post charge of the released outcome (a function of the outcome and the public plan)."""
        orders = plan.worst.orders
        if index is None:
            if p.mode == "pure":
                return RdpCurve.zero(orders)  # Theorem 11: ⊥ is free
            return RdpCurve(orders, tuple(float(v) for v in plan.bottom))
        values = tuple(float(v) for v in plan.charges[index])
        if p.mode == "pure":
            return RdpCurve.from_pure(values[0], orders)
        return RdpCurve(orders, values)

    def run(
        self,
        p: TuningParams,
        ctx: PublicContext,
        table: Table,
        noise: Noise,
        progress: ProgressFn = no_progress,
    ) -> Release:
        plan = self.plan(p, ctx)  # before the data is touched
        learner = LEARNERS[p.learner]
        x, y = design_matrix(p.features, ctx, table, learner.task)
        split = split_rows(x, y, plan.holdout, noise)
        if (
            split.x_train.shape != (plan.shape.n_train, plan.shape.d)
            or split.x_hold.shape[0] != plan.shape.n_hold
        ):
            raise RuntimeError("the data does not have the public shape the charge was computed for")
        # noise-free shared work (ERM minimisers) before the latent is drawn: its time does not depend on k
        learner.prepare(p.grid(), split, lambda _fraction: progress(0.0))
        learner.predraw(plan.candidates, split, noise)  # every entry's noise, one batch (law unchanged)
        n = len(plan.candidates)
        done = [0]

        def run_candidate(i: int) -> tuple[Sequence[float], Any]:
            config = plan.candidates[i]

            def inner(fraction: float) -> None:
                progress(min(1.0, (done[0] + fraction) / n))

            theta, score, score_noise = learner.fit_and_score(config, split, p.order, noise, inner)
            done[0] += 1
            passes = bool(score - p.pass_margin * noise_sd(score_noise) >= p.utility_bar)  # NaN fails
            key = (1.0 if passes else 0.0, -config.epsilon, score)
            return key, (theta, score, passes, score_noise)

        selection = algorithm3(
            plan.drop,
            p.epsilon_prime,
            "geometric" if p.mode == "pure" else "exponential",
            run_candidate,
            noise,
            pad=True,  # always: the work must not depend on k (check refuses pad_to_worst_case_time=false)
            progress=progress,
        )
        realized = self.realized(p, plan, selection.index)
        assert realized <= plan.worst
        charge = realized.as_dict()
        if selection.index is None:
            return Release({"outcome": "none", "charge": charge}, realized)
        theta, score, passes, score_noise = selection.output
        config = plan.candidates[selection.index]
        output = {
            "outcome": "selected",
            "selected": {**config.as_dict(p.learner), "index": selection.index},
            "model": {
                "columns": column_names(p.features, ctx),
                "coefficients": [float(v) if math.isfinite(v) else None for v in theta],
            },
            "score": {
                "metric": "accuracy" if learner.task == "classification" else "negative_mse",
                "value": float(score) if math.isfinite(score) else None,
                "passes": passes,
                "noise": score_noise,
            },
            "charge": charge,
        }
        return Release(output, realized)
