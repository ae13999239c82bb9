// Panel 6: the event consumer's health, and the dashboard stream's own.
import { el, fmt, setText } from "./dom.js";

const FIELDS = [
  ["apply_lag_ms", "apply lag", (c) => fmt.ms(c.apply_lag_ms)],
  ["synced", "synced workers", (c) => `${fmt.int(c.synced_workers)} / ${fmt.int(c.workers)}`],
  ["entries", "stream entries", (c) => fmt.int(c.entries)],
  ["events", "events", (c) => fmt.int(c.events)],
  ["blocks", "blocks", (c) => fmt.int(c.blocks)],
  ["resyncs", "resyncs", (c) => fmt.int(c.resyncs)],
  ["malformed", "malformed", (c) => fmt.int(c.malformed)],
  ["stale_entries", "stale entries", (c) => fmt.int(c.stale_entries)],
  ["skipped_entries", "skipped entries", (c) => fmt.int(c.skipped_entries)],
  ["yields", "yields", (c) => fmt.int(c.yields)],
];
// Counters that mean trouble when they are not zero.
const ALARMS = new Set(["resyncs", "malformed", "stale_entries", "skipped_entries"]);

export class ConsumerPanel {
  constructor({ list, reasons }) {
    this.reasons = reasons;
    this.values = {};
    for (const [key, label] of FIELDS) {
      this.values[key] = el("dd", { dataset: { stat: key } });
      list.append(el("div", { class: "kv" }, el("dt", {}, label), this.values[key]));
    }
    this.reasonsKey = "";
  }

  update(consumer) {
    if (!consumer) return;
    for (const [key, , format] of FIELDS) {
      const dd = this.values[key];
      setText(dd, format(consumer));
      dd.classList.toggle("alarm", ALARMS.has(key) && consumer[key] > 0);
    }
    const reasons = Object.entries(consumer.resync_reasons ?? {}).sort((a, b) => b[1] - a[1]);
    const key = JSON.stringify(reasons);
    if (key === this.reasonsKey) return;
    this.reasonsKey = key;
    this.reasons.replaceChildren(
      ...(reasons.length
        ? reasons.map(([reason, n]) => el("li", { dataset: { reason } }, el("code", {}, reason), ` × ${fmt.int(n)}`))
        : [el("li", { class: "muted" }, "no resyncs")]),
    );
  }
}
