"""One cache per cluster on Kubernetes (issue 17): the chart runs the node daemons as one ring
(``--peers-dns`` the headless Service, ``--advertise-url`` the pod IP, ``--peer-secret-file`` a Secret
the chart generates once), admits daemon-to-daemon traffic, and the webhook gives every injected
container ``SHARDCACHE_NODE`` from the downward API. Rendered with Helm's own engine, checked against
the Kubernetes schemas and kubectl offline, the args parsed by the real ``shardcache serve``, and the
injection run through the real ``shardcache webhook`` over HTTPS."""

from __future__ import annotations

import argparse
import base64
import copy
import re
import shutil
import string
from pathlib import Path
from typing import Any

import jsonpatch  # type: ignore[import-untyped]
import pytest
import yaml

from sidecar.k8s.inject import INJECT_LABEL, NODE_ENV, SIDECAR_NAME, InjectConfig, inject
from sidecar.k8s.patch import json_patch
from tests.support.k8s import (
    CHART,
    Renderer,
    WebhookProcess,
    admission_review,
    admits,
    apply_patch,
    check_pod_semantics,
    find,
    kubectl_parse,
    subcommands,
    validate_k8s,
)

NS = "shardcache"
CLUSTER_FLAGS = {"--peers-dns", "--advertise-url", "--peer-secret-file"}
NODE_ENTRY = {"name": NODE_ENV, "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}
# What the kubelet makes of the downward API on one node.
POD_IP, NODE_NAME = "10.42.3.17", "gpu-node-7"

OPTIONS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "elsewhere": {"node": {"port": 9700, "cluster": {"dnsDomain": "corp.internal"}}, "fullnameOverride": "cache"},
    "existing-secret": {"node": {"cluster": {"peerSecret": {"existingSecret": "my-peer-secret"}}}},
    "auth-none": {"node": {"auth": {"mode": "none"}}},
    "per-node": {"node": {"cluster": {"enabled": False}}},
}


@pytest.fixture(scope="module")
def rendered(renderer: Renderer) -> dict[str, list[dict[str, Any]]]:
    return {name: renderer.objects(copy.deepcopy(values)) for name, values in OPTIONS.items()}


