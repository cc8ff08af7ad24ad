"""The chart, the webhook and the admission policy against a real kube-apiserver (with etcd, RBAC,
Pod Security and admission policies) and, when given, a real kube-controller-manager running the
deployment and replicaset controllers: the envtest way (tests/k8s/controlplane.py). Skipped with
the reason unless SHARDCACHE_TEST_KUBE_APISERVER names a kube-apiserver binary.

The webhook is the real ``shardcache webhook`` process with the flags the chart gives it,
registered by URL with the chart's own MutatingWebhookConfiguration (rules, selectors, match
conditions, failure policy), only its clientConfig pointed at the process.
"""

from __future__ import annotations

import base64
import copy
import dataclasses
import time
from collections.abc import Iterator
from typing import Any

import pytest

from sidecar.k8s.inject import INJECT_LABEL, SIDECAR_NAME, VOLUME_SOCKET, InjectConfig, inject
from tests.support.controlplane import ApiError, ControlPlane, control_plane, eventually
from tests.support.k8s import OPTIONS, VAP_API, Renderer, TLSFiles, WebhookProcess, chart_webhook_args, find, opted_in_deployment, start_webhook
from tests.support.processes import stop

pytestmark = pytest.mark.slow

RELEASE = NS = "shardcache"
# The training namespaces: the default mode, a namespace that chose restricted, and one that
# enforces Pod Security restricted (the webhook's pod-security entry).
HOSTPATH_NS, RESTRICTED_NS, SECURE_NS = "ml", "ml-restricted", "secure"
NAMESPACES = {
    HOSTPATH_NS: {},
    RESTRICTED_NS: {"shardcache.io/mode": "restricted"},
    SECURE_NS: {"pod-security.kubernetes.io/enforce": "restricted", "pod-security.kubernetes.io/enforce-version": "latest"},
}
UPSTREAM = f"tcp://{RELEASE}-local.{NS}.svc:8600"
# What Pod Security restricted asks of every container, for the app containers of the test pods.
RESTRICTED_CONTEXT = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}, "runAsNonRoot": True,
                      "runAsUser": 1000, "seccompProfile": {"type": "RuntimeDefault"}}


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    with control_plane(tmp_path_factory.mktemp("controlplane")) as cp:
        print(f"\nreal control plane: kube-apiserver {cp.version}, controller manager: {cp.controller_manager}")
        yield cp


@pytest.fixture(scope="module")
def chart(renderer: Renderer) -> list[dict[str, Any]]:
    """The chart as the tests install it: release shardcache, workload injection on, on a cluster
    with the admission policy API."""
    return renderer.objects({"webhook": {"injectWorkloads": True}}, namespace=NS, name=RELEASE, api_versions=(VAP_API,))


@pytest.fixture(scope="module")
def hook_config(chart: list[dict[str, Any]]) -> InjectConfig:
    """The injection configuration the chart gives its webhook."""
    from sidecar.cli import build_parser
    from sidecar.cli.commands.webhook import settings_from_args

    args = ["webhook", "--tls-cert", "x", "--tls-key", "y", *chart_webhook_args(chart)]
    config: InjectConfig = settings_from_args(build_parser().parse_args(args)).inject
    return config


@pytest.fixture(scope="module")
def cluster(plane: ControlPlane, chart: list[dict[str, Any]], tls: TLSFiles,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ControlPlane, WebhookProcess]]:
    """The chart's webhook registered by URL, its admission policy created, and the training
    namespaces."""
    objects = chart
    webhook = start_webhook(tmp_path_factory.mktemp("apiserver-webhook"), tls, *chart_webhook_args(objects))
    kube = plane.kube
    try:
        configuration = copy.deepcopy(find(objects, "MutatingWebhookConfiguration"))
        for hook in configuration["webhooks"]:
            path = hook["clientConfig"]["service"]["path"]
            hook["clientConfig"] = {"url": f"https://127.0.0.1:{webhook.port}{path}", "caBundle": base64.b64encode(tls.ca_pem).decode()}
        kube.namespace(NS)
        for name, labels in NAMESPACES.items():
            kube.namespace(name, labels)
        kube.create(configuration)
        kube.create(find(objects, "ValidatingAdmissionPolicy"))
        kube.create(find(objects, "ValidatingAdmissionPolicyBinding"))
        # Admission configuration reaches the API server's admission chain through informers,
        # within seconds, the webhook and the policy each on its own: wait for both.
        eventually(lambda: _injected(kube.create(probe_pod("probe"), dry_run=True).body), timeout=30)
        stray = probe_pod("probe-stray", volumes=[{"name": "cache", "hostPath": {"path": "/var/cache/shardcache"}}])
        eventually(lambda: _refused(lambda: kube.create(stray, dry_run=True)), timeout=30)
        yield plane, webhook
    finally:
        stop(webhook.proc)


