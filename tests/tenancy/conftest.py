"""Tenancy fixtures: an S3 endpoint that enforces IAM as AWS does, in its own process, per module
(helpers and why it is not the session's ``s3_server``: tests/support/tenancy.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.tenancy import IamS3, LauncherServer, start_iam_s3, start_launcher


@pytest.fixture(scope="module")
def iam_s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[IamS3]:
    """Per module: tests may write through ``node`` (s3:*), and the next module gets clean buckets."""
    with start_iam_s3(tmp_path_factory.mktemp("iam-s3") / "moto.log") as endpoint:
        yield endpoint


@pytest.fixture(scope="module")
def sigv4_s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LauncherServer]:
    """The patched server in moto's default mode (IAM not enforced): it must serve as stock moto does."""
    with start_launcher(tmp_path_factory.mktemp("sigv4-s3") / "moto.log") as server:
        yield server
