"""Loading a CSV file into typed numpy columns that honour the public schema.

* The header must name exactly the schema's columns (any order); every data row has one cell per column.
* ``float``/``int`` columns become float64/int64 arrays **clipped to the declared [min, max]**: the data never
  refines or widens a bound, so sensitivities computed from the schema hold for the loaded table. The
  number of clipped values per column is reported (to the data owner, never in a release).
* ``int`` cells must be integral (``"3"`` or ``"3.0"``); numeric cells may be surrounded by whitespace;
  NaN and ±inf are rejected.
* ``categorical`` cells must be exactly one of the declared values (no whitespace stripping) and become
  int64 codes indexing ``values``.
* Empty cells, ragged rows, NUL characters, an empty file and a file without data rows are errors.
  Completely blank lines are skipped (but still counted in the row numbers of error messages).
* A header wider than the schema (which has at most ``MAX_COLUMNS`` columns) is refused with its header
  error before any data row is read; every header check is linear in the header's width.

Errors raise ``TableError`` naming the column and the 1-based data row; they quote at most the first
``QUOTE_CHARS`` characters of a cell or header name, never a long value whole. Work is vectorised per column:
rows are transposed with ``zip(*rows)`` and converted by numpy; only the error path inspects values one
by one, to name the first offending cell.
"""

from __future__ import annotations

import csv
import hashlib
import io
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import compress

import numpy as np

from mechanisms.data.schema import CategoricalColumn, DatasetSchema, FloatColumn, IntColumn

QUOTE_CHARS = 16
"""Error messages quote at most this many characters of a cell (or header name), then an ellipsis."""


class TableError(ValueError):
    """A file that does not match its schema; ``reason`` names the column and row, never other data."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


@dataclass(frozen=True)
class LoadedTable:
    columns: dict[str, np.ndarray]
    n_rows: int
    clipped: dict[str, int]


def content_hash(data: bytes) -> str:
    """SHA-256 of the raw file, hex."""
    return hashlib.sha256(data).hexdigest()


def _fail(reason: str) -> TableError:
    return TableError("file", reason)


def _quote(value: str) -> str:
    """``repr`` of the value's first ``QUOTE_CHARS`` characters, with an ellipsis when it was cut."""
    if len(value) <= QUOTE_CHARS:
        return repr(value)
    return repr(value[:QUOTE_CHARS]) + "…"


def _names(names: Sequence[str], at_most: int = 5) -> str:
    """At most ``at_most`` header names, each quoted by ``_quote``, then how many more there are."""
    shown = ", ".join(map(_quote, names[:at_most]))
    return shown if len(names) <= at_most else f"{shown} and {len(names) - at_most} more"


def _read_rows(data: bytes, schema: DatasetSchema) -> list[list[str]]:
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise _fail(f"the file is not valid UTF-8 (byte {exc.start})") from None
    nul = text.find("\x00")
    if nul >= 0:  # no cell may hold one (PostgreSQL text cannot); often a UTF-16 file
        line = text.count("\n", 0, nul) + 1
        raise _fail(f"line {line} contains a NUL character; save the file as UTF-8 text")
    reader = csv.reader(io.StringIO(text, newline=""))
    try:
        header = next(reader, None)
        if header is None:
            return []
        if len(header) > len(schema.columns):  # refused before any row is read (the check raises)
            check_header(header, schema)
        return [header, *reader]
    except csv.Error as exc:
        raise _fail(f"the file is not valid CSV: {exc}") from None


def check_header(header: Sequence[str], schema: DatasetSchema) -> list[str]:
    """The header's names (stripped), exactly the schema's in any order. Linear in the header's width (counts
    and sets, no ``list.count`` or ``in`` on a list per name): a header of 100 000 names, far wider than any
    schema (``MAX_COLUMNS``), is refused in milliseconds."""
    names = [h.strip() for h in header]
    counts = Counter(names)
    duplicates = sorted(n for n, k in counts.items() if k > 1)
    if duplicates:
        raise _fail(f"duplicate columns in the header: {_names(duplicates)}")
    missing = [n for n in schema.names if n not in counts]
    if missing:
        raise _fail(f"missing columns: {', '.join(map(repr, missing))}")
    declared = set(schema.names)
    extra = [n for n in names if n not in declared]
    if extra:
        raise _fail(f"columns not in the schema: {_names(extra)}")
    return names


