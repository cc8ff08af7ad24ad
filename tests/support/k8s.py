"""The Kubernetes tests' machinery: Helm rendering and the chart's documented value sets, schema
validation of Kubernetes objects, TLS material, a real ``shardcache webhook`` process over HTTPS,
``shardcache inject`` as a process, and NetworkPolicy evaluation."""

from __future__ import annotations

import argparse
import base64
import copy
import datetime
import http.client
import ipaddress
import json
import os
import shutil
import socket
import ssl
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from sidecar.k8s.inject import INJECT_LABEL
from tests.support.processes import PYTHON, REPO, free_port, spawn, stop
from tests.support.waits import wait_until

__all__ = ["CHART", "FIXTURES", "OPTIONS", "RELEASE_NAMESPACE", "Renderer", "TEMPLATE_PATHS", "TLSFiles", "VAP_API", "WebhookProcess", "admission_review", "admits", "apply_patch", "chart_webhook_args", "check_pod_semantics", "client_context", "default_cell", "dig", "docs", "documented_values", "find", "kubectl_parse", "load_fixture_docs", "make_tls", "opted_in_deployment", "pod_templates", "run_inject", "selects", "start_webhook", "subcommands", "validate_k8s"]

FIXTURES = REPO / "tests" / "k8s" / "fixtures"
# What a cluster with the ValidatingAdmissionPolicy API reports (the chart renders its policy only then).
VAP_API = "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy"
CHART = REPO / "charts" / "shardcache"

# Kinds of pod-holding objects and where their pod templates are, written out independently of
# sidecar.k8s.inject so the tests do not trust the code under test to find them.
TEMPLATE_PATHS: dict[str, list[tuple[str, ...]]] = {
    "Pod": [()],
    "Deployment": [("spec", "template")],
    "StatefulSet": [("spec", "template")],
    "DaemonSet": [("spec", "template")],
    "ReplicaSet": [("spec", "template")],
    "Job": [("spec", "template")],
    "CronJob": [("spec", "jobTemplate", "spec", "template")],
    "PyTorchJob": [("spec", "pytorchReplicaSpecs", "Master", "template"), ("spec", "pytorchReplicaSpecs", "Worker", "template")],
    "TFJob": [("spec", "tfReplicaSpecs", "Chief", "template"), ("spec", "tfReplicaSpecs", "Worker", "template")],
}


def dig(obj: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        obj = obj[key]
    return obj


def pod_templates(obj: dict[str, Any]) -> list[dict[str, Any]]:
    return [dig(obj, path) for path in TEMPLATE_PATHS[obj["kind"]]]


def load_fixture_docs(name: str = "workloads.yaml") -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((FIXTURES / name).read_text()) if d]


# ----------------------------------------------------------------------------- validation


def _clean(obj: Any) -> Any:
    """Drop what the API server adds that the published schemas do not describe (nulls, status)."""
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items() if v is not None and k != "status"}
    if isinstance(obj, list):
        return [_clean(v) for v in obj]
    return obj


def validate_k8s(obj: dict[str, Any], version: str = "1.30") -> None:
    """Validate against the official Kubernetes OpenAPI schema of ``version``, strictly (unknown
    fields fail). Custom resources (Kubeflow) are checked through their pod templates as Pods."""
    import kubernetes_validate  # type: ignore[import-untyped]

    obj = _clean(copy.deepcopy(obj))
    if obj["kind"] in ("PyTorchJob", "TFJob"):
        for index, template in enumerate(pod_templates(obj)):
            pod = {"apiVersion": "v1", "kind": "Pod", "metadata": template.get("metadata") or {"name": f"t{index}"}, "spec": template["spec"]}
            pod["metadata"].setdefault("name", f"t{index}")
            kubernetes_validate.validate(pod, version, strict=True)
        return
    kubernetes_validate.validate(obj, version, strict=True)


