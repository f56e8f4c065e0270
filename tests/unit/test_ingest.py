"""Snapshots from CSV and Parquet: csv_to_parquet agrees with load_csv on every file, bit for bit.

Parity with ``mechanisms.data.table.load_csv`` (the contract): csv_to_parquet accepts exactly the files
load_csv accepts; then every column is equal bit for bit (float64 compared as int64 bit patterns, int64
values, categorical codes), and so are the row and clip counts; on a rejection both raise ``TableError``
on field ``"file"`` naming the same column and 1-based row. Checked on hand-written adversarial files and on
Hypothesis-generated ones. Then the physical format (types, order, row groups, determinism) and Parquet
sources registered by reference.
"""

from __future__ import annotations

import hashlib
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mechanisms.data.schema import DatasetSchema
from mechanisms.data.table import TableError, load_csv
from service.data import ingest
from service.data.errors import SourceError
from service.data.ingest import (
    Ingested,
    csv_to_parquet,
    encode_batch,
    parquet_to_snapshot,
    snapshot_schema,
)


def make_schema(*columns: dict[str, Any]) -> DatasetSchema:
    return DatasetSchema.model_validate({"columns": list(columns), "neighboring": "replace_one"})


SCHEMA = make_schema(
    {"name": "age", "type": "float", "min": 0, "max": 100},
    {"name": "n", "type": "int", "min": -5, "max": 10},
    {"name": "group", "type": "categorical", "values": ["a", "b", "c d"]},
)
ONE_COLUMN = make_schema({"name": "x", "type": "float", "min": -1.5, "max": 2.25})
WHERE = re.compile(r"^(?:column '(?P<column>[^']*)', )?row (?P<row>\d+)")


# ----- the parity harness -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    """What a loader made of a file: its columns, or the column and row its error names."""

    reason: str | None = None
    columns: dict[str, np.ndarray] | None = None
    clipped: dict[str, int] | None = None
    n_rows: int | None = None

    @property
    def where(self) -> tuple[str | None, str | None]:
        match = WHERE.match(self.reason or "")
        return (match["column"], match["row"]) if match else (None, None)


def by_load_csv(data: bytes, schema: DatasetSchema) -> Outcome:
    try:
        table = load_csv(data, schema)
    except TableError as exc:
        return rejected(exc)
    return Outcome(columns=table.columns, clipped=table.clipped, n_rows=table.n_rows)


def rejected(error: TableError) -> Outcome:
    assert error.field == "file"
    return Outcome(reason=error.reason)


def read_snapshot(result: Ingested, schema: DatasetSchema) -> dict[str, np.ndarray]:
    table = pq.read_table(result.path)
    assert table.schema == snapshot_schema(schema)
    return {name: table.column(name).to_numpy() for name in schema.names}


def by_csv_to_parquet(data: bytes, schema: DatasetSchema) -> Outcome:
    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        source = work / "upload.csv"
        source.write_bytes(data)
        try:
            result = csv_to_parquet(source, schema, work)
        except TableError as exc:
            failure = exc
        else:
            columns = read_snapshot(result, schema)
            return Outcome(columns=columns, clipped=result.clipped, n_rows=result.n_rows)
        assert sorted(p.name for p in work.iterdir()) == ["upload.csv"], "the partial snapshot is removed"
        return rejected(failure)


def assert_same_columns(
    got: dict[str, np.ndarray], expected: dict[str, np.ndarray], schema: DatasetSchema
) -> None:
    for column in schema.columns:
        ours, theirs = got[column.name], expected[column.name]
        if column.type == "float":
            assert ours.dtype == np.float64
            np.testing.assert_array_equal(ours.view(np.int64), theirs.view(np.int64), err_msg=column.name)
        elif column.type == "int":
            assert ours.dtype == np.int64
            np.testing.assert_array_equal(ours, theirs, err_msg=column.name)
        else:
            assert ours.dtype == np.int32
            np.testing.assert_array_equal(ours.astype(np.int64), theirs, err_msg=column.name)


def assert_parity(data: bytes, schema: DatasetSchema = SCHEMA) -> Outcome:
    expected, got = by_load_csv(data, schema), by_csv_to_parquet(data, schema)
    assert (got.reason is None) == (expected.reason is None), (data[:300], expected.reason, got.reason)
    if expected.reason is not None:
        assert got.where == expected.where, (data[:300], expected.reason, got.reason)
        return got
    assert got.columns is not None
    assert expected.columns is not None
    assert_same_columns(got.columns, expected.columns, schema)
    assert (got.n_rows, got.clipped) == (expected.n_rows, expected.clipped)
    return got


