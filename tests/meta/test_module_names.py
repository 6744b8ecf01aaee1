"""No two modules under ``src/snapstate`` share a file name.

Two ``cli.py`` (or ``data.py``, ``base.py``) send a reader, a traceback and a search for the
file to the wrong one; a module's file name should say which module it is. ``__init__.py`` is
the one name every package shares.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "snapstate"


def shared_names(root: Path) -> dict[str, list[str]]:
    """Each module file name found more than once under ``root``, with every path that has it."""
    where: dict[str, list[str]] = defaultdict(list)
    for path in sorted(root.rglob("*.py")):
        if path.name != "__init__.py":
            where[path.name].append(path.relative_to(root).as_posix())
    return {name: paths for name, paths in where.items() if len(paths) > 1}


def test_no_two_modules_share_a_file_name() -> None:
    modules = list(PACKAGE.rglob("*.py"))
    assert len(modules) > 50, f"only {len(modules)} modules under {PACKAGE}: is the path wrong?"
    shared = shared_names(PACKAGE)
    pairs = "; ".join(" and ".join(paths) for paths in shared.values())
    assert not shared, f"modules under src/snapstate share a file name: {pairs}"


def test_the_check_names_the_pair(tmp_path: Path) -> None:
    for rel in ("cli.py", "bench/cli.py", "bench/__init__.py", "__init__.py", "api.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    assert shared_names(tmp_path) == {"cli.py": ["bench/cli.py", "cli.py"]}
