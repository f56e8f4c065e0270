"""``dp_gd`` on a table streamed in record batches (a Parquet snapshot, ``ParquetTable.batches``) is bit for
bit the in-memory run: the same ``Noise.seeded`` gives the same iterates, clip path and noisy counts.

Why it must be (docs/privacy/finite_precision_learners.md#theorem-dpgd-grid, Theorem DPGD-GRID): every
record's clipped term is a function of its own record and the public θ, and the step's sum is an exact
integer, so cutting the table into batches, the records into blocks, or the work over threads changes nothing.
These tests check the pieces that carry that argument: the design matrix built column by column
(``design_columns``, its row norm summed in numpy's own order), the per-record grid
(``grid_records_from_batches``), the per-step pass by blocks and threads, and whole runs of the service
mechanism (fixed and adaptive clipping, logistic and ridge, replace-one and add/remove) on a dict of columns
and on a ``ParquetTable`` read 37 rows at a time, with a row limit of 10 so that loading any column whole
would fail.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mechanisms.accounting import DEFAULT_ORDERS
from mechanisms.base import PublicContext
from mechanisms.data.schema import DatasetSchema
from mechanisms.learners import dp_gd
from mechanisms.learners.dp_gd import (
    DpGdMechanism,
    DpGdParams,
    adaptive_dp_gd_train,
    clip_count,
    clipped_sum_units,
    dp_gd_train,
    grid_records,
    grid_records_from_batches,
    regrid,
)
from mechanisms.learners.features import (
    column_row_norms,
    design_columns,
    design_matrix,
    learner_task,
    table_batches,
)
from mechanisms.noise import Noise
from service.data.ingest import snapshot_schema
from service.engines import DuckDBEngine, ParquetTable

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the 1e300 rows

N = 3000
SMALL_BATCH = 37


def _schema(neighboring: str) -> DatasetSchema:
    return DatasetSchema.model_validate(
        {
            "columns": [
                {"name": "a", "type": "float", "min": -4, "max": 4},
                {"name": "b", "type": "float", "min": -1, "max": 3},
                {"name": "k", "type": "int", "min": -50, "max": 100},
                {"name": "g", "type": "categorical", "values": ["red", "green", "blue"]},
                {"name": "y", "type": "categorical", "values": ["no", "yes"]},
                {"name": "r", "type": "float", "min": -2, "max": 2},
            ],
            "neighboring": neighboring,
        }
    )


def _columns(seed: int = 0) -> dict[str, np.ndarray]:
    """Columns as a snapshot stores them (float64, int64, int32 codes), with awkward rows: zeros, −0.0,
    subnormals, values far beyond the declared bounds (the design matrix's row clip must handle them)."""
    rng = np.random.default_rng(seed)
    a = rng.normal(size=N) * np.exp(rng.uniform(-3, 3, N))
    b = rng.uniform(-1, 3, N)
    k = rng.integers(-50, 101, N).astype(np.int64)
    g = rng.integers(0, 3, N).astype(np.int32)
    a[:6] = [0.0, -0.0, 5e-324, -1e300, 1e300, 4.0]
    b[:6] = [0.0, -0.0, -5e-324, 1e-310, 3.0, -1.0]
    k[:6] = [0, 0, 0, 10**15, -(10**15), 100]
    margin = a / 4 + 0.5 * b - k / 100 + 0.3 * rng.normal(size=N)
    y = (margin > 0).astype(np.int32)
    r = np.clip(0.6 * a / 4 - 0.4 * b + 0.1 * rng.normal(size=N), -2, 2)
    return {"a": a, "b": b, "k": k, "g": g, "y": y, "r": r}


def _write(directory: Path, schema: DatasetSchema, columns: Mapping[str, np.ndarray]) -> Path:
    arrow = pa.schema(snapshot_schema(schema))
    table = pa.table({name: pa.array(columns[name], type=arrow.field(name).type) for name in schema.names})
    path = directory / "snapshot.parquet"
    pq.write_table(table, path, row_group_size=1000)  # several row groups, batches cross their edges
    return path


class SmallBatches(ParquetTable):
    """A ``ParquetTable`` that streams ``SMALL_BATCH`` rows at a time whatever the caller asks, and counts
    the batches it served."""

    served = 0

    def batches(self, names: Sequence[str], rows_per_batch: int = 65536) -> Iterator[dict[str, np.ndarray]]:
        for batch in super().batches(names, SMALL_BATCH):
            SmallBatches.served += 1
            yield batch


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> DuckDBEngine:
    return DuckDBEngine(threads=1, memory_limit="256MB", temp_dir=tmp_path_factory.mktemp("duckdb-spill"))


# ----- the pieces ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("d", [*range(1, 20), 31, 64, 127, 128, 129, 136, 200, 300])
def test_column_row_norms_are_numpys_row_norms_bit_for_bit(d: int) -> None:
    rng = np.random.default_rng(d)
    x = rng.normal(size=(400, d)) * np.exp(rng.uniform(-40, 40, size=(400, d)))
    x[0] = 0.0
    x[1, 0] = np.nan
    x[2, -1] = np.inf
    x[3] = 1e200  # squares overflow
    with np.errstate(over="ignore"):
        expected = np.linalg.norm(x, axis=1)
        got = column_row_norms(list(np.ascontiguousarray(x.T)), 400)
    assert np.array_equal(got, expected, equal_nan=True)
    assert np.array_equal(got[4:].view(np.int64), expected[4:].view(np.int64))


@pytest.mark.parametrize(("model", "label"), [("logistic", "y"), ("ridge", "r")])
def test_design_columns_are_design_matrix_bit_for_bit(model: str, label: str) -> None:
    schema = _schema("replace_one")
    ctx = PublicContext(schema, N, DEFAULT_ORDERS)
    task = learner_task(model, None)
    table = _columns()
    for features in (("a", "b", "k", "g"), ("g",), ("k", "a")):
        for intercept in (True, False):
            p = DpGdParams.model_validate(
                {"features": features, "label": label, "model": model, "steps": 1, "intercept": intercept}
                | {"noise_multiplier": 1.0, "max_norm": 10.0}
            )
            for row_norm in (1.0, 0.3, 7.0):
                with np.errstate(over="ignore"):  # the 1e300 rows: both overflow the same way
                    x, y = design_matrix(p, ctx, table, task, row_norm)
                    columns, labels = design_columns(p, ctx, table, task, row_norm)
                assert np.array_equal(np.column_stack(columns).view(np.int64), x.view(np.int64))
                assert np.array_equal(labels, y)


def test_grid_records_from_batches_are_grid_records_of_the_design_matrix() -> None:
    schema = _schema("replace_one")
    ctx = PublicContext(schema, N, DEFAULT_ORDERS)
    p = DpGdParams.model_validate(
        {"features": ["a", "b", "k", "g"], "label": "y", "steps": 1, "noise_multiplier": 1.0}
    )
    table = _columns()
    task = learner_task("logistic", None)
    x, y = design_matrix(p, ctx, table, task)
    for clip, z in ((1.0, None), (0.013, 3.0), (250.0, 1e4)):
        whole = grid_records(x, y, clip, noise_multiplier=z)
        for rows_per_batch in (1, SMALL_BATCH, 1000, N):
            streamed = grid_records_from_batches(
                table_batches(p, table, rows_per_batch),
                lambda batch: design_columns(p, ctx, batch, task),
                x.shape[1],
                clip,
                z,
            )
            assert streamed.rows.dtype == np.int32
            assert np.array_equal(streamed.rows, whole.rows)
            for field in ("scale", "cap", "labels"):
                assert np.array_equal(getattr(streamed, field), getattr(whole, field)), field
            assert (streamed.unit, streamed.chunk) == (whole.unit, whole.chunk)


@pytest.mark.parametrize("hint", [None, 0, 100, 499, 500, 501, 10_000])
def test_the_row_hint_only_sizes_memory(hint: int | None) -> None:
    """A missing, short or long ``n_rows`` hint gives the same records (spilled rows are concatenated)."""
    rng = np.random.default_rng(5)
    x = rng.normal(size=(500, 4))
    y = rng.normal(size=500)
    whole = grid_records(x, y, 0.7, noise_multiplier=2.0)
    batches = [{"row": np.arange(lo, min(lo + 61, 500))} for lo in range(0, 500, 61)]
    streamed = grid_records_from_batches(
        batches, lambda batch: (list(x[batch["row"]].T), y[batch["row"]]), 4, 0.7, 2.0, hint
    )
    assert streamed.rows.shape == (500, 4)
    for field in ("rows", "scale", "cap", "labels"):
        assert np.array_equal(getattr(streamed, field), getattr(whole, field)), field


def test_scalar_grad_into_buffers_is_scalar_grad() -> None:
    rng = np.random.default_rng(6)
    margins = np.concatenate(
        [rng.normal(size=3000) * np.exp(rng.uniform(-40, 40, 3000)), [0.0, -0.0, np.inf, -np.inf, np.nan]]
    )
    labels = np.concatenate([np.sign(rng.normal(size=3000)), [1.0, -1.0, -1.0, 1.0, 1.0]])
    for loss in ("logistic", "squared"):
        out, work = np.empty_like(margins), np.empty_like(margins)
        with np.errstate(all="ignore"):  # the NaN and infinite margins
            expected = dp_gd._scalar_grad(margins, labels, loss)
            got = dp_gd._scalar_grad_into(margins, labels, loss, out, work)
        assert np.array_equal(np.isnan(got), np.isnan(expected))
        finite = ~np.isnan(expected)
        assert np.array_equal(got[finite].view(np.int64), expected[finite].view(np.int64))


def test_nonfinite_records_grid_the_same_in_any_batching() -> None:
    rng = np.random.default_rng(4)
    x = rng.normal(size=(500, 6)) * np.exp(rng.uniform(-30, 30, size=(500, 1)))
    x[0] = 0.0
    x[1, 2] = np.nan
    x[2, 0] = -np.inf
    x[3] = 1e308
    x[4] = 1e-310
    y = rng.normal(size=500)
    y[5], y[6] = np.inf, np.nan
    whole = grid_records(x, y, 0.7, noise_multiplier=2.0)
    batches = [{"row": np.arange(lo, min(lo + 29, 500))} for lo in range(0, 500, 29)]
    streamed = grid_records_from_batches(
        batches, lambda batch: (list(x[batch["row"]].T), y[batch["row"]]), 6, 0.7, 2.0
    )
    for field in ("rows", "scale", "cap", "labels"):
        assert np.array_equal(getattr(streamed, field), getattr(whole, field)), field


@pytest.mark.parametrize("loss", ["logistic", "squared"])
def test_per_step_pass_is_the_same_for_any_blocks_and_threads(
    loss: dp_gd.Loss, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(7)
    x = rng.normal(size=(2000, 5)) * np.exp(rng.uniform(-2, 2, size=(2000, 1)))
    y = np.sign(rng.normal(size=2000)) if loss == "logistic" else rng.uniform(-3, 3, 2000)
    records = grid_records(x, y, 0.4, noise_multiplier=2.0)
    thetas = [np.zeros(5), rng.normal(size=5), rng.normal(size=5) * 1e4, np.array([np.nan, 0, 0, 0, 0])]
    expected = [(clipped_sum_units(t, records, loss), clip_count(t, records, loss, 0.3)) for t in thetas]
    moved = regrid(records, 2.5, 2.0)
    expected_moved = [clipped_sum_units(t, moved, loss) for t in thetas]
    monkeypatch.setattr(dp_gd, "BLOCK_ROWS", 97)
    monkeypatch.setattr(dp_gd, "_workers", lambda: 3)
    with dp_gd._thread_pool() as pool:
        assert pool is not None
        roots = dp_gd._row_roots(records, pool)
        for theta, (units, count) in zip(thetas, expected, strict=True):
            got, _ = dp_gd._grid_pass(theta, records, loss, pool)
            assert np.array_equal(got, units)
            _, counted = dp_gd._grid_pass(theta, records, loss, pool, roots=roots, count_clip=0.3)
            assert counted == count
        for theta, units in zip(thetas, expected_moved, strict=True):
            got, _ = dp_gd._grid_pass(theta, records, loss, pool, clip=2.5, noise_multiplier=2.0, roots=roots)
            assert np.array_equal(got, units)
    assert np.array_equal(regrid(records, 2.5, 2.0).cap, moved.cap)


# ----- whole runs: dict vs ParquetTable vs the library path ------------------------------------------------
def _params(model: str, clipping: str, neighboring: str) -> DpGdParams:
    spec: dict[str, Any] = {
        "features": ["a", "b", "k", "g"],
        "label": "y" if model == "logistic" else "r",
        "model": model,
        "steps": 8,
        "noise_multiplier": 0.8,
        "clip": 0.05 if clipping == "adaptive" else 0.5,
        "clipping": clipping,
        "return_iterates": True,
    }
    if neighboring == "add_remove":
        spec["n_hint"] = 2900
    return DpGdParams.model_validate(spec)


CASES = [
    ("logistic", "fixed", "replace_one"),
    ("logistic", "adaptive", "replace_one"),
    ("ridge", "fixed", "replace_one"),
    ("ridge", "adaptive", "replace_one"),
    ("logistic", "fixed", "add_remove"),
    ("ridge", "adaptive", "add_remove"),
]


@pytest.mark.parametrize(("model", "clipping", "neighboring"), CASES)
def test_parquet_stream_gives_the_in_memory_release_bit_for_bit(
    model: str, clipping: str, neighboring: str, engine: DuckDBEngine, tmp_path: Path
) -> None:
    schema = _schema(neighboring)
    ctx = PublicContext(schema, N if neighboring == "replace_one" else None, DEFAULT_ORDERS)
    columns = _columns(seed=1)
    p = _params(model, clipping, neighboring)
    mechanism = DpGdMechanism()
    in_memory = mechanism.run(p, ctx, columns, Noise.seeded(11))
    parquet = SmallBatches(_write(tmp_path, schema, columns), schema, engine, max_memory_rows=10)
    served = SmallBatches.served
    streamed = mechanism.run(p, ctx, parquet, Noise.seeded(11))
    assert SmallBatches.served - served >= N // SMALL_BATCH  # it streamed; loading a column would raise
    assert streamed.output == in_memory.output  # theta, iterates, clip path, noisy counts: exact equality
    assert streamed.realized == in_memory.realized
    path = np.array(streamed.output["iterates"])
    assert path.shape == (8, 3 + 3 + 1)  # a, b, k; g one-hot; intercept
    assert np.all(np.isfinite(path))
    assert len({tuple(row) for row in path}) == 8  # the run moved

    # and both are the library path on the whole design matrix (grid_records of design_matrix at once)
    config = mechanism._config(p, ctx)
    x, y = design_matrix(p, ctx, columns, learner_task(p.model, p.task), p.row_norm)
    n_norm = float(streamed.output["normaliser"])
    if clipping == "fixed":
        library = dp_gd_train(config, x, y, n_norm, Noise.seeded(11), return_iterates=True)
        assert np.array_equal(library, path)
    else:
        iterates, clips, counts = adaptive_dp_gd_train(config, x, y, n_norm, Noise.seeded(11))
        assert np.array_equal(iterates, path)
        assert clips.tolist() == streamed.output["clipping"]["clip_path"]
        assert counts.tolist() == streamed.output["clipping"]["noisy_counts"]
        assert len(set(clips.tolist())) > 1  # the clip moved, so later steps used other grids


def test_dict_columns_of_unequal_length_are_refused() -> None:
    schema = _schema("replace_one")
    ctx = PublicContext(schema, N, DEFAULT_ORDERS)
    columns = _columns()
    columns["b"] = columns["b"][:-1]
    with pytest.raises(ValueError, match="equal length"):
        DpGdMechanism().run(_params("logistic", "fixed", "replace_one"), ctx, columns, Noise.seeded(0))
