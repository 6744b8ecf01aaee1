"""manifest.json: the commit point of a checkpoint; versioned JSON, validated as untrusted input."""

from __future__ import annotations

import bisect
import json
import math
import posixpath
import re
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

import numpy as np
import torch
import xxhash

from snapstate.errors import CorruptCheckpointError, UnsupportedFormatError
from snapstate.format import grid
from snapstate.format.codec import CODECS
from snapstate.format.dtypes import dtype_from_name, itemsize
from snapstate.format.grid import expand, grid_form
from snapstate.format.integrity import block_count
from snapstate.format.tree import tree_problem
from snapstate.format.validation import STEP_NAME, FieldChecks, short

FORMAT_NAME = "snapstate"
FORMAT_VERSION = 2  # 2: the manifest ends with its own "checksum" (1 is still read)
# 3: version 2 plus compressed chunks. Written only when a chunk is compressed, so a reader
# that predates compression refuses such a checkpoint as a newer format (kept, not set aside)
# instead of reading its stored bytes as raw ones; every other save still writes version 2.
COMPRESSED_VERSION = 3
# 4: version 2 or 3 plus references to files of an earlier step of the same root
# (``../step-<n>/<path>``, incremental saves). Written only when a manifest holds one, so a
# reader that predates them refuses it as a newer format instead of looking for the file
# inside this step; every other save writes 2 or 3 as before.
REFERENCE_VERSION = 4
# 5: version 3 or 4 plus tensors whose chunks are written as a grid (``format/grid.py``).
# Written only when a tensor has that many chunks (a job of hundreds of ranks), so that smaller
# checkpoints stay readable by readers that predate it; those refuse a version 5 as newer.
GRID_VERSION = 5
READ_VERSIONS = (1, 2, 3, 4, 5)
MANIFEST = "manifest.json"
# Parsing peaks at about 12x the file in Python objects (measured: a 27 MiB manifest of
# 100k tensors, +330 MiB), so the cap bounds a hostile or runaway manifest to ~1.5 GB. A 70B
# model on 4096 ranks with a sharded optimizer writes 17 MB (`snapstate plan-sim`, grid form).
MAX_MANIFEST_BYTES = 128 << 20
# The checksum is the last member, written byte-exactly: the digest covers the raw bytes before it.
CHECKSUM_TAIL = re.compile(rb',"checksum":"([0-9a-f]{16})"\}\s*\Z')


@dataclass
class ChunkRecord:
    offsets: list[int]
    sizes: list[int]
    file: str
    name: str
    start: int
    end: int
    block_bytes: int
    xxh3: list[str]  # of the stored bytes: compressed ones for a compressed chunk

    @property
    def compressed(self) -> bool:
        return False


@dataclass
class DigestChunk(ChunkRecord):
    """A chunk of an incremental save: ``digest`` is the xxh3-128 of its bytes (32 hex), which
    the next incremental save compares to decide whether to reference it. A subclass, so the
    manifests of other saves keep their bytes."""

    digest: str = ""


DIGEST = re.compile(r"[0-9a-f]{32}")


def is_reference(path: str) -> bool:
    """Whether a manifest's file path names a file of another step (``../step-<n>/...``)."""
    return path.startswith("../")


@dataclass
class CompressedChunk(ChunkRecord):
    """A chunk stored as frames of ``format/codec.py``: ``start..end`` holds the frames back to
    back, ``frames`` lists each one's [stored bytes, raw bytes]. A subclass, not optional
    fields, so that the manifests of uncompressed saves keep their bytes."""

    codec: str = "zstd"
    frames: list[list[int]] = field(default_factory=list)

    @property
    def compressed(self) -> bool:
        return True


@dataclass
class TensorRecord:
    dtype: str
    shape: list[int]
    kind: str  # "tensor" | "ndarray" | "npscalar"
    placement: str  # "replicate" | "shard" | "rank_local"
    chunks: list[ChunkRecord]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(dtype_from_name(self.dtype))


