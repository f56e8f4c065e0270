"""The Gaussian mechanism on a query (count, sum, mean, histogram), released on a public grid.

Construction (docs/mechanisms/gaussian.md, docs/privacy/finite_precision.md#finite-precision): the answer f(D)
is rounded to a public grid γ = 2^k (``mechanisms.queries.language.plan_grid``: γ = 1 and no rounding for
counts, histograms and sums over int columns; otherwise the largest 2^k ≤ 2^-10·Δ₂/√d) and the release is
γ·(round(f/γ) + Z) with Z the discrete Gaussian N_Z(0, s²), P(z) ∝ exp(−z²/(2s²)), drawn exactly from the OS
CSPRNG (``Noise.discrete_gaussian``; Canonne, Kamath, Steinke 2020, Algorithm 3). The scale parameter s² in
grid units is (σ/γ)² rounded **up** to a cheap rational (12 significant bits, an integer when ≥ 2^12), so s ≥
σ/γ. Every released number is an exact multiple of γ.

Privacy: round(f/γ) is an integer vector whose change between neighbours has ℓ2 norm ≤ Δ₂_grid =
‖(m_j)‖₂ with m_j ≤ ⌊shift_j/γ + 1/64⌋ + 1 (exactly shift_j for integer answers on γ = 1). For integer
vectors μ, ν, D_α(N_Z(μ, s²) ‖ N_Z(ν, s²)) ≤ α‖μ − ν‖²/(2s²) (Canonne, Kamath, Steinke 2020, Prop. 5 and
Thm. 15 for the multivariate product). The charge is ``RdpCurve.gaussian(Δ₂_grid, σ/γ)``, at the
**requested** σ: since s ≥ σ/γ, α·Δ₂_grid²/(2(σ/γ)²) ≥ α·Δ₂_grid²/(2s²) ≥ the true divergence, and the
charge is a function of public parameters only (the rounded s is too, but the requested σ is simpler to
audit and never smaller). There is no pure bound.

Ex-post: the charge is the ex-ante RDP curve for every outcome, so realized = worst case.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import ClassVar

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, StrictFloat

from mechanisms.accounting import UNITS_PER_EPSILON, RdpCurve
from mechanisms.accounting.individual import UnitCharges, slope_units
from mechanisms.base import ParamsChecked, PublicContext, Release, Table
from mechanisms.noise import Noise, dyadic_scale_up, float_up
from mechanisms.queries.individual import (
    ChargeFn,
    IndividualTable,
    UnitStep,
    check_individual_query,
    release_answer,
    unit_step,
)
from mechanisms.queries.intervals import ConfidenceLevel, discrete_gaussian_quantile, release_interval
from mechanisms.queries.language import (
    MAX_SCALE_BITS,
    GridPlan,
    MeanQuery,
    Query,
    check_query,
    plan_grid,
    release_output,
)
from mechanisms.queries.ratio_mean import combine, needs_ratio, sigma_ratio, validated_parts

VARIANCE_BITS = 12
"""Significant bits of the discrete Gaussian's s² in grid units (rounded up): keeps the exact sampler's
integers small (s² an integer once it is ≥ 2^12) at a relative cost ≤ 2^-11 in variance, none in charge."""


class GaussianParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    query: Query
    sigma: StrictFloat = Field(
        gt=0, le=1e9, allow_inf_nan=False, description="standard deviation of the noise"
    )
    confidence: ConfidenceLevel = 0.95


def gaussian_plan(params: GaussianParams, ctx: PublicContext) -> tuple[GridPlan, float, Fraction]:
    """(grid plan, σ/γ, s² in grid units) of one release: the grid is coarsened so σ/γ ≤ 2^40."""
    plan = plan_grid(params.query, ctx, math.ldexp(params.sigma, -MAX_SCALE_BITS))
    sigma_units = math.ldexp(params.sigma, -plan.grid.exponent)  # exact: a power-of-two scaling
    variance_units = dyadic_scale_up(Fraction(sigma_units) ** 2, bits=VARIANCE_BITS)
    return plan, sigma_units, variance_units


class Gaussian(ParamsChecked):
    """Discrete Gaussian noise on a public grid; RDP curve α·Δ₂_grid²/(2(σ/γ)²)."""

    name: ClassVar[str] = "gaussian"
    summary: ClassVar[str] = "Count, sum, mean or histogram with Gaussian noise (Rényi DP, no pure bound)."
    params_model: ClassVar[type[BaseModel]] = GaussianParams
    cost_parameter: ClassVar[str] = "sigma"
    cost_increases_with_parameter: ClassVar[bool] = False

    def check(self, p: GaussianParams, ctx: PublicContext) -> None:
        if ctx.schema.individual:
            check_individual_query(p.query)
        if needs_ratio(p.query, ctx):
            for part in self._ratio_parts(p, ctx):
                self.check(part, ctx)
            return
        check_query(p.query, ctx)
        variance_units = gaussian_plan(p, ctx)[2]  # refuses a grid that cannot hold the release
        discrete_gaussian_quantile(variance_units, p.confidence)  # the interval's half-width (cached for run)

    def worst_case(self, p: GaussianParams, ctx: PublicContext) -> RdpCurve:
        if needs_ratio(p.query, ctx):
            total, count = (self.worst_case(part, ctx) for part in self._ratio_parts(p, ctx))
            return total + count
        plan, sigma_units, _ = gaussian_plan(p, ctx)
        return RdpCurve.gaussian(plan.l2_units, sigma_units, ctx.orders)

    def run(self, p: GaussianParams, ctx: PublicContext, table: Table, noise: Noise) -> Release:
        if needs_ratio(p.query, ctx):
            assert isinstance(p.query, MeanQuery)
            total, count = (self.run(part, ctx, table, noise) for part in self._ratio_parts(p, ctx))
            output = combine(p.query, ctx, total.output, count.output, p.confidence)
            return Release(output=output, realized=total.realized + count.realized)
        self.check(p, ctx)
        plan, sigma_units, variance_units = gaussian_plan(p, ctx)  # the public plan of worst_case
        worst = RdpCurve.gaussian(plan.l2_units, sigma_units, ctx.orders)
        quantile = discrete_gaussian_quantile(variance_units, p.confidence)  # public (s², level)
        units, labels, charges = release_answer(
            p.query, ctx, table, plan, lambda individual: self.unit_step(p, ctx, individual)
        )
        draws = noise.discrete_gaussian(variance_units, units.size)
        noisy_units = units.astype(object) + draws
        noisy = plan.grid.from_units(noisy_units)
        realized = worst  # the ex-ante curve holds for every outcome
        spec = {
            "distribution": "discrete_gaussian",
            "sigma": p.sigma,
            "sigma_units": sigma_units,
            "variance_units": float(variance_units),
            **plan.grid.describe(),
        }
        interval = release_interval(noisy_units, plan, quantile, p.confidence, labels)
        output = release_output(noisy, labels, spec, interval)
        return Release(output=output, realized=realized, units=charges)

    def _ratio_parts(self, p: GaussianParams, ctx: PublicContext) -> tuple[GaussianParams, GaussianParams]:
        """A mean without a public size: its count at σ and its sum at σ·Δ_sum/Δ_count (both cost the
        same; ``mechanisms.queries.ratio_mean``)."""
        assert isinstance(p.query, MeanQuery)
        sum_sigma = p.sigma * sigma_ratio(p.query, ctx)
        return validated_parts(
            GaussianParams.model_validate, p.query, p.confidence, {"sigma": sum_sigma}, {"sigma": p.sigma}
        )

    def unit_step(self, p: GaussianParams, ctx: PublicContext, table: IndividualTable) -> UnitStep:
        """The release's answer over the units that can afford it and their charges (deterministic: no
        noise; ``expost ledger verify`` replays it to rebuild the units' filters)."""
        plan, sigma_units, _ = gaussian_plan(p, ctx)
        return unit_step(p.query, ctx, table, plan, gaussian_unit_charge(sigma_units))


def gaussian_unit_charge(sigma_units: float) -> ChargeFn:
    """Each unit's Rényi loss from its own ℓ2² shift ‖m‖² (grid units): α‖m‖²/(2(σ/γ)²) at every order
    (Canonne, Kamath, Steinke 2020 at the unit's own shift; docs/privacy/individual.md#individual-queries),
    kept as its α-slope ‖m‖²/(2(σ/γ)²)."""
    per_square = float_up(Fraction(UNITS_PER_EPSILON) / (2 * Fraction(sigma_units) ** 2))

    def charge(units: np.ndarray, l1: np.ndarray, squares: np.ndarray) -> UnitCharges:
        return UnitCharges(units, np.zeros(units.size, dtype=np.int64), slope_units(squares, per_square))

    return charge
