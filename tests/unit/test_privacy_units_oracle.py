"""Privacy units side by side with an independent library: PipelineDP (pipeline-dp 0.3.1, Google's
differential-privacy library through python-dp), a test-only oracle.

Same bounds on both sides: each privacy unit contributes at most k rows in total (PipelineDP
``max_contributions=k``; ours ``privacy_unit.max_rows=k``), values clamped to [L, U], pure ε, Laplace noise,
add/remove one unit (PipelineDP's only neighbour relation), public partitions (our ``group_by`` over a
categorical column's declared values). PipelineDP's noise parameter b (value units) is read from the library
itself: the ``*_noise_stddev`` it outputs (b = std/√2) or, for MEAN, its explain-computation report; ours is
``laplace_plan``'s scale × granularity (the ``noise.scale`` a release publishes) or ``laplace_plans``'
block scale × granularity. M = max(|L|, |U|).

Claim, for every case below: b_theirs ≤ b_ours ≤ b_theirs·(1 + excess), with excess proved here:

* count, histogram (ℓ1 over the bins), sum of an int column: both sensitivities are k and k·M exactly
  (integers on the grid γ = 1, no rounding). Ours is t = dyadic_scale_up(kΔ/ε) = ⌈x·2^s⌉/2^s with
  s = max(0, 40 − bitlen(⌊x⌋ + 1)), so 0 ≤ t − x < 2^-s, i.e. excess < 2^-s/x ≤ 2^-39 (``_dyadic_excess``);
  the ε we divide by is ``charged_fraction(ε)`` ≤ ε, which only increases t.
* sum of a float column: ours is released on γ = 2^j ≤ 2^-10·kM (``laplace_grid``) with the grid sensitivity
  m = ⌊kM/γ + 1/64⌋ + 1 units (Lemma GRID: rounding the answer to the grid moves it by < 1 unit, the rows'
  own rounding by ≤ 1/64), so b_ours = dyadic(m/ε)·γ ≤ (kM + (1 + 1/64)·γ)/ε·(1 + 2^-39): excess ≤
  (65/64)·γ/(kM) + 2^-39 ≤ (65/64)·2^-10 + 2^-39 ≈ 0.0992 %.
* ``measures.laplace`` grouped over G cells (sum block): a unit's ≤ k rows may sit in c = min(k, G) cells,
  each rounded to the grid (``unit_spread``), so m = ⌊kM/γ + 1/64⌋ + c: excess ≤ (c + 1/64)·γ/(kM) + 2^-39
  ≤ (c + 1/64)·2^-10 (0.39 % at k = 4, G = 5). PipelineDP adds continuous Laplace noise per partition with
  no grid, so it has no such term (and no protection against the floating-point attacks the grid stops).
* mean (``measures.laplace`` mean = noisy centred sum / noisy count; PipelineDP MEAN = the same
  normalised-sum construction): both split ε equally over the count (Δ = k) and the centred sum
  (Δ = k·(U − L)/2). Ours centres at c = fl((L + U)/2) with H = float_up(max(|L − c|, |U − c|)) ≥ (U − L)/2
  (equal when c is exact), then the grid term above: excess ≤ (H − (U − L)/2)/((U − L)/2) +
  (c + 1/64)·γ/(kH) + 2^-39.

Where we differ (none is an under-charge): the grid term above (more noise, ≤ 0.1 % ungrouped); which rows
are kept (PipelineDP samples uniformly at random in every run; ours keeps the first k in a keyed-hash order
fixed at ingestion, the same rows in every query with the same filter) — the kept *number* is the same, so
counts agree, and sums agree whenever a unit's values are equal (``test_bounded_aggregates_agree``); a
``where`` is applied before our bounding (each filtered query keeps up to k of the unit's *selected* rows, a
separate release charged separately), while PipelineDP bounds before partitioning only; PipelineDP also
offers per-partition bounds (``max_partitions_contributed`` m × ``max_contributions_per_partition`` k_p, ℓ1
= m·k_p, ℓ2 = √m·k_p) and per-partition sum clamps, which we do not; we offer replace-one-unit (ℓ1 = 2k for a
histogram), which PipelineDP does not. Gaussian: PipelineDP calibrates (ε, δ) with the analytic Gaussian,
ours is RDP with σ = z·Δ₂; only the ℓ2 sensitivities are comparable, and they agree (k; k·M plus the grid
term for real sums).
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from mechanisms.accounting import DEFAULT_ORDERS
from mechanisms.base import PublicContext
from mechanisms.data.plan import ORDER_COLUMN
from mechanisms.data.schema import DatasetSchema
from mechanisms.noise import float_up
from mechanisms.queries.gaussian import GaussianParams, gaussian_plan
from mechanisms.queries.language import evaluate, laplace_plan
from mechanisms.queries.laplace import LaplaceParams
from mechanisms.queries.measures import MeasuresLaplaceParams, laplace_plans
from service.data.ingest import unit_order

pipeline_dp = pytest.importorskip("pipeline_dp", reason="the test extra pipeline-dp (the oracle) is missing")
from pipeline_dp import dp_computations  # noqa: E402
from pipeline_dp.report_generator import ExplainComputationReport  # noqa: E402

GROUPS = ("a", "b", "c", "d", "e")
KS = (1, 4, 25)
EPSILONS = (0.1, 0.3, 1.0, 2.5)
BOUNDS = ((-2.0, 5.0), (0.0, 100.0), (-7.25, -1.5), (-0.3, 0.7))
INT_BOUNDS = {(-2.0, 5.0): (-2, 5), (0.0, 100.0): (0, 100), (-7.25, -1.5): (-7, -2), (-0.3, 0.7): (-3, 7)}
CASES = [(k, eps, bounds) for k in KS for eps in EPSILONS for bounds in BOUNDS]


# ----- the two sides -----------------------------------------------------------------------------------
def _ctx(k: int, bounds: tuple[float, float]) -> PublicContext:
    low, high = bounds
    int_low, int_high = INT_BOUNDS.get(bounds, (-5, 5))
    schema = DatasetSchema.model_validate(
        {
            "columns": [
                {"name": "user", "type": "int", "min": 0, "max": 10**6},
                {"name": "x", "type": "float", "min": low, "max": high},
                {"name": "i", "type": "int", "min": int_low, "max": int_high},
                {"name": "g", "type": "categorical", "values": list(GROUPS)},
            ],
            "neighboring": "add_remove",
            "privacy_unit": {"column": "user", "max_rows": k},
        }
    )
    return PublicContext(schema, None, DEFAULT_ORDERS)


def _ours(query: dict[str, Any], ctx: PublicContext, eps: float) -> tuple[float, float, int]:
    """(b in value units, γ, grid sensitivity in units) of our ``laplace`` release of ``query``."""
    params = LaplaceParams.model_validate({"query": query, "epsilon": eps})
    plan, scale = laplace_plan(params.query, ctx, eps)
    gamma = plan.grid.granularity
    return float(scale * Fraction(gamma)), gamma, plan.l1_units


def _ours_measures(measures: list[dict[str, Any]], ctx: PublicContext, eps: float) -> dict[str, float]:
    params = MeasuresLaplaceParams.model_validate({"measures": measures, "group_by": ["g"], "epsilon": eps})
    out: dict[str, float] = {}
    for plan, scale in laplace_plans(params, ctx):
        assert scale is not None
        out[plan.block.label] = float(scale * Fraction(plan.grid.granularity))
        out[plan.block.label + ":gamma"] = plan.grid.granularity
    return out


ROWS = [(u, float(u % 7) - 2.5, u % 9 - 4, GROUPS[u % 5]) for u in range(40) for _ in range(1 + (u * 7) % 31)]
"""40 units of 1 to 31 rows; each unit's rows share one value and one group (so any k of them are alike)."""


