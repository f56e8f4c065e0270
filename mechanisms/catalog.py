"""The registries of mechanisms, by name: non-interactive (``MECHANISMS``) and sessions (``INTERACTIVE``).

The registries are heterogeneous (``Mechanism[Any]``): validate raw params with ``params_model`` (and a step
with ``query_model``) before calling a mechanism; a wrong model raises TypeError (``base.ParamsChecked``).
"""

from __future__ import annotations

from typing import Any

from mechanisms.base import InteractiveMechanism, Mechanism
from mechanisms.learners.dp_gd import DpGdMechanism
from mechanisms.learners.rgm_gd import RgmGdMechanism
from mechanisms.per_instance.adaops import ADAOPS_RIDGE
from mechanisms.per_instance.objpert_logistic import ObjPertLogistic
from mechanisms.ptr.classic import CLASSIC_PTR
from mechanisms.ptr.ops_linear import OpsLinear
from mechanisms.ptr.pate import PATE_LABELS
from mechanisms.ptr.select import PTR_SELECT
from mechanisms.queries.gaussian import Gaussian
from mechanisms.queries.laplace import Laplace
from mechanisms.queries.measures import MeasuresGaussian, MeasuresLaplace
from mechanisms.queries.quantile import Quantile
from mechanisms.reduction.accuracy_first import (
    ACCURACY_FIRST_GAUSSIAN,
    ACCURACY_FIRST_LAPLACE,
    NR_GAUSSIAN_SESSION,
    NR_LAPLACE_SESSION,
)
from mechanisms.reduction.accuracy_first_erm import AccuracyFirstLogistic, AccuracyFirstRidge
from mechanisms.threshold.above_threshold import (
    DROPPING,
    GEOMETRIC,
    LAPLACE,
    DroppingAboveThresholdBatch,
    GeometricAboveThresholdBatch,
    LaplaceAboveThresholdBatch,
)
from mechanisms.tuning.select import TuningSelect

MECHANISMS: dict[str, Mechanism[Any]] = {
    "laplace": Laplace(),
    "gaussian": Gaussian(),
    "quantile": Quantile(),
    "measures.laplace": MeasuresLaplace(),
    "measures.gaussian": MeasuresGaussian(),
    "objpert.logistic": ObjPertLogistic(),
    "above_threshold.batch": GeometricAboveThresholdBatch(),
    "above_threshold.dropping.batch": DroppingAboveThresholdBatch(),
    "above_threshold.laplace.batch": LaplaceAboveThresholdBatch(),
    "accuracy_first.laplace": ACCURACY_FIRST_LAPLACE,
    "accuracy_first.gaussian": ACCURACY_FIRST_GAUSSIAN,
    "accuracy_first.ridge": AccuracyFirstRidge(),
    "accuracy_first.logistic": AccuracyFirstLogistic(),
    "rgm.gd": RgmGdMechanism(),
    "dp_gd": DpGdMechanism(),
    "tuning.select": TuningSelect(),
    # (ε, δ) mechanisms: admitted through the δ-ledger (docs/privacy/approximate.md#approximate-dp,
    # mechanisms.ptr.protocol)
    "ptr.classic": CLASSIC_PTR,
    "ptr.select": PTR_SELECT,
    "ptr.ops_linear": OpsLinear(),
    "pate.labels": PATE_LABELS,
    "adaops.ridge": ADAOPS_RIDGE,
}

INTERACTIVE: dict[str, InteractiveMechanism[Any, Any]] = {
    "above_threshold": GEOMETRIC,
    "above_threshold.dropping": DROPPING,
    "above_threshold.laplace": LAPLACE,
    "noise_reduction.laplace": NR_LAPLACE_SESSION,
    "noise_reduction.gaussian": NR_GAUSSIAN_SESSION,
}

IN_ENGINE: frozenset[str] = frozenset(
    {
        "laplace",
        "gaussian",
        "quantile",
        "measures.laplace",
        "measures.gaussian",
        "above_threshold.batch",
        "above_threshold.dropping.batch",
        "above_threshold.laplace.batch",
        "accuracy_first.laplace",
        "accuracy_first.gaussian",
        "dp_gd",
        *INTERACTIVE,
    }
)
"""Mechanisms that read a table only through aggregation plans (``mechanisms.data.plan``) or streamed
batches: they run on tables of any size. Every other mechanism holds the columns it reads in memory and is
refused on a table larger than the deployment's learner row limit, before anything is reserved."""

WITH_UNITS: frozenset[str] = IN_ENGINE | {"pate.labels"}
"""Mechanisms whose sensitivity accounts for a privacy unit's ``max_rows`` (docs/privacy/units.md#units):
their queries' shifts are the unit-level ones, and every plan bounds each unit's rows; ``dp_gd`` clips each
unit's summed gradient (docs/privacy/units_learners.md#theorem-dpgd-unit); ``pate.labels`` deals whole units
to teachers, so a unit changes one teacher whatever its row count (docs/privacy/pate.md#lemma-pate-partition).
The others are refused on a dataset that declares a privacy unit, never run per row."""

WITH_INDIVIDUAL: frozenset[str] = frozenset(
    {
        "laplace",
        "gaussian",
        "accuracy_first.laplace",
        "accuracy_first.gaussian",
        "measures.laplace",
        "measures.gaussian",
        "dp_gd",
    }
)
"""Mechanisms with an individual analysis (docs/privacy/individual.md#individual-queries,
docs/privacy/individual.md#individual-families-proofs): on a dataset
with ``accounting: individual`` they charge each unit its own loss and leave out the units that cannot
afford it. Every other mechanism (and every interactive session) is refused there with a 422."""
