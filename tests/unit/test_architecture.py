"""The import rule of docs/architecture.md, checked on the source (every import, also inside functions).

Layers, top to bottom: the composition roots (``service.app``, ``service.cli``, ``service.embedded``) →
``service.api`` → ``service.runs`` → ``service.datasets`` → ``service.filter`` → ``service.auth`` /
``service.metrics`` → ``service.store`` → ``service.config`` / ``service.logs`` / ``service.errors`` →
``mechanisms``; inside ``mechanisms`` the families stand on the seam, the seam on accounting, noise and
data. A module may import its own layer or lower ones, never a higher one; no module may import a
private (underscore) name of another module; and there is no import circle anywhere.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: (module prefix, layer): the longest matching prefix decides; higher layers may import lower ones.
LAYERS: list[tuple[str, int]] = [
    ("mechanisms.accounting", 0),
    ("mechanisms.noise", 1),
    ("mechanisms.data", 1),
    ("mechanisms.base", 2),
    ("mechanisms.params", 2),
    ("mechanisms.queries", 3),
    ("mechanisms.threshold", 4),
    ("mechanisms.learners", 4),
    ("mechanisms.reduction", 5),
    ("mechanisms.per_instance", 6),
    ("mechanisms.tuning", 6),
    ("mechanisms.ptr", 6),
    ("mechanisms.catalog", 7),
    ("mechanisms", 7),
    ("service.config", 10),
    ("service.logs", 10),
    ("service.errors", 10),
    ("service.data", 10),
    ("service.engines", 10),
    ("service.store", 11),
    ("service.auth", 12),
    ("service.metrics", 12),
    ("service.filter", 13),
    ("service.datasets", 14),
    ("service.runs", 15),
    ("service.api", 16),
    ("service.app", 17),
    ("service.cli", 17),
    ("service.embedded", 18),
    ("service", 17),
]


def layer(module: str) -> int:
    matches = [
        (len(prefix), rank) for prefix, rank in LAYERS if module == prefix or module.startswith(prefix + ".")
    ]
    assert matches, f"{module} has no layer in LAYERS: add it (and to docs/architecture.md)"
    return max(matches)[1]


def modules() -> dict[str, Path]:
    found = {}
    for package in ("mechanisms", "service"):
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def imports(path: Path, known: dict[str, Path]) -> Iterator[tuple[str, list[str], int]]:
    """(imported module, names taken from it, line) for every import of the house's own modules."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in ("mechanisms", "service"):
                    yield alias.name, [], node.lineno
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] not in ("mechanisms", "service"):
                continue
            plain = [a.name for a in node.names if f"{node.module}.{a.name}" not in known]
            for alias in node.names:  # ``from package import module`` imports that module
                if f"{node.module}.{alias.name}" in known:
                    yield f"{node.module}.{alias.name}", [], node.lineno
            if plain:
                yield node.module, plain, node.lineno


MODULES = modules()
EDGES = {
    name: [(target, names, line) for target, names, line in imports(path, MODULES)]
    for name, path in MODULES.items()
}


def test_every_module_has_a_layer() -> None:
    for name in MODULES:
        layer(name)


def test_imports_point_down() -> None:
    upward = [
        f"{source}:{line} imports {target}"
        for source, edges in EDGES.items()
        for target, _, line in edges
        if layer(target) > layer(source)
    ]
    assert not upward, "imports against the layer rule:\n" + "\n".join(upward)


def test_mechanisms_never_import_the_service() -> None:
    wrong = [
        f"{source} imports {target}"
        for source, edges in EDGES.items()
        if source.startswith("mechanisms")
        for target, _, _ in edges
        if target.startswith("service")
    ]
    assert not wrong, wrong


def test_no_private_name_crosses_a_module() -> None:
    crossing = [
        f"{source}:{line} takes {name} from {target}"
        for source, edges in EDGES.items()
        for target, names, line in edges
        for name in names
        if name.startswith("_") and not name.startswith("__") and target != source
    ]
    assert not crossing, "\n".join(crossing)


def _circles() -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), over module-level arrows."""
    graph = {
        name: sorted({t for t, _, _ in edges if t in MODULES and t != name}) for name, edges in EDGES.items()
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in graph[node]:
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for name in graph:
        if name not in index:
            visit(name)
    return circles


def test_no_import_circles() -> None:
    # package faces (__init__) import their own modules; those arrows are not circles of the design
    circles = [c for c in _circles() if not any(MODULES[m].name == "__init__.py" for m in c)]
    assert not circles, circles


@pytest.mark.parametrize("bad", ["service.api.deps", "service.app"])
def test_the_rule_catches_an_upward_import(bad: str) -> None:
    """The check can fail: the store importing the API (or the composition root) is upward."""
    assert layer(bad) > layer("service.store.models")


def api_imports_of_the_store(edges: dict[str, list[tuple[str, list[str], int]]]) -> list[str]:
    """Every import of ``service.store`` by a module of ``service.api`` (routers call domain functions)."""
    return [
        f"{source}:{line} imports {target}"
        for source, found in edges.items()
        if source == "service.api" or source.startswith("service.api.")
        for target, _, line in found
        if target == "service.store" or target.startswith("service.store.")
    ]


def test_the_api_never_imports_the_store() -> None:
    wrong = api_imports_of_the_store(EDGES)
    assert not wrong, "the API reaches the store directly:\n" + "\n".join(wrong)


def test_the_api_rule_catches_a_store_import() -> None:
    """The check can fail: a router importing a repository is reported."""
    edges = {"service.api.routers.requests": [("service.store.repositories", ["RequestRepository"], 3)]}
    assert api_imports_of_the_store(edges) == [
        "service.api.routers.requests:3 imports service.store.repositories"
    ]


UNIT_OF_WORK = "service.store.unit"
"""The one module of ``service/`` that begins and commits transactions (the CLI uses it too)."""


def transaction_calls(source: str, path: str) -> list[int]:
    """Lines that call ``….begin()`` or ``….commit()`` (a session's, a connection's, anything's but the
    unit of work's own functions, ``unit.begin`` and ``unit.commit``)."""
    return sorted(
        node.lineno
        for node in ast.walk(ast.parse(source, path))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in ("begin", "commit")
        and not (isinstance(node.func.value, ast.Name) and node.func.value.id == "unit")
    )


def test_only_the_unit_of_work_begins_and_commits() -> None:
    calls = [
        f"{name}:{line}"
        for name, path in MODULES.items()
        if name.startswith("service") and name != UNIT_OF_WORK
        for line in transaction_calls(path.read_text(), str(path))
    ]
    assert not calls, f"transactions begun or committed outside {UNIT_OF_WORK}:\n" + "\n".join(calls)
    assert transaction_calls(MODULES[UNIT_OF_WORK].read_text(), UNIT_OF_WORK), "the unit of work commits"


@pytest.mark.parametrize(
    "code", ["with sessions() as s, s.begin():\n    pass\n", "session.commit()\n", "conn.begin()\n"]
)
def test_the_transaction_rule_catches_a_begin_or_commit(code: str) -> None:
    assert transaction_calls(code, "<router>") == [1]
    assert transaction_calls("unit.begin(session)\nunit.commit(session, send)\n", "<runs>") == []
