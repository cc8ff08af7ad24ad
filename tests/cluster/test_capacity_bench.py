"""``python -m bench.capacity_bench``: the bound it reports beside the figures, and ``--quick`` end
to end on the test bed (root): a dataset twice the cluster cache, real trainers of one job on two
nodes, daemons reporting to the master and taking its plan; every sample delivered exactly once
per epoch (the bench fails otherwise), the master's per-node cache view filled from the reports,
and the daemons' plan prefetches counted for the job."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.capacity_bench import MODES, bound, markdown_table
from bench.clusterbed import ClusterUnavailable, LinkMeter, check_available
from tests.support.processes import REPO


def test_the_link_meter_spreads_the_links_bytes_over_the_parts_of_an_epoch(tmp_path: Path) -> None:
    log = tmp_path / "link.log"
    # 1 MB/s for 5 s, idle for 5 s, sampled every 0.5 s (and a torn last line, as a live log has)
    lines = [f"{t / 2:.4f} {min(t, 10) * 500_000}" for t in range(21)]
    log.write_text("\n".join(lines) + "\n20.5 99")
    meter = LinkMeter(log)
    assert len(meter.samples()) == 21 and meter.samples()[-1] == (10.0, 5_000_000)
    assert meter.busy_by_part(0.0, 10.0, capacity_bytes_s=1_000_000, parts=10) == [1.0] * 5 + [0.0] * 5
    assert meter.busy_by_part(0.0, 10.0, capacity_bytes_s=2_000_000, parts=2) == [0.5, 0.0]
    assert meter.busy_by_part(2.25, 2.75, capacity_bytes_s=1_000_000, parts=1) == [1.0]  # between samples
    assert meter.busy_by_part(-1.0, 5.0, capacity_bytes_s=1_000_000) is None  # began before the first sample
    assert meter.busy_by_part(0.0, 30.0, capacity_bytes_s=1_000_000) is None  # ends after the last one
    assert LinkMeter(tmp_path / "none.log").busy_by_part(0.0, 1.0, 1.0) is None
    with log.open("a") as handle:  # the torn line completed: read then, with only what came since
        handle.write("9\n")
    assert len(meter.samples()) == 22 and meter.samples()[-1] == (20.5, 999)


def test_the_bound_is_what_the_caches_cannot_hold() -> None:
    assert bound(50, 100) == 0.5 and bound(100, 100) == 0.0 and bound(300, 100) == 0.0
    assert {m.policy for m in MODES.values()} == {"lru", "hold", "planned"}
    assert {m.peers for m in MODES.values()} == {False, True}


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_the_quick_capacity_bench_runs_with_the_masters_plan(tmp_path: Path) -> None:
    try:
        check_available()
    except ClusterUnavailable as exc:
        pytest.skip(str(exc))
    out = tmp_path / "capacity.json"
    done = subprocess.run([sys.executable, "-m", "bench.capacity_bench", "--quick", "--modes", "cluster_lru,cluster_planned",
                           "--out", str(out), "--workdir", str(tmp_path / "work"), "--screenshot", str(tmp_path / "page.png")],
                          cwd=REPO, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(out.read_text())
    assert "| caches, policy | epoch |" in done.stdout and out.with_suffix(".png").stat().st_size > 0
    assert markdown_table(results).startswith("2 nodes")
    setup, modes = results["setup"], results["modes"]
    assert setup["nodes"] == 2 and setup["trainers"] == 4 and setup["dataset_over_cache"] == 2
    for name, mode in modes.items():
        assert mode["bound"] == pytest.approx(0.5, abs=0.01)  # the cluster cache holds half the dataset
        for ep in mode["epochs"]:
            check = ep["check"]  # every sample's bytes checked, each delivered once per epoch
            assert check["samples"] == check["expected"] == setup["samples"], (name, check)
            assert check["bad_bytes"] == check["missing"] == check["duplicated"] == 0, (name, check)
            assert ep["locality"]["window"] == 16 and ep["locality"]["order"]["max_displacement"] < 16 * 4
            assert ep["origin_over_link"] > 0  # origin bytes over what the capped link carries in the epoch
            tenths = ep["link_by_tenth"]  # the same per tenth of the epoch, from the origin's own counter
            assert len(tenths) == 10 and all(0 <= t < 1.5 for t in tenths), (name, ep["epoch"], tenths)
        assert max(mode["epochs"][0]["link_by_tenth"]) > 0.3, mode["epochs"][0]  # the cold epoch fills over the link
    owned = modes["cluster_planned"]["owned_shards"]  # the cluster cache's owners, as the daemons route
    assert set(owned) == {"node0", "node1"} and sum(owned.values()) == setup["shards"]
    assert "shards each node owns" in markdown_table(results)
    planned = modes["cluster_planned"]["epochs"][-1]["cache_view"]
    assert planned["reporting_nodes"] == 2
    assert planned["totals"]["reads"] > 0 and planned["totals"]["hit_bytes"] + planned["totals"]["origin_bytes"] > 0
    assert planned["totals"]["prefetch_bytes"] > 0  # the plan's prefetches, counted for the job
    for ep in modes["cluster_planned"]["epochs"]:  # the daemons' own account of the plan's fills
        assert ep["fills"] > 0 and ep["unread_hint_over_dataset"] >= 0 and ep["unread_plan_over_dataset"] >= 0
    # Over the run, not in the cold epoch: that one lasts ~1.5 s here, and its caches are full of the
    # readers' own fills and hints, which a plan fill may not take (its shards are needed later), so
    # on a loaded machine both nodes can refuse every plan fill of it (CI, stop 44).
    assert sum(ep["plan_filled_over_dataset"] for ep in modes["cluster_planned"]["epochs"]) > 0
    after_first = modes["cluster_planned"]["epochs"][0]["cache_view"]  # the last epoch is still to come: planned
    assert len(after_first["nodes"]) == 2 and all(node["planned_shards"] > 0 for node in after_first["nodes"])
    assert modes["cluster_lru"]["epochs"][-1]["cache_view"]["reporting_nodes"] == 0  # no --master: no reports
    # The status page, taken between the last two epochs (when the plans are live), when there is
    # a chromium to take it; the log says which.
    if "no screenshot: chromium is not installed" not in done.stderr:
        assert (tmp_path / "page.png").read_bytes().startswith(b"\x89PNG"), done.stderr[-2000:]
        log = done.stderr + done.stdout
        assert log.index("screenshot of") < log.index("cluster_planned    epoch 2:"), log[-3000:]
