"""Why is ``objpert.logistic`` below the thesis at ε = 0.1? Measurements (issue 19 item 5).

``benchmarks/objpert.py`` measures 0.855 test accuracy on Synthetic-L at ε = 0.1 (δ = 1e-5) against 0.9005 for
Alg 7 in Redberg's thesis (Table 4.1). The technical note on the thesis (seed_000 §3.6) lists the suspects:
the β convention (β = R²/4 = 0.5 with the bias coordinate, forcing λ ≈ 25), the σ_G convention (analytic vs
RDP-calibrated Gaussian, ×1.3), a lower non-private ceiling, and the thesis's protocol ("test accuracy of the
best learning rate" over a grid of s = 10 runs; if every run draws its own noise, that is a selection on the
test set). Each suspect is measured here on the same data and split as ``benchmarks/objpert.py``, with the
same learner (``train_objpert_logistic``: AMP, exact samplers), many trials:

* ``ours``: the benchmark's former calibration (σ = 1.3·σ_G, σ_G RDP-calibrated with the tight conversion;
  the smallest λ > β = 0.5 whose curve converts to ≤ ε); ``benchmarks/objpert.py`` now uses
  ``analytic_sigma`` below;
* ``beta_quarter``: the same but λ calibrated as if β = 1/4 (under-charges with a bias coordinate: a
  measurement of the convention, not an admissible setting);
* ``analytic_sigma``: σ = 1.3·σ_G with σ_G the analytic Gaussian (Balle & Wang) at (ε, δ), λ recalibrated;
* ``lambda_sweep`` / ``sigma_sweep``: accuracy at fixed (σ, λ) off the calibration (not private at the
  stated ε; they show which knob the accuracy follows);
* ``ceiling``: the non-private fit at λ = 1e-3 and at the calibrated λ, and without our per-column
  standardisation (rows only normalised, as the thesis describes);
* ``frontier`` (``--frontier``): σ = f·σ_G (analytic) for f ∈ {1.15 … 2}, λ calibrated, every point at the
  target (ε, δ);
* ``best_of_10``: for each trial, 10 independent ObjPert runs and the one with the best *test* accuracy
  (what "best learning rate" amounts to when every run redraws the noise; the thesis's own caveat);
  ``best_of_10_analytic`` (``--selection``): the same at the analytic-σ_G calibration.

The ``--frontier`` and ``--selection`` parts merge into an existing output file.

    .venv/bin/python benchmarks/objpert_gap.py [--trials 40] [--output PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.objpert import (  # noqa: E402
    DELTA,
    F_SIGMA,
    ORDERS,
    TAU,
    R,
    _accuracy,
    _bisect,
    _converted,
    _datasets,
    _prepare,
    analytic_gaussian_sigma,
    gaussian_sigma,
)
from mechanisms.accounting import RdpCurve  # noqa: E402
from mechanisms.learners.objective_perturbation import (  # noqa: E402
    ObjPertConfig,
    amp_grid_rdp,
    minimum_tolerance,
    objpert_rdp,
    solve_to_tolerance,
    train_objpert_logistic,
)
from mechanisms.noise import Noise  # noqa: E402

EPS = 0.1
THESIS = 0.9005


def calibrated_lambda(sigma: float, beta: float) -> float:
    """Smallest λ > β with the ObjPert (+AMP) curve, computed with this β, converting to ≤ ε."""

    def ok(lam: float) -> bool:
        values = objpert_rdp(ORDERS, sigma, beta, lam, R) + amp_grid_rdp(
            ORDERS, TAU, lam, sigma, 1000 * TAU / lam
        )
        return _converted(RdpCurve(ORDERS, tuple(float(v) for v in values))) <= EPS

    if not ok(1e7):
        return math.inf  # infeasible: even λ → ∞ leaves the curve above ε (σ too close to the Gaussian's)
    return _bisect(ok, beta * (1 + 1e-9), 1e7, increasing_ok=True)


def _accuracies(
    xtr: np.ndarray,
    ytr: np.ndarray,
    xte: np.ndarray,
    yte: np.ndarray,
    sigma: float,
    lam: float,
    trials: int,
    seed: int,
    best_of: int = 1,
) -> dict[str, Any]:
    # τ no smaller than the public float-rounding floor the service enforces (as benchmarks/objpert.py)
    tau = max(TAU, minimum_tolerance(lam, sigma, R, xtr.shape[1], xtr.shape[0]))
    config = ObjPertConfig(lam=lam, sigma=sigma, tau=tau, row_norm=R, max_rows=xtr.shape[0])
    values = []
    for trial in range(trials):
        runs = []
        for k in range(best_of):
            noise = Noise.seeded(seed + 1000 * trial + k)
            theta, _ = train_objpert_logistic(xtr, ytr, config, noise, ORDERS)
            runs.append(_accuracy(theta, xte, yte))
        values.append(max(runs))
    return {
        "sigma": sigma,
        "lambda": lam,
        "mean": float(np.mean(values)),
        "se": float(np.std(values, ddof=1) / math.sqrt(len(values))),
        "trials": trials,
        "best_of": best_of,
    }


def run(trials: int) -> dict[str, Any]:
    features, labels = _datasets(False)["synthetic-L"]
    xtr, ytr, xte, yte = _prepare(features, labels, seed=0)
    out: dict[str, Any] = {
        "n_train": int(xtr.shape[0]),
        "d": int(xtr.shape[1]),
        "epsilon": EPS,
        "delta": DELTA,
    }
    sigma_rdp = F_SIGMA * gaussian_sigma(EPS, R)
    sigma_an = F_SIGMA * analytic_gaussian_sigma(EPS, R, DELTA)
    lam_ours = calibrated_lambda(sigma_rdp, R * R / 4)
    out["ours"] = _accuracies(xtr, ytr, xte, yte, sigma_rdp, lam_ours, trials, 1)
    print("ours", out["ours"], flush=True)
    lam_q = calibrated_lambda(sigma_rdp, 0.25)
    out["beta_quarter"] = _accuracies(xtr, ytr, xte, yte, sigma_rdp, lam_q, trials, 1)
    print("beta_quarter", out["beta_quarter"], flush=True)
    lam_an = calibrated_lambda(sigma_an, R * R / 4)
    out["analytic_sigma"] = _accuracies(xtr, ytr, xte, yte, sigma_an, lam_an, trials, 1)
    print("analytic_sigma", out["analytic_sigma"], flush=True)
    lam_an_q = calibrated_lambda(sigma_an, 0.25)
    out["analytic_sigma_beta_quarter"] = _accuracies(xtr, ytr, xte, yte, sigma_an, lam_an_q, trials, 1)
    print("analytic_sigma_beta_quarter", out["analytic_sigma_beta_quarter"], flush=True)
    out["lambda_sweep"] = [
        _accuracies(xtr, ytr, xte, yte, sigma_rdp, lam, trials, 1)
        for lam in (1.0, 5.0, 12.0, 25.0, 50.0, 100.0)
    ]
    print("lambda_sweep", [(r["lambda"], round(r["mean"], 4)) for r in out["lambda_sweep"]], flush=True)
    out["sigma_sweep"] = [
        _accuracies(xtr, ytr, xte, yte, s, lam_ours, trials, 1) for s in (10.0, 20.0, 40.0, sigma_rdp)
    ]
    print("sigma_sweep", [(r["sigma"], round(r["mean"], 4)) for r in out["sigma_sweep"]], flush=True)
    out["best_of_10"] = _accuracies(
        xtr, ytr, xte, yte, sigma_rdp, lam_ours, max(10, trials // 2), 1, best_of=10
    )
    print("best_of_10", out["best_of_10"], flush=True)
    ceiling = {}
    for lam in (1e-3, lam_ours):
        theta = solve_to_tolerance(xtr, ytr, lam, np.zeros(xtr.shape[1]), 1e-8)
        ceiling[f"lambda={lam:.4g}"] = _accuracy(theta, xte, yte)
    # the thesis's preprocessing as described: rows normalised to ‖x‖ = 1 (no per-column standardisation)
    rng = np.random.default_rng(0)
    order = rng.permutation(features.shape[0])
    cut = int(0.8 * features.shape[0])
    z = features / np.linalg.norm(features, axis=1, keepdims=True)
    x = np.hstack([z, np.ones((z.shape[0], 1))])
    y = np.where(labels > 0, 1.0, -1.0)
    xa, ya, xb, yb = x[order[:cut]], y[order[:cut]], x[order[cut:]], y[order[cut:]]
    theta = solve_to_tolerance(xa, ya, 1e-3, np.zeros(x.shape[1]), 1e-8)
    ceiling["rows_only_lambda=0.001"] = _accuracy(theta, xb, yb)
    out["ceiling"] = ceiling
    out["rows_only_ours"] = _accuracies(xa, ya, xb, yb, sigma_rdp, lam_ours, trials, 1)
    print("ceiling", ceiling, "rows_only_ours", out["rows_only_ours"], flush=True)
    return out


def frontier(trials: int) -> list[dict[str, Any]]:
    """Accuracy along the privacy frontier at ε = 0.1: σ = f·σ_G (analytic σ_G), λ the smallest admissible.
    Every point is (ε, δ)-DP at the target; f is the thesis's (a priori) knob, 1.3 in its experiments."""
    features, labels = _datasets(False)["synthetic-L"]
    xtr, ytr, xte, yte = _prepare(features, labels, seed=0)
    base = analytic_gaussian_sigma(EPS, R, DELTA)
    rows = []
    for f in (1.15, 1.2, 1.3, 1.45, 1.6, 2.0):
        sigma = f * base
        lam = calibrated_lambda(sigma, R * R / 4)
        if not math.isfinite(lam):
            rows.append({"f": f, "sigma": sigma, "lambda": None, "feasible": False})
            print("frontier", f, "infeasible", flush=True)
            continue
        row = _accuracies(xtr, ytr, xte, yte, sigma, lam, trials, 7)
        row["f"] = f
        print("frontier", f, round(row["lambda"], 3), round(row["mean"], 4), flush=True)
        rows.append(row)
    return rows


