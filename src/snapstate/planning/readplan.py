"""Read once, send to the ranks that need it: which rank reads each shared byte range (pure).

On load every rank lists the byte spans it needs. A span needed by one rank is read by it;
a span needed by several (a replicated tensor under DDP, a DTensor's Replicate dimension)
is read from storage by one of them, chosen to balance bytes read, and sent to the others.
Transfers are packed into batches of one reader and one set of receivers, so thousands of
small tensors cost a handful of collectives.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_BATCH_BYTES = 64 << 20


@dataclass(frozen=True, order=True)
class Span:
    """A byte range of a shard file."""

    file: str
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Batch:
    """Spans one rank reads and sends to ``receivers`` in one transfer (concatenated, in order)."""

    reader: int
    receivers: tuple[int, ...]  # ranks other than the reader that need every span of it
    spans: tuple[Span, ...]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.spans)


@dataclass(frozen=True)
class ReadPlan:
    readers: dict[Span, int]  # shared span -> the rank that reads it
    batches: tuple[Batch, ...]  # in the order every rank runs them

    def reads_for(self, rank: int, needs: list[Span]) -> list[Span]:
        """What ``rank`` reads from storage itself: its private spans and the shared ones it serves."""
        return [s for s in needs if self.readers.get(s, rank) == rank]


def plan_reads(needs: list[list[Span]], batch_bytes: int = DEFAULT_BATCH_BYTES) -> ReadPlan:
    """The same plan on every rank from every rank's needs (``needs[rank]``)."""
    holders: dict[Span, list[int]] = {}
    for rank, spans in enumerate(needs):
        for s in dict.fromkeys(spans):
            holders.setdefault(s, []).append(rank)
    loads = [sum(s.nbytes for s in dict.fromkeys(spans) if len(holders[s]) == 1) for spans in needs]
    shared = sorted((s for s, r in holders.items() if len(r) > 1), key=lambda s: (-s.nbytes, s))
    readers: dict[Span, int] = {}
    for s in shared:
        reader = min(holders[s], key=lambda r: (loads[r], r))
        readers[s] = reader
        loads[reader] += s.nbytes
    return ReadPlan(readers, tuple(_batches(readers, holders, batch_bytes)))


def _batches(
    readers: dict[Span, int], holders: dict[Span, list[int]], batch_bytes: int
) -> list[Batch]:
    groups: dict[tuple[int, tuple[int, ...]], list[Span]] = {}
    for s in sorted(readers):  # file order: a reader's reads run along its files
        reader = readers[s]
        groups.setdefault((reader, tuple(r for r in holders[s] if r != reader)), []).append(s)
    out = []
    for (reader, receivers), spans in sorted(groups.items()):
        current: list[Span] = []
        size = 0
        for s in spans:
            if current and size + s.nbytes > batch_bytes:
                out.append(Batch(reader, receivers, tuple(current)))
                current, size = [], 0
            current.append(s)
            size += s.nbytes
        if current:
            out.append(Batch(reader, receivers, tuple(current)))
    return out
