"""Sidecar injection: one pure function shared by ``shardcache inject`` and ``shardcache webhook``.

:func:`inject` takes a Kubernetes object (a plain ``dict`` as decoded from YAML or JSON) and
returns a new object whose pod template(s) carry the shardcache sidecar,
``SHARDCACHE_ENDPOINT``, ``SHARDCACHE_NODE`` (the downward API's ``spec.nodeName``, in the sidecar
too) and, when configured, ``SHARDCACHE_MASTER_TOKEN`` from a Secret in the pod's namespace. How
the sidecar reaches the node daemon is the pod's *mode*
(:data:`MODES`: the configuration's, unless the pod's ``shardcache.io/mode`` annotation says
otherwise; the webhook takes the configuration's from the namespace, see
:mod:`sidecar.k8s.webhook`):

* ``hostpath``: through the daemon's unix socket, the host directory ``/run/shardcache``
  mounted read-only into the sidecar only: the one hostPath in the pod. With short-circuit
  reads on, the sidecar also passes the app containers open file descriptors of the cached
  entries their tenant may read (``--handles``) over a unix socket in a pod-local ``emptyDir``
  (``/run/shardcache-pod``, read-only in the app containers: connecting needs no write access),
  which they find in ``SHARDCACHE_HANDLES``. No pod mounts the node cache directory: a mount
  would let it open by path what any other tenant cached.
* ``restricted``: no hostPath at all, for namespaces that enforce Pod Security ``restricted``.
  The sidecar reaches the daemon over TCP through the chart's node-local Service
  (``internalTrafficPolicy: Local``), has no handles, and runs as a non-root user with what
  ``restricted`` asks of a container; the pod's own settings are not touched.

The sidecar image a pod's annotation asks for is used only when the configuration allows it;
otherwise the default runs and the :class:`Outcome` carries a warning.
The input is never modified, the result depends only on the object and the
:class:`InjectConfig`, and injecting an injected object changes nothing, so the offline command
and the admission webhook agree byte for byte and a webhook called twice
(``reinvocationPolicy: IfNeeded``) is harmless.

Injection *converges* rather than "adds once": a pod that already has the sidecar still gets the
env vars and mounts on containers that lack them (another webhook may have added a container after
us), and nothing already present is touched, so the user's explicit choices win. The sidecar
already there decides what the others get (its mode and whether it serves handles are read from
it), so a second pass under another configuration never adds a hostPath to a restricted pod.

The sidecar signs its reads with the *pod's* AWS credentials (``shardcache serve --auth sigv4``
checks every read against the caller's own right to it), so it gets the credential settings of
the pod's first app container that has any (:data:`AWS_CREDENTIAL_ENV`, ``envFrom`` Secrets, and
the read-only mounts holding the token and credential files those point at), converging like the
rest: only what the sidecar does not already set, never ``AWS_ENDPOINT_URL``.

:func:`inject_documents` injects what :func:`sidecar.k8s.yamldocs.load_documents` read; the webhook
answers with the patch of :func:`sidecar.k8s.patch.json_patch` between an object and its injection.
"""

from __future__ import annotations

import copy
import posixpath
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from decimal import Decimal, InvalidOperation
from importlib import metadata
from typing import Any, Literal

from sidecar.errors import SidecarError
from sidecar.k8s.patch import json_equal
from wire.names import MAX_GID

__all__ = [
    "INJECT_LABEL",
    "STATUS_ANNOTATION",
    "ANNOTATIONS",
    "SIDECAR_NAME",
    "ENDPOINT_ENV",
    "HANDLES_ENV",
    "NODE_ENV",
    "NODE_FIELD_PATH",
    "MASTER_TOKEN_ENV",
    "MASTER_TOKEN_KEY",
    "CHART_MASTER_TOKEN_SECRET",
    "AWS_CREDENTIAL_ENV",
    "AWS_TOKEN_DIRS",
    "DEFAULT_IMAGE",
    "DEFAULT_RESTRICTED_UPSTREAM",
    "MODES",
    "Mode",
    "VOLUME_SOCKET",
    "VOLUME_POD_SOCKET",
    "SOCKET_MOUNT",
    "POD_SOCKET_MOUNT",
    "RESTRICTED_UID",
    "InjectConfig",
    "InjectionError",
    "Outcome",
    "inject",
    "guard_ephemeral_containers",
    "is_supported",
    "inject_documents",
    "image_allowed",
    "shown",
]


def _default_image() -> str:
    try:
        version = metadata.version("shardcache")
    except metadata.PackageNotFoundError:  # running from a source tree that was never installed
        version = "latest"
    return f"ghcr.io/shardcache/shardcache:{version}"


DEFAULT_IMAGE = _default_image()

# --- names users see (labels and annotations are a contract: documented in the README, section Kubernetes) ---
INJECT_LABEL = "shardcache.io/inject"
STATUS_ANNOTATION = "shardcache.io/injected"
ANN_IMAGE = "shardcache.io/sidecar-image"
ANN_CPU_REQUEST = "shardcache.io/sidecar-cpu-request"
ANN_CPU_LIMIT = "shardcache.io/sidecar-cpu-limit"
ANN_MEMORY_REQUEST = "shardcache.io/sidecar-memory-request"
ANN_MEMORY_LIMIT = "shardcache.io/sidecar-memory-limit"
ANN_PORT = "shardcache.io/port"
ANN_SHORT_CIRCUIT = "shardcache.io/short-circuit"
ANN_POD_CACHE_SIZE = "shardcache.io/pod-cache-size"
ANN_MODE = "shardcache.io/mode"
ANNOTATIONS = (
    ANN_IMAGE,
    ANN_CPU_REQUEST,
    ANN_CPU_LIMIT,
    ANN_MEMORY_REQUEST,
    ANN_MEMORY_LIMIT,
    ANN_PORT,
    ANN_SHORT_CIRCUIT,
    ANN_POD_CACHE_SIZE,
    ANN_MODE,
)

Mode = Literal["hostpath", "restricted"]
MODES: tuple[Mode, ...] = ("hostpath", "restricted")
"""How the sidecar reaches the node daemon (the module docstring says what each injects)."""

# --- what gets injected ---
SIDECAR_NAME = "shardcache"
ENDPOINT_ENV = "SHARDCACHE_ENDPOINT"
# The master's bearer token, from a Secret in the pod's own namespace (the chart's NOTES say how a
# namespace gets its copy). The key name is the one the chart's Secret uses.
MASTER_TOKEN_ENV = "SHARDCACHE_MASTER_TOKEN"
MASTER_TOKEN_KEY = "token"
# The master token Secret of `helm install shardcache charts/shardcache -n shardcache`: the offline
# command's default, so that its output is what the chart's webhook makes (README, Kubernetes).
CHART_MASTER_TOKEN_SECRET = "shardcache-master-token"
# The app containers' address of the sidecar's file handle socket (read by the loader).
HANDLES_ENV = "SHARDCACHE_HANDLES"
# The pod's node, from the downward API: the loader's locality and the master's lease preference
# (docs/design.md), and the sidecar's node in its /stats. The webhook cannot know the node (the pod is
# not scheduled yet), the kubelet can.
NODE_ENV = "SHARDCACHE_NODE"
NODE_FIELD_PATH = "spec.nodeName"
VOLUME_SOCKET = "shardcache-socket"
VOLUME_POD_SOCKET = "shardcache-pod-socket"
VOLUME_POD_CACHE = "shardcache-pod-cache"
# Injected before file handles replaced cache paths; reserved still, so that a pod cannot bring a
# volume of that name that our own checks would take for an old injection.
_VOLUME_NODE_CACHE_LEGACY = "shardcache-node-cache"
OUR_VOLUMES = (VOLUME_SOCKET, VOLUME_POD_SOCKET, VOLUME_POD_CACHE, _VOLUME_NODE_CACHE_LEGACY)
# Paths inside the containers are fixed; only the host side is configurable. The node daemon
# mounts its socket directory at the same path, so its handles socket sits next to daemon.sock.
SOCKET_MOUNT = "/run/shardcache"
POD_SOCKET_MOUNT = "/run/shardcache-pod"
POD_CACHE_MOUNT = "/var/cache/shardcache-pod"
SOCKET_NAME = "daemon.sock"
HANDLES_NAME = "handles.sock"
# The pod-local socket directory holds one socket: a small tmpfs, not node disk.
POD_SOCKET_SIZE = "1Mi"
# The user a restricted-mode sidecar runs as (the chart's other components use it too). Pod
# Security `restricted` asks for runAsNonRoot; a numeric user lets the kubelet check it without
# reading the image.
RESTRICTED_UID = 65532
# The group of the node daemon's unix sockets (`shardcache serve --socket-group`, which makes them
# 0660): the chart's DaemonSet passes it (_helpers.tpl, shardcache.node.socketGroup, the same
# number), and hostpath-mode sidecars run with it as their group, so that they connect and a
# container of another user outside it does not, whatever it mounts. Not a group of any usual
# image (system groups are below 1000, distroless "nonroot" is 65532, "nobody" 65534).
SOCKET_GID = 8600
# The node-local Service of `helm install shardcache charts/shardcache -n shardcache` (the
# chart passes its own to the webhook).
DEFAULT_RESTRICTED_UPSTREAM = "tcp://shardcache-local.shardcache.svc:8600"

