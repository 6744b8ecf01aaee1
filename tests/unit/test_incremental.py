"""Incremental saves under a manager: unchanged chunks referenced, not written; loads, verify,
retention, the fallback of restore and ``copy`` resolve the references."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import snapstate as ss
from fault.corrupt import flip_byte
from snapstate.copystep import copy_step
from snapstate.format.manifest import seal
from snapstate.manager import step_dir
from snapstate.references import damaged_files, verify_steps

FROZEN, HEAD = (512, 256), (64, 256)  # float32: 512 KiB frozen, 64 KiB trained


def make_state(seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "frozen": torch.randn(FROZEN, generator=g),
        "head": torch.randn(HEAD, generator=g),
        "step": 0,
    }


def blank() -> dict[str, Any]:
    return {"frozen": torch.zeros(FROZEN), "head": torch.zeros(HEAD), "step": -1}


def shard_bytes(step: Path) -> int:
    return sum(f.stat().st_size for f in step.rglob("*.safetensors"))


def manifest(root: Path, step: int) -> dict[str, Any]:
    return json.loads((root / step_dir(step) / "manifest.json").read_bytes())


def train(state: dict[str, Any], step: int) -> None:
    state["head"].add_(1.0)
    state["step"] = step


def save_steps(root: Path, steps: int, **kwargs: Any) -> dict[int, dict[str, Any]]:
    """Save ``steps`` steps with only the head changing; returns each step's values."""
    state = make_state()
    saved = {}
    with ss.CheckpointManager(root, incremental=True, **kwargs) as mgr:
        for step in range(1, steps + 1):
            train(state, step)
            mgr.save(step, state)
            mgr.wait()
            saved[step] = {
                k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()
            }
    return saved


def assert_loads(path: Path, expected: dict[str, Any]) -> None:
    target = blank()
    ss.load(target, path)
    for key in ("frozen", "head"):
        assert torch.equal(target[key], expected[key]), key
    assert target["step"] == expected["step"]
    assert ss.verify(path).ok


@pytest.mark.parametrize("async_save", [False, True], ids=["blocking", "async"])
def test_second_save_writes_only_the_changed_bytes(tmp_path: Path, async_save: bool) -> None:
    saved = save_steps(tmp_path, 2, async_save=async_save)
    first, second = tmp_path / step_dir(1), tmp_path / step_dir(2)
    head_bytes = 64 * 256 * 4
    assert shard_bytes(first) > 512 * 256 * 4 + head_bytes
    header = (second / "shards" / "r00000-000.safetensors").read_bytes()[:8]
    written = shard_bytes(second)
    assert written == head_bytes + 8 + int.from_bytes(header, "little")  # the head, no more
    doc = manifest(tmp_path, 2)
    assert doc["version"] == 4 and manifest(tmp_path, 1)["version"] == 2
    assert set(doc["files"]) == {
        "shards/r00000-000.safetensors",
        f"../{step_dir(1)}/shards/r00000-000.safetensors",
    }
    chunks = [c for t in doc["tensors"].values() for c in t["chunks"]]
    assert all(len(c["digest"]) == 32 for c in chunks)
    assert doc["tensors"]["frozen"]["chunks"][0]["file"].startswith(f"../{step_dir(1)}/")
    for step in (1, 2):
        assert_loads(tmp_path / step_dir(step), saved[step])


def test_references_never_chain_and_a_fully_unchanged_file_is_not_written(tmp_path: Path) -> None:
    # one file per tensor: the frozen one's file is referenced whole, never rewritten
    options = ss.SaveOptions(plan=ss.PlanOptions(max_file_bytes=1))
    saved = save_steps(tmp_path, 3, async_save=False, options=options)
    doc = manifest(tmp_path, 3)
    frozen_file = doc["tensors"]["frozen"]["chunks"][0]["file"]
    assert frozen_file.startswith(f"../{step_dir(1)}/")  # step 1 wrote it, not step 2
    assert len(list((tmp_path / step_dir(3) / "shards").iterdir())) == 1
    assert_loads(tmp_path / step_dir(3), saved[3])


