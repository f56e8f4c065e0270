"""DatasetSchema: the public column bounds and neighbour relation, validated strictly."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from mechanisms.data.schema import CategoricalColumn, DatasetSchema, FloatColumn, IntColumn


def test_parses_the_documented_json(schema_json: dict[str, Any]) -> None:
    schema = DatasetSchema.model_validate_json(json.dumps(schema_json))
    assert schema.neighboring == "replace_one"
    assert schema.names == ("age", "n", "group")
    assert isinstance(schema.column("age"), FloatColumn)
    assert isinstance(schema.column("n"), IntColumn)
    group = schema.column("group")
    assert isinstance(group, CategoricalColumn)
    assert group.values == ("a", "b", "c")
    assert schema.column("missing") is None


def test_round_trips_through_json(schema_json: dict[str, Any]) -> None:
    schema = DatasetSchema.model_validate(schema_json)
    assert DatasetSchema.model_validate_json(schema.model_dump_json()) == schema


def test_is_frozen(schema_json: dict[str, Any]) -> None:
    schema = DatasetSchema.model_validate(schema_json)
    with pytest.raises(ValidationError):
        schema.neighboring = "add_remove"  # type: ignore[misc]


def _with_column(schema_json: dict[str, Any], index: int, **changes: Any) -> dict[str, Any]:
    schema_json["columns"][index].update(changes)
    return schema_json


@pytest.mark.parametrize(
    ("index", "changes", "message"),
    [
        (0, {"name": ""}, "at least 1 character"),
        (0, {"min": 5, "max": 1}, "must be ≤ max"),
        (0, {"max": float("nan")}, "finite number"),
        (0, {"min": float("-inf")}, "finite number"),
        (0, {"min": -1.7e308, "max": 1.7e308}, "greater than or equal to -1000000000000000"),
        (0, {"min": 0, "max": 1e16}, "less than or equal to 1000000000000000"),
        (0, {"min": "0"}, "valid number"),
        (0, {"unit": "years"}, "Extra inputs are not permitted"),
        (0, {"type": "decimal"}, "does not match any of the expected tags"),
        (1, {"min": 0.5}, "valid integer"),
        (1, {"max": 3.0}, "valid integer"),
        (1, {"max": True}, "valid integer"),
        (1, {"max": 2**60}, "less than or equal to"),
        (1, {"min": 4, "max": 3}, "must be ≤ max"),
        (2, {"values": []}, "at least 1 item"),
        (2, {"values": ["a", "a"]}, "unique"),
        (2, {"values": ["a", ""]}, "at least 1 character"),
        (2, {"values": ["a", 1]}, "valid string"),
    ],
)
def test_rejects_bad_columns(
    schema_json: dict[str, Any], index: int, changes: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValidationError, match=message):
        DatasetSchema.model_validate(_with_column(schema_json, index, **changes))


def test_rejects_non_finite_bounds_in_json(schema_json: dict[str, Any]) -> None:
    text = json.dumps(schema_json).replace('"max": 100', '"max": Infinity')
    with pytest.raises(ValidationError, match="finite number"):
        DatasetSchema.model_validate_json(text)


def test_rejects_duplicate_names(schema_json: dict[str, Any]) -> None:
    schema_json["columns"][1]["name"] = "age"
    with pytest.raises(ValidationError, match="duplicate column names: 'age'"):
        DatasetSchema.model_validate(schema_json)


def test_rejects_no_columns(schema_json: dict[str, Any]) -> None:
    with pytest.raises(ValidationError, match="at least 1 item"):
        DatasetSchema.model_validate({**schema_json, "columns": []})


def test_rejects_unknown_neighbouring(schema_json: dict[str, Any]) -> None:
    with pytest.raises(ValidationError, match="replace_one"):
        DatasetSchema.model_validate({**schema_json, "neighboring": "swap"})


def test_rejects_extra_top_level_keys(schema_json: dict[str, Any]) -> None:
    with pytest.raises(ValidationError, match="Extra inputs"):
        DatasetSchema.model_validate({**schema_json, "rows": 10})


def test_accepts_equal_bounds_and_add_remove(schema_json: dict[str, Any]) -> None:
    schema_json["columns"][0].update(min=3.5, max=3.5)
    schema = DatasetSchema.model_validate({**schema_json, "neighboring": "add_remove"})
    age = schema.column("age")
    assert isinstance(age, FloatColumn)
    assert (age.min, age.max) == (3.5, 3.5)
    assert schema.neighboring == "add_remove"


def test_a_unit_dataset_may_not_name_a_column_like_the_bounding_order() -> None:
    """The snapshot of a unit dataset carries ``__order`` beside the declared columns: a user column of that
    name is refused at declaration (it crashed ingestion with an Arrow error)."""
    with pytest.raises(ValidationError, match="privacy_unit"):
        DatasetSchema.model_validate(
            {
                "columns": [
                    {"name": "user", "type": "int", "min": 0, "max": 9},
                    {"name": "__order", "type": "int", "min": 0, "max": 9},
                ],
                "neighboring": "add_remove",
                "privacy_unit": {"column": "user", "max_rows": 2},
            }
        )