@dataclass
class RankLocalRecord:
    trees: dict[str, Any]
    tensors: dict[str, TensorRecord]


@dataclass
class FileRecord:
    bytes: int
    rank: int


@dataclass
class Manifest:
    tree: dict[str, Any]
    tensors: dict[str, TensorRecord]
    rank_local: dict[int, RankLocalRecord]
    files: dict[str, FileRecord]
    world_size: int = 1
    step: int | None = None
    mesh: Any = None
    created: str = ""
    versions: dict[str, str] = field(default_factory=dict)
    totals: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, Any] = field(default_factory=dict)
    format: str = FORMAT_NAME
    version: int = FORMAT_VERSION

    def to_json(self) -> bytes:
        # Records are encoded through their __dict__ (json's default hook), not dataclasses.asdict:
        # asdict deep-copies every chunk and took most of the commit time at 10^5 chunks.
        body = {f.name: getattr(self, f.name) for f in fields(self)}
        ordered = {"format": body.pop("format"), "version": body.pop("version"), **body}
        if any(c.compressed for t in self.all_tensors().values() for c in t.chunks):
            ordered["version"] = max(self.version, COMPRESSED_VERSION)
        if any(is_reference(f) for f in self.files):
            ordered["version"] = max(ordered["version"], REFERENCE_VERSION)
        if sum(len(t.chunks) for t in self.tensors.values()) >= grid.GRID_MIN_MANIFEST_CHUNKS:
            where = {path: i for i, path in enumerate(self.files)}
            ordered["tensors"] = {k: _encoded(k, t, where) for k, t in self.tensors.items()}
            if any(type(t) is dict for t in ordered["tensors"].values()):
                ordered["version"] = max(ordered["version"], GRID_VERSION)
        raw = json.dumps(
            ordered, separators=(",", ":"), allow_nan=False, default=_record_fields
        ).encode()
        return seal(raw)

    def all_tensors(self) -> dict[str, TensorRecord]:
        """Global tensors plus rank-local ones under ``rank<r>/<key>``, for listing and verifying."""
        out = dict(self.tensors)
        for rank, rec in sorted(self.rank_local.items()):
            out.update({f"rank{rank}/{k}": t for k, t in rec.tensors.items()})
        return out


def _encoded(key: str, rec: TensorRecord, files: dict[str, int]) -> TensorRecord | dict[str, Any]:
    """The record in grid form where its chunks are a grid, else as it is (a chunk list).
    Chunks that carry a content digest (incremental saves) stay listed: a grid has no digest."""
    if any(isinstance(c, DigestChunk) for c in rec.chunks):
        return rec
    grid = grid_form(key, rec.shape, itemsize(dtype_from_name(rec.dtype)), rec.chunks, files)
    if grid is None:
        return rec
    return {
        "dtype": rec.dtype,
        "shape": rec.shape,
        "kind": rec.kind,
        "placement": rec.placement,
        **grid,
    }


def _record_fields(obj: Any) -> dict[str, Any]:
    if is_dataclass(obj) and not isinstance(obj, type):
        return obj.__dict__
    raise TypeError(f"{type(obj).__name__} is not JSON serializable")


def manifest_digest(body: bytes) -> str:
    """xxh3-64 of the manifest's bytes before its checksum member, as 16 hex digits."""
    return xxhash.xxh3_64_hexdigest(body)


def seal(raw: bytes) -> bytes:
    """A JSON object's bytes with the "checksum" member appended last (format version 2)."""
    body = raw.rstrip()
    if not body.endswith(b"}") or body[:-1].rstrip().endswith(b"{"):
        raise ValueError("only a non-empty JSON object can be sealed")
    body = body[:-1].rstrip()
    return body + b',"checksum":"' + manifest_digest(body).encode() + b'"}'


