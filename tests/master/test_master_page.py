"""The master's status page (``GET /``) in a real headless browser: Debian's ``chromium``, driven
over its DevTools protocol (aiohttp's websocket client: nothing more to install), against a real
``shardcache master`` process whose job is driven by the real client.

The page loads, shows a running job's trainers with their leases, updates as the epoch advances
(leases completed from the test: the progress changes within the page's 2 s refresh), shows a
failed shard, renders a hostile trainer name as text, and with ``--token-file`` asks for the token,
refuses a wrong one and then shows the job. ``STATUS_PAGE_SCREENSHOT=path`` also saves the
screenshot of the running job there (how docs/status-page.png is made).

The Cache panel (a job's ``cache`` section, which the master sums from node daemons' reports) is
checked with sections the test adds to the real master's ``GET /v1/jobs`` answers in the browser,
at the page's ``fetch`` (:data:`_INJECT_CACHE`), for the shapes a real master makes only with many
daemons reporting, or not at all: nodes worst first, null and missing figures, no section (an
older master), a job on 2,000 nodes in a scrolling table that keeps its place across refreshes.
``STATUS_PAGE_CACHE_SCREENSHOT=path`` saves that job's screenshot there
(docs/status-page-cache.png). Where the master takes node reports itself
(``POST /v1/nodes/{node}/report``), a report posted to it shows in the panel with nothing added."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import threading
import time
import urllib.request
from array import array
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from loader.master.client import MasterClient
from tests.support.masters import MasterProcess, http, job_spec
from tests.support.processes import spawn, stop
from tests.support.waits import wait_until
from wire.nodeplan import NodeReport

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [pytest.mark.slow,
    pytest.mark.skipif(CHROMIUM is None, reason="chromium is missing: scripts/test.sh installs Debian's `chromium` "
                       "(apt-get install chromium); the status page test needs a real browser"),
    pytest.mark.timeout(60),
]

TOKEN = "page-token-0123456789abcdef"
# Job and trainer names are user input: the page must show this as text, never as markup.
HOSTILE = '<img src=x onerror="window.pwned=1">'


class Tab:
    """One browser tab over the DevTools protocol, on an event loop of its own thread (the test
    itself stays synchronous and blocking, as the master client is)."""

    def __init__(self, ws_url: str) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="cdp", daemon=True)
        self._thread.start()
        self._id = 0
        self.events: list[dict[str, Any]] = []
        self._run(self._connect(ws_url))
        self.send("Runtime.enable")  # uncaught exceptions and console errors land in self.events
        self.send("Log.enable")  # CSP violations among them

    def _run(self, coro: Any, timeout: float = 20.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _connect(self, ws_url: str) -> None:
        self._session = aiohttp.ClientSession()
        self._ws = await self._session.ws_connect(ws_url, max_msg_size=0)

    async def _send(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        self._id += 1
        await self._ws.send_json({"id": self._id, "method": method, "params": params})
        while True:
            msg = await self._ws.receive_json()
            if msg.get("id") == self._id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return dict(msg.get("result", {}))
            if "method" in msg:
                self.events.append(msg)

    def send(self, method: str, **params: Any) -> dict[str, Any]:
        result: dict[str, Any] = self._run(self._send(method, params))
        return result

    def evaluate(self, expression: str) -> Any:
        result = self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, what: str, timeout: float = 15.0) -> Any:
        """Poll ``expression`` until it is truthy; on timeout, fail with what the page shows."""
        deadline = time.monotonic() + timeout
        # An element found is "true" (returnByValue would turn it into an empty, falsy, object).
        check = f"(() => {{ const v = ({expression}); return v instanceof Node ? true : v; }})()"
        while time.monotonic() < deadline:
            value = self.evaluate(check)
            if value:
                return value
            time.sleep(0.1)
        text = self.evaluate("document.body ? document.body.innerText : ''")
        raise AssertionError(f"the page did not show {what} within {timeout:g} s; it shows:\n{text[:3000]}")

    def navigate(self, url: str) -> None:
        self.send("Page.navigate", url=url)
        self.wait_for("document.readyState === 'complete'", "a loaded document")

    def errors(self) -> list[str]:
        """Uncaught exceptions and error log entries, but the network's own (the 401 the page gets
        before it has a token is logged by the browser as a failed load)."""
        out = []
        for event in self.events:
            if event["method"] == "Runtime.exceptionThrown":
                out.append(json.dumps(event["params"]["exceptionDetails"])[:500])
            elif event["method"] == "Log.entryAdded":
                entry = event["params"]["entry"]
                if entry["level"] == "error" and entry.get("source") != "network":
                    out.append(f"{entry.get('source')}: {entry.get('text')}")
        return out

    def screenshot(self, path: Path) -> bytes:
        height = int(self.evaluate("Math.ceil(document.querySelector('footer').getBoundingClientRect().bottom) + 16"))
        self.send("Emulation.setDeviceMetricsOverride", width=1200, height=min(max(height, 400), 2000),
                  deviceScaleFactor=1, mobile=False)
        png = base64.b64decode(self.send("Page.captureScreenshot", format="png")["data"])
        path.write_bytes(png)
        return png

    def close(self) -> None:
        async def shut() -> None:
            await self._ws.close()
            await self._session.close()

        try:
            self._run(shut(), timeout=5)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
            self._loop.close()


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[str]:
    """A headless chromium with its DevTools endpoint on a free port: yields its HTTP address."""
    profile = tmp_path / "chromium-profile"
    assert CHROMIUM is not None
    proc = spawn(
        [
            CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
            "--no-first-run", "--no-default-browser-check", "--disable-extensions", "--disable-background-networking",
            "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0", "--remote-allow-origins=*",
            f"--user-data-dir={profile}", "--window-size=1200,900", "about:blank",
        ],
        tmp_path / "chromium.log",
    )
    active = profile / "DevToolsActivePort"  # chromium writes its chosen port here once it listens

    def listening() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"chromium exited with {proc.returncode}:\n{(tmp_path / 'chromium.log').read_text()[-3000:]}")
        return active.exists() and active.read_text().strip() != ""

    try:
        wait_until(listening, timeout=20, what="chromium's DevTools endpoint")
        yield f"http://127.0.0.1:{active.read_text().split()[0]}"
    finally:
        stop(proc)


@pytest.fixture
def tab(browser: str) -> Iterator[Tab]:
    with urllib.request.urlopen(browser + "/json/list", timeout=5) as resp:
        targets = json.loads(resp.read())
    page = next(t for t in targets if t.get("type") == "page")
    opened = Tab(page["webSocketDebuggerUrl"])
    try:
        yield opened
    finally:
        opened.close()


def _master(tmp_path: Path, *args: str) -> MasterProcess:
    return MasterProcess(tmp_path, f"sqlite://{tmp_path}/master.db", *args)


def _epoch_done(tab: Tab, job: str, epoch: int) -> int:
    value = tab.evaluate(
        f"(() => {{ const e = document.querySelector('[data-job={json.dumps(job)}] [data-epoch=\"{epoch}\"]');"
        " return e ? Number(e.dataset.done) : -1; })()"
    )
    return int(value)


def _report_wait(master: MasterProcess, job: str, trainer: str, seconds: float, elapsed_s: float,
                 buckets: list[int]) -> None:
    """A trainer's wait report as it goes on the wire (``POST /v1/jobs/{job}/wait``, wire/stall.py)."""
    wait = {"seconds": seconds, "steps": sum(buckets), "elapsed_s": elapsed_s, "buckets": buckets}
    status, body = http("POST", f"{master.url}/v1/jobs/{job}/wait", {"trainer": trainer, "wait": wait})
    assert status == 204, (status, body)