# ----- hand-written files -------------------------------------------------------------------------------

HEADER = b"age,n,group\n"
ADVERSARIAL = [
    HEADER + b"20,1,a\n35.5,4,b\n150,3,a\n-5,12,c d\n60,7,b\n",  # clipping both ways
    HEADER + b"0,-5,a\n100,10,b\n-0,0,a\n-0.0,-0,b\n",  # on the bounds; negative zero
    HEADER + b"1e2,3.0,a\n1E-400,+4,b\n.5,5.,a\n5.,-0.0e3,b\n0001.500,1e1,a\n",  # spellings
    HEADER + b"1e400,1,a\n",  # overflow → inf
    HEADER + b"-1e400,1,a\n",
    HEADER + b"4.9e-324,1,a\n2.2250738585072011e-308,1,a\n",  # subnormals
    HEADER + b"0.1,1,a\n0.30000000000000004,1,a\n123456789.123456789123456789,1,a\n",
    HEADER + b"1" + b"0" * 400 + b",1,a\n",  # a 401-digit number
    HEADER + b"50,9007199254740993,a\n",  # beyond 2^53 (rounds, then clipped)
    HEADER + b"50,-9007199254740993.0,a\n",
    HEADER + b" 7.25 ,\t3\t,a\n\x0b8\x0c,\r\n",  # whitespace; a quoted \r\n cell below
    HEADER + b'1,"\t2\n",a\n',
    HEADER + "\u00a01\u2003,2,a\n".encode(),  # Unicode whitespace: stripped by Python
    HEADER + b"\x1c1\x1f,2,a\n",  # str.strip strips \x1c-\x1f too
    HEADER + b"1_000,2,a\n",  # Python's float reads underscores
    HEADER + "\u0661\u0662,2,a\n".encode(),  # and non-ASCII digits
    HEADER + "\uff11,2,a\n".encode(),
    HEADER + b"nan,1,a\n",
    HEADER + b"1,NaN,a\n",
    HEADER + b"1,2,a\n+inf,1,a\n",
    HEADER + b"-Infinity,1,a\n",
    HEADER + b"iNfInItY,1,a\n",
    HEADER + b"nan(123),1,a\n",  # Arrow reads it as NaN, Python not at all
    HEADER + b"infinit,1,a\n",
    HEADER + b"0x10,1,a\n",
    HEADER + b"1e,1,a\n",
    HEADER + b".,1,a\n",
    HEADER + b"1,2.5,a\n",
    HEADER + b"1,1e-1,a\n",
    HEADER + b"1,2,A\n",
    HEADER + b"1,2, a\n",
    HEADER + b"1,2,c  d\n",
    HEADER + b"1,2,c d \n",
    HEADER + b'1,2,"c d"\n',
    HEADER + b'"1","2","a"\n',
    HEADER + b'"1"x,2,a\n',  # text after a closing quote joins the cell
    HEADER + b'1,2,"a"b\n',
    HEADER + b'1,2,a"b\n',  # a quote inside an unquoted cell is literal
    HEADER + b'1,2,"a""b"\n',
    HEADER + b'1,2,"a',  # an unterminated quote runs to the end of the file
    HEADER + b'1,"2',
    HEADER + b'1,"2\n3,4,a\n',
    HEADER + b'""",2\n',
    HEADER + b",1,a\n",
    HEADER + b"   ,1,a\n",
    HEADER + b"1,,a\n",
    HEADER + b"1,2,\n",
    HEADER + b'1,2,""\n',
    HEADER + b",,\n",
    HEADER + b"1,2\n",
    HEADER + b"1,2,a,\n",
    HEADER + b"1,2,a\n\n\n3,4\n",
    HEADER + b"1,2,a\n\r\n\r3,x,b\n",  # blank records in three spellings
    HEADER + b"1,2,a\r\n\r\n3,4,b\r\n",
    b"age,n,group\r1,2,a\r\r3,4,b\r",
    b"age,n,group",
    HEADER,
    HEADER + b"\n\n\n",
    b"",
    b"\n",
    b"\n\nage,n,group\n1,2,a\n",
    b"\n,\r",  # a blank first line: pyarrow takes the next record for its header
    b"\n1,2\n1," + b"9" * 131_073 + b"\n",
    b"\xef\xbb\xbfage,n,group\n1,2,a\n",
    b"\xef\xbb\xbf",
    b"\xef\xbb\xbf\xef\xbb\xbfage,n,group\n1,2,a\n",  # a second BOM is part of the name
    HEADER + b"\xef\xbb\xbf1,2,a\n",  # a BOM inside the data is a character
    b" group , age,n\n c d,1,2\n",
    b'"group","age","n"\n"a",1,2\n',
    b'"a\nge",n,group\n1,2,a\n',
    b"age,n\n1,2\n",
    b"age,n,group,zip\n1,2,a,9\n",
    b"age,n,group,age\n1,2,a,3\n",
    b"age,n,group, age\n1,2,a,3\n",
    b"AGE,n,group\n1,2,a\n",
    HEADER + b"1,2,a\x00\n",
    b"age,n,gr\x00oup\n1,2,a\n",
    HEADER + b"1,2,\xff\n",
    HEADER + b"1,2,a\n\xc3",  # truncated sequence at the end
    HEADER + b"1,2,\xed\xa0\x80\n",  # an encoded surrogate
    HEADER + "1,2,é\n".encode(),
    "age,n,group\n1,2,a\n".encode("utf-16"),
    # precedence: load_csv checks the whole file in a fixed order
    HEADER + b"x,2,a\n1,2\n",  # ragged beats a bad cell before it
    HEADER + b"1,x,a\n\n,2,a\n",  # the first column beats a row further up
    HEADER + b"1,x,a\n,2,a\nz,2,a\n",  # an empty cell beats a non-number above it
    HEADER + b"nan,2,a\nq,2,a\n",  # "not a number" beats "not finite"
    HEADER + b"1,2.5,a\n1,inf,a\n",  # "not finite" beats "not an integer"
    HEADER + b"1,2,d\n1,2,\n",  # empty beats undeclared
    HEADER + b"x,2,a\n" + b"\xff",  # UTF-8 beats everything
    HEADER + b"x,2,a\n1,2\n\x00",  # then NUL
    b"age,age,n,group\n1,2\n",  # the header is checked before the rows
    HEADER + b"1,2," + b"a" * 131_073 + b"\n",  # the csv module's field limit
    HEADER + b"1,2," + b"a" * 131_072 + b"\n",
    b"age,n,group,x\n1,2," + b"a" * 131_073 + b"\n",  # the limit beats the header error
    HEADER + b"1,2,a\n1,2," + b"a" * 131_073 + b",9\n",  # and a ragged row
    HEADER + b'x,2,a\n1,2,"' + b"a\n" * 70_000 + b'"\n',
]


