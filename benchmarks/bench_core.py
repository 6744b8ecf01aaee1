"""Core benchmark: snapstate against raw I/O, torch.save and DCP on one large state, in one run.

Every method is measured in the same process, interleaved (each repeat runs every method
once, in a new seeded order), after a warm-up round, and reported as medians with min and
max; before each measurement the previous output is deleted and the page cache written back. Reads are cold when the page cache can be dropped (root), warm otherwise; the
report says which. Targets are ratios between methods of this run, never absolute speeds.

    .venv/bin/python benchmarks/bench_core.py [--size-mib 512] [--tensors 16] [--repeats 9]
        [--dir DIR] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

import snapstate as ss

MiB = 1 << 20
GiB = 1 << 30


@dataclass(frozen=True)
class Config:
    size_mib: int = 512
    tensors: int = 16
    repeats: int = 9
    warmup: int = 1
    dir: str | None = None
    json: str | None = None
    drop_caches: bool = True
    only: tuple[str, ...] = ()  # measure only methods whose name contains one of these


@dataclass
class Method:
    """One measured operation; ``run`` returns its seconds (it may time only part of itself)."""

    name: str
    group: str  # "save" | "blocking" | "load"
    run: Callable[[], float]
    samples: list[float] = field(default_factory=list)
    extra: dict[str, list[float]] = field(default_factory=dict)


# ---- the state ------------------------------------------------------------------------------


def make_tensors(cfg: Config) -> list[torch.Tensor]:
    """``tensors`` float32 matrices of 1024 columns, ``size_mib`` in total."""
    per_tensor = cfg.size_mib * MiB // cfg.tensors
    rows = per_tensor // (4 * 1024)
    g = torch.Generator().manual_seed(0)
    return [torch.randn(rows, 1024, generator=g) for _ in range(cfg.tensors)]


def as_state(ts: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    return {f"layer{i:02d}.weight": t for i, t in enumerate(ts)}


def byte_view(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


def nbytes(ts: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def tensor_spans(checkpoint: Path, keys: list[str]) -> list[tuple[Path, str, int]]:
    """(shard file, key, byte offset) of each tensor of a one-file snapstate checkpoint."""
    manifest = ss.inspect(checkpoint)
    spans = []
    for key in keys:
        (chunk,) = manifest.tensors[key].chunks  # one process saved it: one chunk per tensor
        spans.append((checkpoint / chunk.file, key, chunk.start))
    if len({file for file, _, _ in spans}) != 1:
        raise SystemExit("expected a single shard file")
    return sorted(spans, key=lambda s: s[2])


# ---- page cache -----------------------------------------------------------------------------


def try_drop_caches() -> bool:
    """Write back and drop the page cache; False where that is not allowed (not root)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


# ---- the methods ----------------------------------------------------------------------------