def test_the_page_shows_a_running_jobs_trainers_and_follows_the_epoch(tmp_path: Path, tab: Tab) -> None:
    master = _master(tmp_path).start()
    client = MasterClient(master.url, retry_deadline_s=10)
    try:
        client.create_job(job_spec("resnet50", n=16, epochs=2, max_failures=1, locality_window=8))
        t1 = client.lease("resnet50", "trainer-1", "node-a", 3, epoch=0, stream="w0")["leases"]
        t2 = client.lease("resnet50", "trainer-2", "node-b", 2, epoch=0)["leases"]
        client.renew("resnet50", t1[0]["lease"], "trainer-1", 4)

        tab.navigate(master.url + "/")
        tab.wait_for("document.querySelector('[data-trainer=\"trainer-1\"][data-leases=\"3\"]')", "trainer-1 with 3 leases")
        row = tab.evaluate("document.querySelector('[data-trainer=\"trainer-1\"]').innerText")
        assert "node-a" in row and "w0: 3" in row, row
        assert tab.evaluate("document.querySelector('[data-trainer=\"trainer-2\"]').dataset.leases") == "2"
        # No wait reported yet: "–", not a made-up 0 %.
        wait_cell = "document.querySelector('[data-trainer=\"trainer-1\"] .trainer-wait').textContent"
        assert tab.evaluate(wait_cell) == "–"
        assert _epoch_done(tab, "resnet50", 0) == 0
        # Cache-aware leases: no ring and no reads yet, so nothing is placed (not a made-up 0 %).
        locality = tab.evaluate("document.querySelector('[data-job=\"resnet50\"] .job-locality').textContent")
        assert locality == "local leases – (window 8, 0 nodes) · order moved 0.0 positions (ρ 1.000)", locality

        # The epoch advances: completions and a failed shard show within the page's refresh.
        for lease in t1:
            client.complete("resnet50", lease["lease"], "trainer-1")
        assert client.fail("resnet50", t2[0]["lease"], "trainer-2", "read timed out after 30 s") == "failed"
        tab.wait_for("(() => { const e = document.querySelector('[data-job=\"resnet50\"] [data-epoch=\"0\"]');"
                     " return e && e.dataset.done === '3'; })()", "3 shards done in epoch 0")
        tab.wait_for("document.querySelector('[data-trainer=\"trainer-1\"][data-leases=\"0\"]')", "trainer-1 with no lease")
        failed = tab.wait_for("[...document.querySelectorAll('.failed-shard')].map(r => r.innerText).join('\\n')",
                              "the failed shard")
        assert "read timed out after 30 s" in failed and "train-" in failed, failed
        counts = tab.evaluate("document.querySelector('[data-epoch=\"0\"] .epoch-counts').textContent")
        assert counts.startswith("3/16 done · 1 failed"), counts

        # Wait reports (trainer-1 waited 30% of its last 20 s, trainer-2 2%): the fractions, and the
        # job's warning past 10%.
        _report_wait(master, "resnet50", "trainer-1", 6.0, 20.0, [120, 40, 10, 10, 8, 8, 4, 0, 0])
        _report_wait(master, "resnet50", "trainer-2", 0.4, 20.0, [280, 15, 5, 0, 0, 0, 0, 0, 0])
        tab.wait_for(f"{wait_cell} === '30.0 %'", "trainer-1's wait fraction")
        assert tab.evaluate("document.querySelector('[data-trainer=\"trainer-2\"] .trainer-wait').textContent") == "2.0 %"
        warning = tab.wait_for("document.querySelector('[data-job=\"resnet50\"] .badge.warn')?.textContent", "the warning")
        assert "16.0 %" in warning, warning

        # More of the epoch, for the screenshot: a running job mid-epoch, a trainer per node.
        for lease in client.lease("resnet50", "trainer-1", "node-a", 4, epoch=0, stream="w1")["leases"]:
            client.complete("resnet50", lease["lease"], "trainer-1")
        client.lease("resnet50", "trainer-1", "node-a", 2, epoch=0, stream="w0")
        client.lease("resnet50", "trainer-1", "node-a", 1, epoch=0, stream="w1")
        client.lease("resnet50", "trainer-3", "node-c", 2, epoch=0, stream="w0")
        _report_wait(master, "resnet50", "trainer-3", 0.9, 20.0, [150, 60, 20, 8, 2, 0, 0, 0, 0])
        tab.wait_for("(() => { const e = document.querySelector('[data-epoch=\"0\"]'); return e && e.dataset.done === '7'; })()",
                     "7 shards done in epoch 0")
        tab.wait_for("document.querySelector('[data-trainer=\"trainer-3\"] .trainer-wait').textContent === '4.5 %'",
                     "trainer-3's wait")
        png = tab.screenshot(tmp_path / "status-page.png")
        assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000
        target = os.environ.get("STATUS_PAGE_SCREENSHOT")
        if target:
            Path(target).write_bytes(png)
        assert not tab.errors(), tab.errors()
    finally:
        client.close()
        master.stop()


