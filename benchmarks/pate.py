"""PATE with generalized PTR (``pate.labels``) against PATE's data-independent analysis: Fig 3.2's shape.

Fig 3.2 of Redberg's thesis (2023, ch. 3; Redberg, Zhu & Wang 2023 §3.6.2): MNIST, the training set split
into 400 teachers, T = 200 unlabelled test points labelled by GNMax, δ = 10⁻⁵, in a *high-consensus* and a
*low-consensus* selection of queries; y-axis the privacy cost of the 200 labels against the noise σ₁ for
(i) the data-independent Gaussian analysis, (ii) the (non-private) data-dependent analysis of Papernot et
al. 2018 and (iii) PATE-PTR (the smallest ε̂ + ε′ at which Alg 6 releases). The figure is an image: the
thesis prints no numbers for it, and the selection rule of the two query sets is in an appendix missing from
the text.

This is a **synthetic twin** (no MNIST here): 10 classes, d = 10, class means ~ N(0, 0.8²·I), x = mean +
N(0, I) clipped to the declared [−6, 6]; 40 000 private rows (100 per teacher, MNIST has 150) and a public
pool of 1 000 points with known true labels; 400 ``centroid`` teachers (plurality accuracy 0.76 on the
pool). Queries (a non-private choice for illustration, as in the thesis): *high consensus* = 200 random pool
points whose top class has ≥ 90 % of the votes; *low consensus* = 200 with 30–60 %. Add/remove neighbours
(m = 1).

Two tables, both from the mechanism's own functions (``votes`` as in ``run``, then ``gen_ptr_labels``,
the function ``run`` calls, with ``Noise.seeded``; one end-to-end ``PATE_LABELS.run`` per setting checks the
path):

1. **cost against σ** (the thesis's axes): data-independent ε of 200 answers (RDP 200·α/σ² converted at δ,
   Mironov Prop. 3 on the 96-order grid); data-dependent ε at X (not private: ``dependent_epsilon`` with
   shift 0 at δ); PATE + Gen-PTR: the smallest total ε = ε̂ + ε_m at which the test passes with probability
   ≥ ½ (h(X) ≥ K ⟺ F(X, K − 1) ≤ ε_m), with the thesis's test budget ε̂ = 0.5817 (its σ_s = 15) and
   δ′ = δ_m = δ/2; and the label accuracy of GNMax at that σ (mean of 10 draws).
2. **label accuracy against ε**: data-independent GNMax with the smallest σ whose data-independent ε ≤ ε;
   PATE + Gen-PTR at total ε with σ and the test share chosen per ε from a grid (the best mean accuracy over
   10 draws: a non-private choice, like the thesis's "σ₁ aligned" comparison); ⊥ labels nothing (accuracy 0
   for that draw). Accuracy is against the points' true labels.

Usage: ``.venv/bin/python benchmarks/pate.py [--quick] [--output PATH]``.
"""

from __future__ import annotations

import os

for _name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_name, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402
from datetime import UTC, datetime  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

from mechanisms.base import PublicContext  # noqa: E402
from mechanisms.data.schema import DatasetSchema  # noqa: E402
from mechanisms.noise import Noise  # noqa: E402
from mechanisms.ptr.pate import (  # noqa: E402
    PATE_LABELS,
    PateLabelsParams,
    gen_ptr_labels,
    gnmax,
    pate_plan,
    votes,
)
from mechanisms.ptr.pate_analysis import (  # noqa: E402
    dependent_epsilon,
    envelope,
    independent_epsilon,
    top_two_gaps,
)

ROOT = Path(__file__).resolve().parents[1]
D, C, TEACHERS, QUERIES = 10, 10, 400, 200
N_PRIVATE, N_POOL = 40_000, 1_000
DELTA = 1e-5
THESIS_TEST_EPSILON = 0.5817  # ε̂ of Alg 6 at σ_s = σ₂ = 15, δ = 1e-5 (thesis note §2.7 [NUM])
SIGMAS = (5.0, 10.0, 20.0, 30.0, 40.0, 60.0, 80.0, 100.0, 150.0, 200.0)
EPSILONS = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
TEST_SHARES = (0.1, 0.25, 0.5)
SCHEMA = DatasetSchema.model_validate(
    {
        "columns": [
            *({"name": f"x{j}", "type": "float", "min": -6, "max": 6} for j in range(D)),
            {"name": "y", "type": "categorical", "values": [str(c) for c in range(C)]},
        ],
        "neighboring": "add_remove",
    }
)
CTX = PublicContext(SCHEMA, None, (1.5, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0))


