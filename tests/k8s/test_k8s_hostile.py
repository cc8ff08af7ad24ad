"""Hostile documents and annotation values: ``shardcache inject`` (a real subprocess) answers each
with one line on stderr and exit status 2, in bounded time and output; the webhook (a real process
over TLS) admits the pod untouched with the documented warning. Ordinary anchors keep working."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import yaml

from sidecar.k8s.inject import INJECT_LABEL, SIDECAR_NAME
from tests.support.k8s import WebhookProcess, admission_review, run_inject

# "Billion laughs": 338 bytes that PyYAML expands into megabytes (every alias is written out).
ALIAS_BOMB = """apiVersion: v1
kind: ConfigMap
metadata: {name: lol}
data:
  a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]
  b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
  c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
  d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]
  e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]
  f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]
"""


def pod_yaml(annotations: dict[str, str]) -> str:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "p", "namespace": "ml", "labels": {INJECT_LABEL: "true"}, "annotations": annotations},
        "spec": {"containers": [{"name": "train", "image": "trainer:1"}]},
    }
    return yaml.safe_dump(pod)


# Values the API server would refuse in the injected pod (or that cannot be read as what they
# claim): a trailing newline that `$` matched, digits that are not ASCII, a number past int()'s limit.
BAD_ANNOTATIONS: list[tuple[str, str]] = [
    ("shardcache.io/port", "\uff18\uff16\uff10\uff10"),  # fullwidth 8600
    ("shardcache.io/port", "\u0668\u0666\u0660\u0660"),  # Arabic-Indic 8600
    ("shardcache.io/port", "\u00b2"),  # superscript two: isdigit() but not int()
    ("shardcache.io/port", "9" * 5000),  # int() refuses more than 4300 digits
    ("shardcache.io/sidecar-image", "trainer:1\n"),
    ("shardcache.io/sidecar-image", "trainer:1\nevil"),
    ("shardcache.io/pod-cache-size", "20Gi\n"),
    ("shardcache.io/pod-cache-size", "\uff12\uff10Gi"),
    ("shardcache.io/sidecar-cpu-request", "\uff11\uff10\uff10m"),
    ("shardcache.io/sidecar-cpu-limit", "\u0662"),
    ("shardcache.io/sidecar-memory-request", "\u0665\u0661\u0662Mi"),
    ("shardcache.io/sidecar-memory-limit", "2Gi\nx"),
]
BAD_IDS = [
    "port-fullwidth", "port-arabic", "port-superscript", "port-5000-digits", "image-newline", "image-two-lines",
    "size-newline", "size-fullwidth", "cpu-fullwidth", "cpu-arabic", "memory-arabic", "memory-two-lines",
]

HOSTILE_DOCUMENTS: list[tuple[str, str]] = [
    (ALIAS_BOMB, "aliases"),
    ("[" * 20_000, "nested"),
    ("[" * 20_000 + "]" * 20_000, "nested"),
    ("{a: " * 20_000 + "}" * 20_000, "nested"),
    ("- " * 20_000 + "x\n", "nested"),
    ("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: r}\ndata: &r [*r]\n", "recursive"),
    ("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: n}\nx: " + "9" * 5000 + "\n", "integer"),
    ("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: n}\nx: " + ":".join(["1"] * 20_000) + "\n", "integer"),
    *((pod_yaml({annotation: value}), annotation) for annotation, value in BAD_ANNOTATIONS),
]
HOSTILE_IDS = [
    "alias-bomb", "open-brackets", "closed-brackets", "nested-mappings", "nested-block-lists", "recursive-alias",
    "huge-integer", "sexagesimal-integer", *(f"annotation-{name}" for name in BAD_IDS),
]


def assert_one_line_refusal(done: Any, started: float, expected: str) -> None:
    elapsed = time.monotonic() - started
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    assert done.stdout == ""  # all or nothing: nothing reaches `kubectl apply`
    assert "Traceback" not in done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr[-2000:]
    assert lines[0].startswith("shardcache inject: error: ") and expected in lines[0]
    assert len(lines[0]) < 600  # a line a person reads, not the hostile value echoed back
    assert elapsed < 30, elapsed


@pytest.mark.parametrize("text, expected", HOSTILE_DOCUMENTS, ids=HOSTILE_IDS)
@pytest.mark.slow
def test_inject_refuses_hostile_documents_with_one_line(text: str, expected: str) -> None:
    started = time.monotonic()
    done = run_inject("-f", "-", stdin=text)
    assert_one_line_refusal(done, started, expected)


def test_alias_bomb_refusal_says_what_to_do() -> None:
    started = time.monotonic()
    done = run_inject("-f", "-", stdin=ALIAS_BOMB)
    assert_one_line_refusal(done, started, "<stdin>:")
    assert "explode" in done.stderr


def test_ordinary_anchors_and_merge_keys_still_work() -> None:
    # What Helm charts write: one block of resources and env reused by two containers.
    text = """apiVersion: apps/v1
kind: Deployment
metadata: {name: web, namespace: ml}
spec:
  selector: {matchLabels: {app: web}}
  template:
    metadata: {labels: {app: web}}
    spec:
      containers:
        - &base
          name: train
          image: trainer:1
          resources: &res {requests: {cpu: 100m, memory: 1Gi}}
          env: &env [{name: A, value: "1"}, {name: B, value: "2"}]
        - <<: *base
          name: eval
          resources: *res
          env: *env
