"""docs/architecture.md names only paths that exist, and names every package folder of the source.

The page is the map a new maintainer reads first; a module moved without updating it would
send them to a file that is gone. Paths are the backticked spans ending in ``/`` or ``.py``:
``src/snapstate/engine/``, ``tests/unit/``, or short forms below the package (``engine/save.py``,
``api.py``), which resolve against ``src/snapstate/``.
"""

from __future__ import annotations

import re
from pathlib import Path

import snapstate as ss

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
PACKAGE = ROOT / "src" / "snapstate"
FENCED = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
SPAN = re.compile(r"`([^`\n]+)`")
PATHLIKE = re.compile(r"^[A-Za-z_][\w./-]*(?:/|\.py)$")
ROOTED = ("src/", "tests/", "benchmarks/", "docs/")


def named_paths(text: str) -> list[tuple[str, Path]]:
    """The backticked paths of a Markdown text outside fenced blocks, each with where it points.

    A bare file name (``save.py``) belongs to the folder named last before it on its line (a
    table row: ``engine/`` then its modules), else to the package.
    """
    found = []
    for line in FENCED.sub("", text).splitlines():
        folder: Path | None = None
        for span in SPAN.findall(line):
            if not PATHLIKE.match(span):
                continue
            where = ROOT / span if span.startswith(ROOTED) else PACKAGE / span
            if "/" not in span and folder is not None:
                where = folder / span
            found.append((span, where))
            if span.endswith("/"):
                folder = where
    return found


def missing(paths: list[tuple[str, Path]]) -> list[str]:
    return [span for span, where in paths if not where.exists()]


def package_folders() -> list[str]:
    return sorted(
        f"{p.parent.relative_to(PACKAGE).as_posix()}/"
        for p in PACKAGE.rglob("__init__.py")
        if p.parent != PACKAGE
    )


def test_every_path_the_page_names_exists() -> None:
    paths = named_paths(DOC.read_text())
    assert len(paths) > 40, f"the page names only {len(paths)} paths: is the pattern broken?"
    gone = missing(paths)
    assert not gone, f"docs/architecture.md names paths that do not exist: {gone}"


def test_every_package_folder_is_on_the_page() -> None:
    named = {where for _, where in named_paths(DOC.read_text())}
    folders = package_folders()
    assert "engine/" in folders and "collective/" in folders
    absent = [f for f in folders if PACKAGE / f not in named]
    assert not absent, f"package folders docs/architecture.md does not describe: {absent}"


def test_every_public_name_is_on_the_page() -> None:
    spans = set(SPAN.findall(DOC.read_text()))
    absent = [n for n in ss.__all__ if n not in spans]
    assert not absent, f"public names docs/architecture.md does not list: {absent}"


def test_the_check_catches_a_moved_module() -> None:
    text = (
        "see `engine/save.py`, `dist/trees.py` and `manifest.json`\n"
        "| `tests/unit/` | `helpers.py` |\n"
        "| `engine/` | `save.py`, `commit.py` |\n"
        "```\n`x/`\n```\n"
    )
    paths = named_paths(text)
    spans = ["engine/save.py", "dist/trees.py", "tests/unit/", "helpers.py", "engine/", "save.py"]
    assert [span for span, _ in paths] == [*spans, "commit.py"]
    assert paths[3][1] == ROOT / "tests" / "unit" / "helpers.py"
    assert paths[5][1] == PACKAGE / "engine" / "save.py"
    assert missing(paths) == ["dist/trees.py", "helpers.py"]
