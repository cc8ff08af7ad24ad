"""``shardcache webhook`` as a real process over real TLS: AdmissionReview fixtures for every
kind, already injected and unlabelled pods, failure policies, hostile requests, certificate
renewal, metrics and shutdown."""

from __future__ import annotations

import asyncio
import base64
import copy
import json
import os
import shutil
import signal
import socket
import ssl
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from sidecar.k8s.inject import ENDPOINT_ENV, INJECT_LABEL, SIDECAR_NAME, InjectConfig, inject
from sidecar.k8s.webhook import TLSReloader, WebhookSettings, build_app
from tests.support.k8s import (
    FIXTURES,
    TEMPLATE_PATHS,
    TLSFiles,
    WebhookProcess,
    admission_review,
    apply_patch,
    check_pod_semantics,
    client_context,
    load_fixture_docs,
    make_tls,
    pod_templates,
    validate_k8s,
)
from tests.support.processes import free_port

IMAGE = "registry.example.com/shardcache:test"
WORKLOADS = [d for d in load_fixture_docs() if d["kind"] in TEMPLATE_PATHS]


def labelled_pod(**spec: Any) -> dict[str, Any]:
    spec.setdefault("containers", [{"name": "train", "image": "trainer:1"}])
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "ml", "labels": {INJECT_LABEL: "true"}}, "spec": spec}


def assert_allowed_unchanged(status: int, body: dict[str, Any], uid: str = "uid-1") -> None:
    assert status == 200, body
    response = body["response"]
    assert body["apiVersion"] == "admission.k8s.io/v1" and body["kind"] == "AdmissionReview"
    assert response["uid"] == uid and response["allowed"] is True
    assert "patch" not in response and "patchType" not in response


# ----------------------------------------------------------------------------- TLS and health


def test_serves_health_over_verified_tls(webhook: WebhookProcess) -> None:
    assert webhook.request("GET", "/healthz") == (200, b"ok\n")
    assert webhook.request("GET", "/readyz")[0] == 200


def test_rejects_plain_http_and_untrusted_clients_see_a_bad_certificate(webhook: WebhookProcess, tmp_path: Path) -> None:
    with socket.create_connection(("127.0.0.1", webhook.port), timeout=5) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        data = sock.recv(1024)
    assert b"200" not in data.split(b"\r\n", 1)[0]
    other_ca = make_tls(tmp_path / "other", ["localhost"])
    with pytest.raises(ssl.SSLCertVerificationError):
        WebhookProcess(webhook.port, other_ca.ca_pem, webhook.proc, webhook.log).request("GET", "/healthz")


def test_certificate_is_checked_for_the_service_name(webhook: WebhookProcess) -> None:
    wrong_name = WebhookProcess(webhook.port, webhook.ca_pem, webhook.proc, webhook.log, server_hostname="evil.example.com")
    with pytest.raises(ssl.SSLCertVerificationError):
        wrong_name.request("GET", "/healthz")
    right_name = WebhookProcess(webhook.port, webhook.ca_pem, webhook.proc, webhook.log, server_hostname="shardcache-webhook.shardcache.svc")
    assert right_name.request("GET", "/healthz")[0] == 200


# ----------------------------------------------------------------------------- fixtures


def test_pod_from_a_job_controller(webhook: WebhookProcess) -> None:
    review = json.loads((FIXTURES / "review-pod-from-job.json").read_text())
    status, body = webhook.review(review)
    response = body["response"]
    assert status == 200 and response["uid"] == review["request"]["uid"] and response["allowed"] is True
    pod = apply_patch(review["request"]["object"], response)
    expected, _ = inject(review["request"]["object"], InjectConfig(image=IMAGE))
    assert pod == expected
    spec = pod["spec"]
    check_pod_semantics(spec)
    validate_k8s(pod, "1.30")
    assert spec["initContainers"][0]["name"] == SIDECAR_NAME and spec["initContainers"][0]["image"] == IMAGE
    train = spec["containers"][0]
    assert {"name": ENDPOINT_ENV, "value": "http://127.0.0.1:8600"} in train["env"]
    # What the API server had added stays as it was.
    assert train["volumeMounts"][0]["name"].startswith("kube-api-access-")
    assert pod["metadata"]["ownerReferences"] == review["request"]["object"]["metadata"]["ownerReferences"]