@pytest.mark.parametrize("data", ADVERSARIAL, ids=range(len(ADVERSARIAL)))
def test_adversarial_files(data: bytes) -> None:
    assert_parity(data)


def test_rejections_name_column_and_row_like_load_csv() -> None:
    got = assert_parity(HEADER + b"1,2,a\n\n\n1,2,a\n4,x,a\n")
    assert got.where == ("n", "5")
    assert got.reason == "column 'n', row 5: 'x' is not a number"


def test_one_column_blank_lines_and_empty_quotes() -> None:
    for data in (b"x\n1\n\n2\n", b'x\n1\n""\n2\n', b"x\n\n\n", b"x\n \n", b"x\r\n1\r\n\r\n", b'x\n"1\n"\n'):
        assert_parity(data, ONE_COLUMN)


def test_error_rows_across_many_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    """Small CSV blocks: thousands of batches, blank lines everywhere, the error far down the file."""
    monkeypatch.setattr(ingest, "CSV_BLOCK_BYTES", 256)
    rows = [b"1,2,a", b"", b"3.5,4,b", b'"7",-1,"c d"', b"\r"] * 400
    good = HEADER + b"\n".join(rows) + b"\n"
    assert assert_parity(good).n_rows == 1200
    assert_parity(good + b"1,2,a\n5,5,zz\n\n")
    assert_parity(HEADER + b"1,x,a\n" + b"\n".join(rows) + b"\n,1,a\n")  # column order beats batch order
    assert_parity(HEADER + b"x,1,a\n" + b"\n".join(rows) + b"\n1,1\n")  # a ragged row far down wins


