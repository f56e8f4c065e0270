"""Citations of the privacy proofs name stable anchors, and every one of them resolves.

The proofs live in ``docs/privacy/*.md``; a result or section is cited as ``docs/privacy/FILE.md#anchor``,
where the anchor is a line ``<a id="anchor"></a>`` in FILE (directly above the heading or the result).
This test scans the repository's text files (code, docs, README, benchmarks, tests) and fails on:

* a citation whose file or anchor does not exist;
* a leftover citation by section number of the old single file (``docs/privacy.md §8.3``, ``§6 rule 2``,
  ``§10.L3``, or a bare ``§n`` next to a new-style citation);
* an anchor name used twice anywhere under docs/privacy/;
* a relative markdown link from docs/privacy/ (or into it) whose target file or anchor does not exist.

The checker itself is tested on a small repository with one mistake of each kind.
"""

from __future__ import annotations

import re
import subprocess
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PRIVACY_DIR = Path("docs/privacy")
TEXT_SUFFIXES = {".py", ".md", ".js", ".html", ".toml", ".yml", ".yaml", ".txt", ".cfg", ".ini", ".sh"}
TEXT_NAMES = {"Makefile", "Dockerfile"}
SKIPPED_PARTS = {"vendor", ".venv", "node_modules", "__pycache__", ".git"}
THIS_FILE = Path(__file__).resolve().relative_to(ROOT)

ANCHOR = re.compile(r'<a id="([^"]+)"></a>')
ANCHOR_NAME = re.compile(r"[a-z0-9]+(?:-[a-z0-9]+)*")
CITATION = re.compile(r"docs/privacy/([a-z0-9_/]+\.md)(?:#([A-Za-z0-9_-]+))?")
MARKDOWN_LINK = re.compile(r"\]\(([^)\s]+)\)")
OLD_FILE = re.compile(r"(?<![\w/-])(?:docs/)?privacy\.md\b")
SECTION = r"§\s?\d+(?:\.\d+)*(?:\.L\d)?"
# forms that only ever pointed into the old privacy.md: its rules, its proof steps and its 10.L* labels
PRIVACY_ONLY_SECTION = re.compile(
    SECTION + r"(?:,? rules? \d|'s (?:rule|last remark)| Steps? \d)|§\s?10\.L\d"
)
BARE_SECTION = re.compile(SECTION)
# a § right after one of these names another source (a note, a paper, another page), not the proofs
OTHER_SOURCE = re.compile(
    r"(?:(?:note|notes/|seed_\d+|et al\.|thesis|paper|DESIGN|Table|App\.|ch\.|RFC|Alg|"
    r"Wang|Redberg|CKS|Steinke|Roth)[^§]{0,25}|(?<![\w/.-])(?!docs/privacy/)[\w/.-]+\.md`?\s?)$",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class Problem:
    path: str
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.message}"


