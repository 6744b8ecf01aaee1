"""SaveOptions, how a save runs, and the one rule that merges a call's keywords into them."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from snapstate.engine.staging import DEFAULT_SLAB_BYTES
from snapstate.format.codec import CODECS
from snapstate.format.integrity import DEFAULT_BLOCK_BYTES
from snapstate.planning.incremental import Reuse
from snapstate.planning.layout import PlanOptions


@dataclass(frozen=True)
class SaveOptions:
    """How a save runs: pass one to ``ss.save``, ``ss.async_save`` or ``CheckpointManager``.

    Fields:

    - ``timeout``: seconds to wait for other ranks (metadata exchange, commit) and for staging
      memory, before a CheckpointTimeoutError naming who did not come (default 1800).
    - ``block_bytes``: the bytes covered by one xxh3-64 checksum in the shard files
      (default 4 MiB); a load verifies whole blocks.
    - ``piece_bytes``: the unit of staging and writing: large tensors are copied and written in
      pieces of at most this size, capped at the staging pool's slab (default 64 MiB).
    - ``threads``: writer threads per rank; the rank's shard files are spread over them
      (default 1).
    - ``overwrite``: replace a committed checkpoint at the same path; without it such a save
      raises CheckpointExistsError and touches nothing (default False).
    - ``plan``: PlanOptions, how replicated tensors are split into chunks and how large a shard
      file grows.
    - ``verify_replicas``: ``"hash"`` (default): replicas must hash equal across ranks, checked
      at save (a divergence is a ReplicaMismatchError and no commit); ``"off"``: not checked.
    - ``unchecked_replicas``: key paths (each with everything under it) whose replicas may
      differ across ranks: rank 0's copy is written, as for module buffers, and the replica
      check skips them (default none).
    - ``replica_witnesses``: how many holders of each replicated chunk hash their copy per save:
      k = a rotating k of the holders (hash work k x the replicated state per save, a diverged
      holder caught within holders - 1 saves); None = every holder, every save (default 1).
    - ``compression``: ``"zstd"``: every chunk of 4 KiB or more is stored compressed, losslessly
      (zstd level 1; float dtypes split into byte planes first, ``format/codec.py``), on the
      writer threads; loads decode on the read side. Pays where bandwidth is dear (object
      storage); None (default) stores raw bytes, faster where the disk outruns the codec.
    - ``incremental``: set by ``CheckpointManager(incremental=True)`` for each save, not by
      hand: the chunks of the previous committed step that this save references instead of
      writing when their bytes are unchanged (by xxh3-128 digest, computed in the checksum
      pass); every chunk's digest is recorded. Not with ``compression`` (default None: off).
    """

    timeout: float = 1800.0
    block_bytes: int = DEFAULT_BLOCK_BYTES
    piece_bytes: int = DEFAULT_SLAB_BYTES
    threads: int = 1
    overwrite: bool = False
    plan: PlanOptions = field(default_factory=PlanOptions)
    verify_replicas: str = "hash"
    unchecked_replicas: tuple[str, ...] = ()
    replica_witnesses: int | None = 1
    compression: str | None = None
    incremental: Reuse | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.compression not in (None, *CODECS):
            raise ValueError(f"compression={self.compression!r}: expected None or one of {CODECS}")
        if self.compression is not None and self.incremental is not None:
            raise ValueError(INCREMENTAL_COMPRESSED)


INCREMENTAL_COMPRESSED = (
    "incremental saves do not support compression yet: a compressed chunk's stored bytes"
    " differ from its raw ones, so pass compression=None with incremental=True"
)


_DEFAULTS = SaveOptions()


def with_keywords(
    options: SaveOptions | None, *, timeout: float | None = None, overwrite: bool | None = None
) -> SaveOptions:
    """The options of a call that passed both ``options`` and the ``timeout`` / ``overwrite``
    keywords (None: not passed, the options' value holds).

    A keyword fills in a field that ``options`` left at its default; one that contradicts a
    field ``options`` set to another value is a ValueError, so neither silently wins. (A frozen
    dataclass cannot tell ``SaveOptions(timeout=1800.0)`` from ``SaveOptions()``: a field
    equal to its default counts as not set.)
    """
    opts = options if options is not None else SaveOptions()
    for name, value in (("timeout", timeout), ("overwrite", overwrite)):
        held = getattr(opts, name)
        if value is not None and held != value and held != getattr(_DEFAULTS, name):
            raise ValueError(
                f"{name}={value!r} contradicts options.{name}={held!r}: pass it in one place"
            )
    return replace(
        opts,
        timeout=opts.timeout if timeout is None else timeout,
        overwrite=opts.overwrite if overwrite is None else overwrite,
    )
