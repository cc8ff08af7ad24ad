"""The chart's alerts and dashboard (metrics.prometheusRule, metrics.dashboard): rendered with
Helm's own engine, the rules checked and unit-tested by promtool (tests/k8s/fixtures/alerts-test.yaml),
and every metric name in an alert or a panel query found among the names that a real
``shardcache serve`` and ``shardcache master`` export after some traffic."""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.daemons import DaemonProcess
from tests.support.k8s import CHART, FIXTURES, Renderer, find, validate_k8s
from tests.support.masters import MasterProcess
from tests.support.processes import REPO, free_port
from tests.support.waits import wait_until

NS = "shardcache"
ON = {"metrics": {"prometheusRule": {"enabled": True}, "dashboard": {"enabled": True}}}
ALERTS_FILE = CHART / "files" / "alerts.yaml"
DASHBOARD_FILE = CHART / "files" / "dashboard.json"
RUNBOOKS = REPO / "docs" / "alerts.md"
SEVERITIES = {"critical", "warning", "info"}


def with_values(**metrics: Any) -> dict[str, Any]:
    values = copy.deepcopy(ON)
    for key, value in metrics.items():
        values["metrics"].setdefault(key, {}).update(value)
    return values


def rule_object(renderer: Renderer, values: dict[str, Any] | None = None) -> dict[str, Any]:
    return find(renderer.objects(values or ON), "PrometheusRule")


def alerts_of(rule: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["alert"]: r for group in rule["spec"]["groups"] for r in group["rules"]}


def source_alerts() -> list[str]:
    return [r["alert"] for group in yaml.safe_load(ALERTS_FILE.read_text())["groups"] for r in group["rules"]]


@pytest.fixture(scope="module")
def rule(renderer: Renderer) -> dict[str, Any]:
    return rule_object(renderer)


@pytest.fixture(scope="module")
def dashboard(renderer: Renderer) -> dict[str, Any]:
    config_map = find(renderer.objects(ON), "ConfigMap", "-dashboard")
    (text,) = config_map["data"].values()
    parsed: dict[str, Any] = json.loads(text)
    return parsed


# ----------------------------------------------------------------------------- promtool


@pytest.fixture(scope="session")
def promtool() -> str:
    """Prometheus' own rule checker (Debian's `prometheus` package; scripts/test.sh installs it).
    Required, as etcd is: a missing promtool fails these tests rather than skipping them."""
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool is missing: install Debian's prometheus package "
                    "(apt-get update && apt-get install -y prometheus; scripts/test.sh does this)")
    return path