def _theirs(
    metrics: list[Any], k: int, eps: float, bounds: tuple[float, float], value: int = 1, partitions: int = 5
) -> tuple[list[Any], str]:
    """Run PipelineDP's ``DPEngine`` (local backend) on ``ROWS``; the per-partition results and its report."""
    accountant = pipeline_dp.NaiveBudgetAccountant(total_epsilon=eps, total_delta=0)
    engine = pipeline_dp.DPEngine(accountant, pipeline_dp.LocalBackend())
    params = pipeline_dp.AggregateParams(
        noise_kind=pipeline_dp.NoiseKind.LAPLACE,
        metrics=metrics,
        max_contributions=k,
        min_value=bounds[0],
        max_value=bounds[1],
        output_noise_stddev=True,
    )
    extractors = pipeline_dp.DataExtractors(
        privacy_id_extractor=lambda r: r[0],
        partition_extractor=(lambda r: r[3]) if partitions > 1 else (lambda r: "all"),
        value_extractor=lambda r: r[value],
    )
    report = ExplainComputationReport()
    public = list(GROUPS) if partitions > 1 else ["all"]
    result = engine.aggregate(ROWS, params, extractors, public, out_explain_computation_report=report)
    accountant.compute_budgets()
    rows = list(result)
    return rows, report.text()


