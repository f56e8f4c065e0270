"""Shared fixtures for the mechanism unit tests: a small schema, its table and public contexts."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from mechanisms.accounting import DEFAULT_ORDERS
from mechanisms.base import PublicContext
from mechanisms.data.schema import DatasetSchema
from mechanisms.data.table import LoadedTable, load_csv

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
