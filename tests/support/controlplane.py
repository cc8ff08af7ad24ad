"""A real Kubernetes control plane for tests, the envtest way (controller-runtime's
``pkg/envtest``): a kube-apiserver binary named by ``SHARDCACHE_TEST_KUBE_APISERVER`` and,
optionally, a kube-controller-manager named by ``SHARDCACHE_TEST_KUBE_CONTROLLER_MANAGER``, started
on loopback with Debian's etcd on free ports, and a small REST client that finds resources by
discovery. Nothing here builds or downloads Kubernetes: without the variables the tests skip.

The API server runs what a platform team's cluster runs for admission: RBAC, Pod Security,
ValidatingAdmissionPolicy and both admission-webhook plugins. Clients authenticate with a static
bearer token in ``system:masters``.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import ssl
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.support.masters import EtcdServer
from tests.support.processes import free_port, spawn, stop
from tests.support.waits import wait_until

__all__ = ["ADMISSION_PLUGINS", "APISERVER_ENV", "Answer", "ApiError", "CONTROLLERS", "CONTROLLER_MANAGER_ENV", "ControlPlane", "Kube", "Resource", "binary", "control_plane", "eventually", "require_apiserver"]

APISERVER_ENV = "SHARDCACHE_TEST_KUBE_APISERVER"
CONTROLLER_MANAGER_ENV = "SHARDCACHE_TEST_KUBE_CONTROLLER_MANAGER"
ADMISSION_PLUGINS = "PodSecurity,ValidatingAdmissionPolicy,MutatingAdmissionWebhook,ValidatingAdmissionWebhook"
# The controllers a Deployment needs to make ReplicaSets and pods; serviceaccount makes each
# namespace's "default" ServiceAccount, without which the ServiceAccount admission plugin refuses
# pods; the admission policies' status (their type checking) is a controller's work too.
CONTROLLERS = ("deployment-controller,replicaset-controller,serviceaccount-controller,"
               "validatingadmissionpolicy-status-controller")


def binary(variable: str) -> str | None:
    path = os.environ.get(variable)
    if not path:
        return None
    if not os.access(path, os.X_OK):
        raise AssertionError(f"{variable}={path} is not an executable file")
    return path


def require_apiserver() -> str:
    """The kube-apiserver binary, or skip the test with the reason."""
    path = binary(APISERVER_ENV)
    if path is None:
        pytest.skip(f"no real API server: set {APISERVER_ENV} to a kube-apiserver binary (and install etcd-server) "
                    "to run the tests against a real control plane")
    if shutil.which("etcd") is None:
        pytest.skip("etcd is not installed (apt-get install etcd-server); scripts/test.sh installs it")
    return path


class ApiError(Exception):
    """A refused API request: HTTP status, the Status object's reason and message, and warnings."""

    def __init__(self, status: int, body: dict[str, Any], warnings: list[str]) -> None:
        self.status = status
        self.body = body
        self.reason = str(body.get("reason", ""))
        self.message = str(body.get("message", body))
        self.warnings = warnings
        super().__init__(f"{status} {self.reason}: {self.message}")


@dataclass
class Answer:
    status: int
    body: dict[str, Any]
    warnings: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Resource:
    api_version: str
    kind: str
    name: str
    namespaced: bool

    def path(self, namespace: str | None, name: str | None = None) -> str:
        base = f"/api/{self.api_version}" if "/" not in self.api_version else f"/apis/{self.api_version}"
        if self.namespaced:
            base += f"/namespaces/{urllib.parse.quote(namespace or 'default')}"
        base += f"/{self.name}"
        return base + (f"/{urllib.parse.quote(name)}" if name else "")


