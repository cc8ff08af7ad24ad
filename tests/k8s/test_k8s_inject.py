"""The pure injection function: every workload kind, annotations, conflicts, malformed objects,
and the properties that must always hold (idempotence, untouched input, valid pods)."""

from __future__ import annotations

import copy
import http.server
import subprocess
import threading
from collections.abc import Iterator
from typing import Any

import jsonpatch
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sidecar.k8s.inject import (
    ENDPOINT_ENV,
    HANDLES_ENV,
    INJECT_LABEL,
    MODES,
    SIDECAR_NAME,
    InjectConfig,
    InjectionError,
    inject,
    inject_documents,
)
from sidecar.k8s.patch import json_patch
from sidecar.k8s.yamldocs import dump_documents, load_documents
from tests.support.k8s import TEMPLATE_PATHS, check_pod_semantics, dig, load_fixture_docs, pod_templates, subcommands, validate_k8s

CONFIG = InjectConfig(image="registry.example.com/shardcache:1.2.3")
# What every injected container gets (tests/k8s/test_k8s_cluster.py).
NODE_ENTRY = {"name": "SHARDCACHE_NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}
# The master token Secret of the chart's default release, the configuration's default.
MASTER_ENTRY = {"name": "SHARDCACHE_MASTER_TOKEN",
                "valueFrom": {"secretKeyRef": {"name": "shardcache-master-token", "key": "token", "optional": True}}}
FALLBACK = InjectConfig(image="registry.example.com/shardcache:1.2.3", native_sidecar=False)
WORKLOADS = [d for d in load_fixture_docs() if d["kind"] in TEMPLATE_PATHS]
PASSTHROUGH = [d for d in load_fixture_docs() if d["kind"] not in TEMPLATE_PATHS]


def pod(labels: dict[str, str] | None = None, annotations: dict[str, str] | None = None, **spec: Any) -> dict[str, Any]:
    spec.setdefault("containers", [{"name": "train", "image": "trainer:1"}])
    meta: dict[str, Any] = {"name": "p", "namespace": "ml", "labels": {INJECT_LABEL: "true", **(labels or {})}}
    if annotations:
        meta["annotations"] = annotations
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


def sidecar_of(spec: dict[str, Any]) -> dict[str, Any]:
    found = [c for c in spec.get("initContainers", []) + spec["containers"] if c["name"] == SIDECAR_NAME]
    assert len(found) == 1, f"expected one sidecar, found {len(found)}"
    return found[0]


def env_of(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container.get("env", [])}


def volumes_of(spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in spec.get("volumes", [])}


# ----------------------------------------------------------------------------- every kind


@pytest.mark.parametrize("obj", WORKLOADS, ids=lambda o: o["kind"])
def test_each_kind_native_sidecar(obj: dict[str, Any]) -> None:
    original = copy.deepcopy(obj)
    out, outcome = inject(obj, CONFIG)
    assert obj == original, "input must not be modified"
    assert outcome.result == "injected"
    assert outcome.templates == len(TEMPLATE_PATHS[obj["kind"]])
    for version in ("1.29", "1.33"):
        validate_k8s(out, version)
    claims = tuple(c["metadata"]["name"] for c in obj["spec"].get("volumeClaimTemplates", []))
    for before, template in zip(pod_templates(original), pod_templates(out), strict=True):
        spec = template["spec"]
        check_pod_semantics(spec, claims)
        init = spec["initContainers"]
        # The sidecar starts first, so other init containers can already read through it.
        assert init[0]["name"] == SIDECAR_NAME and init[0]["restartPolicy"] == "Always"
        assert [c["name"] for c in init[1:]] == [c["name"] for c in before["spec"].get("initContainers", [])]
        assert [c["name"] for c in spec["containers"]] == [c["name"] for c in before["spec"]["containers"]]
        for container in spec["containers"] + init[1:]:
            assert env_of(container)[ENDPOINT_ENV] == "http://127.0.0.1:8600"
            # Short-circuit by handle: the pod socket read-only, never the node cache directory.
            assert env_of(container)[HANDLES_ENV] == "unix:///run/shardcache-pod/handles.sock"
            mount = [m for m in container["volumeMounts"] if m["name"].startswith("shardcache-")]
            assert mount == [{"name": "shardcache-pod-socket", "mountPath": "/run/shardcache-pod", "readOnly": True}]
        assert template["metadata"]["labels"][INJECT_LABEL] == "true"
        assert template["metadata"]["annotations"]["shardcache.io/injected"] == "native-sidecar"


@pytest.mark.parametrize("obj", WORKLOADS, ids=lambda o: o["kind"])
def test_each_kind_fallback_container_is_valid_on_old_clusters(obj: dict[str, Any]) -> None:
    out, outcome = inject(obj, FALLBACK)
    assert outcome.result == "injected"
    # No restartPolicy on containers: valid even for 1.25-1.28 API servers.
    for version in ("1.25", "1.28"):
        validate_k8s(out, version)
    claims = tuple(c["metadata"]["name"] for c in obj["spec"].get("volumeClaimTemplates", []))
    for template in pod_templates(out):
        spec = template["spec"]
        check_pod_semantics(spec, claims)
        assert spec["containers"][0]["name"] == SIDECAR_NAME
        assert "restartPolicy" not in spec["containers"][0]
        assert SIDECAR_NAME not in [c["name"] for c in spec.get("initContainers", [])]
        # postStart holds the next containers until the sidecar answers (bounded).
        wait = spec["containers"][0]["lifecycle"]["postStart"]["exec"]["command"]
        assert wait[:2] == ["python3", "-c"] and "readyz" in wait[2]
        assert template["metadata"]["annotations"]["shardcache.io/injected"] == "container"


def test_sidecar_matches_the_serve_contract() -> None:
    out, _ = inject(pod(), CONFIG)
    spec = out["spec"]
    sidecar = sidecar_of(spec)
    assert sidecar["image"] == "registry.example.com/shardcache:1.2.3"
    assert sidecar["command"] == ["shardcache"]
    args = sidecar["args"]
    assert args[:9] == [
        "serve", "--mode", "sidecar",
        "--upstream", "unix:///run/shardcache/daemon.sock",
        "--listen", "tcp://127.0.0.1:8600",
        "--cache-dir", "/var/cache/shardcache-pod",
    ]
    # The standalone cache stays under the emptyDir's sizeLimit (10Gi), or the pod gets evicted.
    assert args[9] == "--cache-size" and int(args[10]) == int(10 * 2**30 * 0.9)
    # Handles for the app containers on the pod-local socket (relayed to the node's handles.sock).
    assert args[11:] == ["--handles", "unix:///run/shardcache-pod/handles.sock"]
    volumes = volumes_of(spec)
    assert volumes["shardcache-socket"] == {"name": "shardcache-socket", "hostPath": {"path": "/run/shardcache", "type": "DirectoryOrCreate"}}
    assert volumes["shardcache-pod-cache"]["emptyDir"] == {"sizeLimit": "10Gi"}
    assert volumes["shardcache-pod-socket"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "1Mi"}
    assert set(volumes) == {"shardcache-socket", "shardcache-pod-cache", "shardcache-pod-socket"}
    mounts = {m["mountPath"]: m for m in sidecar["volumeMounts"]}
    # Read-only: the sidecar only connects to daemon.sock and must not be able to replace it.
    assert mounts["/run/shardcache"] == {"name": "shardcache-socket", "mountPath": "/run/shardcache", "readOnly": True}
    assert mounts["/run/shardcache-pod"] == {"name": "shardcache-pod-socket", "mountPath": "/run/shardcache-pod"}
    assert mounts["/var/cache/shardcache-pod"]["name"] == "shardcache-pod-cache"
    assert len(mounts) == 3
    for probe in ("readinessProbe", "startupProbe"):
        assert "readyz" in sidecar[probe]["exec"]["command"][2] and ":8600/" in sidecar[probe]["exec"]["command"][2]
    assert sidecar["startupProbe"]["failureThreshold"] * sidecar["startupProbe"]["periodSeconds"] == 120
    assert sidecar["resources"] == {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}}
    assert sidecar["securityContext"]["allowPrivilegeEscalation"] is False