def test_with_a_token_file_the_page_asks_for_the_token_once(tmp_path: Path, tab: Tab) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    master = _master(tmp_path, "--token-file", str(token_file)).start()
    client = MasterClient(master.url, retry_deadline_s=10, token=TOKEN)
    try:
        # The page itself holds no data and is served without the token; the API is not.
        status, body = http("GET", master.url + "/")
        assert status == 200 and "<form" in body, body
        assert http("GET", master.url + "/page/page.js")[0] == 200
        assert http("GET", master.url + "/v1/jobs")[0] == 401
        assert http("POST", master.url + "/", {})[0] == 401  # only GET/HEAD of the page's files are open
        client.create_job(job_spec("secured", n=4))
        client.lease("secured", "trainer-9", "node-z", 1)
        client.lease("secured", HOSTILE, HOSTILE, 1)

        tab.navigate(master.url + "/")
        tab.wait_for("!document.getElementById('token-form').hidden", "the token form")
        assert tab.evaluate("document.querySelectorAll('[data-job]').length") == 0

        def submit(token: str) -> None:
            tab.evaluate(f"document.getElementById('token').value = {json.dumps(token)};"
                         "document.getElementById('token-form').requestSubmit()")

        submit("wrong-token")
        tab.wait_for("document.getElementById('token-error').textContent.includes('refused')", "the refusal")
        submit(TOKEN)
        tab.wait_for("document.querySelector('[data-job=\"secured\"] [data-trainer=\"trainer-9\"]')", "the job's trainer")
        assert tab.evaluate("document.getElementById('token-form').hidden") is True
        # The hostile name is shown as text: no element was made from it, no script ran.
        names = tab.evaluate("[...document.querySelectorAll('.trainer-name')].map(n => n.textContent)")
        assert HOSTILE in names, names
        assert tab.evaluate("document.querySelectorAll('main img').length") == 0
        assert tab.evaluate("window.pwned === undefined") is True
        # Asked once: a reload in the same tab (browser session) uses the kept token.
        tab.navigate(master.url + "/")
        tab.wait_for("document.querySelector('[data-job=\"secured\"]')", "the job after a reload")
        assert tab.evaluate("document.getElementById('token-form').hidden") is True
        assert not tab.errors(), tab.errors()
    finally:
        client.close()
        master.stop()


