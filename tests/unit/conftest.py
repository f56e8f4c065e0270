"""Shared fixtures for the mechanism unit tests: a small schema, its table and public contexts; and the ridge
neighbour-pair helpers of the relative-sensitivity tests (test_relative_gaussian.py, test_rgm_gd.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from mechanisms.accounting import DEFAULT_ORDERS
from mechanisms.base import PublicContext
from mechanisms.data.schema import DatasetSchema
from mechanisms.data.table import LoadedTable, load_csv
from mechanisms.learners.relative_gaussian import RelativeSensitivity, clip_rows

SCHEMA_JSON: dict[str, Any] = {
    "columns": [
        {"name": "age", "type": "float", "min": 0, "max": 100},
        {"name": "n", "type": "int", "min": 0, "max": 10},
        {"name": "group", "type": "categorical", "values": ["a", "b", "c"]},
    ],
    "neighboring": "replace_one",
}

# Rows after clipping: age (0..100), n (0..10), group.
CSV = b"""age,n,group
20,1,a
35.5,4,b
150,3,a
-5,12,c
60,7,b
"""


def _schema(neighboring: str = "replace_one") -> DatasetSchema:
    return DatasetSchema.model_validate({**SCHEMA_JSON, "neighboring": neighboring})


def _ctx(neighboring: str = "replace_one", n_rows: int = 5) -> PublicContext:
    return PublicContext(
        _schema(neighboring), n_rows if neighboring == "replace_one" else None, DEFAULT_ORDERS
    )


@pytest.fixture
def schema_json() -> dict[str, Any]:
    """A fresh deep copy of the schema JSON, free to mutate."""
    return {**SCHEMA_JSON, "columns": [dict(c) for c in SCHEMA_JSON["columns"]]}


@pytest.fixture
def make_ctx() -> Callable[..., PublicContext]:
    """Factory: ``make_ctx(neighboring, n_rows=5)``."""
    return _ctx


@pytest.fixture
def csv_bytes() -> bytes:
    return CSV


@pytest.fixture
def schema() -> DatasetSchema:
    return _schema()


@pytest.fixture
def table(schema: DatasetSchema) -> LoadedTable:
    return load_csv(CSV, schema)


@pytest.fixture(params=["replace_one", "add_remove"])
def ctx(request: pytest.FixtureRequest) -> PublicContext:
    return _ctx(request.param)


@pytest.fixture
def replace_ctx() -> PublicContext:
    return _ctx("replace_one")


@pytest.fixture
def add_remove_ctx() -> PublicContext:
    return _ctx("add_remove")


# ----- ridge neighbour pairs (relative sensitivity, docs/privacy/gradient_descent.md#lemma-ridge-split) -----


def pair_quantities(
    features: np.ndarray, labels: np.ndarray, new_row: np.ndarray, new_label: np.ndarray, reg: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For a batch of datasets and their replace-record-0 neighbours: A, M = (A₀ − A₀′)A⁻¹/n and
    c = (∇ℓ₀(θ*) − ∇ℓ₀′(θ*))/n, so that ∇f(θ) − ∇f′(θ) = M∇f(θ) + c for every θ."""
    n, d = features.shape[-2:]
    a = np.einsum("bni,bnj->bij", features, features) / n + reg * np.eye(d)
    b = np.einsum("bni,bn->bi", features, labels) / n
    a_inv = np.linalg.inv(a)
    theta_star = np.einsum("bij,bj->bi", a_inv, b)
    x0, y0 = features[:, 0], labels[:, 0]
    outer = np.einsum("bi,bj->bij", x0, x0) - np.einsum("bi,bj->bij", new_row, new_row)
    m = np.einsum("bij,bjk->bik", outer, a_inv) / n
    r0 = np.einsum("bi,bi->b", x0, theta_star) - y0
    r0_new = np.einsum("bi,bi->b", new_row, theta_star) - new_label
    c = (x0 * r0[:, None] - new_row * r0_new[:, None]) / n
    return a, m, c


def sup_ratio_over_theta(m: np.ndarray, c: np.ndarray, sens: RelativeSensitivity) -> np.ndarray:
    """sup_θ ‖M g + c‖²/(η²‖g‖² + R²) over g = ∇f(θ) ∈ R^d (θ ↦ ∇f(θ) is onto): the squared spectral norm of
    [M/η, c/R] (a homogeneous quotient in (g, 1))."""
    stacked = np.concatenate([m / sens.eta, (c / sens.r_rel)[:, :, None]], axis=2)
    result: np.ndarray = np.linalg.norm(stacked, ord=2, axis=(1, 2)) ** 2
    return result


def random_batch(
    rng: np.random.Generator, batch: int, n: int, d: int, x_max: float, y_max: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``batch`` ridge datasets of n records in R^d (rows clipped to x_max, labels to ±y_max, features on
    scales 1e-2..10) and, for each, a replacement for record 0."""
    scale = 10 ** rng.uniform(-2, 1, size=(batch, 1, 1))
    features = clip_rows(rng.normal(size=(batch, n, d)) * scale, x_max)
    labels = np.clip(rng.normal(size=(batch, n)) * 2 * y_max, -y_max, y_max)
    new_row = clip_rows(rng.normal(size=(batch, d)) * 3 * x_max, x_max)
    new_label = np.clip(rng.normal(size=batch) * 3 * y_max, -y_max, y_max)
    return features, labels, new_row, new_label
