"""Accuracy-first counts through the real service: the setting of Table 1 of Ghazi et al. (pure DP).

Task (Ghazi et al. §6.1; notes/seed_003_expost_tuning.md §5.1): synthetic S_N, N samples from a power law
p(x) ∝ x^−0.75 on the 300 threads {1, …, 300}; estimate each thread's count within 10% relative error, for
as many threads as possible under a pure budget ε = 10. A thread's estimate is accepted iff ŷ > 0 and the
Laplace scale b = 1/ε ≤ ŷ/21 (their check with the ŷ > 0 fix). Metrics: "produced answers" (threads
answered before the budget runs out) and "precision" (fraction of answers with |ŷ − c|/c < 0.1), mean ± std
over the runs.

Through the real service: a uvicorn server in this process (the real FastAPI app, SQLite file database,
migrations, API keys, the ledger), one dataset per run with a pure budget (ε = 10, δ = 0). For each thread in
index order (public, data-independent; ≈ decreasing count), the client posts an ``accuracy_first.laplace``
count request (where thread = x) with target ``{"relative": 0.1}`` (the released, free check) over the
grid ε = 0.001·√2^i, truncated to the levels whose top fits in the remaining budget (public: the sum of the
published realized charges). The service walks the grid (Laplace noise reduction, Ligett et al.) and returns
the first release that passes, charged only that level's ε. The run stops at the first refusal (409) or when
not even ε = 0.001 fits. Answers that did not reach the target are charged but not counted.

Oracle ceiling: pay exactly 21/c per thread (c the true count), threads in decreasing true count order.

    .venv/bin/python benchmarks/accuracy_first_counts.py [--runs 20] [--quick]
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import platform
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from service.auth import Role, create_key  # noqa: E402
from service.config import Settings  # noqa: E402
from service.embedded import serve_in_thread  # noqa: E402
from service.store.engine import make_engine, make_sessionmaker  # noqa: E402
from service.store.migrate import upgrade  # noqa: E402

DEFAULT_OUTPUT = ROOT / "benchmarks" / "results" / "accuracy_first_counts.json"
SIZES = (8000, 16000, 32000, 64000, 128000)
THREADS = 300
ANALYST = "bench-analyst"
EXPONENT = -0.75
BUDGET = 10.0
EPS_BASE = 0.001
RELATIVE = 0.1
ACCEPT_FACTOR = 21.0  # b ≤ ŷ/21 ⟺ (ŷ+b)/(ŷ−b) ≤ 1.1
SCHEMA = {
    "columns": [{"name": "thread", "type": "int", "min": 1, "max": THREADS}],
    "neighboring": "add_remove",
}
# Ghazi et al. Table 1 (mean ± std): precision and produced answers per method.
PAPER = {
    8000: {"doubling": (0.911, 14.77), "noise_reduction": (0.999, 2.22), "alg3_laplace": (0.912, 20.37)},
    16000: {"doubling": (0.912, 22.47), "noise_reduction": (0.999, 4.47), "alg3_laplace": (0.911, 30.63)},
    32000: {"doubling": (0.910, 33.96), "noise_reduction": (0.998, 8.12), "alg3_laplace": (0.905, 45.74)},
    64000: {"doubling": (0.909, 50.90), "noise_reduction": (0.998, 15.14), "alg3_laplace": (0.911, 68.39)},
    128000: {"doubling": (0.909, 76.09), "noise_reduction": (0.997, 27.68), "alg3_laplace": (0.912, 102.1)},
}
TARGET_FACTOR = 1.4
TARGET_PRECISION = 0.9


@contextmanager
def _server(workdir: Path) -> Iterator[tuple[str, str, str]]:
    """(base_url, admin key, analyst key) of a fresh server on a fresh SQLite database."""
    url = f"sqlite:///{workdir / 'expost.db'}"
    upgrade(url)
    engine = make_engine(url)
    with make_sessionmaker(engine)() as session, session.begin():
        admin_key = create_key(session, "bench-admin", Role.admin)
        analyst_key = create_key(session, ANALYST, Role.analyst)
    engine.dispose()
    settings = Settings.model_validate(
        {
            "database_url": url,
            "data_dir": workdir / "data",
            "wait_seconds": 60,
            "rate_limit": "",
            "log_level": "WARNING",
        }
    )
    with serve_in_thread(settings, start_timeout=30.0) as base_url:
        yield base_url, admin_key, analyst_key


def synthetic_counts(n: int, rng: np.random.Generator) -> np.ndarray:
    """Thread of each of the n samples: p(x) ∝ x^−0.75 on {1..300}."""
    x = np.arange(1, THREADS + 1)
    p = x**EXPONENT
    samples: np.ndarray = rng.choice(x, size=n, p=p / p.sum())
    return samples


def grid_for(remaining: float) -> list[float]:
    """0.001·√2^i for i = 0.. while the level fits in the remaining budget (with a tiny safety margin)."""
    top = math.floor(2 * math.log2(remaining * (1 - 1e-9) / EPS_BASE)) if remaining > EPS_BASE else -1
    return [EPS_BASE * 2 ** (i / 2) for i in range(min(top, 60) + 1)]


def oracle_answers(counts: np.ndarray) -> int:
    """Threads answerable when each costs exactly 21/c, cheapest (largest c) first."""
    cost = np.cumsum(ACCEPT_FACTOR / np.sort(counts[counts > 0])[::-1])
    return int(np.count_nonzero(cost <= BUDGET))


def one_run(admin: httpx.Client, client: httpx.Client, n: int, seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    samples = synthetic_counts(n, rng)
    counts = np.bincount(samples, minlength=THREADS + 1)[1:]
    csv = ("thread\n" + "\n".join(map(str, samples)) + "\n").encode()
    created = admin.post(
        "/v1/datasets",
        files={"file": ("s.csv", csv, "text/csv")},
        data={"schema": json.dumps(SCHEMA), "name": f"S{n}-{seed}"},
    )
    created.raise_for_status()
    dataset = created.json()["id"]
    admin.put(f"/v1/datasets/{dataset}/budget", json={"epsilon": BUDGET, "delta": 0.0}).raise_for_status()
    admin.post(f"/v1/datasets/{dataset}/grants", json={"analyst": ANALYST}).raise_for_status()
    spent = 0.0
    answers = correct = requests = 0
    for thread in range(1, THREADS + 1):
        grid = grid_for(BUDGET - spent)
        if not grid:
            break
        params = {
            "query": {"kind": "count", "where": [{"column": "thread", "op": "eq", "value": thread}]},
            "epsilons": grid,
            "target": {"relative": RELATIVE},
        }
        response = client.post(
            f"/v1/datasets/{dataset}/requests", json={"mechanism": "accuracy_first.laplace", "params": params}
        )
        requests += 1
        if response.status_code == 409:
            break
        response.raise_for_status()
        body = response.json()
        if body["state"] != "committed":
            raise RuntimeError(f"request not committed: {body}")
        spent += float(body["realized"]["pure"])
        release = body["release"]
        if release["reached"]:
            answers += 1
            truth = counts[thread - 1]
            correct += int(truth > 0 and abs(release["value"] - truth) / truth < RELATIVE)
    budget = admin.get(f"/v1/datasets/{dataset}/budget").json()
    return {
        "answers": answers,
        "precision": correct / answers if answers else math.nan,
        "requests": requests,
        "spent_client": spent,
        "budget": budget,
        "oracle": oracle_answers(counts),
    }


def main() -> int:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    parser.add_argument("--quick", action="store_true", help="2 runs of S8000 (smoke test; no target gate)")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = parser.parse_args()
    runs, sizes = (2, [8000]) if args.quick else (args.runs, args.sizes)
    started = time.monotonic()
    results: dict[str, Any] = {}
    targets_met = True
    consistent = True
    logging.getLogger("httpx").setLevel(logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp, _server(Path(tmp)) as (base_url, admin_key, analyst_key):
        admin = httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {admin_key}"}, timeout=120)
        client = httpx.Client(
            base_url=base_url, headers={"Authorization": f"Bearer {analyst_key}"}, timeout=120
        )
        header = f"{'N':>7} {'answers':>15} {'precision':>15} {'oracle':>8} {'paper Alg3':>11} {'ratio':>6}"
        print(header)
        for n in sizes:
            per_run = [one_run(admin, client, n, seed=1000 * n + r) for r in range(runs)]
            answers = np.array([r["answers"] for r in per_run], dtype=float)
            precision = np.array([r["precision"] for r in per_run], dtype=float)
            oracle = np.array([r["oracle"] for r in per_run], dtype=float)
            paper = PAPER.get(n)
            ratio = float(answers.mean() / paper["alg3_laplace"][1]) if paper else math.nan
            meets = bool(ratio >= TARGET_FACTOR and np.nanmean(precision) >= TARGET_PRECISION)
            targets_met &= meets or paper is None
            for r in per_run:  # the ledger's pure spend must match the sum of the published charges
                r["ledger_pure_spent"] = float(r["budget"]["pure"]["spent"])
                tolerance = 1e-9 * max(1.0, r["spent_client"])
                consistent &= abs(r["ledger_pure_spent"] - r["spent_client"]) < tolerance
                consistent &= r["ledger_pure_spent"] <= BUDGET
                r["budget"] = {k: v for k, v in r["budget"].items() if k != "orders"}
            results[str(n)] = {
                "runs": runs,
                "answers_mean": float(answers.mean()),
                "answers_std": float(answers.std(ddof=1)) if runs > 1 else 0.0,
                "precision_mean": float(np.nanmean(precision)),
                "precision_std": float(np.nanstd(precision, ddof=1)) if runs > 1 else 0.0,
                "oracle_mean": float(oracle.mean()),
                "requests_mean": float(np.mean([r["requests"] for r in per_run])),
                "paper": {k: {"precision": v[0], "answers": v[1]} for k, v in (paper or {}).items()},
                "ratio_to_paper_alg3": ratio,
                "meets_target": meets,
                "per_run": per_run,
            }
            print(
                f"{n:>7} {answers.mean():>8.2f} ± {answers.std(ddof=1) if runs > 1 else 0:>4.2f} "
                f"{np.nanmean(precision):>8.3f} ± {np.nanstd(precision, ddof=1) if runs > 1 else 0:>4.3f} "
                f"{oracle.mean():>8.1f} {paper['alg3_laplace'][1] if paper else math.nan:>11.2f} "
                f"{ratio:>6.2f}",
                flush=True,
            )
        client.close()
        admin.close()
    output = {
        "benchmark": "accuracy_first_counts",
        "created_at": datetime.now(UTC).isoformat(),
        "setting": {
            "threads": THREADS,
            "density_exponent": EXPONENT,
            "budget_pure_epsilon": BUDGET,
            "grid": "0.001·√2^i truncated to the remaining budget",
            "accept": "ŷ > 0 and b ≤ ŷ/21 (released check, free)",
            "mechanism": "accuracy_first.laplace through the HTTP service (SQLite)",
            "target": f"≥ {TARGET_FACTOR}× the paper's Alg. 3 column at precision ≥ {TARGET_PRECISION}",
        },
        "quick": args.quick,
        "seconds": time.monotonic() - started,
        "machine": {"python": platform.python_version(), "platform": platform.platform()},
        "results": results,
        "all_targets_met": targets_met,
        "ledger_consistent": consistent,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(output, indent=2, default=float))
    print(
        f"wrote {args.output} in {output['seconds']:.1f} s; all targets met: {targets_met}; "
        f"ledger = sum of published charges: {consistent}"
    )
    return 0 if consistent and (targets_met or args.quick) else 1


if __name__ == "__main__":
    raise SystemExit(main())