def test_sidecar_args_parse_with_the_real_serve_command() -> None:
    from sidecar.cli import build_parser

    parser = build_parser()
    if "serve" not in subcommands(parser):
        pytest.skip("sidecar.cli.commands.serve is not in this tree yet")
    sidecar = sidecar_of(inject(pod(), CONFIG)[0]["spec"])
    args = parser.parse_args(sidecar["args"])
    assert args.command == "serve"


def test_sidecar_env_from_config() -> None:
    config = InjectConfig(env=(("AWS_ENDPOINT_URL", "http://minio:9000"), ("AWS_REGION", "eu-west-1")))
    sidecar = sidecar_of(inject(pod(), config)[0]["spec"])
    # ...then SHARDCACHE_NODE, which every injected container gets (tests/k8s/test_k8s_cluster.py).
    assert sidecar["env"] == [{"name": "AWS_ENDPOINT_URL", "value": "http://minio:9000"}, {"name": "AWS_REGION", "value": "eu-west-1"}, NODE_ENTRY]
    assert sidecar_of(inject(pod(), CONFIG)[0]["spec"])["env"] == [NODE_ENTRY]
    with pytest.raises(InjectionError, match="environment variable name"):
        InjectConfig(env=(("BAD NAME", "x"),))


def test_host_dirs_and_pull_policy_from_config() -> None:
    config = InjectConfig(socket_host_dir="/mnt/nvme/run", image_pull_policy="Always")
    spec = inject(pod(), config)[0]["spec"]
    volumes = volumes_of(spec)
    assert volumes["shardcache-socket"]["hostPath"]["path"] == "/mnt/nvme/run"
    # Container paths do not move: the sidecar finds daemon.sock and handles.sock where the
    # node daemon puts them in its own container.
    assert {m["mountPath"] for m in sidecar_of(spec)["volumeMounts"]} >= {"/run/shardcache", "/run/shardcache-pod"}
    assert sidecar_of(spec)["imagePullPolicy"] == "Always"