def _b(stddev: float) -> float:
    """Laplace b from PipelineDP's reported standard deviation (b·√2)."""
    return stddev / math.sqrt(2)


_REPORT = re.compile(r"Applied to '(\w+)' Laplace mechanism:\s+parameter=([0-9.e+-]+)\s+eps=([0-9.e+-]+)")


# ----- the bounds of the docstring -----------------------------------------------------------------------
def _dyadic_excess(x: float) -> float:
    """dyadic_scale_up(x)/x − 1 < 2^-s/x, s = max(0, 40 − bitlen(⌊x⌋ + 1))."""
    shift = max(0, 40 - (math.floor(x) + 1).bit_length())
    return 2.0**-shift / x


def _assert_within(ours: float, theirs: float, excess: float, label: str) -> None:
    assert ours >= theirs * (1 - 1e-12), f"{label}: our noise is smaller ({ours} < {theirs})"
    assert ours <= theirs * (1 + excess) * (1 + 1e-12), f"{label}: {ours} vs {theirs}, excess {excess:.3g}"


# ----- the comparisons -------------------------------------------------------------------------------------
@pytest.mark.parametrize(("k", "eps", "bounds"), CASES)
def test_count_and_histogram_scales_equal_pipeline_dps(
    k: int, eps: float, bounds: tuple[float, float]
) -> None:
    ctx = _ctx(k, bounds)
    ours_count, gamma, units = _ours({"kind": "count"}, ctx, eps)
    assert (gamma, units) == (1.0, k)
    rows, _ = _theirs([pipeline_dp.Metrics.COUNT], k, eps, bounds, partitions=1)
    theirs = _b(rows[0][1].count_noise_stddev)
    _assert_within(ours_count, theirs, _dyadic_excess(k / eps), "count")
    ours_histogram, gamma, units = _ours({"kind": "histogram", "column": "g"}, ctx, eps)
    assert (gamma, units) == (1.0, k)
    rows, _ = _theirs([pipeline_dp.Metrics.COUNT], k, eps, bounds)
    assert len(rows) == len(GROUPS)
    for _key, metrics in rows:  # the same b in every partition: ℓ1 = k over all of them
        _assert_within(ours_histogram, _b(metrics.count_noise_stddev), _dyadic_excess(k / eps), "histogram")


