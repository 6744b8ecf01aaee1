"""Which boxes several ranks hold (replicas), and how to compare their hashes (pure).

Boxes are grouped by the set of ranks holding them: under DDP one group holds everything,
under DP x TP each TP shard has its own group of DP replicas. Each rank lists the hashes of
its groups' boxes; a group whose members' lists differ is examined box by box to name the
keys and the ranks that disagree.
"""

from __future__ import annotations

from dataclasses import dataclass

from snapstate.planning.items import Box, ItemMeta, Placement, WriteItem


@dataclass(frozen=True)
class ReplicaGroup:
    ranks: tuple[int, ...]
    boxes: tuple[tuple[str, Box], ...]  # (key, box), in a fixed order


def replica_groups(all_metas: list[list[ItemMeta]]) -> list[ReplicaGroup]:
    """Every (key, box) held by two ranks or more, grouped by holders; same on every rank."""
    # Plain tuple keys (hashed in C), as in planning/dedup.py: this runs over every rank's items.
    holders: dict[tuple[str, tuple[int, ...], tuple[int, ...]], tuple[Box, list[int]]] = {}
    for rank, metas in enumerate(all_metas):
        for meta in metas:
            if meta.placement is Placement.RANK_LOCAL or meta.from_rank0:
                continue
            for box in meta.boxes:
                entry = holders.get((meta.key, box.offsets, box.sizes))
                if entry is not None:
                    entry[1].append(rank)
                elif box.numel:
                    holders[(meta.key, box.offsets, box.sizes)] = (box, [rank])
    groups: dict[tuple[int, ...], list[tuple[str, Box]]] = {}
    for (key, _, _), (box, ranks) in holders.items():
        if len(ranks) > 1:
            groups.setdefault(tuple(ranks), []).append((key, box))
    return [
        ReplicaGroup(r, tuple(sorted(b, key=lambda kb: (kb[0], kb[1].offsets))))
        for r, b in sorted(groups.items())
    ]


@dataclass(frozen=True)
class Divergence:
    key: str
    box: Box
    by_hash: dict[str, tuple[int, ...]]  # hash -> ranks holding that version

    def describe(self) -> str:
        versions = "; ".join(
            f"rank(s) {list(r)} hold xxh3 {h}"
            for h, r in sorted(self.by_hash.items(), key=lambda x: x[1])
        )
        where = f" (box at {list(self.box.offsets)})" if any(self.box.offsets) else ""
        return f"{self.key!r}{where}: {versions}"


def divergences(
    groups: list[ReplicaGroup], bad: list[int], hashes: list[dict[int, list[str]]]
) -> list[Divergence]:
    """Box by box, the replicas that differ; ``hashes[rank][group]`` lists that rank's box hashes."""
    out = []
    for i in bad:
        group = groups[i]
        for j, (key, box) in enumerate(group.boxes):
            by_hash: dict[str, list[int]] = {}
            for r in group.ranks:
                by_hash.setdefault(hashes[r][i][j], []).append(r)
            if len(by_hash) > 1:
                out.append(Divergence(key, box, {h: tuple(r) for h, r in by_hash.items()}))
    return out


@dataclass(frozen=True)
class WitnessItem:
    """A chunk another rank writes that this rank also holds: it may witness the writer."""

    item: WriteItem  # as its writer writes it (``item.rank``)
    others: tuple[int, ...]  # every holder but the writer, in order


def witness_candidates(
    items: tuple[tuple[WriteItem, ...], ...], groups: list[ReplicaGroup], rank: int
) -> list[WitnessItem]:
    """The chunks written by other ranks inside boxes this rank holds as a replica."""
    mine: dict[str, list[tuple[Box, tuple[int, ...]]]] = {}
    for g in groups:
        if rank in g.ranks:
            for key, box in g.boxes:
                mine.setdefault(key, []).append((box, g.ranks))
    out = []
    for writer_items in items:
        for item in writer_items:
            if item.rank == rank or item.placement is Placement.RANK_LOCAL:
                continue
            for box, ranks in mine.get(item.key, ()):
                if _inside(item.box, box) and item.rank in ranks:
                    out.append(WitnessItem(item, tuple(r for r in ranks if r != item.rank)))
                    break
    return out


def witnessed_by(
    candidates: list[WitnessItem], rank: int, turn: int, count: int | None
) -> list[WriteItem]:
    """What ``rank`` hashes in save number ``turn``: all candidates, or a rotating share.

    With ``count`` witnesses per chunk, the ``others`` take turns: over ``len(others)`` saves
    every holder is compared with the writer at least once, and the hash work of a save is
    ``count`` x the replicated state in total, not (holders - 1) x.
    """
    if count is None:
        return [c.item for c in candidates]
    out = []
    for c in candidates:
        n = len(c.others)
        first = (turn + hash_index(c.item)) % n
        if any(c.others[(first + i) % n] == rank for i in range(min(count, n))):
            out.append(c.item)
    return out


def hash_index(item: WriteItem) -> int:
    """A position of the chunk that every rank computes alike (spreads the turns)."""
    return sum(item.box.offsets) + len(item.key)


def _inside(inner: Box, outer: Box) -> bool:
    return all(
        o <= i and i + s <= o + n
        for i, s, o, n in zip(inner.offsets, inner.sizes, outer.offsets, outer.sizes)
    )
