// Panel 5: the prefix map — the most requested prefixes against the workers, each cell how many
// of the prefix's blocks that worker holds, so one sees where each prompt lives.
import { el, fmt, setText } from "./dom.js";

// What the prefixes are ranked by: the router's requests, else (standalone) the stored roots.
const BY_LABELS = { requests: "requests", stored: "times stored" };

function cell(prefix, worker) {
  const held = prefix.held?.[worker] ?? 0;
  const share = prefix.blocks > 0 ? held / prefix.blocks : 0;
  const td = el(
    "td",
    {
      class: held ? (share >= 1 ? "held all" : "held") : "held none",
      dataset: { worker, held },
      title: `${worker} holds ${held} of the ${prefix.blocks} blocks of ${prefix.prefix}`,
    },
    String(held),
  );
  td.style.setProperty("--share", share.toFixed(3));
  return td;
}

export class PrefixPanel {
  constructor({ table, caption }) {
    this.table = table;
    this.caption = caption;
    this.signature = "";
  }

  update(prefixes) {
    if (!prefixes) return;
    const signature = JSON.stringify(prefixes); // a few dozen rows: cheaper than diffing cells
    if (signature === this.signature) return;
    this.signature = signature;
    const workers = prefixes.workers ?? [];
    const by = BY_LABELS[prefixes.by] ?? prefixes.by;
    const head = el(
      "tr",
      {},
      el("th", { class: "prefix" }, "prefix (first block)"),
      el("th", { class: "num" }, by),
      el("th", { class: "num" }, "blocks"),
      ...workers.map((w) => el("th", { class: "w", dataset: { worker: w } }, w)),
    );
    const rows = prefixes.rows.map((p) =>
      el(
        "tr",
        { class: "prefix-row", dataset: { prefix: p.prefix } },
        el("th", { class: "prefix", scope: "row" }, el("code", { title: p.prefix }, p.prefix)),
        el("td", { class: "num count" }, fmt.int(p.count)),
        el("td", { class: "num blocks" }, fmt.int(p.blocks)),
        ...workers.map((w) => cell(p, w)),
      ),
    );
    const body = rows.length
      ? el("tbody", {}, ...rows)
      : el("tbody", {}, el("tr", {}, el("td", { class: "empty", colspan: 3 + workers.length }, "No prefixes seen yet.")));
    this.table.replaceChildren(el("thead", {}, head), body);
    setText(this.caption, `top ${prefixes.rows.length} by ${by}`);
  }
}
