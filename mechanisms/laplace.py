"""The Laplace mechanism on a query (count, sum, mean, histogram).

Noise Lap(b) with b = ``laplace_scale(Δ₁, ε)`` ≥ Δ₁/ε is added to each coordinate of the query's output,
where Δ₁ is the ℓ1 sensitivity derived from the public schema (``mechanisms.queries.shifts``). This is
ε-DP (Dwork, McSherry, Nissim, Smith 2006, "Calibrating noise to sensitivity", Prop. 1 / Thm. 1); its
Rényi curve is Mironov 2017 ("Rényi differential privacy", Prop. 6), summed over the coordinates that can
move (``RdpCurve.laplace``, with the αε²/2 zCDP bound of Bun & Steinke where it is smaller); the pure slot
is charged ε itself.

Ex-post: the Laplace privacy loss of an outcome is bounded by ε for **every** outcome, and the ex-ante RDP
bound is what is charged, so realized = worst case (nothing about the output lowers the charge).

Limitation (documented, not fixed): noise is drawn with numpy's floating-point sampler, which is exposed
to the floating-point attack on textbook Laplace implementations (Mironov 2012, "On significance of the
least significant bits for differential privacy"). A snapping or discrete sampler would be needed to close
it; the accounting here is for the idealised real-valued mechanism.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, StrictFloat

from mechanisms.accounting import RdpCurve, laplace_scale
from mechanisms.base import PublicContext, Release, Table, params_as
from mechanisms.queries import Query, check_query, evaluate, l1, release_output, shifts


class LaplaceParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    query: Query
    epsilon: StrictFloat = Field(gt=0, le=100, allow_inf_nan=False, description="pure-DP ε of this release")



class Laplace:
    """Laplace noise calibrated to the ℓ1 sensitivity of the query; pure ε-DP."""

    name: ClassVar[str] = "laplace"
    summary: ClassVar[str] = "Count, sum, mean or histogram with Laplace noise (pure ε-DP)."
    params_model: ClassVar[type[BaseModel]] = LaplaceParams
    cost_parameter: ClassVar[str] = "epsilon"
    cost_increases_with_parameter: ClassVar[bool] = True

    def check(self, params: BaseModel, ctx: PublicContext) -> None:
        query = params_as(params, LaplaceParams).query
        check_query(query, ctx)

    def worst_case(self, params: BaseModel, ctx: PublicContext) -> RdpCurve:
        p = params_as(params, LaplaceParams)
        return RdpCurve.laplace(shifts(p.query, ctx), p.epsilon, ctx.orders)

    def run(self, params: BaseModel, ctx: PublicContext, table: Table, rng: np.random.Generator) -> Release:
        p = params_as(params, LaplaceParams)
        self.check(p, ctx)
        worst = self.worst_case(p, ctx)
        scale = laplace_scale(l1(shifts(p.query, ctx)), p.epsilon)
        values, labels = evaluate(p.query, ctx, table)
        noisy = values + rng.laplace(0.0, scale, size=values.shape)
        realized = worst
        assert realized <= worst
        output = release_output(noisy, labels, {"distribution": "laplace", "scale": scale})
        return Release(output=output, realized=realized)
