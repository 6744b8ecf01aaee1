"""SaveOptions: every field documented where ``help()`` shows it, and keywords that cannot
contradict the options they come with."""

from __future__ import annotations

import dataclasses
import pydoc
from pathlib import Path

import pytest
import torch

import snapstate as ss


@pytest.mark.parametrize("cls", [ss.SaveOptions, ss.PlanOptions])
def test_every_field_is_documented_in_help(cls: type) -> None:
    shown = pydoc.render_doc(cls, renderer=pydoc.plaintext)
    missing = [
        f.name for f in dataclasses.fields(cls) if f"``{f.name}``:" not in (cls.__doc__ or "")
    ]
    assert not missing, f"{cls.__name__} fields without a line in its docstring: {missing}"
    for f in dataclasses.fields(cls):
        assert f"{f.name}``:" in shown


def test_a_keyword_fills_in_a_field_the_options_leave_at_its_default(tmp_path: Path) -> None:
    ss.save({"x": torch.zeros(3)}, tmp_path / "c")
    options = ss.SaveOptions(threads=2)  # overwrite left at its default
    ss.save({"x": torch.ones(3)}, tmp_path / "c", overwrite=True, options=options)
    target = {"x": torch.zeros(3)}
    ss.load(target, tmp_path / "c")
    assert torch.equal(target["x"], torch.ones(3))


def test_a_keyword_that_agrees_with_the_options_is_accepted(tmp_path: Path) -> None:
    options = ss.SaveOptions(timeout=30.0, overwrite=True)
    ss.save({"x": torch.zeros(3)}, tmp_path / "c", timeout=30.0, overwrite=True, options=options)
    assert ss.verify(tmp_path / "c").ok


@pytest.mark.parametrize("call", [ss.save, ss.async_save])
def test_overwrite_false_cannot_unset_the_options_overwrite(call: object, tmp_path: Path) -> None:
    ss.save({"x": torch.zeros(3)}, tmp_path / "c")
    options = ss.SaveOptions(overwrite=True)
    with pytest.raises(ValueError, match=r"overwrite=False contradicts options.overwrite=True"):
        call({"x": torch.ones(3)}, tmp_path / "c", overwrite=False, options=options)  # type: ignore[operator]
    target = {"x": torch.ones(3)}
    ss.load(target, tmp_path / "c")  # refused before anything was touched
    assert torch.equal(target["x"], torch.zeros(3))


def test_a_timeout_that_contradicts_the_options_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"timeout=5 contradicts options.timeout=60"):
        ss.save(
            {"x": torch.zeros(3)}, tmp_path / "c", timeout=5, options=ss.SaveOptions(timeout=60)
        )
    assert not (tmp_path / "c").exists()


def test_a_manager_refuses_a_timeout_that_contradicts_its_options(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="timeout"):
        ss.CheckpointManager(tmp_path, timeout=5, options=ss.SaveOptions(timeout=60))
    with ss.CheckpointManager(tmp_path, timeout=5, options=ss.SaveOptions(threads=2)) as mgr:
        assert mgr.options.timeout == 5 and mgr.options.threads == 2
