"""RGM gradient descent vs clipped DP-GD at equal privacy, and RGM-GD's wall time vs non-private GD.

Issue 5's benchmark, on synthetic data of the paper's scale (Hendrikx et al. 2024, §6: ijcnn1 has
N = 141 691 records and d = 22 features; ridge λ = 0.03; labels ±1 fitted by ridge least squares):

* data: x_i = z_i/‖z_i‖·u_i with z_i ~ N(0, Σ) (a random covariance with a 30× spread of eigenvalues) and
  u_i ~ U(0.2, 1), so ‖x_i‖ ≤ 1 = X; y_i = sign(w·x_i + 0.3·N(0, 1) − b) with b set for ~10% positives
  (like ijcnn1); |y_i| ≤ 1 = Y;
* step size τ = 0.5/λ_max(A) for every method (the paper's choice; it reads the data, so in the service
  τ is a public parameter: here it is a benchmark setting, not a private computation), θ₀ = 0, T steps;
* excess risk f(θ_t) − f* = ½(θ_t − θ*)ᵀA(θ_t − θ*) (exact for the quadratic), mean/min/max over seeds;
* methods: non-private GD; RGM-GD (``mechanisms.learners.rgm_gd``, the relative sensitivity rgm.gd charges:
  η = 2X²/(λn), R_rel = (2/√3)·D/n, D the gradient-gap bound) with Theorem 1 and with the exact curve;
  clipped DP-GD (``mechanisms.learners.dp_gd``, replace-one Δ = 2C) with C ∈ {c/10, c, 10c},
  c = max_i ‖∇ℓ_i(θ*)‖ (the paper's non-private choice), with C = X·Y = 1 (the largest per-example
  gradient norm at θ₀ = 0, public) and with C_pub = X(XB + Y) on the ball ‖θ‖ ≤ B
  (``never_clipping_threshold``: public, never clips there);
* Proposition NOGAIN (docs/privacy/gradient_descent.md#proposition-nogain): every valid relative sensitivity
  has R_rel ≥ R_floor (``ridge_r_rel_floor``), so no RGM-GD parametrisation has a noise floor below that of a
  Gaussian mechanism with sensitivity R_floor; "rgm_at_floor" runs RGM-GD with σ from R_floor instead of R_rel
  (NOT private: an optimistic bound on what any sound parametrisation could reach);
* privacy levels: (a) per step RDP ε = 0.1 at α = 2 (the paper's "equivalent RDP": RGM γ from Theorem 1 /
  the exact curve, DP-GD noise multiplier z = √(α/(2ε))), (b) a total (ε, δ) = (1, 1e-6) over T steps,
  each method calibrated on its own RDP curve over ``DEFAULT_ORDERS`` with Mironov's conversion;
* wall time: RGM-GD's T steps (``rgm_gd_train``) against non-private GD with the same gradient code
  (``full_gradient``), median of repeats; target ratio ≤ 1.5.

    .venv/bin/python benchmarks/rgm_gd.py [--quick] [--steps 50] [--seeds 3] [--output PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from mechanisms.accounting import DEFAULT_ORDERS, epsilon_at_delta  # noqa: E402
from mechanisms.learners.dp_gd import DpGdConfig, dp_gd_curve, dp_gd_train, noise_multiplier_for  # noqa: E402
from mechanisms.learners.relative_gaussian import RelativeSensitivity  # noqa: E402
from mechanisms.learners.rgm_calibration import (  # noqa: E402
    baseline_sigma,
    gamma_for_step,
    gamma_for_total,
    never_clipping_threshold,
    relative_sensitivity,
    ridge_r_rel_floor,
    scale_curve,
    step_curve,
    theta_bound,
)
from mechanisms.learners.rgm_gd import (  # noqa: E402
    RgmGdConfig,
    full_gradient,
    rgm_gd_train,
)
from mechanisms.noise import Noise  # noqa: E402

REG = 0.03
ALPHA, EPS_STEP = 2.0, 0.1
TOTAL_EPS, TOTAL_DELTA = 1.0, 1e-6


def make_data(n: int, d: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    basis, _ = np.linalg.qr(rng.normal(size=(d, d)))
    scales = np.sqrt(np.geomspace(1.0, 30.0, d))
    z = rng.normal(size=(n, d)) * scales @ basis.T
    x = z / np.linalg.norm(z, axis=1, keepdims=True) * rng.uniform(0.2, 1.0, size=(n, 1))
    score = x @ rng.normal(size=d) + 0.3 * rng.normal(size=n)
    y = np.where(score > np.quantile(score, 0.9), 1.0, -1.0)
    return x, y


def nonprivate_gd(x: np.ndarray, y: np.ndarray, tau: float, steps: int) -> np.ndarray:
    theta = np.zeros(x.shape[1])
    path = np.empty((steps, x.shape[1]))
    for t in range(steps):
        theta = theta - tau * full_gradient(theta, x, y, "ridge", REG)
        path[t] = theta
    return path


def excess(path: np.ndarray, a: np.ndarray, theta_star: np.ndarray) -> np.ndarray:
    diff = path - theta_star
    result: np.ndarray = 0.5 * np.einsum("ti,ij,tj->t", diff, a, diff)
    return result


def summarize(runs: list[np.ndarray], checkpoints: list[int]) -> dict[str, Any]:
    stack = np.vstack(runs)
    return {
        "checkpoints": checkpoints,
        "mean": [float(np.mean(stack[:, t - 1])) for t in checkpoints],
        "min": [float(np.min(stack[:, t - 1])) for t in checkpoints],
        "max": [float(np.max(stack[:, t - 1])) for t in checkpoints],
        "final_mean": float(np.mean(stack[:, -1])),
        "best_mean_over_steps": float(np.min(np.mean(stack, axis=0))),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small smoke run (N = 20 000, T = 10, 1 seed)")
    parser.add_argument("--n", type=int, default=141_691)
    parser.add_argument("--d", type=int, default=22)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5, help="timing repeats (median)")
    parser.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "rgm_gd.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.n, args.steps, args.seeds, args.repeats = 20_000, 10, 1, 3
    n, d, steps = args.n, args.d, args.steps

    x, y = make_data(n, d, 0)
    a = x.T @ x / n + REG * np.eye(d)
    theta_star = np.linalg.solve(a, x.T @ y / n)
    tau = 0.5 / float(np.linalg.eigvalsh(a).max())
    residual = x @ theta_star - y
    c = float(np.max(np.abs(residual) * np.linalg.norm(x, axis=1)))
    sens = relative_sensitivity("ridge", n, REG, 1.0, 1.0)
    c_pub = never_clipping_threshold("ridge", REG, 1.0, 1.0)
    ball = theta_bound("ridge", REG, 1.0, 1.0)
    r_floor = ridge_r_rel_floor(n, REG, 1.0, 1.0)
    checkpoints = sorted({t for t in (1, 2, 5, 10, 20, 50, 100, steps) if t <= steps})
    print(
        f"N = {n}, d = {d}, λ = {REG}, T = {steps}, τ = {tau:.4g}, c = {c:.4g}, "
        f"η = {sens.eta:.4g}, R_rel = {sens.r_rel:.4g}, seeds = {args.seeds}\n"
        f"n·R_rel = {n * sens.r_rel:.4g} (rgm.gd), n·R_floor = {n * r_floor:.4g} (every valid R_rel ≥ it), "
        f"2c = {2 * c:.4g} (DP-GD, C = c), 2C_pub = {2 * c_pub:.4g} (DP-GD, public C that never clips)"
    )

    def rgm_runs(gamma: float, sigma: float) -> dict[str, Any]:
        """Excess-risk curves of RGM-GD with (γ, σ) over the seeds."""
        config = RgmGdConfig("ridge", REG, steps, tau, gamma, sigma)
        noises = [Noise.seeded(seed) for seed in range(args.seeds)]
        paths = [rgm_gd_train(config, x, y, noise).iterates for noise in noises]
        return summarize([excess(path, a, theta_star) for path in paths], checkpoints)

    levels: dict[str, Any] = {}
    for level in ("per_step_alpha2_eps0.1", "total_eps1_delta1e-6"):
        methods: dict[str, dict[str, Any]] = {}
        # --- calibration (public parameters only) ---
        rgm_params: dict[str, tuple[float, float]] = {}
        for bound in ("theorem1", "exact"):
            if level.startswith("per_step"):
                gamma = gamma_for_step(EPS_STEP, ALPHA, sens.eta, d, bound)  # type: ignore[arg-type]
            else:
                gamma = gamma_for_total(TOTAL_EPS, TOTAL_DELTA, steps, sens, d, DEFAULT_ORDERS, bound)  # type: ignore[arg-type]
            rgm_params[bound] = (gamma, baseline_sigma(gamma, sens))
        z = (
            math.sqrt(ALPHA / (2 * EPS_STEP))
            if level.startswith("per_step")
            else noise_multiplier_for(TOTAL_EPS, TOTAL_DELTA, steps, DEFAULT_ORDERS)
        )
        clips: dict[str, tuple[float, float | None]] = {
            "C=c/10": (c / 10, None),
            "C=c": (c, None),
            "C=10c": (10 * c, None),
            "C=1 (public)": (1.0, None),
            "C=C_pub (public, never clips)": (c_pub, ball),
        }

        # --- the privacy each method is charged ---
        for bound, (gamma, sigma) in rgm_params.items():
            curve = scale_curve(step_curve(DEFAULT_ORDERS, sens, gamma, sigma, d, bound), steps)  # type: ignore[arg-type]
            methods[f"rgm_{bound}"] = {
                "gamma": gamma,
                "sigma": sigma,
                "rdp_alpha2_total": curve.at(2.0),
                "epsilon_at_1e-6": epsilon_at_delta(curve, TOTAL_DELTA),
            }
        dp_configs = {
            name: DpGdConfig("squared", REG, steps, tau, clip, z, radius=radius)
            for name, (clip, radius) in clips.items()
        }
        for name, config in dp_configs.items():
            curve = dp_gd_curve(config, "replace_one", DEFAULT_ORDERS)
            methods[f"dpgd_{name}"] = {
                "clip": config.clip,
                "noise_multiplier": z,
                "rdp_alpha2_total": curve.at(2.0),
                "epsilon_at_1e-6": epsilon_at_delta(curve, TOTAL_DELTA),
            }

        # --- runs ---
        for bound, (gamma, sigma) in rgm_params.items():
            methods[f"rgm_{bound}"].update(rgm_runs(gamma, sigma))
        gamma_t1 = rgm_params["theorem1"][0]
        floor_sigma = baseline_sigma(gamma_t1, RelativeSensitivity(sens.eta, r_floor))
        methods["rgm_at_floor (not private)"] = {
            "gamma": gamma_t1,
            "sigma": floor_sigma,
            **rgm_runs(gamma_t1, floor_sigma),
        }
        for name, config in dp_configs.items():
            runs = []
            for seed in range(args.seeds):
                path = dp_gd_train(config, x, y, n, Noise.seeded(seed), return_iterates=True)
                runs.append(excess(path, a, theta_star))
            methods[f"dpgd_{name}"].update(summarize(runs, checkpoints))
        methods["nonprivate"] = summarize(
            [excess(nonprivate_gd(x, y, tau, steps), a, theta_star)], checkpoints
        )

        dp_names = [k for k in methods if k.startswith("dpgd_")]
        best_dp = min(dp_names, key=lambda k: methods[k]["final_mean"])
        rgm_best = min(methods["rgm_theorem1"]["final_mean"], methods["rgm_exact"]["final_mean"])
        levels[level] = {
            "nogain": {
                "dpgd_c_pub_beats_rgm": methods["dpgd_C=C_pub (public, never clips)"]["final_mean"]
                < rgm_best,
                "rgm_at_floor_beats_best_dpgd": methods["rgm_at_floor (not private)"]["final_mean"]
                < methods[best_dp]["final_mean"],
                "noise_std_near_optimum": {
                    "rgm": rgm_params["theorem1"][1],
                    "rgm_at_floor": floor_sigma,
                    **{k: methods[k]["noise_multiplier"] * 2 * methods[k]["clip"] / n for k in dp_names},
                },
            },
            "methods": methods,
            "best_dpgd": best_dp,
            "rgm_theorem1_beats_best_dpgd": methods["rgm_theorem1"]["final_mean"]
            < methods[best_dp]["final_mean"],
            "rgm_exact_beats_best_dpgd": methods["rgm_exact"]["final_mean"] < methods[best_dp]["final_mean"],
            "rgm_theorem1_beats_dpgd": {
                k: methods["rgm_theorem1"]["final_mean"] < methods[k]["final_mean"] for k in dp_names
            },
        }
        print(f"\n[{level}]  excess risk f(θ_t) − f* (mean over seeds) at t = {checkpoints}")
        for key, value in methods.items():
            charge = (
                f"  RDP(α=2) = {value['rdp_alpha2_total']:.4g}, ε(δ=1e-6) = {value['epsilon_at_1e-6']:.4g}"
                if ("rdp_alpha2_total" in value)
                else ""
            )
            print(f"  {key:34s} " + " ".join(f"{v:9.3e}" for v in value["mean"]) + charge)

    # --- wall time: RGM-GD vs non-private GD (same gradient code), median of repeats ---
    gamma = gamma_for_step(EPS_STEP, ALPHA, sens.eta, d)
    sigma = baseline_sigma(gamma, sens)
    config_r = RgmGdConfig("ridge", REG, steps, tau, gamma, sigma)
    config_dp = DpGdConfig("squared", REG, steps, tau, 1.0, math.sqrt(ALPHA / (2 * EPS_STEP)))
    timings: dict[str, list[float]] = {"nonprivate": [], "rgm": [], "dpgd": []}
    for repeat in range(args.repeats):
        start = time.perf_counter()
        nonprivate_gd(x, y, tau, steps)
        timings["nonprivate"].append(time.perf_counter() - start)
        start = time.perf_counter()
        rgm_gd_train(config_r, x, y, Noise.seeded(repeat))
        timings["rgm"].append(time.perf_counter() - start)
        start = time.perf_counter()
        dp_gd_train(config_dp, x, y, n, Noise.seeded(repeat))
        timings["dpgd"].append(time.perf_counter() - start)
    medians = {k: float(np.median(v)) for k, v in timings.items()}
    ratio = medians["rgm"] / medians["nonprivate"]
    print(
        f"\nwall time for {steps} steps (median of {args.repeats}): "
        f"non-private {medians['nonprivate']:.4f} s, RGM-GD {medians['rgm']:.4f} s (×{ratio:.3f}), "
        f"clipped DP-GD {medians['dpgd']:.4f} s "
        f"(×{medians['dpgd'] / medians['nonprivate']:.3f})"
    )

    targets = {
        "rgm_lower_excess_risk_than_best_clipped_dpgd": {
            level: bool(v["rgm_theorem1_beats_best_dpgd"] or v["rgm_exact_beats_best_dpgd"])
            for level, v in levels.items()
        },
        "rgm_wall_time_at_most_1.5x_nonprivate": ratio <= 1.5,
    }
    print(f"targets: {json.dumps(targets)}")
    result = {
        "benchmark": "rgm_gd",
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "quick": bool(args.quick),
        "machine": {"python": platform.python_version(), "platform": platform.platform()},
        "setting": {
            "n": n,
            "d": d,
            "reg": REG,
            "steps": steps,
            "seeds": args.seeds,
            "step_size": tau,
            "c_max_per_example_grad_at_optimum": c,
            "c_pub_never_clips": c_pub,
            "ball_radius": ball,
            "r_rel_floor_every_valid": r_floor,
            "eta": sens.eta,
            "r_rel": sens.r_rel,
            "orders": list(DEFAULT_ORDERS),
        },
        "levels": levels,
        "wall_time_seconds": {"median": medians, "all": timings, "rgm_over_nonprivate": ratio},
        "targets": targets,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
