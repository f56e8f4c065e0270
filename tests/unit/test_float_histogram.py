"""Issue 35 item 9: histograms of float columns with ``bins`` equal-width bins over the declared range
(mechanisms/queries/language.py ``float_bins``): bin j is (e_j, e_{j+1}], the first closed at min; the edges
are public, so a row's bin is a function of the row alone and the histogram's sensitivity is unchanged. The
NumPy reference and DuckDB agree exactly, values on the edges included."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from mechanisms.accounting import DEFAULT_ORDERS
from mechanisms.base import ParamsError, PublicContext
from mechanisms.data.schema import DatasetSchema
from mechanisms.noise import Noise
from mechanisms.queries.language import evaluate
from mechanisms.queries.laplace import Laplace, LaplaceParams
from tests.engine_support import engine_table

SCHEMA = DatasetSchema.model_validate(
    {
        "columns": [
            {"name": "x", "type": "float", "min": -3.0, "max": 7.0},
            {"name": "n", "type": "int", "min": 0, "max": 9},
        ],
        "neighboring": "add_remove",
    }
)
CTX = PublicContext(SCHEMA, None, DEFAULT_ORDERS)


def histogram(bins: int | None, column: str = "x", epsilon: float = 1.0) -> LaplaceParams:
    query = {"kind": "histogram", "column": column, **({"bins": bins} if bins is not None else {})}
    return LaplaceParams.model_validate({"query": query, "epsilon": epsilon})


def edges(bins: int) -> np.ndarray:
    """The public edges, each the double nearest to min + j·(max − min)/bins."""
    return np.asarray([float(Fraction(-3) + Fraction(10 * j, bins)) for j in range(bins + 1)])


def table(seed: int, bins: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = np.concatenate([rng.uniform(-3.0, 7.0, 500), edges(bins), np.nextafter(edges(bins), np.inf)])
    x = np.clip(x, -3.0, 7.0)
    return {"x": x, "n": rng.integers(0, 10, x.size)}


def expected_counts(x: np.ndarray, bins: int) -> np.ndarray:
    """Right-closed bins: the number of interior edges strictly below x (searchsorted, side='left')."""
    index = np.searchsorted(edges(bins)[1:-1], x, side="left")
    return np.bincount(index, minlength=bins)


@pytest.mark.parametrize("bins", [2, 3, 7, 10, 64])
def test_counts_are_right_closed_bins_over_the_declared_range(bins: int) -> None:
    data = table(bins, bins)
    values, labels = evaluate(histogram(bins).query, CTX, data)
    assert list(values.astype(int)) == list(expected_counts(data["x"], bins))
    assert len(labels) == bins
    assert labels[0].startswith("[-3.0, ")
    assert labels[-1].endswith(", 7.0]")


@pytest.mark.parametrize("bins", [3, 10])
def test_duckdb_gives_the_same_counts(bins: int, tmp_path: Path) -> None:
    data = table(100 + bins, bins)
    on_engine = engine_table(data, SCHEMA, tmp_path)
    assert list(evaluate(histogram(bins).query, CTX, on_engine)[0]) == list(
        evaluate(histogram(bins).query, CTX, data)[0]
    )


def test_a_release_has_one_value_per_bin_and_the_histogram_charge() -> None:
    release = Laplace().run(histogram(5, epsilon=0.5), CTX, table(1, 5), Noise.seeded(1))
    assert len(release.output["values"]) == 5
    assert release.realized.pure == 0.5
    assert Laplace().worst_case(histogram(5, epsilon=0.5), CTX) == Laplace().worst_case(
        histogram(None, "n", epsilon=0.5), CTX
    )  # one row moves one bin by 1, as for an int histogram


def test_bins_are_required_for_floats_and_refused_elsewhere() -> None:
    with pytest.raises(ParamsError) as missing:
        Laplace().check(histogram(None), CTX)
    assert missing.value.field == "query.bins"
    with pytest.raises(ParamsError) as misplaced:
        Laplace().check(histogram(4, "n"), CTX)
    assert misplaced.value.field == "query.bins"
    with pytest.raises(ValidationError):
        histogram(1)
