"""Exact samplers over a cryptographic bit source.

Every sampler here is integer arithmetic over uniform random words, so the pmf it draws from is the stated
one exactly (no floating-point rounding anywhere between the bits and the output):

* ``uniform_below(m)``: rejection from 63-bit words (accept u < ⌊2^63/m⌋·m, return u mod m).
* ``bernoulli_exp_neg(num, den)``: P = exp(−num/den) (Canonne, Kamath, Steinke 2020, Algorithm 1: for
  γ ∈ [0, 1] count the successes of Bernoulli(γ/k), k = 1, 2, …; odd means 1; γ > 1 is ⌊γ⌋ Bernoulli(e^{−1})
  and one Bernoulli(e^{−(γ−⌊γ⌋)})).
* ``discrete_laplace(s, r)``: P(z) ∝ exp(−|z|·r/s) (CKS 2020, Algorithm 2).
* ``discrete_gaussian(n, d)``: P(z) ∝ exp(−z²/(2σ²)) with σ² = n/d (CKS 2020, Algorithm 3).

Vectorised: each rejection stage is a NumPy round over the rows still pending (loops over rounds, never
over rows), with a pure-Python big-integer path for parameters whose products would overflow int64.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Callable
from fractions import Fraction

import numpy as np

_TWO63 = 1 << 63
_MAX_MODULUS = 1 << 62
_FAST_DENOMINATOR = 1 << 52
_BLOCK = 1 << 16
_POOL = 4096
_SMALL = 64  # batches up to this size take the scalar Python-integer path (NumPy rounds cost ~2 ms fixed)
_MAX_GEOMETRIC = 1 << 9  # V of CKS Algorithm 2 beyond this has probability < e^{-512}: refused, not wrapped

IntArray = np.ndarray


def _has_ties(sorted_keys: list[np.ndarray]) -> bool:
    """Whether two adjacent rows of lexicographically sorted digit columns are equal in every column."""
    equal = np.ones(sorted_keys[0].size - 1, dtype=bool)
    for column in sorted_keys:
        equal &= column[1:] == column[:-1]
    return bool(equal.any())


def _system_bytes(count: int) -> bytes:
    return os.urandom(count)


class _ShakeStream:
    """A deterministic SHAKE-256 stream keyed by a seed: for tests only (reproducible, still unbiased)."""

    def __init__(self, seed: int) -> None:
        self._key = seed.to_bytes(32, "big", signed=False)
        self._counter = 0

    def __call__(self, count: int) -> bytes:
        self._counter += 1
        return hashlib.shake_256(self._key + self._counter.to_bytes(16, "big")).digest(count)


class Noise:
    """The only source of randomness for a release. Build with ``Noise.system()`` (OS CSPRNG)."""

    def __init__(self, source: Callable[[int], bytes], block: int = _BLOCK, pool: int = _POOL) -> None:
        self._source = source
        self._block, self._pool_size = block, pool  # buffering only: every byte is used once, in order
        self._buffer = b""
        self._position = 0
        self._pool: list[int] = []

    def _bytes(self, count: int) -> bytes:
        """``count`` bytes of the stream, served from a buffer refilled in blocks of at least ``block``."""
        if self._position + count > len(self._buffer):
            self._buffer = self._buffer[self._position :] + self._source(max(count, self._block))
            self._position = 0
        chunk = self._buffer[self._position : self._position + count]
        self._position += count
        return chunk

    @classmethod
    def system(cls) -> Noise:
        """Bits from the operating system's CSPRNG (``os.urandom``): what the service uses, always. Small
        first buffers (512 bytes, 64 scalar words): a service request builds one per release and a scalar
        draw needs a dozen words, and ``os.urandom`` costs about its size (4 KiB: 24 µs, 512 B: 3 µs), so a
        scalar discrete Laplace draw costs 28 µs instead of 62 µs (4 KiB) and a 60-row draw 381 µs
        instead of 585 µs on the benchmark machine. Larger draws read what they need in one call."""
        return cls(_system_bytes, block=1 << 9, pool=64)

    @classmethod
    def seeded(cls, seed: int) -> Noise:
        """A reproducible stream for tests and benchmarks (SHAKE-256 in counter mode). Never in production:
        the service builds only ``Noise.system()`` and no request parameter reaches here."""
        if not 0 <= seed < 1 << 256:
            raise ValueError("seed must be an integer in [0, 2^256)")
        return cls(_ShakeStream(seed))

    # ----- raw bits -------------------------------------------------------------------------------------
    def words(self, count: int) -> np.ndarray:
        """``count`` uniform 64-bit words (uint64)."""
        if count <= 0:
            return np.zeros(0, dtype=np.uint64)
        return np.frombuffer(self._bytes(8 * count), dtype="<u8").astype(np.uint64)

    def _word(self) -> int:
        """One uniform 64-bit Python int, from a pool refilled ``pool`` words at a time (scalar paths)."""
        if not self._pool:
            self._pool = self.words(self._pool_size).tolist()
        return self._pool.pop()

    def random_bits(self, bits: int) -> int:
        """A uniform integer in [0, 2^bits)."""
        if bits <= 0:
            return 0
        value = 0
        while bits >= 64:
            value = (value << 64) | self._word()
            bits -= 64
        return (value << bits) | (self._word() >> (64 - bits)) if bits else value

    def randbelow(self, modulus: int) -> int:
        """A uniform integer in [0, modulus) for any positive Python int (rejection on bit length)."""
        if modulus <= 0:
            raise ValueError("modulus must be positive")
        bits = modulus.bit_length()
        if bits <= 64:
            shift = 64 - bits
            while True:
                candidate = self._word() >> shift
                if candidate < modulus:
                    return candidate
        while True:
            candidate = self.random_bits(bits)
            if candidate < modulus:
                return candidate

    # ----- uniform integers and Bernoulli ---------------------------------------------------------------
    def uniform_below(self, modulus: int | IntArray, size: int | None = None) -> IntArray:
        """Uniform integers in [0, m) per row (m ≤ 2^62, scalar or int64 array), exactly, as int64."""
        m = np.asarray(modulus, dtype=np.int64)
        if size is not None:
            m = np.broadcast_to(m, (size,))
        m = np.atleast_1d(m).astype(np.int64)
        if m.size and (int(m.min()) < 1 or int(m.max()) > _MAX_MODULUS):
            raise ValueError("uniform_below needs 1 ≤ m ≤ 2^62")
        m_u = m.astype(np.uint64)
        limit = (np.uint64(_TWO63) // m_u) * m_u
        u = self.words(m.size) >> np.uint64(1)
        out = (u % m_u).astype(np.int64)
        pending = np.flatnonzero(u >= limit)  # rejected (probability < m/2^63 each): redrawn in order
        while pending.size:
            u = self.words(pending.size) >> np.uint64(1)
            accept = u < limit[pending]
            out[pending[accept]] = (u[accept] % m_u[pending[accept]]).astype(np.int64)
            pending = pending[~accept]
        return out

    def bernoulli(self, probability: Fraction | float, size: int) -> np.ndarray:
        """Bernoulli(p) for an exact rational p ∈ [0, 1] (a float is read as its exact binary value)."""
        p = Fraction(probability)
        if not 0 <= p <= 1:
            raise ValueError("probability must be in [0, 1]")
        if p.denominator <= _MAX_MODULUS:
            result: np.ndarray = self.uniform_below(p.denominator, size) < p.numerator
            return result
        return np.array([self.randbelow(p.denominator) < p.numerator for _ in range(size)], dtype=bool)

    def fair_coins(self, size: int) -> np.ndarray:
        """Bernoulli(1/2) per row."""
        return (self.words(size) & np.uint64(1)).astype(bool)

    def bernoulli_exp_neg(self, numerator: IntArray, denominator: int | IntArray) -> np.ndarray:
        """Bernoulli(exp(−num/den)) per row; num ≥ 0 and 1 ≤ den ≤ 2^52 as int64 (CKS 2020, Algorithm 1)."""
        num = np.atleast_1d(np.asarray(numerator, dtype=np.int64))
        den = np.broadcast_to(np.asarray(denominator, dtype=np.int64), num.shape).astype(np.int64)
        if num.size and (int(num.min()) < 0 or int(den.min()) < 1 or int(den.max()) > _FAST_DENOMINATOR):
            raise ValueError("bernoulli_exp_neg needs num ≥ 0 and 1 ≤ den ≤ 2^52")
        whole, rest = np.divmod(num, den)
        return self._exp_neg_parts(whole, rest, den)

    def _exp_neg_parts(self, whole: IntArray, rest: IntArray, den: IntArray) -> np.ndarray:
        """exp(−(whole + rest/den)) = e^{−1}·…·e^{−1} (whole times) · e^{−rest/den}; rest < den ≤ 2^52."""
        result = self._exp_neg_fraction(rest, den)
        remaining = whole.astype(np.int64).copy()
        alive = np.flatnonzero(result & (remaining > 0))
        while alive.size > _SMALL:
            ones = np.ones(alive.size, dtype=np.int64)
            passed = self._exp_neg_fraction(ones, ones)
            result[alive[~passed]] = False
            remaining[alive] -= 1
            alive = alive[passed & (remaining[alive] > 0)]
        for i in alive:
            result[i] = all(self._exp_neg_big_fraction(1, 1) for _ in range(int(remaining[i])))
        return result

    def _exp_neg_fraction(self, rest: IntArray, den: IntArray) -> np.ndarray:
        """Bernoulli(exp(−γ)), γ = rest/den ∈ [0, 1]: K = 1; while Bernoulli(γ/K): K += 1; return K odd."""
        k = np.ones(rest.size, dtype=np.int64)
        pending = np.flatnonzero(rest > 0)
        while pending.size > _SMALL:
            if int(k[pending].max()) > 1 << 9:  # K beyond 512 has probability below 1/511!
                raise OverflowError("Bernoulli(exp(−γ)) ran past its int64 range")
            success = self.uniform_below(den[pending] * k[pending]) < rest[pending]
            k[pending[success]] += 1
            pending = pending[success]
        for i in pending:
            k[i] = self._exp_neg_count(int(rest[i]), int(den[i]), int(k[i]))
        odd: np.ndarray = (k % 2) == 1
        return odd

    # ----- discrete Laplace -----------------------------------------------------------------------------
    def discrete_laplace(self, scale: Fraction, size: int) -> IntArray:
        """``size`` draws of P(z) ∝ exp(−|z|/t), t = ``scale`` > 0 rational (CKS 2020, Algorithm 2).

        With t = s/r: U ~ Unif{0..s−1} kept w.p. e^{−U/s}; V ~ Geometric(1 − e^{−1}); Y = ⌊(U + sV)/r⌋;
        a fair sign B, rejecting (B = 1, Y = 0). The vectorised path needs s ≤ 2^52.
        """
        t = Fraction(scale)
        if t <= 0:
            raise ValueError("the discrete Laplace scale must be > 0")
        s, r = t.numerator, t.denominator
        if s > _FAST_DENOMINATOR or r > _MAX_MODULUS:
            return np.array([self._discrete_laplace_big(s, r) for _ in range(size)], dtype=object)
        out = np.empty(size, dtype=np.int64)
        pending = np.arange(size)
        while pending.size > _SMALL:
            count = pending.size
            u = self.uniform_below(s, count)
            keep = self.bernoulli_exp_neg(u, s)
            v = self._geometric_exp_neg_one(count)
            y = (u + s * v) // r
            negative = self.fair_coins(count)
            accept = keep & ~(negative & (y == 0))
            out[pending[accept]] = np.where(negative, -y, y)[accept]
            pending = pending[~accept]
        for i in pending:
            out[i] = self._discrete_laplace_big(s, r)
        return out

    def _geometric_exp_neg_one(self, count: int) -> IntArray:
        """The number of successes of Bernoulli(e^{−1}) before the first failure, per row."""
        v = np.zeros(count, dtype=np.int64)
        alive = np.arange(count)
        while alive.size > _SMALL:
            ones = np.ones(alive.size, dtype=np.int64)
            passed = self._exp_neg_fraction(ones, ones)
            v[alive[passed]] += 1
            alive = alive[passed]
        for i in alive:
            while self._exp_neg_big_fraction(1, 1):
                v[i] += 1
        if count and int(v.max()) > _MAX_GEOMETRIC:
            raise OverflowError("geometric draw beyond 2^9 (probability < e^-512)")
        return v

    def _exp_neg_big(self, num: int, den: int) -> bool:
        """Bernoulli(exp(−num/den)) for Python ints of any size (CKS 2020, Algorithm 1)."""
        whole, rest = divmod(num, den)
        for _ in range(whole):
            if not self._exp_neg_big_fraction(1, 1):
                return False
        return self._exp_neg_big_fraction(rest, den)

    def _exp_neg_big_fraction(self, rest: int, den: int) -> bool:
        return self._exp_neg_count(rest, den, 1) % 2 == 1

    def _exp_neg_count(self, rest: int, den: int, k: int) -> int:
        """CKS Algorithm 1's counter K, continued from ``k``: K += 1 while Bernoulli(γ/K) succeeds."""
        while self.randbelow(den * k) < rest:
            k += 1
        return k

    def _discrete_laplace_big(self, s: int, r: int) -> int:
        while True:
            u = self.randbelow(s)
            if not self._exp_neg_big(u, s):
                continue
            v = 0
            while self._exp_neg_big_fraction(1, 1):
                v += 1
            y = (u + s * v) // r
            negative = self.randbelow(2) == 1
            if negative and y == 0:
                continue
            return -y if negative else y

    # ----- discrete Gaussian ----------------------------------------------------------------------------
    def discrete_gaussian(self, variance: Fraction, size: int) -> IntArray:
        """``size`` draws of P(z) ∝ exp(−z²/(2σ²)), σ² = ``variance`` > 0 rational (CKS 2020, Algorithm 3).

        t = ⌊σ⌋ + 1; Y ~ DLap(t); accept with probability exp(−(|Y| − σ²/t)²/(2σ²)). With σ² = n/d the
        exponent is (|Y|·d·t − n)²/(2·n·d·t²): int64 when that denominator is ≤ 2^52 and |Y|·d·t + n < 2^31,
        Python integers for the (rare) rows or parameters beyond.
        """
        var = Fraction(variance)
        if var <= 0:
            raise ValueError("the discrete Gaussian variance must be > 0")
        n, d = var.numerator, var.denominator
        t = math.isqrt(n // d) + 1
        den = 2 * n * d * t * t
        if den > _FAST_DENOMINATOR:
            return np.array([self._discrete_gaussian_big(n, d, t) for _ in range(size)], dtype=object)
        out = np.empty(size, dtype=np.int64)
        pending = np.arange(size)
        while pending.size > _SMALL:
            y = self.discrete_laplace(Fraction(t), pending.size).astype(np.int64)
            accept = np.zeros(pending.size, dtype=bool)
            fast = np.abs(y) < max(0, (1 << 31) - n) // (d * t)
            w = np.abs(y[fast]) * d * t - n
            accept[fast] = self.bernoulli_exp_neg(w * w, den)
            for i in np.flatnonzero(~fast):
                w_big = abs(int(y[i])) * d * t - n
                accept[i] = self._exp_neg_big(w_big * w_big, den)
            out[pending[accept]] = y[accept]
            pending = pending[~accept]
        for i in pending:
            out[i] = self._discrete_gaussian_big(n, d, t)
        return out

    def _discrete_gaussian_big(self, n: int, d: int, t: int) -> int:
        den = 2 * n * d * t * t
        while True:
            y = self._discrete_laplace_big(t, 1)
            w = abs(y) * d * t - n
            if self._exp_neg_big(w * w, den):
                return y

    # ----- data-independent helpers ---------------------------------------------------------------------
    def permutation(self, n: int) -> IntArray:
        """A uniform random permutation of range(n), exactly: the order that sorts n i.i.d. uniform reals
        K_i ∈ [0, 1), revealed 32 bits at a time. The 32-bit prefixes are sorted; while two of
        them tie (probability ≤ n²/2^33 per round), 32 more bits of every key are revealed and the keys are
        sorted by their whole prefixes. The result is the sort order of the reals themselves (distinct with
        probability one), which is uniform by exchangeability; the data-split proofs need only that it is
        independent of the data."""
        keys = [self._key_digits(n)]
        order: np.ndarray = np.argsort(keys[0])  # any sort: ties are resolved below, not by the sort
        while n > 1 and _has_ties([k[order] for k in keys]):
            keys.append(self._key_digits(n))
            order = np.lexsort(keys[::-1])
        return order

    def _key_digits(self, n: int) -> np.ndarray:
        """n uniform 32-bit digits (uint32)."""
        return np.frombuffer(self._bytes(4 * n), dtype="<u4").astype(np.uint32)

    def unit_floats(self, size: int | tuple[int, ...]) -> np.ndarray:
        """Uniform multiples of 2^-53 in [0, 1): only for data-independent choices whose distribution the
        privacy proof does not depend on (initialisations, tie-breaks); never added to a released value."""
        shape = (size,) if isinstance(size, int) else size
        count = int(np.prod(shape))
        bits = self.words(count) >> np.uint64(11)
        result: np.ndarray = (bits.astype(np.float64) * 2.0**-53).reshape(shape)
        return result
