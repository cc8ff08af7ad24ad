"""The master's status page (``GET /``) in a real headless browser: Debian's ``chromium``, driven
over its DevTools protocol (aiohttp's websocket client: nothing more to install), against a real
``shardcache master`` process whose job is driven by the real client.

The page loads, shows a running job's trainers with their leases, updates as the epoch advances
(leases completed from the test: the progress changes within the page's 2 s refresh), shows a
failed shard, renders a hostile trainer name as text, and with ``--token-file`` asks for the token,
refuses a wrong one and then shows the job. ``STATUS_PAGE_SCREENSHOT=path`` also saves the
screenshot of the running job there (how docs/status-page.png is made)."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from loader.master.client import MasterClient
from tests.support.masters import MasterProcess, http, job_spec
from tests.support.processes import spawn, stop
from tests.support.waits import wait_until

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