def text_files(root: Path) -> list[Path]:
    """The repository's text files (tracked or new, not ignored), relative to root."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split("\n")
        candidates = [Path(name) for name in listed if name]
    except (OSError, subprocess.CalledProcessError):
        candidates = [path.relative_to(root) for path in root.rglob("*") if path.is_file()]
    return sorted(
        path
        for path in set(candidates)
        if (path.suffix in TEXT_SUFFIXES or path.name in TEXT_NAMES)
        and not SKIPPED_PARTS & set(path.parts)
        and path != THIS_FILE
        and (root / path).is_file()
    )


def privacy_docs(root: Path) -> list[Path]:
    return sorted(path.relative_to(root) for path in (root / PRIVACY_DIR).rglob("*.md"))


def read_lines(root: Path, path: Path) -> list[str]:
    try:
        return (root / path).read_text(encoding="utf-8").split("\n")
    except UnicodeDecodeError:
        return []


def anchors_by_file(root: Path) -> dict[Path, list[str]]:
    return {path: ANCHOR.findall((root / path).read_text(encoding="utf-8")) for path in privacy_docs(root)}


def anchor_problems(root: Path) -> list[Problem]:
    """Duplicate anchor names (across all of docs/privacy/) and names outside the convention."""
    problems = []
    counts = Counter(name for names in anchors_by_file(root).values() for name in names)
    for path, names in anchors_by_file(root).items():
        for name in sorted(set(names)):
            if counts[name] > 1:
                problems.append(Problem(str(path), 0, f"anchor {name!r} is defined {counts[name]} times"))
            if not ANCHOR_NAME.fullmatch(name):
                problems.append(Problem(str(path), 0, f"anchor {name!r} is not lowercase-with-hyphens"))
    return problems


def citation_problems(root: Path, files: list[Path]) -> list[Problem]:
    """Citations docs/privacy/FILE.md#anchor whose file or anchor does not exist."""
    anchors = anchors_by_file(root)
    problems = []
    for path in files:
        for number, line in enumerate(read_lines(root, path), 1):
            for match in CITATION.finditer(line):
                cited, anchor = PRIVACY_DIR / match.group(1), match.group(2)
                if cited not in anchors:
                    problems.append(Problem(str(path), number, f"{match.group(0)}: no file {cited}"))
                elif anchor is not None and anchor not in anchors[cited]:
                    problems.append(
                        Problem(str(path), number, f"{match.group(0)}: no anchor {anchor!r} there")
                    )
    return problems


def section_number_problems(files: list[Path], root: Path) -> list[Problem]:
    """Citations of the proofs by section number (of the old docs/privacy.md) instead of by anchor."""
    problems = []
    for path in files:
        for number, line in enumerate(read_lines(root, path), 1):
            for pattern in (OLD_FILE, PRIVACY_ONLY_SECTION):
                problems += [
                    Problem(str(path), number, f"section-number citation {m.group(0)!r}")
                    for m in pattern.finditer(line)
                ]
            if CITATION.search(line):
                for match in BARE_SECTION.finditer(line):
                    if not OTHER_SOURCE.search(line[: match.start()]):
                        problems.append(
                            Problem(str(path), number, f"bare {match.group(0)!r} beside a citation")
                        )
    return problems


def link_problems(root: Path, files: list[Path]) -> list[Problem]:
    """Relative markdown links in docs/privacy/, or pointing into it, whose file or anchor does not exist."""
    anchors = anchors_by_file(root)
    problems = []
    for path in files:
        if path.suffix != ".md":
            continue
        inside = path.parent == PRIVACY_DIR or PRIVACY_DIR in path.parents
        for number, line in enumerate(read_lines(root, path), 1):
            for match in MARKDOWN_LINK.finditer(line):
                target = match.group(1)
                if re.match(r"[a-z]+:", target):
                    continue
                file_part, _, anchor = target.partition("#")
                resolved = Path(_normalise(path.parent / file_part)) if file_part else path
                if not (inside or resolved.parent == PRIVACY_DIR or PRIVACY_DIR in resolved.parents):
                    continue
                if not (root / resolved).exists():
                    problems.append(Problem(str(path), number, f"link {target}: no file {resolved}"))
                elif anchor and resolved in anchors and anchor not in anchors[resolved]:
                    problems.append(Problem(str(path), number, f"link {target}: no anchor {anchor!r}"))
    return problems


def _normalise(path: Path) -> str:
    parts: list[str] = []
    for part in path.parts:
        if part == "..":
            if parts:
                parts.pop()
        elif part != ".":
            parts.append(part)
    return "/".join(parts)


def all_problems(root: Path) -> list[Problem]:
    files = text_files(root)
    return (
        anchor_problems(root)
        + citation_problems(root, files)
        + section_number_problems(files, root)
        + link_problems(root, files)
    )


# ----- the repository -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def files() -> list[Path]:
    return text_files(ROOT)