def _data_rows(rows: list[list[str]], width: int) -> tuple[list[list[str]], np.ndarray]:
    """Non-blank data rows and their 1-based row numbers; ragged rows are errors."""
    lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    keep = lengths > 0
    numbers = np.flatnonzero(keep) + 1
    ragged = np.flatnonzero(lengths[keep] != width)
    if ragged.size:
        first = int(ragged[0])
        count = int(lengths[keep][first])
        raise _fail(f"row {numbers[first]}: {count} cells, the header has {width}")
    kept = list(compress(rows, keep))
    if not kept:
        raise _fail("the file has no data rows")
    return kept, numbers


def _first(mask: np.ndarray) -> int:
    return int(np.argmax(mask))


def _cell_error(name: str, numbers: np.ndarray, index: int, message: str) -> TableError:
    return _fail(f"column {name!r}, row {numbers[index]}: {message}")


def _is_float(cell: str) -> bool:
    try:
        float(cell)
    except ValueError:
        return False
    return True


def _parse_numbers(name: str, cells: np.ndarray, numbers: np.ndarray) -> np.ndarray:
    """Float64 values of ``cells`` (whitespace allowed); empty, non-numeric or non-finite cells fail."""
    stripped = np.char.strip(cells)
    empty = stripped == ""
    if empty.any():
        raise _cell_error(name, numbers, _first(empty), "empty cell")
    try:
        values = stripped.astype(np.float64)
    except ValueError:
        bad = ~np.vectorize(_is_float, otypes=[bool])(stripped)
        index = _first(bad)
        raise _cell_error(name, numbers, index, f"{_quote(str(cells[index]))} is not a number") from None
    non_finite = ~np.isfinite(values)
    if non_finite.any():
        index = _first(non_finite)
        raise _cell_error(name, numbers, index, f"{_quote(str(cells[index]))} is not a finite number")
    return values


def _clip(values: np.ndarray, low: float, high: float) -> tuple[np.ndarray, int]:
    outside = int(np.count_nonzero((values < low) | (values > high)))
    return np.clip(values, low, high), outside


def _load_float(column: FloatColumn, cells: np.ndarray, numbers: np.ndarray) -> tuple[np.ndarray, int]:
    return _clip(_parse_numbers(column.name, cells, numbers), column.min, column.max)


def _load_int(column: IntColumn, cells: np.ndarray, numbers: np.ndarray) -> tuple[np.ndarray, int]:
    values = _parse_numbers(column.name, cells, numbers)
    fractional = values != np.floor(values)
    if fractional.any():
        index = _first(fractional)
        raise _cell_error(column.name, numbers, index, f"{_quote(str(cells[index]))} is not an integer")
    clipped, outside = _clip(values, float(column.min), float(column.max))
    return clipped.astype(np.int64), outside


def _load_categorical(
    column: CategoricalColumn, cells: np.ndarray, numbers: np.ndarray
) -> tuple[np.ndarray, int]:
    empty = cells == ""
    if empty.any():
        raise _cell_error(column.name, numbers, _first(empty), "empty cell")
    declared = np.asarray(column.values, dtype=np.str_)
    order = np.argsort(declared)
    position = np.minimum(np.searchsorted(declared[order], cells), declared.size - 1)
    unknown = declared[order][position] != cells
    if unknown.any():
        index = _first(unknown)
        raise _cell_error(column.name, numbers, index, f"{_quote(str(cells[index]))} is not a declared value")
    return order[position].astype(np.int64), 0


def _load_column(
    column: FloatColumn | IntColumn | CategoricalColumn, cells: np.ndarray, numbers: np.ndarray
) -> tuple[np.ndarray, int]:
    if isinstance(column, FloatColumn):
        return _load_float(column, cells, numbers)
    if isinstance(column, IntColumn):
        return _load_int(column, cells, numbers)
    return _load_categorical(column, cells, numbers)


def load_csv(data: bytes, schema: DatasetSchema) -> LoadedTable:
    """Parse ``data`` (UTF-8 CSV with a header row) into clipped, typed columns; raise ``TableError``."""
    rows = _read_rows(data, schema)
    if not rows:
        raise _fail("the file is empty")
    names = check_header(rows[0], schema)
    body, numbers = _data_rows(rows[1:], len(names))
    columns: dict[str, np.ndarray] = {}
    clipped: dict[str, int] = {}
    for name, cells in zip(names, zip(*body, strict=True), strict=True):
        column = schema.column(name)
        assert column is not None  # _check_header guarantees it
        columns[name], clipped[name] = _load_column(column, np.asarray(cells, dtype=np.str_), numbers)
    return LoadedTable(columns=columns, n_rows=len(body), clipped=clipped)
