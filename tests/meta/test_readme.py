"""Every Python example of the README runs as it is, each in an empty directory of its own.

An example whose first line is ``# torchrun --nproc-per-node N train.py`` is saved as
``train.py`` and started on N ranks (gloo on loopback), as that line says. An example that
names ``s3://`` runs against a moto S3 server on 127.0.0.1 with one bucket, ``bucket``,
reached through the environment (``AWS_ENDPOINT_URL``...) as the README says. An example that
imports a package this venv lacks (TensorFlow: `make venv-tf`) is skipped, naming it.

A torchrun example also notes, after its last line, that each rank got there. torch 2.13's
gloo teardown can then abort a rank at interpreter exit ("terminate called without an active
exception"), reproduced here without snapstate (a DDP module and a device mesh in one
process: 4 of 16 runs on the 2-core VM; docs/distributed.md). That abort, after every rank ran
every line and assertion of the example, is reported as a warning; anything else fails.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest

from conformance.s3 import S3Server, aws_test_credentials, s3_server  # noqa: F401 - fixtures

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
HEADING = re.compile(r"^(#{2,3}) (.+)$", re.MULTILINE)
TORCHRUN = re.compile(r"\A# torchrun --nproc-per-node (\d+) train\.py\n")
LINK = re.compile(r"\]\(([^)#:]+)\)")
EXAMPLE_BUCKET = "bucket"
RUN_TIMEOUT_S = 600  # a loaded 2-core machine is slow; a hang still fails


@dataclass(frozen=True)
class Example:
    section: str  # the heading it sits under: "Use / Save and load"
    code: str


def examples(text: str) -> list[Example]:
    """The README's ``python`` fenced blocks, each with the headings above it."""
    headings = [(m.start(), len(m.group(1)), m.group(2)) for m in HEADING.finditer(text)]
    found = []
    for block in FENCE.finditer(text):
        if block.group(1) != "python":
            continue
        above = [(level, title) for at, level, title in headings if at < block.start()]
        top = next((t for lv, t in reversed(above) if lv == 2), "")
        sub = above[-1][1] if above and above[-1][0] == 3 else ""
        found.append(Example(f"{top} / {sub}" if sub else top, block.group(2)))
    return found


def missing_packages(code: str) -> list[str]:
    """Top-level packages the example imports that this interpreter cannot import."""
    names = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return sorted(n for n in names if importlib.util.find_spec(n) is None)


def command(example: Example, script: Path) -> list[str]:
    ranks = TORCHRUN.match(example.code)
    if ranks is None:
        return [sys.executable, str(script)]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    return [*launcher, "--nproc-per-node", ranks.group(1), str(script)]


def s3_environment(server: S3Server) -> dict[str, str]:
    """What a user sets to reach an S3-compatible endpoint: the README's variables."""
    server.client().create_bucket(Bucket=EXAMPLE_BUCKET)
    return {"AWS_ENDPOINT_URL": server.endpoint}


ALL = examples(README.read_text())


def test_the_readme_has_examples() -> None:
    assert len(ALL) >= 6, f"found only {len(ALL)} python examples: is the pattern broken?"


def test_each_use_subsection_has_one_example() -> None:
    use = [e.section for e in ALL if e.section.startswith("Use / ")]
    assert use and len(use) == len(set(use)), f"Use subsections with several examples: {use}"
    text = README.read_text()
    subsections = re.findall(r"^### (.+)$", text.split("## Use\n", 1)[1].split("\n## ", 1)[0], re.M)
    assert [s.removeprefix("Use / ") for s in use] == subsections


def test_every_relative_link_exists() -> None:
    targets = LINK.findall(README.read_text())
    assert targets, "the README links no page: is the pattern broken?"
    absent = [t for t in targets if not (ROOT / t).exists()]
    assert not absent, f"README.md links to files that do not exist: {absent}"


@pytest.mark.parametrize("example", ALL, ids=[e.section for e in ALL])
def test_example_runs(example: Example, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    absent = missing_packages(example.code)
    if absent:
        pytest.skip(f"needs {', '.join(absent)} (its own venv: see the README)")
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    if "s3://" in example.code:
        env.update(s3_environment(request.getfixturevalue("s3_server")))
    script = tmp_path / "train.py"
    script.write_text(example.code + (RAN_EVERY_LINE if TORCHRUN.match(example.code) else ""))
    run = subprocess.run(
        command(example, script),
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    if run.returncode != 0 and torch_teardown_abort(example, tmp_path, run.stderr):
        warnings.warn(
            f"{example.section}: ran to its end, then torch aborted at exit", stacklevel=1
        )
        return
    assert run.returncode == 0, f"README example under {example.section!r} failed:\n{run.stderr}"


RAN_EVERY_LINE = '\nimport os as _os\nopen(f"ran-{_os.environ[\'RANK\']}", "w").close()\n'
TEARDOWN_ABORT = "terminate called without an active exception"


def torch_teardown_abort(example: Example, cwd: Path, stderr: str) -> bool:
    """Every rank of a torchrun example ran past its last line, and a rank then aborted in
    torch's C++ teardown (the only failure tolerated, see the module docstring)."""
    ranks = TORCHRUN.match(example.code)
    if ranks is None or TEARDOWN_ABORT not in stderr:
        return False
    return all((cwd / f"ran-{r}").exists() for r in range(int(ranks.group(1))))
