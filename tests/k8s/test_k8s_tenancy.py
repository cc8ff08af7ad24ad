"""Tenancy on the Kubernetes side: the sidecar image allow-list (pure function, ``shardcache inject``
and ``shardcache webhook`` as real processes), the socket directory read-only in the sidecar (a
real daemon and sidecar across a read-only bind mount), the master token, and the chart's
NetworkPolicies (rendered with Helm's engine, validated, and evaluated for who may connect)."""

from __future__ import annotations

import base64
import errno
import shutil
import socket
import string
import subprocess
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from sidecar.k8s.inject import (
    INJECT_LABEL,
    MASTER_TOKEN_ENV,
    SIDECAR_NAME,
    InjectConfig,
    InjectionError,
    image_allowed,
    inject,
)
from tests.support.daemons import DaemonProcess
from tests.support.k8s import (
    CHART,
    Renderer,
    WebhookProcess,
    admission_review,
    admits,
    apply_patch,
    check_pod_semantics,
    docs,
    find,
    kubectl_parse,
    run_inject,
    selects,
    validate_k8s,
)
from tests.support.waits import wait_until

DEFAULT = "registry.example.com/shardcache:1.2.3"
ANN = "shardcache.io/sidecar-image"
NS = "shardcache"


def pod(annotations: dict[str, str] | None = None, **spec: Any) -> dict[str, Any]:
    spec.setdefault("containers", [{"name": "train", "image": "trainer:1"}])
    meta: dict[str, Any] = {"name": "p", "namespace": "ml", "labels": {INJECT_LABEL: "true"}}
    if annotations:
        meta["annotations"] = annotations
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


def sidecar_of(spec: dict[str, Any]) -> dict[str, Any]:
    (found,) = [c for c in spec.get("initContainers", []) + spec["containers"] if c["name"] == SIDECAR_NAME]
    return found


# ----------------------------------------------------------------------------- the allow-list


def test_an_image_not_allowed_is_ignored_with_the_warning() -> None:
    out, outcome = inject(pod({ANN: "evil.example.com/proxy:1"}), InjectConfig(image=DEFAULT))
    assert outcome.result == "injected"
    assert sidecar_of(out["spec"])["image"] == DEFAULT
    (warning,) = outcome.warnings
    assert warning.startswith(f"annotation {ANN} 'evil.example.com/proxy:1' ignored: not on the allow-list")
    assert DEFAULT in warning and "webhook.allowedSidecarImages" in warning and "--allow-sidecar-image" in warning
    validate_k8s(out, "1.30")
    check_pod_semantics(out["spec"])


def test_a_pod_cannot_turn_short_circuit_back_on() -> None:
    """Where the cluster turned short-circuit reads off, or the pod is in restricted mode, the
    annotation brings no handles socket; and no pod ever mounts the node cache."""
    for config, mode in ((InjectConfig(image=DEFAULT, short_circuit=False), "hostpath"),
                         (InjectConfig(image=DEFAULT, mode="restricted"), "restricted")):
        out, outcome = inject(pod({"shardcache.io/short-circuit": "true"}), config)
        assert "shardcache-pod-socket" not in {v["name"] for v in out["spec"]["volumes"]}
        assert "--handles" not in sidecar_of(out["spec"])["args"]
        (warning,) = outcome.warnings
        assert "shardcache.io/short-circuit" in warning and "ignored" in warning and (mode != "restricted" or "restricted mode" in warning)
    on, _ = inject(pod({"shardcache.io/short-circuit": "true"}), InjectConfig(image=DEFAULT))
    assert {v["name"] for v in on["spec"]["volumes"]} == {"shardcache-socket", "shardcache-pod-cache", "shardcache-pod-socket"}