def mixture(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    means = np.random.default_rng(1000).standard_normal((C, D)) * 0.8
    rng = np.random.default_rng(seed)
    y = rng.integers(0, C, n)
    return np.clip(means[y] + rng.standard_normal((n, D)), -6.0, 6.0), y


def params(queries: np.ndarray, sigma: float, epsilon: float, share: float) -> PateLabelsParams:
    return PateLabelsParams.model_validate(
        {
            "features": {"features": [f"x{j}" for j in range(D)], "label": "y"},
            "labels": [str(c) for c in range(C)],
            "teachers": TEACHERS,
            "queries": [[float(v) for v in row] for row in queries],
            "sigma": sigma,
            "epsilon": epsilon,
            "delta": DELTA,
            "test_fraction": share,
        }
    )


def query_sets(table: dict[str, np.ndarray]) -> dict[str, dict[str, np.ndarray]]:
    """Pool votes (one pass of the teachers), then the high- and low-consensus selections."""
    pool, truth = mixture(N_POOL, 2)
    histogram = votes(params(pool, 10.0, 1.0, 0.25), CTX, table)
    top = histogram.max(axis=1)
    rng = np.random.default_rng(3)
    picks = {
        "high": np.flatnonzero(top >= 0.9 * TEACHERS),
        "low": np.flatnonzero((top >= 0.3 * TEACHERS) & (top <= 0.6 * TEACHERS)),
    }
    out: dict[str, dict[str, np.ndarray]] = {}
    for name, candidates in picks.items():
        chosen = rng.choice(candidates, QUERIES, replace=False)
        out[name] = {"points": pool[chosen], "truth": truth[chosen], "votes": histogram[chosen]}
    return out


def gnmax_accuracy(histogram: np.ndarray, truth: np.ndarray, sigma: float, draws: int, seed: int) -> float:
    noise = Noise.seeded(seed)
    hits = [float(np.mean(gnmax(histogram, sigma, noise) == truth)) for _ in range(draws)]
    return float(np.mean(hits))


def ptr_cost(histogram: np.ndarray, sigma: float) -> dict[str, float]:
    """ε̂ + F(X, K − 1): the smallest total ε at which the test passes w.p. ≥ ½ (ε̂ = the thesis's)."""
    plan = pate_plan(params(np.zeros((1, D)), sigma, 2.0 * THESIS_TEST_EPSILON, 0.5), "add_remove")
    table = envelope(TEACHERS, sigma, 1, C)
    gaps = top_two_gaps(histogram)
    eps_m = dependent_epsilon(table, gaps, 2 * plan.pass_units, DELTA / 2)
    return {
        "test_epsilon": plan.budget.test_epsilon,
        "pass_units": plan.pass_units,
        "total": eps_m + THESIS_TEST_EPSILON,
    }


def cost_table(sets: dict[str, dict[str, np.ndarray]], draws: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, data in sets.items():
        gaps = top_two_gaps(data["votes"])
        rows = []
        for sigma in SIGMAS:
            table = envelope(TEACHERS, sigma, 1, C)
            rows.append(
                {
                    "sigma": sigma,
                    "data_independent": independent_epsilon(QUERIES, sigma, 1, DELTA),
                    "data_dependent_nonprivate": dependent_epsilon(table, gaps, 0, DELTA),
                    "pate_ptr": ptr_cost(data["votes"], sigma),
                    "accuracy": gnmax_accuracy(data["votes"], data["truth"], sigma, draws, 7),
                }
            )
        out[name] = {"median_gap": float(np.median(gaps)), "rows": rows}
    return out


def independent_sigma(epsilon: float) -> float:
    """The smallest σ (to 0.1 %) whose data-independent ε of T answers is ≤ ε."""
    low, high = 0.5, 1e4
    while high / low > 1.001:
        mid = math.sqrt(low * high)
        low, high = (low, mid) if independent_epsilon(QUERIES, mid, 1, DELTA) <= epsilon else (mid, high)
    return high


def ptr_accuracy(data: dict[str, np.ndarray], epsilon: float, draws: int) -> dict[str, Any]:
    configs = []
    for sigma in SIGMAS:
        for share in TEST_SHARES:
            try:
                plan = pate_plan(params(data["points"], sigma, epsilon, share), "add_remove")
            except ValueError:
                continue  # K > H: refused by the mechanism
            noise = Noise.seeded(int(sigma * 1000 + share * 100 + epsilon * 10))
            hits, released = [], 0
            for _ in range(draws):
                labels = gen_ptr_labels(plan, data["votes"], noise)
                released += labels is not None
                hits.append(0.0 if labels is None else float(np.mean(labels == data["truth"])))
            charged = (plan.budget.epsilon, plan.budget.delta)
            assert charged[0] <= epsilon * (1 + 1e-12)
            assert charged[1] <= DELTA * (1 + 1e-12)
            configs.append(
                {
                    "sigma": sigma,
                    "test_fraction": share,
                    "accuracy": float(np.mean(hits)),
                    "released": released,
                }
            )
    best = max(configs, key=lambda c: c["accuracy"]) if configs else None
    return {"best": best, "configs": configs}


def accuracy_table(
    sets: dict[str, dict[str, np.ndarray]], epsilons: tuple[float, ...], draws: int
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, data in sets.items():
        rows = []
        for epsilon in epsilons:
            sigma = independent_sigma(epsilon)
            rows.append(
                {
                    "epsilon": epsilon,
                    "data_independent": {
                        "sigma": sigma,
                        "accuracy": gnmax_accuracy(data["votes"], data["truth"], sigma, draws, 11),
                    },
                    "pate_ptr": ptr_accuracy(data, epsilon, draws),
                }
            )
        out[name] = {
            "teacher_plurality_accuracy": float(np.mean(data["votes"].argmax(axis=1) == data["truth"])),
            "rows": rows,
        }
    return out


def end_to_end(table: dict[str, np.ndarray], sets: dict[str, dict[str, np.ndarray]]) -> dict[str, Any]:
    """One ``PATE_LABELS.run`` per setting at σ = 20, ε = 2, share 0.25 (the full path: teachers included)."""
    out = {}
    for name, data in sets.items():
        p = params(data["points"], 20.0, 2.0, 0.25)
        PATE_LABELS.check(p, CTX)
        release = PATE_LABELS.run(p, CTX, table, Noise.seeded(5))
        labels = release.output["labels"]
        accuracy = None if labels is None else float(np.mean(np.asarray(labels, dtype=int) == data["truth"]))
        out[name] = {"released": release.output["released"], "accuracy": accuracy}
    return out


def print_tables(costs: dict[str, Any], accuracy: dict[str, Any]) -> None:
    for name, block in costs.items():
        print(f"\ncost against σ, {name} consensus (median gap {block['median_gap']:.0f})")
        print("σ | data-independent | data-dependent (non-private) | PATE+Gen-PTR | GNMax accuracy")
        for r in block["rows"]:
            print(
                f"{r['sigma']:g} | {r['data_independent']:.3f} | {r['data_dependent_nonprivate']:.3g} | "
                f"{r['pate_ptr']['total']:.3f} | {r['accuracy']:.3f}"
            )
    for name, block in accuracy.items():
        print(
            f"\nlabel accuracy against ε, {name} consensus "
            f"(teacher plurality {block['teacher_plurality_accuracy']:.3f})"
        )
        print("ε | data-independent (σ) | PATE+Gen-PTR (σ, share, released/draws)")
        for r in block["rows"]:
            di, best = r["data_independent"], r["pate_ptr"]["best"]
            ptr = (
                "refused"
                if best is None
                else (
                    f"{best['accuracy']:.3f} "
                    f"({best['sigma']:g}, {best['test_fraction']:g}, {best['released']})"
                )
            )
            print(f"{r['epsilon']:g} | {di['accuracy']:.3f} ({di['sigma']:.1f}) | {ptr}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="two ε, three draws")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    draws = 3 if args.quick else 10
    epsilons = (0.5, 2.0) if args.quick else EPSILONS
    output = args.output or ROOT / "benchmarks" / "results" / (
        "pate_quick.json" if args.quick else "pate.json"
    )
    started = time.monotonic()
    x, y = mixture(N_PRIVATE, 1)
    table = {**{f"x{j}": x[:, j] for j in range(D)}, "y": y}
    sets = query_sets(table)
    costs = cost_table(sets, draws)
    accuracy = accuracy_table(sets, epsilons, draws)
    checked = end_to_end(table, sets)
    print_tables(costs, accuracy)
    print(f"\nend to end (σ = 20, ε = 2): {checked}")
    payload = {
        "benchmark": "pate",
        "created": datetime.now(UTC).isoformat(),
        "quick": args.quick,
        "draws": draws,
        "delta": DELTA,
        "data": {
            "kind": "synthetic twin of Fig 3.2 (MNIST in the thesis)",
            "classes": C,
            "d": D,
            "teachers": TEACHERS,
            "private_rows": N_PRIVATE,
            "pool": N_POOL,
            "queries": QUERIES,
            "teacher": "centroid",
        },
        "thesis_points": "none printed: Fig 3.2 is an image without values; its y-axis is privacy cost",
        "thesis_test_epsilon": THESIS_TEST_EPSILON,
        "cost_against_sigma": costs,
        "accuracy_against_epsilon": accuracy,
        "end_to_end": checked,
        "python": platform.python_version(),
        "seconds": round(time.monotonic() - started, 1),
        "cpu_seconds": round(time.process_time(), 1),
        "load_average_at_end": list(os.getloadavg()),
    }
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(payload, indent=2))
    print(f"\n{payload['seconds']} s; wrote {output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
