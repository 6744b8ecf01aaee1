"""xxh3-64 checksums per block, so that a partial (resharding) read still verifies what it reads;
and, on request, one xxh3-128 digest of a chunk's whole content, strong enough to decide that an
incremental save may reference an earlier step's copy instead of writing the bytes again."""

from __future__ import annotations

import xxhash

DEFAULT_BLOCK_BYTES = 4 << 20


def block_count(nbytes: int, block_bytes: int) -> int:
    return max(1, -(-nbytes // block_bytes))


def checksum(data: memoryview | bytes) -> str:
    return xxhash.xxh3_64_hexdigest(data)


class BlockHasher:
    """Streams the bytes of one chunk and emits one digest per block of ``block_bytes``."""

    def __init__(self, block_bytes: int, content: bool = False) -> None:
        self.block_bytes = block_bytes
        self.digests: list[str] = []
        self._hasher = xxhash.xxh3_64()
        self._filled = 0
        # the same pass over the bytes feeds the whole-chunk digest: no second read
        self._content = xxhash.xxh3_128() if content else None

    def update(self, data: memoryview) -> None:
        if self._content is not None:
            self._content.update(data)
        while len(data):
            take = min(len(data), self.block_bytes - self._filled)
            if take == self.block_bytes and self._filled == 0:
                self.digests.append(xxhash.xxh3_64_hexdigest(data[:take]))
            else:
                self._hasher.update(data[:take])
                self._filled += take
                if self._filled == self.block_bytes:
                    self._flush()
            data = data[take:]

    def finish(self) -> list[str]:
        if self._filled or not self.digests:
            self._flush()
        return self.digests

    def content_digest(self) -> str:
        """The xxh3-128 of every byte seen; only for a hasher made with ``content=True``."""
        if self._content is None:
            raise ValueError("this BlockHasher was made without content=True")
        return self._content.hexdigest()

    def _flush(self) -> None:
        self.digests.append(self._hasher.hexdigest())
        self._hasher.reset()
        self._filled = 0


def verify_blocks(
    data: memoryview, first_block: int, block_bytes: int, digests: list[str]
) -> int | None:
    """Check ``data`` (starting at block ``first_block`` of a chunk); return the bad block or None."""
    for i in range(0, max(len(data), 1), block_bytes):
        index = first_block + i // block_bytes
        if index >= len(digests) or checksum(data[i : i + block_bytes]) != digests[index]:
            return index
        if not len(data):
            break
    return None
