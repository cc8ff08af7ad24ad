"""The Pod Security Standards, evaluated offline: what Pod Security admission would say of a pod.

Nothing the project can run offline evaluates Pod Security admission (kubectl, Helm and
kubernetes-validate check schemas, not policy), so the rules are written here, check by check,
after the reference implementation the API server runs: ``k8s.io/pod-security-admission``,
``policy/check_*.go`` at tag ``v0.36.2`` (Kubernetes 1.36). Each check keeps the reference's ID
(``hostPathVolumes``, ``runAsNonRoot``...), reads the fields it reads, with its exemptions
(Windows pods, ``hostUsers: false``) and its pod-level/container-level precedence, and every
version of it: :func:`check` takes the ``pod-security.kubernetes.io/enforce-version`` a
namespace pins (``v1.0`` .. :data:`VERSION`, or ``latest``), as the admission plugin does.

:func:`check` takes the pod's ``spec`` and ``metadata`` as plain mappings (decoded YAML or JSON,
a pod template's as well as a Pod's) and returns one :class:`Violation` per offending field, in
the reference's order (baseline checks by ID, then restricted checks by ID). An empty list means
the pod is admitted at that level. Two departures from the reference, both on the side of
refusing: where a check finds fields that are explicitly wrong *and* fields that are missing, the
reference names only the first kind until they are fixed, here both are listed; and a volume
naming a source this module does not know (or more than one source, which the API server
refuses anyway) fails ``restrictedVolumes`` rather than passing it.

Out of scope, as for the reference's checks: the admission configuration's exemptions (users,
runtime classes, namespaces) and what the API server does before admission (defaulting a
``hostNetwork`` pod's ``hostPort``\\ s, refusing schema-invalid pods).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "VERSION",
    "REFERENCE",
    "CHECK_LEVELS",
    "Level",
    "Violation",
    "check",
]

VERSION = "v1.36"
"""The newest Pod Security Standards version these checks implement (what ``latest`` means)."""

REFERENCE = "k8s.io/pod-security-admission v0.36.2 (policy/check_*.go)"
"""The implementation the rules were taken from."""

Level = Literal["privileged", "baseline", "restricted"]


@dataclass(frozen=True)
class Violation:
    """One field of a pod that the level forbids."""

    check: str
    """The check's ID in the reference implementation (``hostPathVolumes``, ``runAsNonRoot``...)."""
    path: str
    """The field, from the pod's root: ``spec.volumes[0].hostPath``,
    ``spec.containers[1].securityContext.runAsNonRoot`` (a field that must be set names where),
    ``metadata.annotations[container.apparmor.security.beta.kubernetes.io/app]``."""
    message: str
    """What is wrong and what to set instead."""


# ----------------------------------------------------------------------------- reading the pod