@pytest.mark.parametrize("obj", PASSTHROUGH, ids=lambda o: o["kind"])
def test_objects_without_pods_pass_through(obj: dict[str, Any]) -> None:
    out, outcome = inject(obj, CONFIG, require_label=False)
    assert out is obj and outcome.result == "unsupported"


# ----------------------------------------------------------------------------- opt-in


def test_unlabelled_pod_is_never_touched() -> None:
    obj = pod()
    del obj["metadata"]["labels"][INJECT_LABEL]
    out, outcome = inject(obj, CONFIG)
    assert out is obj and outcome.result == "skipped" and INJECT_LABEL in outcome.reason


@pytest.mark.parametrize("value", ["false", "True", "yes", ""])
def test_label_must_be_exactly_true(value: str) -> None:
    out, outcome = inject(pod(labels={INJECT_LABEL: value}), CONFIG)
    assert outcome.result == "skipped"


def test_cli_mode_injects_unlabelled_but_respects_false() -> None:
    unlabelled = pod()
    del unlabelled["metadata"]["labels"][INJECT_LABEL]
    out, outcome = inject(unlabelled, CONFIG, require_label=False)
    assert outcome.result == "injected"
    # The label marks the pod as opted in, so the webhook later sees it as already injected.
    assert out["metadata"]["labels"][INJECT_LABEL] == "true"
    opted_out, outcome = inject(pod(labels={INJECT_LABEL: "false"}), CONFIG, require_label=False)
    assert outcome.result == "skipped"


def test_null_metadata() -> None:
    bare = {"apiVersion": "v1", "kind": "Pod", "metadata": None, "spec": {"containers": [{"name": "c", "image": "i"}]}}
    assert inject(bare, CONFIG)[1].result == "skipped"
    out, outcome = inject(bare, CONFIG, require_label=False)
    assert outcome.result == "injected" and out["metadata"]["labels"] == {INJECT_LABEL: "true"}
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": None,
           "spec": {"template": {"metadata": None, "spec": {"containers": [{"name": "c", "image": "i"}], "restartPolicy": "Never"}}}}
    assert inject(job, CONFIG, require_label=False)[1].result == "injected"


