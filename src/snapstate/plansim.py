"""``snapstate plan-sim``: the save planner on synthetic metadata of a large job, on paper.

A transformer (a preset or a parameter count) with Adam, laid out on a DP x TP x PP mesh the
way Megatron-style jobs lay it out: tensor-parallel shards split columns or rows, pipeline
stages hold their own layers, data-parallel replicas hold identical copies (or, with
``--shard-optimizer``, split the optimizer state among themselves). The planner runs exactly
as in a real save; the report gives bytes per rank, files, manifest size and the predicted
save time for a per-node bandwidth, against rank 0 writing everything.

Its timings are one rank's: ``metadata`` derives this rank's metadata and decodes the tables
every rank sends in the gather (pickled as the exchange sends them; the gather's transfer is
not counted), ``plan (per rank)`` indexes them, assigns every chunk, lays out this rank's
files and finds its replica groups and witnesses. Each also in CPU time, which other jobs on
the same cores do not inflate. The other ranks' synthetic metadata is setup, not counted.
"""

from __future__ import annotations

import json
import math
import pickle
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import click

from snapstate.engine.commit import assemble_manifest, marker_chunk
from snapstate.engine.gcpause import paused as gc_paused
from snapstate.format.integrity import block_count
from snapstate.format.manifest import Manifest, parse_manifest
from snapstate.format.marker import Marker
from snapstate.planning.holdings import gather_holdings
from snapstate.planning.items import Box, ItemMeta, Placement
from snapstate.planning.layout import PlanOptions, SavePlan, plan_from
from snapstate.planning.metatable import pack
from snapstate.planning.replicas import groups_from, witness_candidates

GiB = 1 << 30
PRESETS: dict[str, dict[str, int]] = {  # Llama-style dimensions
    "1b": {"layers": 16, "hidden": 2048, "ffn": 8192, "kv": 512, "vocab": 128256},
    "8b": {"layers": 32, "hidden": 4096, "ffn": 14336, "kv": 1024, "vocab": 128256},
    "70b": {"layers": 80, "hidden": 8192, "ffn": 28672, "kv": 1024, "vocab": 128256},
    "405b": {"layers": 126, "hidden": 16384, "ffn": 53248, "kv": 1024, "vocab": 128256},
}


@dataclass(frozen=True)
class Model:
    layers: int
    hidden: int
    ffn: int
    kv: int  # width of k and v projections (kv heads x head dim)
    vocab: int

    @staticmethod
    def named(name: str) -> Model:
        """A preset (``70b``) or dimensions fitted to a parameter count (``13b``, ``500m``)."""
        key = name.lower()
        if key in PRESETS:
            return Model(**PRESETS[key])
        scale = {"m": 1e6, "b": 1e9, "t": 1e12}.get(key[-1:])
        if scale is None:
            raise click.BadParameter(
                f"{name!r} is neither a preset ({', '.join(PRESETS)}) nor a size like 13b"
            )
        params = float(key[:-1]) * scale
        layers = max(2, round(16 * (params / 1e9) ** 0.35))
        hidden = max(256, round(math.sqrt(params / (12.6 * layers)) / 256) * 256)
        return Model(layers, hidden, round(3.5 * hidden / 256) * 256, min(1024, hidden), 128256)

    def tensors(self) -> list[tuple[str, tuple[int, int] | tuple[int], int | None, int]]:
        """(key, shape, tensor-parallel dim or None, pipeline layer or -1 first / -2 last)."""
        h = self.hidden
        specs: list[tuple[str, tuple[int, int] | tuple[int], int | None, int]] = [
            ("embed", (self.vocab, h), 0, -1)
        ]
        for i in range(self.layers):
            p = f"layers/{i}"
            specs += [
                (f"{p}/attn_norm", (h,), None, i),
                (f"{p}/q", (h, h), 0, i),
                (f"{p}/k", (self.kv, h), 0, i),
                (f"{p}/v", (self.kv, h), 0, i),
                (f"{p}/o", (h, h), 1, i),
                (f"{p}/mlp_norm", (h,), None, i),
                (f"{p}/gate", (self.ffn, h), 0, i),
                (f"{p}/up", (self.ffn, h), 0, i),
                (f"{p}/down", (h, self.ffn), 1, i),
            ]
        return specs + [("norm", (h,), None, -2), ("lm_head", (self.vocab, h), 0, -2)]

    @property
    def params(self) -> int:
        return sum(math.prod(shape) for _, shape, _, _ in self.tensors())


