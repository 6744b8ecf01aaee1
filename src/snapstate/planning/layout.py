"""Where each chunk goes: shard files per rank, their headers and byte offsets (pure)."""

from __future__ import annotations

from dataclasses import dataclass, field

from snapstate.format.dtypes import safetensors_entry
from snapstate.format.shard import ShardEntry, build_header
from snapstate.planning.dedup import DEFAULT_CHUNK_BYTES, Assignment, Chunk, assign
from snapstate.planning.holdings import Holdings, gather_holdings
from snapstate.planning.items import FilePlan, ItemMeta, PlacedItem, RankPlan, WriteItem
from snapstate.planning.validate import check_consistent

DEFAULT_FILE_BYTES = 2 << 30


@dataclass(frozen=True)
class PlanOptions:
    """How a save is planned (``SaveOptions.plan``).

    Fields:

    - ``chunk_bytes``: replicated tensors are split into chunks of about this size, spread
      over the ranks that hold them, so that each rank writes a balanced share (default
      32 MiB).
    - ``max_file_bytes``: a rank starts a new shard file once its current one passes this size
      (default 2 GiB).
    """

    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    max_file_bytes: int = DEFAULT_FILE_BYTES


def plan_save(all_metas: list[list[ItemMeta]], options: PlanOptions = PlanOptions()) -> SavePlan:
    """Every rank calls this with the same gathered metadata and gets the same plan."""
    return plan_from(gather_holdings(all_metas), options)


def plan_from(holdings: Holdings, options: PlanOptions = PlanOptions()) -> SavePlan:
    """The plan of already indexed metadata (the exchange indexes it once for several uses)."""
    check_consistent(holdings)
    assignment = assign(holdings, options.chunk_bytes)
    return SavePlan(holdings.world_size, assignment, holdings.metas, options.max_file_bytes)


def plan_files(rank: int, items: list[WriteItem], max_file_bytes: int) -> list[FilePlan]:
    # Larger itemsizes first keeps every tensor aligned to its element size in the buffer.
    ordered = sorted(items, key=lambda i: (-i.itemsize, i.placement.value, i.key, i.box.offsets))
    groups: list[list[WriteItem]] = [[]]
    size = 0
    for item in ordered:
        if groups[-1] and size + item.nbytes > max_file_bytes:
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += item.nbytes
    return [
        _file_plan(f"shards/r{rank:05d}-{i:03d}.safetensors", g)
        for i, g in enumerate(groups)
        if g or i == 0
    ]


def _file_plan(path: str, items: list[WriteItem]) -> FilePlan:
    entries = [
        ShardEntry(i.name, *safetensors_entry(i.dtype, i.box.sizes, i.nbytes), i.nbytes)
        for i in items
    ]
    header, starts = build_header(entries, {"format": "snapstate/1"})
    placed = tuple(PlacedItem(item, path, start) for item, start in zip(items, starts))
    return FilePlan(path, header, placed)


@dataclass(frozen=True)
class SavePlan:
    """The same on every rank: what each rank writes, and the keys the manifest reports.

    A rank turns only its own chunks into write items and lays out only its own files
    (``items_of``, ``for_rank``): at thousands of ranks, doing so for every rank on every
    rank cost more than the whole assignment.
    """

    world_size: int
    assignment: Assignment
    metas: dict[str, ItemMeta] = field(default_factory=dict)  # global (non rank-local) keys
    max_file_bytes: int = 2 << 30
    _items: dict[int, tuple[WriteItem, ...]] = field(
        default_factory=dict, compare=False, repr=False
    )
    _layout: dict[int, RankPlan] = field(default_factory=dict, compare=False, repr=False)

    def items_of(self, rank: int) -> tuple[WriteItem, ...]:
        """The chunks ``rank`` writes (made once, then kept)."""
        items = self._items.get(rank)
        if items is None:
            items = self._items[rank] = tuple(
                write_item(chunk, rank) for chunk in self.assignment.chunks_of(rank)
            )
        return items

    @property
    def items(self) -> tuple[tuple[WriteItem, ...], ...]:
        """Every rank's chunks (tools and tests; a save asks only for its own)."""
        return tuple(self.items_of(r) for r in range(self.world_size))

    def for_rank(self, rank: int) -> RankPlan:
        """The rank's shard files with headers and offsets (built once, then kept)."""
        plan = self._layout.get(rank)
        if plan is None:
            plan = self._layout[rank] = RankPlan(
                rank, tuple(plan_files(rank, list(self.items_of(rank)), self.max_file_bytes))
            )
        return plan

    @property
    def ranks(self) -> tuple[RankPlan, ...]:
        return tuple(self.for_rank(r) for r in range(self.world_size))


def write_item(chunk: Chunk, rank: int) -> WriteItem:
    meta, box, _ = chunk
    return WriteItem(meta.key, meta.dtype, meta.shape, meta.itemsize, meta.placement, box, rank)
