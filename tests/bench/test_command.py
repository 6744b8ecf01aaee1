"""Command-line options become a sweep configuration; bad names are refused before anything runs."""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner

from snapstate.bench.command import bench, build_config, demo
from snapstate.bench.presets import PRESETS


def options(**given: str | int | None) -> dict[str, str | int | None]:
    base: dict[str, str | int | None] = dict.fromkeys(
        (
            "methods",
            "models",
            "gpt_sizes",
            "ranks",
            "steps",
            "every",
            "repeats",
            "batch",
            "data_dir",
            "ckpt_dir",
        )
    )
    return {**base, **given}


def test_overrides_apply_to_the_preset() -> None:
    cfg = build_config("smoke", **options(methods="dcp,snapstate", ranks="1,2,4", steps=9))
    assert cfg.methods == ("dcp", "snapstate") and cfg.ranks == (1, 2, 4) and cfg.steps == 9
    assert cfg.every == PRESETS["smoke"].every  # untouched options keep the preset's value


def test_gpt_sizes_add_models() -> None:
    cfg = build_config("smoke", **options(models="vgg16", gpt_sizes="10M,1B"))
    assert cfg.models == ("vgg16", "gpt:p=10M", "gpt:p=1B")


def test_unknown_names_are_refused() -> None:
    with pytest.raises(click.BadParameter, match="known"):
        build_config("smoke", **options(methods="pickle-everything"))
    with pytest.raises(click.BadParameter, match="known"):
        build_config("smoke", **options(models="alexnet"))


def test_help_lists_presets_and_subcommands() -> None:
    out = CliRunner().invoke(bench, ["--help"])
    assert out.exit_code == 0
    assert "smoke" in out.output and "report" in out.output
    assert CliRunner().invoke(demo, ["--help"]).exit_code == 0