@dataclass(frozen=True)
class Mesh:
    dp: int
    tp: int
    pp: int

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pp, dp, tp) of a rank; tensor parallelism innermost, so a TP group shares a node."""
        return rank // (self.dp * self.tp), (rank // self.tp) % self.dp, rank % self.tp


@dataclass
class SimConfig:
    ranks: int = 4096
    model: str = "70b"
    tp: int = 8
    pp: int = 16
    dp: int | None = None
    optimizer: str = "adam"
    shard_optimizer: bool = False
    chunk_mib: int = 32
    block_mib: int = 4
    file_gib: int = 2
    node_gbps: float = 10.0  # GB/s a node writes
    ranks_per_node: int = 8


@dataclass
class SimReport:
    config: dict[str, Any]
    model: dict[str, int]
    state_bytes: int
    bytes_per_rank: dict[str, float]
    files: int
    chunks: int
    manifest_bytes: int
    metadata_bytes_per_rank: int  # what one rank sends in the (first, uncached) metadata gather
    ideal_max_bytes: (
        float  # the least a busiest rank can write: each box's bytes split evenly among its holders
    )
    predicted_save_s: float
    rank0_only_save_s: float
    timings_s: dict[str, float] = field(default_factory=dict)


def _tp_box(shape: tuple[int, ...], dim: int | None, index: int, parts: int) -> Box:
    if dim is None:
        return Box.full(shape)
    step = -(-shape[dim] // parts)  # torch.chunk: the last shards may be short or empty
    lo = min(index * step, shape[dim])
    size = max(0, min(step, shape[dim] - lo))
    offsets = tuple(lo if d == dim else 0 for d in range(len(shape)))
    return Box(offsets, tuple(size if d == dim else s for d, s in enumerate(shape)))


def _dp_box(box: Box, index: int, parts: int) -> Box:
    """ZeRO: a DP replica's slice (rows) of its TP shard."""
    step = -(-box.sizes[0] // parts)
    lo = min(index * step, box.sizes[0])
    size = max(0, min(step, box.sizes[0] - lo))
    return Box((box.offsets[0] + lo, *box.offsets[1:]), (size, *box.sizes[1:]))


def stage_of(layer: int, layers: int, pp: int) -> int:
    if layer == -1:
        return 0
    if layer == -2:
        return pp - 1
    return layer * pp // layers


def rank_metas(
    model: Model, mesh: Mesh, cfg: SimConfig
) -> dict[tuple[int, int, int], list[ItemMeta]]:
    """Metadata per distinct (pp, dp, tp) coordinate (replicas share one list, as they are equal)."""
    dp_groups = mesh.dp if cfg.shard_optimizer else 1
    return {
        (pp, dp, tp): coord_metas(model, mesh, cfg, (pp, dp, tp))
        for pp in range(mesh.pp)
        for tp in range(mesh.tp)
        for dp in range(dp_groups)
    }


def rank_metas_of(model: Model, mesh: Mesh, cfg: SimConfig, rank: int) -> list[ItemMeta]:
    """What one rank derives of its own state before the gather."""
    return coord_metas(model, mesh, cfg, _coord_key(mesh.coords(rank), cfg))


def coord_metas(
    model: Model, mesh: Mesh, cfg: SimConfig, coord: tuple[int, int, int]
) -> list[ItemMeta]:
    """The metadata of the ranks at (pp, dp, tp): parameters, optimizer steps and states."""
    states = {"adam": ("master", "exp_avg", "exp_avg_sq"), "sgd": ("momentum",), "none": ()}[
        cfg.optimizer
    ]
    dp_groups = mesh.dp if cfg.shard_optimizer else 1
    pp, dp, tp = coord
    mine = [t for t in model.tensors() if stage_of(t[3], model.layers, mesh.pp) == pp]
    params = [
        ItemMeta(f"model/{k}", "bfloat16", s, 2, Placement.SHARD, (_tp_box(s, d, tp, mesh.tp),))
        for k, s, d, _ in mine
    ]
    steps = [
        ItemMeta(f"optim/state/{k}/step", "float32", (), 4, Placement.REPLICATE, (Box.full(()),))
        for k, _, _, _ in mine
        if states
    ]
    opt = [
        ItemMeta(
            f"optim/state/{k}/{name}",
            "float32",
            s,
            4,
            Placement.SHARD,
            (
                _dp_box(_tp_box(s, d, tp, mesh.tp), dp, dp_groups)
                if dp_groups > 1
                else _tp_box(s, d, tp, mesh.tp),
            ),
        )
        for k, s, d, _ in mine
        for name in states
    ]
    return params + steps + opt


def simulate(cfg: SimConfig) -> SimReport:
    model = Model.named(cfg.model)
    mesh = _mesh(cfg)
    timings: dict[str, float] = {}
    with gc_paused():  # setup, not a rank's work: every rank's metadata, as it sends it
        by_coord = rank_metas(model, mesh, cfg)
        all_metas = [by_coord[_coord_key(mesh.coords(r), cfg)] for r in range(cfg.ranks)]
        sent = {id(m): pickle.dumps(pack(m)) for m in by_coord.values()}
        gathered = [sent[id(m)] for m in all_metas]
        metadata_bytes = max(len(b) for b in sent.values())
        ideal = ideal_max(all_metas)  # for the report; then the metadata objects go
        del sent, by_coord, all_metas
    options = PlanOptions(chunk_bytes=cfg.chunk_mib << 20, max_file_bytes=cfg.file_gib * GiB)
    with gc_paused():  # as in a save, whose planning runs with the cyclic collector paused
        # what one rank spends before it writes (collective/exchange.py): its own metadata,
        # the gathered metadata of every rank decoded, their index, the whole assignment, its
        # own files, the replica groups and what it witnesses
        # wall time, and the CPU time of this process (other jobs sharing the cores slow the
        # first, not the second)
        started, cpu = time.perf_counter(), time.process_time()
        pack(rank_metas_of(model, mesh, cfg, 0))
        tables = [pickle.loads(blob) for blob in gathered]
        timings["metadata"] = time.perf_counter() - started
        timings["metadata (cpu)"] = time.process_time() - cpu
        started, cpu = time.perf_counter(), time.process_time()
        holdings = gather_holdings(tables)
        plan = plan_from(holdings, options)
        plan.for_rank(0)
        groups_from(holdings)
        witness_candidates(plan, 0)
        timings["plan (per rank)"] = time.perf_counter() - started
        timings["plan (per rank, cpu)"] = time.process_time() - cpu
        del gathered, tables  # what the gather received: not kept by a save either
    started = time.perf_counter()
    rank_plans = plan.ranks  # every rank's files: for this report, not part of a rank's save
    timings["layout of all ranks (report only)"] = time.perf_counter() - started
    manifest_bytes, chunks, t_build, t_parse = _manifest(plan, cfg.block_mib << 20)
    timings.update(manifest_build=t_build, manifest_parse=t_parse)
    per_rank = [r.nbytes for r in rank_plans]
    per_node = [
        sum(per_rank[i : i + cfg.ranks_per_node]) for i in range(0, cfg.ranks, cfg.ranks_per_node)
    ]
    bandwidth = cfg.node_gbps * 1e9
    return SimReport(
        config=asdict(cfg),
        model={**asdict(model), "params": model.params},
        state_bytes=sum(per_rank),
        bytes_per_rank={
            "min": min(per_rank),
            "median": statistics.median(per_rank),
            "max": max(per_rank),
            "mean": sum(per_rank) / len(per_rank),
        },
        files=sum(len(r.files) for r in rank_plans),
        chunks=chunks,
        manifest_bytes=manifest_bytes,
        metadata_bytes_per_rank=metadata_bytes,
        ideal_max_bytes=ideal,
        predicted_save_s=max(per_node) / bandwidth,
        rank0_only_save_s=sum(per_rank) / bandwidth,
        timings_s=timings,
    )


def ideal_max(all_metas: list[list[ItemMeta]]) -> float:
    """Max over ranks of a fractional share: every box's bytes divided evenly among its holders."""
    holders: dict[tuple[str, Box], int] = {}
    for metas in all_metas:
        for m in metas:
            for box in m.boxes:
                holders[(m.key, box)] = holders.get((m.key, box), 0) + 1
    share: dict[int, float] = {}
    for rank, metas in enumerate(all_metas):
        key = id(metas)  # replicas share one list: compute once
        if key not in share:
            share[key] = sum(
                b.numel * m.itemsize / holders[(m.key, b)] for m in metas for b in m.boxes
            )
    return max(share.values())


def _mesh(cfg: SimConfig) -> Mesh:
    dp = cfg.dp if cfg.dp is not None else cfg.ranks // (cfg.tp * cfg.pp)
    if dp < 1 or dp * cfg.tp * cfg.pp != cfg.ranks:
        raise click.BadParameter(
            f"dp x tp x pp = {dp} x {cfg.tp} x {cfg.pp} does not make {cfg.ranks} ranks"
        )
    return Mesh(dp, cfg.tp, cfg.pp)


def _coord_key(coords: tuple[int, int, int], cfg: SimConfig) -> tuple[int, int, int]:
    pp, dp, tp = coords
    return (pp, dp if cfg.shard_optimizer else 0, tp)


def _manifest(plan: SavePlan, block_bytes: int) -> tuple[int, int, float, float]:
    """The manifest a save of this plan commits (checksums faked), its size and timings."""
    started = time.perf_counter()
    manifest = _manifest_of(plan, block_bytes)
    raw = manifest.to_json()
    chunks = sum(len(t.chunks) for t in manifest.tensors.values())
    built = time.perf_counter() - started
    started = time.perf_counter()
    parse_manifest(raw)
    return len(raw), chunks, built, time.perf_counter() - started


def _manifest_of(plan: SavePlan, block_bytes: int) -> Manifest:
    """What the commit assembles from every rank's marker, each block's checksum made up."""
    markers = []
    for rank_plan in plan.ranks:
        items = [
            marker_chunk(
                p, block_bytes, ["0123456789abcdef"] * block_count(p.item.nbytes, block_bytes)
            )
            for f in rank_plan.files
            for p in f.items
        ]
        markers.append(
            Marker(
                rank=rank_plan.rank,
                files={f.path: f.size for f in rank_plan.files},
                chunks=tuple(items),
                kinds={},
            )
        )
    return assemble_manifest(plan, markers, {"d": []}, 0, {})


def format_report(r: SimReport) -> str:
    m, c, b = r.model, r.config, r.bytes_per_rank
    gb = 1e9
    mesh = _mesh(SimConfig(**c))
    lines = [
        f"model {c['model']}: {m['params'] / 1e9:.1f}B params ({m['layers']} layers, hidden {m['hidden']}, ffn {m['ffn']}), optimizer {c['optimizer']}"
        + (" sharded over DP" if c["shard_optimizer"] else ""),
        f"mesh: {c['ranks']} ranks = DP {mesh.dp} x TP {mesh.tp} x PP {mesh.pp}, {c['ranks_per_node']} ranks per node",
        f"state written: {r.state_bytes / gb:.1f} GB in {r.files} files, {r.chunks} chunks",
        f"bytes per rank: min {b['min'] / gb:.3f} GB, median {b['median'] / gb:.3f} GB, max {b['max'] / gb:.3f} GB (mean {b['mean'] / gb:.3f})",
        f"busiest rank vs the best possible for this layout (each box split evenly among its holders): {b['max'] / r.ideal_max_bytes:.3f}x",
        f"manifest: {r.manifest_bytes / 1e6:.1f} MB; metadata sent per rank before planning: {r.metadata_bytes_per_rank / 1e3:.0f} kB (once; cached after)",
        f"predicted save at {c['node_gbps']:g} GB/s per node: {r.predicted_save_s:.1f} s (rank 0 writing everything: {r.rank0_only_save_s:.0f} s)",
        "planner time: " + ", ".join(f"{k} {v:.2f} s" for k, v in r.timings_s.items()),
    ]
    return "\n".join(lines)


@click.command("plan-sim")
@click.option("--ranks", default=4096, show_default=True)
@click.option(
    "--model",
    default="70b",
    show_default=True,
    help=f"a preset ({', '.join(PRESETS)}) or a size such as 13b",
)
@click.option("--tp", default=8, show_default=True)
@click.option("--pp", default=16, show_default=True)
@click.option("--dp", type=int, default=None, help="data-parallel replicas [ranks / (tp x pp)]")
@click.option(
    "--optimizer", type=click.Choice(["adam", "sgd", "none"]), default="adam", show_default=True
)
@click.option(
    "--shard-optimizer",
    is_flag=True,
    help="ZeRO-1: optimizer state split over DP instead of replicated",
)
@click.option(
    "--chunk-mib",
    default=32,
    show_default=True,
    help="replicated data is split and spread in chunks of this size",
)
@click.option(
    "--node-gbps", default=10.0, show_default=True, help="write bandwidth of one node, GB/s"
)
@click.option("--ranks-per-node", default=8, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="print the report as JSON")
def plan_sim(as_json: bool, **options: Any) -> None:
    """Run the save planner for a synthetic large job and predict its checkpoint."""
    report = simulate(SimConfig(**options))
    click.echo(json.dumps(asdict(report), indent=2) if as_json else format_report(report))
