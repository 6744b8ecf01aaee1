"""The snapstate command: inspect, verify, ls, export."""

from __future__ import annotations

import importlib.abc
import json
import subprocess
import sys
from pathlib import Path

import click
import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open

import snapstate as ss
from snapstate import cli
from snapstate.cli import main
from support.bits import assert_bitwise_equal
from support.states import trained


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output


def training_state() -> dict:
    model, opt = trained((4, 8, 2), batch=3)
    return {
        "model": model,
        "optim": opt,
        "arr": np.arange(6, dtype=np.int16),
        "epoch": 7,
        "lr": 0.5,
    }


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    path = tmp_path_factory.mktemp("cli") / "c"
    state = training_state()
    ss.save(state, path, step=42)
    return path, state


def test_inspect_table(checkpoint) -> None:
    path, _ = checkpoint
    code, out = run("inspect", str(path))
    assert code == 0
    for text in (
        "model/0.weight",
        "float32",
        "[8, 4]",
        "optim/state/0/exp_avg",
        "step 42",
        "files: 1",
    ):
        assert text in out, text
    assert "blocking" in out and "write" in out  # save timings


def test_inspect_json(checkpoint) -> None:
    path, state = checkpoint
    code, out = run("inspect", str(path), "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc["format"] == "snapstate/2" and doc["step"] == 42 and doc["world_size"] == 1
    weight = doc["tensors"]["model/0.weight"]
    assert weight == {
        "dtype": "float32",
        "shape": [8, 4],
        "placement": "replicate",
        "bytes": 128,
        "chunks": 1,
    }
    assert doc["tensors"]["arr"]["dtype"] == "int16"
    (shard,) = doc["files"]
    assert doc["files"][shard]["bytes"] == (path / shard).stat().st_size
    assert doc["timings"]["per_rank"][0]["blocking_s"] >= 0


def test_verify_ok_then_corrupt(tmp_path: Path) -> None:
    ss.save({"w": torch.randn(100), "v": torch.randn(10)}, tmp_path / "c")
    code, out = run("verify", str(tmp_path / "c"))
    assert code == 0 and out.startswith("ok: 2 tensors")
    chunk = ss.inspect(tmp_path / "c").tensors["w"].chunks[0]
    shard = tmp_path / "c" / chunk.file
    data = bytearray(shard.read_bytes())
    data[chunk.start + 17] ^= 0x01
    shard.write_bytes(bytes(data))
    code, out = run("verify", str(tmp_path / "c"))
    assert code == 1
    assert "checksum mismatch" in out and chunk.file in out and "'w'" in out


def test_verify_and_inspect_of_a_missing_checkpoint(tmp_path: Path) -> None:
    for command in ("verify", "inspect"):
        code, out = run(command, str(tmp_path / "absent"))
        assert code == 1 and "no committed checkpoint" in out


def test_ls_shows_committed_and_uncommitted_steps(tmp_path: Path) -> None:
    with ss.CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(100, {"x": torch.zeros(1024)})
        mgr.save(200, {"x": torch.zeros(2048)})
    (tmp_path / "step-000000300" / "shards").mkdir(parents=True)  # a save that never committed
    code, out = run("ls", str(tmp_path))
    assert code == 0
    lines = {
        line.split()[1]: line
        for line in out.splitlines()
        if line.split()[1:2] and line.split()[1].isdigit()
    }
    assert "committed" in lines["100"] and "4.1 KiB" in lines["100"]
    assert "committed" in lines["200"] and "8.1 KiB" in lines["200"]
    assert "uncommitted" in lines["300"]


def test_inspect_of_a_manager_root_lists_the_steps_and_the_newest_valid(tmp_path: Path) -> None:
    with ss.CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(100, {"x": torch.zeros(4)})
        mgr.save(200, {"x": torch.zeros(4)})
    (tmp_path / "step-000000200" / "manifest.json").write_text("{not json")  # damaged
    (tmp_path / "step-000000300" / "shards").mkdir(parents=True)  # never committed
    code, out = run("inspect", str(tmp_path))
    assert code == 0, out
    assert "newest valid step: 100" in out
    rows = {line.split()[1]: line for line in out.splitlines() if line[2:5].isdigit()}
    assert "committed" in rows["100"] and "invalid" in rows["200"] and "uncommitted" in rows["300"]
    code, out = run("inspect", str(tmp_path), "--json")
    doc = json.loads(out)
    assert doc["newest_valid"] == 100 and [s["step"] for s in doc["steps"]] == [100, 200, 300]


@pytest.mark.parametrize("what", ["missing", "a file", "an empty directory", "a checkpoint"])
def test_ls_of_what_is_no_manager_root_fails_in_one_line(tmp_path: Path, what: str) -> None:
    path = tmp_path / "p"
    if what == "a file":
        path.write_text("x")
    elif what == "an empty directory":
        path.mkdir()
    elif what == "a checkpoint":
        ss.save({"x": torch.zeros(2)}, path)
    result = CliRunner().invoke(main, ["ls", str(path)])
    assert result.exit_code == 1 and result.stdout == ""
    (line,) = result.stderr.splitlines()
    assert line.startswith("error: ") and str(path) in line
    assert ("see snapstate inspect" in line) == (what == "a checkpoint")


def test_inspect_prints_long_keys_whole(tmp_path: Path) -> None:
    key = "encoder.layers.11.self_attention.query_key_value_projection." * 3 + "weight"
    ss.save({"model": {key: torch.zeros(2)}}, tmp_path / "c")
    code, out = run("inspect", str(tmp_path / "c"))
    assert code == 0
    assert any(f"model/{key}" in line for line in out.splitlines()), out


@pytest.mark.parametrize(
    "args",
    [
        ["inspect"],
        ["export", "{ckpt}", "--to", "zip", "{tmp}/o"],
        ["export", "{ckpt}", "--to", "torch", "{tmp}"],
        ["export", "{tmp}/absent", "--to", "hf", "{tmp}/o"],
        ["nope"],
    ],
    ids=["usage", "bad-choice", "onto-a-directory", "no-checkpoint", "no-command"],
)
def test_every_error_of_the_command_is_one_line(tmp_path: Path, args: list[str]) -> None:
    ss.save({"x": torch.zeros(2)}, tmp_path / "c")
    argv = [a.format(ckpt=tmp_path / "c", tmp=tmp_path) for a in args]
    script = Path(sys.executable).with_name("snapstate")
    done = subprocess.run([str(script), *argv], capture_output=True, text=True, timeout=120)
    assert done.returncode in (1, 2) and done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert line.startswith("error: ") and "Traceback" not in line


def test_export_to_torch_loads_with_weights_only(checkpoint, tmp_path: Path) -> None:
    path, state = checkpoint
    out = tmp_path / "model.pt"
    code, text = run("export", str(path), "--to", "torch", str(out))
    assert code == 0 and "wrote" in text
    loaded = torch.load(out, weights_only=True)
    for key, value in state["model"].state_dict().items():
        assert_bitwise_equal(loaded["model"][key], value)
    for index, slots in state["optim"].state_dict()["state"].items():
        for name, value in slots.items():
            assert_bitwise_equal(loaded["optim"]["state"][index][name], value)
    assert loaded["optim"]["param_groups"][0]["betas"] == (0.9, 0.999)
    assert torch.equal(loaded["arr"], torch.arange(6, dtype=torch.int16))
    assert loaded["epoch"] == 7 and loaded["lr"] == 0.5


def test_export_to_safetensors(checkpoint, tmp_path: Path) -> None:
    path, state = checkpoint
    out = tmp_path / "model.safetensors"
    code, _ = run("export", str(path), "--to", "safetensors", str(out))
    assert code == 0
    with safe_open(str(out), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open is not a dict
        values = json.loads(f.metadata()["values"])
    for key, value in state["model"].state_dict().items():
        assert_bitwise_equal(tensors[f"model/{key}"], value)
    assert_bitwise_equal(
        tensors["optim/state/1/exp_avg"], state["optim"].state_dict()["state"][1]["exp_avg"]
    )
    assert values["epoch"] == 7 and values["optim/param_groups/0/lr"] == 0.001


def test_console_script_verify_exit_code(tmp_path: Path) -> None:
    ss.save({"w": torch.randn(64)}, tmp_path / "c")
    chunk = ss.inspect(tmp_path / "c").tensors["w"].chunks[0]
    shard = tmp_path / "c" / chunk.file
    data = bytearray(shard.read_bytes())
    data[chunk.end - 1] ^= 0x80
    shard.write_bytes(bytes(data))
    script = Path(sys.executable).with_name("snapstate")
    done = subprocess.run(
        [str(script), "verify", str(tmp_path / "c")], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1 and "checksum mismatch" in done.stderr


class RaiseOnImport(importlib.abc.MetaPathFinder):
    """A finder that fails the import of one module with a chosen error, as a broken install would."""

    def __init__(self, module: str, error: ImportError) -> None:
        self.module, self.error = module, error

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name == self.module:
            raise self.error


def attach_with_failing_import(monkeypatch: pytest.MonkeyPatch, error: ImportError) -> click.Group:
    monkeypatch.delitem(sys.modules, "snapstate.bench.command", raising=False)
    finder = RaiseOnImport("snapstate.bench.command", error)
    monkeypatch.setattr(sys, "meta_path", [finder, *sys.meta_path])
    group = click.Group("snapstate")
    cli.attach_bench(group)
    return group


def test_bench_without_an_optional_package_says_which_and_how_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    missing = ModuleNotFoundError("No module named 'matplotlib'", name="matplotlib")
    group = attach_with_failing_import(monkeypatch, missing)
    for args in (["bench", "--preset", "smoke"], ["bench", "report", "r.json"], ["demo"]):
        result = CliRunner().invoke(group, args)
        assert result.exit_code == 1, result.output
        assert "'matplotlib'" in result.output and "pip install 'snapstate[bench]'" in result.output


@pytest.mark.parametrize(
    "error",
    [
        ImportError("cannot import name 'PRESETS' from 'snapstate.bench.presets'"),
        ModuleNotFoundError("No module named 'snapstate.bench.gone'", name="snapstate.bench.gone"),
        ModuleNotFoundError("No module named 'psutil'", name="psutil"),
    ],
    ids=["broken-name", "missing-harness-module", "missing-core-dependency"],
)
def test_a_broken_harness_is_raised_not_hidden(
    monkeypatch: pytest.MonkeyPatch, error: ImportError
) -> None:
    with pytest.raises(ImportError) as raised:
        attach_with_failing_import(monkeypatch, error)
    assert raised.value is error


def test_the_command_fails_to_start_when_the_harness_is_broken() -> None:
    code = "import sys; sys.modules['snapstate.bench.presets'] = None; import snapstate.cli"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "snapstate.bench.presets" in done.stderr
    assert "ModuleNotFoundError" in done.stderr


def test_the_bench_commands_are_attached() -> None:
    assert {"bench", "demo", "plan-sim"} <= set(main.commands)
    assert isinstance(main.commands["bench"], click.Group)  # the harness, not a stand-in
