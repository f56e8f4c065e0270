"""Tables on the engine path for tests written against NumPy columns: the same columns as a Parquet snapshot
(the layout ``service/data/ingest.py`` writes) behind a ``ParquetTable`` scanned by DuckDB, so a test can run
a mechanism on both engines and compare."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from mechanisms.data.schema import DatasetSchema
from service.engines.duckdb_engine import DuckDBEngine
from service.engines.table import ParquetTable

_ENGINES: dict[Path, DuckDBEngine] = {}


def engine_table(
    columns: Mapping[str, np.ndarray],
    schema: DatasetSchema,
    folder: Path,
    extra: Mapping[str, np.ndarray] | None = None,
) -> ParquetTable:
    """``columns`` (float64 / int64 / int codes, already within the schema's bounds), and ``extra`` columns
    as they are (e.g. ``__order``), as a DuckDB-scanned Parquet snapshot in ``folder``."""
    arrays = {name: pa.array(values) for name, values in (extra or {}).items()}
    for column in schema.columns:
        values = np.asarray(columns[column.name])
        kind = {"float": np.float64, "int": np.int64, "categorical": np.int32}[column.type]
        arrays[column.name] = pa.array(values.astype(kind))
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{uuid.uuid4().hex}.parquet"
    pq.write_table(pa.table(arrays), path)
    engine = _ENGINES.get(folder)
    if engine is None:
        engine = _ENGINES[folder] = DuckDBEngine(1, "256MB", folder / "tmp")
    return ParquetTable(path, schema, engine, max_memory_rows=10**7)
