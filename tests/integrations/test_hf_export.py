"""GPT-2 (tied lm_head and wte) saved by snapstate, exported with `--to hf`, loaded by
transformers' from_pretrained: same weights, no newly initialized ones, bitwise logits."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

import snapstate as ss
from support.integrations import needs

pytestmark = needs("transformers")


def _tiny_gpt2() -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_embd=32, n_layer=2, n_head=2, n_positions=64, vocab_size=101)
    model = GPT2LMHeadModel(config).eval()
    assert model.lm_head.weight is model.transformer.wte.weight  # tied
    return model


def _export(ckpt: Path, out: Path, config: Path, *extra: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "snapstate.cli", "export", str(ckpt), "--to", "hf", str(out)]
        + ["--key", "model", "--config", str(config), *extra],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    return done.stderr


def _load_and_compare(model: Any, out: Path) -> None:
    from transformers import GPT2LMHeadModel

    # transformers' logger does not propagate: its loading info is what says what was missing
    loaded, info = GPT2LMHeadModel.from_pretrained(out, output_loading_info=True)
    loaded.eval()
    assert not info["missing_keys"], info  # none newly initialized
    assert not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    tokens = torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = model(tokens).logits, loaded(tokens).logits
    assert torch.equal(got, want)


def test_gpt2_round_trip_through_from_pretrained(tmp_path: Path) -> None:
    model = _tiny_gpt2()
    opt = torch.optim.AdamW(model.parameters())
    ss.save({"model": model, "optim": opt, "rng": ss.RNGState(), "step": 3}, tmp_path / "ckpt")
    manifest = ss.inspect(tmp_path / "ckpt")
    assert "model/transformer.wte.weight" in manifest.tensors
    assert "model/lm_head.weight" not in manifest.tensors  # the tied weight is stored once
    model.config.save_pretrained(tmp_path / "cfg")
    notes = _export(tmp_path / "ckpt", tmp_path / "hf", tmp_path / "cfg" / "config.json")
    assert "lm_head.weight (= transformer.wte.weight)" in notes
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == [
        "config.json",
        "model.safetensors",
    ]
    from safetensors import safe_open

    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert f.metadata() == {"format": "pt"}
    assert names == set(model.state_dict()) - {"lm_head.weight"}  # no prefix, tied once
    _load_and_compare(model, tmp_path / "hf")


def test_a_sharded_export_by_the_python_call_loads(tmp_path: Path) -> None:
    model = _tiny_gpt2()
    ss.save({"model": model}, tmp_path / "ckpt")
    model.config.save_pretrained(tmp_path / "cfg")
    config = tmp_path / "cfg" / "config.json"
    files = ss.export_hf(tmp_path / "ckpt", tmp_path / "hf", config=config, max_shard_size="20KB")
    assert files[-2:] == ["model.safetensors.index.json", "config.json"]
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and all((tmp_path / "hf" / s).is_file() for s in shards)
    assert not (tmp_path / "hf" / "model.safetensors").exists()
    assert "lm_head.weight" not in index["weight_map"]
    _load_and_compare(model, tmp_path / "hf")


def test_the_loading_info_sees_a_prefixed_file(tmp_path: Path) -> None:
    """The check above is not vacuous: a file with the `model/` prefix is reported missing."""
    from safetensors.torch import save_file
    from transformers import GPT2LMHeadModel

    model = _tiny_gpt2()
    model.config.save_pretrained(tmp_path)
    tensors = {f"model/{k}": v.contiguous() for k, v in model.state_dict().items()}
    del tensors["model/lm_head.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    _, info = GPT2LMHeadModel.from_pretrained(tmp_path, output_loading_info=True)
    assert info["missing_keys"]
