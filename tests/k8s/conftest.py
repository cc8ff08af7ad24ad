"""Fixtures for the Kubernetes area (helpers: tests/support/k8s.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests.support.k8s import Renderer, TLSFiles, WebhookProcess, make_tls, start_webhook
from tests.support.processes import stop


@pytest.fixture(scope="session")
def renderer() -> Iterator[Renderer]:
    r = Renderer()
    try:
        yield r
    finally:
        r.close()


@pytest.fixture(scope="session")
def tls(tmp_path_factory: pytest.TempPathFactory) -> TLSFiles:
    return make_tls(tmp_path_factory.mktemp("tls"), ["localhost", "shardcache-webhook.shardcache.svc"])


@pytest.fixture(scope="module")
def webhook_factory(tmp_path_factory: pytest.TempPathFactory, tls: TLSFiles) -> Iterator[Callable[..., WebhookProcess]]:
    started: list[WebhookProcess] = []
    tmp = tmp_path_factory.mktemp("webhook")

    def factory(*extra: str, tls_files: TLSFiles | None = None, server_hostname: str = "localhost") -> WebhookProcess:
        server = start_webhook(tmp, tls_files or tls, *extra, server_hostname=server_hostname)
        started.append(server)
        return server

    try:
        yield factory
    finally:
        for server in started:
            stop(server.proc)


@pytest.fixture(scope="module")
def webhook(webhook_factory: Callable[..., WebhookProcess]) -> WebhookProcess:
    """The webhook with its defaults (native sidecar, failure policy ignore)."""
    return webhook_factory("--sidecar-image", "registry.example.com/shardcache:test")
