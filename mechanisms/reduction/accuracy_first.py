"""Accuracy-first statistics: noise reduction over a grid, stopped at the first release meeting a target.

Service-facing adapters over ``mechanisms.reduction.noise_reduction`` (samplers, charges) and Ligett et al.'s
InteractiveAboveThreshold (``mechanisms.threshold.interactive``). Documentation with request examples:
docs/mechanisms/noise_reduction.md; proofs: docs/privacy/noise_reduction.md#noise-reduction.

One-shot mechanisms (``Mechanism``):

``accuracy_first.laplace``
    Discrete Laplace noise reduction on a public grid (Ligett et al. Algorithm 1 with the exact discrete
    decomposition of ``mechanisms.noise.reduction``, per-coordinate coins) over an increasing ε-grid for a
    count/sum/mean/histogram query. The service walks the grid from the most private level and returns the
    first release that meets the target, or ``reached: false`` ("target not reachable within the grid") with
    the last level's release.
``accuracy_first.gaussian``
    Brownian noise reduction on a public grid (discrete Gaussian bridge steps around rounded means) over a
    decreasing variance grid, same walk.

Every release is an exact multiple of the published γ (``noise.granularity``);
docs/privacy/noise_reduction.md#noise-reduction,
docs/privacy/finite_precision_reduction.md#fp-noise-reduction.

Targets (``target``):

* ``{"relative": r, "scale_multiplier": k}``: the check of Ghazi et al. 2024 §6.1 (Table 1) with the
  ``ŷ > 0`` fix: accept ŷ iff ŷ > 0 and (ŷ + σ)/(ŷ − σ) ≤ 1 + r, i.e. σ·(2 + r) ≤ r·ŷ, where σ = k × the
  noise scale (the discrete Laplace scale γ/x_t, or Gaussian std √t); every coordinate of a histogram must
  pass. For r = 0.1, k = 1 this is b ≤ ŷ/21 (Table 1's rule).
* ``{"absolute": a, "confidence": 1 − β}``: accept the first level whose error satisfies
  P(max_j |error_j| ≤ a) ≥ 1 − β (discrete Laplace exactly: (1 − 2q^{m+1}/(1 + q))^d, m = ⌊(a − rounding)/γ⌋;
  Gaussian: (1 − 2Φ(−a/√t))^d, the continuous law the grid chain approximates).

``check = "released"`` (default): the check reads only the released value and public noise parameters, so
it is post-processing of the released prefix: the stopped release at level t is charged exactly the level
(pure ε_t for Laplace, Theorem 2.7; α·C_t for Brownian, per-step composition), ``reached: false`` the last
level. An absolute target with the released check reads no value at all: its level is fixed by public
parameters, the worst case is that level, and an unreachable absolute target is refused before any data is
read.

``check = "private"``: the check reads the data, through InteractiveAboveThreshold (Ligett et al. Lemma 2.8)
on the query f_t(D) = min_j(r·|y_j| − |ŷ_{t,j} − y_j|) (relative; sensitivity (1 + r)·max_j γ·m_j) or
a − max_j |ŷ_{t,j} − y_j| (absolute; sensitivity max_j γ·m_j), y the grid answer γ·round(v/γ), passing
when f_t + Lap(4Δ_q/ε_A) ≥ W + Lap(2Δ_q/ε_A) (on the IAT's own grid,
``mechanisms.threshold.interactive``). Charge ε_A + (level charge) at the pass, ε_A + (last level charge)
without a pass. ε_A and W are given explicitly or by a labelled calibration (paper-theorem or reference-code)
with width α and failure γ. For the Brownian family the pure ε_A is added to the RDP curve at every order
(proof in docs/privacy/noise_reduction.md#accuracy-first-statistics).

Interactive sessions (``InteractiveMechanism``): ``noise_reduction.laplace`` and ``noise_reduction.gaussian``.
Laplace: ``start`` draws the level-0 integer noise of the lazy sampler without reading data; Gaussian: each
step draws a fresh bridge step around the previous release. Each ``step`` (query ``{}``) releases the next,
less noisy level; ``realized`` is the charge of the last released level (a function of
the transcript's length only); the worst case is the last level of the grid. The secret state (the current
noise) never appears in an answer.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Any, ClassVar

import numpy as np
from pydantic import BaseModel
from scipy import special

from mechanisms.accounting import UNITS_PER_EPSILON, RdpCurve, pad_up, units_up
from mechanisms.accounting.individual import UnitCharges, pure_units, slope_units
from mechanisms.base import ParamsChecked, ParamsError, PublicContext, Release, StepResult, Table
from mechanisms.data.schema import CategoricalColumn, IntColumn
from mechanisms.noise import Grid, Noise, float_up
from mechanisms.queries.individual import (
    IndividualTable,
    UnitStep,
    check_individual_query,
    individual_table,
    unit_step,
)
from mechanisms.queries.language import (
    MAX_SCALE_BITS,
    AnyQuery,
    GridPlan,
    HistogramQuery,
    charged_fraction,
    check_query,
    check_unit_grid,
    evaluate_units,
    is_integer_valued,
    l1,
    l2,
    plan_grid,
    release_output,
    shifts,
    unit_shift,
)
from mechanisms.reduction.accuracy_first_params import (
    AbsoluteTarget,
    GaussianOneShotParams,
    GaussianSessionParams,
    LaplaceOneShotParams,
    LaplaceSessionParams,
    NextQuery,
    OneShotParams,
    PrivateCheck,
    RelativeTarget,
    SessionParams,
    Target,
)
from mechanisms.reduction.noise_reduction import (
    LazyBrownianNR,
    LazyLaplaceNR,
    brownian_cumulative_costs,
    brownian_grid,
    brownian_nr_charge,
    brownian_step,
    brownian_unit_coefficients,
    laplace_nr_charge,
    laplace_nr_path,
    laplace_nr_scales,
    laplace_nr_unit_rate,
    units_to_values,
)
from mechanisms.reduction.nr_intervals import brownian_level_units, laplace_level_units, level_interval
from mechanisms.threshold.interactive import (
    InteractiveAboveThreshold,
)

MAX_PATH_ENTRIES = 4_000_000
"""levels × output coordinates of an eager one-shot walk (memory bound; larger requests use a session)."""
NOT_REACHABLE = "target not reachable within the grid"

Steps = list[tuple[dict[str, Any], dict[str, Any]]]


# ----- shared helpers ------------------------------------------------------------------------------------
def output_dim(query: AnyQuery, ctx: PublicContext) -> int:
    """Number of output coordinates, from the public schema only (1, or the histogram's bins)."""
    if not isinstance(query, HistogramQuery):
        return 1
    column = ctx.schema.column(query.column)
    if isinstance(column, CategoricalColumn):
        return len(column.values)
    if isinstance(column, IntColumn):
        return column.max - column.min + 1
    raise ParamsError("query.column", "a histogram needs a categorical or int column")


@dataclass(frozen=True)
class _Plan:
    """The public release plan of one request: grid, per-level noise, sensitivity (no data read)."""

    grid_values: tuple[float, ...]
    grid: Grid
    grid_plan: GridPlan
    dim: int
    sensitivity: float
    """In grid units: Laplace the ℓ1 bound Σ m_j (integer); Gaussian the ℓ2 bound ‖m‖₂."""
    scales: np.ndarray
    """The σ of each level that the relative check uses, in value units (Laplace γ·scale, Gaussian √t)."""


@dataclass(frozen=True)
class UnitShifts:
    """Per unit (sorted ids) its own shift of the grid answer, in grid units: ℓ1 and ℓ2² bounds, each capped
    at the public bound (``mechanisms.queries.individual.unit_step``). Secret: a function of its rows."""

    units: np.ndarray
    l1: np.ndarray
    squares: np.ndarray

    def subset(self, mask: np.ndarray) -> UnitShifts:
        return UnitShifts(self.units[mask], self.l1[mask], self.squares[mask])


class _Family(ABC):
    """What differs between Laplace and Brownian noise reduction: grid, sampler, scales and charges."""

    distribution: ClassVar[str]
    grid_field: ClassVar[str]

    def grid(self, params: BaseModel) -> tuple[float, ...]:
        """The request's grid: its ``grid_field`` (ε increasing, or variances decreasing)."""
        return tuple(getattr(params, self.grid_field))

    @abstractmethod
    def plan(self, query: AnyQuery, ctx: PublicContext, grid_values: Sequence[float]) -> _Plan:
        """The public plan (ParamsError when the grid cannot be released on a grid)."""

    @abstractmethod
    def charge(self, plan: _Plan, level: int, orders: Sequence[float]) -> RdpCurve: ...

    @abstractmethod
    def unit_charges(self, plan: _Plan, level: int, shifts: UnitShifts) -> UnitCharges:
        """Each unit's own charge of a release stopped at ``level``, from its own shift: never above the
        level's dataset charge (docs/privacy/individual.md#individual-noise-reduction-proof)."""

    @abstractmethod
    def walk(self, plan: _Plan, units: np.ndarray, noise: Noise) -> Iterator[np.ndarray]:
        """The released values (value units) of levels 0, 1, … in order (one chain, drawn once)."""

    @abstractmethod
    def release_at(self, plan: _Plan, level: int, units: np.ndarray, noise: Noise) -> np.ndarray:
        """The release at one level fixed by public parameters (its marginal in the chain)."""

    @abstractmethod
    def start(self, plan: _Plan, noise: Noise) -> dict[str, Any]: ...

    @abstractmethod
    def step(
        self, plan: _Plan, sampler: dict[str, Any], released: int, units: np.ndarray, noise: Noise
    ) -> tuple[np.ndarray, int, dict[str, Any]]:
        """Release level ``released`` of a session: (values, level, new sampler state)."""

    @abstractmethod
    def matches(self, plan: _Plan, sampler: dict[str, Any]) -> bool:
        """Whether a stored sampler state is the chain this plan describes."""

    @abstractmethod
    def absolute_ok(self, plan: _Plan, absolute: float, confidence: float) -> np.ndarray:
        """Per level: P(max_j |error_j| ≤ a) ≥ confidence (a function of public parameters)."""

    @abstractmethod
    def level_info(self, plan: _Plan, level: int) -> dict[str, Any]:
        """Public description of one level (its grid value, noise parameter and release grid)."""

    @abstractmethod
    def interval_units(self, plan: _Plan, confidence: float, parts: int) -> list[int]:
        """Per level, the half-width k_t (grid units) of its interval at 1 − (1 − confidence)/parts
        (``mechanisms.reduction.nr_intervals``; public parameters only)."""

    def interval(
        self,
        plan: _Plan,
        level: int,
        values: np.ndarray,
        labels: list[str] | None,
        confidence: float,
        parts: int,
    ) -> dict[str, Any]:
        """The interval of the release at ``level``, valid at all ``parts`` levels at once."""
        units = self.interval_units(plan, confidence, parts)[level]
        return level_interval(values, plan.grid, plan.grid_plan.exact, units, confidence, parts, labels)


def _values(plan: _Plan, units: np.ndarray) -> np.ndarray:
    return units_to_values([int(u) for u in units], plan.grid)


class _LaplaceFamily(_Family):
    distribution = "laplace"
    grid_field = "epsilons"

    def plan(self, query: AnyQuery, ctx: PublicContext, grid_values: Sequence[float]) -> _Plan:
        eps = [float(e) for e in grid_values]
        delta = l1(shifts(query, ctx))
        too_small = ParamsError("epsilons", "the smallest ε is too small: its noise would not fit the grid")
        try:  # the continuous scale of the noisiest level over 2^38 (as ``laplace_plan``): t_0 ≤ 2^40 units
            coarsest = math.ldexp(float(Fraction(delta) / charged_fraction(eps[0])), 2 - MAX_SCALE_BITS)
        except OverflowError:
            raise too_small from None
        grid_plan = plan_grid(query, ctx, coarsest)
        units = max(grid_plan.l1_units, 1)
        try:
            scales = laplace_nr_scales(float(units), eps)
        except ValueError as exc:
            raise ParamsError("epsilons", str(exc)) from None
        dim = output_dim(query, ctx)
        return _Plan(
            tuple(eps), grid_plan.grid, grid_plan, dim, float(units), scales * grid_plan.grid.granularity
        )

    def charge(self, plan: _Plan, level: int, orders: Sequence[float]) -> RdpCurve:
        return laplace_nr_charge(plan.grid_values, level, orders)

    def unit_charges(self, plan: _Plan, level: int, shifts: UnitShifts) -> UnitCharges:
        # pure x_t·‖δ_u‖₁ (Theorem D-2 at the unit's own shift), ≤ x_t·Δ_g ≤ ε_t: capped at the level's ε
        rate = laplace_nr_unit_rate(plan.sensitivity, plan.grid_values, level)
        pure = pure_units(shifts.l1, float_up(rate * UNITS_PER_EPSILON))
        ceiling = units_up(float(plan.grid_values[level])) or 0
        return UnitCharges(shifts.units, np.minimum(pure, ceiling), np.zeros(shifts.units.size, np.int64))

    def walk(self, plan: _Plan, units: np.ndarray, noise: Noise) -> Iterator[np.ndarray]:
        path = laplace_nr_path(plan.sensitivity, plan.grid_values, plan.dim, noise)
        for row in path:
            yield _values(plan, units.astype(object) + row.astype(object))

    def release_at(self, plan: _Plan, level: int, units: np.ndarray, noise: Noise) -> np.ndarray:
        # The chain's marginal at a level is that level's discrete Laplace: draw only it.
        path = laplace_nr_path(plan.sensitivity, plan.grid_values[level : level + 1], plan.dim, noise)
        return _values(plan, units.astype(object) + path[0].astype(object))

    def start(self, plan: _Plan, noise: Noise) -> dict[str, Any]:
        return LazyLaplaceNR.start(plan.sensitivity, plan.grid_values, plan.dim, noise)

    def step(
        self, plan: _Plan, sampler: dict[str, Any], released: int, units: np.ndarray, noise: Noise
    ) -> tuple[np.ndarray, int, dict[str, Any]]:
        if released > 0:
            sampler = LazyLaplaceNR.advance(sampler, noise)
        chain = LazyLaplaceNR.noise(sampler)
        if chain.size != units.size:
            raise ValueError("not a noise_reduction.laplace session state")
        return (
            _values(plan, units.astype(object) + chain.astype(object)),
            LazyLaplaceNR.level(sampler),
            sampler,
        )

    def matches(self, plan: _Plan, sampler: dict[str, Any]) -> bool:
        return bool(
            sampler.get("epsilons") == [float(e) for e in plan.grid_values]
            and sampler.get("grid_sensitivity") == plan.sensitivity
        )

    def absolute_ok(self, plan: _Plan, absolute: float, confidence: float) -> np.ndarray:
        # |error| ≤ γ/2 (rounding, unless exact) + γ|Z|: enough that |Z| ≤ m = ⌊(a − rounding)/γ⌋.
        # P(|Z| > m) = 2q^{m+1}/(1+q), q = e^{−1/scale}; need (1 − that)^d ≥ c; compared in log space.
        gamma = plan.grid.granularity
        rounding = 0.0 if plan.grid_plan.exact else gamma / 2
        m = math.floor((absolute - rounding) / gamma)
        if m < 0:
            return np.zeros(len(plan.grid_values), dtype=bool)
        per_coordinate_miss = -math.expm1(math.log(confidence) / plan.dim)
        x = gamma / plan.scales  # the rate of each level (value-unit scales back to grid units)
        log_miss = math.log(2.0) - x * (m + 1) - np.log1p(np.exp(-x))
        result: np.ndarray = log_miss <= math.log(per_coordinate_miss) - 1e-12
        return result

    def level_info(self, plan: _Plan, level: int) -> dict[str, Any]:
        noise = {
            "distribution": "discrete_laplace",
            "scale": float(plan.scales[level]),
            **plan.grid.describe(),
        }
        return {"epsilon": float(plan.grid_values[level]), "noise": noise}

    def interval_units(self, plan: _Plan, confidence: float, parts: int) -> list[int]:
        return laplace_level_units(plan.sensitivity, plan.grid_values, confidence, parts)


class _GaussianFamily(_Family):
    distribution = "gaussian"
    grid_field = "variances"

    def plan(self, query: AnyQuery, ctx: PublicContext, grid_values: Sequence[float]) -> _Plan:
        variances = tuple(float(v) for v in grid_values)
        delta = l2(shifts(query, ctx))
        dim = output_dim(query, ctx)
        try:
            grid = brownian_grid(delta, variances, dim)
        except (ValueError, OverflowError) as exc:
            raise ParamsError("variances", str(exc)) from None
        # The answer is rounded to γ once (``evaluate_units``); its per-coordinate integer shifts m_i enter
        # every step's sensitivity as (1 − r_j)·‖m‖₂ + √d (``brownian_step_costs`` with Δ = ‖m‖₂·γ).
        exact = is_integer_valued(query, ctx) and grid.exponent <= 0
        check_unit_grid(query, ctx, exact)
        units = tuple(unit_shift(s, grid, exact) for s in shifts(query, ctx))
        grid_plan = GridPlan(grid, exact, units)
        sensitivity = grid_plan.l2_units  # ‖m‖₂ in grid units
        scales: np.ndarray = np.sqrt(np.asarray(variances, dtype=float))
        return _Plan(variances, grid, grid_plan, dim, sensitivity, scales)

    def charge(self, plan: _Plan, level: int, orders: Sequence[float]) -> RdpCurve:
        return brownian_nr_charge(plan.sensitivity, plan.grid_values, plan.dim, plan.grid, level, orders)

    def unit_charges(self, plan: _Plan, level: int, shifts: UnitShifts) -> UnitCharges:
        # α·(P_S‖δ‖₂² + Q_S‖δ‖₁ + R_S·#cells) (Theorem B-1 at the unit's own shift δ; the unit moves at most
        # min(‖δ‖₁, d) cells), ≤ the dataset's α·C_S: capped there
        squares, linear, cells = brownian_unit_coefficients(plan.grid_values, plan.grid, level)
        moved = np.minimum(shifts.l1, plan.dim)
        slope = (
            slope_units(shifts.squares, float_up(squares * UNITS_PER_EPSILON))
            + slope_units(shifts.l1, float_up(linear * UNITS_PER_EPSILON))
            + slope_units(moved, float_up(cells * UNITS_PER_EPSILON))
        )
        costs = brownian_cumulative_costs(plan.sensitivity, plan.grid_values, plan.dim, plan.grid)
        ceiling = units_up(costs[level]) or 0
        return UnitCharges(shifts.units, np.zeros(shifts.units.size, np.int64), np.minimum(slope, ceiling))

    def walk(self, plan: _Plan, units: np.ndarray, noise: Noise) -> Iterator[np.ndarray]:
        previous: list[int] | None = None
        for level in range(len(plan.grid_values)):
            previous = brownian_step(noise, units, previous, level, plan.grid_values, plan.grid)
            yield _values(plan, np.asarray(previous, dtype=object))

    def release_at(self, plan: _Plan, level: int, units: np.ndarray, noise: Noise) -> np.ndarray:
        # The chain is defined forward: walk it to the level (charged as the whole prefix, which it covers).
        for index, values in enumerate(self.walk(plan, units, noise)):
            if index == level:
                return values
        raise ValueError("level outside the grid")

    def start(self, plan: _Plan, noise: Noise) -> dict[str, Any]:
        return LazyBrownianNR.start(plan.sensitivity, plan.grid_values, plan.dim, plan.grid)

    def step(
        self, plan: _Plan, sampler: dict[str, Any], released: int, units: np.ndarray, noise: Noise
    ) -> tuple[np.ndarray, int, dict[str, Any]]:
        if sampler.get("level") != released:
            raise ValueError("not a noise_reduction.gaussian session state")
        released_units, sampler = LazyBrownianNR.step(sampler, units, noise)
        return _values(plan, np.asarray(released_units, dtype=object)), released, sampler

    def matches(self, plan: _Plan, sampler: dict[str, Any]) -> bool:
        return bool(
            sampler.get("variances") == [float(v) for v in plan.grid_values]
            and sampler.get("unit_l2") == plan.sensitivity
            and sampler.get("dim") == plan.dim
            and sampler.get("grid_exponent") == plan.grid.exponent
        )

    def absolute_ok(self, plan: _Plan, absolute: float, confidence: float) -> np.ndarray:
        # (1 − 2Φ(−a/σ))^d ≥ c with σ = √t: the continuous chain's law; the grid chain's error differs by
        # discrete noise and roundings of order γ ≤ 2^-10·Δ₂ (accuracy only, never privacy).
        per_coordinate_miss = -math.expm1(math.log(confidence) / plan.dim)
        log_miss: np.ndarray = math.log(2.0) + special.log_ndtr(-absolute / plan.scales)
        result: np.ndarray = log_miss <= math.log(per_coordinate_miss) - 1e-12
        return result

    def level_info(self, plan: _Plan, level: int) -> dict[str, Any]:
        noise = {
            "distribution": "discrete_gaussian_bridge",
            "sigma": float(plan.scales[level]),
            **plan.grid.describe(),
        }
        return {"variance": float(plan.grid_values[level]), "noise": noise}

    def interval_units(self, plan: _Plan, confidence: float, parts: int) -> list[int]:
        return brownian_level_units(plan.grid_values, plan.grid, confidence, parts)


def _checked_plan(
    family: _Family, query: AnyQuery, ctx: PublicContext, grid_values: Sequence[float]
) -> _Plan:
    """Schema checks, then the public plan; the sensitivity must be > 0 (public information only)."""
    check_query(query, ctx)
    sensitivity = l1(shifts(query, ctx)) if family.distribution == "laplace" else l2(shifts(query, ctx))
    if not (sensitivity > 0.0 and math.isfinite(sensitivity)):
        raise ParamsError("query", "the query has zero sensitivity under the declared bounds")
    return family.plan(query, ctx, grid_values)


def _check_confidence(family: _Family, plan: _Plan, confidence: float) -> None:
    """The interval's per-level confidence is computable (refused here when too close to 1)."""
    try:
        family.interval_units(plan, confidence, len(plan.grid_values))
    except ValueError as exc:
        raise ParamsError("confidence", str(exc)) from None


def relative_pass(noisy: np.ndarray, sigma: np.ndarray, target: RelativeTarget) -> np.ndarray:
    """Per level (rows): every coordinate has ŷ > 0 and σ·(2 + r) ≤ r·ŷ (Ghazi's check, ŷ > 0 fix)."""
    r = target.relative
    s = target.scale_multiplier * sigma[:, None]
    result: np.ndarray = np.all((noisy > 0.0) & (s * (2.0 + r) <= r * noisy), axis=1)
    return result


def _private_query_sensitivity(plan: _Plan, target: Target) -> float:
    """Sensitivity of f_t(D) for a fixed released ŷ_t: f_t is computed from the grid answer γ·round(v/γ),
    whose coordinates move by ≤ γ·m_j, so Δ_q = (max_j γ·m_j) × (1 + r) when relative (rounded up)."""
    largest = max(plan.grid_plan.unit_shifts) * plan.grid.granularity
    factor = 1.0 + target.relative if isinstance(target, RelativeTarget) else 1.0
    return pad_up(largest * factor)


def _private_values(noisy: np.ndarray, truth: np.ndarray, target: Target) -> float:
    """f_t(D) of one level: min_j(r|y_j| − |ŷ_j − y_j|) (relative) or a − max_j |ŷ_j − y_j| (absolute).

    Computed in exact rationals and rounded once to a float (relative error ≤ 2^-53), so the only float
    error the threshold test's grid must absorb is that one rounding, whatever the magnitudes (the
    InteractiveAboveThreshold grid's 2^-6-unit slack covers it up to its ±2^44-unit clamp)."""
    released = [Fraction(float(v)) for v in np.ravel(noisy)]
    answers = [Fraction(float(v)) for v in np.ravel(truth)]
    errors = [abs(a - b) for a, b in zip(released, answers, strict=True)]
    if isinstance(target, RelativeTarget):
        r = Fraction(target.relative)
        return float(min(r * abs(y) - e for y, e in zip(answers, errors, strict=True)))
    return float(Fraction(target.absolute) - max(errors))


def _plus_pure(curve: RdpCurve, epsilon: float) -> RdpCurve:
    """curve + the pure ε (constant at every order, added to the pure slot too)."""
    return curve + RdpCurve.from_pure(epsilon, curve.orders)


# ----- one-shot mechanisms -------------------------------------------------------------------------------
class AccuracyFirst(ParamsChecked):
    """Walk a noise-reduction grid and release the first level meeting the target (see module doc)."""

    family: ClassVar[_Family]
    name: ClassVar[str]
    summary: ClassVar[str]
    params_model: ClassVar[type[BaseModel]]
    cost_parameter: ClassVar[str]
    cost_increases_with_parameter: ClassVar[bool] = True

    def _plan(self, p: OneShotParams, ctx: PublicContext) -> _Plan:
        return _checked_plan(self.family, p.query, ctx, self.family.grid(p))

    def _fixed_level(self, p: OneShotParams, plan: _Plan) -> int | None:
        """The level of an absolute target with the released check (public), None when unreachable."""
        assert isinstance(p.target, AbsoluteTarget)
        assert p.target.confidence is not None
        ok = self.family.absolute_ok(plan, p.target.absolute, p.target.confidence)
        return int(np.argmax(ok)) if bool(np.any(ok)) else None

    def check(self, p: OneShotParams, ctx: PublicContext) -> None:
        check_query(p.query, ctx)
        if ctx.schema.individual:
            check_individual_query(p.query)
        levels = len(self.family.grid(p))
        if levels * output_dim(p.query, ctx) > MAX_PATH_ENTRIES:
            reason = f"levels × output size must be ≤ {MAX_PATH_ENTRIES} (use a noise_reduction session)"
            raise ParamsError(self.family.grid_field, reason)
        plan = self._plan(p, ctx)
        _check_confidence(self.family, plan, p.confidence)
        if isinstance(p.target, AbsoluteTarget) and p.check == "released":
            if self._fixed_level(p, plan) is None:
                raise ParamsError("target", f"{NOT_REACHABLE}: no level's noise meets the absolute target")
        if p.private is not None:
            p.private.resolve(_private_query_sensitivity(plan, p.target), levels)

    def worst_case(self, p: OneShotParams, ctx: PublicContext) -> RdpCurve:
        plan = self._plan(p, ctx)
        levels = len(plan.grid_values)
        if isinstance(p.target, AbsoluteTarget) and p.check == "released":
            level = self._fixed_level(p, plan)
            if level is None:
                raise ParamsError("target", NOT_REACHABLE)
            return self.family.charge(plan, level, ctx.orders)
        last = self.family.charge(plan, levels - 1, ctx.orders)
        if p.private is None:
            return last
        calibration = p.private.resolve(_private_query_sensitivity(plan, p.target), levels)
        return _plus_pure(last, calibration.epsilon_a)

    def run(self, p: OneShotParams, ctx: PublicContext, table: Table, noise: Noise) -> Release:
        self.check(p, ctx)
        worst = self.worst_case(p, ctx)
        plan = self._plan(p, ctx)
        shifts: UnitShifts | None = None
        individual = individual_table(ctx, table)
        if individual is None:
            units, labels = evaluate_units(p.query, ctx, table, plan.grid_plan)
        else:
            step, shifts = self._admitted(p, ctx, individual, plan)
            units, labels = step.answer_units, step.labels
        if isinstance(p.target, AbsoluteTarget) and p.check == "released":
            # The level is fixed by public parameters: a single release at that level.
            level = self._fixed_level(p, plan)
            assert level is not None
            noisy = self.family.release_at(plan, level, units, noise)
            realized = self.family.charge(plan, level, ctx.orders)
            charges = None if shifts is None else self._unit_charges(p, plan, level, shifts)
            interval = self.family.interval(plan, level, noisy, labels, p.confidence, 1)  # no selection
            return self._release(
                plan, level, noisy, labels, True, p.check, realized, worst, interval, charges
            )
        last = len(plan.grid_values) - 1
        walk = self.family.walk(plan, units, noise)
        if p.private is None:
            assert isinstance(p.target, RelativeTarget)
            # The walk stops at the first level whose released value passes (a rule on released values and
            # public scales only); levels beyond are never drawn (Brownian) or never released (Laplace).
            level, noisy, reached = last, np.zeros(0), False
            for index, values in enumerate(walk):
                level, noisy = index, values
                if bool(relative_pass(values[None, :], plan.scales[index : index + 1], p.target)[0]):
                    reached = True
                    break
            realized = self.family.charge(plan, level, ctx.orders)
        else:
            q_sensitivity = _private_query_sensitivity(plan, p.target)
            calibration = p.private.resolve(q_sensitivity, len(plan.grid_values))
            truth = _values(plan, units)  # the grid answer γ·round(v/γ): moves by ≤ γ·m_j per coordinate
            iat = InteractiveAboveThreshold(
                calibration.threshold, calibration.epsilon_a, q_sensitivity, noise
            )
            level, noisy = last, np.zeros(0)
            for index, values in enumerate(walk):
                level, noisy = index, values
                if iat.test(_private_values(values, truth, p.target), noise):
                    break
            reached = iat.halted
            level_charge = self.family.charge(plan, level, ctx.orders)
            realized = _plus_pure(level_charge, calibration.epsilon_a)
        charges = None if shifts is None else self._unit_charges(p, plan, level, shifts)
        # the level depends on released values (or the data): the interval holds at every level at once
        interval = self.family.interval(plan, level, noisy, labels, p.confidence, len(plan.grid_values))
        return self._release(plan, level, noisy, labels, reached, p.check, realized, worst, interval, charges)

    # ----- individual accounting (docs/privacy/individual.md#individual-noise-reduction-proof) -----
    def _worst_level(self, p: OneShotParams, plan: _Plan) -> int:
        """The level a unit may pay at most (public): the absolute released check's fixed level, else the
        last (least noisy) level of the grid."""
        if isinstance(p.target, AbsoluteTarget) and p.check == "released":
            level = self._fixed_level(p, plan)
            if level is None:
                raise ParamsError("target", NOT_REACHABLE)
            return level
        return len(plan.grid_values) - 1

    def _unit_charges(self, p: OneShotParams, plan: _Plan, level: int, shifts: UnitShifts) -> UnitCharges:
        """The family's per-unit charge at ``level``, plus the private check's pure ε_A for every unit whose
        removal moves the grid answer (InteractiveAboveThreshold reads it; a unit that moves nothing leaves
        every f_t unchanged)."""
        charges = self.family.unit_charges(plan, level, shifts)
        if p.private is None:
            return charges
        calibration = p.private.resolve(_private_query_sensitivity(plan, p.target), len(plan.grid_values))
        extra = np.where(shifts.l1 > 0, units_up(calibration.epsilon_a) or 0, 0).astype(np.int64)
        return UnitCharges(charges.units, charges.pure + extra, charges.slope)

    def _admitted(
        self, p: OneShotParams, ctx: PublicContext, table: IndividualTable, plan: _Plan
    ) -> tuple[UnitStep, UnitShifts]:
        """The answer over the units that can afford their worst case (their charge at the worst level,
        decided before anything is computed or released) and those units' shifts."""
        worst_level = self._worst_level(p, plan)
        seen: list[UnitShifts] = []

        def charge(units: np.ndarray, l1: np.ndarray, squares: np.ndarray) -> UnitCharges:
            seen.append(UnitShifts(units, l1, squares))
            return self._unit_charges(p, plan, worst_level, seen[-1])

        step = unit_step(p.query, ctx, table, plan.grid_plan, charge)
        shifts = seen[-1]
        return step, shifts.subset(np.isin(shifts.units, step.charges.units))

    def unit_step(
        self, p: OneShotParams, ctx: PublicContext, table: IndividualTable, level: int | None = None
    ) -> UnitStep:
        """The answer over the admitted units and their charges at the released ``level`` (read from the
        release's output; None: the worst level, the admission charge). Deterministic (no noise): ``expost
        ledger verify`` replays it to rebuild the units' filters."""
        plan = self._plan(p, ctx)
        step, shifts = self._admitted(p, ctx, table, plan)
        if level is None:
            return step
        return replace(step, charges=self._unit_charges(p, plan, level, shifts))

    def released_unit_step(
        self, p: OneShotParams, ctx: PublicContext, table: IndividualTable, output: Mapping[str, Any]
    ) -> UnitStep:
        """``unit_step`` at the level the stored release stopped at (``output["level"]``, public): what the
        run charged its units (``ReleaseDependentUnits``, for the ledger's replay)."""
        level = output.get("level")
        if isinstance(level, bool) or not isinstance(level, int):
            raise ValueError("the release has no level")
        return self.unit_step(p, ctx, table, level)

    def _release(
        self,
        plan: _Plan,
        level: int,
        noisy: np.ndarray,
        labels: list[str] | None,
        reached: bool,
        check: str,
        realized: RdpCurve,
        worst: RdpCurve,
        interval: dict[str, Any],
        units: UnitCharges | None = None,
    ) -> Release:
        assert realized <= worst
        info = self.family.level_info(plan, level)
        output = release_output(noisy, labels, info.pop("noise"), interval)
        output.update(info)
        output.update({"reached": reached, "level": level, "levels": len(plan.grid_values), "check": check})
        if not reached:
            output["reason"] = NOT_REACHABLE
        return Release(output=output, realized=realized, units=units)


class AccuracyFirstLaplace(AccuracyFirst):
    family: ClassVar[_Family] = _LaplaceFamily()
    name: ClassVar[str] = "accuracy_first.laplace"
    summary: ClassVar[str] = (
        "Accuracy-first count/sum/mean/histogram: discrete Laplace noise reduction on a public grid over an "
        "increasing ε-grid, the first release meeting a relative or absolute target; pure ex-post ε of that "
        "level (+ ε_A if the check is private)."
    )
    params_model: ClassVar[type[BaseModel]] = LaplaceOneShotParams
    cost_parameter: ClassVar[str] = "epsilons"


class AccuracyFirstGaussian(AccuracyFirst):
    family: ClassVar[_Family] = _GaussianFamily()
    name: ClassVar[str] = "accuracy_first.gaussian"
    summary: ClassVar[str] = (
        "Accuracy-first count/sum/mean/histogram: Brownian noise reduction on a public grid (discrete "
        "Gaussian bridge steps) over a decreasing variance grid, the first release meeting the target; "
        "ex-post RDP ≈ (1 + 2^-10)²·α·Δ₂²/(2t) of that level (+ ε_A if the check is private)."
    )
    params_model: ClassVar[type[BaseModel]] = GaussianOneShotParams
    cost_parameter: ClassVar[str] = "variances"
    cost_increases_with_parameter: ClassVar[bool] = False


# ----- interactive sessions ------------------------------------------------------------------------------
class NoiseReductionSession(ParamsChecked):
    """A noise-reduction session: each step releases the next, less noisy level of one chain.

    Secret state (JSON): ``{"mechanism": name, "sampler": <sampler state>, "released": n,
    "halted": bool}``; the Laplace sampler holds the current integer noise. It never appears in answers or
    errors. Answers: ``{"level": t, "levels": k, "epsilon" | "variance": …, "value" | "values": …,
    "noise": {…, "granularity": γ}}``.
    """

    family: ClassVar[_Family]
    name: ClassVar[str]
    summary: ClassVar[str]
    params_model: ClassVar[type[BaseModel]]
    query_model: ClassVar[type[BaseModel]] = NextQuery

    def _plan(self, p: SessionParams, ctx: PublicContext) -> _Plan:
        return _checked_plan(self.family, p.query, ctx, self.family.grid(p))

    def check(self, p: SessionParams, ctx: PublicContext) -> None:
        _check_confidence(self.family, self._plan(p, ctx), p.confidence)

    def worst_case(self, p: SessionParams, ctx: PublicContext) -> RdpCurve:
        plan = self._plan(p, ctx)
        return self.family.charge(plan, len(plan.grid_values) - 1, ctx.orders)

    def check_query(self, p: SessionParams, ctx: PublicContext, query: NextQuery, asked: int) -> None:
        self.check(p, ctx)
        levels = len(self.family.grid(p))
        if asked < 0:
            raise ValueError("asked must be ≥ 0")
        if asked >= levels:
            raise ParamsError("query", f"the session has already released all {levels} levels")

    def start(self, p: SessionParams, ctx: PublicContext, noise: Noise) -> dict[str, Any]:
        sampler = self.family.start(self._plan(p, ctx), noise)
        return {"mechanism": self.name, "sampler": sampler, "released": 0, "halted": False}

    def _read_state(self, state: dict[str, Any]) -> tuple[dict[str, Any], int]:
        expected = {"mechanism", "sampler", "released", "halted"}
        if not isinstance(state, dict) or set(state) != expected or state["mechanism"] != self.name:
            raise ValueError(f"not a {self.name} session state")
        released, sampler = state["released"], state["sampler"]
        if isinstance(released, bool) or not isinstance(released, int) or released < 0:
            raise ValueError(f"not a {self.name} session state")
        if not isinstance(sampler, dict):
            raise ValueError(f"not a {self.name} session state")
        if state["halted"] is not False:
            raise ValueError("the session has halted")
        return sampler, released

    def step(
        self,
        p: SessionParams,
        ctx: PublicContext,
        state: dict[str, Any],
        query: NextQuery,
        table: Table,
        noise: Noise,
    ) -> StepResult:
        sampler, released = self._read_state(state)
        self.check_query(p, ctx, query, released)
        plan = self._plan(p, ctx)
        if not self.family.matches(plan, sampler):
            raise ValueError(f"not a {self.name} session state")  # the chain must be the one params describe
        units, labels = evaluate_units(p.query, ctx, table, plan.grid_plan)
        values, level, sampler = self.family.step(plan, sampler, released, units, noise)
        if level != released or values.size != plan.dim:
            raise ValueError(f"not a {self.name} session state")
        info = self.family.level_info(plan, level)
        # valid at every step of the session at once (a union bound over the grid's levels)
        interval = self.family.interval(plan, level, values, labels, p.confidence, len(plan.grid_values))
        answer = release_output(values, labels, info.pop("noise"), interval)
        answer.update(info)
        answer.update({"level": level, "levels": len(plan.grid_values)})
        halted = level == len(plan.grid_values) - 1
        new_state = {"mechanism": self.name, "sampler": sampler, "released": released + 1, "halted": halted}
        return StepResult(answer, new_state, halted)

    def realized(self, p: SessionParams, ctx: PublicContext, steps: Steps, halted: bool) -> RdpCurve:
        """The charge of the last released level: the transcript's length − 1 (public), 0 if none."""
        plan = self._plan(p, ctx)
        if len(steps) > len(plan.grid_values):
            raise ValueError("the transcript is longer than the grid")
        for index, (query, answer) in enumerate(steps):
            NextQuery.model_validate(query)
            if answer.get("level") != index:
                raise ValueError(f"step {index} is not a {self.name} answer")
        if not steps:
            return RdpCurve.zero(ctx.orders)  # nothing was released: the data was never read
        return self.family.charge(plan, len(steps) - 1, ctx.orders)


class LaplaceNoiseReductionSession(NoiseReductionSession):
    family: ClassVar[_Family] = _LaplaceFamily()
    name: ClassVar[str] = "noise_reduction.laplace"
    summary: ClassVar[str] = (
        "Laplace noise-reduction session on a public grid: each step releases the next, less noisy level "
        "of one correlated discrete Laplace chain over an increasing ε-grid; pure ex-post ε of the last "
        "released level."
    )
    params_model: ClassVar[type[BaseModel]] = LaplaceSessionParams


class GaussianNoiseReductionSession(NoiseReductionSession):
    family: ClassVar[_Family] = _GaussianFamily()
    name: ClassVar[str] = "noise_reduction.gaussian"
    summary: ClassVar[str] = (
        "Brownian noise-reduction session on a public grid: each step releases the next, less noisy level "
        "over a decreasing variance grid (a discrete Gaussian bridge step); ex-post RDP ≈ (1 + 2^-10)²·"
        "α·Δ₂²/(2t) of the last released level (the sum of its steps' curves)."
    )
    params_model: ClassVar[type[BaseModel]] = GaussianSessionParams


ACCURACY_FIRST_LAPLACE = AccuracyFirstLaplace()
ACCURACY_FIRST_GAUSSIAN = AccuracyFirstGaussian()
NR_LAPLACE_SESSION = LaplaceNoiseReductionSession()
NR_GAUSSIAN_SESSION = GaussianNoiseReductionSession()

__all__ = [
    "ACCURACY_FIRST_GAUSSIAN",
    "ACCURACY_FIRST_LAPLACE",
    "NR_GAUSSIAN_SESSION",
    "NR_LAPLACE_SESSION",
    "AbsoluteTarget",
    "AccuracyFirstGaussian",
    "AccuracyFirstLaplace",
    "GaussianNoiseReductionSession",
    "LaplaceNoiseReductionSession",
    "NextQuery",
    "PrivateCheck",
    "RelativeTarget",
    "output_dim",
]
