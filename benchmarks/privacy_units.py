"""Privacy units with contribution bounding vs today's group-privacy fallback, at equal per-person ε.

Issue "Protect people, not rows": a dataset that declares ``privacy_unit {column, max_rows: k}`` keeps at most
k of each person's selected rows in every query (keyed-hash order, ``mechanisms.data.plan.UnitBound``) and
charges the unit-level sensitivity (k × the row's). Without units, the only way to protect a person with up
to k_max rows is group privacy: run the row-level mechanism with ε/k_max (pure ε-DP composes over the
person's k_max rows). This script measures both on a synthetic event table.

Data (fixed seeds): ``--events`` (10⁶) events of ``--users`` (10⁴) users; rows per user = 1 + a multinomial
split of the rest with heavy-tailed weights: ``lognormal`` (σ = 1.5) or ``zipf`` (weight ∝ rank⁻¹), both run
by default. Each user has a favourite of 8 groups (popularities 30/20/15/10/10/7/5/3 %) and puts 60 % of
their events there, the rest uniformly; a float ``amount`` declared in [0, 200]: user level
30·e^{N(0, 0.4)}·(n_u/100)^−0.15 (heavy users buy smaller items: bounding them away biases means, and that
bias is measured, not assumed away) × e^{N(0, 0.5)} per event × (1 + 0.1·group), clipped at ingestion.

Queries at per-person ε = ``--epsilon`` (1.0), NumPy path (dict tables with ``__order`` from
``service.data.ingest.unit_order``), the real plans and scales (``laplace_plan``, ``laplace_plans``,
``evaluate_units``, ``evaluate_blocks``, the measures' own post-processing ``_derive``), ``--draws`` (2000)
noise draws from ``Noise.seeded`` around the exact bounded answer (one ``run`` per setting checks the
published noise scale):

* ``count``: ``laplace`` count of all events; truth 10⁶.
* ``sum``: ``laplace`` sum of amount; truth Σ clipped amount.
* ``group counts``: ``measures.laplace`` count by group (8 cells; error averaged over cells).
* ``group means``: ``measures.laplace`` mean(amount) by group (noisy centred sum / noisy count, ε/2 each;
  error averaged over cells); truth = the mean over all events of the group.

Unit-level settings: k = the 50th, 90th, 99th, 99.9th percentile of rows per user and k_max (no row dropped:
must tie with the fallback). Choosing k from the data's percentiles is itself data-dependent (a leak in a real
deployment, where k is public or chosen with budget); it is an oracle choice here, as the fallback's true
k_max is. Errors: MAE = mean |released − truth|; **bias** = |exact bounded answer − truth| (rows dropped by
the bound; 0 for the fallback); **noise** = mean |released − exact bounded answer|.

A bound worth printing beside the result: for the total count with Laplace noise, MAE(k) ≥ max(bias, E|Z|) ≥
max(k_max − k, k/ε) (the heaviest user alone loses k_max − k rows) ≥ k_max/(1 + ε), while the fallback's is
k_max/ε: bounding rows can beat group privacy on a total by at most (1 + ε)/ε (2× at ε = 1), whatever the
data. Large gains need statistics where the dropped rows cancel (means) or are spread thin (many cells).

Usage: ``.venv/bin/python benchmarks/privacy_units.py [--draws 2000] [--distributions lognormal zipf]``.
Writes ``benchmarks/results/privacy_units.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from mechanisms.accounting import DEFAULT_ORDERS
from mechanisms.base import PublicContext
from mechanisms.data.plan import ORDER_COLUMN
from mechanisms.data.schema import DatasetSchema
from mechanisms.noise import Noise
from mechanisms.queries.language import evaluate_units, laplace_plan
from mechanisms.queries.laplace import Laplace, LaplaceParams
from mechanisms.queries.measures import (
    MeasuresLaplace,
    MeasuresLaplaceParams,
    _derive,
    evaluate_blocks,
    laplace_plans,
)
from service.data.ingest import unit_order

GROUPS = tuple(f"g{i}" for i in range(8))
POPULARITY = np.array([0.30, 0.20, 0.15, 0.10, 0.10, 0.07, 0.05, 0.03])
AMOUNT_MAX = 200.0
SECRET = 0x5EED_2026
PERCENTILES = (50.0, 90.0, 99.0, 99.9)


# ----- data ------------------------------------------------------------------------------------------------
def rows_per_user(distribution: str, users: int, events: int, rng: np.random.Generator) -> np.ndarray:
    if distribution == "lognormal":
        weights = rng.lognormal(0.0, 1.5, users)
    elif distribution == "zipf":
        weights = 1.0 / np.arange(1, users + 1)
    else:
        raise ValueError(distribution)
    counts: np.ndarray = rng.multinomial(events - users, weights / weights.sum()) + 1
    return counts


def make_table(
    distribution: str, users: int, events: int, seed: int
) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """The event table (as the service reads a snapshot: clipped columns and ``__order``) and n_u."""
    rng = np.random.default_rng(seed)
    n_u = rows_per_user(distribution, users, events, rng)
    user = np.repeat(np.arange(users, dtype=np.int64), n_u)
    favourite = rng.choice(len(GROUPS), size=users, p=POPULARITY)
    own = rng.random(events) < 0.6
    group = np.where(own, np.repeat(favourite, n_u), rng.integers(0, len(GROUPS), events)).astype(np.int64)
    level = 30.0 * np.exp(rng.normal(0.0, 0.4, users)) * (n_u / 100.0) ** -0.15
    amount = np.repeat(level, n_u) * np.exp(rng.normal(0.0, 0.5, events)) * (1.0 + 0.1 * group)
    amount = np.clip(amount, 0.0, AMOUNT_MAX)  # ingestion clips to the declared bounds
    columns = {"user": user, "group": group, "amount": amount}
    arrays = [pa.array(columns[name]) for name in ("user", "group", "amount")]
    columns[ORDER_COLUMN] = unit_order(arrays, SECRET).to_numpy()
    return columns, n_u


def context(users: int, k: int | None) -> PublicContext:
    raw: dict[str, Any] = {
        "columns": [
            {"name": "user", "type": "int", "min": 0, "max": users - 1},
            {"name": "group", "type": "categorical", "values": list(GROUPS)},
            {"name": "amount", "type": "float", "min": 0.0, "max": AMOUNT_MAX},
        ],
        "neighboring": "add_remove",
    }
    if k is not None:
        raw["privacy_unit"] = {"column": "user", "max_rows": k}
    return PublicContext(DatasetSchema.model_validate(raw), None, DEFAULT_ORDERS)


# ----- releases ---------------------------------------------------------------------------------------------
def scalar_releases(
    query: dict[str, Any], ctx: PublicContext, eps: float, table: dict[str, np.ndarray], draws: int, seed: int
) -> tuple[float, np.ndarray, float, float]:
    """(exact bounded answer on the grid, ``draws`` releases, published scale, seconds of one ``run``)."""
    params = LaplaceParams.model_validate({"query": query, "epsilon": eps})
    plan, scale = laplace_plan(params.query, ctx, eps)
    units = evaluate_units(params.query, ctx, table, plan)[0]
    noise = Noise.seeded(seed).discrete_laplace(scale, draws)
    released = plan.grid.from_units(units[0] + noise)
    exact = float(plan.grid.from_units(units)[0])
    started = time.perf_counter()
    output = Laplace().run(params, ctx, table, Noise.seeded(seed + 1)).output
    seconds = time.perf_counter() - started
    published = output["noise"]["scale"]
    assert published == float(scale * Fraction(plan.grid.granularity))
    return exact, released, published, seconds


def grouped_releases(
    measure: dict[str, Any],
    ctx: PublicContext,
    eps: float,
    table: dict[str, np.ndarray],
    draws: int,
    seed: int,
) -> tuple[np.ndarray, np.ndarray, dict[str, float], float]:
    """(exact bounded measure per cell, releases (draws × cells), published block scales, seconds of one
    ``run``) of ``measures.laplace`` [measure] by group."""
    params = MeasuresLaplaceParams.model_validate(
        {"measures": [measure], "group_by": ["group"], "epsilon": eps}
    )
    planned = laplace_plans(params, ctx)
    plans = [plan for plan, _ in planned]
    units, _columns = evaluate_blocks(params, ctx, table, plans)
    noise = Noise.seeded(seed)
    cells = len(GROUPS)
    released: dict[str, np.ndarray] = {}
    exact: dict[str, np.ndarray] = {}
    scales: dict[str, float] = {}
    for (plan, scale), block_units in zip(planned, units, strict=True):
        assert scale is not None
        draw = noise.discrete_laplace(scale, draws * cells).reshape(draws, cells)
        released[plan.block.label] = plan.grid.from_units(block_units[None, :] + draw)
        exact[plan.block.label] = plan.grid.from_units(block_units)[None, :]
        scales[plan.block.label] = float(scale * Fraction(plan.grid.granularity))
    label = params.measures[0].label
    noisy = _derive(params, ctx, released, cells)[label]
    exact_measure = _derive(params, ctx, exact, cells)[label][0]
    started = time.perf_counter()
    output = MeasuresLaplace().run(params, ctx, table, Noise.seeded(seed + 1)).output
    seconds = time.perf_counter() - started
    assert {b["block"]: b["scale"] for b in output["blocks"]} == scales
    return exact_measure, noisy, scales, seconds


def errors(truth: np.ndarray, exact: np.ndarray, released: np.ndarray) -> dict[str, float]:
    """MAE (per draw averaged over cells, then over draws), bias (mean over cells of |exact − truth|), noise
    (mean |released − exact|)."""
    released = released.reshape(released.shape[0], -1)
    exact = np.asarray(exact, dtype=np.float64).reshape(1, -1)
    truth = np.asarray(truth, dtype=np.float64).reshape(1, -1)
    return {
        "mae": float(np.mean(np.abs(released - truth))),
        "bias": float(np.mean(np.abs(exact - truth))),
        "noise": float(np.mean(np.abs(released - exact))),
    }


QUERIES: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("count", "scalar", {"kind": "count"}),
    ("sum", "scalar", {"kind": "sum", "column": "amount"}),
    ("group counts", "grouped", {"kind": "count"}),
    ("group means", "grouped", {"kind": "mean", "column": "amount"}),
)


def truths(table: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    group, amount = table["group"], table["amount"]
    counts = np.bincount(group, minlength=len(GROUPS)).astype(np.float64)
    sums = np.bincount(group, weights=amount, minlength=len(GROUPS))
    return {
        "count": np.array([float(group.size)]),
        "sum": np.array([float(math.fsum(amount.tolist()))]),
        "group counts": counts,
        "group means": sums / counts,
    }


def run_setting(
    name: str,
    kind: str,
    query: dict[str, Any],
    ctx: PublicContext,
    eps: float,
    table: dict[str, np.ndarray],
    truth: np.ndarray,
    draws: int,
    seed: int,
) -> dict[str, Any]:
    started = time.perf_counter()
    if kind == "scalar":
        exact, released, scale, run_seconds = scalar_releases(query, ctx, eps, table, draws, seed)
        scales: dict[str, float] = {"scale": scale}
        exact_array = np.array([exact])
    else:
        exact_array, released, scales, run_seconds = grouped_releases(query, ctx, eps, table, draws, seed)
    return {
        **errors(truth, exact_array, released),
        "scales": scales,
        "run_seconds": round(run_seconds, 3),
        "seconds": round(time.perf_counter() - started, 3),
    }


def benchmark(distribution: str, args: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    table, n_u = make_table(distribution, args.users, args.events, args.seed)
    k_max = int(n_u.max())
    percentiles = {f"p{p:g}": int(np.ceil(np.percentile(n_u, p))) for p in PERCENTILES}
    ks = sorted(set(percentiles.values()) | {k_max})
    truth = truths(table)
    stats = {
        "users": args.users,
        "events": int(n_u.sum()),
        "rows_per_user": {"max": k_max, "mean": float(n_u.mean()), **percentiles},
        "top_user_share": float(k_max / n_u.sum()),
        "generation_seconds": round(time.perf_counter() - started, 2),
    }
    results: dict[str, Any] = {}
    for index, (name, kind, query) in enumerate(QUERIES):
        seed = args.seed * 100 + index
        fallback = run_setting(
            name,
            kind,
            query,
            context(args.users, None),
            args.epsilon / k_max,
            table,
            truth[name],
            args.draws,
            seed,
        )
        fallback["epsilon_per_row"] = args.epsilon / k_max
        units: dict[str, Any] = {}
        for k in ks:
            result = run_setting(
                name, kind, query, context(args.users, k), args.epsilon, table, truth[name], args.draws, seed
            )
            result["dropped_rows"] = int(np.maximum(n_u - k, 0).sum())
            units[str(k)] = result
        best_k = min(units, key=lambda k: units[k]["mae"])
        results[name] = {
            "fallback": fallback,
            "units": units,
            "best_k": int(best_k),
            "ratio": fallback["mae"] / units[best_k]["mae"],
        }
    return {"data": stats, "results": results, "total_ceiling": (1 + args.epsilon) / args.epsilon}


def print_table(distribution: str, report: dict[str, Any]) -> None:
    data = report["data"]
    rows = data["rows_per_user"]
    print(
        f"\n{distribution}: {data['events']} events, {data['users']} users; rows per user max {rows['max']} "
        f"(top user {100 * data['top_user_share']:.2f} % of events), mean {rows['mean']:.0f}, "
        + ", ".join(f"{p} {rows[p]}" for p in rows if p.startswith("p"))
    )
    header = f"{'query':14} {'setting':18} {'MAE':>12} {'bias':>12} {'noise':>12} {'dropped':>9}  scale"
    print(header)
    print("-" * len(header))
    for name, result in report["results"].items():
        fb = result["fallback"]
        scales = ", ".join(f"{k}={v:.4g}" for k, v in fb["scales"].items())
        print(
            f"{name:14} {'fallback ε/k_max':18} {fb['mae']:12.5g} {fb['bias']:12.5g} {fb['noise']:12.5g} "
            f"{0:>9}  {scales}"
        )
        for k, unit in result["units"].items():
            mark = " *" if int(k) == result["best_k"] else ""
            scales = ", ".join(f"{key}={v:.4g}" for key, v in unit["scales"].items())
            errors_ = f"{unit['mae']:12.5g} {unit['bias']:12.5g} {unit['noise']:12.5g}"
            print(f"{'':14} {'k=' + k + mark:18} {errors_} {unit['dropped_rows']:>9}  {scales}")
        print(f"{'':14} fallback / best unit MAE = {result['ratio']:.2f}×")
    print(f"(a total count can gain at most (1 + ε)/ε = {report['total_ceiling']:.2f}× from bounding rows)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--users", type=int, default=10_000)
    parser.add_argument("--epsilon", type=float, default=1.0)
    parser.add_argument("--draws", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--distributions", nargs="+", default=["lognormal", "zipf"])
    parser.add_argument(
        "--output", type=Path, default=Path(__file__).parent / "results" / "privacy_units.json"
    )
    args = parser.parse_args()
    started = time.perf_counter()
    out: dict[str, Any] = {
        "settings": {k: v for k, v in vars(args).items() if k != "output"},
        "machine": {
            "python": platform.python_version(),
            "processor": platform.processor() or platform.machine(),
        },
        "distributions": {},
    }
    for distribution in args.distributions:
        report = benchmark(distribution, args)
        out["distributions"][distribution] = report
        print_table(distribution, report)
    out["seconds"] = round(time.perf_counter() - started, 1)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(out, indent=2) + "\n")
    print(f"\nwrote {args.output} ({out['seconds']} s)")


if __name__ == "__main__":
    main()
