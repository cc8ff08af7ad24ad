"""The cases that kept the webhook on its own ``json_patch``: each one is a wrong patch from
``jsonpatch.make_patch`` 1.33. The API server applies the patch it is given, so it must turn
``before`` into ``after`` exactly (JSON types included), and it must not touch the user's fields."""

from __future__ import annotations

import copy
import json
from typing import Any

import jsonpatch
import pytest

from sidecar.k8s.patch import json_patch


def _same(a: Any, b: Any) -> bool:
    """JSON equality: ``false`` is not ``0`` (``==`` says it is). Canonical text is an oracle
    independent of the code under test."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def _apply(before: Any, patch: list[dict[str, Any]]) -> Any:
    return jsonpatch.apply_patch(copy.deepcopy(before), patch)


@pytest.mark.parametrize(
    ("before", "after"),
    [
        # make_patch: remove /0/0, then move /0/0 -> /1/b; it applies, and sets b to None
        ([[[], None], {"a": None}], [[], {"a": None, "b": []}]),
        # make_patch: a move from a path that no longer exists; the patch does not apply
        ([None, None, None, []], [None, [], [], [None, None]]),
        # make_patch: [] (false and 0 compare equal in Python)
        ({"a": [False]}, {"a": [0]}),
        ({"a": {"b": [True, 1]}}, {"a": {"b": [1, True]}}),  # make_patch: [] as well
    ],
)
def test_patch_turns_before_into_exactly_after(before: Any, after: Any) -> None:
    patch = json_patch(before, after)
    assert patch, "a real change needs at least one operation"
    assert _same(_apply(before, patch), after)
    assert {op["op"] for op in patch} <= {"add", "remove", "replace"}  # nothing moves or copies


def test_prepended_init_container_leaves_the_users_container_alone() -> None:
    pod = {"spec": {"initContainers": [{"name": "a", "image": "busybox"}], "containers": [{"name": "c"}]}}
    new = copy.deepcopy(pod)
    new["spec"]["initContainers"].insert(0, {"name": "shardcache", "image": "shardcache:1"})
    new["spec"]["containers"][0]["env"] = [{"name": "SHARDCACHE_ENDPOINT", "value": "http://127.0.0.1:8600"}]
    patch = json_patch(pod, new)
    assert _same(_apply(pod, patch), new)
    # make_patch renames container "a" in place (replace /spec/initContainers/0/name) and adds it again.
    assert not [op for op in patch if op["path"].startswith("/spec/initContainers/")]
    assert {"op": "add", "path": "/spec/containers/0/env", "value": new["spec"]["containers"][0]["env"]} in patch