def test_utf8_checked_across_block_boundaries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ingest, "READ_BYTES", 7)
    text = "age,n,group\n" + "1,2,a\n" * 3
    assert_parity(("\ufeff" + text).encode(), SCHEMA)
    header = "é,n,group\n".encode()
    for at in range(len(header) + 2):  # a bad byte at every offset, each side of a block boundary
        data = header[:at] + b"\xff" + header[at:]
        with pytest.raises(TableError) as ours:
            convert_in_temp(data)
        with pytest.raises(TableError) as theirs:
            load_csv(data, SCHEMA)
        assert ours.value.reason == theirs.value.reason


def convert_in_temp(data: bytes, schema: DatasetSchema = SCHEMA) -> Ingested:
    with tempfile.TemporaryDirectory() as folder:
        source = Path(folder) / "upload.csv"
        source.write_bytes(data)
        return csv_to_parquet(source, schema, Path(folder))


# ----- Hypothesis-generated files -----------------------------------------------------------------------

NUMBER_TOKENS = [
    "nan",
    "NaN",
    "-nan",
    "inf",
    "-Infinity",
    "1_0",
    "1e400",
    "nan(2)",
    "\u0661",
    "\u00a01",
    "",
    " ",
    "1.5",
    "3.0",
    "+.5e1",
    "x",
    "1e",
    "0x1",
    "--1",
    "1,5",
    '"',
    "1 2",
    "\t",
]
CATEGORY_TOKENS = ["", " a", "a ", "A", "d", "c  d", "c d ", '"a"', "a,b", "a\nb", "é"]
safe_text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=4)


def numbers(noise: int) -> st.SearchStrategy[str]:
    plain = st.one_of(
        st.floats(-200, 200).map(repr),
        st.floats(allow_nan=False, allow_infinity=False).map(repr),
        st.integers(-20, 120).map(str),
        st.integers(-20, 120).map("{}.0".format),
        st.floats(-200, 200).map("{:.3e}".format),
        st.floats(-200, 200).map("{:.2f}".format),
    )
    padded = st.tuples(st.sampled_from(["", " ", "\t"]), plain, st.sampled_from(["", " "])).map("".join)
    bad = st.one_of(
        st.sampled_from(NUMBER_TOKENS), st.text("0123456789+-.eE_ infatyINFATY", max_size=6), safe_text
    )
    return st.integers(0, 9).flatmap(lambda k: bad if k < noise else padded)


def categories(noise: int, values: tuple[str, ...]) -> st.SearchStrategy[str]:
    good = st.sampled_from(values)
    bad = st.one_of(st.sampled_from(CATEGORY_TOKENS), safe_text)
    return st.integers(0, 9).flatmap(lambda k: bad if k < noise else good)


def encode_cell(cell: str, quote: bool) -> str:
    if quote or any(c in cell for c in ",\r\n") or cell.startswith('"'):
        return '"' + cell.replace('"', '""') + '"'
    return cell


@st.composite
def csv_files(draw: st.DrawFn) -> bytes:
    noise = draw(st.sampled_from([0, 0, 1, 3]))
    names = list(draw(st.permutations(SCHEMA.names)))
    if noise and draw(st.integers(0, 9)) == 0:
        names = draw(st.sampled_from([names[:-1], [*names, "zip"], [*names, names[0]]]))
    cells = {
        "age": numbers(noise),
        "n": numbers(noise),
        "group": categories(noise, ("a", "b", "c d")),
        "zip": st.just("9"),
    }
    lines = [
        ",".join(encode_cell(draw(st.sampled_from(["", " ", "  "])) + n, draw(st.booleans())) for n in names)
    ]
    for _ in range(draw(st.integers(0, 12))):
        kind = draw(st.integers(0, 19))
        if kind == 0:
            lines.append("")
            continue
        row = [draw(cells[n]) for n in names]
        if noise and kind == 1:
            row = row[:-1] if draw(st.booleans()) else [*row, "1"]
        lines.append(",".join(encode_cell(c, draw(st.integers(0, 4)) == 0) for c in row))
    endings = [draw(st.sampled_from(["\n", "\r\n", "\r"])) for _ in lines]
    text = "".join(line + end for line, end in zip(lines, endings, strict=True))
    if draw(st.booleans()):
        text = text[: -len(endings[-1])]
    return (draw(st.sampled_from(["", "\ufeff"])) + text).encode()


