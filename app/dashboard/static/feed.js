// Panel 3: the live feed of KV events, filterable by worker and type, with pause and resume.
//
// Items are kept in a bounded buffer (BUFFER, newest last) whatever the filters or the pause;
// the DOM shows at most MAX_ROWS of them, newest on top. Paused, the list does not move; on
// resume (or a filter change) it is rebuilt from the newest matching items.
import { el, fmt, setText } from "./dom.js";

const MAX_ROWS = 200;
const BUFFER = 2000;
const SHOWN_HASHES = 2;
const SHORT_HASH = 8; // hex digits shown; the row's title has them whole
export const EVENT_TYPES = ["stored", "removed", "updated", "created"];

function row(item) {
  const hashes = item.hashes ?? [];
  const more = item.blocks - Math.min(hashes.length, SHOWN_HASHES);
  const hashCell = el(
    "td",
    { class: "hashes", title: hashes.join("\n") || null },
    ...hashes.slice(0, SHOWN_HASHES).map((h) => el("code", { dataset: { hash: h } }, h.slice(0, SHORT_HASH))),
    more > 0 ? el("span", { class: "more" }, `+${more}`) : null,
  );
  const extra = item.tier
    ? el(
        "span",
        { class: "tier-move", title: item.type === "updated" ? "moved between tiers (0 GPU, 1 host)" : "stored on tier (0 GPU, 1 host)" },
        `tier ${item.tier}`,
      )
    : null;
  return el(
    "tr",
    { class: "feed-row", dataset: { id: item.id, worker: item.worker, type: item.type } },
    el("td", { class: "time", title: fmt.time(item.t) }, fmt.clock(item.t)),
    el("td", { class: "worker" }, item.worker),
    el("td", {}, el("span", { class: "etype", dataset: { type: item.type } }, item.type)),
    el("td", { class: "num", title: item.parent ? `parent ${item.parent}` : null }, fmt.int(item.blocks)),
    hashCell,
    el("td", { class: "extra" }, extra),
  );
}

export class FeedPanel {
  constructor({ body, workerFilter, typeFilter, pauseButton, status }) {
    this.body = body;
    this.workerFilter = workerFilter;
    this.typeFilter = typeFilter;
    this.pauseButton = pauseButton;
    this.status = status;
    this.items = [];
    this.lastId = -1;
    this.renderedId = -1; // the newest item id the DOM has considered
    this.rowCount = 0;
    this.paused = false;
    this.pending = 0; // matching items that arrived while paused
    this.skipped = 0;
    this.hiddenWorkers = new Set();
    this.hiddenTypes = new Set();
    this.knownWorkers = new Set();
    for (const t of EVENT_TYPES) this.addCheckbox(typeFilter, "feed-type", t, this.hiddenTypes);
    pauseButton.addEventListener("click", () => this.setPaused(!this.paused));
    this.updateStatus();
  }

  /** Takes a frame's feed at once (not at the next paint), so that no item is lost. */
  ingest(feed) {
    if (!feed) return;
    if (feed.last_id < this.lastId) this.reset(); // the server restarted: its ids start again
    for (const item of feed.items) {
      if (item.id <= this.lastId) continue; // a resumed stream may repeat what we have
      this.items.push(item);
      this.lastId = item.id;
      this.addWorker(item.worker);
      if (this.paused && this.matches(item)) this.pending += 1;
    }
    if (this.items.length > BUFFER) this.items.splice(0, this.items.length - BUFFER);
    this.skipped = feed.skipped ?? 0;
  }

  reset() {
    this.items = [];
    this.lastId = -1;
    this.renderedId = -1;
    this.body.replaceChildren();
    this.rowCount = 0;
  }

  addWorker(name) {
    if (this.knownWorkers.has(name)) return;
    this.knownWorkers.add(name);
    this.addCheckbox(this.workerFilter, "feed-worker", name, this.hiddenWorkers, true);
  }

  addCheckbox(container, name, value, hidden, sorted = false) {
    const input = el("input", { type: "checkbox", name, value, checked: true });
    input.addEventListener("change", () => {
      if (input.checked) hidden.delete(value);
      else hidden.add(value);
      this.rebuild();
    });
    const label = el("label", { class: "check", dataset: { value } }, input, value);
    const next = sorted ? [...container.children].find((c) => c.dataset.value > value) : null;
    container.insertBefore(label, next ?? null);
  }

  matches(item) {
    return !this.hiddenWorkers.has(item.worker) && !this.hiddenTypes.has(item.type);
  }

  setPaused(paused) {
    this.paused = paused;
    this.pending = 0;
    if (!paused) this.rebuild();
    this.pauseButton.setAttribute("aria-pressed", String(paused));
    this.updateStatus();
  }

  /** Adds the rows that arrived since the last paint, newest on top (nothing while paused). */
  render() {
    if (!this.paused && this.renderedId < this.lastId) {
      this.prependRange(this.renderedId, this.lastId);
      this.renderedId = this.lastId;
    }
    this.updateStatus();
  }

  /** Puts the matching items with after < id <= upTo on top of the list, then trims its tail. */
  prependRange(after, upTo) {
    const fresh = [];
    for (let i = this.items.length - 1; i >= 0 && this.items[i].id > after; i--) {
      const item = this.items[i];
      if (item.id <= upTo && this.matches(item)) fresh.push(item);
      if (fresh.length >= MAX_ROWS) break;
    }
    if (!fresh.length) return;
    const fragment = document.createDocumentFragment();
    for (const item of fresh) fragment.append(row(item));
    this.body.prepend(fragment);
    this.rowCount += fresh.length;
    while (this.rowCount > MAX_ROWS) {
      this.body.lastElementChild.remove();
      this.rowCount -= 1;
    }
  }

  /**
   * The newest matching items from the buffer, after a filter change or on resume. Paused, the
   * list stays frozen at the item it showed last (a filter still applies to it).
   */
  rebuild() {
    this.body.replaceChildren();
    this.rowCount = 0;
    if (this.paused) {
      this.prependRange(-1, this.renderedId);
      this.pending = this.items.filter((i) => i.id > this.renderedId && this.matches(i)).length;
    } else {
      this.renderedId = this.lastId;
      this.prependRange(-1, this.lastId);
    }
    this.updateStatus();
  }

  updateStatus() {
    setText(this.pauseButton, this.paused ? (this.pending ? `Resume (${this.pending} new)` : "Resume") : "Pause");
    const parts = [`${this.rowCount} shown`];
    if (this.skipped) parts.push(`server skipped ${fmt.int(this.skipped)} (sampling)`);
    setText(this.status, parts.join(" · "));
  }
}
