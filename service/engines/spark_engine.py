"""Apache Spark as an engine (beyond one machine): the same compiled plan, rendered as Spark SQL.

The SparkSession is created lazily on the first call (``pyspark`` is an optional dependency: importing this
module does not import it). Its settings: ANSI mode **on** (forced: without it Spark wraps BIGINT overflow
and turns DECIMAL overflow into NULL), session time zone UTC, no UI, no console progress bar, few shuffle
partitions (the aggregates have at most a few thousand cells), log level WARN. Every
:meth:`SparkEngine.aggregate` runs in its own ``newSession()`` (same SparkContext, isolated temp views), so
concurrent calls cannot see each other's views: the snapshot is the temp view
:data:`~service.engines.compile.SOURCE` (``spark.read.parquet`` with the schema given, so no inference job;
Spark reads only the columns the query names), and each bucket key whose corrections need a lookup gets its
candidate table as a broadcast DataFrame.

Exactness: :mod:`service.engines.compile`'s module docstring; for Spark in particular, sums are
``SUM(CAST(v AS DECIMAL(38, 0)))`` (collected as integral ``Decimal`` values, converted to ``int``
exactly), ``FLOOR``/``CEIL`` of a double return BIGINT (integral values, as in DuckDB), and the doubles are
``CAST('<repr>' AS DOUBLE)``, parsed by ``Double.parseDouble`` (correctly rounded).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa

from mechanisms.data.plan import Aggregation, Answer, UnitAnswer
from service.engines.compile import SOURCE, CompiledPlan, compile_plan, snapshot_kinds, snapshot_schema

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

DEFAULT_CONF: dict[str, str] = {
    "spark.sql.session.timeZone": "UTC",
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.sql.shuffle.partitions": "4",
    "spark.sql.adaptive.enabled": "true",
}
FORCED_CONF: dict[str, str] = {"spark.sql.ansi.enabled": "true"}
"""Set after the caller's ``conf``: exact sums rely on ANSI overflow errors."""


class SparkEngine:
    """Runs :class:`~mechanisms.data.plan.Aggregation` plans on Parquet snapshots with Spark SQL."""

    def __init__(self, master: str = "local[2]", conf: dict[str, str] | None = None) -> None:
        self.master = master
        self.conf = {**DEFAULT_CONF, **(conf or {}), **FORCED_CONF}
        self._session: SparkSession | None = None
        self._lock = threading.Lock()

    @property
    def session(self) -> SparkSession:
        """The engine's SparkSession, created on first use."""
        with self._lock:
            if self._session is None:
                from pyspark.sql import SparkSession

                builder = SparkSession.builder.master(self.master).appName("expost")
                for key, value in self.conf.items():
                    builder = builder.config(key, value)
                session = builder.getOrCreate()
                for key, value in self.conf.items():  # getOrCreate may return a running session
                    if session.conf.isModifiable(key):
                        session.conf.set(key, value)
                session.sparkContext.setLogLevel("WARN")
                self._session = session
            return self._session

    def aggregate(self, path: Path, plan: Aggregation) -> Answer:
        """The plan's exact answer on the snapshot at ``path`` (thread-safe; one Spark session per call)."""
        compiled = compile_plan(plan, snapshot_kinds(path))
        rows = self._prepared(path, compiled).sql(compiled.spark_sql).collect()
        return compiled.answer([tuple(row) for row in rows])

    def aggregate_units(self, path: Path, plan: Aggregation) -> UnitAnswer:
        """The plan's exact per-(unit, cell) sums on the snapshot at ``path``, collected as one Arrow table
        (``DataFrame.toArrow``; DECIMAL(38, 0) sums as decimal128). Raises ValueError without a unit."""
        compiled = compile_plan(plan, snapshot_kinds(path), by_unit=True)
        result = self._prepared(path, compiled).sql(compiled.spark_sql).toArrow()
        return compiled.unit_answer(result)

    def _prepared(self, path: Path, compiled: CompiledPlan) -> SparkSession:
        """A new session (isolated temp views, ANSI mode checked) with the snapshot as :data:`SOURCE` and
        the plan's candidate tables registered."""
        from pyspark.sql.functions import broadcast

        session = self.session.newSession()
        if session.conf.get("spark.sql.ansi.enabled") != "true":
            raise RuntimeError("Spark's ANSI mode is off: sums would not be exact")
        # the schema given (from the cached footer) spares Spark a schema-inference job per call
        reader = session.read.schema(_spark_schema(snapshot_schema(path), compiled.columns))
        reader.parquet(str(path)).createOrReplaceTempView(SOURCE)
        for candidates in compiled.candidates:
            broadcast(session.createDataFrame(candidates.table)).createOrReplaceTempView(candidates.name)
        return session

    def close(self) -> None:
        """Stop the SparkSession (and its SparkContext) if this engine started one."""
        with self._lock:
            if self._session is not None:
                self._session.stop()
                self._session = None


_SPARK_TYPES = {pa.float64(): "DOUBLE", pa.int64(): "BIGINT", pa.int32(): "INT"}


def _spark_schema(schema: pa.Schema, columns: tuple[str, ...]) -> str:
    """A Spark DDL schema for ``columns`` (or one column when the plan reads none: Spark needs one)."""
    names = columns or (schema.names[0],)
    fields = []
    for name in names:
        arrow_type = schema.field(name).type
        if arrow_type not in _SPARK_TYPES:
            raise ValueError(f"column {name!r} has an unsupported type {arrow_type}")
        fields.append(f"`{name.replace('`', '``')}` {_SPARK_TYPES[arrow_type]}")
    return ", ".join(fields)
