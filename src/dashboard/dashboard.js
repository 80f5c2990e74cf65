// The dashboard's behaviour: poll /dashboard/data once a second and redraw.
// Every value goes into the page as text (textContent, SVG attributes), never as markup: tool
// names, scopes and messages are data, whatever they contain.
// With auth.required the data needs a key: the page asks for one, keeps it in this tab's
// sessionStorage and sends it as a Bearer header; a refused key is forgotten and asked again.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const POLL_MS = 1000;
const KEY_ITEM = "mcp-ratelimit-dashboard-key";
let timer = null;
// The key, for browsers without sessionStorage (then it lasts as long as the page).
let heldKey = null;

function $(id) {
  return document.getElementById(id);
}

// An element with a class and text.
function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined && text !== null) node.textContent = String(text);
  return node;
}

function svgEl(tag, attrs) {
  const node = document.createElementNS(SVG, tag);
  for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, String(value));
  return node;
}

function number(n) {
  return Number(n).toLocaleString("en-US");
}

// A duration for people: "12 s", "3 min", "2 h".
function duration(ms) {
  const s = Math.ceil(ms / 1000);
  if (s < 120) return s + " s";
  const min = Math.round(s / 60);
  if (min < 120) return min + " min";
  return Math.round(min / 60) + " h";
}

function ago(ms) {
  return ms < 1000 ? "just now" : duration(ms) + " ago";
}

// Replaces a table body's rows; shows the "empty" note when there are none.
function fillTable(tableId, emptyId, rows) {
  const body = $(tableId).tBodies[0];
  body.replaceChildren(...rows);
  $(tableId).hidden = rows.length === 0;
  $(emptyId).hidden = rows.length !== 0;
}

function codeChip(code, count) {
  const chip = el("span", "code " + code, count === undefined ? code : code + " " + number(count));
  chip.title = code;
  return chip;
}

// A horizontal meter: `value` of `max`, coloured by how full (or, for levels, how empty) it is.
function meter(svg, value, max, tone) {
  const width = max > 0 ? Math.max(0, Math.min(1, value / max)) * 200 : 0;
  svg.replaceChildren(
    svgEl("rect", { class: "track", x: 0, y: 0, width: 200, height: 12, rx: 3 }),
    svgEl("rect", { class: "fill " + tone, x: 0, y: 0, width: width, height: 12, rx: 3 }),
  );
}

function fullness(value, max) {
  if (max <= 0) return "";
  const share = value / max;
  return share >= 1 ? "bad" : share >= 0.75 ? "warn" : "";
}

function sparkline(perBucket, max, code) {
  const n = perBucket.length;
  const bar = 10;
  const svg = svgEl("svg", { class: "spark", viewBox: `0 0 ${n * bar} 36`, preserveAspectRatio: "none", role: "img" });
  svg.appendChild(svgEl("rect", { class: "bg", x: 0, y: 35, width: n * bar, height: 1 }));
  perBucket.forEach((count, i) => {
    if (count === 0) return;
    const h = Math.max(2, Math.round((count / max) * 34));
    const rect = svgEl("rect", { class: "bar " + code, x: i * bar + 1, y: 35 - h, width: bar - 2, height: h });
    const title = svgEl("title", {});
    title.textContent = count + " refused";
    rect.appendChild(title);
    svg.appendChild(rect);
  });
  return svg;
}

function renderTools(tools, windowMinutes) {
  const max = Math.max(1, ...tools.flatMap((t) => t.per_bucket));
  const rows = tools.map((t) => {
    const row = el("div", "tool-row");
    row.dataset.tool = t.tool;
    const name = el("div");
    name.append(el("span", "tool-name", t.tool), el("span", "layer", t.layer === "tool" ? "" : t.layer + " layer"));
    const codes = el("div", "codes");
    t.codes.forEach((c) => codes.appendChild(codeChip(c.code, c.refused)));
    const top = t.codes.length ? t.codes[0].code : "";
    const spark = sparkline(t.per_bucket, max, top);
    spark.setAttribute("aria-label", `${t.tool}: ${t.refused} refused in the last ${windowMinutes} minutes`);
    const axis = el("div", "axis");
    axis.append(el("span", "", windowMinutes + " min ago"), el("span", "", "now"));
    row.append(name, el("div", "count", number(t.refused)), codes, spark, axis);
    return row;
  });
  $("per-tool").replaceChildren(...rows);
  $("per-tool-empty").hidden = rows.length !== 0;
}

