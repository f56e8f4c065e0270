"""Making a snapshot: a CSV upload, a Parquet file or folder, or a PostgreSQL table or query → a Parquet file.

Physical format of a snapshot (the engines rely on it): one Parquet file, the schema's columns in schema
order and named as in the schema, no nulls (every field non-nullable); a ``float`` column is float64, finite
and clipped to [min, max]; an ``int`` column is int64, clipped; a ``categorical`` column is int32 codes
indexing the declared ``values``. Row groups hold exactly ``ROW_GROUP_ROWS`` rows (the last one fewer), each
written from one contiguous chunk, so the same rows give the same bytes whichever source they came from and
however it was batched (with the same pyarrow version). zstd compression. The snapshot's id is the SHA-256
of the file.

Every source is streamed with bounded memory (a few CSV blocks or record batches, and at most two row
groups: one filling, one being written); nothing loads a whole table. Each function returns ``Ingested``
for a temporary file in ``work_dir`` (created if needed; the caller stores the file with
``SnapshotStore.put`` and deletes it); on any error the partial file is removed. ``progress(rows_done)`` is
called after every batch.

* ``csv_to_parquet`` accepts exactly the files ``mechanisms.data.table.load_csv`` accepts and produces the
  same values bit for bit and the same clip counts; a rejected file raises ``TableError`` (field ``"file"``)
  naming the same column and 1-based data row as ``load_csv`` (blank lines count in row numbers). Parsing is
  ``pyarrow.csv``'s multithreaded streaming reader, every cell read as a string; validation is vectorised with
  ``pyarrow.compute`` and NumPy. Python touches single cells only for cells that are not plain ASCII decimals
  (bad cells, NaN/inf spellings, underscores, non-ASCII digits), and the error path re-reads the file with the
  ``csv`` module (C-level, streamed) to turn a data index into ``load_csv``'s row number. pyarrow's reader is
  configured to split records and unquote cells as the csv module does (blank lines skipped, quoted newlines,
  non-strict quotes), which the tests check on adversarial and generated files; a record longer than
  ``CSV_BLOCK_BYTES`` is read again with larger blocks. The pass goes to the end of the file even after an
  error, because load_csv checks the whole file in a fixed order (text, CSV syntax, header, ragged rows,
  then column by column) and a later error can take precedence.
* ``parquet_to_snapshot`` and ``postgres_to_snapshot`` validate typed Arrow batches with one function,
  ``encode_batch``; a bad source raises ``SourceError`` (field ``"source"``) naming the column and row.
* ``postgres_to_snapshot`` reads through ADBC in one READ ONLY, REPEATABLE READ transaction (one consistent
  snapshot of the database). Its DSN is used for the copy only: never stored or logged, and scrubbed from
  every error message (with the password it holds).
"""

from __future__ import annotations

import codecs
import csv
import io
import re
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

import adbc_driver_manager
import adbc_driver_postgresql as adbc_postgres_driver
import adbc_driver_postgresql.dbapi as adbc_postgres
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pcsv
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from mechanisms.data.plan import ORDER_COLUMN
from mechanisms.data.schema import CategoricalColumn, DatasetSchema, FloatColumn, IntColumn
from mechanisms.data.table import QUOTE_CHARS, TableError, check_header
from mechanisms.noise import Noise
from service.data.errors import SourceError
from service.data.storage import file_sha256

ROW_GROUP_ROWS = 1 << 20
"""Rows per Parquet row group of a snapshot (the last group may hold fewer)."""
COMPRESSION = "zstd"
CSV_BLOCK_BYTES = 16 << 20
"""Bytes of CSV parsed per block (one record batch). A record longer than a block is read again with blocks
8 and 64 times larger (up to 1 GiB), so no record the csv module reads is refused for its length."""
READ_BYTES = 16 << 20
"""Bytes read at a time by the UTF-8 and NUL pre-check."""
SOURCE_BATCH_ROWS = 1 << 18
"""Rows per record batch read from a Parquet source."""
POSTGRES_BATCH_BYTES = 16 << 20
"""Size hint of the record batches ADBC reads from PostgreSQL."""

Progress = Callable[[int], None]
SchemaColumn = FloatColumn | IntColumn | CategoricalColumn


@dataclass(frozen=True)
class Ingested:
    """A snapshot written to a local temporary file: its rows, clip counts per column and SHA-256 (its id)."""

    path: Path
    n_rows: int
    clipped: dict[str, int]
    sha256: str


def snapshot_schema(schema: DatasetSchema) -> pa.Schema:
    """The Arrow schema of a snapshot of ``schema``: float64 / int64 / int32 codes, in order, non-nullable;
    with a privacy unit, then ``ORDER_COLUMN`` (int64, ``unit_order``)."""
    types = {"float": pa.float64(), "int": pa.int64(), "categorical": pa.int32()}
    fields = [pa.field(c.name, types[c.type], nullable=False) for c in schema.columns]
    if schema.privacy_unit is not None:
        fields.append(pa.field(ORDER_COLUMN, pa.int64(), nullable=False))
    return pa.schema(fields)