def test_a_tenants_page_shows_its_own_jobs_only(tmp_path: Path, tab: Tab) -> None:
    """With ``--tenant-tokens`` the page, fed the token of tenant B, shows B's job and not A's."""
    (tmp_path / "operator").write_text(TOKEN)
    tenants = tmp_path / "tenants"
    tenants.mkdir()
    (tenants / "team-a").write_text("team-a-page-token-0123456789")
    (tenants / "team-b").write_text("team-b-page-token-0123456789")
    master = _master(tmp_path, "--token-file", str(tmp_path / "operator"), "--tenant-tokens", str(tenants)).start()
    try:
        for tenant, job in (("team-a", "a-secret-job"), ("team-b", "b-job")):
            with MasterClient(master.url, retry_deadline_s=10, token=(tenants / tenant).read_text()) as client:
                client.create_job(job_spec(job, n=4))
                client.lease(job, f"{tenant}-trainer", "node-x", 1)
        tab.navigate(master.url + "/")
        tab.wait_for("!document.getElementById('token-form').hidden", "the token form")
        tab.evaluate(f"sessionStorage.clear(); document.getElementById('token').value = "
                     f"{json.dumps((tenants / 'team-b').read_text())}; document.getElementById('token-form').requestSubmit()")
        tab.wait_for("document.querySelector('[data-job=\"b-job\"] [data-trainer=\"team-b-trainer\"]')", "B's job")
        shown = tab.evaluate("[...document.querySelectorAll('[data-job]')].map(e => e.dataset.job)")
        assert set(shown) == {"b-job"}, shown
        assert "a-secret-job" not in tab.evaluate("document.body.innerText")
        assert not tab.errors(), tab.errors()
    finally:
        tab.evaluate("sessionStorage.clear()")
        master.stop()


