// Small DOM and formatting helpers shared by the panels. Everything the server sends is put on
// the page as text (textContent, attributes), never as HTML.

/** Makes an element: el("td", {class: "num", title: "x"}, "text", child, ...). */
export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "class") node.className = value;
    else if (key === "dataset") Object.assign(node.dataset, value);
    else node.setAttribute(key, value === true ? "" : String(value));
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

/** Writes text only when it changed: no needless style recalculation on a 4 Hz update. */
export function setText(node, text) {
  const value = String(text);
  if (node.textContent !== value) node.textContent = value;
}

export function setAttr(node, name, value) {
  if (value === null || value === undefined) {
    if (node.hasAttribute(name)) node.removeAttribute(name);
  } else if (node.getAttribute(name) !== String(value)) {
    node.setAttribute(name, String(value));
  }
}

export function setWidth(node, fraction) {
  const value = `${(Math.max(0, Math.min(1, fraction)) * 100).toFixed(2)}%`;
  if (node.style.width !== value) node.style.width = value;
}

export const fmt = {
  int(n) {
    return Number.isFinite(n) ? Math.round(n).toLocaleString("en-US") : "—";
  },
  pct(x) {
    return Number.isFinite(x) ? `${(x * 100).toFixed(x >= 0.995 || x === 0 ? 0 : 1)}%` : "—";
  },
  num(x, digits = 1) {
    if (!Number.isFinite(x)) return "—";
    if (Math.abs(x) >= 1000) return Math.round(x).toLocaleString("en-US");
    return x.toFixed(digits);
  },
  rate(x) {
    if (!Number.isFinite(x)) return "—";
    if (x >= 10_000) return `${(x / 1000).toFixed(0)}k`;
    if (x >= 1000) return `${(x / 1000).toFixed(1)}k`;
    return x >= 10 ? x.toFixed(0) : x.toFixed(1).replace(/\.0$/, "");
  },
  age(seconds) {
    if (!Number.isFinite(seconds)) return "—";
    if (seconds < 10) return `${seconds.toFixed(1)} s`;
    if (seconds < 120) return `${seconds.toFixed(0)} s`;
    if (seconds < 7200) return `${(seconds / 60).toFixed(0)} min`;
    return `${(seconds / 3600).toFixed(1)} h`;
  },
  ms(x) {
    if (!Number.isFinite(x)) return "—";
    return x >= 1000 ? `${(x / 1000).toFixed(1)} s` : `${x.toFixed(x >= 10 ? 0 : 1)} ms`;
  },
  /** Local wall-clock time to the tenth of a second (the full time is in `timeTitle`). */
  clock(unixSeconds) {
    return fmt.time(unixSeconds).slice(0, 10);
  },
  time(unixSeconds) {
    if (!Number.isFinite(unixSeconds)) return "—";
    const d = new Date(unixSeconds * 1000);
    const pad = (n, w = 2) => String(n).padStart(w, "0");
    return `${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}.${pad(d.getMilliseconds(), 3)}`;
  },
};
