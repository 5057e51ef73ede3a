"""`pagellm bench serve` and `bench sweep` against one live `pagellm serve` (SmolLM2 on the CPU), and the
other tools that read the same server: `pagellm plan`'s KV blocks, the alert rules' and dashboard's
metric names, the probe paths of the Kubernetes manifests."""
from __future__ import annotations

import json
import re
import statistics
import urllib.request
from pathlib import Path

import pytest
import yaml

from pagellm.benchmarks.serve_client import arrival_gaps
from pagellm.benchmarks.sweep import analyze, parse_slo
from pagellm.cli import main as cli_main
from server_utils import RemoteServer, free_port, metric_samples

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
KV_BYTES = 24 << 20
SERVER_FLAGS = ("--device", "cpu", "--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory-bytes",
                str(KV_BYTES), "--served-model-name", "smollm2")
SMALL_LOAD = ["--num-prompts", "4", "--input-len", "16", "--output-len", "4", "--disable-tqdm"]
VLLM_KEYS = ["completed", "failed", "request_throughput", "output_throughput", "total_token_throughput",
             *(f"{stat}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for stat in ("mean", "median", "p99"))]


@pytest.fixture(scope="module")
def server(smollm2_path):
    # One thread: these tiny loads gain nothing from two, and two threads that wait on each other
    # slow down many times over when another process takes a core.
    remote = RemoteServer(smollm2_path, *SERVER_FLAGS, env={"OMP_NUM_THREADS": "1"})
    yield remote
    assert remote.stop() == 0


def _bench(args: list[str], tmp_path: Path, capsys) -> dict:
    path = tmp_path / "serve.json"
    assert cli_main(["bench", "serve", *args, "--output-json", str(path)]) == 0
    capsys.readouterr()
    return json.loads(path.read_text())


def _delta(after: dict[str, float], before: dict[str, float], name: str) -> float:
    return after[name] - before[name]


@pytest.mark.slow
def test_counts_equal_the_servers_own_metrics(server, tmp_path, capsys):
    before = metric_samples(server.url)
    result = _bench(["--base-url", server.url + "/v1", *SMALL_LOAD, "--goodput", "ttft:600000", "e2el:600000"],
                    tmp_path, capsys)
    after = metric_samples(server.url)
    assert result["model_id"] == "smollm2" and result["usage_from_server"]
    assert result["completed"] == 4 and result["failed"] == 0 and result["errors"] == []
    assert _delta(after, before, "pagellm:request_success_total{length}") == result["completed"]
    assert _delta(after, before, "pagellm:prompt_tokens_total") == result["total_input_tokens"]
    assert _delta(after, before, "pagellm:generation_tokens_total") == result["total_output_tokens"] == 4 * 4
    assert result["output_lens"] == [4] * 4  # ignore_eos: exactly the asked-for lengths
    assert all(key in result and result[key] is not None for key in VLLM_KEYS)
    for metric in ("ttft", "tpot", "itl", "e2el"):
        assert 0 < result[f"median_{metric}_ms"] <= result[f"p90_{metric}_ms"] <= result[f"p99_{metric}_ms"]
    assert result["mean_ttft_ms"] < result["mean_e2el_ms"]
    assert result["request_throughput"] == pytest.approx(4 / result["duration"])
    assert result["request_goodput"] == result["request_throughput"]  # limits far above any latency here
    assert result["git"]["commit"] and result["hardware"]["logical_cores"] >= 1


@pytest.mark.slow
def test_chat_on_shared_prefixes_one_at_a_time(server, tmp_path, capsys):
    before = metric_samples(server.url)
    result = _bench(["--base-url", server.url, "--endpoint", "/v1/chat/completions", "--dataset", "prefix",
                     "--num-prefixes", "1", "--prefix-len", "48", "--max-concurrency", "1", "--goodput", "ttft:0.001",
                     "--num-prompts", "3", "--input-len", "4", "--output-len", "2", "--disable-tqdm"], tmp_path, capsys)
    after = metric_samples(server.url)
    assert result["completed"] == 3 and result["peak_concurrent_requests"] == 1
    assert _delta(after, before, "pagellm:prompt_tokens_total") == result["total_input_tokens"]
    assert _delta(after, before, "pagellm:generation_tokens_total") == result["total_output_tokens"]
    # Every request after the first finds the shared prefix (and the chat template's) in the cache.
    assert _delta(after, before, "pagellm:prefix_cache_hits_total") >= 2 * 48
    assert result["request_goodput"] == 0.0  # no first token comes within a microsecond


def test_arrival_schedules():
    assert arrival_gaps(3, float("inf"), 1.0, 0) == [0.0, 0.0, 0.0]
    for burstiness, cv in ((1.0, 1.0), (4.0, 0.5), (0.25, 2.0)):  # gamma: CV = 1 / sqrt(shape)
        gaps = arrival_gaps(4000, 8.0, burstiness, seed=1)
        assert statistics.fmean(gaps) == pytest.approx(1 / 8, rel=0.1)
        assert statistics.pstdev(gaps) / statistics.fmean(gaps) == pytest.approx(cv, rel=0.15)
    assert arrival_gaps(5, 2.0, 1.0, 7) == arrival_gaps(5, 2.0, 1.0, 7)


@pytest.mark.parametrize("args, flag", [
    (["--base-url", "localhost:8000"], "--base-url"),
    (["--base-url", "http://127.0.0.1:{port}"], "--base-url"),
    (["--goodput", "ttft=500"], "--goodput"),
    (["--request-rate", "0"], "--request-rate"),
])
def test_bad_input_is_one_line_naming_the_flag(args, flag, capsys):
    args = [a.format(port=free_port()) for a in args]
    assert cli_main(["bench", "serve", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pagellm bench serve: error: ") and flag in err and err.count("\n") == 1
    assert "Traceback" not in err


@pytest.mark.slow
def test_sweep_writes_plots_and_a_recommendation(server, tmp_path, capsys):
    out = tmp_path / "sweep"
    assert cli_main(["bench", "sweep", "--base-url", server.url, "--sweep", "max-concurrency", "--values", "1", "3",
                     "--num-prompts", "3", "--input-len", "8", "--output-len", "3", "--disable-tqdm",
                     "--num-warmups", "0", "--slo", "ttft_p99:600000", "--output-dir", str(out)]) == 0
    printed = capsys.readouterr().out
    sweep = json.loads((out / "sweep.json").read_text())
    assert [r["load"] for r in sweep["rungs"]] == [1, 3]
    assert [r["peak_concurrent_requests"] for r in sweep["rungs"]] == [1, 3]
    assert all(r["completed"] == 3 and "ttfts" not in r for r in sweep["rungs"])
    assert sweep["slo_passing"] == [0, 1] and sweep["slo_limit"] == 1  # a limit no run here comes near
    assert sweep["throughput_knee"] in (0, 1) and sweep["recommended"] == sweep["throughput_knee"]
    assert sweep["recommended_load"] == sweep["rungs"][sweep["recommended"]]["load"]
    assert sweep["recommendation"] in printed and "--max-num-seqs" in sweep["recommendation"]
    for name in ("sweep_throughput.png", "sweep_latency.png"):
        data = (out / name).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 10_000


def test_knee_and_slo_limit():
    def rung(load, tok_s, ttft_p99, failed=0):
        return {"load": load, "output_throughput": tok_s, "request_throughput": tok_s / 10, "p99_ttft_ms": ttft_p99,
                "p99_tpot_ms": 20.0, "failed": failed, "errors": ["HTTP 503: at capacity"] * failed}

    # A local plateau (1 -> 2) is not the knee: 4 is the first rung within 10% of the best.
    rungs = [rung(1, 100, 50), rung(2, 105, 60), rung(4, 190, 80), rung(8, 205, 400)]
    result = analyze(rungs, "request-rate", parse_slo(["ttft_p99:100"]), 0.1)
    assert result["throughput_knee"] == 2 and result["saturated"]
    assert result["slo_limit"] == 2 and result["recommended_load"] == 4
    strict = analyze(rungs, "request-rate", parse_slo(["ttft_p99:55"]), 0.1)
    assert strict["slo_limit"] == 0 and strict["recommended_load"] == 1 and "breaks the SLO" in strict["recommendation"]
    # A server setting: small ones queue (TTFT over the SLO), so the smallest good one is chosen.
    settings = [rung(1, 50, 9000), rung(2, 90, 3000), rung(4, 100, 500), rung(8, 104, 450), rung(16, 80, 400)]
    chosen = analyze(settings, "max-num-seqs", parse_slo(["ttft_p99:1000"]), 0.1, "model.gguf", "--device cpu")
    assert chosen["slo_passing"] == [2, 3, 4] and chosen["slo_limit"] is None and chosen["recommended_load"] == 4
    assert "pagellm serve model.gguf --device cpu --max-num-seqs 4" in chosen["recommendation"]
    growing = analyze(rungs[:1] + [rung(2, 150, 60)], "request-rate", {}, 0.1)
    assert not growing["saturated"] and growing["recommended_load"] == 2 and "extend --values" in growing[
        "recommendation"]
    failing = analyze([rung(1, 100, 50, failed=1)], "request-rate", {}, 0.1)
    assert failing["recommended"] is None and "1 failed requests, e.g. HTTP 503" in failing["recommendation"]
    with pytest.raises(ValueError, match="--slo"):
        parse_slo(["ttft_p42:100"])


@pytest.mark.slow
def test_plan_predicts_the_servers_kv_blocks(server, smollm2_path, capsys):
    blocks = int(re.search(r"engine core ready \(pid \d+\): (\d+) KV blocks", server.log_tail(1_000_000)).group(1))
    assert cli_main(["plan", smollm2_path, "--device", "cpu", "--dtype", "float32", "--kv-cache-memory-bytes",
                     str(KV_BYTES), "--max-model-len", "256", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["num_kv_blocks"] == blocks


@pytest.mark.slow
def test_monitoring_names_only_metrics_the_server_exports(server):
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as response:
        exported = set(re.findall(r"^(pagellm:[a-z_:]+)", response.read().decode(), re.MULTILINE))
    rules = yaml.safe_load((DEPLOY / "monitoring" / "alerts.yml").read_text())["groups"][0]["rules"]
    dashboard = json.loads((DEPLOY / "monitoring" / "grafana" / "dashboards" / "pagellm.json").read_text())
    exprs = [r["expr"] for r in rules] + [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    named = {name for expr in exprs for name in re.findall(r"pagellm:[a-z_:]+", expr)}
    assert named and named <= exported, named - exported
    panels = " ".join(p["title"].lower() for p in dashboard["panels"])
    for topic in ("throughput", "first token", "output token", "inter-token", "running and waiting", "kv-cache",
                  "preemptions", "prefix-cache", "turned away", "errors"):
        assert topic in panels

@pytest.mark.slow
def test_kubernetes_probes_answer_on_the_server(server):
    deployment = yaml.safe_load((DEPLOY / "k8s" / "deployment.yaml").read_text())
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    paths = {container[probe]["httpGet"]["path"] for probe in ("startupProbe", "livenessProbe", "readinessProbe")}
    assert paths == {"/health/live", "/health/ready"}
    for path in paths:
        assert urllib.request.urlopen(f"{server.url}{path}", timeout=10).status == 200