class Bench:
    """The state, its preallocated load targets, and a fresh output path per measurement."""

    def __init__(self, cfg: Config, work: Path) -> None:
        self.cfg, self.work = cfg, work
        self.ts = make_tensors(cfg)
        self.state = as_state(self.ts)
        self.targets = as_state([torch.empty_like(t) for t in self.ts])
        # Buffers of the copy floor alone: loads into ``targets`` may leave their memory in a
        # state (file-backed, unfaulted) that makes a later copy into it slow.
        self.copy_dst = [torch.empty_like(t) for t in self.ts]
        self.pool = ss.HostBufferPool()
        self.cold = cfg.drop_caches and try_drop_caches()
        self.sources: dict[str, Path] = {}
        self.raw_spans: list[tuple[Path, str, int]] = []
        self._dcp_pg = False

    def fresh(self, name: str) -> Path:
        """An empty output path; the previous one is removed and written back first."""
        path = self.work / "out" / name
        shutil.rmtree(path, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        path.parent.mkdir(parents=True, exist_ok=True)
        os.sync()
        return path

    def before_read(self) -> None:
        if self.cold:
            try_drop_caches()

    # -- saves ---------------------------------------------------------------------------
    def raw_write(self, path: Path | None = None) -> float:
        path = path or self.fresh("raw.bin")
        started = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for t in self.ts:
                view = byte_view(t)
                while len(view):
                    view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        return time.perf_counter() - started

    def torch_save(self, path: Path | None = None) -> float:
        path = path or self.fresh("torch.pt")
        started = time.perf_counter()
        with open(path, "wb") as f:
            torch.save(self.state, f)
            f.flush()
            os.fsync(f.fileno())
        return time.perf_counter() - started

    def dcp_save(self, path: Path | None = None) -> float:
        import torch.distributed.checkpoint as dcp

        path = path or self.fresh("dcp")
        started = time.perf_counter()
        dcp.save(self.state, checkpoint_id=str(path))
        return time.perf_counter() - started

    def ss_save(self, path: Path | None = None) -> float:
        path = path or self.fresh("ss")
        started = time.perf_counter()
        ss.save(self.state, path)
        return time.perf_counter() - started

    # -- blocking parts ------------------------------------------------------------------
    def clone(self) -> float:
        gc.collect()
        started = time.perf_counter()
        copies = [t.clone() for t in self.ts]
        elapsed = time.perf_counter() - started
        del copies
        return elapsed

    def copy_into(self) -> float:
        """The floor of any staging: copying into memory that is already allocated."""
        started = time.perf_counter()
        for dst, src in zip(self.copy_dst, self.ts, strict=True):
            dst.copy_(src)
        return time.perf_counter() - started

    def ss_async(self, method: Method) -> float:
        path = self.fresh("ss-async")
        started = time.perf_counter()
        handle = ss.async_save(self.state, path, pool=self.pool)
        blocking = time.perf_counter() - started
        handle.wait()
        method.extra.setdefault("total", []).append(time.perf_counter() - started)
        return blocking

    def dcp_async(self, method: Method) -> float:
        path = self.fresh("dcp-async")
        started = time.perf_counter()
        future = self._dcp_async_save(path)
        blocking = time.perf_counter() - started
        future.result()
        method.extra.setdefault("total", []).append(time.perf_counter() - started)
        return blocking

    def _dcp_async_save(self, path: Path) -> Any:
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        try:
            return dcp.async_save(self.state, checkpoint_id=str(path))
        except (RuntimeError, ValueError):
            if self._dcp_pg or dist.is_initialized():
                raise
            # Older torch: async_save needs a process group; one rank of gloo on loopback.
            dist.init_process_group(
                "gloo", init_method="tcp://127.0.0.1:29517", rank=0, world_size=1
            )
            self._dcp_pg = True
            return dcp.async_save(self.state, checkpoint_id=str(path))

    # -- loads ---------------------------------------------------------------------------
    def prepare_sources(self) -> None:
        """One file or directory per format to load from, written once."""
        src = self.work / "src"
        src.mkdir(parents=True, exist_ok=True)
        self.sources = {"torch": src / "torch.pt", "dcp": src / "dcp", "ss": src / "ss"}
        self.torch_save(self.sources["torch"])
        self.dcp_save(self.sources["dcp"])
        self.ss_save(self.sources["ss"])
        self.raw_spans = tensor_spans(self.sources["ss"], list(self.targets))

    def raw_read(self) -> float:
        """The tensors' bytes read from the very file ss.load reads, in file order, one thread.

        Why that file: on a virtual disk two files of the same size can read at different
        speeds (placement, host caching); the same blocks leave only the software path.
        """
        self.before_read()
        started = time.perf_counter()
        with open(self.raw_spans[0][0], "rb", buffering=0) as f:
            for _, key, start in self.raw_spans:
                f.seek(start)
                view = byte_view(self.targets[key])
                while len(view):
                    view = view[f.readinto(view) :]
        return time.perf_counter() - started

    def torch_load(self, into_targets: bool = False) -> float:
        """torch.load: new tensors, nothing restored (informs). ``into_targets``: then copied
        into the targets, as ``load_state_dict`` does: the restore a torch user runs, and the
        work ss.load does (into the same targets)."""
        self.before_read()
        started = time.perf_counter()
        loaded = torch.load(self.sources["torch"], weights_only=True)
        if into_targets:
            for key, target in self.targets.items():
                target.copy_(loaded[key])
        elapsed = time.perf_counter() - started
        del loaded
        return elapsed

    def dcp_load(self) -> float:
        import torch.distributed.checkpoint as dcp

        self.before_read()
        started = time.perf_counter()
        dcp.load(self.targets, checkpoint_id=str(self.sources["dcp"]))
        return time.perf_counter() - started

    def ss_load(self) -> float:
        self.before_read()
        started = time.perf_counter()
        ss.load(self.targets, self.sources["ss"])
        return time.perf_counter() - started

    # -- checks --------------------------------------------------------------------------
    def check_loads(self) -> None:
        """Every load method really restores the state (a fast wrong load proves nothing)."""
        for name, load in [
            ("raw read", self.raw_read),
            ("dcp.load", self.dcp_load),
            ("ss.load", self.ss_load),
        ]:
            for t in self.targets.values():
                t.zero_()
            load()
            if not all(torch.equal(self.targets[k], v) for k, v in self.state.items()):
                raise SystemExit(f"{name} did not restore the state")
        loaded = torch.load(self.sources["torch"], weights_only=True)
        if not all(torch.equal(loaded[k], v) for k, v in self.state.items()):
            raise SystemExit("torch.load did not restore the state")
        for t in self.targets.values():
            t.zero_()
        self.torch_load(into_targets=True)
        if not all(torch.equal(self.targets[k], v) for k, v in self.state.items()):
            raise SystemExit("torch.load + copy did not restore the state")


def methods(b: Bench, only: tuple[str, ...] = ()) -> list[Method]:
    out = [
        Method("raw write+fsync", "save", b.raw_write),
        Method("torch.save+fsync", "save", b.torch_save),
        Method("dcp.save", "save", b.dcp_save),
        Method("ss.save", "save", b.ss_save),
        Method("clone", "blocking", b.clone),
        Method("copy into allocated", "blocking", b.copy_into),
        Method("ss.async_save blocking", "blocking", lambda: 0.0),
        Method("dcp.async_save blocking", "blocking", lambda: 0.0),
        Method("raw read", "load", b.raw_read),
        Method("torch.load", "load", b.torch_load),
        Method("torch.load + copy", "load", lambda: b.torch_load(into_targets=True)),
        Method("dcp.load", "load", b.dcp_load),
        Method("ss.load", "load", b.ss_load),
    ]
    by_name = {m.name: m for m in out}
    by_name["ss.async_save blocking"].run = lambda: b.ss_async(by_name["ss.async_save blocking"])
    by_name["dcp.async_save blocking"].run = lambda: b.dcp_async(by_name["dcp.async_save blocking"])
    if only:  # the baselines always run: every ratio needs them
        keep = set(BASELINE.values())
        out = [m for m in out if m.name in keep or any(o in m.name for o in only)]
    return out


# ---- running ---------------------------------------------------------------------------------


def rounds(ms: list[Method], repeats: int, seed: int = 0) -> Iterator[list[Method]]:
    """Every method once per repeat, in a fresh (seeded) order each time.

    Why not a plain rotation: it keeps each method right after the same neighbour, so one
    method's after-effects (writeback, freed memory) would always land on the same other one.
    """
    rng = random.Random(seed)
    for _ in range(repeats):
        order = list(ms)
        rng.shuffle(order)
        yield order


def run_all(b: Bench, ms: list[Method], cfg: Config, console: Console) -> None:
    for order in rounds(ms, cfg.warmup, seed=-1):
        for m in order:
            m.run()  # warm-up: buffer pool, page tables, imports, DCP planner caches
    for m in ms:
        m.extra.clear()
    for r, order in enumerate(rounds(ms, cfg.repeats)):
        for m in order:
            gc.collect()
            m.samples.append(m.run())
        console.print(f"  repeat {r + 1}/{cfg.repeats} done", style="dim")


# ---- report ----------------------------------------------------------------------------------

BASELINE = {"save": "raw write+fsync", "blocking": "clone", "load": "raw read"}


@dataclass
class Target:
    """``ratio`` (of medians) decides; ``paired`` is the median of same-repeat ratios, a check.
    Without a ``limit`` the row informs and always passes."""

    text: str
    ratio: float
    paired: float
    limit: float | None
    passed: bool = field(init=False)

    def __post_init__(self) -> None:
        self.passed = self.limit is None or self.ratio <= self.limit


def median(m: Method) -> float:
    return statistics.median(m.samples)


# A load that writes no target before every byte is verified (a failed load leaves the state
# as it was) reads the bytes once and copies them once: its floor is a raw read plus a copy
# into allocated memory of the same bytes, both measured in this run.
LOAD_FLOOR = ("raw read", "copy into allocated")


def targets(by: dict[str, Method]) -> list[Target]:
    def target(text: str, a: str, b: str | tuple[str, ...], limit: float | None) -> Target | None:
        bs = (b,) if isinstance(b, str) else b
        if a not in by or any(x not in by for x in bs):
            return None
        rounds = zip(by[a].samples, *(by[x].samples for x in bs))
        paired = statistics.median(r[0] / sum(r[1:]) for r in rounds)
        return Target(text, median(by[a]) / sum(median(by[x]) for x in bs), paired, limit)

    found = [
        target("ss.save <= 1.15 x raw write+fsync", "ss.save", "raw write+fsync", 1.15),
        target("ss.save faster than torch.save", "ss.save", "torch.save+fsync", 1.0),
        target("ss.save faster than dcp.save", "ss.save", "dcp.save", 1.0),
        target("ss.async_save blocking <= 1.0 x clone", "ss.async_save blocking", "clone", 1.0),
        target(
            "ss.async_save blocking well under DCP's (<= 0.5 x)",
            "ss.async_save blocking",
            "dcp.async_save blocking",
            0.5,
        ),
        target("ss.load <= 1.15 x (raw read + copy into allocated)", "ss.load", LOAD_FLOOR, 1.15),
        target("ss.load / raw read (informs)", "ss.load", "raw read", None),
        # ss.load restores into the caller's tensors; torch.load alone only makes new ones
        target("ss.load faster than torch.load + copy", "ss.load", "torch.load + copy", 1.0),
        target("ss.load / torch.load alone (informs)", "ss.load", "torch.load", None),
        target("ss.load faster than dcp.load", "ss.load", "dcp.load", 1.0),
    ]
    return [t for t in found if t is not None]


def figures_table(ms: list[Method], size: int, cold: bool) -> Table:
    by = {m.name: m for m in ms}
    reads = "cold (page cache dropped before each)" if cold else "warm (page cache not dropped)"
    table = Table(title=f"{size / GiB:.2f} GiB state; reads {reads}; seconds")
    for col in ("method", "median", "min", "max", "GiB/s", "x baseline", "baseline"):
        table.add_column(col, justify="left" if col in ("method", "baseline") else "right")
    for m in ms:
        base = by.get(BASELINE[m.group], m)
        table.add_row(
            m.name,
            f"{median(m):.3f}",
            f"{min(m.samples):.3f}",
            f"{max(m.samples):.3f}",
            f"{size / GiB / median(m):.2f}",
            f"{median(m) / median(base):.2f}",
            base.name,
        )
        if "total" in m.extra:
            total = m.extra["total"]
            table.add_row(
                "  (until committed)",
                f"{statistics.median(total):.3f}",
                f"{min(total):.3f}",
                f"{max(total):.3f}",
                "",
                "",
                "",
            )
    return table


def targets_table(ts: list[Target]) -> Table:
    table = Table(title="targets: ratio of medians (decides) and median of same-repeat ratios")
    for col in ("target", "ratio", "paired", "limit", "result"):
        table.add_column(col)
    for t in ts:
        table.add_row(
            t.text,
            f"{t.ratio:.3f}",
            f"{t.paired:.3f}",
            "-" if t.limit is None else f"{t.limit:.2f}",
            "-" if t.limit is None else "[green]PASS[/]" if t.passed else "[red]FAIL[/]",
        )
    return table


def write_json(path: str, cfg: Config, b: Bench, ms: list[Method], ts: list[Target]) -> None:
    doc = {
        "config": asdict(cfg),
        "bytes": nbytes(b.ts),
        "reads": "cold" if b.cold else "warm",
        "environment": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "snapstate": ss.__version__,
        },
        "methods": {
            m.name: {
                "group": m.group,
                "baseline": BASELINE[m.group],
                "samples_s": m.samples,
                "median_s": median(m),
                "min_s": min(m.samples),
                "max_s": max(m.samples),
                "extra_s": m.extra,
            }
            for m in ms
        },
        "targets": [asdict(t) for t in ts],
    }
    Path(path).write_text(json.dumps(doc, indent=2))


