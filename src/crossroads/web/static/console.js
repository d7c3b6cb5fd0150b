// crossroads console: polls the status API, redraws counters and inline-SVG
// charts; on the admin page, lists sessions and revokes them with the token;
// on the insight page, draws recent attempts' paths and why they were relayed.
// Vanilla JavaScript, no dependency, no build step.
"use strict";

const SVG = "http://www.w3.org/2000/svg";

function formatNumber(value) {
  return Number.isInteger(value) ? String(value) : value.toFixed(1);
}

function drawChart(holder, label, points) {
  let svg = holder.querySelector("svg");
  if (!svg) {
    svg = document.createElementNS(SVG, "svg");
    svg.setAttribute("viewBox", "0 0 100 30");
    svg.setAttribute("preserveAspectRatio", "none");
    svg.setAttribute("role", "img");
    svg.appendChild(document.createElementNS(SVG, "title"));
    svg.appendChild(document.createElementNS(SVG, "polyline"));
    holder.appendChild(svg);
  }
  const values = points.map((p) => p[1]);
  const max = Math.max(1, ...values);
  const span = Math.max(1, values.length - 1);
  const coords = values.map((v, i) =>
    `${((i / span) * 100).toFixed(2)},${(29 - (v / max) * 28).toFixed(2)}`);
  svg.querySelector("polyline").setAttribute("points", coords.join(" "));
  const last = values.length ? formatNumber(values[values.length - 1]) : "0";
  const text = `${label}, last ten minutes: ${values.length} readings, ` +
    `peak ${formatNumber(max)}, now ${last}`;
  svg.setAttribute("aria-label", text);
  svg.querySelector("title").textContent = text;
}

async function refreshStatus() {
  const response = await fetch("/console/api/status", { cache: "no-store" });
  if (!response.ok) throw new Error(`status ${response.status}`);
  const status = await response.json();
  const labels = Object.fromEntries(status.counters.map((c) => [c.key, c.label]));
  for (const el of document.querySelectorAll("[data-counter]")) {
    const key = el.dataset.counter;
    if (key in status.current) el.textContent = formatNumber(status.current[key]);
  }
  for (const el of document.querySelectorAll("[data-chart]")) {
    const key = el.dataset.chart;
    if (key in status.series) drawChart(el, labels[key] || key, status.series[key]);
  }
  for (const el of document.querySelectorAll("[data-errors]")) {
    el.textContent = String(status.errors);
  }
  const updated = document.getElementById("updated");
  if (updated) updated.textContent = `Last update ${new Date().toLocaleTimeString()}.`;
}

function startPolling() {
  const seconds = Number(document.body.dataset.poll || "2");
  const tick = () => refreshStatus().catch(() => {
    const updated = document.getElementById("updated");
    if (updated) updated.textContent = "The server does not answer; retrying.";
  });
  tick();
  setInterval(tick, seconds * 1000);
}

// ------------------------------------------------------------------ admin

function token() {
  return sessionStorage.getItem("crossroads-admin-token") || "";
}

async function adminFetch(path, options = {}) {
  const headers = Object.assign({}, options.headers || {},
    { Authorization: `Bearer ${token()}` });
  const response = await fetch(path, Object.assign({}, options, { headers }));
  if (response.status === 401) throw new Error("The admin token was refused.");
  if (!response.ok) throw new Error(`The server answered ${response.status}.`);
  return response.json();
}

function cell(row, text, header) {
  const el = document.createElement(header ? "th" : "td");
  if (header) el.scope = "row";
  el.textContent = text;
  row.appendChild(el);
  return el;
}

function sessionTable(kind, sessions) {
  const table = document.createElement("table");
  const caption = table.createCaption();
  caption.textContent = `${sessions.length} live ${kind} session(s)`;
  const head = table.createTHead().insertRow();
  for (const title of ["Session", "Client", "User", "Detail", "Expires in", "Action"]) {
    const th = document.createElement("th");
    th.scope = "col";
    th.textContent = title;
    head.appendChild(th);
  }
  const body = table.createTBody();
  for (const s of sessions) {
    const row = body.insertRow();
    cell(row, s.id, true);
    cell(row, s.client);
    cell(row, s.user || "—");
    cell(row, s.detail);
    cell(row, s.expires_in === null ? "—" : `${Math.round(s.expires_in)} s`);
    if (!s.revocable) {
      cell(row, "—");
      continue;
    }
    const button = document.createElement("button");
    button.type = "button";
    button.className = "revoke";
    button.textContent = "Revoke";
    button.setAttribute("aria-label", `Revoke ${kind} session ${s.id}`);
    button.addEventListener("click", () => revoke(kind, s.id));
    cell(row, "").appendChild(button);
  }
  const wrap = document.createElement("div");
  wrap.className = "scroll";
  wrap.appendChild(table);
  return wrap;
}

function say(text) {
  document.getElementById("admin-status").textContent = text;
}

