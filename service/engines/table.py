"""A dataset snapshot as a table: aggregations run in an engine, single columns load on demand.

:class:`ParquetTable` is a ``Mapping[str, np.ndarray]`` over one immutable Parquet snapshot (one file;
float64, int64 and int32-code columns, no nulls), a :class:`~mechanisms.data.plan.Scanner` and a
:class:`~mechanisms.data.plan.UnitScanner`: mechanisms call ``aggregate(plan)`` (or ``aggregate_units(plan)``
for per-unit contributions), which the engine runs where the data is, and never need the rows. Learners that
need columns in memory index the mapping; that loads the column with pyarrow, refused with
:class:`RowLimitExceeded` above ``max_memory_rows``, or stream it with :meth:`ParquetTable.batches` in
bounded memory.

The row count (:attr:`ParquetTable.n_rows`) is **private** under ``add_remove`` neighbouring: it is read
from the Parquet footer for the memory limit and must never reach a release or an error message shown to
an analyst (:class:`RowLimitExceeded` names the limit, and carries the count only for the data owner's
logs).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import Protocol

import numpy as np
import pyarrow.parquet as pq

from mechanisms.data.plan import ORDER_COLUMN, Aggregation, Answer, UnitAnswer
from mechanisms.data.schema import DatasetSchema


class Engine(Protocol):
    """What runs a plan on a snapshot file (``DuckDBEngine``, ``SparkEngine``)."""

    def aggregate(self, path: Path, plan: Aggregation) -> Answer: ...

    def aggregate_units(self, path: Path, plan: Aggregation) -> UnitAnswer:
        """Per-(unit, cell) sums of a plan with a privacy unit (``mechanisms.data.plan.UnitAnswer``)."""
        ...

    def close(self) -> None: ...


class RowLimitExceeded(RuntimeError):
    """A column was asked for in memory, but the snapshot has more rows than the limit.

    The message names the limit only; ``n_rows`` (private: see the module docstring) is an attribute for
    the data owner's logs."""

    def __init__(self, limit: int, n_rows: int, column: str) -> None:
        super().__init__(
            f"column {column!r} cannot be loaded into memory: the dataset has more than {limit} rows; "
            "use an aggregation or stream record batches"
        )
        self.limit = limit
        self.n_rows = n_rows
        self.column = column


class ParquetTable(Mapping[str, np.ndarray]):
    """One Parquet snapshot, its public schema and the engine that scans it."""

    def __init__(self, path: Path, schema: DatasetSchema, engine: Engine, max_memory_rows: int) -> None:
        self.path = Path(path)
        self.schema = schema
        self.engine = engine
        self.max_memory_rows = max_memory_rows

    # Scanner
    def aggregate(self, plan: Aggregation) -> Answer:
        """The plan's exact answer, computed by the engine on the snapshot."""
        return self.engine.aggregate(self.path, plan)

    # UnitScanner
    def aggregate_units(self, plan: Aggregation) -> UnitAnswer:
        """The plan's exact per-(unit, cell) sums, computed by the engine on the snapshot."""
        return self.engine.aggregate_units(self.path, plan)

    # Mapping
    def __getitem__(self, name: str) -> np.ndarray:
        """Column ``name`` as a NumPy array (as stored: float64, int64, or int32 codes)."""
        if name not in self.schema.names:
            raise KeyError(name)
        if self.n_rows > self.max_memory_rows:
            raise RowLimitExceeded(self.max_memory_rows, self.n_rows, name)
        column = pq.read_table(self.path, columns=[name]).column(name)
        array: np.ndarray = column.to_numpy()
        return array

    def __iter__(self) -> Iterator[str]:
        return iter(self.schema.names)

    def __len__(self) -> int:
        return len(self.schema.names)

    def __contains__(self, name: object) -> bool:
        return name in self.schema.names

    @cached_property
    def n_rows(self) -> int:
        """The snapshot's row count, from the Parquet footer. **Private** information (module docstring)."""
        return int(pq.ParquetFile(self.path).metadata.num_rows)

    def batches(self, names: Sequence[str], rows_per_batch: int = 65536) -> Iterator[dict[str, np.ndarray]]:
        """The columns ``names`` in record batches of at most ``rows_per_batch`` rows (bounded memory); with
        a privacy unit also ``ORDER_COLUMN`` (the bounding order a learner needs to bound units)."""
        readable = (*self.schema.names, *((ORDER_COLUMN,) if self.schema.privacy_unit is not None else ()))
        unknown = [name for name in names if name not in readable]
        if unknown:
            raise KeyError(unknown[0])
        if rows_per_batch < 1:
            raise ValueError("rows_per_batch must be at least 1")
        with pq.ParquetFile(self.path, pre_buffer=False) as parquet:
            for batch in parquet.iter_batches(batch_size=rows_per_batch, columns=list(names)):
                yield {name: batch.column(name).to_numpy() for name in names}
