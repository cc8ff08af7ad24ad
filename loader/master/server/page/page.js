// The master's status page: GET v1/jobs every 2 s, rendered with DOM calls and textContent only
// (job and trainer names are user input: never innerHTML). No build step, no dependencies.
"use strict";

const REFRESH_MS = 2000;
const TOKEN_KEY = "shardcache-master-token";
const WARN_WAIT = 0.10; // as `shardcache status --warn-wait`'s default

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

function jobCard(job) {
  const wait = job.wait || {};
  const epochs = job.epochs === null || job.epochs === undefined ? "epochs unbounded" : `${job.epochs} epochs`;
  const badges = [];
  if (job.finished) badges.push(el("span", { className: "badge finished" }, "finished"));
  if (typeof wait.fraction_60s === "number" && wait.fraction_60s > WARN_WAIT) {
    badges.push(el("span", { className: "badge warn" }, `trainers waited ${pct(wait.fraction_60s)} of the last 60 s for data`));
  }
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
    document.getElementById("jobs").replaceChildren(
      ...(jobs.length ? jobs.map(jobCard) : [el("p", { className: "muted" }, "no jobs")]));
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
