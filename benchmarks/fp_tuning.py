"""Wall time of ``tuning.select`` before/after the exact samplers (issue: floating-point-safe noise).

A small fixed configuration, run in either tree (the script detects the old ``rng`` API or the new
``noise`` API): output-perturbation logistic regression on 4 000 synthetic rows (3 features + intercept),
9 ε values × 2 λ × 3 repeats = 54 candidates, ε′ = 0.05, in pure mode (geometric latent) and in rdp mode
(exponential latent); plus the latent + keep-mask draw alone for a 1 000-entry list. Each timing is the
median of ``--repeats`` runs (after one warm-up), wall clock and CPU time of the process (the CPU time is
the fairer number on a shared machine). Results are merged into ``--output`` under ``--label``; run
``before`` and ``after`` alternately (``--label before_1``, ``after_1``, …) when the machine is busy.

Usage (from the repository root of either tree)::

    PYTHONPATH=. .venv/bin/python benchmarks/fp_tuning.py --label before --output /path/fp_tuning.json
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

for _name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_name, "1")

import numpy as np  # noqa: E402

sys.path.insert(0, os.getcwd())

from mechanisms.accounting import DEFAULT_ORDERS  # noqa: E402
from mechanisms.base import PublicContext  # noqa: E402

try:  # the layout since the architecture issue
    from mechanisms.data.schema import DatasetSchema
    from mechanisms.tuning.params import TuningParams
    from mechanisms.tuning.select import TuningSelect, sample_kept
except ModuleNotFoundError:  # the float tree (flat mechanisms/ modules)
    from mechanisms.schema import DatasetSchema  # type: ignore[no-redef]

    from mechanisms.tuning import TuningParams, TuningSelect, sample_kept  # type: ignore[no-redef]

ROWS = 4_000


def _data() -> tuple[dict[str, np.ndarray], PublicContext]:
    rng = np.random.default_rng(7)  # test DATA only
    a, b, c = rng.uniform(-1, 1, ROWS), rng.uniform(-1, 1, ROWS), rng.uniform(-1, 1, ROWS)
    y = (rng.uniform(size=ROWS) < 1 / (1 + np.exp(-3 * a + 2 * b - c))).astype(float)
    schema = DatasetSchema.model_validate(
        {
            "columns": [{"name": n, "type": "float", "min": -1, "max": 1} for n in ("a", "b", "c")]
            + [{"name": "y", "type": "float", "min": 0, "max": 1}],
            "neighboring": "replace_one",
        }
    )
    return {"a": a, "b": b, "c": c, "y": y}, PublicContext(schema, ROWS, DEFAULT_ORDERS)


def _params(mode: str) -> TuningParams:
    return TuningParams.model_validate(
        {
            "learner": "output_perturbation.logistic",
            "features": {"features": ["a", "b", "c"], "label": "y"},
            "epsilons": [0.05, 0.07, 0.1, 0.14, 0.2, 0.28, 0.4, 0.57, 0.8],
            "regularization": [0.01, 0.1],
            "repeats": 3,
            "epsilon_prime": 0.05,
            "utility_bar": 0.7,
            "pass_margin": 2.0,
            "mode": mode,
        }
    )


def _randomness(seed: int) -> Any:
    """The old API takes a numpy Generator, the new one a ``Noise`` (seeded: benchmark only)."""
    names = list(inspect.signature(TuningSelect.run).parameters)
    if "noise" in names:
        from mechanisms.noise import Noise

        return Noise.seeded(seed)
    return np.random.default_rng(seed)


def _median_seconds(action: Any, repeats: int) -> tuple[float, float, list[float]]:
    """(median wall seconds, median CPU seconds of this process, all wall times), after one warm-up."""
    action()
    wall, cpu = [], []
    for _ in range(repeats):
        started, started_cpu = time.perf_counter(), time.process_time()
        action()
        wall.append(time.perf_counter() - started)
        cpu.append(time.process_time() - started_cpu)
    return statistics.median(wall), statistics.median(cpu), wall


def _merge_efficiency(before_path: Path, after_path: Path, output: Path) -> int:
    """The privacy-efficiency numbers of benchmarks/tuning.py before and after, and their ratios."""
    summary: dict[str, Any] = {}
    for label, path in (("before", before_path), ("after", after_path)):
        data = json.loads(path.read_text())
        choice = data["choose_epsilon"]
        summary[label] = {
            "seconds_wall": data["seconds"],
            "mean_charged_epsilon": choice["mean_charged_epsilon"],
            "ratio_alg3_over_doubling_tuned": choice["ratio_alg3_over_doubling_tuned"],
            "ratio_alg3_over_doubling_best_lambda": choice["ratio_alg3_over_doubling_best_lambda"],
            "analytics_alg3_answers": [row["alg3"]["answers_mean"] for row in data["analytics"]],
            "analytics_doubling_answers": [row["doubling"]["answers_mean"] for row in data["analytics"]],
        }
    summary["change_of_ratio_alg3_over_doubling_tuned"] = (
        summary["after"]["ratio_alg3_over_doubling_tuned"]
        / summary["before"]["ratio_alg3_over_doubling_tuned"]
    )
    report: dict[str, Any] = json.loads(output.read_text()) if output.exists() else {}
    report["privacy_efficiency"] = summary
    output.write_text(json.dumps(report, indent=2))
    print(json.dumps(summary, indent=2))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--label", required=True, help="key for the results (before/after)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument(
        "--efficiency",
        nargs=2,
        type=Path,
        metavar=("BEFORE_JSON", "AFTER_JSON"),
        help="instead of timing: merge the privacy-efficiency summary of two benchmarks/tuning.py outputs",
    )
    parser.add_argument(
        "--after-rounds", nargs="*", metavar="LABEL", help="the after rounds the ratio uses (default: all)"
    )
    args = parser.parse_args()
    if args.efficiency:
        return _merge_efficiency(args.efficiency[0], args.efficiency[1], args.output)
    table, ctx = _data()
    mechanism = TuningSelect()
    results: dict[str, Any] = {"rows": ROWS, "candidates": 54, "repeats": args.repeats}
    for mode in ("pure", "rdp"):
        params, source = _params(mode), _randomness(11)

        def select(params: TuningParams = params, source: Any = source) -> Any:
            return mechanism.run(params, ctx, table, source)

        median, cpu, times = _median_seconds(select, args.repeats)
        results[f"select_{mode}_seconds"] = median
        results[f"select_{mode}_cpu_seconds"] = cpu
        results[f"select_{mode}_all"] = times
    drops = np.repeat([0.05, 0.1, 0.2, 0.4, 0.8], 200)
    for latent in ("geometric", "exponential"):
        source = _randomness(12)

        def keep(latent: Any = latent, source: Any = source) -> Any:
            return sample_kept(drops, latent, 0.05, source)

        median, cpu, _times = _median_seconds(keep, args.repeats)
        results[f"sample_kept_{latent}_1000_seconds"] = median
        results[f"sample_kept_{latent}_1000_cpu_seconds"] = cpu
    report: dict[str, Any] = json.loads(args.output.read_text()) if args.output.exists() else {}
    report[args.label] = results
    rounds = {
        side: [k for k, v in report.items() if k.startswith(f"{side}_") and isinstance(v, dict)]
        for side in ("before", "after")
    }
    if args.after_rounds:  # e.g. only the rounds of the current code
        rounds["after"] = [k for k in rounds["after"] if k in args.after_rounds]
    befores = [report[k] for k in rounds["before"]]
    afters = [report[k] for k in rounds["after"]]
    if befores and afters:
        report["ratio_rounds"] = rounds
        keys = [k for k in afters[0] if k.endswith("_seconds") and k in befores[0]]
        report["median_over_rounds"] = {
            side: {k: statistics.median(r[k] for r in rounds) for k in keys}
            for side, rounds in (("before", befores), ("after", afters))
        }
        med = report["median_over_rounds"]
        report["ratio_after_over_before"] = {
            k: med["after"][k] / med["before"][k] for k in keys if med["before"][k] > 0
        }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2))
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