def _load_json(raw: bytes, file: str) -> dict[str, Any]:
    try:
        doc = json.loads(raw, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:
        # ValueError: bad JSON, bad UTF-8, ints of 4300+ digits, NaN/Infinity
        raise CorruptCheckpointError(f"manifest is not valid JSON: {exc}", file=file) from None
    if not isinstance(doc, dict):
        raise CorruptCheckpointError("manifest is not a JSON object", file=file)
    return doc


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed in a manifest")


def _check_version(doc: dict[str, Any], raw: bytes, file: str) -> None:
    if doc.get("format") != FORMAT_NAME:
        raise UnsupportedFormatError(
            f"format {doc.get('format')!r} is not {FORMAT_NAME!r}", file=file
        )
    version = doc.get("version")
    if type(version) is not int or version not in READ_VERSIONS:  # not 1.0, not true
        raise UnsupportedFormatError(
            f"format version {version!r} is not supported (this library reads {READ_VERSIONS})",
            file=file,
        )
    if version < 2 and "checksum" not in doc:
        return
    # A manifest that carries a checksum is verified whatever its version says: two bit
    # errors turn "version":2 into 1, and skipping the check would load the next flip.
    tail = CHECKSUM_TAIL.search(raw)
    if tail is None:
        raise CorruptCheckpointError(
            "manifest does not end with its checksum", file=file, key="checksum"
        )
    if manifest_digest(raw[: tail.start()]) != tail.group(1).decode():
        raise CorruptCheckpointError(
            "manifest checksum does not match its bytes (the manifest was altered or torn)",
            file=file,
            key="checksum",
        )
    if version < 2:  # version 1 never had a checksum: the version itself was altered
        raise CorruptCheckpointError(
            "a version 1 manifest carries a checksum (its version was altered)",
            file=file,
            key="version",
        )


def parse_manifest(raw: bytes, file: str = MANIFEST) -> Manifest:
    """Parse and validate; every problem is a CorruptCheckpointError naming the file and key."""
    doc: Any = _load_json(raw, file)  # values unchecked until validated below
    _check_version(doc, raw, file)
    v = _Validator(file)
    v.version = doc["version"]  # checked by _check_version
    v.grid_budget = grid.MAX_GRID_CHUNKS
    step = doc.get("step")
    v.require(
        step is None or (isinstance(step, int) and not isinstance(step, bool)),
        "step is not an integer",
        "step",
    )
    v.step = step
    files = {
        v.path(p, "files"): v.file_record(p, r)
        for p, r in v.mapping(doc.get("files"), "files").items()
    }
    world = v.integer(doc.get("world_size", 1), "world_size", minimum=1)
    tensors = {
        k: v.tensor(k, t, files) for k, t in v.mapping(doc.get("tensors"), "tensors").items()
    }
    rank_local = {
        v.rank(r, world): v.rank_local(r, rec, files)
        for r, rec in v.mapping(doc.get("rank_local", {}), "rank_local").items()
    }
    tree = doc.get("tree")
    v.require(isinstance(tree, dict), "tree is not an object", "tree")
    v.trees(tree, tensors, rank_local)
    v.disjoint(
        [*tensors.items(), *((k, t) for r in rank_local.values() for k, t in r.tensors.items())]
    )
    return Manifest(
        tree=tree,
        tensors=tensors,
        rank_local=rank_local,
        files=files,
        world_size=world,
        step=step,
        mesh=doc.get("mesh"),
        created=str(doc.get("created", "")),
        versions=doc.get("versions") if isinstance(doc.get("versions"), dict) else {},
        totals=doc.get("totals") if isinstance(doc.get("totals"), dict) else {},
        timings=doc.get("timings") if isinstance(doc.get("timings"), dict) else {},
    )


class _Validator(FieldChecks):
    """The manifest's records, on the shared field checks."""

    version: int = FORMAT_VERSION
    grid_budget: int = 0  # how many chunks the grids of this manifest may still expand to
    file_order: tuple[list[str], list[int]] | None = None
    step: int | None = None

    def path(self, value: Any, key: str) -> str:
        if isinstance(value, str) and is_reference(value):
            return self.reference(value, key)
        ok = (
            isinstance(value, str)
            and value
            and not value.startswith("/")
            and "\\" not in value
            and "\x00" not in value
        )
        norm = posixpath.normpath(value) if ok else ""
        self.require(
            bool(ok) and norm == value and not norm.startswith("..") and norm != ".",
            f"path {short(value)} points outside the checkpoint",
            key,
        )
        return value

    def reference(self, value: str, key: str) -> str:
        """``../step-<n>/<path>``, exactly: one ``..``, then an earlier step of the same root,
        then a normalized relative path; anything else points outside the root."""
        where = f"{key}/{short(value)}"
        self.require(
            self.version >= REFERENCE_VERSION,
            f"path {short(value)} points outside the checkpoint (a reference to another"
            f" step's file needs format version {REFERENCE_VERSION}, this manifest is"
            f" version {self.version})",
            where,
        )
        parts = value.split("/")
        norm = posixpath.normpath(value) == value and "\\" not in value and "\x00" not in value
        step = STEP_NAME.fullmatch(parts[1]) if len(parts) > 2 else None
        self.require(
            norm and step is not None and all(p not in ("", ".", "..") for p in parts[2:]),
            f"path {short(value)} points outside the checkpoint: a reference must be"
            " ../step-<number>/<normalized relative path>",
            where,
        )
        assert step is not None  # for mypy: required above
        self.require(
            self.step is not None and int(step.group(1)) < self.step,
            f"path {short(value)} references step {int(step.group(1))}, which is not an"
            f" earlier step of the root than this manifest's step {self.step}",
            where,
        )
        return value

    def rank(self, value: str, world: int) -> int:
        self.require(
            value.isascii() and value.isdigit() and int(value) < world,
            f"rank {short(value)} is not below world size {world}",
            "rank_local",
        )
        return int(value)

    def file_record(self, path: str, rec: Any) -> FileRecord:
        rec = self.mapping(rec, f"files/{path}")
        return FileRecord(
            self.integer(rec.get("bytes"), f"files/{path}"),
            self.integer(rec.get("rank", 0), f"files/{path}"),
        )

    def rank_local(self, rank: str, rec: Any, files: dict[str, FileRecord]) -> RankLocalRecord:
        rec = self.mapping(rec, f"rank_local/{rank}")
        trees = self.mapping(rec.get("trees"), f"rank_local/{rank}/trees")
        tensors = {
            k: self.tensor(k, t, files)
            for k, t in self.mapping(rec.get("tensors"), f"rank_local/{rank}/tensors").items()
        }
        return RankLocalRecord(trees, tensors)

    def tensor(self, key: str, rec: Any, files: dict[str, FileRecord]) -> TensorRecord:
        rec = self.mapping(rec, key)
        dtype = dtype_from_name(rec.get("dtype"), file=self.file, key=key)
        shape = self.ints(rec.get("shape"), key)
        kind = rec.get("kind", "tensor")
        if kind not in ("tensor", "ndarray", "npscalar"):
            raise self.fail(f"unknown kind {kind!r}", key)
        placement = rec.get("placement")
        if placement not in ("replicate", "shard", "rank_local"):
            raise self.fail(f"unknown placement {placement!r}", key)
        if "grid" in rec:
            return TensorRecord(
                rec["dtype"],
                shape,
                kind,
                placement,
                self.grid_chunks(key, rec, shape, dtype, files),
            )
        raw_chunks = rec.get("chunks")
        self.require(isinstance(raw_chunks, list), "chunks is not a list", key)
        chunks = [
            self.chunk(key, c, shape, itemsize(dtype), files, self.version) for c in raw_chunks
        ]
        self.covers(key, shape, chunks)
        return TensorRecord(rec["dtype"], shape, kind, placement, chunks)

    def grid_chunks(
        self,
        key: str,
        rec: dict[str, Any],
        shape: list[int],
        dtype: torch.dtype,
        files: dict[str, FileRecord],
    ) -> list[ChunkRecord]:
        """A grid's chunks: they tile the shape by construction, so no tiling check."""
        self.require(
            self.version >= GRID_VERSION, f"a version {self.version} tensor has a grid", key
        )
        self.require("chunks" not in rec, "a tensor has both chunks and a grid", key)
        # snapstate names a rank-local chunk rank<r>/<key>@...: its grid would name others
        self.require(rec.get("placement") != "rank_local", "a rank-local tensor has a grid", key)
        if self.file_order is None:  # a grid's file indices: the files in document order
            self.file_order = (list(files), [f.bytes for f in files.values()])
        paths, sizes = self.file_order
        chunks = [
            ChunkRecord(*c)
            for c in expand(self, key, rec, shape, itemsize(dtype), paths, sizes, self.grid_budget)
        ]
        self.grid_budget -= len(chunks)
        return chunks

    def chunk(
        self,
        key: str,
        rec: Any,
        shape: list[int],
        size: int,
        files: dict[str, FileRecord],
        version: int = FORMAT_VERSION,
    ) -> ChunkRecord:
        # Every message below is formatted only on failure: this runs once per chunk.
        rec = self.mapping(rec, key)
        offsets = self.ints(rec.get("offsets"), key, len(shape))
        sizes = self.ints(rec.get("sizes"), key, len(shape))
        if any(o + s > dim for o, s, dim in zip(offsets, sizes, shape)):
            raise self.fail(
                f"chunk at {short(offsets)} size {short(sizes)} exceeds shape {short(shape)}",
                key,
            )
        file = rec.get("file")
        if not (type(file) is str and file in files):  # listed files are valid paths already
            self.path(file, key)
            raise self.fail(f"chunk file {file!r} is not listed in files", key)
        start, end = self.integer(rec.get("start"), key), self.integer(rec.get("end"), key)
        elements = math.prod(sizes)
        frames = self.frames(key, rec, elements * size, end - start, version)
        if frames is None and end - start != elements * size:
            raise self.fail(
                f"chunk byte range {start}..{end} does not match its {elements} elements", key
            )
        if end > files[file].bytes:
            raise self.fail(
                f"chunk byte range ends at {end}, beyond {file} ({files[file].bytes} bytes)", key
            )
        block = self.integer(rec.get("block_bytes"), key, minimum=1)
        digests = rec.get("xxh3")
        if not (type(digests) is list and all(type(d) is str for d in digests)):
            raise self.fail("xxh3 is not a list of strings", key)
        if len(digests) != block_count(end - start, block):
            raise self.fail(
                f"{len(digests)} checksums for {end - start} bytes in blocks of {block}", key
            )
        name = rec.get("name")
        if type(name) is not str:
            raise self.fail("chunk name is not a string", key)
        if frames is not None:
            return CompressedChunk(
                offsets, sizes, file, name, start, end, block, digests, rec["codec"], frames
            )
        if "digest" in rec:
            digest = rec["digest"]
            if not (type(digest) is str and DIGEST.fullmatch(digest)):
                raise self.fail(f"digest {short(digest)} is not 32 hex digits", key)
            return DigestChunk(offsets, sizes, file, name, start, end, block, digests, digest)
        return ChunkRecord(offsets, sizes, file, name, start, end, block, digests)

    def frames(
        self, key: str, rec: dict[str, Any], raw: int, stored: int, version: int
    ) -> list[list[int]] | None:
        """A compressed chunk's frames, each [stored, raw] bytes, summing to its two sizes."""
        if "codec" not in rec:
            return None
        self.require(version >= COMPRESSED_VERSION, f"a version {version} chunk has a codec", key)
        self.require(rec["codec"] in CODECS, f"unknown codec {short(rec['codec'])}", key)
        frames = rec.get("frames")
        if type(frames) is not list:
            raise self.fail("frames is not a list", key)
        pairs = [self.ints(f, key, 2) for f in frames]
        self.require(
            sum(f[0] for f in pairs) == stored and sum(f[1] for f in pairs) == raw,
            f"frames do not add up to the chunk's {stored} stored and {raw} raw bytes",
            key,
        )
        return pairs

    def trees(
        self,
        tree: dict[str, Any],
        tensors: dict[str, TensorRecord],
        rank_local: dict[int, RankLocalRecord],
    ) -> None:
        problem = tree_problem(tree, tensors)
        self.require(problem is None, str(problem), "tree")
        for rank, rec in rank_local.items():
            for path, sub in rec.trees.items():
                problem = tree_problem(sub, rec.tensors)
                self.require(problem is None, str(problem), f"rank_local/{rank}/trees/{path}")

    def disjoint(self, tensors: list[tuple[str, TensorRecord]]) -> None:
        """No two chunks share bytes: together they then hold no more than the files do, so no
        manifest makes a load allocate more than the checkpoint's files hold."""
        ranges = sorted(
            (c.file, c.start, c.end, key)
            for key, rec in tensors
            for c in rec.chunks
            if c.end > c.start
        )
        for (f1, _, end1, key1), (f2, start2, _, key2) in zip(ranges, ranges[1:]):
            if f1 == f2 and start2 < end1:
                raise self.fail(f"chunks of {key1!r} and {key2!r} share bytes of {f1}", key2)

    def covers(self, key: str, shape: list[int], chunks: list[ChunkRecord]) -> None:
        """The chunks tile the shape exactly (no hole, no overlap), at any chunk count."""
        total = sum(math.prod(c.sizes) for c in chunks)
        if total != math.prod(shape):
            raise self.fail(f"chunks hold {total} elements, the tensor {math.prod(shape)}", key)
        boxes = [c for c in chunks if math.prod(c.sizes) > 0]
        if len(boxes) > 1:
            problem = tiling_problem(shape, [(c.offsets, c.sizes) for c in boxes])
            self.require(problem is None, str(problem), key)


# A chunk layout whose grid of cut points has more cells than this (per chunk) is refused
# rather than checked: snapstate's own layouts are grids (cells == chunks).
MAX_GRID_CELLS_PER_CHUNK = 64
MIN_GRID_CELLS = 1 << 20


def tiling_problem(shape: list[int], boxes: list[tuple[list[int], list[int]]]) -> str | None:
    """Why non-empty ``boxes`` (inside ``shape``) overlap, or None if none do.

    The cut points of every dimension split the tensor into a grid of cells; each box covers
    whole cells, so two boxes overlap exactly when they mark the same cell. Work is the number
    of cells, which is the number of chunks for grid layouts: near-linear at any chunk count.
    """
    all_cuts = [sorted({o for o, _ in d} | {o + s for o, s in d}) for d in _per_dim(boxes)]
    # A dimension no chunk divides tells no boxes apart: dropped (numpy has at most 32 dims).
    dims = [d for d, c in enumerate(all_cuts) if len(c) > 2]
    cuts = [all_cuts[d] for d in dims]
    reduced = [([o[d] for d in dims], [s[d] for d in dims]) for o, s in boxes]
    cells = math.prod(len(c) - 1 for c in cuts)
    if cells > max(MIN_GRID_CELLS, MAX_GRID_CELLS_PER_CHUNK * len(boxes)):
        return f"{len(boxes)} chunks cut the tensor into {cells} cells: not a chunk grid"
    grid = np.zeros([len(c) - 1 for c in cuts], dtype=np.bool_)
    for (offsets, sizes), (at, size) in zip(boxes, reduced):
        region = tuple(
            slice(bisect.bisect_left(c, o), bisect.bisect_left(c, o + n))
            for c, o, n in zip(cuts, at, size)
        )
        if grid[region].any():
            return f"chunk at {short(offsets)} size {short(sizes)} overlaps another chunk"
        grid[region] = True
    return None if grid.all() else "chunks leave a hole in the tensor"


def _per_dim(boxes: list[tuple[list[int], list[int]]]) -> list[list[tuple[int, int]]]:
    return [[(o[d], s[d]) for o, s in boxes] for d in range(len(boxes[0][0]))]
