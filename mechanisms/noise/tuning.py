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
* **Keep mask given k.** Entry i is kept iff V_i < e^{−c_i k} for a fresh uniform V_i (exact, as above);
  the 64-bit enclosure of e^{−c_i k} is the k-th power of a cached 192-bit enclosure of e^{−c_i}
  (``exp_neg_multiple_bounds``, outward rounding at every product).
* **Exponential latent: an exponential race.** With X ~ Exp(ε′) and T_i ~ Exp(c_i) independent,
  P(T_i > X | X = x) = e^{−c_i x} independently over i, so {i : T_i > X} has exactly the mask law of
  Theorem 13. The race is run event by event: by memorylessness the next clock to ring among those still
  running is j with probability rate_j/Σ rates, independently of the past. Rates are rationals scaled to
  integers, one ``Noise.randbelow`` per event picks the clock (exact). The race stops when X rings; the
  clocks still running are the kept entries. x itself is never materialised (nothing needs it). Every race
  is padded with discarded draws to the largest number of events, so its work does not reveal k.
* **Discrete Laplace rows (the candidates' noise).** Z = Y − Y′ with Y, Y′ ~ Geom(e^{−1/t}), each drawn by
  its independent binary digits, 16 random bits per digit against cached integer enclosures of the digit
  probabilities (``discrete_laplace_rows``): one vectorised pass, no rejection.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
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


_BASE_BITS = 192


@lru_cache(maxsize=1 << 12)
def _exp_neg_base(numerator: int, denominator: int) -> tuple[int, int]:
    return exp_neg_bounds(numerator, denominator, _BASE_BITS)


def _power_bounds(lo: int, hi: int, k: int, precision: int) -> tuple[int, int]:
    """From lo ≤ y·2^P ≤ hi (y ≥ 0) to lo′ ≤ y^k·2^P ≤ hi′: square-and-multiply, the lower end rounded down
    and the upper end up at every product (x ↦ x·z is increasing on [0, ∞), so each step only widens)."""
    one = 1 << precision
    r_lo = r_hi = one
    while k:
        if k & 1:
            r_lo, r_hi = r_lo * lo >> precision, _ceil_div(r_hi * hi, one)
        k >>= 1
        if k:
            lo, hi = lo * lo >> precision, _ceil_div(hi * hi, one)
    return r_lo, r_hi


@lru_cache(maxsize=1 << 16)
def exp_neg_multiple_bounds(numerator: int, denominator: int, k: int, bits: int = _WORD) -> tuple[int, int]:
    """Integers (lo, hi) with lo ≤ e^{−k·x}·2^bits ≤ hi, x = numerator/denominator ≥ 0, integer k ≥ 0.

    The k-th power (``_power_bounds``) of a cached 192-bit enclosure of e^{−x}, rounded outward to ``bits``:
    one enclosure per distinct x serves every k (the keep mask needs e^{−c_i·k} for a fresh k each run).
    Each product adds at most one unit at 2^{−192} and the values are ≤ 1 (up to the enclosure's slack), so
    the width at 2^{−bits} stays below 3 for any practical k; if it does not, ``exp_neg_bounds(k·x)``.
    """
    if k < 0:
        raise ValueError("k must be ≥ 0")
    if k == 0 or numerator == 0 or numerator * k >= bits * denominator or bits > _BASE_BITS - 64:
        return exp_neg_bounds(numerator * k, denominator, bits)
    lo, hi = _power_bounds(*_exp_neg_base(numerator, denominator), k, _BASE_BITS)
    shift = _BASE_BITS - bits
    lo, hi = lo >> shift, _ceil_div(hi, 1 << shift)
    if hi - lo > 3:
        return exp_neg_bounds(numerator * k, denominator, bits)
    return lo, hi


class LazyUniform:
    """A uniform real U ∈ [0, 1) revealed 64 bits at a time: U ∈ [prefix/2^bits, (prefix+1)/2^bits)."""

    def __init__(self, noise: Noise, prefix: int, bits: int = _WORD) -> None:
        self.noise = noise
        self.prefix = prefix
        self.bits = bits

    def below_exp_neg(self, x: Fraction) -> bool:
        """1{U < e^{−x}}, drawing more bits of U until the enclosure of e^{−x} decides it."""
        return self.below(lambda bits: exp_neg_bounds(x.numerator, x.denominator, bits))

    def below(self, bounds: Callable[[int], tuple[int, int]]) -> bool:
        """1{U < p} for an irrational p ∈ [0, 1] given by ``bounds(b)`` = integers lo ≤ p·2^b ≤ hi (a
        bounded width): more bits of U until the enclosure decides it (ends with probability one)."""
        while True:
            lo, hi = bounds(self.bits)
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


def _bound_arrays(bounds: Sequence[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """64-bit enclosures as arrays: (lo clipped, lo == 2^64, hi clipped, hi ≥ 2^64)."""
    lo = np.array([min(b[0], _TWO64 - 1) for b in bounds], dtype=np.uint64)
    lo_full = np.array([b[0] >= _TWO64 for b in bounds], dtype=bool)
    hi = np.array([min(b[1], _TWO64 - 1) for b in bounds], dtype=np.uint64)
    hi_full = np.array([b[1] >= _TWO64 for b in bounds], dtype=bool)
    return lo, lo_full, hi, hi_full


def _thresholds(values: Sequence[Fraction]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """64-bit enclosures of e^{−x} per distinct x: (lo clipped, lo == 2^64, hi clipped, hi ≥ 2^64)."""
    return _bound_arrays([exp_neg_bounds(v.numerator, v.denominator, _WORD) for v in values])


def _decide_table(
    noise: Noise, bounds: Sequence[tuple[int, int]], exponent: Callable[[int], Fraction], index: np.ndarray
) -> np.ndarray:
    """Row r is 1{U_r < e^{−x_j}}, j = index[r], for fresh uniforms U_r, given 64-bit enclosures ``bounds[j]``
    of e^{−x_j}; ``exponent(j)`` is x_j as an exact rational, built only for the rows the enclosure leaves
    open (probability ≤ 2^{−62} each; finished with more bits by ``LazyUniform``)."""
    idx = np.asarray(index, dtype=np.int64).ravel()
    lo, lo_full, hi, hi_full = _bound_arrays(bounds)
    u = noise.words(idx.size)
    below = lo_full[idx] | (u < lo[idx])
    above = ~hi_full[idx] & (u >= hi[idx])
    result: np.ndarray = below.copy()
    for r in np.flatnonzero(~below & ~above):
        result[r] = LazyUniform(noise, int(u[r])).below_exp_neg(exponent(int(idx[r])))
    return result.reshape(np.shape(index))


def bernoulli_exp_neg_table(noise: Noise, values: Sequence[Fraction], index: np.ndarray) -> np.ndarray:
    """Row r is Bernoulli(e^{−values[index[r]]}) (independent rows): exact lazy comparison, vectorised.

    One 64-bit word per row decides it unless it falls inside the (≤ 3 units wide) enclosure; such rows
    (probability ≤ 2^{−62} each) are finished one by one with more bits (``LazyUniform``).
    """
    bounds = [exp_neg_bounds(v.numerator, v.denominator, _WORD) for v in values]
    return _decide_table(noise, bounds, lambda j: values[j], index)


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
            start = math.floor(-uniform.log_estimate() / float(rate))
            draws.append(geometric_by_inversion(uniform, rate, start))
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
            k[r] = geometric_by_inversion(LazyUniform(noise, int(u[r])), rate, int(m[r]))
        pending = pending[decided]
    for r in pending:
        k[r] = geometric_by_inversion(LazyUniform(noise, int(u[r])), rate, int(m[r]))
    return k


def geometric_by_inversion(uniform: LazyUniform, rate: Fraction, start: int) -> int:
    """k = max{m : U < e^{−rate·m}}, i.e. k ~ Geom_{e^{−rate}} on {0, 1, …} by inversion of the uniform U,
    decided by exact comparisons; the search starts at the guess ``start`` (only the number of comparisons
    depends on it, never k). Known bounds low ≤ k ≤ high shrink at every step
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

    Shape (runs, n). One enclosure per distinct (c, k) pair (``exp_neg_multiple_bounds``: a power of the
    cached enclosure of e^{−c}); one 64-bit word per entry.
    """
    k = np.asarray(latent, dtype=np.int64).ravel()
    drop_index = np.asarray(index, dtype=np.int64).ravel()
    groups = len(values)
    if k.size == 1:  # a request's single run
        distinct_k, k_index = k, np.zeros(1, dtype=np.int64)
    else:
        distinct_k, k_index = np.unique(k, return_inverse=True)
    codes = k_index[:, None] * groups + drop_index[None, :]
    if distinct_k.size * groups <= 1 << 17:  # every (k, c) pair: no sort of the codes needed
        pairs = [(c, int(kv)) for kv in distinct_k for c in values]
    else:
        distinct_codes, code_index = np.unique(codes, return_inverse=True)
        pairs = [(values[int(v) % groups], int(distinct_k[int(v) // groups])) for v in distinct_codes]
        codes = code_index.reshape(codes.shape)
    bounds = [exp_neg_multiple_bounds(c.numerator, c.denominator, kv) for c, kv in pairs]
    return _decide_table(noise, bounds, lambda j: pairs[j][0] * pairs[j][1], codes)


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
    common = math.lcm(eps_prime.denominator, *(c.denominator for c in values))
    latent_weight = eps_prime.numerator * (common // eps_prime.denominator)
    members_of: list[list[int]] = [[] for _ in values]
    for i, g in enumerate(drop_index.tolist()):
        members_of[g].append(i)
    order = sorted(
        (
            (c.numerator * (common // c.denominator), members)
            for c, members in zip(values, members_of, strict=True)
            if c > 0 and members
        ),
        key=lambda item: -item[0] * len(item[1]),
    )
    kept = np.ones((runs, drop_index.size), dtype=bool)
    for run in range(runs):
        dropped = _race(noise, latent_weight, order)
        kept[run, dropped] = False
    return kept


def _race(noise: Noise, latent_weight: int, order: list[tuple[int, list[int]]]) -> list[int]:
    """One race (``exponential_race``): the entries whose clock rang before X, padded to the most events.

    ``order`` lists (integer rate, members) per group; ``blocks[g]`` = rate × running count of group g.
    """
    weights = [w for w, _ in order]
    running = [list(members) for _, members in order]
    blocks = [w * len(members) for w, members in order]
    start_total = total = sum(blocks)
    events, dropped = 0, []
    while total > 0:
        events += 1
        r = noise.randbelow(latent_weight + total) - latent_weight
        if r < 0:
            break  # X rang first: every clock still running is kept
        g = 0
        while r >= blocks[g]:
            r -= blocks[g]
            g += 1
        members, weight = running[g], weights[g]
        j = r // weight  # r is uniform on the group's block: j is a uniform running member
        dropped.append(members[j])
        members[j] = members[-1]
        members.pop()
        blocks[g] -= weight
        total -= weight
    ringing = sum(len(members) for _, members in order)
    for _ in range(ringing + 1 - events):  # pad to the most events: the work does not reveal k
        noise.randbelow(latent_weight + start_total)
    return dropped


_DIGIT = 16  # the binary digits of the discrete Laplace's geometrics are decided 16 bits at a time
_TAIL_RATE = 45  # e^{−45} < 2^{−64}: a geometric of parameter e^{−45} or less is 0 unless U < 2^{−64}
_TABLE_BITS = 128  # fixed-point precision of the e^{−2^j/t} enclosures behind the digit thresholds


def _logistic_bounds(numerator: int, denominator: int, bits: int) -> tuple[int, int]:
    """Integers (lo, hi) with lo ≤ 2^bits·p ≤ hi, p = e^{−x}/(1 + e^{−x}), x = numerator/denominator ≥ 0
    (p is increasing in e^{−x}, so the enclosure of e^{−x} at bits + 2 maps to one of p, rounded outward)."""
    e_lo, e_hi = exp_neg_bounds(numerator, denominator, bits + 2)
    one = 1 << (bits + 2)
    return (e_lo << bits) // (one + e_lo), _ceil_div(e_hi << bits, one + e_hi)


@lru_cache(maxsize=1 << 10)
def _digit_table(numerator: int, denominator: int) -> tuple[np.ndarray, np.ndarray]:
    """16-bit decision thresholds for the binary digits y_j, j < J, of Y ~ Geom(q), q = e^{−1/t},
    t = numerator/denominator, J the least with 2^J/t ≥ 45: (below_j, above_j) with
    below_j ≤ 2^16·p_j ≤ above_j, p_j = q^{2^j}/(1 + q^{2^j}) = P(y_j = 1).

    e^{−2^j/t} is enclosed at 128 bits by squaring an enclosure of e^{−1/t} j times (floor on the lower
    end, ceiling on the upper: each squaring only widens), then mapped through e ↦ e/(1 + e) (increasing).
    One table per scale, cached: a tuning list repeats the same few scales.
    """
    r, s = denominator, numerator  # 1/t = r/s
    one = 1 << _TABLE_BITS
    e_lo, e_hi = exp_neg_bounds(r, s, _TABLE_BITS)
    below, above = [], []
    j = 0
    while (r << j) < _TAIL_RATE * s:
        below.append((e_lo << _DIGIT) // (one + e_lo))
        above.append(_ceil_div(e_hi << _DIGIT, one + e_hi))
        e_lo, e_hi = e_lo * e_lo >> _TABLE_BITS, _ceil_div(e_hi * e_hi, one)
        j += 1
    return np.array(below, dtype=np.uint16), np.array(above, dtype=np.uint16)


def _geometric_digit(noise: Noise, digit: int, t: Fraction, j: int) -> bool:
    """y_j = 1{U < p_j} for the uniform U whose first 16 bits ``digit`` left it open: more bits of U."""
    x = Fraction(1 << j) / t
    return LazyUniform(noise, digit, _DIGIT).below(lambda b: _logistic_bounds(x.numerator, x.denominator, b))


def discrete_laplace_rows(noise: Noise, scales: Sequence[Fraction]) -> np.ndarray:
    """One draw per row of the discrete Laplace P(z) ∝ exp(−|z|/t_row), exactly, vectorised over rows whose
    scales differ (one batch for every candidate of a tuning list instead of one small batch each).

    Z = Y − Y′ for independent Y, Y′ ~ Geom(q) on {0, 1, …}, q = e^{−1/t}: P(Z = z) = Σ_y (1−q)²q^{2y+|z|}
    = (1−q)/(1+q)·q^{|z|}, the discrete Laplace (Inusah, Kozubowski 2006). Each geometric is drawn by its
    binary digits: P(Y = Σ_j 2^j y_j) ∝ q^{Σ_j 2^j y_j} = Π_j (q^{2^j})^{y_j} is a product over digits, so
    the digits are independent with P(y_j = 1) = p_j = q^{2^j}/(1 + q^{2^j}), and the digits from J on are
    those of G = ⌊Y/2^J⌋ ~ Geom(q^{2^J}). Digit j < J is 1{U_j < p_j} for a uniform U_j whose first 16 bits
    d decide it against the table's integer enclosure (d < below_j: yes; d ≥ above_j: no); otherwise
    (probability ≤ 2^{−15}) more bits of U_j decide (``LazyUniform``). With 2^J/t ≥ 45, q^{2^J} < 2^{−64},
    so G = 0 whenever the first 16 bits of its uniform are not all zero; otherwise G is drawn exactly by
    inversion (``geometric_by_inversion``). No rejection: one pass, two geometrics per row. Rows with s > 2^52
    (t = s/r) use ``Noise.discrete_laplace`` one by one. Rows usually repeat a few scale objects (one per
    configuration): each distinct object is read once.
    """
    ids = np.fromiter(map(id, scales), dtype=np.uint64, count=len(scales))
    first, index = np.unique(ids, return_index=True, return_inverse=True)[1:]  # one scale object, many rows
    ts = [t if isinstance(t, Fraction) else Fraction(t) for t in (scales[int(i)] for i in first)]
    if any(t.numerator <= 0 for t in ts):
        raise ValueError("a discrete Laplace scale must be > 0")
    fast = np.array([t.numerator <= 1 << 52 for t in ts], dtype=bool)
    out = np.zeros(len(scales), dtype=np.int64)
    for i in np.flatnonzero(~fast[index]):
        out[i] = int(noise.discrete_laplace(ts[int(index[i])], 1)[0])
    rows = np.flatnonzero(fast[index])
    if rows.size:
        keys = tuple((t.numerator, t.denominator) if fast[k] else (1, 1) for k, t in enumerate(ts))
        below, above = _digit_matrix(keys)
        scale_of = index[rows]
        y = _geometrics(noise, below[scale_of], above[scale_of], lambda r: ts[int(scale_of[r])])
        out[rows] = y[:, 0] - y[:, 1]
    return out


@lru_cache(maxsize=64)
def _digit_matrix(keys: tuple[tuple[int, int], ...]) -> tuple[np.ndarray, np.ndarray]:
    """``_digit_table`` of every scale (numerator, denominator) as rows of two uint16 matrices, padded with
    zeros (a digit beyond its scale's J is decided 0: it belongs to G). Cached per list of scales."""
    tables = [_digit_table(*key) for key in keys]
    width = max(below.size for below, _ in tables)
    below = np.zeros((len(keys), width), dtype=np.uint16)
    above = np.zeros((len(keys), width), dtype=np.uint16)  # above_j ≤ 2^15 + 1: p_j ≤ 1/2
    for k, (b, a) in enumerate(tables):
        below[k, : b.size], above[k, : a.size] = b, a
    return below, above


def _geometrics(
    noise: Noise, below: np.ndarray, above: np.ndarray, scale: Callable[[int], Fraction]
) -> np.ndarray:
    """Two independent Geom(e^{−1/t}) per row (shape (rows, 2)) from the rows' digit thresholds; ``scale(r)``
    is row r's t, read only on the rare rows that need more bits."""
    rows, width = below.shape
    count = rows * 2 * (width + 1)
    digits = noise.words(-(-count // 4)).view(np.uint16)[:count].reshape(rows, 2, width + 1)
    low = digits[:, :, :width]
    ones = low < below[:, None, :]
    open_ = (low - below[:, None, :]) < (above - below)[:, None, :]  # below ≤ d < above (uint16 wraps)
    if open_.any():
        for r, g, j in zip(*np.nonzero(open_), strict=True):
            ones[r, g, j] = _geometric_digit(noise, int(low[r, g, j]), scale(int(r)), int(j))
    y = ones.astype(np.int64) @ (np.int64(1) << np.arange(width, dtype=np.int64))
    for r, g in zip(*np.nonzero(digits[:, :, width] == 0), strict=True):  # G may be ≥ 1: U < 2^{−16}
        t = scale(int(r))
        top = _digit_table(t.numerator, t.denominator)[0].size  # J of this row's scale
        tail = geometric_by_inversion(LazyUniform(noise, 0, _DIGIT), Fraction(1 << top) / t, 0)
        y[r, g] = int(y[r, g]) + (tail << top)  # beyond int64 (probability < e^{−45·32}): OverflowError
    return y
