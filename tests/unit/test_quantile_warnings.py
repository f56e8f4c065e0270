"""Issue 35, item 1: a quantile at a useless ε says so in its release.

At ε = 8.5e-6 on 1 000 rows the 95 % rank-error bound is millions of rows and the released "quartiles" are
random candidates (q25 = 88, q50 = 48, q75 = 72 was seen); the release now carries a ``warnings`` entry
computed from public values only (the bound and the public row count). A useful ε carries none.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from mechanisms.accounting import DEFAULT_ORDERS
from mechanisms.base import PublicContext
from mechanisms.data.schema import DatasetSchema
from mechanisms.noise import Noise
from mechanisms.queries.quantile import Quantile, QuantileParams
from service.cli import DEMO_SCHEMA, demo_csv

ROWS = 1000


def demo_context(neighboring: str = "replace_one") -> PublicContext:
    schema = DatasetSchema.model_validate({**DEMO_SCHEMA, "neighboring": neighboring})
    return PublicContext(schema, ROWS if neighboring == "replace_one" else None, DEFAULT_ORDERS)


def demo_ages() -> dict[str, np.ndarray]:
    lines = demo_csv().decode().splitlines()[1:]
    return {"age": np.array([float(line.split(",")[0]) for line in lines], dtype=np.float64)}


def quartiles(epsilon: float, neighboring: str = "replace_one") -> dict[str, Any]:
    params = QuantileParams(column="age", quantiles=(0.25, 0.5, 0.75), epsilon=epsilon)
    ctx = demo_context(neighboring)
    return Quantile().run(params, ctx, demo_ages(), Noise.seeded(35)).output


def test_the_demo_table_has_the_public_row_count() -> None:
    assert demo_ages()["age"].size == ROWS


def test_a_tiny_epsilon_warns_with_the_bound_and_a_useful_epsilon() -> None:
    output = quartiles(8.5e-6)
    bound = output["mechanism"]["rank_error_95"]
    assert bound > 1e6  # the issue's ≈ 7·10⁶ rows on 1 000
    [warning] = output["warnings"]
    assert "rank_error_95" in warning
    assert f"{ROWS} rows" in warning
    suggested = float(warning.rsplit("at least ", 1)[1].split()[0])
    assert suggested > 8.5e-6
    assert "warnings" not in quartiles(suggested * 1.01)  # the suggestion is enough (bound ∝ 1/ε)


@pytest.mark.parametrize("epsilon", [0.5, 1.0, 5.0])
def test_a_useful_epsilon_does_not_warn(epsilon: float) -> None:
    output = quartiles(epsilon)
    assert output["mechanism"]["rank_error_95"] < ROWS / 4
    assert "warnings" not in output


def test_without_a_public_row_count_there_is_nothing_to_compare_with() -> None:
    assert "warnings" not in quartiles(8.5e-6, neighboring="add_remove")


@pytest.mark.parametrize("seed", range(20))
def test_released_quantiles_are_monotone_in_the_level(seed: int) -> None:
    """Issue 35 item 9: the selections are sorted (post-processing), so a higher level never gets a smaller
    value, even at an ε where each selection is close to random (the issue's q25 = 88, q50 = 48, q75 = 72)."""
    params = QuantileParams(column="age", quantiles=(0.75, 0.1, 0.5, 0.25), epsilon=8.5e-6)
    values = Quantile().run(params, demo_context(), demo_ages(), Noise.seeded(seed)).output["values"]
    assert list(values) == ["0.75", "0.1", "0.5", "0.25"]  # in the order asked
    by_level = [values[repr(q)] for q in sorted(params.quantiles)]
    assert by_level == sorted(by_level)


def test_sorting_changes_a_non_monotone_selection() -> None:
    """Power: at that ε unsorted selections are out of order in most seeds, so the sorting is doing work."""
    params = QuantileParams(column="age", quantiles=(0.25, 0.5, 0.75), epsilon=8.5e-6)
    ctx, table = demo_context(), demo_ages()
    from mechanisms.queries.quantile import noise_rate, noisy_max_select, selected_rank_counts

    out_of_order = 0
    for seed in range(20):
        noise = Noise.seeded(seed)
        _candidates, counts, selected = selected_rank_counts(params, ctx, table)
        rate = noise_rate(params, ctx.schema.unit_rows)
        raw = [int(noisy_max_select(noise, counts, selected, q, rate)[0]) for q in params.quantiles]
        out_of_order += raw != sorted(raw)
    assert out_of_order >= 10
