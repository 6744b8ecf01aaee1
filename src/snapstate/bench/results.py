"""The results.json schema (``snapstate-bench/1``): one record per method x model x ranks x repeat.

Top level: ``schema``, ``created`` (ISO time), ``host`` (machine and versions), ``config`` (the
sweep), ``methods`` (name -> MethodInfo), ``records`` (list of Record), ``determinism`` (list of
DeterminismResult), ``skipped`` (methods that could not run here, with the reason). Times are
seconds, sizes bytes. docs/bench.md describes every field.
"""

from __future__ import annotations

import json
import re
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SCHEMA = "snapstate-bench/1"


@dataclass
class Record:
    """One method on one model and world size, one repeat (medians over its checkpoints)."""

    method: str
    model: str
    ranks: int
    repeat: int
    unique_state_bytes: int  # one copy of model + optimizer tensors
    bytes_on_disk: int  # every file of one checkpoint
    files: int
    bytes_per_rank: list[int]  # bytes written by each rank
    blocking_s: float  # training stopped for this long per checkpoint (slowest rank)
    save_s: float  # call to durable, per checkpoint (slowest rank)
    persist_s: float  # save_s - blocking_s: the part hidden in the background
    load_s: float  # restoring the last checkpoint, cold page cache: median of load_s_all
    train_step_s: float  # median step time while this method checkpoints
    overhead_pct: float  # training time with checkpoints vs without, in percent
    peak_rss_bytes: int  # peak resident memory while checkpointing (largest rank)
    deterministic: bool | None  # kill-and-resume bitwise identical; None when not checked
    rss_added_bytes: int = 0  # peak above the no-checkpoint baseline's peak (largest rank)
    baseline_step_s: float = 0.0
    train_s: float = 0.0
    baseline_train_s: float = 0.0
    checkpoints: int = 0
    blocking_s_all: list[float] = field(default_factory=list)
    save_s_all: list[float] = field(default_factory=list)
    save_s_per_rank: list[float] = field(default_factory=list)
    load_s_all: list[float] = field(default_factory=list)  # each cold load (slowest rank)
    largest_file_bytes: int = 0
    raw_write_bytes_per_s: float = 0.0  # write+fsync of plain files, same storage, same run
    write_bytes_per_s: float = 0.0  # bytes_on_disk / save_s
    model_params: int = 0
    format: str = ""
    device: str = "cpu"
    framework: str = "torch"
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class DeterminismResult:
    """Uninterrupted vs killed (SIGKILL) after a checkpoint and resumed in a new process."""

    method: str
    model: str
    ranks: int
    steps: int
    checkpoint_step: int
    killed_at_step: int | None
    params_identical: bool
    losses_identical: bool
    max_param_diff: float
    max_loss_diff: float
    first_divergent_step: int | None
    reason: str = ""

    @property
    def deterministic(self) -> bool:
        return self.params_identical and self.losses_identical

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "deterministic": self.deterministic}


RECORD_TYPES: dict[str, type | tuple[type, ...]] = {
    "method": str,
    "model": str,
    "ranks": int,
    "repeat": int,
    "unique_state_bytes": int,
    "bytes_on_disk": int,
    "files": int,
    "bytes_per_rank": list,
    "blocking_s": (int, float),
    "save_s": (int, float),
    "load_s": (int, float),
    "train_step_s": (int, float),
    "overhead_pct": (int, float),
    "peak_rss_bytes": int,
}


def validate(doc: dict[str, Any]) -> list[str]:
    """Problems with a results document (empty when it follows the schema)."""
    problems = (
        [] if doc.get("schema") == SCHEMA else [f"schema is {doc.get('schema')!r}, want {SCHEMA!r}"]
    )
    for key in ("host", "config", "methods", "records", "determinism"):
        if key not in doc:
            problems.append(f"missing top-level key {key!r}")
    for i, rec in enumerate(doc.get("records", [])):
        problems += [f"record {i}: {p}" for p in _record_problems(rec)]
    return problems


