"""The README's test command collects every test file, the multi-rank ones included.

pytest skips folders named ``dist`` or ``build`` by default, and ruff skips ``dist``; a test
folder hidden that way passes by never running. This guards against it.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
COLLECTED = re.compile(r"^(tests/[^:\s]+\.py)(?:::|: \d+$)", re.MULTILINE)
DIST_MARK = re.compile(r"^(pytestmark = .*|@)pytest\.mark\.dist\b", re.MULTILINE)


def readme_test_args() -> list[str]:
    """The pytest arguments of ``make test``, read from the Makefile the README points to."""
    text = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^test:.*\n\t(.+)$", text, re.MULTILINE)
    assert recipe, "Makefile: no recipe line under the 'test' target"
    words = shlex.split(recipe.group(1))
    return words[words.index("pytest") + 1 :]


def collected_files(args: list[str]) -> set[str]:
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    # -q lists "file::test" lines, -qq lists "file: count" lines; accept either.
    return {m.group(1) for m in COLLECTED.finditer(out.stdout)}


def all_test_files() -> list[Path]:
    return sorted(p for p in TESTS.rglob("test_*.py") if ".venv" not in p.parts)


def test_every_test_file_and_every_dist_file_is_collected() -> None:
    files = collected_files(readme_test_args())
    every = {str(p.relative_to(ROOT)) for p in all_test_files()}
    marked = {str(p.relative_to(ROOT)) for p in all_test_files() if DIST_MARK.search(p.read_text())}
    assert marked, "no test file is marked dist: the guard itself is broken"
    assert marked <= files, (
        f"dist-marked test files the test command skips: {sorted(marked - files)}"
    )
    # A file whose every test is slow is deselected by the marker, not hidden by a folder name.
    all_marks = collected_files([a for a in readme_test_args() if a not in ("-m", "not slow")])
    assert every <= all_marks, f"test files pytest never collects: {sorted(every - all_marks)}"
