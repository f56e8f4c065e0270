"""Wide schemas and headers (issue 35, hole 13): the header and schema checks are linear in the number of
columns, and a schema has at most ``MAX_COLUMNS`` columns.

The header check used ``names.count`` per name: quadratic (20 000 columns took 26.8 s, 100 000 more than two
minutes). Here 100 000 header names are checked well under a second, on every error path and on a header that
matches a schema of ``MAX_COLUMNS`` columns. The bounds are generous (a loaded CI machine), and far below
what the quadratic check needed.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from pydantic import ValidationError

from mechanisms.data.schema import MAX_COLUMNS, DatasetSchema
from mechanisms.data.table import TableError, load_csv

WIDE = 100_000
BOUND = 1.0  # seconds; the quadratic check took minutes at this width


def _schema(names: list[str]) -> dict[str, Any]:
    return {
        "columns": [{"name": n, "type": "float", "min": 0, "max": 1} for n in names],
        "neighboring": "replace_one",
    }


def _csv(header: list[str]) -> bytes:
    return (",".join(header) + "\n" + ",".join("0" for _ in header) + "\n").encode()


@pytest.fixture(scope="module")
def small() -> DatasetSchema:
    return DatasetSchema.model_validate(_schema(["a", "b", "c"]))


def _timed_error(data: bytes, schema: DatasetSchema) -> tuple[TableError, float]:
    started = time.perf_counter()
    with pytest.raises(TableError) as caught:
        load_csv(data, schema)
    return caught.value, time.perf_counter() - started


def test_a_header_of_100k_unknown_columns_fails_fast(small: DatasetSchema) -> None:
    header = ["a", "b", "c", *(f"x{i}" for i in range(WIDE))]
    error, elapsed = _timed_error(_csv(header), small)
    assert error.field == "file"
    assert error.reason.startswith("columns not in the schema: 'x0', 'x1', 'x2', 'x3', 'x4' and ")
    assert error.reason.endswith(f"and {WIDE - 5} more")
    assert elapsed < BOUND, f"{elapsed:.2f} s"


def test_a_header_of_100k_duplicated_columns_fails_fast(small: DatasetSchema) -> None:
    header = [f"d{i % (WIDE // 2)}" for i in range(WIDE)]  # every name twice
    error, elapsed = _timed_error(_csv(header), small)
    assert error.reason.startswith("duplicate columns in the header: 'd0', 'd1', 'd10', 'd100', 'd1000'")
    assert error.reason.endswith(f"and {WIDE // 2 - 5} more")
    assert elapsed < BOUND, f"{elapsed:.2f} s"


def test_a_header_of_100k_columns_missing_the_schemas_fails_fast(small: DatasetSchema) -> None:
    error, elapsed = _timed_error(_csv([f"x{i}" for i in range(WIDE)]), small)
    assert error.reason == "missing columns: 'a', 'b', 'c'"
    assert elapsed < BOUND, f"{elapsed:.2f} s"


def test_a_schema_of_max_columns_loads_a_matching_header_fast() -> None:
    names = [f"c{i}" for i in range(MAX_COLUMNS)]
    started = time.perf_counter()
    schema = DatasetSchema.model_validate(_schema(names))
    table = load_csv(_csv(list(reversed(names))), schema)
    elapsed = time.perf_counter() - started
    assert table.n_rows == 1
    assert list(table.columns) == list(reversed(names))
    assert elapsed < BOUND, f"{elapsed:.2f} s"


def test_a_schema_has_at_most_max_columns() -> None:
    assert MAX_COLUMNS == 1000
    started = time.perf_counter()
    with pytest.raises(ValidationError) as caught:
        DatasetSchema.model_validate(_schema([f"c{i}" for i in range(WIDE)]))
    elapsed = time.perf_counter() - started
    first = caught.value.errors()[0]
    assert first["loc"] == ("columns",)
    assert f"at most {MAX_COLUMNS} columns" in first["msg"]
    assert f"{WIDE}" in first["msg"]
    assert elapsed < BOUND, f"{elapsed:.2f} s"
    with pytest.raises(ValidationError) as one_more:
        DatasetSchema.model_validate(_schema([f"c{i}" for i in range(MAX_COLUMNS + 1)]))
    assert one_more.value.errors()[0]["loc"] == ("columns",)


def test_duplicate_names_in_a_wide_schema_are_found_fast() -> None:
    names = [f"c{i % (MAX_COLUMNS // 2)}" for i in range(MAX_COLUMNS)]
    started = time.perf_counter()
    with pytest.raises(ValidationError, match="duplicate column names: 'c0', 'c1', 'c10'"):
        DatasetSchema.model_validate(_schema(names))
    assert time.perf_counter() - started < BOUND


def test_a_header_wider_than_the_schema_is_refused_before_the_rows_are_read(small: DatasetSchema) -> None:
    """Its header error, even when a row further on is not valid CSV (a field over the csv module's limit):
    the rows of a header that cannot match are never parsed."""
    too_long = "9" * 200_000
    wide = b"a,b,c,zip\n1,2,3,4\n" + f"1,2,3,{too_long}\n".encode()
    error, _ = _timed_error(wide, small)
    assert error.reason == "columns not in the schema: 'zip'"
    narrow = b"a,b,c\n1,2,3\n" + f"1,2,{too_long}\n".encode()  # not wider: the file is read first, as before
    error, _ = _timed_error(narrow, small)
    assert error.reason.startswith("the file is not valid CSV: field larger than field limit")
