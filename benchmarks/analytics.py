"""Accuracy of the analytics mechanisms (quantiles, grouped means) against literature-style baselines.

Data: the shipped demo incomes (``service/demo_data/incomes.csv``, 1000 rows, the schema of ``expost demo``:
age in [18, 90], income in [0, 250000], region with 4 declared values, replace-one) and a 10 000-row sample
drawn with replacement from it (the same distribution at a larger n).

Quantiles (median of age, 90th percentile of income), error = |released − true| and rank error = the
distance of q·n to the released value's rank interval [#{x < v}, #{x ≤ v}], in rows, ``--trials``
releases per setting:

* ``expost quantile``: this repository's mechanism (exact report-noisy-max with one-sided geometric noise
  over 1024 public candidates: the exponential mechanism's ε and accuracy bound, data-independent work).
* ``interval EM (Smith 2011)``: the exponential mechanism over the intervals between sorted data points,
  weight length × exp(−ε·|i − q·n|/2), a uniform point inside the chosen interval: the construction of
  Tumult Analytics' and diffprivlib's quantile (re-implemented here in floating point for the comparison; it
  is not a release path of this service).
* ``candidate EM + Gumbel``: the same candidates and score as ours, selected by report-noisy-max with
  floating-point Gumbel noise (the shape of OpenDP's ``make_quantile_score_candidates`` +
  ``make_report_noisy_max_gumbel``): the exponential mechanism's law up to floating point, the reference
  our selection must match (report-noisy-max with exponential noise is never worse in expectation).

Reference number (literature): the exponential mechanism's utility theorem (McSherry and Talwar 2007):
with probability ≥ 1 − β the released candidate's rank error is ≤ best + 2·ln(K/β)/ε (K = 1024, β = 0.05).

Grouped means (mean income per region, 4 cells), error = mean over cells of |released − true|:

* ``expost measures.laplace``: centred sum and count per cell, ε/2 each, exact discrete Laplace on a grid.
* ``Tumult-style``: the same decomposition (midpoint-centred sum and count, ε/2 each) with continuous
  Laplace in floating point: Tumult Analytics' AVERAGE.
* ``uncentred sum/count``: sum over [0, U] and count, ε/2 each (an uncentred sum, as a naive SUM/COUNT
  would do): under replace-one with grouping its ℓ1 is 2U instead of U.

Reference number: with the centred sum the noise of the cell's sum has scale b = U/(ε/2) (ℓ1 = U: a record
moving between cells shifts two centred sums by ≤ U/2 each), E|Lap(b)| = b, so the mean's error is about
b/n_cell for large cells (printed as ``predicted``).

Usage: ``.venv/bin/python benchmarks/analytics.py [--trials 200] [--output benchmarks/results/…json]``.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np

from mechanisms.accounting import DEFAULT_ORDERS
from mechanisms.base import PublicContext
from mechanisms.data.schema import DatasetSchema
from mechanisms.data.table import load_csv
from mechanisms.noise import Noise
from mechanisms.queries.measures import MeasuresLaplace, MeasuresLaplaceParams
from mechanisms.queries.quantile import Quantile, QuantileParams, candidate_grid
from service.cli import DEMO_SCHEMA, demo_csv

EPSILONS = (0.1, 0.5, 1.0)
CANDIDATES = 1024
BETA = 0.05


def load(rows: int, rng: np.random.Generator) -> tuple[dict[str, np.ndarray], PublicContext]:
    schema = DatasetSchema.model_validate(DEMO_SCHEMA)
    table = load_csv(demo_csv(), schema)
    columns = table.columns
    if rows != table.n_rows:
        pick = rng.integers(0, table.n_rows, rows)
        columns = {name: values[pick] for name, values in columns.items()}
    return columns, PublicContext(schema, rows, DEFAULT_ORDERS)


def rank_error(data: np.ndarray, value: float, q: float) -> float:
    """Distance of q·n to the rank interval [#{x < v}, #{x ≤ v}] of v (0 when v is an exact q-quantile)."""
    below, at_most = float(np.count_nonzero(data < value)), float(np.count_nonzero(data <= value))
    return max(0.0, below - q * data.size, q * data.size - at_most)


def interval_em(
    data: np.ndarray, low: float, high: float, q: float, eps: float, rng: np.random.Generator
) -> float:
    z = np.concatenate([[low], np.sort(np.clip(data, low, high)), [high]])
    lengths = np.diff(z)
    utility = -np.abs(np.arange(lengths.size) - q * data.size)
    with np.errstate(divide="ignore"):
        logw = np.log(lengths) + eps * utility / 2.0
    logw -= logw.max()
    weights = np.exp(logw)
    i = rng.choice(lengths.size, p=weights / weights.sum())
    return float(rng.uniform(z[i], z[i + 1]))


def gumbel_candidates(
    data: np.ndarray, candidates: np.ndarray, q: float, eps: float, rng: np.random.Generator
) -> float:
    counts = np.searchsorted(np.sort(data), candidates, side="right")
    score = -np.abs(counts - q * data.size) * eps / 2.0
    return float(candidates[np.argmax(score + rng.gumbel(size=candidates.size))])


def quantile_rows(
    data: dict[str, np.ndarray], ctx: PublicContext, trials: int, rng: np.random.Generator, seed: int
) -> list[dict[str, Any]]:
    rows = []
    quantile = Quantile()
    noise = Noise.seeded(seed)
    for column, q in (("age", 0.5), ("income", 0.9)):
        values = data[column]
        spec = ctx.schema.column(column)
        assert spec is not None
        assert spec.type != "categorical"
        low, high = float(spec.min), float(spec.max)
        truth = float(np.quantile(values, q))
        candidates = candidate_grid(spec, CANDIDATES)
        for eps in EPSILONS:
            params = QuantileParams(column=column, quantiles=(q,), epsilon=eps, candidates=CANDIDATES)
            methods = {
                "expost quantile": lambda p=params, level=q: float(
                    quantile.run(p, ctx, data, noise).output["values"][repr(level)]
                ),
                "interval EM (Smith 2011)": lambda e=eps, v=values, level=q, lo=low, hi=high: interval_em(
                    v, lo, hi, level, e, rng
                ),
                "candidate EM + Gumbel": lambda e=eps, v=values, level=q, c=candidates: gumbel_candidates(
                    v, c, level, e, rng
                ),
            }
            for name, release in methods.items():
                started = time.perf_counter()
                released = np.array([release() for _ in range(trials)])
                seconds = (time.perf_counter() - started) / trials
                ranks = np.array([rank_error(values, r, q) for r in released])
                rows.append(
                    {
                        "query": f"q{q}({column})",
                        "n": int(values.size),
                        "epsilon": eps,
                        "method": name,
                        "median_abs_error": float(np.median(np.abs(released - truth))),
                        "mean_abs_error": float(np.mean(np.abs(released - truth))),
                        "median_rank_error": float(np.median(ranks)),
                        "p95_rank_error": float(np.quantile(ranks, 0.95)),
                        "reference_rank_error_95": 2 * math.log(CANDIDATES / BETA) / eps,
                        "ms_per_release": 1000 * seconds,
                    }
                )
    return rows


def grouped_rows(
    data: dict[str, np.ndarray], ctx: PublicContext, trials: int, rng: np.random.Generator, seed: int
) -> list[dict[str, Any]]:
    rows = []
    mechanism = MeasuresLaplace()
    noise = Noise.seeded(seed + 1)
    upper = 250000.0
    region, income = data["region"], data["income"]
    sizes = np.bincount(region, minlength=4).astype(float)
    sums = np.bincount(region, weights=income, minlength=4)
    truth = sums / sizes
    centre = upper / 2
    for eps in EPSILONS:
        params = MeasuresLaplaceParams.model_validate(
            {"measures": [{"kind": "mean", "column": "income"}], "group_by": ["region"], "epsilon": eps}
        )

        def ours(p: MeasuresLaplaceParams = params) -> np.ndarray:
            groups = mechanism.run(p, ctx, data, noise).output["groups"]
            return np.array([g["mean(income)"] for g in groups])

        def tumult(e: float = eps) -> np.ndarray:
            csum = sums - centre * sizes + rng.laplace(0.0, upper / (e / 2), 4)
            count = np.maximum(sizes + rng.laplace(0.0, 2.0 / (e / 2), 4), 1.0)
            return np.asarray(np.clip(centre + csum / count, 0.0, upper))

        def uncentred(e: float = eps) -> np.ndarray:
            total = sums + rng.laplace(0.0, 2 * upper / (e / 2), 4)
            count = np.maximum(sizes + rng.laplace(0.0, 2.0 / (e / 2), 4), 1.0)
            return np.asarray(np.clip(total / count, 0.0, upper))

        predicted = float(np.mean((upper / (eps / 2)) / sizes))
        for name, release in (
            ("expost measures.laplace", ours),
            ("Tumult-style centred sum/count", tumult),
            ("uncentred sum/count", uncentred),
        ):
            started = time.perf_counter()
            errors = np.array([np.mean(np.abs(release() - truth)) for _ in range(trials)])
            seconds = (time.perf_counter() - started) / trials
            rows.append(
                {
                    "query": "mean(income) by region",
                    "n": int(income.size),
                    "epsilon": eps,
                    "method": name,
                    "mean_abs_error": float(np.mean(errors)),
                    "median_abs_error": float(np.median(errors)),
                    "predicted_abs_error": predicted,
                    "ms_per_release": 1000 * seconds,
                }
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=200)
    parser.add_argument("--seed", type=int, default=20261126)
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/analytics.json"))
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    results: list[dict[str, Any]] = []
    for rows in (1000, 10000):
        data, ctx = load(rows, rng)
        results += quantile_rows(data, ctx, args.trials, rng, args.seed + rows)
        results += grouped_rows(data, ctx, args.trials, rng, args.seed + rows)
    header = f"{'query':<24}{'n':>7}{'ε':>5}  {'method':<32}{'med |err|':>11}{'med rank':>10}{'ref/pred':>10}"
    print(header)
    for r in results:
        rank = r.get("median_rank_error", float("nan"))
        ref = r.get("reference_rank_error_95", r.get("predicted_abs_error", float("nan")))
        print(
            f"{r['query']:<24}{r['n']:>7}{r['epsilon']:>5}  {r['method']:<32}"
            f"{r['median_abs_error']:>11.4g}{rank:>10.4g}{ref:>10.4g}"
        )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    payload = {"trials": args.trials, "seed": args.seed, "epsilons": list(EPSILONS), "results": results}
    args.output.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