@pytest.mark.parametrize("obj", WORKLOADS, ids=lambda o: o["kind"])
def test_each_workload_kind(webhook: WebhookProcess, obj: dict[str, Any]) -> None:
    status, body = webhook.review(admission_review(obj, uid=f"uid-{obj['kind']}"))
    assert status == 200 and body["response"]["uid"] == f"uid-{obj['kind']}"
    patched = apply_patch(copy.deepcopy(obj), body["response"])
    assert patched == inject(obj, InjectConfig(image=IMAGE))[0]
    validate_k8s(patched, "1.30")
    for template in pod_templates(patched):
        check_pod_semantics(template["spec"], tuple(c["metadata"]["name"] for c in obj["spec"].get("volumeClaimTemplates", [])))
        assert template["spec"]["initContainers"][0]["name"] == SIDECAR_NAME


def test_unlabelled_pod_is_admitted_unchanged(webhook: WebhookProcess) -> None:
    pod = labelled_pod()
    del pod["metadata"]["labels"][INJECT_LABEL]
    assert_allowed_unchanged(*webhook.review(admission_review(pod)))


def test_already_injected_pod_gets_no_patch(webhook: WebhookProcess) -> None:
    injected, _ = inject(labelled_pod(), InjectConfig(image="someone/else:1"))
    assert_allowed_unchanged(*webhook.review(admission_review(injected)))


def test_pod_update_and_delete_are_never_patched(webhook: WebhookProcess) -> None:
    assert_allowed_unchanged(*webhook.review(admission_review(labelled_pod(), operation="UPDATE")))
    review = admission_review(labelled_pod(), operation="DELETE")
    review["request"]["object"] = None
    assert_allowed_unchanged(*webhook.review(review))


def test_workload_update_is_injected(webhook: WebhookProcess) -> None:
    deployment = next(d for d in WORKLOADS if d["kind"] == "Deployment")
    status, body = webhook.review(admission_review(deployment, operation="UPDATE"))
    assert status == 200 and body["response"]["patchType"] == "JSONPatch"


def test_objects_without_type_meta_use_request_kind(webhook: WebhookProcess) -> None:
    pod = labelled_pod()
    review = admission_review(pod)
    del review["request"]["object"]["apiVersion"], review["request"]["object"]["kind"]
    status, body = webhook.review(review)
    patched = apply_patch(review["request"]["object"], body["response"])
    assert patched["spec"]["initContainers"][0]["name"] == SIDECAR_NAME


def test_other_kinds_are_admitted(webhook: WebhookProcess) -> None:
    configmap = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c", "labels": {INJECT_LABEL: "true"}}, "data": {}}
    assert_allowed_unchanged(*webhook.review(admission_review(configmap)))


