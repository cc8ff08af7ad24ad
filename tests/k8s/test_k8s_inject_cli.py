"""``shardcache inject`` as a real subprocess (``python -m sidecar.cli inject``) on multi-document
YAML, including a Kubeflow PyTorchJob."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from sidecar.k8s.inject import INJECT_LABEL, SIDECAR_NAME, InjectConfig, inject
from tests.support.k8s import FIXTURES, TEMPLATE_PATHS, check_pod_semantics, docs, kubectl_parse, pod_templates, run_inject, validate_k8s

WORKLOADS_YAML = FIXTURES / "workloads.yaml"


@pytest.fixture(scope="module")
def injected() -> subprocess.CompletedProcess[str]:
    return run_inject("-f", str(WORKLOADS_YAML), "--sidecar-image", "registry.example.com/shardcache:1.0")


def test_injects_every_workload_and_passes_the_rest_through(injected: subprocess.CompletedProcess[str]) -> None:
    assert injected.returncode == 0, injected.stderr
    inputs = docs(WORKLOADS_YAML.read_text())
    outputs = docs(injected.stdout)
    assert [(d["kind"], d["metadata"]["name"]) for d in outputs] == [(d["kind"], d["metadata"]["name"]) for d in inputs]
    config = InjectConfig(image="registry.example.com/shardcache:1.0")
    for before, after in zip(inputs, outputs, strict=True):
        # The command and the webhook share one function: same result, byte for byte.
        assert after == inject(before, config, require_label=False)[0]
        if before["kind"] not in TEMPLATE_PATHS:
            assert after == before
            continue
        validate_k8s(after, "1.30")
        for template in pod_templates(after):
            check_pod_semantics(template["spec"], tuple(c["metadata"]["name"] for c in before["spec"].get("volumeClaimTemplates", [])))
            assert template["spec"]["initContainers"][0]["image"] == "registry.example.com/shardcache:1.0"


def test_pytorchjob_master_and_workers(injected: subprocess.CompletedProcess[str]) -> None:
    job = next(d for d in docs(injected.stdout) if d["kind"] == "PyTorchJob")
    for role in ("Master", "Worker"):
        replica = job["spec"]["pytorchReplicaSpecs"][role]
        spec = replica["template"]["spec"]
        assert spec["initContainers"][0]["name"] == SIDECAR_NAME
        assert spec["initContainers"][0]["restartPolicy"] == "Always"
        assert spec["containers"][0]["args"] == ["--epochs", "3"]  # the trainer is unchanged...
        assert {"name": "SHARDCACHE_ENDPOINT", "value": "http://127.0.0.1:8600"} in spec["containers"][0]["env"]  # ...but for this
        assert replica["restartPolicy"] == "OnFailure"
    assert job["spec"]["elasticPolicy"] == {"rdzvBackend": "c10d", "minReplicas": 1, "maxReplicas": 4}


def test_report_on_stderr(injected: subprocess.CompletedProcess[str]) -> None:
    lines = injected.stderr.splitlines()
    assert "pod/ml/trainer: injected" in lines
    assert "pytorchjob/ml/bert-elastic: injected" in lines
    assert "configmap/ml/train-config: unsupported (holds no pod template)" in lines


def test_output_is_idempotent_and_kubectl_reads_it(injected: subprocess.CompletedProcess[str]) -> None:
    again = run_inject("-f", "-", "--sidecar-image", "registry.example.com/shardcache:1.0", stdin=injected.stdout)
    assert again.returncode == 0
    assert again.stdout == injected.stdout
    assert "unchanged (already injected)" in again.stderr
    parsed = kubectl_parse(injected.stdout)
    assert [o["kind"] for o in parsed] == [d["kind"] for d in docs(injected.stdout)]


def test_stdin_directory_and_kind_list(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text(WORKLOADS_YAML.read_text())
    (tmp_path / "b.json").write_text('{"apiVersion": "v1", "kind": "List", "items": [{"apiVersion": "v1", "kind": "Pod", '
                                      '"metadata": {"name": "x"}, "spec": {"containers": [{"name": "c", "image": "i"}]}}]}')
    (tmp_path / "notes.txt").write_text("ignored")
    out = run_inject("-f", str(tmp_path))
    assert out.returncode == 0, out.stderr
    result = docs(out.stdout)
    assert len(result) == len(docs(WORKLOADS_YAML.read_text())) + 1
    listed = result[-1]
    assert listed["kind"] == "List" and listed["items"][0]["spec"]["initContainers"][0]["name"] == SIDECAR_NAME
    piped = run_inject("-f", "-", stdin=(tmp_path / "b.json").read_text())
    assert docs(piped.stdout) == [listed]


def test_labelled_only_and_opt_out(tmp_path: Path) -> None:
    manifest = tmp_path / "m.yaml"
    manifest.write_text(
        "apiVersion: v1\nkind: Pod\nmetadata: {name: plain}\nspec: {containers: [{name: c, image: i}]}\n---\n"
        "apiVersion: v1\nkind: Pod\nmetadata: {name: out, labels: {shardcache.io/inject: 'false'}}\n"
        "spec: {containers: [{name: c, image: i}]}\n"
    )
    everything = docs(run_inject("-f", str(manifest)).stdout)
    assert everything[0]["metadata"]["labels"][INJECT_LABEL] == "true" and "initContainers" in everything[0]["spec"]
    assert "initContainers" not in everything[1]["spec"]
    only = run_inject("-f", str(manifest), "--labelled-only")
    assert only.returncode == 0 and docs(only.stdout) == docs(manifest.read_text())
    assert "warning: no pod template was injected" in only.stderr


def test_flags_and_env_vars(tmp_path: Path) -> None:
    out = run_inject(
        "-f", str(WORKLOADS_YAML), "--no-native-sidecar", "--sidecar-port", "9100", "--no-short-circuit",
        "--sidecar-cpu-limit", "2", "--sidecar-memory-limit", "", "-q",
        env={"SHARDCACHE_SIDECAR_IMAGE": "mirror.local/shardcache:env", "SHARDCACHE_SOCKET_HOST_DIR": "/mnt/run"},
    )
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""
    job = next(d for d in docs(out.stdout) if d["kind"] == "Job")
    spec = job["spec"]["template"]["spec"]
    sidecar = spec["containers"][0]
    assert sidecar["name"] == SIDECAR_NAME and sidecar["image"] == "mirror.local/shardcache:env"
    assert "tcp://127.0.0.1:9100" in sidecar["args"]
    # The Job's annotation overrides the flag for that pod.
    assert sidecar["resources"]["limits"] == {"cpu": "2", "memory": "2Gi"}
    assert {v["name"]: v for v in spec["volumes"]}["shardcache-socket"]["hostPath"]["path"] == "/mnt/run"
    assert "shardcache-node-cache" not in {v["name"] for v in spec["volumes"]}
    validate_k8s(job, "1.26")


@pytest.mark.parametrize(
    "content, message",
    [
        ("apiVersion: v1\nkind: Pod\nmetadata:\n  name: x\n spec: [\n", "m.yaml:5:"),
        ("apiVersion: v1\nkind: Pod\nmetadata: {name: x, labels: {shardcache.io/inject: true}}\nspec: {containers: [{name: c, image: i}]}\n", "quote values"),
        ("apiVersion: v1\nkind: Pod\nmetadata: {name: ok}\nspec: {containers: [{name: c, image: i}]}\n---\n"
         "apiVersion: v1\nkind: Pod\nmetadata: {name: x, annotations: {shardcache.io/port: nope}}\nspec: {containers: [{name: c, image: i}]}\n",
         "document 2: metadata.annotations[shardcache.io/port]: invalid value 'nope'"),
        ("- just\n- a list\n", "expected a Kubernetes object"),
        ("apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: d}\nspec: {replicas: 1}\n", "spec.template is missing"),
    ],
    ids=["bad-yaml", "unquoted-label", "bad-annotation", "not-an-object", "no-template"],
)
def test_errors_write_nothing_and_exit_2(tmp_path: Path, content: str, message: str) -> None:
    manifest = tmp_path / "m.yaml"
    manifest.write_text(content)
    out = run_inject("-f", str(manifest))
    assert out.returncode == 2
    assert out.stdout == ""  # all or nothing: nothing half-injected reaches kubectl apply
    assert message in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr


def test_missing_file_and_bad_flags(tmp_path: Path) -> None:
    missing = run_inject("-f", str(tmp_path / "nope.yaml"))
    assert missing.returncode == 2 and "no such file" in missing.stderr
    empty_dir = run_inject("-f", str(tmp_path))
    assert empty_dir.returncode == 2 and "no *.yaml" in empty_dir.stderr
    bad = run_inject("-f", str(WORKLOADS_YAML), "--pod-cache-size", "huge")
    assert bad.returncode == 2 and "invalid pod cache size 'huge'" in bad.stderr and bad.stdout == ""
    env = run_inject("-f", str(WORKLOADS_YAML), "--sidecar-env", "AWS_REGION")
    assert env.returncode == 2 and "use NAME=VALUE" in env.stderr and env.stdout == ""


def test_help_has_examples() -> None:
    out = run_inject("--help")
    assert out.returncode == 0
    assert "kubectl apply -f -" in out.stdout and "PyTorchJob" in out.stdout
