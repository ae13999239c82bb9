// Charts drawn on canvas, no library: sparklines of the event rates.

/** Sizes a canvas for the device's pixel ratio once; returns its 2D context in CSS pixels. */
export function makeCanvas(widthPx, heightPx, className) {
  const canvas = document.createElement("canvas");
  const ratio = window.devicePixelRatio || 1;
  canvas.width = Math.round(widthPx * ratio);
  canvas.height = Math.round(heightPx * ratio);
  canvas.style.width = `${widthPx}px`;
  canvas.style.height = `${heightPx}px`;
  if (className) canvas.className = className;
  const ctx = canvas.getContext("2d");
  ctx.scale(ratio, ratio);
  return { canvas, ctx, width: widthPx, height: heightPx };
}

/**
 * A filled sparkline of `values` (oldest first), scaled to `max` (the largest value if absent),
 * right-aligned so that the newest value is at the right edge whatever the series' length.
 */
export function drawSparkline(chart, values, color, capacity, max) {
  const { ctx, width, height } = chart;
  ctx.clearRect(0, 0, width, height);
  const top = Math.max(max ?? 0, ...values, 1e-9);
  const step = width / Math.max(1, capacity - 1);
  const x0 = width - (values.length - 1) * step;
  const y = (v) => height - 1 - (Math.max(0, v) / top) * (height - 3);
  ctx.beginPath();
  ctx.moveTo(x0, height);
  values.forEach((v, i) => ctx.lineTo(x0 + i * step, y(v)));
  ctx.lineTo(width, height);
  ctx.closePath();
  ctx.globalAlpha = 0.22;
  ctx.fillStyle = color;
  ctx.fill();
  ctx.globalAlpha = 1;
  ctx.beginPath();
  values.forEach((v, i) => (i ? ctx.lineTo : ctx.moveTo).call(ctx, x0 + i * step, y(v)));
  ctx.lineWidth = 1.25;
  ctx.strokeStyle = color;
  ctx.stroke();
}