// "caller #3fa2c1 b07": the keyed hash and the metrics bucket, never the caller's id.
function hashedCaller(caller, bucket) {
  const line = el("div", "caller", "caller " + caller + " ");
  line.appendChild(el("span", "bucket", bucket));
  return line;
}

function renderRefusals(latest) {
  const rows = latest.map((r) => {
    const tr = el("tr");
    tr.append(el("td", "when", ago(r.ago_ms)));
    const tool = el("td", "tool", r.tool);
    if (r.layer !== "tool") tool.appendChild(el("span", "layer", r.layer));
    tr.append(tool);
    const code = el("td");
    code.appendChild(codeChip(r.code));
    if (r.count > 1) code.appendChild(el("span", "count", "×" + number(r.count)));
    tr.append(code);
    const who = el("td", "who");
    if (r.tenant) who.appendChild(el("div", "tenant", "tenant " + r.tenant));
    who.appendChild(hashedCaller(r.caller, r.bucket));
    tr.append(who, el("td", "scope", r.scope || "–"));
    const why = el("td", "why", r.message);
    const detail = [];
    if (r.limit !== null && r.limit !== undefined) detail.push("limit " + number(r.limit));
    if (r.remaining !== null && r.remaining !== undefined) detail.push(number(r.remaining) + " left");
    if (r.retry_after_ms !== null && r.retry_after_ms !== undefined) detail.push("told to wait " + duration(r.retry_after_ms));
    if (detail.length) why.appendChild(el("span", "detail", detail.join(" · ")));
    tr.append(why);
    return tr;
  });
  fillTable("refusals", "refusals-empty", rows);
}

function renderScopes(scopes) {
  const rows = scopes.map((s) => {
    const tr = el("tr");
    const scope = el("td", "scope", s.scope + " ");
    scope.appendChild(el("span", "bucket", s.bucket));
    const level = el("td");
    const box = el("div", "level");
    const bar = svgEl("svg", { class: "meter", viewBox: "0 0 200 12", preserveAspectRatio: "none" });
    const tone = s.remaining === 0 ? "bad" : s.remaining * 4 <= s.limit ? "warn" : "";
    meter(bar, s.remaining, s.limit, tone);
    // A level read from the store just now says so; one the store could not read is as the last
    // sampled call left it.
    const when = s.current ? "now" : "when last seen";
    box.append(bar, el("span", tone, `${number(s.remaining)} of ${number(s.limit)} left ${when}`));
    level.appendChild(box);
    tr.append(scope, el("td", "", s.kind), level, el("td", "num", number(s.refused)), el("td", "seen", ago(s.ago_ms)));
    return tr;
  });
  fillTable("scopes", "scopes-empty", rows);
}

function renderJobs(jobs) {
  $("jobs-in-flight").textContent = number(jobs.in_flight);
  $("account-note").textContent = `${jobs.account_in_use} of ${jobs.account_max} account slots in use`;
  meter($("account-meter"), jobs.account_in_use, jobs.account_max, fullness(jobs.account_in_use, jobs.account_max));
  const learnt = jobs.account_max !== jobs.account_ceiling ? ` (learnt; ceiling ${jobs.account_ceiling})` : "";
  $("account-text").textContent = `${jobs.account_in_use} of ${jobs.account_max} in use${learnt}`;
  const ends = jobs.webhooks ? "ends by webhook" : "ends by poll";
  $("account-split").hidden = jobs.webhooks === null;
  $("account-split").textContent =
    `${jobs.account_busy} busy · ${jobs.account_held_idle} idle but held · ${jobs.account_free} free (${ends})`;
  meter($("queue-meter"), jobs.queue_waiting, jobs.queue_max, fullness(jobs.queue_waiting, jobs.queue_max));
  $("queue-text").textContent = `${jobs.queue_waiting} of ${jobs.queue_max} waiting`;
  meter($("video-meter"), jobs.videos_waiting, jobs.videos_max, fullness(jobs.videos_waiting, jobs.videos_max));
  $("video-text").textContent = `${jobs.videos_waiting} of ${jobs.videos_max} waiting`;
  const rows = jobs.per_owner.map((o) => {
    const tr = el("tr");
    tr.append(el("td", "who", o.owner), el("td", "num", number(o.running)), el("td", "num", number(o.waiting)));
    return tr;
  });
  fillTable("owners", "owners-empty", rows);
  const tiers = jobs.tiers.map((t) => {
    const tr = el("tr");
    tr.append(
      el("td", "who", t.tier),
      el("td", "num", String(t.rank)),
      el("td", "num", `${number(t.in_use)} of ${number(t.reserved_slots)} reserved`),
      el("td", "num", `${number(t.waiting)} of ${number(t.reserved_places)} reserved`),
    );
    return tr;
  });
  // Shown only when the config reserves a share or ranks a tier.
  $("tiers").tBodies[0].replaceChildren(...tiers);
  $("tiers").hidden = tiers.length === 0;
}

