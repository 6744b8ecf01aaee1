"""The grid form of a tensor's chunks (format version 5): cut points, files, starts, one
string of checksums, instead of one JSON object per chunk.

A job of 4,096 ranks writes about 450,000 chunks; as objects they made a 98 MB manifest,
about 215 bytes a chunk, most of it member names, paths and names a reader can derive. A
tensor whose chunks form a grid (every cell of the cut points of each dimension one chunk,
as snapstate's layouts are) is written as that grid: per chunk only a file index, a start
and its checksums remain. ``expand`` turns it back into the chunks, as untrusted input.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

from snapstate.format.integrity import block_count
from snapstate.format.validation import FieldChecks, short

# Fewer chunks stay a list: the grid would save little, and small checkpoints keep the
# version 2 format older readers read. Per tensor, and in the whole manifest: below 4,096
# chunks (about 1 MB of chunk lists) no tensor is written as a grid.
GRID_MIN_CHUNKS = 16
GRID_MIN_MANIFEST_CHUNKS = 4096
# The most chunks the grids of one manifest expand to (a 4,096-rank 70B job has 454,484):
# records cost about 500 bytes each in memory, so this bounds a hostile manifest to ~1 GB.
MAX_GRID_CHUNKS = 1 << 21
DIGEST_CHARS = 16  # an xxh3-64 in hex
_HEX = re.compile(r"[0-9a-f]*\Z")

# What a chunk expands to: offsets, sizes, file, name, start, end, block_bytes, xxh3.
Expanded = tuple[list[int], list[int], str, str, int, int, int, list[str]]


class Chunk(Protocol):
    offsets: list[int]
    sizes: list[int]
    file: str
    name: str
    start: int
    end: int
    block_bytes: int
    xxh3: list[str]

    @property
    def compressed(self) -> bool: ...


def grid_form(
    key: str, shape: list[int], itemsize: int, chunks: Sequence[Chunk], files: dict[str, int]
) -> dict[str, Any] | None:
    """The grid members of a tensor record, or None where its chunks are no grid this form
    holds exactly (compressed, empty, named or checksummed otherwise). ``files``: each
    path's place among the manifest's ``files``, which the grid's file indices refer to."""
    if len(chunks) < GRID_MIN_CHUNKS or not all(shape):
        return None
    ordered = sorted(chunks, key=lambda c: c.offsets)
    cuts = [sorted({c.offsets[d] for c in ordered} | {dim}) for d, dim in enumerate(shape)]
    if math.prod(len(c) - 1 for c in cuts) != len(ordered):
        return None
    block = ordered[0].block_bytes
    for chunk, (offsets, sizes) in zip(ordered, cells(cuts)):
        if (
            chunk.compressed
            or chunk.offsets != offsets
            or chunk.sizes != sizes
            or chunk.block_bytes != block
            or chunk.end - chunk.start != math.prod(sizes) * itemsize
            or chunk.name != chunk_name(key, offsets)
        ):
            return None
    digests = [d for c in ordered for d in c.xxh3]
    joined = "".join(digests)
    if set(map(len, digests)) != {DIGEST_CHARS} or not _HEX.match(joined):
        return None  # checksums of another form than snapstate's: kept as listed
    return {
        "grid": cuts,
        "file": [files[c.file] for c in ordered],
        "start": [c.start for c in ordered],
        "block_bytes": block,
        "xxh3": joined,
    }


def chunk_name(key: str, offsets: list[int]) -> str:
    """The name snapstate gives a chunk in its shard header (``planning/items.py``)."""
    return f"{key}@{','.join(map(str, offsets))}"


def cells(cuts: list[list[int]]) -> Iterator[tuple[list[int], list[int]]]:
    """(offsets, sizes) of every cell of the grid, row-major: the chunks' order by offsets."""
    spans = [[(c[i], c[i + 1] - c[i]) for i in range(len(c) - 1)] for c in cuts]
    for cell in itertools.product(*spans):
        yield [o for o, _ in cell], [s for _, s in cell]


def expand(
    v: FieldChecks,
    key: str,
    rec: dict[str, Any],
    shape: list[int],
    itemsize: int,
    paths: list[str],
    file_bytes: list[int],
    budget: int,
) -> list[Expanded]:
    """A grid record's chunks, each checked as a listed chunk would be; at most ``budget``.
    ``paths`` and ``file_bytes``: the manifest's files in order, and their sizes.

    The cell count is checked against the record's own per-chunk lists, the budget and the
    bytes its files hold before any chunk is made, so a small record cannot expand to many.
    """
    cuts = _cuts(v, key, rec.get("grid"), shape)
    index = v.ints(rec.get("file"), f"{key}/file")
    starts = v.ints(rec.get("start"), f"{key}/start")
    count = 1
    for c in cuts:  # stops as soon as the product passes the lists' length
        count *= len(c) - 1
        if count > len(index):
            break
    v.require(
        count == len(index) == len(starts),
        f"a grid of {count if count <= len(index) else 'more'} cells has {len(index)} file "
        f"indices and {len(starts)} starts",
        key,
    )
    v.require(count <= budget, f"grids expand to more than {MAX_GRID_CHUNKS} chunks", f"{key}/grid")
    # every cell holds an element, and chunks share no bytes: no more cells than bytes
    held = sum(file_bytes[i] for i in set(index) if i < len(paths))
    v.require(count <= held, f"{count} chunks cannot fit in {held} bytes of their files", key)
    block = v.integer(rec.get("block_bytes"), f"{key}/block_bytes", minimum=1)
    digests = rec.get("xxh3")
    if not (type(digests) is str and len(digests) % DIGEST_CHARS == 0 and _HEX.match(digests)):
        raise v.fail(f"xxh3 is not a string of 16-digit hex checksums: {short(digests)}", key)
    out: list[Expanded] = []
    at = 0
    for (offsets, sizes), i, start in zip(cells(cuts), index, starts):
        if i >= len(paths):
            raise v.fail(f"file index {i} is not below {len(paths)}", f"{key}/file")
        nbytes = math.prod(sizes) * itemsize
        end, path = start + nbytes, paths[i]
        if end > file_bytes[i]:
            raise v.fail(
                f"chunk byte range ends at {end}, beyond {path} ({file_bytes[i]} bytes)", key
            )
        n = block_count(nbytes, block) * DIGEST_CHARS
        if at + n > len(digests):
            raise v.fail(f"{len(digests) // DIGEST_CHARS} checksums are too few", f"{key}/xxh3")
        blocks = [digests[j : j + DIGEST_CHARS] for j in range(at, at + n, DIGEST_CHARS)]
        at += n
        out.append((offsets, sizes, path, chunk_name(key, offsets), start, end, block, blocks))
    v.require(at == len(digests), f"{(len(digests) - at) // DIGEST_CHARS} checksums too many", key)
    return out


def _cuts(v: FieldChecks, key: str, grid: Any, shape: list[int]) -> list[list[int]]:
    where = f"{key}/grid"
    if not (type(grid) is list and len(grid) == len(shape)):
        raise v.fail(f"grid is not a list of {len(shape)} lists of cut points", where)
    cuts = [v.ints(c, where) for c in grid]
    for c, dim in zip(cuts, shape):
        if not (
            len(c) >= 2 and c[0] == 0 and c[-1] == dim and all(a < b for a, b in zip(c, c[1:]))
        ):
            raise v.fail(f"cut points {short(c)} do not rise from 0 to {dim}", where)
    return cuts
