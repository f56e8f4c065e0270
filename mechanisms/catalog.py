"""The registries of mechanisms, by name: non-interactive (``MECHANISMS``) and sessions (``INTERACTIVE``)."""

from __future__ import annotations

from mechanisms.above_threshold import (
    DROPPING,
    GEOMETRIC,
    LAPLACE,
    DroppingAboveThresholdBatch,
    GeometricAboveThresholdBatch,
    LaplaceAboveThresholdBatch,
)
from mechanisms.base import InteractiveMechanism, Mechanism
from mechanisms.gaussian import Gaussian
from mechanisms.laplace import Laplace

MECHANISMS: dict[str, Mechanism] = {
    "laplace": Laplace(),
    "gaussian": Gaussian(),
    "above_threshold.batch": GeometricAboveThresholdBatch(),
    "above_threshold.dropping.batch": DroppingAboveThresholdBatch(),
    "above_threshold.laplace.batch": LaplaceAboveThresholdBatch(),
}

INTERACTIVE: dict[str, InteractiveMechanism] = {
    "above_threshold": GEOMETRIC,
    "above_threshold.dropping": DROPPING,
    "above_threshold.laplace": LAPLACE,
}
