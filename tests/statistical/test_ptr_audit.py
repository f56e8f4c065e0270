"""Monte Carlo audit of ``ptr.ops_linear`` on a neighbouring pair (docs/mechanisms/ptr.md §5).

Pair: 40 rows (x = 0.5, y = 0) versus the same plus the outlier (x = 1, y = 1), λ = 1 (the added row has
the largest residual and leverage the bounds allow). Events: ⊥ and 20 quantile bins of the released
coefficient, chosen on one half of the samples and evaluated on the other half (so the estimate is unbiased
for the chosen event); the lower 4.5-sigma confidence bound of P(S) − e^ε·P′(S) must not exceed the charged δ.
The broken variant (one-sided margins dropped) is caught by the coverage of its released bounds, which fails
about half the time instead of ≤ δ′.
"""

from __future__ import annotations

import math

import numpy as np

from mechanisms.learners.features import FeatureSpec
from mechanisms.noise import Noise
from mechanisms.ptr.ops_linear import OpsLinearParams, ops_release, plan

X = np.full((40, 1), 0.5)
Y = np.zeros(40)
X2 = np.vstack([X, [[1.0]]])
Y2 = np.concatenate([Y, [1.0]])
PARAMS = OpsLinearParams(
    features=FeatureSpec(features=("x",), label="y"), lam=1.0, epsilon=6.0, delta=0.009, test_fraction=0.6
)
N = 800


def _samples(x: np.ndarray, y: np.ndarray, seed: int, broken: bool = False) -> np.ndarray:
    pl = plan(PARAMS, 1, "add_remove")
    noise = Noise.seeded(seed)
    outs = (ops_release(pl, x, y, noise, drop_margins=broken) for _ in range(N))
    return np.array([o["coefficients"][0] if o["released"] else np.nan for o in outs])


def _cells(s: np.ndarray, edges: np.ndarray) -> np.ndarray:
    released = s[~np.isnan(s)]
    return np.concatenate([[np.isnan(s).sum()], np.histogram(released, bins=edges)[0]]) / s.size


def _lower_bound(a: np.ndarray, b: np.ndarray, eps: float) -> float:
    half = a.size // 2
    pooled = np.concatenate([a[:half], b[:half]])
    pooled = pooled[~np.isnan(pooled)]
    edges = np.quantile(pooled, np.linspace(0, 1, 21)) if pooled.size else np.array([0.0, 1.0])
    edges[0], edges[-1] = -np.inf, np.inf
    chosen = _cells(a[:half], edges) - math.exp(eps) * _cells(b[:half], edges) > 0
    p = float(_cells(a[half:], edges)[chosen].sum())
    q = float(_cells(b[half:], edges)[chosen].sum())
    m = a.size - half
    return p - 4.5 * math.sqrt(max(p * (1 - p), 1e-6) / m) - math.exp(eps) * q


def test_ops_linear_hockey_stick_at_the_charged_epsilon_is_within_the_charged_delta() -> None:
    charged = plan(PARAMS, 1, "add_remove").budget
    a, b = _samples(X, Y, 1), _samples(X2, Y2, 2)
    assert _lower_bound(a, b, charged.epsilon) <= charged.delta
    assert _lower_bound(b, a, charged.epsilon) <= charged.delta
    # power of the estimator (not of the mechanism: on this pair OPS-PTR's output is within sampling error of
    # the neighbour's even at ε = 0): a shift by one standard deviation of the output is detected at ε = 0
    shifted = a + float(np.nanstd(a))
    assert _lower_bound(a, shifted, 0.0) > 0.01 or _lower_bound(shifted, a, 0.0) > 0.01


def test_broken_variant_without_margins_is_caught() -> None:
    pl = plan(PARAMS, 1, "add_remove")
    lam_min = float(np.sum(X[:, 0] ** 2))
    noise = Noise.seeded(3)
    broken = [
        ops_release(pl, X, Y, noise, drop_margins=True)["lambda_min_lower"] > lam_min for _ in range(400)
    ]
    sound = [ops_release(pl, X, Y, noise)["lambda_min_lower"] > lam_min for _ in range(400)]
    assert sum(sound) == 0  # δ′₁ ≈ 1e-3: expected 0.45 failures in 400
    assert sum(broken) / 400 > 0.3  # ≈ 1/2: the PTR false-positive condition is violated