@pytest.mark.parametrize(
    "image, allowed",
    [
        (DEFAULT, True),                                             # the default image needs no entry
        ("mirror.local/shardcache:2.0.0", True),                     # exact entry
        ("mirror.local/shardcache:2.0.1", False),
        ("mirror.local/other:2.0.0", False),
        ("registry.example.com/ml/shardcache:1", True),              # registry.example.com/ml/*
        ("registry.example.com/ml/team/shardcache@sha256:" + "a" * 64, True),
        ("registry.example.com/ml/", False),
        ("registry.example.com/ml/../evil:1", False),                # not a path component
        ("registry.example.com/ml-evil/shardcache:1", False),
        ("registry.example.com/mlx:1", False),
        ("ghcr.io/shardcache/shardcache:0.2.0", True),               # ghcr.io/shardcache/shardcache:*
        ("ghcr.io/shardcache/shardcache:0.2.0@sha256:" + "b" * 64, True),
        ("ghcr.io/shardcache/shardcache:0.2/../../evil", False),     # a tag holds no '/'
        ("ghcr.io/shardcache/shardcache-evil:1", False),
        ("quay.io/sc/shardcache@sha256:" + "c" * 64, True),          # quay.io/sc/shardcache@*
        ("quay.io/sc/shardcache@sha256:short", False),
        ("quay.io/sc/shardcache:latest", False),
    ],
)
def test_allow_list_entries(image: str, allowed: bool) -> None:
    config = InjectConfig(
        image=DEFAULT,
        allowed_sidecar_images=("mirror.local/shardcache:2.0.0", "registry.example.com/ml/*",
                                "ghcr.io/shardcache/shardcache:*", "quay.io/sc/shardcache@*"),
    )
    assert image_allowed(image, config) is allowed
    out, outcome = inject(pod({ANN: image}), config)
    assert sidecar_of(out["spec"])["image"] == (image if allowed else DEFAULT)
    assert bool(outcome.warnings) is not allowed


@pytest.mark.parametrize("entry", ["*", "mirror.local/*/shardcache", "mirror.local/shardcache*", "mirror local/x", "", "x:1\n"])
def test_bad_allow_list_entries_fail_at_start(entry: str) -> None:
    with pytest.raises(InjectionError, match="allowed sidecar image"):
        InjectConfig(allowed_sidecar_images=(entry,))


def test_malformed_image_annotation_is_still_an_error() -> None:
    # Not merely "not allowed": the annotation is wrong, as every other bad annotation is.
    with pytest.raises(InjectionError, match=r"metadata.annotations\[shardcache.io/sidecar-image\]: invalid value"):
        inject(pod({ANN: "not an image"}), InjectConfig(image=DEFAULT))


def test_one_warning_per_injected_template_and_none_when_already_injected() -> None:
    def replica(image: str) -> dict[str, Any]:
        return {"replicas": 1, "template": {"metadata": {"annotations": {ANN: image}},
                                            "spec": {"containers": [{"name": "pytorch", "image": "trainer:1"}]}}}

    job = {
        "apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
        "metadata": {"name": "j", "namespace": "ml", "labels": {INJECT_LABEL: "true"}},
        "spec": {"pytorchReplicaSpecs": {"Master": replica("evil:1"), "Worker": replica("evil:2")}},
    }
    out, outcome = inject(job, InjectConfig(image=DEFAULT), require_label=False)
    assert [w.split(" ignored")[0] for w in outcome.warnings] == [
        f"spec.pytorchReplicaSpecs.Master.template.annotation {ANN} 'evil:1'",
        f"spec.pytorchReplicaSpecs.Worker.template.annotation {ANN} 'evil:2'",
    ]
    for role in ("Master", "Worker"):
        assert out["spec"]["pytorchReplicaSpecs"][role]["template"]["spec"]["initContainers"][0]["image"] == DEFAULT
    # A second webhook call (reinvocation) finds the sidecar there: nothing to say again.
    again, second = inject(out, InjectConfig(image=DEFAULT), require_label=False)
    assert second.result == "unchanged" and second.warnings == () and again == out


# ----------------------------------------------------------------------------- the master token


def test_master_token_comes_from_an_optional_secret_in_the_pods_namespace() -> None:
    config = InjectConfig(image=DEFAULT, master_token_secret="sc-shardcache-master-token")
    obj = pod(containers=[{"name": "train", "image": "t"},
                          {"name": "mine", "image": "t", "env": [{"name": MASTER_TOKEN_ENV, "value": "set-by-me"}]}],
              initContainers=[{"name": "early", "image": "t"}])
    out, _ = inject(obj, config)
    spec = out["spec"]
    train, mine = spec["containers"]
    ref = {"secretKeyRef": {"name": "sc-shardcache-master-token", "key": "token", "optional": True}}
    assert {"name": MASTER_TOKEN_ENV, "valueFrom": ref} in train["env"]
    # The user's value wins.
    assert [e for e in mine["env"] if e["name"] == MASTER_TOKEN_ENV] == [{"name": MASTER_TOKEN_ENV, "value": "set-by-me"}]
    assert all(e["name"] != MASTER_TOKEN_ENV for e in sidecar_of(spec).get("env", []))  # the sidecar never calls the master
    # "early" now starts after the native sidecar (index 0), so it may call the master too.
    assert {"name": MASTER_TOKEN_ENV, "valueFrom": ref} in spec["initContainers"][1]["env"]
    validate_k8s(out, "1.30")
    check_pod_semantics(spec)
    assert inject(out, config)[0] == out
    untokened = InjectConfig(image=DEFAULT, master_token_secret=None)
    assert all(e["name"] != MASTER_TOKEN_ENV for e in inject(obj, untokened)[0]["spec"]["containers"][0]["env"])


