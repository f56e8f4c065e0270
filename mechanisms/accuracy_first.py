"""Accuracy-first statistics: noise reduction over a grid, stopped at the first release meeting a target.

Service-facing adapters over ``mechanisms.noise_reduction`` (samplers, charges) and Ligett et al.'s
InteractiveAboveThreshold (``mechanisms.above_threshold``). Documentation with request examples:
docs/mechanisms/noise_reduction.md; proofs: docs/privacy.md §8.1.

One-shot mechanisms (``Mechanism``):

``accuracy_first.laplace``
    Laplace noise reduction (Ligett et al. Algorithm 1, per-coordinate coins) over an increasing ε-grid for a
    count/sum/mean/histogram query. The service walks the grid from the most private level and returns the
    first release that meets the target, or ``reached: false`` ("target not reachable within the grid") with
    the last level's release.
``accuracy_first.gaussian``
    Brownian noise reduction over a decreasing variance grid, same walk.

Targets (``target``):

* ``{"relative": r, "scale_multiplier": k}``: the check of Ghazi et al. §6.1 (notes/seed_003 §5.1) with the
  ``ŷ > 0`` fix: accept ŷ iff ŷ > 0 and (ŷ + σ)/(ŷ − σ) ≤ 1 + r, i.e. σ·(2 + r) ≤ r·ŷ, where σ = k × the
  noise scale (Laplace scale b, or Gaussian std √t); every coordinate of a histogram must pass. For r = 0.1,
  k = 1 this is b ≤ ŷ/21 (Table 1's rule).
* ``{"absolute": a, "confidence": 1 − β}``: accept the first level whose noise satisfies
  P(max_j |noise_j| ≤ a) ≥ 1 − β exactly (Laplace: (1 − e^{−a/b})^d; Gaussian: (1 − 2Φ(−a/√t))^d).

``check = "released"`` (default): the check reads only the released value and public noise parameters, so
it is post-processing of the released prefix: the stopped release at level t is charged exactly the level
(pure ε_t for Laplace, Theorem 2.7; α·Δ₂²/(2t) for Brownian, optional stopping), ``reached: false`` the last
level. An absolute target with the released check reads no value at all: its level is fixed by public
parameters, the worst case is that level, and an unreachable absolute target is refused before any data is
read.

``check = "private"``: the check reads the data, through InteractiveAboveThreshold (Ligett et al. Lemma 2.8)
on the query f_t(D) = min_j(r·|y_j| − |ŷ_{t,j} − y_j|) (relative; sensitivity (1 + r)·max shift) or
a − max_j |ŷ_{t,j} − y_j| (absolute; sensitivity max shift), passing when f_t + Lap(4Δ_q/ε_A) ≥ W +
Lap(2Δ_q/ε_A). Charge ε_A + (level charge) at the pass, ε_A + (last level charge) without a pass. ε_A and W
are given explicitly or by a labelled calibration (paper-theorem or reference-code) with width α and
failure γ. For the Brownian family the pure ε_A is added to the RDP curve at every order (proof in
docs/privacy.md §8.1.4).

Interactive sessions (``InteractiveMechanism``): ``noise_reduction.laplace`` and ``noise_reduction.gaussian``.
``start`` draws the level-0 noise of the lazy sampler without reading data; each ``step`` (query ``{}``)
releases the next, less noisy level; ``realized`` is the charge of the last released level (a function of
the transcript's length only); the worst case is the last level of the grid. The secret state (the current
noise) never appears in an answer.
"""

from __future__ import annotations

import itertools
import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Annotated, Any, ClassVar, Literal, Self

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator
from scipy import special

