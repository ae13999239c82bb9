// Panel 2: blocks per second per worker and event type, as sparklines over the last minutes.
import { drawSparkline, makeCanvas } from "./charts.js";
import { el, fmt, setText } from "./dom.js";

export const TYPE_COLORS = { stored: "#4cc38a", removed: "#f2994a", updated: "#9b8cff" };
const TYPES = Object.keys(TYPE_COLORS);
const WIDTH = 136;
const HEIGHT = 26;

export class RatesPanel {
  constructor(root, caption) {
    this.caption = caption;
    this.body = el("tbody");
    const head = el("tr", {}, el("th", {}, "worker"), ...TYPES.map((t) => el("th", { dataset: { type: t } }, t)));
    root.append(el("table", { class: "rates" }, el("thead", {}, head), this.body));
    this.rows = new Map();
    this.drawnEnd = null;
  }

  update(rates) {
    if (!rates) return;
    const names = Object.keys(rates.series).sort();
    const key = `${rates.end}|${names.join(",")}`;
    if (key === this.drawnEnd) return; // the series move once a step, not once a frame
    this.drawnEnd = key;
    for (const [name, row] of this.rows) {
      if (!(name in rates.series)) {
        row.tr.remove();
        this.rows.delete(name);
      }
    }
    let capacity = 0;
    for (const name of names) {
      for (const t of TYPES) capacity = Math.max(capacity, rates.series[name][t]?.length ?? 0);
    }
    for (const name of names) {
      const row = this.row(name);
      for (const t of TYPES) {
        const values = rates.series[name][t] ?? [];
        const cell = row.cells[t];
        drawSparkline(cell.chart, values, TYPE_COLORS[t], capacity);
        const peak = Math.max(0, ...values);
        setText(cell.now, `peak ${fmt.rate(peak)}/s`);
        cell.chart.canvas.title = `${name} ${t}: blocks per second, peak ${fmt.rate(peak)}`;
      }
    }
    const minutes = (capacity * rates.step_s) / 60;
    setText(this.caption, capacity ? `blocks/s, last ${minutes >= 1 ? `${fmt.num(minutes, 0)} min` : `${capacity * rates.step_s} s`}` : "");
  }

  row(name) {
    let row = this.rows.get(name);
    if (row) return row;
    const cells = {};
    const tr = el("tr", { dataset: { worker: name } }, el("th", { scope: "row" }, name));
    for (const t of TYPES) {
      const chart = makeCanvas(WIDTH, HEIGHT, "spark");
      const now = el("span", { class: "spark-now" });
      cells[t] = { chart, now };
      tr.append(el("td", { dataset: { type: t } }, chart.canvas, now));
    }
    row = { tr, cells };
    this.rows.set(name, row);
    const names = [...this.rows.keys()].sort();
    const next = this.rows.get(names[names.indexOf(name) + 1]);
    this.body.insertBefore(tr, next ? next.tr : null);
    return row;
  }
}