# The environment of boto3's credential chain (and the region and STS settings that decide where
# its STS calls go), copied from the pod's app container into the sidecar. AWS_ENDPOINT_URL (and
# AWS_ENDPOINT_URL_*) is deliberately absent: an app's points at the sidecar itself.
AWS_CREDENTIAL_ENV = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_PROFILE",
    "AWS_ROLE_ARN",
    "AWS_ROLE_SESSION_NAME",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE",
    "AWS_CONFIG_FILE",
    "AWS_SHARED_CREDENTIALS_FILE",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_STS_REGIONAL_ENDPOINTS",
)
# Those of them that name a file: the mount holding it is copied too.
_AWS_FILE_ENV = (
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE",
    "AWS_CONFIG_FILE",
    "AWS_SHARED_CREDENTIALS_FILE",
)
# Where EKS mounts the projected service account tokens: IRSA's (pod-identity-webhook) and EKS Pod
# Identity's. Copied whenever the app container mounts them, whatever its env says.
AWS_TOKEN_DIRS = (
    "/var/run/secrets/eks.amazonaws.com/serviceaccount",
    "/var/run/secrets/pods.eks.amazonaws.com/serviceaccount",
)
# A shared credentials/config directory mounted at the app user's ~/.aws: boto3 finds it through
# HOME, which is not the sidecar's, so the sidecar gets the two file variables pointing into it.
_AWS_HOME_DIR = ".aws"

# The standalone cache must stay below the emptyDir sizeLimit, or the kubelet evicts the pod.
POD_CACHE_FILL = Decimal("0.9")

# Every pattern is applied with fullmatch() and written in ASCII classes: `$` also matches before a
# trailing newline and `\d` matches any Unicode digit ("８６００"), and the API server refuses both
# in the injected pod. Digit runs are bounded so int()/Decimal never see a hostile length.
_CPU_RE = re.compile(r"([0-9]{1,18}(\.[0-9]{1,9})?|\.[0-9]{1,9})m?", re.ASCII)
_MEMORY_RE = re.compile(r"([0-9]{1,18}(\.[0-9]{1,9})?)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?", re.ASCII)
_ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*", re.ASCII)
_IMAGE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/:@+-]{0,511}", re.ASCII)
_PORT_RE = re.compile(r"[0-9]{1,5}", re.ASCII)
# tcp://HOST:PORT with a DNS name, an IPv4 address or a bracketed IPv6 address.
_TCP_UPSTREAM_RE = re.compile(
    r"tcp://(?:[A-Za-z0-9](?:[-A-Za-z0-9.]{0,251}[A-Za-z0-9])?|\[[0-9A-Fa-f:.]{2,45}\]):([0-9]{1,5})", re.ASCII
)
# A Secret name: a DNS subdomain (RFC 1123), as the API server checks it.
_SECRET_NAME_RE = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?", re.ASCII)
# What may follow an allow-list prefix, in the image reference grammar of distribution/reference
# (what containerd and CRI-O parse): path components, then a tag, then a digest. Stricter than
# _IMAGE_RE on purpose, so "registry/shardcache/*" cannot be stretched by "registry/shardcache/../x".
_PATH_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_TAG = r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}"
_DIGEST = r"[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}"
_AFTER_PREFIX = {
    "/": re.compile(rf"{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*(?::{_TAG})?(?:@{_DIGEST})?", re.ASCII),
    ":": re.compile(rf"{_TAG}(?:@{_DIGEST})?", re.ASCII),
    "@": re.compile(_DIGEST, re.ASCII),
}
# Longest annotation value quoted back in an error (CLI line, webhook warning).
_SHOWN_CHARS = 60
_MEMORY_UNITS = {
    None: 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
}

# Workload kinds whose pod template sits at a fixed path: (API group, kind) -> path to the template.
_TEMPLATE_PATHS: dict[tuple[str, str], tuple[str, ...]] = {
    ("apps", "Deployment"): ("spec", "template"),
    ("apps", "StatefulSet"): ("spec", "template"),
    ("apps", "DaemonSet"): ("spec", "template"),
    ("apps", "ReplicaSet"): ("spec", "template"),
    ("", "ReplicationController"): ("spec", "template"),
    ("batch", "Job"): ("spec", "template"),
    ("batch", "CronJob"): ("spec", "jobTemplate", "spec", "template"),
}
# Kubeflow training operators (PyTorchJob, TFJob, MPIJob, XGBoostJob, PaddleJob, JAXJob...) all
# hold `spec.<x>ReplicaSpecs.<Role>.template`.
_KUBEFLOW_GROUP = "kubeflow.org"
_REPLICA_SPECS_SUFFIX = "ReplicaSpecs"


class InjectionError(SidecarError, ValueError):
    """The object cannot be injected as it is: malformed, conflicting, or a bad annotation.

    The message names the field and says what to change.
    """


