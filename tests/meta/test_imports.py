"""The package graph has no loop, and the engine names its backends' types.

Nodes are the packages of ``src/snapstate`` (``engine``, ``state``, ...) and the modules at its
root (``api``, ``data``, ...); an edge is any import between two of them, at module level or
inside a function, read from the AST (an import deferred into a function is still a loop).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "snapstate"


def node(parts: list[str]) -> str:
    """The package (or root module) that a module path below ``snapstate`` belongs to."""
    if not parts or parts == ["__init__"]:
        return "snapstate"
    return parts[0] + "/" if (SRC / parts[0]).is_dir() else parts[0]


def imported(tree: ast.AST, package: list[str]) -> Iterator[list[str]]:
    """Every ``snapstate`` module path an AST imports (its parts after ``snapstate``)."""
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            yield from (a.name.split(".") for a in n.names)
        elif isinstance(n, ast.ImportFrom):
            if n.level:
                base = ["snapstate", *package[: len(package) - n.level + 1]]
            else:
                base = []
            module = [*base, *(n.module.split(".") if n.module else [])]
            for a in n.names:  # ``from snapstate import data`` imports a module too
                yield [*module, a.name] if len(module) == 1 else module


def package_graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC)
        source = node(list(rel.with_suffix("").parts))
        for target in imported(ast.parse(path.read_text()), list(rel.parent.parts)):
            if target[:1] == ["snapstate"] and (dest := node(target[1:])) != source:
                edges.setdefault(source, set()).add(dest)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan, iterative enough)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = stack[stack.index(v) :]
            del stack[stack.index(v) :]
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_two_packages_import_each_other_even_through_others() -> None:
    edges = package_graph()
    loops = cycles(edges)
    detail = [sorted((a, b) for a in c for b in edges.get(a, ()) if b in c) for c in loops]
    assert not loops, f"package import cycles: {loops}; edges inside them: {detail}"


def test_the_cycle_finder_finds_a_loop_through_a_third_package() -> None:
    assert cycles({"a/": {"b/"}, "b/": {"c"}, "c": {"a/"}, "d": {"a/"}}) == [["a/", "b/", "c"]]
    assert cycles({"a/": {"b/"}, "b/": {"c"}}) == []


def test_the_graph_sees_function_level_and_relative_imports() -> None:
    tree = ast.parse("def f():\n    from snapstate.state import rng\nfrom ..errors import X\n")
    assert sorted(imported(tree, ["engine"])) == [["snapstate", "errors"], ["snapstate", "state"]]
    assert node(["state", "rng"]) == "state/" and node(["errors"]) == "errors"


BACKEND_NAMES = {"storage", "backend", "inner", "durable", "fast"}


def any_typed_backends(path: Path) -> Iterator[str]:
    """Parameters and annotated attributes named like a backend but typed ``Any``."""
    for n in ast.walk(ast.parse(path.read_text())):
        named: list[tuple[str, ast.expr | None]] = []
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = n.args
            named = [(p.arg, p.annotation) for p in [*a.posonlyargs, *a.args, *a.kwonlyargs]]
        elif isinstance(n, ast.AnnAssign):
            target = n.target
            name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
            named = [(name, n.annotation)]
        for name, annotation in named:
            if (
                name in BACKEND_NAMES
                and annotation is not None
                and "Any" in ast.unparse(annotation)
            ):
                yield f"{path.name}:{n.lineno} {name}: {ast.unparse(annotation)}"


def test_no_backend_in_engine_is_typed_any() -> None:
    found = [
        hit for path in sorted((SRC / "engine").glob("*.py")) for hit in any_typed_backends(path)
    ]
    assert not found, f"backends typed Any in engine/ (use Storage or a capability): {found}"


def test_the_any_check_sees_parameters_and_attributes(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text("def f(storage: Any, n: Any) -> None:\n    backend: Any = storage\n")
    assert [h.split(" ", 1)[1] for h in any_typed_backends(sample)] == [
        "storage: Any",
        "backend: Any",
    ]
