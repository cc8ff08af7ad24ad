"""The offline Pod Security Standards check (sidecar.k8s.podsecurity): every baseline and
restricted check with a compliant and a violating pod, the values the Pod Security Standards page
lists as allowed, pod-level settings inherited by containers, the versioned rules, and the two
shardcache modes at each level.

Cases were written from the page and from k8s.io/pod-security-admission's policy/check_*.go;
the module also agrees with all 4,241 fixtures that project generates for v1.0 to v1.36
(test/testdata, run by hand: the fixtures are not ours to copy here)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from sidecar.k8s.inject import InjectConfig, inject
from sidecar.k8s.podsecurity import CHECK_LEVELS, VERSION, Violation, check
from tests.support.k8s import TEMPLATE_PATHS, load_fixture_docs, pod_templates

pytestmark = pytest.mark.timeout(60)

Pod = dict[str, Any]

RESTRICTED_CONTEXT = {
    "allowPrivilegeEscalation": False,
    "runAsNonRoot": True,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}


def restricted_pod() -> Pod:
    """A pod (metadata and spec) that passes restricted: one container, one init container."""
    return {
        "metadata": {"name": "p"},
        "spec": {
            "initContainers": [{"name": "init", "image": "busybox:1.36", "securityContext": copy.deepcopy(RESTRICTED_CONTEXT)}],
            "containers": [{"name": "app", "image": "trainer:1", "securityContext": copy.deepcopy(RESTRICTED_CONTEXT)}],
        },
    }


def app(pod: Pod) -> dict[str, Any]:
    return pod["spec"]["containers"][0]


def app_sc(pod: Pod) -> dict[str, Any]:
    return app(pod)["securityContext"]


def pod_sc(pod: Pod) -> dict[str, Any]:
    return pod["spec"].setdefault("securityContext", {})


def judge(pod: Pod, level: str, version: str = VERSION) -> list[Violation]:
    return check(pod["spec"], level, pod["metadata"], version=version)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Case:
    name: str
    tweak: Callable[[Pod], object]
    """Changes the restricted pod."""
    baseline: tuple[str, ...] = ()
    """Check IDs baseline refuses it on (empty: admitted)."""
    restricted: tuple[str, ...] = ()
    """Check IDs restricted refuses it on."""
    paths: tuple[str, ...] = field(default=())
    """Every violation's path, at the strictest level that refuses it."""
    version: str = VERSION


def sets(target: Callable[[Pod], dict[str, Any]], **values: Any) -> Callable[[Pod], object]:
    return lambda pod: target(pod).update(values)


def add_volume(volume: dict[str, Any]) -> Callable[[Pod], object]:
    return lambda pod: pod["spec"].setdefault("volumes", []).append(volume)


def annotate(key: str, value: str) -> Callable[[Pod], object]:
    return lambda pod: pod["metadata"].setdefault("annotations", {}).__setitem__(key, value)


C0 = "spec.containers[0]"
SC = f"{C0}.securityContext"
APPARMOR = "container.apparmor.security.beta.kubernetes.io/app"

