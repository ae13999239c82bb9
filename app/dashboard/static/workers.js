// Panel 1: a card per worker — its state, blocks per tier as stacked bars, load and freshness.
import { el, fmt, setAttr, setText, setWidth } from "./dom.js";

const TIERS = [
  ["gpu", "GPU"],
  ["host", "host"],
];
const STATS = [
  ["hit_rate", "hit rate", (w) => fmt.pct(w.hit_rate)],
  ["running", "running", (w) => fmt.int(w.running)],
  ["waiting", "waiting", (w) => fmt.int(w.waiting)],
  ["decisions", "routed", (w) => fmt.int(w.decisions)],
  ["heartbeat", "heartbeat", (w) => fmt.age(w.heartbeat_age_s)],
  ["lag", "index lag", (w) => fmt.ms(w.lag_ms)],
];

function tierRow(key, label) {
  const parts = {
    used: el("i", { class: "seg used" }),
    cached: el("i", { class: "seg cached" }),
    free: el("i", { class: "seg free" }),
  };
  const bar = el("div", { class: "bar" }, parts.used, parts.cached, parts.free);
  const numbers = el("span", { class: "tier-num" });
  const row = el("div", { class: "tier", dataset: { tier: key } }, el("span", { class: "tier-name" }, label), bar, numbers);
  return { row, bar, parts, numbers };
}

function makeCard(name) {
  const badge = el("span", { class: "badge state" });
  // Routed by what was sent to it (no KV events: kvmesh register), said on the card.
  const approximate = el(
    "span",
    { class: "tag approximate", title: "no KV events: routed by what routers sent it" },
    "approximate",
  );
  const model = el("span", { class: "model" });
  const url = el("span", { class: "url" });
  const tiers = Object.fromEntries(TIERS.map(([key, label]) => [key, tierRow(key, label)]));
  const stats = {};
  const grid = el("dl", { class: "stats" });
  for (const [key, label] of STATS) {
    stats[key] = el("dd", { dataset: { stat: key } });
    grid.append(el("div", {}, el("dt", {}, label), stats[key]));
  }
  const root = el(
    "article",
    { class: "card worker", dataset: { worker: name } },
    el("header", {}, el("span", { class: "worker-name" }, name), badge, approximate, model, url),
    ...TIERS.map(([key]) => tiers[key].row),
    grid,
  );
  return { root, badge, approximate, model, url, tiers, stats };
}

function updateTier(tier, blocks) {
  const capacity = blocks?.capacity ?? 0;
  if (capacity <= 0) {
    setAttr(tier.row, "data-empty", "");
    setText(tier.numbers, "none");
    setAttr(tier.bar, "title", "this worker has no such tier");
    for (const part of Object.values(tier.parts)) setWidth(part, 0);
    return;
  }
  setAttr(tier.row, "data-empty", null);
  for (const key of ["used", "cached", "free"]) setWidth(tier.parts[key], blocks[key] / capacity);
  setText(tier.numbers, `${fmt.int(blocks.used + blocks.cached)} / ${fmt.int(capacity)}`);
  setAttr(
    tier.bar,
    "title",
    `${blocks.used} used by running sequences, ${blocks.cached} cached (reusable), ` +
      `${blocks.free} free, of ${capacity} blocks`,
  );
}

// Why the badge says what it says: an operator's cordon or drain, or why the data is stale.
function badgeTitle(w) {
  if (w.cordon) {
    const since = new Date(w.cordon.since * 1000).toLocaleTimeString();
    const left = w.cordon.in_flight
      ? `; in flight: ${w.cordon.in_flight.running} running, ${w.cordon.in_flight.waiting} waiting`
      : "";
    return `${w.cordon.state} by an operator since ${since}${left}`;
  }
  return w.stale_reason || null;
}

export class WorkerCards {
  constructor(root) {
    this.root = root;
    this.cards = new Map();
    this.empty = el("p", { class: "empty" }, "No workers yet.");
    root.append(this.empty);
  }

  update(workers) {
    const seen = new Set();
    for (const w of workers) {
      seen.add(w.worker);
      let card = this.cards.get(w.worker);
      if (!card) {
        card = makeCard(w.worker);
        this.cards.set(w.worker, card);
        this.insertSorted(w.worker, card.root);
      }
      setAttr(card.root, "data-state", w.state);
      setText(card.badge, w.state);
      setAttr(card.badge, "data-state", w.state);
      setAttr(card.badge, "title", badgeTitle(w));
      card.approximate.hidden = !w.approximate;
      setText(card.model, w.model ?? "");
      setText(card.url, w.url ?? "");
      for (const [key] of TIERS) updateTier(card.tiers[key], w[key]);
      for (const [key, , format] of STATS) setText(card.stats[key], format(w));
    }
    for (const [name, card] of this.cards) {
      if (!seen.has(name)) {
        card.root.remove();
        this.cards.delete(name);
      }
    }
    this.empty.hidden = this.cards.size > 0;
  }

  insertSorted(name, node) {
    const after = [...this.cards.keys()].filter((other) => other > name).sort()[0];
    const before = after ? this.cards.get(after).root : null;
    if (before && before.parentNode === this.root) this.root.insertBefore(node, before);
    else this.root.append(node);
  }
}