"""
    done = run_inject("-f", "-", stdin=text)
    assert done.returncode == 0, done.stderr
    (out,) = [d for d in yaml.safe_load_all(done.stdout) if d]
    spec = out["spec"]["template"]["spec"]
    assert "&" not in done.stdout and "*" not in done.stdout  # written out, as kubectl users read it
    assert spec["initContainers"][0]["name"] == SIDECAR_NAME
    train, eval_ = spec["containers"]
    assert (train["name"], eval_["name"]) == ("train", "eval") and eval_["image"] == "trainer:1"
    assert train["resources"] == eval_["resources"] == {"requests": {"cpu": "100m", "memory": "1Gi"}}
    # Each container got its own variables once, though both env lists were one anchor.
    for container in (train, eval_):
        assert [e["name"] for e in container["env"]] == [
            "A", "B", "SHARDCACHE_ENDPOINT", "SHARDCACHE_MASTER_TOKEN", "SHARDCACHE_HANDLES", "SHARDCACHE_NODE"]


def test_deep_but_reasonable_nesting_still_works() -> None:
    # CRD schemas nest deeply; 40 levels of data in a ConfigMap-like object pass through.
    text = "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: deep}\nx: " + "[" * 40 + "1" + "]" * 40 + "\n"
    done = run_inject("-f", "-", stdin=text)
    assert done.returncode == 0, done.stderr
    assert "configmap/deep: unsupported" in done.stderr


# ----------------------------------------------------------------------------- the webhook


def labelled_pod(annotations: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "p", "namespace": "ml", "labels": {INJECT_LABEL: "true"}, "annotations": annotations},
        "spec": {"containers": [{"name": "train", "image": "trainer:1"}]},
    }


@pytest.mark.parametrize("annotation, value", BAD_ANNOTATIONS, ids=BAD_IDS)
def test_webhook_admits_bad_annotation_untouched_with_the_warning(
    webhook: WebhookProcess, annotation: str, value: str
) -> None:
    # The module's webhook process is shared: count this request's internal errors only (the
    # line is logged, and flushed, before the answer is sent).
    internal_errors = webhook.log_text().count("internal error")
    status, body = webhook.review(admission_review(labelled_pod({annotation: value}), uid="u-hostile"))
    assert status == 200, body
    response = body["response"]
    assert response["uid"] == "u-hostile" and response["allowed"] is True
    assert "patch" not in response and "patchType" not in response  # the pod is untouched
    (warning,) = response["warnings"]
    assert warning.startswith("shardcache: sidecar not injected into pod ml/p: ")
    assert f"metadata.annotations[{annotation}]: invalid value" in warning
    assert len(warning) <= 256 and warning.isascii() and warning.isprintable()
    assert webhook.log_text().count("internal error") == internal_errors


def test_webhook_still_injects_good_annotations(webhook: WebhookProcess) -> None:
    good = {"shardcache.io/port": " 9700 ", "shardcache.io/sidecar-cpu-request": "250m", "shardcache.io/pod-cache-size": "20Gi"}
    status, body = webhook.review(admission_review(labelled_pod(good)))
    assert status == 200 and body["response"]["patchType"] == "JSONPatch"


def test_fail_policy_refuses_bad_annotation_in_one_line(webhook_factory: Callable[..., WebhookProcess]) -> None:
    strict = webhook_factory("--failure-policy", "fail")
    status, body = strict.review(admission_review(labelled_pod({"shardcache.io/sidecar-image": "trainer:1\n"}), uid="u-f"))
    response = body["response"]
    assert status == 200 and response["allowed"] is False
    message = response["status"]["message"]
    assert "shardcache.io/sidecar-image" in message and "\n" not in message


def test_warning_is_one_printable_line_whatever_the_object_names(webhook: WebhookProcess) -> None:
    # generateName is validated by the API server only after admission, so the webhook sees it raw.
    pod = labelled_pod({"shardcache.io/port": "eighty"})
    del pod["metadata"]["name"]
    pod["metadata"]["generateName"] = "tr\u00e4in-\n\x1b[31mred-"
    review = admission_review(pod, uid="u-name")
    review["request"]["name"] = ""
    status, body = webhook.review(review)
    assert status == 200 and body["response"]["allowed"] is True and "patch" not in body["response"]
    (warning,) = body["response"]["warnings"]
    assert warning.isascii() and warning.isprintable(), warning
    assert "shardcache.io/port" in warning and "tr\\xe4in-\\n\\x1b[31mred-*" in warning


@pytest.mark.parametrize(
    "flags, expected",
    [
        (("--sidecar-image", "registry.example.com/shardcache:1\n"), "invalid sidecar image"),
        (("--pod-cache-size", "10Gi\n"), "invalid pod cache size"),
        (("--sidecar-cpu-request", "\u0661\u0660\u0660m"), "invalid cpu request"),
        (("--sidecar-memory-limit", "\uff11Gi"), "invalid memory limit"),
        (("--sidecar-env", "AWS_ENDPOINT_URL\n=http://minio:9000"), "invalid sidecar environment variable name"),
        (("--sidecar-env", "\u00c9T\u00c9=1"), "invalid sidecar environment variable name"),
    ],
    ids=["image-newline", "size-newline", "cpu-arabic", "memory-fullwidth", "env-newline", "env-non-ascii"],
)
def test_inject_refuses_bad_flag_values_with_one_line(flags: tuple[str, str], expected: str) -> None:
    started = time.monotonic()
    done = run_inject("-f", "-", *flags, stdin=pod_yaml({}))
    assert_one_line_refusal(done, started, expected)