def daemon(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (only,) = find(objects, "DaemonSet", "-node")["spec"]["template"]["spec"]["containers"]
    return only


def arg_after(args: list[str], flag: str) -> str:
    assert args.count(flag) == 1, args
    return args[args.index(flag) + 1]


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    entries = container.get("env", [])
    names = [e["name"] for e in entries]
    assert len(names) == len(set(names)), names
    return {e["name"]: e for e in entries}


def headless(objects: list[dict[str, Any]]) -> dict[str, Any]:
    return next(o for o in objects if o["kind"] == "Service" and o["spec"].get("clusterIP") == "None")


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


# ----------------------------------------------------------------------------- the DaemonSet


@pytest.mark.parametrize("option", ["defaults", "elsewhere", "existing-secret", "auth-none"])
def test_daemons_find_each_other_through_the_headless_service(rendered: dict[str, list[dict[str, Any]]], option: str) -> None:
    objects = rendered[option]
    c = daemon(objects)
    args = c["args"]
    svc = headless(objects)
    ds = find(objects, "DaemonSet", "-node")
    port = c["ports"][0]["containerPort"]
    domain = OPTIONS[option].get("node", {}).get("cluster", {}).get("dnsDomain", "cluster.local")
    # --peers-dns names the headless Service that selects these very pods, in this namespace.
    assert arg_after(args, "--peers-dns") == f"{svc['metadata']['name']}.{NS}.svc.{domain}"
    assert selects(svc["spec"]["selector"], ds["spec"]["template"]["metadata"]["labels"])
    assert svc["spec"]["ports"][0]["port"] == port
    # Every A record is a pod IP; the port of each member comes from --advertise-url.
    assert arg_after(args, "--advertise-url") == f"http://$(POD_IP):{port}"
    assert f"tcp://0.0.0.0:{port}" in args
    env = env_of(c)
    # $(POD_IP) expands in args only from a variable defined in the container's env.
    assert env["POD_IP"] == {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    assert env[NODE_ENV] == NODE_ENTRY
    assert "hostNetwork" not in ds["spec"]["template"]["spec"]  # pod IPs, not node IPs, are the members


def test_the_headless_service_publishes_daemons_that_are_not_ready(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for option in OPTIONS:
        svc = headless(rendered[option])
        assert svc["spec"]["publishNotReadyAddresses"] is True, option
    # ...and the template says why, where the next editor looks.
    template = (CHART / "templates" / "node-daemonset.yaml").read_text()
    comment = template[: template.index("publishNotReadyAddresses")].rsplit("clusterIP: None", 1)[1]
    assert "readiness" in comment and "forever" in comment


def test_the_peer_secret_is_generated_and_mounted(rendered: dict[str, list[dict[str, Any]]]) -> None:
    objects = rendered["defaults"]
    secret = find(objects, "Secret", "-node-peer-secret")
    assert secret["metadata"]["name"] == "sc-shardcache-node-peer-secret" and secret["type"] == "Opaque"
    assert secret["metadata"]["labels"]["app.kubernetes.io/component"] == "node"
    value = base64.b64decode(secret["data"]["secret"]).decode()
    assert len(value) == 64 and set(value) <= set(string.ascii_letters + string.digits)
    c = daemon(objects)
    spec = find(objects, "DaemonSet", "-node")["spec"]["template"]["spec"]
    volume = {v["name"]: v for v in spec["volumes"]}["peer-secret"]
    assert volume["secret"] == {"secretName": secret["metadata"]["name"], "defaultMode": 0o400,
                                "items": [{"key": "secret", "path": "secret"}]}
    (mount,) = [m for m in c["volumeMounts"] if m["name"] == "peer-secret"]
    assert mount["readOnly"] is True
    assert arg_after(c["args"], "--peer-secret-file") == f"{mount['mountPath']}/secret"
    # Another release's daemons get another secret: each render without a cluster generates anew.
    assert find(rendered["auth-none"], "Secret", "-node-peer-secret")["data"]["secret"] != secret["data"]["secret"]


def test_an_existing_secret_is_used_and_none_generated(rendered: dict[str, list[dict[str, Any]]]) -> None:
    objects = rendered["existing-secret"]
    assert not [o for o in objects if o["kind"] == "Secret" and "peer" in o["metadata"]["name"]]
    spec = find(objects, "DaemonSet", "-node")["spec"]["template"]["spec"]
    assert {v["name"]: v for v in spec["volumes"]}["peer-secret"]["secret"]["secretName"] == "my-peer-secret"


def test_the_secret_is_kept_across_upgrades(renderer: Renderer, tmp_path: Path) -> None:
    """`lookup` answers only against a cluster, so the chart is copied with the API server's answer
    (the Secret of the first install) written in place of the call; the template's keep branch is
    then what renders."""
    template = (CHART / "templates" / "node-peer-secret.yaml").read_text()
    call = 'lookup "v1" "Secret" .Release.Namespace $name'
    assert template.count(call) == 1
    kept = base64.b64encode(b"K" * 64).decode()
    chart = tmp_path / "shardcache"
    shutil.copytree(CHART, chart)
    (chart / "templates" / "node-peer-secret.yaml").write_text(template.replace(call, f'dict "data" (dict "secret" "{kept}")'))
    import helm_python

    copied = helm_python.Chart.load(str(chart))
    try:
        files = copied.render(values={}, name="sc", namespace=NS, is_upgrade=True)
    finally:
        copied.close()
    (secret,) = [d for d in yaml.safe_load_all(files["shardcache/templates/node-peer-secret.yaml"]) if d]
    assert secret["data"]["secret"] == kept


def test_cluster_off_runs_each_node_on_its_own(rendered: dict[str, list[dict[str, Any]]], renderer: Renderer) -> None:
    objects = rendered["per-node"]
    c = daemon(objects)
    assert not CLUSTER_FLAGS & set(c["args"])
    assert "POD_IP" not in env_of(c) and env_of(c)[NODE_ENV] == NODE_ENTRY  # the node's name stays in /stats
    assert "peer-secret" not in {m["name"] for m in c["volumeMounts"]}
    assert not [o for o in objects if o["kind"] == "Secret" and "peer" in o["metadata"]["name"]]
    policy = find(objects, "NetworkPolicy", "-node")
    assert len(policy["spec"]["ingress"]) == 1
    notes = renderer.files(OPTIONS["per-node"])["shardcache/templates/NOTES.txt"]
    assert "One cache per cluster" not in notes


def test_the_daemon_accepts_its_args(rendered: dict[str, list[dict[str, Any]]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from sidecar.cli import build_parser

    for option in ("defaults", "elsewhere", "auth-none"):
        objects = rendered[option]
        c = daemon(objects)
        # The kubelet's part: the downward API's values in the env, $(POD_IP) expanded in args, the
        # Secret's key as a file.
        monkeypatch.setenv(NODE_ENV, NODE_NAME)
        parser = build_parser()
        if "serve" not in subcommands(parser):
            pytest.skip("sidecar.cli.commands.serve is not in this tree yet")
        serve = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
        if not CLUSTER_FLAGS <= serve._option_string_actions.keys():
            pytest.skip(f"shardcache serve lacks {sorted(CLUSTER_FLAGS - serve._option_string_actions.keys())} (issue 17, being built)")
        from sidecar.cli.commands.serve import build_settings

        argv = [a.replace("$(POD_IP)", POD_IP) for a in c["args"]]
        secret_value = base64.b64decode(find(objects, "Secret", "-node-peer-secret")["data"]["secret"])
        secret_file = tmp_path / option / "secret"
        secret_file.parent.mkdir()
        secret_file.write_bytes(secret_value)
        args = parser.parse_args(argv)
        assert args.command == "serve" and args.mode == "node"
        assert args.peer_secret_file == "/etc/shardcache/peer-secret/secret"
        args.peer_secret_file = str(secret_file)
        # The daemon's own checks (a secret with --auth sigv4, the advertise URL's form).
        settings = build_settings(args)
        cluster = settings.cluster
        assert cluster is not None
        assert cluster.peers_dns == arg_after(c["args"], "--peers-dns") and cluster.peers == ()
        port = c["ports"][0]["containerPort"]
        assert cluster.advertise_url == f"http://{POD_IP}:{port}" and cluster.port == port
        assert cluster.secret == secret_value and cluster.links == "authenticated"
        assert settings.node == NODE_NAME


def master_args(objects: list[dict[str, Any]]) -> list[str]:
    (only,) = find(objects, "Deployment", "-master")["spec"]["template"]["spec"]["containers"]
    return list(only["args"])


def test_the_master_reads_the_ring_from_the_daemons_service(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """Cache-aware leases (issue 18): the master asks the daemons' headless Service for the ring,
    with the flag the real ``shardcache master`` takes; per-node caches have no ring to read."""
    from sidecar.cli import build_parser

    for option in ("defaults", "elsewhere"):
        objects = rendered[option]
        args = master_args(objects)
        port = daemon(objects)["ports"][0]["containerPort"]
        dns = arg_after(daemon(objects)["args"], "--peers-dns")
        assert arg_after(args, "--cluster") == f"http://{dns}:{port}"
        parsed = build_parser().parse_args(args)
        assert parsed.command == "master" and parsed.cluster == [f"http://{dns}:{port}"]
    assert "--cluster" not in master_args(rendered["per-node"])


# ----------------------------------------------------------------------------- NetworkPolicy


def test_daemons_reach_each_other_through_the_network_policy(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for option in ("defaults", "elsewhere"):
        objects = rendered[option]
        policy = find(objects, "NetworkPolicy", "-node")
        daemon_labels = find(objects, "DaemonSet", "-node")["spec"]["template"]["metadata"]["labels"]
        master_labels = find(objects, "Deployment", "-master")["spec"]["template"]["metadata"]["labels"]
        port = daemon(objects)["ports"][0]["containerPort"]
        assert admits(policy, NS, port, daemon_labels)
        # The daemons and the masters (they read the ring for cache-aware leases), only on their port:
        # not another pod of the release's namespace, not another port, not a daemon-labelled pod in
        # another namespace.
        assert admits(policy, NS, port, master_labels) and not admits(policy, NS, port + 1, daemon_labels)
        assert not admits(policy, NS, port, {"app": "other"})
        assert not admits(policy, "kube-system", port, daemon_labels)
        # The training namespaces' rule is untouched.
        assert admits(policy, "ml", port) and not admits(policy, NS, port)


# ----------------------------------------------------------------------------- schema, validity, NOTES


@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.slow
def test_lint_and_objects_are_valid(renderer: Renderer, rendered: dict[str, list[dict[str, Any]]], option: str) -> None:
    report = renderer.helm.lint(str(CHART), copy.deepcopy(OPTIONS[option]), strict=True, namespace=NS, kube_version="v1.30.0")
    assert report["errors"] == [] and report["messages"] == [], report
    for obj in rendered[option]:
        if obj["kind"] in ("DaemonSet", "Service", "Secret", "NetworkPolicy"):
            for version in ("1.25", "1.30"):
                validate_k8s(obj, version)


def test_kubectl_reads_the_cluster_objects(renderer: Renderer) -> None:
    files = renderer.files({})
    text = "\n---\n".join(files[f"shardcache/templates/{name}"] for name in ("node-daemonset.yaml", "node-peer-secret.yaml", "networkpolicies.yaml"))
    parsed = kubectl_parse(text)
    ds = next(o for o in parsed if o["kind"] == "DaemonSet")
    assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in ds["spec"]["template"]["spec"]["containers"][0]["env"]
    assert any(o["kind"] == "Service" and o["spec"].get("publishNotReadyAddresses") is True for o in parsed)
    assert any(o["kind"] == "Secret" and o["metadata"]["name"].endswith("-node-peer-secret") for o in parsed)


@pytest.mark.parametrize(
    "values, where",
    [
        ({"node": {"cluster": {"enabled": "yes"}}}, "/node/cluster/enabled"),
        ({"node": {"cluster": {"dnsDomain": "Cluster_Local"}}}, "/node/cluster/dnsDomain"),
        ({"node": {"cluster": {"peerSecret": {"existingSecret": "My_Secret"}}}}, "/node/cluster/peerSecret/existingSecret"),
        ({"node": {"cluster": {"peers": ["http://x:1"]}}}, "peers"),
    ],
)
def test_schema_rejects_bad_cluster_values(renderer: Renderer, values: dict[str, Any], where: str) -> None:
    with pytest.raises(renderer.helm.HelmValuesError) as info:
        renderer.files(values)
    assert where in str(info.value)


def test_notes_say_it_in_one_line(renderer: Renderer) -> None:
    notes = renderer.files({})["shardcache/templates/NOTES.txt"]
    (line,) = [line for line in notes.splitlines() if "One cache per cluster" in line]
    assert "sc-shardcache-node.shardcache.svc.cluster.local" in line and "/_shardcache/peers" in line


# ----------------------------------------------------------------------------- the webhook


CONFIG = InjectConfig(image="registry.example.com/shardcache:test")


def pod(**spec: Any) -> dict[str, Any]:
    spec.setdefault("containers", [{"name": "train", "image": "trainer:1"}, {"name": "eval", "image": "trainer:1"}])
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "ml", "labels": {INJECT_LABEL: "true"}}, "spec": spec}


def all_containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return list(spec.get("initContainers", [])) + list(spec["containers"])


@pytest.mark.parametrize(
    "config",
    [CONFIG, InjectConfig(image=CONFIG.image, native_sidecar=False), InjectConfig(image=CONFIG.image, mode="restricted"),
     InjectConfig(image=CONFIG.image, env=(("AWS_ENDPOINT_URL", "http://minio:9000"),), master_token_secret="sc-shardcache-master-token")],
    ids=["native", "container", "restricted", "endpoint-and-token"],
)
def test_every_injected_container_gets_its_node(config: InjectConfig) -> None:
    obj = pod(initContainers=[{"name": "fetch", "image": "f:1"}])
    out, outcome = inject(obj, config)
    assert outcome.result == "injected"
    spec = out["spec"]
    check_pod_semantics(spec)
    validate_k8s(out, "1.30")
    sidecar = next(c for c in all_containers(spec) if c["name"] == SIDECAR_NAME)
    assert env_of(sidecar)[NODE_ENV] == NODE_ENTRY
    for container in spec["containers"]:
        assert env_of(container)[NODE_ENV] == NODE_ENTRY, container["name"]
    # An init container after a native sidecar reads through it, as the app containers do; one that
    # runs before a regular-container sidecar starts gets none of the cache's variables.
    fetch = next(c for c in spec.get("initContainers", []) if c["name"] == "fetch")
    assert (NODE_ENV in env_of(fetch)) is config.native_sidecar
    # Idempotent: a second pass (reinvocationPolicy IfNeeded) changes nothing.
    again, outcome = inject(out, config)
    assert outcome.result == "unchanged" and again == out
    # The webhook's answer reaches the same pod and removes nothing (a prepended sidecar replaces
    # the container list it joins; test_a_pod_injected_before_gets_the_node_appended: env only adds).
    patch = json_patch(obj, out)
    assert patch and not [op for op in patch if op["op"] == "remove"], patch
    assert jsonpatch.apply_patch(obj, patch) == out


def test_a_node_the_user_set_wins() -> None:
    mine = [{"name": NODE_ENV, "value": "pinned"}]
    theirs = [{"name": NODE_ENV, "valueFrom": {"fieldRef": {"fieldPath": "metadata.annotations['topology/node']"}}}]
    obj = pod(containers=[{"name": "train", "image": "t:1", "env": copy.deepcopy(mine)},
                          {"name": "eval", "image": "t:1", "env": copy.deepcopy(theirs)}])
    out, _ = inject(obj, InjectConfig(image=CONFIG.image, env=((NODE_ENV, "sidecar-node"),)))
    train, evaluate = out["spec"]["containers"]
    assert [e for e in train["env"] if e["name"] == NODE_ENV] == mine
    assert [e for e in evaluate["env"] if e["name"] == NODE_ENV] == theirs
    sidecar = out["spec"]["initContainers"][0]
    assert [e for e in sidecar["env"] if e["name"] == NODE_ENV] == [{"name": NODE_ENV, "value": "sidecar-node"}]


def test_a_pod_injected_before_gets_the_node_appended() -> None:
    """A pod injected by an older webhook (its sidecar and app containers without SHARDCACHE_NODE)
    converges: the entry is appended to each container's env, and nothing else changes."""
    out, _ = inject(pod(), CONFIG)
    older = copy.deepcopy(out)
    for container in all_containers(older["spec"]):
        container["env"] = [e for e in container.get("env", []) if e["name"] != NODE_ENV]
        if not container["env"]:
            del container["env"]
    again, outcome = inject(older, CONFIG)
    assert outcome.result == "injected" and again == out
    patch = json_patch(older, again)
    assert all(op["op"] == "add" for op in patch) and len(patch) == 3, patch
    assert all(re.fullmatch(r"/spec/(initContainers|containers)/\d+/env(/\d+)?", op["path"]) for op in patch), patch


def test_the_real_webhook_injects_the_node(webhook: WebhookProcess) -> None:
    obj = pod()
    status, body = webhook.review(admission_review(obj))
    assert status == 200 and body["response"]["allowed"] is True, body
    patched = apply_patch(obj, body["response"])
    for container in all_containers(patched["spec"]):
        assert env_of(container)[NODE_ENV] == NODE_ENTRY, container["name"]
    validate_k8s(patched, "1.30")
    # Called again on its own output (reinvocation): nothing more to patch.
    status, body = webhook.review(admission_review(patched, uid="uid-2"))
    assert status == 200 and body["response"]["allowed"] is True and "patch" not in body["response"], body
