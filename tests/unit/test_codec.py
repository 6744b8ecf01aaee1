"""format/codec.py: byte-grouped zstd frames round-trip every dtype and refuse damaged frames."""

from __future__ import annotations

import struct

import pytest
import torch

from snapstate.errors import CorruptCheckpointError
from snapstate.format import codec
from snapstate.format.dtypes import DTYPES, dtype_name
from support.bits import itemsize
from support.tensors import random_tensor

BYTE_DTYPES = [d for d in DTYPES.values() if itemsize(d) >= 1]


def _raw(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().view(-1).view(torch.uint8).numpy())


def _weights(dtype: torch.dtype) -> torch.Tensor:
    """Trained-like values: small normals, whose exponent bytes repeat."""
    gen = torch.Generator().manual_seed(1)
    return (torch.randn(1 << 16, generator=gen) * 0.02).to(dtype)


@pytest.mark.parametrize("dtype", BYTE_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(0,), (1,), (37, 5)])
def test_every_dtype_round_trips(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    t = random_tensor(dtype, shape, seed=3)
    raw = _raw(t)
    width = codec.group_width(dtype_name(dtype), t.element_size())
    frame = codec.encode(raw, width)
    assert codec.decoded_size(frame) == len(raw)
    assert bytes(codec.decode(frame)) == bytes(raw)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_floats_are_grouped_and_shrink(dtype: torch.dtype) -> None:
    t = _weights(dtype)
    raw = _raw(t)
    assert codec.group_width(dtype_name(dtype), t.element_size()) == t.element_size()
    grouped = codec.encode(raw, t.element_size())
    assert len(grouped) < len(codec.encode(raw, 1)) < len(raw)
    out = bytearray(len(raw))
    codec.decode_into(grouped, memoryview(out))
    assert bytes(out) == bytes(raw)


def test_integers_are_not_grouped() -> None:
    assert codec.group_width("int32", 4) == 1
    assert codec.group_width("bool", 1) == 1
    assert codec.group_width("float8_e4m3fn", 1) == 1


def test_input_is_not_modified() -> None:
    t = _weights(torch.float32)
    before = t.clone()
    codec.encode(_raw(t), 4)
    assert torch.equal(t.view(torch.int32), before.view(torch.int32))


def test_incompressible_planes_are_stored() -> None:
    raw = _raw(random_tensor(torch.float32, (4096,), seed=9))
    frame = codec.encode(raw, 4)
    # four stored planes: the frame is the raw bytes plus its headers
    assert len(frame) == len(raw) + 13 + 4 * 9


@pytest.mark.parametrize(
    "damage",
    [
        lambda f: b"XXXX" + f[4:],
        lambda f: f[:-1],
        lambda f: f + b"\0",
        lambda f: f[:13] + struct.pack("<BQ", 7, 1) + f[22:],
        lambda f: f[:5] + struct.pack("<Q", 3) + f[13:],
    ],
    ids=["magic", "truncated", "trailing", "mode", "raw-length"],
)
def test_damaged_frame_is_corrupt_naming_file_and_key(damage) -> None:  # type: ignore[no-untyped-def]
    frame = codec.encode(_raw(_weights(torch.float32)), 4)
    with pytest.raises(CorruptCheckpointError) as info:
        codec.decode(damage(frame), file="shards/r00000-000.safetensors", key="w")
    assert info.value.file == "shards/r00000-000.safetensors" and info.value.key == "w"


def test_damaged_zstd_body_is_corrupt() -> None:
    frame = bytearray(codec.encode(_raw(_weights(torch.float32)), 4))
    frame[-20] ^= 0xFF  # inside the last compressed plane
    with pytest.raises(CorruptCheckpointError):
        codec.decode(bytes(frame), file="f", key="k")


def test_wrong_output_size_is_refused() -> None:
    frame = codec.encode(_raw(_weights(torch.float32)), 4)
    with pytest.raises(CorruptCheckpointError, match="expected"):
        codec.decode_into(frame, memoryview(bytearray(8)), file="f", key="k")
