"""The Laplace mechanism on a query (count, sum, mean, histogram), released on a public grid.

Construction (docs/mechanisms/laplace.md, docs/privacy/finite_precision.md#finite-precision): the answer f(D)
is rounded to a public grid γ = 2^k (``mechanisms.queries.language.plan_grid``: γ = 1 and no rounding for
integer answers, i.e. counts, histograms and sums over int columns; otherwise the largest 2^k ≤ 2^-10·Δ₁/d),
and the release is γ·(round(f/γ) + Z) with Z discrete Laplace, P(z) ∝ exp(−|z|/t), drawn exactly from the OS
CSPRNG (``Noise.discrete_laplace``; Canonne, Kamath, Steinke 2020, Algorithm 2). Every released number is an
exact multiple of γ, so its low-order bits carry no information (the attack of Mironov 2012 has nothing to
read).

Privacy: coordinate j of round(f/γ) moves by an integer m_j ≤ ⌊shift_j/γ + 1/64⌋ + 1 between neighbours
(exactly shift_j on γ = 1 for integer answers); the discrete Laplace at an integer shift m has privacy loss
≤ m/t for every outcome, so the release is (Σ m_j/t)-DP with t = ``dyadic_scale_up``(Σ m_j/ε) ≥ Σ m_j/ε:
pure ε, charged as requested. Rényi curve: ``RdpCurve.pure_product`` over the per-coordinate pure epsilons
m_j/t (randomized-response bound, Lemma RR, docs/privacy/finite_precision.md#lemma-rr), **not** Mironov's
continuous-Laplace formula, which the discrete Laplace exceeds at large orders (tests/unit/test_noise.py pins
this).

Ex-post: the loss of every outcome is bounded by the same numbers, so realized = worst case.
"""

from __future__ import annotations

from fractions import Fraction
from functools import lru_cache
from typing import ClassVar

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, StrictFloat

from mechanisms.accounting import UNITS_PER_EPSILON, RdpCurve, units_up
from mechanisms.accounting.individual import UnitCharges, pure_units
from mechanisms.base import ParamsChecked, PublicContext, Release, Table
from mechanisms.noise import Noise, float_up
from mechanisms.queries.individual import (
    ChargeFn,
    IndividualTable,
    UnitStep,
    check_individual_query,
    release_answer,
    unit_step,
)
from mechanisms.queries.intervals import ConfidenceLevel, discrete_laplace_quantile, release_interval
from mechanisms.queries.language import (
    AnyQuery,
    GridPlan,
    MeanQuery,
    Query,
    check_query,
    laplace_plan,
    release_output,
)
from mechanisms.queries.ratio_mean import combine, half_epsilon, needs_ratio, validated_parts


class LaplaceParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    query: Query
    epsilon: StrictFloat = Field(gt=0, le=100, allow_inf_nan=False, description="pure-DP ε of this release")
    confidence: ConfidenceLevel = 0.95


def _capped(curve: RdpCurve, epsilon: float) -> RdpCurve:
    """``curve`` with every value at most ε and its pure bound ε: valid when the exact loss is ≤ ε as the
    ledger reads it (the parts of a ratio mean, ``half_epsilon``)."""
    return RdpCurve(curve.orders, tuple(min(v, epsilon) for v in curve.values), epsilon)


def laplace_curve(plan: GridPlan, scale: Fraction, epsilon: float, orders: tuple[float, ...]) -> RdpCurve:
    """The charge of one grid release: ``pure_product`` of the per-coordinate pure epsilons m_j/t (each
    rounded up), with the pure slot the requested ε (the exact loss Σ m_j/t ≤ ε by the choice of t, where
    ε is compared as ``charged_fraction``: the smaller of the float and its shortest decimal)."""
    per_coordinate = [float_up(Fraction(m) / scale) for m in plan.unit_shifts]
    curve = RdpCurve.pure_product(per_coordinate, orders)
    # D_α ≤ D_∞ ≤ Σ m_j/t ≤ ε: capping at ε (read by the ledger as its decimal, ≥ the exact loss) is valid
    return RdpCurve(curve.orders, tuple(min(v, epsilon) for v in curve.values), epsilon)


@lru_cache(maxsize=1024)
def _release_plan(query: AnyQuery, ctx: PublicContext, epsilon: float) -> tuple[GridPlan, Fraction, RdpCurve]:
    """The grid, the scale and the charge of a release: a function of public parameters only (cached)."""
    plan, scale = laplace_plan(query, ctx, epsilon)
    return plan, scale, laplace_curve(plan, scale, epsilon, ctx.orders)


