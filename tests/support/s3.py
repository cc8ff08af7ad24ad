"""The S3 origin of the tests: moto's server in its own process (:mod:`bench.servers`' moto,
with the tests' environment and moto's own spooling), S3 clients and uploads."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import boto3
from botocore.config import Config

from bench.servers import MotoServer

__all__ = ["S3Server", "put_objects", "s3_client"]


class S3Server(MotoServer):
    """A moto S3 server in its own process, its log in ``workdir``; ``stop`` then ``start`` (same
    port) and ``kill9`` make real faults."""

    credentials: ClassVar[Mapping[str, str]] = {}

    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir, in_memory=False)

    def client(self, max_pool: int = 10) -> Any:
        """A boto3 client that tries once (a fault shows instead of being retried away)."""
        return boto3.client(
            "s3", endpoint_url=self.endpoint,
            config=Config(retries={"max_attempts": 1, "mode": "standard"}, max_pool_connections=max_pool),
        )

    def new_bucket(self) -> str:
        name = "b-" + uuid.uuid4().hex[:12]
        self.client().create_bucket(Bucket=name)
        return name


def s3_client(endpoint: str, retries: int = 0) -> Any:
    """A path-style boto3 client for ``endpoint`` (a daemon, a sidecar) making ``retries`` retries."""
    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        config=Config(retries={"total_max_attempts": retries + 1, "mode": "standard"}, s3={"addressing_style": "path"}),
    )


def put_objects(client: Any, bucket: str, objects: dict[str, bytes]) -> None:
    for key, data in objects.items():
        client.put_object(Bucket=bucket, Key=key, Body=data)
