"""Cost of floating-point-safe noise: per-sample time of each exact sampler, and a Laplace count's latency
through the real service before (numpy float sampler) and after (discrete Laplace from the OS CSPRNG).

* Samplers: ``mechanisms.noise.Noise.system()`` (OS CSPRNG), vectorised draws of ``--samples`` values, best of
  ``--repeats``; numpy's float samplers alongside for reference.
* Latency: a fresh SQLite database and the app served in-process (``service.embedded.serve_in_thread``),
  ``--requests`` sequential ``laplace`` count requests (ε = 1e-6) on a keep-alive client; p50/p90/p99.
  "Before" runs the same measurement against another checkout of the code (``--before PATH``, e.g. a
  ``git worktree`` of the commit before the change) in a subprocess with that checkout first on ``sys.path``.

    .venv/bin/python benchmarks/fp_noise.py [--before /tmp/before] [--requests 400]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from fractions import Fraction
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUTPUT = ROOT / "benchmarks" / "results" / "fp_noise.json"
SCHEMA = {"columns": [{"name": "x", "type": "int", "min": 0, "max": 100}], "neighboring": "replace_one"}


def _best_seconds(draw: Any, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        draw()
        best = min(best, time.perf_counter() - start)
    return best


def sampler_costs(samples: int, repeats: int) -> dict[str, float]:
    """Nanoseconds per sample of each exact sampler (and numpy's float samplers for reference)."""
    import numpy as np

    from mechanisms.noise import Noise

    noise = Noise.system()
    reference = np.random.default_rng(0)  # the float samplers replaced, for comparison only
    draws = {
        "uniform_below(1000)": lambda: noise.uniform_below(1000, samples),
        "bernoulli(1/3)": lambda: noise.bernoulli(Fraction(1, 3), samples),
        "bernoulli_exp_neg(x in [0,2))": lambda: noise.bernoulli_exp_neg(
            noise.uniform_below(2000, samples), 1000
        ),
        "discrete_laplace(t=10)": lambda: noise.discrete_laplace(Fraction(10), samples),
        "discrete_laplace(t=1e6/3)": lambda: noise.discrete_laplace(Fraction(10**6, 3), samples),
        "discrete_gaussian(sigma=1)": lambda: noise.discrete_gaussian(Fraction(1), samples),
        "discrete_gaussian(sigma=4096)": lambda: noise.discrete_gaussian(Fraction(4096**2), samples),
        "numpy float laplace (replaced)": lambda: reference.laplace(0.0, 10.0, samples),
        "numpy float normal (replaced)": lambda: reference.normal(0.0, 10.0, samples),
    }
    from mechanisms.noise.tuning import discrete_laplace_rows

    ten, third = [Fraction(10)] * samples, [Fraction(10**6, 3)] * samples  # one scale object, as predraw
    draws |= {  # the tuning list's batched sampler, and the data split's permutation
        "discrete_laplace_rows(t=10)": lambda: discrete_laplace_rows(noise, ten),
        "discrete_laplace_rows(t=1e6/3)": lambda: discrete_laplace_rows(noise, third),
        "permutation(4000), per element": lambda: [noise.permutation(4000) for _ in range(samples // 4000)],
    }
    big = {
        "discrete_gaussian(sigma=1e6, big-integer path)": lambda: noise.discrete_gaussian(
            Fraction(10**12), max(samples // 100, 1)
        )
    }
    costs = {name: 1e9 * _best_seconds(draw, repeats) / samples for name, draw in draws.items()}
    costs |= {name: 1e9 * _best_seconds(draw, repeats) / max(samples // 100, 1) for name, draw in big.items()}
    return costs


def latency(requests: int) -> dict[str, Any]:
    """Sequential Laplace-count latency through the in-process server on SQLite (run inside one checkout)."""
    import httpx

    from service.auth import Role, create_key
    from service.config import Settings
    from service.embedded import serve_in_thread
    from service.store.engine import make_engine, make_sessionmaker
    from service.store.migrate import upgrade

    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{Path(tmp) / 'expost.db'}"
        upgrade(url)
        engine = make_engine(url)
        with make_sessionmaker(engine)() as session, session.begin():
            admin_key = create_key(session, "bench-admin", Role.admin)
            analyst_key = create_key(session, "bench-analyst", Role.analyst)
        engine.dispose()
        settings = Settings.model_validate(
            {"database_url": url, "data_dir": Path(tmp) / "data", "rate_limit": "", "log_level": "WARNING"}
        )
        with serve_in_thread(settings, start_timeout=30.0) as base:
            admin = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {admin_key}"}, timeout=30)
            csv = ("x\n" + "\n".join(str(i % 100) for i in range(1000)) + "\n").encode()
            made = admin.post(
                "/v1/datasets",
                files={"file": ("d.csv", csv, "text/csv")},
                data={"schema": json.dumps(SCHEMA), "name": "latency"},
            )
            made.raise_for_status()
            dataset = made.json()["id"]
            budget = {"epsilon": 1e6, "delta": 0.0}
            admin.put(f"/v1/datasets/{dataset}/budget", json=budget).raise_for_status()
            admin.post(f"/v1/datasets/{dataset}/grants", json={"analyst": "bench-analyst"}).raise_for_status()
            analyst = httpx.Client(
                base_url=base, headers={"Authorization": f"Bearer {analyst_key}"}, timeout=30
            )
            body = {"mechanism": "laplace", "params": {"query": {"kind": "count"}, "epsilon": 1e-6}}
            seconds: list[float] = []
            values: list[float] = []
            for i in range(requests + 20):
                start = time.perf_counter()
                answer = analyst.post(f"/v1/datasets/{dataset}/requests", json=body)
                elapsed = time.perf_counter() - start
                answer.raise_for_status()
                if i >= 20:  # warm-up excluded
                    seconds.append(elapsed)
                    values.append(float(answer.json()["release"]["value"]))
    ordered = sorted(seconds)
    return {
        "requests": requests,
        "p50_ms": 1e3 * statistics.median(ordered),
        "p90_ms": 1e3 * ordered[int(0.9 * (len(ordered) - 1))],
        "p99_ms": 1e3 * ordered[int(0.99 * (len(ordered) - 1))],
        "mean_ms": 1e3 * statistics.fmean(ordered),
        "integer_releases": sum(v.is_integer() for v in values),
    }


def latency_in(checkout: Path, requests: int) -> dict[str, Any]:
    """``latency`` run in a subprocess whose imports come from ``checkout``."""
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); sys.path.insert(1, sys.argv[2]);"
        "import fp_noise; print(json.dumps(fp_noise.latency(int(sys.argv[3]))))"
    )
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    done = subprocess.run(
        [sys.executable, "-c", code, str(checkout), str(ROOT / "benchmarks"), str(requests)],
        cwd=checkout,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--before", type=Path, help="a checkout of the code before the change")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    parser.add_argument(
        "--samplers-only", action="store_true", help="update ns_per_sample only (keep the stored latency)"
    )
    args = parser.parse_args(argv)

    costs = sampler_costs(args.samples, args.repeats)
    print(f"{'sampler':<48} ns/sample")
    for name, ns in costs.items():
        print(f"{name:<48} {ns:10.0f}")
    if args.samplers_only:
        kept: dict[str, Any] = json.loads(args.output.read_text()) if args.output.exists() else {}
        kept |= {"samplers_when": datetime.now(UTC).isoformat(timespec="seconds"), "ns_per_sample": costs}
        args.output.write_text(json.dumps(kept, indent=2) + "\n")
        print(f"wrote {args.output}")
        return 0
    result: dict[str, Any] = {
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "samples": args.samples,
        "ns_per_sample": costs,
        "laplace_count_latency": {"after": latency_in(ROOT, args.requests)},
    }
    if args.before is not None:
        result["laplace_count_latency"]["before"] = latency_in(args.before, args.requests)
    for label, row in result["laplace_count_latency"].items():
        print(
            f"laplace count latency {label:>6}: p50 {row['p50_ms']:.2f} ms  p90 {row['p90_ms']:.2f} ms  "
            f"p99 {row['p99_ms']:.2f} ms  ({row['integer_releases']}/{row['requests']} integer releases)"
        )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
