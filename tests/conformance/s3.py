"""A real S3 server for tests: moto in a thread of the test session, reached through s3fs."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import fsspec.config
import pytest

from snapstate.storage.fsspec import FsspecStorage

BUCKET = "snapstate-test"
PART_BYTES = 5 << 20  # S3's smallest multipart part: files above it go multipart


@dataclass
class S3Server:
    endpoint: str
    options: dict

    def storage(self, url: str, **extra: object) -> FsspecStorage:
        return FsspecStorage(url, part_bytes=PART_BYTES, **self.options, **extra)

    def client(self) -> Any:
        """A plain boto3 client, to look at the server without s3fs in between."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        )


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """A moto S3 server in a thread of this session, with one bucket; fsspec is pointed at it."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    options = {
        "endpoint_url": endpoint,
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"region_name": "us-east-1"},
    }
    S3Server(endpoint, options).client().create_bucket(Bucket=BUCKET)
    # What FSSPEC_S3='{"endpoint_url": ...}' in the environment does: URLs reach the server.
    saved = fsspec.config.conf.get("s3")
    fsspec.config.conf["s3"] = dict(options)
    try:
        yield S3Server(endpoint, options)
    finally:
        if saved is None:
            fsspec.config.conf.pop("s3", None)
        else:
            fsspec.config.conf["s3"] = saved
        server.stop()


@pytest.fixture(autouse=True, scope="session")
def aws_test_credentials() -> Iterator[None]:
    """Never reach real AWS credentials or config, nor a proxy, from these tests."""
    local = ",".join(filter(None, [os.environ.get("NO_PROXY", ""), "127.0.0.1,localhost"]))
    names = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        "NO_PROXY": local,
        "no_proxy": local,
    }
    saved = {k: os.environ.get(k) for k in [*names, "AWS_PROFILE"]}
    os.environ.pop("AWS_PROFILE", None)  # a profile that the empty config lacks would fail
    os.environ.update(names)
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
