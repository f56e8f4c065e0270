"""Distribution tests of the Laplace and Gaussian noise (DESIGN §7).

The noise of a release (released minus true value) is tested with Kolmogorov–Smirnov against the declared
distribution at a false-alarm rate of 1e-6 with fixed seeds, and the same test must reject a scale that is
30% off in either direction (power check).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from scipy import stats

from mechanisms.accounting import DEFAULT_ORDERS
from mechanisms.base import Mechanism, PublicContext
from mechanisms.gaussian import Gaussian
from mechanisms.laplace import Laplace
from mechanisms.queries import evaluate
from mechanisms.schema import DatasetSchema

pytestmark = pytest.mark.statistical

ALPHA = 1e-6
BINS = 10_000
RUNS = 2
SEED = 12345


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
    rng = np.random.default_rng(SEED)
    return {"k": rng.integers(0, BINS, size=3_000), "x": rng.uniform(-1.0, 3.0, size=3_000)}


def _histogram_noise(
    mechanism: Mechanism, params: dict[str, Any], neighboring: str
) -> tuple[np.ndarray, dict[str, Any]]:
    ctx = _context(neighboring)
    table = _table()
    model: Any = mechanism.params_model.model_validate(params)
    mechanism.check(model, ctx)
    truth, _ = evaluate(model.query, ctx, table)
    rng = np.random.default_rng(SEED)
    releases = [mechanism.run(model, ctx, table, rng).output for _ in range(RUNS)]
    noise = np.concatenate([np.fromiter(r["values"].values(), float) - truth for r in releases])
    return noise, releases[0]["noise"]


def _scalar_noise(
    mechanism: Mechanism, params: dict[str, Any], draws: int
) -> tuple[np.ndarray, dict[str, Any]]:
    ctx = _context("replace_one")
    table = _table()
    model: Any = mechanism.params_model.model_validate(params)
    mechanism.check(model, ctx)
    truth = evaluate(model.query, ctx, table)[0][0]
    rng = np.random.default_rng(SEED)
    releases = [mechanism.run(model, ctx, table, rng).output for _ in range(draws)]
    return np.array([r["value"] for r in releases]) - truth, releases[0]["noise"]


def _assert_fits_and_power(noise: np.ndarray, distribution: Any, scale: float) -> None:
    assert stats.kstest(noise, distribution(loc=0.0, scale=scale).cdf).pvalue > ALPHA
    for wrong in (0.7 * scale, 1.3 * scale):
        assert stats.kstest(noise, distribution(loc=0.0, scale=wrong).cdf).pvalue < ALPHA
    assert stats.kstest(noise + 0.3 * scale, distribution(loc=0.0, scale=scale).cdf).pvalue < ALPHA


@pytest.mark.parametrize(("neighboring", "expected_scale"), [("add_remove", 2.0), ("replace_one", 4.0)])
def test_laplace_histogram_noise(neighboring: str, expected_scale: float) -> None:
    noise, spec = _histogram_noise(
        Laplace(), {"query": {"kind": "histogram", "column": "k"}, "epsilon": 0.5}, neighboring
    )
    assert noise.size == RUNS * BINS
    assert spec["distribution"] == "laplace"
    assert spec["scale"] == pytest.approx(expected_scale, rel=1e-14)
    _assert_fits_and_power(noise, stats.laplace, spec["scale"])


def test_gaussian_histogram_noise() -> None:
    noise, spec = _histogram_noise(
        Gaussian(), {"query": {"kind": "histogram", "column": "k"}, "sigma": 2.5}, "add_remove"
    )
    assert spec == {"distribution": "gaussian", "sigma": 2.5}
    _assert_fits_and_power(noise, stats.norm, 2.5)


def test_laplace_scalar_noise() -> None:
    # Mean of x over 3000 rows: Δ₁ = 4/3000, ε = 0.1, so the scale is 4/300.
    noise, spec = _scalar_noise(Laplace(), {"query": {"kind": "mean", "column": "x"}, "epsilon": 0.1}, 5_000)
    assert spec["scale"] == pytest.approx(4.0 / 300.0, rel=1e-12)
    _assert_fits_and_power(noise, stats.laplace, spec["scale"])


def test_gaussian_scalar_noise() -> None:
    noise, spec = _scalar_noise(Gaussian(), {"query": {"kind": "sum", "column": "x"}, "sigma": 7.0}, 5_000)
    assert spec["sigma"] == 7.0
    _assert_fits_and_power(noise, stats.norm, 7.0)
