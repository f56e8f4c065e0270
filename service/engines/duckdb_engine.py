"""The default engine: DuckDB, embedded and out of core, scanning one Parquet snapshot per call.

One DuckDB database (in memory) per engine holds the settings (``threads``, ``memory_limit``,
``temp_directory`` for spilling, ``preserve_insertion_order=false``); every :meth:`DuckDBEngine.aggregate`
runs on its own cursor (a connection to that database), so several threads can scan at once.

Exactness: the query is :mod:`service.engines.compile`'s rendering for DuckDB (its module docstring has the
argument); its named parameters are the snapshot's path (``read_parquet($path)``) and the bucket keys'
candidate lists (``list_extract``), and DuckDB reads only the columns the plan names. Sums come back as
HUGEINT (Python ``int``), counts as BIGINT. :meth:`DuckDBEngine.aggregate_units` (per-unit contributions)
fetches its result as one Arrow table (HUGEINT as decimal128(38, 0)), converted to NumPy without a loop over
rows.
"""

from __future__ import annotations

import threading
from pathlib import Path

import duckdb

from mechanisms.data.plan import Aggregation, Answer, UnitAnswer
from service.engines.compile import compile_plan, snapshot_kinds


class DuckDBEngine:
    """Runs :class:`~mechanisms.data.plan.Aggregation` plans on Parquet snapshots with DuckDB."""

    def __init__(self, threads: int, memory_limit: str, temp_dir: Path) -> None:
        if threads < 1:
            raise ValueError("threads must be at least 1")
        temp_dir.mkdir(parents=True, exist_ok=True)
        self._connection = duckdb.connect(":memory:")
        self._connection.execute(f"SET threads = {int(threads)}")
        self._connection.execute("SET memory_limit = ?", [memory_limit])
        self._connection.execute("SET temp_directory = ?", [str(temp_dir)])
        self._connection.execute("SET preserve_insertion_order = false")
        self._lock = threading.Lock()
        self._closed = False

    def aggregate(self, path: Path, plan: Aggregation) -> Answer:
        """The plan's exact answer on the snapshot at ``path`` (thread-safe; one cursor per call)."""
        compiled = compile_plan(plan, snapshot_kinds(path))
        cursor = self._cursor()
        try:
            rows = cursor.execute(compiled.duckdb_sql, compiled.duckdb_parameters(path)).fetchall()
        finally:
            cursor.close()
        return compiled.answer(rows)

    def aggregate_units(self, path: Path, plan: Aggregation) -> UnitAnswer:
        """The plan's exact per-(unit, cell) sums on the snapshot at ``path`` (thread-safe; one cursor per
        call). Raises ValueError for a plan without a privacy unit."""
        compiled = compile_plan(plan, snapshot_kinds(path), by_unit=True)
        cursor = self._cursor()
        try:
            result = cursor.sql(compiled.duckdb_sql, params=compiled.duckdb_parameters(path)).to_arrow_table()
        finally:
            cursor.close()
        return compiled.unit_answer(result)

    def _cursor(self) -> duckdb.DuckDBPyConnection:
        with self._lock:
            if self._closed:
                raise RuntimeError("the DuckDB engine is closed")
            return self._connection.cursor()

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._connection.close()
