"""The Gaussian mechanism on a query (count, sum, mean, histogram).

Noise N(0, σ²) is added to each coordinate of the query's output. With ℓ2 sensitivity Δ₂ derived from the
public schema (``mechanisms.queries``), the release is (α, α·Δ₂²/(2σ²))-RDP at every order α (Mironov 2017,
"Rényi differential privacy", Prop. 7; the multivariate case follows because the loss only depends on the
projection on the shift direction). There is no pure bound.

Ex-post: the charge is the ex-ante RDP curve for every outcome, so realized = worst case.

Limitation (documented, not fixed): noise is drawn with numpy's floating-point sampler, which is exposed to
the floating-point attack on naive continuous samplers (Mironov 2012, "On significance of the least
significant bits for differential privacy"); the accounting is for the idealised real-valued mechanism.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, StrictFloat

from mechanisms.accounting import RdpCurve
from mechanisms.base import PublicContext, Release, Table, params_as
from mechanisms.queries import Query, check_query, evaluate, l2, release_output, shifts


class GaussianParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    query: Query
    sigma: StrictFloat = Field(
        gt=0, le=1e9, allow_inf_nan=False, description="standard deviation of the noise"
    )



class Gaussian:
    """Gaussian noise of standard deviation σ; RDP curve α·Δ₂²/(2σ²)."""

    name: ClassVar[str] = "gaussian"
    summary: ClassVar[str] = "Count, sum, mean or histogram with Gaussian noise (Rényi DP, no pure bound)."
    params_model: ClassVar[type[BaseModel]] = GaussianParams
    cost_parameter: ClassVar[str] = "sigma"
    cost_increases_with_parameter: ClassVar[bool] = False

    def check(self, params: BaseModel, ctx: PublicContext) -> None:
        query = params_as(params, GaussianParams).query
        check_query(query, ctx)

    def worst_case(self, params: BaseModel, ctx: PublicContext) -> RdpCurve:
        p = params_as(params, GaussianParams)
        return RdpCurve.gaussian(l2(shifts(p.query, ctx)), p.sigma, ctx.orders)

    def run(self, params: BaseModel, ctx: PublicContext, table: Table, rng: np.random.Generator) -> Release:
        p = params_as(params, GaussianParams)
        self.check(p, ctx)
        worst = self.worst_case(p, ctx)
        values, labels = evaluate(p.query, ctx, table)
        noisy = values + rng.normal(0.0, p.sigma, size=values.shape)
        realized = worst
        assert realized <= worst
        output = release_output(noisy, labels, {"distribution": "gaussian", "sigma": p.sigma})
        return Release(output=output, realized=realized)
