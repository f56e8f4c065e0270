"""The number types that several parameter models share (public inputs only).

A type carries the bounds a field of its kind has wherever it appears, so a model states only what is its
own (default, description): ``report_sigma: NoiseStd | None = Field(default=None, description="…")``. The
JSON schema, the validation and every error message are those of the ``Field(gt=…, le=…)`` it stands for.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, StrictFloat, StrictInt

NoiseStd = Annotated[StrictFloat, Field(gt=0, le=1e9, allow_inf_nan=False)]
"""A standard deviation σ of Gaussian noise: positive, at most 1e9."""

OpenUnit = Annotated[StrictFloat, Field(gt=0, lt=1, allow_inf_nan=False)]
"""A number strictly between 0 and 1: a confidence level, a share of ε, a δ."""

SmallDelta = Annotated[StrictFloat, Field(gt=0, lt=0.01, allow_inf_nan=False)]
"""A δ of approximate DP: positive, below 0.01."""

PositiveUpTo1e12 = Annotated[StrictFloat, Field(gt=0, le=1e12, allow_inf_nan=False)]
"""A positive scale with a wide public ceiling (γ of the RGM, a stopping tolerance)."""

Steps = Annotated[StrictInt, Field(ge=1, le=10_000)]
"""A number of gradient steps (or of consecutive steps): 1 to 10 000."""

StepSize = Annotated[StrictFloat, Field(gt=0, le=1e6, allow_inf_nan=False)]
"""A gradient step τ: positive, at most 1e6."""

TargetEpsilon = Annotated[StrictFloat, Field(gt=0, le=1e4, allow_inf_nan=False)]
"""An ε to calibrate the noise to: positive, at most 1e4."""