@pytest.mark.parametrize("name", ["Master_Token", "-token", "token-", "a" * 254, "to ken"])
def test_bad_master_token_secret_name_fails_at_start(name: str) -> None:
    with pytest.raises(InjectionError, match="master token Secret name"):
        InjectConfig(master_token_secret=name)


# ----------------------------------------------------------------------------- shardcache inject


def pod_yaml(image: str) -> str:
    return (
        "apiVersion: v1\nkind: Pod\nmetadata:\n  name: p\n  namespace: ml\n"
        f"  annotations: {{shardcache.io/sidecar-image: '{image}'}}\n"
        "spec:\n  containers: [{name: train, image: trainer:1}]\n"
    )


def test_inject_command_warns_and_uses_the_default_image() -> None:
    for quiet in ((), ("-q",)):
        done = run_inject("-f", "-", "--sidecar-image", DEFAULT, *quiet, stdin=pod_yaml("evil.example.com/proxy:1"))
        assert done.returncode == 0, done.stderr
        (out,) = docs(done.stdout)
        assert out["spec"]["initContainers"][0]["image"] == DEFAULT
        warnings = [line for line in done.stderr.splitlines() if line.startswith("warning:")]
        assert warnings == [
            f"warning: pod/ml/p: annotation {ANN} 'evil.example.com/proxy:1' ignored: not on the allow-list "
            f"(webhook.allowedSidecarImages, --allow-sidecar-image); the sidecar runs {DEFAULT}"
        ], done.stderr


def test_inject_command_honours_allowed_images() -> None:
    done = run_inject("-f", "-", "--sidecar-image", DEFAULT, "--allow-sidecar-image", "mirror.local/x:1",
                      "--allow-sidecar-image", "mirror.local/shardcache:*", stdin=pod_yaml("mirror.local/shardcache:9"))
    assert done.returncode == 0 and "warning" not in done.stderr, done.stderr
    assert docs(done.stdout)[0]["spec"]["initContainers"][0]["image"] == "mirror.local/shardcache:9"
    bad = run_inject("-f", "-", "--allow-sidecar-image", "mirror.local/*", "--allow-sidecar-image", "*", stdin=pod_yaml("x:1"))
    assert bad.returncode == 2 and bad.stdout == ""
    assert "invalid allowed sidecar image '*'" in bad.stderr and "Traceback" not in bad.stderr


# ----------------------------------------------------------------------------- shardcache webhook


@pytest.fixture(scope="module")
def tenant_webhook(webhook_factory: Callable[..., WebhookProcess]) -> WebhookProcess:
    return webhook_factory("--sidecar-image", DEFAULT, "--allow-sidecar-image", "mirror.local/shardcache:*",
                           "--master-token-secret", "sc-shardcache-master-token")


def test_webhook_injects_the_default_image_with_a_warning(tenant_webhook: WebhookProcess) -> None:
    obj = pod({ANN: "evil.example.com/proxy:1"})
    status, body = tenant_webhook.review(admission_review(obj, uid="u-image"))
    assert status == 200, body
    response = body["response"]
    assert response["uid"] == "u-image" and response["allowed"] is True
    spec = apply_patch(obj, response)["spec"]
    assert sidecar_of(spec)["image"] == DEFAULT
    (warning,) = response["warnings"]
    assert warning.startswith(f"shardcache: pod ml/p: annotation {ANN} 'evil.example.com/proxy:1' ignored: not on the allow-list")
    assert len(warning) <= 256 and warning.isascii() and warning.isprintable()
    assert DEFAULT in warning
    assert f"pod ml/p: annotation {ANN} 'evil.example.com/proxy:1' ignored" in tenant_webhook.log_text()
    # Trainers get the master token from their namespace's copy of the Secret.
    env = spec["containers"][0]["env"]
    assert {"name": MASTER_TOKEN_ENV, "valueFrom": {"secretKeyRef": {"name": "sc-shardcache-master-token", "key": "token",
                                                                     "optional": True}}} in env


