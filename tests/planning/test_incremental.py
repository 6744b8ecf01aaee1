"""The pure part of incremental saves: reuse decisions and references (retention's side is
tested with real files in tests/unit/test_incremental.py)."""

from __future__ import annotations

import numpy as np
import pytest

from snapstate.format.integrity import BlockHasher
from snapstate.planning.incremental import (
    ChunkContent,
    StoredChunk,
    plan_reuse,
    reference,
    resolve,
)

OLD = "step-000000010"
NEW = "step-000000020"


def content(digest: str, nbytes: int = 64, codec: str = "raw") -> ChunkContent:
    return ChunkContent((nbytes // 4,), "float32", codec, nbytes, digest)


def stored(c: ChunkContent, file: str = f"{OLD}/shards/r00000-000.safetensors") -> StoredChunk:
    return StoredChunk(c, file, "w.0", 128, 128 + c.stored_bytes, 4 << 20, ("0" * 16,))


def test_unchanged_chunks_are_reused_and_changed_ones_written() -> None:
    prior = {("frozen", (0,)): stored(content("a" * 32)), ("head", (0,)): stored(content("b" * 32))}
    current = {("frozen", (0,)): content("a" * 32), ("head", (0,)): content("c" * 32)}
    plan = plan_reuse(prior, current)
    assert plan.reused == {("frozen", (0,)): prior[("frozen", (0,))]}
    assert plan.written == (("head", (0,)),)
    assert plan.bytes_reused == 64


@pytest.mark.parametrize(
    "changed",
    [content("a" * 32, nbytes=128), content("a" * 32, codec="zstd"), content("d" * 32)],
    ids=["size", "codec", "digest"],
)
def test_equal_digest_alone_is_not_enough(changed: ChunkContent) -> None:
    prior = {("w", (0,)): stored(content("a" * 32))}
    plan = plan_reuse(prior, {("w", (0,)): changed})
    assert not plan.reused and plan.written == (("w", (0,)),)


def test_a_new_chunk_or_no_prior_step_writes_everything() -> None:
    current = {("w", (0,)): content("a" * 32), ("w", (4,)): content("a" * 32)}
    assert plan_reuse({}, current).written == (("w", (0,)), ("w", (4,)))
    prior = {("w", (0,)): stored(content("a" * 32))}
    assert plan_reuse(prior, current).written == (("w", (4,)),)


def test_reuse_never_chains_references() -> None:
    first = stored(content("a" * 32))
    second = plan_reuse({("w", (0,)): first}, {("w", (0,)): content("a" * 32)})
    third = plan_reuse(dict(second.reused), {("w", (0,)): content("a" * 32)})
    assert third.reused[("w", (0,))].file.startswith(OLD + "/")
    assert reference("step-000000030", third.reused[("w", (0,))].file).startswith(f"../{OLD}/")


def test_reference_and_resolve_are_inverse() -> None:
    own = f"{NEW}/shards/r00000-000.safetensors"
    other = f"{OLD}/shards/r00001-000.safetensors"
    assert reference(NEW, own) == "shards/r00000-000.safetensors"
    assert reference(NEW, other) == f"../{other}"
    for f in (own, other):
        assert resolve(NEW, reference(NEW, f)) == f


@pytest.mark.parametrize(
    "bad", ["../../etc/passwd", "../x", f"../{OLD}/../y", f"../{NEW}/shards/a", f"../{OLD}//a"]
)
def test_resolve_refuses_escapes_and_self_references(bad: str) -> None:
    with pytest.raises(ValueError, match="reference"):
        resolve(NEW, bad)


def test_content_digest_comes_from_the_block_pass_and_tells_bytes_apart() -> None:
    data = np.arange(3000, dtype=np.float32)
    whole, parts = BlockHasher(1024, content=True), BlockHasher(1024, content=True)
    whole.update(memoryview(data.tobytes()))
    for piece in np.array_split(data, 7):
        parts.update(memoryview(piece.tobytes()))
    assert whole.finish() == parts.finish()
    assert whole.content_digest() == parts.content_digest()
    assert len(whole.content_digest()) == 32
    data[1234] += 1
    other = BlockHasher(1024, content=True)
    other.update(memoryview(data.tobytes()))
    assert other.content_digest() != whole.content_digest()
    with pytest.raises(ValueError, match="content=True"):
        BlockHasher(1024).content_digest()
