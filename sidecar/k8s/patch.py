"""The RFC 6902 JSON patch between two objects: what the admission webhook answers with (the
difference between a pod and its injection, :mod:`sidecar.k8s.inject`)."""

from __future__ import annotations

from typing import Any

__all__ = ["json_patch", "json_equal"]


def json_patch(before: Any, after: Any, path: str = "") -> list[dict[str, Any]]:
    """RFC 6902 operations that turn ``before`` into ``after``.

    Objects are diffed key by key, lists of equal length element by element, a list that only
    grew gets ``add`` at the end, any other list change replaces the whole list (small patches
    for what injection does: append env vars and volumes, prepend one init container).

    Not ``jsonpatch.make_patch`` (1.33), because its patches were wrong in a measured
    run of tests/k8s/test_k8s_inject.py's property; tests/k8s/test_json_patch_cases.py
    keeps the cases:
    ``[[[], None], {"a": None}] -> [[], {"a": None, "b": []}]`` gives ``remove /0/0`` then
    ``move /0/0 -> /1/b``, which applies and sets ``b`` to ``None``;
    ``[None, None, None, []] -> [None, [], [], [None, None]]`` gives a ``move`` whose path does not
    resolve, so the API server would refuse it; ``[False] -> [0]`` inside an object gives no op.
    Prepending our init container to ``[{"name": "a"}]`` made it rename the user's container
    ``a`` in place and add ``a`` again at index 1. That patch reaches the right object, but it
    says something the change never meant.
    """
    if isinstance(before, dict) and isinstance(after, dict):
        ops: list[dict[str, Any]] = []
        for key in before:
            if key not in after:
                ops.append({"op": "remove", "path": f"{path}/{_escape(key)}"})
        for key, value in after.items():
            child = f"{path}/{_escape(key)}"
            if key not in before:
                ops.append({"op": "add", "path": child, "value": value})
            else:
                ops.extend(json_patch(before[key], value, child))
        return ops
    if isinstance(before, list) and isinstance(after, list):
        if len(before) == len(after):
            return [op for index in range(len(after)) for op in json_patch(before[index], after[index], f"{path}/{index}")]
        if len(after) > len(before) and json_equal(after[: len(before)], before):
            return [{"op": "add", "path": f"{path}/{index}", "value": after[index]} for index in range(len(before), len(after))]
    if json_equal(before, after):
        return []
    return [{"op": "replace", "path": path, "value": after}]


def json_equal(a: Any, b: Any) -> bool:
    """Equality that, unlike ``==``, tells JSON ``true`` from ``1``."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(json_equal(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(json_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _escape(key: str) -> str:
    return str(key).replace("~", "~0").replace("/", "~1")