def test_the_page_is_served_with_a_strict_policy(tmp_path: Path) -> None:
    master = _master(tmp_path).start()
    try:
        req = urllib.request.Request(master.url + "/")
        with urllib.request.urlopen(req, timeout=5) as resp:
            csp = resp.headers["Content-Security-Policy"]
            assert resp.headers["Content-Type"].startswith("text/html")
        assert "script-src 'self'" in csp and "default-src 'none'" in csp, csp
        with urllib.request.urlopen(master.url + "/page/page.css", timeout=5) as resp:
            assert resp.headers["Content-Type"].startswith("text/css")
    finally:
        master.stop()


# -- the Cache panel -------------------------------------------------------------------------------

# Runs in the tab before the page's own script (Page.addScriptToEvaluateOnNewDocument, which the
# page's CSP does not apply to): the real master's answers to GET v1/jobs, with the cache section
# of each job named in window.__cacheSections set to the test's (null: none, as from a master older
# than the section). Counts those answers, so a test can wait for the page's next refresh.
_INJECT_CACHE = """
(() => {
  window.__cacheSections = %s;
  window.__jobFetches = 0;
  const realFetch = window.fetch.bind(window);
  window.fetch = async (input, init) => {
    const resp = await realFetch(input, init);
    if (new URL(String(input), location.href).pathname !== "/v1/jobs" || !resp.ok) return resp;
    const body = await resp.json();
    for (const job of body.jobs || []) {
      if (!Object.hasOwn(window.__cacheSections, job.name)) continue;
      const section = window.__cacheSections[job.name];
      if (section === null) delete job.cache; else job.cache = section;  // null: as from a master before it
    }
    window.__jobFetches += 1;
    return new Response(JSON.stringify(body), { status: resp.status, headers: resp.headers });
  };
})();
"""

GiB = 1 << 30


def _cache_node(node: str, **figures: Any) -> dict[str, Any]:
    """One node of a cache section, as the master's job status gives it; ``figures`` override."""
    row = {"node": node, "report_age_s": 1.2, "trainers": 2, "reads": 10, "hit_bytes": 1000, "origin_bytes": 100,
           "peer_bytes": 0, "prefetch_bytes": 500, "hit_rate": 0.909, "held_shards": 12, "planned_shards": 20,
           "prefetch_lead_shards": 5, "wait_fraction": 0.01}
    row.update(figures)
    return row


def _cache_section(nodes: list[dict[str, Any]], **totals: Any) -> dict[str, Any]:
    base = {"reads": 0, "hit_bytes": 0, "origin_bytes": 0, "peer_bytes": 0, "prefetch_bytes": 0, "hit_rate": None}
    return {"reporting_nodes": len(nodes), "totals": {**base, **totals}, "nodes": nodes, "nodes_omitted": 0}


def _inject_cache(tab: Tab, sections: dict[str, Any]) -> None:
    """Add ``sections`` to the master's answers in the documents ``tab`` loads from now on."""
    tab.send("Page.enable")  # without it, chromium keeps the script but runs it in no document
    tab.send("Page.addScriptToEvaluateOnNewDocument", source=_INJECT_CACHE % json.dumps(sections))


def _set_cache(tab: Tab, job: str, section: Any) -> None:
    tab.evaluate(f"window.__cacheSections[{json.dumps(job)}] = {json.dumps(section)}; true")


def _next_refresh(tab: Tab) -> None:
    """Wait until the page has rendered an answer fetched after now (two answers on: the one in
    flight may predate the change)."""
    seen = int(tab.evaluate("window.__jobFetches"))
    tab.wait_for(f"window.__jobFetches >= {seen + 2}", "the page's next refresh", timeout=10)
    tab.wait_for("document.readyState === 'complete'", "a rendered page")


def _cache_rows(tab: Tab, job: str) -> list[list[str]]:
    return list(tab.evaluate(
        f"[...document.querySelectorAll('[data-job={json.dumps(job)}] .cache-node')]"
        ".map(r => [...r.cells].map(c => c.textContent))"
    ))


def _panel_text(tab: Tab, job: str, part: str) -> Any:
    return tab.evaluate(f"document.querySelector('[data-job={json.dumps(job)}] .cache {part}')?.textContent ?? null")