from mechanisms.above_threshold import (
    IatCalibration,
    InteractiveAboveThreshold,
    iat_paper_calibration,
    iat_reference_calibration,
)
from mechanisms.accounting import RdpCurve
from mechanisms.accounting.curve import _pad_up
from mechanisms.base import ParamsError, PublicContext, Release, StepResult, Table, params_as
from mechanisms.noise_reduction import (
    MAX_LEVELS,
    LazyBrownianNR,
    LazyLaplaceNR,
    brownian_nr_charge,
    brownian_nr_path,
    laplace_nr_charge,
    laplace_nr_path,
    laplace_nr_scales,
)
from mechanisms.queries import (
    AnyQuery,
    HistogramQuery,
    Query,
    check_query,
    evaluate,
    l1,
    l2,
    release_output,
    shifts,
)
from mechanisms.schema import CategoricalColumn, IntColumn

MAX_PATH_ENTRIES = 4_000_000
"""levels × output coordinates of an eager one-shot walk (memory bound; larger requests use a session)."""
NOT_REACHABLE = "target not reachable within the grid"

Epsilon = Annotated[float, Field(strict=True, ge=1e-9, le=100.0, allow_inf_nan=False)]
Variance = Annotated[float, Field(strict=True, gt=0.0, le=1e18, allow_inf_nan=False)]
Steps = list[tuple[dict[str, Any], dict[str, Any]]]


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# ----- parameter models ----------------------------------------------------------------------------------
class RelativeTarget(_Frozen):
    """Relative error r: accept ŷ iff ŷ > 0 and (ŷ + σ)/(ŷ − σ) ≤ 1 + r (σ = scale_multiplier × scale)."""

    relative: float = Field(strict=True, gt=0.0, le=10.0, allow_inf_nan=False, description="relative error r")
    scale_multiplier: float = Field(
        default=1.0,
        strict=True,
        gt=0.0,
        le=1e3,
        allow_inf_nan=False,
        description="σ = this × the noise scale (Laplace b or Gaussian std); 1 reproduces Ghazi et al. §6.1",
    )


class AbsoluteTarget(_Frozen):
    """Absolute error a: every coordinate's error ≤ a with probability ≥ confidence (released check)."""

    absolute: float = Field(strict=True, gt=0.0, le=1e15, allow_inf_nan=False, description="absolute error a")
    confidence: float | None = Field(
        default=None,
        strict=True,
        gt=0.0,
        lt=1.0,
        allow_inf_nan=False,
        description="1 − β for the released check (required there; not used by the private check)",
    )


class PrivateCheck(_Frozen):
    """InteractiveAboveThreshold parameters: explicit (ε_A, threshold) or a labelled calibration."""

    epsilon_a: float | None = Field(
        default=None, strict=True, ge=1e-9, le=100.0, allow_inf_nan=False, description="explicit ε_A"
    )
    threshold: float = Field(
        default=0.0,
        strict=True,
        ge=-1e15,
        le=1e15,
        allow_inf_nan=False,
        description="W with an explicit ε_A: pass when f_t + Lap(4Δ/ε_A) ≥ W + Lap(2Δ/ε_A) (f ≥ 0: met)",
    )
    calibration: Literal["paper", "reference"] | None = Field(
        default=None, description="paper-theorem (Ligett Thm A.1) or reference-code (note §2.11 C2/C3)"
    )
    width: float | None = Field(
        default=None, strict=True, gt=0.0, le=1e15, allow_inf_nan=False, description="α of the calibration"
    )
    failure: float | None = Field(
        default=None, strict=True, gt=0.0, lt=1.0, allow_inf_nan=False, description="γ of the calibration"
    )

    @model_validator(mode="after")
    def _one_way(self) -> Self:
        if (self.epsilon_a is None) == (self.calibration is None):
            raise ValueError("give either epsilon_a (with threshold) or calibration (with width and failure)")
        if self.calibration is not None and (self.width is None or self.failure is None):
            raise ValueError("a calibration needs width and failure")
        if self.calibration is None and (self.width is not None or self.failure is not None):
            raise ValueError("width and failure belong to a calibration")
        return self

    def resolve(self, query_sensitivity: float, levels: int) -> IatCalibration:
        """ε_A and W for this query's sensitivity and grid size (public information only)."""
        if self.epsilon_a is not None:
            return IatCalibration(self.epsilon_a, self.threshold, "explicit")
        assert self.width is not None
        assert self.failure is not None
        calibrate = iat_paper_calibration if self.calibration == "paper" else iat_reference_calibration
        try:
            calibration = calibrate(query_sensitivity, self.width, self.failure, levels)
        except ValueError as exc:
            raise ParamsError("private", str(exc)) from None
        if not (calibration.epsilon_a <= 100.0 and math.isfinite(calibration.threshold)):
            raise ParamsError("private", f"the calibration gives ε_A = {calibration.epsilon_a:g} (> 100)")
        return calibration


