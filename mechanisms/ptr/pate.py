"""``pate.labels``: PATE's noisy arg-max labels with generalized propose-test-release (Redberg, Zhu & Wang
2023, Alg 6 / Fig 3.2, rebuilt on the top-two gap; docs/privacy/pate.md#theorem-pate-ptr).

k teachers are trained (non-privately, any of ``TEACHERS``) on disjoint parts of the dataset; each votes a
label for each of the T public query points the analyst supplies. The release is, for every query, the
arg-max of the vote histogram plus exact discrete Gaussian noise N_Z(0, σ²) per class (GNMax) — but only if
a Gen-PTR test passes: the test privately checks that the data-dependent (ε_m, δ_m) guarantee of those T
answers, computed from each query's gap between its two largest counts, holds at X and at every neighbour
(``pate_analysis``). Otherwise ⊥ (``released: false``, no labels). Charged (ε, δ) on the δ-ledger whatever
the outcome (docs/privacy/approximate.md#condition-e-delta).

The partition: row r goes to teacher H(r) mod k, H a fixed public 64-bit mix of the row's own values (the
feature and label columns). A row's teacher is a function of that row alone, so adding or removing one row
changes one teacher (m = 1) and replacing one changes at most two (m = 2) — whatever the row order. (A
position-based split such as r mod k would re-deal every later row on an insertion.) On a dataset with a
privacy unit, H is taken of the unit's id instead: all rows of a unit go to one teacher, so adding or
removing a unit (with all its rows, however many) changes one teacher, and no row bound is needed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, ClassVar, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, StrictStr

from mechanisms.accounting.approximate import ApproximateCharge
from mechanisms.base import ParamsError, PublicContext, Release, Table
from mechanisms.data.schema import CategoricalColumn
from mechanisms.learners.features import FeatureSpec, design_columns
from mechanisms.noise import Noise
from mechanisms.ptr.classic import pass_units
from mechanisms.ptr.generalized import GenPtrBudget, laplace_scale_units
from mechanisms.ptr.pate_analysis import (
    distance_cap,
    envelope,
    instability_distance,
    noisy_argmax,
    top_two_gaps,
    vote_histogram,
)
from mechanisms.ptr.pate_teachers import TeacherSpec, teacher_votes
from mechanisms.ptr.protocol import ApproximateBase

MAX_TEACHERS = 2000
MAX_QUERIES = 1000
MAX_LABELS = 64
QueryValue = StrictFloat | StrictInt | StrictStr


class PateLabelsParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    features: FeatureSpec = Field(description="feature columns and the (categorical) label column")
    labels: tuple[StrictStr, ...] = Field(
        min_length=2, max_length=MAX_LABELS, description="the public label set: declared values of the label"
    )
    teachers: StrictInt = Field(ge=2, le=MAX_TEACHERS, description="k: number of teachers (disjoint parts)")
    queries: tuple[tuple[QueryValue, ...], ...] = Field(
        min_length=1,
        max_length=MAX_QUERIES,
        description="public unlabelled points, one value per feature column (categorical ones as strings)",
    )
    sigma: StrictFloat = Field(
        ge=0.5, le=1e4, allow_inf_nan=False, description="σ: std of the discrete Gaussian noise on each count"
    )
    epsilon: StrictFloat = Field(gt=0, le=20, allow_inf_nan=False, description="total ε of the call")
    delta: StrictFloat = Field(gt=0, lt=0.01, allow_inf_nan=False, description="total δ of the call")
    test_fraction: StrictFloat = Field(
        default=0.25, gt=0, lt=1, allow_inf_nan=False, description="share of ε spent on the Gen-PTR test"
    )
    teacher: TeacherSpec = Field(default_factory=TeacherSpec, description="the teachers' learner")


@dataclass(frozen=True)
class PatePlan:
    """Everything public about one call: the budget split, the sensitivity m, the test's scale and
    threshold K, the distance cap H."""

    budget: GenPtrBudget
    sensitivity: int
    test_scale: Fraction
    pass_units: int
    cap: int
    sigma: float
    classes: int
    teachers: int

    def charge(self, orders: tuple[float, ...]) -> ApproximateCharge:
        return ApproximateCharge.from_epsilon_delta(self.budget.epsilon, self.budget.delta, orders)


def neighbour_teachers(neighbouring: Literal["replace_one", "add_remove"]) -> int:
    """m: teachers one neighbour step can change (content-hash partition)."""
    return 1 if neighbouring == "add_remove" else 2


def pate_plan(p: PateLabelsParams, neighbouring: Literal["replace_one", "add_remove"]) -> PatePlan:
    eps_test = p.epsilon * p.test_fraction
    eps_mech = p.epsilon - eps_test
    budget = GenPtrBudget(
        test_epsilon=eps_test,
        test_delta=0.0,
        false_positive=p.delta / 2.0,
        mechanism_epsilon=eps_mech,
        mechanism_delta=p.delta / 2.0,
    )
    scale = laplace_scale_units(1, eps_test)
    m = neighbour_teachers(neighbouring)
    threshold = pass_units(scale, budget.false_positive)
    cap = distance_cap(p.teachers, m)
    if threshold > cap:
        raise ParamsError(
            "epsilon",
            f"the test needs a distance ≥ {threshold} neighbour steps but {p.teachers} teachers allow "
            f"at most {cap}: raise epsilon, test_fraction or teachers",
        )
    return PatePlan(budget, m, scale, threshold, cap, p.sigma, len(p.labels), p.teachers)


# ----- inputs -----------------------------------------------------------------------------------------------


def label_codes(p: PateLabelsParams, ctx: PublicContext) -> list[int]:
    """The declared codes of the label set, in the order given (class j ↔ labels[j])."""
    column = ctx.schema.column(p.features.label)
    if not isinstance(column, CategoricalColumn):
        raise ParamsError("features.label", "the label column must be categorical")
    if len(set(p.labels)) != len(p.labels):
        raise ParamsError("labels", "labels must be distinct")
    values = [str(v) for v in column.values]
    for i, label in enumerate(p.labels):
        if label not in values:
            raise ParamsError(f"labels[{i}]", f"{label!r} is not a declared value of {column.name!r}")
    return [values.index(label) for label in p.labels]


def query_table(p: PateLabelsParams, ctx: PublicContext) -> dict[str, np.ndarray]:
    """The queries as a table of the feature columns (categorical values as codes), checked per field."""
    names = p.features.features
    columns: dict[str, list[Any]] = {name: [] for name in names}
    for i, point in enumerate(p.queries):
        if len(point) != len(names):
            raise ParamsError(
                f"queries[{i}]", f"needs {len(names)} values (one per feature), got {len(point)}"
            )
        for j, (name, value) in enumerate(zip(names, point, strict=True)):
            columns[name].append(_query_value(ctx, name, value, f"queries[{i}][{j}]"))
    table = {name: np.asarray(values) for name, values in columns.items()}
    table[p.features.label] = np.zeros(len(p.queries), dtype=np.int64)
    return table


def _query_value(ctx: PublicContext, name: str, value: float | int | str, field: str) -> float | int:
    column = ctx.schema.column(name)
    if isinstance(column, CategoricalColumn):
        values = [str(v) for v in column.values]
        if not isinstance(value, str) or value not in values:
            raise ParamsError(field, f"must be one of the declared values of {name!r}")
        return values.index(value)
    if isinstance(value, str) or not math.isfinite(value):
        raise ParamsError(field, f"must be a finite number for the numeric column {name!r}")
    return float(value)


def query_features(p: PateLabelsParams, ctx: PublicContext) -> np.ndarray:
    columns, _ = design_columns(p.features, ctx, query_table(p, ctx), "classification")
    return np.column_stack(columns)


# ----- the partition and the votes (data-dependent, never released) -----------------------------------------


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser (a fixed public bijection of uint64)."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        mixed: np.ndarray = x ^ (x >> np.uint64(31))
        return mixed


def teacher_of_rows(raw_columns: Sequence[np.ndarray], teachers: int) -> np.ndarray:
    """H(row) mod k: a public hash of each row's own values (−0.0 and NaN normalised), so a row's teacher
    depends on that row alone."""
    n = raw_columns[0].shape[0] if raw_columns else 0
    state = np.full(n, 0x9E3779B97F4A7C15, dtype=np.uint64)
    for column in raw_columns:
        values = np.asarray(column, dtype=np.float64) + 0.0  # −0.0 ↦ +0.0
        values = np.where(np.isnan(values), np.nan, values)
        with np.errstate(over="ignore"):
            state = _mix64(state ^ values.view(np.uint64)) + np.uint64(0x9E3779B97F4A7C15)
    assignment: np.ndarray = (_mix64(state) % np.uint64(teachers)).astype(np.int64)
    return assignment


def partition_columns(p: PateLabelsParams, ctx: PublicContext) -> list[str]:
    """The columns the partition hashes: a unit dataset's unit id, else the row's features and label."""
    unit = ctx.schema.privacy_unit
    return [unit.column] if unit is not None else [*p.features.features, p.features.label]


def votes(p: PateLabelsParams, ctx: PublicContext, table: Table) -> np.ndarray:
    """The (T, C) vote histogram of the k teachers on the queries."""
    codes = label_codes(p, ctx)
    raw = [np.asarray(table[name]) for name in partition_columns(p, ctx)]
    columns, _ = design_columns(p.features, ctx, table, "classification")
    x = np.column_stack(columns)
    label_raw = np.asarray(table[p.features.label])
    classes = np.full(label_raw.shape, -1, dtype=np.int64)
    for j, code in enumerate(codes):
        classes[label_raw == code] = j
    part = teacher_of_rows(raw, p.teachers)
    queries = query_features(p, ctx)
    predictions = teacher_votes(p.teacher, x, classes, part, p.teachers, queries, len(codes))
    return vote_histogram(predictions, len(codes))


# ----- the release ------------------------------------------------------------------------------------------


def gen_ptr_labels(plan: PatePlan, histogram: np.ndarray, noise: Noise) -> np.ndarray | None:
    """Alg 4 on GNMax: the test 1[h(X) + DLap(t) ≥ K], then the T noisy arg-maxes, or ⊥ (None)."""
    gaps = top_two_gaps(histogram)
    table = envelope(plan.teachers, plan.sigma, plan.sensitivity, plan.classes)
    budget = plan.budget
    h = instability_distance(
        table, gaps, plan.sensitivity, budget.mechanism_epsilon, budget.mechanism_delta, plan.cap
    )
    passed = h + int(noise.discrete_laplace(plan.test_scale, 1)[0]) >= plan.pass_units
    if not passed:
        return None
    return gnmax(histogram, plan.sigma, noise)


def gnmax(histogram: np.ndarray, sigma: float, noise: Noise) -> np.ndarray:
    """arg-max_j n_j + N_Z(0, σ²) per query, σ² = the float σ squared exactly (a dyadic rational)."""
    variance = Fraction(sigma) ** 2
    draws = noise.discrete_gaussian(variance, histogram.size).astype(np.int64).reshape(histogram.shape)
    return noisy_argmax(histogram, draws)


class PateLabels(ApproximateBase[PateLabelsParams]):
    """``pate.labels``: teacher-ensemble labels for public points by GNMax behind a Gen-PTR test."""

    name: ClassVar[str] = "pate.labels"
    summary: ClassVar[str] = (
        "PATE: k teachers trained on disjoint parts of the data label public query points by a noisy "
        "arg-max of their votes, released only if a generalized propose-test-release test of the "
        "data-dependent loss (the top-two vote gaps) passes (approximate DP: charged (ε, δ) on the δ-ledger)"
    )
    params_model: ClassVar[type[BaseModel]] = PateLabelsParams

    def check(self, p: PateLabelsParams, ctx: PublicContext) -> None:
        _check_columns(p, ctx)
        label_codes(p, ctx)
        query_table(p, ctx)
        pate_plan(p, ctx.schema.neighboring)

    def approximate_charge(self, p: PateLabelsParams, ctx: PublicContext) -> ApproximateCharge:
        return pate_plan(p, ctx.schema.neighboring).charge(ctx.orders)

    def run(self, p: PateLabelsParams, ctx: PublicContext, table: Table, noise: Noise) -> Release:
        plan = pate_plan(p, ctx.schema.neighboring)
        winners = gen_ptr_labels(plan, votes(p, ctx, table), noise)
        output: dict[str, Any] = {
            "released": winners is not None,
            "labels": None if winners is None else [p.labels[int(w)] for w in winners],
            "teachers": p.teachers,
            "queries": len(p.queries),
        }
        return self.release(p, ctx, output)


def _check_columns(p: PateLabelsParams, ctx: PublicContext) -> None:
    """The feature columns exist, are distinct and not the label (``check_features`` without its binary
    label rule: PATE's label is any categorical column)."""
    names = list(p.features.features)
    if len(set(names)) != len(names):
        raise ParamsError("features.features", "feature names must be distinct")
    for i, name in enumerate(names):
        column = ctx.schema.column(name)
        if column is None:
            raise ParamsError(f"features.features[{i}]", f"no column {name!r} in the dataset schema")
        if not isinstance(column, CategoricalColumn) and max(abs(column.min), abs(column.max)) == 0:
            raise ParamsError(f"features.features[{i}]", f"column {name!r} is declared constant zero")
    if p.features.label in names:
        raise ParamsError("features.label", "the label cannot also be a feature")
    if ctx.schema.column(p.features.label) is None:
        raise ParamsError("features.label", f"no column {p.features.label!r} in the dataset schema")


PATE_LABELS = PateLabels()
