"""SaveOptions: every field documented where ``help()`` shows it, and keywords that cannot
contradict the options they come with."""

from __future__ import annotations

import dataclasses
import inspect
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


def test_save_async_save_and_the_manager_share_one_options_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every save reaches the engine through api._start with with_keywords' merge: the same
    settings, given as keywords, options or a manager's, arrive as the same SaveOptions."""
    arrived: list[ss.SaveOptions] = []
    real = ss.api.start_save

    def recording(*args: object, options: ss.SaveOptions, **kwargs: object) -> ss.SaveHandle:
        arrived.append(options)
        return real(*args, options=options, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(ss.api, "start_save", recording)
    given = ss.SaveOptions(threads=2)
    state = {"x": torch.ones(3)}
    ss.save(state, tmp_path / "a", timeout=30.0, options=given)
    ss.async_save(state, tmp_path / "b", timeout=30.0, options=given).wait()
    for async_save in (False, True):
        with ss.CheckpointManager(
            tmp_path / f"m{async_save}", async_save=async_save, timeout=30.0, options=given
        ) as mgr:
            mgr.save(1, state).wait()
    assert arrived == [dataclasses.replace(given, timeout=30.0)] * 4


@pytest.mark.parametrize("entry", ["save", "async_save", "manager"])
def test_every_entry_names_the_contradicted_field(entry: str, tmp_path: Path) -> None:
    options = ss.SaveOptions(timeout=60)
    with pytest.raises(ValueError, match=r"^timeout=5 contradicts options.timeout=60"):
        if entry == "manager":
            ss.CheckpointManager(tmp_path, timeout=5, options=options)
        else:
            getattr(ss, entry)({"x": torch.ones(3)}, tmp_path / "c", timeout=5, options=options)
    assert not (tmp_path / "c").exists()


def test_async_save_takes_the_keywords_of_save_and_a_pool() -> None:
    """One set of keywords: async_save's are save's (same defaults, same types) plus ``pool``."""
    blocking = inspect.signature(ss.save).parameters
    background = dict(inspect.signature(ss.async_save).parameters)
    assert background.pop("pool").default is None
    assert list(background.values()) == list(blocking.values())
