"""The ``snapstate`` command: inspect, verify, ls, export, plus the bench harness and demo."""

from __future__ import annotations

import json
import sys
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from snapstate import api
from snapstate.errors import CheckpointError
from snapstate.format.manifest import Manifest
from snapstate.plansim import plan_sim

console = Console()


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


@click.group()
@click.version_option(package_name="snapstate")
def main() -> None:
    """Checkpoints for PyTorch training: asynchronous, parallel, reshardable, verified."""


@main.command()
@click.argument("path")
@click.option("--json", "as_json", is_flag=True, help="Print the manifest summary as JSON.")
def inspect(path: str, as_json: bool) -> None:
    """Keys, dtypes, shapes, bytes, files and save timings of a checkpoint."""
    manifest = _or_exit(lambda: api.inspect(path))
    if as_json:
        click.echo(json.dumps(summary(manifest), indent=2))
        return
    table = Table(title=f"{path}  (step {manifest.step}, {manifest.world_size} rank(s))")
    for col in ("key", "dtype", "shape", "placement", "chunks", "bytes"):
        table.add_column(col, justify="right" if col in ("chunks", "bytes") else "left")
    for key, rec in sorted(manifest.all_tensors().items()):
        table.add_row(
            key, rec.dtype, str(rec.shape), rec.placement, str(len(rec.chunks)), human(rec.nbytes)
        )
    console.print(table)
    totals = manifest.totals
    console.print(
        f"files: {totals.get('files')}   bytes: {human(totals.get('bytes', 0))}   bytes per rank: {[human(b) for b in totals.get('bytes_per_rank', [])]}"
    )
    per_rank = manifest.timings.get("per_rank", [])
    if per_rank:
        console.print(
            "timings per rank (s): "
            + ", ".join(
                f"r{i}: blocking {t.get('blocking_s', 0):.3f} write {t.get('write_s', 0):.3f}"
                for i, t in enumerate(per_rank)
            )
        )


def summary(manifest: Manifest) -> dict[str, Any]:
    return {
        "format": f"{manifest.format}/{manifest.version}",
        "step": manifest.step,
        "world_size": manifest.world_size,
        "created": manifest.created,
        "versions": manifest.versions,
        "totals": manifest.totals,
        "timings": manifest.timings,
        "files": {p: {"bytes": f.bytes, "rank": f.rank} for p, f in manifest.files.items()},
        "tensors": {
            k: {
                "dtype": r.dtype,
                "shape": r.shape,
                "placement": r.placement,
                "bytes": r.nbytes,
                "chunks": len(r.chunks),
            }
            for k, r in manifest.all_tensors().items()
        },
    }


@main.command()
@click.argument("path")
def verify(path: str) -> None:
    """Check every checksum; exit 1 with the reason on corruption."""
    report = _or_exit(lambda: _verify_with_progress(path))
    click.echo(
        f"ok: {report.tensors} tensors, {report.chunks} chunks, {human(report.bytes_checked)} verified in {report.files} files"
    )


def _verify_with_progress(path: str) -> Any:
    from snapstate.engine.verify import verify_checkpoint
    from snapstate.storage.base import storage_for

    if not sys.stderr.isatty():
        return verify_checkpoint(storage_for(path))
    from rich.progress import Progress

    total = api.inspect(path).totals.get("tensor_bytes", 0)
    with Progress(console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("verifying", total=total)
        return verify_checkpoint(storage_for(path), progress=lambda n: progress.advance(task, n))


@main.command("ls")
@click.argument("root")
def ls(root: str) -> None:
    """Steps under a manager root: committed or not, and their sizes."""
    from snapstate.manager import STEP_DIR
    from snapstate.storage.base import storage_for

    storage = storage_for(root)
    table = Table(title=root)
    for col in ("step", "state", "bytes", "files", "ranks"):
        table.add_column(col)
    for name in storage.listdir():
        match = STEP_DIR.match(name)
        if not match:
            continue
        try:
            m = api.inspect(storage.child(name).root)
            table.add_row(
                str(int(match.group(1))),
                "committed",
                human(m.totals.get("bytes", 0)),
                str(m.totals.get("files")),
                str(m.world_size),
            )
        except CheckpointError as exc:
            state = "uncommitted" if "not committed" in str(exc) else f"invalid: {exc}"[:60]
            table.add_row(str(int(match.group(1))), state, "-", "-", "-")
    console.print(table)


@main.command()
@click.argument("path")
@click.option("--to", "to", type=click.Choice(["torch", "safetensors"]), required=True)
@click.argument("out")
def export(path: str, to: str, out: str) -> None:
    """Consolidate a (sharded) checkpoint into one torch or safetensors file."""
    from snapstate.export import export_checkpoint

    n = _or_exit(lambda: export_checkpoint(path, to, out))  # type: ignore[arg-type]
    click.echo(f"wrote {n} tensors to {out}")


def _or_exit(fn: Any) -> Any:
    try:
        return fn()
    except CheckpointError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)


# The packages of the `bench` extra (pyproject.toml): only their absence may disable the harness's
# commands. Any other ImportError is a broken harness and must not hide `snapstate bench`.
BENCH_EXTRA = ("matplotlib", "torchdata")
BENCH_INSTALL = "pip install 'snapstate[bench]'"


def attach_bench(group: click.Group) -> None:
    """Add ``bench`` and ``demo`` to ``group``; without a package of the bench extra, stand-ins."""
    commands: tuple[click.Command, ...]
    try:
        from snapstate.bench.command import bench, demo

        commands = (bench, demo)
    except ModuleNotFoundError as exc:
        package = missing_optional(exc, BENCH_EXTRA)
        if package is None:
            raise
        commands = tuple(unavailable(name, package, BENCH_INSTALL) for name in ("bench", "demo"))
    for command in commands:
        group.add_command(command)


def missing_optional(exc: ModuleNotFoundError, packages: tuple[str, ...]) -> str | None:
    """The optional package whose absence ``exc`` reports, or None for any other module."""
    top = (exc.name or "").partition(".")[0]
    return top if top in packages else None


def unavailable(name: str, package: str, install: str) -> click.Command:
    """A command that only says which package it lacks and how to install it, and exits 1."""
    reason = f"snapstate {name} needs the optional package {package!r}, not installed: {install}"

    def refuse() -> None:
        click.echo(f"error: {reason}", err=True)
        sys.exit(1)

    return click.Command(
        name,
        callback=refuse,
        help=f"Unavailable: {reason}.",
        context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
    )


main.add_command(plan_sim)
attach_bench(main)

if __name__ == "__main__":
    main()
