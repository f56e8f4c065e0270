"""Distribution tests of the exact samplers and of the noise the query mechanisms add (DESIGN §7).

Every sampler of ``mechanisms.noise.Noise`` used by the query families is tested by chi-square against its
exact pmf (computed in closed form or by exact summation), with fixed seeds and a false-alarm rate of
ALPHA = 1e-4 per test; the same draws must reject a 30%-wrong parameter (power check). The big-integer
path of the discrete Laplace and Gaussian samplers (parameters whose products leave int64) is tested too.
The mechanism-level tests take release − round(truth/γ), in grid units, over many releases and test it
against the discrete law the release says it used (``noise`` in the output).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from fractions import Fraction
from typing import Any

import numpy as np
import pytest
from scipy import stats

from mechanisms.accounting import DEFAULT_ORDERS
from mechanisms.base import Mechanism, PublicContext
from mechanisms.data.schema import DatasetSchema
from mechanisms.noise import Noise
from mechanisms.queries.gaussian import Gaussian
from mechanisms.queries.language import evaluate_units, plan_grid
from mechanisms.queries.laplace import Laplace

pytestmark = pytest.mark.statistical

ALPHA = 1e-4
SEED = 12345
BINS = 10_000

Cdf = Callable[[np.ndarray], np.ndarray]
"""P(Z ≤ z) at integer z, exact."""


# ----- exact laws -------------------------------------------------------------------------------------
def dlap_cdf(scale: Fraction | float) -> Cdf:
    """Discrete Laplace P(z) ∝ e^{−|z|/t}: P(Z ≤ z) = q^{−z}/(1+q) for z ≤ −1, else 1 − q^{z+1}/(1+q)."""
    q = math.exp(-1 / float(scale))

    def cdf(z: np.ndarray) -> np.ndarray:
        z = np.asarray(z, dtype=float)
        with np.errstate(over="ignore", under="ignore"):
            low = np.exp(-z * math.log(q)) / (1 + q)
            high = 1 - np.exp((z + 1) * math.log(q)) / (1 + q)
        result: np.ndarray = np.where(z <= -1, low, high)
        return result

    return cdf


def dgauss_cdf(variance: Fraction | float) -> Cdf:
    """Discrete Gaussian P(z) ∝ e^{−z²/(2σ²)}: cumulative sums over |z| ≤ 40σ + 10 (the rest < e^{−800})."""
    var = float(variance)
    reach = int(40 * math.sqrt(var)) + 10
    support = np.arange(-reach, reach + 1)
    weights = np.exp(-(support.astype(float) ** 2) / (2 * var))
    cumulative = np.cumsum(weights) / weights.sum()

    def cdf(z: np.ndarray) -> np.ndarray:
        index = np.clip(np.asarray(z, dtype=np.int64) + reach, -1, 2 * reach)
        result: np.ndarray = np.where(index < 0, 0.0, cumulative[np.maximum(index, 0)])
        return result

    return cdf


def geometric_cdf(rate: float) -> Cdf:
    def cdf(z: np.ndarray) -> np.ndarray:
        z = np.asarray(z, dtype=float)
        result: np.ndarray = np.where(z < 0, 0.0, -np.expm1(-rate * (z + 1)))
        return result

    return cdf


def chi_square_p(draws: np.ndarray, cdf: Cdf, edges: np.ndarray) -> float:
    """p-value of the draws binned at integer ``edges`` (bins (−∞, e₀], (e₀, e₁], …, (e_last, ∞))."""
    edges = np.unique(np.asarray(edges, dtype=np.int64))
    values = np.asarray(draws, dtype=np.int64)
    observed = np.bincount(np.searchsorted(edges, values, side="left"), minlength=edges.size + 1)
    cumulative = np.concatenate([[0.0], cdf(edges), [1.0]])
    expected = np.diff(cumulative) * values.size
    keep = expected > 0
    assert observed[~keep].sum() == 0, "a draw fell where the law has no mass"
    expected = expected[keep] * observed[keep].sum() / expected[keep].sum()  # float rounding of the total
    return float(stats.chisquare(observed[keep], expected).pvalue)


def symmetric_edges(spread: float, count: int = 40) -> np.ndarray:
    return np.unique(np.round(np.linspace(-spread, spread, count)).astype(np.int64))


# ----- the samplers -----------------------------------------------------------------------------------
@pytest.mark.parametrize("modulus", [7, 1000, 3 * 2**60])
def test_uniform_below(modulus: int) -> None:
    draws = Noise.seeded(SEED).uniform_below(modulus, 60_000)
    assert draws.dtype == np.int64
    assert 0 <= int(draws.min())
    assert int(draws.max()) < modulus
    buckets = min(modulus, 32)
    index = (draws.astype(object) * buckets // modulus).astype(np.int64)  # exact bucket of each draw
    edges = [math.ceil(Fraction(modulus * (b + 1), buckets)) for b in range(buckets)]
    probabilities = np.diff([0, *edges]) / modulus
    assert stats.chisquare(np.bincount(index, minlength=buckets), probabilities * draws.size).pvalue > ALPHA
    skewed = probabilities * np.linspace(0.7, 1.3, buckets)  # power: a 30% tilt
    skewed = skewed / skewed.sum()
    assert stats.chisquare(np.bincount(index, minlength=buckets), skewed * draws.size).pvalue < ALPHA


@pytest.mark.parametrize("probability", [Fraction(1, 3), Fraction(5, 7), Fraction(1, 2**70 + 1)])
def test_bernoulli(probability: Fraction) -> None:
    n = 200_000 if probability.denominator < 2**62 else 2_000
    draws = Noise.seeded(SEED).bernoulli(probability, n)
    p = float(probability)
    assert stats.binomtest(int(draws.sum()), n, p).pvalue > ALPHA
    if p > 0.01:
        assert stats.binomtest(int(draws.sum()), n, 0.7 * p).pvalue < ALPHA


@pytest.mark.parametrize(("numerator", "denominator"), [(3, 7), (5, 2), (0, 1), (1, 2**40), (40, 3)])
def test_bernoulli_exp_neg(numerator: int, denominator: int) -> None:
    n = 200_000
    draws = Noise.seeded(SEED).bernoulli_exp_neg(np.full(n, numerator, dtype=np.int64), denominator)
    p = math.exp(-numerator / denominator)
    assert stats.binomtest(int(draws.sum()), n, p).pvalue > ALPHA
    if 0.05 < p < 0.95:
        wrong = math.exp(-1.3 * numerator / denominator)
        assert stats.binomtest(int(draws.sum()), n, wrong).pvalue < ALPHA


@pytest.mark.parametrize(
    ("scale", "size"),
    [
        (Fraction(1, 2), 100_000),
        (Fraction(3), 100_000),
        (Fraction(7, 3), 100_000),
        (Fraction(3202), 100_000),
        (Fraction(2**53 + 1, 2**50), 20_000),  # numerator > 2^52: the Python big-integer path
    ],
)
def test_discrete_laplace(scale: Fraction, size: int) -> None:
    draws = Noise.seeded(SEED).discrete_laplace(scale, size)
    if scale.numerator > 2**52:
        assert draws.dtype == object
    draws = draws.astype(np.int64)
    edges = symmetric_edges(6 * float(scale) + 3)
    assert chi_square_p(draws, dlap_cdf(scale), edges) > ALPHA
    for wrong in (0.7, 1.3):
        assert chi_square_p(draws, dlap_cdf(float(scale) * wrong), edges) < ALPHA


@pytest.mark.parametrize(
    ("variance", "size"),
    [
        (Fraction(1, 4), 100_000),
        (Fraction(9), 100_000),
        (Fraction(7, 3), 100_000),
        (Fraction(4_194_304), 100_000),
        (Fraction(2**26), 20_000),  # 2·σ²·t² > 2^52: the Python big-integer path
    ],
)
def test_discrete_gaussian(variance: Fraction, size: int) -> None:
    draws = Noise.seeded(SEED).discrete_gaussian(variance, size)
    if variance == 2**26:
        assert draws.dtype == object
    draws = draws.astype(np.int64)
    sigma = math.sqrt(float(variance))
    edges = symmetric_edges(4 * sigma + 2)
    assert chi_square_p(draws, dgauss_cdf(variance), edges) > ALPHA
    for wrong in (0.7, 1.3):  # σ 30% off
        assert chi_square_p(draws, dgauss_cdf(float(variance) * wrong**2), edges) < ALPHA


def test_geometric_fold_of_the_discrete_laplace() -> None:
    """The AboveThreshold geometric draw (folded discrete Laplace) has the exact Geom_{e^{−1/t}} law."""
    from mechanisms.threshold.above_threshold import geometric_array, geometric_scale

    draws = geometric_array(Noise.seeded(SEED), 0.3, 100_000)
    rate = float(1 / geometric_scale(0.3))
    edges = np.arange(0, 40)
    assert chi_square_p(draws, geometric_cdf(rate), edges) > ALPHA
    for wrong in (0.7, 1.3):
        assert chi_square_p(draws, geometric_cdf(rate * wrong), edges) < ALPHA


def test_permutation_is_uniform() -> None:
    """``Noise.permutation`` (the data split): the 24 orders of 4 items are equally likely (χ², FA 1e-4).
    Power: the same test rejects sorting by short keys with ties left in index order (the bias the tie
    rule of ``permutation`` removes). A size where 32-bit keys tie (n = 300 000: ~10 tied pairs expected)
    still yields a permutation (the tie path)."""
    noise, draws = Noise.seeded(SEED), 48_000

    def p_value(orders: list[np.ndarray]) -> float:
        codes = [sum(int(v) * 4**i for i, v in enumerate(order)) for order in orders]
        observed = np.unique(codes, return_counts=True)[1]
        return float(stats.chisquare(np.append(observed, np.zeros(24 - observed.size))).pvalue)

    assert p_value([noise.permutation(4) for _ in range(draws)]) > ALPHA
    tied = [np.argsort(noise.uniform_below(8, 4), kind="stable") for _ in range(draws)]
    assert p_value(tied) < ALPHA
    big = noise.permutation(300_000)
    assert np.array_equal(np.sort(big), np.arange(300_000))


# ----- the noise of the query mechanisms --------------------------------------------------------------
def _context(neighboring: str) -> PublicContext:
    schema = DatasetSchema.model_validate(
        {
            "columns": [
                {"name": "k", "type": "int", "min": 0, "max": BINS - 1},
                {"name": "x", "type": "float", "min": -1.0, "max": 3.0},
            ],
            "neighboring": neighboring,
        }
    )
    return PublicContext(schema, 3_000 if neighboring == "replace_one" else None, DEFAULT_ORDERS)


def _table() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(SEED)  # test data only
    return {"k": rng.integers(0, BINS, size=3_000), "x": rng.uniform(-1.0, 3.0, size=3_000)}


def _noise_units(
    mechanism: Mechanism, params: dict[str, Any], neighboring: str, runs: int
) -> tuple[np.ndarray, dict[str, Any]]:
    """release/γ − round(truth/γ) over ``runs`` releases (grid units), and the first release's noise spec."""
    ctx = _context(neighboring)
    table = _table()
    model: Any = mechanism.params_model.model_validate(params)
    mechanism.check(model, ctx)
    noise = Noise.seeded(SEED)
    releases = [mechanism.run(model, ctx, table, noise).output for _ in range(runs)]
    spec = releases[0]["noise"]
    plan = plan_grid(model.query, ctx, 0.0)
    assert plan.grid.granularity == spec["granularity"]
    truth, _ = evaluate_units(model.query, ctx, table, plan)
    collected = []
    for release in releases:
        values = [release["value"]] if "value" in release else list(release["values"].values())
        units = np.array([v / spec["granularity"] for v in values])
        assert np.all(units == np.round(units))  # every released number is a grid multiple
        collected.append(units.astype(np.int64) - truth)
    return np.concatenate(collected), spec