def check_pod_semantics(spec: dict[str, Any], claims: tuple[str, ...] = ()) -> None:
    """What the schema cannot say but the API server's validation does (``claims``: volumes a
    StatefulSet's volumeClaimTemplates add)."""
    containers = spec["containers"] + spec.get("initContainers", [])
    names = [c["name"] for c in containers]
    assert len(names) == len(set(names)), f"duplicate container names {names}"
    volumes = [v["name"] for v in spec.get("volumes", [])]
    assert len(volumes) == len(set(volumes)), f"duplicate volume names {volumes}"
    for container in containers:
        paths = [m["mountPath"] for m in container.get("volumeMounts", [])]
        assert len(paths) == len(set(paths)), f"{container['name']}: duplicate mountPaths {paths}"
        for mount in container.get("volumeMounts", []):
            assert mount["name"] in volumes or mount["name"] in claims, f"{container['name']} mounts unknown volume {mount['name']}"
        envs = [e["name"] for e in container.get("env", [])]
        assert len(envs) == len(set(envs)), f"{container['name']}: duplicate env {envs}"
    for container in spec["containers"]:
        assert "restartPolicy" not in container, "restartPolicy is only allowed on init containers"


def kubectl_parse(text: str) -> list[dict[str, Any]]:
    """Have kubectl (offline, no cluster) decode every document as a Kubernetes object."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed (apt-get install kubectl)")
    proc = subprocess.run(
        [kubectl, "label", "--local", "-f", "-", "-o", "json", "checked-by=kubectl"],
        input=text.encode(),
        capture_output=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr.decode()
    # kubectl prints one JSON document per object, back to back.
    decoder, text, pos = json.JSONDecoder(), proc.stdout.decode(), 0
    objects: list[dict[str, Any]] = []
    while pos < len(text.rstrip()):
        obj, end = decoder.raw_decode(text, pos)
        objects.extend(obj["items"] if obj.get("kind") == "List" else [obj])
        pos = end
        while pos < len(text) and text[pos].isspace():
            pos += 1
    return objects


# ----------------------------------------------------------------------------- Helm


def subcommands(parser: argparse.ArgumentParser) -> set[str]:
    """Names of the subcommands this tree's ``shardcache`` registers."""
    return {name for action in parser._actions if isinstance(action, argparse._SubParsersAction) for name in action.choices}


class Renderer:
    """Helm's own engine (helm-python-sdk), offline: values in, parsed objects out."""

    def __init__(self) -> None:
        import helm_python

        self.helm = helm_python
        self.chart = helm_python.Chart.load(str(CHART))

    def files(self, values: dict[str, Any] | None = None, *, namespace: str = "shardcache", name: str = "sc",
              api_versions: tuple[str, ...] = (), kube_version: str | None = None) -> dict[str, str]:
        """Rendered files by path; ``api_versions``: what a cluster's discovery would report (what
        ``helm template --api-versions`` passes), ``kube_version`` its version (``--kube-version``).
        The SDK's ``Chart.render`` exposes neither option, so its native call is made with
        Chart.render's options plus those."""
        if not api_versions and kube_version is None:
            return self.chart.render(values=values or {}, name=name, namespace=namespace, is_install=True)
        from helm_python import _native

        opts: dict[str, Any] = {"name": name, "namespace": namespace, "is_install": True, "api_versions": list(api_versions)}
        if kube_version is not None:
            opts["kube_version"] = kube_version
        files: dict[str, str] = json.loads(_native.call_string("helm_render", self.chart._raw(), json.dumps(values or {}), json.dumps(opts)))
        return files

    def objects(self, values: dict[str, Any] | None = None, *, namespace: str = "shardcache", name: str = "sc",
                api_versions: tuple[str, ...] = ()) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for path, text in sorted(self.files(values, namespace=namespace, name=name, api_versions=api_versions).items()):
            if path.endswith(".yaml"):
                out.extend(d for d in yaml.safe_load_all(text) if d)
        return out

    def close(self) -> None:
        self.chart.close()


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Kubernetes label selector semantics (an empty selector selects everything)."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        ok = {"In": key in labels and labels[key] in values, "NotIn": labels.get(key) not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def find(objects: list[dict[str, Any]], kind: str, name_suffix: str = "") -> dict[str, Any]:
    matches = [o for o in objects if o["kind"] == kind and o["metadata"]["name"].endswith(name_suffix)]
    assert len(matches) == 1, f"expected one {kind} *{name_suffix}, got {[o['metadata']['name'] for o in matches]}"
    return matches[0]


# ----------------------------------------------------------------------------- TLS


@dataclass
class TLSFiles:
    ca: Path
    cert: Path
    key: Path
    ca_pem: bytes


