"""Supervised-learning inputs shared by the learners (ERM, gradient descent, objective perturbation, tuning).

A learner names feature columns and a label column of the dataset's public schema. The design matrix is
built from **declared bounds only** (docs/privacy.md §6, rule 1), so its guarantees are public facts:

* each numeric feature is divided by its declared magnitude max(|min|, |max|), so |x_j| ≤ 1;
* a categorical feature becomes one-hot indicators (one column per declared value);
* an intercept column of ones is appended when asked;
* finally every row is scaled down, if needed, to ℓ2 norm ≤ ``row_norm`` (per-row clipping: a function of
  that row alone, so neighbouring datasets still differ in at most one row of X).

Labels: ``regression`` divides a numeric label by its declared magnitude (|y| ≤ 1); ``classification``
maps a label to ±1: a categorical column with exactly two declared values (the second is +1), or a
numeric column with declared bounds [0, 1] (y > 0.5 is +1).
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, StrictBool

from mechanisms.base import ParamsError, PublicContext, Table
from mechanisms.data.schema import CategoricalColumn

Task = Literal["regression", "classification"]


class FeatureSpec(BaseModel):
    """Which columns a learner reads (public)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    features: tuple[str, ...] = Field(min_length=1, max_length=200, description="feature column names")
    label: str = Field(description="label column name")
    intercept: StrictBool = Field(default=True, description="append a constant-one feature")


def learner_task(model: str, task: str | None) -> Task:
    """The label handling for a model: ``task`` if given, else classification for logistic and regression
    otherwise. Logistic regression needs ±1 labels, so any other task is refused (ParamsError on ``task``)."""
    if task is None:
        task = "classification" if model == "logistic" else "regression"
    chosen: Task = "classification" if task == "classification" else "regression"
    if model == "logistic" and chosen != "classification":
        raise ParamsError("task", "logistic regression needs a classification label")
    return chosen


def _magnitude(low: float, high: float) -> float:
    return max(abs(float(low)), abs(float(high)))


def _at(field: str, name: str) -> str:
    return f"{field}.{name}" if field else name


def check_features(spec: FeatureSpec, ctx: PublicContext, task: Task, field: str = "") -> None:
    """Schema-dependent validation: the columns exist, are distinct, and the label suits ``task``.

    ``field``: where the FeatureSpec sits inside the mechanism's params ("" when its fields are top-level);
    the service prefixes ``params.`` itself.
    """
    names = list(spec.features)
    if len(set(names)) != len(names):
        raise ParamsError(_at(field, "features"), "feature names must be distinct")
    for i, name in enumerate(names):
        column = ctx.schema.column(name)
        if column is None:
            raise ParamsError(_at(field, f"features[{i}]"), f"no column {name!r} in the dataset schema")
        if not isinstance(column, CategoricalColumn) and _magnitude(column.min, column.max) == 0:
            raise ParamsError(_at(field, f"features[{i}]"), f"column {name!r} is declared constant zero")
    if spec.label in names:
        raise ParamsError(_at(field, "label"), "the label cannot also be a feature")
    label = ctx.schema.column(spec.label)
    if label is None:
        raise ParamsError(_at(field, "label"), f"no column {spec.label!r} in the dataset schema")
    if task == "regression":
        if isinstance(label, CategoricalColumn):
            raise ParamsError(_at(field, "label"), "a regression label must be a numeric column")
        if _magnitude(label.min, label.max) == 0:
            raise ParamsError(_at(field, "label"), "the label column is declared constant zero")
    elif isinstance(label, CategoricalColumn):
        if len(label.values) != 2:
            raise ParamsError(_at(field, "label"), "a classification label needs exactly two declared values")
    elif (label.min, label.max) != (0, 1):
        raise ParamsError(_at(field, "label"), "a numeric classification label must be declared on [0, 1]")


def dimension(spec: FeatureSpec, ctx: PublicContext) -> int:
    """The number of columns of the design matrix (public)."""
    width = 0
    for name in spec.features:
        column = ctx.schema.column(name)
        assert column is not None
        width += len(column.values) if isinstance(column, CategoricalColumn) else 1
    return width + int(spec.intercept)


def _feature_block(name: str, ctx: PublicContext, table: Table) -> np.ndarray:
    column = ctx.schema.column(name)
    data = np.asarray(table[name])
    if isinstance(column, CategoricalColumn):
        one_hot: np.ndarray = (data[:, None] == np.arange(len(column.values))[None, :]).astype(np.float64)
        return one_hot
    assert column is not None
    scaled: np.ndarray = data.astype(np.float64) / _magnitude(column.min, column.max)
    return scaled[:, None]


def clip_row_norms(features: np.ndarray, bound: float) -> np.ndarray:
    """Scale each row down to ℓ2 norm ≤ ``bound`` (rows already inside are unchanged)."""
    norms = np.linalg.norm(features, axis=1)
    scale = np.minimum(1.0, bound / np.maximum(norms, np.finfo(np.float64).tiny))
    clipped: np.ndarray = features * scale[:, None]
    return clipped


def design_matrix(
    spec: FeatureSpec, ctx: PublicContext, table: Table, task: Task, row_norm: float = 1.0
) -> tuple[np.ndarray, np.ndarray]:
    """(X, y): X of shape (n, dimension) with every row's ℓ2 norm ≤ ``row_norm``; y as described above."""
    blocks = [_feature_block(name, ctx, table) for name in spec.features]
    n = blocks[0].shape[0]
    if spec.intercept:
        blocks.append(np.ones((n, 1)))
    features = clip_row_norms(np.hstack(blocks), row_norm)
    label = ctx.schema.column(spec.label)
    raw = np.asarray(table[spec.label])
    if task == "classification":
        positive = raw == 1 if isinstance(label, CategoricalColumn) else raw > 0.5
        return features, np.where(positive, 1.0, -1.0)
    assert label is not None
    assert not isinstance(label, CategoricalColumn)
    return features, raw.astype(np.float64) / _magnitude(label.min, label.max)


def column_names(spec: FeatureSpec, ctx: PublicContext) -> list[str]:
    """Names of the design-matrix columns (public): numeric name, ``name=value`` one-hots, ``(intercept)``."""
    names: list[str] = []
    for name in spec.features:
        column = ctx.schema.column(name)
        if isinstance(column, CategoricalColumn):
            names.extend(f"{name}={value}" for value in column.values)
        else:
            names.append(name)
    if spec.intercept:
        names.append("(intercept)")
    return names