async function loadAdmin() {
  const sessions = await adminFetch("/console/api/admin/sessions");
  for (const section of document.querySelectorAll("section.sessions")) {
    const kind = section.dataset.kind;
    const list = sessions[kind] || [];
    for (const old of section.querySelectorAll("div.scroll, [data-empty]")) old.remove();
    if (list.length) {
      section.appendChild(sessionTable(kind, list));
    } else {
      const p = document.createElement("p");
      p.className = "muted";
      p.dataset.empty = "";
      p.textContent = "None.";
      section.appendChild(p);
    }
  }
  const errors = (await adminFetch("/console/api/admin/errors")).errors;
  const holder = document.getElementById("errors");
  holder.replaceChildren();
  if (!errors.length) {
    const p = document.createElement("p");
    p.className = "muted";
    p.textContent = "None.";
    holder.appendChild(p);
  } else {
    const list = document.createElement("ol");
    for (const e of errors.slice().reverse()) {
      const li = document.createElement("li");
      li.textContent = `${new Date(e.time * 1000).toLocaleTimeString()} ` +
        `${e.level} ${e.logger}: ${e.message}`;
      list.appendChild(li);
    }
    holder.appendChild(list);
  }
  document.getElementById("admin").hidden = false;
}

async function revoke(kind, id) {
  try {
    await adminFetch("/console/api/admin/revoke", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ kind, id }),
    });
    say(`Revoked ${kind} session ${id}.`);
    await loadAdmin();
  } catch (error) {
    say(error.message);
  }
}

function startAdmin() {
  const form = document.getElementById("token-form");
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    sessionStorage.setItem("crossroads-admin-token", form.token.value);
    loadAdmin().then(() => say("Sessions loaded.")).catch((error) => {
      document.getElementById("admin").hidden = true;
      say(error.message);
    });
  });
  if (token()) loadAdmin().catch((error) => say(error.message));
  setInterval(() => {
    if (token() && !document.getElementById("admin").hidden) {
      loadAdmin().catch((error) => say(error.message));
    }
  }, 5000);
}

// ---------------------------------------------------------------- insight

function muted(text) {
  const p = document.createElement("p");
  p.className = "muted";
  p.textContent = text;
  return p;
}

function table(captionText, titles) {
  const t = document.createElement("table");
  t.createCaption().textContent = captionText;
  const head = t.createTHead().insertRow();
  for (const title of titles) {
    const th = document.createElement("th");
    th.scope = "col";
    th.textContent = title;
    head.appendChild(th);
  }
  t.createTBody();
  const wrap = document.createElement("div");
  wrap.className = "scroll";
  wrap.appendChild(t);
  return [wrap, t.tBodies[0]];
}

function bar(fraction, label) {
  const svg = document.createElementNS(SVG, "svg");
  svg.setAttribute("viewBox", "0 0 100 6");
  svg.setAttribute("preserveAspectRatio", "none");
  svg.setAttribute("class", "bar");
  svg.setAttribute("role", "img");
  svg.setAttribute("aria-label", label);
  const rect = document.createElementNS(SVG, "rect");
  rect.setAttribute("width", String(Math.max(1, fraction * 100)));
  rect.setAttribute("height", "6");
  svg.appendChild(rect);
  return svg;
}

function breakdown(holder, rows, what) {
  holder.replaceChildren();
  if (!rows.length) {
    holder.appendChild(muted("None."));
    return;
  }
  const total = rows.reduce((sum, r) => sum + r.count, 0);
  const [wrap, body] = table(`${total} ${what} attempt(s) by cause`, ["Cause", "Attempts", "Share"]);
  for (const r of rows) {
    const row = body.insertRow();
    cell(row, r.cause, true);
    cell(row, String(r.count));
    const share = r.count / total;
    cell(row, "").appendChild(bar(share, `${Math.round(share * 100)} % of ${what} attempts`));
  }
  holder.appendChild(wrap);
}

function formatBytes(n) {
  if (n >= 1e9) return `${(n / 1e9).toFixed(1)} GB`;
  if (n >= 1e6) return `${(n / 1e6).toFixed(1)} MB`;
  if (n >= 1e3) return `${(n / 1e3).toFixed(1)} kB`;
  return `${n} B`;
}

function topCodes(holder, codes) {
  holder.replaceChildren();
  if (!codes.length) {
    holder.appendChild(muted("Nothing relayed yet."));
    return;
  }
  const most = Math.max(1, ...codes.map((c) => c.bytes_up + c.bytes_down));
  const [wrap, body] = table("Codes by bytes relayed, both ways (today)",
    ["Code", "Family", "Game", "Sessions", "Up", "Down", "Share"]);
  for (const c of codes) {
    const row = body.insertRow();
    cell(row, c.code, true);
    cell(row, c.family);
    cell(row, c.game || "—");
    cell(row, String(c.sessions));
    cell(row, formatBytes(c.bytes_up));
    cell(row, formatBytes(c.bytes_down));
    const both = c.bytes_up + c.bytes_down;
    cell(row, "").appendChild(bar(both / most, `${formatBytes(both)} in all`));
  }
  holder.appendChild(wrap);
}