@given(csv_files())
def test_generated_files(data: bytes) -> None:
    assert_parity(data)


@given(st.lists(numbers(2), min_size=1, max_size=30))
def test_generated_numbers(cells: list[str]) -> None:
    """One numeric column: the cast fast path, the cell-by-cell path and load_csv agree on every cell."""
    body = "".join(encode_cell(c, False) + "\n" for c in cells)
    assert_parity(("x\n" + body).encode(), ONE_COLUMN)
    assert_parity(
        ("x,n\n" + "".join(f"{encode_cell(c, False)},{encode_cell(c, False)}\n" for c in cells)).encode(),
        make_schema(
            {"name": "x", "type": "float", "min": -1e15, "max": 1e15},
            {"name": "n", "type": "int", "min": -(2**53 - 1), "max": 2**53 - 1},
        ),
    )


# ----- the physical format ------------------------------------------------------------------------------


def test_snapshot_columns_in_schema_order_typed_and_not_nullable(tmp_path: Path) -> None:
    source = tmp_path / "upload.csv"
    source.write_bytes(b"group,n,age\nb,3,20.5\n")
    table = pq.read_table(csv_to_parquet(source, SCHEMA, tmp_path).path)
    assert table.schema == snapshot_schema(SCHEMA)
    assert table.schema == pa.schema(
        [
            pa.field("age", pa.float64(), nullable=False),
            pa.field("n", pa.int64(), nullable=False),
            pa.field("group", pa.int32(), nullable=False),
        ]
    )
    assert table.to_pydict() == {"age": [20.5], "n": [3], "group": [1]}


def test_row_groups_and_bytes_do_not_depend_on_batching(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ingest, "ROW_GROUP_ROWS", 10)
    source = tmp_path / "upload.csv"
    source.write_bytes(HEADER + b"".join(b"%d.5,%d,a\n" % (i, i % 7) for i in range(95)))
    digests = set()
    for block in (64, 300, 1 << 20):
        monkeypatch.setattr(ingest, "CSV_BLOCK_BYTES", block)
        result = csv_to_parquet(source, SCHEMA, tmp_path)
        metadata = pq.ParquetFile(result.path).metadata
        assert [metadata.row_group(i).num_rows for i in range(metadata.num_row_groups)] == [10] * 9 + [5]
        assert metadata.row_group(0).column(0).compression == "ZSTD"
        digests.add(result.sha256)
        result.path.unlink()
    assert len(digests) == 1


def test_progress_is_called_per_batch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ingest, "CSV_BLOCK_BYTES", 128)
    source = tmp_path / "upload.csv"
    source.write_bytes(HEADER + b"1,2,a\n" * 300)
    seen: list[int] = []
    result = csv_to_parquet(source, SCHEMA, tmp_path, progress=seen.append)
    assert len(seen) >= 300 * 6 // 128
    assert seen == sorted(seen)
    assert seen[-1] == result.n_rows == 300


def test_sha256_is_the_file_hash(tmp_path: Path) -> None:
    source = tmp_path / "upload.csv"
    source.write_bytes(HEADER + b"1,2,a\n")
    result = csv_to_parquet(source, SCHEMA, tmp_path)
    assert result.sha256 == hashlib.sha256(result.path.read_bytes()).hexdigest()
    assert result.path.parent == tmp_path


# ----- Parquet by reference -----------------------------------------------------------------------------


def write_parquet(path: Path, columns: dict[str, pa.Array], row_group_size: int | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), path, row_group_size=row_group_size)
    return path


def snapshot_of_csv(data: bytes, schema: DatasetSchema, work: Path) -> Ingested:
    source = work / "equivalent.csv"
    source.write_bytes(data)
    return csv_to_parquet(source, schema, work)


