"""Each shard's header read once per load, capped, and every chunk read checked against it.

A manifest resealed with another dtype (or shape, or byte range) verifies on its own, and
its chunks' checksums still pass: only the shard header tells that the bytes are float32,
not the int32 the manifest now says. So every read path (loads, ``read_state``, exports,
``verify``) holds the records it uses to their shards' headers before it allocates from the
manifest or reads a byte; the header is a few KB, read once per file for the whole load.
"""

from __future__ import annotations

from snapstate.errors import CheckpointIOError, CorruptCheckpointError
from snapstate.format.manifest import Manifest, TensorRecord
from snapstate.format.shard import MAX_HEADER_BYTES, ParsedShard, check_chunk_entry, parse_header
from snapstate.storage.base import Storage


class ShardHeaders:
    """The parsed headers of one load's shards, each file's read once, on first need."""

    def __init__(self, storage: Storage, manifest: Manifest) -> None:
        self.storage, self.manifest = storage, manifest
        self._parsed: dict[str, ParsedShard] = {}
        self._checked: set[int] = set()  # ids of the records already held to their headers
        self._starts: dict[str, int] | None = None  # each file's first chunk, once needed

    def check(self, key: str, record: TensorRecord) -> None:
        """Every chunk of ``record`` agrees with its shard's header (CorruptCheckpointError)."""
        if id(record) in self._checked:
            return
        for chunk in record.chunks:
            check_chunk_entry(self.parsed(chunk.file, key), chunk, record.dtype, key)
        self._checked.add(id(record))

    def parsed(self, file: str, key: str | None) -> ParsedShard:
        """``file``'s header, validated against the file's recorded size; errors name ``key``."""
        parsed = self._parsed.get(file)
        if parsed is None:
            parsed = self._parsed[file] = self._read(file, key)
        return parsed

    def _read(self, file: str, key: str | None) -> ParsedShard:
        size = self.manifest.files[file].bytes  # read_manifest checked the file has it
        try:
            # one read of the header the manifest implies; more only if the file says more
            first = min(self._data_start(file), size, 8 + MAX_HEADER_BYTES)
            prefix = self._read_bytes(file, 0, first, key)
            wanted = 8 + int.from_bytes(prefix[:8], "little") if len(prefix) >= 8 else 0
            # never past the cap: parse_header refuses a larger size without looking at it
            wanted = min(wanted, size, 8 + MAX_HEADER_BYTES)
            if len(prefix) < wanted:
                prefix += self._read_bytes(file, len(prefix), wanted - len(prefix), key)
            return parse_header(prefix, size, file)
        except CorruptCheckpointError as exc:
            if exc.key is not None or key is None:
                raise
            raise CorruptCheckpointError(exc.reason, file=file, key=key) from None

    def _data_start(self, file: str) -> int:
        """Where the manifest's chunks of ``file`` begin: the header ends there (8 if none)."""
        if self._starts is None:
            self._starts = {}
            for record in self.manifest.all_tensors().values():
                for c in record.chunks:
                    self._starts[c.file] = min(self._starts.get(c.file, c.start), c.start)
        return max(8, self._starts.get(file, 8))

    def _read_bytes(self, file: str, offset: int, length: int, key: str | None) -> bytes:
        try:
            return self.storage.read_bytes(file, offset, length)
        except FileNotFoundError:
            raise shard_gone(file, key) from None
        except OSError as exc:
            raise CheckpointIOError(
                exc.errno, f"{exc.strerror or exc} (reading {file})", exc.filename
            ) from exc


def shard_gone(file: str, key: str | None) -> CorruptCheckpointError:
    """A shard the validated manifest lists is not there (any more): removed, or replaced
    by a save that overwrote the checkpoint while it was read."""
    return CorruptCheckpointError(
        "shard file is missing (changed or removed while loading; retry)", file=file, key=key
    )
