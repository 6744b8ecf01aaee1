"""Exports of a full training checkpoint: one torch or safetensors file, or the model in the
Hugging Face layout (read back here with safetensors; tests/integrations loads it in transformers)."""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import load_file

import snapstate as ss
from snapstate.cli import main
from snapstate.hfexport import parse_size
from support.bits import assert_bitwise_equal


class Tied(torch.nn.Module):
    """A language-model shape: the output projection is the embedding (one Parameter)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(50, 8)
        self.body = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 50, bias=False)
        self.head.weight = self.embed.weight


def invoke(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.stdout, result.stderr


@pytest.fixture(scope="module")
def training(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Tied]:
    torch.manual_seed(0)
    model = Tied()
    opt = torch.optim.AdamW(model.parameters())
    model.head(model.body(model.embed(torch.tensor([1, 2, 3])))).sum().backward()
    opt.step()
    hparams = {
        "path": pathlib.Path("/data"),
        "dtype": torch.bfloat16,
        "when": datetime.datetime(2026, 1, 2),
        "ns": argparse.Namespace(a=1),
        "tags": {"a", "b"},
    }
    state = {"model": model, "optim": opt, "rng": ss.RNGState(), "hp": hparams, "step": 3}
    state["loader"] = ss.RankLocal({"position": 17})
    path = tmp_path_factory.mktemp("export") / "ckpt"
    ss.save(state, path)
    return path, model


def test_to_torch_loads_weights_only_and_names_what_it_left_out(training, tmp_path) -> None:
    path, model = training
    code, out, err = invoke("export", str(path), "--to", "torch", str(tmp_path / "s.pt"))
    assert code == 0 and "wrote" in out
    loaded = torch.load(tmp_path / "s.pt", weights_only=True)
    for key, value in model.state_dict().items():
        assert_bitwise_equal(loaded["model"][key], value)
    assert loaded["hp"] == {"dtype": torch.bfloat16, "tags": {"a", "b"}} and loaded["step"] == 3
    assert set(loaded) == {"model", "optim", "hp", "step"}
    (note,) = err.splitlines()
    for left_out in ("rng", "loader", "hp/path (PosixPath)", "hp/when (datetime)", "hp/ns"):
        assert left_out in note, note


def test_to_safetensors_puts_json_values_in_the_metadata(training, tmp_path) -> None:
    path, model = training
    code, _, err = invoke("export", str(path), "--to", "safetensors", str(tmp_path / "s.st"))
    assert code == 0
    tensors = load_file(tmp_path / "s.st")
    for key, value in model.state_dict().items():  # a tied weight under each of its names
        assert_bitwise_equal(tensors[f"model/{key}"], value)
    with safe_open(str(tmp_path / "s.st"), "pt") as f:
        values = json.loads(f.metadata()["values"])
    assert values["step"] == 3 and values["optim/param_groups/0/lr"] == 0.001
    assert "hp/dtype (dtype)" in err and "hp/tags (set)" in err and "rng" in err


def test_hf_export_has_no_prefix_and_the_tied_weight_once(training, tmp_path) -> None:
    path, model = training
    config = tmp_path / "config.json"
    config.write_text('{"model_type": "tied"}')
    notes: list[str] = []
    files = ss.export_hf(path, tmp_path / "hf", config=config, say=notes.append)
    assert files == ["model.safetensors", "config.json"]
    assert (tmp_path / "hf" / "config.json").read_text() == config.read_text()
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}  # transformers refuses a file without it
        stored = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - not a dict
    expected = model.state_dict()
    del expected["head.weight"]  # tied to embed.weight: stored once, as save_pretrained does
    assert set(stored) == set(expected)
    for key, value in expected.items():
        assert_bitwise_equal(stored[key], value)
    assert notes == ["tied weights written once: head.weight (= embed.weight)"]


def test_a_sharded_hf_export_has_an_index_covering_every_tensor(training, tmp_path) -> None:
    path, model = training
    files = ss.export_hf(path, tmp_path / "hf", max_shard_size=200)  # 1600, 256, 32 bytes
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert files == [*shards, "model.safetensors.index.json"] and len(shards) == 3
    assert shards[0] == "model-00001-of-00003.safetensors"
    assert not (tmp_path / "hf" / "model.safetensors").exists()
    merged: dict[str, torch.Tensor] = {}
    for shard in shards:
        part = load_file(tmp_path / "hf" / shard)
        assert all(index["weight_map"][k] == shard for k in part)
        assert len(part) == 1 or sum(t.numel() * t.element_size() for t in part.values()) <= 200
        merged.update(part)
    expected = {k: v for k, v in model.state_dict().items() if k != "head.weight"}
    assert set(merged) == set(expected)
    for key, value in expected.items():
        assert_bitwise_equal(merged[key], value)
    total = sum(t.numel() * t.element_size() for t in expected.values())
    assert index["metadata"]["total_size"] == total


def test_shard_sizes_read_as_transformers_writes_them() -> None:
    assert parse_size("5GB") == 5 * 10**9 and parse_size("500MiB") == 500 * 2**20
    assert parse_size(1234) == 1234 and parse_size("20000") == 20000
    for bad in ("5QB", "-1", "0", "GB", True):
        with pytest.raises(ValueError, match="max shard size"):
            parse_size(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("to", ["torch", "safetensors", "hf"])
def test_an_existing_target_is_one_line_and_left_as_it_was(training, tmp_path, to) -> None:
    path, _ = training
    (tmp_path / "taken").write_text("mine")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("mine")
    for target in ("taken", "full"):
        code, out, err = invoke("export", str(path), "--to", to, str(tmp_path / target))
        assert code == 1 and out == "", (out, err)
        assert err.startswith("error: ") and len(err.splitlines()) == 1 and target in err
    assert (tmp_path / "taken").read_text() == "mine" and os_listing(tmp_path / "full") == ["x"]


def test_an_empty_directory_takes_an_hf_export(training, tmp_path) -> None:
    path, _ = training
    (tmp_path / "hf").mkdir()
    assert ss.export_hf(path, tmp_path / "hf") == ["model.safetensors"]


@pytest.mark.parametrize(
    ("key", "message"),
    [("nope", "nope: missing in checkpoint"), ("step", "holds a value of type int")],
)
def test_a_key_that_is_no_model_fails_and_leaves_nothing(training, tmp_path, key, message) -> None:
    path, _ = training
    code, _, err = invoke("export", str(path), "--to", "hf", str(tmp_path / "hf"), "--key", key)
    assert code == 1 and message in err and len(err.splitlines()) == 1
    assert os_listing(tmp_path) == []  # neither the directory nor its temporary sibling


def test_options_of_hf_alone_are_refused_for_a_file(training, tmp_path) -> None:
    path, _ = training
    code, _, err = invoke("export", str(path), "--to", "torch", str(tmp_path / "x"), "--key", "m")
    assert code == 2 and "--key applies only to --to hf" in err and len(err.splitlines()) == 1


def os_listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())