function renderSaved(saved) {
  $("saved-total").textContent = number(saved.coalesced + saved.cached);
  $("saved-note").textContent = `${number(saved.coalesced)} coalesced, ${number(saved.cached)} cached, since start`;
}

function setCard(id, tone) {
  $(id).classList.remove("ok", "warn", "bad");
  if (tone) $(id).classList.add(tone);
}

function renderHealth(breaker, store) {
  const words = { closed: "closed", half_open: "half-open", open: "open" };
  $("breaker-state").textContent = words[breaker.state] || breaker.state;
  setCard("breaker-card", breaker.state === "closed" ? "ok" : breaker.state === "open" ? "bad" : "warn");
  $("breaker-note").textContent =
    breaker.state === "open"
      ? `refusing upstream calls; one probe in ${duration(breaker.open_for_ms || 0)}`
      : breaker.state === "half_open"
        ? "one probe decides"
        : `opens after ${breaker.failures_to_open} failures in a row`;
  $("store-state").textContent = store.up ? "up" : "down";
  setCard("store-card", store.up ? "ok" : "bad");
  $("store-note").textContent =
    store.backend === "redis"
      ? `Redis, shared by every instance; ${store.slice_units} units of ${store.slice_keys} busy budgets held here in slices`
      : "memory, this process";
}

function render(data) {
  $("refused-window").textContent = number(data.refused_in_window);
  $("refused-total").textContent = number(data.refused_total);
  $("admitted-total").textContent = number(data.admitted_total);
  $("limits-enabled").textContent = data.limits_enabled ? "since start" : "limits are OFF (limits.enabled = false)";
  const windowMinutes = Math.round(data.window_s / 60);
  $("window-minutes").textContent = windowMinutes;
  $("bucket-seconds").textContent = data.bucket_s;
  renderTools(data.tools, windowMinutes);
  renderRefusals(data.latest);
  renderScopes(data.scopes);
  renderJobs(data.jobs);
  renderHealth(data.breaker, data.store);
  renderSaved(data.saved);
}

function status(text, tone) {
  const node = $("status");
  node.textContent = text;
  node.className = "status " + tone;
}

// The key this tab was given, if any.
function storedKey() {
  try {
    return window.sessionStorage.getItem(KEY_ITEM);
  } catch (_) {
    return heldKey;
  }
}

function storeKey(key) {
  heldKey = key;
  try {
    if (key) window.sessionStorage.setItem(KEY_ITEM, key);
    else window.sessionStorage.removeItem(KEY_ITEM);
  } catch (_) {
    // No storage: heldKey serves.
  }
}

function askForKey(message) {
  $("key-message").textContent = message;
  $("key-panel").hidden = false;
  $("key-input").focus();
}

function schedule() {
  clearTimeout(timer);
  timer = setTimeout(poll, POLL_MS);
}

async function poll() {
  const key = storedKey();
  const headers = key ? { Authorization: "Bearer " + key } : {};
  try {
    const response = await fetch("/dashboard/data", { cache: "no-store", credentials: "omit", headers });
    if (response.status === 401) {
      storeKey(null);
      askForKey(
        key
          ? "That key is not accepted here (401): give one of the server's configured API keys, or the admin key."
          : "auth.required is on, so the dashboard's data needs a key: one of the server's configured API keys, or the admin key.",
      );
      status(key ? "key refused" : "waiting for a key", "down");
      return; // until a key is given
    }
    if (!response.ok) throw new Error("HTTP " + response.status);
    const data = await response.json();
    $("key-panel").hidden = true;
    render(data);
    const showing = data.showing && data.showing !== "everyone" ? " · showing " + data.showing : "";
    status("live" + showing + " · updated " + new Date().toLocaleTimeString(), "live");
  } catch (error) {
    status("cannot reach the server (" + error.message + "); retrying", "down");
  }
  schedule();
}

function submitKey(event) {
  event.preventDefault();
  const key = $("key-input").value.trim();
  if (!/^[\x21-\x7e]+$/.test(key)) {
    askForKey("A key is printable ASCII without spaces.");
    return;
  }
  storeKey(key);
  $("key-input").value = "";
  $("key-message").textContent = "";
  clearTimeout(timer);
  poll();
}

document.addEventListener("DOMContentLoaded", () => {
  $("key-form").addEventListener("submit", submitKey);
  poll();
});
