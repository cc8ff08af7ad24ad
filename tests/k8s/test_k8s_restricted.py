"""Injection without the node cache, the ``restricted`` mode, and the chart's admission policy.

hostpath mode (the default): an injected pod has exactly one hostPath, the daemon's socket
directory, read-only and in the sidecar only; no container mounts the node cache; the app
containers get file handles through a pod-local ``emptyDir`` (read-only) and
``SHARDCACHE_HANDLES``. restricted mode: no hostPath at all, the sidecar reads through the chart's
node-local Service and is what Pod Security ``restricted`` asks of a container. The mode comes from
the namespace (the webhook path its MutatingWebhookConfiguration entry calls) or the pod's
annotation, through the pure function, the real ``shardcache webhook`` and ``shardcache inject``
processes. The chart (Helm's engine): the Service with ``internalTrafficPolicy: Local``, the
webhook entries' namespace selectors evaluated, the NetworkPolicy that admits the Service's traffic,
and the ValidatingAdmissionPolicy, whose CEL is evaluated with cel-python against pods.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
from collections.abc import Callable
from typing import Any

import pytest

from sidecar.k8s.inject import (
    DEFAULT_RESTRICTED_UPSTREAM,
    ENDPOINT_ENV,
    HANDLES_ENV,
    INJECT_LABEL,
    RESTRICTED_UID,
    SIDECAR_NAME,
    InjectConfig,
    inject,
)
from sidecar.k8s.patch import json_patch
from sidecar.k8s.yamldocs import dump_documents
from tests.support.k8s import (
    CHART,
    TEMPLATE_PATHS,
    VAP_API,
    Renderer,
    WebhookProcess,
    admission_review,
    apply_patch,
    check_pod_semantics,
    docs,
    find,
    kubectl_parse,
    load_fixture_docs,
    pod_templates,
    run_inject,
    selects,
    subcommands,
    validate_k8s,
)

NS = "shardcache"
IMAGE = "registry.example.com/shardcache:test"
UPSTREAM = "tcp://sc-shardcache-local.shardcache.svc:8600"
HOSTPATH = InjectConfig(image=IMAGE, restricted_upstream=UPSTREAM)
RESTRICTED = InjectConfig(image=IMAGE, mode="restricted", restricted_upstream=UPSTREAM)
RESTRICTED_FALLBACK = InjectConfig(image=IMAGE, mode="restricted", restricted_upstream=UPSTREAM, native_sidecar=False)
HANDLES = "unix:///run/shardcache-pod/handles.sock"
WORKLOADS = [d for d in load_fixture_docs() if d["kind"] in TEMPLATE_PATHS]


def pod(annotations: dict[str, str] | None = None, labels: dict[str, str] | None = None, **spec: Any) -> dict[str, Any]:
    spec.setdefault("containers", [{"name": "train", "image": "trainer:1"}])
    meta: dict[str, Any] = {"name": "p", "namespace": "ml", "labels": {INJECT_LABEL: "true", **(labels or {})}}
    if annotations:
        meta["annotations"] = annotations
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


def compliant_pod(annotations: dict[str, str] | None = None) -> dict[str, Any]:
    """A trainer whose own settings Pod Security ``restricted`` admits (pod-level user and
    seccomp, containers without privilege escalation or capabilities)."""
    hardened = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    return pod(
        annotations,
        securityContext={"runAsNonRoot": True, "runAsUser": 1000, "fsGroup": 1000, "seccompProfile": {"type": "RuntimeDefault"}},
        containers=[{"name": "train", "image": "trainer:1", "securityContext": hardened,
                     "volumeMounts": [{"name": "data", "mountPath": "/data"}]}],
        initContainers=[{"name": "fetch", "image": "fetch:1", "securityContext": hardened}],
        volumes=[{"name": "data", "emptyDir": {}}],
    )


def sidecar_of(spec: dict[str, Any]) -> dict[str, Any]:
    (found,) = [c for c in spec.get("initContainers", []) + spec["containers"] if c["name"] == SIDECAR_NAME]
    return found


def apps_of(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """The containers the sidecar serves: regular ones, and init containers after a native sidecar."""
    init = spec.get("initContainers", [])
    after = [c for i, c in enumerate(init) if i > 0] if init and init[0]["name"] == SIDECAR_NAME else []
    return [c for c in spec["containers"] if c["name"] != SIDECAR_NAME] + after


def env_of(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container.get("env", [])}


def host_paths(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [v for v in spec.get("volumes", []) if "hostPath" in v]


def every_container(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return spec["containers"] + spec.get("initContainers", []) + spec.get("ephemeralContainers", [])


def injected(obj: dict[str, Any], config: InjectConfig) -> dict[str, Any]:
    out, outcome = inject(obj, config)
    assert outcome.result == "injected"
    for version in ("1.29", "1.30") if config.native_sidecar else ("1.25", "1.30"):
        validate_k8s(out, version)
    claims = tuple(c["metadata"]["name"] for c in obj.get("spec", {}).get("volumeClaimTemplates", []))
    for template in pod_templates(out):
        check_pod_semantics(template["spec"], claims)
    return out


def assert_hostpath_shape(spec: dict[str, Any], *, handles: bool = True) -> None:
    # Exactly one hostPath: the daemon's socket directory, read-only, and only the sidecar mounts it.
    (socket,) = host_paths(spec)
    assert socket == {"name": "shardcache-socket", "hostPath": {"path": "/run/shardcache", "type": "DirectoryOrCreate"}}
    mounting = [(c["name"], m) for c in every_container(spec) for m in c.get("volumeMounts", []) if m["name"] == "shardcache-socket"]
    assert mounting == [(SIDECAR_NAME, {"name": "shardcache-socket", "mountPath": "/run/shardcache", "readOnly": True})]
    # No container sees the node cache directory, by any path.
    for container in every_container(spec):
        for mount in container.get("volumeMounts", []):
            assert not mount["mountPath"].rstrip("/").startswith("/var/cache/shardcache") or mount["mountPath"] == "/var/cache/shardcache-pod"
            assert mount["name"] != "shardcache-node-cache"
    sidecar = sidecar_of(spec)
    args = sidecar["args"]
    assert args[args.index("--upstream") + 1] == "unix:///run/shardcache/daemon.sock"
    volumes = {v["name"]: v for v in spec["volumes"]}
    if not handles:
        assert "--handles" not in args and "shardcache-pod-socket" not in volumes
        assert all(HANDLES_ENV not in env_of(c) for c in apps_of(spec))
        return
    assert args[args.index("--handles") + 1] == HANDLES
    assert volumes["shardcache-pod-socket"] == {"name": "shardcache-pod-socket", "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}}
    assert {"name": "shardcache-pod-socket", "mountPath": "/run/shardcache-pod"} in sidecar["volumeMounts"]
    for container in apps_of(spec):
        assert env_of(container)[HANDLES_ENV] == HANDLES
        ours = [m for m in container["volumeMounts"] if m["name"].startswith("shardcache-")]
        # Read-only: connecting to the sidecar's socket needs no write access.
        assert ours == [{"name": "shardcache-pod-socket", "mountPath": "/run/shardcache-pod", "readOnly": True}]


def assert_restricted_shape(spec: dict[str, Any], upstream: str = UPSTREAM) -> None:
    assert host_paths(spec) == []
    sidecar = sidecar_of(spec)
    args = sidecar["args"]
    assert args[args.index("--upstream") + 1] == upstream and "--handles" not in args
    assert {v["name"] for v in spec["volumes"] if v["name"].startswith("shardcache-")} == {"shardcache-pod-cache"}
    assert [m["name"] for m in sidecar["volumeMounts"] if m["name"].startswith("shardcache-")] == ["shardcache-pod-cache"]
    # What Pod Security restricted asks of every container, on the sidecar's own securityContext.
    assert sidecar["securityContext"] == {
        "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}, "runAsNonRoot": True,
        "runAsUser": RESTRICTED_UID, "runAsGroup": RESTRICTED_UID, "seccompProfile": {"type": "RuntimeDefault"},
    }
    assert RESTRICTED_UID != 0
    for container in apps_of(spec):
        assert env_of(container)[ENDPOINT_ENV].startswith("http://127.0.0.1:")
        assert HANDLES_ENV not in env_of(container)
        assert not [m for m in container.get("volumeMounts", []) if m["name"].startswith("shardcache-")]


# ----------------------------------------------------------------------------- hostpath mode


@pytest.mark.parametrize("config", [HOSTPATH, InjectConfig(image=IMAGE, native_sidecar=False)], ids=["native", "container"])
@pytest.mark.parametrize("obj", WORKLOADS, ids=lambda o: o["kind"])
def test_hostpath_pods_have_the_socket_as_their_only_host_path(obj: dict[str, Any], config: InjectConfig) -> None:
    out = injected(obj, config)
    for template in pod_templates(out):
        assert_hostpath_shape(template["spec"])


def test_hostpath_without_short_circuit_has_no_pod_socket() -> None:
    for obj, config in ((pod(), InjectConfig(image=IMAGE, short_circuit=False)),
                        (pod({"shardcache.io/short-circuit": "false"}), HOSTPATH)):
        assert_hostpath_shape(injected(obj, config)["spec"], handles=False)


def test_sidecar_args_are_accepted_by_the_real_serve_command() -> None:
    from sidecar.cli import build_parser

    parser = build_parser()
    if "serve" not in subcommands(parser):
        pytest.skip("sidecar.cli.commands.serve is not in this tree yet")
    from sidecar.cli.commands.serve import build_settings

    hostpath = sidecar_of(injected(pod(), HOSTPATH)["spec"])["args"]
    restricted = sidecar_of(injected(pod(), RESTRICTED)["spec"])["args"]
    try:
        parsed = [parser.parse_args(hostpath), parser.parse_args(restricted)]
    except SystemExit:
        pytest.skip("shardcache serve lacks --handles (being built alongside)")
    first, second = (build_settings(args) for args in parsed)
    # The sidecar relays the app containers' handle requests to the node's handles.sock, next to
    # daemon.sock in the socket directory it mounts.
    assert first.mode == "sidecar" and first.handles == HANDLES and first.upstream == "unix:///run/shardcache/daemon.sock"
    assert second.mode == "sidecar" and second.handles is None and second.upstream == UPSTREAM


# ----------------------------------------------------------------------------- restricted mode


@pytest.mark.parametrize("config", [RESTRICTED, RESTRICTED_FALLBACK], ids=["native", "container"])
@pytest.mark.parametrize("obj", WORKLOADS, ids=lambda o: o["kind"])
def test_restricted_pods_have_no_host_path(obj: dict[str, Any], config: InjectConfig) -> None:
    out = injected(obj, config)
    for template in pod_templates(out):
        assert_restricted_shape(template["spec"])


def test_restricted_leaves_the_pods_own_settings_alone() -> None:
    original = compliant_pod()
    out = injected(original, RESTRICTED)
    assert out["spec"]["securityContext"] == original["spec"]["securityContext"]
    for before in original["spec"]["containers"] + original["spec"]["initContainers"]:
        (after,) = [c for c in every_container(out["spec"]) if c["name"] == before["name"]]
        assert after["securityContext"] == before["securityContext"]
    # The webhook's patch touches nothing of the pod's but the init containers the sidecar is
    # put in front of (a list that changed other than at its end is replaced whole).
    patch = json_patch(original, out)
    assert [op["path"] for op in patch if op["op"] != "add"] == ["/spec/initContainers"], patch


def test_the_default_upstream_is_the_default_release_service() -> None:
    # `helm install shardcache charts/shardcache -n shardcache`: fullname shardcache, Service shardcache-local.
    sidecar = sidecar_of(injected(pod(), InjectConfig(mode="restricted"))["spec"])
    assert sidecar["args"][sidecar["args"].index("--upstream") + 1] == DEFAULT_RESTRICTED_UPSTREAM == "tcp://shardcache-local.shardcache.svc:8600"


def test_the_pods_annotation_wins_over_the_configured_mode() -> None:
    assert_restricted_shape(injected(pod({"shardcache.io/mode": "restricted"}), HOSTPATH)["spec"])
    assert_restricted_shape(injected(pod({"shardcache.io/mode": " Restricted "}), HOSTPATH)["spec"])
    assert_hostpath_shape(injected(pod({"shardcache.io/mode": "hostpath"}), RESTRICTED)["spec"])


def test_restricted_has_no_short_circuit_even_when_asked() -> None:
    out, outcome = inject(pod({"shardcache.io/short-circuit": "true"}), RESTRICTED)
    assert_restricted_shape(out["spec"])
    (warning,) = outcome.warnings
    assert "shardcache.io/short-circuit" in warning and "restricted mode" in warning and "shardcache.io/mode: hostpath" in warning


def test_an_injected_pod_keeps_its_mode_whatever_the_next_pass() -> None:
    # The sidecar already there decides: a restricted pod never gets the hostPath or the handles
    # from a later pass configured otherwise (a reinvocation, `kubectl get ... | shardcache inject`).
    restricted = injected(pod(), RESTRICTED)
    hostpath = injected(pod(), HOSTPATH)
    for once, other in ((restricted, HOSTPATH), (hostpath, RESTRICTED), (hostpath, InjectConfig(image=IMAGE, short_circuit=False))):
        again, outcome = inject(once, other)
        assert again == once and outcome.result == "unchanged"
    # A container another webhook added later gets what the pod's own mode gives.
    for once, check in ((restricted, assert_restricted_shape), (hostpath, assert_hostpath_shape)):
        mutated = copy.deepcopy(once)
        mutated["spec"]["containers"].append({"name": "added-later", "image": "istio/proxyv2:1.22"})
        again = injected(mutated, HOSTPATH if once is restricted else RESTRICTED)
        check(again["spec"])
        patch = json_patch(mutated, again)
        assert patch and all(op["op"] == "add" for op in patch), patch


def test_mode_by_annotation_on_a_workload_template() -> None:
    job = copy.deepcopy(next(d for d in WORKLOADS if d["kind"] == "PyTorchJob"))
    job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["metadata"].setdefault("annotations", {})["shardcache.io/mode"] = "restricted"
    out = injected(job, HOSTPATH)
    assert_hostpath_shape(out["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"])
    assert_restricted_shape(out["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"])


# ----------------------------------------------------------------------------- the real webhook and command


@pytest.fixture(scope="module")
def mode_webhook(webhook_factory: Callable[..., WebhookProcess]) -> WebhookProcess:
    return webhook_factory("--sidecar-image", IMAGE, "--restricted-upstream", UPSTREAM)


def _mutate(webhook: WebhookProcess, path: str, obj: dict[str, Any]) -> tuple[int, Any]:
    status, data = webhook.request("POST", path, json.dumps(admission_review(obj)).encode(), {"Content-Type": "application/json"})
    try:
        return status, json.loads(data)
    except ValueError:
        return status, data


def test_webhook_mode_by_path_and_by_annotation(mode_webhook: WebhookProcess) -> None:
    for path, obj, check, config in (
        ("/mutate", pod(), assert_hostpath_shape, HOSTPATH),
        ("/mutate/hostpath", pod(), assert_hostpath_shape, HOSTPATH),
        ("/mutate/restricted", pod(), assert_restricted_shape, RESTRICTED),
        # The pod wins over its namespace, either way.
        ("/mutate/restricted", pod({"shardcache.io/mode": "hostpath"}), assert_hostpath_shape, RESTRICTED),
        ("/mutate/hostpath", pod({"shardcache.io/mode": "restricted"}), assert_restricted_shape, HOSTPATH),
    ):
        status, body = _mutate(mode_webhook, path, obj)
        assert status == 200 and body["response"]["allowed"] is True, (path, body)
        patched = apply_patch(obj, body["response"])
        check(patched["spec"])
        # The same as the offline function, in the namespace's mode.
        assert patched == inject(obj, config)[0], path
        validate_k8s(patched, "1.30")
    status, body = _mutate(mode_webhook, "/mutate/privileged", pod())
    assert status == 404 and "error" in body


def test_inject_command_mode_flag() -> None:
    done = run_inject("-f", "-", "--mode", "restricted", "--restricted-upstream", UPSTREAM, "--sidecar-image", IMAGE,
                      stdin=dump_documents([pod(), pod({"shardcache.io/mode": "hostpath"})]))
    assert done.returncode == 0, done.stderr
    restricted, hostpath = docs(done.stdout)
    assert_restricted_shape(restricted["spec"])
    assert_hostpath_shape(hostpath["spec"])
    assert [o["kind"] for o in kubectl_parse(done.stdout)] == ["Pod", "Pod"]
    bad = run_inject("-f", "-", "--mode", "restricted", "--restricted-upstream", "http://x:8600", stdin=dump_documents([pod()]))
    assert bad.returncode == 2 and bad.stdout == "" and "invalid restricted upstream 'http://x:8600'" in bad.stderr
    assert "Traceback" not in bad.stderr
    wrong = run_inject("-f", "-", "--mode", "baseline", stdin=dump_documents([pod()]))
    assert wrong.returncode == 2 and "--mode" in wrong.stderr


# ----------------------------------------------------------------------------- Pod Security


def test_pod_security_levels_of_each_mode() -> None:
    podsecurity = pytest.importorskip("sidecar.k8s.podsecurity")
    for obj in (compliant_pod(), compliant_pod({"shardcache.io/mode": "restricted"})):
        assert podsecurity.check(obj["spec"], "restricted", obj["metadata"]) == [], "the trainer alone complies"
        restricted = injected(obj, RESTRICTED if "annotations" not in obj["metadata"] else HOSTPATH)
        assert host_paths(restricted["spec"]) == []
        assert podsecurity.check(restricted["spec"], "restricted", restricted["metadata"]) == []
        assert podsecurity.check(restricted["spec"], "baseline", restricted["metadata"]) == []
    # hostpath mode: refused by baseline (and so restricted) for its one hostPath volume, and for nothing else.
    hostpath = injected(compliant_pod(), HOSTPATH)
    violations = podsecurity.check(hostpath["spec"], "baseline", hostpath["metadata"])
    assert violations and {v.check for v in violations} == {"hostPathVolumes"}, violations
    index = [v["name"] for v in hostpath["spec"]["volumes"]].index("shardcache-socket")
    assert all(v.path.startswith(f"spec.volumes[{index}]") for v in violations), violations
    assert podsecurity.check(hostpath["spec"], "privileged", hostpath["metadata"]) == []


# ----------------------------------------------------------------------------- the chart


def render_files(renderer: Renderer, values: dict[str, Any] | None = None, *, api_versions: tuple[str, ...] = ()) -> dict[str, str]:
    return renderer.files(values, namespace=NS, api_versions=api_versions)


def render(renderer: Renderer, values: dict[str, Any] | None = None, *, api_versions: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    return renderer.objects(values, namespace=NS, api_versions=api_versions)


def namespace(name: str, **labels: str) -> dict[str, str]:
    return {"kubernetes.io/metadata.name": name, **labels}


def webhook_args(objects: list[dict[str, Any]]) -> list[str]:
    (container,) = find(objects, "Deployment", "-webhook")["spec"]["template"]["spec"]["containers"]
    return list(container["args"])


def test_the_node_local_service(renderer: Renderer) -> None:
    objects = renderer.objects({})
    svc = find(objects, "Service", "-local")
    ds = find(objects, "DaemonSet", "-node")
    assert svc["metadata"]["name"] == "sc-shardcache-local"
    spec = svc["spec"]
    # Only the daemon on the caller's own node: its cache is the one that node's pods share.
    assert spec["internalTrafficPolicy"] == "Local" and spec["type"] == "ClusterIP" and "clusterIP" not in spec
    assert spec["selector"].items() <= ds["spec"]["template"]["metadata"]["labels"].items()
    (port,) = spec["ports"]
    (daemon,) = ds["spec"]["template"]["spec"]["containers"]
    assert port["port"] == 8600 and {p["name"]: p["containerPort"] for p in daemon["ports"]}[port["targetPort"]] == 8600
    # The daemon listens on its pod IP: no host network, no host port.
    assert "tcp://0.0.0.0:8600" in daemon["args"]
    assert "hostNetwork" not in ds["spec"]["template"]["spec"] and all("hostPort" not in p for p in daemon["ports"])
    for version in ("1.25", "1.30"):
        validate_k8s(svc, version)
    # The webhook points restricted-mode sidecars at it.
    args = webhook_args(objects)
    assert args[args.index("--restricted-upstream") + 1] == f"tcp://{svc['metadata']['name']}.{NS}.svc:8600"
    ported = renderer.objects({"node": {"port": 9700}, "fullnameOverride": "cache"})
    assert find(ported, "Service", "-local")["spec"]["ports"][0]["port"] == 9700
    args = webhook_args(ported)
    assert args[args.index("--restricted-upstream") + 1] == "tcp://cache-local.shardcache.svc:9700"


def test_the_charts_webhook_injects_restricted_pods_at_the_service(renderer: Renderer) -> None:
    from sidecar.cli import build_parser
    from sidecar.cli.commands.webhook import settings_from_args

    args = webhook_args(renderer.objects({}))
    config = settings_from_args(build_parser().parse_args(args)).inject
    assert config.mode == "hostpath" and config.restricted_upstream == UPSTREAM and config.short_circuit is True
    assert_restricted_shape(injected(pod({"shardcache.io/mode": "restricted"}), config)["spec"])
    assert_hostpath_shape(injected(pod(), config)["spec"])
    # The node daemon serves the handles the hostpath sidecars relay.
    (daemon,) = find(renderer.objects({}), "DaemonSet", "-node")["spec"]["template"]["spec"]["containers"]
    assert daemon["args"][daemon["args"].index("--handles") + 1] == "unix:///run/shardcache/handles.sock"


@pytest.mark.parametrize(
    "values, expected",
    [
        # (namespace labels -> the webhook entry that injects it, or None)
        ({}, [(namespace("ml"), "pods"), (namespace("ml", **{"shardcache.io/mode": "hostpath"}), "pods"),
              (namespace("vision", **{"shardcache.io/mode": "restricted"}), "restricted-pods"),
              (namespace("kube-system", **{"shardcache.io/mode": "restricted"}), None), (namespace(NS), None),
              # Pod Security baseline and restricted refuse every hostPath: the pod-security entry
              # (restricted mode, whatever is asked); privileged does not.
              (namespace("secure", **{"pod-security.kubernetes.io/enforce": "restricted"}), "pod-security-pods"),
              (namespace("secure", **{"pod-security.kubernetes.io/enforce": "baseline", "shardcache.io/mode": "hostpath"}),
               "pod-security-pods"),
              (namespace("open", **{"pod-security.kubernetes.io/enforce": "privileged"}), "pods"),
              (namespace("warned", **{"pod-security.kubernetes.io/warn": "restricted"}), "pods")]),
        ({"webhook": {"sidecar": {"mode": "restricted"}}},
         [(namespace("ml"), "pods"), (namespace("ml", **{"shardcache.io/mode": "restricted"}), "pods"),
          (namespace("legacy", **{"shardcache.io/mode": "hostpath"}), "hostpath-pods")]),
        ({"webhook": {"namespaceSelector": {"matchLabels": {"team": "vision"}}}},
         [(namespace("ml"), None), (namespace("a", team="vision"), "pods"),
          (namespace("b", team="vision", **{"shardcache.io/mode": "restricted"}), "restricted-pods")]),
    ],
    ids=["defaults", "restricted-by-default", "namespaces"],
)
def test_the_mode_follows_the_namespace_label(renderer: Renderer, values: dict[str, Any], expected: list[tuple[dict[str, str], str | None]]) -> None:
    objects = renderer.objects(values)
    mwc = find(objects, "MutatingWebhookConfiguration")
    default = values.get("webhook", {}).get("sidecar", {}).get("mode", "hostpath")
    other = "restricted" if default == "hostpath" else "hostpath"
    hooks = {h["name"].removesuffix(".inject.shardcache.io"): h for h in mwc["webhooks"]}
    assert set(hooks) == {"pods", f"{other}-pods", "pod-security-pods"}
    assert hooks["pod-security-pods"]["clientConfig"]["service"]["path"] == "/mutate/pod-security"
    # The plain entry (and path) is the webhook's own --mode; the other one has its mode in the path.
    assert hooks["pods"]["clientConfig"]["service"]["path"] == "/mutate"
    assert hooks[f"{other}-pods"]["clientConfig"]["service"]["path"] == f"/mutate/{other}"
    args = webhook_args(objects)
    assert args[args.index("--mode") + 1] == default
    for labels, hook in expected:
        matching = [name for name, h in hooks.items() if selects(h["namespaceSelector"], labels)]
        assert matching == ([hook] if hook else []), (labels, matching)
    validate_k8s(mwc, "1.30")


def test_network_policy_admits_restricted_sidecars_on_the_service_port(renderer: Renderer) -> None:
    # The Service delivers to the daemon's pod IP and port, so the daemons' ingress rule for the
    # training namespaces is what a restricted-mode sidecar's connection meets.
    for values in ({}, {"webhook": {"namespaceSelector": {"matchLabels": {"team": "vision"}}}}):
        objects = renderer.objects(values)
        policy = next(o for o in objects if o["kind"] == "NetworkPolicy" and o["metadata"]["name"].endswith("-node"))
        ds = find(objects, "DaemonSet", "-node")
        assert selects(policy["spec"]["podSelector"], ds["spec"]["template"]["metadata"]["labels"])
        port = find(objects, "Service", "-local")["spec"]["ports"][0]["port"]
        restricted = namespace("vision", team="vision", **{"shardcache.io/mode": "restricted"})
        # The first rule; the other admits the other daemons (node.cluster, tests/k8s/test_k8s_cluster.py).
        rule = policy["spec"]["ingress"][0]
        assert any(p["port"] == port for p in rule["ports"])
        assert any(selects(peer["namespaceSelector"], restricted) for peer in rule["from"] if "namespaceSelector" in peer)
        assert not any(selects(peer["namespaceSelector"], namespace("kube-system")) for peer in rule["from"] if "namespaceSelector" in peer)


# ----------------------------------------------------------------------------- the admission policy


class Policy:
    """A rendered ValidatingAdmissionPolicy's CEL, compiled with cel-python and evaluated as the
    API server does for a pod: variables in order, then each validation; a failed one answers its
    messageExpression (its message where that does not evaluate)."""

    def __init__(self, vap: dict[str, Any]) -> None:
        import celpy

        self.celpy = celpy
        env = celpy.Environment()
        spec = vap["spec"]
        expressions = [v["expression"] for v in spec.get("variables", [])]
        expressions += [e for v in spec["validations"] for e in (v["expression"], v.get("messageExpression", "true"))]
        expressions += [c["expression"] for c in spec.get("matchConditions", [])]
        for expression in expressions:
            # Only what these evaluations supply: no request, params, namespace or authorizer.
            assert not re.search(r"\b(oldObject|request|params|namespaceObject|authorizer)\b", expression), expression
        self.variables = [(v["name"], env.program(env.compile(v["expression"]))) for v in spec.get("variables", [])]
        self.conditions = [env.program(env.compile(c["expression"])) for c in spec.get("matchConditions", [])]
        self.validations = [
            (env.program(env.compile(v["expression"])),
             env.program(env.compile(v["messageExpression"])) if "messageExpression" in v else None,
             v.get("message", ""))
            for v in spec["validations"]
        ]
        for v in spec["validations"]:
            assert "\n" not in v.get("message", ""), "the API server refuses a message with line breaks"

    def refusals(self, obj: dict[str, Any]) -> list[str]:
        from celpy import celtypes

        activation: dict[str, Any] = {"object": self.celpy.json_to_cel(obj)}
        if not all(bool(c.evaluate(activation)) for c in self.conditions):
            return []
        computed: dict[Any, Any] = {}
        for name, program in self.variables:
            activation["variables"] = celtypes.MapType(computed)
            computed[celtypes.StringType(name)] = program.evaluate(activation)
        activation["variables"] = celtypes.MapType(computed)
        out = []
        for check, message, fallback in self.validations:
            result = check.evaluate(activation)
            assert isinstance(result, celtypes.BoolType), result
            if not result:
                text = str(message.evaluate(activation)) if message is not None else fallback
                assert "\n" not in text
                out.append(text)
        return out


def admission_policy(renderer: Renderer, values: dict[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    objects = render(renderer, values, api_versions=(VAP_API,))
    vap = find(objects, "ValidatingAdmissionPolicy")
    binding = find(objects, "ValidatingAdmissionPolicyBinding")
    return vap, binding


@pytest.fixture(scope="module")
def policy(renderer: Renderer) -> Policy:
    return Policy(admission_policy(renderer)[0])


def test_the_policy_is_rendered_where_the_cluster_has_the_api(renderer: Renderer) -> None:
    vap, binding = admission_policy(renderer)
    for obj in (vap, binding):
        validate_k8s(obj, "1.30")
        assert "namespace" not in obj["metadata"]  # cluster-scoped
        assert obj["metadata"]["labels"]["app.kubernetes.io/instance"] == "sc"
    assert binding["spec"]["policyName"] == vap["metadata"]["name"] == "sc-shardcache-hostpath-policy"
    assert binding["spec"]["validationActions"] == ["Deny"] and vap["spec"]["failurePolicy"] == "Fail"
    rules = vap["spec"]["matchConstraints"]["resourceRules"]
    assert [(r["operations"], r["resources"]) for r in rules] == [(["CREATE"], ["pods"]), (["UPDATE"], ["pods/ephemeralcontainers"])]
    # helm template without --api-versions: Kubernetes 1.30+ is assumed, where the API is GA.
    # (Before, the policy was skipped there, silently: a GitOps install had none.)
    kinds = {o["kind"] for o in render(renderer, {})}
    assert {"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"} <= kinds
    off = {o["kind"] for o in render(renderer, {"admissionPolicy": {"enabled": False}}, api_versions=(VAP_API,))}
    assert not off & {"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}
    with_policy = render(renderer, {}, api_versions=(VAP_API,))
    text = dump_documents([o for o in with_policy if o["kind"].startswith("ValidatingAdmissionPolicy")])
    assert {o["kind"] for o in kubectl_parse(text)} == {"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}
    notes = render_files(renderer, {}, api_versions=(VAP_API,))["shardcache/templates/NOTES.txt"]
    assert "ValidatingAdmissionPolicy sc-shardcache-hostpath-policy (Deny)" in notes
    assert "nor run privileged, add capabilities" in notes
    off_notes = render_files(renderer, {"admissionPolicy": {"enabled": False}})["shardcache/templates/NOTES.txt"]
    assert "ValidatingAdmissionPolicy" not in off_notes


def test_the_chart_fails_loudly_on_a_cluster_without_the_policy_api(renderer: Renderer) -> None:
    """A cluster before 1.30 serves no ValidatingAdmissionPolicy: the chart refuses to render
    (install) without it, saying what to do, rather than skip it; unless it is turned off."""

    def render_at(kube_version: str, values: dict[str, Any], api_versions: tuple[str, ...] = ()) -> dict[str, str]:
        return renderer.files(values, namespace=NS, api_versions=api_versions, kube_version=kube_version)

    with pytest.raises(renderer.helm.HelmRenderError) as info:
        render_at("v1.29.0", {})
    assert "Kubernetes v1.29.0 serves no ValidatingAdmissionPolicy" in str(info.value)
    assert "set admissionPolicy.enabled=false" in str(info.value)
    assert "kind: ValidatingAdmissionPolicy" not in "".join(render_at("v1.29.0", {"admissionPolicy": {"enabled": False}}).values())
    # Discovery listing the API is enough (a 1.28 cluster with the beta feature promoted by a vendor).
    assert "kind: ValidatingAdmissionPolicy" in render_at("v1.28.0", {}, (VAP_API,))["shardcache/templates/admission-policy.yaml"]
    assert "kind: ValidatingAdmissionPolicy" in render_at("v1.30.0", {})["shardcache/templates/admission-policy.yaml"]


def test_the_policy_guards_the_injected_namespaces(renderer: Renderer) -> None:
    for values, inside, outside in (
        ({}, [namespace("ml"), namespace("vision", **{"shardcache.io/mode": "restricted"})], [namespace("kube-system"), namespace(NS)]),
        ({"webhook": {"namespaceSelector": {"matchLabels": {"team": "vision"}}}}, [namespace("a", team="vision")],
         [namespace("ml"), namespace(NS, team="vision"), namespace("kube-system", team="vision")]),
        ({"admissionPolicy": {"namespaceSelector": {"matchLabels": {"training": "true"}}}}, [namespace("ml", training="true")],
         [namespace("monitoring"), namespace(NS, training="true")]),
    ):
        _, binding = admission_policy(renderer, values)
        selector = binding["spec"]["matchResources"]["namespaceSelector"]
        mwc = find(render(renderer, values), "MutatingWebhookConfiguration")
        for labels in inside:
            assert selects(selector, labels), (values, labels)
        for labels in outside:
            assert not selects(selector, labels), (values, labels)
        if "admissionPolicy" not in values:
            # The same namespaces the mutating webhook injects, in either mode (but kube-system
            # and the release's own, which a webhook.namespaceSelector of the user's may match).
            for labels in inside + outside:
                if labels["kubernetes.io/metadata.name"] in ("kube-system", NS):
                    continue
                assert selects(selector, labels) == any(selects(h["namespaceSelector"], labels) for h in mwc["webhooks"]), labels
    _, warn = admission_policy(renderer, {"admissionPolicy": {"validationActions": ["Warn", "Audit"]}})
    assert warn["spec"]["validationActions"] == ["Warn", "Audit"]


@pytest.mark.parametrize("values, where", [
    ({"admissionPolicy": {"validationActions": ["Deny", "Warn"]}}, "/admissionPolicy/validationActions"),
    ({"admissionPolicy": {"validationActions": []}}, "/admissionPolicy/validationActions"),
    ({"admissionPolicy": {"validationActions": ["Block"]}}, "/admissionPolicy/validationActions/0"),
    ({"admissionPolicy": {"enabled": "auto"}}, "/admissionPolicy/enabled"),
    ({"webhook": {"sidecar": {"mode": "baseline"}}}, "/webhook/sidecar/mode"),
])
def test_schema_refuses_bad_policy_and_mode_values(renderer: Renderer, values: dict[str, Any], where: str) -> None:
    with pytest.raises(renderer.helm.HelmValuesError) as info:
        renderer.files(values)
    assert where in str(info.value)


def _with_mount(obj: dict[str, Any], container: str, mount: dict[str, Any], kind: str = "containers") -> dict[str, Any]:
    out = copy.deepcopy(obj)
    for c in out["spec"].get(kind, []):
        if c["name"] == container:
            c.setdefault("volumeMounts", []).append(mount)
    return out


def test_the_policy_admits_injected_and_plain_pods(policy: Policy) -> None:
    for obj in (injected(pod(), HOSTPATH), injected(compliant_pod(), HOSTPATH), injected(pod(), InjectConfig(image=IMAGE, native_sidecar=False)),
                injected(pod(), RESTRICTED), injected(pod({"shardcache.io/short-circuit": "false"}), HOSTPATH),
                pod(), compliant_pod(), pod(labels={INJECT_LABEL: "false"}), {"apiVersion": "v1", "kind": "Pod", "spec": {"containers": [{"name": "c"}]}}):
        assert policy.refusals(obj) == [], obj["spec"]
    # An app container may mount the socket directory too, read-only (connecting needs no more).
    obj = _with_mount(injected(pod(), HOSTPATH), "train", {"name": "shardcache-socket", "mountPath": "/run/shardcache", "readOnly": True})
    assert policy.refusals(obj) == []


def test_the_policy_refuses_another_host_path(policy: Policy) -> None:
    base = injected(pod(), HOSTPATH)
    cases = {
        # The node cache, by hand: what the policy is for.
        "cache": ({"name": "cache", "hostPath": {"path": "/var/cache/shardcache"}}, "cache (hostPath /var/cache/shardcache)"),
        "root": ({"name": "host", "hostPath": {"path": "/", "type": "Directory"}}, "host (hostPath /)"),
        # The socket's path under another name.
        "renamed-copy": ({"name": "my-socket", "hostPath": {"path": "/run/shardcache"}}, "my-socket (hostPath /run/shardcache)"),
    }
    for case, (volume, named) in cases.items():
        obj = copy.deepcopy(base)
        obj["spec"]["volumes"].append(volume)
        (message,) = policy.refusals(obj)
        assert f"this pod has 1 other(s), first {named}" in message, case
        assert message.startswith("shardcache: pods in this namespace may have no hostPath volume but shardcache-socket (hostPath /run/shardcache")
    # Even without the label: a pod author cannot skip the sidecar and mount the cache instead.
    plain = pod(labels={INJECT_LABEL: "false"}, volumes=[{"name": "cache", "hostPath": {"path": "/var/cache/shardcache"}}],
                containers=[{"name": "c", "image": "i", "volumeMounts": [{"name": "cache", "mountPath": "/cache", "readOnly": True}]}])
    (message,) = policy.refusals(plain)
    assert "first cache (hostPath /var/cache/shardcache)" in message
    two = copy.deepcopy(base)
    two["spec"]["volumes"] += [cases["cache"][0], cases["root"][0]]
    (message,) = policy.refusals(two)
    assert "this pod has 2 other(s), first cache" in message


def test_the_policy_refuses_a_renamed_or_moved_socket_volume(policy: Policy) -> None:
    base = injected(pod(), HOSTPATH)
    renamed = json.loads(json.dumps(base).replace('"shardcache-socket"', '"node-socket"'))
    (message,) = policy.refusals(renamed)
    assert "first node-socket (hostPath /run/shardcache)" in message
    for path in ("/run", "/run/shardcache/", "/run/shardcache/../shardcache", "/var/cache/shardcache"):
        moved = copy.deepcopy(base)
        next(v for v in moved["spec"]["volumes"] if v["name"] == "shardcache-socket")["hostPath"]["path"] = path
        (message,) = policy.refusals(moved)
        assert f"first shardcache-socket (hostPath {path})" in message, path


@pytest.mark.parametrize("kind, container", [("initContainers", SIDECAR_NAME), ("containers", "train"), ("ephemeralContainers", "debugger")])
def test_the_policy_refuses_a_writable_socket_mount(policy: Policy, kind: str, container: str) -> None:
    base = injected(pod(), HOSTPATH)
    if kind == "ephemeralContainers":
        # kubectl debug: an UPDATE of pods/ephemeralcontainers, whose object is the whole pod.
        base["spec"]["ephemeralContainers"] = [{"name": "debugger", "image": "busybox", "targetContainerName": "train"}]
    for mount in ({"name": "shardcache-socket", "mountPath": "/host-run"},
                  {"name": "shardcache-socket", "mountPath": "/host-run", "readOnly": False}):
        if kind == "initContainers":
            obj = copy.deepcopy(base)
            sidecar = sidecar_of(obj["spec"])
            next(m for m in sidecar["volumeMounts"] if m["name"] == "shardcache-socket").pop("readOnly")
            if "readOnly" in mount:
                next(m for m in sidecar["volumeMounts"] if m["name"] == "shardcache-socket")["readOnly"] = False
        else:
            obj = _with_mount(base, container, mount, kind)
        (message,) = policy.refusals(obj)
        assert message.startswith(f"shardcache: container {container} mounts the volume shardcache-socket")
        assert "set readOnly: true" in message


def test_the_policy_follows_the_socket_host_dir(renderer: Renderer) -> None:
    moved = Policy(admission_policy(renderer, {"node": {"socketHostDir": "/var/run/shardcache"}})[0])
    injected_there = injected(pod(), InjectConfig(image=IMAGE, socket_host_dir="/var/run/shardcache"))
    assert moved.refusals(injected_there) == []
    (message,) = moved.refusals(injected(pod(), HOSTPATH))
    assert "no hostPath volume but shardcache-socket (hostPath /var/run/shardcache" in message
    # A path that needs escaping in a CEL string stays one string.
    odd = Policy(admission_policy(renderer, {"node": {"socketHostDir": "/run/sc\"it's\\"}})[0])
    assert odd.refusals(injected(pod(), InjectConfig(image=IMAGE, socket_host_dir="/run/sc\"it's\\"))) == []


def test_the_injected_pod_is_what_the_policy_and_the_chart_agree_on(renderer: Renderer, policy: Policy) -> None:
    """The webhook args the chart renders, injecting into every fixture workload's pods: each
    pod, in either mode, is admitted by the policy the same chart renders."""
    from sidecar.cli import build_parser
    from sidecar.cli.commands.webhook import settings_from_args

    config = settings_from_args(build_parser().parse_args(webhook_args(renderer.objects({})))).inject
    for obj in WORKLOADS:
        for mode in ("hostpath", "restricted"):
            out = injected(obj, dataclasses.replace(config, mode=mode))
            for template in pod_templates(out):
                pod_obj = {"apiVersion": "v1", "kind": "Pod", "metadata": template.get("metadata", {}), "spec": template["spec"]}
                assert policy.refusals(pod_obj) == [], (obj["kind"], mode)
    text = (CHART / "templates" / "admission-policy.yaml").read_text()
    assert "cel-python" in text and "join" in text  # the constraint on the CEL is written where it is kept


def _with_context(obj: dict[str, Any], container: str, kind: str = "containers", **context: Any) -> dict[str, Any]:
    out = copy.deepcopy(obj)
    for c in out["spec"].get(kind, []):
        if c["name"] == container:
            c.setdefault("securityContext", {}).update(context)
    return out


@pytest.mark.parametrize("kind, container", [("containers", "train"), ("initContainers", "setup"), ("ephemeralContainers", "debugger")])
def test_the_policy_refuses_privileged_and_added_capabilities(policy: Policy, kind: str, container: str) -> None:
    """In a hostpath namespace (Pod Security privileged, for the socket's hostPath) a privileged or
    SYS_ADMIN container could remount the read-only socket directory writable and replace the
    socket: the policy applies baseline's rules there, in every kind of container."""
    base = injected(pod(), HOSTPATH)
    base["spec"].setdefault("initContainers", []).append({"name": "setup", "image": "busybox"})
    base["spec"]["ephemeralContainers"] = [{"name": "debugger", "image": "busybox", "targetContainerName": "train"}]
    assert policy.refusals(base) == []
    (message,) = policy.refusals(_with_context(base, container, kind, privileged=True))
    assert message.startswith(f"shardcache: container {container} is privileged: remove securityContext.privileged")
    for caps, first in ((["SYS_ADMIN"], "SYS_ADMIN"), (["NET_BIND_SERVICE", "NET_ADMIN", "SYS_ADMIN"], "NET_ADMIN"),
                        (["SYS_PTRACE"], "SYS_PTRACE")):
        (message,) = policy.refusals(_with_context(base, container, kind, capabilities={"add": caps}))
        assert message.startswith(f"shardcache: container {container} adds {first} in securityContext.capabilities.add"), message
    # The runtime's default set (what Pod Security baseline allows) and dropping stay admitted.
    allowed = _with_context(base, container, kind, privileged=False,
                            capabilities={"add": ["NET_BIND_SERVICE", "CHOWN", "SETUID"], "drop": ["ALL"]})
    assert policy.refusals(allowed) == []


def test_the_policy_refuses_host_namespaces_and_ports(policy: Policy) -> None:
    base = injected(pod(), HOSTPATH)
    for field in ("hostPID", "hostIPC", "hostNetwork"):
        obj = copy.deepcopy(base)
        obj["spec"][field] = True
        (message,) = policy.refusals(obj)
        assert message.startswith(f"shardcache: spec.{field} is true: remove it"), message
        obj["spec"][field] = False
        assert policy.refusals(obj) == []
    for kind, name in (("containers", "train"), ("initContainers", SIDECAR_NAME)):
        obj = copy.deepcopy(base)
        target = next(c for c in obj["spec"][kind] if c["name"] == name)
        target.setdefault("ports", []).append({"containerPort": 8080, "hostPort": 8080})
        (message,) = policy.refusals(obj)
        assert message.startswith(f"shardcache: container {name} sets a hostPort"), message
        target["ports"][-1]["hostPort"] = 0
        assert policy.refusals(obj) == []
    # Several at once: every rule answers.
    worst = _with_context(copy.deepcopy(base), "train", privileged=True, capabilities={"add": ["SYS_ADMIN"]})
    worst["spec"]["hostPID"] = True
    assert len(policy.refusals(worst)) == 3
