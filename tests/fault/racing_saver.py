"""Child of the racing-save tests: saves one state per round to a path another process saves to.

``python racing_saver.py WORK WHO ROUNDS OVERWRITE``: for each round it says it is ready,
waits for the parent's go file, saves its own state (values tell the savers apart) to
``WORK/round-N`` and reports the outcome, one JSON line per round on stdout.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import torch

import snapstate as ss


def state_of(who: int, n: int = 1 << 18) -> dict[str, Any]:
    """A few MB in several shards' worth of tensors, every value naming the saver."""
    return {f"t{i}": torch.full((n,), float(who * 100 + i)) for i in range(8)} | {"who": who}


def main(work: str, who: int, rounds: int, overwrite: bool) -> None:
    state = state_of(who)
    for r in range(rounds):
        print(json.dumps({"ready": r}), flush=True)
        go = os.path.join(work, f"go-{r}")
        while not os.path.exists(go):
            time.sleep(0.0002)
        try:
            ss.save(state, os.path.join(work, f"round-{r}"), overwrite=overwrite)
            outcome = "ok"
        except ss.CheckpointExistsError:
            outcome = "exists"
        except BaseException as exc:  # noqa: BLE001 - the parent reports anything else
            outcome = f"{type(exc).__name__}: {exc}"
        print(json.dumps({"round": r, "outcome": outcome}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1")
