// The status page: polls /ui/state every two seconds and draws the
// services and the recent swaps. No framework; nothing from elsewhere.
"use strict";

const COLORS = ["#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#eeca3b", "#b279a2", "#ff9da6", "#9d755d", "#bab0ac", "#1b9e77", "#7570b3", "#e7298a", "#66a61e"];
const phaseColor = new Map();
let key = sessionStorage.getItem("gpusnap-key") || "";

function color(phase) {
  if (!phaseColor.has(phase)) phaseColor.set(phase, COLORS[phaseColor.size % COLORS.length]);
  return phaseColor.get(phase);
}

function bytes(n) {
  if (!n) return "";
  const u = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < u.length - 1) { n /= 1024; i++; }
  return (i ? n.toFixed(1) : n) + " " + u[i];
}

function duration(ms) {
  if (ms == null) return "";
  if (ms < 1000) return Math.round(ms) + " ms";
  const s = ms / 1000;
  if (s < 120) return s.toFixed(1) + " s";
  if (s < 7200) return Math.round(s / 60) + " min";
  return (s / 3600).toFixed(1) + " h";
}

function cell(tr, text, cls) {
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
  tr.appendChild(td);
  return td;
}

function drawServices(services) {
  const body = document.querySelector("#services tbody");
  body.replaceChildren();
  for (const s of services) {
    const tr = document.createElement("tr");
    tr.dataset.service = s.name;
    cell(tr, s.name);
    cell(tr, (s.models || []).join(", "));
    const st = cell(tr, "");
    const badge = document.createElement("span");
    badge.className = "state state-" + s.state;
    badge.textContent = s.state;
    st.appendChild(badge);
    cell(tr, duration(s.in_state_ms), "num");
    cell(tr, bytes(s.gpu_bytes), "num gpu");
    cell(tr, bytes(s.host_bytes), "num host");
    cell(tr, bytes(s.image_bytes), "num");
    cell(tr, s.next ? s.next.action + " in " + duration(s.next.in_ms) : "", "next");
    cell(tr, s.connections + (s.waiting ? " (" + s.waiting + " waiting)" : ""), "num");
    cell(tr, s.last_error || "", "error");
    body.appendChild(tr);
  }
}

function drawSwaps(swaps, now) {
  const box = document.getElementById("swaps");
  box.replaceChildren();
  const newest = swaps.slice().reverse();
  const longest = Math.max(1, ...newest.map((w) => w.total_ms));
  for (const w of newest) {
    const row = document.createElement("div");
    row.className = "swap";
    row.dataset.service = w.service;
    const label = document.createElement("span");
    label.className = "label";
    label.textContent = w.service + " " + duration(w.total_ms) + ", " + duration(now - w.at_unix_ms) + " ago";
    const bar = document.createElement("div");
    bar.className = "bar";
    bar.style.maxWidth = (60 * w.total_ms / longest).toFixed(2) + "em";
    for (const p of w.phases) {
      const seg = document.createElement("span");
      seg.style.width = (100 * p.ms / Math.max(w.total_ms, 0.001)).toFixed(3) + "%";
      seg.style.background = color(p.phase);
      seg.title = p.phase + ": " + duration(p.ms);
      bar.appendChild(seg);
    }
    row.append(label, bar);
    box.appendChild(row);
  }
  const legend = document.getElementById("legend");
  legend.replaceChildren();
  for (const [phase, c] of phaseColor) {
    const item = document.createElement("span");
    const sw = document.createElement("i");
    sw.style.background = c;
    item.append(sw, phase);
    legend.appendChild(item);
  }
}

async function refresh() {
  const status = document.getElementById("status");
  try {
    const headers = key ? { Authorization: "Bearer " + key } : {};
    const r = await fetch("/ui/state", { headers, cache: "no-store" });
    if (r.status === 401) {
      document.getElementById("key").hidden = false;
      status.textContent = "an API key is needed";
      return;
    }
    if (!r.ok) throw new Error("status " + r.status);
    const s = await r.json();
    drawServices(s.services);
    drawSwaps(s.swaps, s.now_unix_ms);
    status.textContent = "updated " + new Date(s.now_unix_ms).toLocaleTimeString();
    document.body.dataset.loaded = "1";
  } catch (e) {
    status.textContent = "the agent does not answer (" + e.message + ")";
  }
}

document.getElementById("key").addEventListener("submit", (ev) => {
  ev.preventDefault();
  key = document.getElementById("keyinput").value;
  sessionStorage.setItem("gpusnap-key", key);
  document.getElementById("key").hidden = true;
  refresh();
});

refresh();
setInterval(refresh, 2000);