def test_webhook_honours_an_allowed_image_silently(tenant_webhook: WebhookProcess) -> None:
    obj = pod({ANN: "mirror.local/shardcache:0.2.0"})
    status, body = tenant_webhook.review(admission_review(obj, uid="u-ok"))
    assert status == 200 and "warnings" not in body["response"], body
    assert sidecar_of(apply_patch(obj, body["response"])["spec"])["image"] == "mirror.local/shardcache:0.2.0"


# ----------------------------------------------------------------------------- the socket directory, for real


def _mount(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["mount", *args], capture_output=True, text=True, timeout=10)


@pytest.fixture
def read_only_view(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """(the daemon's socket dir, a read-only bind mount of it): the hostPath as the node daemon
    and as the injected sidecar see it."""
    if shutil.which("mount") is None:
        pytest.skip("no mount command: cannot build a read-only bind mount")
    host, view = tmp_path / "run-shardcache", tmp_path / "pod-run-shardcache"
    host.mkdir()
    view.mkdir()
    bound = _mount("--bind", str(host), str(view))
    if bound.returncode != 0:
        pytest.skip(f"mount --bind is not permitted here (needs root or CAP_SYS_ADMIN): {bound.stderr.strip()}")
    try:
        ro = _mount("-o", "remount,bind,ro", str(view))
        if ro.returncode != 0:
            pytest.skip(f"cannot remount the bind mount read-only: {ro.stderr.strip()}")
        yield host, view
    finally:
        # A process still holding a file there makes a plain umount fail: detach it then.
        if subprocess.run(["umount", str(view)], capture_output=True, timeout=10).returncode != 0:
            subprocess.run(["umount", "-l", str(view)], capture_output=True, timeout=10)


@pytest.mark.timeout(90)
def test_sidecar_reads_through_a_read_only_socket_dir_and_cannot_write_it(
    tmp_path: Path, read_only_view: tuple[Path, Path]
) -> None:
    host, view = read_only_view
    origin = tmp_path / "origin"
    (origin / "bucket").mkdir(parents=True)
    data = bytes(range(256)) * 4096
    (origin / "bucket" / "shard-000.tar").write_bytes(data)
    node = DaemonProcess(
        ["--origin", f"file://{origin}", "--cache-dir", str(tmp_path / "node-cache"), "--cache-size", "64MiB",
         "--min-free", "0", "--listen", f"unix://{host}/daemon.sock"],
        tmp_path / "node.log",
    ).start()
    try:
        assert (view / "daemon.sock").is_socket()
        # What the injected sidecar runs, with its socket on the read-only mount.
        sidecar = DaemonProcess(
            ["--mode", "sidecar", "--upstream", f"unix://{view}/daemon.sock", "--origin", f"file://{origin}",
             "--cache-dir", str(tmp_path / "pod-cache"), "--cache-size", "64MiB", "--min-free", "0"],
            tmp_path / "sidecar.log",
        ).start()
        try:
            with urllib.request.urlopen(sidecar.url + "/readyz", timeout=10) as resp:
                assert b'"upstream": true' in resp.read()
            with urllib.request.urlopen(sidecar.url + "/bucket/shard-000.tar", timeout=30) as resp:
                assert resp.read() == data
                # Through the node daemon, not the sidecar's standalone cache on the same origin.
                assert resp.headers["x-shardcache-via"] == "upstream"
            # The node daemon filled it (its entry is published as the body completes).
            wait_until(lambda: node.stats()["cache"]["items"] == 1, timeout=10, what="the node daemon's cache entry")
        finally:
            sidecar.stop()
        # Nothing in the directory can be created, replaced or removed through that mount, not
        # even by root: a sidecar image cannot put its own socket in place of the daemon's.
        attempts: list[Callable[[], object]] = [
            lambda: (view / "planted").write_bytes(b"x"),
            lambda: (view / "daemon.sock").unlink(),
            lambda: (view / "lock").mkdir(),
            lambda: socket.socket(socket.AF_UNIX).bind(str(view / "daemon2.sock")),
        ]
        for attempt in attempts:
            with pytest.raises(OSError) as info:
                attempt()
            assert info.value.errno == errno.EROFS
        assert sorted(p.name for p in view.iterdir()) == ["daemon.sock"]
    finally:
        node.stop()


# ----------------------------------------------------------------------------- the chart


@pytest.fixture(scope="module")
def charts(renderer: Renderer) -> dict[str, list[dict[str, Any]]]:
    return {
        "defaults": renderer.objects({}),
        "tenancy": renderer.objects({
            "networkPolicy": {"trainingNamespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ml"}},
                              "metricsNamespaceSelector": None, "apiServerCIDRs": ["10.0.0.0/28"],
                              "extraFrom": {"master": [{"ipBlock": {"cidr": "192.168.0.0/16"}}]}},
            "webhook": {"allowedSidecarImages": ["mirror.local/shardcache:*", "registry.example.com/ml/*"]},
            "master": {"auth": {"existingSecret": "my-master-token"}},
        }),
        "namespaces": renderer.objects({"webhook": {"namespaceSelector": {"matchLabels": {"team": "vision"}}}}),
        "open": renderer.objects({"networkPolicy": {"enabled": False}, "master": {"auth": {"enabled": False}}}),
    }