Target = RelativeTarget | AbsoluteTarget


class _OneShotParams(_Frozen):
    query: Query
    target: Target = Field(description="{relative: r} or {absolute: a, confidence: 1 − β}")
    check: Literal["released", "private"] = Field(
        default="released", description="released: free post-processing; private: InteractiveAboveThreshold"
    )
    private: PrivateCheck | None = Field(default=None, description="required iff check = private")

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if (self.check == "private") != (self.private is not None):
            raise ValueError("'private' is required with check = private and refused otherwise")
        if isinstance(self.target, AbsoluteTarget):
            if self.check == "released" and self.target.confidence is None:
                raise ValueError("an absolute target with the released check needs a confidence")
            if self.check == "private" and self.target.confidence is not None:
                raise ValueError("the private check does not use confidence (its failure is the IAT's γ)")
        return self


def _strictly(values: Sequence[float], increasing: bool, what: str) -> None:
    pairs = itertools.pairwise(values)
    if not all((b > a) if increasing else (b < a) for a, b in pairs):
        raise ValueError(f"{what} must be strictly {'increasing' if increasing else 'decreasing'}")


class LaplaceGridParams(_Frozen):
    epsilons: tuple[Epsilon, ...] = Field(
        min_length=1, max_length=MAX_LEVELS, description="strictly increasing ε-grid (most private first)"
    )

    @model_validator(mode="after")
    def _grid(self) -> Self:
        _strictly(self.epsilons, True, "epsilons")
        return self


class GaussianGridParams(_Frozen):
    variances: tuple[Variance, ...] = Field(
        min_length=1, max_length=MAX_LEVELS, description="strictly decreasing variances t (noisiest first)"
    )

    @model_validator(mode="after")
    def _grid(self) -> Self:
        _strictly(self.variances, False, "variances")
        return self


class LaplaceSessionParams(LaplaceGridParams):
    query: Query


class GaussianSessionParams(GaussianGridParams):
    query: Query


class LaplaceOneShotParams(_OneShotParams, LaplaceGridParams):
    """A query, an increasing ε-grid, a target and how it is checked."""


class GaussianOneShotParams(_OneShotParams, GaussianGridParams):
    """A query, a decreasing variance grid, a target and how it is checked."""


class NextQuery(_Frozen):
    """A session step has no parameters: ``{}`` asks for the next, less noisy level."""


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


