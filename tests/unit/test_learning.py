"""The shared design matrix: bounded rows and labels from public bounds only."""

from __future__ import annotations

import numpy as np
import pytest

from mechanisms.accounting import DEFAULT_ORDERS
from mechanisms.base import ParamsError, PublicContext
from mechanisms.data.schema import DatasetSchema
from mechanisms.learners.features import FeatureSpec, check_features, design_matrix, dimension

SCHEMA = DatasetSchema.model_validate(
    {
        "neighboring": "replace_one",
        "columns": [
            {"name": "age", "type": "int", "min": 0, "max": 100},
            {"name": "income", "type": "float", "min": -50.0, "max": 200.0},
            {"name": "region", "type": "categorical", "values": ["n", "s", "e"]},
            {"name": "churn", "type": "categorical", "values": ["no", "yes"]},
            {"name": "flag", "type": "int", "min": 0, "max": 1},
        ],
    }
)
CTX = PublicContext(schema=SCHEMA, n_rows=4, orders=DEFAULT_ORDERS)
TABLE = {
    "age": np.array([0, 50, 100, 100]),
    "income": np.array([-50.0, 0.0, 200.0, 100.0]),
    "region": np.array([0, 1, 2, 2]),
    "churn": np.array([0, 1, 1, 0]),
    "flag": np.array([1, 0, 1, 0]),
}


def test_rows_are_bounded_and_one_hot_expanded() -> None:
    spec = FeatureSpec(features=("age", "income", "region"), label="churn")
    check_features(spec, CTX, "classification")
    x, y = design_matrix(spec, CTX, TABLE, "classification")
    assert x.shape == (4, dimension(spec, CTX)) == (4, 6)
    assert np.all(np.linalg.norm(x, axis=1) <= 1.0 + 1e-12)
    assert np.array_equal(y, [-1.0, 1.0, 1.0, -1.0])
    # a row inside the ball is unchanged: scaled features (0, 0, one-hot s) + intercept has norm √2 > 1
    assert np.allclose(np.linalg.norm(x, axis=1), 1.0)


def test_regression_label_scaled_by_declared_magnitude() -> None:
    spec = FeatureSpec(features=("age",), label="income", intercept=False)
    check_features(spec, CTX, "regression")
    x, y = design_matrix(spec, CTX, TABLE, "regression", row_norm=0.5)
    assert np.allclose(y, [-0.25, 0.0, 1.0, 0.5])
    assert np.allclose(x[:, 0], [0.0, 0.5, 0.5, 0.5])


@pytest.mark.parametrize(
    ("spec", "task", "field"),
    [
        (FeatureSpec(features=("nope",), label="churn"), "classification", "features[0]"),
        (FeatureSpec(features=("age", "age"), label="churn"), "classification", "features"),
        (FeatureSpec(features=("age",), label="age"), "classification", "label"),
        (FeatureSpec(features=("age",), label="region"), "classification", "label"),
        (FeatureSpec(features=("age",), label="income"), "classification", "label"),
        (FeatureSpec(features=("age",), label="churn"), "regression", "label"),
    ],
)
def test_bad_columns_name_the_field(spec: FeatureSpec, task: str, field: str) -> None:
    with pytest.raises(ParamsError) as caught:
        check_features(spec, CTX, task)  # type: ignore[arg-type]
    assert caught.value.field == field


def test_numeric_zero_one_label_is_a_classification_label() -> None:
    spec = FeatureSpec(features=("age",), label="flag")
    check_features(spec, CTX, "classification")
    _, y = design_matrix(spec, CTX, TABLE, "classification")
    assert np.array_equal(y, [1.0, -1.0, 1.0, -1.0])
