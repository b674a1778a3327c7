// The berth dashboard: one server-sent event stream (/api/stream) keeps `state` up to date, and
// each kind of message redraws only its own part of the page. No framework, no build step.

import { sparkline, stackedBar, usageBar } from "./charts.js";

const MAX_NODES_SHOWN = 200;

const state = {
  prefix: "",
  bus: { connected: false, error: "connecting" },
  online: false, // the stream to this server is open
  services: [],
  nodes: new Map(), // nodename -> {nodename, labels, bars}
  nodesAvailable: null,
  pools: [],
  poolsAvailable: null,
  events: [],
  charts: [],
  agents: [],
  agent: null, // the metrics agent whose charts are shown
  series: {}, // agent -> metric -> [[time, value], ...]
};

// -- small helpers -------------------------------------------------------------------------------

const $ = (selector) => document.querySelector(selector);

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === null || value === undefined) continue;
    if (key === "class") node.className = value;
    else node.setAttribute(key, value);
  }
  node.append(...children.filter((c) => c !== null && c !== undefined));
  return node;
}

function number(value) {
  if (!Number.isFinite(value)) return String(value);
  if (Number.isInteger(value)) return value.toLocaleString("en");
  return String(Number(value.toFixed(Math.abs(value) < 10 ? 2 : 1)));
}

function bytes(value) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
  let i = 0;
  while (Math.abs(value) >= 1024 && i < units.length - 1) {
    value /= 1024;
    i += 1;
  }
  return `${number(value)} ${units[i]}`;
}

function amount(value, unit) {
  if (unit === "bytes") return bytes(value);
  if (unit === "ratio") return `${(value * 100).toFixed(1)}%`;
  return number(value);
}

function usedOfTotal({ used, total, unit }) {
  if (unit === "bytes") return `${bytes(used)} / ${bytes(total)}`;
  return `${number(used)} / ${number(total)}${unit === "cores" ? " cores" : ""}`;
}

function ago(seconds) {
  if (seconds < 60) return `${Math.max(0, Math.floor(seconds))} s`;
  if (seconds < 3600) return `${Math.floor(seconds / 60)} min`;
  if (seconds < 86400) return `${Math.floor(seconds / 3600)} h`;
  return `${Math.floor(seconds / 86400)} d`;
}

function clock(unixSeconds) {
  const d = new Date(unixSeconds * 1000);
  return [d.getHours(), d.getMinutes(), d.getSeconds()].map((n) => String(n).padStart(2, "0")).join(":");
}

const now = () => Date.now() / 1000;

// -- header --------------------------------------------------------------------------------------

function renderStatus() {
  $("#prefix").textContent = state.prefix ? `prefix ${state.prefix}` : "";
  const pill = $("#status");
  let text, level;
  if (!state.online) [text, level] = ["reconnecting to the dashboard…", "warn"];
  else if (!state.bus.connected) [text, level] = [state.bus.error || "NATS unreachable", "bad"];
  else [text, level] = ["live", "good"];
  pill.textContent = text;
  pill.dataset.level = level;
}

// -- services ------------------------------------------------------------------------------------

function renderServices() {
  const box = $("#services");
  box.replaceChildren(
    ...state.services.map((service) => {
      const n = service.instances.length;
      const tile = el("div", {
        class: `service ${n ? "present" : "absent"}`,
        "data-service": service.name,
        "data-instances": String(n),
      });
      tile.append(
        el("div", { class: "service-head" },
          el("span", { class: "dot" }),
          el("b", {}, service.name),
          el("span", { class: "count" }, n ? `${n} instance${n > 1 ? "s" : ""}` : "absent")),
      );
      if (!n) {
        tile.append(el("p", { class: "muted" }, `no instance of ${service.service} answers`));
        return tile;
      }
      const rows = service.instances.map((i) =>
        el("tr", {},
          el("td", { title: i.id }, i.id.slice(0, 8), i.node ? el("span", { class: "muted" }, ` ${i.node}`) : null),
          el("td", {}, i.started ? ago(now() - i.started) : "?"),
          el("td", { class: "num" }, number(i.requests)),
          el("td", { class: `num ${i.errors ? "bad" : ""}` }, number(i.errors)),
          el("td", { class: "num" }, `${number(i.avg_ms)} ms`)));
      tile.append(
        el("table", { class: "instances" },
          el("thead", {}, el("tr", {},
            el("th", {}, "instance"), el("th", {}, "up"),
            ...["requests", "errors", "avg"].map((h) => el("th", { class: "num" }, h)))),
          el("tbody", {}, ...rows)),
      );
      return tile;
    }),
  );
}

// -- nodes ---------------------------------------------------------------------------------------

// The node's status as its agent keeps it: up, draining, or down once the agent's lease lapsed.
function agentBadge(node) {
  const agent = node.agent;
  const text = agent ? `${node.status} · agent ${agent.address} · ${agent.running} running` : `${node.status} · no agent`;
  const title = agent ? `lease of ${agent.ttl_seconds} s; CPUs pinned by ${agent.pinning || "-"}` : "added by hand: always up";
  return el("span", { class: `status status-${node.status}`, "data-status": node.status, title }, text);
}

