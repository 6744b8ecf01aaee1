"""Lossless compression of a trained state: ratios and MB/s per core, and S3 save time with it.

A small transformer is trained a few hundred AdamW steps (so weights and moments carry real
structure, not init noise); its fp32 weights, the same weights in bf16, and AdamW's exp_avg_sq
are then compressed on one thread by plain zstd-1, by snapstate's codec (byte planes, then
zstd-1: ``format/codec.py``), and by zipnn where installed (always on a copy: zipnn 0.5.4
reorders its input buffer in place). Last, the trained state is saved to a moto S3 server on
loopback and to the local disk, with and without ``SaveOptions(compression="zstd")``,
interleaved, medians. Every figure comes from this one run; JSON first (``--json``), then
the table.

    .venv/bin/python benchmarks/bench_compress.py [--width 384] [--layers 4] [--steps 300]
        [--repeats 3] [--json PATH] [--local-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from typing import Any

import torch
import zstandard
from rich.console import Console
from rich.table import Table

import snapstate as ss
from snapstate.format import codec

Codec = tuple[Callable[[bytes], bytes], Callable[[bytes], bytes]]


def train(width: int, layers: int, steps: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A small causal LM on a learnable token stream (next token = a fixed map of this one)."""
    torch.manual_seed(0)
    vocab, seq = 512, 64
    model = torch.nn.Sequential(
        torch.nn.Embedding(vocab, width),
        torch.nn.TransformerEncoder(
            torch.nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0, batch_first=True),
            layers,
        ),
        torch.nn.Linear(width, vocab),
    )
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mapping = torch.randperm(vocab)
    for _ in range(steps):
        x = torch.randint(0, vocab, (8, seq))
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), mapping[x].flatten())
        optim.zero_grad()
        loss.backward()
        optim.step()
    return model, optim


def samples(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, tuple[bytes, str]]:
    """The three byte streams compressed, each as (bytes, dtype name)."""
    params = [p.detach().reshape(-1) for p in model.parameters()]
    fp32 = torch.cat(params)
    sq = torch.cat([optim.state[p]["exp_avg_sq"].reshape(-1) for p in model.parameters()])
    return {
        "fp32 weights": (_bytes(fp32), "float32"),
        "bf16 weights": (_bytes(fp32.bfloat16()), "bfloat16"),
        "fp32 exp_avg_sq": (_bytes(sq), "float32"),
    }


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def codecs(dtype: str) -> dict[str, Codec]:
    width = codec.group_width(dtype, 2 if dtype == "bfloat16" else 4)
    zc, zd = zstandard.ZstdCompressor(level=1), zstandard.ZstdDecompressor()
    out: dict[str, Codec] = {
        "zstd-1": (zc.compress, zd.decompress),
        "snapstate (planes+zstd-1)": (lambda b: codec.encode(b, width), codec.decode),
    }
    try:
        from zipnn import ZipNN
    except ImportError:
        return out
    z = ZipNN(input_format="byte", bytearray_dtype=dtype, threads=1)
    # bytearray(): a private copy, since zipnn reorders its input in place
    out["zipnn 0.5.4"] = (lambda b: z.compress(bytearray(b)), lambda f: z.decompress(f))
    return out


def measure(data: bytes, pair: Codec, repeats: int) -> dict[str, float]:
    encode, decode = pair
    enc_s, dec_s = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        frame = encode(data)
        enc_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        back = decode(frame)
        dec_s.append(time.perf_counter() - started)
    assert bytes(back) == data, "not lossless"
    mb = len(data) / 1e6
    return {
        "raw_bytes": len(data),
        "stored_bytes": len(frame),
        "ratio": len(data) / len(frame),
        "compress_MBps": mb / statistics.median(enc_s),
        "decompress_MBps": mb / statistics.median(dec_s),
    }


