"""``shardcache serve --auth sigv4`` on Kubernetes.

The chart (Helm's own engine, offline): the daemon's auth flags for each setting, the schema's and
the cross-field checks' refusals, valid objects (kubernetes-validate, kubectl), no node cache in
pods under sigv4, open egress to STS, the notes. The injection: the sidecar gets the pod's own AWS
credentials (IRSA, EKS Pod Identity, a Secret's keys, credential files), never AWS_ENDPOINT_URL and
never over what it already sets, idempotently; through the pure function, the real webhook and
``shardcache inject`` processes; and real boto3 resolving the credentials in the app container's
and in the sidecar's filesystem views (bind mounts in a private mount namespace) against a local
STS and Pod Identity agent.
"""

from __future__ import annotations

import argparse
import base64
import copy
import dataclasses
import hashlib
import http.server
import json
import os
import shutil
import subprocess
import sys
import threading
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonpatch  # type: ignore[import-untyped]
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sidecar.k8s.inject import (
    AWS_CREDENTIAL_ENV,
    AWS_TOKEN_DIRS,
    INJECT_LABEL,
    NODE_ENV,
    SIDECAR_NAME,
    InjectConfig,
    InjectionError,
    inject,
)
from sidecar.k8s.patch import json_patch
from sidecar.k8s.yamldocs import dump_documents
from tests.support.k8s import (
    CHART,
    Renderer,
    WebhookProcess,
    admission_review,
    apply_patch,
    check_pod_semantics,
    docs,
    find,
    kubectl_parse,
    pod_templates,
    run_inject,
    subcommands,
    validate_k8s,
)

NS = "shardcache"
SIGV4 = ["--auth", "sigv4", "--auth-identity", "sts", "--auth-cache-ttl", "120"]

# values -> what follows `--origin s3` in the daemon's args.
AUTH_OPTIONS: dict[str, tuple[dict[str, Any], list[str]]] = {
    "defaults": ({}, SIGV4),
    "none": ({"node": {"auth": {"mode": "none"}}}, ["--auth", "none"]),
    "access-key": (
        {"node": {"auth": {"identity": "access-key", "cacheTTLSeconds": 30}}},
        ["--auth", "sigv4", "--auth-identity", "access-key", "--auth-cache-ttl", "30"],
    ),
    "every-read": ({"node": {"auth": {"cacheTTLSeconds": 0}}}, ["--auth", "sigv4", "--auth-identity", "sts", "--auth-cache-ttl", "0"]),
    "file-origin": ({"node": {"origin": {"type": "file", "file": {"hostPath": "/mnt/datasets"}}, "auth": {"mode": "none"}}},
                    ["--auth", "none"]),
    "sts-endpoint": (
        {"node": {"auth": {"stsEndpoint": "https://sts.us-west-2.amazonaws.com"}}},
        ["--auth", "sigv4", "--auth-identity", "sts", "--sts-endpoint", "https://sts.us-west-2.amazonaws.com", "--auth-cache-ttl", "120"],
    ),
    "quota": (
        {"node": {"tenantQuota": "50GiB", "extraArgs": ["--origin-concurrency", "64"]}},
        [*SIGV4, "--tenant-quota", "50GiB", "--origin-concurrency", "64"],
    ),
    "minio": (
        {"node": {"origin": {"s3": {"endpoint": "http://minio.storage:9000", "credentialsSecret": {"name": "minio"}}},
                  "auth": {"identity": "access-key"}}},
        ["--auth", "sigv4", "--auth-identity", "access-key", "--auth-cache-ttl", "120"],
    ),
}


@pytest.fixture(scope="module")
def charts(renderer: Renderer) -> dict[str, list[dict[str, Any]]]:
    return {name: renderer.objects(copy.deepcopy(values)) for name, (values, _) in AUTH_OPTIONS.items()}