@dataclass(frozen=True)
class InjectConfig:
    """How the sidecar is injected; built once from flags (CLI) or chart values (webhook).

    Per-pod annotations (``shardcache.io/*``) override the mode, image, resources, port,
    short-circuit reads and pod cache size.
    """

    mode: Mode = "hostpath"
    """How the sidecar reaches the node daemon (:data:`MODES`); a pod's ``shardcache.io/mode``
    annotation wins. The webhook sets it per namespace (the path it is called on)."""

    image: str = DEFAULT_IMAGE
    """Sidecar container image."""
    image_pull_policy: str = "IfNotPresent"
    """imagePullPolicy of the sidecar container."""
    native_sidecar: bool = True
    """Inject as a native sidecar (init container with ``restartPolicy: Always``, Kubernetes
    >= 1.29) so Jobs complete when the trainer exits; False injects a regular container first in
    ``containers`` (older clusters; a Job's pod then only ends when the sidecar is stopped)."""
    port: int = 8600
    """Port of the sidecar's localhost endpoint (``SHARDCACHE_ENDPOINT``)."""
    socket_host_dir: str = "/run/shardcache"
    """Host directory holding the node daemon's unix sockets (``daemon.sock``, ``handles.sock``);
    hostpath mode mounts it read-only into the sidecar."""
    restricted_upstream: str = DEFAULT_RESTRICTED_UPSTREAM
    """``tcp://HOST:PORT`` of the node daemon for restricted-mode sidecars: a Service with
    ``internalTrafficPolicy: Local`` selecting the daemons, so each pod reaches its own node's."""
    short_circuit: bool = True
    """Short-circuit reads by file handle (hostpath mode): the sidecar serves descriptors of
    authorized cache entries on a pod-local socket, the app containers get ``SHARDCACHE_HANDLES``.
    A pod may turn them off (``shardcache.io/short-circuit: "false"``), never on."""
    pod_cache_size: str = "10Gi"
    """sizeLimit of the emptyDir used when the node has no daemon (standalone sidecar cache)."""
    cpu_request: str | None = "100m"
    """Sidecar CPU request (Kubernetes quantity), None for none."""
    cpu_limit: str | None = None
    """Sidecar CPU limit, None for none (a throttled cache slows every read)."""
    memory_request: str | None = "256Mi"
    """Sidecar memory request."""
    memory_limit: str | None = "1Gi"
    """Sidecar memory limit."""
    startup_timeout_seconds: int = 120
    """How long the app containers wait for the sidecar to become ready before starting anyway."""
    env: tuple[tuple[str, str], ...] = ()
    """Extra environment of the sidecar, e.g. ``AWS_ENDPOINT_URL`` so that its standalone cache
    (node without a daemon) reads the same object store as the daemons."""
    allowed_sidecar_images: tuple[str, ...] = ()
    """Images the ``shardcache.io/sidecar-image`` annotation may choose, besides ``image`` (always
    allowed). The sidecar mounts the node's socket directory, which every pod on the node connects
    through, so its image is not the pod author's choice: any other annotated image is ignored
    with a warning and ``image`` is used. Each entry is an exact reference
    (``mirror.local/shardcache:0.1.0``, compared as a string: ``shardcache:1`` and
    ``docker.io/library/shardcache:1`` are different entries), or a prefix ending in ``/*`` (any
    image under that path), ``:*`` (any tag of that repository) or ``@*`` (any digest of it).
    Empty: only ``image``."""
    socket_group: int | None = SOCKET_GID
    """The node daemon's ``--socket-group``: a hostpath-mode sidecar runs with it as its group
    (``securityContext.runAsGroup``: the sidecar's only, not the pod's ``supplementalGroups``,
    which would put every container of the pod in it), so that it may connect to the daemon's
    0660 sockets. None: the sidecar keeps its image's group (a daemon whose sockets are 0666)."""
    master_token_secret: str | None = CHART_MASTER_TOKEN_SECRET
    """Name of a Secret in the pod's own namespace whose key ``token`` the app containers get as
    ``SHARDCACHE_MASTER_TOKEN`` (an optional reference: without that Secret the variable is not
    set and the pod starts as before). None: no such variable. The default is the chart's Secret
    for a release named shardcache, so that ``shardcache inject`` with no flags gives what the
    chart's webhook gives."""
    hostpath_forbidden: bool = False
    """The pod's namespace enforces Pod Security ``baseline`` or ``restricted``, which refuse every
    hostPath volume: pods are injected in restricted mode whatever the pod or the configuration
    asks (a pod asking for hostpath gets a warning that says why), and a pod that already carries
    a hostpath-mode sidecar is refused with the fix, rather than by Pod Security with none. The
    webhook sets it on the chart's entry for such namespaces (``/mutate/pod-security``)."""

    def __post_init__(self) -> None:
        # Fail at startup (CLI flags, webhook flags) rather than on the first pod.
        _check_image(self.image, "sidecar image")
        _check_port(self.port, "sidecar port")
        _check_quantity(self.pod_cache_size, _MEMORY_RE, "pod cache size")
        for name in ("cpu_request", "cpu_limit"):
            value = getattr(self, name)
            if value is not None:
                _check_quantity(value, _CPU_RE, name.replace("_", " "))
        for name in ("memory_request", "memory_limit"):
            value = getattr(self, name)
            if value is not None:
                _check_quantity(value, _MEMORY_RE, name.replace("_", " "))
        if self.image_pull_policy not in {"Always", "IfNotPresent", "Never"}:
            raise InjectionError(
                f"invalid image pull policy {self.image_pull_policy!r}: use Always, IfNotPresent or Never"
            )
        if self.mode not in MODES:
            raise InjectionError(f"invalid mode {shown(self.mode)}: use {' or '.join(MODES)}")
        if not isinstance(self.socket_host_dir, str) or not self.socket_host_dir.startswith("/") or "\0" in self.socket_host_dir:
            raise InjectionError(f"socket host dir {shown(self.socket_host_dir)} must be an absolute path")
        upstream = _TCP_UPSTREAM_RE.fullmatch(self.restricted_upstream) if isinstance(self.restricted_upstream, str) else None
        if upstream is None or not 1 <= int(upstream.group(1)) <= 65535:
            raise InjectionError(
                f"invalid restricted upstream {shown(self.restricted_upstream)}: expected tcp://HOST:PORT, e.g. "
                f"{DEFAULT_RESTRICTED_UPSTREAM} (the chart's node-local Service)"
            )
        if not 1 <= self.startup_timeout_seconds <= 3600:
            raise InjectionError("startup timeout must be between 1 and 3600 seconds")
        for name, _ in self.env:
            if not isinstance(name, str) or not _ENV_NAME_RE.fullmatch(name):
                raise InjectionError(f"invalid sidecar environment variable name {shown(name)}")
        for entry in self.allowed_sidecar_images:
            _check_allowed_image(entry)
        if self.socket_group is not None and (
            isinstance(self.socket_group, bool) or not isinstance(self.socket_group, int)
            or not 0 <= self.socket_group <= MAX_GID
        ):
            raise InjectionError(
                f"invalid socket group {shown(self.socket_group)}: expected the node daemon's --socket-group, a "
                f"numeric group id from 0 to {MAX_GID} (the chart's is {SOCKET_GID})"
            )
        if self.master_token_secret is not None and (
            not isinstance(self.master_token_secret, str) or not _SECRET_NAME_RE.fullmatch(self.master_token_secret)
        ):
            raise InjectionError(
                f"invalid master token Secret name {shown(self.master_token_secret)}: expected a Kubernetes "
                "object name like shardcache-master-token (lower case letters, digits, '-' and '.')"
            )


@dataclass(frozen=True)
class Outcome:
    """What :func:`inject` did to one object, for logs, CLI reports and webhook metrics."""

    kind: str
    """Object kind (``Pod``, ``Deployment``, ``PyTorchJob``...)."""
    name: str
    """``namespace/name`` or ``name`` (``generateName*`` for pods not yet named)."""
    result: Literal["injected", "unchanged", "skipped", "unsupported"]
    """injected: something was added; unchanged: already injected; skipped: not opted in;
    unsupported: not a kind that holds pods."""
    reason: str = ""
    """Why, in a few words (for skipped and unsupported)."""
    templates: int = 0
    """Pod templates changed."""
    warnings: tuple[str, ...] = ()
    """What was ignored while injecting (an annotation naming an image that is not allowed), one
    line each, naming the field; the CLI prints them, the webhook answers them to kubectl."""

    def describe(self) -> str:
        text = f"{self.kind.lower()}/{self.name}: {self.result}"
        return f"{text} ({self.reason})" if self.reason else text


# ----------------------------------------------------------------------------- the function