function nodeRow(node) {
  const labels = Object.entries(node.labels).map(([k, v]) => `${k}=${v}`);
  const row = el("div", { class: "node", "data-node": node.nodename });
  row.dataset.search = [node.nodename, ...labels].join(" ").toLowerCase();
  row.append(
    el("div", { class: "node-head" },
      el("b", {}, node.nodename),
      agentBadge(node),
      ...labels.map((label) => el("span", { class: "label" }, label))),
  );
  const bars = el("div", { class: "bars" });
  for (const bar of node.bars) {
    bars.append(
      el("div", {
        class: "bar",
        "data-plugin": bar.plugin,
        "data-resource": bar.resource,
        "data-used": String(bar.used),
        "data-total": String(bar.total),
        title: `${bar.plugin}: ${bar.resource}${bar.note ? ` (${bar.note})` : ""}`,
      },
      el("span", { class: `bar-name plugin-${bar.plugin}` }, bar.resource),
      usageBar(bar.used, bar.total),
      el("span", { class: "bar-text" }, usedOfTotal(bar) + (bar.note ? " (shared)" : ""))),
    );
  }
  if (!node.bars.length) bars.append(el("span", { class: "muted" }, "no capacity"));
  row.append(bars);
  return row;
}

function renderNodes() {
  const box = $("#nodes");
  const names = [...state.nodes.keys()].sort();
  box.replaceChildren(...names.map((name) => nodeRow(state.nodes.get(name))));
  filterNodes();
}

function upsertNode(node) {
  const box = $("#nodes");
  const row = nodeRow(node);
  const old = box.querySelector(`[data-node="${CSS.escape(node.nodename)}"]`);
  state.nodes.set(node.nodename, node);
  if (old) old.replaceWith(row);
  else {
    const next = [...box.children].find((child) => child.dataset.node > node.nodename);
    box.insertBefore(row, next ?? null);
  }
  filterNodes();
}

function removeNode(name) {
  state.nodes.delete(name);
  $("#nodes").querySelector(`[data-node="${CSS.escape(name)}"]`)?.remove();
  filterNodes();
}

function filterNodes() {
  const words = $("#node-filter").value.toLowerCase().split(/\s+/).filter(Boolean);
  let matching = 0;
  for (const row of $("#nodes").children) {
    const match = words.every((w) => row.dataset.search.includes(w));
    if (match) matching += 1;
    row.hidden = !match || matching > MAX_NODES_SHOWN;
  }
  const total = state.nodes.size;
  let note = `${total} node${total === 1 ? "" : "s"}`;
  if (matching !== total) note += `, ${matching} matching`;
  if (matching > MAX_NODES_SHOWN) note += `, first ${MAX_NODES_SHOWN} shown`;
  $("#node-count").textContent = note;
  const absent = state.nodesAvailable === false;
  $("#nodes-note").textContent = absent ? "allocation is not answering: the nodes as last read" : "";
  $("#nodes-empty").hidden = total > 0 || absent;
}

// -- pools ---------------------------------------------------------------------------------------

function strategyText(strategy) {
  if (strategy.type === "const") return `const ${strategy.num}`;
  if (strategy.type === "reactive") return `reactive ${strategy.min}–${strategy.max}`;
  return strategy.type ?? "?";
}

function renderPools() {
  const body = $("#pools tbody");
  body.replaceChildren(
    ...state.pools.map((pool) => {
      const cooling = pool.cooling_until > now();
      const unsold = pool.idle + pool.warming;
      const status = cooling ? `cooling until ${clock(pool.cooling_until)}` : pool.idle >= pool.target ? "ready" : "warming";
      return el("tr", {
        "data-pool": `${pool.user}/${pool.name}`,
        "data-idle": String(pool.idle),
        "data-warming": String(pool.warming),
        "data-sold": String(pool.sold),
        "data-target": String(pool.target),
      },
      el("td", {}, el("span", { class: "muted" }, `${pool.user}/`), el("b", {}, pool.name)),
      el("td", {}, strategyText(pool.strategy)),
      el("td", {}, stackedBar(
        [{ value: pool.idle, cls: "idle" }, { value: pool.warming, cls: "warming" }],
        Math.max(pool.target, unsold, 1))),
      el("td", { class: "num" }, String(pool.idle)),
      el("td", { class: "num" }, String(pool.warming)),
      el("td", { class: "num" }, String(pool.target)),
      el("td", { class: "num" }, String(pool.sold)),
      el("td", { class: `pool-status ${cooling ? "bad" : pool.idle >= pool.target ? "good" : "warn"}` }, status));
    }),
  );
  $("#pools-empty").hidden = state.pools.length > 0;
  $("#pools-note").textContent = state.poolsAvailable === false ? "broker is not answering: the pools as last read" : "";
}

