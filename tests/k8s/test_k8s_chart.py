"""The Helm chart, linted and rendered with Helm's own engine (helm-python-sdk, no cluster) for
the defaults and each documented option, and the rendered objects checked."""

from __future__ import annotations

import argparse
import base64
import copy
import json
import re
from typing import Any

import pytest
import yaml

from sidecar.k8s.inject import INJECT_LABEL, SIDECAR_NAME
from tests.support.k8s import (
    CHART,
    OPTIONS,
    Renderer,
    WebhookProcess,
    admission_review,
    apply_patch,
    default_cell,
    documented_values,
    find,
    kubectl_parse,
    start_webhook,
    subcommands,
    validate_k8s,
)

NS = "shardcache"
BUILTIN_KINDS = {
    "DaemonSet", "Deployment", "Service", "ServiceAccount", "Secret", "PersistentVolumeClaim",
    "PodDisruptionBudget", "MutatingWebhookConfiguration", "PriorityClass", "NetworkPolicy",
}
RBAC_KINDS = {"Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding"}

@pytest.fixture(scope="module")
def rendered(renderer: Renderer) -> dict[str, list[dict[str, Any]]]:
    return {name: renderer.objects(values) for name, values in OPTIONS.items()}


def pod_specs(objects: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    return [(o, o["spec"]["template"]) for o in objects if o["kind"] in ("DaemonSet", "Deployment")]


def container(obj: dict[str, Any]) -> dict[str, Any]:
    (only,) = obj["spec"]["template"]["spec"]["containers"]
    return only


def arg_after(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


# ----------------------------------------------------------------------------- lint and generic checks


@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.slow
def test_lint_is_clean(renderer: Renderer, option: str) -> None:
    report = renderer.helm.lint(str(CHART), copy.deepcopy(OPTIONS[option]), strict=True, namespace=NS, kube_version="v1.30.0")
    assert report["errors"] == [] and report["messages"] == [], report


def without_newer_fields(obj: dict[str, Any]) -> dict[str, Any]:
    """The object as the chart renders it for a cluster older than 1.30: webhook matchConditions
    are rendered only from 1.30 (semverCompare on .Capabilities.KubeVersion)."""
    obj = copy.deepcopy(obj)
    for hook in obj.get("webhooks", []) if obj["kind"] == "MutatingWebhookConfiguration" else []:
        hook.pop("matchConditions", None)
    return obj


@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.slow
def test_objects_are_valid_and_labelled(rendered: dict[str, list[dict[str, Any]]], option: str) -> None:
    objects = rendered[option]
    assert objects
    names = [(o["kind"], o["metadata"]["name"]) for o in objects]
    assert len(names) == len(set(names)), f"duplicate objects {names}"
    for obj in objects:
        labels = obj["metadata"]["labels"]
        for key in ("app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/version",
                    "app.kubernetes.io/managed-by", "app.kubernetes.io/component", "app.kubernetes.io/part-of", "helm.sh/chart"):
            assert key in labels, f"{obj['kind']}/{obj['metadata']['name']} lacks {key}"
        assert labels["app.kubernetes.io/instance"] == "sc"
        assert len(obj["metadata"]["name"]) <= 63
        if obj["kind"] in BUILTIN_KINDS:
            for version in ("1.25", "1.30"):
                validate_k8s(without_newer_fields(obj) if version == "1.25" else obj, version)
        if obj["kind"] not in ("MutatingWebhookConfiguration", "PriorityClass", "ValidatingAdmissionPolicy",
                               "ValidatingAdmissionPolicyBinding"):  # cluster-scoped
            assert obj["metadata"]["namespace"] == NS
    for workload, template in pod_specs(objects):
        selector = workload["spec"]["selector"]["matchLabels"]
        assert selector.items() <= template["metadata"]["labels"].items()
        spec = template["spec"]
        # Least privilege: no component gets an API token.
        assert spec["automountServiceAccountToken"] is False
        sa = spec["serviceAccountName"]
        assert ("ServiceAccount", sa) in names
        assert find(objects, "ServiceAccount", sa)["automountServiceAccountToken"] is False
        for c in spec["containers"]:
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
            assert "resources" in c and c["resources"]["limits"]["memory"]
            assert {"livenessProbe", "readinessProbe"} <= c.keys()
            mounted = {m["name"] for m in c.get("volumeMounts", [])}
            assert mounted <= {v["name"] for v in spec.get("volumes", [])}
    for svc in (o for o in objects if o["kind"] == "Service"):
        pods = [t for w, t in pod_specs(objects) if svc["spec"]["selector"].items() <= t["metadata"]["labels"].items()]
        assert len(pods) == 1, f"service {svc['metadata']['name']} selects {len(pods)} workloads"
        port_names = {p["name"] for c in pods[0]["spec"]["containers"] for p in c.get("ports", [])}
        assert all(p["targetPort"] in port_names for p in svc["spec"]["ports"])
    for pdb in (o for o in objects if o["kind"] == "PodDisruptionBudget"):
        owner = [w for w, t in pod_specs(objects) if pdb["spec"]["selector"]["matchLabels"].items() <= t["metadata"]["labels"].items()]
        assert len(owner) == 1 and owner[0]["spec"]["replicas"] > 1


@pytest.mark.parametrize("option", OPTIONS)
def test_rbac_grants_nothing(rendered: dict[str, list[dict[str, Any]]], option: str) -> None:
    # No component calls the Kubernetes API, so least privilege is no permission at all.
    kinds = {o["kind"] for o in rendered[option]}
    assert not kinds & RBAC_KINDS


def test_kubectl_reads_the_rendered_chart(renderer: Renderer) -> None:
    files = renderer.files({})
    text = "\n---\n".join(v for k, v in sorted(files.items()) if k.endswith(".yaml") and v.strip())
    parsed = kubectl_parse(text)
    assert {o["kind"] for o in parsed} >= {"DaemonSet", "Deployment", "MutatingWebhookConfiguration", "Secret"}


# ----------------------------------------------------------------------------- node daemon


def test_daemonset_contract_mounts_and_probes(rendered: dict[str, list[dict[str, Any]]]) -> None:
    objects = rendered["defaults"]
    ds = find(objects, "DaemonSet", "-node")
    c = container(ds)
    assert c["image"] == "ghcr.io/shardcache/shardcache:0.1.0"
    assert c["command"] == ["shardcache"]
    assert c["args"] == [
        "--log-level", "INFO", "serve", "--mode", "node",
        "--listen", "unix:///run/shardcache/daemon.sock", "--socket-group", "8600", "--listen", "tcp://0.0.0.0:8600",
        # node.cluster.enabled (tests/k8s/test_k8s_cluster.py)
        "--peers-dns", "sc-shardcache-node.shardcache.svc.cluster.local", "--advertise-url", "http://$(POD_IP):8600",
        "--peer-secret-file", "/etc/shardcache/peer-secret/secret",
        "--handles", "unix:///run/shardcache/handles.sock",
        "--cache-dir", "/var/cache/shardcache", "--cache-dir-read-only", "/var/cache/shardcache-ro",
        "--cache-size", "200GiB", "--min-free", "10%", "--eviction", "lru", "--origin", "s3",
        "--auth", "sigv4", "--auth-identity", "sts", "--auth-cache-ttl", "120",
    ]
    spec = ds["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    assert volumes[mounts["/run/shardcache"]]["hostPath"] == {"path": "/run/shardcache", "type": "DirectoryOrCreate"}
    assert volumes[mounts["/var/cache/shardcache"]]["hostPath"] == {"path": "/var/cache/shardcache", "type": "DirectoryOrCreate"}
    # The same volume again, read-only: the handed-out descriptors are opened through it (a root
    # pod cannot reopen one for writing through /proc/self/fd; tests/daemon/test_handles_readonly.py).
    assert {"name": "cache", "mountPath": "/var/cache/shardcache-ro", "readOnly": True} in c["volumeMounts"]
    assert not any(m.get("readOnly") for m in c["volumeMounts"] if m["mountPath"] == "/var/cache/shardcache")
    assert c["securityContext"]["readOnlyRootFilesystem"] is True and "/tmp" in mounts
    assert c["ports"] == [{"name": "http", "containerPort": 8600, "protocol": "TCP"}]
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert c["startupProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert c["startupProbe"]["failureThreshold"] * c["startupProbe"]["periodSeconds"] >= 300
    annotations = ds["spec"]["template"]["metadata"]["annotations"]
    assert annotations == {"prometheus.io/scrape": "true", "prometheus.io/port": "8600", "prometheus.io/path": "/metrics"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    svc = find(objects, "Service", "-node")
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["ports"][0]["port"] == 8600
    # The daemon listens on its pod IP, through no host network or port (restricted-mode sidecars
    # reach it through the node-local Service, tests/k8s/test_k8s_restricted.py).
    assert "hostNetwork" not in spec and all("hostPort" not in p for p in c["ports"])


def test_daemonset_args_parse_with_the_real_serve_command(rendered: dict[str, list[dict[str, Any]]]) -> None:
    from sidecar.cli import build_parser

    parser = build_parser()
    if "serve" not in subcommands(parser):
        pytest.skip("sidecar.cli.commands.serve is not in this tree yet")
    serve = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    cluster = {"--peers-dns", "--advertise-url", "--peer-secret-file"}  # node.cluster.enabled, the default
    if not cluster <= serve._option_string_actions.keys():
        pytest.skip(f"shardcache serve lacks {sorted(cluster - serve._option_string_actions.keys())} (issue 17, being built)")
    for option in ("defaults", "gpu-nodes", "file-origin"):
        args = parser.parse_args(container(find(rendered[option], "DaemonSet", "-node"))["args"])
        assert args.command == "serve" and args.mode == "node"


def test_gpu_node_options(rendered: dict[str, list[dict[str, Any]]]) -> None:
    ds = find(rendered["gpu-nodes"], "DaemonSet", "-node")
    spec = ds["spec"]["template"]["spec"]
    c = container(ds)
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert spec["tolerations"] == OPTIONS["gpu-nodes"]["node"]["tolerations"]
    assert spec["priorityClassName"] == "gpu-infra"
    assert (arg_after(c["args"], "--cache-size"), arg_after(c["args"], "--min-free"), arg_after(c["args"], "--eviction")) == ("1.5TiB", "5%", "hold")
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["cache"]["hostPath"]["path"] == "/mnt/nvme0/shardcache"
    assert volumes["socket"]["hostPath"]["path"] == "/var/run/shardcache"
    # The webhook injects the same socket directory into pods, and never the cache directory.
    hook_args = container(find(rendered["gpu-nodes"], "Deployment", "-webhook"))["args"]
    assert arg_after(hook_args, "--socket-host-dir") == "/var/run/shardcache"
    assert "/mnt/nvme0/shardcache" not in hook_args


def test_ephemeral_cache_keeps_short_circuit_by_handle(rendered: dict[str, list[dict[str, Any]]]) -> None:
    ds = find(rendered["ephemeral-cache"], "DaemonSet", "-node")
    volume = {v["name"]: v for v in ds["spec"]["template"]["spec"]["volumes"]}["cache"]
    claim = volume["ephemeral"]["volumeClaimTemplate"]["spec"]
    assert claim["storageClassName"] == "local-path" and claim["resources"]["requests"]["storage"] == "800Gi"
    # File handles do not need the pods to see the cache directory, wherever it lives.
    assert "--short-circuit" in container(find(rendered["ephemeral-cache"], "Deployment", "-webhook"))["args"]
    assert arg_after(container(ds)["args"], "--handles") == "unix:///run/shardcache/handles.sock"
    # The ephemeral volume is mounted read-only a second time too, for the descriptors.
    assert arg_after(container(ds)["args"], "--cache-dir-read-only") == "/var/cache/shardcache-ro"
    assert {"name": "cache", "mountPath": "/var/cache/shardcache-ro", "readOnly": True} in container(ds)["volumeMounts"]
    # Turned off in the chart: neither the daemon nor the sidecars serve handles (and no view).
    assert "--no-short-circuit" in container(find(rendered["sidecar"], "Deployment", "-webhook"))["args"]
    plain = container(find(rendered["sidecar"], "DaemonSet", "-node"))
    assert "--handles" not in plain["args"] and "--cache-dir-read-only" not in plain["args"]
    assert [m["mountPath"] for m in plain["volumeMounts"] if m["name"] == "cache"] == ["/var/cache/shardcache"]


def test_s3_endpoint_and_credentials(rendered: dict[str, list[dict[str, Any]]]) -> None:
    objects = rendered["s3-credentials"]
    env = {e["name"]: e for e in container(find(objects, "DaemonSet", "-node"))["env"]}
    assert env["AWS_ENDPOINT_URL"]["value"] == "http://minio.storage:9000"
    assert env["AWS_REGION"]["value"] == "us-east-1"
    assert env["AWS_ACCESS_KEY_ID"]["valueFrom"]["secretKeyRef"] == {"name": "minio-creds", "key": "user"}
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "minio-creds", "key": "password"}
    sa = find(objects, "ServiceAccount", "-node")
    assert sa["metadata"]["annotations"] == {"eks.amazonaws.com/role-arn": "arn:aws:iam::1:role/x"}
    defaults = {e["name"] for e in container(find(rendered["defaults"], "DaemonSet", "-node"))["env"]}
    assert not defaults & {"AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID"}
    # Sidecars on nodes without a daemon read the same object store.
    from sidecar.cli import build_parser
    from sidecar.cli.commands.webhook import settings_from_args

    args = container(find(objects, "Deployment", "-webhook"))["args"]
    settings = settings_from_args(build_parser().parse_args(args))
    assert settings.inject.env == (("AWS_ENDPOINT_URL", "http://minio.storage:9000"), ("AWS_REGION", "us-east-1"))
    assert "--sidecar-env" not in container(find(rendered["defaults"], "Deployment", "-webhook"))["args"]


def test_file_origin(rendered: dict[str, list[dict[str, Any]]]) -> None:
    ds = find(rendered["file-origin"], "DaemonSet", "-node")
    c = container(ds)
    root = arg_after(c["args"], "--origin")
    assert root.startswith("file:///")
    mount = next(m for m in c["volumeMounts"] if m["name"] == "origin")
    assert root == "file://" + mount["mountPath"] and mount["readOnly"] is True
    volume = {v["name"]: v for v in ds["spec"]["template"]["spec"]["volumes"]}["origin"]
    assert volume["hostPath"] == {"path": "/mnt/datasets", "type": "Directory"}


def test_priority_class(rendered: dict[str, list[dict[str, Any]]]) -> None:
    pc = find(rendered["priority-class"], "PriorityClass")
    assert pc["value"] == 2000000 and pc["globalDefault"] is False
    ds = find(rendered["priority-class"], "DaemonSet", "-node")
    assert ds["spec"]["template"]["spec"]["priorityClassName"] == pc["metadata"]["name"]


# ----------------------------------------------------------------------------- master


def test_master_sqlite_default(rendered: dict[str, list[dict[str, Any]]]) -> None:
    objects = rendered["defaults"]
    deployment = find(objects, "Deployment", "-master")
    c = container(deployment)
    assert c["args"] == ["--log-level", "INFO", "master", "--listen", "tcp://0.0.0.0:8700", "--state", "sqlite:///var/lib/shardcache/master.db",
                         "--cluster", "http://sc-shardcache-node.shardcache.svc.cluster.local:8600",
                         "--token-file", "/etc/shardcache/master-token/token"]
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"] == {"type": "Recreate"}
    pvc = find(objects, "PersistentVolumeClaim", "-master")
    volume = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}["state"]
    assert volume["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
    assert {"name": "state", "mountPath": "/var/lib/shardcache"} in c["volumeMounts"]
    assert pvc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz" and c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    svc = find(objects, "Service", "-master")
    assert svc["spec"]["ports"][0]["port"] == 8700
    # A single SQLite master gets no PodDisruptionBudget (it could only block drains).
    assert not [o for o in objects if o["kind"] == "PodDisruptionBudget" and o["metadata"]["name"].endswith("-master")]


def test_master_etcd_ha(rendered: dict[str, list[dict[str, Any]]]) -> None:
    objects = rendered["etcd-ha"]
    deployment = find(objects, "Deployment", "-master")
    c = container(deployment)
    assert arg_after(c["args"], "--state") == "etcd://etcd-0.etcd:2379,etcd-1.etcd:2379/sc"
    assert arg_after(c["args"], "--advertise-url") == "http://$(POD_IP):8700"
    assert {e["name"] for e in c["env"]} == {"POD_IP"}
    assert deployment["spec"]["replicas"] == 3 and "strategy" not in deployment["spec"]
    assert not [o for o in objects if o["kind"] == "PersistentVolumeClaim"]
    assert find(objects, "PodDisruptionBudget", "-master")["spec"]["maxUnavailable"] == 1
    # Standbys must count as ready or a rolling update never completes.
    assert c["readinessProbe"]["httpGet"]["path"] == "/healthz"


def test_master_args_parse_with_the_real_master_command(rendered: dict[str, list[dict[str, Any]]]) -> None:
    from sidecar.cli import build_parser

    parser = build_parser()
    if "master" not in subcommands(parser):
        pytest.skip("sidecar.cli.commands.master is not in this tree yet")
    master = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["master"]
    # `--token-file` is being added to `shardcache master` alongside the chart: until it is, check the rest.
    has_token_file = "--token-file" in master._option_string_actions
    for option in ("defaults", "etcd-ha", "open"):
        argv = container(find(rendered[option], "Deployment", "-master"))["args"]
        if not has_token_file and "--token-file" in argv:
            at = argv.index("--token-file")
            argv = argv[:at] + argv[at + 2:]
        args = parser.parse_args(argv)
        assert args.command == "master"
        if has_token_file and option != "open":
            assert args.token_file == "/etc/shardcache/master-token/token"


def test_master_persistence_options(rendered: dict[str, list[dict[str, Any]]]) -> None:
    volumes = {v["name"]: v for v in find(rendered["master-no-persistence"], "Deployment", "-master")["spec"]["template"]["spec"]["volumes"]}
    assert volumes["state"] == {"name": "state", "emptyDir": {}}
    existing = rendered["master-existing-claim"]
    assert not [o for o in existing if o["kind"] == "PersistentVolumeClaim"]
    volumes = {v["name"]: v for v in find(existing, "Deployment", "-master")["spec"]["template"]["spec"]["volumes"]}
    assert volumes["state"]["persistentVolumeClaim"]["claimName"] == "my-claim"


# ----------------------------------------------------------------------------- webhook


def _webhook_parts(objects: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    return (
        find(objects, "MutatingWebhookConfiguration"),
        find(objects, "Service", "-webhook"),
        find(objects, "Deployment", "-webhook"),
    )


def test_webhook_configuration_defaults(rendered: dict[str, list[dict[str, Any]]]) -> None:
    mwc, svc, deployment = _webhook_parts(rendered["defaults"])
    # One entry per injection mode, told apart by the namespace label (tests/k8s/test_k8s_restricted.py),
    # and one for namespaces that enforce Pod Security baseline or restricted.
    hostpath, restricted, pod_security = mwc["webhooks"]
    assert (hostpath["name"], restricted["name"], pod_security["name"]) == (
        "pods.inject.shardcache.io", "restricted-pods.inject.shardcache.io", "pod-security-pods.inject.shardcache.io")
    assert pod_security["clientConfig"]["service"]["path"] == "/mutate/pod-security"
    for hook in (hostpath, restricted, pod_security):
        assert hook["admissionReviewVersions"] == ["v1"] and hook["sideEffects"] == "None"
        assert hook["failurePolicy"] == "Ignore" and hook["timeoutSeconds"] == 5
        assert hook["reinvocationPolicy"] == "IfNeeded"
        assert hook["objectSelector"] == {"matchLabels": {INJECT_LABEL: "true"}}
        excluded = hook["namespaceSelector"]["matchExpressions"][0]
        assert excluded["operator"] == "NotIn" and set(excluded["values"]) == {"kube-system", NS}
        assert hook["rules"] == [
            {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["pods"], "scope": "Namespaced"},
            {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["UPDATE"], "resources": ["pods/ephemeralcontainers"], "scope": "Namespaced"},
        ]
        assert "matchConditions" not in hook
    args = container(deployment)["args"]
    assert arg_after(args, "--failure-policy") == "ignore"
    # nativeSidecar auto on a 1.29+ cluster; short-circuit reads by handle (no node cache mount).
    assert "--native-sidecar" in args and "--short-circuit" in args and arg_after(args, "--mode") == "hostpath"
    assert arg_after(args, "--sidecar-image") == "ghcr.io/shardcache/shardcache:0.1.0"
    assert deployment["spec"]["replicas"] == 2
    assert find(rendered["defaults"], "PodDisruptionBudget", "-webhook")["spec"]["maxUnavailable"] == 1


def test_webhook_service_and_ca_bundle_match(rendered: dict[str, list[dict[str, Any]]]) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import padding, rsa

    objects = rendered["defaults"]
    mwc, svc, deployment = _webhook_parts(objects)
    client = mwc["webhooks"][0]["clientConfig"]
    assert client["service"] == {"name": svc["metadata"]["name"], "namespace": NS, "path": "/mutate", "port": 443}
    (port,) = svc["spec"]["ports"]
    assert port["port"] == 443
    c = container(deployment)
    assert {p["name"]: p["containerPort"] for p in c["ports"]}[port["targetPort"]] == int(arg_after(c["args"], "--listen").rsplit(":", 1)[1])
    secret = find(objects, "Secret", "-webhook-tls")
    volume = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}["tls"]
    assert volume["secret"]["secretName"] == secret["metadata"]["name"]
    mount = next(m for m in c["volumeMounts"] if m["name"] == "tls")
    assert arg_after(c["args"], "--tls-cert") == mount["mountPath"] + "/tls.crt"
    assert arg_after(c["args"], "--tls-key") == mount["mountPath"] + "/tls.key"
    ca = x509.load_pem_x509_certificate(base64.b64decode(client["caBundle"]))
    ca_key = ca.public_key()
    assert isinstance(ca_key, rsa.RSAPublicKey)  # Helm's genCA makes RSA keys
    assert base64.b64decode(secret["data"]["ca.crt"]) == base64.b64decode(client["caBundle"])
    cert = x509.load_pem_x509_certificate(base64.b64decode(secret["data"]["tls.crt"]))
    # The serving certificate is signed by the CA the API server is told to trust...
    assert cert.signature_hash_algorithm is not None
    ca_key.verify(cert.signature, cert.tbs_certificate_bytes, padding.PKCS1v15(), cert.signature_hash_algorithm)
    assert cert.issuer == ca.subject
    # ...and names the Service the API server dials.
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    assert f"{svc['metadata']['name']}.{NS}.svc" in sans


def test_rendered_certificate_and_args_serve_the_api_server(rendered: dict[str, list[dict[str, Any]]], tmp_path: Any) -> None:
    """End to end: the chart's own Secret and webhook args, run by the real `shardcache webhook`,
    verified the way the API server does (caBundle as trust, the Service DNS name)."""
    from tests.support.k8s import TLSFiles

    objects = rendered["sidecar"]
    mwc, svc, deployment = _webhook_parts(objects)
    secret = find(objects, "Secret", "-webhook-tls")
    ca_pem = base64.b64decode(mwc["webhooks"][0]["clientConfig"]["caBundle"])
    files = TLSFiles(tmp_path / "ca.crt", tmp_path / "tls.crt", tmp_path / "tls.key", ca_pem)
    files.cert.write_bytes(base64.b64decode(secret["data"]["tls.crt"]))
    files.key.write_bytes(base64.b64decode(secret["data"]["tls.key"]))
    args = container(deployment)["args"]
    webhook_args = args[args.index("webhook") + 1 :]
    # Keep every chart flag but where to listen and where the files are.
    skip = {"--listen", "--tls-cert", "--tls-key"}
    kept: list[str] = []
    it = iter(webhook_args)
    for arg in it:
        if arg in skip:
            next(it)
        else:
            kept.append(arg)
    server: WebhookProcess = start_webhook(tmp_path, files, *kept, server_hostname=f"{svc['metadata']['name']}.{NS}.svc")
    try:
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "labels": {INJECT_LABEL: "true"}},
               "spec": {"containers": [{"name": "t", "image": "t"}]}}
        status, body = server.review(admission_review(pod))
        assert status == 200
        spec = apply_patch(pod, body["response"])["spec"]
        sidecar = spec["initContainers"][0]
        assert sidecar["name"] == SIDECAR_NAME and sidecar["image"] == "mirror.local/shardcache:9.9.9"
        assert "tcp://127.0.0.1:9600" in sidecar["args"]
        assert sidecar["resources"] == {"requests": {"cpu": "250m", "memory": "512Mi"}, "limits": {"cpu": "2", "memory": "2Gi"}}
        assert {v["name"]: v for v in spec["volumes"]}["shardcache-pod-cache"]["emptyDir"]["sizeLimit"] == "40Gi"
        assert "shardcache-node-cache" not in {v["name"] for v in spec["volumes"]}
    finally:
        from tests.support.processes import stop

        stop(server.proc)


def test_self_signed_certificate_is_fresh_per_render(renderer: Renderer) -> None:
    # Without a cluster `lookup` finds nothing, so each render generates; with one, the Secret is reused.
    first = find(renderer.objects({}), "Secret", "-webhook-tls")["data"]["ca.crt"]
    second = find(renderer.objects({}), "Secret", "-webhook-tls")["data"]["ca.crt"]
    assert first != second
    template = (CHART / "templates" / "webhook-admission.yaml").read_text()
    assert 'lookup "v1" "Secret"' in template


def test_cert_manager_mode(rendered: dict[str, list[dict[str, Any]]]) -> None:
    objects = rendered["cert-manager"]
    mwc, svc, deployment = _webhook_parts(objects)
    assert not [o for o in objects if o["kind"] == "Secret" and o["metadata"]["name"].endswith("-tls")]
    assert "caBundle" not in mwc["webhooks"][0]["clientConfig"]
    serving = find(objects, "Certificate", svc["metadata"]["name"])
    assert mwc["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == f"{NS}/{serving['metadata']['name']}"
    assert f"{svc['metadata']['name']}.{NS}.svc" in serving["spec"]["dnsNames"]
    secret_name = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}["tls"]["secret"]["secretName"]
    assert serving["spec"]["secretName"] == secret_name
    # The chart bootstraps a CA: self-signed issuer -> CA certificate -> CA issuer -> serving cert.
    ca_cert = find(objects, "Certificate", "-ca")
    assert ca_cert["spec"]["isCA"] is True
    ca_issuer = find(objects, "Issuer", "-webhook-ca")
    assert ca_issuer["spec"]["ca"]["secretName"] == ca_cert["spec"]["secretName"]
    assert serving["spec"]["issuerRef"] == {"name": ca_issuer["metadata"]["name"], "kind": "Issuer", "group": "cert-manager.io"}
    corp = rendered["cert-manager-issuer"]
    assert not [o for o in corp if o["kind"] == "Issuer"]
    assert find(corp, "Certificate")["spec"]["issuerRef"] == {"name": "corp-ca", "kind": "ClusterIssuer", "group": "cert-manager.io"}


def test_existing_secret_mode(rendered: dict[str, list[dict[str, Any]]]) -> None:
    objects = rendered["tls-secret"]
    mwc, _, deployment = _webhook_parts(objects)
    assert not [o for o in objects if o["kind"] == "Secret" and o["metadata"]["name"].endswith("-tls")]
    assert mwc["webhooks"][0]["clientConfig"]["caBundle"] == OPTIONS["tls-secret"]["webhook"]["tls"]["secret"]["caBundle"]
    assert {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}["tls"]["secret"]["secretName"] == "my-tls"


def test_native_sidecar_switch_and_policies(rendered: dict[str, list[dict[str, Any]]]) -> None:
    assert "--no-native-sidecar" in container(find(rendered["old-cluster"], "Deployment", "-webhook"))["args"]
    mwc, _, deployment = _webhook_parts(rendered["fail-closed"])
    assert mwc["webhooks"][0]["failurePolicy"] == "Fail" and mwc["webhooks"][0]["timeoutSeconds"] == 10
    assert arg_after(container(deployment)["args"], "--failure-policy") == "fail"
    mwc, _, _ = _webhook_parts(rendered["namespaces"])
    assert mwc["webhooks"][0]["namespaceSelector"] == {"matchLabels": {"shardcache.io/enabled": "true"},
                                                       "matchExpressions": [{"key": "shardcache.io/mode", "operator": "NotIn", "values": ["restricted"]},
                                                                            {"key": "pod-security.kubernetes.io/enforce", "operator": "NotIn",
                                                                             "values": ["baseline", "restricted"]}]}
    assert not [o for o in rendered["single-webhook"] if o["kind"] == "PodDisruptionBudget"]


def test_workload_injection_webhook(rendered: dict[str, list[dict[str, Any]]]) -> None:
    mwc, _, _ = _webhook_parts(rendered["workloads"])
    pods, _restricted_pods, _pod_security_pods, workloads, restricted_workloads, pod_security_workloads = mwc["webhooks"]
    assert pods["name"] == "pods.inject.shardcache.io" and workloads["name"] == "workloads.inject.shardcache.io"
    assert restricted_workloads["name"] == "restricted-workloads.inject.shardcache.io"
    assert restricted_workloads["rules"] == workloads["rules"] and restricted_workloads["clientConfig"]["service"]["path"] == "/mutate/restricted"
    assert pod_security_workloads["rules"] == workloads["rules"] and pod_security_workloads["clientConfig"]["service"]["path"] == "/mutate/pod-security"
    # The storm's guard on the API server's side: nothing a controller made is sent (a Deployment's
    # ReplicaSets); the webhook skips them too (tests/k8s/test_k8s_controllers.py).
    for hook in (workloads, restricted_workloads, pod_security_workloads):
        (condition,) = hook["matchConditions"]
        assert "ownerReferences" in condition["expression"] and "controller" in condition["expression"]
    resources = {r for rule in workloads["rules"] for r in rule["resources"]}
    assert {"deployments", "statefulsets", "daemonsets", "jobs", "cronjobs", "pytorchjobs", "tfjobs"} <= resources
    assert workloads["objectSelector"] == pods["objectSelector"]


def test_webhook_args_parse_with_the_real_command(rendered: dict[str, list[dict[str, Any]]]) -> None:
    from sidecar.cli import build_parser
    from sidecar.cli.commands.webhook import settings_from_args

    for option in ("defaults", "sidecar", "old-cluster", "fail-closed", "ephemeral-cache"):
        args = build_parser().parse_args(container(find(rendered[option], "Deployment", "-webhook"))["args"])
        settings = settings_from_args(args)
        assert settings.port == 8443 and settings.inject.port in (8600, 9600)
    settings = settings_from_args(build_parser().parse_args(container(find(rendered["defaults"], "Deployment", "-webhook"))["args"]))
    assert settings.inject.cpu_limit is None and settings.inject.memory_limit == "1Gi"


# ----------------------------------------------------------------------------- metrics, images, names


def test_service_monitors(rendered: dict[str, list[dict[str, Any]]]) -> None:
    objects = rendered["service-monitor"]
    monitors = [o for o in objects if o["kind"] == "ServiceMonitor"]
    assert len(monitors) == 2
    for monitor in monitors:
        assert monitor["metadata"]["labels"]["release"] == "prom"
        svc = find(objects, "Service", monitor["metadata"]["name"][-7:] if monitor["metadata"]["name"].endswith("-master") else "-node")
        assert monitor["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
        assert monitor["spec"]["endpoints"][0]["port"] in {p["name"] for p in svc["spec"]["ports"]}
        assert monitor["spec"]["endpoints"][0]["interval"] == "15s"
    for _workload, template in pod_specs(objects):
        assert "prometheus.io/scrape" not in (template["metadata"].get("annotations") or {})


def test_image_digest_pull_secrets_and_common_labels(rendered: dict[str, list[dict[str, Any]]]) -> None:
    objects = rendered["pinned-image"]
    for workload, template in pod_specs(objects):
        assert template["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
        assert container(workload)["image"] == "mirror.local/sc@sha256:" + "a" * 64
    args = container(find(objects, "Deployment", "-webhook"))["args"]
    assert arg_after(args, "--sidecar-image") == "mirror.local/sc@sha256:" + "a" * 64
    assert all(o["metadata"]["labels"]["team"] == "ml-infra" for o in objects)


def test_names_and_disabled_components(rendered: dict[str, list[dict[str, Any]]]) -> None:
    assert {o["metadata"]["name"] for o in rendered["names"] if o["kind"] == "DaemonSet"} == {"cache-node"}
    kinds = {o["kind"] for o in rendered["only-node"]}
    assert "MutatingWebhookConfiguration" not in kinds and "Deployment" not in kinds and "DaemonSet" in kinds


def test_notes_tell_the_user_what_to_do(renderer: Renderer) -> None:
    notes = renderer.files({})["shardcache/templates/NOTES.txt"]
    assert 'shardcache.io/inject: "true"' in notes
    assert "http://sc-shardcache-master.shardcache.svc:8700" in notes
    assert "shardcache inject -f" in notes and "pod-security.kubernetes.io/enforce=privileged" in notes
    no_persist = renderer.files({"master": {"persistence": {"enabled": False}}})["shardcache/templates/NOTES.txt"]
    assert "job state is lost" in no_persist
    # How a training namespace gets the master token, and how trainers read it.
    assert "kubectl -n shardcache get secret sc-shardcache-master-token -o jsonpath='{.data.token}' | base64 -d" in notes
    assert "kubectl -n TRAINING_NS create secret generic sc-shardcache-master-token --from-file=token=/dev/stdin" in notes
    assert "reflector.v1.k8s.emberstack.com/reflection-auto-enabled" in notes
    assert "name: SHARDCACHE_MASTER_TOKEN" in notes and "secretKeyRef: {name: sc-shardcache-master-token, key: token}" in notes
    assert "networkPolicy.apiServerCIDRs (0.0.0.0/0, ::/0)" in notes
    open_notes = renderer.files(OPTIONS["open"])["shardcache/templates/NOTES.txt"]
    assert "SHARDCACHE_MASTER_TOKEN" not in open_notes and "NetworkPolicies" not in open_notes


# ----------------------------------------------------------------------------- values: schema, checks, docs


@pytest.mark.parametrize(
    "values, where",
    [
        ({"bogus": 1}, "bogus"),
        ({"webhook": {"failurePolicy": "Sometimes"}}, "/webhook/failurePolicy"),
        ({"webhook": {"timeoutSeconds": 60}}, "/webhook/timeoutSeconds"),
        ({"webhook": {"nativeSidecar": "maybe"}}, "/webhook/nativeSidecar"),
        ({"webhook": {"tls": {"mode": "vault"}}}, "/webhook/tls/mode"),
        ({"webhook": {"sidecar": {"port": 70000}}}, "/webhook/sidecar/port"),
        ({"webhook": {"sidecar": {"podCacheSize": "big"}}}, "/webhook/sidecar/podCacheSize"),
        ({"webhook": {"sidecar": {"resources": {"limits": {"memory": "lots"}}}}}, "/webhook/sidecar/resources/limits/memory"),
        ({"webhook": {"replicas": 0}}, "/webhook/replicas"),
        ({"node": {"cache": {"size": "lots"}}}, "/node/cache/size"),
        ({"node": {"cache": {"minFree": "150%"}}}, "/node/cache/minFree"),
        ({"node": {"cache": {"eviction": "fifo"}}}, "/node/cache/eviction"),
        ({"node": {"cache": {"type": "nfs"}}}, "/node/cache/type"),
        ({"node": {"cache": {"hostPath": "relative/dir"}}}, "/node/cache/hostPath"),
        ({"node": {"origin": {"type": "gcs"}}}, "/node/origin/type"),
        ({"node": {"port": "8600"}}, "/node/port"),
        ({"node": {"tolerations": {"key": "x"}}}, "/node/tolerations"),
        ({"master": {"state": {"type": "redis"}}}, "/master/state/type"),
        ({"master": {"state": {"etcd": {"endpoints": ["http://etcd:2379"]}}}}, "/master/state/etcd/endpoints"),
        ({"image": {"pullPolicy": "Sometimes"}}, "/image/pullPolicy"),
        ({"image": {"digest": "md5:abc"}}, "/image/digest"),
        ({"metrics": {"serviceMonitor": {"interval": "soon"}}}, "/metrics/serviceMonitor/interval"),
        ({"webhook": {"tls": {"certManager": {"issuerRef": {"kind": "Vault"}}}}}, "/webhook/tls/certManager/issuerRef/kind"),
        ({"webhook": {"allowedSidecarImages": ["registry.example.com/*/shardcache"]}}, "/webhook/allowedSidecarImages/0"),
        ({"webhook": {"allowedSidecarImages": "mirror.local/shardcache:1"}}, "/webhook/allowedSidecarImages"),
        ({"master": {"auth": {"existingSecret": "My_Token"}}}, "/master/auth/existingSecret"),
        ({"networkPolicy": {"apiServerCIDRs": ["10.0.0.1"]}}, "/networkPolicy/apiServerCIDRs/0"),
        ({"networkPolicy": {"enabled": "yes"}}, "/networkPolicy/enabled"),
        ({"networkPolicy": {"extraFrom": {"node": [{"ipBlock": {"cidr": "everywhere"}}]}}}, "/networkPolicy/extraFrom/node/0/ipBlock/cidr"),
        ({"networkPolicy": {"extraFrom": {"daemon": []}}}, "daemon"),
    ],
)
def test_schema_rejects_bad_values(renderer: Renderer, values: dict[str, Any], where: str) -> None:
    with pytest.raises(renderer.helm.HelmValuesError) as info:
        renderer.files(values)
    assert where in str(info.value)


@pytest.mark.parametrize(
    "values, message",
    [
        ({"master": {"replicas": 2}}, "master.replicas > 1 needs master.state.type=etcd"),
        ({"master": {"state": {"type": "etcd"}}}, "master.state.etcd.endpoints is required"),
        ({"node": {"origin": {"type": "file"}}}, "node.origin.file.hostPath is required"),
        ({"webhook": {"tls": {"mode": "secret", "secret": {"caBundle": "eA=="}}}}, "webhook.tls.secret.name is required"),
        ({"webhook": {"tls": {"mode": "secret", "secret": {"name": "x"}}}}, "webhook.tls.secret.caBundle"),
    ],
)
def test_inconsistent_values_fail_with_what_to_change(renderer: Renderer, values: dict[str, Any], message: str) -> None:
    with pytest.raises(renderer.helm.HelmError) as info:
        renderer.files(values)
    assert message in str(info.value)


def _leaf_keys(values: Any, prefix: str = "") -> list[str]:
    if isinstance(values, dict) and values:
        return [k for key, value in values.items() for k in _leaf_keys(value, f"{prefix}{key}.")]
    return [prefix.rstrip(".")]


def test_readme_lists_every_value() -> None:
    text = (CHART / "values.yaml").read_text()
    documented = documented_values(text)
    # Every value is documented in values.yaml (itself or the object holding it)...
    for key in _leaf_keys(yaml.safe_load(text)):
        parts = key.split(".")
        assert any(".".join(parts[:i]) in documented for i in range(1, len(parts) + 1)), f"{key} has no '# --' comment"
    # ...and README.md has one row per documented value, with its real default.
    rows = dict(re.findall(r"^\| `([^`]+)` \| (`[^|]*`) \|", (CHART / "README.md").read_text(), flags=re.M))
    assert set(rows) == set(documented), f"missing: {set(documented) - set(rows)}, unknown: {set(rows) - set(documented)}"
    for key, (default, _) in documented.items():
        assert rows[key] == default_cell(default), f"README.md default of {key}"


def test_schema_describes_every_value(renderer: Renderer) -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    text = (CHART / "values.yaml").read_text()
    values = yaml.safe_load(text)
    defs = schema["definitions"]

    def resolve(node: dict[str, Any]) -> dict[str, Any]:
        while "$ref" in node:
            node = defs[node["$ref"].rsplit("/", 1)[1]]
        return node

    for key in documented_values(text):
        node = schema
        for part in key.split("."):
            node = resolve(node)
            assert part in node.get("properties", {}), f"values.schema.json does not describe {key}"
            node = node["properties"][part]
    renderer.chart.validate_schema(values)


def test_daemons_report_to_the_master_when_asked(renderer: Renderer) -> None:
    """node.master.report: every daemon reports to this release's master with its token, the
    master's NetworkPolicy admits them, and the args parse with the real serve command; off by
    default (the defaults render no --master)."""
    from sidecar.cli import build_parser

    assert "--master" not in container(find(renderer.objects({}), "DaemonSet", "-node"))["args"]
    objects = renderer.objects({"node": {"master": {"report": True}, "cache": {"eviction": "planned"}},
                                "networkPolicy": {"enabled": True}})
    daemonset = find(objects, "DaemonSet", "-node")
    c = container(daemonset)
    args = c["args"]
    assert arg_after(args, "--master") == "http://sc-shardcache-master.shardcache.svc:8700"
    assert arg_after(args, "--master-token-file") == "/etc/shardcache/master-token/token"
    assert arg_after(args, "--eviction") == "planned"
    assert {"name": "master-token", "mountPath": "/etc/shardcache/master-token", "readOnly": True} in c["volumeMounts"]
    volume = {v["name"]: v for v in daemonset["spec"]["template"]["spec"]["volumes"]}["master-token"]
    assert volume["secret"]["secretName"] == find(objects, "Secret", "-master-token")["metadata"]["name"]
    parsed = build_parser().parse_args(args)
    assert parsed.command == "serve" and parsed.master
    policy = find(objects, "NetworkPolicy", "-master")
    node_labels = daemonset["spec"]["selector"]["matchLabels"]
    assert any(peer.get("podSelector", {}).get("matchLabels") == node_labels
               for rule in policy["spec"]["ingress"] for peer in rule["from"])
