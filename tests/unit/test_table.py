"""load_csv: typed, clipped columns; every malformed file raises TableError naming column and row."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from mechanisms.data.schema import DatasetSchema
from mechanisms.data.table import LoadedTable, TableError, content_hash, load_csv


def test_types_and_clipped_values(table: LoadedTable) -> None:
    assert table.n_rows == 5
    age, n, group = table.columns["age"], table.columns["n"], table.columns["group"]
    assert age.dtype == np.float64
    assert n.dtype == np.int64
    assert group.dtype == np.int64
    np.testing.assert_array_equal(age, [20.0, 35.5, 100.0, 0.0, 60.0])
    np.testing.assert_array_equal(n, [1, 4, 3, 10, 7])
    np.testing.assert_array_equal(group, [0, 1, 0, 2, 1])


def test_clip_counts(table: LoadedTable) -> None:
    assert table.clipped == {"age": 2, "n": 1, "group": 0}


def test_header_in_any_order_with_whitespace_and_bom(schema: DatasetSchema) -> None:
    data = "\ufeffgroup, age ,n\r\nb, 7.25 ,3.0\r\n\r\nc,1e1,-2\r\n".encode()
    table = load_csv(data, schema)
    assert table.n_rows == 2
    np.testing.assert_array_equal(table.columns["age"], [7.25, 10.0])
    np.testing.assert_array_equal(table.columns["n"], [3, 0])
    np.testing.assert_array_equal(table.columns["group"], [1, 2])
    assert table.clipped == {"age": 0, "n": 1, "group": 0}


def test_quoted_cells(schema: DatasetSchema) -> None:
    table = load_csv(b'"age","n","group"\n"15",2,"b"\n', schema)
    assert table.columns["age"].tolist() == [15.0]
    assert table.columns["group"].tolist() == [1]


def test_values_on_the_bounds_are_not_clipped(schema: DatasetSchema) -> None:
    table = load_csv(b"age,n,group\n0,0,a\n100,10,c\n", schema)
    assert table.clipped == {"age": 0, "n": 0, "group": 0}


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"age,n,group\n1,2,a\nabc,3,b\n", "column 'age', row 2: 'abc' is not a number"),
        (b"age,n,group\n1,2,a\n2,2.5,b\n3,1,a\n", "column 'n', row 2: '2.5' is not an integer"),
        (b"age,n,group\n1,x,a\n", "column 'n', row 1: 'x' is not a number"),
        (b"age,n,group\n1,2,a\n1,2,d\n", "column 'group', row 2: 'd' is not a declared value"),
        (b"age,n,group\n1,2,a\n1,2, a\n", "column 'group', row 2: ' a' is not a declared value"),
        (b"age,n,group\n1,2,a\n,2,b\n", "column 'age', row 2: empty cell"),
        (b"age,n,group\n1,2,\n", "column 'group', row 1: empty cell"),
        (b"age,n,group\n1,2,a\n2,2,a\n3,2,a\nnan,2,a\n", "column 'age', row 4: 'nan' is not a finite number"),
        (b"age,n,group\n1,inf,a\n", "column 'n', row 1: 'inf' is not a finite number"),
        (b"age,n\n1,2\n", "missing columns: 'group'"),
        (b"age,n,group,zip\n1,2,a,9\n", "columns not in the schema: 'zip'"),
        (b"age,n,group,age\n1,2,a,3\n", "duplicate columns in the header: 'age'"),
        (b"age,n,group\n1,2,a\n1,2\n", "row 2: 2 cells, the header has 3"),
        (b"age,n,group\n1,2,a,4\n", "row 1: 4 cells, the header has 3"),
        (b"", "the file is empty"),
        (b"age,n,group\n", "the file has no data rows"),
        (b"age,n,group\n\n\n", "the file has no data rows"),
        (b"age,n,group\n1,2,\xff\n", "not valid UTF-8"),
    ],
)
def test_bad_files(schema: DatasetSchema, data: bytes, reason: str) -> None:
    with pytest.raises(TableError) as caught:
        load_csv(data, schema)
    assert caught.value.field == "file"
    assert reason in caught.value.reason
    assert isinstance(caught.value, ValueError)


def test_row_numbers_count_blank_lines(schema: DatasetSchema) -> None:
    with pytest.raises(TableError, match="column 'age', row 3: 'x' is not a number"):
        load_csv(b"age,n,group\n1,2,a\n\nx,2,a\n", schema)


def test_content_hash_is_sha256(csv_bytes: bytes) -> None:
    assert content_hash(csv_bytes) == hashlib.sha256(csv_bytes).hexdigest()
    assert content_hash(csv_bytes) != content_hash(csv_bytes + b"\n")
    assert len(content_hash(b"")) == 64