def policies(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["labels"]["app.kubernetes.io/component"]: o for o in objects if o["kind"] == "NetworkPolicy"}


def test_network_policies_by_default(charts: dict[str, list[dict[str, Any]]], renderer: Renderer) -> None:
    objects = charts["defaults"]
    by_component = policies(objects)
    assert set(by_component) == {"node", "master", "webhook"}
    workloads = {"node": find(objects, "DaemonSet", "-node"), "master": find(objects, "Deployment", "-master"),
                 "webhook": find(objects, "Deployment", "-webhook")}
    mwc = find(objects, "MutatingWebhookConfiguration")
    for component, policy in by_component.items():
        validate_k8s(policy, "1.25")
        validate_k8s(policy, "1.30")
        spec = policy["spec"]
        assert spec["policyTypes"] == ["Ingress"] and "egress" not in spec  # egress stays open
        # Each policy selects its component's pods, and only those.
        selected = [w for w in (o for o in objects if o["kind"] in ("DaemonSet", "Deployment"))
                    if selects(spec["podSelector"], w["spec"]["template"]["metadata"]["labels"])]
        assert selected == [workloads[component]]
        # The node policy's second rule admits the other daemons (node.cluster, tests/k8s/test_k8s_cluster.py).
        rule, *peers = spec["ingress"]
        assert len(peers) == (component == "node")
        (container,) = workloads[component]["spec"]["template"]["spec"]["containers"]
        assert rule["ports"] == [{"port": p["containerPort"], "protocol": "TCP"} for p in container["ports"]]
        if component == "webhook":
            assert rule["from"] == [{"ipBlock": {"cidr": "0.0.0.0/0"}}, {"ipBlock": {"cidr": "::/0"}}]
            continue
        training, metrics = rule["from"]
        # Training namespaces are, by default, the namespaces the webhook injects, in either mode
        # (each webhook entry adds its shardcache.io/mode expression to that selector).
        for hook in mwc["webhooks"]:
            expressions = hook["namespaceSelector"]["matchExpressions"]
            assert [e for e in expressions if e["key"] not in ("shardcache.io/mode", "pod-security.kubernetes.io/enforce")] == (
                training["namespaceSelector"]["matchExpressions"])
        assert metrics == {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
        port = container["ports"][0]["containerPort"]
        assert admits(policy, "ml", port) and admits(policy, "monitoring", port)
        assert not admits(policy, "kube-system", port) and not admits(policy, NS, port)
        assert not admits(policy, "ml", port + 1)
    files = renderer.files({})
    parsed = kubectl_parse(files["shardcache/templates/networkpolicies.yaml"])
    assert [o["kind"] for o in parsed] == ["NetworkPolicy"] * 3


def test_network_policies_follow_the_values(charts: dict[str, list[dict[str, Any]]]) -> None:
    tenancy = policies(charts["tenancy"])
    for component in ("node", "master"):
        policy = tenancy[component]
        port = policy["spec"]["ingress"][0]["ports"][0]["port"]
        assert admits(policy, "ml", port)
        assert not admits(policy, "monitoring", port) and not admits(policy, "research", port)
    assert tenancy["master"]["spec"]["ingress"][0]["from"][-1] == {"ipBlock": {"cidr": "192.168.0.0/16"}}
    assert tenancy["webhook"]["spec"]["ingress"][0]["from"] == [{"ipBlock": {"cidr": "10.0.0.0/28"}}]
    for component in ("node", "master"):
        policy = policies(charts["namespaces"])[component]
        port = policy["spec"]["ingress"][0]["ports"][0]["port"]
        assert policy["spec"]["ingress"][0]["from"][0] == {"namespaceSelector": {"matchLabels": {"team": "vision"}}}
        assert not admits(policy, "ml", port)
    assert not policies(charts["open"])


def test_master_token_secret_mount_and_flags(charts: dict[str, list[dict[str, Any]]], renderer: Renderer) -> None:
    from sidecar.cli import build_parser
    from sidecar.cli.commands.webhook import settings_from_args

    objects = charts["defaults"]
    secret = find(objects, "Secret", "-master-token")
    assert secret["metadata"]["name"] == "sc-shardcache-master-token" and secret["type"] == "Opaque"
    token = base64.b64decode(secret["data"]["token"]).decode()
    assert len(token) == 48 and set(token) <= set(string.ascii_letters + string.digits)
    master = find(objects, "Deployment", "-master")
    spec = master["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    volume = {v["name"]: v for v in spec["volumes"]}["token"]
    assert volume["secret"]["secretName"] == secret["metadata"]["name"]
    assert volume["secret"]["items"] == [{"key": "token", "path": "token"}]
    assert volume["secret"]["defaultMode"] == 0o440  # group-readable: the master runs as 65532 with fsGroup 65532
    mount = next(m for m in container["volumeMounts"] if m["name"] == "token")
    assert mount["readOnly"] is True
    args = container["args"]
    assert args[args.index("--token-file") + 1] == mount["mountPath"] + "/token"
    hook_args = find(objects, "Deployment", "-webhook")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert settings_from_args(build_parser().parse_args(hook_args)).inject.master_token_secret == secret["metadata"]["name"]
    # Generated once: without a cluster `lookup` finds nothing, so each render makes a new one.
    again = find(renderer.objects({}), "Secret", "-master-token")["data"]["token"]
    assert again != secret["data"]["token"]
    assert 'lookup "v1" "Secret"' in (CHART / "templates" / "master-token.yaml").read_text()


def test_existing_token_secret_and_auth_off(charts: dict[str, list[dict[str, Any]]]) -> None:
    from sidecar.cli import build_parser
    from sidecar.cli.commands.webhook import settings_from_args

    tenancy = charts["tenancy"]
    assert not [o for o in tenancy if o["kind"] == "Secret" and o["metadata"]["name"].endswith("-master-token")]
    spec = find(tenancy, "Deployment", "-master")["spec"]["template"]["spec"]
    assert {v["name"]: v for v in spec["volumes"]}["token"]["secret"]["secretName"] == "my-master-token"
    hook_args = find(tenancy, "Deployment", "-webhook")["spec"]["template"]["spec"]["containers"][0]["args"]
    settings = settings_from_args(build_parser().parse_args(hook_args))
    assert settings.inject.master_token_secret == "my-master-token"
    assert settings.inject.allowed_sidecar_images == ("mirror.local/shardcache:*", "registry.example.com/ml/*")
    open_chart = charts["open"]
    assert not [o for o in open_chart if o["kind"] == "Secret" and o["metadata"]["name"].endswith("-master-token")]
    master = find(open_chart, "Deployment", "-master")["spec"]["template"]["spec"]
    assert "--token-file" not in master["containers"][0]["args"] and "token" not in {v["name"] for v in master["volumes"]}
    hook_args = find(open_chart, "Deployment", "-webhook")["spec"]["template"]["spec"]["containers"][0]["args"]
    # Passed empty: the flag's default is the token Secret of a release named shardcache.
    assert hook_args[hook_args.index("--master-token-secret") + 1] == "" and "--allow-sidecar-image" not in hook_args
    assert settings_from_args(build_parser().parse_args(hook_args)).inject.master_token_secret is None


def test_secret_annotations_for_reflector(renderer: Renderer) -> None:
    annotations = {"reflector.v1.k8s.emberstack.com/reflection-allowed": "true",
                   "reflector.v1.k8s.emberstack.com/reflection-auto-enabled": "true"}
    secret = find(renderer.objects({"master": {"auth": {"secretAnnotations": annotations}}}), "Secret", "-master-token")
    assert secret["metadata"]["annotations"] == annotations