def _map(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _seq(value: Any) -> Sequence[Any]:
    return value if isinstance(value, list | tuple) else ()


def _text(value: Any) -> str:
    """A string field as the reference reads it: unset is "", anything else is compared as text."""
    if value is None:
        return ""
    return value if isinstance(value, str) else str(value)


def _is_zero(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float) and value == 0


@dataclass(frozen=True)
class _Container:
    path: str
    """``spec.containers[0]``"""
    name: str
    body: Mapping[str, Any]

    @property
    def context(self) -> Mapping[str, Any] | None:
        """securityContext, None where unset (the reference's ``SecurityContext == nil``)."""
        value = self.body.get("securityContext")
        return value if isinstance(value, Mapping) else None

    def field(self, rest: str) -> str:
        return f"{self.path}.securityContext.{rest}"

    @property
    def quoted(self) -> str:
        return f'container "{self.name}"'


@dataclass(frozen=True)
class _Pod:
    spec: Mapping[str, Any]
    annotations: Mapping[str, Any]
    containers: tuple[_Container, ...]
    """initContainers, containers, ephemeralContainers: the reference's visitContainers order."""

    @classmethod
    def of(cls, spec: Mapping[str, Any], metadata: Mapping[str, Any]) -> _Pod:
        containers = [
            _Container(f"spec.{kind}[{i}]", str(_map(c).get("name") or ""), _map(c))
            for kind in ("initContainers", "containers", "ephemeralContainers")
            for i, c in enumerate(_seq(spec.get(kind)))
        ]
        return cls(spec, _map(metadata.get("annotations")), tuple(containers))

    @property
    def context(self) -> Mapping[str, Any] | None:
        value = self.spec.get("securityContext")
        return value if isinstance(value, Mapping) else None

    @property
    def windows(self) -> bool:
        # 1.25+: restricted checks whose fields Windows pods cannot set exempt pods with
        # spec.os.name=windows (API validation refuses those fields there).
        return _map(self.spec.get("os")).get("name") == "windows"

    @property
    def user_namespace(self) -> bool:
        # relaxPolicyForUserNamespacePod: hostUsers explicitly false
        return self.spec.get("hostUsers") is False


_Found = Iterator[Violation]


# ----------------------------------------------------------------------------- baseline checks


_APPARMOR_ANNOTATION = "container.apparmor.security.beta.kubernetes.io/"


def _app_armor_profile(pod: _Pod, minor: int) -> _Found:
    """Baseline "AppArmor": appArmorProfile.type RuntimeDefault, Localhost or unset (pod and
    containers); annotations ``container.apparmor.security.beta.kubernetes.io/*`` empty,
    ``runtime/default`` or ``localhost/*``."""
    check = "appArmorProfile"

    def bad(profile: Any) -> str | None:
        kind = _map(profile).get("type")
        return None if kind in ("RuntimeDefault", "Localhost") else _text(kind)

    if pod.context is not None and pod.context.get("appArmorProfile") is not None:
        kind = bad(pod.context["appArmorProfile"])
        if kind is not None:
            yield Violation(
                check,
                "spec.securityContext.appArmorProfile.type",
                f'pod must not set AppArmor profile type to "{kind}": use RuntimeDefault or Localhost, or leave it unset',
            )
    for c in pod.containers:
        if c.context is not None and c.context.get("appArmorProfile") is not None:
            kind = bad(c.context["appArmorProfile"])
            if kind is not None:
                yield Violation(
                    check,
                    c.field("appArmorProfile.type"),
                    f'{c.quoted} must not set AppArmor profile type to "{kind}": use RuntimeDefault or Localhost, or leave it unset',
                )
    for key in sorted(k for k in pod.annotations if isinstance(k, str) and k.startswith(_APPARMOR_ANNOTATION)):
        value = _text(pod.annotations[key])
        if value and value != "runtime/default" and not value.startswith("localhost/"):
            yield Violation(
                check,
                f"metadata.annotations[{key}]",
                f'annotation {key}="{value}" is forbidden: use runtime/default or localhost/<profile>, or remove it',
            )


_DEFAULT_CAPABILITIES = frozenset(
    {
        "AUDIT_WRITE",
        "CHOWN",
        "DAC_OVERRIDE",
        "FOWNER",
        "FSETID",
        "KILL",
        "MKNOD",
        "NET_BIND_SERVICE",
        "SETFCAP",
        "SETGID",
        "SETPCAP",
        "SETUID",
        "SYS_CHROOT",
    }
)


def _capabilities_baseline(pod: _Pod, minor: int) -> _Found:
    """Baseline "Capabilities": capabilities.add only from the container runtime's default set
    (no NET_RAW, no SYS_ADMIN...)."""
    for c in pod.containers:
        if c.context is None or c.context.get("capabilities") is None:
            continue
        extra = sorted({_text(cap) for cap in _seq(_map(c.context["capabilities"]).get("add"))} - _DEFAULT_CAPABILITIES)
        if extra:
            yield Violation(
                "capabilities_baseline",
                c.field("capabilities.add"),
                f"{c.quoted} must not include {_quote(extra)} in securityContext.capabilities.add (non-default capabilities)",
            )


def _host_namespaces(pod: _Pod, minor: int) -> _Found:
    """Baseline "Host Namespaces": hostNetwork, hostPID, hostIPC unset or false."""
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.spec.get(field) is True:
            yield Violation("hostNamespaces", f"spec.{field}", f"pod must not set {field}=true (host namespaces)")


def _host_path_volumes(pod: _Pod, minor: int) -> _Found:
    """Baseline "HostPath Volumes": no volume with a hostPath."""
    for i, volume in enumerate(_seq(pod.spec.get("volumes"))):
        if _map(volume).get("hostPath") is not None:
            name = _map(volume).get("name") or ""
            yield Violation("hostPathVolumes", f"spec.volumes[{i}].hostPath", f'volume "{name}" must not be a hostPath volume')


def _host_ports(pod: _Pod, minor: int) -> _Found:
    """Baseline "Host Ports": ports[*].hostPort unset or 0."""
    for c in pod.containers:
        for i, port in enumerate(_seq(c.body.get("ports"))):
            host_port = _map(port).get("hostPort")
            if host_port is not None and not _is_zero(host_port):
                yield Violation("hostPorts", f"{c.path}.ports[{i}].hostPort", f"{c.quoted} must not use hostPort {host_port}")


def _host_probes_and_host_lifecycle(pod: _Pod, minor: int) -> _Found:
    """Baseline "Host Probes / Lifecycle Hooks" (v1.34+): httpGet.host and tcpSocket.host of
    the liveness, readiness and startup probes and of the postStart and preStop handlers unset
    or empty (tcpSocket is no lifecycle handler any more, but the field is still read)."""
    for c in pod.containers:
        lifecycle = _map(c.body.get("lifecycle"))
        handlers = [(name, _map(c.body.get(name))) for name in ("livenessProbe", "readinessProbe", "startupProbe")]
        handlers += [(f"lifecycle.{name}", _map(lifecycle.get(name))) for name in ("postStart", "preStop")]
        for where, handler in handlers:
            for action in ("httpGet", "tcpSocket"):
                host = _text(_map(handler.get(action)).get("host"))
                if host:
                    yield Violation(
                        "hostProbesAndHostLifecycle",
                        f"{c.path}.{where}.{action}.host",
                        f'{c.quoted} must not set {where}.{action}.host ("{host}"): leave it unset to reach the pod IP',
                    )


def _privileged(pod: _Pod, minor: int) -> _Found:
    """Baseline "Privileged Containers": securityContext.privileged unset or false."""
    for c in pod.containers:
        if c.context is not None and c.context.get("privileged") is True:
            yield Violation("privileged", c.field("privileged"), f"{c.quoted} must not set securityContext.privileged=true")


def _unmasked_proc(pod: _Pod, check: str) -> _Found:
    for c in pod.containers:
        if c.context is None or c.context.get("procMount") is None:
            continue
        value = c.context["procMount"]
        if value != "Default":
            yield Violation(
                check, c.field("procMount"), f'{c.quoted} must not set securityContext.procMount to "{value}": use Default or leave it unset'
            )


def _proc_mount(pod: _Pod, minor: int) -> _Found:
    """Baseline "/proc Mount Type": procMount unset or Default; v1.35+ any value in a user
    namespace (hostUsers: false)."""
    if minor >= 35 and pod.user_namespace:
        return
    yield from _unmasked_proc(pod, "procMount")


_SELINUX_TYPES = frozenset({"", "container_t", "container_init_t", "container_kvm_t"})
_SELINUX_TYPES_1_31 = _SELINUX_TYPES | {"container_engine_t"}


def _se_linux_options(pod: _Pod, minor: int) -> _Found:
    """Baseline "SELinux": seLinuxOptions.type unset, container_t, container_init_t,
    container_kvm_t (v1.31+: container_engine_t); user and role unset (pod and containers)."""
    allowed = _SELINUX_TYPES_1_31 if minor >= 31 else _SELINUX_TYPES
    setters: list[tuple[str, str, Mapping[str, Any] | None]] = [("pod", "spec.securityContext", pod.context)]
    setters += [(c.quoted, f"{c.path}.securityContext", c.context) for c in pod.containers]
    for who, base, context in setters:
        if context is None or context.get("seLinuxOptions") is None:
            continue
        options = _map(context["seLinuxOptions"])
        kind = _text(options.get("type"))
        if kind not in allowed:
            yield Violation(
                "seLinuxOptions",
                f"{base}.seLinuxOptions.type",
                f'{who} must not set securityContext.seLinuxOptions.type to "{kind}": use {_quote(sorted(allowed - {""}))} or leave it unset',
            )
        for field in ("user", "role"):
            if _text(options.get(field)):
                yield Violation("seLinuxOptions", f"{base}.seLinuxOptions.{field}", f"{who} must not set securityContext.seLinuxOptions.{field}")


_SECCOMP_POD_ANNOTATION = "seccomp.security.alpha.kubernetes.io/pod"
_SECCOMP_CONTAINER_ANNOTATION = "container.seccomp.security.alpha.kubernetes.io/"
_SECCOMP_TYPES = ("RuntimeDefault", "Localhost")


def _seccomp_fields(pod: _Pod, check: str, required: bool) -> _Found:
    """seccompProfile.type RuntimeDefault or Localhost where set; with ``required``, set on the
    pod or on every container (a container's own setting wins over the pod's)."""
    pod_set = False
    if pod.context is not None and pod.context.get("seccompProfile") is not None:
        kind = _map(pod.context["seccompProfile"]).get("type")
        if kind in _SECCOMP_TYPES:
            pod_set = True
        else:
            yield Violation(
                check,
                "spec.securityContext.seccompProfile.type",
                f'pod must not set securityContext.seccompProfile.type to "{_text(kind)}": use RuntimeDefault or Localhost',
            )
    for c in pod.containers:
        if c.context is not None and c.context.get("seccompProfile") is not None:
            kind = _map(c.context["seccompProfile"]).get("type")
            if kind not in _SECCOMP_TYPES:
                yield Violation(
                    check,
                    c.field("seccompProfile.type"),
                    f'{c.quoted} must not set securityContext.seccompProfile.type to "{_text(kind)}": use RuntimeDefault or Localhost',
                )
        elif required and not pod_set:
            yield Violation(
                check,
                c.field("seccompProfile.type"),
                f'pod or {c.quoted} must set securityContext.seccompProfile.type to "RuntimeDefault" or "Localhost"',
            )


def _seccomp_profile_baseline(pod: _Pod, minor: int) -> _Found:
    """Baseline "Seccomp": v1.19+ seccompProfile.type unset, RuntimeDefault or Localhost (pod
    and containers); before v1.19 the alpha annotations: runtime/default, docker/default or
    localhost/*."""
    if minor >= 19:
        yield from _seccomp_fields(pod, "seccompProfile_baseline", required=False)
        return
    keys = [_SECCOMP_POD_ANNOTATION] + [_SECCOMP_CONTAINER_ANNOTATION + c.name for c in pod.containers]
    for key in sorted(set(keys)):
        if key not in pod.annotations:
            continue
        value = _text(pod.annotations[key])
        if value not in ("runtime/default", "docker/default") and not value.startswith("localhost/"):
            yield Violation(
                "seccompProfile_baseline",
                f"metadata.annotations[{key}]",
                f'annotation {key}="{value}" is forbidden: use runtime/default or localhost/<profile>',
            )


_SAFE_SYSCTLS = {
    0: frozenset(
        {
            "kernel.shm_rmid_forced",
            "net.ipv4.ip_local_port_range",
            "net.ipv4.tcp_syncookies",
            "net.ipv4.ping_group_range",
            "net.ipv4.ip_unprivileged_port_start",
        }
    ),
    27: frozenset({"net.ipv4.ip_local_reserved_ports"}),
    29: frozenset({"net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl", "net.ipv4.tcp_keepalive_probes"}),
    32: frozenset({"net.ipv4.tcp_rmem", "net.ipv4.tcp_wmem"}),
}
"""The "safe" namespaced sysctls, by the version that allowed them."""


def _sysctls(pod: _Pod, minor: int) -> _Found:
    """Baseline "Sysctls": spec.securityContext.sysctls[*].name only from the safe set of the
    version."""
    allowed = frozenset().union(*(names for since, names in _SAFE_SYSCTLS.items() if since <= minor))
    for i, sysctl in enumerate(_seq(_map(pod.context).get("sysctls"))):
        name = _text(_map(sysctl).get("name"))
        if name not in allowed:
            yield Violation("sysctls", f"spec.securityContext.sysctls[{i}].name", f'pod must not set sysctl "{name}" (forbidden sysctls)')


def _windows_host_process(pod: _Pod, minor: int) -> _Found:
    """Baseline "HostProcess": windowsOptions.hostProcess unset or false (pod and containers)."""
    setters: list[tuple[str, str, Mapping[str, Any] | None]] = [("pod", "spec.securityContext", pod.context)]
    setters += [(c.quoted, f"{c.path}.securityContext", c.context) for c in pod.containers]
    for who, base, context in setters:
        if context is not None and _map(context.get("windowsOptions")).get("hostProcess") is True:
            yield Violation(
                "windowsHostProcess", f"{base}.windowsOptions.hostProcess", f"{who} must not set securityContext.windowsOptions.hostProcess=true"
            )


# ----------------------------------------------------------------------------- restricted checks


def _allow_privilege_escalation(pod: _Pod, minor: int) -> _Found:
    """Restricted "Privilege Escalation" (v1.8+): allowPrivilegeEscalation=false on every
    container; v1.25+ Windows pods exempt."""
    if minor >= 25 and pod.windows:
        return
    for c in pod.containers:
        if c.context is None or c.context.get("allowPrivilegeEscalation") is not False:
            yield Violation(
                "allowPrivilegeEscalation",
                c.field("allowPrivilegeEscalation"),
                f"{c.quoted} must set securityContext.allowPrivilegeEscalation=false",
            )


def _capabilities_restricted(pod: _Pod, minor: int) -> _Found:
    """Restricted "Capabilities" (v1.22+): capabilities.drop includes ALL, capabilities.add
    only NET_BIND_SERVICE; v1.25+ Windows pods exempt."""
    if minor >= 25 and pod.windows:
        return
    for c in pod.containers:
        capabilities = _map(c.context).get("capabilities")
        if capabilities is None or "ALL" not in _seq(_map(capabilities).get("drop")):
            yield Violation(
                "capabilities_restricted", c.field("capabilities.drop"), f'{c.quoted} must set securityContext.capabilities.drop=["ALL"]'
            )
        extra = sorted({_text(cap) for cap in _seq(_map(capabilities).get("add"))} - {"NET_BIND_SERVICE"})
        if extra:
            yield Violation(
                "capabilities_restricted",
                c.field("capabilities.add"),
                f"{c.quoted} must not include {_quote(extra)} in securityContext.capabilities.add (only NET_BIND_SERVICE)",
            )


def _proc_mount_restricted(pod: _Pod, minor: int) -> _Found:
    """Restricted "/proc Mount Type" (v1.35+): procMount unset or Default, user namespace or
    not (replaces the relaxed baseline check at this level)."""
    yield from _unmasked_proc(pod, "procMount_restricted")


_ALLOWED_VOLUMES = frozenset(
    {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "image", "persistentVolumeClaim", "projected", "secret"}
)


def _restricted_volumes(pod: _Pod, minor: int) -> _Found:
    """Restricted "Volume Types": only configMap, csi, downwardAPI, emptyDir, ephemeral, image,
    persistentVolumeClaim, projected and secret volumes (hostPath included in the refusal: this
    check replaces hostPathVolumes at this level)."""
    for i, volume in enumerate(_seq(pod.spec.get("volumes"))):
        body = _map(volume)
        # A volume naming no source is defaulted to an emptyDir by the API server.
        sources = [str(key) for key, value in body.items() if key != "name" and value is not None]
        bad = sorted(key for key in sources if key not in _ALLOWED_VOLUMES)
        for key in bad:
            yield Violation(
                "restrictedVolumes",
                f"spec.volumes[{i}].{key}",
                f'volume "{body.get("name") or ""}" uses restricted volume type "{key}": use {_quote(sorted(_ALLOWED_VOLUMES))}',
            )


def _run_as_non_root(pod: _Pod, minor: int) -> _Found:
    """Restricted "Running as Non-root": runAsNonRoot=true on the pod or on every container (a
    container's own setting wins; false anywhere is refused); v1.35+ any value in a user
    namespace."""
    if minor >= 35 and pod.user_namespace:
        return
    pod_value = _map(pod.context).get("runAsNonRoot")
    if pod_value is not None and pod_value is not True:
        yield Violation("runAsNonRoot", "spec.securityContext.runAsNonRoot", "pod must not set securityContext.runAsNonRoot=false")
    for c in pod.containers:
        value = c.context.get("runAsNonRoot") if c.context is not None else None
        if value is not None and value is not True:
            yield Violation("runAsNonRoot", c.field("runAsNonRoot"), f"{c.quoted} must not set securityContext.runAsNonRoot=false")
        elif value is None and pod_value is not True:
            yield Violation("runAsNonRoot", c.field("runAsNonRoot"), f"pod or {c.quoted} must set securityContext.runAsNonRoot=true")


def _run_as_user(pod: _Pod, minor: int) -> _Found:
    """Restricted "Running as Non-root user" (v1.23+): runAsUser not 0 (pod and containers);
    v1.35+ any value in a user namespace."""
    if minor >= 35 and pod.user_namespace:
        return
    if _is_zero(_map(pod.context).get("runAsUser")):
        yield Violation("runAsUser", "spec.securityContext.runAsUser", "pod must not set runAsUser=0")
    for c in pod.containers:
        if c.context is not None and _is_zero(c.context.get("runAsUser")):
            yield Violation("runAsUser", c.field("runAsUser"), f"{c.quoted} must not set runAsUser=0")


def _seccomp_profile_restricted(pod: _Pod, minor: int) -> _Found:
    """Restricted "Seccomp" (v1.19+): seccompProfile.type RuntimeDefault or Localhost, on the
    pod or on every container; v1.25+ Windows pods exempt."""
    if minor >= 25 and pod.windows:
        return
    yield from _seccomp_fields(pod, "seccompProfile_restricted", required=True)


# ----------------------------------------------------------------------------- the registry


@dataclass(frozen=True)
class _Check:
    id: str
    level: Literal["baseline", "restricted"]
    since: int
    """First minor version (1.x) the check belongs to."""
    run: Callable[[_Pod, int], _Found]
    replaces: str | None = None
    """The baseline check this restricted check stands in for at the restricted level."""


_CHECKS: tuple[_Check, ...] = (
    # Baseline checks sorted by ID, then restricted ones: the order the reference reports in.
    _Check("appArmorProfile", "baseline", 0, _app_armor_profile),
    _Check("capabilities_baseline", "baseline", 0, _capabilities_baseline),
    _Check("hostNamespaces", "baseline", 0, _host_namespaces),
    _Check("hostPathVolumes", "baseline", 0, _host_path_volumes),
    _Check("hostPorts", "baseline", 0, _host_ports),
    _Check("hostProbesAndHostLifecycle", "baseline", 34, _host_probes_and_host_lifecycle),
    _Check("privileged", "baseline", 0, _privileged),
    _Check("procMount", "baseline", 0, _proc_mount),
    _Check("seLinuxOptions", "baseline", 0, _se_linux_options),
    _Check("seccompProfile_baseline", "baseline", 0, _seccomp_profile_baseline),
    _Check("sysctls", "baseline", 0, _sysctls),
    _Check("windowsHostProcess", "baseline", 0, _windows_host_process),
    _Check("allowPrivilegeEscalation", "restricted", 8, _allow_privilege_escalation),
    _Check("capabilities_restricted", "restricted", 22, _capabilities_restricted, replaces="capabilities_baseline"),
    _Check("procMount_restricted", "restricted", 35, _proc_mount_restricted, replaces="procMount"),
    _Check("restrictedVolumes", "restricted", 0, _restricted_volumes, replaces="hostPathVolumes"),
    _Check("runAsNonRoot", "restricted", 0, _run_as_non_root),
    _Check("runAsUser", "restricted", 23, _run_as_user),
    _Check("seccompProfile_restricted", "restricted", 19, _seccomp_profile_restricted, replaces="seccompProfile_baseline"),
)

CHECK_LEVELS: Mapping[str, str] = {c.id: c.level for c in _CHECKS}
"""Every check ID of :data:`VERSION` and the level that introduces it."""

_VERSION_RE = re.compile(r"v1\.(0|[1-9][0-9]{0,2})")
_LATEST_MINOR = int(VERSION.split(".")[1])


def _minor(version: str) -> int:
    if version == "latest":
        return _LATEST_MINOR
    match = _VERSION_RE.fullmatch(version) if isinstance(version, str) else None
    if match is None:
        raise ValueError(f"invalid Pod Security version {version!r}: use v1.<minor> (v1.0 to {VERSION}) or latest")
    minor = int(match.group(1))
    if minor > _LATEST_MINOR:
        # The admission plugin evaluates a newer version as its newest one; here that would
        # claim rules nobody wrote down yet.
        raise ValueError(f"Pod Security version {version} is newer than the {VERSION} these checks implement: use {VERSION} or latest")
    return minor


def _quote(items: Sequence[str]) -> str:
    return ", ".join(f'"{item}"' for item in items)


def check(
    pod_spec: Mapping[str, Any],
    level: Level,
    pod_metadata: Mapping[str, Any] | None = None,
    *,
    version: str = VERSION,
) -> list[Violation]:
    """The fields of the pod that Pod Security ``level`` forbids at ``version``; empty: admitted.

    ``pod_spec`` is a Pod's ``spec`` (or a pod template's), ``pod_metadata`` its ``metadata``
    (the AppArmor and, before v1.19, seccomp annotations are read there). ``privileged`` admits
    everything; ``restricted`` includes the baseline checks it does not replace.
    """
    if level not in ("privileged", "baseline", "restricted"):
        raise ValueError(f"invalid Pod Security level {level!r}: use privileged, baseline or restricted")
    minor = _minor(version)
    if not isinstance(pod_spec, Mapping):
        raise TypeError(f"pod_spec must be a mapping (a Pod's spec), not {type(pod_spec).__name__}")
    if "kind" in pod_spec or "apiVersion" in pod_spec:
        raise ValueError("pod_spec is a whole object: pass its spec (pod['spec']) and its metadata as pod_metadata")
    if level == "privileged":
        return []
    active = [c for c in _CHECKS if c.since <= minor and (c.level == "baseline" or level == "restricted")]
    replaced = {c.replaces for c in active if c.replaces is not None and level == "restricted"}
    pod = _Pod.of(pod_spec, _map(pod_metadata))
    return [violation for c in active if c.id not in replaced for violation in c.run(pod, minor)]