def _refused(call: Any) -> bool:
    try:
        call()
    except ApiError:
        return True
    return False


def _injected(pod: dict[str, Any]) -> bool:
    return any(c["name"] == SIDECAR_NAME for c in pod["spec"].get("initContainers", []))


def probe_pod(name: str, namespace: str = HOSTPATH_NS, *, annotations: dict[str, str] | None = None, restricted: bool = False,
              labelled: bool = True, **spec: Any) -> dict[str, Any]:
    container: dict[str, Any] = {"name": "train", "image": "trainer:1"}
    if restricted:
        container["securityContext"] = RESTRICTED_CONTEXT
    spec.setdefault("containers", [container])
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "labels": {INJECT_LABEL: "true"} if labelled else {}}
    if annotations:
        meta["annotations"] = annotations
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


def contains(actual: Any, expected: Any, where: str = "") -> None:
    """``expected`` is in ``actual``: mappings by key (the API server adds defaults), lists element
    by element (the ServiceAccount admission plugin appends its token volume and mounts)."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict), f"{where}: {actual!r}"
        for key, value in expected.items():
            assert key in actual, f"{where}.{key} missing from {sorted(actual)}"
            contains(actual[key], value, f"{where}.{key}")
    elif isinstance(expected, list):
        assert isinstance(actual, list) and len(actual) >= len(expected), f"{where}: {actual!r} != {expected!r}"
        for index, (a, e) in enumerate(zip(actual, expected, strict=False)):
            contains(a, e, f"{where}[{index}]")
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


# ----------------------------------------------------------------------------- the chart's objects


@pytest.mark.parametrize("option", OPTIONS)
def test_every_chart_object_is_accepted(plane: ControlPlane, renderer: Renderer, option: str) -> None:
    """Every object of every value set the chart tests use, created with strict field validation
    (server-side dry run: validation and admission, nothing stored). Kinds of operators the test
    server does not have (ServiceMonitor, cert-manager's Certificate) are left out and named."""
    kube = plane.kube
    kube.namespace(NS)
    objects = renderer.objects(copy.deepcopy(OPTIONS[option]), namespace=NS, api_versions=(VAP_API,))
    accepted, unserved = [], []
    for obj in objects:
        try:
            kube.create(obj, dry_run=True, namespace=obj["metadata"].get("namespace", NS))
        except LookupError:
            unserved.append(f"{obj['apiVersion']} {obj['kind']}")
            continue
        except ApiError as exc:
            raise AssertionError(f"{option}: {obj['kind']} {obj['metadata']['name']} refused: {exc}") from None
        accepted.append(obj["kind"])
    assert accepted, option
    assert {u.split()[0].split("/")[0] for u in unserved} <= {"monitoring.coreos.com", "cert-manager.io"}, unserved


# ----------------------------------------------------------------------------- injected pods


def test_a_hostpath_pod_is_stored_injected(cluster: tuple[ControlPlane, WebhookProcess], hook_config: InjectConfig) -> None:
    plane, _ = cluster
    pod = probe_pod("hostpath-1")
    stored = plane.kube.create(pod).body
    expected, _ = inject(pod, hook_config)
    contains(stored["spec"]["initContainers"], expected["spec"]["initContainers"], "initContainers")
    # The ServiceAccount plugin mounted its token into the app container before the webhook ran.
    (train,) = stored["spec"]["containers"]
    contains(train["env"], expected["spec"]["containers"][0]["env"], "train.env")
    assert {"name": "shardcache-pod-socket", "mountPath": "/run/shardcache-pod", "readOnly": True} in train["volumeMounts"]
    volumes = {v["name"]: v for v in stored["spec"]["volumes"]}
    assert volumes[VOLUME_SOCKET]["hostPath"]["path"] == "/run/shardcache"
    sidecar = stored["spec"]["initContainers"][0]
    assert sidecar["name"] == SIDECAR_NAME and sidecar["restartPolicy"] == "Always"
    assert {m["name"]: m.get("readOnly") for m in sidecar["volumeMounts"]}[VOLUME_SOCKET] is True
    assert stored["metadata"]["annotations"]["shardcache.io/injected"] == "native-sidecar"


def test_a_restricted_pod_is_stored_injected(cluster: tuple[ControlPlane, WebhookProcess], hook_config: InjectConfig) -> None:
    plane, _ = cluster
    pod = probe_pod("restricted-1", RESTRICTED_NS, restricted=True)
    stored = plane.kube.create(pod).body
    expected, _ = inject(pod, dataclasses.replace(hook_config, mode="restricted"))
    contains(stored["spec"]["initContainers"], expected["spec"]["initContainers"], "initContainers")
    assert not any("hostPath" in v for v in stored["spec"]["volumes"])
    args = stored["spec"]["initContainers"][0]["args"]
    assert args[args.index("--upstream") + 1] == UPSTREAM


def test_pod_security_restricted_admits_a_restricted_mode_pod(cluster: tuple[ControlPlane, WebhookProcess]) -> None:
    plane, _ = cluster
    answer = plane.kube.create(probe_pod("secure-1", SECURE_NS, restricted=True))
    stored = answer.body
    assert _injected(stored) and not any("hostPath" in v for v in stored["spec"]["volumes"])
    # A pod that asks for hostpath there gets restricted mode, and is told why.
    answer = plane.kube.create(probe_pod("secure-2", SECURE_NS, restricted=True, annotations={"shardcache.io/mode": "hostpath"}))
    assert _injected(answer.body) and not any("hostPath" in v for v in answer.body["spec"]["volumes"])
    assert any("Pod Security" in w and "shardcache.io/mode" in w for w in answer.warnings), answer.warnings


def test_a_hostpath_sidecar_refused_by_pod_security_is_told_the_fix(cluster: tuple[ControlPlane, WebhookProcess]) -> None:
    """`shardcache inject` output (hostpath mode) applied to a namespace that enforces Pod Security:
    Pod Security refuses it with its own message, and the webhook's warning says what to do."""
    plane, _ = cluster
    injected, _ = inject(probe_pod("secure-3", SECURE_NS, restricted=True), InjectConfig())
    with pytest.raises(ApiError) as refused:
        plane.kube.create(injected)
    assert refused.value.status == 403 and "hostPath" in refused.value.message, refused.value
    assert any("--mode restricted" in w for w in refused.value.warnings), refused.value.warnings


def test_a_writable_socket_mount_is_stored_read_only(cluster: tuple[ControlPlane, WebhookProcess]) -> None:
    plane, _ = cluster
    sneaky = {"name": "sneaky", "image": "x:1", "volumeMounts": [{"name": VOLUME_SOCKET, "mountPath": "/run/shardcache"}]}
    answer = plane.kube.create(probe_pod("sneaky-1", containers=[{"name": "train", "image": "t:1"}, sneaky]))
    stored = {c["name"]: c for c in answer.body["spec"]["containers"]}["sneaky"]
    assert stored["volumeMounts"][0]["readOnly"] is True
    assert any("sneaky" in w and "read-only" in w for w in answer.warnings), answer.warnings


# ----------------------------------------------------------------------------- the admission policy


def test_the_policy_type_checks_and_refuses_what_it_should(cluster: tuple[ControlPlane, WebhookProcess]) -> None:
    plane, _ = cluster
    kube = plane.kube
    name = f"{RELEASE}-hostpath-policy"

    def checked() -> dict[str, Any]:
        policy = kube.get("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicy", name)
        status: dict[str, Any] = policy.get("status", {})
        assert status.get("observedGeneration") == policy["metadata"]["generation"], status
        return status

    if plane.controller_manager:  # type checking is the controller manager's work
        status = eventually(checked, timeout=60)
        # Type-checked against the pod schema: no expression warnings (a typo in a field name would be one).
        assert status.get("typeChecking", {}).get("expressionWarnings", []) == [], status
    # A hostPath of the pod author's own, next to the injected one.
    stray = probe_pod("stray-1", volumes=[{"name": "cache", "hostPath": {"path": "/var/cache/shardcache"}}])
    with pytest.raises(ApiError) as refused:
        kube.create(stray)
    assert refused.value.status in (403, 422) and "may have no hostPath volume but shardcache-socket" in refused.value.message
    # The socket volume mounted writable by hand, in a pod the webhook does not inject.
    by_hand = probe_pod("by-hand-1", labelled=False, volumes=[{"name": VOLUME_SOCKET, "hostPath": {"path": "/run/shardcache"}}],
                        containers=[{"name": "c", "image": "x:1", "volumeMounts": [{"name": VOLUME_SOCKET, "mountPath": "/s"}]}])
    with pytest.raises(ApiError) as refused:
        kube.create(by_hand)
    assert "mounts the volume shardcache-socket" in refused.value.message and "readOnly: true" in refused.value.message


# ----------------------------------------------------------------------------- controllers


@pytest.mark.parametrize("label_on", ["template", "deployment"])
def test_a_deployment_settles_at_one_replicaset(cluster: tuple[ControlPlane, WebhookProcess], label_on: str) -> None:
    """The storm: with workload injection on, a Deployment opted in on its template (as the
    README shows) or on itself, under a running deployment controller, makes one ReplicaSet,
    whose pods carry the sidecar, and no hash collision."""
    plane, webhook = cluster
    if not plane.controller_manager:
        pytest.skip("no controller manager: set SHARDCACHE_TEST_KUBE_CONTROLLER_MANAGER to a kube-controller-manager binary")
    kube = plane.kube
    name = f"train-{label_on}"
    stored = kube.create(opted_in_deployment(name, HOSTPATH_NS, label_on=label_on, replicas=2)).body
    # Labelled on itself, the Deployment is what is injected; on its template, its pods are.
    assert _injected(stored["spec"]["template"]) == (label_on == "deployment")

    def pods() -> list[dict[str, Any]]:
        found = kube.list("v1", "Pod", HOSTPATH_NS, selector=f"app={name}")
        return found if len(found) == 2 else []

    for pod in eventually(pods, timeout=60):
        assert _injected(pod), pod["metadata"]["name"]
    time.sleep(10)  # the storm made 150 ReplicaSets in 40 s: ten seconds show it
    replicasets = kube.list("apps/v1", "ReplicaSet", HOSTPATH_NS, selector=f"app={name}")
    assert len(replicasets) == 1, [r["metadata"]["name"] for r in replicasets]
    status = kube.get("apps/v1", "Deployment", name, HOSTPATH_NS).get("status", {})
    assert not status.get("collisionCount"), status
    template = copy.deepcopy(replicasets[0]["spec"]["template"])
    template["metadata"]["labels"].pop("pod-template-hash")
    assert template == kube.get("apps/v1", "Deployment", name, HOSTPATH_NS)["spec"]["template"]
    assert "injected replicaset" not in webhook.log_text()


def test_the_webhook_metrics_name_no_replicaset(cluster: tuple[ControlPlane, WebhookProcess]) -> None:
    """What controllers made never reaches the webhook (the workload entries' matchConditions)."""
    _, webhook = cluster
    status, body = webhook.request("GET", "/metrics")
    assert status == 200
    lines = [line for line in body.decode().splitlines() if line.startswith("shardcache_webhook_admissions_total{")]
    assert not [line for line in lines if 'kind="ReplicaSet"' in line], lines

