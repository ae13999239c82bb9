// Panel 4: the router's recent decisions, newest on top, with every worker's cost.
import { el, fmt, setText } from "./dom.js";

function costs(decision) {
  const entries = Object.entries(decision.costs ?? {}).sort(([a], [b]) => (a < b ? -1 : 1));
  const finite = entries.map(([, c]) => c).filter(Number.isFinite);
  const top = Math.max(1e-9, ...finite.map(Math.abs));
  return el(
    "div",
    { class: "costs" },
    ...entries.map(([worker, cost]) => {
      const chosen = worker === decision.worker;
      const bar = el("i", { class: "cost-bar" });
      bar.style.width = `${Number.isFinite(cost) ? (Math.abs(cost) / top) * 100 : 100}%`;
      return el(
        "span",
        { class: chosen ? "cost chosen" : "cost", dataset: { worker }, title: `${worker}: cost ${cost}${chosen ? " (chosen)" : ""}` },
        bar,
        el("b", {}, worker),
        fmt.num(cost, Math.abs(cost) >= 100 ? 0 : 1),
      );
    }),
  );
}

function row(d) {
  const ratio = d.num_tokens > 0 ? d.expected_cached_tokens / d.num_tokens : 0;
  const fill = el("i");
  fill.style.width = `${Math.min(1, ratio) * 100}%`;
  return el(
    "tr",
    { class: "decision-row", dataset: { id: d.id, requestId: d.request_id ?? "", worker: d.worker } },
    el("td", { class: "time", title: fmt.time(d.t) }, fmt.clock(d.t)),
    el("td", { class: "request", title: d.request_id ?? "" }, d.request_id ?? "—"),
    el("td", {}, d.kind),
    el("td", {}, d.policy),
    el("td", { class: "chosen-worker" }, d.worker),
    el(
      "td",
      { class: "cached", title: `${d.expected_cached_tokens} of ${d.num_tokens} prompt tokens expected cached` },
      el("span", { class: "ratio" }, fill),
      `${fmt.int(d.expected_cached_tokens)} / ${fmt.int(d.num_tokens)}`,
    ),
    el("td", { class: d.fresh ? "fresh yes" : "fresh no", title: d.fresh ? "the index was fresh" : "routed on a stale index" }, d.fresh ? "fresh" : "stale"),
    el("td", {}, costs(d)),
  );
}

export class DecisionsPanel {
  constructor({ table, body, note, count }) {
    this.table = table;
    this.body = body;
    this.note = note;
    this.count = count;
    this.rows = new Map(); // decision id -> tr, for the decisions the server still lists
  }

  update(decisions) {
    const standalone = decisions === null || decisions === undefined;
    this.table.hidden = standalone;
    this.note.hidden = !standalone;
    if (standalone) {
      setText(this.count, "");
      return;
    }
    const listed = new Set();
    const fresh = [];
    for (const d of decisions) {
      listed.add(d.id);
      if (!this.rows.has(d.id)) fresh.push(d);
    }
    for (const [id, tr] of this.rows) {
      if (!listed.has(id)) {
        tr.remove();
        this.rows.delete(id);
      }
    }
    if (fresh.length) {
      const fragment = document.createDocumentFragment();
      for (const d of fresh.reverse()) {
        const tr = row(d);
        this.rows.set(d.id, tr);
        fragment.append(tr);
      }
      this.body.prepend(fragment); // newest first: decisions come newest last
    }
    setText(this.count, decisions.length ? `last ${decisions.length}` : "none yet");
  }
}
