// A small time-series line chart on <canvas>: a few series over the last N seconds, y from 0.

const FONT = "11px system-ui, sans-serif";

// A round upper bound for the y axis (1, 2, 5 x 10^k) at or above `value`.
function niceMax(value) {
  if (!(value > 0)) return 1;
  const magnitude = 10 ** Math.floor(Math.log10(value));
  for (const step of [1, 2, 5, 10]) if (step * magnitude >= value) return step * magnitude;
  return 10 * magnitude;
}

function formatValue(value, unit) {
  if (unit === "%") return `${value.toFixed(0)}%`;
  if (unit === "s") return value >= 1 ? `${value.toFixed(1)} s` : `${(value * 1000).toFixed(0)} ms`;
  return value >= 1000 ? `${(value / 1000).toFixed(1)}k` : `${+value.toFixed(2)}`;
}

export class LineChart {
  // `series`: [{name, color}]; `unit`: "", "%" or "s"; `fixedMax`: the y axis' top (else from the data).
  constructor(container, title, series, { unit = "", fixedMax = null } = {}) {
    this.series = series;
    this.unit = unit;
    this.fixedMax = fixedMax;
    container.insertAdjacentHTML("beforeend", `<div class="chart"><h3></h3><div class="legend"></div><canvas></canvas></div>`);
    const root = container.lastElementChild;
    root.querySelector("h3").textContent = title;
    this.legend = root.querySelector(".legend");
    this.canvas = root.querySelector("canvas");
    this.canvas.setAttribute("aria-label", title);
    this.canvas.setAttribute("role", "img");
  }

  // `times` (seconds, ascending) and one array of values (null: no data) per series.
  draw(times, values, windowSeconds) {
    const canvas = this.canvas;
    const ratio = window.devicePixelRatio || 1;
    const width = canvas.clientWidth;
    const height = canvas.clientHeight;
    if (canvas.width !== Math.round(width * ratio)) canvas.width = Math.round(width * ratio);
    if (canvas.height !== Math.round(height * ratio)) canvas.height = Math.round(height * ratio);
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, width, height);
    const style = getComputedStyle(document.documentElement);
    const muted = style.getPropertyValue("--muted");
    const border = style.getPropertyValue("--border");

    const latest = values.map((v) => v.findLast((x) => x !== null));
    this.legend.innerHTML = this.series.map((s, i) =>
      `<span><i style="background:${s.color}"></i>${s.name}: <b>${latest[i] == null ? "–" : formatValue(latest[i], this.unit)}</b></span>`)
      .join("");

    const all = values.flat().filter((v) => v !== null);
    const top = this.fixedMax ?? niceMax(Math.max(0, ...all));
    const left = 46;
    const bottom = height - 18;
    const plotWidth = width - left - 8;
    const now = times.length ? times[times.length - 1] : 0;
    const x = (t) => left + plotWidth * (1 - (now - t) / windowSeconds);
    const y = (v) => bottom - (bottom - 6) * (v / top);

    ctx.font = FONT;
    ctx.lineWidth = 1;
    ctx.strokeStyle = border;
    ctx.fillStyle = muted;
    ctx.textAlign = "right";
    ctx.textBaseline = "middle";
    for (let i = 0; i <= 4; i++) {
      const v = (top * i) / 4;
      ctx.beginPath();
      ctx.moveTo(left, y(v));
      ctx.lineTo(width - 8, y(v));
      ctx.stroke();
      ctx.fillText(formatValue(v, this.unit), left - 6, y(v));
    }
    ctx.textAlign = "center";
    ctx.textBaseline = "top";
    for (let i = 0; i <= 5; i++) {
      const ago = (windowSeconds * i) / 5;
      const label = ago === 0 ? "now" : ago >= 60 ? `-${+(ago / 60).toFixed(1)}m` : `-${ago}s`;
      ctx.fillText(label, x(now - ago), bottom + 4);
    }

    ctx.lineWidth = 1.8;
    ctx.lineJoin = "round";
    this.series.forEach((s, i) => {
      ctx.strokeStyle = s.color;
      ctx.beginPath();
      let drawing = false;
      times.forEach((t, j) => {
        const v = values[i][j];
        if (v === null || now - t > windowSeconds) { drawing = false; return; }
        if (drawing) ctx.lineTo(x(t), y(Math.min(v, top)));
        else ctx.moveTo(x(t), y(Math.min(v, top)));
        drawing = true;
      });
      ctx.stroke();
    });
  }
}
