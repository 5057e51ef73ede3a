// The dashboard: polls /stats every second, turns its totals into rates and windowed percentiles, and
// charts the last minutes. Everything is kept in memory: a reload starts the charts afresh.
import { apiFetch, errorText, setupTheme } from "./api.js";
import { LineChart } from "./chart.js";

const POLL_MS = 1000;
const KEEP_S = 900; // the longest window offered
const PERCENTILE_WINDOW_S = 30; // latency percentiles over the requests of the last 30 s
const MIN_WINDOW_S = 30; // until this much is charted, the x axis spans what there is (not a sliver at its end)
const RATE_WINDOW_S = 5; // rates (tokens/s, hit rate) over the last 5 s, so that one slow poll does not spike them
const $ = (id) => document.getElementById(id);

const history = []; // the /stats snapshots of the last KEEP_S seconds
const points = { times: [] }; // one entry per snapshot, per chart series

const charts = {};
let latest = null; // the last snapshot and its chart values

function setupCharts() {
  const root = $("charts");
  charts.throughput = new LineChart(root, "Throughput (tokens/s)",
    [{ name: "output", color: "#4f6bed" }, { name: "input (prefill)", color: "#2fb36d" }]);
  charts.requests = new LineChart(root, "Requests",
    [{ name: "running", color: "#4f6bed" }, { name: "waiting", color: "#e8a33d" }]);
  charts.kv = new LineChart(root, "KV-cache usage", [{ name: "used", color: "#8a3fd1" }], { unit: "%", fixedMax: 100 });
  charts.prefix = new LineChart(root, "Prefix-cache hit rate", [{ name: "hits", color: "#2fb36d" }],
    { unit: "%", fixedMax: 100 });
  charts.ttft = new LineChart(root, `Time to first token (last ${PERCENTILE_WINDOW_S} s)`,
    [{ name: "p50", color: "#4f6bed" }, { name: "p90", color: "#e8a33d" }, { name: "p99", color: "#d64545" }],
    { unit: "s" });
  charts.tpot = new LineChart(root, `Time per output token (last ${PERCENTILE_WINDOW_S} s)`,
    [{ name: "p50", color: "#4f6bed" }, { name: "p90", color: "#e8a33d" }, { name: "p99", color: "#d64545" }],
    { unit: "s" });
  charts.trouble = new LineChart(root, "Preemptions and rejected requests (per s)",
    [{ name: "preemptions", color: "#e8a33d" }, { name: "rejected", color: "#d64545" }]);
}

// The snapshot at least `seconds` older than the latest (the oldest kept if none is that old).
function before(seconds) {
  const latest = history[history.length - 1];
  for (let i = history.length - 2; i >= 0; i--) {
    if (latest.time - history[i].time >= seconds) return history[i];
  }
  return history.length > 1 ? history[0] : null;
}

// The q-quantile of the observations between two cumulative histograms (linear within a bucket).
function percentile(now, then, q) {
  const counts = now.cumulative.map((c, i) => c - (then ? then.cumulative[i] : 0));
  const total = counts[counts.length - 1];
  if (!(total > 0)) return null;
  const target = q * total;
  for (let i = 0; i < counts.length; i++) {
    if (counts[i] >= target) {
      if (i >= now.le.length) return now.le[now.le.length - 1]; // past the last bound
      const lower = i === 0 ? 0 : now.le[i - 1];
      const below = i === 0 ? 0 : counts[i - 1];
      const inBucket = counts[i] - below;
      return lower + (now.le[i] - lower) * (inBucket > 0 ? (target - below) / inBucket : 1);
    }
  }
  return null;
}

const sum = (values) => Object.values(values).reduce((a, b) => a + b, 0);

function record(snapshot) {
  history.push(snapshot);
  while (snapshot.time - history[0].time > KEEP_S) history.shift();
  const then = before(RATE_WINDOW_S);
  const dt = then ? snapshot.time - then.time : 0;
  const rate = (get) => (then && dt > 0 ? Math.max(0, get(snapshot) - get(then)) / dt : null);
  const old = before(PERCENTILE_WINDOW_S);
  const latency = (name, q) => percentile(snapshot.latency[name], old?.latency[name], q);
  const queries = then ? snapshot.prefix_cache.queries - then.prefix_cache.queries : 0;
  const row = {
    output: rate((s) => s.tokens.generation),
    input: rate((s) => s.tokens.prompt),
    running: snapshot.requests.running,
    waiting: snapshot.requests.waiting,
    kv: snapshot.kv_cache_usage * 100,
    prefix: queries > 0 ? (100 * (snapshot.prefix_cache.hits - then.prefix_cache.hits)) / queries : null,
    ttft50: latency("ttft", 0.5), ttft90: latency("ttft", 0.9), ttft99: latency("ttft", 0.99),
    tpot50: latency("itl", 0.5), tpot90: latency("itl", 0.9), tpot99: latency("itl", 0.99),
    preemptions: rate((s) => s.preemptions),
    rejected: rate((s) => sum(s.requests.turned_away)),
  };
  points.times.push(snapshot.time);
  for (const [key, value] of Object.entries(row)) (points[key] ||= []).push(value);
  while (points.times.length > history.length) {
    for (const key of Object.keys(points)) points[key].shift();
  }
  return row;
}