@pytest.mark.parametrize("async_save", [False, True], ids=["blocking", "async"])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_chunk_in_many_pieces_is_decided_whole(
    tmp_path: Path, async_save: bool, threads: int
) -> None:
    # pieces of 16 KiB: the 512 KiB frozen chunk arrives in 32 pieces, held until the last
    # (an async save's staging buffers are reused meanwhile)
    plan = ss.PlanOptions(max_file_bytes=1 if threads > 1 else 2 << 30)  # a file per tensor
    options = ss.SaveOptions(piece_bytes=16 << 10, block_bytes=4096, threads=threads, plan=plan)
    state = make_state()
    with ss.CheckpointManager(
        tmp_path, incremental=True, async_save=async_save, options=options
    ) as m:
        m.save(1, state)
        m.wait()
        state["frozen"][100, 7] += 1.0  # one element of the large chunk changes
        state["step"] = 2
        m.save(2, state)
        m.wait()
        state["step"] = 3
        m.save(3, state)  # nothing changes
    doc2, doc3 = manifest(tmp_path, 2), manifest(tmp_path, 3)
    assert not doc2["tensors"]["frozen"]["chunks"][0]["file"].startswith("../")
    assert doc2["tensors"]["head"]["chunks"][0]["file"].startswith("../")
    # the frozen chunk where step 2 wrote it, the head where step 1 did: no chain
    assert {f.split("/")[1] for f in doc3["files"]} == {step_dir(1), step_dir(2)}
    assert doc3["tensors"]["frozen"]["chunks"][0]["file"].startswith(f"../{step_dir(2)}/")
    assert doc3["tensors"]["head"]["chunks"][0]["file"].startswith(f"../{step_dir(1)}/")
    assert shard_bytes(tmp_path / step_dir(3)) == 0
    assert_loads(tmp_path / step_dir(3), state)


def test_retention_keeps_referenced_files_and_drops_them_once_unreferenced(tmp_path: Path) -> None:
    saved = save_steps(tmp_path, 3, keep_last=1, async_save=False)
    assert ss.CheckpointManager(tmp_path).steps() == [3]
    old = tmp_path / step_dir(1)
    assert not (old / "manifest.json").exists()  # no longer a step
    assert (old / "shards" / "r00000-000.safetensors").exists()  # step 3 references it
    assert not (tmp_path / step_dir(2)).exists()  # nothing of step 2 is referenced
    assert_loads(tmp_path / step_dir(3), saved[3])
    state = make_state(seed=1)  # everything changes: step 1's file is needed no more
    with ss.CheckpointManager(tmp_path, keep_last=1, incremental=True, async_save=False) as m:
        m.save(4, state)
    assert not old.exists() and not (tmp_path / step_dir(3)).exists()
    assert ss.verify(tmp_path / step_dir(4)).ok


def test_verify_names_every_step_a_damaged_shared_file_breaks(tmp_path: Path) -> None:
    save_steps(tmp_path, 3, async_save=False)
    shared = tmp_path / step_dir(1) / "shards" / "r00000-000.safetensors"
    frozen = manifest(tmp_path, 1)["tensors"]["frozen"]["chunks"][0]
    flip_byte(shared, frozen["start"] + 10)
    checks = verify_steps(ss.CheckpointManager(tmp_path).storage)
    assert [c.step for c in checks if c.problem] == [step_dir(s) for s in (1, 2, 3)]
    assert damaged_files(checks) == {
        f"{step_dir(1)}/shards/r00000-000.safetensors": [step_dir(s) for s in (1, 2, 3)]
    }
    with ss.CheckpointManager(tmp_path) as mgr:
        assert mgr.restore(blank()) is None  # every step uses the damaged file
        assert sorted(mgr.corrupt_steps) == [1, 2, 3]


def test_restore_falls_back_past_a_step_whose_own_file_is_damaged(tmp_path: Path) -> None:
    saved = save_steps(tmp_path, 3, async_save=False)
    own = tmp_path / step_dir(3) / "shards" / "r00000-000.safetensors"
    flip_byte(own, own.stat().st_size - 10)  # the head: written by step 3 alone
    target = blank()
    with ss.CheckpointManager(tmp_path) as mgr:
        assert mgr.restore(target) == 2
        assert mgr.steps() == [1, 2]
    assert torch.equal(target["head"], saved[2]["head"])
    assert (tmp_path / f"{step_dir(3)}.corrupt").is_dir()


def test_setting_aside_a_referenced_step_keeps_the_files_others_need(tmp_path: Path) -> None:
    saved = save_steps(tmp_path, 2, async_save=False)
    own = tmp_path / step_dir(1) / "shards" / "r00000-000.safetensors"
    head = manifest(tmp_path, 1)["tensors"]["head"]["chunks"][0]
    flip_byte(own, head["start"])  # step 1's head, which step 2 does not reference
    with ss.CheckpointManager(tmp_path) as mgr:
        mgr._set_aside(1)  # as restore does for a damaged step
        assert mgr.steps() == [2]
    assert own.exists()  # step 2 still references the frozen chunk in it
    assert_loads(tmp_path / step_dir(2), saved[2])
    with (
        ss.CheckpointManager(tmp_path, incremental=True) as mgr,
        pytest.raises(ss.CheckpointError, match="reference"),
    ):
        mgr.save(1, make_state())  # would clear files step 2 needs


