"""Engines that run aggregation plans where the data is (DESIGN.md §7): DuckDB by default, Spark beyond one
machine (``service.engines.spark_engine``, imported on demand: pyspark is optional). One compiler
(:mod:`service.engines.compile`) renders every plan for both, with identical exact integer answers."""

from service.engines.duckdb_engine import DuckDBEngine
from service.engines.table import Engine, ParquetTable, RowLimitExceeded

__all__ = ["DuckDBEngine", "Engine", "ParquetTable", "RowLimitExceeded"]