def test_workload_label_on_the_owner_counts_for_its_template() -> None:
    job = copy.deepcopy(next(d for d in WORKLOADS if d["kind"] == "Job"))
    del job["spec"]["template"]["metadata"]["labels"][INJECT_LABEL]
    assert inject(job, CONFIG)[1].result == "skipped"
    job["metadata"]["labels"] = {INJECT_LABEL: "true"}
    out, outcome = inject(job, CONFIG)
    assert outcome.result == "injected"
    assert out["spec"]["template"]["metadata"]["labels"][INJECT_LABEL] == "true"
    # ...unless the template opts out explicitly.
    job["spec"]["template"]["metadata"]["labels"][INJECT_LABEL] = "false"
    assert inject(job, CONFIG)[1].result == "skipped"


def test_kubeflow_roles_are_injected_independently() -> None:
    job = copy.deepcopy(next(d for d in WORKLOADS if d["kind"] == "PyTorchJob"))
    del job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["metadata"]["labels"][INJECT_LABEL]
    out, outcome = inject(job, CONFIG)
    assert outcome.result == "injected" and outcome.templates == 1
    assert "initContainers" not in out["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    assert out["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["initContainers"][0]["name"] == SIDECAR_NAME


# ----------------------------------------------------------------------------- idempotence


@pytest.mark.parametrize("config", [CONFIG, FALLBACK], ids=["native", "container"])
@pytest.mark.parametrize("obj", WORKLOADS, ids=lambda o: o["kind"])
def test_injecting_twice_changes_nothing(obj: dict[str, Any], config: InjectConfig) -> None:
    once, _ = inject(obj, config)
    twice, outcome = inject(once, config)
    assert twice == once and outcome.result == "unchanged"
    # Even with another configuration: an existing sidecar is never replaced (its image allowed:
    # a sidecar of an image the webhook does not know is refused, test_k8s_auth).
    other = InjectConfig(image="other/image:9", native_sidecar=not config.native_sidecar,
                         allowed_sidecar_images=(config.image,))
    assert inject(once, other) == (once, inject(once, other)[1])
    assert inject(once, other)[1].result == "unchanged"


def test_reinvocation_completes_containers_added_later() -> None:
    once, _ = inject(pod(), CONFIG)
    once["spec"]["containers"].append({"name": "added-by-another-webhook", "image": "istio/proxyv2:1.22"})
    again, outcome = inject(once, CONFIG)
    assert outcome.result == "injected"
    added = again["spec"]["containers"][-1]
    assert env_of(added)[ENDPOINT_ENV] == "http://127.0.0.1:8600"
    assert len([c for c in again["spec"]["initContainers"] if c["name"] == SIDECAR_NAME]) == 1


# ----------------------------------------------------------------------------- user choices win


def test_existing_env_and_pod_socket_path_are_kept() -> None:
    obj = pod(containers=[{
        "name": "train", "image": "t:1",
        "env": [{"name": ENDPOINT_ENV, "value": "http://elsewhere:9000"}],
        "volumeMounts": [{"name": "mine", "mountPath": "/run/shardcache-pod"}],
    }, {
        "name": "eval", "image": "t:1",
        "env": [{"name": HANDLES_ENV, "value": "unix:///elsewhere/h.sock"}],
    }], volumes=[{"name": "mine", "emptyDir": {}}])
    out, outcome = inject(obj, CONFIG)
    train, evaluate = out["spec"]["containers"]
    assert outcome.result == "injected"
    # The path is the user's: no mount of ours over it, and no handles address the container
    # could not reach.
    assert train["env"] == [{"name": ENDPOINT_ENV, "value": "http://elsewhere:9000"}, MASTER_ENTRY, NODE_ENTRY]
    assert train["volumeMounts"] == [{"name": "mine", "mountPath": "/run/shardcache-pod"}]
    # A value the user set wins; the mount is still added.
    assert [e for e in evaluate["env"] if e["name"] == HANDLES_ENV] == [{"name": HANDLES_ENV, "value": "unix:///elsewhere/h.sock"}]
    assert evaluate["volumeMounts"] == [{"name": "shardcache-pod-socket", "mountPath": "/run/shardcache-pod", "readOnly": True}]
    check_pod_semantics(out["spec"])


def test_init_containers_before_an_existing_sidecar_are_left_alone() -> None:
    obj = pod(initContainers=[{"name": "early", "image": "busybox"}, {"name": SIDECAR_NAME, "image": CONFIG.image, "restartPolicy": "Always"}, {"name": "late", "image": "busybox"}])
    out, _ = inject(obj, CONFIG)
    early, _, late = out["spec"]["initContainers"]
    assert ENDPOINT_ENV not in env_of(early)
    assert env_of(late)[ENDPOINT_ENV] == "http://127.0.0.1:8600"


# ----------------------------------------------------------------------------- annotations


def test_annotations_override_the_configuration() -> None:
    # The image annotation is honoured for allow-listed images only (tests/k8s/test_k8s_tenancy.py).
    config = InjectConfig(image="registry.example.com/shardcache:1.2.3", allowed_sidecar_images=("mirror.local/shardcache:*",))
    obj = pod(annotations={
        "shardcache.io/sidecar-image": "mirror.local/shardcache:2.0.0",
        "shardcache.io/sidecar-cpu-request": "2",
        "shardcache.io/sidecar-cpu-limit": "4",
        "shardcache.io/sidecar-memory-request": "1Gi",
        "shardcache.io/sidecar-memory-limit": "",
        "shardcache.io/port": "9700",
        "shardcache.io/pod-cache-size": "50Gi",
    })
    spec = inject(obj, config)[0]["spec"]
    sidecar = sidecar_of(spec)
    assert sidecar["image"] == "mirror.local/shardcache:2.0.0"
    assert sidecar["resources"] == {"requests": {"cpu": "2", "memory": "1Gi"}, "limits": {"cpu": "4"}}
    assert "tcp://127.0.0.1:9700" in sidecar["args"]
    assert sidecar["ports"][0]["containerPort"] == 9700
    assert ":9700/readyz" in sidecar["readinessProbe"]["exec"]["command"][2]
    assert env_of(spec["containers"][0])[ENDPOINT_ENV] == "http://127.0.0.1:9700"
    assert volumes_of(spec)["shardcache-pod-cache"]["emptyDir"]["sizeLimit"] == "50Gi"
    assert int(sidecar["args"][sidecar["args"].index("--cache-size") + 1]) == int(50 * 2**30 * 0.9)
    validate_k8s(inject(obj, config)[0], "1.30")


def test_short_circuit_can_be_turned_off_per_pod() -> None:
    spec = inject(pod(annotations={"shardcache.io/short-circuit": "false"}), CONFIG)[0]["spec"]
    assert set(volumes_of(spec)) == {"shardcache-socket", "shardcache-pod-cache"}
    assert "--handles" not in sidecar_of(spec)["args"]
    for container in spec["containers"]:
        assert HANDLES_ENV not in env_of(container)
        assert "volumeMounts" not in container
    check_pod_semantics(spec)


@pytest.mark.parametrize(
    "annotation, value",
    [
        ("shardcache.io/port", "http"),
        ("shardcache.io/port", "70000"),
        ("shardcache.io/port", "0"),
        ("shardcache.io/sidecar-cpu-request", "lots"),
        ("shardcache.io/sidecar-memory-limit", "1 GB"),
        ("shardcache.io/sidecar-image", "not an image"),
        ("shardcache.io/short-circuit", "maybe"),
        ("shardcache.io/pod-cache-size", "-5Gi"),
        ("shardcache.io/mode", "privileged"),
    ],
)
def test_bad_annotation_is_a_clear_error(annotation: str, value: str) -> None:
    with pytest.raises(InjectionError) as info:
        inject(pod(annotations={annotation: value}), CONFIG)
    assert annotation in str(info.value) and repr(value) in str(info.value)


def test_memory_request_above_limit_is_refused() -> None:
    with pytest.raises(InjectionError, match="above its limit"):
        inject(pod(annotations={"shardcache.io/sidecar-memory-request": "4Gi"}), CONFIG)


# ----------------------------------------------------------------------------- malformed and conflicts


@pytest.mark.parametrize(
    "obj, message",
    [
        ([], "expected a Kubernetes object"),
        ({"kind": "Pod"}, "no apiVersion/kind"),
        ({"apiVersion": "v1", "kind": "Pod", "metadata": {"labels": {INJECT_LABEL: "true"}}}, "spec is missing"),
        ({"apiVersion": "v1", "kind": "Pod", "metadata": "x", "spec": {}}, "metadata must be an object"),
        ({"apiVersion": "v1", "kind": "Pod", "metadata": {"labels": {INJECT_LABEL: True}}, "spec": {"containers": []}}, "quote values"),
        (pod(containers="train"), "spec.containers must be a non-empty list"),
        (pod(containers=[]), "spec.containers must be a non-empty list"),
        (pod(containers=[{"image": "x"}]), r"spec.containers\[0\] must be a container with a name"),
        (pod(initContainers={"a": 1}), "spec.initContainers must be a non-empty list"),
        (pod(volumes="none"), "volumes must be a list"),
        ({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d"}, "spec": {}}, "spec.template is missing"),
        ({"apiVersion": "batch/v1", "kind": "CronJob", "metadata": {"name": "c"}, "spec": {"jobTemplate": []}}, "must be an object"),
        ({"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": "j"}, "spec": {"pytorchReplicaSpecs": {"Worker": {}}}}, "Worker.template is missing"),
        ({"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": "j"}, "spec": {}}, "no pod template"),
        (pod(hostNetwork=True), "hostNetwork"),
        (pod(volumes=[{"name": "shardcache-socket", "emptyDir": {}}]), "reserved"),
        (pod(containers=[{"name": "web", "image": "x", "ports": [{"containerPort": 8600}]}]), "shardcache.io/port"),
    ],
)
def test_malformed_or_conflicting_objects_raise_clear_errors(obj: Any, message: str) -> None:
    before = copy.deepcopy(obj)
    with pytest.raises(InjectionError, match=message):
        inject(obj, CONFIG)
    assert obj == before


def test_invalid_configuration_fails_at_construction() -> None:
    for kwargs in ({"port": 0}, {"image": "a b"}, {"pod_cache_size": "big"}, {"cpu_request": "x"},
                   {"image_pull_policy": "Sometimes"}, {"socket_host_dir": "relative"}, {"startup_timeout_seconds": 0},
                   {"mode": "baseline"}, {"restricted_upstream": "http://sc-local:8600"}, {"restricted_upstream": "tcp://sc-local:0"}):
        with pytest.raises(InjectionError):
            InjectConfig(**kwargs)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- the probe commands run


class _Ready(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:  # noqa: N802
        self.send_response(self.status if self.path == "/readyz" else 404)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def readyz() -> Iterator[tuple[int, type[_Ready]]]:
    handler = type("Handler", (_Ready,), {"status": 200})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], handler
    finally:
        server.shutdown()
        server.server_close()


def _run(command: list[str], timeout: float = 30) -> int:
    assert command[0] == "python3"
    return subprocess.run(command, capture_output=True, timeout=timeout).returncode


def test_probe_command_passes_only_when_ready(readyz: tuple[int, type[_Ready]]) -> None:
    port, handler = readyz
    sidecar = sidecar_of(inject(pod(annotations={"shardcache.io/port": str(port)}), CONFIG)[0]["spec"])
    probe = sidecar["readinessProbe"]["exec"]["command"]
    assert _run(probe) == 0
    handler.status = 503
    assert _run(probe) != 0
    closed = sidecar_of(inject(pod(annotations={"shardcache.io/port": "1"}), CONFIG)[0]["spec"])
    assert _run(closed["readinessProbe"]["exec"]["command"]) != 0


def test_post_start_wait_returns_when_ready_and_is_bounded(readyz: tuple[int, type[_Ready]]) -> None:
    port, _ = readyz
    config = InjectConfig(native_sidecar=False, startup_timeout_seconds=1)
    ready = sidecar_of(inject(pod(annotations={"shardcache.io/port": str(port)}), config)[0]["spec"])
    assert _run(ready["lifecycle"]["postStart"]["exec"]["command"], timeout=10) == 0
    never = sidecar_of(inject(pod(annotations={"shardcache.io/port": "1"}), config)[0]["spec"])
    # Gives up after the startup timeout rather than holding the pod forever.
    assert _run(never["lifecycle"]["postStart"]["exec"]["command"], timeout=20) == 0


# ----------------------------------------------------------------------------- properties

_names = st.from_regex(r"[a-z][a-z0-9-]{0,8}", fullmatch=True)
_env = st.lists(st.fixed_dictionaries({"name": st.sampled_from(["A", "B", ENDPOINT_ENV, "PATH"]), "value": st.text(max_size=5)}), max_size=3, unique_by=lambda e: e["name"])


@st.composite
def _pods(draw: st.DrawFn) -> dict[str, Any]:
    volume_names = draw(st.lists(_names.filter(lambda n: not n.startswith("shardcache")), max_size=3, unique=True))
    mount_paths = st.sampled_from(["/data", "/run/shardcache-pod", "/out", "/run"])

    def containers(prefix: str, max_size: int, min_size: int) -> list[dict[str, Any]]:
        names = draw(st.lists(_names.filter(lambda n: n != SIDECAR_NAME), min_size=min_size, max_size=max_size, unique=True))
        out = []
        for name in names:
            container: dict[str, Any] = {"name": f"{prefix}{name}", "image": "img:1"}
            if env := draw(_env):
                container["env"] = env
            if draw(st.booleans()) and volume_names:
                paths = draw(st.lists(mount_paths, max_size=2, unique=True))
                container["volumeMounts"] = [{"name": draw(st.sampled_from(volume_names)), "mountPath": p} for p in paths]
            out.append(container)
        return out

    spec: dict[str, Any] = {"containers": containers("c-", 3, 1)}
    if init := containers("i-", 2, 0):
        spec["initContainers"] = init
    if volume_names:
        spec["volumes"] = [{"name": n, "emptyDir": {}} for n in volume_names]
    labels = draw(st.sampled_from([{}, {INJECT_LABEL: "true"}, {INJECT_LABEL: "false"}, {"app": "x", INJECT_LABEL: "true"}]))
    annotations = draw(st.dictionaries(
        st.sampled_from(["shardcache.io/port", "shardcache.io/short-circuit", "shardcache.io/pod-cache-size", "shardcache.io/mode", "other/x"]),
        st.sampled_from(["9000", "true", "false", "20Gi", "hostpath", "restricted"]), max_size=3,
    ))
    # Only keep annotation values that are valid for their key (bad ones are tested above).
    valid = {"shardcache.io/port": {"9000"}, "shardcache.io/short-circuit": {"true", "false"}, "shardcache.io/pod-cache-size": {"20Gi"},
             "shardcache.io/mode": {"hostpath", "restricted"}}
    annotations = {k: v for k, v in annotations.items() if v in valid.get(k, {v})}
    meta: dict[str, Any] = {"name": "p", "labels": labels}
    if annotations:
        meta["annotations"] = annotations
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(obj=_pods(), native=st.booleans(), require_label=st.booleans(), mode=st.sampled_from(["hostpath", "restricted"]))
def test_injection_properties(obj: dict[str, Any], native: bool, require_label: bool, mode: str) -> None:
    config = InjectConfig(native_sidecar=native, mode=mode)  # type: ignore[arg-type]
    original = copy.deepcopy(obj)
    out, outcome = inject(obj, config, require_label=require_label)
    assert obj == original, "the input is never modified"
    label = original["metadata"]["labels"].get(INJECT_LABEL)
    wanted = label == "true" or (not require_label and label is None)
    if not wanted:
        assert out is obj and outcome.result == "skipped"
        return
    assert outcome.result == "injected"
    spec = out["spec"]
    check_pod_semantics(spec)
    sidecar_of(spec)  # exactly one
    port = int(original["metadata"].get("annotations", {}).get("shardcache.io/port", 8600))
    for container in spec["containers"]:
        if container["name"] == SIDECAR_NAME:
            continue
        before = next(c for c in original["spec"]["containers"] if c["name"] == container["name"])
        expected = env_of(before).get(ENDPOINT_ENV, f"http://127.0.0.1:{port}")
        assert env_of(container)[ENDPOINT_ENV] == expected
        # Everything the user had is still there, in order.
        assert container["env"][: len(before.get("env", []))] == before.get("env", [])
        assert container.get("volumeMounts", [])[: len(before.get("volumeMounts", []))] == before.get("volumeMounts", [])
    # The pod's mode (its annotation, else the configuration's): restricted pods have no hostPath.
    pod_mode = original["metadata"].get("annotations", {}).get("shardcache.io/mode", mode)
    host_paths = [v["name"] for v in spec["volumes"] if "hostPath" in v]
    assert host_paths == (["shardcache-socket"] if pod_mode == "hostpath" else [])
    # Idempotent, whatever the configuration of the second pass (its mode included).
    assert inject(out, config, require_label=require_label) == (out, inject(out, config, require_label=require_label)[1])
    assert inject(out, InjectConfig(native_sidecar=not native))[0] == out
    for other in MODES:
        assert inject(out, InjectConfig(mode=other, short_circuit=other == "restricted"))[0] == out
    # The webhook's patch turns the original into exactly the injected object.
    assert jsonpatch.apply_patch(original, json_patch(original, out)) == out
    validate_k8s(out, "1.30")


_json_scalars = st.none() | st.booleans() | st.integers(-5, 5) | st.text(max_size=3)
_json_keys = st.sampled_from(["a", "b", "a/b", "~0", "x~1y", "", "shardcache.io/inject"])
_json = st.recursive(_json_scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_json_keys, inner, max_size=4), max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(before=_json, after=_json)
def test_json_patch_turns_before_into_after(before: Any, after: Any) -> None:
    patch = json_patch(before, after)
    result = jsonpatch.apply_patch(copy.deepcopy(before), patch) if patch else before
    assert jsonpatch.JsonPatch(patch) is not None
    assert result == after and type(result) is type(after)
    if before == after and type(before) is type(after):
        assert patch == [] or all(op["op"] == "replace" for op in patch)


def test_json_patch_tells_true_from_one() -> None:
    assert json_patch({"a": 1}, {"a": True}) == [{"op": "replace", "path": "/a", "value": True}]
    assert json_patch({"a": [1]}, {"a": [1, 2]}) == [{"op": "add", "path": "/a/1", "value": 2}]


# ----------------------------------------------------------------------------- YAML helpers


def test_documents_round_trip_keeps_order_and_strings() -> None:
    text = (
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}\ndata:\n  when: 2024-01-01\n  yes: \"on\"\n"
        "---\n---\napiVersion: v1\nkind: Pod\nmetadata: {name: p}\nspec: {containers: [{name: a, image: b}]}\n"
    )
    docs = load_documents(text)
    assert len(docs) == 2
    assert docs[0]["data"]["when"] == "2024-01-01"  # a string, as Kubernetes reads it
    import datetime

    import yaml

    assert yaml.safe_load("a: 2024-01-01") == {"a": datetime.date(2024, 1, 1)}  # PyYAML itself untouched
    out, outcomes = inject_documents(docs, CONFIG)
    assert [o.result for o in outcomes] == ["unsupported", "injected"]
    dumped = dump_documents(out)
    assert dumped.startswith("---\napiVersion: v1\nkind: ConfigMap")
    assert load_documents(dumped) == out


def test_kind_list_items_are_injected() -> None:
    items = [d for d in WORKLOADS if d["kind"] in ("Deployment", "Job")]
    out, outcomes = inject_documents([{"apiVersion": "v1", "kind": "List", "items": items}], CONFIG)
    assert [o.result for o in outcomes] == ["injected", "injected"]
    assert out[0]["items"][1]["spec"]["template"]["spec"]["initContainers"][0]["name"] == SIDECAR_NAME


def test_invalid_yaml_names_the_line() -> None:
    with pytest.raises(InjectionError, match=r"job.yaml:3:\d+: invalid YAML"):
        load_documents("a: 1\nb: 2\n  c: [\n", "job.yaml")


def test_document_errors_name_the_document() -> None:
    with pytest.raises(InjectionError, match="document 2: .*spec.containers"):
        inject_documents([pod(), pod(containers="x")], CONFIG)


def test_hostpath_types_are_sane() -> None:
    spec = inject(pod(), CONFIG)[0]["spec"]
    for volume in spec["volumes"]:
        if "hostPath" in volume:
            assert volume["hostPath"]["type"] == "DirectoryOrCreate"
    assert dig(spec, ("initContainers",))[0]["ports"][0]["name"] == "shardcache"