@pytest.mark.parametrize(("neighboring", "expected_scale"), [("add_remove", 2.0), ("replace_one", 4.0)])
def test_laplace_histogram_noise(neighboring: str, expected_scale: float) -> None:
    draws, spec = _noise_units(
        Laplace(), {"query": {"kind": "histogram", "column": "k"}, "epsilon": 0.5}, neighboring, runs=2
    )
    assert draws.size == 2 * BINS
    assert spec["distribution"] == "discrete_laplace"
    assert spec["scale"] == spec["scale_units"] == expected_scale
    edges = symmetric_edges(6 * expected_scale + 3)
    assert chi_square_p(draws, dlap_cdf(expected_scale), edges) > ALPHA
    for wrong in (0.7, 1.3):
        assert chi_square_p(draws, dlap_cdf(expected_scale * wrong), edges) < ALPHA


def test_gaussian_histogram_noise() -> None:
    draws, spec = _noise_units(
        Gaussian(), {"query": {"kind": "histogram", "column": "k"}, "sigma": 2.5}, "add_remove", runs=2
    )
    assert spec["distribution"] == "discrete_gaussian"
    assert spec["variance_units"] == 6.25
    edges = symmetric_edges(12)
    assert chi_square_p(draws, dgauss_cdf(6.25), edges) > ALPHA
    for wrong in (0.7, 1.3):
        assert chi_square_p(draws, dgauss_cdf(6.25 * wrong**2), edges) < ALPHA