def test_huge_pod_is_injected(webhook: WebhookProcess) -> None:
    # ~2.5 MiB of annotations and env: larger than etcd allows, still answered correctly.
    pod = labelled_pod(containers=[{"name": "train", "image": "t:1", "env": [{"name": f"V{i}", "value": "x" * 200} for i in range(6000)]}])
    pod["metadata"]["annotations"] = {f"example.com/a{i}": "y" * 1000 for i in range(1200)}
    started = time.monotonic()
    status, body = webhook.review(admission_review(pod))
    assert status == 200, body
    assert time.monotonic() - started < 10  # well inside the API server's webhook timeout
    patched = apply_patch(pod, body["response"])
    assert patched["spec"]["containers"][0]["env"][-4:] == [{"name": ENDPOINT_ENV, "value": "http://127.0.0.1:8600"},
                                                            {"name": "SHARDCACHE_MASTER_TOKEN", "valueFrom": {"secretKeyRef": {
                                                                "name": "shardcache-master-token", "key": "token", "optional": True}}},
                                                            {"name": "SHARDCACHE_HANDLES", "value": "unix:///run/shardcache-pod/handles.sock"},
                                                            {"name": "SHARDCACHE_NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}]
    # A small patch (env appended, not the whole list replaced).
    assert len(base64.b64decode(body["response"]["patch"])) < 20_000


# ----------------------------------------------------------------------------- hostile and malformed


@pytest.mark.parametrize(
    "body, status, message",
    [
        (b"{not json", 400, "not JSON"),
        (b"[1, 2, 3]", 400, "AdmissionReview object"),
        (b'"AdmissionReview"', 400, "AdmissionReview object"),
        (json.dumps({"apiVersion": "admission.k8s.io/v1beta1", "kind": "AdmissionReview", "request": {"uid": "u"}}).encode(), 400, "admissionReviewVersions"),
        (json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"}).encode(), 400, "uid is required"),
        (json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {"uid": 7}}).encode(), 400, "uid is required"),
        (b"[" * 100_000 + b"]" * 100_000, 400, "not JSON"),
        (b"\xff\xfe\x00garbage", 400, "not JSON"),
    ],
    ids=["garbage", "array", "string", "v1beta1", "no-request", "numeric-uid", "deep-nesting", "binary"],
)
def test_malformed_reviews_get_400(webhook: WebhookProcess, body: bytes, status: int, message: str) -> None:
    got, data = webhook.review(body)
    assert got == status
    assert message in data["error"]


def test_wrong_content_type_and_method(webhook: WebhookProcess) -> None:
    assert webhook.request("POST", "/mutate", b"{}", {"Content-Type": "text/plain"})[0] == 415
    assert webhook.request("GET", "/mutate")[0] == 405
    assert webhook.request("GET", "/../../etc/passwd")[0] == 404


def test_request_over_the_size_limit_is_413(webhook: WebhookProcess) -> None:
    body = json.dumps(admission_review(labelled_pod())).encode() + b" " * (9 * 1024 * 1024)
    status, _ = webhook.request("POST", "/mutate", body, {"Content-Type": "application/json"}, timeout=60)
    assert status == 413
    assert webhook.request("GET", "/healthz")[0] == 200


@pytest.mark.parametrize(
    "mangle, reason",
    [
        (lambda p: p["spec"].__setitem__("containers", "train"), "spec.containers must be a non-empty list"),
        (lambda p: p["metadata"].__setitem__("annotations", {"shardcache.io/port": "eighty"}), "shardcache.io/port"),
        (lambda p: p["spec"].__setitem__("volumes", [{"name": "shardcache-socket", "emptyDir": {}}]), "reserved"),
        (lambda p: p.__setitem__("spec", None), "spec is missing"),
        (lambda p: p["spec"].__setitem__("hostNetwork", True), "hostNetwork"),
    ],
    ids=["containers-string", "bad-annotation", "reserved-volume", "null-spec", "host-network"],
)
def test_uninjectable_pod_with_ignore_policy_is_admitted_with_a_warning(
    webhook: WebhookProcess, mangle: Callable[[dict[str, Any]], None], reason: str
) -> None:
    pod = labelled_pod()
    mangle(pod)
    status, body = webhook.review(admission_review(pod, uid="u-warn"))
    assert_allowed_unchanged(status, body, "u-warn")
    (warning,) = body["response"]["warnings"]
    assert warning.startswith("shardcache: sidecar not injected into pod ml/p: ") and reason in warning
    assert len(warning) <= 256


def test_fail_policy_refuses_with_the_reason(webhook_factory: Callable[..., WebhookProcess]) -> None:
    strict = webhook_factory("--failure-policy", "fail")
    pod = labelled_pod()
    pod["metadata"]["annotations"] = {"shardcache.io/sidecar-memory-limit": "lots"}
    status, body = strict.review(admission_review(pod, uid="u-fail"))
    response = body["response"]
    assert status == 200 and response["uid"] == "u-fail" and response["allowed"] is False
    assert response["status"]["code"] == 400
    assert "shardcache.io/sidecar-memory-limit" in response["status"]["message"]
    # A good pod still goes through.
    status, body = strict.review(admission_review(labelled_pod()))
    assert body["response"]["allowed"] is True and body["response"]["patchType"] == "JSONPatch"


def test_container_mode_for_old_clusters(webhook_factory: Callable[..., WebhookProcess]) -> None:
    old = webhook_factory("--no-native-sidecar", "--sidecar-port", "9600", "--no-short-circuit")
    pod = labelled_pod()
    status, body = old.review(admission_review(pod))
    patched = apply_patch(pod, body["response"])
    spec = patched["spec"]
    assert spec["containers"][0]["name"] == SIDECAR_NAME and "initContainers" not in spec
    assert {"name": ENDPOINT_ENV, "value": "http://127.0.0.1:9600"} in spec["containers"][1]["env"]
    assert all("hostPath" not in v or v["hostPath"]["path"] != "/var/cache/shardcache" for v in spec["volumes"])
    validate_k8s(patched, "1.25")


def test_metrics_count_results(webhook_factory: Callable[..., WebhookProcess]) -> None:
    fresh = webhook_factory()
    fresh.review(admission_review(labelled_pod()))
    fresh.review(b"nope")
    pod = labelled_pod()
    pod["spec"]["hostNetwork"] = True
    fresh.review(admission_review(pod))
    status, text = fresh.request("GET", "/metrics")
    assert status == 200
    metrics = text.decode()
    assert 'shardcache_webhook_admissions_total{kind="Pod",result="injected"} 1.0' in metrics
    assert 'shardcache_webhook_admissions_total{kind="unknown",result="invalid"} 1.0' in metrics
    assert 'shardcache_webhook_admissions_total{kind="Pod",result="error-ignored"} 1.0' in metrics
    assert "shardcache_webhook_admission_duration_seconds_count 3.0" in metrics


def test_concurrent_reviews(webhook: WebhookProcess) -> None:
    import concurrent.futures

    def one(i: int) -> str:
        status, body = webhook.review(admission_review(labelled_pod(), uid=f"c-{i}"))
        assert status == 200
        return str(body["response"]["uid"])

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        assert sorted(pool.map(one, range(40))) == sorted(f"c-{i}" for i in range(40))


# ----------------------------------------------------------------------------- CLI errors and shutdown


@pytest.mark.slow
def test_cli_errors_are_one_clear_line(tmp_path: Path, tls: TLSFiles) -> None:
    import subprocess

    from tests.support.processes import PYTHON, REPO

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        return subprocess.run([PYTHON, "-m", "sidecar.cli", "webhook", *args], capture_output=True, text=True, timeout=60, env=env, cwd=REPO)

    missing = run("--tls-cert", str(tmp_path / "nope.crt"), "--tls-key", str(tls.key))
    assert missing.returncode == 2 and "nope.crt not found" in missing.stderr and "Traceback" not in missing.stderr
    (tmp_path / "bad.crt").write_text("not a certificate")
    bad = run("--tls-cert", str(tmp_path / "bad.crt"), "--tls-key", str(tls.key))
    assert bad.returncode == 2 and "cannot load TLS certificate" in bad.stderr
    mismatched = make_tls(tmp_path / "other", ["localhost"])
    pair = run("--tls-cert", str(tls.cert), "--tls-key", str(mismatched.key))
    assert pair.returncode == 2 and "cannot load TLS certificate" in pair.stderr
    listen = run("--listen", "0.0.0.0:8443", "--tls-cert", str(tls.cert), "--tls-key", str(tls.key))
    assert listen.returncode == 2 and "tcp://HOST:PORT" in listen.stderr
    image = run("--sidecar-image", "bad image", "--tls-cert", str(tls.cert), "--tls-key", str(tls.key))
    assert image.returncode == 2 and "invalid sidecar image" in image.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = run("--listen", f"tcp://127.0.0.1:{taken.getsockname()[1]}", "--tls-cert", str(tls.cert), "--tls-key", str(tls.key))
    assert busy.returncode == 69 and "cannot listen" in busy.stderr


def test_sigterm_stops_the_server(webhook_factory: Callable[..., WebhookProcess]) -> None:
    server = webhook_factory()
    os.killpg(server.proc.pid, signal.SIGTERM)
    assert server.proc.wait(timeout=15) == 0


# ----------------------------------------------------------------------------- certificate renewal (in process)


def _install(files: TLSFiles, cert: Path, key: Path) -> None:
    # Like a Secret volume update: new files appear by rename, never half-written.
    for src, dst in ((files.key, key), (files.cert, cert)):
        tmp = dst.with_suffix(".tmp")
        shutil.copyfile(src, tmp)
        os.replace(tmp, dst)


def test_renewed_certificate_is_served_without_restart(tmp_path: Path) -> None:
    first = make_tls(tmp_path / "first", ["localhost"], ca_name="first-ca")
    second = make_tls(tmp_path / "second", ["localhost"], ca_name="second-ca")
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    _install(first, cert, key)
    port = free_port()
    tls = TLSReloader(cert, key)  # reads files: before the loop, as `shardcache webhook` does

    async def scenario() -> None:
        settings = WebhookSettings(host="127.0.0.1", port=port, tls_cert=cert, tls_key=key, tls_reload_interval=0.05)
        runner = web.AppRunner(build_app(settings, tls))
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port, ssl_context=tls.server_context).start()
        url = f"https://localhost:{port}/healthz"
        try:
            async with aiohttp.ClientSession() as session:
                async def status(ca: TLSFiles) -> int:
                    async with session.get(url, ssl=client_context(ca.ca_pem)) as resp:
                        return resp.status

                assert await status(first) == 200
                with pytest.raises(aiohttp.ClientConnectorCertificateError):
                    await status(second)
                # A broken pair (cert renewed, key not yet) keeps the old certificate.
                await asyncio.to_thread(shutil.copyfile, second.cert, cert)
                await asyncio.sleep(0.3)  # time for the watcher to see the pair (nothing to wait for: it must not change)
                assert await status(first) == 200
                await asyncio.to_thread(_install, second, cert, key)
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline:
                    try:
                        if await status(second) == 200:
                            break
                    except aiohttp.ClientConnectorCertificateError:
                        await asyncio.sleep(0.05)
                else:
                    raise AssertionError("renewed certificate never served")
                with pytest.raises(aiohttp.ClientConnectorCertificateError):
                    await status(first)
                async with session.get(f"https://localhost:{port}/metrics", ssl=client_context(second.ca_pem)) as resp:
                    assert "shardcache_webhook_tls_reloads_total 1.0" in await resp.text()
        finally:
            await runner.cleanup()

    asyncio.run(scenario())


