"""The node daemon's sockets belong to one group (``shardcache serve --socket-group``, mode 0660),
and the injected sidecar runs in it: the chart passes the group to the DaemonSet, the webhook gives
it to every hostpath-mode sidecar as ``runAsGroup`` (native sidecar and regular container alike),
and to no other container of the pod. (The sockets themselves: tests/daemon/test_socket_mode.py.)"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from sidecar.k8s.inject import RESTRICTED_UID, SIDECAR_NAME, SOCKET_GID, InjectConfig, InjectionError, inject
from sidecar.k8s.patch import json_patch
from tests.support.k8s import Renderer, find, validate_k8s

IMAGE = "registry.example.com/shardcache:1.2.3"


def pod(**spec: Any) -> dict[str, Any]:
    spec.setdefault("containers", [{"name": "train", "image": "trainer:1"}])
    meta = {"name": "p", "namespace": "ml", "labels": {"shardcache.io/inject": "true"}}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


def containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [*spec.get("initContainers", []), *spec["containers"]]


def sidecar_of(spec: dict[str, Any]) -> dict[str, Any]:
    (found,) = [c for c in containers(spec) if c["name"] == SIDECAR_NAME]
    return found


@pytest.mark.parametrize("native", [True, False], ids=["native-sidecar", "container"])
def test_the_hostpath_sidecar_runs_in_the_socket_group(native: bool) -> None:
    original = pod(securityContext={"runAsUser": 1000, "runAsNonRoot": True},
                   initContainers=[{"name": "fetch", "image": "fetch:1"}])
    out, outcome = inject(original, InjectConfig(image=IMAGE, native_sidecar=native))
    assert outcome.result == "injected"
    spec = out["spec"]
    sidecar = sidecar_of(spec)
    assert sidecar["securityContext"]["runAsGroup"] == SOCKET_GID
    assert sidecar["securityContext"]["allowPrivilegeEscalation"] is False
    # Only the sidecar: the app containers and the pod's own settings are the pod author's.
    for other in containers(spec):
        if other["name"] != SIDECAR_NAME:
            assert "securityContext" not in other, other["name"]
    assert spec["securityContext"] == original["spec"]["securityContext"]
    validate_k8s(out, "1.30")
    # A second pass (the webhook's reinvocation) changes nothing.
    again, outcome = inject(out, InjectConfig(image=IMAGE, native_sidecar=native))
    assert again == out and outcome.result == "unchanged"


def test_restricted_sidecars_have_no_socket_and_keep_their_group() -> None:
    out, _ = inject(pod(), InjectConfig(image=IMAGE, mode="restricted"))
    assert sidecar_of(out["spec"])["securityContext"]["runAsGroup"] == RESTRICTED_UID


def test_without_a_socket_group_the_sidecar_keeps_the_image_group() -> None:
    out, _ = inject(pod(), InjectConfig(image=IMAGE, socket_group=None))
    assert "runAsGroup" not in sidecar_of(out["spec"])["securityContext"]


def test_an_older_injection_converges_and_a_chosen_group_wins() -> None:
    out, _ = inject(pod(), InjectConfig(image=IMAGE))
    older = copy.deepcopy(out)
    del sidecar_of(older["spec"])["securityContext"]["runAsGroup"]  # injected before --socket-group
    again, outcome = inject(older, InjectConfig(image=IMAGE))
    assert outcome.result == "injected" and again == out
    # What the webhook answers: one add, nothing else touched.
    assert json_patch(older, again) == [{"op": "add", "path": "/spec/initContainers/0/securityContext/runAsGroup",
                                         "value": SOCKET_GID}]
    chosen = copy.deepcopy(out)
    sidecar_of(chosen["spec"])["securityContext"]["runAsGroup"] = 4242
    assert inject(chosen, InjectConfig(image=IMAGE))[0] == chosen


@pytest.mark.parametrize("bad", [-1, 2**32 - 1, True, "8600"])
def test_a_bad_socket_group_is_refused(bad: Any) -> None:
    with pytest.raises(InjectionError, match="socket group"):
        InjectConfig(image=IMAGE, socket_group=bad)


def test_the_chart_passes_the_group_the_injector_gives(renderer: Renderer, tmp_path: Path) -> None:
    from sidecar.cli import build_parser
    from sidecar.cli.commands.serve import build_settings
    from sidecar.cli.commands.webhook import settings_from_args

    objects = renderer.objects({})
    daemon = find(objects, "DaemonSet", "-node")["spec"]["template"]["spec"]["containers"][0]
    args = daemon["args"]
    assert args[args.index("--socket-group") + 1] == str(SOCKET_GID)
    parsed = build_parser().parse_args(args)
    # What the kubelet and the Secret volume provide (as tests/k8s/test_k8s_auth.py does).
    parsed.advertise_url = parsed.advertise_url.replace("$(POD_IP)", "10.0.0.7")
    (tmp_path / "peer-secret").write_text("s" * 64)
    parsed.peer_secret_file = str(tmp_path / "peer-secret")
    assert build_settings(parsed).socket_group == SOCKET_GID
    webhook = find(objects, "Deployment", "-webhook")["spec"]["template"]["spec"]["containers"][0]
    assert webhook["args"][webhook["args"].index("--socket-group") + 1] == str(SOCKET_GID)
    assert settings_from_args(build_parser().parse_args(webhook["args"])).inject.socket_group == SOCKET_GID
