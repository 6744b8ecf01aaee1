"""Which boxes several ranks hold (replicas), and how to compare their hashes (pure).

Boxes are grouped by the set of ranks holding them: under DDP one group holds everything,
under DP x TP each TP shard has its own group of DP replicas. Each rank lists the hashes of
its groups' boxes; a group whose members' lists differ is examined box by box to name the
keys and the ranks that disagree.
"""

from __future__ import annotations

from dataclasses import dataclass

from snapstate.planning.holdings import Holdings, gather_holdings
from snapstate.planning.items import Box, ItemMeta, WriteItem
from snapstate.planning.layout import SavePlan, write_item


@dataclass(frozen=True)
class ReplicaGroup:
    ranks: tuple[int, ...]
    boxes: tuple[tuple[str, Box], ...]  # (key, box), in a fixed order


def replica_groups(all_metas: list[list[ItemMeta]]) -> list[ReplicaGroup]:
    """Every (key, box) held by two ranks or more, grouped by holders; same on every rank."""
    return groups_from(gather_holdings(all_metas))


def groups_from(holdings: Holdings) -> list[ReplicaGroup]:
    """``replica_groups`` of already indexed metadata. Rank 0's copy of a ``from_rank0`` key
    is written unchecked (module buffers): such boxes are in no group."""
    groups: dict[tuple[int, ...], list[tuple[str, Box]]] = {}
    for h in holdings.several:
        if not h.meta.from_rank0 and h.box.numel:
            groups.setdefault(tuple(h.ranks), []).append((h.meta.key, h.box))
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


def witness_candidates(plan: SavePlan, rank: int) -> list[WitnessItem]:
    """The chunks written by other ranks inside boxes this rank holds as a replica.

    Those are the chunks several ranks could have written (the plan's flexible ones), save
    rank 0's unchecked copies and empty tensors; each is witnessed by its holders other than its writer.
    """
    out = []
    for flexible, writer in plan.assignment.flexible:
        ranks = flexible.ranks
        meta, _, nbytes = flexible.chunk
        if writer != rank and rank in ranks and nbytes and not meta.from_rank0:
            others = tuple(r for r in ranks if r != writer)
            out.append(WitnessItem(write_item(flexible.chunk, writer), others))
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
