"""Make a checkpoint's shards cold for real: their clean pages dropped from the page cache."""

from __future__ import annotations

import os
from pathlib import Path


def drop_cached_pages(ckpt: Path | str) -> None:
    """POSIX_FADV_DONTNEED on every shard (no root needed); fsync first, since dirty pages
    cannot be dropped."""
    for shard in (Path(ckpt) / "shards").glob("*.safetensors"):
        fd = os.open(shard, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
