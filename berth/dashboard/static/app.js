// The berth dashboard: one server-sent event stream (/api/stream) keeps `state` up to date, and
// each kind of message redraws only its own part of the page. No framework, no build step.

import { heatColor, heatInk, heatLegend, sparkline, stackedBar, usageBar } from "./charts.js";

const MAX_NODES_SHOWN = 200;
const MAX_CELLS = 2000; // heat map cells drawn
const COMPACT_CELLS = 150; // past this many cells, they are small squares without text
const PLUGIN_RANK = { cpumem: 0, storage: 1, gpu: 2 };

const state = {
  prefix: "",
  bus: { connected: false, error: "connecting" },
  online: false, // the stream to this server is open
  services: [],
  servicesAvailable: null, // null: not read yet (each part says "connecting…" until its first data)
  nodes: new Map(), // nodename -> {nodename, labels, bars}
  nodesAvailable: null,
  pools: [],
  poolsAvailable: null,
  events: [],
  eventsRead: false,
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

function percent(fraction) {
  return `${Math.round(fraction * 100)}%`;
}

// The line a panel shows when it lists nothing: "connecting…" until its first data arrives (never
// a claim that there is nothing), then what the emptiness means; hidden while there is something.
function emptyLine(selector, { pending, empty }, ...said) {
  const line = $(selector);
  line.dataset.pending = String(pending);
  line.hidden = !pending && !empty;
  if (pending) line.replaceChildren("connecting…");
  else if (empty) line.replaceChildren(...said);
}

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

function errorsTitle(instance) {
  const last = Object.entries(instance.last_errors ?? {});
  return last.length ? `latest error of each endpoint:\n${last.map(([name, error]) => `${name}: ${error}`).join("\n")}` : null;
}

function renderServices() {
  const box = $("#services");
  const pending = state.servicesAvailable === null;
  box.replaceChildren(
    ...state.services.map((service) => {
      const n = service.instances.length;
      const tile = el("div", {
        class: `service ${n ? "present" : pending ? "pending" : "absent"}`,
        "data-service": service.name,
        "data-instances": String(n),
      });
      tile.append(
        el("div", { class: "service-head" },
          el("span", { class: "dot" }),
          el("b", {}, service.name),
          el("span", { class: "count" }, n ? `${n} instance${n > 1 ? "s" : ""}` : pending ? "connecting…" : "absent")),
      );
      if (!n) {
        if (!pending) tile.append(el("p", { class: "muted" }, `no instance of ${service.service} answers`));
        return tile;
      }
      const rows = service.instances.map((i) =>
        el("tr", { "data-instance": i.id, "data-requests": String(i.requests) },
          el("td", { title: i.id }, i.id.slice(0, 8), i.node ? el("span", { class: "muted" }, ` ${i.node}`) : null),
          el("td", {}, i.started ? ago(now() - i.started) : "?"),
          el("td", { class: "num" }, number(i.requests)),
          el("td", { class: `num ${i.errors ? "bad" : ""}`, "data-errors": String(i.errors), title: errorsTitle(i) }, number(i.errors)),
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
  $("#services-note").textContent = state.servicesAvailable === false ? "the services could not be asked: as last read" : "";
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
  row.dataset.search = searchText(node);
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
  renderHeatmap();
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
  renderHeatmap();
}

function removeNode(name) {
  state.nodes.delete(name);
  $("#nodes").querySelector(`[data-node="${CSS.escape(name)}"]`)?.remove();
  filterNodes();
  renderHeatmap();
}

// The selection both node panels show: every word of the filter in the node's name or labels.
function selectionWords() {
  return $("#node-filter").value.toLowerCase().split(/\s+/).filter(Boolean);
}

function searchText(node) {
  return [node.nodename, ...Object.entries(node.labels).map(([k, v]) => `${k}=${v}`)].join(" ").toLowerCase();
}

function filterNodes() {
  const words = selectionWords();
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
  $("#node-count").textContent = state.nodesAvailable === null && !total ? "" : note;
  const absent = state.nodesAvailable === false;
  $("#nodes-note").textContent = absent ? "allocation is not answering: the nodes as last read" : "";
  emptyLine("#nodes-empty", { pending: state.nodesAvailable === null && !total, empty: !total && !absent },
    "no node yet: add one with ", el("code", {}, "resource.add-node"));
}

// -- placement heat map --------------------------------------------------------------------------

// One cell per node of the selection, coloured by how much of one resource is used, grouped by a
// label: spread placements colour the cells alike, packed ones make a few hot and the rest pale.
const heat = { measure: "cpu", group: "" };

function measures() {
  const seen = new Map(); // resource -> plugin, in the order the bars come
  for (const node of state.nodes.values()) for (const bar of node.bars) if (!seen.has(bar.resource)) seen.set(bar.resource, bar.plugin);
  return [...seen].sort((a, b) => (PLUGIN_RANK[a[1]] ?? 9) - (PLUGIN_RANK[b[1]] ?? 9)).map(([resource]) => resource);
}

function labelKeys() {
  const keys = new Set();
  for (const node of state.nodes.values()) for (const key of Object.keys(node.labels)) keys.add(key);
  return [...keys].sort();
}

// Keep a <select>'s options to `values` (a first option `none`, if given), and its choice if it is still one.
function syncSelect(select, values, chosen, none = null) {
  const options = [...(none === null ? [] : [["", none]]), ...values.map((v) => [v, v])];
  if (select.options.length !== options.length || options.some(([v], i) => select.options[i].value !== v)) {
    select.replaceChildren(...options.map(([value, text]) => el("option", { value }, text)));
  }
  const value = options.some(([v]) => v === chosen) ? chosen : (options[0]?.[0] ?? "");
  select.value = value;
  return value;
}

function heatCell(node, measure) {
  const bar = node.bars.find((b) => b.resource === measure);
  const fraction = bar ? (bar.total > 0 ? bar.used / bar.total : 0) : null;
  const labels = Object.entries(node.labels).map(([k, v]) => `${k}=${v}`);
  const title = [
    `${node.nodename} (${node.status})${labels.length ? ` ${labels.join(" ")}` : ""}`,
    ...node.bars.map((b) => `${b.resource}: ${usedOfTotal(b)}${b.total > 0 ? ` (${percent(b.used / b.total)})` : ""}`),
  ].join("\n");
  const cell = el("div", {
    class: `heat-cell status-${node.status}${fraction === null ? " none" : ""}${fraction > 1 ? " over" : ""}`,
    "data-heat-node": node.nodename,
    "data-fraction": fraction === null ? "" : fraction.toFixed(3),
    "data-status": node.status,
    title,
  },
  el("span", { class: "heat-name" }, node.nodename),
  el("span", { class: "heat-value" }, fraction === null ? "–" : percent(fraction)));
  if (fraction !== null) {
    cell.style.background = heatColor(fraction);
    cell.style.color = heatInk(fraction);
  }
  return cell;
}

function groupSummary(name, nodes, measure) {
  const fractions = nodes
    .map((n) => n.bars.find((b) => b.resource === measure))
    .filter((b) => b && b.total > 0)
    .map((b) => b.used / b.total);
  let text = `${nodes.length} node${nodes.length === 1 ? "" : "s"}`;
  if (fractions.length) {
    const mean = fractions.reduce((a, b) => a + b, 0) / fractions.length;
    text += ` · ${measure} ${percent(Math.min(...fractions))}–${percent(Math.max(...fractions))}, mean ${percent(mean)}`;
  }
  return el("div", { class: "heat-group-name" }, name ? el("b", {}, name) : null, name ? " · " : null, text);
}

function renderHeatmap() {
  const [resources, keys] = [measures(), labelKeys()];
  heat.measure = syncSelect($("#heat-measure"), resources, heat.measure);
  heat.group = syncSelect($("#heat-group"), keys, heat.group, "none");
  $("#heat-measure").parentElement.hidden = !resources.length;
  $("#heat-group").parentElement.hidden = !keys.length;
  const words = selectionWords();
  const names = [...state.nodes.keys()].sort();
  const selected = names.map((name) => state.nodes.get(name)).filter((node) => words.every((w) => searchText(node).includes(w)));
  const shown = selected.slice(0, MAX_CELLS);
  const groups = new Map();
  for (const node of shown) {
    const key = heat.group ? (node.labels[heat.group] === undefined ? null : `${heat.group}=${node.labels[heat.group]}`) : "";
    if (!groups.has(key)) groups.set(key, []);
    groups.get(key).push(node);
  }
  const order = [...groups.keys()].sort((a, b) => (a === null) - (b === null) || String(a).localeCompare(String(b)));
  const box = $("#heatmap");
  box.classList.toggle("compact", shown.length > COMPACT_CELLS);
  box.replaceChildren(...order.map((key) => {
    const nodes = groups.get(key);
    return el("div", { class: "heat-group", "data-group": key ?? `no ${heat.group}` },
      groupSummary(key === null ? `no ${heat.group}` : key, nodes, heat.measure),
      el("div", { class: "heat-cells" }, ...nodes.map((node) => heatCell(node, heat.measure))));
  }));
  let count = `${selected.length} of ${names.length} node${names.length === 1 ? "" : "s"}`;
  if (selected.length > MAX_CELLS) count += `, first ${MAX_CELLS} shown`;
  $("#heat-count").textContent = names.length ? count : "";
  const legend = $("#heat-legend");
  legend.hidden = !shown.length;
  if (shown.length) {
    legend.replaceChildren(
      el("span", {}, `${heat.measure} used`), el("span", {}, "0%"), heatLegend(), el("span", {}, "100%"),
      el("span", { class: "heat-key status-down" }, "down"), el("span", { class: "heat-key none" }, "–"),
      el("span", {}, `no ${heat.measure}`));
  }
  emptyLine("#heat-empty", { pending: state.nodesAvailable === null && !names.length, empty: !selected.length },
    names.length ? "no node matches the selection" : "no node to place on yet");
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
  emptyLine("#pools-empty", { pending: state.poolsAvailable === null, empty: !state.pools.length },
    "no warm pool: add one with ", el("code", {}, "broker.add-broker"));
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
  emptyLine("#events-empty", { pending: !state.eventsRead && !state.events.length, empty: !state.events.length }, "no event yet");
}

function addEvent(event) {
  state.events.push(event);
  const list = $("#events");
  list.prepend(eventItem(event));
  while (state.events.length > 100) {
    state.events.shift();
    list.lastElementChild?.remove();
  }
  emptyLine("#events-empty", { pending: false, empty: false });
}

// -- metrics -------------------------------------------------------------------------------------

function renderAgents() {
  if (!state.agents.includes(state.agent)) state.agent = state.agents[0] ?? null;
  const select = $("#agent");
  select.replaceChildren(...state.agents.map((a) => el("option", { value: a }, a)));
  select.value = state.agent ?? "";
  select.hidden = state.agents.length === 0;
  emptyLine("#metrics-empty", { pending: state.servicesAvailable === null && !state.agents.length, empty: !state.agents.length },
    "no metrics agent answers");
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
      prefix: data.prefix, bus: data.bus, services: data.services.services, servicesAvailable: data.services.available,
      nodes: new Map(data.nodes.nodes.map((n) => [n.nodename, n])), nodesAvailable: data.nodes.available,
      pools: data.pools.pools, poolsAvailable: data.pools.available,
      events: data.events, eventsRead: data.events_read, charts: data.charts, agents: data.agents, series: data.series,
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
    state.services = data.services;
    state.servicesAvailable = data.available;
    renderServices();
    renderAgents();
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
    state.eventsRead = true;
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

$("#node-filter").addEventListener("input", () => {
  filterNodes();
  renderHeatmap();
});
$("#heat-measure").addEventListener("change", (e) => {
  heat.measure = e.target.value;
  renderHeatmap();
});
$("#heat-group").addEventListener("change", (e) => {
  heat.group = e.target.value;
  renderHeatmap();
});
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