def daemon(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (container,) = find(objects, "DaemonSet", "-node")["spec"]["template"]["spec"]["containers"]
    return container


def webhook_args(objects: list[dict[str, Any]]) -> list[str]:
    (container,) = find(objects, "Deployment", "-webhook")["spec"]["template"]["spec"]["containers"]
    return list(container["args"])


# ----------------------------------------------------------------------------- the chart


@pytest.mark.parametrize("option", AUTH_OPTIONS)
def test_daemon_args_for_each_auth_setting(charts: dict[str, list[dict[str, Any]]], option: str) -> None:
    args = daemon(charts[option])["args"]
    at = args.index("--origin") + 2
    assert args[at:] == AUTH_OPTIONS[option][1]
    if option != "file-origin":  # everything before the auth flags is what it was
        defaults = daemon(charts["defaults"])["args"]
        assert args[:at] == defaults[: defaults.index("--origin") + 2]


@pytest.mark.parametrize("option", AUTH_OPTIONS)
def test_the_daemon_accepts_its_args(charts: dict[str, list[dict[str, Any]]], option: str, tmp_path: Path) -> None:
    from sidecar.cli import build_parser

    parser = build_parser()
    if "serve" not in subcommands(parser):
        pytest.skip("sidecar.cli.commands.serve is not in this tree yet")
    serve = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    flags = {"--auth", "--auth-identity", "--sts-endpoint", "--auth-cache-ttl", "--tenant-quota"}
    if not flags <= serve._option_string_actions.keys():
        pytest.skip(f"shardcache serve lacks {sorted(flags - serve._option_string_actions.keys())} (issue 15, being built)")
    # The DaemonSet also runs the cluster flags (node.cluster.enabled, tests/k8s/test_k8s_cluster.py).
    cluster = {"--peers-dns", "--advertise-url", "--peer-secret-file"}
    if not cluster <= serve._option_string_actions.keys():
        pytest.skip(f"shardcache serve lacks {sorted(cluster - serve._option_string_actions.keys())} (issue 17, being built)")
    from sidecar.cli.commands.serve import build_settings

    args = parser.parse_args(daemon(charts[option])["args"])
    assert args.command == "serve" and args.mode == "node"
    if args.origin.startswith("file://"):
        args.origin = f"file://{tmp_path}"  # the hostPath the DaemonSet mounts there
    # What the kubelet and the Secret volume provide: $(POD_IP) expanded, the peer secret's file.
    args.advertise_url = args.advertise_url.replace("$(POD_IP)", "10.0.0.7")
    (tmp_path / "peer-secret").write_text("s" * 64)  # as long as the chart generates
    args.peer_secret_file = str(tmp_path / "peer-secret")
    # The daemon's own checks of its flags (sigv4 needs an S3 origin, the TTL's range, the quota's size).
    settings = build_settings(args)
    auth = AUTH_OPTIONS[option][0].get("node", {}).get("auth", {})
    assert settings.auth.mode == auth.get("mode", "sigv4")
    if settings.auth.mode == "sigv4":
        assert settings.auth.identity == auth.get("identity", "sts")
        assert settings.auth.sts_endpoint == (auth.get("stsEndpoint") or None)
        assert settings.auth.decision_ttl_s == auth.get("cacheTTLSeconds", 120)
    quota = AUTH_OPTIONS[option][0].get("node", {}).get("tenantQuota")
    assert settings.store.tenant_quota_bytes == (50 * 2**30 if quota else None)


@pytest.mark.parametrize("option", AUTH_OPTIONS)
@pytest.mark.slow
def test_lint_and_objects_are_valid(renderer: Renderer, charts: dict[str, list[dict[str, Any]]], option: str) -> None:
    report = renderer.helm.lint(str(CHART), copy.deepcopy(AUTH_OPTIONS[option][0]), strict=True, namespace=NS, kube_version="v1.30.0")
    assert report["errors"] == [] and report["messages"] == [], report
    for kind, suffix in (("DaemonSet", "-node"), ("Deployment", "-webhook"), ("MutatingWebhookConfiguration", ""), ("NetworkPolicy", "-node")):
        for version in ("1.25", "1.30"):
            validate_k8s(find(charts[option], kind, suffix), version)


def test_kubectl_reads_the_rendered_chart(renderer: Renderer) -> None:
    for values, _ in (AUTH_OPTIONS["defaults"], AUTH_OPTIONS["quota"]):
        files = renderer.files(copy.deepcopy(values))
        text = "\n---\n".join(v for k, v in sorted(files.items()) if k.endswith(".yaml") and v.strip())
        (ds,) = [o for o in kubectl_parse(text) if o["kind"] == "DaemonSet"]
        assert "--auth" in ds["spec"]["template"]["spec"]["containers"][0]["args"]


@pytest.mark.parametrize(
    "values, where",
    [
        ({"node": {"auth": {"mode": "iam"}}}, "/node/auth/mode"),
        ({"node": {"auth": {"mode": True}}}, "/node/auth/mode"),
        ({"node": {"auth": {"mode": "SIGV4"}}}, "/node/auth/mode"),
        ({"node": {"auth": {"identity": "oidc"}}}, "/node/auth/identity"),
        ({"node": {"auth": {"stsEndpoint": "sts.amazonaws.com"}}}, "/node/auth/stsEndpoint"),
        ({"node": {"auth": {"cacheTTLSeconds": -1}}}, "/node/auth/cacheTTLSeconds"),
        ({"node": {"auth": {"cacheTTLSeconds": 3601}}}, "/node/auth/cacheTTLSeconds"),
        ({"node": {"auth": {"cacheTTLSeconds": 1.5}}}, "/node/auth/cacheTTLSeconds"),
        ({"node": {"auth": {"cacheTTLSeconds": "120"}}}, "/node/auth/cacheTTLSeconds"),
        ({"node": {"tenantQuota": "lots"}}, "/node/tenantQuota"),
        ({"node": {"tenantQuota": 50}}, "/node/tenantQuota"),
        ({"node": {"auth": {"modes": "sigv4"}}}, "modes"),
        # The auth settings are the daemon's, so they live under node (next to master.auth).
        ({"auth": {"mode": "sigv4"}}, "auth"),
    ],
)
def test_schema_refuses_bad_auth_values(renderer: Renderer, values: dict[str, Any], where: str) -> None:
    with pytest.raises(renderer.helm.HelmValuesError) as info:
        renderer.files(values)
    assert where in str(info.value)


@pytest.mark.parametrize(
    "values, message",
    [
        ({"node": {"auth": {"mode": "none"}, "tenantQuota": "10GiB"}}, "node.tenantQuota needs node.auth.mode=sigv4"),
        ({"node": {"auth": {"mode": "none", "stsEndpoint": "https://sts.example"}}}, "node.auth.stsEndpoint is used only with"),
        ({"node": {"auth": {"identity": "access-key", "stsEndpoint": "https://sts.example"}}}, "node.auth.stsEndpoint is used only with"),
        # The daemon refuses --auth sigv4 without an S3 origin: say so at install, not in a crash loop.
        ({"node": {"origin": {"type": "file", "file": {"hostPath": "/mnt/datasets"}}}}, "set node.auth.mode=none"),
    ],
)
def test_inconsistent_auth_values_fail_with_what_to_change(renderer: Renderer, values: dict[str, Any], message: str) -> None:
    with pytest.raises(renderer.helm.HelmError) as info:
        renderer.files(values)
    assert message in str(info.value)


def test_no_pod_mounts_the_node_cache_whatever_the_auth_mode(renderer: Renderer, charts: dict[str, list[dict[str, Any]]]) -> None:
    from sidecar.cli import build_parser
    from sidecar.cli.commands.webhook import settings_from_args

    # A read-only node cache in every pod would show every tenant's cached bytes, past the checks:
    # short-circuit reads go by file handle instead, checked per tenant, so they stay on under sigv4.
    ephemeral = renderer.objects({"node": {"auth": {"mode": "none"}, "cache": {"type": "ephemeral"}}})
    for objects in (charts["defaults"], charts["none"], ephemeral):
        args = webhook_args(objects)
        assert "--short-circuit" in args and "--cache-host-dir" not in args
        config = settings_from_args(build_parser().parse_args(args)).inject
        assert config.short_circuit is True
        spec = inject({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "labels": {INJECT_LABEL: "true"}},
                       "spec": {"containers": [{"name": "t", "image": "t"}]}}, config)[0]["spec"]
        assert [v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v] == ["/run/shardcache"]
        assert all(not m["mountPath"].startswith("/var/cache/shardcache/") and m["mountPath"] != "/var/cache/shardcache"
                   for c in spec["containers"] + spec["initContainers"] for m in c.get("volumeMounts", []))
        assert "--handles" in daemon(objects)["args"]


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, "the chart's policies select by labels only"
    return all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items())


@pytest.mark.parametrize("option", ["defaults", "sts-endpoint", "minio"])
def test_daemon_egress_reaches_sts_and_s3(charts: dict[str, list[dict[str, Any]]], option: str) -> None:
    objects = charts[option]
    labels = find(objects, "DaemonSet", "-node")["spec"]["template"]["metadata"]["labels"]
    selecting = [p for p in objects if p["kind"] == "NetworkPolicy" and _selects(p["spec"]["podSelector"], labels)]
    assert selecting, "the daemon has its ingress policy"
    for policy in selecting:
        # No policy restricts the daemons' egress, so STS (and S3) stay reachable.
        assert "Egress" not in policy["spec"]["policyTypes"] and "egress" not in policy["spec"]
    comment = (CHART / "templates" / "networkpolicies.yaml").read_text()
    assert "STS" in comment.split("-}}", 1)[0]


