"""Incremental saves, the pure part: which chunks an earlier step already holds, and how a
manifest names a file of another step (retention's side is ``references.py``).

A chunk is reused only when its content digest (xxh3-128 of the stored bytes, computed in the
pass that makes the block checksums) and everything that decides how its bytes are read
(sizes, dtype, codec, stored length) equal those of the same chunk (key and offsets) in the
newest earlier committed step. Files are named here root-relative (``step-000000010/shards/
r00000-000.safetensors``); a manifest names a file of its own step as today and a file of
another step as ``../step-000000010/shards/...`` (one ``..``, never more). Reuse copies the
stored chunk's root-relative file, so references never chain: a third step that reuses a
reused chunk points at the step that wrote the bytes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from snapstate.format.validation import STEP_NAME

ChunkId = tuple[str, tuple[int, ...]]  # (key, offsets): the same chunk across steps


@dataclass(frozen=True)
class ChunkContent:
    """What must be equal for two chunks to be interchangeable on disk."""

    sizes: tuple[int, ...]
    dtype: str
    codec: str  # "raw" for an uncompressed chunk
    stored_bytes: int
    digest: str  # xxh3-128 of the stored bytes


@dataclass(frozen=True)
class StoredChunk:
    """A committed chunk: its content and where its bytes are (``file`` root-relative)."""

    content: ChunkContent
    file: str
    name: str
    start: int
    end: int
    block_bytes: int
    xxh3: tuple[str, ...]


@dataclass(frozen=True)
class ReusePlan:
    reused: Mapping[ChunkId, StoredChunk]  # referenced, not written
    written: tuple[ChunkId, ...]  # new or changed: written by this step, in sorted order

    @property
    def bytes_reused(self) -> int:
        return sum(c.content.stored_bytes for c in self.reused.values())


@dataclass(frozen=True)
class Reuse:
    """What an incremental save may reference: the chunks of the newest earlier committed step
    of its root (empty for the first save, which still records digests), with the size of
    every file they lie in; ``step`` is the directory name of the step being saved."""

    step: str
    chunks: Mapping[ChunkId, StoredChunk] = field(default_factory=dict)
    file_bytes: Mapping[str, int] = field(default_factory=dict)  # root-relative file -> size

    def reusable(self, cid: ChunkId, content: ChunkContent) -> StoredChunk | None:
        """The earlier copy of chunk ``cid`` if its content equals ``content``."""
        prior = self.chunks.get(cid)
        return prior if prior is not None and prior.content == content else None


def chunk_id(name: str, offsets: Iterable[int]) -> ChunkId:
    """A chunk's identity across steps from its shard entry name (``<key>@<offsets>``, with
    ``rank<r>/`` before a rank-local key): the key part and the offsets."""
    return (name.rpartition("@")[0], tuple(offsets))


def plan_reuse(
    prior: Mapping[ChunkId, StoredChunk], current: Mapping[ChunkId, ChunkContent]
) -> ReusePlan:
    """Chunks of ``current`` whose content equals that of the same chunk in ``prior``: the
    decision the writer makes chunk by chunk (``Reuse.reusable``), for a whole save at once."""
    reuse = Reuse("", prior)
    reused = {cid: p for cid, c in current.items() if (p := reuse.reusable(cid, c)) is not None}
    written = tuple(sorted(cid for cid in current if cid not in reused))
    return ReusePlan(reused, written)


def reference(step: str, root_file: str) -> str:
    """The name a manifest of ``step`` gives the root-relative ``root_file``."""
    own = step + "/"
    return root_file[len(own) :] if root_file.startswith(own) else "../" + root_file


def resolve(step: str, manifest_file: str) -> str:
    """Root-relative path of a file named in ``step``'s manifest; inverse of ``reference``."""
    parts = manifest_file.split("/")
    if parts[0] != "..":
        return f"{step}/{manifest_file}"
    rest = parts[1:]
    if len(rest) < 2 or any(p in ("", ".", "..") for p in rest) or rest[0] == step:
        raise ValueError(f"{manifest_file!r}: a reference is ../<another step>/<path>")
    return "/".join(rest)


def step_number(name: str) -> int | None:
    """The step of a step directory's name, or None for any other name."""
    m = STEP_NAME.fullmatch(name)
    return int(m.group(1)) if m else None
