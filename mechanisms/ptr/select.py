"""``ptr.select``: Gen-PTR with hyperparameter selection by Liu–Talwar random stopping (Redberg, Zhu & Wang
2023, Alg 5; Liu & Talwar 2019, Thm 3.4 as quoted in Thm 3.5.6), selecting the proposal β of classic PTR
(``ptr.classic``, the median of a bounded numeric column) among a public candidate list.

Why Alg 5 and not Alg 12. Alg 12 needs one private bound valid for every candidate at once (the sufficient
statistics of ε_φ(X) must not depend on φ). Classic PTR's statistic is the distance to instability D_β(X),
a different sensitivity-1 function for every β: a neighbour can move all k of them, so a joint release costs
k-fold composition (a k·ε test), whereas random stopping costs 3ε* + 3√(2δ*) whatever k is. The score of a
candidate is public given its output (released beats ⊥; a smaller β, i.e. less noise, is better), so no
validation set is needed.

The loop (Alg 5 / Liu & Talwar's random stopping with cut-off T): repeat { draw j uniformly from the k
candidates; run Alg 3 with β_j at the per-call budget (ε*, δ*); keep the output; stop with probability τ },
at most T times; return the best output. Q = (uniform j, Alg 3(β_j), a uniform 62-bit tag) is (ε*, δ*)-DP (a
public mixture of (ε*, δ*)-DP mechanisms); outputs are ranked by the strict total order (released, −β, tag,
value), the tag breaking ties between releases of the same β without biasing the value. Only the best output
is returned: the number of iterations T̂ = min(G, T) must stay secret (revealing it turns the guarantee into
a fixed-length loop's), so the work is constant: all T draws are made, the best among the first T̂ is kept.

Budget from the public (ε, δ, τ, k): δ₂ = δ/2, T = ⌈log(1/δ₂)/τ⌉, δ* = ((δ − δ₂)/T)²/2 (rounded down),
ε* = (ε − 3√(2δ*))/3 (rounded down), Alg 3 with ε*/2 per half. Charge (Thm 3.5.6 with δ₂′ = e^{−τT} ≤ δ₂,
whose cut-off log(1/δ₂′)/τ is exactly T): (3ε_c + 3√(2δ*), √(2δ*)·T + δ₂), ε_c ≥ ε* the per-call ε as
charged by ``ClassicPtrPlan.budget``, every step rounded up. ⊥ (no candidate passed) is charged the same.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, ClassVar

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictStr

from mechanisms.accounting.approximate import ApproximateCharge
from mechanisms.base import ParamsError, PublicContext, Release, Table
from mechanisms.noise import Noise
from mechanisms.ptr.classic import (
    ClassicPtrPlan,
    check_beta,
    clipped_column,
    instability_distance,
    lower_median,
    numeric_column,
)
from mechanisms.ptr.protocol import ApproximateBase

MAX_CANDIDATES = 64
MAX_ITERATIONS = 1 << 20
_PAD = 1.0 + 1e-12
_TAG = 1 << 62


def _up(x: float) -> float:
    return math.nextafter(x * _PAD, math.inf)


def _down(x: float) -> float:
    return math.nextafter(x / _PAD, -math.inf)


class PtrSelectParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    column: StrictStr = Field(min_length=1, max_length=200, description="a numeric column (its median)")
    betas: tuple[StrictFloat, ...] = Field(
        min_length=2, max_length=MAX_CANDIDATES, description="public candidate bounds β (distinct, > 0)"
    )
    epsilon: StrictFloat = Field(ge=1e-3, le=20, allow_inf_nan=False, description="total ε of the selection")
    delta: StrictFloat = Field(gt=0, lt=0.01, allow_inf_nan=False, description="total δ of the selection")
    stop_probability: StrictFloat | None = Field(
        default=None, gt=0, le=1, allow_inf_nan=False, description="τ (default 1/(10k))"
    )


@dataclass(frozen=True)
class SelectPlan:
    """Everything public about one selection: τ, the cut-off T, δ₂, the per-call plans and the charge."""

    tau: float
    cutoff: int
    delta2: float
    delta_star: float
    eps_star: float
    plans: tuple[ClassicPtrPlan, ...]
    epsilon: float
    delta: float

    def charge(self, orders: tuple[float, ...]) -> ApproximateCharge:
        return ApproximateCharge.from_epsilon_delta(self.epsilon, self.delta, orders)


def liu_talwar_charge(
    call_epsilon: float, delta_star: float, cutoff: int, delta2: float
) -> tuple[float, float]:
    """(3ε_c + 3√(2δ*), √(2δ*)·T + δ₂), each operation rounded up (Liu & Talwar 2019, Thm 3.4)."""
    root = _up(math.sqrt(_up(2.0 * delta_star)))
    epsilon = _up(_up(3.0 * call_epsilon) + _up(3.0 * root))
    exact_delta = Fraction(root) * cutoff + Fraction(delta2)
    delta = float(exact_delta)
    return epsilon, delta if Fraction(delta) >= exact_delta else math.nextafter(delta, math.inf)


def select_plan(params: PtrSelectParams) -> SelectPlan:
    k = len(params.betas)
    tau = params.stop_probability if params.stop_probability is not None else 1.0 / (10 * k)
    delta2 = params.delta / 2.0
    cutoff = math.ceil(math.log(1.0 / delta2) / tau * _PAD)
    if cutoff > MAX_ITERATIONS:
        raise ParamsError("stop_probability", f"cut-off {cutoff} exceeds {MAX_ITERATIONS} iterations")
    delta_star = _down(_down((params.delta - delta2) / cutoff) ** 2 / 2.0)
    eps_star = _down((params.epsilon - _up(3.0 * _up(math.sqrt(_up(2.0 * delta_star))))) / 3.0)
    if not eps_star > 0.0:
        raise ParamsError("epsilon", "too small for the random-stopping overhead 3√(2δ*)")
    try:
        plans = tuple(ClassicPtrPlan.build(beta, eps_star / 2.0, delta_star) for beta in params.betas)
    except ValueError as error:
        raise ParamsError("betas", str(error)) from error
    call_epsilon = max(p.budget().epsilon for p in plans)
    epsilon, delta = liu_talwar_charge(call_epsilon, delta_star, cutoff, delta2)
    return SelectPlan(tau, cutoff, delta2, delta_star, eps_star, plans, epsilon, delta)


def stopping_time(noise: Noise, tau: float, cutoff: int) -> int:
    """T̂ = min(G, T), G ~ Geometric(τ) on {1, 2, …} (exact Bernoulli(τ) flips, τ read as its binary value)."""
    flips = noise.bernoulli(tau, cutoff)
    hits = np.flatnonzero(flips)
    return int(hits[0]) + 1 if hits.size else cutoff


def random_stopping_select(
    plan: SelectPlan, distances: list[int], value: float, noise: Noise
) -> tuple[int, float] | None:
    """Alg 5 on classic PTR: (index of the chosen β, released value) or None (⊥). Constant work: all T
    candidate draws and runs are made, the best among the first T̂ is returned."""
    k, cutoff = len(plan.plans), plan.cutoff
    stop = stopping_time(noise, plan.tau, cutoff)
    choice = noise.uniform_below(k, cutoff)
    test = plan.plans[0].test_scale  # the same for every candidate (same ε*/2)
    passed = np.asarray(distances)[choice] + noise.discrete_laplace(test, cutoff) >= plan.plans[0].pass_units
    tags = noise.uniform_below(_TAG, cutoff)
    released = np.zeros(cutoff, dtype=np.float64)
    for j, pl in enumerate(plan.plans):
        rows = np.flatnonzero(choice == j)
        noisy = noise.discrete_laplace(pl.release_scale, rows.size)
        released[rows] = pl.grid.from_units(pl.grid.to_units(np.full(rows.size, value)) + noisy)
    best: tuple[float, int, float, int] | None = None
    for i in range(stop):
        if passed[i]:
            j = int(choice[i])
            key = (-plan.plans[j].beta, int(tags[i]), float(released[i]), j)
            best = key if best is None or key > best else best
    return None if best is None else (best[3], best[2])


class PtrSelect(ApproximateBase[PtrSelectParams]):
    """``ptr.select``: the median by classic PTR with β chosen among public candidates (Alg 5)."""

    name: ClassVar[str] = "ptr.select"
    summary: ClassVar[str] = (
        "Median of a bounded numeric column by classic propose-test-release, selecting the proposal β "
        "among public candidates by Liu–Talwar random stopping "
        "(approximate DP: charged (ε, δ) on the δ-ledger)"
    )
    params_model: ClassVar[type[BaseModel]] = PtrSelectParams

    def check(self, p: PtrSelectParams, ctx: PublicContext) -> None:
        column = numeric_column(ctx, p.column, "column")
        if len(set(p.betas)) != len(p.betas):
            raise ParamsError("betas", "candidates must be distinct")
        for beta in p.betas:
            if not (math.isfinite(beta) and beta > 0.0):
                raise ParamsError("betas", f"{beta!r} is not a finite β > 0")
            check_beta(column, beta, "betas")
        select_plan(p)

    def approximate_charge(self, p: PtrSelectParams, ctx: PublicContext) -> ApproximateCharge:
        return select_plan(p).charge(ctx.orders)

    def run(self, p: PtrSelectParams, ctx: PublicContext, table: Table, noise: Noise) -> Release:
        column = numeric_column(ctx, p.column, "column")
        pl = select_plan(p)
        values = np.sort(clipped_column(table, column))
        lo, hi = float(column.min), float(column.max)
        distances = [instability_distance(values, lo, hi, c.beta, ctx.schema.neighboring) for c in pl.plans]
        chosen = random_stopping_select(pl, distances, lower_median(values, lo, hi), noise)
        output: dict[str, Any] = {"column": p.column, "released": chosen is not None}
        if chosen is None:
            output.update(beta=None, median=None, granularity=None, grid_exponent=None)
        else:
            index, value = chosen
            output.update(beta=p.betas[index], median=value, **pl.plans[index].grid.describe())
        return self.release(p, ctx, output)


PTR_SELECT = PtrSelect()
