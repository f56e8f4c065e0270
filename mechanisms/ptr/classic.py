"""Classic propose-test-release (Dwork & Lei 2009; Redberg, Zhu & Wang 2023, Alg 3) on a public grid.

    if D_β(X) + DLap(t_d) < K:  ⊥      else  γ·(round(f(X)/γ) + DLap(t_f)),      K = ⌈t_d·log(1/δ)⌉

D_β(X) is the (integer) distance from X to the nearest dataset whose local sensitivity exceeds the proposed
bound β; it has sensitivity 1, so with t_d ≥ 1/ε the test is ε-DP. If D_β(X) ≥ 1 every neighbour's f is within
β, so round(f/γ) moves by ≤ m = ⌊β/γ⌋ + 1 grid units (Lemma GRID, docs/privacy/finite_precision.md#lemma-grid)
and t_f ≥ m/ε makes the release ε-DP; if D_β(X) = 0 the test passes with probability P[Z ≥ K] ≤ e^{−K/t_d} ≤
δ. Thm 3.3.4: (2ε, δ)-DP, charged through the approximate-DP path
(docs/privacy/approximate.md#approximate-dp). The threshold is the integer K
(Alg 3's log(1/δ)/ε rounded up in the noise's own scale): with the dyadic t_d slightly above 1/ε, the float
threshold log(1/δ)/ε could let P[Z > log(1/δ)/ε] exceed δ by a factor 1 + O(2^−40·ε·K) at large ε.

``classic_ptr`` is Alg 3 written directly; ``classic_via_gen_ptr`` is the same algorithm as a generalized PTR
instance (M_φ = f + DLap(φ), T = 1[D_β + DLap ≥ K], ε_φ(X) > ε ⇔ Δ_LS(X) > β). They consume the randomness in
the same order, so they agree draw for draw; tests/unit/test_ptr.py also checks the distributions.

``ClassicPtr`` (``ptr.classic``) is the service mechanism: Alg 3 on the **median** of a bounded numeric column
(Dwork & Lei's example). Rows are clipped to the schema's declared [lo, hi]; the median is the lower median
x_(⌈n/2⌉) of the values sorted with the padding x_i = lo for i ≤ 0 and x_i = hi for i ≥ n + 1 (so the empty
dataset's median is lo). The distance to instability is computed exactly from the sorted values
(``instability_distance``; proofs in docs/mechanisms/ptr.md §6):

* replace-one (n public, median index m fixed): A^(k)(X) = max_{0≤t≤k+1} (x_{m+t} − x_{m+t−k−1}), the largest
  local sensitivity over datasets within distance k (Nissim, Raskhodnikova & Smith 2007, Prop. 3.4);
* add/remove: A^(k)(X) = max(x_{c+k} − x_{c−1}, x_{c+k+1} − x_c), c = ⌈(n − k)/2⌉ (derived in ptr.md §6);

and D(X) = min{k ≥ 0: fl(A^(k)(X)) ≥ β} (float differences compared with ≥: rounding is monotone, so this is
the exact distance for a threshold θ ≤ β, which keeps both properties the proof needs: |D(X) − D(X′)| ≤ 1 and
D(X) ≥ 1 ⇒ every neighbour's median is within β). Neither D(X) nor the median is returned, stored or logged:
the output is ⊥ or the noisy median on its grid.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, ClassVar, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictStr

from mechanisms.accounting.approximate import ApproximateCharge
from mechanisms.base import ParamsError, PublicContext, Release, Table
from mechanisms.data.schema import FloatColumn, IntColumn
from mechanisms.noise import Grid, Noise, laplace_grid
from mechanisms.ptr.generalized import GenPtrBudget, gen_ptr, laplace_scale_units
from mechanisms.ptr.protocol import ApproximateBase

_PAD = 1.0 + 1e-12
MAX_VALUE_UNITS = 2**44
"""|f/γ| ≤ 2^44 for every value of the column (checked from the declared bounds): exact grid arithmetic."""
Neighbouring = Literal["replace_one", "add_remove"]


@dataclass(frozen=True)
class ClassicPtrPlan:
    """Public plan of one Alg 3 call: grid, noise scales (grid units), threshold, charge.

    ``epsilon`` is Alg 3's ε (each of the test and the release); the call is (2ε, δ)-DP. The test passes iff
    D + Z ≥ ``pass_units`` = K, i.e. iff D + Z > ``threshold`` = K − 1."""

    beta: float
    epsilon: float
    delta: float
    grid: Grid
    test_scale: Fraction
    release_scale: Fraction
    pass_units: int

    @property
    def threshold(self) -> float:
        return float(self.pass_units - 1)

    @classmethod
    def build(cls, beta: float, epsilon: float, delta: float) -> ClassicPtrPlan:
        if not (math.isfinite(beta) and beta > 0.0):
            raise ValueError("beta must be finite and > 0")
        if not (math.isfinite(epsilon) and 0.0 < epsilon <= 100.0):
            raise ValueError("epsilon must be in (0, 100]")
        if not (0.0 < delta < 1.0):
            raise ValueError("delta must be in (0, 1)")
        grid = laplace_grid(beta, 1, integer_valued=False)
        shift_units = math.floor(Fraction(beta) / Fraction(grid.granularity)) + 1
        test_scale = laplace_scale_units(1, epsilon)
        return cls(
            beta=beta,
            epsilon=epsilon,
            delta=delta,
            grid=grid,
            test_scale=test_scale,
            release_scale=laplace_scale_units(shift_units, epsilon),
            pass_units=pass_units(test_scale, delta),
        )

    def budget(self) -> GenPtrBudget:
        """As Gen-PTR: test (ε, 0), false-positive δ, mechanism (ε, 0): total (2ε, δ) (Thm 3.3.4)."""
        return GenPtrBudget(self.epsilon, 0.0, self.delta, self.epsilon, 0.0)

    def charge(self, orders: tuple[float, ...]) -> ApproximateCharge:
        budget = self.budget()
        return ApproximateCharge.from_epsilon_delta(budget.epsilon, budget.delta, orders)


def pass_units(scale: Fraction, delta: float) -> int:
    """K = ⌈t·log(1/δ)⌉ (padded up, ≥ 1): P[Z ≥ K] = q^K/(1 + q) ≤ e^{−K/t} ≤ δ for Z ~ DLap(t),
    q = e^{−1/t}."""
    return max(1, math.ceil(float(scale) * math.log(1.0 / delta) * _PAD))


def classic_ptr(plan: ClassicPtrPlan, distance: int, value: float, noise: Noise) -> float | None:
    """Alg 3 directly: ⊥ (None) if D_β + DLap(t_d) < K, else f on the grid plus DLap(t_f)."""
    if distance < 0:
        raise ValueError("a distance to instability is ≥ 0")
    noisy_distance = distance + int(noise.discrete_laplace(plan.test_scale, 1)[0])
    if noisy_distance < plan.pass_units:
        return None
    units = plan.grid.to_units(np.asarray([value]))
    released = units + noise.discrete_laplace(plan.release_scale, 1)
    return float(plan.grid.from_units(released)[0])


def distance_test(plan: ClassicPtrPlan, distance: int, noise: Noise) -> bool:
    """Gen-PTR's test T(X) = 1[D_β(X) + DLap(t_d) ≥ K]: passes on a bad X (D_β = 0) w.p. ≤ δ."""
    return distance + int(noise.discrete_laplace(plan.test_scale, 1)[0]) >= plan.pass_units