def test_the_cache_panel_shows_each_jobs_nodes_worst_first_and_follows_the_refresh(tmp_path: Path, tab: Tab) -> None:
    master = _master(tmp_path).start()
    client = MasterClient(master.url, retry_deadline_s=10)
    try:
        for name in ("resnet50", "older", "quiet"):
            client.create_job(job_spec(name, n=16))
        client.lease("resnet50", "trainer-1", "node-a", 2)
        client.lease("resnet50", "trainer-2", "node-b", 2)
        _report_wait(master, "resnet50", "trainer-1", 6.0, 20.0, [120, 40, 10, 10, 8, 8, 4, 0, 0])  # 30 % waited
        nodes = [
            _cache_node("node-a", hit_rate=0.2, wait_fraction=0.3, origin_bytes=3 * GiB, prefetch_bytes=None,
                        prefetch_lead_shards=2, fetching_through=True),  # its plans fetch through: marked
            _cache_node("node-b"),  # the example's figures
            _cache_node("node-c", hit_rate=None, wait_fraction=None, trainers=0, reads=0, report_age_s=125.0,
                        held_shards=None),
            _cache_node(HOSTILE, hit_rate=0.5, wait_fraction=0.01),
        ]
        # "older" has no section (a master before it); "quiet" one with no report yet.
        _inject_cache(tab, {
            "older": None,
            "resnet50": _cache_section(nodes, reads=20, hit_bytes=2000, origin_bytes=3 * GiB + 200, prefetch_bytes=500,
                                       hit_rate=0.2),
            "quiet": _cache_section([]),
        })
        tab.navigate(master.url + "/")
        tab.wait_for("document.querySelector('[data-job=\"resnet50\"] .cache-node')", "the Cache panel's nodes")

        assert _panel_text(tab, "resnet50", "h3") == "Cache (4 nodes reporting)"
        assert _panel_text(tab, "resnet50", ".cache-totals") == \
            "hit rate 20.0 % · origin 3.0 GiB · peer 0 B · prefetched 500 B · 20 reads"
        heads = tab.evaluate("[...document.querySelectorAll('[data-job=\"resnet50\"] .cache th')].map(h => h.textContent)")
        assert heads == ["node", "trainers", "hit rate", "origin", "peer", "prefetched", "held / planned", "prefetch lead",
                         "wait", "report age"]
        # Worst first: the most waited, then (same wait) the lowest hit rate; unknown figures last.
        assert _cache_rows(tab, "resnet50") == [
            ["node-a", "2", "20.0 %", "3.0 GiB", "0 B", "–", "12 / 20", "2 · through", "30.0 %", "1.2 s ago"],
            [HOSTILE, "2", "50.0 %", "100 B", "0 B", "500 B", "12 / 20", "5", "1.0 %", "1.2 s ago"],
            ["node-b", "2", "90.9 %", "100 B", "0 B", "500 B", "12 / 20", "5", "1.0 %", "1.2 s ago"],
            ["node-c", "0", "–", "100 B", "0 B", "500 B", "– / 20", "5", "–", "125.0 s ago"],
        ]
        titles = tab.evaluate("[...document.querySelectorAll('[data-job=\"resnet50\"] .cache-lead')].map(c => c.title)")
        assert titles[0].startswith("fetching through:") and titles[1:] == ["", "", ""], titles
        # The figures past the thresholds stand out; the job's head says why its trainers wait.
        flagged = tab.evaluate("[...document.querySelectorAll('[data-job=\"resnet50\"] td.alert')].map(c => c.textContent)")
        assert flagged == ["20.0 %", "30.0 %"], flagged
        badge = tab.evaluate("document.querySelector('[data-job=\"resnet50\"] .cache-warn')?.textContent")
        assert badge == "cache hit rate 20.0 % while trainers wait", badge
        assert tab.evaluate("document.querySelectorAll('main img').length") == 0  # the hostile name is text
        assert tab.evaluate("document.querySelector('[data-job=\"older\"] .cache')") is None
        assert _panel_text(tab, "quiet", "h3") == "Cache (0 nodes reporting)"
        assert _panel_text(tab, "quiet", ".cache-totals").startswith("no node reports yet")
        assert tab.evaluate("document.querySelector('[data-job=\"quiet\"] .cache-warn')") is None

        # The panel follows the page's refresh: a new section, and fields a report may leave out.
        _set_cache(tab, "resnet50", {"reporting_nodes": 1, "totals": {"hit_rate": 0.95, "origin_bytes": 5 * GiB},
                                     "nodes": [{"node": "node-a"}]})
        tab.wait_for("document.querySelector('[data-job=\"resnet50\"] .cache-totals').textContent.startsWith('hit rate 95.0 %')",
                     "the refreshed totals")
        assert _panel_text(tab, "resnet50", ".cache-totals") == "hit rate 95.0 % · origin 5.0 GiB · peer – · prefetched – · – reads"
        assert _cache_rows(tab, "resnet50") == [["node-a", "–", "–", "–", "–", "–", "– / –", "–", "–", "–"]]
        assert tab.evaluate("document.querySelector('[data-job=\"resnet50\"] .cache-warn')") is None

        # A job on 2,000 nodes: all of them, worst first, in a box that scrolls and keeps its place
        # across the page's refreshes (each rebuilds the jobs).
        many = [_cache_node(f"node-{i:04d}", wait_fraction=(i % 100) / 1000, hit_rate=0.5 + (i % 7) / 20) for i in range(2000)]
        _set_cache(tab, "resnet50", {**_cache_section(many, hit_rate=0.6, origin_bytes=2000 * 100), "reporting_nodes": 2500,
                                     "nodes_omitted": 500})
        tab.wait_for("document.querySelectorAll('[data-job=\"resnet50\"] .cache-node').length === 2000", "2,000 node rows")
        assert _panel_text(tab, "resnet50", "h3") == "Cache (2500 nodes reporting)"
        # The master lists a job's nodes up to a cap: the rest are counted, in the totals.
        assert _panel_text(tab, "resnet50", ".cache-omitted") == "500 more nodes not listed by the master (counted in the totals)"
        rows = _cache_rows(tab, "resnet50")
        waits = [float(r[8].removesuffix(" %")) for r in rows]
        worst = min(many, key=lambda n: (-n["wait_fraction"], n["hit_rate"], n["node"]))
        assert waits == sorted(waits, reverse=True) and rows[0][0] == worst["node"], rows[:3]
        box = "document.querySelector('[data-job=\"resnet50\"] .cache-scroll')"
        height, full = tab.evaluate(f"[{box}.clientHeight, {box}.scrollHeight]")
        assert 100 < height < 400 < full, (height, full)
        tab.evaluate(f"{box}.scrollTop = 5000; true")
        _next_refresh(tab)
        assert tab.evaluate(f"{box}.scrollTop") == 5000
        assert tab.evaluate("document.querySelectorAll('[data-job=\"resnet50\"] .cache-node').length") == 2000
        assert not tab.errors(), tab.errors()
    finally:
        client.close()
        master.stop()