# One compliant and one (or more) violating pod per check, each from the restricted pod.
CASES = [
    # appArmorProfile (baseline): fields and annotations
    Case("apparmor localhost field", sets(app_sc, appArmorProfile={"type": "Localhost", "localhostProfile": "k8s-trainer"})),
    Case("apparmor runtime/default annotation", annotate(APPARMOR, "runtime/default")),
    Case("apparmor unconfined field", sets(app_sc, appArmorProfile={"type": "Unconfined"}), ("appArmorProfile",), ("appArmorProfile",), (f"{SC}.appArmorProfile.type",)),
    Case("apparmor unconfined pod field", sets(pod_sc, appArmorProfile={"type": "Unconfined"}), ("appArmorProfile",), ("appArmorProfile",), ("spec.securityContext.appArmorProfile.type",)),
    Case("apparmor unconfined annotation", annotate(APPARMOR, "unconfined"), ("appArmorProfile",), ("appArmorProfile",), (f"metadata.annotations[{APPARMOR}]",)),
    # capabilities_baseline / capabilities_restricted
    Case("default capability added", sets(app_sc, capabilities={"drop": ["ALL"], "add": ["CHOWN"]}), (), ("capabilities_restricted",), (f"{SC}.capabilities.add",)),
    Case("NET_RAW added", sets(app_sc, capabilities={"drop": ["ALL"], "add": ["NET_RAW"]}), ("capabilities_baseline",), ("capabilities_restricted",), (f"{SC}.capabilities.add",)),
    Case("NET_BIND_SERVICE added", sets(app_sc, capabilities={"drop": ["ALL"], "add": ["NET_BIND_SERVICE"]})),
    Case("ALL not dropped", sets(app_sc, capabilities={"drop": ["NET_RAW"]}), (), ("capabilities_restricted",), (f"{SC}.capabilities.drop",)),
    Case("no capabilities", lambda pod: app_sc(pod).pop("capabilities"), (), ("capabilities_restricted",), (f"{SC}.capabilities.drop",)),
    Case("lower-case all is not ALL", sets(app_sc, capabilities={"drop": ["all"]}), (), ("capabilities_restricted",), (f"{SC}.capabilities.drop",)),
    # hostNamespaces
    Case("host namespaces false", lambda pod: pod["spec"].update(hostNetwork=False, hostPID=False, hostIPC=False)),
    Case("hostNetwork", lambda pod: pod["spec"].update(hostNetwork=True), ("hostNamespaces",), ("hostNamespaces",), ("spec.hostNetwork",)),
    Case("hostPID and hostIPC", lambda pod: pod["spec"].update(hostPID=True, hostIPC=True), ("hostNamespaces",), ("hostNamespaces",), ("spec.hostPID", "spec.hostIPC")),
    # hostPathVolumes (baseline); restrictedVolumes stands in for it at restricted
    Case("hostPath volume", add_volume({"name": "host", "hostPath": {"path": "/run/shardcache"}}), ("hostPathVolumes",), ("restrictedVolumes",), ("spec.volumes[0].hostPath",)),
    Case("hostPath null", add_volume({"name": "v", "hostPath": None, "emptyDir": {}})),
    # hostPorts
    Case("containerPort only", sets(app, ports=[{"containerPort": 8600}, {"containerPort": 8601, "hostPort": 0}])),
    Case("hostPort", sets(app, ports=[{"containerPort": 8600}, {"containerPort": 8600, "hostPort": 8600}]), ("hostPorts",), ("hostPorts",), (f"{C0}.ports[1].hostPort",)),
    # hostProbesAndHostLifecycle (v1.34+)
    Case("probe without host", sets(app, livenessProbe={"httpGet": {"port": 8600, "host": ""}}, readinessProbe={"tcpSocket": {"port": 8600}})),
    Case("probe with host", sets(app, livenessProbe={"httpGet": {"port": 80, "host": "169.254.169.254"}}), ("hostProbesAndHostLifecycle",), ("hostProbesAndHostLifecycle",), (f"{C0}.livenessProbe.httpGet.host",)),
    Case("lifecycle with host", sets(app, lifecycle={"preStop": {"tcpSocket": {"port": 22, "host": "10.0.0.1"}}}), ("hostProbesAndHostLifecycle",), ("hostProbesAndHostLifecycle",), (f"{C0}.lifecycle.preStop.tcpSocket.host",)),
    Case("probe with host before v1.34", sets(app, startupProbe={"httpGet": {"port": 80, "host": "10.0.0.1"}}), version="v1.33"),
    # privileged
    Case("privileged false", sets(app_sc, privileged=False)),
    Case("privileged", sets(app_sc, privileged=True), ("privileged",), ("privileged",), (f"{SC}.privileged",)),
    # procMount (baseline) / procMount_restricted (v1.35+)
    Case("procMount Default", sets(app_sc, procMount="Default")),
    Case("procMount Unmasked", sets(app_sc, procMount="Unmasked"), ("procMount",), ("procMount_restricted",), (f"{SC}.procMount",)),
    Case("procMount Unmasked, user namespace", lambda pod: (app_sc(pod).update(procMount="Unmasked"), pod["spec"].update(hostUsers=False)), (), ("procMount_restricted",), (f"{SC}.procMount",)),
    Case("procMount Unmasked, user namespace, v1.34", lambda pod: (app_sc(pod).update(procMount="Unmasked"), pod["spec"].update(hostUsers=False)), ("procMount",), ("procMount",), (f"{SC}.procMount",), version="v1.34"),
    # seLinuxOptions
    Case("SELinux container_t with level", sets(app_sc, seLinuxOptions={"type": "container_t", "level": "s0:c123,c456"})),
    Case("SELinux spc_t", sets(pod_sc, seLinuxOptions={"type": "spc_t"}), ("seLinuxOptions",), ("seLinuxOptions",), ("spec.securityContext.seLinuxOptions.type",)),
    Case("SELinux user and role", sets(app_sc, seLinuxOptions={"user": "system_u", "role": "system_r"}), ("seLinuxOptions",), ("seLinuxOptions",), (f"{SC}.seLinuxOptions.user", f"{SC}.seLinuxOptions.role")),
    Case("SELinux container_engine_t v1.31", sets(app_sc, seLinuxOptions={"type": "container_engine_t"}), version="v1.31"),
    Case("SELinux container_engine_t v1.30", sets(app_sc, seLinuxOptions={"type": "container_engine_t"}), ("seLinuxOptions",), ("seLinuxOptions",), (f"{SC}.seLinuxOptions.type",), version="v1.30"),
    # seccompProfile_baseline / seccompProfile_restricted
    Case("seccomp Localhost", sets(app_sc, seccompProfile={"type": "Localhost", "localhostProfile": "profiles/trainer.json"})),
    Case("seccomp Unconfined", sets(app_sc, seccompProfile={"type": "Unconfined"}), ("seccompProfile_baseline",), ("seccompProfile_restricted",), (f"{SC}.seccompProfile.type",)),
    Case("seccomp unset", lambda pod: app_sc(pod).pop("seccompProfile"), (), ("seccompProfile_restricted",), (f"{SC}.seccompProfile.type",)),
    # sysctls
    Case("safe sysctl", sets(pod_sc, sysctls=[{"name": "net.ipv4.ip_local_port_range", "value": "1024 65535"}])),
    Case("unsafe sysctl", sets(pod_sc, sysctls=[{"name": "kernel.shm_rmid_forced", "value": "0"}, {"name": "kernel.msgmax", "value": "65536"}]), ("sysctls",), ("sysctls",), ("spec.securityContext.sysctls[1].name",)),
    Case("tcp_rmem v1.32", sets(pod_sc, sysctls=[{"name": "net.ipv4.tcp_rmem", "value": "4096 87380 6291456"}]), version="v1.32"),
    Case("tcp_rmem v1.31", sets(pod_sc, sysctls=[{"name": "net.ipv4.tcp_rmem", "value": "4096 87380 6291456"}]), ("sysctls",), ("sysctls",), ("spec.securityContext.sysctls[0].name",), version="v1.31"),
    # windowsHostProcess
    Case("hostProcess false", sets(app_sc, windowsOptions={"hostProcess": False})),
    Case("hostProcess", sets(app_sc, windowsOptions={"hostProcess": True}), ("windowsHostProcess",), ("windowsHostProcess",), (f"{SC}.windowsOptions.hostProcess",)),
    Case("pod hostProcess", sets(pod_sc, windowsOptions={"hostProcess": True}), ("windowsHostProcess",), ("windowsHostProcess",), ("spec.securityContext.windowsOptions.hostProcess",)),
    # allowPrivilegeEscalation (restricted)
    Case("allowPrivilegeEscalation unset", lambda pod: app_sc(pod).pop("allowPrivilegeEscalation"), (), ("allowPrivilegeEscalation",), (f"{SC}.allowPrivilegeEscalation",)),
    Case("allowPrivilegeEscalation true", sets(app_sc, allowPrivilegeEscalation=True), (), ("allowPrivilegeEscalation",), (f"{SC}.allowPrivilegeEscalation",)),
    # restrictedVolumes
    Case(
        "every allowed volume type",
        lambda pod: pod["spec"].update(
            volumes=[
                {"name": "implicit-empty-dir"},
                {"name": "a", "emptyDir": {}},
                {"name": "b", "configMap": {"name": "c"}},
                {"name": "c", "secret": {"secretName": "s"}},
                {"name": "d", "persistentVolumeClaim": {"claimName": "c"}},
                {"name": "e", "downwardAPI": {"items": []}},
                {"name": "f", "projected": {"sources": []}},
                {"name": "g", "csi": {"driver": "inline.storage.kubernetes.io"}},
                {"name": "h", "ephemeral": {"volumeClaimTemplate": {"spec": {}}}},
                {"name": "i", "image": {"reference": "registry.example.com/weights:1"}},
            ]
        ),
    ),
    Case("nfs volume", add_volume({"name": "datasets", "nfs": {"server": "nfs", "path": "/datasets"}}), (), ("restrictedVolumes",), ("spec.volumes[0].nfs",)),
    Case("unknown volume source", add_volume({"name": "x", "someFutureSource": {}}), (), ("restrictedVolumes",), ("spec.volumes[0].someFutureSource",)),
    # runAsNonRoot
    Case("runAsNonRoot on the pod only", lambda pod: (app_sc(pod).pop("runAsNonRoot"), pod_sc(pod).update(runAsNonRoot=True))),
    Case("runAsNonRoot unset", lambda pod: app_sc(pod).pop("runAsNonRoot"), (), ("runAsNonRoot",), (f"{SC}.runAsNonRoot",)),
    Case("runAsNonRoot false", sets(app_sc, runAsNonRoot=False), (), ("runAsNonRoot",), (f"{SC}.runAsNonRoot",)),
    Case("runAsNonRoot false, user namespace", lambda pod: (app_sc(pod).update(runAsNonRoot=False), pod["spec"].update(hostUsers=False))),
    Case("runAsNonRoot false, user namespace, v1.34", lambda pod: (app_sc(pod).update(runAsNonRoot=False), pod["spec"].update(hostUsers=False)), (), ("runAsNonRoot",), (f"{SC}.runAsNonRoot",), version="v1.34"),
    # runAsUser (v1.23+)
    Case("runAsUser 1000", lambda pod: (app_sc(pod).update(runAsUser=1000), pod_sc(pod).update(runAsUser=65532))),
    Case("runAsUser 0", sets(app_sc, runAsUser=0), (), ("runAsUser",), (f"{SC}.runAsUser",)),
    Case("pod runAsUser 0", sets(pod_sc, runAsUser=0), (), ("runAsUser",), ("spec.securityContext.runAsUser",)),
    Case("runAsUser 0, user namespace", lambda pod: (app_sc(pod).update(runAsUser=0), pod["spec"].update(hostUsers=False))),
    Case("runAsUser 0 before v1.23", sets(app_sc, runAsUser=0), version="v1.22"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_check_case(case: Case) -> None:
    pod = restricted_pod()
    case.tweak(pod)
    baseline, restricted = judge(pod, "baseline", case.version), judge(pod, "restricted", case.version)
    assert sorted({v.check for v in baseline}) == sorted(case.baseline), baseline
    assert sorted({v.check for v in restricted}) == sorted(case.restricted), restricted
    strictest = baseline or restricted
    assert [v.path for v in strictest] == list(case.paths)
    assert judge(pod, "privileged", case.version) == []
    for violation in baseline + restricted:
        assert isinstance(violation, Violation) and violation.message


def test_every_check_has_a_violating_case() -> None:
    covered = {c for case in CASES for c in case.baseline + case.restricted}
    assert covered == set(CHECK_LEVELS), set(CHECK_LEVELS) - covered


# ----------------------------------------------------------------------------- the page's lists


# The values the Pod Security Standards page lists as allowed (v1.36).
DEFAULT_CAPABILITIES = ["AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD", "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"]
SAFE_SYSCTLS = [
    "kernel.shm_rmid_forced",
    "net.ipv4.ip_local_port_range",
    "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies",
    "net.ipv4.ping_group_range",
    "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time",
    "net.ipv4.tcp_fin_timeout",
    "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
    "net.ipv4.tcp_rmem",
    "net.ipv4.tcp_wmem",
]


def test_page_default_capabilities_pass_baseline_only_net_bind_service_restricted() -> None:
    for capability in DEFAULT_CAPABILITIES:
        pod = restricted_pod()
        app_sc(pod)["capabilities"]["add"] = [capability]
        assert judge(pod, "baseline") == []
        assert [v.check for v in judge(pod, "restricted")] == ([] if capability == "NET_BIND_SERVICE" else ["capabilities_restricted"])
    for capability in ["NET_RAW", "SYS_ADMIN", "SYS_PTRACE", "BPF", "net_raw"]:
        pod = restricted_pod()
        app_sc(pod)["capabilities"]["add"] = [capability]
        assert [v.check for v in judge(pod, "baseline")] == ["capabilities_baseline"]


def test_page_safe_sysctls() -> None:
    pod = restricted_pod()
    pod_sc(pod)["sysctls"] = [{"name": name, "value": "1"} for name in SAFE_SYSCTLS]
    assert judge(pod, "restricted") == []
    # net.* sysctls outside the list, even namespaced ones, are refused
    pod_sc(pod)["sysctls"].append({"name": "net.core.somaxconn", "value": "1024"})
    assert [v.path for v in judge(pod, "baseline")] == [f"spec.securityContext.sysctls[{len(SAFE_SYSCTLS)}].name"]


@pytest.mark.parametrize(
    ("options", "allowed"),
    [
        ({}, True),
        ({"type": ""}, True),
        ({"type": "container_t"}, True),
        ({"type": "container_init_t"}, True),
        ({"type": "container_kvm_t"}, True),
        ({"type": "container_engine_t"}, True),
        ({"level": "s0:c1,c2"}, True),
        ({"type": "spc_t"}, False),
        ({"type": "unconfined_t"}, False),
        ({"user": "system_u"}, False),
        ({"role": "object_r"}, False),
    ],
)
def test_page_selinux_values(options: dict[str, str], allowed: bool) -> None:
    for where in (pod_sc, app_sc):
        pod = restricted_pod()
        where(pod)["seLinuxOptions"] = options
        assert (judge(pod, "baseline") == []) is allowed


@pytest.mark.parametrize(
    ("value", "allowed"), [("", True), ("runtime/default", True), ("localhost/trainer", True), ("unconfined", False), ("docker/default", False)]
)
def test_page_apparmor_annotation_values(value: str, allowed: bool) -> None:
    pod = restricted_pod()
    pod["metadata"]["annotations"] = {APPARMOR: value}
    assert (judge(pod, "restricted") == []) is allowed


@pytest.mark.parametrize(
    ("profile", "allowed"),
    [({"type": "RuntimeDefault"}, True), ({"type": "Localhost", "localhostProfile": "p"}, True), ({"type": "Unconfined"}, False), ({}, False)],
)
def test_page_apparmor_and_seccomp_types(profile: dict[str, str], allowed: bool) -> None:
    for key, check_id in (("appArmorProfile", "appArmorProfile"), ("seccompProfile", "seccompProfile_baseline")):
        for where in (pod_sc, app_sc):
            pod = restricted_pod()
            where(pod)[key] = profile
            assert [v.check for v in judge(pod, "baseline")] == ([] if allowed else [check_id])


# ----------------------------------------------------------------------------- the minimal pod


MINIMAL = {"metadata": {"name": "p"}, "spec": {"containers": [{"name": "app", "image": "trainer:1"}]}}


def test_empty_pod_passes_baseline_and_fails_restricted_on_exactly_four_checks() -> None:
    assert judge(MINIMAL, "baseline") == []
    assert judge(MINIMAL, "restricted") == [
        Violation("allowPrivilegeEscalation", f"{SC}.allowPrivilegeEscalation", 'container "app" must set securityContext.allowPrivilegeEscalation=false'),
        Violation("capabilities_restricted", f"{SC}.capabilities.drop", 'container "app" must set securityContext.capabilities.drop=["ALL"]'),
        Violation("runAsNonRoot", f"{SC}.runAsNonRoot", 'pod or container "app" must set securityContext.runAsNonRoot=true'),
        Violation("seccompProfile_restricted", f"{SC}.seccompProfile.type", 'pod or container "app" must set securityContext.seccompProfile.type to "RuntimeDefault" or "Localhost"'),
    ]
    # v1.0 had neither allowPrivilegeEscalation (1.8), capabilities_restricted (1.22) nor seccomp fields (1.19)
    assert [v.check for v in judge(MINIMAL, "restricted", "v1.0")] == ["runAsNonRoot"]
    # a spec with no containers at all has nothing the container checks could refuse
    assert check({}, "baseline") == [] and check({}, "restricted") == []


# ----------------------------------------------------------------------------- precedence


def test_pod_level_settings_are_inherited_by_every_container() -> None:
    pod: Pod = {
        "metadata": {"name": "p"},
        "spec": {
            "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "seccompProfile": {"type": "RuntimeDefault"}},
            "initContainers": [{"name": "init", "image": "i", "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}}],
            "containers": [{"name": "app", "image": "a", "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}}],
            "ephemeralContainers": [{"name": "debug", "image": "d", "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}}],
        },
    }
    assert judge(pod, "restricted") == []
    # allowPrivilegeEscalation and capabilities have no pod-level field: each container sets them
    del pod["spec"]["ephemeralContainers"][0]["securityContext"]
    assert {(v.check, v.path) for v in judge(pod, "restricted")} == {
        ("allowPrivilegeEscalation", "spec.ephemeralContainers[0].securityContext.allowPrivilegeEscalation"),
        ("capabilities_restricted", "spec.ephemeralContainers[0].securityContext.capabilities.drop"),
    }


def test_container_settings_win_over_the_pod_but_a_bad_pod_value_is_refused() -> None:
    # a container's explicit value wins over the pod's
    pod = restricted_pod()
    pod_sc(pod).update(runAsNonRoot=True, seccompProfile={"type": "RuntimeDefault"})
    app_sc(pod).update(runAsNonRoot=False, seccompProfile={"type": "Unconfined"})
    assert {(v.check, v.path) for v in judge(pod, "restricted")} == {
        ("runAsNonRoot", f"{SC}.runAsNonRoot"),
        ("seccompProfile_restricted", f"{SC}.seccompProfile.type"),
    }
    # containers may set what the pod does not
    pod = restricted_pod()
    assert judge(pod, "restricted") == []
    # a forbidden pod-level value is refused even where every container overrides it
    pod_sc(pod).update(runAsNonRoot=False, seccompProfile={"type": "Unconfined"}, runAsUser=0)
    app_sc(pod)["runAsUser"] = 1000
    pod["spec"]["initContainers"][0]["securityContext"]["runAsUser"] = 1000
    assert [(v.check, v.path) for v in judge(pod, "restricted")] == [
        ("runAsNonRoot", "spec.securityContext.runAsNonRoot"),
        ("runAsUser", "spec.securityContext.runAsUser"),
        ("seccompProfile_restricted", "spec.securityContext.seccompProfile.type"),
    ]


def test_every_container_kind_is_checked_in_the_reference_order() -> None:
    pod = restricted_pod()
    privileged = {"privileged": True}
    pod["spec"]["ephemeralContainers"] = [{"name": "debug", "image": "d", "securityContext": {**RESTRICTED_CONTEXT, **privileged}}]
    pod["spec"]["initContainers"][0]["securityContext"].update(privileged)
    app_sc(pod).update(privileged)
    assert [v.path for v in judge(pod, "baseline")] == [
        "spec.initContainers[0].securityContext.privileged",
        "spec.containers[0].securityContext.privileged",
        "spec.ephemeralContainers[0].securityContext.privileged",
    ]


def test_violations_come_in_the_reference_order() -> None:
    pod = restricted_pod()
    pod["spec"]["hostNetwork"] = True
    pod["spec"]["volumes"] = [{"name": "h", "hostPath": {"path": "/"}}]
    app_sc(pod).update(privileged=True, runAsUser=0, allowPrivilegeEscalation=True)
    app_sc(pod)["capabilities"]["add"] = ["SYS_ADMIN"]
    pod["metadata"]["annotations"] = {APPARMOR: "unconfined"}
    assert [v.check for v in judge(pod, "baseline")] == ["appArmorProfile", "capabilities_baseline", "hostNamespaces", "hostPathVolumes", "privileged"]
    assert [v.check for v in judge(pod, "restricted")] == [
        "appArmorProfile",
        "hostNamespaces",
        "privileged",
        "allowPrivilegeEscalation",
        "capabilities_restricted",
        "restrictedVolumes",
        "runAsUser",
    ]


def test_windows_pods_are_exempt_from_the_linux_only_restricted_checks() -> None:
    pod: Pod = {
        "metadata": {"name": "w"},
        "spec": {
            "os": {"name": "windows"},
            "securityContext": {"runAsNonRoot": True},
            "containers": [{"name": "app", "image": "mcr.microsoft.com/windows/nanoserver:ltsc2022"}],
        },
    }
    assert judge(pod, "restricted") == []
    # before v1.25 spec.os was not read
    assert {v.check for v in judge(pod, "restricted", "v1.24")} == {"allowPrivilegeEscalation", "capabilities_restricted", "seccompProfile_restricted"}
    # runAsNonRoot and the baseline checks still apply to Windows pods
    pod["spec"]["securityContext"]["windowsOptions"] = {"hostProcess": True}
    del pod["spec"]["securityContext"]["runAsNonRoot"]
    assert {v.check for v in judge(pod, "restricted")} == {"runAsNonRoot", "windowsHostProcess"}


def test_seccomp_annotations_before_v1_19() -> None:
    pod = restricted_pod()
    pod["metadata"]["annotations"] = {"seccomp.security.alpha.kubernetes.io/pod": "unconfined", "container.seccomp.security.alpha.kubernetes.io/app": "docker/default"}
    assert [(v.check, v.path) for v in judge(pod, "baseline", "v1.18")] == [("seccompProfile_baseline", "metadata.annotations[seccomp.security.alpha.kubernetes.io/pod]")]
    # from v1.19 the fields are read instead, and the annotations are ignored
    assert judge(pod, "baseline", "v1.19") == []


# ----------------------------------------------------------------------------- the API


def test_versions_and_levels() -> None:
    pod = restricted_pod()
    app_sc(pod)["seLinuxOptions"] = {"type": "container_engine_t"}
    assert judge(pod, "baseline", "latest") == judge(pod, "baseline", VERSION) == []
    for version in ("v1.37", "1.30", "v2.0", "v1.030", "", "Latest"):
        with pytest.raises(ValueError, match="version"):
            judge(pod, "baseline", version)
    with pytest.raises(ValueError, match="use privileged, baseline or restricted"):
        judge(pod, "Restricted")
    with pytest.raises(ValueError, match=r"pass its spec \(pod\['spec'\]\)"):
        check({"apiVersion": "v1", "kind": "Pod", "spec": {}}, "baseline")
    with pytest.raises(TypeError, match="mapping"):
        check([], "baseline")  # type: ignore[arg-type]


def test_violations_are_frozen_values() -> None:
    violation = judge(MINIMAL, "restricted")[0]
    with pytest.raises(AttributeError):
        violation.check = "x"  # type: ignore[misc]
    assert violation == Violation(violation.check, violation.path, violation.message)


def test_malformed_fields_do_not_crash() -> None:
    spec: dict[str, Any] = {
        "securityContext": {"sysctls": [{"name": {"a": 1}}, "x"], "seLinuxOptions": {"type": ["spc_t"]}, "runAsNonRoot": "yes"},
        "volumes": [{"name": "v", 3: {}}, "junk"],
        "containers": [{"name": "c", "securityContext": {"capabilities": {"add": [{"x": 1}], "drop": "ALL"}, "procMount": ""}, "ports": "80"}, None],
    }
    found = check(spec, "restricted", {"annotations": {APPARMOR: None}})
    assert found and all(v.path.startswith(("spec.", "metadata.")) for v in found)


# ----------------------------------------------------------------------------- the project's pods


def test_workload_fixture_pods_are_judged() -> None:
    config = InjectConfig(image="registry.example.com/shardcache:1.2.3")
    judged = 0
    for doc in load_fixture_docs():
        if doc["kind"] not in TEMPLATE_PATHS:
            continue
        injected, _ = inject(doc, config)
        for obj in (doc, injected):
            for template in pod_templates(obj):
                for level in ("privileged", "baseline", "restricted"):
                    for violation in check(template["spec"], level, template.get("metadata"), version=VERSION):
                        assert violation.check in CHECK_LEVELS
                        assert violation.path.startswith(("spec.", "metadata.annotations["))
                judged += 1
    assert judged >= 2 * len([d for d in load_fixture_docs() if d["kind"] in TEMPLATE_PATHS])


def compliant_app_pod() -> Pod:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "trainer", "namespace": "ml", "labels": {"shardcache.io/inject": "true"}},
        "spec": {"containers": [{"name": "train", "image": "trainer:1", "securityContext": copy.deepcopy(RESTRICTED_CONTEXT)}]},
    }


def test_hostpath_mode_is_admitted_by_privileged_only() -> None:
    injected, _ = inject(compliant_app_pod(), InjectConfig(image="registry.example.com/shardcache:1.2.3"))
    spec, metadata = injected["spec"], injected["metadata"]
    assert check(spec, "privileged", metadata) == []
    baseline = check(spec, "baseline", metadata)
    assert baseline and {v.check for v in baseline} == {"hostPathVolumes"}
    assert "restrictedVolumes" in {v.check for v in check(spec, "restricted", metadata)}


def test_restricted_mode_shape_passes_restricted() -> None:
    """The restricted mode as issue 16 specifies it: no hostPath, the sidecar non-root with drop
    ALL, RuntimeDefault seccomp and no privilege escalation, reaching the daemon over the pod
    network; written out here, the injector's own test checks what it injects."""
    pod = compliant_app_pod()
    pod["spec"]["initContainers"] = [
        {
            "name": "shardcache",
            "image": "registry.example.com/shardcache:1.2.3",
            "restartPolicy": "Always",
            "args": ["serve", "--mode", "sidecar", "--upstream", "http://shardcache-node.shardcache.svc:8600"],
            "ports": [{"containerPort": 8600, "name": "shardcache"}],
            "readinessProbe": {"httpGet": {"path": "/readyz", "port": 8600}},
            "volumeMounts": [{"name": "shardcache-pod-cache", "mountPath": "/var/cache/shardcache-pod"}],
            "securityContext": {**copy.deepcopy(RESTRICTED_CONTEXT), "runAsUser": 65532, "readOnlyRootFilesystem": True},
        }
    ]
    pod["spec"]["volumes"] = [{"name": "shardcache-pod-cache", "emptyDir": {"sizeLimit": "10Gi"}}]
    assert check(pod["spec"], "restricted", pod["metadata"]) == []
    # an app container that does not comply is still refused: the mode does not make a pod compliant
    del pod["spec"]["containers"][0]["securityContext"]["runAsNonRoot"]
    assert [v.path for v in check(pod["spec"], "restricted", pod["metadata"])] == ["spec.containers[0].securityContext.runAsNonRoot"]
