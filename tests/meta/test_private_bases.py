"""No class under ``src/snapstate`` subclasses a private name imported from another module.

A leading underscore says "this module's own business": a subclass elsewhere ties that module's
internals to a second one (the marker once extended the manifest's ``_Validator``). Shared
behaviour belongs in a public, named helper.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "snapstate"


def private_bases(source: str) -> list[str]:
    """The bases of the module's classes that are private names it imports from elsewhere."""
    tree = ast.parse(source)
    imported = {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
        if alias.name.startswith("_") and not alias.name.startswith("__")
    }
    return [
        f"{node.name}({base.id})"
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
        for base in node.bases
        if isinstance(base, ast.Name) and base.id in imported
    ]


def test_no_class_subclasses_another_modules_private_class() -> None:
    found = {
        path.relative_to(PACKAGE).as_posix(): bases
        for path in sorted(PACKAGE.rglob("*.py"))
        if (bases := private_bases(path.read_text()))
    }
    assert not found, f"classes that subclass another module's private class: {found}"


def test_the_check_catches_an_imported_private_base() -> None:
    source = (
        "from snapstate.format.manifest import _Validator, Manifest\n"
        "class _Own:\n    pass\n"
        "class Check(_Validator):\n    pass\n"
        "class Fine(_Own, Manifest):\n    pass\n"
    )
    assert private_bases(source) == ["Check(_Validator)"]
