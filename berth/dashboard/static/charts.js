// Tiny SVG charts, written for this page: a usage bar, a stacked bar and a sparkline.
// Each function returns a new <svg> element; the page replaces it when the data changes.

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
