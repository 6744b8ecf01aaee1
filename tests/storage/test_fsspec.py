"""FsspecStorage on S3 (a moto server): multipart uploads, routing, options, listings, the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import fsspec.config
import pytest
import torch
from click.testing import CliRunner

import snapstate as ss
from conformance.s3 import BUCKET, S3Server
from snapstate.cli import main as cli_main
from snapstate.storage.base import storage_for
from snapstate.storage.fsspec import FsspecStorage
from snapstate.storage.local import LocalStorage


def fresh_url(name: str = "t") -> str:
    return f"s3://{BUCKET}/{uuid.uuid4().hex}/{name}"


def write(storage: FsspecStorage, path: str, data: bytes, piece: int) -> None:
    writer = storage.open_writer(path, len(data))
    for offset in range(0, len(data), piece):
        writer.write_at(memoryview(data)[offset : offset + piece], offset)
    writer.close()


def test_large_file_is_a_multipart_upload(s3_server: S3Server) -> None:
    url = fresh_url()
    storage = s3_server.storage(url)
    data = os.urandom(11 << 20)
    write(storage, "shard", data, piece=1 << 20)
    bucket_key = url.removeprefix(f"s3://{BUCKET}/") + "/shard"
    head = s3_server.client().head_object(Bucket=BUCKET, Key=bucket_key)
    assert head["ETag"].strip('"').endswith("-3")  # parts of 5 + 5 + 1 MiB
    assert storage.read_bytes("shard") == data


def test_aborted_upload_leaves_no_object_and_no_open_upload(s3_server: S3Server) -> None:
    url = fresh_url()
    storage = s3_server.storage(url)
    writer = storage.open_writer("shard", 12 << 20)
    writer.write_at(memoryview(os.urandom(6 << 20)), 0)
    writer.abort()
    prefix = url.removeprefix(f"s3://{BUCKET}/")
    client = s3_server.client()
    assert client.list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("KeyCount", 0) == 0
    uploads = client.list_multipart_uploads(Bucket=BUCKET, Prefix=prefix).get("Uploads", [])
    assert uploads == []


def test_engine_writes_multipart_shards_in_order(s3_server: S3Server) -> None:
    """A 12 MiB state in 256 KiB pieces over two writer threads: parts stream out in order."""
    state = {"a": torch.randn(1536, 1024), "b": torch.randn(1536, 1024), "step": 4}
    storage = s3_server.storage(fresh_url())
    options = ss.SaveOptions(
        threads=2, piece_bytes=256 << 10, plan=ss.PlanOptions(max_file_bytes=7 << 20)
    )
    ss.save(state, storage, options=options)
    files = ss.inspect(storage).files
    assert len(files) == 2
    prefix = storage.root.removeprefix(f"s3://{BUCKET}/")
    for path in files:
        etag = s3_server.client().head_object(Bucket=BUCKET, Key=f"{prefix}/{path}")["ETag"]
        assert "-" in etag  # a completed multipart upload
    target = {"a": torch.zeros(1536, 1024), "b": torch.zeros(1536, 1024), "step": 0}
    ss.load(target, storage)
    assert (
        torch.equal(target["a"], state["a"])
        and torch.equal(target["b"], state["b"])
        and target["step"] == 4
    )
    assert ss.verify(storage).ok


def test_storage_for_routes_urls_and_passes_storage_objects_through(
    s3_server: S3Server, tmp_path
) -> None:
    url = fresh_url()
    routed = storage_for(url, part_bytes=6 << 20)
    assert isinstance(routed, FsspecStorage) and routed.root == url and routed.part_bytes == 6 << 20
    assert isinstance(storage_for(str(tmp_path)), LocalStorage)
    assert isinstance(storage_for(f"file://{tmp_path}"), LocalStorage)
    given = s3_server.storage(url)
    assert storage_for(given) is given
    with pytest.raises(TypeError):
        storage_for(given, endpoint_url="http://elsewhere")


def test_explicit_storage_options_need_no_global_configuration(
    s3_server: S3Server, monkeypatch
) -> None:
    monkeypatch.setitem(fsspec.config.conf, "s3", {})
    storage = FsspecStorage(fresh_url(), skip_instance_cache=True, **s3_server.options)
    ss.save({"w": torch.arange(5)}, storage)
    target = {"w": torch.zeros(5, dtype=torch.int64)}
    ss.load(target, storage)
    assert target["w"].tolist() == [0, 1, 2, 3, 4]


def test_aws_endpoint_url_environment_variable_is_honoured(
    s3_server: S3Server, monkeypatch
) -> None:
    url = fresh_url()
    s3_server.storage(url).write_atomic("hello", b"world")
    monkeypatch.setitem(fsspec.config.conf, "s3", {})  # only the environment points at the server
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)
    assert FsspecStorage(url, skip_instance_cache=True).read_bytes("hello") == b"world"


def test_listings_are_never_stale(s3_server: S3Server) -> None:
    """Another process (here: another client) writes the prefix; the next listing sees it."""
    url = fresh_url()
    mine = s3_server.storage(url)
    theirs = s3_server.storage(url, skip_instance_cache=True)
    mine.write_atomic("step-000000001/manifest.json", b"{}")
    assert mine.listdir() == ["step-000000001"]
    theirs.write_atomic("step-000000002/manifest.json", b"{}")
    assert mine.listdir() == ["step-000000001", "step-000000002"]
    assert mine.exists("step-000000002/manifest.json")
    theirs.remove_tree("step-000000001")
    assert mine.listdir() == ["step-000000002"] and not mine.exists("step-000000001/manifest.json")


def test_remove_tree_of_a_bucket_root_keeps_the_bucket(s3_server: S3Server) -> None:
    bucket = f"root-{uuid.uuid4().hex[:12]}"
    client = s3_server.client()
    client.create_bucket(Bucket=bucket)
    storage = s3_server.storage(f"s3://{bucket}")
    storage.write_atomic("step-000000001/manifest.json", b"{}")
    storage.remove_tree()
    assert storage.listdir() == []
    client.head_bucket(Bucket=bucket)  # raises if the bucket went with its contents


def test_cli_lists_and_verifies_s3_checkpoints(s3_server: S3Server) -> None:
    root = fresh_url("run")
    with ss.CheckpointManager(root, async_save=False) as mgr:
        mgr.save(5, {"w": torch.ones(3)})
    listed = CliRunner().invoke(cli_main, ["ls", root])
    assert listed.exit_code == 0, listed.output
    assert "committed" in listed.output
    # A fresh process that knows the server only from the environment, as a user's shell would.
    env = {k: v for k, v in os.environ.items() if not k.startswith("FSSPEC_")}
    env["FSSPEC_S3"] = json.dumps(
        {"endpoint_url": s3_server.endpoint, "key": "testing", "secret": "testing"}
    )
    done = subprocess.run(
        [sys.executable, "-m", "snapstate.cli", "verify", f"{root}/step-000000005"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