def test_copy_makes_a_self_contained_checkpoint(tmp_path: Path) -> None:
    root = tmp_path / "root"
    saved = save_steps(root, 3, async_save=False)
    report = copy_step(root, 3, tmp_path / "copy")
    assert report.ok and report.files == 2
    with pytest.raises(ss.CheckpointExistsError):
        copy_step(root, 3, tmp_path / "copy")
    shutil.rmtree(root)
    doc = json.loads((tmp_path / "copy" / "manifest.json").read_bytes())
    assert doc["version"] == 2 and not any(f.startswith("..") for f in doc["files"])
    assert_loads(tmp_path / "copy", saved[3])


def test_copy_command(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from snapstate.cli import main

    root = tmp_path / "root"
    saved = save_steps(root, 2, async_save=False)
    result = CliRunner().invoke(main, ["copy", str(root), "2", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert "copied step 2" in result.output
    assert_loads(tmp_path / "out", saved[2])


def edit(path: Path, change: Any) -> None:
    doc = json.loads((path / "manifest.json").read_bytes())
    doc.pop("checksum")
    change(doc)
    (path / "manifest.json").write_bytes(seal(json.dumps(doc).encode()))


BAD_REFERENCES = {
    "two dots": ("../../etc/passwd", "points outside the checkpoint"),
    "not a step": ("../other/shards/r00000-000.safetensors", "../step-<number>/"),
    "dot dot inside": (f"../{step_dir(1)}/../x.safetensors", "../step-<number>/"),
    "empty part": (f"../{step_dir(1)}//x.safetensors", "../step-<number>/"),
    "itself": (f"../{step_dir(2)}/shards/r00000-000.safetensors", "not an earlier step"),
    "later step": (f"../{step_dir(7)}/shards/r00000-000.safetensors", "not an earlier step"),
    "absolute": ("/etc/passwd", "points outside the checkpoint"),
}


@pytest.mark.parametrize("name", sorted(BAD_REFERENCES))
def test_bad_references_are_refused_naming_file_and_key(tmp_path: Path, name: str) -> None:
    save_steps(tmp_path, 2, async_save=False)
    step = tmp_path / step_dir(2)
    bad, reason = BAD_REFERENCES[name]
    old = f"../{step_dir(1)}/shards/r00000-000.safetensors"

    def change(doc: dict[str, Any]) -> None:
        doc["files"][bad] = doc["files"].pop(old)
        doc["tensors"]["frozen"]["chunks"][0]["file"] = bad

    edit(step, change)
    for reader in (ss.inspect, ss.verify, lambda p: ss.load(blank(), p)):
        with pytest.raises(ss.CorruptCheckpointError) as info:
            reader(step)
        message = str(info.value)
        assert (
            reason in message
            and "manifest.json" in message
            and "files" in message.split("key", 1)[1]
        )


def test_a_reference_in_a_version_2_manifest_is_refused(tmp_path: Path) -> None:
    save_steps(tmp_path, 2, async_save=False)
    step = tmp_path / step_dir(2)
    edit(step, lambda d: d.update(version=2))
    with pytest.raises(ss.CorruptCheckpointError, match="needs format version 4"):
        ss.inspect(step)


def test_a_reference_that_links_outside_its_step_is_refused(tmp_path: Path) -> None:
    save_steps(tmp_path, 2, async_save=False)
    moved = tmp_path.parent / f"{tmp_path.name}-elsewhere"
    (tmp_path / step_dir(1)).rename(moved)
    (tmp_path / step_dir(1)).symlink_to(moved)
    with pytest.raises(ss.CorruptCheckpointError, match="links outside"):
        ss.verify(tmp_path / step_dir(2))
    shutil.rmtree(moved)


def test_incremental_refuses_compression_and_object_stores(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="compression"):
        ss.CheckpointManager(tmp_path, incremental=True, options=ss.SaveOptions(compression="zstd"))
    with pytest.raises(ValueError, match="local-only"):
        ss.CheckpointManager("memory://snapstate-incremental", incremental=True)


def test_a_plain_manager_keeps_what_incremental_steps_reference(tmp_path: Path) -> None:
    saved = save_steps(tmp_path, 3, async_save=False)
    with ss.CheckpointManager(tmp_path, keep_last=2, async_save=False) as mgr:  # not incremental
        mgr.save(4, make_state(seed=2))
        assert mgr.steps() == [3, 4]
    assert (tmp_path / step_dir(1) / "shards" / "r00000-000.safetensors").exists()
    assert not (tmp_path / step_dir(2)).exists()
    assert_loads(tmp_path / step_dir(3), saved[3])


def test_export_and_read_state_resolve_references(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from snapstate.export import export_checkpoint

    saved = save_steps(tmp_path / "root", 2, async_save=False)
    step = tmp_path / "root" / step_dir(2)
    export_checkpoint(step, "safetensors", tmp_path / "out.safetensors")
    exported = load_file(str(tmp_path / "out.safetensors"))
    assert torch.equal(exported["frozen"], saved[2]["frozen"])
    assert torch.equal(exported["head"], saved[2]["head"])
    plain = ss.read_state(step, ["frozen"])
    assert torch.equal(plain["frozen"], saved[2]["frozen"])


def test_rank_local_state_is_referenced_when_unchanged(tmp_path: Path) -> None:
    state = {"local": ss.RankLocal({"table": torch.arange(4096.0)}), "w": torch.ones(8)}
    with ss.CheckpointManager(tmp_path, incremental=True, async_save=False) as mgr:
        mgr.save(1, state)
        state["w"] += 1
        mgr.save(2, state)
    doc = manifest(tmp_path, 2)
    local = doc["rank_local"]["0"]["tensors"]
    assert all(c["file"].startswith("../") for t in local.values() for c in t["chunks"])
    target = {"local": ss.RankLocal({"table": torch.zeros(4096)}), "w": torch.zeros(8)}
    ss.load(target, tmp_path / step_dir(2))
    assert torch.equal(target["local"].value["table"], torch.arange(4096.0))
    assert torch.equal(target["w"], torch.full((8,), 2.0))


def test_a_missing_base_file_makes_the_next_save_write_everything(tmp_path: Path) -> None:
    saved = save_steps(tmp_path, 1, async_save=False)
    (tmp_path / step_dir(1) / "shards" / "r00000-000.safetensors").unlink()
    state = dict(saved[1], step=2)
    with ss.CheckpointManager(tmp_path, incremental=True, async_save=False) as mgr:
        mgr.save(2, state)
    assert not any(f.startswith("../") for f in manifest(tmp_path, 2)["files"])
    assert_loads(tmp_path / step_dir(2), state)


def test_an_incremental_save_without_a_step_is_refused(tmp_path: Path) -> None:
    from snapstate.planning.incremental import Reuse

    with pytest.raises(ValueError, match="needs its step"):
        ss.save(make_state(), tmp_path / "x", options=ss.SaveOptions(incremental=Reuse("x")))


def test_retention_deletes_nothing_when_a_manifest_cannot_be_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    import snapstate.references as references

    save_steps(tmp_path, 2, async_save=False)

    def failing(*args: Any) -> bytes:
        raise OSError(errno.EIO, "injected I/O error")

    state = make_state()
    state["head"].add_(7.0)
    with ss.CheckpointManager(tmp_path, keep_last=1, incremental=True, async_save=False) as mgr:
        monkeypatch.setattr(references, "read_capped", failing)
        mgr.save(3, state)  # committed; retention cannot tell what step 3 references
        assert mgr.steps() == [1, 2, 3]
        monkeypatch.undo()
        mgr.save(4, state)  # readable again: retention runs, keeping what step 4 references
        assert mgr.steps() == [4]
    assert (tmp_path / step_dir(1) / "shards" / "r00000-000.safetensors").exists()
    assert ss.verify(tmp_path / step_dir(4)).ok


def test_a_reader_before_version_4_refuses_references_as_a_newer_format(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import snapstate.format.manifest as manifest_format

    save_steps(tmp_path, 2, async_save=False)
    monkeypatch.setattr(manifest_format, "READ_VERSIONS", (1, 2, 3))
    ss.inspect(tmp_path / step_dir(1))  # no reference: still version 2
    with pytest.raises(ss.UnsupportedFormatError, match="version 4"):
        ss.inspect(tmp_path / step_dir(2))


def test_inspect_of_a_root_names_a_deleted_step_whose_files_later_steps_reference(
    tmp_path: Path,
) -> None:
    from click.testing import CliRunner

    from snapstate.cli import main

    save_steps(tmp_path, 3, keep_last=1, async_save=False)  # steps 1, 2 deleted; 1's frozen kept
    result = CliRunner().invoke(main, ["inspect", str(tmp_path), "--json"])  # a manager root
    assert result.exit_code == 0, result.output
    states = {row["step"]: row["state"] for row in json.loads(result.output)["steps"]}
    assert states[3] == "committed"
    assert states[1] == "deleted (files referenced by later steps kept)"
    assert 2 not in states  # nothing of it referenced: removed whole