class _Family(ABC):
    """What differs between Laplace and Brownian noise reduction: grid, sampler, scales and charges."""

    distribution: ClassVar[str]
    grid_field: ClassVar[str]

    def grid(self, params: BaseModel) -> tuple[float, ...]:
        """The request's grid: its ``grid_field`` (ε increasing, or variances decreasing)."""
        return tuple(getattr(params, self.grid_field))

    @staticmethod
    @abstractmethod
    def sensitivity(query: AnyQuery, ctx: PublicContext) -> float: ...

    @staticmethod
    @abstractmethod
    def scales(sensitivity: float, grid: Sequence[float]) -> np.ndarray:
        """The σ of each level that the relative check uses (Laplace scale b_t, or Gaussian std √t)."""

    @staticmethod
    @abstractmethod
    def path(sensitivity: float, grid: Sequence[float], dim: int, rng: np.random.Generator) -> np.ndarray: ...

    @staticmethod
    @abstractmethod
    def charge(
        sensitivity: float, grid: Sequence[float], level: int, orders: Sequence[float]
    ) -> RdpCurve: ...

    @staticmethod
    @abstractmethod
    def start(
        sensitivity: float, grid: Sequence[float], dim: int, rng: np.random.Generator
    ) -> dict[str, Any]: ...

    @staticmethod
    @abstractmethod
    def advance(state: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]: ...

    @staticmethod
    @abstractmethod
    def noise(state: dict[str, Any]) -> tuple[np.ndarray, int]: ...

    @staticmethod
    @abstractmethod
    def absolute_ok(scales: np.ndarray, absolute: float, confidence: float, dim: int) -> np.ndarray:
        """Per level: P(max_j |noise_j| ≤ a) ≥ confidence (exact, a function of public parameters)."""

    @staticmethod
    @abstractmethod
    def level_info(grid: Sequence[float], scales: np.ndarray, level: int) -> dict[str, Any]:
        """Public description of one level (its grid value and noise parameter)."""