def s3_saves(state: dict[str, Any], repeats: int) -> dict[str, Any]:
    """Blocking saves of ``state`` to a moto server on loopback, raw and compressed, interleaved."""
    from moto.server import ThreadedMotoServer

    from snapstate.storage.fsspec import FsspecStorage

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    options = {
        "endpoint_url": f"http://{host}:{port}",
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"region_name": "us-east-1"},
    }
    import boto3

    os.environ.update(AWS_CONFIG_FILE=os.devnull, AWS_SHARED_CREDENTIALS_FILE=os.devnull)
    boto3.client(
        "s3",
        endpoint_url=options["endpoint_url"],
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    ).create_bucket(Bucket="bench")
    try:
        return interleaved_saves(
            state, lambda: FsspecStorage(f"s3://bench/{uuid.uuid4().hex}", **options), repeats
        )
    finally:
        server.stop()


def local_saves(state: dict[str, Any], repeats: int, root: str) -> dict[str, Any]:
    """The same saves to the local disk under ``root`` (fsynced): where the codec does not pay."""
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        return interleaved_saves(state, lambda: os.path.join(tmp, uuid.uuid4().hex), repeats)


def interleaved_saves(
    state: dict[str, Any], new_target: Callable[[], Any], repeats: int
) -> dict[str, Any]:
    """Blocking saves raw and compressed, alternating, to a fresh target each; medians."""
    times: dict[str, list[float]] = {"raw": [], "zstd": []}
    stored: dict[str, int] = {}
    for i in range(repeats + 1):  # round 0 warms up (plan cache, connections), untimed
        for name, compression in (("raw", None), ("zstd", "zstd")):
            target = new_target()
            started = time.perf_counter()
            ss.save(state, target, options=ss.SaveOptions(compression=compression))
            if i:
                times[name].append(time.perf_counter() - started)
            stored[name] = ss.inspect(target).totals["bytes"]
    return {
        name: {"save_s": statistics.median(t), "bytes": stored[name], "all_s": t}
        for name, t in times.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=384)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    parser.add_argument("--local-dir", default=".", help="a directory on the local disk")
    args = parser.parse_args()
    torch.set_num_threads(1)  # per core: every codec on one thread
    model, optim = train(args.width, args.layers, args.steps)
    results: dict[str, Any] = {"args": vars(args), "codecs": {}}
    for name, (data, dtype) in samples(model, optim).items():
        results["codecs"][name] = {
            label: measure(data, pair, args.repeats) for label, pair in codecs(dtype).items()
        }
    state = {"model": model, "optim": optim}
    results["s3"] = s3_saves(state, args.repeats)
    results["local"] = local_saves(state, args.repeats, args.local_dir)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    report(results)


def report(results: dict[str, Any]) -> None:
    console = Console()
    table = Table(title="lossless compression, one thread (ratios and speeds of this run)")
    for col in ("stream", "codec", "raw MB", "ratio", "compress MB/s", "decompress MB/s"):
        table.add_column(col)
    for stream, by_codec in results["codecs"].items():
        for label, r in by_codec.items():
            table.add_row(
                stream,
                label,
                f"{r['raw_bytes'] / 1e6:.1f}",
                f"{r['ratio']:.3f}",
                f"{r['compress_MBps']:.0f}",
                f"{r['decompress_MBps']:.0f}",
            )
    console.print(table)
    for key, label in (("s3", "S3 (moto, loopback)"), ("local", "local disk, fsynced")):
        raw, zstd = results[key]["raw"], results[key]["zstd"]
        console.print(
            f"{label} blocking save: raw {raw['save_s']:.2f} s for {raw['bytes']} B, "
            f"zstd {zstd['save_s']:.2f} s for {zstd['bytes']} B: time ratio "
            f"{zstd['save_s'] / raw['save_s']:.2f}x, bytes ratio {raw['bytes'] / zstd['bytes']:.3f}x"
        )


if __name__ == "__main__":
    main()
