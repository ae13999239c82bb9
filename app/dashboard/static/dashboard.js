// kvmesh dashboard: one read-only page fed by server-sent events. Each `frame` event carries the
// whole picture (workers, rates, decisions, prefixes, consumer) plus the feed items new since
// the previous frame. Frames are taken as they come; the page is painted at most once per
// animation frame, from the newest frame, and each panel touches only what changed.
import { ConsumerPanel } from "./consumer.js";
import { DecisionsPanel } from "./decisions.js";
import { fmt, setAttr, setText } from "./dom.js";
import { FeedPanel } from "./feed.js";
import { PrefixPanel } from "./prefixes.js";
import { RatesPanel } from "./rates.js";
import { WorkerCards } from "./workers.js";

const STREAM_URL = "/dashboard/stream";
const STATE_URL = "/dashboard/state";
const RETRY_MS = 2000;

const $ = (id) => document.getElementById(id);

const panels = {
  workers: new WorkerCards($("workers")),
  rates: new RatesPanel($("rates"), $("rates-caption")),
  feed: new FeedPanel({
    body: $("feed-body"),
    workerFilter: $("feed-workers"),
    typeFilter: $("feed-types"),
    pauseButton: $("feed-pause"),
    status: $("feed-status"),
  }),
  decisions: new DecisionsPanel({
    table: $("decisions-table"),
    body: $("decisions-body"),
    note: $("decisions-none"),
    count: $("decisions-caption"),
  }),
  prefixes: new PrefixPanel({ table: $("prefixes-table"), caption: $("prefixes-caption") }),
  consumer: new ConsumerPanel({ list: $("consumer"), reasons: $("resync-reasons") }),
};

const view = {
  conn: $("conn"),
  source: $("source"),
  seq: $("seq"),
  age: $("frame-age"),
  frames: $("stream-frames"),
  reconnects: $("stream-reconnects"),
};

const stream = { frames: 0, reconnects: 0, streamed: false, lastAt: 0, interval: 0.25 };
let latest = null;
let paintScheduled = false;

function setConnection(state) {
  setText(view.reconnects, fmt.int(stream.reconnects)); // no frame comes to paint it while down
  setText(view.conn, state);
  setAttr(view.conn, "data-state", state);
  document.body.classList.toggle("offline", state !== "connected");
}

function accept(frame) {
  panels.feed.ingest(frame.feed);
  latest = frame;
  stream.lastAt = performance.now();
  stream.interval = frame.interval_s || stream.interval;
  if (!paintScheduled) {
    paintScheduled = true;
    requestAnimationFrame(paint);
  }
}

function paint() {
  paintScheduled = false;
  const f = latest;
  setText(view.source, f.source === "router" ? "router" : "standalone");
  setText(view.seq, `#${f.seq}`);
  setText(view.frames, fmt.int(stream.frames));
  setText(view.reconnects, fmt.int(stream.reconnects));
  panels.workers.update(f.workers ?? []);
  panels.rates.update(f.rates);
  panels.feed.render();
  panels.decisions.update(f.decisions);
  panels.prefixes.update(f.prefixes);
  panels.consumer.update(f.consumer);
}

function onMessage(message) {
  let frame;
  try {
    frame = JSON.parse(message.data);
  } catch (err) {
    console.warn("kvmesh dashboard: a frame that is not JSON", err);
    return;
  }
  stream.frames += 1;
  stream.streamed = true;
  accept(frame);
}

function connect() {
  setConnection(stream.frames ? "reconnecting" : "connecting");
  const source = new EventSource(STREAM_URL);
  source.addEventListener("open", () => setConnection("connected"));
  source.addEventListener("frame", onMessage);
  source.addEventListener("message", onMessage); // a server that names no event
  source.addEventListener("error", () => {
    stream.reconnects += 1;
    setConnection("reconnecting");
    // The browser retries by itself (with Last-Event-ID) unless the server answered an error.
    if (source.readyState === EventSource.CLOSED) setTimeout(connect, RETRY_MS);
  });
}

async function firstPaint() {
  try {
    const response = await fetch(STATE_URL, { headers: { accept: "application/json" } });
    if (!response.ok) return;
    const frame = await response.json();
    if (!stream.streamed) accept(frame); // the stream got here first: its frame is newer
  } catch {
    // the stream will paint instead
  }
}

// How old the newest frame is, once a second: a stalled stream shows itself.
setInterval(() => {
  if (!stream.lastAt) return;
  const age = (performance.now() - stream.lastAt) / 1000;
  setText(view.age, age < 1 ? "live" : `${fmt.age(age)} ago`);
  setAttr(view.age, "data-stalled", age > Math.max(2, 8 * stream.interval) ? "" : null);
}, 1000);

firstPaint();
connect();
