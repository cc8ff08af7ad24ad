"""The chart's tenants (``master.auth.tenants``, issue 29 item 1): a master token per training
namespace, rendered by Helm's own engine, and the rendered Secrets and arguments driving a real
``shardcache master``: each namespace's token sees its own jobs only, the operator's all."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pytest

from tests.support.k8s import Renderer, find, validate_k8s
from tests.support.masters import MasterProcess, http, job_spec

TENANTS = {"master": {"auth": {"tenants": ["ml", "team-b"]}}}


def _secret(objects: list[dict[str, Any]], name: str, namespace: str) -> dict[str, str]:
    (found,) = [o for o in objects if o["kind"] == "Secret" and o["metadata"]["name"] == name
                and o["metadata"]["namespace"] == namespace]
    return {k: base64.b64decode(v).decode() for k, v in found["data"].items()}


def test_each_namespace_gets_a_token_of_its_own_and_the_master_reads_them(renderer: Renderer, tmp_path: Path) -> None:
    objects = renderer.objects(TENANTS)
    for obj in objects:
        validate_k8s(obj)
    tenants = _secret(objects, "sc-shardcache-master-tenants", "shardcache")
    assert set(tenants) == {"ml", "team-b"} and tenants["ml"] != tenants["team-b"]
    operator = _secret(objects, "sc-shardcache-master-token", "shardcache")["token"]
    # The webhook injects SHARDCACHE_MASTER_TOKEN from this name in the pod's namespace.
    for ns in ("ml", "team-b"):
        assert _secret(objects, "sc-shardcache-master-token", ns) == {"token": tenants[ns]}
        assert operator != tenants[ns]

    deployment = find(objects, "Deployment", "-master")
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    args = c["args"]
    tenants_dir = args[args.index("--tenant-tokens") + 1]
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert mounts["tenants"]["mountPath"] == tenants_dir and mounts["tenants"]["readOnly"] is True
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["tenants"]["secret"]["secretName"] == "sc-shardcache-master-tenants"

    # The rendered Secrets as the kubelet would mount them, the rendered flags, a real master.
    (tmp_path / "tenants").mkdir()
    for ns, token in tenants.items():
        (tmp_path / "tenants" / ns).write_text(token)
    (tmp_path / "token").write_text(operator)
    flags = ["--token-file", str(tmp_path / "token"), "--tenant-tokens", str(tmp_path / "tenants")]
    master = MasterProcess(tmp_path, f"sqlite://{tmp_path / 'm.db'}", *flags, name="m", advertise=False).start()
    try:
        def as_(token: str) -> dict[str, str]:
            return {"Authorization": f"Bearer {token}"}

        assert http("POST", master.url + "/v1/jobs", job_spec("ml-job"), headers=as_(tenants["ml"]))[0] == 201
        assert http("GET", master.url + "/v1/jobs/ml-job", headers=as_(tenants["team-b"]))[0] == 403
        assert http("GET", master.url + "/v1/jobs", headers=as_(tenants["team-b"]))[1]["jobs"] == []
        assert [j["name"] for j in http("GET", master.url + "/v1/jobs", headers=as_(operator))[1]["jobs"]] == ["ml-job"]
    finally:
        master.stop()


def test_tokens_are_kept_per_render_only_through_lookup(renderer: Renderer) -> None:
    """`helm template` (no cluster to look up) makes new tokens each time, as the operator's."""
    first = _secret(renderer.objects(TENANTS), "sc-shardcache-master-tenants", "shardcache")
    second = _secret(renderer.objects(TENANTS), "sc-shardcache-master-tenants", "shardcache")
    assert first["ml"] != second["ml"]


def test_without_tenants_nothing_changes(renderer: Renderer) -> None:
    objects = renderer.objects({})
    assert not [o for o in objects if o["metadata"]["name"].endswith("-master-tenants")]
    (c,) = find(objects, "Deployment", "-master")["spec"]["template"]["spec"]["containers"]
    assert "--tenant-tokens" not in c["args"]
    assert [o["metadata"]["namespace"] for o in objects if o["kind"] == "Secret"
            and o["metadata"]["name"] == "sc-shardcache-master-token"] == ["shardcache"]


@pytest.mark.parametrize(
    "values, message",
    [
        ({"master": {"auth": {"tenants": ["shardcache"]}}}, "the release's own namespace"),
        ({"master": {"auth": {"enabled": False, "tenants": ["ml"]}}}, "master.auth.tenants needs master.auth.enabled"),
    ],
)
def test_inconsistent_tenants_fail_with_what_to_change(renderer: Renderer, values: dict[str, Any], message: str) -> None:
    with pytest.raises(renderer.helm.HelmError) as info:
        renderer.files(values)
    assert message in str(info.value)


@pytest.mark.parametrize("tenants", [["Team_A"], ["ml", "ml"], "ml"])
def test_schema_refuses_tenants_that_are_not_namespaces(renderer: Renderer, tenants: Any) -> None:
    with pytest.raises(renderer.helm.HelmValuesError) as info:
        renderer.files({"master": {"auth": {"tenants": tenants}}})
    assert "/master/auth/tenants" in str(info.value)


def test_notes_say_each_namespace_has_its_token(renderer: Renderer) -> None:
    notes = renderer.files(TENANTS)["shardcache/templates/NOTES.txt"]
    assert "ml, team-b" in notes and "own token" in notes
    assert "create secret generic" not in notes  # nothing to copy by hand
    plain = renderer.files({})["shardcache/templates/NOTES.txt"]
    assert "master.auth.tenants" in plain  # says how to give namespaces their own


def test_the_service_monitor_scrapes_the_master_with_the_operator_token(renderer: Renderer) -> None:
    objects = renderer.objects({**TENANTS, "metrics": {"serviceMonitor": {"enabled": True}}})
    (endpoint,) = find(objects, "ServiceMonitor", "-master")["spec"]["endpoints"]
    assert endpoint["authorization"] == {"type": "Bearer", "credentials": {"name": "sc-shardcache-master-token", "key": "token"}}
    (endpoint,) = find(objects, "ServiceMonitor", "-node")["spec"]["endpoints"]
    assert "authorization" not in endpoint
