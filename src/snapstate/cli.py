"""The ``snapstate`` command: inspect, verify, ls, export, plus the bench harness and demo."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NoReturn

import click
from rich.console import Console
from rich.table import Table

from snapstate import api
from snapstate.errors import CheckpointError, CheckpointNotFoundError
from snapstate.format.manifest import Manifest
from snapstate.plansim import plan_sim

if TYPE_CHECKING:
    from snapstate.storage.base import Storage

console = Console()


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


class OneLineErrors(click.Group):
    """A group whose every error, a usage error included, is one line on stderr and exit 1
    (2 for usage), never a traceback."""

    def main(  # type: ignore[override]
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, False, **extra)
        try:
            code = super().main(args, prog_name, complete_var, False, **extra)
        except click.ClickException as exc:
            ctx = getattr(exc, "ctx", None)
            hint = f" (see {ctx.command_path} --help)" if ctx is not None else ""
            click.echo(f"error: {_one_line_text(exc.format_message())}{hint}", err=True)
            sys.exit(exc.exit_code)
        except click.Abort:
            click.echo("error: aborted", err=True)
            sys.exit(1)
        except Exception as exc:  # noqa: BLE001 - the promise: one line, no traceback
            _fail(exc)
        sys.exit(code if isinstance(code, int) else 0)


@click.group(cls=OneLineErrors)
@click.version_option(package_name="snapstate")
def main() -> None:
    """Checkpoints for PyTorch training: asynchronous, parallel, reshardable, verified."""


@main.command()
@click.argument("path")
@click.option("--json", "as_json", is_flag=True, help="Print the manifest summary as JSON.")
def inspect(path: str, as_json: bool) -> None:
    """Keys, dtypes, shapes, bytes, files and save timings of a checkpoint (or the steps of a
    manager's root)."""
    try:
        manifest = api.inspect(path)
    except CheckpointNotFoundError:
        rows = _or_exit(lambda: step_rows(path))
        if not rows:
            _or_exit(lambda: api.inspect(path))  # the original error, one line
        _print_steps(path, rows, as_json)
        return
    except Exception as exc:  # noqa: BLE001 - every error is one line
        _fail(exc)
    if as_json:
        click.echo(json.dumps(summary(manifest), indent=2))
        return
    keys = manifest.all_tensors()
    table = Table(title=f"{path}  (step {manifest.step}, {manifest.world_size} rank(s))")
    table.add_column("key", no_wrap=True)  # whole, however long: the console widens instead
    for col in ("dtype", "shape", "placement", "chunks", "bytes"):
        table.add_column(col, justify="right" if col in ("chunks", "bytes") else "left")
    for key, rec in sorted(keys.items()):
        table.add_row(
            key, rec.dtype, str(rec.shape), rec.placement, str(len(rec.chunks)), human(rec.nbytes)
        )
    longest = max((len(k) for k in keys), default=0)
    out = (
        Console(width=max(console.width, longest + 70)) if longest + 70 > console.width else console
    )
    out.print(table)
    totals = manifest.totals
    out.print(
        f"files: {totals.get('files')}   bytes: {human(totals.get('bytes', 0))}   bytes per rank: {[human(b) for b in totals.get('bytes_per_rank', [])]}"
    )
    per_rank = manifest.timings.get("per_rank", [])
    if per_rank:
        out.print(
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
    """Check every checksum; exit 1 with the reason on corruption. PATH may be a manager
    root: then every step is checked, and a damaged file shared by incremental steps is
    named with every step it breaks."""
    if not _is_checkpoint(path) and step_rows(path):
        _verify_root(path)
        return
    report = _or_exit(lambda: _verify_with_progress(path))
    click.echo(
        f"ok: {report.tensors} tensors, {report.chunks} chunks, {human(report.bytes_checked)} verified in {report.files} files"
    )


def _verify_root(root: str) -> None:
    from snapstate.references import damaged_files, verify_steps
    from snapstate.storage.base import storage_for

    checks = _or_exit(lambda: verify_steps(storage_for(root)))
    for check in checks:
        click.echo(
            f"{check.step}: " + ("ok" if check.problem is None else f"DAMAGED: {check.problem}")
        )
    for file, steps in damaged_files(checks).items():
        click.echo(f"damaged file {file} breaks steps: {', '.join(steps)}")
    if any(c.problem is not None for c in checks):
        sys.exit(1)


@main.command("copy")
@click.argument("root")
@click.argument("step", type=int)
@click.argument("dest")
def copy(root: str, step: int, dest: str) -> None:
    """Copy STEP of the manager ROOT to DEST as a self-contained checkpoint (the files its
    incremental saves reference copied in, a manifest without references), then verify it."""
    from snapstate.copystep import copy_step

    report = _or_exit(lambda: copy_step(root, step, dest))
    click.echo(
        f"copied step {step} to {dest}: {report.files} files, {human(report.bytes_checked)} verified"
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
    rows = _or_exit(lambda: step_rows(root))
    if not rows:
        _fail(CheckpointNotFoundError(_no_steps(root)))
    _print_steps(root, rows, as_json=False)


def _no_steps(root: str) -> str:
    from snapstate.storage.base import storage_for

    if not storage_for(root).exists(""):
        return f"{root}: no such directory"
    hint = " (it is one checkpoint: see snapstate inspect)" if _is_checkpoint(root) else ""
    return f"{root} is not a checkpoint manager root: no step-NNNNNNNNN directories{hint}"


def _is_checkpoint(path: str) -> bool:
    try:
        api.inspect(path)
    except CheckpointError:
        return False
    return True


def step_rows(root: str) -> list[tuple[int, str, Manifest | None]]:
    """Each step directory under ``root``: (step, its state, its manifest if it validates)."""
    from snapstate.manager import STEP_DIR
    from snapstate.storage.base import storage_for

    storage = storage_for(root)
    rows: list[tuple[int, str, Manifest | None]] = []
    for name in storage.listdir():
        match = STEP_DIR.match(name)
        if not match:
            continue
        try:
            rows.append((int(match.group(1)), "committed", api.inspect(storage.child(name).root)))
        except CheckpointError as exc:
            state = "uncommitted" if "not committed" in str(exc) else f"invalid: {_one_line(exc)}"
            rows.append((int(match.group(1)), state[:60], None))
    return sorted(_kept_for_references(storage, rows), key=lambda row: row[0])


def _kept_for_references(
    storage: Storage, rows: list[tuple[int, str, Manifest | None]]
) -> list[tuple[int, str, Manifest | None]]:
    """A step retention deleted whose files later steps still reference (incremental saves)
    is no leftover of an interrupted save: say so."""
    from snapstate.manager import step_dir
    from snapstate.references import referenced, steps_holding

    if not any(state == "uncommitted" for _, state, _ in rows):
        return rows
    held = steps_holding(referenced(storage, [step_dir(s) for s, _, m in rows if m is not None]))
    return [
        (step, "deleted (files referenced by later steps kept)", m)
        if state == "uncommitted" and step_dir(step) in held
        else (step, state, m)
        for step, state, m in rows
    ]


def _print_steps(root: str, rows: list[tuple[int, str, Manifest | None]], as_json: bool) -> None:
    valid = [step for step, _, m in rows if m is not None]
    newest = max(valid) if valid else None
    if as_json:
        steps = [{"step": step, "state": state} for step, state, _ in rows]
        click.echo(json.dumps({"root": root, "steps": steps, "newest_valid": newest}, indent=2))
        return
    table = Table(title=root)
    for col in ("step", "state", "bytes", "files", "ranks"):
        table.add_column(col)
    for step, state, m in rows:
        sizes = ("-", "-", "-")
        if m is not None:
            sizes = (human(m.totals.get("bytes", 0)), str(m.totals.get("files")), str(m.world_size))
        table.add_row(str(step), state, *sizes)
    console.print(table)
    console.print(f"newest valid step: {newest}" if newest is not None else "no valid step")


@main.command()
@click.argument("path")
@click.option("--to", "to", type=click.Choice(["torch", "safetensors", "hf"]), required=True)
@click.argument("out")
@click.option("--key", default=None, help="--to hf: the model's key  [default: model]")
@click.option("--config", default=None, help="--to hf: a config.json copied beside the weights.")
@click.option(
    "--max-shard-size",
    default=None,
    help="--to hf: bytes per shard, as 5GB or 500MiB  [default: 5GB]",
)
def export(
    path: str, to: str, out: str, key: str | None, config: str | None, max_shard_size: str | None
) -> None:
    """Consolidate a (sharded) checkpoint into the new file OUT (--to torch or safetensors), or
    write its model (--key) to the new directory OUT that from_pretrained loads (--to hf)."""
    from snapstate.export import export_checkpoint
    from snapstate.hfexport import DEFAULT_MAX_SHARD_SIZE, export_hf

    def note(line: str) -> None:
        click.echo(f"note: {line}", err=True)

    if to == "hf":
        size = max_shard_size or DEFAULT_MAX_SHARD_SIZE
        files = _or_exit(
            lambda: export_hf(
                path, out, key=key or "model", config=config, max_shard_size=size, say=note
            )
        )
        click.echo(f"wrote {', '.join(files)} to {out}")
        return
    given = [
        f"--{n}"
        for n, v in (("key", key), ("config", config), ("max-shard-size", max_shard_size))
        if v
    ]
    if given:
        verb = "applies" if len(given) == 1 else "apply"
        raise click.UsageError(f"{', '.join(given)} {verb} only to --to hf")
    n = _or_exit(lambda: export_checkpoint(path, to, out, say=note))  # type: ignore[arg-type]
    click.echo(f"wrote {n} tensors to {out}")


def _or_exit(fn: Any) -> Any:
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - every error is one line and exit 1, no traceback
        _fail(exc)


def _fail(exc: BaseException) -> NoReturn:
    known = isinstance(exc, (CheckpointError, OSError, ValueError, TypeError))
    click.echo(f"error: {'' if known else type(exc).__name__ + ': '}{_one_line(exc)}", err=True)
    sys.exit(1)


def _one_line(exc: BaseException) -> str:
    """A multi-line message (an IncompatibleStateError's list) joined into one line."""
    return _one_line_text(str(exc) or type(exc).__name__)


def _one_line_text(text: str) -> str:
    parts = [part.strip() for part in text.splitlines() if part.strip()]
    last = len(parts) - 1
    return " ".join(p if p.endswith(":") or i == last else p + ";" for i, p in enumerate(parts))


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
