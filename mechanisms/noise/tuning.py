"""Exact samplers for the secret latent and the keep mask of ex-post tuning (Ghazi et al. Algorithm 3).

Both tuning theorems rest on the law of the keep mask: entry i is kept with probability e^{−c_i k} given one
shared latent k, with k ~ Geom_{e^{−ε′}} (Theorem 11, pure) or x ~ Exp(rate ε′) (Theorem 13, RDP). Every
parameter here is an exact rational (a float is read as its exact binary value, the very number the charge
uses), and the samplers draw from the stated law **exactly**: no floating-point value is ever compared
with a random number.

* **Bernoulli(e^{−x}) by lazy comparison.** A uniform real U ∈ [0, 1) is revealed 64 bits at a time
  (``Noise.words`` / ``Noise.random_bits``). ``exp_neg_bounds`` gives integers lo ≤ e^{−x}·2^b ≤ hi
  (a rigorous enclosure: alternating Taylor partial sums in exact rational arithmetic, then squarings
  with outward rounding). With the prefix u of U at b bits, U ∈ [u/2^b, (u+1)/2^b): if u + 1 ≤ lo then
  U < e^{−x}; if u ≥ hi then U ≥ e^{−x}; otherwise (probability ≤ 4·2^{−b}) 64 more bits are drawn and
  the enclosure is recomputed at b + 64 bits. The answer is exactly 1{U < e^{−x}}, so P(1) = e^{−x}.
  e^{−x} is irrational for rational x > 0 (Lindemann 1882), so U never equals it and the loop ends with
  probability one; x = 0 gives lo = hi = 2^b and is decided at once.
* **Geometric latent by exact inversion.** k = max{m ≥ 0 : U < e^{−ε′m}} for one uniform U, so
  P(k ≥ m) = P(U < e^{−ε′m}) = e^{−ε′m}: k ~ Geom_{e^{−ε′}} on {0, 1, …}. A float estimate of −ln U/ε′
  only proposes m; the two exact comparisons U < e^{−ε′m} and U ≥ e^{−ε′(m+1)} (same U) accept it or
  bound k from one side, and the next proposal is clipped into the bounds until both hold.
* **Keep mask given k.** Entry i is kept iff V_i < e^{−c_i k} for a fresh uniform V_i (exact, as above).
* **Exponential latent: an exponential race.** With X ~ Exp(ε′) and T_i ~ Exp(c_i) independent,
  P(T_i > X | X = x) = e^{−c_i x} independently over i, so {i : T_i > X} has exactly the mask law of
  Theorem 13. The race is run event by event: by memorylessness the next clock to ring among those still
  running is j with probability rate_j/Σ rates, independently of the past. Rates are rationals scaled to
  integers, one ``Noise.randbelow`` per event picks the clock (exact). The race stops when X rings; the
  clocks still running are the kept entries. x itself is never materialised (nothing needs it). Every race
  is padded with discarded draws to the largest number of events, so its work does not reveal k.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction
from functools import lru_cache

import numpy as np

from mechanisms.noise.exact import Noise

_WORD = 64
_TWO64 = 1 << 64
_MAX_ESTIMATE = 1 << 52
_SCALAR = 8


def _ceil_div(a: int, b: int) -> int:
    """⌈a/b⌉ for integers, b > 0."""
    return -(-a // b)


@lru_cache(maxsize=1 << 16)
def exp_neg_bounds(numerator: int, denominator: int, bits: int) -> tuple[int, int]:
    """Integers (lo, hi) with lo ≤ e^{−x}·2^bits ≤ hi and hi − lo ≤ 3, x = numerator/denominator ≥ 0.

    x ≥ bits: e^{−x} < 2^{−bits}, so (0, 1). Otherwise y = x/2^s ≤ 1/2 and, in fixed point with P = bits +
    s + 12 fractional bits, every Taylor term y^j/j! of e^{−y} gets an integer lower and upper bound
    (floor/ceiling at each multiplication and division). The series alternates with decreasing terms, so a
    partial sum ending on an odd term is ≤ e^{−y} and one ending on an even term is ≥ e^{−y} (Leibniz);
    the lower end uses the terms' lower bounds with + and upper bounds with −, the upper end the opposite.
    Then e^{−x} = (e^{−y})^{2^s}: s squarings, floor on the lower and ceiling on the upper end (x ↦ x² is
    increasing on [0, ∞)), and a final outward rounding to ``bits``. Every step only widens the interval.
    """
    if numerator < 0 or denominator <= 0 or bits <= 0:
        raise ValueError("exp_neg_bounds needs x ≥ 0 and bits > 0")
    full = 1 << bits
    if numerator == 0:
        return full, full
    if numerator >= bits * denominator:
        return 0, 1
    s = 0
    while 2 * numerator > denominator << s:  # x/2^s > 1/2
        s += 1
    precision = bits + s + 12
    scaled = numerator << precision
    divisor = denominator << s
    y_lo, y_hi = scaled // divisor, _ceil_div(scaled, divisor)
    one = 1 << precision
    t_lo, t_hi = one, one  # bounds on y^j/j!·2^P
    lower = upper = one  # partial sums S_j: lower ≤ S_j(true) ≤ upper
    low_end = high_end = None
    j = 0
    while low_end is None or high_end is None:
        j += 1
        t_lo = (t_lo * y_lo >> precision) // j
        t_hi = _ceil_div(_ceil_div(t_hi * y_hi, one), j)
        if j % 2:
            lower, upper = lower - t_hi, upper - t_lo
            if t_hi <= 1 or (high_end is not None):
                low_end = lower if low_end is None else low_end
        else:
            lower, upper = lower + t_lo, upper + t_hi
            if t_hi <= 1 or (low_end is not None):
                high_end = upper if high_end is None else high_end
    lo, hi = max(low_end, 0), high_end
    for _ in range(s):
        lo = (lo * lo) >> precision
        hi = _ceil_div(hi * hi, one)
    shift = precision - bits
    return lo >> shift, _ceil_div(hi, 1 << shift)


class LazyUniform:
    """A uniform real U ∈ [0, 1) revealed 64 bits at a time: U ∈ [prefix/2^bits, (prefix+1)/2^bits)."""

    def __init__(self, noise: Noise, prefix: int, bits: int = _WORD) -> None:
        self.noise = noise
        self.prefix = prefix
        self.bits = bits

    def below_exp_neg(self, x: Fraction) -> bool:
        """1{U < e^{−x}}, drawing more bits of U until the enclosure of e^{−x} decides it."""
        while True:
            lo, hi = exp_neg_bounds(x.numerator, x.denominator, self.bits)
            if self.prefix + 1 <= lo:
                return True
            if self.prefix >= hi:
                return False
            self.prefix = (self.prefix << _WORD) | self.noise.random_bits(_WORD)
            self.bits += _WORD

    def log_estimate(self) -> float:
        """A float approximation of ln U (only to propose a candidate; never decides anything)."""
        if self.prefix == 0:
            return -(self.bits + 1) * math.log(2.0)
        return math.log(self.prefix) + 0.5 / self.prefix - self.bits * math.log(2.0)


def _thresholds(values: Sequence[Fraction]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """64-bit enclosures of e^{−x} per distinct x: (lo clipped, lo == 2^64, hi clipped, hi ≥ 2^64)."""
    bounds = [exp_neg_bounds(v.numerator, v.denominator, _WORD) for v in values]
    lo = np.array([min(b[0], _TWO64 - 1) for b in bounds], dtype=np.uint64)
    lo_full = np.array([b[0] >= _TWO64 for b in bounds], dtype=bool)
    hi = np.array([min(b[1], _TWO64 - 1) for b in bounds], dtype=np.uint64)
    hi_full = np.array([b[1] >= _TWO64 for b in bounds], dtype=bool)
    return lo, lo_full, hi, hi_full


def bernoulli_exp_neg_table(noise: Noise, values: Sequence[Fraction], index: np.ndarray) -> np.ndarray:
    """Row r is Bernoulli(e^{−values[index[r]]}) (independent rows): exact lazy comparison, vectorised.

    One 64-bit word per row decides it unless it falls inside the (≤ 3 units wide) enclosure; such rows
    (probability ≤ 2^{−62} each) are finished one by one with more bits (``LazyUniform``).
    """
    idx = np.asarray(index, dtype=np.int64).ravel()
    lo, lo_full, hi, hi_full = _thresholds(values)
    u = noise.words(idx.size)
    below = lo_full[idx] | (u < lo[idx])
    above = ~hi_full[idx] & (u >= hi[idx])
    result: np.ndarray = below.copy()
    for r in np.flatnonzero(~below & ~above):
        result[r] = LazyUniform(noise, int(u[r])).below_exp_neg(values[int(idx[r])])
    return result.reshape(np.shape(index))


def _as_fraction(value: float | Fraction, name: str) -> Fraction:
    result = Fraction(value)
    if result < 0:
        raise ValueError(f"{name} must be ≥ 0")
    return result


def geometric_latent(noise: Noise, eps_prime: float | Fraction, size: int) -> np.ndarray:
    """``size`` draws of k ~ Geom_{e^{−ε′}} on {0, 1, …}: P(k ≥ m) = e^{−ε′m} exactly (inversion, int64)."""
    rate = _as_fraction(eps_prime, "ε′")
    if rate <= 0:
        raise ValueError("ε′ must be > 0")
    if size <= _SCALAR:  # a request draws one k: plain Python integers, no NumPy rounds
        draws = []
        for _ in range(size):
            uniform = LazyUniform(noise, noise.random_bits(_WORD))
            draws.append(_geometric_slow(uniform, rate, math.floor(-uniform.log_estimate() / float(rate))))
        return np.array(draws, dtype=np.int64)
    u = noise.words(size)
    estimate = -np.log((u.astype(np.float64) + 0.5) * 2.0**-64) / float(rate)
    m = np.floor(np.minimum(estimate, float(_MAX_ESTIMATE))).astype(np.int64)
    k = np.full(size, -1, dtype=np.int64)
    pending = np.arange(size)
    for _ in range(4):  # the float proposal is right or one off; vectorised fixes, then row by row
        if not pending.size:
            break
        candidates = m[pending]
        distinct, inverse = np.unique(np.concatenate([candidates, candidates + 1]), return_inverse=True)
        values = [rate * int(v) for v in distinct]
        lo, lo_full, hi, hi_full = _thresholds(values)
        words = u[pending]
        first, second = inverse[: pending.size], inverse[pending.size :]
        at_m_below = lo_full[first] | (words < lo[first])
        at_m_above = ~hi_full[first] & (words >= hi[first])
        next_below = lo_full[second] | (words < lo[second])
        next_above = ~hi_full[second] & (words >= hi[second])
        done = at_m_below & next_above
        k[pending[done]] = candidates[done]
        m[pending[at_m_above]] -= 1  # U ≥ e^{−ε′m}: k < m
        m[pending[next_below]] += 1  # U < e^{−ε′(m+1)}: k > m
        decided = at_m_above | next_below
        undecided = ~done & ~decided
        for r in pending[undecided]:
            k[r] = _geometric_slow(LazyUniform(noise, int(u[r])), rate, int(m[r]))
        pending = pending[decided]
    for r in pending:
        k[r] = _geometric_slow(LazyUniform(noise, int(u[r])), rate, int(m[r]))
    return k


def _geometric_slow(uniform: LazyUniform, rate: Fraction, start: int) -> int:
    """max{m : U < e^{−rate·m}} by exact comparisons. Known bounds low ≤ k ≤ high shrink at every step
    (U ≥ e^{−rate·m} gives k < m; U < e^{−rate(m+1)} gives k > m); the next m is the float estimate from U's
    revealed prefix, clipped into the bounds, so the search ends after finitely many comparisons."""
    low, high = 0, None
    m = max(0, start)
    while True:
        if not uniform.below_exp_neg(rate * m):
            high = m - 1
        elif uniform.below_exp_neg(rate * (m + 1)):
            low = m + 1
        else:
            return m
        estimate = math.floor(-uniform.log_estimate() / float(rate))
        m = max(low, estimate if high is None else min(high, estimate))


def keep_given_latent(
    noise: Noise, values: Sequence[Fraction], index: np.ndarray, latent: np.ndarray
) -> np.ndarray:
    """mask[r, i] ~ Bernoulli(e^{−c_i·k_r}) independently, c_i = values[index[i]], integer latents k_r.

    Shape (runs, n). One enclosure per distinct (c, k) pair; one 64-bit word per entry.
    """
    k = np.asarray(latent, dtype=np.int64).ravel()
    drop_index = np.asarray(index, dtype=np.int64).ravel()
    groups = len(values)
    distinct_k, k_index = np.unique(k, return_inverse=True)
    codes = k_index[:, None] * groups + drop_index[None, :]
    if distinct_k.size * groups <= 1 << 17:  # every (k, c) pair: no sort of the codes needed
        table = [c * int(kv) for kv in distinct_k for c in values]
        return bernoulli_exp_neg_table(noise, table, codes)
    distinct_codes, code_index = np.unique(codes, return_inverse=True)
    table = [values[int(v) % groups] * int(distinct_k[int(v) // groups]) for v in distinct_codes]
    return bernoulli_exp_neg_table(noise, table, code_index.reshape(codes.shape))


def exponential_race(
    noise: Noise, values: Sequence[Fraction], index: np.ndarray, eps_prime: Fraction, runs: int = 1
) -> np.ndarray:
    """``runs`` keep masks of Theorem 13's law, shape (runs, n), c_i = values[index[i]]: the set
    {i : T_i > X}, T_i ~ Exp(c_i), X ~ Exp(ε′), by an exact race.

    Entries with c_i = 0 never ring (always kept). Entries with equal c_i form one group: the event picks a
    group with probability (its running count × its rate)/(total), and r // rate is then a uniform copy of
    that group (r is uniform on the group's block), so each running clock j rings with rate_j/total.
    The number of events (dropped entries + 1) reveals the latent, so every run is padded with discarded
    draws to the largest possible count (every ringing clock + X): the work does not depend on k.
    """
    if eps_prime <= 0:
        raise ValueError("ε′ must be > 0")
    drop_index = np.asarray(index, dtype=np.int64).ravel()
    n = drop_index.size
    common = math.lcm(eps_prime.denominator, *(c.denominator for c in values))
    latent_weight = int(eps_prime * common)
    members_of = [np.flatnonzero(drop_index == g).tolist() for g in range(len(values))]
    order = sorted(
        (
            (int(c * common), members)
            for c, members in zip(values, members_of, strict=True)
            if c > 0 and members
        ),
        key=lambda item: -item[0] * len(item[1]),
    )
    weights = [w for w, _ in order]
    start_total = sum(w * len(members) for w, members in order)
    ringing = sum(len(members) for _, members in order)
    kept = np.ones((runs, n), dtype=bool)
    for run in range(runs):
        row = kept[run]
        running = [list(members) for _, members in order]
        total = start_total
        events = 0
        while total > 0:
            events += 1
            r = noise.randbelow(latent_weight + total)
            if r < latent_weight:
                break  # X rang first: every clock still running is kept
            r -= latent_weight
            for g, weight in enumerate(weights):
                block = weight * len(running[g])
                if r < block:
                    members = running[g]
                    j = r // weight
                    row[members[j]] = False
                    members[j] = members[-1]
                    members.pop()
                    total -= weight
                    break
                r -= block
        for _ in range(ringing + 1 - events):  # pad to the most events: the work does not reveal k
            noise.randbelow(latent_weight + start_total)
    return kept


_MAX_GEOMETRIC_ROWS = 1 << 10


def discrete_laplace_rows(noise: Noise, scales: Sequence[Fraction]) -> np.ndarray:
    """One draw per row of the discrete Laplace P(z) ∝ exp(−|z|/t_row), exactly, vectorised over rows whose
    scales differ (one batch for every candidate of a tuning list instead of one small batch each).

    CKS 2020, Algorithm 2 per row, with t = s/r: U ~ Unif{0..s−1} kept with probability e^{−U/s}
    (``Noise.bernoulli_exp_neg``), V = the number of successes of Bernoulli(e^{−1}) before the first failure,
    Y = ⌊(U + sV)/r⌋, a fair sign B, rejecting (B = 1, Y = 0); rejected rows are redrawn. Rows with s > 2^52
    use ``Noise.discrete_laplace`` one by one (its big-integer path).
    """
    ts = [Fraction(t) for t in scales]
    if any(t <= 0 for t in ts):
        raise ValueError("a discrete Laplace scale must be > 0")
    out = np.zeros(len(ts), dtype=np.int64)
    fast = np.array([t.numerator <= 1 << 52 and t.denominator < 1 << 62 for t in ts], dtype=bool)
    for i in np.flatnonzero(~fast):
        out[i] = int(noise.discrete_laplace(ts[int(i)], 1)[0])
    rows = np.flatnonzero(fast)
    s_all = np.array([ts[int(i)].numerator for i in rows], dtype=np.int64)
    r_all = np.array([ts[int(i)].denominator for i in rows], dtype=np.int64)
    pending = np.arange(rows.size)
    while pending.size:
        s, r = s_all[pending], r_all[pending]
        u = noise.uniform_below(s)
        keep = noise.bernoulli_exp_neg(u, s)
        v = np.zeros(pending.size, dtype=np.int64)
        alive = np.arange(pending.size)
        while alive.size:
            passed = noise.bernoulli_exp_neg(np.ones(alive.size, dtype=np.int64), 1)
            v[alive[passed]] += 1
            alive = alive[passed]
            if alive.size and int(v[alive].max()) > _MAX_GEOMETRIC_ROWS:
                raise OverflowError("geometric draw beyond 2^10 (probability < e^-1024)")
        y = (u + s * v) // r
        negative = noise.fair_coins(pending.size)
        accept = keep & ~(negative & (y == 0))
        out[rows[pending[accept]]] = np.where(negative, -y, y)[accept]
        pending = pending[~accept]
    return out
