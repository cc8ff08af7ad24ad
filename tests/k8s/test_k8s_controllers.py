"""What Kubernetes' controllers and admission do with injected objects, without an API server:
objects a controller makes from an injected template are never injected again (the ReplicaSet
storm), no app container mounts a host path writable through injection, namespaces that enforce
Pod Security get restricted mode, and ``shardcache inject`` gives what the chart's webhook gives.

The same behaviours are checked against a real kube-apiserver and kube-controller-manager in
tests/k8s/test_k8s_apiserver.py when a binary is given."""

from __future__ import annotations

import copy
import hashlib
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sidecar.k8s.inject import (
    INJECT_LABEL,
    SIDECAR_NAME,
    VOLUME_POD_SOCKET,
    VOLUME_SOCKET,
    InjectConfig,
    InjectionError,
    inject,
)
from tests.support.k8s import (
    Renderer,
    TLSFiles,
    WebhookProcess,
    admission_review,
    apply_patch,
    chart_webhook_args,
    opted_in_deployment,
    start_webhook,
)
from tests.support.processes import PYTHON, REPO, stop

pytestmark = pytest.mark.slow

CONFIG = InjectConfig(image="registry.example.com/shardcache:1.2.3")


def deployment(*, label_on: str = "template") -> dict[str, Any]:
    return opted_in_deployment("train", "ml", label_on=label_on)


def owner(kind: str, name: str, api_version: str = "apps/v1") -> dict[str, Any]:
    return {"apiVersion": api_version, "kind": kind, "name": name, "uid": f"{name}-uid", "controller": True, "blockOwnerDeletion": True}


def replicaset_of(deploy: dict[str, Any]) -> dict[str, Any]:
    """What the deployment controller creates: the Deployment's template plus pod-template-hash
    (in the template's labels and the selector), labels from the template, a controller reference."""
    template = copy.deepcopy(deploy["spec"]["template"])
    digest = hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:10]
    template["metadata"]["labels"]["pod-template-hash"] = digest
    return {
        "apiVersion": "apps/v1",
        "kind": "ReplicaSet",
        "metadata": {
            "name": f"{deploy['metadata']['name']}-{digest}",
            "namespace": deploy["metadata"]["namespace"],
            "labels": dict(template["metadata"]["labels"]),
            "ownerReferences": [owner("Deployment", deploy["metadata"]["name"])],
        },
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {**deploy["spec"]["selector"]["matchLabels"], "pod-template-hash": digest}},
            "template": template,
        },
    }


def pod_of(rs: dict[str, Any]) -> dict[str, Any]:
    template = copy.deepcopy(rs["spec"]["template"])
    meta = {**template.get("metadata", {}), "generateName": rs["metadata"]["name"] + "-", "namespace": rs["metadata"]["namespace"],
            "ownerReferences": [owner("ReplicaSet", rs["metadata"]["name"])]}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": template["spec"]}


def template_without_hash(template: dict[str, Any]) -> dict[str, Any]:
    """The deployment controller's comparison (EqualIgnoreHash): templates equal but the hash label."""
    template = copy.deepcopy(template)
    template["metadata"]["labels"].pop("pod-template-hash", None)
    return template


def mounts_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {m["name"]: m for m in container.get("volumeMounts", [])}


# ----------------------------------------------------------------------------- the storm


@pytest.mark.parametrize("label_on", ["template", "deployment"])
def test_a_replicaset_its_deployment_made_is_never_injected(label_on: str) -> None:
    deploy = deployment(label_on=label_on)
    # The workload rule's objectSelector sees the Deployment's own labels only: labelled on its
    # template, the Deployment is stored as written, and only its ReplicaSet carries the label.
    stored = inject(deploy, CONFIG)[0] if label_on == "deployment" else deploy
    rs = replicaset_of(stored)
    out, outcome = inject(rs, CONFIG)
    assert outcome.result == "skipped" and "Deployment train" in outcome.reason, outcome
    assert out is rs or out == rs
    # So the controller finds its own ReplicaSet: no hash collision, no second ReplicaSet.
    assert template_without_hash(out["spec"]["template"]) == stored["spec"]["template"]


def test_a_job_its_cronjob_made_is_never_injected() -> None:
    job = {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": "nightly-1", "namespace": "ml", "labels": {INJECT_LABEL: "true"},
                     "ownerReferences": [owner("CronJob", "nightly", "batch/v1")]},
        "spec": {"template": {"metadata": {"labels": {INJECT_LABEL: "true"}},
                              "spec": {"restartPolicy": "Never", "containers": [{"name": "t", "image": "t:1"}]}}},
    }
    _, outcome = inject(job, CONFIG)
    assert outcome.result == "skipped" and "CronJob nightly" in outcome.reason
    # Offline too: `kubectl get deploy,rs,job -o yaml | shardcache inject` leaves what controllers made.
    _, outcome = inject(job, CONFIG, require_label=False)
    assert outcome.result == "skipped"