class Kube:
    """A REST client of one API server: create, get, list, delete, by kind (discovery)."""

    def __init__(self, url: str, token: str, ca_file: Path) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.context = ssl.create_default_context(cafile=str(ca_file))
        self._resources: dict[tuple[str, str], Resource] | None = None

    def request(self, method: str, path: str, body: Any = None, *, query: dict[str, str] | None = None,
                content_type: str = "application/json", timeout: float = 30) -> Answer:
        url = self.url + path + (("?" + urllib.parse.urlencode(query)) if query else "")
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(url, data=data, method=method, headers={
            "Authorization": f"Bearer {self.token}", "Accept": "application/json", "Content-Type": content_type})
        try:
            with urllib.request.urlopen(req, context=self.context, timeout=timeout) as resp:
                text = resp.read()
                is_json = resp.headers.get_content_type() == "application/json"
                body = json.loads(text) if text and is_json else {"text": text.decode(errors="replace")}
                return Answer(resp.status, body, resp.headers.get_all("Warning") or [])
        except urllib.error.HTTPError as exc:
            text = exc.read()
            try:
                parsed = json.loads(text)
            except ValueError:
                parsed = {"message": text.decode(errors="replace")}
            raise ApiError(exc.code, parsed, exc.headers.get_all("Warning") or []) from None

    # -- discovery

    def resource(self, api_version: str, kind: str) -> Resource | None:
        if self._resources is None or (api_version, kind) not in self._resources:
            self._resources = self._discover()
        return self._resources.get((api_version, kind))

    def _discover(self) -> dict[tuple[str, str], Resource]:
        found: dict[tuple[str, str], Resource] = {}
        versions = ["v1"]
        for group in self.request("GET", "/apis").body.get("groups", []):
            versions += [v["groupVersion"] for v in group["versions"]]
        for gv in versions:
            path = "/api/v1" if gv == "v1" else f"/apis/{gv}"
            for res in self.request("GET", path).body.get("resources", []):
                if "/" not in res["name"]:
                    found.setdefault((gv, res["kind"]), Resource(gv, res["kind"], res["name"], res["namespaced"]))
        return found

    def _resource_of(self, obj: dict[str, Any]) -> Resource:
        resource = self.resource(obj["apiVersion"], obj["kind"])
        if resource is None:
            raise LookupError(f"the API server serves no {obj['apiVersion']} {obj['kind']}")
        return resource

    # -- verbs

    def create(self, obj: dict[str, Any], *, dry_run: bool = False, namespace: str | None = None) -> Answer:
        resource = self._resource_of(obj)
        query = {"fieldValidation": "Strict"}
        if dry_run:
            query["dryRun"] = "All"
        ns = namespace or obj.get("metadata", {}).get("namespace")
        return self.request("POST", resource.path(ns), obj, query=query)

    def get(self, api_version: str, kind: str, name: str, namespace: str | None = None) -> dict[str, Any]:
        resource = self.resource(api_version, kind)
        assert resource is not None, kind
        return self.request("GET", resource.path(namespace, name)).body

    def list(self, api_version: str, kind: str, namespace: str | None = None, *, selector: str | None = None) -> list[dict[str, Any]]:
        resource = self.resource(api_version, kind)
        assert resource is not None, kind
        items = self.request("GET", resource.path(namespace), query={"labelSelector": selector} if selector else None).body
        return list(items.get("items", []))

    def delete(self, api_version: str, kind: str, name: str, namespace: str | None = None) -> None:
        resource = self.resource(api_version, kind)
        assert resource is not None, kind
        try:
            self.request("DELETE", resource.path(namespace, name))
        except ApiError as exc:
            if exc.status != 404:
                raise

    def namespace(self, name: str, labels: dict[str, str] | None = None) -> None:
        """Create a namespace and its default ServiceAccount (pods need it; without a controller
        manager nothing else makes it). Either may exist already (another test, the serviceaccount
        controller)."""
        for obj in ({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels or {}}},
                    {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default", "namespace": name}}):
            try:
                self.create(obj)
            except ApiError as exc:
                if exc.status != 409:
                    raise


@dataclass
class ControlPlane:
    kube: Kube
    version: str
    controller_manager: bool
    directory: Path

    def log(self, name: str) -> str:
        path = self.directory / f"{name}.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""


def _write_keys(directory: Path) -> tuple[Path, Path]:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    private = directory / "sa.key"
    public = directory / "sa.pub"
    private.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    return private, public


@contextmanager
def control_plane(directory: Path) -> Iterator[ControlPlane]:
    """etcd, kube-apiserver and (when given) kube-controller-manager, stopped afterwards."""
    apiserver = require_apiserver()
    manager = binary(CONTROLLER_MANAGER_ENV)
    directory.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        etcd = EtcdServer(directory, binary="etcd", data_dir="etcd", log_level=None)
        etcd.launch()
        assert etcd.proc is not None
        procs.append(etcd.proc)
        etcd.wait_ready()
        token = secrets.token_hex(16)
        (directory / "tokens.csv").write_text(f"{token},admin,admin-uid,system:masters\n")
        private, public = _write_keys(directory)
        port = free_port()
        certs = directory / "certs"
        procs.append(spawn([
            apiserver, "--bind-address", "127.0.0.1", "--advertise-address", "127.0.0.1", "--secure-port", str(port),
            "--etcd-servers", etcd.endpoint, "--cert-dir", str(certs),
            "--service-cluster-ip-range", "10.0.0.0/24",
            "--service-account-issuer", "https://kubernetes.default.svc",
            "--service-account-signing-key-file", str(private), "--service-account-key-file", str(public),
            "--authorization-mode", "RBAC", "--token-auth-file", str(directory / "tokens.csv"),
            "--enable-admission-plugins", ADMISSION_PLUGINS,
        ], directory / "apiserver.log"))
        clients: list[Kube] = []

        def ready() -> bool:
            for proc in procs:
                if proc.poll() is not None:
                    raise AssertionError(f"{proc.args[0]} exited with {proc.returncode}:\n"
                                         f"{(directory / 'apiserver.log').read_text(errors='replace')[-3000:]}")
            try:
                # A new client each try: the server writes its self-signed CA next to its
                # certificate after the file first appears.
                kube = Kube(f"https://127.0.0.1:{port}", token, certs / "apiserver.crt")
                if kube.request("GET", "/readyz", timeout=5).status == 200:
                    clients.append(kube)
                    return True
            except (ApiError, OSError, ssl.SSLError):
                pass
            return False

        try:
            wait_until(ready, timeout=120, interval=0.5, what="kube-apiserver /readyz")
        except TimeoutError:
            raise AssertionError(f"kube-apiserver not ready:\n{(directory / 'apiserver.log').read_text(errors='replace')[-3000:]}") from None
        kube = clients[0]
        version = kube.request("GET", "/version").body.get("gitVersion", "?")
        if manager is not None:
            kubeconfig = directory / "kubeconfig"
            kubeconfig.write_text(json.dumps({
                "apiVersion": "v1", "kind": "Config", "current-context": "test",
                "clusters": [{"name": "test", "cluster": {"server": kube.url, "certificate-authority": str(certs / "apiserver.crt")}}],
                "users": [{"name": "admin", "user": {"token": token}}],
                "contexts": [{"name": "test", "context": {"cluster": "test", "user": "admin"}}],
            }))
            procs.append(spawn([
                manager, "--kubeconfig", str(kubeconfig), "--controllers", CONTROLLERS, "--leader-elect=false",
                "--bind-address", "127.0.0.1", "--secure-port", str(free_port()),
            ], directory / "controller-manager.log"))
        yield ControlPlane(kube, version, manager is not None, directory)
    finally:
        for proc in reversed(procs):
            stop(proc)


def eventually(check: Any, timeout: float = 30.0, interval: float = 0.5) -> Any:
    """Call ``check`` until it returns something truthy (that value) or the time is up (its last
    AssertionError, raised)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = check()
            if value:
                return value
        except AssertionError:
            if time.monotonic() > deadline:
                raise
        if time.monotonic() > deadline:
            raise AssertionError(f"not true within {timeout} s")
        time.sleep(interval)