def test_rewritten_identical_files_are_not_a_reload(tmp_path: Path) -> None:
    first = make_tls(tmp_path / "first", ["localhost"], ca_name="first-ca")
    second = make_tls(tmp_path / "second", ["localhost"], ca_name="second-ca")
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    _install(first, cert, key)
    reloader = TLSReloader(cert, key)
    served = reloader._current

    async def scenario() -> None:
        # A Secret resync renames the same bytes into place: new inode and mtime, nothing renewed.
        await asyncio.to_thread(_install, first, cert, key)
        assert not await reloader.check()
        assert reloader.reloads == 0 and reloader._current is served
        # The real renewal, then the same pair written again key-first: exactly one reload.
        await asyncio.to_thread(_install, second, cert, key)
        assert await reloader.check()
        await asyncio.to_thread(_install, second, cert, key)
        assert not await reloader.check()
        assert reloader.reloads == 1 and reloader._current is not served

    asyncio.run(scenario())


def test_in_process_review_does_not_block_the_loop(tmp_path: Path, tls: TLSFiles) -> None:
    """The autouse blockbuster guard fails this test if the handler blocks the event loop."""
    port = free_port()
    reloader = TLSReloader(tls.cert, tls.key)

    async def scenario() -> None:
        settings = WebhookSettings(host="127.0.0.1", port=port, tls_cert=tls.cert, tls_key=tls.key)
        runner = web.AppRunner(build_app(settings, reloader))
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port, ssl_context=reloader.server_context).start()
        try:
            async with aiohttp.ClientSession() as session:
                body = admission_review(labelled_pod())
                async with session.post(f"https://localhost:{port}/mutate", json=body, ssl=client_context(tls.ca_pem)) as resp:
                    assert resp.status == 200
                    data = await resp.json()
                assert data["response"]["patchType"] == "JSONPatch"
                await reloader.check()  # the reload path too
        finally:
            await runner.cleanup()

    asyncio.run(scenario())


def test_a_pair_swapped_during_the_reload_is_counted_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found in CI: the files changed between the digest and the load, the reloader kept a digest
    of a pair it never loaded, and the next check reloaded (and counted) the same pair again."""
    import sidecar.k8s.webhook as webhook_module

    first = make_tls(tmp_path / "first", ["localhost"], ca_name="first-ca")
    second = make_tls(tmp_path / "second", ["localhost"], ca_name="second-ca")
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    _install(first, cert, key)
    tls = TLSReloader(cert, key)
    shutil.copyfile(second.cert, cert)  # mid-swap: the new certificate, the old key
    load = webhook_module._load_context

    def load_while_the_key_lands(cert_path: Path, key_path: Path) -> Any:
        _install(second, cert, key)  # the rest of the swap lands while the reloader loads
        return load(cert_path, key_path)

    monkeypatch.setattr(webhook_module, "_load_context", load_while_the_key_lands)

    async def checks() -> list[bool]:
        return [await tls.check() for _ in range(3)]

    asyncio.run(checks())
    assert tls.reloads == 1