// The path: one lane per step, placed by its start and length within the
// attempt; the winner drawn solid, the others by outcome.
function pathDrawing(attempt) {
  const figure = document.createElement("figure");
  figure.className = "path";
  const steps = attempt.steps;
  const span = Math.max(attempt.duration,
    ...steps.map((s) => s.start + s.duration), 1e-6);
  // The winner is the last step of the winner's name (a ladder may retry one).
  let winning = -1;
  steps.forEach((s, i) => { if (s.name === attempt.winner) winning = i; });
  const svg = document.createElementNS(SVG, "svg");
  svg.setAttribute("viewBox", `0 0 100 ${Math.max(1, steps.length) * 8}`);
  svg.setAttribute("preserveAspectRatio", "none");
  svg.setAttribute("aria-hidden", "true");
  steps.forEach((s, i) => {
    const rect = document.createElementNS(SVG, "rect");
    rect.setAttribute("x", String((s.start / span) * 100));
    rect.setAttribute("y", String(i * 8 + 1));
    rect.setAttribute("width", String(Math.max(1.5, (s.duration / span) * 100)));
    rect.setAttribute("height", "6");
    const winner = i === winning;
    rect.setAttribute("class", `step ${winner ? "winner" : s.outcome}`);
    rect.dataset.step = s.name;
    svg.appendChild(rect);
  });
  figure.appendChild(svg);
  const caption = document.createElement("figcaption");
  caption.textContent = steps.map((s, i) =>
    `${s.name} at ${s.start.toFixed(2)} s for ${s.duration.toFixed(2)} s: ${s.outcome}` +
    (i === winning ? " (winner)" : "")).join("; ") || "no step";
  figure.appendChild(caption);
  return figure;
}

function attemptsTable(holder, attempts) {
  holder.replaceChildren();
  if (!attempts.length) {
    holder.appendChild(muted("No record yet."));
    return;
  }
  const [wrap, body] = table(`${attempts.length} recent attempt(s)`,
    ["Code", "Family", "Started", "Outcome", "Winner", "Cause", "Path", "Sides", "Relayed"]);
  for (const a of attempts) {
    const row = body.insertRow();
    row.dataset.family = a.family;
    row.dataset.outcome = a.outcome;
    cell(row, a.session, true);
    cell(row, a.family);
    cell(row, new Date(a.started * 1000).toLocaleTimeString());
    cell(row, a.outcome).className = `outcome ${a.outcome}`;
    cell(row, a.winner || "—");
    cell(row, a.cause || "—");
    cell(row, "").appendChild(pathDrawing(a));
    cell(row, a.sides.map((s) => [s.prefix || s.id, s.nat, s.rtt_ms === null ? "" :
      `${Math.round(s.rtt_ms)} ms`].filter(Boolean).join(" ")).join(" ↔ ") || "—");
    const u = a.usage;
    cell(row, u ? `${formatBytes(u.bytes_up + u.bytes_down)}, ${u.packets_up + u.packets_down} packets` +
      (u.rtt_ms === null ? "" : `, RTT ${Math.round(u.rtt_ms)} ms`) : "—");
  }
  holder.appendChild(wrap);
}

async function loadInsight() {
  const family = document.getElementById("family").value;
  const query = new URLSearchParams({ limit: "50" });
  if (family) query.set("family", family);
  const [records, summary] = await Promise.all([
    adminFetch(`/v1/insight/attempts?${query}`),
    adminFetch("/v1/insight/summary"),
  ]);
  breakdown(document.getElementById("why-relayed"), summary.why_relayed, "relayed");
  breakdown(document.getElementById("why-failed"), summary.why_failed, "failed");
  topCodes(document.getElementById("top-codes"), summary.top_codes);
  attemptsTable(document.getElementById("attempts"), records.attempts);
  document.getElementById("insight").hidden = false;
}

function startInsight() {
  const form = document.getElementById("token-form");
  const shown = () => !document.getElementById("insight").hidden;
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    sessionStorage.setItem("crossroads-admin-token", form.token.value);
    loadInsight().then(() => say("Records loaded.")).catch((error) => {
      document.getElementById("insight").hidden = true;
      say(error.message);
    });
  });
  document.getElementById("family").addEventListener("change",
    () => loadInsight().catch((error) => say(error.message)));
  if (token()) loadInsight().catch((error) => say(error.message));
  setInterval(() => {
    if (token() && shown()) loadInsight().catch((error) => say(error.message));
  }, 5000);
}

document.addEventListener("DOMContentLoaded", () => {
  if (document.body.dataset.page === "admin") startAdmin();
  else if (document.body.dataset.page === "insight") startInsight();
  else startPolling();
});
