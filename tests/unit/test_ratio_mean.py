"""Issue 35 item 9: a mean whose selection size is private (add/remove, or a ``where``) is released as a
noisy sum over a noisy count instead of being refused (mechanisms/queries/ratio_mean.py): charged exactly
the requested ε (Laplace) or a count at σ/√2 (Gaussian), with an interval that covers the true mean at
its level, clamped to the column's bounds."""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import numpy as np
import pytest

from mechanisms.accounting import DEFAULT_ORDERS, RdpCurve, UnitsVector
from mechanisms.base import ParamsError, PublicContext
from mechanisms.data.schema import DatasetSchema
from mechanisms.noise import Noise
from mechanisms.queries.gaussian import Gaussian, GaussianParams
from mechanisms.queries.language import charged_fraction
from mechanisms.queries.laplace import Laplace, LaplaceParams
from mechanisms.queries.ratio_mean import half_epsilon

SCHEMA = {
    "columns": [
        {"name": "x", "type": "float", "min": 0, "max": 100},
        {"name": "g", "type": "int", "min": 0, "max": 3},
    ],
    "neighboring": "add_remove",
}
CTX = PublicContext(DatasetSchema.model_validate(SCHEMA), None, DEFAULT_ORDERS)
RNG = np.random.default_rng(35)
TABLE = {"x": RNG.uniform(0, 100, 4000), "g": RNG.integers(0, 4, 4000)}
SELECTED = TABLE["x"][TABLE["g"] == 1]


def mean_query(**extra: Any) -> dict[str, Any]:
    return {"kind": "mean", "column": "x", "where": [{"column": "g", "op": "eq", "value": 1}], **extra}


@pytest.mark.parametrize("epsilon", [0.1, 0.3, 1.0, 2.5, 7.0 / 3.0])
def test_laplace_charges_exactly_the_requested_epsilon(epsilon: float) -> None:
    params = LaplaceParams.model_validate({"query": mean_query(), "epsilon": epsilon})
    worst = Laplace().worst_case(params, CTX)
    assert worst.pure == epsilon
    assert all(v <= epsilon for v in worst.values)
    charge = UnitsVector.charge(worst)
    assert charge.finite[-1] == UnitsVector.charge(RdpCurve.from_pure(epsilon, DEFAULT_ORDERS)).finite[-1]
    half = half_epsilon(epsilon)
    assert 2 * charged_fraction(half) <= charged_fraction(epsilon)  # the two parts stay within ε
    assert half <= epsilon / 2
    assert Fraction(half) > Fraction(epsilon / 2) * (1 - Fraction(1, 2**50))


def test_gaussian_costs_a_count_at_sigma_over_root_two() -> None:
    params = GaussianParams.model_validate({"query": mean_query(), "sigma": 4.0})
    worst = Gaussian().worst_case(params, CTX)
    expected = RdpCurve.gaussian(1.0, 4.0 / np.sqrt(2.0), DEFAULT_ORDERS)
    # the real sum's grid adds one rounding unit to its shift (Δ/γ + 1, γ ≤ 2^-10·Δ): at most 0.1 % more
    assert all(e <= v <= e * 1.001 for v, e in zip(worst.values, expected.values, strict=True))
    assert worst.pure == np.inf


def test_the_release_is_the_ratio_of_its_parts_and_carries_both_noises() -> None:
    params = LaplaceParams.model_validate({"query": mean_query(), "epsilon": 1.0})
    release = Laplace().run(params, CTX, TABLE, Noise.seeded(1))
    out = release.output
    assert out["value"] == pytest.approx(out["parts"]["sum"] / out["parts"]["count"])
    assert set(out["noise"]) == {"sum", "count"}
    assert abs(out["value"] - SELECTED.mean()) < 2.0
    assert release.realized.pure == 1.0


@pytest.mark.parametrize("mechanism", ["laplace", "gaussian"])
def test_the_interval_covers_the_true_mean_at_its_level(mechanism: str) -> None:
    """Coverage over 400 seeded releases: at level 0.9 the union bound guarantees ≥ 0.9; the number of
    misses is Binomial(400, ≤ 0.1), so more than 58 misses has probability < 1e-3 (false alarm)."""
    level, runs = 0.9, 400
    if mechanism == "laplace":
        run = Laplace().run
        params: Any = LaplaceParams.model_validate(
            {"query": mean_query(), "epsilon": 0.05, "confidence": level}
        )
    else:
        run = Gaussian().run  # type: ignore[assignment]
        params = GaussianParams.model_validate({"query": mean_query(), "sigma": 40.0, "confidence": level})
    misses, widths = 0, []
    for seed in range(runs):
        out = run(params, CTX, TABLE, Noise.seeded(seed)).output
        interval = out["interval"]
        misses += not interval["lower"] <= SELECTED.mean() <= interval["upper"]
        widths.append(interval["upper"] - interval["lower"])
    assert misses <= 58
    assert 0 < np.median(widths) < 100  # informative: narrower than the column's range


def test_power_a_narrowed_interval_misses_often() -> None:
    """The coverage check can fail: shrinking each interval to a quarter of its width misses far more than
    10 % (the union-bound interval is conservative, so halving it is not enough to show it)."""
    params = LaplaceParams.model_validate({"query": mean_query(), "epsilon": 0.05, "confidence": 0.9})
    misses = 0
    for seed in range(200):
        interval = Laplace().run(params, CTX, TABLE, Noise.seeded(seed)).output["interval"]
        middle = (interval["lower"] + interval["upper"]) / 2
        half = (interval["upper"] - interval["lower"]) / 8
        misses += not middle - half <= SELECTED.mean() <= middle + half
    assert misses > 30


def test_a_count_at_or_below_zero_releases_no_mean() -> None:
    tiny = {"x": np.array([50.0]), "g": np.array([1])}
    params = LaplaceParams.model_validate({"query": mean_query(), "epsilon": 0.01})
    outputs = [Laplace().run(params, CTX, tiny, Noise.seeded(seed)).output for seed in range(40)]
    empty = [o for o in outputs if o["parts"]["count"] <= 0]
    assert empty, "some noisy counts of one row at ε = 0.01 are ≤ 0"
    assert all(o["value"] is None and o["warnings"] for o in empty)
    assert all(0 <= o["value"] <= 100 for o in outputs if o["value"] is not None)  # clamped to the bounds
    assert all(o["interval"]["lower"] >= 0 and o["interval"]["upper"] <= 100 for o in outputs)


def test_individual_datasets_still_refuse_a_mean() -> None:
    schema = {**SCHEMA, "columns": [*SCHEMA["columns"], {"name": "u", "type": "int", "min": 0, "max": 9}]}
    individual = {**schema, "privacy_unit": {"column": "u", "max_rows": 1}, "accounting": "individual"}
    ctx = PublicContext(DatasetSchema.model_validate(individual), None, DEFAULT_ORDERS)
    params = LaplaceParams.model_validate({"query": mean_query(), "epsilon": 1.0})
    with pytest.raises(ParamsError, match="no individual analysis"):
        Laplace().check(params, ctx)