def parse_args(argv: list[str] | None) -> Config:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--size-mib",
        type=int,
        default=512,
        help="total state size (512 to 1024 is the study's range)",
    )
    p.add_argument("--tensors", type=int, default=16, help="number of float32 matrices")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--warmup", type=int, default=1, help="unmeasured rounds first")
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    p.add_argument("--json", default=None, help="also write the results as JSON here")
    p.add_argument(
        "--no-drop-caches",
        dest="drop_caches",
        action="store_false",
        help="keep the page cache (warm reads)",
    )
    p.add_argument(
        "--only",
        default="",
        help="comma-separated parts of method names to measure (baselines always run)",
    )
    a = p.parse_args(argv)
    only = tuple(o.strip() for o in a.only.split(",") if o.strip())
    return Config(a.size_mib, a.tensors, a.repeats, a.warmup, a.dir, a.json, a.drop_caches, only)


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    console = Console()
    console.width = max(console.width, 120)  # the tables stay readable when piped
    warnings.filterwarnings("ignore")  # DCP's deprecation chatter would bury the tables
    work = Path(tempfile.mkdtemp(prefix="snapstate-bench-", dir=cfg.dir))
    try:
        b = Bench(cfg, work)
        console.print(
            f"state: {cfg.tensors} float32 matrices, {nbytes(b.ts) / MiB:.0f} MiB; writing under {work}"
        )
        b.prepare_sources()
        b.check_loads()
        ms = methods(b, cfg.only)
        run_all(b, ms, cfg, console)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ts = targets({m.name: m for m in ms})
    console.print(figures_table(ms, nbytes(b.ts), b.cold))
    console.print(targets_table(ts))
    if cfg.json:
        write_json(cfg.json, cfg, b, ms, ts)
    return 0 if all(t.passed for t in ts) else 1


if __name__ == "__main__":
    sys.exit(main())
