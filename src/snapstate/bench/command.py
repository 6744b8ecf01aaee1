"""Command line of the harness: ``snapstate bench`` (sweep, ``report``) and ``snapstate demo``."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import click

from snapstate.bench.methods import method_names
from snapstate.bench.presets import PRESETS, BenchConfig, get_preset


class LineProgress:
    """Progress as plain lines on stderr, for logs and pipes."""

    def __init__(self) -> None:
        self.total, self.done = 0, 0

    def begin(self, total: int) -> None:
        self.total = total

    def advance(self, label: str) -> None:
        self.done += 1
        click.echo(f"[{self.done}/{self.total}] {label}", err=True)

    def note(self, text: str) -> None:
        click.echo(text, err=True)


class RichProgress:
    """A rich progress bar, when attached to a terminal."""

    def __init__(self) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        self.bar = Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()
        )
        self.task: Any = None

    def begin(self, total: int) -> None:
        self.bar.start()
        self.task = self.bar.add_task("starting ranks", total=total)

    def advance(self, label: str) -> None:
        self.bar.update(self.task, advance=1, description=label)

    def note(self, text: str) -> None:
        self.bar.console.print(text)

    def stop(self) -> None:
        self.bar.stop()


def _progress() -> Any:
    return RichProgress() if sys.stderr.isatty() else LineProgress()


def _split(text: str | None) -> tuple[str, ...] | None:
    return tuple(p.strip() for p in text.split(",") if p.strip()) if text else None


def _check_methods(names: tuple[str, ...] | None) -> None:
    unknown = [n for n in names or () if n not in method_names()]
    if unknown:
        raise click.BadParameter(
            f"unknown method(s) {', '.join(unknown)}; known: {', '.join(method_names())}"
        )


def _check_models(names: tuple[str, ...] | None) -> None:
    from snapstate.bench.models import parse_model

    for n in names or ():
        try:
            parse_model(n)
        except ValueError as e:
            raise click.BadParameter(str(e)) from e


def build_config(preset: str, **opts: Any) -> BenchConfig:
    """The preset with the command line's overrides applied."""
    methods, models = _split(opts.pop("methods")), _split(opts.pop("models"))
    gpt = _split(opts.pop("gpt_sizes"))
    _check_methods(methods)
    if gpt:
        models = (models or get_preset(preset).models) + tuple(f"gpt:p={s}" for s in gpt)
    _check_models(models)
    ranks = _split(opts.pop("ranks"))
    return get_preset(preset).with_overrides(
        methods=methods,
        models=models,
        ranks=tuple(int(r) for r in ranks) if ranks else None,
        **opts,
    )


def run_and_report(cfg: BenchConfig, out: Path, keep_work: bool = False) -> dict[str, Any]:
    """Run a sweep (in place under torchrun/srun, else launching ranks) and say where it went."""
    from snapstate.bench.launch import distributed_env
    from snapstate.bench.runner import run_bench, run_inplace

    env = distributed_env()
    if env is not None:
        doc = run_inplace(cfg, out, *env)
        if doc is None:
            sys.exit(0)
        return doc
    progress = _progress()
    try:
        doc = run_bench(cfg, out, progress, keep_work=keep_work)
    finally:
        if isinstance(progress, RichProgress):
            progress.stop()
    return doc


def print_summary(doc: dict[str, Any], out: Path) -> None:
    from snapstate.bench.report import main_table

    if doc["records"]:
        click.echo(main_table(doc))
    for e in doc.get("errors", []):
        click.echo(f"error in {e['run']}:\n{e['error']}", err=True)
    click.echo(f"\nresults: {out / 'results.json'}\nreport:  {out / 'report.md'}")


@click.group(invoke_without_command=True)
@click.option(
    "--preset",
    type=click.Choice(list(PRESETS)),
    default="demo",
    show_default=True,
    help="Sweep to run.",
)
@click.option("--methods", help=f"Comma-separated methods (known: {', '.join(method_names())}).")
@click.option(
    "--models",
    help="Comma-separated models: vgg16, resnet18, resnet50, gpt, with options as resnet18:w=0.5 or gpt:p=100M.",
)
@click.option("--gpt-sizes", help="Add GPT models of these parameter counts, e.g. 10M,100M,1B.")
@click.option("--ranks", help="Comma-separated world sizes, e.g. 1,2,4.")
@click.option("--steps", type=int, help="Training steps per measured segment.")
@click.option("--every", type=int, help="Checkpoint every K steps.")
@click.option("--repeats", type=int, help="Repeats of every measurement.")
@click.option("--batch", type=int, help="Batch size per rank.")
@click.option(
    "--data-dir",
    type=click.Path(file_okay=False),
    help="CIFAR-10 binary batches (default: synthetic data).",
)
@click.option(
    "--ckpt-dir",
    type=click.Path(file_okay=False),
    help="Where checkpoints go (default: under --out).",
)
@click.option("--no-determinism", is_flag=True, help="Skip the kill-and-resume checks.")
@click.option("--keep-work", is_flag=True, help="Keep job files and rank logs under OUT/work.")
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("bench-out"),
    show_default=True,
)
@click.pass_context
def bench(
    ctx: click.Context, preset: str, out: Path, no_determinism: bool, keep_work: bool, **opts: Any
) -> None:
    """Measure checkpointing methods side by side; writes OUT/results.json, report.md, *.png."""
    if ctx.invoked_subcommand is not None:
        return
    cfg = build_config(preset, **opts)
    if no_determinism:
        cfg = replace(cfg, determinism=None)
    doc = run_and_report(cfg, out, keep_work)
    print_summary(doc, out)
    if doc["errors"]:
        ctx.exit(1)


@bench.command("report")
@click.argument(
    "results", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path)
)
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    help="Directory for report.md and plots (default: next to RESULTS; for several, merged/ "
    "next to the first, so no input is overwritten).",
)
def report_cmd(results: tuple[Path, ...], out: Path | None) -> None:
    """Re-render report.md and the plots from saved results.json files.

    Several files are merged into one report, later ones winning for the same method, model
    and ranks: rerun one framework's part of a sweep and report it with the rest.
    """
    from snapstate.bench.report import render_report
    from snapstate.bench.results import merge_results, read_results, write_results

    try:
        docs = [read_results(r) for r in results]
    except ValueError as e:
        raise click.ClickException(str(e)) from e
    where = out or results[0].parent / ("merged" if len(docs) > 1 else "")
    doc = docs[0]
    if len(docs) > 1:
        doc = merge_results(docs)
        where.mkdir(parents=True, exist_ok=True)
        write_results(doc, where / "results.json")
    path = render_report(doc, where)
    click.echo(f"report: {path}")


@click.command()
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("demo-out"),
    show_default=True,
)
@click.option("--preset", type=click.Choice(list(PRESETS)), default="demo", show_default=True)
def demo(out: Path, preset: str) -> None:
    """Run the demo sweep and a kill-and-resume determinism check; print where the report is."""
    cfg = get_preset(preset)
    click.echo(
        f"snapstate demo: {len(cfg.methods)} methods x {len(cfg.models)} models x ranks {cfg.ranks}, "
        f"{cfg.repeats} repeats, then kill-and-resume checks; writing to {out}/",
        err=True,
    )
    doc = run_and_report(cfg, out)
    print_summary(doc, out)
    if doc["errors"]:
        sys.exit(1)


if __name__ == "__main__":
    bench()
