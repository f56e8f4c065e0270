"""docs/architecture.md walks one request from the router to the ledger, naming the functions it takes.
Every dotted name of the house in that walk must exist, so the page cannot drift from the code."""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
SECTION = "## One request, from router to ledger"


def walk_text() -> str:
    text = (ROOT / "docs" / "architecture.md").read_text()
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    return text[start : end if end != -1 else len(text)]


def dotted_names(text: str) -> list[str]:
    """The code spans of ``text`` that name something of the house (``service.…``, ``mechanisms.…``)."""
    spans = re.findall(r"`([A-Za-z_][\w.]*)`", text)
    return sorted({s for s in spans if s.split(".")[0] in ("service", "mechanisms") and "." in s})


def resolve(name: str) -> object:
    """The module, or the attribute reached from the longest importable module prefix of ``name``."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[cut:]:
            found = getattr(found, attribute)  # AttributeError: the page names what does not exist
        return found
    raise ModuleNotFoundError(name)


NAMES = dotted_names(walk_text())


def test_the_walk_names_the_functions_of_the_path() -> None:
    assert len(NAMES) >= 30
    for essential in (
        "service.runs.admission.transact",
        "service.filter.batch.FilterBatch.reserve",
        "service.store.unit.commit",
    ):
        assert essential in NAMES


@pytest.mark.parametrize("name", NAMES)
def test_every_name_of_the_walk_exists(name: str) -> None:
    found = resolve(name)
    assert isinstance(found, ModuleType) or callable(found), f"{name} is neither a module nor callable"


def test_a_name_that_does_not_exist_is_caught() -> None:
    with pytest.raises(AttributeError):
        resolve("service.runs.admission.admit_locked")
    with pytest.raises(ModuleNotFoundError):
        resolve("servicex.nothing")