def test_a_screenshot_of_a_job_with_its_cache_panel(tmp_path: Path, tab: Tab) -> None:
    """A job mid-epoch on four nodes, with their cache figures: ``STATUS_PAGE_CACHE_SCREENSHOT=path``
    saves it there (docs/status-page-cache.png)."""
    master = _master(tmp_path).start()
    client = MasterClient(master.url, retry_deadline_s=10)
    try:
        client.create_job(job_spec("resnet50", n=64, epochs=2))
        for trainer, node, done in (("trainer-1", "node-a", 9), ("trainer-2", "node-b", 7), ("trainer-3", "node-c", 6),
                                    ("trainer-4", "node-d", 5)):
            for lease in client.lease("resnet50", trainer, node, done, epoch=0)["leases"]:
                client.complete("resnet50", lease["lease"], trainer)
            client.lease("resnet50", trainer, node, 2, epoch=0)
        _report_wait(master, "resnet50", "trainer-4", 3.0, 20.0, [200, 60, 20, 10, 8, 2, 0, 0, 0])
        _report_wait(master, "resnet50", "trainer-3", 0.6, 20.0, [280, 15, 5, 0, 0, 0, 0, 0, 0])
        nodes = [
            _cache_node("node-d", trainers=1, reads=412, hit_bytes=int(9.1 * GiB), origin_bytes=int(6.2 * GiB),
                        peer_bytes=int(1.1 * GiB), prefetch_bytes=int(4.0 * GiB), hit_rate=0.555, held_shards=31,
                        planned_shards=48, prefetch_lead_shards=1, fetching_through=True, wait_fraction=0.15,
                        report_age_s=1.8),
            _cache_node("node-c", trainers=1, reads=530, hit_bytes=int(17.5 * GiB), origin_bytes=int(1.4 * GiB),
                        peer_bytes=int(0.6 * GiB), prefetch_bytes=int(7.2 * GiB), hit_rate=0.897, held_shards=44,
                        planned_shards=48, prefetch_lead_shards=4, wait_fraction=0.03, report_age_s=0.7),
            _cache_node("node-a", trainers=1, reads=611, hit_bytes=int(22.8 * GiB), origin_bytes=int(0.3 * GiB),
                        peer_bytes=int(0.2 * GiB), prefetch_bytes=int(9.9 * GiB), hit_rate=0.978, held_shards=48,
                        planned_shards=48, prefetch_lead_shards=8, wait_fraction=0.0, report_age_s=1.1),
            _cache_node("node-b", trainers=1, reads=588, hit_bytes=int(21.0 * GiB), origin_bytes=int(0.5 * GiB),
                        peer_bytes=int(0.4 * GiB), prefetch_bytes=int(8.8 * GiB), hit_rate=0.959, held_shards=47,
                        planned_shards=48, prefetch_lead_shards=7, wait_fraction=None, report_age_s=2.4),
        ]
        totals = {key: sum(n[key] for n in nodes) for key in ("reads", "hit_bytes", "origin_bytes", "peer_bytes", "prefetch_bytes")}
        totals["hit_rate"] = round(totals["hit_bytes"] / (totals["hit_bytes"] + totals["origin_bytes"] + totals["peer_bytes"]), 3)
        _inject_cache(tab, {"resnet50": _cache_section(nodes, **totals)})
        tab.navigate(master.url + "/")
        tab.wait_for("document.querySelectorAll('[data-job=\"resnet50\"] .cache-node').length === 4", "the Cache panel")
        tab.wait_for("document.querySelector('[data-trainer=\"trainer-4\"] .trainer-wait').textContent === '15.0 %'",
                     "trainer-4's wait")
        png = tab.screenshot(tmp_path / "status-page-cache.png")
        assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000
        target = os.environ.get("STATUS_PAGE_CACHE_SCREENSHOT")
        if target:
            Path(target).parent.mkdir(parents=True, exist_ok=True)
            Path(target).write_bytes(png)
        assert not tab.errors(), tab.errors()
    finally:
        client.close()
        master.stop()


