// Tiny SVG charts, written for this page: a usage bar, a stacked bar, a sparkline, and the heat
// map's colour ramp. Each chart is a new <svg> element; the page replaces it when the data changes.

const NS = "http://www.w3.org/2000/svg";

function svg(tag, attrs = {}) {
  const el = document.createElementNS(NS, tag);
  for (const [key, value] of Object.entries(attrs)) el.setAttribute(key, value);
  return el;
}

function clamp01(x) {
  return Number.isFinite(x) ? Math.min(1, Math.max(0, x)) : 0;
}

// A bar filled to used/total; its class says how full it is (ok, high, full).
export function usageBar(used, total, { width = 90, height = 10 } = {}) {
  const fraction = total > 0 ? clamp01(used / total) : 0;
  const level = fraction >= 0.9 ? "full" : fraction >= 0.7 ? "high" : "ok";
  const root = svg("svg", { width, height, viewBox: `0 0 ${width} ${height}`, class: "usage-bar", role: "img" });
  root.append(
    svg("rect", { class: "track", x: 0, y: 0, width, height, rx: height / 2 }),
    svg("rect", { class: `fill ${level}`, x: 0, y: 0, width: (width * fraction).toFixed(1), height, rx: height / 2 }),
  );
  return root;
}

// Segments [{value, cls}] side by side, scaled so that `total` fills the width.
export function stackedBar(segments, total, { width = 160, height = 12 } = {}) {
  const root = svg("svg", { width, height, viewBox: `0 0 ${width} ${height}`, class: "stacked-bar", role: "img" });
  root.append(svg("rect", { class: "track", x: 0, y: 0, width, height, rx: 3 }));
  let x = 0;
  for (const { value, cls } of segments) {
    const w = total > 0 ? (width * value) / total : 0;
    if (w > 0) root.append(svg("rect", { class: `seg ${cls}`, x: x.toFixed(1), y: 0, width: Math.max(0, w - 1).toFixed(1), height, rx: 2 }));
    x += w;
  }
  return root;
}

// A line over [[time, value], ...] with the area below it shaded; y from `low` to the highest value.
export function sparkline(points, { width = 220, height = 48, low = 0, high = null } = {}) {
  const root = svg("svg", { width, height, viewBox: `0 0 ${width} ${height}`, class: "sparkline", role: "img" });
  if (points.length === 0) return root;
  const t0 = points[0][0];
  const t1 = points[points.length - 1][0];
  const values = points.map((p) => p[1]);
  const top = high ?? Math.max(...values);
  const bottom = Math.min(low, ...values);
  const span = top - bottom || 1;
  const pad = 2;
  const x = (t) => (t1 > t0 ? ((t - t0) / (t1 - t0)) * (width - 2 * pad) + pad : width - pad);
  const y = (v) => height - pad - ((v - bottom) / span) * (height - 2 * pad);
  const line = points.map(([t, v]) => `${x(t).toFixed(1)},${y(v).toFixed(1)}`).join(" ");
  const first = x(t0).toFixed(1);
  const last = x(t1).toFixed(1);
  root.append(
    svg("polygon", { class: "area", points: `${first},${height - pad} ${line} ${last},${height - pad}` }),
    svg("polyline", { class: "line", points: line }),
    svg("circle", { class: "dot", cx: last, cy: y(values[values.length - 1]).toFixed(1), r: 2.5 }),
  );
  return root;
}

// The heat map's colour ramp, from an idle node (pale) to a full one (red); past 1 stays red.
const HEAT = [
  [0, [237, 242, 247]],
  [0.25, [190, 224, 210]],
  [0.5, [242, 207, 110]],
  [0.75, [232, 137, 72]],
  [1, [196, 50, 72]],
];

// The colour of a fraction used (0..1) as `rgb(...)`.
export function heatColor(fraction) {
  const f = clamp01(fraction);
  let i = 1;
  while (i < HEAT.length - 1 && f > HEAT[i][0]) i += 1;
  const [[f0, c0], [f1, c1]] = [HEAT[i - 1], HEAT[i]];
  const t = (f - f0) / (f1 - f0);
  return `rgb(${c0.map((c, k) => Math.round(c + (c1[k] - c) * t)).join(",")})`;
}

// The ink that reads on `heatColor(fraction)`.
export function heatInk(fraction) {
  return clamp01(fraction) >= 0.7 ? "#ffffff" : "#1d2733";
}

// The ramp as a bar, for the legend.
export function heatLegend({ width = 140, height = 10 } = {}) {
  const root = svg("svg", { width, height, viewBox: `0 0 ${width} ${height}`, class: "heat-ramp", role: "img" });
  const gradient = svg("linearGradient", { id: "heat-ramp", x1: 0, x2: 1, y1: 0, y2: 0 });
  for (const [at, rgb] of HEAT) gradient.append(svg("stop", { offset: at, "stop-color": `rgb(${rgb.join(",")})` }));
  const defs = svg("defs");
  defs.append(gradient);
  root.append(defs, svg("rect", { x: 0, y: 0, width, height, rx: 3, fill: "url(#heat-ramp)" }));
  return root;
}