@pytest.mark.parametrize("values", [{}, {"webhook": {"injectWorkloads": True}}])
def test_webhook_is_reinvoked_when_a_later_webhook_changes_the_pod(renderer: Renderer, values: dict[str, Any]) -> None:
    hooks = find(renderer.objects(values), "MutatingWebhookConfiguration")["webhooks"]
    assert hooks and all(h["reinvocationPolicy"] == "IfNeeded" for h in hooks)


def test_notes_say_what_sigv4_means_for_tenants(renderer: Renderer) -> None:
    notes = renderer.files({})["shardcache/templates/NOTES.txt"]
    assert "Tenants (node.auth.mode=sigv4)" in notes
    assert "signs with the pod's own AWS credentials" in notes
    assert "must therefore be able to read, with their own credentials, everything they read through the" in notes
    assert "403 AccessDenied" in notes and "checked at AWS's regional STS" in notes
    assert "mounted read-only at /var/cache/shardcache" not in notes and "WARNING: node.auth.mode is none" not in notes
    minio = renderer.files(copy.deepcopy(AUTH_OPTIONS["minio"][0]))["shardcache/templates/NOTES.txt"]
    assert "Tenants are access key ids (node.auth.identity=access-key)" in minio
    quota = renderer.files({"node": {"tenantQuota": "50GiB", "origin": {"s3": {"endpoint": "http://minio:9000"}}}})["shardcache/templates/NOTES.txt"]
    assert "checked at http://minio:9000" in quota and "each tenant may hold up to 50GiB" in quota
    none = renderer.files({"node": {"auth": {"mode": "none"}}})["shardcache/templates/NOTES.txt"]
    assert "WARNING: node.auth.mode is none" in none and "Tenants (node.auth.mode=sigv4)" not in none
    assert "mounted read-only at /var/cache/shardcache" not in none and "SHARDCACHE_HANDLES" in none


# ----------------------------------------------------------------------------- injection: pod shapes

CONFIG = InjectConfig(image="registry.example.com/shardcache:test")
FALLBACK = InjectConfig(image="registry.example.com/shardcache:test", native_sidecar=False)
MINIO = InjectConfig(image="registry.example.com/shardcache:test",
                     env=(("AWS_ENDPOINT_URL", "http://minio.storage:9000"), ("AWS_REGION", "eu-central-1")))

IRSA_TOKEN_DIR, POD_IDENTITY_TOKEN_DIR = AWS_TOKEN_DIRS
# What EKS's pod-identity webhook adds to each container present when it runs (IRSA)...
IRSA_ENV = [
    {"name": "AWS_STS_REGIONAL_ENDPOINTS", "value": "regional"},
    {"name": "AWS_DEFAULT_REGION", "value": "us-west-2"},
    {"name": "AWS_REGION", "value": "us-west-2"},
    {"name": "AWS_ROLE_ARN", "value": "arn:aws:iam::111122223333:role/trainer"},
    {"name": "AWS_WEB_IDENTITY_TOKEN_FILE", "value": f"{IRSA_TOKEN_DIR}/token"},
]
IRSA_MOUNT = {"name": "aws-iam-token", "mountPath": IRSA_TOKEN_DIR, "readOnly": True}
IRSA_VOLUME = {"name": "aws-iam-token", "projected": {"defaultMode": 420, "sources": [
    {"serviceAccountToken": {"audience": "sts.amazonaws.com", "expirationSeconds": 86400, "path": "token"}}]}}
# ...and for EKS Pod Identity.
POD_IDENTITY_ENV = [
    {"name": "AWS_CONTAINER_CREDENTIALS_FULL_URI", "value": "http://169.254.170.23/v1/credentials"},
    {"name": "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE", "value": f"{POD_IDENTITY_TOKEN_DIR}/eks-pod-identity-token"},
]
POD_IDENTITY_MOUNT = {"name": "eks-pod-identity-token", "mountPath": POD_IDENTITY_TOKEN_DIR, "readOnly": True}
POD_IDENTITY_VOLUME = {"name": "eks-pod-identity-token", "projected": {"defaultMode": 420, "sources": [
    {"serviceAccountToken": {"audience": "pods.eks.amazonaws.com", "expirationSeconds": 86400, "path": "eks-pod-identity-token"}}]}}
APP_ENDPOINT = {"name": "AWS_ENDPOINT_URL", "value": "http://127.0.0.1:8600"}


def pod(containers: list[dict[str, Any]], volumes: list[dict[str, Any]] | None = None, **spec: Any) -> dict[str, Any]:
    spec = {"serviceAccountName": "trainer", "containers": containers, **spec}
    if volumes:
        spec["volumes"] = volumes
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "ml", "labels": {INJECT_LABEL: "true"}}, "spec": spec}


def trainer(**fields: Any) -> dict[str, Any]:
    return {"name": "train", "image": "trainer:1", **fields}


def irsa_pod() -> dict[str, Any]:
    return pod([trainer(env=[*copy.deepcopy(IRSA_ENV), APP_ENDPOINT], volumeMounts=[IRSA_MOUNT])], [IRSA_VOLUME])


def pod_identity_pod() -> dict[str, Any]:
    return pod([trainer(env=copy.deepcopy(POD_IDENTITY_ENV), volumeMounts=[POD_IDENTITY_MOUNT])], [POD_IDENTITY_VOLUME])


def secret_pod() -> dict[str, Any]:
    return pod([trainer(
        env=[{"name": "AWS_ACCESS_KEY_ID", "valueFrom": {"secretKeyRef": {"name": "team-a-keys", "key": "id"}}},
             {"name": "AWS_SECRET_ACCESS_KEY", "valueFrom": {"secretKeyRef": {"name": "team-a-keys", "key": "secret"}}},
             {"name": "DATASET", "value": "s3://team-a/train"}],
        envFrom=[{"secretRef": {"name": "team-a-session"}}, {"configMapRef": {"name": "trainer-settings"}},
                 {"prefix": "MINIO_", "secretRef": {"name": "minio", "optional": True}}],
    )])


def sidecar_of(spec: dict[str, Any]) -> dict[str, Any]:
    (found,) = [c for c in spec.get("initContainers", []) + spec["containers"] if c["name"] == SIDECAR_NAME]
    return found