def test_an_owner_that_is_not_a_controller_does_not_count() -> None:
    job = {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": "j", "namespace": "ml", "ownerReferences": [{**owner("ConfigMap", "c", "v1"), "controller": False}]},
        "spec": {"template": {"metadata": {"labels": {INJECT_LABEL: "true"}},
                              "spec": {"restartPolicy": "Never", "containers": [{"name": "t", "image": "t:1"}]}}},
    }
    assert inject(job, CONFIG)[1].result == "injected"


def test_pods_from_an_injected_template_are_not_injected_again() -> None:
    stored, outcome = inject(deployment(label_on="deployment"), CONFIG)
    assert outcome.result == "injected"
    pod = pod_of(replicaset_of(stored))
    # Even under another configuration (a changed webhook), the pod stays what its template says.
    other = InjectConfig(image="registry.example.com/shardcache:9", master_token_secret="tok", env=(("A", "b"),))
    out, outcome = inject(pod, other)
    assert outcome.result == "skipped" and "ReplicaSet" in outcome.reason
    assert out == pod


def test_pods_from_a_template_that_was_not_injected_are_injected() -> None:
    pod = pod_of(replicaset_of(deployment(label_on="template")))
    out, outcome = inject(pod, CONFIG)
    assert outcome.result == "injected"
    assert out["spec"]["initContainers"][0]["name"] == SIDECAR_NAME


# ----------------------------------------------------------------------------- the socket directory


def pod(**spec: Any) -> dict[str, Any]:
    spec.setdefault("containers", [{"name": "train", "image": "trainer:1"}])
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "ml", "labels": {INJECT_LABEL: "true"}}, "spec": spec}


@pytest.mark.parametrize("read_only", [None, False])
@pytest.mark.parametrize("where", ["containers", "initContainers"])
def test_an_app_container_never_gets_the_socket_directory_writable(read_only: Any, where: str) -> None:
    mount: dict[str, Any] = {"name": VOLUME_SOCKET, "mountPath": "/run/shardcache"}
    if read_only is False:
        mount["readOnly"] = False
    sneaky = {"name": "sneaky", "image": "x:1", "volumeMounts": [mount]}
    spec: dict[str, Any] = {"containers": [{"name": "train", "image": "trainer:1"}]}
    spec[where] = spec.get(where, []) + [sneaky]
    out, outcome = inject(pod(**spec), CONFIG)
    volumes = {v["name"]: v for v in out["spec"]["volumes"]}
    assert "hostPath" in volumes[VOLUME_SOCKET]
    for container in out["spec"]["containers"] + out["spec"].get("initContainers", []):
        for m in container.get("volumeMounts", []):
            if m["name"] == VOLUME_SOCKET:
                assert m.get("readOnly") is True, f"{container['name']} mounts the node's socket directory writable"
    assert any("sneaky" in w and VOLUME_SOCKET in w and "read-only" in w for w in outcome.warnings), outcome.warnings


def test_a_later_pass_forces_read_only_too() -> None:
    """A Deployment injected at CREATE, then updated with an app container mounting the socket
    volume (already in the pod, from the first injection) writable."""
    stored, _ = inject(deployment(label_on="deployment"), CONFIG)
    edited = copy.deepcopy(stored)
    edited["spec"]["template"]["spec"]["containers"].append(
        {"name": "sneaky", "image": "x:1", "volumeMounts": [{"name": VOLUME_SOCKET, "mountPath": "/host-sockets"},
                                                              {"name": VOLUME_POD_SOCKET, "mountPath": "/pod-sockets"}]})
    out, outcome = inject(edited, CONFIG)
    assert outcome.result == "injected"
    sneaky = next(c for c in out["spec"]["template"]["spec"]["containers"] if c["name"] == "sneaky")
    assert all(m["readOnly"] is True for m in sneaky["volumeMounts"])
    # The sidecar itself keeps its writable pod socket (it creates handles.sock there).
    sidecar = out["spec"]["template"]["spec"]["initContainers"][0]
    assert mounts_of(sidecar)[VOLUME_POD_SOCKET].get("readOnly") is not True
    assert mounts_of(sidecar)[VOLUME_SOCKET]["readOnly"] is True


# ----------------------------------------------------------------------------- Pod Security


def test_a_namespace_that_enforces_pod_security_gets_restricted_mode() -> None:
    config = InjectConfig(image=CONFIG.image, hostpath_forbidden=True)
    out, outcome = inject(pod(), config)
    spec = out["spec"]
    assert not any("hostPath" in v for v in spec.get("volumes", []))
    assert "--upstream" in spec["initContainers"][0]["args"]
    assert outcome.warnings == ()
    # A pod asking for hostpath is told why it does not get it, and what to do instead.
    asking = pod()
    asking["metadata"]["annotations"] = {"shardcache.io/mode": "hostpath"}
    out, outcome = inject(asking, config)
    assert not any("hostPath" in v for v in out["spec"].get("volumes", []))
    assert any("Pod Security" in w and "shardcache.io/mode" in w for w in outcome.warnings), outcome.warnings


