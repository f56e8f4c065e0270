"""Wall time of ``dp_gd`` before/after the floating-point-safe noise
(docs/privacy/finite_precision.md#finite-precision).

"Before" is the unchanged original code checked out at /tmp/before (float Gaussian noise from numpy's PCG64,
float clipped sum), run in a subprocess; "after" is this tree (exact integer clipped sum on the term grid,
exact discrete Gaussian from the OS CSPRNG, all T·d draws in one vectorised call). Same data, same
configuration, median of ``--repeats`` interleaved runs each (the machine may be shared).
Writes benchmarks/results/fp_learners.json.

    .venv/bin/python benchmarks/fp_learners.py [--before /tmp/before] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

SETTINGS = [
    {"n": 2_000, "d": 10, "steps": 5_000, "loss": "logistic"},
    {"n": 20_000, "d": 22, "steps": 2_000, "loss": "logistic"},
    {"n": 141_691, "d": 22, "steps": 2_000, "loss": "squared"},  # --full only (minutes per run)
]

_RUNNER = r"""
import json, sys, time
import numpy as np
sys.path.insert(0, sys.argv[1])
from mechanisms.learners.dp_gd import DpGdConfig, dp_gd_train, default_radius
setting = json.loads(sys.argv[2]); mode = sys.argv[3]; repeats = int(sys.argv[4])
n, d, steps, loss = setting["n"], setting["d"], setting["steps"], setting["loss"]
data = np.random.default_rng(0)
x = data.normal(size=(n, d)); x /= np.maximum(1.0, np.linalg.norm(x, axis=1))[:, None]
score = x @ data.normal(size=d)
y = np.where(score > 0, 1.0, -1.0) if loss == "logistic" else np.clip(score, -1.0, 1.0)
reg = 0.01
config = DpGdConfig(loss, reg, steps, 0.5, 1.0, 1.0, radius=default_radius(loss, reg, 1.0, 1.0))
times = []
for repeat in range(repeats):
    if mode == "before":
        source = np.random.default_rng(repeat)
    else:
        from mechanisms.noise import Noise
        source = Noise.system()
    start = time.perf_counter()
    theta = dp_gd_train(config, x, y, float(n), source)
    times.append(time.perf_counter() - start)
print(json.dumps({"seconds": sorted(times)[len(times) // 2], "all": times}))
"""


def _run(tree: str, setting: dict[str, Any], mode: str, repeats: int) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-c", _RUNNER, tree, json.dumps(setting), mode, str(repeats)],
        cwd=tree,
        capture_output=True,
        text=True,
        check=True,
    )
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def erm_comparison(rgm: tuple[str, str] | None, objpert: tuple[str, str] | None) -> dict[str, Any]:
    """Before/after summaries of benchmarks/rgm_gd.py and benchmarks/objpert.py JSON outputs (run separately,
    "before" from /tmp/before): charges (ε at δ, calibrated λ) and utility (excess risk, accuracy)."""
    out: dict[str, Any] = {}
    if rgm is not None:
        before, after = (json.loads(Path(path).read_text()) for path in rgm)
        rows = []
        for level, data in before["levels"].items():
            for method, old in data["methods"].items():
                new = after["levels"][level]["methods"][method]
                rows.append(
                    {
                        "level": level,
                        "method": method,
                        "epsilon_before": old.get("epsilon_at_1e-6"),
                        "epsilon_after": new.get("epsilon_at_1e-6"),
                        "gamma_before": old.get("gamma"),
                        "gamma_after": new.get("gamma"),
                        "final_excess_before": old["final_mean"],
                        "final_excess_after": new["final_mean"],
                        "best_excess_before": old["best_mean_over_steps"],
                        "best_excess_after": new["best_mean_over_steps"],
                    }
                )
        out["rgm_gd"] = {
            "rows": rows,
            "wall_before": before["wall_time_seconds"]["median"],
            "wall_after": after["wall_time_seconds"]["median"],
        }
    if objpert is not None:
        before, after = (json.loads(Path(path).read_text()) for path in objpert)
        rows = []
        for name, data in before["results"].items():
            for old, new in zip(data["rows"], after["results"][name]["rows"], strict=True):
                rows.append(
                    {
                        "dataset": name,
                        "epsilon": old["epsilon"],
                        "lambda_before": old["objpert_lambda"],
                        "lambda_after": new["objpert_lambda"],
                        **{f"{m}_before": old[m]["mean"] for m in ("objpert", "outpert", "dp-gd")},
                        **{f"{m}_after": new[m]["mean"] for m in ("objpert", "outpert", "dp-gd")},
                        **{f"{m}_se_after": new[m]["se"] for m in ("objpert", "outpert", "dp-gd")},
                    }
                )
        out["objpert"] = {"rows": rows}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--before", default="/tmp/before")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", default=str(ROOT / "benchmarks" / "results" / "fp_learners.json"))
    parser.add_argument("--quick", action="store_true", help="only the first setting")
    parser.add_argument("--full", action="store_true", help="also the 141 691-row setting")
    parser.add_argument("--rgm", nargs=2, metavar=("BEFORE", "AFTER"), help="rgm_gd.py outputs to compare")
    parser.add_argument("--objpert", nargs=2, metavar=("BEFORE", "AFTER"), help="objpert.py outputs")
    parser.add_argument("--skip-timing", action="store_true", help="only the ERM comparison")
    args = parser.parse_args(argv)
    rows = []
    chosen = SETTINGS[:1] if args.quick else SETTINGS if args.full else SETTINGS[:2]
    for setting in [] if args.skip_timing else chosen:
        # interleaved single runs, so both see the same machine load; medians
        befores: list[float] = []
        afters: list[float] = []
        for _ in range(args.repeats):
            befores.append(_run(args.before, setting, "before", 1)["seconds"])
            afters.append(_run(str(ROOT), setting, "after", 1)["seconds"])
        before_s = sorted(befores)[len(befores) // 2]
        after_s = sorted(afters)[len(afters) // 2]
        ratio = after_s / before_s
        rows.append(
            {
                **setting,
                "before_s": before_s,
                "after_s": after_s,
                "ratio": ratio,
                "before_all": befores,
                "after_all": afters,
            }
        )
        print(
            f"dp_gd n={setting['n']} d={setting['d']} T={setting['steps']} {setting['loss']}: "
            f"before {before_s:.3f} s, after {after_s:.3f} s, ratio {ratio:.3f}"
        )
    payload = {
        "benchmark": "dp_gd wall time before/after exact grid noise",
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "target_ratio": 1.2,
        "results": rows,
        "erm": erm_comparison(args.rgm, args.objpert),
    }
    Path(args.output).write_text(json.dumps(payload, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