def test_parquet_types_give_the_same_snapshot_as_the_csv(tmp_path: Path) -> None:
    columns = {
        "group": pa.array(["a", "c d", "b", "a"]).dictionary_encode(),
        "age": pa.array([20.5, 150.0, -3.0, 0.25], pa.float32()),
        "n": pa.array([1, 12, -7, 3], pa.int16()),
        "extra": pa.array(["ignored"] * 4),
    }
    source = write_parquet(tmp_path / "in.parquet", columns)
    result = parquet_to_snapshot(str(source), SCHEMA, tmp_path)
    csv = snapshot_of_csv(b"age,n,group\n20.5,1,a\n150,12,c d\n-3,-7,b\n0.25,3,a\n", SCHEMA, tmp_path)
    assert result.sha256 == csv.sha256
    assert result.clipped == csv.clipped == {"age": 2, "n": 2, "group": 0}
    assert result.n_rows == 4


@pytest.mark.parametrize(
    ("age", "n", "group"),
    [
        (pa.array([1.5, 2.0]), pa.array([3.0, 4.0]), pa.array(["a", "b"], pa.large_string())),
        (
            pa.array([1, 2], pa.uint8()),
            pa.array([3, 2**64 - 1], pa.uint64()),
            pa.array(["a", "b"], pa.string_view()),
        ),
        (
            pa.array([1, 2], pa.int64()),
            pa.array([3, 4], pa.int32()),
            pa.array(["a", "b"]).dictionary_encode(),
        ),
        (
            pa.array(["1.5", "2"]).cast(pa.decimal128(10, 2)),
            pa.array(["3", "4.00"]).cast(pa.decimal128(10, 2)),
            pa.array(["a", "b"]),
        ),
    ],
)
def test_parquet_accepted_types(tmp_path: Path, age: pa.Array, n: pa.Array, group: pa.Array) -> None:
    source = write_parquet(tmp_path / "in.parquet", {"age": age, "n": n, "group": group})
    result = parquet_to_snapshot(str(source), SCHEMA, tmp_path)
    columns = read_snapshot(result, SCHEMA)
    assert columns["group"].tolist() == [0, 1]
    assert columns["n"].tolist()[0] == 3


@pytest.mark.parametrize(
    ("columns", "reason"),
    [
        (
            {"age": pa.array([1.0, None]), "n": pa.array([1, 2]), "group": pa.array(["a", "b"])},
            "column 'age', row 2",
        ),
        (
            {"age": pa.array([1.0, float("nan")]), "n": pa.array([1, 2]), "group": pa.array(["a", "b"])},
            "column 'age', row 2",
        ),
        (
            {"age": pa.array([float("-inf"), 1.0]), "n": pa.array([1, 2]), "group": pa.array(["a", "b"])},
            "column 'age', row 1",
        ),
        (
            {"age": pa.array([1.0, 2.0]), "n": pa.array([1.0, 2.5]), "group": pa.array(["a", "b"])},
            "column 'n', row 2",
        ),
        (
            {"age": pa.array([1.0, 2.0]), "n": pa.array([1, None]), "group": pa.array(["a", "b"])},
            "column 'n', row 2",
        ),
        (
            {"age": pa.array([1.0, 2.0]), "n": pa.array([1, 2]), "group": pa.array(["a", "z"])},
            "column 'group', row 2",
        ),
        (
            {"age": pa.array([1.0, 2.0]), "n": pa.array([1, 2]), "group": pa.array([None, "a"])},
            "column 'group', row 1",
        ),
        (
            {"age": pa.array(["1", "2"]), "n": pa.array([1, 2]), "group": pa.array(["a", "b"])},
            "column 'age' has type string",
        ),
        (
            {"age": pa.array([1.0, 2.0]), "n": pa.array([True, False]), "group": pa.array(["a", "b"])},
            "column 'n' has type bool",
        ),
        (
            {"age": pa.array([1.0, 2.0]), "n": pa.array([1, 2]), "group": pa.array([0, 1])},
            "column 'group' has type int64",
        ),
        ({"age": pa.array([1.0, 2.0]), "n": pa.array([1, 2])}, "column 'group' is not in"),
    ],
)
def test_parquet_bad_values_name_column_and_row(
    tmp_path: Path, columns: dict[str, pa.Array], reason: str
) -> None:
    source = write_parquet(tmp_path / "in.parquet", columns)
    with pytest.raises(SourceError) as caught:
        parquet_to_snapshot(str(source), SCHEMA, tmp_path / "work")
    assert caught.value.field == "source"
    assert reason in caught.value.reason