def test_a_hostpath_sidecar_in_a_pod_security_namespace_names_the_fix() -> None:
    injected, _ = inject(pod(), CONFIG)  # e.g. `shardcache inject` output applied to the wrong namespace
    with pytest.raises(InjectionError, match=r"--mode restricted.*Pod Security"):
        inject(injected, InjectConfig(image=CONFIG.image, hostpath_forbidden=True))


# ----------------------------------------------------------------------------- webhook process


@pytest.fixture(scope="module")
def chart_webhook(tmp_path_factory: pytest.TempPathFactory, tls: TLSFiles, renderer: Renderer) -> Iterator[tuple[WebhookProcess, list[str]]]:
    """The webhook with exactly the args the chart's defaults give it (`helm install shardcache
    charts/shardcache -n shardcache`), but its address and certificate."""
    kept = chart_webhook_args(renderer.objects(name="shardcache", namespace="shardcache"))
    server = start_webhook(tmp_path_factory.mktemp("chart-webhook"), tls, *kept)
    try:
        yield server, kept
    finally:
        stop(server.proc)


def test_the_webhook_leaves_controller_made_objects_alone(chart_webhook: tuple[WebhookProcess, list[str]]) -> None:
    webhook, _ = chart_webhook
    rs = replicaset_of(deployment(label_on="template"))
    for operation in ("CREATE", "UPDATE"):
        status, body = webhook.review(admission_review(rs, operation=operation))
        assert status == 200 and body["response"]["allowed"] is True and "patch" not in body["response"], body


def test_a_job_update_is_never_patched(chart_webhook: tuple[WebhookProcess, list[str]]) -> None:
    """A Job's pod template is immutable: a patch on UPDATE (Kueue unsuspending it, a label edit)
    would make the API server refuse the user's own change."""
    webhook, _ = chart_webhook
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "j", "namespace": "ml", "labels": {INJECT_LABEL: "true"}},
           "spec": {"suspend": False, "template": {"metadata": {"labels": {INJECT_LABEL: "true"}},
                                                   "spec": {"restartPolicy": "Never", "containers": [{"name": "t", "image": "t:1"}]}}}}
    status, body = webhook.review(admission_review(job, operation="UPDATE"))
    assert status == 200 and "patch" not in body["response"], body
    status, body = webhook.review(admission_review(job, operation="CREATE"))
    assert body["response"]["patchType"] == "JSONPatch"


def test_the_pod_security_path_injects_restricted(chart_webhook: tuple[WebhookProcess, list[str]]) -> None:
    webhook, _ = chart_webhook
    review = admission_review(pod())
    status, data = webhook.request("POST", "/mutate/pod-security", json.dumps(review).encode(), {"Content-Type": "application/json"})
    assert status == 200, data
    patched = apply_patch(pod(), json.loads(data)["response"])
    assert not any("hostPath" in v for v in patched["spec"].get("volumes", []))


def test_inject_defaults_equal_the_charts_webhook(chart_webhook: tuple[WebhookProcess, list[str]], tmp_path: Path) -> None:
    """The README's promise: `shardcache inject` with no flags gives what the chart's webhook gives,
    so the webhook has nothing to add to its output."""
    webhook, _ = chart_webhook
    manifest = tmp_path / "pod.yaml"
    manifest.write_text(json.dumps(pod()))
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([PYTHON, "-m", "sidecar.cli", "inject", "-f", str(manifest), "-q"],
                          capture_output=True, text=True, timeout=60, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    import yaml

    injected = yaml.safe_load(proc.stdout)
    # The webhook's own result from the bare pod, and from the injector's output.
    status, body = webhook.review(admission_review(pod()))
    assert apply_patch(pod(), body["response"]) == injected
    status, body = webhook.review(admission_review(injected))
    assert status == 200 and "patch" not in body["response"], body


def test_an_ephemeral_container_gets_the_socket_directory_read_only(chart_webhook: tuple[WebhookProcess, list[str]]) -> None:
    """`kubectl debug` adds an ephemeral container through pods/ephemeralcontainers (an UPDATE):
    its mount of the injected hostPath volume is made read-only, like an app container's."""
    webhook, _ = chart_webhook
    running, _ = inject(pod(), CONFIG)
    running["spec"]["ephemeralContainers"] = [
        {"name": "debugger", "image": "busybox", "volumeMounts": [{"name": VOLUME_SOCKET, "mountPath": "/host"}]}]
    review = admission_review(running, operation="UPDATE")
    review["request"]["subResource"] = "ephemeralcontainers"
    status, body = webhook.review(review)
    assert status == 200 and body["response"]["allowed"] is True, body
    patched = apply_patch(copy.deepcopy(running), body["response"])
    assert patched["spec"]["ephemeralContainers"][0]["volumeMounts"][0]["readOnly"] is True
    assert any("debugger" in w and "read-only" in w for w in body["response"]["warnings"])
    # A plain pod UPDATE is still never patched.
    del review["request"]["subResource"]
    status, body = webhook.review(review)
    assert "patch" not in body["response"]
