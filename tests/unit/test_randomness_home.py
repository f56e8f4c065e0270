"""Nothing but ``mechanisms.noise`` draws randomness (docs/privacy/finite_precision.md#fp-construction).

An AST scan of every module under ``mechanisms/`` and ``service/``. Outside ``mechanisms/noise/`` no module
may: reach ``numpy.random`` under any alias; import Python's ``random``, ``secrets`` or ``importlib``; call
``os.urandom``, ``__import__``, a SciPy ``.rvs`` or ``.ppf`` (inverse-CDF sampling), a float sampler method
(``.laplace(``, ``.normal(``, …) on anything but ``RdpCurve``, or a private ``Noise`` method; the
data-independent escape hatches (``unit_floats``, ``permutation``) are allowed only where listed. Inside
``mechanisms/noise/`` the bits come from ``os.urandom`` or the seeded SHAKE stream only: no ``numpy.random``
and no Python ``random``. ``secrets`` is allowed in the service modules that make API keys, ids and retry
jitter (no release reads them). The scan is checked against planted violations so that it can fail.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOISE_HOME = ROOT / "mechanisms" / "noise"
FLOAT_SAMPLERS = frozenset(
    {
        "laplace",
        "normal",
        "standard_normal",
        "standard_exponential",
        "exponential",
        "gumbel",
        "uniform",
        "random",
        "random_sample",
        "rand",
        "randn",
        "poisson",
        "binomial",
        "geometric",
        "lognormal",
        "choice",
        "shuffle",
        "integers",
        "randint",
        "standard_cauchy",
        "standard_t",
        "gamma",
        "beta",
        "logistic",
        "multivariate_normal",
        "vonmises",
        "gauss",
        "default_rng",
        "SeedSequence",
        "PCG64",
        "Generator",
        "RandomState",
        "rvs",
        "ppf",
        "urandom",
        "getrandbits",
        "randbits",
        "token_bytes",
    }
)
CURVE_CONSTRUCTORS = frozenset({"RdpCurve", "cls"})  # RdpCurve.laplace(...) is accounting, not sampling
FORBIDDEN_MODULES = frozenset({"random", "numpy.random", "secrets", "importlib"})
SECRETS_ALLOWED = frozenset({"service/auth.py", "service/cli.py"})
ESCAPE_HATCHES = frozenset({"unit_floats", "permutation"})
ESCAPES_ALLOWED = frozenset({"mechanisms/tuning/candidates.py"})  # the train/holdout split


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    if isinstance(node, ast.Name):
        return node.id
    return "?"


def _numpy_aliases(tree: ast.AST) -> set[str]:
    names = {"np", "numpy"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.asname or a.name for a in node.names if a.name == "numpy"}
    return names


def violations(source: str, filename: str, *, noise_home: bool = False) -> list[str]:
    """Every place in ``source`` that draws randomness outside the noise home."""
    tree = ast.parse(source, filename)
    numpy_names = _numpy_aliases(tree)
    forbidden = {"random", "numpy.random"} if noise_home else set(FORBIDDEN_MODULES)
    if filename in SECRETS_ALLOWED:
        forbidden.discard("secrets")
    found: list[str] = []
    for node in ast.walk(tree):
        where = f"{filename}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            found += [f"{where} imports {a.name}" for a in node.names if a.name in forbidden]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if module in forbidden or module.startswith("numpy.random."):
                found.append(f"{where} imports from {module}")
            if module == "numpy" and any(a.name == "random" for a in node.names):
                found.append(f"{where} imports numpy.random")
        elif isinstance(node, ast.Attribute):
            dotted = _dotted(node)
            parts = dotted.split(".")
            if len(parts) >= 2 and parts[0] in numpy_names and parts[1] == "random":
                found.append(f"{where} uses {dotted}")
        elif isinstance(node, ast.Call):
            if isinstance(node.func, ast.Name) and node.func.id == "__import__":
                found.append(f"{where} calls __import__")
            if noise_home or not isinstance(node.func, ast.Attribute):
                continue
            receiver, method = _dotted(node.func.value), node.func.attr
            if method in FLOAT_SAMPLERS and receiver.split(".")[-1] not in CURVE_CONSTRUCTORS:
                found.append(f"{where} calls {receiver}.{method}(…)")
            elif method.startswith("_") and not method.startswith("__") and receiver.endswith("noise"):
                found.append(f"{where} calls the private {receiver}.{method}(…)")
            elif method in ESCAPE_HATCHES and filename not in ESCAPES_ALLOWED:
                found.append(f"{where} calls {receiver}.{method}(…) outside the allowed modules")
    return sorted(set(found))


def _modules() -> list[Path]:
    return sorted([*(ROOT / "mechanisms").rglob("*.py"), *(ROOT / "service").rglob("*.py")])


def _scan(path: Path) -> list[str]:
    name = path.relative_to(ROOT).as_posix()
    return violations(path.read_text(), name, noise_home=NOISE_HOME in path.parents)


def test_the_scan_covers_the_code() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in _modules()}
    assert {"mechanisms/queries/laplace.py", "service/runs/requests.py", "mechanisms/noise/exact.py"} <= names


@pytest.mark.parametrize(
    "planted",
    [
        "import numpy as np\nrng = np.random.default_rng(1)\n",
        "import numpy as np\nx = np.random.laplace(0.0, 1.0)\n",
        "import numpy as xp\nx = xp.random.standard_t(3)\n",
        "from numpy.random import Generator\n",
        "from numpy import random\n",
        "import random\nx = random.random()\n",
        "import secrets\nx = secrets.randbelow(10)\n",
        "import os\nx = os.urandom(8)\n",
        "x = __import__('random').gauss(0, 1)\n",
        "import importlib\nm = importlib.import_module('numpy.random')\n",
        "def f(rng):\n    return rng.normal(0.0, 1.0, size=3)\n",
        "def f(rng):\n    return rng.multivariate_normal([0.0], [[1.0]])\n",
        "from scipy import stats\nx = stats.norm.rvs(size=3)\n",
        "def f(noise):\n    return stats.laplace.ppf(noise.unit_floats(3))\n",
        "def f(noise):\n    return noise._word() * 2.0**-64\n",
        "def f(gen):\n    return gen.standard_exponential(4)\n",
    ],
)
def test_the_scan_catches_a_planted_sampler(planted: str) -> None:
    assert violations(planted, "mechanisms/planted.py")


def test_the_noise_home_may_not_use_numpy_random_either() -> None:
    assert violations("import numpy as np\nx = np.random.default_rng()\n", "n.py", noise_home=True)
    assert violations("import random\n", "n.py", noise_home=True)
    assert violations("import os\nb = os.urandom(8)\n", "n.py", noise_home=True) == []


def test_accounting_constructors_and_allowed_uses_are_not_samplers() -> None:
    assert violations("c = RdpCurve.laplace([1.0], 0.5, orders)\n", "mechanisms/ok.py") == []
    assert violations("import secrets\nk = secrets.token_urlsafe(32)\n", "service/auth.py") == []
    assert violations("p = noise.permutation(10)\n", "mechanisms/tuning/candidates.py") == []


def test_nothing_outside_the_noise_home_draws_randomness() -> None:
    found = [v for path in _modules() for v in _scan(path)]
    assert found == []
