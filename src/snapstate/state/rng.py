"""RNGState: every random generator a training step may draw from, per rank."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


class RNGState:
    """Captures and restores python ``random``, numpy's global generator, torch CPU and CUDA.

    Saved as rank-local state: each rank restores its own generators. ``state_dict()`` reads
    the generators at the moment of the save, so put it in the state and save as usual.
    """

    def state_dict(self) -> dict[str, Any]:
        py_version, py_internal, py_gauss = random.getstate()
        np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state(legacy=True)
        state: dict[str, Any] = {
            "python": {"version": py_version, "internal": list(py_internal), "gauss": py_gauss},
            "numpy": {
                "name": np_name,
                "keys": np.asarray(np_keys).copy(),
                "pos": int(np_pos),
                "has_gauss": int(np_has_gauss),
                "gauss": float(np_gauss),
            },
            "torch": torch.get_rng_state(),
            "cuda": [],
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = [s.cpu() for s in torch.cuda.get_rng_state_all()]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        py = state["python"]
        random.setstate((py["version"], tuple(py["internal"]), py["gauss"]))
        n = state["numpy"]
        np.random.set_state(
            (
                n["name"],
                np.asarray(n["keys"], dtype=np.uint32),
                n["pos"],
                n["has_gauss"],
                n["gauss"],
            )
        )
        torch.set_rng_state(torch.as_tensor(state["torch"], dtype=torch.uint8).cpu())
        cuda_states = state.get("cuda") or []
        if cuda_states:
            if not torch.cuda.is_available():
                raise RuntimeError("checkpoint holds CUDA RNG states but CUDA is not available")
            if len(cuda_states) != torch.cuda.device_count():
                raise RuntimeError(
                    f"checkpoint holds {len(cuda_states)} CUDA RNG states, "
                    f"this process sees {torch.cuda.device_count()} devices"
                )
            torch.cuda.set_rng_state_all([s.cpu() for s in cuda_states])
