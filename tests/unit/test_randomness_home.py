"""Nothing but ``mechanisms.noise`` draws randomness (docs/privacy.md §10.4).

An AST scan of every module under ``mechanisms/`` and ``service/``: outside ``mechanisms/noise/`` no module
may reach ``numpy.random`` (a Generator, a seed sequence, a legacy sampler), import Python's ``random``,
call a SciPy ``.rvs``, or call a float sampler method (``.laplace(``, ``.normal(``, …) on anything but
``RdpCurve``.
The scan is checked against a planted violation so that it can fail.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOISE_HOME = ROOT / "mechanisms" / "noise"
FLOAT_SAMPLERS = frozenset(
    {
        "laplace", "normal", "standard_normal", "standard_exponential", "exponential", "gumbel", "uniform",
        "random", "random_sample", "rand", "randn", "poisson", "binomial", "geometric", "lognormal", "choice",
        "shuffle", "integers", "randint", "standard_cauchy", "gamma", "beta", "logistic",
        "default_rng", "SeedSequence", "PCG64", "Generator", "RandomState", "rvs",
    }
)
CURVE_CONSTRUCTORS = frozenset({"RdpCurve", "cls"})  # RdpCurve.laplace(...) is accounting, not sampling


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    if isinstance(node, ast.Name):
        return node.id
    return "?"


def violations(source: str, filename: str) -> list[str]:
    """Every place in ``source`` that draws randomness outside the noise home."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source, filename)):
        where = f"{filename}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            found += [f"{where} imports {a.name}" for a in node.names if a.name in {"random", "numpy.random"}]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if module in {"random", "numpy.random"} or module.startswith("numpy.random."):
                found.append(f"{where} imports from {module}")
            if module == "numpy" and any(a.name == "random" for a in node.names):
                found.append(f"{where} imports numpy.random")
        elif isinstance(node, ast.Attribute):
            dotted = _dotted(node)
            if dotted.startswith(("np.random", "numpy.random")) or ".random." in f".{dotted}.":
                if dotted.split(".")[0] in {"np", "numpy"}:
                    found.append(f"{where} uses {dotted}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            receiver = _dotted(node.func.value)
            if node.func.attr in FLOAT_SAMPLERS and receiver.split(".")[-1] not in CURVE_CONSTRUCTORS:
                found.append(f"{where} calls {receiver}.{node.func.attr}(…)")
    return sorted(set(found))


def _modules() -> list[Path]:
    paths = [*(ROOT / "mechanisms").rglob("*.py"), *(ROOT / "service").rglob("*.py")]
    return sorted(p for p in paths if NOISE_HOME not in p.parents)


def test_the_scan_covers_the_code() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in _modules()}
    assert "mechanisms/laplace.py" in names
    assert "service/requests.py" in names
    assert not any(name.startswith("mechanisms/noise/") for name in names)


@pytest.mark.parametrize(
    "planted",
    [
        "import numpy as np\nrng = np.random.default_rng(1)\n",
        "import numpy as np\nx = np.random.laplace(0.0, 1.0)\n",
        "from numpy.random import Generator\n",
        "import random\nx = random.random()\n",
        "def f(rng):\n    return rng.normal(0.0, 1.0, size=3)\n",
        "from scipy import stats\nx = stats.norm.rvs(size=3)\n",
        "def f(gen):\n    return gen.standard_exponential(4)\n",
    ],
)
def test_the_scan_catches_a_planted_sampler(planted: str) -> None:
    assert violations(planted, "planted.py")


def test_accounting_constructors_are_not_samplers() -> None:
    assert violations("c = RdpCurve.laplace([1.0], 0.5, orders)\n", "ok.py") == []


def test_nothing_outside_the_noise_home_draws_randomness() -> None:
    found = [
        v for path in _modules() for v in violations(path.read_text(), path.relative_to(ROOT).as_posix())
    ]
    assert found == []