def inject(obj: Any, config: InjectConfig, *, require_label: bool = True) -> tuple[Any, Outcome]:
    """Return ``(injected copy of obj, outcome)``; ``obj`` itself is never modified.

    ``require_label=True`` (the webhook) injects only pod templates labelled
    ``shardcache.io/inject: "true"`` (for workloads the label may also sit on the workload's own
    metadata). ``require_label=False`` (``shardcache inject``: running the command is the opt-in)
    injects every pod template except those labelled ``"false"``.

    Raises :class:`InjectionError` for a malformed object, a conflicting pod or a bad annotation.
    """
    if not isinstance(obj, Mapping):
        raise InjectionError(f"expected a Kubernetes object (a mapping), got {type(obj).__name__}")
    kind = obj.get("kind")
    api_version = obj.get("apiVersion")
    if not isinstance(kind, str) or not kind or not isinstance(api_version, str) or not api_version:
        raise InjectionError("object has no apiVersion/kind: is this a Kubernetes manifest?")
    meta = obj.get("metadata")
    name = _display_name(meta if isinstance(meta, Mapping) else {})
    if not is_supported(api_version, kind):
        return obj, Outcome(kind, name, "unsupported", "holds no pod template")
    if meta is not None:
        _mapping(meta, "metadata")

    made_by = _controller(meta if isinstance(meta, Mapping) else {})
    if made_by is not None and kind != "Pod":
        # A controller made this object from its own template, and may compare the two: the
        # deployment controller looks for a ReplicaSet whose template equals the Deployment's,
        # and a ReplicaSet injected behind its back is a "hash collision" that makes it create
        # another, for ever (seen on a real cluster: 153 ReplicaSets in 40 s). The owner's
        # template is the one to inject; otherwise the pods are, when they are created.
        return obj, Outcome(kind, name, "skipped", f"made by its controller {made_by}: inject that, or let its pods be injected")
    if made_by is not None and _has_sidecar(obj):
        # Made by a controller from a template that was injected: the pod is what its template
        # says, under whatever configuration injected it; injecting it again (under a changed
        # configuration) would make it differ from its template and its siblings.
        return obj, Outcome(kind, name, "skipped", f"made by its controller {made_by} from an injected template")

    result = copy.deepcopy(dict(obj))
    owner_labels = _string_map(result.get("metadata") or {}, "labels", "metadata")
    changed = 0
    skipped: list[str] = []
    warnings: list[str] = []
    seen = 0
    for where, template in _pod_templates(result, api_version, kind):
        seen += 1
        template_meta = template.setdefault("metadata", {})
        if template_meta is None:
            template_meta = template["metadata"] = {}
        _mapping(template_meta, f"{where}metadata")
        labels = _string_map(template_meta, "labels", f"{where}metadata")
        value = labels.get(INJECT_LABEL, owner_labels.get(INJECT_LABEL) if where else None)
        if value != "true" and (require_label or value is not None):
            skipped.append(f"label {INJECT_LABEL} is {shown(value)}" if value is not None else f"no {INJECT_LABEL}=true label")
            continue
        if _inject_template(template, config, where, warnings):
            changed += 1
    if seen == 0:
        raise InjectionError(f"{kind} {name} has no pod template to inject")
    if changed:
        return result, Outcome(kind, name, "injected", templates=changed, warnings=tuple(warnings))
    if len(skipped) == seen:
        return obj, Outcome(kind, name, "skipped", skipped[0])
    return obj, Outcome(kind, name, "unchanged", "already injected")


def _controller(meta: Mapping[str, Any]) -> str | None:
    """``"Kind name"`` of the object's managing controller (the ownerReference with
    ``controller: true``), None if it has none."""
    refs = meta.get("ownerReferences")
    if not isinstance(refs, list):
        return None
    for ref in refs:
        if isinstance(ref, Mapping) and ref.get("controller") is True:
            return f"{_printable_name(ref.get('kind'))} {_printable_name(ref.get('name'))}"
    return None


def _printable_name(value: Any) -> str:
    return value if isinstance(value, str) and value.isprintable() and len(value) <= 253 else shown(value)


def _has_sidecar(pod: Mapping[str, Any]) -> bool:
    spec = pod.get("spec")
    if not isinstance(spec, Mapping):
        return False
    lists = [spec.get(key) for key in ("initContainers", "containers")]
    return any(isinstance(c, Mapping) and c.get("name") == SIDECAR_NAME for items in lists if isinstance(items, list) for c in items)


def guard_ephemeral_containers(pod: Any) -> tuple[Any, Outcome]:
    """The rule of :func:`_read_only_ours` for ephemeral containers (``kubectl debug`` adds them
    to a running pod through ``pods/ephemeralcontainers``): their mounts of the sidecar's volumes
    become read-only. Returns ``(pod or a changed copy, outcome)``; ``pod`` is never modified."""
    if not isinstance(pod, Mapping):
        raise InjectionError(f"expected a Pod (a mapping), got {type(pod).__name__}")
    meta = pod.get("metadata")
    name = _display_name(meta if isinstance(meta, Mapping) else {})
    result = copy.deepcopy(dict(pod))
    spec = _mapping(result.get("spec"), "spec")
    containers = _named_list(spec, "ephemeralContainers", "spec")
    warnings: list[str] = []
    _read_only_ours([(f"spec.ephemeralContainers[{i}]", c) for i, c in enumerate(containers)], warnings)
    if not warnings:
        return pod, Outcome("Pod", name, "unchanged", "no ephemeral container mounts the sidecar's volumes writable")
    return result, Outcome("Pod", name, "injected", templates=1, warnings=tuple(warnings))


def is_supported(api_version: str, kind: str) -> bool:
    """Whether objects of this apiVersion/kind hold pod templates that :func:`inject` handles."""
    group = api_version.rpartition("/")[0]
    if group == "" and kind == "Pod":
        return True
    if (group, kind) in _TEMPLATE_PATHS:
        return True
    return group == _KUBEFLOW_GROUP and kind.endswith("Job")


