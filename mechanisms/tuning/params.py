"""The parameter model of ``tuning.select`` (public inputs only): the candidate grid, the latent's ε′, the
pass rule and the mode. The mechanism: ``mechanisms.tuning.select``."""

from __future__ import annotations

from itertools import product
from typing import Annotated, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, model_validator

from mechanisms.learners.features import FeatureSpec
from mechanisms.tuning.candidates import CandidateConfig, LearnerName

MAX_CANDIDATES = 10_000
MAX_TOTAL_STEPS = 5_000_000
"""Compute limit: gradient steps summed over every DP-GD candidate of a request (padding runs them all)."""
GridEpsilon = Annotated[float, Field(strict=True, ge=1e-6, le=100, allow_inf_nan=False)]
Regularization = Annotated[float, Field(strict=True, ge=1e-6, le=1e3, allow_inf_nan=False)]
Steps = Annotated[int, Field(strict=True, ge=1, le=10_000)]
StepSize = Annotated[float, Field(strict=True, gt=0, le=1e3, allow_inf_nan=False)]
Clip = Annotated[float, Field(strict=True, gt=0, le=1e6, allow_inf_nan=False)]


class TuningParams(BaseModel):
    """Public parameters of ``tuning.select`` (the candidate list is fixed by them, before k is drawn)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    learner: LearnerName = Field(description="base learner of every candidate")
    features: FeatureSpec = Field(description="feature and label columns")
    epsilons: tuple[GridEpsilon, ...] = Field(
        min_length=1, max_length=200, description="grid of candidate ε (each candidate's drop parameter)"
    )
    regularization: tuple[Regularization, ...] = Field(
        default=(0.01,), min_length=1, max_length=50, description="grid of ridge λ"
    )
    steps: tuple[Steps, ...] | None = Field(
        default=None, min_length=1, max_length=20, description="DP-GD only: grid of step counts"
    )
    step_size: tuple[StepSize, ...] | None = Field(
        default=None, min_length=1, max_length=20, description="DP-GD only: grid of step sizes"
    )
    clip: tuple[Clip, ...] | None = Field(
        default=None, min_length=1, max_length=20, description="DP-GD only: grid of clipping norms"
    )
    repeats: int = Field(default=1, strict=True, ge=1, le=1000, description="copies of each configuration")
    epsilon_prime: StrictFloat = Field(
        ge=1e-6, le=10, allow_inf_nan=False, description="ε′ of the latent (Geom or Exp with rate ε′)"
    )
    utility_bar: StrictFloat = Field(
        ge=-4,
        le=1,
        allow_inf_nan=False,
        description="a candidate passes if its noisy held-out utility (accuracy, or −MSE) is ≥ this",
    )
    pass_margin: StrictFloat = Field(
        default=0.0,
        ge=0,
        le=10,
        allow_inf_nan=False,
        description="a candidate passes iff score − pass_margin × (sd of the score noise) ≥ utility_bar",
    )
    mode: Literal["pure", "rdp"] = Field(description="pure: Theorem 11 (geometric); rdp: Theorem 13 (exp)")
    order: StrictFloat | None = Field(
        default=None,
        gt=1,
        le=1e6,
        allow_inf_nan=False,
        description="rdp + DP-GD/objpert: the calibration order α* (a dataset order); candidates' RDP "
        "is ≤ their ε at orders where the curve says so (DP-GD: exactly α ≤ α*), +∞ elsewhere",
    )
    holdout_fraction: StrictFloat = Field(
        default=0.2, ge=0.01, le=0.9, allow_inf_nan=False, description="share of rows held out for scoring"
    )
    pad_to_worst_case_time: StrictBool = Field(
        default=True,
        description="must be true (the default): every candidate runs, dropped ones are discarded, so the "
        "work does not reveal the secret latent k; false is refused (the run count voids the charge)",
    )

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        gd = self.learner.startswith("dp_gd")
        calibrated = gd or self.learner == "objpert.logistic"  # RDP-only learners, calibrated at α*
        for name in ("steps", "step_size", "clip"):
            if not gd and getattr(self, name) is not None:
                raise ValueError(f"{name} applies to DP-GD learners only")
        if calibrated and self.mode == "pure":
            raise ValueError(f"{self.learner} has no pure ε guarantee: use mode 'rdp' or output_perturbation")
        if calibrated and self.order is None:
            raise ValueError(f"{self.learner} candidates need the calibration order 'order'")
        if not calibrated and self.order is not None:
            raise ValueError("order applies to DP-GD and objpert learners only")
        if self.learner == "objpert.logistic" and min(self.regularization) <= 0.25:
            raise ValueError("objpert.logistic needs every regularization (sum-scale λ) > β = 1/4")
        if len(self.grid()) * self.repeats > MAX_CANDIDATES:
            raise ValueError(f"at most {MAX_CANDIDATES} candidates (grid size × repeats)")
        if gd and sum(c.steps for c in self.grid()) * self.repeats > MAX_TOTAL_STEPS:
            raise ValueError(f"at most {MAX_TOTAL_STEPS} DP-GD steps over the whole list (compute limit)")
        return self

    def grid(self) -> list[CandidateConfig]:
        """The configurations in list order (ε outermost), without repeats."""
        if self.learner.startswith("dp_gd"):
            return [
                CandidateConfig(e, r, s, t, c)
                for e, r, s, t, c in product(
                    self.epsilons,
                    self.regularization,
                    self.steps or (100,),
                    self.step_size or (1.0,),
                    self.clip or (1.0,),
                )
            ]
        return [CandidateConfig(e, r) for e, r in product(self.epsilons, self.regularization)]

    def candidates(self) -> list[CandidateConfig]:
        """The full list: each configuration repeated ``repeats`` times (each copy its own index)."""
        return [config for config in self.grid() for _ in range(self.repeats)]
