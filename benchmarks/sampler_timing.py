"""How much of a release's noise its running time shows (issue 35, item 16: the sampler's timing).

The exact discrete Laplace sampler (mechanisms/noise/exact.py, CKS 2020 Algorithm 2) draws a geometric
V ~ Geometric(1 − e^{−1}) by repeated Bernoulli(e^{−1}) trials, and |Z| ≈ V·t for scale t: its running time
grows with |Z|/t. This script measures that dependence where an attacker could see it:

1. **In process** (an attacker timing the sampler itself, e.g. a co-tenant measuring CPU): ``--draws``
   single draws per scale t, their time against V = ⌊|Z|/t⌋; the ordinary least-squares slope (µs per unit
   of V, i.e. per scale unit of |noise|) with its standard error, and the median time per V.
2. **Over HTTP** (a client timing its own requests): a real ``expost serve`` process on SQLite, one
   keep-alive client sending ``--requests`` Laplace counts (ε = 1, so t = 1 grid unit and |noise| = V
   roughly) one after another; each response's latency against |released − true count|: the slope and its
   standard error, and the correlation. The generator's CPU and the load average are recorded beside them.

    .venv/bin/python benchmarks/sampler_timing.py [--draws 20000] [--requests 3000]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from datetime import UTC, datetime
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.service_load import Server, cli, client_for, create_key  # noqa: E402
from mechanisms.noise.exact import Noise  # noqa: E402

DEFAULT_OUTPUT = ROOT / "benchmarks" / "results" / "sampler_timing.json"
ROWS = 1000
SCHEMA = {
    "columns": [{"name": "age", "type": "float", "min": 18, "max": 90}],
    "neighboring": "add_remove",
}


def slope_fit(x: np.ndarray, y: np.ndarray) -> dict[str, float]:
    """OLS slope of y on x with its standard error, and the correlation."""
    design = np.column_stack([np.ones_like(x), x])
    coef, *_ = np.linalg.lstsq(design, y, rcond=None)
    residual = y - design @ coef
    sigma2 = float(residual @ residual) / max(1, len(x) - 2)
    cov = sigma2 * np.linalg.inv(design.T @ design)
    return {
        "slope": float(coef[1]),
        "slope_se": float(np.sqrt(cov[1, 1])),
        "correlation": float(np.corrcoef(x, y)[0, 1]),
    }


def median_slope(v: np.ndarray, micros: np.ndarray) -> float:
    """The slope through the median times at V = 0, 1, 2, 3 (robust to the machine's outliers, which
    dominate the least-squares slope on a busy host)."""
    levels = [level for level in range(4) if np.any(v == level)]
    medians = [float(np.median(micros[v == level])) for level in levels]
    return float(np.polyfit(levels, medians, 1)[0]) if len(levels) >= 2 else float("nan")


def medians_by_v(v: np.ndarray, micros: np.ndarray) -> dict[str, dict[str, float]]:
    table = {}
    for level in range(5):
        chosen = micros[v == level] if level < 4 else micros[v >= level]
        if chosen.size:
            label = str(level) if level < 4 else "4+"
            table[label] = {"n": int(chosen.size), "median_us": float(np.median(chosen))}
    return table


def in_process(draws: int) -> list[dict[str, Any]]:
    noise = Noise.system()
    rows = []
    for scale in (Fraction(1), Fraction(10), Fraction(1000)):
        times = np.empty(draws)
        values = np.empty(draws)
        for i in range(draws):
            start = time.perf_counter_ns()
            values[i] = abs(int(noise.discrete_laplace(scale, 1)[0]))
            times[i] = (time.perf_counter_ns() - start) / 1e3
        v = np.floor(values / float(scale))
        by_v = medians_by_v(v, times)
        row: dict[str, Any] = {
            "scale": float(scale),
            "draws": draws,
            **slope_fit(v, times),
            "median_slope": median_slope(v, times),
            "by_v": by_v,
        }
        rows.append(row)
        print(
            f"in process, t = {float(scale):>6.0f}: {row['median_slope']:+.2f} µs per unit of |Z|/t "
            f"through the medians (OLS {row['slope']:+.2f} ± {row['slope_se']:.2f}, "
            f"corr {row['correlation']:+.3f}); by V: "
            + ", ".join(f"{k}: {m['median_us']:.1f} µs" for k, m in by_v.items())
        )
    return rows


def over_http(requests: int, workdir: Path) -> dict[str, Any]:
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "EXPOST_DATABASE_URL": f"sqlite:///{workdir / 'timing.db'}",
        "EXPOST_DATA_DIR": str(workdir / "data"),
        "EXPOST_RATE_LIMIT": "",
    }
    cli(env, workdir, "migrate")
    admin_key = create_key(env, workdir, "admin")
    analyst_key = create_key(env, workdir, "analyst")
    server = Server(env, workdir, 1, tag="timing")
    try:
        server.wait_ready()
        with client_for(server.base_url, admin_key) as admin:
            created = admin.post(
                "/v1/datasets",
                files={"file": ("t.csv", b"age\n" + b"40\n" * ROWS, "text/csv")},
                data={"schema": json.dumps(SCHEMA), "name": "timing"},
            )
            created.raise_for_status()
            dataset = created.json()["id"]
            admin.post(f"/v1/datasets/{dataset}/grants", json={"analyst": "load-analyst"}).raise_for_status()
            admin.put(
                f"/v1/datasets/{dataset}/budget", json={"epsilon": 1e6, "delta": 0.0}
            ).raise_for_status()
        body = {"mechanism": "laplace", "params": {"query": {"kind": "count"}, "epsilon": 1.0}}
        latencies = np.empty(requests)
        noise = np.empty(requests)
        cpu_before, load_before = time.process_time(), os.getloadavg()[0]
        with client_for(server.base_url, analyst_key) as analyst:
            for _ in range(50):  # warm-up
                analyst.post(f"/v1/datasets/{dataset}/requests", json=body).raise_for_status()
            wall = time.perf_counter()
            for i in range(requests):
                start = time.perf_counter_ns()
                answer = analyst.post(f"/v1/datasets/{dataset}/requests", json=body)
                latencies[i] = (time.perf_counter_ns() - start) / 1e3
                answer.raise_for_status()
                noise[i] = abs(float(answer.json()["release"]["value"]) - ROWS)
            wall = time.perf_counter() - wall
        fit = slope_fit(noise, latencies)
        result = {
            "requests": requests,
            **fit,
            "median_slope": median_slope(noise, latencies),
            "median_latency_us": float(np.median(latencies)),
            "latency_iqr_us": float(np.subtract(*np.percentile(latencies, [75, 25]))),
            "by_abs_noise": medians_by_v(noise, latencies),
            "generator_cpu_share": (time.process_time() - cpu_before) / wall,
            "loadavg_1min_before": load_before,
            "loadavg_1min_after": os.getloadavg()[0],
        }
        print(
            f"over HTTP (ε = 1, t = 1): {result['median_slope']:+.1f} µs per unit of |noise| through "
            f"the medians (OLS {fit['slope']:+.1f} ± {fit['slope_se']:.1f}, corr {fit['correlation']:+.3f}); "
            f"median latency {result['median_latency_us']:.0f} µs, IQR {result['latency_iqr_us']:.0f} µs; "
            f"generator CPU {result['generator_cpu_share']:.2f} core, "
            f"load {load_before:.1f}→{result['loadavg_1min_after']:.1f}"
        )
        return result
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--draws", type=int, default=20000, help="single draws per scale, in process")
    parser.add_argument("--requests", type=int, default=3000, help="sequential Laplace counts over HTTP")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        results = {
            "when": datetime.now(UTC).isoformat(timespec="seconds"),
            "cpu_count": os.cpu_count(),
            "in_process": in_process(args.draws),
            "over_http": over_http(args.requests, Path(tmp)),
        }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
