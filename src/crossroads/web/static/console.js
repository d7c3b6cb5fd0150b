// crossroads console: polls the status API, redraws counters and inline-SVG
// charts; on the admin page, lists sessions and revokes them with the token.
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

document.addEventListener("DOMContentLoaded", () => {
  if (document.body.dataset.page === "admin") startAdmin();
  else startPolling();
});