def test_the_proofs_have_anchors_and_an_index_that_links_every_file() -> None:
    anchors = anchors_by_file(ROOT)
    assert sum(len(names) for names in anchors.values()) > 100
    index = (ROOT / PRIVACY_DIR / "index.md").read_text(encoding="utf-8")
    unlinked = [path.name for path in anchors if path.name != "index.md" and f"]({path.name})" not in index]
    assert unlinked == [], f"docs/privacy/index.md does not link {unlinked}"


def test_anchor_names_are_unique_and_well_formed() -> None:
    assert anchor_problems(ROOT) == [], "\n".join(map(str, anchor_problems(ROOT)))


def test_every_citation_names_an_existing_file_and_anchor(files: list[Path]) -> None:
    problems = citation_problems(ROOT, files)
    assert problems == [], "\n".join(map(str, problems))
    cited = sum(len(CITATION.findall("\n".join(read_lines(ROOT, path)))) for path in files)
    assert cited > 200  # the scan really sees the code's and the docs' citations


def test_no_citation_by_section_number_is_left(files: list[Path]) -> None:
    problems = section_number_problems(files, ROOT)
    assert problems == [], "\n".join(map(str, problems))


def test_markdown_links_of_the_proofs_resolve(files: list[Path]) -> None:
    problems = link_problems(ROOT, files)
    assert problems == [], "\n".join(map(str, problems))


# ----- the checker on a small repository with one mistake of each kind -----------------------------------


def _write(root: Path, name: str, text: str) -> None:
    (root / name).parent.mkdir(parents=True, exist_ok=True)
    (root / name).write_text(text, encoding="utf-8")


@pytest.fixture
def example(tmp_path: Path) -> Path:
    _write(tmp_path, "docs/privacy/index.md", '<a id="lemma-a"></a>\n# A\n\nSee [B](b.md#theorem-b).\n')
    _write(tmp_path, "docs/privacy/b.md", '<a id="theorem-b"></a>\n## B\n\n[back](index.md#lemma-a)\n')
    _write(tmp_path, "service/good.py", '"""Sound by docs/privacy/b.md#theorem-b (note seed_001 §4.1)."""\n')
    return tmp_path


def test_the_checker_accepts_a_clean_example(example: Path) -> None:
    assert all_problems(example) == []


@pytest.mark.parametrize(
    ("name", "text", "expected"),
    [
        ("service/a.py", "# see docs/privacy/b.md#theorem-c\n", "no anchor 'theorem-c'"),
        ("service/a.py", "# see docs/privacy/c.md#theorem-b\n", "no file docs/privacy/c.md"),
        ("service/a.py", '"""Proof: docs/privacy.md §8.3."""\n', "section-number citation"),
        ("docs/x.md", "Sound (privacy.md, Theorem B).\n", "section-number citation"),
        ("tests/t.py", "# reserve first (§6 rule 2)\n", "section-number citation"),
        ("docs/y.md", "Lemma COUPLE (§10.L3) couples\n", "section-number citation"),
        ("mechanisms/m.py", "# docs/privacy/b.md#theorem-b, §10\n", "bare '§10' beside a citation"),
        ("docs/privacy/c.md", '<a id="theorem-b"></a>\n# C\n', "anchor 'theorem-b' is defined 2 times"),
        ("docs/privacy/c.md", '<a id="Theorem_C"></a>\n# C\n', "is not lowercase-with-hyphens"),
        ("docs/privacy/c.md", "# C\n\n[gone](d.md)\n", "link d.md: no file docs/privacy/d.md"),
        ("docs/privacy/c.md", "# C\n\n[here](#nowhere)\n", "no anchor 'nowhere'"),
        ("docs/z.md", "[B](privacy/b.md#theorem-x)\n", "no anchor 'theorem-x'"),
    ],
)
def test_the_checker_catches_each_kind_of_mistake(example: Path, name: str, text: str, expected: str) -> None:
    _write(example, name, text)
    problems = all_problems(example)
    assert any(expected in str(problem) for problem in problems), problems