function draw(row, snapshot) {
  const elapsed = points.times[points.times.length - 1] - points.times[0];
  const windowSeconds = Math.min(Number($("window").value), Math.max(MIN_WINDOW_S, Math.ceil(elapsed / 10) * 10));
  const series = (...keys) => keys.map((key) => points[key]);
  charts.throughput.draw(points.times, series("output", "input"), windowSeconds);
  charts.requests.draw(points.times, series("running", "waiting"), windowSeconds);
  charts.kv.draw(points.times, series("kv"), windowSeconds);
  charts.prefix.draw(points.times, series("prefix"), windowSeconds);
  charts.ttft.draw(points.times, series("ttft50", "ttft90", "ttft99"), windowSeconds);
  charts.tpot.draw(points.times, series("tpot50", "tpot90", "tpot99"), windowSeconds);
  charts.trouble.draw(points.times, series("preemptions", "rejected"), windowSeconds);
  $("tile-output").textContent = row.output == null ? "–" : row.output.toFixed(1);
  $("tile-requests").textContent = `${snapshot.requests.running} / ${snapshot.requests.waiting}`;
  $("tile-kv").textContent = `${row.kv.toFixed(1)}%`;
  $("tile-finished").textContent = sum(snapshot.requests.finished).toLocaleString();
  $("tile-generated").textContent = snapshot.tokens.generation.toLocaleString();
  $("tile-rejected").textContent = `${snapshot.preemptions} / ${sum(snapshot.requests.turned_away)}`;
}

const CONFIG_LABELS = {
  served_model_names: "Served as", model: "Model", architecture: "Architecture", load_format: "Format",
  dtype: "dtype", quantization: "Quantization", kv_cache_dtype: "KV-cache dtype", device: "Device",
  attention_backend: "Attention backend", max_model_len: "Max model length", block_size: "Block size (tokens)",
  num_kv_blocks: "KV blocks", num_kv_tokens: "KV tokens", enable_prefix_caching: "Prefix caching",
  max_num_seqs: "Max sequences", max_num_batched_tokens: "Max batched tokens", scheduling_policy: "Scheduling",
  tensor_parallel_size: "Tensor parallel", pipeline_parallel_size: "Pipeline parallel",
  data_parallel_size: "Data parallel", speculative: "Speculative decoding", reasoning_parser: "Reasoning parser",
  lora: "LoRA adapters", sampling_defaults: "Sampling defaults",
};

function showConfig(engine) {
  const shown = (value) => {
    if (value === null || value === undefined) return "none";
    if (typeof value === "boolean") return value ? "on" : "off";
    if (Array.isArray(value)) return value.join(", ");
    if (typeof value === "object") return Object.entries(value).map(([k, v]) => `${k}=${v}`).join(", ") || "none";
    return typeof value === "number" ? value.toLocaleString() : String(value);
  };
  $("config").replaceChildren(...Object.entries(CONFIG_LABELS).map(([key, label]) => {
    const row = document.createElement("div");
    row.innerHTML = "<dt></dt><dd></dd>";
    row.querySelector("dt").textContent = label;
    row.querySelector("dd").textContent = shown(engine[key]);
    row.dataset.key = key;
    return row;
  }));
}

async function poll() {
  const live = $("live");
  try {
    const response = await apiFetch("/stats");
    if (!response.ok) throw new Error(await errorText(response));
    const snapshot = await response.json();
    if (!history.length) showConfig(snapshot.engine);
    latest = { row: record(snapshot), snapshot };
    draw(latest.row, snapshot);
    live.textContent = "live";
    live.classList.remove("offline");
  } catch (e) {
    live.textContent = `no answer from the server (${e.message})`;
    live.classList.add("offline");
  }
  setTimeout(poll, POLL_MS); // after the answer, so that a slow server never has polls piling up
}

setupTheme($("theme"));
const redraw = () => latest && draw(latest.row, latest.snapshot); // the theme's colours, another window
$("theme").addEventListener("click", redraw);
$("window").addEventListener("change", redraw);
setupCharts();
poll();