class _LaplaceFamily(_Family):
    distribution = "laplace"
    grid_field = "epsilons"

    @staticmethod
    def sensitivity(query: AnyQuery, ctx: PublicContext) -> float:
        return l1(shifts(query, ctx))

    @staticmethod
    def scales(sensitivity: float, grid: Sequence[float]) -> np.ndarray:
        return laplace_nr_scales(sensitivity, grid)

    @staticmethod
    def path(sensitivity: float, grid: Sequence[float], dim: int, rng: np.random.Generator) -> np.ndarray:
        return laplace_nr_path(sensitivity, grid, dim, rng)

    @staticmethod
    def charge(sensitivity: float, grid: Sequence[float], level: int, orders: Sequence[float]) -> RdpCurve:
        return laplace_nr_charge(grid, level, orders)

    @staticmethod
    def start(
        sensitivity: float, grid: Sequence[float], dim: int, rng: np.random.Generator
    ) -> dict[str, Any]:
        return LazyLaplaceNR.start(sensitivity, grid, dim, rng)

    @staticmethod
    def advance(state: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
        return LazyLaplaceNR.advance(state, rng)

    @staticmethod
    def noise(state: dict[str, Any]) -> tuple[np.ndarray, int]:
        return LazyLaplaceNR.noise(state), LazyLaplaceNR.level(state)

    @staticmethod
    def absolute_ok(scales: np.ndarray, absolute: float, confidence: float, dim: int) -> np.ndarray:
        # (1 − e^{−a/b})^d ≥ c  ⟺  e^{−a/b} ≤ 1 − c^{1/d} = −expm1(log(c)/d); compared in log space.
        per_coordinate_miss = -math.expm1(math.log(confidence) / dim)
        result: np.ndarray = -absolute / scales <= math.log(per_coordinate_miss) - 1e-12
        return result

    @staticmethod
    def level_info(grid: Sequence[float], scales: np.ndarray, level: int) -> dict[str, Any]:
        noise = {"distribution": "laplace", "scale": float(scales[level])}
        return {"epsilon": float(grid[level]), "noise": noise}


class _GaussianFamily(_Family):
    distribution = "gaussian"
    grid_field = "variances"

    @staticmethod
    def sensitivity(query: AnyQuery, ctx: PublicContext) -> float:
        return l2(shifts(query, ctx))

    @staticmethod
    def scales(sensitivity: float, grid: Sequence[float]) -> np.ndarray:
        result: np.ndarray = np.sqrt(np.asarray(grid, dtype=float))
        return result

    @staticmethod
    def path(sensitivity: float, grid: Sequence[float], dim: int, rng: np.random.Generator) -> np.ndarray:
        return brownian_nr_path(grid, dim, rng)

    @staticmethod
    def charge(sensitivity: float, grid: Sequence[float], level: int, orders: Sequence[float]) -> RdpCurve:
        return brownian_nr_charge(sensitivity, grid, level, orders)

    @staticmethod
    def start(
        sensitivity: float, grid: Sequence[float], dim: int, rng: np.random.Generator
    ) -> dict[str, Any]:
        return LazyBrownianNR.start(grid, dim, rng)

    @staticmethod
    def advance(state: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
        return LazyBrownianNR.advance(state, rng)

    @staticmethod
    def noise(state: dict[str, Any]) -> tuple[np.ndarray, int]:
        return LazyBrownianNR.noise(state), LazyBrownianNR.level(state)

    @staticmethod
    def absolute_ok(scales: np.ndarray, absolute: float, confidence: float, dim: int) -> np.ndarray:
        # (1 − 2Φ(−a/σ))^d ≥ c  ⟺  2Φ(−a/σ) ≤ −expm1(log(c)/d); log Φ via scipy's log_ndtr.
        per_coordinate_miss = -math.expm1(math.log(confidence) / dim)
        log_miss: np.ndarray = math.log(2.0) + special.log_ndtr(-absolute / scales)
        result: np.ndarray = log_miss <= math.log(per_coordinate_miss) - 1e-12
        return result

    @staticmethod
    def level_info(grid: Sequence[float], scales: np.ndarray, level: int) -> dict[str, Any]:
        noise = {"distribution": "gaussian", "sigma": float(scales[level])}
        return {"variance": float(grid[level]), "noise": noise}


def _checked_query(family: _Family, query: AnyQuery, ctx: PublicContext) -> tuple[float, int]:
    """Schema checks; the sensitivity (> 0) and the output dimension, from public information."""
    check_query(query, ctx)
    sensitivity = family.sensitivity(query, ctx)
    if not (sensitivity > 0.0 and math.isfinite(sensitivity)):
        raise ParamsError("query", "the query has zero sensitivity under the declared bounds")
    return sensitivity, output_dim(query, ctx)


def _relative_pass(noisy: np.ndarray, sigma: np.ndarray, target: RelativeTarget) -> np.ndarray:
    """Per level (rows): every coordinate has ŷ > 0 and σ·(2 + r) ≤ r·ŷ (Ghazi's check, ŷ > 0 fix)."""
    r = target.relative
    s = target.scale_multiplier * sigma[:, None]
    result: np.ndarray = np.all((noisy > 0.0) & (s * (2.0 + r) <= r * noisy), axis=1)
    return result


def _private_query_sensitivity(query: AnyQuery, ctx: PublicContext, target: Target) -> float:
    """Sensitivity of f_t(D) for a fixed released ŷ_t (max coordinate shift, × (1 + r) when relative)."""
    largest = max(shifts(query, ctx))
    factor = 1.0 + target.relative if isinstance(target, RelativeTarget) else 1.0
    return _pad_up(largest * factor)


def _private_values(noisy: np.ndarray, truth: np.ndarray, target: Target) -> np.ndarray:
    """f_t(D) per level: min_j(r|y_j| − |ŷ_j − y_j|) (relative) or a − max_j |ŷ_j − y_j| (absolute)."""
    error = np.abs(noisy - truth[None, :])
    if isinstance(target, RelativeTarget):
        result: np.ndarray = np.min(target.relative * np.abs(truth)[None, :] - error, axis=1)
    else:
        result = target.absolute - np.max(error, axis=1)
    return result


def _plus_pure(curve: RdpCurve, epsilon: float) -> RdpCurve:
    """curve + the pure ε (constant at every order, added to the pure slot too)."""
    return curve + RdpCurve.from_pure(epsilon, curve.orders)


# ----- one-shot mechanisms -------------------------------------------------------------------------------
class AccuracyFirst:
    """Walk a noise-reduction grid and release the first level meeting the target (see module doc)."""

    family: ClassVar[_Family]
    name: ClassVar[str]
    summary: ClassVar[str]
    params_model: ClassVar[type[BaseModel]]
    cost_parameter: ClassVar[str]
    cost_increases_with_parameter: ClassVar[bool] = True

    def _params(self, params: BaseModel) -> _OneShotParams:
        return params_as(params_as(params, self.params_model), _OneShotParams)

    def _fixed_level(self, p: _OneShotParams, sensitivity: float, dim: int) -> int | None:
        """The level of an absolute target with the released check (public), None when unreachable."""
        assert isinstance(p.target, AbsoluteTarget)
        assert p.target.confidence is not None
        scales = self.family.scales(sensitivity, self.family.grid(p))
        ok = self.family.absolute_ok(scales, p.target.absolute, p.target.confidence, dim)
        return int(np.argmax(ok)) if bool(np.any(ok)) else None

    def check(self, params: BaseModel, ctx: PublicContext) -> None:
        p = self._params(params)
        sensitivity, dim = _checked_query(self.family, p.query, ctx)
        levels = len(self.family.grid(p))
        if levels * dim > MAX_PATH_ENTRIES:
            reason = f"levels × output size must be ≤ {MAX_PATH_ENTRIES} (use a noise_reduction session)"
            raise ParamsError(self.family.grid_field, reason)
        if isinstance(p.target, AbsoluteTarget) and p.check == "released":
            if self._fixed_level(p, sensitivity, dim) is None:
                raise ParamsError("target", f"{NOT_REACHABLE}: no level's noise meets the absolute target")
        if p.private is not None:
            p.private.resolve(_private_query_sensitivity(p.query, ctx, p.target), levels)

    def worst_case(self, params: BaseModel, ctx: PublicContext) -> RdpCurve:
        p = self._params(params)
        sensitivity, dim = _checked_query(self.family, p.query, ctx)
        grid = self.family.grid(p)
        if isinstance(p.target, AbsoluteTarget) and p.check == "released":
            level = self._fixed_level(p, sensitivity, dim)
            if level is None:
                raise ParamsError("target", NOT_REACHABLE)
            return self.family.charge(sensitivity, grid, level, ctx.orders)
        last = self.family.charge(sensitivity, grid, len(grid) - 1, ctx.orders)
        if p.private is None:
            return last
        calibration = p.private.resolve(_private_query_sensitivity(p.query, ctx, p.target), len(grid))
        return _plus_pure(last, calibration.epsilon_a)

    def run(self, params: BaseModel, ctx: PublicContext, table: Table, rng: np.random.Generator) -> Release:
        p = self._params(params)
        self.check(p, ctx)
        worst = self.worst_case(p, ctx)
        sensitivity, dim = _checked_query(self.family, p.query, ctx)
        grid = self.family.grid(p)
        scales = self.family.scales(sensitivity, grid)
        truth, labels = evaluate(p.query, ctx, table)
        if isinstance(p.target, AbsoluteTarget) and p.check == "released":
            # The level is fixed by public parameters: a single release at that level (the chain's
            # marginal there is exactly the level's noise, so only that level is drawn).
            level = self._fixed_level(p, sensitivity, dim)
            assert level is not None
            noisy = truth + self.family.path(sensitivity, grid[level : level + 1], dim, rng)[0]
            realized = self.family.charge(sensitivity, grid, level, ctx.orders)
            return self._release(grid, scales, level, noisy, labels, True, p.check, realized, worst)
        path = self.family.path(sensitivity, grid, dim, rng)
        noisy_path = truth[None, :] + path
        last = len(grid) - 1
        if p.private is None:
            assert isinstance(p.target, RelativeTarget)
            passed = _relative_pass(noisy_path, scales, p.target)
            reached = bool(np.any(passed))
            level = int(np.argmax(passed)) if reached else last
            realized = self.family.charge(sensitivity, grid, level, ctx.orders)
        else:
            q_sensitivity = _private_query_sensitivity(p.query, ctx, p.target)
            calibration = p.private.resolve(q_sensitivity, len(grid))
            # f_t(D) for every level (vectorised); the IAT reads them in order and stops at the first pass.
            values = _private_values(noisy_path, truth, p.target)
            iat = InteractiveAboveThreshold(calibration.threshold, calibration.epsilon_a, q_sensitivity, rng)
            level = next((t for t in range(len(grid)) if iat.test(float(values[t]), rng)), last)
            reached = iat.halted
            level_charge = self.family.charge(sensitivity, grid, level, ctx.orders)
            realized = _plus_pure(level_charge, calibration.epsilon_a)
        noisy = noisy_path[level]
        return self._release(grid, scales, level, noisy, labels, reached, p.check, realized, worst)

    def _release(
        self,
        grid: Sequence[float],
        scales: np.ndarray,
        level: int,
        noisy: np.ndarray,
        labels: list[str] | None,
        reached: bool,
        check: str,
        realized: RdpCurve,
        worst: RdpCurve,
    ) -> Release:
        assert realized <= worst
        info = self.family.level_info(grid, scales, level)
        output = release_output(noisy, labels, info.pop("noise"))
        output.update(info)
        output.update({"reached": reached, "level": level, "levels": len(grid), "check": check})
        if not reached:
            output["reason"] = NOT_REACHABLE
        return Release(output=output, realized=realized)


class AccuracyFirstLaplace(AccuracyFirst):
    family: ClassVar[_Family] = _LaplaceFamily()
    name: ClassVar[str] = "accuracy_first.laplace"
    summary: ClassVar[str] = (
        "Accuracy-first count/sum/mean/histogram: Laplace noise reduction over an increasing ε-grid, the "
        "first release meeting a relative or absolute target; pure ex-post ε of that level (+ ε_A if the "
        "check is private)."
    )
    params_model: ClassVar[type[BaseModel]] = LaplaceOneShotParams
    cost_parameter: ClassVar[str] = "epsilons"


class AccuracyFirstGaussian(AccuracyFirst):
    family: ClassVar[_Family] = _GaussianFamily()
    name: ClassVar[str] = "accuracy_first.gaussian"
    summary: ClassVar[str] = (
        "Accuracy-first count/sum/mean/histogram: Brownian noise reduction over a decreasing variance grid, "
        "the first release meeting the target; ex-post RDP α·Δ₂²/(2t) of that level (+ ε_A if the check "
        "is private)."
    )
    params_model: ClassVar[type[BaseModel]] = GaussianOneShotParams
    cost_parameter: ClassVar[str] = "variances"
    cost_increases_with_parameter: ClassVar[bool] = False


# ----- interactive sessions ------------------------------------------------------------------------------
class NoiseReductionSession:
    """A noise-reduction session: each step releases the next, less noisy level of one lazy chain.

    Secret state (JSON): ``{"mechanism": name, "sampler": <lazy sampler state>, "released": n,
    "halted": bool}``; the sampler holds the current noise. It never appears in answers or errors.
    Answers: ``{"level": t, "levels": k, "epsilon" | "variance": …, "value" | "values": …, "noise": {…}}``.
    """

    family: ClassVar[_Family]
    name: ClassVar[str]
    summary: ClassVar[str]
    params_model: ClassVar[type[BaseModel]]
    query_model: ClassVar[type[BaseModel]] = NextQuery

    def _params(self, params: BaseModel) -> BaseModel:
        return params_as(params, self.params_model)

    def _query(self, params: BaseModel) -> AnyQuery:
        query: AnyQuery = getattr(self._params(params), "query")  # noqa: B009 - field of a session model
        return query

    def check(self, params: BaseModel, ctx: PublicContext) -> None:
        _checked_query(self.family, self._query(params), ctx)

    def worst_case(self, params: BaseModel, ctx: PublicContext) -> RdpCurve:
        sensitivity, _ = _checked_query(self.family, self._query(params), ctx)
        grid = self.family.grid(self._params(params))
        return self.family.charge(sensitivity, grid, len(grid) - 1, ctx.orders)

    def check_query(self, params: BaseModel, ctx: PublicContext, query: BaseModel, asked: int) -> None:
        params_as(query, NextQuery)
        self.check(params, ctx)
        levels = len(self.family.grid(self._params(params)))
        if asked < 0:
            raise ValueError("asked must be ≥ 0")
        if asked >= levels:
            raise ParamsError("query", f"the session has already released all {levels} levels")

    def start(self, params: BaseModel, ctx: PublicContext, rng: np.random.Generator) -> dict[str, Any]:
        sensitivity, dim = _checked_query(self.family, self._query(params), ctx)
        sampler = self.family.start(sensitivity, self.family.grid(self._params(params)), dim, rng)
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
        params: BaseModel,
        ctx: PublicContext,
        state: dict[str, Any],
        query: BaseModel,
        table: Table,
        rng: np.random.Generator,
    ) -> StepResult:
        sampler, released = self._read_state(state)
        self.check_query(params, ctx, query, released)
        sensitivity, dim = _checked_query(self.family, self._query(params), ctx)
        grid = self.family.grid(self._params(params))
        if [float(g) for g in grid] != sampler.get(self.family.grid_field) or (
            "l1_sensitivity" in sampler and sampler["l1_sensitivity"] != sensitivity
        ):
            raise ValueError(f"not a {self.name} session state")  # the chain must be the one params describe
        if released > 0:
            sampler = self.family.advance(sampler, rng)
        noise, level = self.family.noise(sampler)
        if level != released or noise.size != dim:
            raise ValueError(f"not a {self.name} session state")
        truth, labels = evaluate(self._query(params), ctx, table)
        scales = self.family.scales(sensitivity, grid)
        info = self.family.level_info(grid, scales, level)
        answer = release_output(truth + noise, labels, info.pop("noise"))
        answer.update(info)
        answer.update({"level": level, "levels": len(grid)})
        halted = level == len(grid) - 1
        new_state = {"mechanism": self.name, "sampler": sampler, "released": released + 1, "halted": halted}
        return StepResult(answer, new_state, halted)

    def realized(self, params: BaseModel, ctx: PublicContext, steps: Steps, halted: bool) -> RdpCurve:
        """The charge of the last released level: the transcript's length − 1 (public), 0 if none."""
        sensitivity, _ = _checked_query(self.family, self._query(params), ctx)
        grid = self.family.grid(self._params(params))
        if len(steps) > len(grid):
            raise ValueError("the transcript is longer than the grid")
        for index, (query, answer) in enumerate(steps):
            NextQuery.model_validate(query)
            if answer.get("level") != index:
                raise ValueError(f"step {index} is not a {self.name} answer")
        if not steps:
            return RdpCurve.zero(ctx.orders)  # nothing was released: the data was never read
        return self.family.charge(sensitivity, grid, len(steps) - 1, ctx.orders)


class LaplaceNoiseReductionSession(NoiseReductionSession):
    family: ClassVar[_Family] = _LaplaceFamily()
    name: ClassVar[str] = "noise_reduction.laplace"
    summary: ClassVar[str] = (
        "Laplace noise-reduction session: each step releases the next, less noisy level of one correlated "
        "chain over an increasing ε-grid; pure ex-post ε of the last released level."
    )
    params_model: ClassVar[type[BaseModel]] = LaplaceSessionParams


class GaussianNoiseReductionSession(NoiseReductionSession):
    family: ClassVar[_Family] = _GaussianFamily()
    name: ClassVar[str] = "noise_reduction.gaussian"
    summary: ClassVar[str] = (
        "Brownian noise-reduction session: each step releases the next, less noisy level over a decreasing "
        "variance grid; ex-post RDP α·Δ₂²/(2t) of the last released level."
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
