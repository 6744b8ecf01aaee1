"""Child of the load-during-overwrite test: saves one path over and over, each save whole.

``python overwriting_saver.py PATH STOP``: saves version 1, 2, 3... to PATH with
``overwrite=True`` (every value of version v is v), says ``{"saved": 1}`` after the first,
writes the count of saves to STOP.count after each, and when the file STOP exists reports
how many it saved and what went wrong, if anything.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch

import snapstate as ss

TENSORS = 6


def version_state(version: int, n: int = 1 << 16) -> dict[str, Any]:
    """Several shards' worth of tensors, every value naming the version."""
    return {f"t{i}": torch.full((n,), float(version)) for i in range(TENSORS)} | {"v": version}


def main(path: str, stop: str) -> None:
    version, error = 0, None
    # a shard file per tensor or two: a load meets several files, any of them replaced
    options = ss.SaveOptions(block_bytes=64 << 10, plan=ss.PlanOptions(max_file_bytes=1 << 19))
    while not os.path.exists(stop):
        version += 1
        try:
            ss.save(version_state(version), path, overwrite=True, options=options)
        except BaseException as exc:  # noqa: BLE001 - the parent reports it
            error = f"{type(exc).__name__}: {exc}"
            break
        with open(stop + ".count.tmp", "w") as f:
            f.write(str(version))
        os.replace(stop + ".count.tmp", stop + ".count")
        if version == 1:
            print(json.dumps({"saved": 1}), flush=True)
    print(json.dumps({"saves": version, "error": error}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