def run_promtool(promtool: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def write_rules(rule: dict[str, Any], directory: Path) -> Path:
    """The PrometheusRule's spec is a Prometheus rule file as it stands (groups:)."""
    path = directory / "shardcache-rules.yaml"
    path.write_text(yaml.safe_dump(rule["spec"], sort_keys=False))
    return path


def test_promtool_checks_the_rendered_rules(rule: dict[str, Any], promtool: str, tmp_path: Path) -> None:
    path = write_rules(rule, tmp_path)
    done = run_promtool(promtool, "check", "rules", path.name, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(alerts_of(rule))} rules found" in done.stdout


def test_promtool_unit_tests_pass(rule: dict[str, Any], promtool: str, tmp_path: Path) -> None:
    write_rules(rule, tmp_path)
    shutil.copy(FIXTURES / "alerts-test.yaml", tmp_path / "alerts-test.yaml")
    done = run_promtool(promtool, "test", "rules", "alerts-test.yaml", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_promtool_unit_tests_fail_on_a_changed_rule(rule: dict[str, Any], promtool: str, tmp_path: Path) -> None:
    # The cases look at what fires: a threshold moved past the test's values must break them.
    changed = copy.deepcopy(rule)
    alerts_of(changed)["ShardcacheTrainersWaitingOnData"]["expr"] = alerts_of(changed)["ShardcacheTrainersWaitingOnData"]["expr"].replace("> 0.1", "> 0.5")
    write_rules(changed, tmp_path)
    shutil.copy(FIXTURES / "alerts-test.yaml", tmp_path / "alerts-test.yaml")
    done = run_promtool(promtool, "test", "rules", "alerts-test.yaml", cwd=tmp_path)
    assert done.returncode != 0 and "ShardcacheTrainersWaitingOnData" in done.stdout + done.stderr


def test_every_alert_has_a_firing_and_a_quiet_case(rule: dict[str, Any]) -> None:
    cases = yaml.safe_load((FIXTURES / "alerts-test.yaml").read_text())
    assert cases["rule_files"] == ["shardcache-rules.yaml"]
    firing: set[str] = set()
    quiet: set[str] = set()
    for test in cases["tests"]:
        for check in test.get("alert_rule_test", []):
            (firing if check.get("exp_alerts") else quiet).add(check["alertname"])
    names = set(alerts_of(rule))
    assert names - firing == set(), "alerts without a case where they fire"
    assert names - quiet == set(), "alerts without a case where they stay quiet"
    assert (firing | quiet) <= names, "cases of alerts the chart does not ship"


# ----------------------------------------------------------------------------- the PrometheusRule


def test_off_by_default(renderer: Renderer) -> None:
    objects = renderer.objects({})
    assert not [o for o in objects if o["kind"] == "PrometheusRule"]
    assert not [o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"].endswith("-dashboard")]


def test_lint_is_clean_with_alerts_and_dashboard(renderer: Renderer) -> None:
    values = with_values(prometheusRule={"labels": {"release": "prom"}, "alertLabels": {"team": "ml"}},
                         dashboard={"annotations": {"grafana_folder": "ML platform"}})
    report = renderer.helm.lint(str(CHART), values, strict=True, namespace=NS, kube_version="v1.30.0")
    assert report["errors"] == [] and report["messages"] == [], report


def test_rule_object(renderer: Renderer, rule: dict[str, Any]) -> None:
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["namespace"] == NS
    labels = rule["metadata"]["labels"]
    assert labels["app.kubernetes.io/instance"] == "sc" and labels["app.kubernetes.io/component"] == "monitoring"
    assert [g["name"] for g in rule["spec"]["groups"]] == ["shardcache-master", "shardcache-node"]
    # Exactly the rules of files/alerts.yaml, every placeholder filled in.
    assert list(alerts_of(rule)) == source_alerts()
    assert "${" not in json.dumps(rule["spec"])
    labelled = rule_object(renderer, with_values(prometheusRule={"labels": {"release": "prom"}}))
    assert labelled["metadata"]["labels"]["release"] == "prom"


def test_every_alert_is_documented_and_has_a_runbook(rule: dict[str, Any]) -> None:
    anchors = {re.sub(r"[^a-z0-9-]", "", heading.lower().replace(" ", "-"))
               for heading in re.findall(r"^#+ (.+)$", RUNBOOKS.read_text(), flags=re.M)}
    for name, alert in alerts_of(rule).items():
        assert re.fullmatch(r"Shardcache[A-Z][A-Za-z]+", name)
        assert alert["labels"]["severity"] in SEVERITIES, name
        assert re.fullmatch(r"[0-9]+[smh]", alert["for"]), name
        annotations = alert["annotations"]
        assert set(annotations) == {"summary", "description", "runbook_url"}, name
        url = annotations["runbook_url"]
        assert url == f"https://github.com/shardcache/shardcache/blob/main/docs/alerts.md#{name.lower()}"
        assert name.lower() in anchors, f"docs/alerts.md has no section {name}"
        # Each alert also in the runbooks' table, with its severity.
        assert re.search(rf"^\| {name} \| {alert['labels']['severity']} \|", RUNBOOKS.read_text(), flags=re.M), name


def test_selectors_follow_release_and_values(renderer: Renderer, rule: dict[str, Any]) -> None:
    alerts = alerts_of(rule)
    assert 'up{job="sc-shardcache-node",namespace="shardcache"} == 0' in alerts["ShardcacheNodeDaemonDown"]["expr"]
    assert 'absent(up{job="sc-shardcache-master",namespace="shardcache"})' in alerts["ShardcacheMasterDown"]["expr"]
    # The master's per-job series carry the training job in `job`: selected by namespace only.
    assert 'shardcache_master_wait_ratio{namespace="shardcache"}' in alerts["ShardcacheTrainersWaitingOnData"]["expr"]
    other = alerts_of(rule_object(renderer, with_values(prometheusRule={"nodeJob": "kubernetes-pods", "masterJob": "lease-master"})))
    assert 'up{job="kubernetes-pods",namespace="shardcache"} == 0' in other["ShardcacheNodeDaemonDown"]["expr"]
    assert 'absent(up{job="lease-master",namespace="shardcache"})' in other["ShardcacheMasterDown"]["expr"]
    elsewhere = alerts_of(find(renderer.objects(ON, namespace="ml-cache", name="cache"), "PrometheusRule"))
    assert 'up{job="cache-shardcache-node",namespace="ml-cache"} == 0' in elsewhere["ShardcacheNodeDaemonDown"]["expr"]


def test_thresholds_and_durations_are_values(renderer: Renderer, rule: dict[str, Any]) -> None:
    tuned = alerts_of(rule_object(renderer, with_values(prometheusRule={
        "waitRatio": 0.25, "originErrorRatio": 0.2, "refusedAdmissionRatio": 0.5,
        "for": {"ShardcacheTrainersWaitingOnData": "30m", "ShardcachePeerDown": "1h"},
    })))
    assert tuned["ShardcacheTrainersWaitingOnData"]["expr"].rstrip().endswith("> 0.25")
    assert "above the 0.25 threshold" in tuned["ShardcacheTrainersWaitingOnData"]["annotations"]["description"]
    assert tuned["ShardcacheOriginErrors"]["expr"].rstrip().endswith("> 0.2")
    assert tuned["ShardcacheCacheFull"]["expr"].rstrip().endswith("> 0.5")
    assert tuned["ShardcacheTenantQuotaFull"]["expr"].rstrip().endswith("> 0.5")
    assert tuned["ShardcacheTrainersWaitingOnData"]["for"] == "30m" and tuned["ShardcachePeerDown"]["for"] == "1h"
    defaults = alerts_of(rule)
    assert tuned["ShardcacheMasterDown"]["for"] == defaults["ShardcacheMasterDown"]["for"] == "5m"
    # One `for` value per alert of files/alerts.yaml, and no other.
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert list(values["metrics"]["prometheusRule"]["for"]) == source_alerts()


def test_alert_labels_are_added_severity_kept(renderer: Renderer) -> None:
    alerts = alerts_of(rule_object(renderer, with_values(prometheusRule={"alertLabels": {"team": "ml", "severity": "page"}})))
    for name, alert in alerts.items():
        assert alert["labels"]["team"] == "ml", name
        assert alert["labels"]["severity"] in SEVERITIES, name


def test_a_disabled_component_has_no_alerts(renderer: Renderer) -> None:
    only_node = rule_object(renderer, {**with_values(), "master": {"enabled": False}})
    assert [g["name"] for g in only_node["spec"]["groups"]] == ["shardcache-node"]
    only_master = rule_object(renderer, {**with_values(), "node": {"enabled": False}})
    assert [g["name"] for g in only_master["spec"]["groups"]] == ["shardcache-master"]


@pytest.mark.parametrize(
    "values, where",
    [
        ({"prometheusRule": {"waitRatio": 2}}, "/metrics/prometheusRule/waitRatio"),
        ({"prometheusRule": {"originErrorRatio": "high"}}, "/metrics/prometheusRule/originErrorRatio"),
        ({"prometheusRule": {"for": {"ShardcachePeerDown": "soon"}}}, "/metrics/prometheusRule/for/ShardcachePeerDown"),
        ({"prometheusRule": {"for": {"ShardcacheTypo": "5m"}}}, "ShardcacheTypo"),
        ({"prometheusRule": {"runbookURL": "https://example.com/runbooks#x"}}, "/metrics/prometheusRule/runbookURL"),
        ({"prometheusRule": {"labels": {"release": 1}}}, "/metrics/prometheusRule/labels/release"),
        ({"dashboard": {"label": "not a label"}}, "/metrics/dashboard/label"),
        ({"dashboard": {"labelValue": 1}}, "/metrics/dashboard/labelValue"),
        ({"dashboard": {"namespace": "Monitoring"}}, "/metrics/dashboard/namespace"),
    ],
)
def test_schema_rejects_bad_values(renderer: Renderer, values: dict[str, Any], where: str) -> None:
    with pytest.raises(renderer.helm.HelmValuesError) as info:
        renderer.files(with_values(**values))
    assert where in str(info.value)


def test_service_monitors_scrape_each_pod_once(renderer: Renderer) -> None:
    # The rules select the daemons by the headless Service's job: the ServiceMonitor must not also
    # pick FULLNAME-local, which selects the same pods (every series twice, sums doubled).
    objects = renderer.objects({"metrics": {"serviceMonitor": {"enabled": True}}})
    services = [o for o in objects if o["kind"] == "Service"]
    for monitor in (o for o in objects if o["kind"] == "ServiceMonitor"):
        selector = monitor["spec"]["selector"]
        picked = [s["metadata"]["name"] for s in services
                  if selector["matchLabels"].items() <= s["metadata"]["labels"].items()
                  and all(e["key"] not in s["metadata"]["labels"] for e in selector.get("matchExpressions", []) if e["operator"] == "DoesNotExist")]
        assert picked == [monitor["metadata"]["name"]], (monitor["metadata"]["name"], picked)
        honor = monitor["spec"]["endpoints"][0].get("honorLabels", False)
        assert honor is monitor["metadata"]["name"].endswith("-master")


# ----------------------------------------------------------------------------- the dashboard


def test_dashboard_config_map(renderer: Renderer, dashboard: dict[str, Any]) -> None:
    config_map = find(renderer.objects(ON), "ConfigMap", "-dashboard")
    validate_k8s(config_map)
    assert config_map["metadata"]["namespace"] == NS
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert list(config_map["data"]) == ["shardcache.json"]
    assert dashboard == json.loads(DASHBOARD_FILE.read_text())
    custom = find(renderer.objects(with_values(dashboard={
        "label": "grafana.example.com/dashboard", "labelValue": "shardcache", "namespace": "monitoring",
        "annotations": {"grafana_folder": "ML platform"},
    })), "ConfigMap", "-dashboard")
    validate_k8s(custom)
    assert custom["metadata"]["labels"]["grafana.example.com/dashboard"] == "shardcache"
    assert "grafana_dashboard" not in custom["metadata"]["labels"]
    assert custom["metadata"]["namespace"] == "monitoring"
    assert custom["metadata"]["annotations"] == {"grafana_folder": "ML platform"}


def panels_of(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def queries_of(dashboard: dict[str, Any]) -> list[str]:
    """Every PromQL expression of the dashboard: the panels' targets and the query variables'
    label_values() selectors."""
    exprs = [t["expr"] for p in panels_of(dashboard) for t in p.get("targets", [])]
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            match = re.fullmatch(r"label_values\((.+),\s*[a-zA-Z_][a-zA-Z0-9_]*\)", query)
            assert match, query
            exprs.append(match.group(1))
    return exprs


def test_dashboard_uses_the_datasource_variable(dashboard: dict[str, Any]) -> None:
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for name in ("namespace", "node", "job"):
        assert variables[name]["type"] == "query"
        assert variables[name]["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
    assert variables["node"]["multi"] and variables["node"]["includeAll"] and variables["node"]["allValue"] == ".*"
    assert variables["job"]["multi"] and variables["job"]["includeAll"] and variables["job"]["allValue"] == ".*"
    # No data source named or hard-coded anywhere but Grafana's built-in annotations.
    refs: list[Any] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if "datasource" in node:
                refs.append(node["datasource"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk({"panels": dashboard["panels"], "templating": [v for v in dashboard["templating"]["list"] if v["name"] != "datasource"]})
    assert refs and all(ref == {"type": "prometheus", "uid": "${datasource}"} for ref in refs), refs
    panels = [p for p in panels_of(dashboard) if p["type"] != "row"]
    assert all(p["datasource"] == {"type": "prometheus", "uid": "${datasource}"} and p["targets"] for p in panels)


def test_dashboard_layout(dashboard: dict[str, Any]) -> None:
    assert dashboard["uid"] == "shardcache" and "id" not in dashboard
    panels = panels_of(dashboard)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["w"] > 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        assert panel["title"], panel
        for target in panel.get("targets", []):
            assert target["refId"] and target["expr"].strip()
    titles = [p["title"] for p in panels]
    assert len(titles) == len(set(titles))


def test_dashboard_shows_what_the_metrics_hold(dashboard: dict[str, Any]) -> None:
    exprs = "\n".join(queries_of(dashboard))
    for needle in (
        "sum by (source) (rate(shardcache_client_bytes_total",  # bytes by source: local, peer, origin
        'source="local"',  # hit rate
        'result="hit"',
        "shardcache_fills_total",
        "histogram_quantile(0.99, sum by (le, op) (rate(shardcache_origin_request_duration_seconds_bucket",
        "shardcache_cache_evicted_bytes_total",
        "shardcache_master_wait_ratio",
        "shardcache_master_job_shards",
        "shardcache_master_job_events_total",
    ):
        assert needle in exprs, needle
    # Per node and per job: every panel query of a daemon's series follows $node, of a job's $job.
    for expr in (t["expr"] for p in panels_of(dashboard) for t in p.get("targets", [])):
        names = metric_names(expr)
        if any(not n.startswith("shardcache_master_") for n in names):
            assert 'node=~"$node"' in expr, expr
        if any(n.startswith(("shardcache_master_job_", "shardcache_master_wait_")) for n in names):
            assert 'job=~"$job"' in expr, expr
        assert 'namespace="$namespace"' in expr, expr


# ----------------------------------------------------------------------------- metric names

# Words of PromQL that look like metric names: aggregation modifiers, set operators, keywords.
PROMQL_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset", "and", "or", "unless", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """The metric names an expression selects, found by tokenizing roughly: strings, label
    matchers, ranges, label lists of by/without/on/ignoring/group_*, Grafana variables and
    numbers go; an identifier followed by '(' is a function or an aggregation."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', '""', expr)
    text = re.sub(r"\$\{[^}]*\}|\$[A-Za-z_]\w*", "", text)
    text = re.sub(r"\{[^{}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = set()
    for match in re.finditer(r"(?<![\w.])[A-Za-z_:][\w:]*", text):
        word = match.group(0)
        if word.lower() in PROMQL_KEYWORDS or text[match.end():].lstrip().startswith("("):
            continue
        names.add(word)
    return names


@pytest.mark.parametrize(
    "expr, names",
    [
        ('sum by (le, op) (rate(a_bucket{op="get", le=~"0.1|inf"}[5m])) / on(job) group_left(node) b', {"a_bucket", "b"}),
        ("max without (instance) (x offset 1h) > bool 0.5 and y unless z or up", {"x", "y", "z", "up"}),
        ('histogram_quantile(0.99, sum(rate(h_bucket{n=~"$node"}[$__rate_interval])) by (le)) * 1e3', {"h_bucket"}),
        ('absent(up{job="a b(c)"} == 1) or vector(0) - Inf + NaN', {"up"}),
        ("rate(c_total[5m:1m]) / ignoring(kind) sum(d:recorded)", {"c_total", "d:recorded"}),
    ],
)
def test_metric_names_tokenizer(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names


@dataclass
class Exported:
    daemon: set[str]
    master: set[str]
    scrapes: dict[str, str]


def exported_names(text: str) -> set[str]:
    """Sample names a Prometheus scrape of ``text`` stores: every sample line's, and those each
    ``# TYPE`` line promises (a labelled family with no child yet has no sample line)."""
    names: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(None, 3)
            base = name.removesuffix("_total")
            names |= {
                "counter": {f"{base}_total", f"{base}_created"},
                "histogram": {f"{name}_bucket", f"{name}_sum", f"{name}_count", f"{name}_created"},
                "summary": {name, f"{name}_sum", f"{name}_count", f"{name}_created"},
            }.get(kind, {name})
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{\s]", line, maxsplit=1)[0])
    return names


def _get(url: str, body: dict[str, Any] | None = None, method: str | None = None) -> tuple[int, bytes]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method or ("POST" if data else "GET"),
                                     headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _series(text: str, name: str, **labels: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name) and re.match(rf"{re.escape(name)}[{{\s]", line):
            found = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}", 1)[0] if "{" in line else ""))
            if labels.items() <= found.items():
                return float(line.rsplit(None, 1)[1])
    return None


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Exported]:
    """A real daemon (file:// origin, cluster mode with one dead peer) and a real master, some
    traffic through both (a miss, a hit, a 404; a job, a lease, a renew with a wait report, a
    completion), then their /metrics."""
    tmp = tmp_path_factory.mktemp("exporters")
    (tmp / "origin" / "bkt").mkdir(parents=True)
    (tmp / "origin" / "bkt" / "train-000000.tar").write_bytes(b"x" * 70_000)
    daemon = DaemonProcess(["--cache-dir", str(tmp / "cache"), "--cache-size", "1GiB", "--min-free", "0%",
                            "--origin", f"file://{tmp / 'origin'}", "--node", "node-a"], tmp / "daemon.log", ready_path="/healthz")
    daemon.args += ["--advertise-url", daemon.url, "--peer", f"http://127.0.0.1:{free_port()}"]
    master = MasterProcess(tmp, f"sqlite://{tmp / 'master.db'}", advertise=False)
    master.ready_path = "/healthz"
    servers = [daemon, master]
    daemon_url, master_url = daemon.url, master.url
    try:
        for server in servers:  # both at once, then each waited for
            server.launch()
        for server in servers:
            server.wait_ready()
        # The peer never answers: once the daemon counts it dead its reads stay local.
        wait_until(lambda: _series(_get(daemon_url + "/metrics")[1].decode(), "shardcache_cluster_members", state="dead") == 1,
                   timeout=30, what="the dead peer counted")
        assert _get(daemon_url + "/bkt/train-000000.tar")[0] == 200  # miss: filled from the origin
        # Once published (a read meanwhile would join the fill: coalesced), a read is a hit.
        wait_until(lambda: _series(_get(daemon_url + "/metrics")[1].decode(), "shardcache_cache_admitted_total") == 1,
                   timeout=30, what="the fill published")
        assert _get(daemon_url + "/bkt/train-000000.tar")[0] == 200
        assert _get(daemon_url + "/bkt/missing.tar")[0] == 404
        job = {"name": "resnet50", "dataset": f"file://{tmp / 'origin'}/bkt/", "locality_window": 4,
               "shards": [{"key": "train-000000.tar", "size": 70_000, "samples": 10}, {"key": "train-000001.tar", "size": 70_000, "samples": 10}]}
        assert _get(master_url + "/v1/jobs", job)[0] == 201
        status, body = _get(master_url + "/v1/jobs/resnet50/leases", {"trainer": "t1", "node": "node-a", "count": 1})
        assert status == 200, body
        lease = json.loads(body)["leases"][0]["lease"]
        wait = {"seconds": 2.0, "steps": 10, "elapsed_s": 5.0, "buckets": [5, 1, 1, 1, 1, 0, 0, 1, 0]}
        assert _get(f"{master_url}/v1/jobs/resnet50/leases/{lease}/renew", {"trainer": "t1", "offset": 5, "wait": wait})[0] == 200
        assert _get(f"{master_url}/v1/jobs/resnet50/leases/{lease}/complete", {"trainer": "t1"})[0] == 200
        scrapes = {"daemon": _get(daemon_url + "/metrics")[1].decode(), "master": _get(master_url + "/metrics")[1].decode()}
        yield Exported(exported_names(scrapes["daemon"]), exported_names(scrapes["master"]), scrapes)
    finally:
        for server in servers:
            server.stop()


def test_the_exporters_count_what_the_alerts_read(exported: Exported) -> None:
    # Not only the names: the series the alerts and panels divide mean what they assume.
    daemon, master = exported.scrapes["daemon"], exported.scrapes["master"]
    assert _series(daemon, "shardcache_cluster_members", state="dead") == 1
    assert _series(daemon, "shardcache_cluster_peer_links_open") == 1  # started without --peer-secret-file
    assert _series(daemon, "shardcache_client_bytes_total", source="local") == 70_000
    assert _series(daemon, "shardcache_client_bytes_total", source="origin") == 70_000
    assert _series(daemon, "shardcache_cache_admitted_total") == 1
    assert _series(daemon, "shardcache_cache_rejected_full_total") == 0
    assert _series(daemon, "shardcache_origin_request_duration_seconds_count", op="get") == 1
    assert _series(daemon, "shardcache_cache_lookups_total", result="hit") == 1
    assert _series(master, "shardcache_master_wait_ratio", job="resnet50") == pytest.approx(0.4)  # 2 s of 5 s
    assert _series(master, "shardcache_master_wait_seconds_count", job="resnet50") == 10
    assert _series(master, "shardcache_master_job_shards", job="resnet50", state="done") == 1
    assert _series(master, "shardcache_master_leader") == 1


def test_alerts_use_only_exported_metric_names(rule: dict[str, Any], exported: Exported) -> None:
    known = {"shardcache-node": exported.daemon | {"up"}, "shardcache-master": exported.master | {"up"}}
    for group in rule["spec"]["groups"]:
        for alert in group["rules"]:
            names = metric_names(alert["expr"])
            assert names, alert["alert"]
            unknown = names - known[group["name"]]
            assert not unknown, f"{alert['alert']} reads {sorted(unknown)}, which the {group['name'].split('-')[1]} does not export"
            # The annotations name the metrics they explain: those must be real too.
            for text in alert["annotations"].values():
                for name in re.findall(r"\bshardcache_[a-z_]+", text):
                    assert name in known[group["name"]], f"{alert['alert']} annotations name {name}"


def test_dashboard_uses_only_exported_metric_names(dashboard: dict[str, Any], exported: Exported) -> None:
    known = exported.daemon | exported.master
    seen: set[str] = set()
    for expr in queries_of(dashboard):
        names = metric_names(expr)
        assert names, expr
        assert names <= known, f"{sorted(names - known)} in {expr}"
        seen |= names
    # The panels cover both exporters.
    assert seen & exported.daemon and seen & exported.master


def test_a_renamed_metric_is_caught(rule: dict[str, Any], exported: Exported) -> None:
    renamed = alerts_of(rule)["ShardcacheCacheFull"]["expr"].replace("shardcache_cache_rejected_full_total", "shardcache_cache_refused_total")
    assert metric_names(renamed) - exported.daemon == {"shardcache_cache_refused_total"}
