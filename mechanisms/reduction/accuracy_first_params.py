"""The parameter models of the accuracy-first statistics and of the noise-reduction sessions (public inputs
only): targets, the private check (InteractiveAboveThreshold), the ε- or variance grids. The mechanisms that
run them: ``mechanisms.reduction.accuracy_first``."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Annotated, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from mechanisms.base import ParamsError
from mechanisms.queries.intervals import ConfidenceLevel
from mechanisms.queries.language import Query
from mechanisms.reduction.noise_reduction import MAX_LEVELS
from mechanisms.threshold.interactive import IatCalibration, iat_paper_calibration, iat_reference_calibration

Epsilon = Annotated[float, Field(strict=True, ge=1e-9, le=100.0, allow_inf_nan=False)]
Variance = Annotated[float, Field(strict=True, gt=0.0, le=1e18, allow_inf_nan=False)]
Probability = Annotated[float, Field(strict=True, gt=0.0, lt=1.0, allow_inf_nan=False)]


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
    confidence: Probability | None = Field(
        default=None,
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
        default=None,
        description="paper-theorem (Ligett Thm A.1) or reference-code (the authors' code, "
        "docs/privacy/accuracy_first_erm.md#accuracy-first-erm-calibration)",
    )
    width: float | None = Field(
        default=None, strict=True, gt=0.0, le=1e15, allow_inf_nan=False, description="α of the calibration"
    )
    failure: Probability | None = Field(default=None, description="γ of the calibration")

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


class OneShotParams(_Frozen):
    query: Query
    target: Target = Field(description="{relative: r} or {absolute: a, confidence: 1 − β}")
    check: Literal["released", "private"] = Field(
        default="released", description="released: free post-processing; private: InteractiveAboveThreshold"
    )
    private: PrivateCheck | None = Field(default=None, description="required iff check = private")
    confidence: ConfidenceLevel = 0.95
    """The released interval's level (``_GridParams``); not the absolute target's own ``confidence``."""

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


GRID_INCREASES = {"epsilons": True, "variances": False}
"""The grid fields, most private level first: ε strictly increasing, variances strictly decreasing."""


class _GridParams(_Frozen):
    """A noise-level grid: the subclass declares one of the fields of ``GRID_INCREASES``; ``confidence`` is
    the level of the interval published with every release (``mechanisms.reduction.nr_intervals``: valid
    at every level of the grid at once; post-processing, free)."""

    confidence: ConfidenceLevel = 0.95

    @model_validator(mode="after")
    def _grid(self) -> Self:
        for field, increasing in GRID_INCREASES.items():
            if field in type(self).model_fields:
                _strictly(getattr(self, field), increasing, field)
        return self


class LaplaceGridParams(_GridParams):
    epsilons: tuple[Epsilon, ...] = Field(
        min_length=1, max_length=MAX_LEVELS, description="strictly increasing ε-grid (most private first)"
    )


class GaussianGridParams(_GridParams):
    variances: tuple[Variance, ...] = Field(
        min_length=1, max_length=MAX_LEVELS, description="strictly decreasing variances t (noisiest first)"
    )


class LaplaceSessionParams(LaplaceGridParams):
    query: Query


class GaussianSessionParams(GaussianGridParams):
    query: Query


class LaplaceOneShotParams(OneShotParams, LaplaceGridParams):
    """A query, an increasing ε-grid, a target and how it is checked."""


class GaussianOneShotParams(OneShotParams, GaussianGridParams):
    """A query, a decreasing variance grid, a target and how it is checked."""


class NextQuery(_Frozen):
    """A session step has no parameters: ``{}`` asks for the next, less noisy level."""


SessionParams = LaplaceSessionParams | GaussianSessionParams