@pytest.mark.parametrize(("k", "eps", "bounds"), CASES)
def test_sum_scales_match_pipeline_dps_within_the_grid_term(
    k: int, eps: float, bounds: tuple[float, float]
) -> None:
    ctx = _ctx(k, bounds)
    ours, gamma, units = _ours({"kind": "sum", "column": "x"}, ctx, eps)
    m = max(abs(bounds[0]), abs(bounds[1]))
    assert gamma <= 2**-10 * k * m
    assert (
        units
        == math.floor(Fraction(float_up(Fraction(k) * Fraction(m))) / Fraction(gamma) + Fraction(1, 64)) + 1
    )
    rows, _ = _theirs([pipeline_dp.Metrics.SUM], k, eps, bounds, partitions=1)
    theirs = _b(rows[0][1].sum_noise_stddev)
    excess = (65 / 64) * gamma / (k * m) + _dyadic_excess(units / eps)
    assert excess <= (65 / 64) * 2**-10 + 2**-39
    _assert_within(ours, theirs, excess, "float sum")
    # an int column: exact on γ = 1, the same b as PipelineDP's on the int bounds
    int_bounds = tuple(float(b) for b in INT_BOUNDS[bounds])
    ours_int, gamma, units = _ours({"kind": "sum", "column": "i"}, ctx, eps)
    int_m = max(abs(int_bounds[0]), abs(int_bounds[1]))
    assert (gamma, units) == (1.0, k * int_m)
    rows, _ = _theirs(
        [pipeline_dp.Metrics.SUM], k, eps, (int_bounds[0], int_bounds[1]), value=2, partitions=1
    )
    _assert_within(ours_int, _b(rows[0][1].sum_noise_stddev), _dyadic_excess(k * int_m / eps), "int sum")


@pytest.mark.parametrize(("k", "eps", "bounds"), CASES)
def test_grouped_count_and_sum_match_pipeline_dps(k: int, eps: float, bounds: tuple[float, float]) -> None:
    """``measures.laplace`` count + sum(x) by g against PipelineDP COUNT + SUM over public partitions: ε is
    split in two on both sides; the sum block's excess includes c = min(k, 5) rounded cells."""
    ctx = _ctx(k, bounds)
    ours = _ours_measures([{"kind": "count"}, {"kind": "sum", "column": "x"}], ctx, eps)
    rows, _ = _theirs([pipeline_dp.Metrics.COUNT, pipeline_dp.Metrics.SUM], k, eps, bounds)
    m = max(abs(bounds[0]), abs(bounds[1]))
    cells = min(k, len(GROUPS))
    gamma = ours["sum(x):gamma"]
    excess = (cells + 1 / 64) * gamma / (k * m) + _dyadic_excess(ours["sum(x)"] / gamma)
    for _key, metrics in rows:
        _assert_within(
            ours["count"], _b(metrics.count_noise_stddev), _dyadic_excess(2 * k / eps), "count block"
        )
        _assert_within(ours["sum(x)"], _b(metrics.sum_noise_stddev), excess, "sum block")


@pytest.mark.parametrize(("k", "eps", "bounds"), CASES)
def test_grouped_mean_matches_pipeline_dps(k: int, eps: float, bounds: tuple[float, float]) -> None:
    """Mean = noisy centred sum / noisy count on both sides (PipelineDP's MEAN, read from its report)."""
    ctx = _ctx(k, bounds)
    ours = _ours_measures([{"kind": "mean", "column": "x"}], ctx, eps)
    _rows, report = _theirs([pipeline_dp.Metrics.MEAN], k, eps, bounds)
    theirs = {name: (float(b), float(e)) for name, b, e in _REPORT.findall(report)}
    assert set(theirs) == {"count", "normalized_sum"}, report
    assert all(math.isclose(e, eps / 2) for _b_, e in theirs.values())  # ε split in two, as ours
    low, high = bounds
    half = (Fraction(high) - Fraction(low)) / 2
    centre = float((Fraction(low) + Fraction(high)) / 2)
    h = Fraction(float_up(max(abs(Fraction(low) - Fraction(centre)), abs(Fraction(high) - Fraction(centre)))))
    gamma = ours["csum(x):gamma"]
    cells = min(k, len(GROUPS))
    excess = float((h - half) / half) + (cells + 1 / 64) * gamma / float(k * h)
    excess += _dyadic_excess(ours["csum(x)"] / gamma)
    _assert_within(ours["count"], theirs["count"][0], _dyadic_excess(2 * k / eps), "mean: count")
    _assert_within(ours["csum(x)"], theirs["normalized_sum"][0], excess, "mean: centred sum")


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("bounds", BOUNDS)
def test_gaussian_l2_sensitivities_agree(k: int, bounds: tuple[float, float]) -> None:
    """ℓ2 sensitivity under max_contributions = k: count and histogram k, sum k·M (ours plus the grid
    term); PipelineDP's from ``dp_computations.compute_sensitivities_for_*``."""
    ctx = _ctx(k, bounds)
    params = pipeline_dp.AggregateParams(
        noise_kind=pipeline_dp.NoiseKind.GAUSSIAN,
        metrics=[pipeline_dp.Metrics.COUNT],
        max_contributions=k,
        min_value=bounds[0],
        max_value=bounds[1],
    )
    theirs_count = dp_computations.compute_sensitivities_for_count(params).l2
    theirs_sum = dp_computations.compute_sensitivities_for_sum(params).l2
    for query, theirs in (
        ({"kind": "count"}, theirs_count),
        ({"kind": "histogram", "column": "g"}, theirs_count),
        ({"kind": "sum", "column": "x"}, theirs_sum),
    ):
        plan = gaussian_plan(GaussianParams.model_validate({"query": query, "sigma": 1.0}), ctx)[0]
        gamma = plan.grid.granularity
        ours = plan.l2_units * gamma
        excess = 0.0 if plan.exact else (65 / 64) * gamma / theirs
        _assert_within(ours, theirs, excess + 1e-15, f"ℓ2 {query['kind']}")