# Every injected container gets it (tests/k8s/test_k8s_cluster.py); these tests are about the rest.
NODE_ENTRY = {"name": NODE_ENV, "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}


def cred_env(container: dict[str, Any]) -> list[dict[str, Any]]:
    """The container's env but the SHARDCACHE_NODE entry, which must be there once."""
    env = container.get("env", [])
    assert env.count(NODE_ENTRY) == 1, env
    return [e for e in env if e != NODE_ENTRY]


def env_names(container: dict[str, Any]) -> list[str]:
    return [e["name"] for e in cred_env(container)]


def extra_mounts(container: dict[str, Any]) -> list[dict[str, Any]]:
    """The sidecar's mounts but its own (socket, caches)."""
    return [m for m in container.get("volumeMounts", []) if not m["name"].startswith("shardcache-")]


def injected(obj: dict[str, Any], config: InjectConfig = CONFIG) -> dict[str, Any]:
    out, outcome = inject(obj, config)
    assert outcome.result == "injected"
    for version in ("1.29", "1.30") if config.native_sidecar else ("1.25", "1.30"):
        validate_k8s(out, version)
    for template in pod_templates(out):
        check_pod_semantics(template["spec"])
    return out


@pytest.mark.parametrize("config", [CONFIG, FALLBACK], ids=["native", "container"])
def test_irsa_role_and_token_reach_the_sidecar(config: InjectConfig) -> None:
    original = irsa_pod()
    out = injected(original, config)
    sidecar = sidecar_of(out["spec"])
    assert cred_env(sidecar) == IRSA_ENV
    assert extra_mounts(sidecar) == [IRSA_MOUNT]
    # The app container is left as it was, but for what injection always adds.
    (train,) = [c for c in out["spec"]["containers"] if c["name"] == "train"]
    assert train["env"][: len(original["spec"]["containers"][0]["env"])] == original["spec"]["containers"][0]["env"]
    assert out["spec"]["volumes"][0] == IRSA_VOLUME


def test_pod_identity_uri_and_token_reach_the_sidecar() -> None:
    sidecar = sidecar_of(injected(pod_identity_pod())["spec"])
    assert cred_env(sidecar) == POD_IDENTITY_ENV
    assert extra_mounts(sidecar) == [POD_IDENTITY_MOUNT]


def test_keys_from_a_secret_and_env_from_secrets() -> None:
    sidecar = sidecar_of(injected(secret_pod())["spec"])
    # valueFrom as it is; app settings (DATASET) are not the sidecar's.
    assert cred_env(sidecar) == secret_pod()["spec"]["containers"][0]["env"][:2]
    # Secrets whole, prefix and optional kept; the ConfigMap of app settings is not copied.
    assert sidecar["envFrom"] == [{"secretRef": {"name": "team-a-session"}}, {"prefix": "MINIO_", "secretRef": {"name": "minio", "optional": True}}]
    assert extra_mounts(sidecar) == []


def test_the_sidecar_keeps_what_it_already_sets() -> None:
    # The chart's settings (the store's endpoint and region) stay the sidecar's.
    sidecar = sidecar_of(injected(irsa_pod(), MINIO)["spec"])
    assert sidecar["env"][:2] == [{"name": "AWS_ENDPOINT_URL", "value": "http://minio.storage:9000"},
                                  {"name": "AWS_REGION", "value": "eu-central-1"}]
    assert env_names(sidecar) == ["AWS_ENDPOINT_URL", "AWS_REGION", "AWS_STS_REGIONAL_ENDPOINTS", "AWS_DEFAULT_REGION",
                                  "AWS_ROLE_ARN", "AWS_WEB_IDENTITY_TOKEN_FILE"]
    # A sidecar already in the pod (written by hand) keeps its own role and its own token mount.
    own_role = {"name": "AWS_ROLE_ARN", "value": "arn:aws:iam::111122223333:role/cache-reader"}
    own_mount = {"name": "my-token", "mountPath": IRSA_TOKEN_DIR, "readOnly": True}
    obj = irsa_pod()
    obj["spec"]["volumes"].append({"name": "my-token", "projected": {"sources": [{"serviceAccountToken": {"audience": "sts.amazonaws.com", "path": "token"}}]}})
    obj["spec"]["initContainers"] = [{"name": SIDECAR_NAME, "image": "registry.example.com/shardcache:test", "restartPolicy": "Always",
                                      "env": [own_role], "volumeMounts": [own_mount]}]
    sidecar = sidecar_of(injected(obj)["spec"])
    assert sidecar["env"][0] == own_role and env_names(sidecar).count("AWS_ROLE_ARN") == 1
    assert sidecar["volumeMounts"] == [own_mount]
    assert [e for e in cred_env(sidecar) if e["name"] != "AWS_ROLE_ARN"] == [e for e in IRSA_ENV if e["name"] != "AWS_ROLE_ARN"]


def test_endpoint_urls_are_never_copied() -> None:
    obj = pod([trainer(env=[
        APP_ENDPOINT,
        {"name": "AWS_ENDPOINT_URL_S3", "value": "http://127.0.0.1:8600"},
        {"name": "AWS_ENDPOINT_URL_STS", "valueFrom": {"configMapKeyRef": {"name": "x", "key": "sts"}}},
        {"name": "AWS_ACCESS_KEY_ID", "value": "AKIAEXAMPLE"},
        {"name": "AWS_SECRET_ACCESS_KEY", "valueFrom": {"secretKeyRef": {"name": "k", "key": "secret"}}},
        {"name": "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "value": "false"},
    ])])
    for config in (CONFIG, MINIO):
        sidecar = sidecar_of(injected(obj, config)["spec"])
        copied = [n for n in env_names(sidecar) if n not in dict(config.env)]
        assert copied == ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"]
        endpoint = [e for e in sidecar["env"] if e["name"].startswith("AWS_ENDPOINT_URL")]
        assert endpoint == [{"name": k, "value": v} for k, v in config.env if k == "AWS_ENDPOINT_URL"]


def test_credential_files_bring_the_mounts_that_hold_them() -> None:
    obj = pod([trainer(
        env=[{"name": "AWS_SHARED_CREDENTIALS_FILE", "value": "/etc/aws/team-a/credentials"},
             {"name": "AWS_CONFIG_FILE", "value": "/etc/aws-config"},
             {"name": "AWS_PROFILE", "value": "team-a"}],
        volumeMounts=[
            {"name": "data", "mountPath": "/etc"},  # holds the file too, but not as deep
            {"name": "creds", "mountPath": "/etc/aws/team-a/", "mountPropagation": "HostToContainer"},
            {"name": "config", "mountPath": "/etc/aws-config", "subPath": "config"},
            {"name": "scratch", "mountPath": "/scratch"},
        ])], [{"name": "data", "emptyDir": {}}, {"name": "creds", "secret": {"secretName": "team-a-aws"}},
              {"name": "config", "configMap": {"name": "aws-config"}}, {"name": "scratch", "emptyDir": {}}])
    sidecar = sidecar_of(injected(obj)["spec"])
    assert env_names(sidecar) == ["AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE", "AWS_PROFILE"]
    # Read-only, without the app's propagation; a file mounted by subPath keeps its subPath.
    assert extra_mounts(sidecar) == [
        {"name": "creds", "mountPath": "/etc/aws/team-a/", "readOnly": True},
        {"name": "config", "mountPath": "/etc/aws-config", "readOnly": True, "subPath": "config"},
    ]
    # A file path from valueFrom, a relative one, or under a subPathExpr mount brings no mount.
    odd = pod([trainer(
        env=[{"name": "AWS_CONFIG_FILE", "valueFrom": {"configMapKeyRef": {"name": "x", "key": "path"}}},
             {"name": "AWS_SHARED_CREDENTIALS_FILE", "value": "creds/credentials"},
             {"name": "AWS_WEB_IDENTITY_TOKEN_FILE", "value": "/tokens/token"}],
        volumeMounts=[{"name": "v", "mountPath": "/tokens", "subPathExpr": "$(POD_NAME)"}, {"name": "w", "mountPath": "/creds"}],
    )], [{"name": "v", "emptyDir": {}}, {"name": "w", "emptyDir": {}}])
    sidecar = sidecar_of(injected(odd)["spec"])
    assert env_names(sidecar) == ["AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE", "AWS_WEB_IDENTITY_TOKEN_FILE"]
    assert extra_mounts(sidecar) == []


def test_a_home_aws_directory_is_pointed_at() -> None:
    # boto3 finds ~/.aws through HOME, which is the app user's, not the sidecar's.
    mount = {"name": "aws", "mountPath": "/home/trainer/.aws", "readOnly": True}
    obj = pod([trainer(env=[{"name": "AWS_PROFILE", "value": "team-a"}], volumeMounts=[mount])],
              [{"name": "aws", "secret": {"secretName": "team-a-aws"}}])
    sidecar = sidecar_of(injected(obj)["spec"])
    assert cred_env(sidecar) == [{"name": "AWS_PROFILE", "value": "team-a"},
                              {"name": "AWS_SHARED_CREDENTIALS_FILE", "value": "/home/trainer/.aws/credentials"},
                              {"name": "AWS_CONFIG_FILE", "value": "/home/trainer/.aws/config"}]
    assert extra_mounts(sidecar) == [mount]
    # Named files win over the directory.
    obj["spec"]["containers"][0]["env"].append({"name": "AWS_CONFIG_FILE", "value": "/home/trainer/.aws/team-a.ini"})
    sidecar = sidecar_of(injected(obj)["spec"])
    assert env_names(sidecar) == ["AWS_PROFILE", "AWS_CONFIG_FILE"]


def test_one_source_the_first_app_container_with_credentials() -> None:
    other = [{"name": "AWS_ACCESS_KEY_ID", "value": "AKIAOTHER"}, {"name": "AWS_SECRET_ACCESS_KEY", "value": "other"},
             {"name": "AWS_SESSION_TOKEN", "value": "other-session"}]
    obj = pod([
        {"name": "logs", "image": "fluent-bit:3", "env": [{"name": "LOG_LEVEL", "value": "info"}]},
        trainer(env=[{"name": "AWS_ACCESS_KEY_ID", "value": "AKIATRAIN"}, {"name": "AWS_SECRET_ACCESS_KEY", "value": "train"}]),
        {"name": "uploader", "image": "u:1", "env": other},
    ], initContainers=[{"name": "fetch", "image": "f:1", "env": [{"name": "AWS_ROLE_ARN", "value": "arn:aws:iam::1:role/init"}]}])
    sidecar = sidecar_of(injected(obj)["spec"])
    # Never the uploader's session token with the trainer's keys, nor the role of the init
    # container (regular containers, the trainers, come first).
    assert cred_env(sidecar) == [{"name": "AWS_ACCESS_KEY_ID", "value": "AKIATRAIN"}, {"name": "AWS_SECRET_ACCESS_KEY", "value": "train"}]
    # A pod without credentials gives the sidecar nothing: it runs as it always did.
    plain = sidecar_of(injected(pod([trainer(env=[APP_ENDPOINT])]))["spec"])
    assert cred_env(plain) == [] and "envFrom" not in plain and extra_mounts(plain) == []


def test_a_malformed_env_from_names_the_field() -> None:
    from sidecar.k8s.inject import InjectionError

    with pytest.raises(InjectionError, match=r"spec\.containers\[1\]\.envFrom must be a list of objects"):
        inject(pod([{"name": "logs", "image": "l:1"}, trainer(envFrom={"secretRef": {"name": "keys"}})]), CONFIG)


SHAPES = {"irsa": irsa_pod, "pod-identity": pod_identity_pod, "secret": secret_pod}


@pytest.mark.parametrize("config", [CONFIG, FALLBACK, MINIO], ids=["native", "container", "minio"])
@pytest.mark.parametrize("shape", SHAPES)
def test_reinjection_changes_nothing(shape: str, config: InjectConfig) -> None:
    once = injected(SHAPES[shape](), config)
    twice, outcome = inject(once, config)
    assert twice == once and outcome.result == "unchanged"
    assert json_patch(once, twice) == []
    # A webhook moved to another image (a mirror) keeps the pods injected with the old one when the
    # allow-list names it, and another tag of its own image always.
    other = InjectConfig(image="other/image:9", native_sidecar=not config.native_sidecar, env=(("AWS_REGION", "ap-south-1"),),
                         allowed_sidecar_images=(config.image,))
    assert inject(once, other) == (once, inject(once, other)[1])
    upgraded = dataclasses.replace(config, image="registry.example.com/shardcache:next")
    assert inject(once, upgraded)[0] == once


@pytest.mark.parametrize("native", [True, False])
def test_a_hand_written_sidecar_of_another_image_gets_no_socket(native: bool) -> None:
    """A container written by hand under the sidecar's name is not the sidecar: the injector would
    otherwise give it the node daemon's socket (and the app containers its handles) whatever it
    runs. Refused with the reason; its own image, another tag of it or an allowed one are kept."""
    config = CONFIG if native else FALLBACK
    for image in ("attacker/tool:1", "registry.example.com/shardcache-evil:test", "registry.example.com:5000/shardcache:test",
                  None, 7):
        obj = pod([trainer()])
        fake = {"name": "shardcache", **({"image": image} if image is not None else {})}
        obj["spec"]["initContainers" if native else "containers"] = [fake, *obj["spec"].get("containers", [])] if not native else [fake]
        with pytest.raises(InjectionError, match="a container named 'shardcache' runs image .* which is not the shardcache sidecar"):
            inject(obj, config)
    allowed = dataclasses.replace(config, allowed_sidecar_images=("attacker/tool:1",))
    obj = pod([trainer()])
    obj["spec"]["initContainers" if native else "containers"] = (
        [{"name": "shardcache", "image": "attacker/tool:1"}] if native
        else [{"name": "shardcache", "image": "attacker/tool:1"}, *obj["spec"]["containers"]])
    done, outcome = inject(obj, allowed)
    assert outcome.result == "injected"


def test_credentials_a_later_webhook_adds_reach_the_sidecar_on_reinvocation() -> None:
    # Ours first, then EKS's pod-identity webhook mutating the app container only (say it skipped
    # the sidecar); the API server then calls ours again (reinvocationPolicy: IfNeeded).
    once = injected(pod([trainer(env=[APP_ENDPOINT])]))
    mutated = copy.deepcopy(once)
    train = mutated["spec"]["containers"][0]
    train["env"] += copy.deepcopy(IRSA_ENV)
    train["volumeMounts"].append(IRSA_MOUNT)
    mutated["spec"]["volumes"].append(IRSA_VOLUME)
    again = injected(mutated)
    sidecar = sidecar_of(again["spec"])
    assert cred_env(sidecar) == IRSA_ENV and extra_mounts(sidecar) == [IRSA_MOUNT]
    patch = json_patch(mutated, again)
    assert patch and all(op["op"] == "add" for op in patch), patch
    assert jsonpatch.apply_patch(mutated, patch) == again
    # Had it mutated the sidecar too, there is nothing left to copy.
    both = copy.deepcopy(mutated)
    sidecar = sidecar_of(both["spec"])
    sidecar["env"] += copy.deepcopy(IRSA_ENV)
    sidecar["volumeMounts"].append(IRSA_MOUNT)
    out, outcome = inject(both, CONFIG)
    assert outcome.result == "unchanged" and out == both


def test_every_pod_template_of_a_workload() -> None:
    template = {"metadata": {"labels": {INJECT_LABEL: "true"}},
                "spec": {"serviceAccountName": "trainer", "restartPolicy": "OnFailure",
                         "containers": [{"name": "pytorch", "image": "trainer:1", "env": copy.deepcopy(IRSA_ENV), "volumeMounts": [IRSA_MOUNT]}],
                         "volumes": [IRSA_VOLUME]}}
    job = {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": "j", "namespace": "ml"},
           "spec": {"pytorchReplicaSpecs": {"Master": {"replicas": 1, "template": copy.deepcopy(template)},
                                            "Worker": {"replicas": 3, "template": copy.deepcopy(template)}}}}
    out = injected(job)
    for pod_template in pod_templates(out):
        sidecar = sidecar_of(pod_template["spec"])
        assert cred_env(sidecar) == IRSA_ENV and extra_mounts(sidecar) == [IRSA_MOUNT]


# ----------------------------------------------------------------------------- properties

_volumes = ["v1", "v2", "v3"]
_paths = [IRSA_TOKEN_DIR, POD_IDENTITY_TOKEN_DIR, "/etc/aws", "/home/u/.aws", "/data", "/etc/aws/deep"]
_values = st.sampled_from(["x", f"{IRSA_TOKEN_DIR}/token", "/etc/aws/credentials", "/etc/aws/deep/config", "rel/path"])
_env_entry = st.builds(
    lambda name, value, secret: {"name": name, **({"valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}} if secret else {"value": value})},
    st.sampled_from([*AWS_CREDENTIAL_ENV, "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "APP"]), _values, st.booleans(),
)
_env_from = st.sampled_from([{"secretRef": {"name": "a"}}, {"secretRef": {"name": "b"}, "prefix": "P_"}, {"configMapRef": {"name": "c"}}])


@st.composite
def _credential_pods(draw: st.DrawFn) -> dict[str, Any]:
    containers = []
    for index in range(draw(st.integers(1, 3))):
        container: dict[str, Any] = {"name": f"c{index}", "image": "img:1"}
        if env := draw(st.lists(_env_entry, max_size=5, unique_by=lambda e: e["name"])):
            container["env"] = env
        if env_from := draw(st.lists(_env_from, max_size=2, unique_by=json.dumps)):
            container["envFrom"] = env_from
        if mounts := draw(st.lists(st.sampled_from(_paths), max_size=3, unique=True)):
            container["volumeMounts"] = [{"name": draw(st.sampled_from(_volumes)), "mountPath": p, **draw(st.sampled_from([{}, {"readOnly": False}, {"subPath": "s"}]))} for p in mounts]
        containers.append(container)
    obj = pod(containers, [{"name": v, "emptyDir": {}} for v in _volumes])
    if draw(st.booleans()):  # a sidecar already there, with a name and a path of its own
        obj["spec"]["initContainers"] = [{"name": SIDECAR_NAME, "image": CONFIG.image, "restartPolicy": "Always",
                                          "env": [{"name": "AWS_REGION", "value": "mine"}],
                                          "volumeMounts": [{"name": "v1", "mountPath": IRSA_TOKEN_DIR, "readOnly": True}]}]
    return obj


def _has_credentials(container: dict[str, Any]) -> bool:
    return (any(e["name"] in AWS_CREDENTIAL_ENV for e in container.get("env", []))
            or any("secretRef" in e for e in container.get("envFrom", []))
            or any(m["mountPath"] in AWS_TOKEN_DIRS or m["mountPath"].endswith("/.aws") for m in container.get("volumeMounts", [])))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(obj=_credential_pods(), config=st.sampled_from([CONFIG, FALLBACK, MINIO]))
def test_credential_properties(obj: dict[str, Any], config: InjectConfig) -> None:
    original = copy.deepcopy(obj)
    out, outcome = inject(obj, config)
    assert obj == original and outcome.result == "injected"
    check_pod_semantics(out["spec"])
    validate_k8s(out, "1.30")
    sidecar = sidecar_of(out["spec"])
    before = next((c for c in original["spec"].get("initContainers", []) if c["name"] == SIDECAR_NAME), None)
    own = before["env"] if before else [{"name": k, "value": v} for k, v in config.env]
    source = next((c for c in original["spec"]["containers"] if _has_credentials(c)), None)
    # What the sidecar had, then the source's credential entries it lacked, as they were.
    expected = own + [e for e in (source or {}).get("env", []) if e["name"] in AWS_CREDENTIAL_ENV and e["name"] not in {o["name"] for o in own}]
    names = env_names(sidecar)
    assert sidecar.get("env", [])[: len(expected)] == expected
    # Beyond those, only the two file variables pointing into a ~/.aws directory.
    assert set(names[len(expected):]) <= {"AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE"}
    assert not [n for n in names if n.startswith("AWS_ENDPOINT_URL") and n not in dict(config.env)]
    assert sidecar.get("envFrom", []) == [e for e in (source or {}).get("envFrom", []) if "secretRef" in e]
    ours = {"shardcache-socket", "shardcache-pod-cache", "shardcache-pod-socket"}
    for mount in sidecar.get("volumeMounts", []):
        if mount["name"] not in ours and not (before and mount in before["volumeMounts"]):
            assert source is not None and mount["readOnly"] is True
            assert any(m["mountPath"] == mount["mountPath"] and m["name"] == mount["name"] for m in source["volumeMounts"])
    again = inject(out, config)
    assert again[0] == out and again[1].result == "unchanged"
    assert jsonpatch.apply_patch(original, json_patch(original, out)) == out


# ----------------------------------------------------------------------------- the real webhook and command


def test_webhook_and_command_give_the_sidecar_the_same_credentials(webhook: WebhookProcess) -> None:
    for shape in SHAPES.values():
        obj = shape()
        status, body = webhook.review(admission_review(obj))
        assert status == 200 and body["response"]["allowed"] is True
        patch = json.loads(base64.b64decode(body["response"]["patch"]))
        assert all(op["op"] == "add" for op in patch), patch
        patched = apply_patch(obj, body["response"])
        assert patched == inject(obj, CONFIG)[0]
        assert sidecar_of(patched["spec"]).get("env") or sidecar_of(patched["spec"]).get("envFrom")
        # A second call (reinvocation) answers no patch.
        status, body = webhook.review(admission_review(patched, uid="uid-2"))
        assert status == 200 and body["response"]["allowed"] is True and "patch" not in body["response"]
        proc = run_inject("-f", "-", "--labelled-only", "--sidecar-image", "registry.example.com/shardcache:test", stdin=dump_documents([obj]))
        assert proc.returncode == 0, proc.stderr
        (offline,) = docs(proc.stdout)
        assert offline == patched
        kubectl_parse(proc.stdout)


# ----------------------------------------------------------------------------- real boto3 in each container's view

# Resolves credentials with boto3's default chain, as the sidecar does, and prints what it found.
_CHECK = """
import json, boto3
credentials = boto3.Session().get_credentials()
frozen = credentials.get_frozen_credentials() if credentials is not None else None
print(json.dumps(None if frozen is None else {"key": frozen.access_key, "method": credentials.method}))
"""

# Runs in a private mount namespace: a fresh tmpfs over /run (so nothing lands on the host), the
# container's volume mounts bound under it (read-only where asked), then _CHECK with its env.
_VIEW = """
import json, os, subprocess, sys
plan = json.load(open(sys.argv[1]))
def mount(*args):
    subprocess.run(["mount", *args], check=True, capture_output=True, timeout=10)
mount("-t", "tmpfs", "tmpfs", "/run")
for m in sorted(plan["mounts"], key=lambda m: m["target"].count("/")):
    if os.path.isdir(m["source"]):
        os.makedirs(m["target"], exist_ok=True)
    else:
        os.makedirs(os.path.dirname(m["target"]), exist_ok=True)
        open(m["target"], "a").close()
    mount("--bind", m["source"], m["target"])
    if m["readOnly"]:
        mount("-o", "remount,bind,ro", m["target"])
os.makedirs(plan["env"]["HOME"], exist_ok=True)
proc = subprocess.run([sys.executable, "-c", plan["check"]], env=plan["env"], capture_output=True, text=True, timeout=60)
sys.stdout.write(proc.stdout)
sys.stderr.write(proc.stderr)
sys.exit(proc.returncode)
"""


def container_env(container: dict[str, Any], secrets: dict[str, dict[str, str]]) -> dict[str, str]:
    """The environment the kubelet gives ``container``: envFrom first, env over it (Secrets only;
    ConfigMaps the tests give are absent, as an optional reference would be)."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        if "secretRef" in source:
            data = secrets.get(source["secretRef"]["name"])
            assert data is not None or source["secretRef"].get("optional"), source
            env.update({source.get("prefix", "") + k: v for k, v in (data or {}).items()})
    for entry in container.get("env", []):
        if "value" in entry:
            assert "$(" not in entry["value"], "no dependent variables in these pods"
            env[entry["name"]] = entry["value"]
        elif ref := entry.get("valueFrom", {}).get("secretKeyRef"):
            if ref["name"] not in secrets and ref.get("optional"):
                continue  # the kubelet leaves the variable unset (the master token of a namespace without it)
            env[entry["name"]] = secrets[ref["name"]][ref["key"]]
    return env


def resolve_in_view(container: dict[str, Any], spec: dict[str, Any], volumes: dict[str, Path], secrets: dict[str, dict[str, str]],
                    home: str, node_env: dict[str, str], tmp: Path) -> Any:
    """Run _CHECK with the container's env and mounts; ``volumes`` holds each volume's contents."""
    declared = {v["name"] for v in spec.get("volumes", [])}
    mounts = []
    for mount in container.get("volumeMounts", []):
        if mount["name"].startswith("shardcache-"):
            continue  # the socket and the caches: nothing to do with credentials
        assert mount["name"] in declared and mount["name"] in volumes, mount
        target = os.path.realpath(mount["mountPath"].rstrip("/") or "/")
        assert target.startswith("/run/"), f"{target}: the tests mount only under /run, which the view replaces"
        source = volumes[mount["name"]] / mount.get("subPath", "")
        mounts.append({"source": str(source), "target": target, "readOnly": bool(mount.get("readOnly"))})
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": home, **node_env, **container_env(container, secrets)}
    plan = tmp / f"plan-{container['name']}-{len(list(tmp.iterdir()))}.json"
    plan.write_text(json.dumps({"mounts": mounts, "env": env, "check": _CHECK}))
    proc = subprocess.run(["unshare", "--mount", "--propagation", "private", sys.executable, "-c", _VIEW, str(plan)],
                          capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def _key_for(*parts: str) -> str:
    return "ASIA" + hashlib.sha256("|".join(parts).encode()).hexdigest()[:16].upper()


class _CredentialServer(http.server.BaseHTTPRequestHandler):
    """STS (AssumeRoleWithWebIdentity) and the EKS Pod Identity agent, answering keys derived from
    the token they were shown, so the same key from two views means the same token was read."""

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        form = urllib.parse.parse_qs(self.rfile.read(int(self.headers["Content-Length"])).decode())
        assert form["Action"] == ["AssumeRoleWithWebIdentity"], form
        key = _key_for(form["WebIdentityToken"][0], form["RoleArn"][0])
        body = (
            '<AssumeRoleWithWebIdentityResponse xmlns="https://sts.amazonaws.com/doc/2011-06-15/"><AssumeRoleWithWebIdentityResult>'
            f"<Credentials><AccessKeyId>{key}</AccessKeyId><SecretAccessKey>s</SecretAccessKey><SessionToken>t</SessionToken>"
            "<Expiration>2099-01-01T00:00:00Z</Expiration></Credentials>"
            "<AssumedRoleUser><Arn>arn:aws:sts::111122223333:assumed-role/trainer/s</Arn><AssumedRoleId>AROA:s</AssumedRoleId></AssumedRoleUser>"
            "</AssumeRoleWithWebIdentityResult><ResponseMetadata><RequestId>r</RequestId></ResponseMetadata></AssumeRoleWithWebIdentityResponse>"
        ).encode()
        self._answer(body, "text/xml")

    def do_GET(self) -> None:  # noqa: N802
        token = self.headers.get("Authorization") or ""
        body = json.dumps({"AccessKeyId": _key_for(token), "SecretAccessKey": "s", "Token": "t",
                           "Expiration": "2099-01-01T00:00:00Z"}).encode()
        self._answer(body, "application/json")

    def _answer(self, body: bytes, content_type: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def credential_server() -> Iterator[str]:
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        pytest.skip("needs unshare and mount to build each container's view")
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "mount", "-t", "tmpfs", "tmpfs", "/run"],
                           capture_output=True, text=True, timeout=10)
    if probe.returncode != 0:
        pytest.skip(f"a private mount namespace is not permitted here (needs root or CAP_SYS_ADMIN): {probe.stderr.strip()}")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _CredentialServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


Scenario = tuple[dict[str, Any], dict[str, dict[str, str]], dict[str, dict[str, str]], str]


def _credential_scenarios(agent: str) -> dict[str, Scenario]:
    """name -> (pod, volume name -> {file: contents}, Secrets, the method boto3 should report).
    Paths are under /run/... (here /var/run is /run) so the view can replace them."""
    irsa = irsa_pod()
    identity = pod_identity_pod()
    identity["spec"]["containers"][0]["env"][0]["value"] = f"{agent}/v1/credentials"
    files = pod([trainer(
        env=[{"name": "AWS_SHARED_CREDENTIALS_FILE", "value": "/run/secrets/aws/credentials"}, {"name": "AWS_PROFILE", "value": "team-a"}],
        volumeMounts=[{"name": "aws-creds", "mountPath": "/run/secrets/aws", "readOnly": True}])],
        [{"name": "aws-creds", "secret": {"secretName": "team-a-aws"}}])
    home = pod([trainer(volumeMounts=[{"name": "aws-home", "mountPath": "/run/home/trainer/.aws", "readOnly": True}])],
               [{"name": "aws-home", "secret": {"secretName": "team-a-aws"}}])
    profiles = "[default]\naws_access_key_id = AKIADEFAULT\naws_secret_access_key = d\n[team-a]\naws_access_key_id = AKIATEAMA\naws_secret_access_key = a\n"
    keys = {"team-a-keys": {"id": "AKIASECRETREF", "secret": "s"},
            "team-a-session": {"AWS_SESSION_TOKEN": "session"}, "minio": {"ACCESS": "x"}}
    return {
        "irsa": (irsa, {"aws-iam-token": {"token": "jwt-of-trainer"}}, {}, "assume-role-with-web-identity"),
        "pod-identity": (identity, {"eks-pod-identity-token": {"eks-pod-identity-token": "pod-identity-jwt"}}, {}, "container-role"),
        "secret-keys": (secret_pod(), {}, keys, "env"),
        "credentials-file": (files, {"aws-creds": {"credentials": profiles}}, {}, "shared-credentials-file"),
        "home-aws": (home, {"aws-home": {"credentials": profiles}}, {}, "shared-credentials-file"),
    }


@pytest.mark.timeout(240)
@pytest.mark.parametrize("scenario", ["irsa", "pod-identity", "secret-keys", "credentials-file", "home-aws"])
@pytest.mark.slow
def test_boto3_in_the_sidecar_finds_the_apps_credentials(
    scenario: str, credential_server: str, webhook: WebhookProcess, tmp_path: Path
) -> None:
    obj, contents, secrets, method = _credential_scenarios(credential_server)[scenario]
    volumes: dict[str, Path] = {}
    for name, files in contents.items():
        volumes[name] = tmp_path / "volumes" / name
        volumes[name].mkdir(parents=True)
        for file, text in files.items():
            (volumes[name] / file).write_text(text)
    status, body = webhook.review(admission_review(obj))
    assert status == 200
    spec = apply_patch(obj, body["response"])["spec"]
    # What the node gives every container: no instance metadata, and STS at the local one.
    node_env = {"AWS_EC2_METADATA_DISABLED": "true", "AWS_ENDPOINT_URL_STS": credential_server}
    views = tmp_path / "views"
    views.mkdir()
    (app,) = [c for c in spec["containers"] if c["name"] == "train"]
    seen_by_app = resolve_in_view(app, spec, volumes, secrets, "/run/home/trainer", node_env, views)
    seen_by_sidecar = resolve_in_view(sidecar_of(spec), spec, volumes, secrets, "/run/home/sidecar", node_env, views)
    assert seen_by_app is not None and seen_by_app["method"] == method
    assert seen_by_sidecar == seen_by_app
    if scenario == "secret-keys":
        assert seen_by_app["key"] == "AKIASECRETREF"
    if scenario == "credentials-file":
        assert seen_by_app["key"] == "AKIATEAMA"  # AWS_PROFILE came along
    if scenario == "home-aws":
        assert seen_by_app["key"] == "AKIADEFAULT"
    # The control: the sidecar as injected before this change (its own env and mounts only) finds nothing.
    bare = sidecar_of(inject(pod([trainer()]), CONFIG)[0]["spec"])
    assert resolve_in_view(bare, spec, volumes, secrets, "/run/home/sidecar", node_env, views) is None
