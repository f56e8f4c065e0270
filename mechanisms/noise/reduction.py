"""Exact integer samplers for discrete Laplace noise reduction
(docs/privacy/noise_reduction.md#laplace-noise-reduction, finite precision).

Rates are exact rationals with one fixed denominator D = 2^48: a level of rate m (an integer) has discrete
Laplace noise P(z) ∝ q^{|z|} with q = e^{−m/D}. Every probability below is built from Bernoulli(exp(−num/D))
coins (``Noise.bernoulli_exp_neg``, Canonne, Kamath, Steinke 2020, Algorithm 1) and uniform integers, so the
output law is the stated pmf exactly (integer arithmetic only; Python integers where an exponent would
overflow int64).

**The decomposition.** The discrete Laplace of parameter q has characteristic function
(1−q)²/(1 − 2q cos u + q²) = 1/(1 + c_q·w), w = 2(1 − cos u), c_q = q/(1−q)², the form 1/(1 + c·w) of the
continuous Laplace (c = b², w = u²). Hence for rates a < b (c_a > c_b):
DLap(a) = DLap(b) + W with W = 0 w.p. ρ = c_b/c_a, else W ~ DLap(a), W independent of DLap(b)
(the ratio of characteristic functions is (1 + c_b w)/(1 + c_a w) = ρ + (1 − ρ)/(1 + c_a w)).
With q = e^{−x}: ρ = e^{−(b−a)}·R(a, b)², R(a, b) = (1 − e^{−a})/(1 − e^{−b}) (``ratio_coins``).

**The reverse (lazy) kernel.** Given the noisier level's value x (rate a), the next level (rate b > a) is
y = x ("stay") with probability ρ·P_b(x)/P_a(x) = e^{−(b−a)(1+|x|)}·R(2a, 2b), else y has pmf
∝ e^{−a|x−y| − b|y|} on Z, drawn by rejection from a three-piece proposal whose acceptance probabilities
are products of exp-coins (``_move_rows``; derivation in the function's docstring).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from mechanisms.noise.exact import Noise

RATE_BITS = 48
RATE_DENOMINATOR = 1 << RATE_BITS
"""D: every rate is an integer m meaning x = m/D (q = e^{−x})."""
_D = RATE_DENOMINATOR
_INT64_SAFE = 1 << 62
_MAX_GEOMETRIC = 1 << 9  # V beyond this has probability < e^{-512}: refused (OverflowError), never wrapped

IntArray = np.ndarray


# ----- exp coins with arbitrary (Python int) exponents ------------------------------------------------------
def exp_neg_coins(noise: Noise, numerators: Sequence[int] | np.ndarray) -> np.ndarray:
    """Bernoulli(exp(−num/D)) per row for integers num ≥ 0 of any size (int64 or Python ints).

    Rows below 2^62 go to ``Noise.bernoulli_exp_neg``; larger ones are e^{−⌊num/D⌋} (a run of e^{−1} coins,
    stopped at the first failure) times e^{−(num mod D)/D}: the same coins, never a float.
    """
    nums = np.asarray(numerators, dtype=object) if not isinstance(numerators, np.ndarray) else numerators
    n = len(nums)
    if n == 0:
        return np.zeros(0, dtype=bool)
    if nums.dtype != object:
        if int(np.min(nums)) < 0:
            raise ValueError("exp_neg_coins needs num ≥ 0")
        result: np.ndarray = noise.bernoulli_exp_neg(nums.astype(np.int64), _D)
        return result
    values = [int(v) for v in nums]
    if min(values) < 0:
        raise ValueError("exp_neg_coins needs num ≥ 0")
    small = np.array([v < _INT64_SAFE for v in values], dtype=bool)
    out = np.zeros(n, dtype=bool)
    idx_small = np.flatnonzero(small)
    if idx_small.size:
        out[idx_small] = noise.bernoulli_exp_neg(np.array([values[i] for i in idx_small], dtype=np.int64), _D)
    idx_big = np.flatnonzero(~small)
    if idx_big.size:
        whole = [values[i] // _D for i in idx_big]
        rest = np.array([values[i] % _D for i in idx_big], dtype=np.int64)
        passed = noise.bernoulli_exp_neg(rest, _D)
        remaining = list(whole)
        alive = [j for j in range(idx_big.size) if passed[j]]
        while alive:
            coins = noise.bernoulli_exp_neg(np.ones(len(alive), dtype=np.int64), 1)
            still = []
            for j, coin in zip(alive, coins, strict=True):
                if not coin:
                    passed[j] = False
                    continue
                remaining[j] -= 1
                if remaining[j] > 0:
                    still.append(j)
            alive = still
        out[idx_big] = passed
    return out


def geometric_e1(noise: Noise, count: int) -> IntArray:
    """Successes of Bernoulli(e^{−1}) before the first failure, per row: P(V = v) = (1 − e^{−1})e^{−v}."""
    v = np.zeros(count, dtype=np.int64)
    alive = np.arange(count)
    while alive.size:
        passed = noise.bernoulli_exp_neg(np.ones(alive.size, dtype=np.int64), 1)
        v[alive[passed]] += 1
        alive = alive[passed]
        if alive.size and int(v[alive].max()) > _MAX_GEOMETRIC:
            raise OverflowError("geometric draw beyond 2^9 (probability < e^-512)")
    return v


# ----- geometric and discrete Laplace with per-row rates ----------------------------------------------------
def _check_rates(rates: np.ndarray) -> np.ndarray:
    m = np.atleast_1d(np.asarray(rates, dtype=np.int64))
    if m.size and (int(m.min()) < 1 or int(m.max()) >= 1 << 56):
        raise ValueError("rates must be integers in [1, 2^56)")
    return m


def geometric_rates(noise: Noise, rates: np.ndarray) -> IntArray:
    """Per row G ≥ 0 with P(G = g) ∝ e^{−g·m/D} (m the row's rate), exactly.

    CKS 2020 Algorithm 2's geometric stage: X = U + D·V with U ~ Unif{0..D−1} kept w.p. e^{−U/D} and
    V ~ Geometric(e^{−1}) has P(X = x) ∝ e^{−x/D}; then G = ⌊X/m⌋ has P(G = g) ∝ Σ_{x=gm}^{gm+m−1} e^{−x/D}
    ∝ e^{−gm/D}.
    """
    m = _check_rates(rates)
    out = np.empty(m.size, dtype=np.int64)
    pending = np.arange(m.size)
    while pending.size:
        u = noise.uniform_below(_D, pending.size)
        keep = noise.bernoulli_exp_neg(u, _D)
        done = pending[keep]
        v = geometric_e1(noise, done.size)
        out[done] = (u[keep] + _D * v) // m[done]
        pending = pending[~keep]
    return out


def discrete_laplace_rates(noise: Noise, rates: np.ndarray) -> IntArray:
    """Per row Z with P(Z = z) ∝ e^{−|z|·m/D}: a geometric magnitude, a fair sign, rejecting (−, 0)."""
    m = _check_rates(rates)
    out = np.empty(m.size, dtype=np.int64)
    pending = np.arange(m.size)
    while pending.size:
        g = geometric_rates(noise, m[pending])
        negative = noise.fair_coins(pending.size)
        accept = ~(negative & (g == 0))
        out[pending[accept]] = np.where(negative, -g, g)[accept]
        pending = pending[~accept]
    return out


# ----- the ratio coin and the stay coin ---------------------------------------------------------------------
def ratio_coins(noise: Noise, low: np.ndarray, high: np.ndarray) -> np.ndarray:
    """Per row Bernoulli(R) with R = (1 − e^{−A/D})/(1 − e^{−B/D}), integers 0 ≤ A ≤ B, B ≥ 1.

    B ≤ D: K uniform on {0..B−1} kept w.p. e^{−K/D} has P(K = k) ∝ e^{−k/D}, so P(K < A) = R (geometric
    sums); acceptance ≥ e^{−1}. B > D: with one exponential clock E, "E < A/D" is a failed e^{−A/D} coin and,
    given E ≥ A/D, "E < B/D" a failed e^{−(B−A)/D} coin (memorylessness); rejecting E ≥ B/D leaves
    P(E < A/D | E < B/D) = R; acceptance ≥ 1 − e^{−1}.
    """
    a = np.atleast_1d(np.asarray(low, dtype=np.int64))
    b = np.atleast_1d(np.asarray(high, dtype=np.int64))
    if a.size and (int(a.min()) < 0 or bool(np.any(a > b)) or int(b.min()) < 1 or int(b.max()) >= 1 << 60):
        raise ValueError("ratio_coins needs 0 ≤ A ≤ B, 1 ≤ B < 2^60")
    out = a == b
    pending = np.flatnonzero(~out)
    while pending.size:
        small = b[pending] <= _D
        rows = pending[small]
        if rows.size:
            k = noise.uniform_below(b[rows])
            keep = noise.bernoulli_exp_neg(k, _D)
            out[rows[keep]] = k[keep] < a[rows[keep]]
            next_small = rows[~keep]
        else:
            next_small = rows
        rows = pending[~small]
        if rows.size:
            first = noise.bernoulli_exp_neg(a[rows], _D)  # survives past A/D
            out[rows[~first]] = True
            later = rows[first]
            second = noise.bernoulli_exp_neg(b[later] - a[later], _D)  # survives past B/D too
            out[later[~second]] = False
            next_big = later[second]
        else:
            next_big = rows
        pending = np.concatenate([next_small, next_big])
    result: np.ndarray = out
    return result


def stay_coins(noise: Noise, low: np.ndarray, high: np.ndarray) -> np.ndarray:
    """Per row Bernoulli(ρ), ρ = c_b/c_a for rates A ≤ B (c = q/(1−q)², q = e^{−x}): the eager chain's
    "no new noise" coin. ρ = e^{−(B−A)/D}·R(A, B)·R(A, B), three independent coins."""
    a = np.atleast_1d(np.asarray(low, dtype=np.int64))
    b = np.atleast_1d(np.asarray(high, dtype=np.int64))
    first = noise.bernoulli_exp_neg(b - a, _D)
    second = ratio_coins(noise, a, b)
    third = ratio_coins(noise, a, b)
    result: np.ndarray = first & second & third
    return result


# ----- eager path -------------------------------------------------------------------------------------------
def dlap_nr_path(noise: Noise, rates: Sequence[int], dim: int) -> IntArray:
    """The integer noise path, shape (k, dim), row t of rate rates[t] (non-decreasing: noisiest first).

    η_{k−1} ~ DLap(rate_{k−1}); η_t = η_{t+1} + [move]·DLap(rate_t), the move coin being NOT
    Bernoulli(c_{t+1}/c_t), independently per coordinate and level (the decomposition above).
    """
    m = np.asarray(rates, dtype=np.int64)
    k = m.size
    if k == 0 or bool(np.any(np.diff(m) < 0)):
        raise ValueError("rates must be a non-empty non-decreasing sequence")
    top = discrete_laplace_rates(noise, np.full(dim, m[-1], dtype=np.int64))
    if k == 1:
        return top[None, :]
    low = np.repeat(m[:-1], dim)
    high = np.repeat(m[1:], dim)
    moves = ~stay_coins(noise, low, high)
    increments = np.zeros(low.size, dtype=np.int64)
    moved = np.flatnonzero(moves)
    if moved.size:
        increments[moved] = discrete_laplace_rates(noise, low[moved])
    steps = increments.reshape(k - 1, dim)
    largest = max(int(np.max(np.abs(steps))), int(np.max(np.abs(top))))
    if largest * k >= 1 << 62:  # astronomically unlikely (scales ≤ 2^41 units): exact Python integers
        steps, top = steps.astype(object), top.astype(object)
    below = np.cumsum(steps[::-1], axis=0)[::-1]
    path: np.ndarray = np.vstack([top[None, :] + below, top[None, :]])
    return path


# ----- the lazy (reverse-time) kernel -----------------------------------------------------------------------
def _ceil_div(num: int, den: int) -> int:
    return -(-num // den)


def _move_rows(noise: Noise, magnitude: list[int], low: int, high: int) -> list[int]:
    """Per row, y from pmf ∝ T(y) = e^{−a|X−y| − b|y| + aX} (X = magnitude ≥ 0, a = low/D < b = high/D).

    T(−k) = e^{−(a+b)k} (k ≥ 1), T(y) = e^{−(b−a)y} (0 ≤ y ≤ X), T(X+k) = e^{−(b−a)X}e^{−(a+b)k} (k ≥ 1).
    Proposal, with L = ⌈1/(a+b)⌉, L₂ = ⌈1/(b−a)⌉, N₂ = min(X+1, L₂), M = 2L + N₂: a uniform u < M picks
    piece 1 (u < L), piece 3 (L ≤ u < 2L) or piece 2.
    * Tails (1, 3): k = 1 + U + L·V, U ~ Unif{0..L−1}, V ~ Geometric(e^{−1}): pmf (1 − e^{−1})e^{−V}/L;
      accept w.p. e^{−(a+b)(1+U) − ((a+b)L − 1)V} (× e^{−(b−a)X} for piece 3), which is ≤ 1 as (a+b)L ≥ 1.
      Joint: (1 − e^{−1})/M · T(y).
    * Middle (2), X + 1 ≤ L₂: y ~ Unif{0..X}; accept w.p. (1 − e^{−1})·e^{−(b−a)y}: (1 − e^{−1})/M · T(y).
    * Middle (2), X + 1 > L₂: y = U + L₂·V (U ~ Unif{0..L₂−1}, V ~ Geometric(e^{−1})), rejected if y > X,
      else accepted w.p. e^{−(b−a)U − ((b−a)L₂ − 1)V}: (1 − e^{−1})/M · T(y).
    Every accepted y therefore has probability ∝ T(y): the target, exactly. The acceptance rate is bounded
    below by a constant (≈ (1 − e^{−1})·Σ T / M, and Σ T ≥ c·M piecewise).
    """
    a, b = low, high
    tail = _ceil_div(_D, a + b)
    middle = _ceil_div(_D, b - a)
    n = len(magnitude)
    out: list[int] = [0] * n
    pending = list(range(n))
    while pending:
        xs = [magnitude[i] for i in pending]
        n2 = [min(x + 1, middle) for x in xs]
        total = np.array([2 * tail + c for c in n2], dtype=np.int64)
        u = noise.uniform_below(total)
        count = len(pending)
        is_tail = u < 2 * tail
        # tail proposals (drawn for every row; only tail rows use them)
        tu = noise.uniform_below(tail, count)
        tv = geometric_e1(noise, count)
        # middle proposals
        mu = noise.uniform_below(np.array([min(x + 1, middle) for x in xs], dtype=np.int64))
        mv = geometric_e1(noise, count)
        candidates: list[int] = []
        exponents: list[int] = []
        valid = np.ones(count, dtype=bool)
        extra = np.zeros(count, dtype=bool)  # rows needing the (1 − e^{−1}) coin
        for j in range(count):
            x = xs[j]
            if is_tail[j]:
                k = 1 + int(tu[j]) + tail * int(tv[j])
                exponent = (a + b) * (1 + int(tu[j])) + ((a + b) * tail - _D) * int(tv[j])
                if u[j] < tail:
                    candidates.append(-k)
                else:
                    candidates.append(x + k)
                    exponent += (b - a) * x
            elif x + 1 <= middle:
                y = int(mu[j])
                candidates.append(y)
                exponent = (b - a) * y
                extra[j] = True
            else:
                y = int(mu[j]) + middle * int(mv[j])
                candidates.append(y)
                valid[j] = y <= x
                exponent = (b - a) * int(mu[j]) + ((b - a) * middle - _D) * int(mv[j])
            exponents.append(exponent)
        accept = valid & exp_neg_coins(noise, np.array(exponents, dtype=object))
        if bool(extra.any()):
            rows = np.flatnonzero(extra)
            accept[rows] &= ~noise.bernoulli_exp_neg(np.ones(rows.size, dtype=np.int64), 1)
        still = []
        for j, row in enumerate(pending):
            if accept[j]:
                out[row] = candidates[j]
            else:
                still.append(row)
        pending = still
    return out


def dlap_nr_advance(noise: Noise, current: np.ndarray, low: int, high: int) -> IntArray:
    """One lazy step per coordinate: η_{t+1} given η_t = ``current`` (rates low = a·D ≤ high = b·D).

    Stay with probability e^{−(b−a)(1+|x|)}·R(2a, 2b) (= ρ·P_b(x)/P_a(x)); otherwise y from
    ∝ e^{−a|x−y| − b|y|} (``_move_rows`` on |x|, mirrored for x < 0). This is the reverse-time kernel of
    ``dlap_nr_path``'s chain, so the joint law of all levels is the same (tested against exact pmfs).
    """
    x = np.asarray(current, dtype=np.int64)
    if high < low or low < 1:
        raise ValueError("rates must satisfy 1 ≤ low ≤ high")
    if high == low:
        return x.copy()
    n = x.size
    magnitudes = [abs(int(v)) for v in x]
    first = exp_neg_coins(noise, np.array([(high - low) * (1 + m) for m in magnitudes], dtype=object))
    second = ratio_coins(noise, np.full(n, 2 * low, dtype=np.int64), np.full(n, 2 * high, dtype=np.int64))
    stay = first & second
    out = x.copy()
    movers = np.flatnonzero(~stay)
    if movers.size:
        drawn = _move_rows(noise, [magnitudes[i] for i in movers], low, high)
        signs = np.where(x[movers] < 0, -1, 1)
        out[movers] = signs * np.array(drawn, dtype=np.int64)
    return out


# ----- exact pmfs (for tests and documentation) -------------------------------------------------------------
def dlap_log_q(rate: int) -> float:
    """log q = −rate/D of a level (float; for public descriptions and tests only)."""
    return -rate / _D
