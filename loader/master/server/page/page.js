// The master's status page: GET v1/jobs every 2 s, rendered with DOM calls and textContent only
// (job and trainer names are user input: never innerHTML). No build step, no dependencies.
"use strict";

const REFRESH_MS = 2000;
const TOKEN_KEY = "shardcache-master-token";
const WARN_WAIT = 0.10; // as `shardcache status --warn-wait`'s default
const WARN_HIT = 0.50; // as `shardcache status --warn-hit-rate`'s default

// el("td", {className: "num"}, "text", childNode...): text arguments become text nodes.
function el(tag, props, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(props || {})) {
    if (key === "dataset") Object.assign(node.dataset, value);
    else node[key] = value;
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

const dash = "–";
const num = (v, digits = 1) => (typeof v === "number" && isFinite(v) ? v.toFixed(digits) : dash);
const pct = (v) => (typeof v === "number" && isFinite(v) ? (100 * v).toFixed(1) + " %" : dash);
const isNum = (v) => typeof v === "number" && isFinite(v);
const whole = (v) => (isNum(v) ? String(Math.trunc(v)) : dash);
const UNITS = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
// 1536 -> "1.5 KiB": IEC units, as `shardcache status` prints them.
function bytes(v) {
  if (!isNum(v)) return dash;
  let value = v;
  for (const unit of UNITS) {
    if (Math.abs(value) < 1024 || unit === UNITS[UNITS.length - 1]) return unit === "B" ? `${value.toFixed(0)} B` : `${value.toFixed(1)} ${unit}`;
    value /= 1024;
  }
  return dash;
}
const secs = (v) => (typeof v === "number" && isFinite(v) ? (v < 1 ? (1000 * v).toFixed(1) + " ms" : v.toFixed(2) + " s") : dash);

function bar(counts) {
  const total = Math.max(counts.total || 0, 1);
  const parts = ["done", "failed", "leased"].map((state) =>
    el("span", { className: state, title: `${state}: ${counts[state] || 0}` }));
  parts.forEach((part, i) => { part.style.width = (100 * (counts[["done", "failed", "leased"][i]] || 0) / total) + "%"; });
  return el("div", { className: "bar" }, ...parts);
}

function epochRow(e) {
  const total = e.total || 0;
  // Closed: done or failed (a failed shard no longer blocks the epoch).
  const closed = total ? ` · ${Math.floor(100 * (e.done + e.failed) / total)} %` : "";
  return el("div", { className: "epoch", dataset: { epoch: String(e.epoch), done: String(e.done) } },
    el("span", {}, `epoch ${e.epoch}${closed}`),
    bar(e),
    el("span", { className: "epoch-counts" },
      `${e.done}/${total} done · ${e.failed} failed · ${e.leased} leased · ${e.todo} to do`));
}

function trainersTable(trainers) {
  if (!trainers.length) return el("p", { className: "muted" }, "no trainers");
  const head = el("tr", {}, ...["trainer", "node", "last seen", "leases", "streams", "wait (60 s)", "wait p50",
    "wait p99", "steps"].map((h, i) => el("th", { className: i >= 2 && i !== 4 ? "num" : "" }, h)));
  const rows = trainers.map((t) => {
    const w = t.wait || {};
    const streams = (t.streams || []).map((s) => `${s.stream === "" ? "(trainer)" : s.stream}: ${s.leases}`).join(", ");
    return el("tr", { className: "trainer", dataset: { trainer: t.trainer, leases: String(t.leases) } },
      el("td", { className: "trainer-name" }, t.trainer),
      el("td", {}, t.node || dash),
      el("td", { className: "num" }, t.last_seen_s_ago === null || t.last_seen_s_ago === undefined ? dash : `${num(t.last_seen_s_ago)} s ago`),
      el("td", { className: "num trainer-leases" }, t.leases),
      el("td", {}, streams || dash),
      el("td", { className: "num trainer-wait" }, pct(w.fraction_60s)),
      el("td", { className: "num" }, secs(w.p50_s)),
      el("td", { className: "num" }, secs(w.p99_s)),
      el("td", { className: "num" }, typeof w.steps === "number" ? w.steps : dash));
  });
  return el("table", {}, el("thead", {}, head), el("tbody", {}, ...rows));
}

function failedTable(title, failed) {
  if (!failed || !failed.length) return null;
  const head = el("tr", {}, el("th", {}, "shard"), el("th", {}, "key"), el("th", { className: "num" }, "failures"),
    el("th", {}, "last error"));
  const rows = failed.map((f) => el("tr", { className: "failed-shard" },
    el("td", {}, f.shard), el("td", {}, f.key), el("td", { className: "num" }, f.failures), el("td", {}, f.last_error || "")));
  return el("div", {}, el("h3", {}, title), el("table", {}, el("thead", {}, head), el("tbody", {}, ...rows)));
}

// Cache-aware leases (locality_window > 0): how many leases found their shard on the trainer's node,
// and how far the handed-out order moved from the seeded one (the newest epoch).
function localitySpan(loc) {
  if (!loc) return [];
  const newest = loc.epochs && loc.epochs.length ? loc.epochs[loc.epochs.length - 1] : null;
  const moved = newest && typeof newest.mean_displacement === "number"
    ? ` · order moved ${num(newest.mean_displacement)} positions (ρ ${newest.spearman === null ? "-" : newest.spearman.toFixed(3)})` : "";
  return [el("span", { className: "job-locality" },
    `local leases ${pct(loc.local_share)} (window ${loc.window}, ${loc.ring ? loc.ring.nodes : 0} nodes)${moved}`)];
}

// The job's cache as the node daemons started with --master report it (the status's `cache`
// section; none from a master older than it). Nodes whose trainers waited most come first, then
// the lowest hit rate, unknown figures after known ones: the nodes to look at on top, as
// `shardcache status --job` lists them.
function worstFirst(nodes) {
  const key = (n) => [isNum(n.wait_fraction) ? 0 : 1, isNum(n.wait_fraction) ? -n.wait_fraction : 0,
    isNum(n.hit_rate) ? 0 : 1, isNum(n.hit_rate) ? n.hit_rate : 0];
  return nodes.map((n) => [key(n), n]).sort((a, b) => {
    for (let i = 0; i < a[0].length; i++) if (a[0][i] !== b[0][i]) return a[0][i] - b[0][i];
    return String(a[1].node).localeCompare(String(b[1].node));
  }).map(([, n]) => n);
}

const THROUGH_TITLE = "fetching through: its trainers wait on the origin, so its plans fetch past the shards it kept";

function cacheNodesTable(job, nodes) {
  const heads = ["node", "trainers", "hit rate", "origin", "peer", "prefetched", "held / planned", "prefetch lead",
    "wait", "report age"];
  const head = el("tr", {}, ...heads.map((h, i) => el("th", { className: i ? "num" : "" }, h)));
  const rows = worstFirst(nodes).map((n) => el("tr", { className: "cache-node", dataset: { node: String(n.node) } },
    el("td", { className: "cache-node-name" }, n.node || dash),
    el("td", { className: "num" }, whole(n.trainers)),
    el("td", { className: "num cache-hit" + (isNum(n.hit_rate) && n.hit_rate < WARN_HIT ? " alert" : "") }, pct(n.hit_rate)),
    el("td", { className: "num" }, bytes(n.origin_bytes)),
    el("td", { className: "num" }, bytes(n.peer_bytes)),
    el("td", { className: "num" }, bytes(n.prefetch_bytes)),
    el("td", { className: "num" }, `${whole(n.held_shards)} / ${whole(n.planned_shards)}`),
    // Marked while the node's plans fetch through what it kept (its trainers waited on the origin).
    el("td", { className: "num cache-lead", title: n.fetching_through === true ? THROUGH_TITLE : "" },
      whole(n.prefetch_lead_shards) + (n.fetching_through === true ? " · through" : "")),
    el("td", { className: "num cache-wait" + (isNum(n.wait_fraction) && n.wait_fraction > WARN_WAIT ? " alert" : "") },
      pct(n.wait_fraction)),
    el("td", { className: "num" }, isNum(n.report_age_s) ? `${num(n.report_age_s)} s ago` : dash)));
  // A scrolling box of its own: a job on hundreds of nodes keeps the rest of the page in view.
  return el("div", { className: "cache-scroll", dataset: { job: job.name } },
    el("table", {}, el("thead", {}, head), el("tbody", {}, ...rows)));
}

function cachePanel(job) {
  const cache = job.cache;
  if (!cache || typeof cache !== "object") return null;
  const nodes = Array.isArray(cache.nodes) ? cache.nodes.filter((n) => n && typeof n === "object") : [];
  const reporting = isNum(cache.reporting_nodes) ? cache.reporting_nodes : nodes.length;
  const t = cache.totals || {};
  const title = el("h3", {}, `Cache (${reporting} ${reporting === 1 ? "node" : "nodes"} reporting)`);
  if (!reporting && !nodes.length) {
    return el("div", { className: "cache" }, title, el("p", { className: "muted cache-totals" },
      "no node reports yet: node daemons started with --master report what this job's trainers read every few seconds"));
  }
  return el("div", { className: "cache" }, title,
    el("p", { className: "cache-totals" },
      `hit rate ${pct(t.hit_rate)} · origin ${bytes(t.origin_bytes)} · peer ${bytes(t.peer_bytes)} · ` +
      `prefetched ${bytes(t.prefetch_bytes)} · ${whole(t.reads)} reads`),
    nodes.length ? cacheNodesTable(job, nodes) : null,
    omittedNote(cache.nodes_omitted));
}

// The master lists a job's nodes up to a cap; the rest are in the totals only.
function omittedNote(omitted) {
  if (!isNum(omitted) || omitted <= 0) return null;
  return el("p", { className: "muted cache-omitted" },
    `${whole(omitted)} more ${omitted === 1 ? "node" : "nodes"} not listed by the master (counted in the totals)`);
}

// Low hit rate while the trainers wait: the reads that miss the cache are the likely reason.
function cacheBadge(job) {
  const hit = job.cache && job.cache.totals ? job.cache.totals.hit_rate : null;
  const wait = (job.wait || {}).fraction_60s;
  if (!isNum(hit) || !isNum(wait) || hit >= WARN_HIT || wait <= WARN_WAIT) return null;
  return el("span", { className: "badge warn cache-warn" }, `cache hit rate ${pct(hit)} while trainers wait`);
}

function jobCard(job) {
  const wait = job.wait || {};
  const epochs = job.epochs === null || job.epochs === undefined ? "epochs unbounded" : `${job.epochs} epochs`;
  const badges = [];
  if (job.finished) badges.push(el("span", { className: "badge finished" }, "finished"));
  if (typeof wait.fraction_60s === "number" && wait.fraction_60s > WARN_WAIT) {
    badges.push(el("span", { className: "badge warn" }, `trainers waited ${pct(wait.fraction_60s)} of the last 60 s for data`));
  }
  const cacheWarn = cacheBadge(job);
  if (cacheWarn) badges.push(cacheWarn);
  const open = job.open_epochs && job.open_epochs.length ? job.open_epochs
    : [{ epoch: job.epoch, ...job.shards }];
  const totals = job.totals || {};
  return el("section", { className: "job", dataset: { job: job.name } },
    el("div", { className: "job-head" },
      el("h2", { className: "job-name" }, job.name),
      el("span", { className: "muted" }, job.dataset),
      el("span", {}, `epoch ${job.epoch} · ${epochs}`),
      el("span", { className: "samples" }, `${num(job.samples_per_s)} samples/s`),
      el("span", { className: "job-wait" }, `waited for data ${pct(wait.fraction_60s)} of the last 60 s`),
      ...localitySpan(job.locality),
      ...badges),
    el("h3", {}, "Epochs", el("span", { className: "legend muted" },
      ...["done", "failed", "leased", "todo"].flatMap((s) => [el("span", { className: s }), s === "todo" ? "to do" : s]))),
    ...open.map(epochRow),
    el("h3", {}, `Trainers (${(job.trainers || []).length})`),
    trainersTable(job.trainers || []),
    cachePanel(job),
    failedTable("Failed shards (this epoch)", job.failed_shards),
    failedTable("Failed shards (previous epoch)", job.failed_previous_epoch),
    el("p", { className: "muted" },
      `totals: ${totals.leased || 0} leased, ${totals.completed || 0} completed, ${totals.reissued || 0} reissued, ` +
      `${totals.expired || 0} expired, ${totals.failures || 0} failures, ${totals.epochs || 0} epochs closed`));
}

function show(id, text) {
  const node = document.getElementById(id);
  node.textContent = text || "";
  node.hidden = !text;
}

function askToken(message) {
  document.getElementById("token-form").hidden = false;
  show("token-error", message);
  document.getElementById("jobs").replaceChildren();
  document.getElementById("token").focus();
}

// Every refresh rebuilds the jobs: where the user scrolled each Cache table to is kept across it.
function cacheScrolls() {
  const at = new Map();
  for (const box of document.querySelectorAll(".cache-scroll")) at.set(box.dataset.job, box.scrollTop);
  return at;
}

function restoreCacheScrolls(at) {
  for (const box of document.querySelectorAll(".cache-scroll")) {
    if (at.has(box.dataset.job)) box.scrollTop = at.get(box.dataset.job);
  }
}

let timer = null;

async function refresh() {
  clearTimeout(timer);
  const token = sessionStorage.getItem(TOKEN_KEY);
  const headers = token ? { Authorization: `Bearer ${token}` } : {};
  try {
    const resp = await fetch("v1/jobs", { headers, cache: "no-store" });
    if (resp.status === 401) {
      sessionStorage.removeItem(TOKEN_KEY);
      askToken(token ? "The master refused that token: type the current one." : "");
      show("updated", "token needed");
      return; // no polling until a token is given
    }
    const body = await resp.json().catch(() => ({}));
    if (!resp.ok) {
      const leader = body.leader ? ` (leader: ${body.leader})` : "";
      throw new Error(`${resp.status} ${body.error || ""}: ${body.message || "no message"}${leader}`);
    }
    document.getElementById("token-form").hidden = true;
    show("error", "");
    const jobs = body.jobs || [];
    const scrolled = cacheScrolls();
    document.getElementById("jobs").replaceChildren(
      ...(jobs.length ? jobs.map(jobCard) : [el("p", { className: "muted" }, "no jobs")]));
    restoreCacheScrolls(scrolled);
    show("updated", `updated ${new Date().toLocaleTimeString()}`);
  } catch (err) {
    show("error", `refresh failed: ${err.message || err}`);
  }
  timer = setTimeout(refresh, REFRESH_MS);
}

document.getElementById("token-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const input = document.getElementById("token");
  sessionStorage.setItem(TOKEN_KEY, input.value.trim());
  input.value = "";
  refresh();
});

refresh();