def selection(trials: int) -> dict[str, Any]:
    """best-of-10 by test accuracy (fresh noise per run) at the current calibration (analytic σ_G)."""
    features, labels = _datasets(False)["synthetic-L"]
    xtr, ytr, xte, yte = _prepare(features, labels, seed=0)
    sigma = F_SIGMA * analytic_gaussian_sigma(EPS, R, DELTA)
    row = _accuracies(xtr, ytr, xte, yte, sigma, calibrated_lambda(sigma, R * R / 4), trials, 11, best_of=10)
    print("best_of_10_analytic", row, flush=True)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=40)
    parser.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "objpert_gap.json")
    parser.add_argument(
        "--frontier", action="store_true", help="only the frontier sweep, merged into an existing output"
    )
    parser.add_argument(
        "--selection", action="store_true", help="only best-of-10 at the analytic calibration, merged"
    )
    args = parser.parse_args()
    started = time.monotonic()
    if args.selection:
        payload = json.loads(args.output.read_text()) if args.output.exists() else {"results": {}}
        payload["results"]["best_of_10_analytic"] = selection(args.trials)
        args.output.write_text(json.dumps(payload, indent=2))
        print(f"wrote {args.output}")
        return 0
    if args.frontier:
        payload = json.loads(args.output.read_text()) if args.output.exists() else {"results": {}}
        payload["results"]["frontier"] = frontier(args.trials)
        args.output.write_text(json.dumps(payload, indent=2))
        print(f"wrote {args.output}")
        return 0
    results = run(args.trials)
    payload = {
        "benchmark": "objpert_gap",
        "created": datetime.now(UTC).isoformat(),
        "thesis_alg7_synthetic_l_eps_0.1": THESIS,
        "seconds": round(time.monotonic() - started, 2),
        "results": results,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(payload, indent=2))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