def test_parquet_row_numbers_count_across_batches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ingest, "SOURCE_BATCH_ROWS", 3)
    age = [1.0] * 10 + [float("nan")]
    columns = {"age": pa.array(age), "n": pa.array([1] * 11), "group": pa.array(["a"] * 11)}
    source = write_parquet(tmp_path / "in.parquet", columns, row_group_size=4)
    with pytest.raises(SourceError, match=r"column 'age', row 11: nan is not a finite number"):
        parquet_to_snapshot(str(source), SCHEMA, tmp_path)


def test_parquet_folder_in_path_order(tmp_path: Path) -> None:
    folder = tmp_path / "lake"
    for index, part in ((2, "b/part-0.parquet"), (1, "a/part-1.parquet"), (0, "a/part-0.parquet")):
        write_parquet(
            folder / part, {"age": pa.array([float(index)]), "n": pa.array([index]), "group": pa.array(["a"])}
        )
    (folder / "_SUCCESS").write_bytes(b"")
    (folder / "a" / ".part-0.parquet.crc").write_bytes(b"junk")
    (folder / "_temporary").mkdir()
    (folder / "_temporary" / "junk.parquet").write_bytes(b"junk")
    work = tmp_path / "work"
    work.mkdir()
    result = parquet_to_snapshot(f"file://{folder}", SCHEMA, work)
    assert read_snapshot(result, SCHEMA)["n"].tolist() == [0, 1, 2]
    write_parquet(
        folder / "b" / "part-1.parquet",
        {"age": pa.array([1.0, 2.0]), "n": pa.array([1, None]), "group": pa.array(["a", "b"])},
    )
    with pytest.raises(SourceError, match=r"column 'n', row 2 of b/part-1.parquet: null value"):
        parquet_to_snapshot(str(folder), SCHEMA, work)
    assert [p.name for p in work.iterdir()] == [result.path.name], "the partial snapshot is removed"


def test_parquet_clipping(tmp_path: Path) -> None:
    columns = {
        "age": pa.array([-1e300, 1e300, 50.0]),
        "n": pa.array([-(2**62), 2**62, 0]),
        "group": pa.array(["a"] * 3),
    }
    result = parquet_to_snapshot(str(write_parquet(tmp_path / "in.parquet", columns)), SCHEMA, tmp_path)
    snapshot = read_snapshot(result, SCHEMA)
    assert snapshot["age"].tolist() == [0.0, 100.0, 50.0]
    assert snapshot["n"].tolist() == [-5, 10, 0]
    assert result.clipped == {"age": 2, "n": 2, "group": 0}


@pytest.mark.parametrize(
    "make",
    [
        lambda root: str(root / "nowhere.parquet"),
        lambda root: str(root / "empty-folder"),
        lambda root: str(root / "not-parquet.parquet"),
        lambda root: "s3://bucket/key.parquet",
        lambda root: str(root / "empty.parquet"),
    ],
)
def test_parquet_bad_sources(tmp_path: Path, make: Callable[[Path], str]) -> None:
    (tmp_path / "empty-folder").mkdir()
    (tmp_path / "not-parquet.parquet").write_bytes(b"PAR1 but not really")
    write_parquet(
        tmp_path / "empty.parquet",
        {
            "age": pa.array([], pa.float64()),
            "n": pa.array([], pa.int64()),
            "group": pa.array([], pa.string()),
        },
    )
    source = make(tmp_path)
    with pytest.raises(SourceError) as caught:
        parquet_to_snapshot(source, SCHEMA, tmp_path)
    assert caught.value.field == "source"
    assert Path(source).name in caught.value.reason or "s3://bucket/key.parquet" in caught.value.reason
    assert not list(tmp_path.glob("snapshot-*")), "no partial snapshot is left"


def test_encode_batch_is_shared_and_strict() -> None:
    batch = pa.record_batch({"group": pa.array(["b"]), "n": pa.array([4], pa.int8()), "age": pa.array([7.5])})
    arrays, clipped = encode_batch(batch, SCHEMA)
    assert [a.type for a in arrays] == [pa.float64(), pa.int64(), pa.int32()]
    assert [a.to_pylist() for a in arrays] == [[7.5], [4], [1]]
    assert clipped == {"age": 0, "n": 0, "group": 0}
    with pytest.raises(SourceError, match="row 13: null value"):
        encode_batch(
            pa.record_batch(
                {"group": pa.array([None], pa.string()), "n": pa.array([1]), "age": pa.array([1.0])}
            ),
            SCHEMA,
            first_row=12,
        )