def test_laplace_scalar_noise() -> None:
    """Mean of x over 3000 rows: Δ₁ = 4/3000, ε = 0.1; γ = 2^-20 and t = ⌈M/ε⌉ in grid units."""
    draws, spec = _noise_units(
        Laplace(), {"query": {"kind": "mean", "column": "x"}, "epsilon": 0.1}, "replace_one", runs=4_000
    )
    assert spec["scale"] >= 4.0 / 300.0
    assert spec["scale"] == pytest.approx(4.0 / 300.0, rel=2e-3)
    t = spec["scale_units"]
    edges = symmetric_edges(6 * t)
    assert chi_square_p(draws, dlap_cdf(t), edges) > ALPHA
    for wrong in (0.7, 1.3):
        assert chi_square_p(draws, dlap_cdf(t * wrong), edges) < ALPHA


def test_gaussian_scalar_noise() -> None:
    draws, spec = _noise_units(
        Gaussian(), {"query": {"kind": "sum", "column": "x"}, "sigma": 7.0}, "replace_one", runs=4_000
    )
    assert spec["sigma"] == 7.0
    variance = spec["variance_units"]
    assert variance >= (7.0 / spec["granularity"]) ** 2
    edges = symmetric_edges(4 * math.sqrt(variance))
    assert chi_square_p(draws, dgauss_cdf(variance), edges) > ALPHA
    for wrong in (0.7, 1.3):
        assert chi_square_p(draws, dgauss_cdf(variance * wrong**2), edges) < ALPHA