def _mix(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser on uint64 (wrapping arithmetic)."""
    z = z + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    result: np.ndarray = z ^ (z >> np.uint64(31))
    return result


def unit_order(arrays: Sequence[pa.Array], secret: int) -> pa.Array:
    """Each row's bounding order (``mechanisms.data.plan.UnitBound``): a hash of the row's encoded values
    keyed by ``secret`` (drawn from the OS CSPRNG once per snapshot and then discarded). A function of the row
    alone, so the rows a unit keeps depend on that unit's rows only; unknown to everyone, so no analyst can
    steer or predict which rows are kept."""
    n = len(arrays[0]) if arrays else 0
    state = np.full(n, np.uint64(secret), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for array in arrays:
            values = array.to_numpy(zero_copy_only=False)
            bits = (
                values.view(np.uint64)
                if values.dtype == np.float64
                else values.astype(np.int64).view(np.uint64)
            )
            state = _mix(state ^ bits)
    return pa.array(state.view(np.int64))


# ----- writing ------------------------------------------------------------------------------------------


class _SnapshotWriter:
    """Buffers encoded batches and writes row groups of exactly ``ROW_GROUP_ROWS`` rows, each from one
    contiguous chunk (so the bytes do not depend on how the source was batched)."""

    def __init__(self, schema: DatasetSchema, work_dir: Path) -> None:
        self.schema = snapshot_schema(schema)
        self.names = schema.names  # the data columns, in order (the snapshot may add ``ORDER_COLUMN``)
        # the bounding secret comes from the one home of randomness (the OS CSPRNG), like every noise draw
        self._secret = Noise.system().random_bits(64) if schema.privacy_unit is not None else None
        self._unit = schema.privacy_unit.column if schema.privacy_unit is not None else None
        work_dir.mkdir(parents=True, exist_ok=True)
        self.path = work_dir / f"snapshot-{uuid.uuid4().hex}.parquet"
        dictionary = [c.name for c in schema.columns if not isinstance(c, FloatColumn)]
        self._writer = pq.ParquetWriter(
            self.path, self.schema, compression=COMPRESSION, use_dictionary=dictionary
        )
        self._pending: list[pa.RecordBatch] = []
        self._pending_rows = 0
        self.n_rows = 0
        self.clipped = dict.fromkeys(schema.names, 0)

    def append(self, arrays: Sequence[pa.Array], clipped: Mapping[str, int]) -> None:
        """Add encoded columns (schema order) and their clip counts."""
        columns = list(arrays)
        if self._unit is not None and clipped.get(self._unit, 0):
            raise TableError(
                "file",
                f"column {self._unit!r} identifies the privacy unit, and some of its values lie outside its "
                "declared bounds: identifiers are never clipped (two people would become one unit); widen "
                "the bounds",
            )
        if self._secret is not None:
            columns.append(unit_order(columns, self._secret))
        batch = pa.RecordBatch.from_arrays(columns, schema=self.schema)
        self._pending.append(batch)
        self._pending_rows += batch.num_rows
        self.n_rows += batch.num_rows
        for name, count in clipped.items():
            self.clipped[name] += count
        self._flush(final=False)

    def _flush(self, final: bool) -> None:
        while self._pending_rows >= ROW_GROUP_ROWS or (final and self._pending_rows):
            table = pa.Table.from_batches(self._pending, schema=self.schema)
            size = min(ROW_GROUP_ROWS, table.num_rows)
            self._writer.write_table(table.slice(0, size).combine_chunks(), row_group_size=ROW_GROUP_ROWS)
            rest = table.slice(size)
            self._pending, self._pending_rows = rest.to_batches(), rest.num_rows

    def finish(self, empty_error: Exception) -> Ingested:
        """Close the file and hash it; ``empty_error`` is raised when no row was written."""
        if not self.n_rows:
            raise empty_error
        self._flush(final=True)
        self._writer.close()
        self._secret = None  # never stored: the order cannot be recomputed, or predicted
        return Ingested(self.path, self.n_rows, dict(self.clipped), file_sha256(self.path))

    def discard(self) -> None:
        self._writer.close()
        self.path.unlink(missing_ok=True)


@contextmanager
def _writing(schema: DatasetSchema, work_dir: Path) -> Iterator[_SnapshotWriter]:
    """A snapshot writer whose file is removed when the block raises."""
    writer = _SnapshotWriter(schema, work_dir)
    try:
        yield writer
    except BaseException:
        writer.discard()
        raise


# ----- clipping (the same NumPy operations as load_csv) -------------------------------------------------


def _clip(values: np.ndarray, low: float, high: float) -> tuple[np.ndarray, int]:
    outside = int(np.count_nonzero((values < low) | (values > high)))
    return np.clip(values, low, high), outside


def _encode_float(column: FloatColumn, values: np.ndarray) -> tuple[pa.Array, int]:
    clipped, outside = _clip(values, column.min, column.max)
    return pa.array(clipped, pa.float64()), outside


def _encode_int_from_floats(column: IntColumn, values: np.ndarray) -> tuple[pa.Array, int]:
    """Integral float64 values → int64, clipped in float64 first exactly as load_csv does."""
    clipped, outside = _clip(values, float(column.min), float(column.max))
    return pa.array(clipped.astype(np.int64), pa.int64()), outside


def _first(mask: np.ndarray) -> int:
    return int(np.argmax(mask))


def _quote(value: str) -> str:
    """``repr`` of at most ``QUOTE_CHARS`` characters of a cell, then an ellipsis (as load_csv quotes)."""
    return repr(value) if len(value) <= QUOTE_CHARS else repr(value[:QUOTE_CHARS]) + "…"


# ----- CSV: the text checks (UTF-8, NUL, empty) ----------------------------------------------------------

_BOM = codecs.BOM_UTF8


def _fail(reason: str) -> TableError:
    return TableError("file", reason)


def _line_of(source: Path, offset: int) -> int:
    """1-based line of byte ``offset`` (newlines before it, plus one)."""
    newlines = 0
    with source.open("rb") as raw:
        while offset > 0 and (chunk := raw.read(min(READ_BYTES, offset))):
            newlines += chunk.count(b"\n")
            offset -= len(chunk)
    return newlines + 1


def _check_text(source: Path) -> None:
    """load_csv's first checks, streamed: valid UTF-8 (a BOM allowed), no NUL character, not empty.

    Byte offsets count from after the BOM, as load_csv's do."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset, nul, characters, bom = 0, -1, 0, 0
    with source.open("rb") as raw:
        while chunk := raw.read(READ_BYTES):
            if offset == 0 and not bom and chunk.startswith(_BOM):
                chunk, bom = chunk[len(_BOM) :], len(_BOM)
            pending = len(decoder.getstate()[0])
            try:
                characters += len(decoder.decode(chunk))
            except UnicodeDecodeError as exc:
                raise _fail(f"the file is not valid UTF-8 (byte {offset - pending + exc.start})") from None
            if nul < 0 and (found := chunk.find(b"\x00")) >= 0:
                nul = offset + found
            offset += len(chunk)
    pending = len(decoder.getstate()[0])
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError as exc:
        raise _fail(f"the file is not valid UTF-8 (byte {offset - pending + exc.start})") from None
    if nul >= 0:
        raise _fail(
            f"line {_line_of(source, nul + bom)} contains a NUL character; save the file as UTF-8 text"
        )
    if not characters:
        raise _fail("the file is empty")


def _read_header(source: Path) -> list[str]:
    """The first record, as the csv module reads it (``[]`` for a blank first line)."""
    with source.open(encoding="utf-8-sig", newline="") as text:
        try:
            return next(csv.reader(text), [])
        except csv.Error as exc:
            raise _fail(f"the file is not valid CSV: {exc}") from None


def _layout(header: Sequence[str], schema: DatasetSchema) -> list[tuple[int, SchemaColumn]] | TableError:
    """(position in the file, column) per header cell, or load_csv's header error (``check_header``, the one
    header check: linear in the width)."""
    try:
        names = check_header(header, schema)
    except TableError as exc:
        return exc
    by_name = {c.name: c for c in schema.columns}
    return [(position, by_name[name]) for position, name in enumerate(names)]


# ----- CSV: cells → values ------------------------------------------------------------------------------

# Kinds of bad cells, in the order load_csv checks a column (the first kind found in a column wins).
_EMPTY, _NOT_NUMBER, _NOT_FINITE, _NOT_INTEGER = 0, 1, 2, 3
_NOT_DECLARED = 1
_MESSAGES = {
    ("number", _NOT_NUMBER): "is not a number",
    ("number", _NOT_FINITE): "is not a finite number",
    ("number", _NOT_INTEGER): "is not an integer",
    ("categorical", _NOT_DECLARED): "is not a declared value",
}
_PLAIN_DECIMAL = r"^[ \t\n\v\f\r]*[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?[ \t\n\v\f\r]*$"
"""Cells Arrow's cast and Python's ``float`` read alike (both correctly rounded); others go to ``float``."""

Problems = dict[int, int]
"""Kind of bad cell → index of its first occurrence in a batch."""


def _cast_floats(cells: pa.Array) -> np.ndarray | None:
    """float64 values when every cell is a number for Arrow's cast (after trimming ASCII whitespace)."""
    try:
        values: np.ndarray = pc.cast(cells, pa.float64()).to_numpy()
    except pa.ArrowInvalid:
        try:
            values = pc.cast(pc.ascii_trim_whitespace(cells), pa.float64()).to_numpy()
        except pa.ArrowInvalid:
            return None
    return values


def _read_cell(cell: str) -> tuple[int, float]:
    """(kind, value) of one cell as load_csv reads it: stripped, then Python's float."""
    stripped = cell.strip()
    if not stripped:
        return _EMPTY, 0.0
    try:
        return -1, float(stripped)
    except ValueError:
        return _NOT_NUMBER, 0.0


def _floats_cell_by_cell(cells: pa.Array) -> tuple[np.ndarray, Problems]:
    """Plain decimals through Arrow; the other cells (bad or unusual spellings) one by one in Python."""
    plain = pc.match_substring_regex(cells, _PLAIN_DECIMAL).to_numpy(zero_copy_only=False)
    values = np.zeros(len(cells), dtype=np.float64)
    kinds = np.full(len(cells), -1, dtype=np.int64)
    try:
        text = pc.ascii_trim_whitespace(cells.filter(pa.array(plain)))
        values[plain] = pc.cast(text, pa.float64()).to_numpy()
    except pa.ArrowInvalid:  # not expected for plain decimals; Python then reads every cell
        plain[:] = False
    others = np.flatnonzero(~plain)
    read = [_read_cell(cell) for cell in cells.take(others).to_pylist()]
    kinds[others] = [kind for kind, _ in read]
    values[others] = [value for _, value in read]
    kinds[(kinds < 0) & ~np.isfinite(values)] = _NOT_FINITE
    return values, {int(k): _first(kinds == k) for k in np.unique(kinds[kinds >= 0])}


def _floats(cells: pa.Array) -> tuple[np.ndarray, Problems]:
    """float64 values of numeric cells and the first index of each kind of bad cell (load_csv's rules)."""
    values = _cast_floats(cells)
    if values is not None and np.isfinite(values).all():
        return values, {}
    return _floats_cell_by_cell(cells)


def _read_csv_column(column: SchemaColumn, cells: pa.Array) -> tuple[pa.Array | None, int, Problems]:
    """(encoded column or None, clipped count, problems) for one column of a CSV batch."""
    if isinstance(column, CategoricalColumn):
        codes = pc.index_in(cells, value_set=pa.array(column.values, pa.string()))
        if not codes.null_count:
            return codes, 0, {}
        empty = pc.equal(cells, "").to_numpy(zero_copy_only=False)
        unknown = codes.is_null().to_numpy(zero_copy_only=False) & ~empty
        masks = {_EMPTY: empty, _NOT_DECLARED: unknown}
        return None, 0, {kind: _first(mask) for kind, mask in masks.items() if mask.any()}
    values, problems = _floats(cells)
    if isinstance(column, IntColumn) and not problems:
        fractional = values != np.floor(values)
        if fractional.any():
            problems = {_NOT_INTEGER: _first(fractional)}
    if problems:
        return None, 0, problems
    if isinstance(column, FloatColumn):
        return (*_encode_float(column, values), {})
    return (*_encode_int_from_floats(column, values), {})


# ----- CSV: the streamed scan ---------------------------------------------------------------------------


def _inconsistent() -> TableError:
    """pyarrow's reader and the csv module disagree on the records (never seen: the tests compare them)."""
    return _fail("the file is not valid CSV: its records cannot be read unambiguously")


def _record_lengths(source: Path) -> Iterator[np.ndarray]:
    """Cell counts of the records after the header (0 for a blank one), read by the csv module as load_csv
    reads them."""
    with source.open(encoding="utf-8-sig", newline="") as text:
        records = csv.reader(text)
        next(records, None)
        while (lengths := np.fromiter(map(len, islice(records, 1 << 16)), dtype=np.int64)).size:
            yield lengths


def _first_ragged(source: Path, width: int) -> tuple[int, int]:
    """(row, cells) of the first non-blank record whose width differs from the header's."""
    offset = 0
    for lengths in _record_lengths(source):
        ragged = np.flatnonzero((lengths != 0) & (lengths != width))
        if ragged.size:
            return offset + int(ragged[0]) + 1, int(lengths[ragged[0]])
        offset += lengths.size
    raise _inconsistent()


def _row_of(source: Path, index: int) -> int:
    """load_csv's 1-based row number of the ``index``-th (0-based) non-blank data record."""
    offset, seen = 0, 0
    for lengths in _record_lengths(source):
        data = np.flatnonzero(lengths)
        if seen + data.size > index:
            return offset + int(data[index - seen]) + 1
        seen, offset = seen + data.size, offset + lengths.size
    raise _inconsistent()


@dataclass
class _CsvScan:
    """One pass of pyarrow's streaming CSV reader: writes the snapshot while the file is valid, and keeps
    what is needed to report load_csv's error otherwise (load_csv checks the whole file in a fixed order, so
    the pass goes on after a first error: an error further on may take precedence)."""

    source: Path
    header: list[str]
    layout: list[tuple[int, SchemaColumn]] | TableError
    writer: _SnapshotWriter
    progress: Progress | None
    block_bytes: int
    limit: int = field(default_factory=lambda: csv.field_size_limit())
    batches: int = 0
    data_rows: int = 0
    too_long: bool = False
    ragged: bool = False
    failed: TableError | None = None
    cells: dict[tuple[int, int], tuple[int, str]] = field(default_factory=dict)

    def _arrow_width(self) -> int:
        """Cells in pyarrow's first row: the header's, or (a blank first line, which pyarrow skips) those of
        the first non-blank record; every column is read as strings."""
        if self.header:
            return len(self.header)
        with self.source.open(encoding="utf-8-sig", newline="") as text:
            return next(filter(None, map(len, csv.reader(text))), 1)

    def _on_invalid_row(self, row: Any) -> str:
        self.ragged = True
        if len(row.text) > self.limit:
            try:
                list(csv.reader(io.StringIO(row.text, newline="")))
            except csv.Error:
                self.too_long = True
        return "skip"

    def _open(self) -> pcsv.CSVStreamingReader:
        return pcsv.open_csv(
            self.source,
            read_options=pcsv.ReadOptions(block_size=self.block_bytes, autogenerate_column_names=True),
            parse_options=pcsv.ParseOptions(
                newlines_in_values=True, ignore_empty_lines=True, invalid_row_handler=self._on_invalid_row
            ),
            convert_options=pcsv.ConvertOptions(
                column_types={f"f{i}": pa.string() for i in range(self._arrow_width())}, check_utf8=False
            ),
        )

    def run(self) -> None:
        """Read the whole file (unless a field is too long: nothing can take precedence over that)."""
        try:
            reader = self._open()
        except pa.ArrowInvalid as exc:  # blank lines only (the header check reports it), or unparsable
            self._arrow_failed(exc)
            return
        batches = iter(reader)
        while not self.too_long and self.failed is None:
            try:
                batch = next(batches)
            except StopIteration:
                return
            except pa.ArrowInvalid as exc:
                self._arrow_failed(exc)
                return
            self._scan(batch)

    def _arrow_failed(self, exc: pa.ArrowInvalid) -> None:
        if "straddl" in str(exc):
            raise _RecordTooLong from None
        if self.header:
            self.failed = _fail("the file is not valid CSV")

    def _scan(self, batch: pa.RecordBatch) -> None:
        self.batches += 1
        if self.batches == 1 and self.header:
            batch = self._without_header(batch)
        self.too_long = self.too_long or self._has_long_field(batch)
        if not isinstance(self.layout, TableError) and not (self.too_long or self.ragged):
            self._read(batch)
        self.data_rows += batch.num_rows
        if self.progress is not None:
            self.progress(self.data_rows)

    def _without_header(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        if batch.num_rows and not isinstance(self.layout, TableError):
            first = [batch.column(i)[0].as_py() for i in range(batch.num_columns)]
            if first != self.header:
                self.failed = _fail("the file is not valid CSV: its header row is ambiguous")
        return batch.slice(1)

    def _has_long_field(self, batch: pa.RecordBatch) -> bool:
        """Whether a cell exceeds the csv module's field limit (load_csv would fail with csv.Error)."""
        for cells in batch.columns:
            if not pa.types.is_string(cells.type) or not len(cells):
                continue
            if pc.max(pc.binary_length(cells)).as_py() > self.limit:
                if pc.max(pc.utf8_length(cells)).as_py() > self.limit:
                    return True
        return False

    def _read(self, batch: pa.RecordBatch) -> None:
        assert not isinstance(self.layout, TableError)
        encoded: dict[str, pa.Array] = {}
        clipped: dict[str, int] = {}
        for position, column in self.layout:
            cells = batch.column(position)
            array, clipped[column.name], problems = _read_csv_column(column, cells)
            for kind, index in problems.items():
                self.cells.setdefault((position, kind), (self.data_rows + index, cells[index].as_py()))
            if array is not None:
                encoded[column.name] = array
        if not self.cells:
            self.writer.append([encoded[name] for name in self.writer.names], clipped)

    def error(self) -> TableError | None:
        """load_csv's error for this file (the first in its order of checks), or None when it is valid."""
        if self.too_long:
            return _fail(f"the file is not valid CSV: field larger than field limit ({self.limit})")
        if isinstance(self.layout, TableError):
            return self.layout
        if self.failed is not None:
            return self.failed
        if self.ragged:
            row, count = _first_ragged(self.source, len(self.header))
            return _fail(f"row {row}: {count} cells, the header has {len(self.header)}")
        if not self.data_rows:
            return _fail("the file has no data rows")
        if self.cells:
            return self._cell_error(*min(self.cells.items()))
        return None

    def _cell_error(self, where: tuple[int, int], first: tuple[int, str]) -> TableError:
        (position, kind), (index, cell) = where, first
        _, column = self.layout[position]  # type: ignore[index]  # error() checked the layout
        row = _row_of(self.source, index)
        if kind == _EMPTY:
            return _fail(f"column {column.name!r}, row {row}: empty cell")
        family = "categorical" if isinstance(column, CategoricalColumn) else "number"
        return _fail(f"column {column.name!r}, row {row}: {_quote(cell)} {_MESSAGES[family, kind]}")


class _RecordTooLong(Exception):
    """A record does not fit in one CSV block: read the file again with larger blocks."""


def _convert_csv(
    source: Path,
    schema: DatasetSchema,
    work_dir: Path,
    progress: Progress | None,
    header: list[str],
    block_bytes: int,
) -> Ingested:
    with _writing(schema, work_dir) as writer:
        scan = _CsvScan(source, header, _layout(header, schema), writer, progress, block_bytes)
        try:
            scan.run()
            failure = scan.error()
        except csv.Error as exc:  # the csv module met an error that pyarrow did not
            failure = _fail(f"the file is not valid CSV: {exc}")
        if failure is not None:
            raise failure
        return writer.finish(_fail("the file has no data rows"))


def csv_to_parquet(
    source: Path, schema: DatasetSchema, work_dir: Path, progress: Progress | None = None
) -> Ingested:
    """A snapshot of a CSV file (an upload spooled to disk), validated exactly as ``load_csv`` validates.

    Raises ``TableError`` (field ``"file"``) naming the column and 1-based data row, like ``load_csv``.
    """
    _check_text(source)
    header = _read_header(source)
    layout = _layout(header, schema)
    if isinstance(layout, TableError) and len(header) > len(schema.columns):
        raise layout  # a header wider than the schema: refused before any row is read, as load_csv does
    for block_bytes in (CSV_BLOCK_BYTES, 8 * CSV_BLOCK_BYTES, 64 * CSV_BLOCK_BYTES):
        try:
            return _convert_csv(source, schema, work_dir, progress, header, min(block_bytes, 1 << 30))
        except _RecordTooLong:
            continue
    raise _fail("the file is not valid CSV: a record is longer than 1 GiB")


# ----- typed Arrow batches (Parquet, PostgreSQL) ---------------------------------------------------------


def _source_error(reason: str) -> SourceError:
    return SourceError("source", reason)


def _cell_problem(name: str, row: int, where: str, message: str) -> SourceError:
    return _source_error(f"column {name!r}, row {row}{where}: {message}")


def _is_numeric_text(data_type: pa.DataType) -> bool:
    """PostgreSQL ``numeric`` as ADBC delivers it: an opaque extension type stored as its decimal text."""
    return isinstance(data_type, pa.OpaqueType) and data_type.type_name == "numeric"


def _is_text(data_type: pa.DataType) -> bool:
    if isinstance(data_type, pa.ExtensionType):
        data_type = data_type.storage_type
    if pa.types.is_dictionary(data_type):
        data_type = data_type.value_type
    return bool(pa.types.is_string(data_type) or pa.types.is_large_string(data_type)) or (
        pa.types.is_string_view(data_type)
    )


def _is_number(data_type: pa.DataType) -> bool:
    t = pa.types
    return bool(t.is_integer(data_type) or t.is_floating(data_type) or t.is_decimal(data_type))


def type_problem(column: SchemaColumn, data_type: pa.DataType) -> str | None:
    """Why a source column of ``data_type`` cannot fill ``column``, or None when it can."""
    if isinstance(column, CategoricalColumn):
        if _is_text(data_type):
            return None
        return f"column {column.name!r} has type {data_type}; a categorical column needs strings"
    if _is_number(data_type) or _is_numeric_text(data_type):
        return None
    return f"column {column.name!r} has type {data_type}; a {column.type} column needs a numeric type"


def _as_floats(cells: pa.Array) -> np.ndarray:
    """float64 values of a numeric array (decimals and PostgreSQL numeric through their decimal text, so
    they round exactly like the same number in a CSV file; integers beyond 2⁵³ round, and are clipped)."""
    if _is_numeric_text(cells.type):
        cells = cells.storage
    if pa.types.is_decimal(cells.type):
        cells = pc.cast(cells, pa.string())
    values: np.ndarray = pc.cast(cells, pa.float64(), safe=False).to_numpy(zero_copy_only=False)
    return values


def _first_row(mask: np.ndarray, first_row: int) -> int:
    return first_row + _first(mask) + 1


def _first_non_number(cells: pa.Array) -> int:
    """Index of the first cell whose text is not a number (error path: one batch, cell by cell)."""
    text = pc.cast(cells.storage if _is_numeric_text(cells.type) else cells, pa.string()).to_pylist()
    return next((i for i, cell in enumerate(text) if _read_cell(cell)[0] >= 0), 0)


def _checked_floats(name: str, cells: pa.Array, first_row: int, where: str) -> np.ndarray:
    try:
        values = _as_floats(cells)
    except pa.ArrowInvalid:
        row = first_row + _first_non_number(cells) + 1
        raise _cell_problem(name, row, where, "is not a number") from None
    non_finite = ~np.isfinite(values)
    if non_finite.any():
        value = values[_first(non_finite)]
        raise _cell_problem(name, _first_row(non_finite, first_row), where, f"{value} is not a finite number")
    return values


def _int64(cells: pa.Array) -> np.ndarray:
    """int64 values of an integer array; uint64 values beyond int64 are first lowered to 2⁶³−1 (they are
    above every bound, so clipping gives the same result)."""
    if pa.types.is_uint64(cells.type):
        cells = pc.min_element_wise(cells, pa.scalar(2**63 - 1, pa.uint64()))
    values: np.ndarray = pc.cast(cells, pa.int64()).to_numpy(zero_copy_only=False)
    return values


def _encode_typed_number(
    column: FloatColumn | IntColumn, cells: pa.Array, first_row: int, where: str
) -> tuple[pa.Array, int]:
    if isinstance(column, IntColumn) and pa.types.is_integer(cells.type):
        clipped, outside = _clip(_int64(cells), column.min, column.max)
        return pa.array(clipped, pa.int64()), outside
    values = _checked_floats(column.name, cells, first_row, where)
    if isinstance(column, FloatColumn):
        return _encode_float(column, values)
    fractional = values != np.floor(values)
    if fractional.any():
        value = values[_first(fractional)]
        raise _cell_problem(
            column.name, _first_row(fractional, first_row), where, f"{value} is not an integer"
        )
    return _encode_int_from_floats(column, values)


def _encode_typed_categorical(
    column: CategoricalColumn, cells: pa.Array, first_row: int, where: str
) -> pa.Array:
    if isinstance(cells.type, pa.ExtensionType):
        cells = cells.storage
    declared = pa.array(column.values, pa.string())
    if pa.types.is_dictionary(cells.type):
        known = pc.index_in(pc.cast(cells.dictionary, pa.string()), value_set=declared)
        codes = pc.take(known, cells.indices)
    else:
        codes = pc.index_in(pc.cast(cells, pa.string()), value_set=declared)
    if codes.null_count:
        unknown = codes.is_null().to_numpy(zero_copy_only=False)
        cell = str(cells[_first(unknown)].as_py())
        raise _cell_problem(
            column.name, _first_row(unknown, first_row), where, f"{_quote(cell)} is not a declared value"
        )
    return codes.cast(pa.int32())


def encode_batch(
    batch: pa.RecordBatch, schema: DatasetSchema, first_row: int = 0, where: str = ""
) -> tuple[list[pa.Array], dict[str, int]]:
    """Validate a typed Arrow batch against ``schema`` and encode it in the snapshot format.

    ``batch`` holds the schema's columns by name (any order; others are ignored). Numeric columns accept
    integer, floating and decimal types (an ``int`` column takes floats only when integral); categorical
    columns accept strings (plain, large, view or dictionary-encoded). Nulls, NaN, ±inf, non-integral values
    in ``int`` columns and undeclared categories raise ``SourceError`` naming the column and the 1-based row
    (``first_row`` rows came before this batch; ``where`` is appended to the row, e.g. " of part-1.parquet").
    Returns the encoded columns in schema order and the number of values clipped per column.
    """
    arrays: list[pa.Array] = []
    clipped: dict[str, int] = {}
    for column in schema.columns:
        if batch.schema.get_field_index(column.name) < 0:
            raise _source_error(f"column {column.name!r} is missing or appears more than once")
        cells = batch.column(column.name)
        problem = type_problem(column, cells.type)
        if problem is not None:
            raise _source_error(problem)
        if cells.null_count:
            nulls = cells.is_null().to_numpy(zero_copy_only=False)
            raise _cell_problem(column.name, _first_row(nulls, first_row), where, "null value")
        if isinstance(column, CategoricalColumn):
            arrays.append(_encode_typed_categorical(column, cells, first_row, where))
            clipped[column.name] = 0
        else:
            array, clipped[column.name] = _encode_typed_number(column, cells, first_row, where)
            arrays.append(array)
    return arrays, clipped


def _copy_batches(
    batches: Iterator[pa.RecordBatch],
    schema: DatasetSchema,
    writer: _SnapshotWriter,
    progress: Progress | None,
    where: str = "",
) -> None:
    rows = 0
    for batch in batches:
        arrays, clipped = encode_batch(batch, schema, rows, where)
        writer.append(arrays, clipped)
        rows += batch.num_rows
        if progress is not None:
            progress(writer.n_rows)


# ----- Parquet by reference ------------------------------------------------------------------------------


def _label(source: str) -> str:
    """The source as shown in messages: no user information, query or fragment."""
    parts = urlsplit(source)
    if not parts.scheme or len(parts.scheme) == 1:  # a path (or a Windows drive letter)
        return source
    return f"{parts.scheme}://{parts.hostname or ''}{parts.path}"


def _location(source: str, filesystem: pafs.FileSystem | None) -> tuple[pafs.FileSystem, str]:
    parts = urlsplit(source)
    if parts.scheme == "s3":
        if filesystem is None:
            raise _source_error(f"{_label(source)}: an s3:// source needs the object store's settings")
        return filesystem, f"{parts.hostname or ''}{parts.path}".rstrip("/")
    if parts.scheme == "file":
        source = unquote(parts.path)
    if filesystem is None:
        return pafs.LocalFileSystem(), str(Path(source).expanduser().resolve())
    return filesystem, source.rstrip("/")


def _hidden(relative: str) -> bool:
    """Files Spark, Hive and pyarrow.dataset skip: any path part starting with ``_`` or ``.``."""
    return any(part.startswith(("_", ".")) for part in relative.split("/"))


def _parquet_files(filesystem: pafs.FileSystem, root: str, label: str) -> list[str]:
    """The Parquet file, or the files of the folder (recursively, sorted, hidden ones skipped)."""
    try:
        info = filesystem.get_file_info(root)
        if info.type == pafs.FileType.File:
            return [root]
        if info.type != pafs.FileType.Directory:
            raise _source_error(f"{label} does not exist")
        entries = filesystem.get_file_info(pafs.FileSelector(root, recursive=True))
    except OSError as exc:
        raise _source_error(f"{label} cannot be read ({type(exc).__name__})") from None
    prefix = root.rstrip("/") + "/"
    files = sorted(
        e.path for e in entries if e.type == pafs.FileType.File and not _hidden(e.path.removeprefix(prefix))
    )
    if not files:
        raise _source_error(f"{label} holds no Parquet files")
    return files


def _check_parquet_columns(arrow_schema: pa.Schema, schema: DatasetSchema, shown: str) -> None:
    for column in schema.columns:
        indices = arrow_schema.get_all_field_indices(column.name)
        if not indices:
            raise _source_error(f"column {column.name!r} is not in {shown}")
        if len(indices) > 1:
            raise _source_error(f"column {column.name!r} appears {len(indices)} times in {shown}")
        problem = type_problem(column, arrow_schema.field(indices[0]).type)
        if problem is not None:
            raise _source_error(f"{problem} (in {shown})")


def _copy_parquet_file(
    filesystem: pafs.FileSystem,
    path: str,
    root: str,
    label: str,
    schema: DatasetSchema,
    writer: _SnapshotWriter,
    progress: Progress | None,
) -> None:
    """Append one Parquet file's rows; messages name the file (relative to a folder source) and its rows."""
    shown = label if path == root else path.removeprefix(root.rstrip("/") + "/")
    where = "" if path == root else f" of {shown}"
    try:
        with filesystem.open_input_file(path) as handle:
            parquet = pq.ParquetFile(handle, pre_buffer=False)
            _check_parquet_columns(parquet.schema_arrow, schema, shown)
            batches = parquet.iter_batches(SOURCE_BATCH_ROWS, columns=list(schema.names), use_threads=True)
            _copy_batches(batches, schema, writer, progress, where)
    except (OSError, pa.ArrowException) as exc:
        raise _source_error(f"{shown} is not a readable Parquet file ({type(exc).__name__})") from None


def parquet_to_snapshot(
    source: str,
    schema: DatasetSchema,
    work_dir: Path,
    filesystem: pafs.FileSystem | None = None,
    progress: Progress | None = None,
) -> Ingested:
    """A snapshot of a Parquet file or folder (local path, ``file://`` URI, or ``s3://`` URI read through the
    caller's ``filesystem``): the schema's columns only, batch by batch, files in path order.

    Raises ``SourceError`` (field ``"source"``) for a missing path, an unreadable file, a missing column or a
    bad value (naming the column, row and file).
    """
    label = _label(source)
    filesystem, root = _location(source, filesystem)
    files = _parquet_files(filesystem, root, label)
    with _writing(schema, work_dir) as writer:
        for path in files:
            _copy_parquet_file(filesystem, path, root, label, schema, writer, progress)
        return writer.finish(_source_error(f"{label} has no rows"))


# ----- PostgreSQL by reference ---------------------------------------------------------------------------

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_$]{0,62}")


def _quoted(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _table_name(table: str) -> str:
    """``name`` or ``schema.name``, each a plain identifier, double-quoted (so case is kept as given)."""
    parts = table.split(".")
    if len(parts) > 2 or not all(_IDENTIFIER.fullmatch(part) for part in parts):
        raise _source_error("a table is named `name` or `schema.name` (letters, digits, _ and $)")
    return ".".join(map(_quoted, parts))


def _select(schema: DatasetSchema, table: str | None, query: str | None) -> str:
    """The statement that reads the schema's columns, in schema order, from the table or query."""
    if (table is None) == (query is None):
        raise _source_error("give exactly one of a table or a query")
    columns = ", ".join(map(_quoted, schema.names))
    if table is not None:
        return f"SELECT {columns} FROM {_table_name(table)}"
    assert query is not None
    body = query.strip().rstrip(";").strip()
    if not body:
        raise _source_error("the query is empty")
    return f"SELECT {columns} FROM (\n{body}\n) AS expost_source"


def _secrets(dsn: str) -> list[str]:
    """The DSN and every form of the password it holds, longest first (what must never be shown)."""
    found = {dsn}
    if "://" in dsn:
        parts = urlsplit(dsn)
        userinfo = parts.netloc.rpartition("@")[0]
        found.update({userinfo, parts.password or "", unquote(parts.password or "")})
        found.update(value for key, value in parse_qsl(parts.query) if key == "password")
    for match in re.finditer(r"password\s*=\s*('(?:[^'\\]|\\.)*'|\S+)", dsn):
        found.update({match.group(1), match.group(1).strip("'")})
    return sorted((s for s in found if s), key=len, reverse=True)


def _driver_message(exc: BaseException, dsn: str) -> str:
    """The first line of a driver error without its codes and prefixes, and without any secret."""
    line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    line = re.sub(r"^[A-Z_]+: ", "", line)
    for prefix in (
        "[libpq] ",
        "Failed to connect: ",
        "Failed to prepare query: ",
        "Failed to execute query: ",
    ):
        line = line.removeprefix(prefix)
    line = re.sub(r"^(ERROR|FATAL):\s+", "", line)
    for secret in _secrets(dsn):
        line = line.replace(secret, "***")
    return line[:300]


def _read_postgres(
    dsn: str, statement: str, schema: DatasetSchema, writer: _SnapshotWriter, progress: Progress | None
) -> str | None:
    """Copy the statement's rows into ``writer`` in one READ ONLY, REPEATABLE READ transaction; the scrubbed
    driver message when the server cannot be reached or the statement fails."""
    stage = "cannot connect to PostgreSQL"
    try:
        with adbc_postgres.connect(dsn, autocommit=True) as connection, connection.cursor() as cursor:
            stage = "the PostgreSQL source cannot be read"
            cursor.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
            cursor.execute("SET LOCAL synchronize_seqscans = off")  # a table is read in the same order
            hint = {
                adbc_postgres_driver.StatementOptions.BATCH_SIZE_HINT_BYTES.value: str(POSTGRES_BATCH_BYTES)
            }
            cursor.adbc_statement.set_options(**hint)
            cursor.execute(statement)
            batches = (b.rename_columns(list(schema.names)) for b in cursor.fetch_record_batch())
            _copy_batches(batches, schema, writer, progress)
            cursor.execute("COMMIT")
    except (adbc_driver_manager.Error, pa.ArrowException, OSError) as exc:
        return f"{stage}: {_driver_message(exc, dsn)}"
    return None


def postgres_to_snapshot(
    dsn: str,
    schema: DatasetSchema,
    work_dir: Path,
    table: str | None = None,
    query: str | None = None,
    progress: Progress | None = None,
) -> Ingested:
    """A snapshot of a PostgreSQL table (``name`` or ``schema.name``) or of an admin's SELECT ``query``
    (exactly one), read in one consistent READ ONLY, REPEATABLE READ transaction.

    The DSN is used for this copy only and appears in no message. Raises ``SourceError`` (field ``"source"``)
    for a malformed table name or an empty query, when the server cannot be reached, when the statement
    fails, or when a value does not fit the schema.
    """
    statement = _select(schema, table, query)
    with _writing(schema, work_dir) as writer:
        failure = _read_postgres(dsn, statement, schema, writer, progress)
        if failure is not None:
            raise _source_error(failure)
        return writer.finish(_source_error("the PostgreSQL source has no rows"))