def laplace_mechanism(plan: ClassicPtrPlan, value: float, noise: Noise) -> float:
    """M_φ(X) = γ·(round(f/γ) + DLap(φ)), φ = t_f: ε_φ(X) ≤ ε whenever Δ_LS(X) ≤ β (Example 3.5.2)."""
    units = plan.grid.to_units(np.asarray([value]))
    return float(plan.grid.from_units(units + noise.discrete_laplace(plan.release_scale, 1))[0])


def classic_via_gen_ptr(plan: ClassicPtrPlan, distance: int, value: float, noise: Noise) -> float | None:
    """Alg 3 as Gen-PTR (Alg 4): the test, then the mechanism only if it passed."""
    passed = distance_test(plan, distance, noise)
    return gen_ptr(passed, laplace_mechanism(plan, value, noise) if passed else None)


# ----- the median: its value and its distance to instability (data-dependent, never released) ------------


def _padded(sorted_values: np.ndarray, lo: float, hi: float, index: np.ndarray) -> np.ndarray:
    """x_i for 1-based indices i, with x_i = lo for i ≤ 0 and x_i = hi for i ≥ n + 1."""
    n = sorted_values.size
    inside = np.clip(index, 1, max(n, 1)) - 1
    values = sorted_values[inside] if n else np.full(index.shape, lo)
    return np.where(index <= 0, lo, np.where(index >= n + 1, hi, values))


def median_index(n: int) -> int:
    """m = ⌈n/2⌉: the lower median x_(m) (m = 0 for the empty dataset: the padded value lo)."""
    return (n + 1) // 2


def lower_median(sorted_values: np.ndarray, lo: float, hi: float) -> float:
    m = median_index(sorted_values.size)
    return float(_padded(sorted_values, lo, hi, np.asarray([m]))[0])