def _our_table(ctx: PublicContext) -> dict[str, np.ndarray]:
    columns = {
        "user": np.array([r[0] for r in ROWS], dtype=np.int64),
        "x": np.array([r[1] for r in ROWS], dtype=np.float64),
        "i": np.array([r[2] for r in ROWS], dtype=np.int64),
        "g": np.array([GROUPS.index(r[3]) for r in ROWS], dtype=np.int64),
    }
    arrays = [pa.array(columns[name]) for name in ctx.schema.names]
    columns[ORDER_COLUMN] = unit_order(arrays, 0xC0FFEE).to_numpy()
    return columns


@pytest.mark.parametrize("k", KS)
def test_bounded_aggregates_agree(k: int) -> None:
    """The bounding itself, side by side: with a unit's rows alike (one value, one group), keeping any k of
    them gives the same aggregates, so PipelineDP's (random k rows, noise negligible at ε = 10⁹) and ours
    (hash order, exact) agree per partition: Σ min(n_u, k) rows and Σ min(n_u, k)·clamp(v_u)."""
    bounds = (-2.0, 3.0)
    ctx = _ctx(k, bounds)
    table = _our_table(ctx)
    histogram, labels = evaluate(
        LaplaceParams.model_validate({"query": {"kind": "histogram", "column": "g"}, "epsilon": 1.0}).query,
        ctx,
        table,
    )
    assert labels == list(GROUPS)
    rows, _ = _theirs([pipeline_dp.Metrics.COUNT, pipeline_dp.Metrics.SUM], k, 1e9, bounds)
    theirs = dict(rows)
    per_unit = {u: sum(1 for r in ROWS if r[0] == u) for u in range(40)}
    for index, group in enumerate(GROUPS):
        expected_count = sum(min(n, k) for u, n in per_unit.items() if GROUPS[u % 5] == group)
        expected_sum = sum(
            min(n, k) * min(max(float(u % 7) - 2.5, bounds[0]), bounds[1])
            for u, n in per_unit.items()
            if GROUPS[u % 5] == group
        )
        assert histogram[index] == expected_count
        assert theirs[group].count == pytest.approx(expected_count, abs=1e-3)
        assert theirs[group].sum == pytest.approx(expected_sum, abs=1e-3)
        where = [{"column": "g", "op": "eq", "value": group}]
        ours_sum, _ = evaluate(
            LaplaceParams.model_validate(
                {"query": {"kind": "sum", "column": "x", "where": where}, "epsilon": 1.0}
            ).query,
            ctx,
            table,
        )
        assert ours_sum[0] == pytest.approx(expected_sum, abs=1e-9)