def _pod_templates(obj: dict[str, Any], api_version: str, kind: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Yield (field path prefix for messages, pod template dict) pairs; "" for a bare Pod."""
    group = api_version.rpartition("/")[0]
    if group == "" and kind == "Pod":
        yield "", obj
        return
    path = _TEMPLATE_PATHS.get((group, kind))
    if path is not None:
        node: Any = obj
        walked = ""
        for key in path:
            node = _mapping(node, walked.rstrip(".") or "object").get(key)
            walked += f"{key}."
            if node is None:
                raise InjectionError(f"{kind}: {walked.rstrip('.')} is missing")
        yield walked, _mapping(node, walked.rstrip("."))
        return
    # Kubeflow: every `spec.*ReplicaSpecs` map of role -> replica spec.
    spec = _mapping(obj.get("spec"), "spec")
    for key in sorted(k for k in spec if isinstance(k, str) and k.endswith(_REPLICA_SPECS_SUFFIX)):
        roles = _mapping(spec[key], f"spec.{key}")
        for role in sorted(roles, key=str):
            replica = _mapping(roles[role], f"spec.{key}.{role}")
            where = f"spec.{key}.{role}.template."
            template = replica.get("template")
            if template is None:
                raise InjectionError(f"{kind}: {where.rstrip('.')} is missing")
            yield where, _mapping(template, where.rstrip("."))


def _resolve(config: InjectConfig, annotations: Mapping[str, str], where: str, warnings: list[str]) -> InjectConfig:
    """Apply ``shardcache.io/*`` annotations; a bad value raises with the annotation's name, an
    image that is not allowed is ignored with a line in ``warnings``."""
    changes: dict[str, Any] = {}
    prefix = f"{where}metadata.annotations[{{}}]"

    def bad(key: str, expected: str) -> InjectionError:
        return InjectionError(f"{prefix.format(key)}: invalid value {shown(annotations[key])}: {expected}")

    if ANN_IMAGE in annotations:
        image = annotations[ANN_IMAGE]
        if not _IMAGE_RE.fullmatch(image):
            raise bad(ANN_IMAGE, "expected an image reference like ghcr.io/shardcache/shardcache:0.1.0")
        if image_allowed(image, config):
            changes["image"] = image
        else:
            # Not an error: the pod still gets a working sidecar, only not the image it asked for.
            warnings.append(
                f"{where}annotation {ANN_IMAGE} {shown(image)} ignored: not on the allow-list "
                f"(webhook.allowedSidecarImages, --allow-sidecar-image); the sidecar runs {config.image}"
            )
    if ANN_PORT in annotations:
        raw = annotations[ANN_PORT].strip()
        if not _PORT_RE.fullmatch(raw) or not 1 <= int(raw) <= 65535:
            raise bad(ANN_PORT, "expected a port number between 1 and 65535")
        changes["port"] = int(raw)
    mode = config.mode
    if ANN_MODE in annotations:
        raw = annotations[ANN_MODE].strip().lower()
        if raw not in MODES:
            raise bad(ANN_MODE, f"expected {' or '.join(MODES)}")
        mode = changes["mode"] = raw
    if config.hostpath_forbidden and mode != "restricted":
        if ANN_MODE in annotations:
            warnings.append(
                f"{where}annotation {ANN_MODE} {shown(annotations[ANN_MODE])} ignored: this namespace enforces Pod "
                "Security baseline or restricted, which refuse the hostPath that hostpath mode needs, so the sidecar "
                f"runs in restricted mode; remove the annotation, or inject where {ANN_MODE}: hostpath is allowed"
            )
        mode = changes["mode"] = "restricted"
    if ANN_SHORT_CIRCUIT in annotations:
        raw = annotations[ANN_SHORT_CIRCUIT].strip().lower()
        if raw not in {"true", "false"}:
            raise bad(ANN_SHORT_CIRCUIT, 'expected "true" or "false"')
        if raw == "true" and mode == "restricted":
            # Handles travel over the node's socket directory, which a restricted pod does not mount.
            warnings.append(
                f"{where}annotation {ANN_SHORT_CIRCUIT} \"true\" ignored: restricted mode has no short-circuit "
                f"reads (they need the node's socket directory); set {ANN_MODE}: hostpath where hostPath is allowed"
            )
        elif raw == "true" and not config.short_circuit:
            # The cluster turned short-circuit reads off: a pod may only turn them off, never on.
            warnings.append(
                f"{where}annotation {ANN_SHORT_CIRCUIT} \"true\" ignored: short-circuit reads are off on this "
                "cluster (webhook.sidecar.shortCircuit, --no-short-circuit)"
            )
        else:
            changes["short_circuit"] = raw == "true"
    if ANN_POD_CACHE_SIZE in annotations:
        if not _MEMORY_RE.fullmatch(annotations[ANN_POD_CACHE_SIZE]):
            raise bad(ANN_POD_CACHE_SIZE, "expected a size like 20Gi")
        changes["pod_cache_size"] = annotations[ANN_POD_CACHE_SIZE]
    for key, attr, pattern, example in (
        (ANN_CPU_REQUEST, "cpu_request", _CPU_RE, "500m"),
        (ANN_CPU_LIMIT, "cpu_limit", _CPU_RE, "2"),
        (ANN_MEMORY_REQUEST, "memory_request", _MEMORY_RE, "512Mi"),
        (ANN_MEMORY_LIMIT, "memory_limit", _MEMORY_RE, "2Gi"),
    ):
        if key in annotations:
            raw = annotations[key].strip()
            if raw == "":
                changes[attr] = None  # empty value: no request/limit of that kind
            elif not pattern.fullmatch(raw):
                raise bad(key, f'expected a Kubernetes quantity like {example}, or "" for none')
            else:
                changes[attr] = raw
    resolved = replace(config, **changes) if changes else config
    request, limit = resolved.memory_request, resolved.memory_limit
    if request is not None and limit is not None and _memory_bytes(request) > _memory_bytes(limit):
        raise InjectionError(f"{where}sidecar memory request {request} is above its limit {limit}: raise the limit")
    return resolved


def _inject_template(template: dict[str, Any], config: InjectConfig, where: str, warnings: list[str]) -> bool:
    """Bring one pod template (``{"metadata": ..., "spec": ...}``) to the injected state.

    Mutates ``template`` (a private deep copy); returns whether anything changed. What was
    ignored on the way is appended to ``warnings``.
    """
    meta = template["metadata"]
    annotations = _string_map(meta, "annotations", f"{where}metadata")
    ignored: list[str] = []
    effective = _resolve(config, annotations, where, ignored)
    spec = template.get("spec")
    if spec is None:
        raise InjectionError(f"{where}spec is missing")
    spec = _mapping(spec, f"{where}spec")
    if spec.get("hostNetwork") is True:
        raise InjectionError(
            f"{where}spec.hostNetwork is true: the sidecar's localhost port would be the node's; "
            f"point {ENDPOINT_ENV} at the node daemon instead and remove the {INJECT_LABEL} label"
        )
    containers = _container_list(spec, "containers", where, required=True)
    init_containers = _container_list(spec, "initContainers", where, required=False)
    volumes = _named_list(spec, "volumes", where)

    before = copy.deepcopy(template)
    sidecar_at = _find(init_containers, SIDECAR_NAME)
    present = init_containers[sidecar_at] if sidecar_at is not None else (
        containers[found] if (found := _find(containers, SIDECAR_NAME)) is not None else None
    )
    if present is not None and not _our_sidecar_image(present.get("image"), config):
        # A container written by hand under the sidecar's name would get the node daemon's socket
        # (and the pod's handles) with whatever it runs: only the sidecar's own image may.
        raise InjectionError(
            f"{where}a container named {SIDECAR_NAME!r} runs image {shown(present.get('image'))}, which is not the "
            f"shardcache sidecar's ({config.image}, any tag of it, or webhook.allowedSidecarImages): rename that "
            "container (the webhook adds the sidecar itself), or use the shardcache.io/sidecar-image annotation"
        )
    if present is None:
        _check_conflicts(containers + init_containers, volumes, effective, where)
        sidecar = _sidecar(effective)
        # Only the sidecar created now runs the image we chose: a pod that already has one (a
        # second webhook call) needs no second warning.
        warnings.extend(ignored)
        if effective.native_sidecar:
            sidecar_at = 0
            init_containers.insert(0, sidecar)
            spec["initContainers"] = init_containers
        else:
            containers.insert(0, sidecar)
    native = sidecar_at is not None
    if sidecar_at is not None:
        sidecar_container = init_containers[sidecar_at]
    else:
        sidecar_container = containers[_find(containers, SIDECAR_NAME) or 0]
    # The sidecar in the pod (ours from a first pass, or one written by hand) decides whether the
    # app containers get handles: never a socket address that nothing serves, and never the pod
    # socket for a sidecar injected in restricted mode, whatever this pass's configuration says.
    handles = _handles_url() in _string_list(sidecar_container.get("args"))
    if effective.hostpath_forbidden and any(
        m.get("name") == VOLUME_SOCKET for m in _named_list(sidecar_container, "volumeMounts", f"{where}container {SIDECAR_NAME}")
    ):
        # The fix first: the webhook's warning is cut at 256 characters.
        raise InjectionError(
            f"{where}inject with `shardcache inject --mode restricted` (or let the webhook inject): the sidecar is in "
            "hostpath mode, whose hostPath this namespace's Pod Security (baseline or restricted) refuses"
        )
    others = [(f"{where}spec.containers[{i}]", c) for i, c in enumerate(containers) if c.get("name") != SIDECAR_NAME]
    others += [(f"{where}spec.initContainers[{i}]", c) for i, c in enumerate(init_containers) if c.get("name") != SIDECAR_NAME]
    _read_only_ours(others, warnings)

    # App containers: every regular container, and the init containers that start after a native
    # sidecar (they can use the cache too). Init containers before it run without the sidecar.
    apps = [(f"{where}spec.containers[{i}]", c) for i, c in enumerate(containers) if c.get("name") != SIDECAR_NAME]
    if sidecar_at is not None:
        apps += [(f"{where}spec.initContainers[{i}]", c) for i, c in enumerate(init_containers) if i > sidecar_at]
    for label, container in apps:
        _inject_app_container(container, effective, label, handles=handles)
    _share_credentials(sidecar_container, apps, where)
    # After the credentials, so that a sidecar that already had them (a second pass, or an older
    # injection) only gains this one entry at the end of its env.
    sidecar_env = _named_list(sidecar_container, "env", f"{where}container {SIDECAR_NAME}")
    _add_node_env(sidecar_env)
    sidecar_container["env"] = sidecar_env
    _join_socket_group(sidecar_container, effective, where)

    # Our volumes, each only where the sidecar mounts it (and the pod socket for the handles the
    # app containers connect to): a restricted sidecar has no socket mount, so its pod never gets
    # the hostPath, whatever another container names; one written by hand gets only what it uses.
    mounted = {m.get("name") for m in _named_list(sidecar_container, "volumeMounts", f"{where}container {SIDECAR_NAME}")}
    if handles:
        mounted.add(VOLUME_POD_SOCKET)
    for volume in _volumes(effective):
        if volume["name"] in mounted and _find(volumes, volume["name"]) is None:
            volumes.append(volume)
    if volumes:
        spec["volumes"] = volumes

    labels = meta.setdefault("labels", {})
    labels[INJECT_LABEL] = "true"
    ann = meta.setdefault("annotations", {})
    ann.setdefault(STATUS_ANNOTATION, "native-sidecar" if native else "container")
    return template != before


def _check_conflicts(containers: list[dict[str, Any]], volumes: list[dict[str, Any]], config: InjectConfig, where: str) -> None:
    for volume in volumes:
        if volume.get("name") in OUR_VOLUMES:
            raise InjectionError(
                f"{where}spec.volumes: a volume named {shown(volume['name'])} exists but the {SIDECAR_NAME!r} "
                "sidecar does not: rename the volume (the shardcache-* names are reserved)"
            )
    for container in containers:
        for port in container.get("ports") or []:
            if isinstance(port, Mapping) and port.get("containerPort") == config.port:
                raise InjectionError(
                    f"{where}container {shown(container.get('name'))} uses port {config.port}, the sidecar's port: "
                    f"set the annotation {ANN_PORT} to a free port"
                )


def _read_only_ours(containers: list[tuple[str, dict[str, Any]]], warnings: list[str]) -> None:
    """Every mount of one of our volumes by a container other than the sidecar becomes read-only.

    The sidecar's volumes are ours to write: ``shardcache-socket`` is the node's socket directory
    (a writable mount could replace the socket every pod on the node connects through), the pod
    socket holds the sidecar's handles socket, the pod cache its entries. A container that names
    one of them gets it because injection adds the volume for the sidecar, so whatever it declares
    (no readOnly, ``readOnly: false``, a volume it never declared), injection must not make it
    writable. Forced, not refused: under ``failurePolicy: Ignore`` a refused object is admitted
    unchanged, writable mount included, and on a later pass the volume is already in the pod.
    """
    for label, container in containers:
        for mount in _named_list(container, "volumeMounts", label):
            name = mount.get("name")
            if name in OUR_VOLUMES and mount.get("readOnly") is not True:
                mount["readOnly"] = True
                warnings.append(
                    f"{label} ({shown(container.get('name'))}) mounts the volume {name} writable: made read-only (it is "
                    f"the {SIDECAR_NAME} sidecar's{', the node daemon socket directory' if name == VOLUME_SOCKET else ''}; "
                    "reading needs no write access)"
                )


def _inject_app_container(container: dict[str, Any], config: InjectConfig, where: str, *, handles: bool) -> None:
    env = _named_list(container, "env", where)
    if _find(env, ENDPOINT_ENV) is None:  # a value the user set wins
        env.append({"name": ENDPOINT_ENV, "value": f"http://127.0.0.1:{config.port}"})
    if config.master_token_secret is not None and _find(env, MASTER_TOKEN_ENV) is None:
        # optional: the webhook cannot see whether the pod's namespace holds the Secret (it calls
        # no API), and a namespace without it must still start its pods.
        secret_ref = {"name": config.master_token_secret, "key": MASTER_TOKEN_KEY, "optional": True}
        env.append({"name": MASTER_TOKEN_ENV, "valueFrom": {"secretKeyRef": secret_ref}})
    if handles:
        mounts = _named_list(container, "volumeMounts", where)
        ours = {"name": VOLUME_POD_SOCKET, "mountPath": POD_SOCKET_MOUNT, "readOnly": True}
        # Read-only: connecting to a unix socket needs no write access, so nothing in the app
        # container can put a socket of its own where the sidecar's is.
        if not any(_normpath(str(m.get("mountPath", ""))) == POD_SOCKET_MOUNT or m.get("name") == VOLUME_POD_SOCKET for m in mounts):
            mounts.append(ours)
            container["volumeMounts"] = mounts
        # Only a container that sees the socket where the variable says; the user's value wins.
        sees = any(m.get("name") == VOLUME_POD_SOCKET and _normpath(str(m.get("mountPath", ""))) == POD_SOCKET_MOUNT for m in mounts)
        if sees and _find(env, HANDLES_ENV) is None:
            env.append({"name": HANDLES_ENV, "value": _handles_url()})
    _add_node_env(env)
    container["env"] = env


def _join_socket_group(sidecar: dict[str, Any], config: InjectConfig, where: str) -> None:
    """A sidecar that mounts the node's socket directory runs in the sockets' group. Converging:
    a sidecar injected before the daemon had ``--socket-group`` gets it on the next pass; a group
    already set (by hand, or a second pass) is left as it is."""
    mounts = _named_list(sidecar, "volumeMounts", f"{where}container {SIDECAR_NAME}")
    if config.socket_group is None or not any(m.get("name") == VOLUME_SOCKET for m in mounts):
        return
    security = sidecar.get("securityContext")
    if security is None:
        security = sidecar["securityContext"] = {}
    security = _mapping(security, f"{where}container {SIDECAR_NAME} securityContext")
    security.setdefault("runAsGroup", config.socket_group)


def _add_node_env(env: list[dict[str, Any]]) -> None:
    """Append ``SHARDCACHE_NODE`` from ``spec.nodeName`` unless the container sets it (the user's
    value, or a fieldRef of their own, wins); appended like the other variables, so the webhook's
    patch only adds."""
    if _find(env, NODE_ENV) is None:
        env.append({"name": NODE_ENV, "valueFrom": {"fieldRef": {"fieldPath": NODE_FIELD_PATH}}})


def _handles_url() -> str:
    return f"unix://{POD_SOCKET_MOUNT}/{HANDLES_NAME}"


def _string_list(value: Any) -> list[str]:
    return [item for item in value if isinstance(item, str)] if isinstance(value, list) else []


def _share_credentials(sidecar: dict[str, Any], apps: list[tuple[str, dict[str, Any]]], where: str) -> None:
    """Give the sidecar the AWS credentials of the first app container in ``apps`` ((field path,
    container) pairs, regular containers first) that has any.

    Why copy rather than rely on the credential webhooks: EKS's pod-identity webhook (IRSA, Pod
    Identity) mutates only the containers present when it runs, and the order of mutating webhooks
    is not guaranteed, so when it runs before ours only the app containers hold the role and the
    token mount. When it runs after ours it mutates the sidecar itself, whose names are then set
    and nothing is copied. Another webhook that adds credentials to the app containers after ours
    gets them copied on reinvocation (``reinvocationPolicy: IfNeeded``).

    One source container, so the sidecar never mixes one container's key id with another's secret.
    Only names and mount paths the sidecar does not already have are added (a choice already made
    for the sidecar wins, and a second pass adds nothing); everything is appended, so the webhook's
    JSON patch only adds.
    """
    found = next(((label, c) for label, c in apps if _has_credentials(c, label)), None)
    if found is None:
        return
    label, source = found
    env = _named_list(source, "env", label)
    credential_env = [e for e in env if e.get("name") in AWS_CREDENTIAL_ENV]
    sidecar_env = _named_list(sidecar, "env", f"{where}container {SIDECAR_NAME}")
    for entry in credential_env:
        if _find(sidecar_env, entry["name"]) is None:
            sidecar_env.append(copy.deepcopy(entry))

    # envFrom: Secrets only, whole (keys cannot be picked from them). A ConfigMap holds the app's
    # settings, which may include its AWS_ENDPOINT_URL; the sidecar's own env always wins over
    # envFrom (Kubernetes' precedence), so the endpoint the chart gives the sidecar stays.
    secrets = [e for e in _named_list(source, "envFrom", label) if isinstance(e.get("secretRef"), Mapping)]
    if secrets:
        sidecar_from = _named_list(sidecar, "envFrom", f"{where}container {SIDECAR_NAME}")
        for entry in secrets:
            if not any(json_equal(entry, have) for have in sidecar_from):
                sidecar_from.append(copy.deepcopy(entry))
        sidecar["envFrom"] = sidecar_from

    mounts = [m for m in _named_list(source, "volumeMounts", label)
              if isinstance(m.get("name"), str) and isinstance(m.get("mountPath"), str)
              # $(VAR) in subPathExpr expands with the source's env, which the sidecar may lack.
              and "subPathExpr" not in m]
    wanted: list[dict[str, Any]] = [m for m in mounts if _normpath(m["mountPath"]) in AWS_TOKEN_DIRS]
    for entry in credential_env:
        if entry["name"] in _AWS_FILE_ENV and isinstance(entry.get("value"), str):
            holder = _mount_holding(mounts, entry["value"])
            if holder is not None:
                wanted.append(holder)
    named = {e["name"] for e in credential_env}
    if not named & {"AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"}:
        home = next((m for m in mounts if posixpath.basename(_normpath(m["mountPath"])) == _AWS_HOME_DIR), None)
        if home is not None:
            wanted.append(home)
            base = _normpath(home["mountPath"])
            for name, file in (("AWS_SHARED_CREDENTIALS_FILE", "credentials"), ("AWS_CONFIG_FILE", "config")):
                if _find(sidecar_env, name) is None:
                    sidecar_env.append({"name": name, "value": f"{base}/{file}"})
    if sidecar_env:
        sidecar["env"] = sidecar_env
    if wanted:
        sidecar_mounts = _named_list(sidecar, "volumeMounts", f"{where}container {SIDECAR_NAME}")
        for mount in wanted:
            path = _normpath(mount["mountPath"])
            if any(_normpath(str(m.get("mountPath", ""))) == path for m in sidecar_mounts):
                continue
            # Read-only, and no mountPropagation: the sidecar only reads tokens and credential files.
            copied = {"name": mount["name"], "mountPath": mount["mountPath"], "readOnly": True}
            if isinstance(mount.get("subPath"), str):
                copied["subPath"] = mount["subPath"]
            sidecar_mounts.append(copied)
        sidecar["volumeMounts"] = sidecar_mounts


def _has_credentials(container: dict[str, Any], where: str) -> bool:
    if any(e.get("name") in AWS_CREDENTIAL_ENV for e in _named_list(container, "env", where)):
        return True
    if any(isinstance(e.get("secretRef"), Mapping) for e in _named_list(container, "envFrom", where)):
        return True
    return any(
        isinstance(m.get("mountPath"), str)
        and (_normpath(m["mountPath"]) in AWS_TOKEN_DIRS or posixpath.basename(_normpath(m["mountPath"])) == _AWS_HOME_DIR)
        for m in _named_list(container, "volumeMounts", where)
    )


def _mount_holding(mounts: list[dict[str, Any]], file: str) -> dict[str, Any] | None:
    """The mount a file path lies in: the deepest mountPath that is the file or one of its parents."""
    if not file.startswith("/"):
        return None
    path = _normpath(file)
    best: dict[str, Any] | None = None
    for mount in mounts:
        root = _normpath(mount["mountPath"])
        if (path == root or path.startswith(root.rstrip("/") + "/")) and (best is None or len(root) > len(_normpath(best["mountPath"]))):
            best = mount
    return best


def _normpath(path: str) -> str:
    # posixpath.normpath keeps a leading "//"; Kubernetes paths do not mean anything by it.
    return "/" + posixpath.normpath(path).lstrip("/") if path.startswith("/") else posixpath.normpath(path)


def _sidecar(config: InjectConfig) -> dict[str, Any]:
    pod_cache_bytes = int(Decimal(_memory_bytes(config.pod_cache_size)) * POD_CACHE_FILL)
    ready = _probe_command(config.port)
    restricted = config.mode == "restricted"
    upstream = config.restricted_upstream if restricted else f"unix://{SOCKET_MOUNT}/{SOCKET_NAME}"
    args = [
        "serve",
        "--mode", "sidecar",
        "--upstream", upstream,
        "--listen", f"tcp://127.0.0.1:{config.port}",
        "--cache-dir", POD_CACHE_MOUNT,
        "--cache-size", str(pod_cache_bytes),
    ]
    mounts: list[dict[str, Any]] = []
    if not restricted:
        # Read-only: connecting to a unix socket needs no write access to its directory, and
        # a writable mount would let the sidecar replace daemon.sock, the socket every pod
        # on the node connects through. The sidecar creates nothing there (its cache is the
        # emptyDir below, its own sockets are in the pod socket emptyDir, it listens on TCP).
        mounts.append({"name": VOLUME_SOCKET, "mountPath": SOCKET_MOUNT, "readOnly": True})
    mounts.append({"name": VOLUME_POD_CACHE, "mountPath": POD_CACHE_MOUNT})
    if not restricted and config.short_circuit:
        # The node daemon's handles.sock is next to daemon.sock (the sidecar's default).
        args += ["--handles", _handles_url()]
        mounts.append({"name": VOLUME_POD_SOCKET, "mountPath": POD_SOCKET_MOUNT})
    security: dict[str, Any] = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    if restricted:
        # What Pod Security `restricted` asks of every container, set on ours so that the pod
        # passes where its own containers do; the pod-level securityContext is the pod author's.
        security.update({
            "runAsNonRoot": True,
            "runAsUser": RESTRICTED_UID,
            "runAsGroup": RESTRICTED_UID,
            "seccompProfile": {"type": "RuntimeDefault"},
        })
    container: dict[str, Any] = {
        "name": SIDECAR_NAME,
        "image": config.image,
        "imagePullPolicy": config.image_pull_policy,
        "command": ["shardcache"],
        "args": args,
        "ports": [{"name": "shardcache", "containerPort": config.port, "protocol": "TCP"}],
        # The sidecar listens on the pod's loopback only (the cache must not be reachable from
        # other pods), and the kubelet's httpGet probes come from the node's network namespace,
        # so the probes run inside the container.
        "readinessProbe": {"exec": {"command": ready}, "periodSeconds": 5, "timeoutSeconds": 3, "failureThreshold": 3},
        "resources": _resources(config),
        "securityContext": security,
        "volumeMounts": mounts,
    }
    if config.env:
        container["env"] = [{"name": name, "value": value} for name, value in config.env]
    if config.native_sidecar:
        container["restartPolicy"] = "Always"
        # The kubelet starts the next container only after a native sidecar's startup probe has
        # passed, so the trainer's first read already finds the cache endpoint up.
        container["startupProbe"] = {
            "exec": {"command": ready},
            "periodSeconds": 1,
            "timeoutSeconds": 3,
            "failureThreshold": config.startup_timeout_seconds,
        }
    else:
        # A regular container: the kubelet starts containers in order and waits for each
        # postStart hook, so blocking here (bounded) holds the app until the sidecar is ready.
        container["lifecycle"] = {"postStart": {"exec": {"command": _wait_command(config.port, config.startup_timeout_seconds)}}}
    return container


def _probe_command(port: int) -> list[str]:
    return [
        "python3",
        "-c",
        f"import urllib.request as u; u.urlopen('http://127.0.0.1:{port}/readyz', timeout=2)",
    ]


def _wait_command(port: int, timeout: int) -> list[str]:
    script = (
        "import time, urllib.request as u\n"
        f"deadline = time.monotonic() + {timeout}\n"
        "while time.monotonic() < deadline:\n"
        "    try:\n"
        f"        u.urlopen('http://127.0.0.1:{port}/readyz', timeout=2)\n"
        "        break\n"
        "    except Exception:\n"
        "        time.sleep(0.5)\n"
    )
    return ["python3", "-c", script]


def _resources(config: InjectConfig) -> dict[str, Any]:
    resources: dict[str, Any] = {}
    requests = {k: v for k, v in (("cpu", config.cpu_request), ("memory", config.memory_request)) if v is not None}
    limits = {k: v for k, v in (("cpu", config.cpu_limit), ("memory", config.memory_limit)) if v is not None}
    if requests:
        resources["requests"] = requests
    if limits:
        resources["limits"] = limits
    return resources


def _volumes(config: InjectConfig) -> list[dict[str, Any]]:
    """Every volume the sidecar or app containers may mount; only those mounted are added."""
    # DirectoryOrCreate: on a node without the daemon the pod still starts, the sidecar finds no
    # socket and runs as a standalone cache on its emptyDir.
    return [
        {"name": VOLUME_SOCKET, "hostPath": {"path": config.socket_host_dir, "type": "DirectoryOrCreate"}},
        {"name": VOLUME_POD_CACHE, "emptyDir": {"sizeLimit": config.pod_cache_size}},
        {"name": VOLUME_POD_SOCKET, "emptyDir": {"medium": "Memory", "sizeLimit": POD_SOCKET_SIZE}},
    ]


# ----------------------------------------------------------------------------- small checks


def _mapping(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise InjectionError(f"{where} must be an object, got {_type_name(value)}")
    return value


def _string_map(parent: Mapping[str, Any], key: str, where: str) -> dict[str, str]:
    value = parent.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise InjectionError(f"{where}.{key} must map strings to strings (quote values like \"true\")")
    return value


def _container_list(spec: dict[str, Any], key: str, where: str, *, required: bool) -> list[dict[str, Any]]:
    value = spec.get(key)
    if value is None and not required:
        return []
    if not isinstance(value, list) or (required and not value):
        raise InjectionError(f"{where}spec.{key} must be a non-empty list of containers")
    for index, item in enumerate(value):
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
            raise InjectionError(f"{where}spec.{key}[{index}] must be a container with a name")
    spec[key] = value
    return value


def _named_list(parent: dict[str, Any], key: str, where: str) -> list[dict[str, Any]]:
    value = parent.get(key)
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
        raise InjectionError(f"{where}.{key} must be a list of objects".replace("..", "."))
    return value


def _find(items: list[dict[str, Any]], name: str) -> int | None:
    for index, item in enumerate(items):
        if item.get("name") == name:
            return index
    return None


def _display_name(meta: Mapping[str, Any]) -> str:
    name = meta.get("name") or (f"{meta['generateName']}*" if meta.get("generateName") else "<unnamed>")
    namespace = meta.get("namespace")
    return f"{namespace}/{name}" if namespace else str(name)


def _type_name(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", type(None): "null", bool: "a boolean"}.get(
        type(value), type(value).__name__
    )


def _check_image(value: str, what: str) -> None:
    if not isinstance(value, str) or not _IMAGE_RE.fullmatch(value):
        raise InjectionError(f"invalid {what} {shown(value)}: expected an image reference like ghcr.io/shardcache/shardcache:0.1.0")


def image_allowed(image: str, config: InjectConfig) -> bool:
    """Whether ``shardcache.io/sidecar-image: image`` may be honoured under ``config``: the
    default image, an exact allow-list entry, or under a ``/*``, ``:*`` or ``@*`` prefix entry."""
    if image == config.image:
        return True
    for entry in config.allowed_sidecar_images:
        if not entry.endswith("*"):
            if image == entry:
                return True
            continue
        prefix = entry[:-1]
        rest = image[len(prefix):] if image.startswith(prefix) else None
        if rest is not None and _AFTER_PREFIX[prefix[-1]].fullmatch(rest):
            return True
    return False


def _repository(image: str) -> str:
    """``image`` without its tag and digest (a registry port's colon is not a tag's)."""
    name = image.split("@", 1)[0]
    slash = name.rfind("/")
    colon = name.rfind(":")
    return name[:colon] if colon > slash else name


def _our_sidecar_image(image: object, config: InjectConfig) -> bool:
    """Whether a sidecar already in a pod runs an image the injector may give the socket to: an
    allowed one (:func:`image_allowed`), or another tag or digest of the configured image (a
    template injected before an upgrade of the chart, injected again after it)."""
    if not isinstance(image, str) or not _IMAGE_RE.fullmatch(image):
        return False
    return image_allowed(image, config) or _repository(image) == _repository(config.image)


def _check_allowed_image(entry: str) -> None:
    if not isinstance(entry, str) or not entry:
        raise InjectionError(f"invalid allowed sidecar image {shown(entry)}: expected an image reference")
    if "*" in entry[:-1] or entry == "*" or (entry.endswith("*") and entry[-2:-1] not in ("/", ":", "@")):
        raise InjectionError(
            f"invalid allowed sidecar image {shown(entry)}: '*' is allowed only at the end, after '/', ':' or '@' "
            "(registry.example.com/shardcache/*, ghcr.io/shardcache/shardcache:*); to allow any image, list "
            "the registries instead"
        )
    _check_image(entry.removesuffix("*"), "allowed sidecar image")


def _check_port(value: int, what: str) -> None:
    if not isinstance(value, int) or not 1 <= value <= 65535:
        raise InjectionError(f"invalid {what} {value!r}: expected a port number between 1 and 65535")


def _check_quantity(value: str, pattern: re.Pattern[str], what: str) -> None:
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise InjectionError(f"invalid {what} {shown(value)}: expected a Kubernetes quantity like 500m, 2 or 10Gi")


def shown(value: Any) -> str:
    """A value quoted in an error: ASCII and one line (newlines and foreign digits visible as
    escapes), cut short so a hostile value is not echoed back whole."""
    text = ascii(value)
    return text if len(text) <= _SHOWN_CHARS else f"{text[:_SHOWN_CHARS]}...{text[-1]} ({len(str(value))} characters)"


def _memory_bytes(quantity: str) -> int:
    match = _MEMORY_RE.fullmatch(quantity)
    if not match:
        raise InjectionError(f"invalid size {quantity!r}")
    try:
        return int(Decimal(match.group(1)) * _MEMORY_UNITS[match.group(3)])
    except InvalidOperation as exc:  # pragma: no cover - the regex admits only decimals
        raise InjectionError(f"invalid size {quantity!r}") from exc


# ----------------------------------------------------------------------------- documents


def inject_documents(docs: list[Any], config: InjectConfig, *, require_label: bool = False) -> tuple[list[Any], list[Outcome]]:
    """Inject every document (and every item of a ``kind: List``); errors name the document."""
    out: list[Any] = []
    outcomes: list[Outcome] = []
    for index, doc in enumerate(docs, start=1):
        try:
            if isinstance(doc, Mapping) and doc.get("kind") == "List" and isinstance(doc.get("items"), list):
                items = []
                for item in doc["items"]:
                    new_item, outcome = inject(item, config, require_label=require_label)
                    items.append(new_item)
                    outcomes.append(outcome)
                out.append({**doc, "items": items})
                continue
            new_doc, outcome = inject(doc, config, require_label=require_label)
        except InjectionError as exc:
            raise InjectionError(f"document {index}: {exc}") from exc
        out.append(new_doc)
        outcomes.append(outcome)
    return out, outcomes