def test_the_cache_panel_from_a_node_report_to_the_master(tmp_path: Path, tab: Tab) -> None:
    """End to end, nothing added: a node daemon's report (wire/nodeplan.py) posted to the master
    shows in the job's Cache panel."""
    master = _master(tmp_path).start()
    client = MasterClient(master.url, retry_deadline_s=10)
    try:
        client.create_job(job_spec("resnet50", n=16))
        client.lease("resnet50", "trainer-1", "node-a", 2)
        counters = {"reads": 10, "hit_bytes": 1000, "origin_bytes": 100, "peer_bytes": 0, "prefetch_bytes": 500}
        report = NodeReport(daemon="daemon-a", seq=1, base=None, held=array("Q"), dropped=array("Q"),
                            capacity_bytes=GiB, used_bytes=1100, mean_entry_bytes=1100, jobs={"resnet50": counters})
        status, body = http("POST", f"{master.url}/v1/nodes/node-a/report", report.to_json())
        assert status == 200, (status, body)
        tab.navigate(master.url + "/")
        tab.wait_for("document.querySelector('[data-job=\"resnet50\"] .cache-node[data-node=\"node-a\"]')", "node-a's cache row")
        (row,) = _cache_rows(tab, "resnet50")
        assert row[0] == "node-a" and row[3] == "100 B" and row[5] == "500 B", row
        assert "origin 100 B" in _panel_text(tab, "resnet50", ".cache-totals")
        assert not tab.errors(), tab.errors()
    finally:
        client.close()
        master.stop()