// -- events --------------------------------------------------------------------------------------

function eventItem(event) {
  return el("li", { "data-service": event.service, "data-type": event.type },
    el("time", {}, event.time ? clock(event.time) : ""),
    el("span", { class: "subject" }, event.subject),
    el("span", { class: "detail" }, event.detail));
}

function renderEvents() {
  $("#events").replaceChildren(...state.events.slice().reverse().map(eventItem));
  $("#events-empty").hidden = state.events.length > 0;
}

function addEvent(event) {
  state.events.push(event);
  const list = $("#events");
  list.prepend(eventItem(event));
  while (state.events.length > 100) {
    state.events.shift();
    list.lastElementChild?.remove();
  }
  $("#events-empty").hidden = true;
}

// -- metrics -------------------------------------------------------------------------------------

function renderAgents() {
  if (!state.agents.includes(state.agent)) state.agent = state.agents[0] ?? null;
  const select = $("#agent");
  select.replaceChildren(...state.agents.map((a) => el("option", { value: a }, a)));
  select.value = state.agent ?? "";
  select.hidden = state.agents.length === 0;
  $("#metrics-empty").hidden = state.agents.length > 0;
  renderCharts();
}

function chartCard(chart) {
  const points = state.series[state.agent]?.[chart.metric] ?? [];
  const card = el("div", { class: "chart", "data-chart": chart.metric, "data-count": String(points.length) });
  const values = points.map((p) => p[1]);
  const last = values.length ? amount(values[values.length - 1], chart.unit) : "–";
  card.append(
    el("div", { class: "chart-head" },
      el("span", {}, chart.title, el("span", { class: "metric-name" }, chart.metric)),
      el("b", {}, last)),
    sparkline(points, { low: chart.unit === "bytes" && values.length ? Math.min(...values) * 0.9 : 0 }),
    el("div", { class: "chart-foot muted" }, values.length
      ? `min ${amount(Math.min(...values), chart.unit)} · max ${amount(Math.max(...values), chart.unit)}`
      : "waiting for a sample"),
  );
  return card;
}

function renderCharts(only = null) {
  const box = $("#charts");
  if (!state.agent) {
    box.replaceChildren();
    return;
  }
  if (only) {
    const chart = state.charts.find((c) => c.metric === only);
    box.querySelector(`[data-chart="${CSS.escape(only)}"]`)?.replaceWith(chartCard(chart));
    return;
  }
  box.replaceChildren(...state.charts.map(chartCard));
}

// -- the stream ----------------------------------------------------------------------------------

const handlers = {
  snapshot(data) {
    Object.assign(state, {
      prefix: data.prefix, bus: data.bus, services: data.services,
      nodes: new Map(data.nodes.nodes.map((n) => [n.nodename, n])), nodesAvailable: data.nodes.available,
      pools: data.pools.pools, poolsAvailable: data.pools.available,
      events: data.events, charts: data.charts, agents: data.agents, series: data.series,
    });
    renderStatus();
    renderServices();
    renderNodes();
    renderPools();
    renderEvents();
    renderAgents();
    document.body.dataset.ready = "true";
  },
  bus(data) {
    state.bus = data;
    renderStatus();
  },
  services(data) {
    state.services = data;
    renderServices();
  },
  nodes(data) {
    state.nodes = new Map(data.nodes.map((n) => [n.nodename, n]));
    state.nodesAvailable = data.available;
    renderNodes();
  },
  node: upsertNode,
  "node-removed": (data) => removeNode(data.nodename),
  pools(data) {
    state.pools = data.pools;
    state.poolsAvailable = data.available;
    renderPools();
  },
  events(data) {
    state.events = data;
    renderEvents();
  },
  event: addEvent,
  agents(data) {
    state.agents = data.agents;
    for (const agent of Object.keys(state.series)) if (!data.agents.includes(agent)) delete state.series[agent];
    renderAgents();
  },
  sample({ node, metric, t, v }) {
    const series = (state.series[node] ??= {});
    const points = (series[metric] ??= []);
    points.push([t, v]);
    if (points.length > 180) points.shift();
    if (node === state.agent) renderCharts(metric);
  },
};

function connect() {
  const source = new EventSource("/api/stream");
  source.onopen = () => {
    state.online = true;
    renderStatus();
  };
  source.onerror = () => {
    state.online = false; // EventSource tries again by itself
    renderStatus();
  };
  for (const [kind, handle] of Object.entries(handlers)) {
    source.addEventListener(kind, (message) => {
      handle(JSON.parse(message.data));
      $("#updated").textContent = `updated ${clock(now())}`;
    });
  }
}

$("#node-filter").addEventListener("input", filterNodes);
$("#agent").addEventListener("change", (e) => {
  state.agent = e.target.value;
  renderCharts();
});
// Ages ("up 3 min") and cooling ends move with the clock, not only with messages.
setInterval(() => {
  renderServices();
  renderPools();
}, 5000);
connect();