def _windows(n: int, k: int, neighbouring: Neighbouring) -> tuple[np.ndarray, np.ndarray]:
    """The index windows (U, U − k − 1) whose widths bound the local sensitivity within distance k."""
    if neighbouring == "replace_one":
        upper = median_index(n) + np.arange(k + 2)
    else:
        c = -((k - n) // 2)  # ⌈(n − k)/2⌉
        upper = np.asarray([c + k, c + k + 1])
    return upper, upper - k - 1


def unstable_within(
    sorted_values: np.ndarray, lo: float, hi: float, beta: float, k: int, neighbouring: Neighbouring
) -> bool:
    """Whether fl(A^(k)(X)) ≥ β: some dataset within distance k may have local sensitivity ≥ θ (θ ≤ β)."""
    upper, lower = _windows(sorted_values.size, k, neighbouring)
    widths = _padded(sorted_values, lo, hi, upper) - _padded(sorted_values, lo, hi, lower)
    return bool(np.any(widths >= beta))


def instability_distance(
    sorted_values: np.ndarray, lo: float, hi: float, beta: float, neighbouring: Neighbouring
) -> int:
    """D(X) = min{k ≥ 0: fl(A^(k)(X)) ≥ β} by bisection (the predicate is monotone in k). Needs
    fl(hi − lo) ≥ β (checked from the schema), so that k = n is unstable and D(X) ≤ n."""
    n = sorted_values.size
    if not unstable_within(sorted_values, lo, hi, beta, n, neighbouring):
        raise ValueError("β must be below the column's range")
    low, high = -1, n  # stable at low (vacuously for −1), unstable at high
    while high - low > 1:
        mid = (low + high) // 2
        unstable = unstable_within(sorted_values, lo, hi, beta, mid, neighbouring)
        low, high = (low, mid) if unstable else (mid, high)
    return high


def clipped_column(table: Table, column: FloatColumn | IntColumn) -> np.ndarray:
    """The column as float64, each row clipped to the declared [min, max] (a per-row map; NaN ↦ min)."""
    values = np.asarray(table[column.name], dtype=np.float64)
    values = np.where(np.isnan(values), float(column.min), values)
    return np.clip(values, float(column.min), float(column.max))


# ----- the service mechanism ------------------------------------------------------------------------------


class ClassicPtrParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    column: StrictStr = Field(min_length=1, max_length=200, description="a numeric column (its median)")
    beta: StrictFloat = Field(
        gt=0, allow_inf_nan=False, description="proposed bound β on the median's local sensitivity"
    )
    epsilon: StrictFloat = Field(
        ge=1e-4, le=20, allow_inf_nan=False, description="total ε of the call (ε/2 test, ε/2 release)"
    )
    delta: StrictFloat = Field(gt=0, lt=0.01, allow_inf_nan=False, description="total δ of the call")


def numeric_column(ctx: PublicContext, name: str, field: str) -> FloatColumn | IntColumn:
    column = ctx.schema.column(name)
    if column is None:
        raise ParamsError(field, f"unknown column {name!r}")
    if not isinstance(column, (FloatColumn, IntColumn)):
        raise ParamsError(field, f"column {name!r} is not numeric")
    return column


def check_beta(column: FloatColumn | IntColumn, beta: float, field: str) -> None:
    """Schema checks of a proposal β: below the range (else the median needs no test) and a grid on which
    every value of the column is exact."""
    lo, hi = float(column.min), float(column.max)
    if not hi - lo > beta:
        raise ParamsError(field, f"{beta!r} is not below the column's range {hi - lo!r} (use laplace)")
    grid = laplace_grid(beta, 1, integer_valued=False)
    if max(abs(lo), abs(hi)) > MAX_VALUE_UNITS * grid.granularity:
        raise ParamsError(field, f"{beta!r} is too small for the column's bounds (grid 2^−10·β)")


def classic_plan(params: ClassicPtrParams) -> ClassicPtrPlan:
    try:
        return ClassicPtrPlan.build(params.beta, params.epsilon / 2.0, params.delta)
    except ValueError as error:
        raise ParamsError("epsilon", str(error)) from error


class ClassicPtr(ApproximateBase[ClassicPtrParams]):
    """``ptr.classic``: the median of a bounded numeric column by classic PTR (Alg 3), or ⊥."""

    name: ClassVar[str] = "ptr.classic"
    summary: ClassVar[str] = (
        "Median of a bounded numeric column by classic propose-test-release: propose a local-sensitivity "
        "bound β, test the noisy distance to instability, release the noisy median or ⊥ "
        "(approximate DP: charged (ε, δ) on the δ-ledger)"
    )
    params_model: ClassVar[type[BaseModel]] = ClassicPtrParams

    def check(self, p: ClassicPtrParams, ctx: PublicContext) -> None:
        check_beta(numeric_column(ctx, p.column, "column"), p.beta, "beta")
        classic_plan(p)

    def approximate_charge(self, p: ClassicPtrParams, ctx: PublicContext) -> ApproximateCharge:
        return classic_plan(p).charge(ctx.orders)

    def run(self, p: ClassicPtrParams, ctx: PublicContext, table: Table, noise: Noise) -> Release:
        column = numeric_column(ctx, p.column, "column")
        pl = classic_plan(p)
        values = np.sort(clipped_column(table, column))
        lo, hi = float(column.min), float(column.max)
        distance = instability_distance(values, lo, hi, pl.beta, ctx.schema.neighboring)
        released = classic_ptr(pl, distance, lower_median(values, lo, hi), noise)
        output: dict[str, Any] = {
            "column": p.column,
            "beta": p.beta,
            "released": released is not None,
            "median": released,
            **pl.grid.describe(),
        }
        return self.release(p, ctx, output)


CLASSIC_PTR = ClassicPtr()
