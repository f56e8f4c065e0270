"""Supervised-learning inputs shared by the learners (ERM, gradient descent, objective perturbation, tuning).

A learner names feature columns and a label column of the dataset's public schema. The design matrix is
built from **declared bounds only** (docs/privacy/rules.md#rule-public-charges), so its guarantees are public
facts:

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

from collections.abc import Iterator, Mapping, Sequence
from typing import Literal, Protocol, runtime_checkable

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
    return features, _labels(spec, ctx, np.asarray(table[spec.label]), task)


def _labels(spec: FeatureSpec, ctx: PublicContext, raw: np.ndarray, task: Task) -> np.ndarray:
    """y from the raw label column: ±1 for classification, else scaled by the label's public magnitude."""
    label = ctx.schema.column(spec.label)
    if task == "classification":
        positive = raw == 1 if isinstance(label, CategoricalColumn) else raw > 0.5
        return np.where(positive, 1.0, -1.0)
    assert label is not None
    assert not isinstance(label, CategoricalColumn)
    scaled: np.ndarray = raw.astype(np.float64) / _magnitude(label.min, label.max)
    return scaled


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


# ----- the design matrix column by column, batch by batch (bounded memory) ----------------------------------
DESIGN_BATCH_ROWS = 1 << 16
"""Rows per record batch read by ``table_batches`` (a few MB of float64 temporaries per design column)."""

_PAIRWISE_BLOCK = 128  # numpy's PW_BLOCKSIZE: above it, pairwise_sum splits the row in two


@runtime_checkable
class BatchedTable(Protocol):
    """A table that streams its columns in record batches (``service.engines.ParquetTable``): learners that
    need rows read them this way in bounded memory instead of loading whole columns."""

    def batches(
        self, names: Sequence[str], rows_per_batch: int = DESIGN_BATCH_ROWS
    ) -> Iterator[Mapping[str, np.ndarray]]: ...


def _pairwise_sum(terms: Sequence[np.ndarray]) -> np.ndarray:
    """Σ_j terms[j] elementwise in the order of numpy's ``pairwise_sum`` over a row of len(terms) entries.

    ``np.add.reduce(a, axis=1)`` on a C-contiguous float64 (m, d) array sums each row with that routine
    (numpy/_core/src/umath/loops_utils.h.src): below 8 terms left to right; up to 128, eight accumulators
    r_k = a_k + a_{k+8} + …, then ((r₀ + r₁) + (r₂ + r₃)) + ((r₄ + r₅) + (r₆ + r₇)) and the remainder left
    to right; above 128, the two halves (the first a multiple of 8) summed apart. The reduction starts from
    0.0, which changes no term ≥ +0 (all callers sum squares). Checked against numpy for d = 1 … 300 in
    tests/unit/test_dp_gd_streaming.py."""
    count = len(terms)
    if count < 8:
        first: np.ndarray = terms[0].copy()
        for term in terms[1:]:
            first += term
        return first
    if count <= _PAIRWISE_BLOCK:
        partial = [terms[k].copy() for k in range(8)]
        index = 8
        while index < count - count % 8:
            for k in range(8):
                partial[k] += terms[index + k]
            index += 8
        total: np.ndarray = ((partial[0] + partial[1]) + (partial[2] + partial[3])) + (
            (partial[4] + partial[5]) + (partial[6] + partial[7])
        )
        for term in terms[index:]:
            total += term
        return total
    half = count // 2
    half -= half % 8
    halves: np.ndarray = _pairwise_sum(terms[:half]) + _pairwise_sum(terms[half:])
    return halves


def column_row_norms(columns: Sequence[np.ndarray], n_rows: int) -> np.ndarray:
    """``np.linalg.norm(np.column_stack(columns), axis=1)`` bit for bit, without the (n, d) matrix: the
    squares of each column, summed across columns in numpy's row order (``_pairwise_sum``), then sqrt.
    Elementwise per row, so each norm is a function of its own row whatever its position or batch."""
    if not columns:
        return np.zeros(n_rows)
    norms: np.ndarray = np.sqrt(_pairwise_sum([column * column for column in columns]))
    return norms


def design_columns(
    spec: FeatureSpec, ctx: PublicContext, table: Table, task: Task, row_norm: float = 1.0
) -> tuple[list[np.ndarray], np.ndarray]:
    """``design_matrix`` as the list of X's columns and y, **bit for bit the same values** (the same
    elementwise operations; the row norm of ``clip_row_norms`` by ``column_row_norms``), without building
    the n×d matrix or its temporaries. Every entry of row i is a function of record i alone, so the design
    matrix of a table read in batches is the concatenation of the batches' design matrices."""
    columns: list[np.ndarray] = []
    for name in spec.features:
        column = ctx.schema.column(name)
        data = np.asarray(table[name])
        if isinstance(column, CategoricalColumn):
            columns.extend((data == code).astype(np.float64) for code in range(len(column.values)))
        else:
            assert column is not None
            columns.append(data.astype(np.float64) / _magnitude(column.min, column.max))
    n = columns[0].shape[0]
    if any(c.shape != (n,) for c in columns):
        raise ValueError("feature columns must be one-dimensional and of equal length")
    if spec.intercept:
        columns.append(np.ones(n))
    norms = column_row_norms(columns, n)
    scale = np.minimum(1.0, row_norm / np.maximum(norms, np.finfo(np.float64).tiny))
    clipped = [c * scale for c in columns]
    raw = np.asarray(table[spec.label])
    if raw.shape != (n,):
        raise ValueError("the label column must be one-dimensional and as long as the features")
    return clipped, _labels(spec, ctx, raw, task)


def table_batches(
    spec: FeatureSpec, table: Table, rows_per_batch: int = DESIGN_BATCH_ROWS, extra: Sequence[str] = ()
) -> Iterator[Mapping[str, np.ndarray]]:
    """The feature and label columns (and the ``extra`` ones, e.g. a privacy unit's id and its bounding
    order) in record batches of at most ``rows_per_batch`` rows, in row order: streamed by ``table.batches``
    when the table has it (a Parquet snapshot: bounded memory, no column is loaded whole), else slices of the
    in-memory columns. Empty batches are skipped."""
    names = list(dict.fromkeys([*spec.features, spec.label, *extra]))
    if isinstance(table, BatchedTable):
        for batch in table.batches(names, rows_per_batch):
            if len(batch[spec.label]):
                yield batch
        return
    loaded = {name: np.asarray(table[name]) for name in names}
    n = loaded[spec.label].size
    if any(column.shape != (n,) for column in loaded.values()):
        raise ValueError("the feature and label columns must be one-dimensional and of equal length")
    for start in range(0, n, rows_per_batch):
        yield {name: column[start : start + rows_per_batch] for name, column in loaded.items()}