def make_tls(directory: Path, hostnames: list[str], *, ca_name: str = "test-ca") -> TLSFiles:
    """A CA and a server certificate for ``hostnames`` (and 127.0.0.1), written as PEM files."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, ca_name)])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_subject)
        .issuer_name(ca_subject)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    sans: list[x509.GeneralName] = [x509.DNSName(h) for h in hostnames]
    sans.append(x509.IPAddress(ipaddress.ip_address("127.0.0.1")))
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hostnames[0])]))
        .issuer_name(ca_subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    files = TLSFiles(directory / "ca.crt", directory / "tls.crt", directory / "tls.key", ca_cert.public_bytes(serialization.Encoding.PEM))
    files.ca.write_bytes(files.ca_pem)
    files.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    files.key.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return files


def client_context(ca_pem: bytes) -> ssl.SSLContext:
    context = ssl.create_default_context(cadata=ca_pem.decode())
    return context


# ----------------------------------------------------------------------------- the webhook process


class _Connection(http.client.HTTPSConnection):
    """HTTPS to 127.0.0.1 that verifies the certificate for another name (the Service's DNS
    name the API server dials), as the API server does."""

    def __init__(self, port: int, context: ssl.SSLContext, server_hostname: str, timeout: float) -> None:
        super().__init__("127.0.0.1", port, context=context, timeout=timeout)
        self._tls_context = context
        self._sni = server_hostname

    def connect(self) -> None:
        sock = socket.create_connection((self.host, self.port), self.timeout)
        self.sock = self._tls_context.wrap_socket(sock, server_hostname=self._sni)


@dataclass
class WebhookProcess:
    port: int
    ca_pem: bytes
    proc: subprocess.Popen[bytes]
    log: Path
    server_hostname: str = "localhost"

    def request(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
        timeout: float = 30,
    ) -> tuple[int, bytes]:
        conn = _Connection(self.port, client_context(self.ca_pem), self.server_hostname, timeout)
        try:
            conn.request(method, path, body=body, headers=headers or {})
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def review(self, payload: Any, headers: dict[str, str] | None = None) -> tuple[int, Any]:
        body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        status, data = self.request("POST", "/mutate", body, {"Content-Type": "application/json", **(headers or {})})
        try:
            return status, json.loads(data)
        except ValueError:
            return status, data

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


def start_webhook(tmp: Path, tls: TLSFiles, *extra: str, server_hostname: str = "localhost") -> WebhookProcess:
    port = free_port()
    log = tmp / f"webhook-{port}.log"
    proc = spawn(
        [PYTHON, "-m", "sidecar.cli", "webhook", "--listen", f"tcp://127.0.0.1:{port}",
         "--tls-cert", str(tls.cert), "--tls-key", str(tls.key), *extra],
        log,
    )
    server = WebhookProcess(port, tls.ca_pem, proc, log, server_hostname)

    def healthy() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"webhook exited with {proc.returncode}:\n{server.log_text()}")
        return server.request("GET", "/healthz", timeout=2)[0] == 200

    try:
        wait_until(healthy, timeout=30, what="webhook /healthz over TLS")
    except TimeoutError:
        stop(proc)
        raise AssertionError(f"webhook did not come up:\n{server.log_text()}") from None
    return server


def opted_in_deployment(name: str, namespace: str, *, label_on: str, replicas: int = 1) -> dict[str, Any]:
    """A Deployment opted in with the inject label on its pod template (as the README shows) or
    on its own metadata (``label_on``: ``"template"`` or ``"deployment"``)."""
    template_labels = {"app": name}
    own: dict[str, str] = {}
    (template_labels if label_on == "template" else own)[INJECT_LABEL] = "true"
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace, "labels": own},
        "spec": {"replicas": replicas, "selector": {"matchLabels": {"app": name}},
                 "template": {"metadata": {"labels": template_labels},
                              "spec": {"containers": [{"name": "train", "image": "trainer:1"}]}}},
    }


def chart_webhook_args(objects: list[dict[str, Any]]) -> list[str]:
    """The ``shardcache webhook`` flags of a rendered chart's webhook Deployment, less its address
    and certificate (a test gives its own)."""
    args = find(objects, "Deployment", "-webhook")["spec"]["template"]["spec"]["containers"][0]["args"]
    args = args[args.index("webhook") + 1:]
    kept: list[str] = []
    pairs = iter(args)
    for arg in pairs:
        if arg in ("--listen", "--tls-cert", "--tls-key"):
            next(pairs)
            continue
        kept.append(arg)
    return kept


def admission_review(obj: dict[str, Any], *, operation: str = "CREATE", uid: str = "uid-1") -> dict[str, Any]:
    group, _, version = obj["apiVersion"].rpartition("/")
    meta = obj.get("metadata", {})
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": uid,
            "kind": {"group": group, "version": version, "kind": obj["kind"]},
            "resource": {"group": group, "version": version, "resource": obj["kind"].lower() + "s"},
            "namespace": meta.get("namespace", "default"),
            "name": meta.get("name", ""),
            "operation": operation,
            "userInfo": {"username": "kubernetes-admin"},
            "object": obj,
            "oldObject": None,
            "dryRun": False,
        },
    }


def apply_patch(obj: dict[str, Any], response: dict[str, Any]) -> dict[str, Any]:
    import base64

    import jsonpatch  # type: ignore[import-untyped]

    assert response["patchType"] == "JSONPatch"
    patch = json.loads(base64.b64decode(response["patch"]))
    return jsonpatch.apply_patch(obj, patch)



# ----------------------------------------------------------------------------- values documentation


def documented_values(text: str) -> dict[str, tuple[Any, str]]:
    """Keys of values.yaml that carry a ``# --`` comment (the helm-docs convention), with their
    default and description. Line-based: keys are nested by two-space indentation."""
    values = yaml.safe_load(text)
    out: dict[str, tuple[Any, str]] = {}
    stack: list[tuple[int, str]] = []
    comment: list[str] | None = None
    for line in text.splitlines():
        stripped = line.strip()
        indent = len(line) - len(line.lstrip(" "))
        if stripped.startswith("# --"):
            comment = [stripped[4:].strip()]
            continue
        if stripped.startswith("#") and comment is not None:
            comment.append(stripped.lstrip("#").strip())
            continue
        if not stripped or stripped.startswith("#") or stripped.startswith("- "):
            if not stripped.startswith("- "):
                comment = None
            continue
        key = stripped.split(":", 1)[0]
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, key))
        if comment is not None:
            path = ".".join(k for _, k in stack)
            out[path] = (dig(values, tuple(k for _, k in stack)), " ".join(comment))
            comment = None
    return out


def default_cell(value: Any) -> str:
    return "`" + json.dumps(value, separators=(", ", ": ")) + "`"


# ----------------------------------------------------------------------------- shardcache inject


def run_inject(*args: str, stdin: str | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDCACHE_")}
    full_env.update({"PYTHONPATH": str(REPO), **(env or {})})
    return subprocess.run(
        [PYTHON, "-m", "sidecar.cli", "inject", *args],
        input=stdin, capture_output=True, text=True, timeout=60, env=full_env, cwd=REPO,
    )


def docs(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]


# ----------------------------------------------------------------------------- network policies


RELEASE_NAMESPACE = "shardcache"  # the namespace the tests install the chart in


def admits(policy: dict[str, Any], namespace: str, port: int, pod_labels: dict[str, str] | None = None,
           release_namespace: str = RELEASE_NAMESPACE) -> bool:
    """Whether ``policy`` admits a TCP connection to ``port`` from a pod in ``namespace``
    (namespaces carry their kubernetes.io/metadata.name label). ipBlocks are not evaluated: pod
    addresses in them are implementation-defined."""
    ns_labels = {"kubernetes.io/metadata.name": namespace}
    for rule in policy["spec"].get("ingress", []):
        if not any(p.get("port") == port and p.get("protocol", "TCP") == "TCP" for p in rule.get("ports", [])):
            continue
        for peer in rule.get("from", []):
            if "ipBlock" in peer:
                continue
            if "namespaceSelector" in peer:
                ns_ok = selects(peer["namespaceSelector"], ns_labels)
            else:
                ns_ok = namespace == release_namespace
            if ns_ok and selects(peer.get("podSelector", {}), pod_labels or {}):
                return True
    return False


# ----------------------------------------------------------------------------- the chart's value sets


# Every documented option set; each is linted, rendered, and checked by the generic tests.
OPTIONS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "gpu-nodes": {
        "node": {
            "nodeSelector": {"nvidia.com/gpu.present": "true"},
            "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "gpu", "effect": "NoSchedule"}],
            "priorityClassName": "gpu-infra",
            "cache": {"hostPath": "/mnt/nvme0/shardcache", "size": "1.5TiB", "minFree": "5%", "eviction": "hold"},
            "socketHostDir": "/var/run/shardcache",
        },
    },
    "ephemeral-cache": {"node": {"cache": {"type": "ephemeral", "ephemeral": {"storageClassName": "local-path", "size": "800Gi"}}}},
    "s3-credentials": {
        "node": {"origin": {"s3": {"endpoint": "http://minio.storage:9000", "region": "us-east-1",
                                    "credentialsSecret": {"name": "minio-creds", "accessKeyIdKey": "user", "secretAccessKeyKey": "password"}}},
                 "serviceAccount": {"annotations": {"eks.amazonaws.com/role-arn": "arn:aws:iam::1:role/x"}}},
    },
    # --auth sigv4 (the default) checks callers against S3's IAM: a file origin goes without.
    "file-origin": {"node": {"origin": {"type": "file", "file": {"hostPath": "/mnt/datasets"}}, "auth": {"mode": "none"}}},
    "priority-class": {"priorityClass": {"create": True, "value": 2000000}},
    "etcd-ha": {"master": {"replicas": 3, "state": {"type": "etcd", "etcd": {"endpoints": ["etcd-0.etcd:2379", "etcd-1.etcd:2379"], "prefix": "/sc"}}}},
    "master-no-persistence": {"master": {"persistence": {"enabled": False}}},
    "master-existing-claim": {"master": {"persistence": {"existingClaim": "my-claim"}}},
    "cert-manager": {"webhook": {"tls": {"mode": "certManager"}}},
    "cert-manager-issuer": {"webhook": {"tls": {"mode": "certManager", "certManager": {"issuerRef": {"name": "corp-ca", "kind": "ClusterIssuer"}}}}},
    "tls-secret": {"webhook": {"tls": {"mode": "secret", "secret": {"name": "my-tls", "caBundle": base64.b64encode(b"-----BEGIN CERTIFICATE-----\n").decode()}}}},
    "old-cluster": {"webhook": {"nativeSidecar": False}},
    "fail-closed": {"webhook": {"failurePolicy": "Fail", "timeoutSeconds": 10, "replicas": 3}},
    "namespaces": {"webhook": {"namespaceSelector": {"matchLabels": {"shardcache.io/enabled": "true"}}}},
    "workloads": {"webhook": {"injectWorkloads": True}},
    # Pods restricted by default (namespaces labelled shardcache.io/mode=hostpath keep the socket);
    # the admission policy only reporting, in its own namespaces (rendered where the API exists).
    "restricted-default": {"webhook": {"injectWorkloads": True, "sidecar": {"mode": "restricted"}},
                           "admissionPolicy": {"validationActions": ["Warn", "Audit"],
                                               "namespaceSelector": {"matchLabels": {"training": "true"}}}},
    "sidecar": {"webhook": {"sidecar": {"image": {"repository": "mirror.local/shardcache", "tag": "9.9.9"}, "port": 9600,
                                        "shortCircuit": False, "podCacheSize": "40Gi",
                                        "resources": {"requests": {"cpu": "250m", "memory": "512Mi"}, "limits": {"cpu": 2, "memory": "2Gi"}}}}},
    "service-monitor": {"metrics": {"podAnnotations": False, "serviceMonitor": {"enabled": True, "interval": "15s", "labels": {"release": "prom"}}}},
    "single-webhook": {"webhook": {"replicas": 1}},
    "pinned-image": {"image": {"repository": "mirror.local/sc", "digest": "sha256:" + "a" * 64},
                     "imagePullSecrets": [{"name": "regcred"}], "commonLabels": {"team": "ml-infra"}},
    "names": {"fullnameOverride": "cache"},
    "only-node": {"master": {"enabled": False}, "webhook": {"enabled": False}},
    "tenancy": {
        "networkPolicy": {
            "trainingNamespaceSelector": {"matchLabels": {"shardcache.io/training": "true"}},
            "metricsNamespaceSelector": {"matchExpressions": [{"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["prom"]}]},
            "apiServerCIDRs": ["10.0.0.0/28"],
            "extraFrom": {"node": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ops"}}}],
                          "webhook": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
                                       "podSelector": {"matchLabels": {"k8s-app": "konnectivity-agent"}}}]},
        },
        "webhook": {"allowedSidecarImages": ["mirror.local/shardcache:*", "registry.example.com/ml/*", "ghcr.io/shardcache/shardcache:0.1.0"]},
        "master": {"auth": {"existingSecret": "my-master-token"}},
    },
    "open": {"networkPolicy": {"enabled": False}, "master": {"auth": {"enabled": False}}},
}
