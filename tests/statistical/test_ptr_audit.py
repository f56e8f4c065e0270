"""Monte Carlo audit of ``ptr.ops_linear`` on a worst-case neighbouring pair (docs/mechanisms/ptr.md §3–§5).

**Pair** (add/remove, d = 1, R = 1, no intercept): Z = four rows (x = 0, y = 0) and Z′ = Z + (x = 1, y = 1).
Every quantity the Gen-PTR test releases moves as far as the proofs allow: λ_min(XᵀX) goes from 0 to R²
(the Weyl sensitivity the λ^P release is calibrated to), Δ = log(1 + R‖θ*_λ‖) from 0 to log(1 + 1/(λ+1)),
within 10 % of Lemma LOGNORM's log(1 + R²/λ); the added row has leverage v = xᵀH_Z⁻¹x = R²/λ, exactly the
worst case the bound assumes, and residual r = 1 = e^{Δ(Z)}, the largest Lemma OPS-DD allows at Z.

**Parameters** ε = 2, δ = 10⁻³, λ = 8, test_fraction = 0.04: the test's share is small, so the discrete
Laplace noise of λ^P and Δ^P is large against what it measures and the one-sided margins k = t·log(1/δ′) are
what keeps ε̄(γ) an upper bound. The real mechanism releases (λ^P ≪ 0, Δ^P ≫ 0, a tiny γ); the broken variant
(the same ``run`` with both margins dropped, built here by subclassing through ``ops_release``'s
``drop_margins`` switch) under-states Δ about half the time and then picks a γ ~10⁹× larger, whose posterior
sample separates Z from Z′.

**Statistic and events** (fixed before sampling): for a released (θ, γ), T = log N(θ; μ_Z, (γH_Z)⁻¹) −
log N(θ; μ_Z′, (γH_Z′)⁻¹), the exact privacy loss of the posterior-sample step at that γ (⊥: no event).
S₊ = {T > ε + 1} for D_{e^ε}(M(Z) ‖ M(Z′)) and S₋ = {T < −(ε + 1)} for D_{e^ε}(M(Z′) ‖ M(Z)). The hockey-stick
divergence on S is P(S) − e^ε·P′(S) ≤ δ for an (ε, δ)-DP mechanism; its lower confidence bound is the
Clopper–Pearson lower bound of P(S) minus e^ε times the upper bound of P′(S), each at level 0.5·10⁻⁴.

**Checks.** Real mechanism: lower bound ≤ the charged δ for both events (false alarm ≤ 10⁻⁴ per event when
the mechanism is (ε, δ)-DP, 2·10⁻⁴ in all). Broken variant: lower bound > δ for both events. Measured with
these seeds (N = 2000 per world): real mechanism 0 hits on either side (γ ≈ 2·10⁻²²), lower bounds −0.036;
broken variant (γ ≈ 2) hits 347 vs 3 on S₊ and 306 vs 2 on S₋, lower bounds 0.080 and 0.069, i.e. 69–80 × δ.
Power at those rates (exact binomial sums): P(broken not caught) = 5·10⁻⁷ on S₊, 1.5·10⁻⁶ on S₋. The same
samples check the margins' coverage: the real bounds are on the wrong side in ≤ 8 of 4000 releases (each
release w.p. ≤ δ′₁ + δ′₂ = 3δ/8, expected ≤ 1.5, P(> 8) < 5·10⁻⁵), the broken ones in more than half
(expected ¾: each bound independently on the wrong side w.p. ≈ ½).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from scipy import stats

from mechanisms.accounting import DEFAULT_ORDERS
from mechanisms.base import PublicContext, Release, Table
from mechanisms.data.schema import DatasetSchema
from mechanisms.learners.features import FeatureSpec, design_matrix
from mechanisms.noise import Noise
from mechanisms.ptr.ops_linear import OPS_LINEAR, OpsLinear, OpsLinearParams, ops_release, plan

pytestmark = [pytest.mark.statistical, pytest.mark.slow]

LAM = 8.0
EPSILON = 2.0
DELTA = 1e-3
PARAMS = OpsLinearParams(
    features=FeatureSpec(features=("x",), label="y", intercept=False),
    lam=LAM,
    epsilon=EPSILON,
    delta=DELTA,
    test_fraction=0.04,
)
CTX = PublicContext(
    DatasetSchema.model_validate(
        {
            "columns": [
                {"name": "x", "type": "float", "min": -1, "max": 1},
                {"name": "y", "type": "float", "min": -1, "max": 1},
            ],
            "neighboring": "add_remove",
        }
    ),
    None,
    DEFAULT_ORDERS,
)
Z: dict[str, np.ndarray] = {"x": np.zeros(4), "y": np.zeros(4)}
Z_PRIME: dict[str, np.ndarray] = {"x": np.append(Z["x"], 1.0), "y": np.append(Z["y"], 1.0)}
N = 2000
LEVEL = 1e-4  # per event: each Clopper–Pearson bound at LEVEL/2
THRESHOLD = EPSILON + 1.0


class MarginsDropped(OpsLinear):
    """The broken variant: ``OpsLinear.run`` with λ^P and Δ^P released without their one-sided margins."""

    def run(self, p: OpsLinearParams, ctx: PublicContext, table: Table, noise: Noise) -> Release:
        x, y = design_matrix(p.features, ctx, table, "regression", row_norm=p.row_norm)
        pl = plan(p, x.shape[1], ctx.schema.neighboring)
        output = ops_release(pl, x, y, noise, drop_margins=True)
        return Release(output=output, realized=self.worst_case(p, ctx))


def _posterior(table: dict[str, np.ndarray]) -> tuple[float, float]:
    """(μ, H) of the OPS posterior N(μ, (γH)⁻¹) on the table (d = 1, exact in floats for this pair)."""
    h = LAM + float(table["x"] @ table["x"])
    return float(table["x"] @ table["y"]) / h, h


def _draw(mechanism: OpsLinear, table: dict[str, np.ndarray], seed: int) -> list[dict[str, Any]]:
    noise = Noise.seeded(seed)
    return [mechanism.run(PARAMS, CTX, table, noise).output for _ in range(N)]


def _loss(outputs: list[dict[str, Any]]) -> np.ndarray:
    """T = log p_Z(θ | γ) − log p_Z′(θ | γ) per output (0 for ⊥)."""
    (mu, h), (mu2, h2) = _posterior(Z), _posterior(Z_PRIME)
    values = []
    for o in outputs:
        if not o["released"]:
            values.append(0.0)
            continue
        theta, gamma = o["coefficients"][0], o["gamma"]
        log_p = 0.5 * math.log(gamma * h) - 0.5 * gamma * h * (theta - mu) ** 2
        log_q = 0.5 * math.log(gamma * h2) - 0.5 * gamma * h2 * (theta - mu2) ** 2
        values.append(log_p - log_q)
    return np.array(values)


def hockey_stick_lower_bound(hits: int, hits_other: int, runs: int, epsilon: float) -> float:
    """Lower confidence bound (level LEVEL) of P(S) − e^ε·P′(S) from hit counts (Clopper–Pearson)."""
    lower = float(stats.beta.ppf(LEVEL / 2, hits, runs - hits + 1)) if hits > 0 else 0.0
    upper = (
        float(stats.beta.ppf(1 - LEVEL / 2, hits_other + 1, runs - hits_other)) if hits_other < runs else 1.0
    )
    return lower - math.exp(epsilon) * upper


def _audit(mechanism: OpsLinear, seed: int) -> dict[str, Any]:
    on_z, on_z_prime = _draw(mechanism, Z, seed), _draw(mechanism, Z_PRIME, seed + 1)
    t, t_prime = _loss(on_z), _loss(on_z_prime)
    forward = hockey_stick_lower_bound(
        int(np.sum(t > THRESHOLD)), int(np.sum(t_prime > THRESHOLD)), N, EPSILON
    )
    backward = hockey_stick_lower_bound(
        int(np.sum(t_prime < -THRESHOLD)), int(np.sum(t < -THRESHOLD)), N, EPSILON
    )
    # coverage of the released bounds: λ^P ≤ λ_min and Δ^P ≥ Δ (true values of each table)
    wrong = 0
    for outputs, table in ((on_z, Z), (on_z_prime, Z_PRIME)):
        lam_min = float(table["x"] @ table["x"])
        mu, _ = _posterior(table)
        log_true = math.log(1.0 + abs(mu))
        wrong += sum(o["lambda_min_lower"] > lam_min or o["log_lipschitz_upper"] < log_true for o in outputs)
    return {"forward": forward, "backward": backward, "wrong_side": wrong}


def test_charge_of_the_audited_call() -> None:
    charge = OPS_LINEAR.approximate_charge(PARAMS, CTX)
    assert charge.epsilon == pytest.approx(EPSILON, rel=1e-9)
    assert plan(PARAMS, 1, "add_remove").budget.delta == pytest.approx(DELTA, rel=1e-9)


def test_hockey_stick_estimator() -> None:
    # no hits on either side: the bound is −e^ε·(upper bound of a zero count), far below 0
    assert hockey_stick_lower_bound(0, 0, 2000, 2.0) < -0.03
    # 340 hits against 0 at ε = 2: P(S) ≥ 0.14 and P′(S) ≤ 0.005 at these levels
    assert 0.1 < hockey_stick_lower_bound(340, 0, 2000, 2.0) < 0.15
    # the bound is valid: under P(S) = P′(S)·e^ε + δ exactly, it exceeds δ in ≤ LEVEL of the draws
    rng = np.random.default_rng(11)
    p_other = 0.01
    p = math.exp(2.0) * p_other + DELTA
    draws = [
        hockey_stick_lower_bound(rng.binomial(2000, p), rng.binomial(2000, p_other), 2000, 2.0)
        for _ in range(300)
    ]
    assert max(draws) <= DELTA


def test_real_mechanism_hockey_stick_within_the_charged_delta() -> None:
    result = _audit(OPS_LINEAR, 101)
    assert result["forward"] <= DELTA
    assert result["backward"] <= DELTA
    assert result["wrong_side"] <= 8


def test_broken_variant_without_margins_is_caught_by_the_hockey_stick() -> None:
    result = _audit(MarginsDropped(), 201)
    assert result["forward"] > DELTA
    assert result["backward"] > DELTA
    assert result["wrong_side"] > N  # of 2N releases
