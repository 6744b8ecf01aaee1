"""Which boxes several ranks hold (replicas), and how to compare their hashes (pure).

Boxes are grouped by the set of ranks holding them: under DDP one group holds everything,
under DP x TP each TP shard has its own group of DP replicas. Each rank lists the hashes of
its groups' boxes; a group whose members' lists differ is examined box by box to name the
keys and the ranks that disagree.
"""

from __future__ import annotations

from dataclasses import dataclass

from snapstate.planning.items import Box, ItemMeta, Placement


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