class Laplace(ParamsChecked):
    """Discrete Laplace noise on a public grid, calibrated to the ℓ1 sensitivity in grid units; pure ε-DP."""

    name: ClassVar[str] = "laplace"
    summary: ClassVar[str] = "Count, sum, mean or histogram with Laplace noise (pure ε-DP)."
    params_model: ClassVar[type[BaseModel]] = LaplaceParams
    cost_parameter: ClassVar[str] = "epsilon"
    cost_increases_with_parameter: ClassVar[bool] = True

    def check(self, p: LaplaceParams, ctx: PublicContext) -> None:
        if ctx.schema.individual:
            check_individual_query(p.query)
        if needs_ratio(p.query, ctx):
            for part in self._ratio_parts(p):
                self.check(part, ctx)
            return
        check_query(p.query, ctx)
        scale = _release_plan(p.query, ctx, p.epsilon)[1]  # refuses an ε whose noise would not fit the grid
        discrete_laplace_quantile(scale, p.confidence)  # the interval's half-width (cached for run)

    def worst_case(self, p: LaplaceParams, ctx: PublicContext) -> RdpCurve:
        if needs_ratio(p.query, ctx):
            total, count = (self.worst_case(part, ctx) for part in self._ratio_parts(p))
            return _capped(total + count, p.epsilon)
        return _release_plan(p.query, ctx, p.epsilon)[2]

    def run(self, p: LaplaceParams, ctx: PublicContext, table: Table, noise: Noise) -> Release:
        if needs_ratio(p.query, ctx):
            assert isinstance(p.query, MeanQuery)
            total, count = (self.run(part, ctx, table, noise) for part in self._ratio_parts(p))
            output = combine(p.query, ctx, total.output, count.output, p.confidence)
            return Release(output=output, realized=_capped(total.realized + count.realized, p.epsilon))
        check_query(p.query, ctx)
        plan, scale, worst = _release_plan(p.query, ctx, p.epsilon)  # the plan of check and worst_case
        quantile = discrete_laplace_quantile(scale, p.confidence)  # public (scale, level): post-processing
        units, labels, charges = release_answer(
            p.query, ctx, table, plan, lambda individual: self.unit_step(p, ctx, individual)
        )
        noisy_units = units.astype(object) + noise.discrete_laplace(scale, units.size)
        noisy = plan.grid.from_units(noisy_units)
        realized = worst  # the loss bound holds for every outcome: nothing about the output lowers it
        spec = {
            "distribution": "discrete_laplace",
            "scale": float(scale * Fraction(plan.grid.granularity)),
            "scale_units": float(scale),
            **plan.grid.describe(),
        }
        interval = release_interval(noisy_units, plan, quantile, p.confidence, labels)
        output = release_output(noisy, labels, spec, interval)
        return Release(output=output, realized=realized, units=charges)

    def _ratio_parts(self, p: LaplaceParams) -> tuple[LaplaceParams, LaplaceParams]:
        """A mean without a public size: its sum and count, each at ε/2 (rounded so that the pair's loss
        stays within the ε the ledger charges; ``mechanisms.queries.ratio_mean``)."""
        assert isinstance(p.query, MeanQuery)
        cost = {"epsilon": half_epsilon(p.epsilon)}
        return validated_parts(LaplaceParams.model_validate, p.query, p.confidence, cost, cost)

    def unit_step(self, p: LaplaceParams, ctx: PublicContext, table: IndividualTable) -> UnitStep:
        """The release's answer over the units that can afford it and their charges (deterministic: no
        noise; ``expost ledger verify`` replays it to rebuild the units' filters)."""
        plan, scale, _ = _release_plan(p.query, ctx, p.epsilon)
        return unit_step(p.query, ctx, table, plan, laplace_unit_charge(scale, p.epsilon))


def laplace_unit_charge(scale: Fraction, epsilon: float) -> ChargeFn:
    """Each unit's pure loss from its own ℓ1 shift m (grid units): the discrete Laplace at integer shifts
    summing to m has loss ≤ m/t for every outcome (docs/privacy/individual.md#individual-queries), never
    above the requested ε (m ≤ the public ℓ1 bound M and M/t ≤ ε)."""
    per_shift = float_up(Fraction(UNITS_PER_EPSILON) / scale)
    ceiling = units_up(epsilon) or 0

    def charge(units: np.ndarray, l1: np.ndarray, squares: np.ndarray) -> UnitCharges:
        pure = np.minimum(pure_units(l1, per_shift), ceiling)
        return UnitCharges(units, pure, np.zeros(units.size, dtype=np.int64))

    return charge