def _record_problems(rec: dict[str, Any]) -> list[str]:
    out = []
    for key, typ in RECORD_TYPES.items():
        if not isinstance(rec.get(key), typ) or isinstance(rec.get(key), bool):
            out.append(f"{key} is {rec.get(key)!r}")
    if rec.get("deterministic") not in (True, False, None) or "deterministic" not in rec:
        out.append("deterministic must be true, false or null")
    if isinstance(rec.get("bytes_per_rank"), list) and len(rec["bytes_per_rank"]) != rec.get(
        "ranks"
    ):
        out.append("bytes_per_rank must have one entry per rank")
    return out


def median(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else 0.0


def _per_checkpoint_max(ranks: list[dict[str, Any]], key: str) -> list[float]:
    """For each checkpoint, the slowest rank's value (the one training waits for)."""
    columns = [r[key] for r in ranks]
    return [max(vals) for vals in zip(*columns, strict=True)] if columns else []


def _per_load_max(per_rank: list[dict[str, Any]]) -> list[float]:
    """For each timed load, the slowest rank's time (observations older than the repeated
    loads carry one ``load_s``)."""
    return _per_checkpoint_max(
        [{"load": m.get("load_s_all") or [m["load_s"]]} for m in per_rank], "load"
    )


def records_from_run(
    run: dict[str, Any], model: str, repeat: int, infos: dict[str, Any]
) -> list[Record]:
    """Turn the observations every rank of one measurement run reported into records."""
    ranks = run["ranks"]
    world = len(ranks)
    base = _baseline(ranks)
    raw_bps = sum(r["raw_bytes"] for r in ranks) / max(max(r["raw_write_s"] for r in ranks), 1e-9)
    out = []
    for name in ranks[0]["methods"]:
        per_rank = [r["methods"][name] for r in ranks]
        rec = _method_record(name, per_rank, base, world)
        rec.model, rec.repeat = model, repeat
        rec.unique_state_bytes, rec.model_params = run["unique_state_bytes"], run["model_params"]
        rec.raw_write_bytes_per_s, rec.device = raw_bps, run.get("device", "cpu")
        rec.format = infos.get(name, {}).get("format", "")
        rec.framework = run.get("framework", infos.get(name, {}).get("framework", "torch"))
        out.append(rec)
    return out


def _baseline(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    segs = [r["baseline"] for r in ranks]
    train_s = [max(s[i]["train_s"] for s in segs) for i in range(len(segs[0]))]
    return {
        "train_s": median(train_s),
        "segment_train_s": train_s,
        "step_s": max(median([t for seg in s for t in seg["step_s"]]) for s in segs),
        # How far training alone lifts the resident size above the window's start: the
        # first baseline, before any method kept buffers alive.
        "rise": [s[0]["peak_rss"] - s[0]["start_rss"] for s in segs],
    }


def _bracket_train_s(observed: dict[str, Any], base: dict[str, Any]) -> float:
    """The mean of the baseline segments run just before and just after this method (older
    results without a bracket: the median of all baselines)."""
    bracket = observed.get("bracket")
    segments = base["segment_train_s"]
    if not bracket or max(bracket) >= len(segments):
        return float(base["train_s"])
    return sum(segments[i] for i in bracket) / len(bracket)


def _method_record(
    name: str, per_rank: list[dict[str, Any]], base: dict[str, Any], world: int
) -> Record:
    segs = [m["segment"] for m in per_rank]
    blocking = _per_checkpoint_max(segs, "blocking_s")
    save = _per_checkpoint_max(segs, "save_s")
    loads = _per_load_max(per_rank)
    files = per_rank[0]["files"]
    by_rank = [sum(f["bytes"] for f in files if f["rank"] == r) for r in range(world)]
    train_s = max(s["train_s"] for s in segs)
    on_disk = sum(f["bytes"] for f in files)
    reference = _bracket_train_s(per_rank[0], base)
    return Record(
        method=name,
        model="",
        ranks=world,
        repeat=0,
        unique_state_bytes=0,
        bytes_on_disk=on_disk,
        files=len(files),
        bytes_per_rank=by_rank,
        blocking_s=median(blocking),
        save_s=median(save),
        persist_s=median([s - b for s, b in zip(save, blocking, strict=True)]),
        load_s=median(loads),
        train_step_s=max(median(s["step_s"]) for s in segs),
        overhead_pct=100.0 * (train_s - reference) / reference,
        peak_rss_bytes=max(s["peak_rss"] for s in segs),
        deterministic=None,
        rss_added_bytes=max(
            max(0, s["peak_rss"] - s["start_rss"] - rise)
            for s, rise in zip(segs, base["rise"], strict=True)
        ),
        baseline_step_s=base["step_s"],
        train_s=train_s,
        baseline_train_s=reference,
        checkpoints=len(save),
        blocking_s_all=blocking,
        save_s_all=save,
        save_s_per_rank=[median(s["save_s"]) for s in segs],
        load_s_all=loads,
        largest_file_bytes=max((f["bytes"] for f in files), default=0),
        write_bytes_per_s=on_disk / median(save) if save and median(save) > 0 else 0.0,
        extra=_extra(per_rank[0]),
    )


def _extra(first: dict[str, Any]) -> dict[str, Any]:
    extra: dict[str, Any] = {}
    if first.get("manifest"):
        extra["manifest_totals"] = first["manifest"]
    timings = [e for e in first["segment"].get("extra", []) if e]
    if timings:
        extra["library_timings"] = timings
    return extra


def apply_determinism(records: list[dict[str, Any]], checks: list[dict[str, Any]]) -> None:
    """Mark records of (method, model, ranks) that had a kill-and-resume check."""
    verdict = {
        (c["method"], c["model"], c["ranks"]): c["params_identical"] and c["losses_identical"]
        for c in checks
    }
    for rec in records:
        rec["deterministic"] = verdict.get(
            (rec["method"], rec["model"], rec["ranks"]), rec.get("deterministic")
        )


def to_json(obj: Any) -> Any:
    if hasattr(obj, "__dataclass_fields__"):
        return asdict(obj)
    raise TypeError(f"cannot encode {type(obj).__name__}")


def write_results(doc: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=to_json))
    tmp.replace(path)


def read_results(path: Path) -> dict[str, Any]:
    doc = json.loads(Path(path).read_text())
    problems = validate(doc)
    if problems:
        raise ValueError(f"{path} does not follow {SCHEMA}:\n  " + "\n  ".join(problems[:20]))
    return doc


def _error_key(error: dict[str, Any]) -> tuple[str, str, int] | None:
    """(framework, model, ranks) of a failed run from its tag ``<fw>-<model>-n<ranks>-r<k>``."""
    m = re.match(r"^(\w+)-(.+)-n(\d+)-r\d+$", error.get("run", ""))
    return (m.group(1), m.group(2), int(m.group(3))) if m else None


def merge_results(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """One document from several sweeps (e.g. one framework rerun apart): later ones win.

    A later document's records replace the earlier records of the same method, model and
    world size; its determinism checks replace those of the same method; an earlier run's
    error is dropped once a later document holds records of that framework, model and size.
    """
    if not docs:
        raise ValueError("nothing to merge")
    out = json.loads(json.dumps(docs[0]))
    for doc in docs[1:]:
        new = {(r["method"], r["model"], r["ranks"]) for r in doc["records"]}
        out["records"] = [
            r for r in out["records"] if (r["method"], r["model"], r["ranks"]) not in new
        ] + doc["records"]
        checked = {c["method"] for c in doc["determinism"]}
        out["determinism"] = [c for c in out["determinism"] if c["method"] not in checked]
        out["determinism"] += doc["determinism"]
        out["methods"].update(doc["methods"])
        out["skipped"] = [s for s in out["skipped"] if s["method"] not in doc["methods"]]
        out["skipped"] += doc["skipped"]
        out["errors"] += doc["errors"]
        cfg = out["config"]
        cfg["methods"] = list(dict.fromkeys([*cfg["methods"], *doc["config"]["methods"]]))
        cfg["models"] = list(dict.fromkeys([*cfg["models"], *doc["config"]["models"]]))
        cfg["ranks"] = sorted({*cfg["ranks"], *doc["config"]["ranks"]})
    measured = {
        (r.get("framework", "torch"), tag_name(r["model"]), r["ranks"]) for r in out["records"]
    }
    out["errors"] = [e for e in out["errors"] if _error_key(e) not in measured]
    out["merged_from"] = [d.get("created", "") for d in docs]
    apply_determinism(out["records"], out["determinism"])
    return out


def tag_name(name: str) -> str:
    """A model name as run tags and file names spell it (resnet18:w=0.25 -> resnet18_w_0.25)."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
