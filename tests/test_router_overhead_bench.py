"""benchmarks/router_overhead.py: its smoke run (a `pagellm serve` of the embedded model and a
`pagellm router` in front, the same requests to each) and its flag checks."""
from __future__ import annotations

import json

import pytest

from benchmarks.router_overhead import _SMOKE, main


@pytest.mark.slow  # a `pagellm serve` of the embedded model (not named on its command line) and a router
def test_smoke_run_measures_both_targets(tmp_path) -> None:
    payload = main(["--smoke", "--out-dir", str(tmp_path)])
    (written,) = tmp_path.glob("router_overhead_*.json")
    assert json.loads(written.read_text())["overhead"] == payload["overhead"]
    direct, routed = payload["runs"]["direct"], payload["runs"]["router"]
    assert len(direct) == len(routed) == _SMOKE["rounds"]
    assert direct[0]["base_url"] != routed[0]["base_url"]  # the router's own port, not the engine's
    for run in (*direct, *routed):
        assert run["completed"] == _SMOKE["num_prompts"] and run["failed"] == 0
        assert run["total_output_tokens"] == _SMOKE["num_prompts"] * _SMOKE["output_len"]
    summary = payload["summary"]
    added = summary["router"]["ttft_p50_ms"] - summary["direct"]["ttft_p50_ms"]
    assert payload["overhead"]["ttft_p50_added_ms"] == added
    assert {"date_utc", "command", "git", "hardware"} <= payload.keys()


@pytest.mark.parametrize("flag", ["--rounds", "--num-prompts", "--max-concurrency"])
def test_non_positive_sizes_are_refused_naming_the_flag(flag, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([flag, "0"])
    assert exit_info.value.code == 2 and flag in capsys.readouterr().err


@pytest.mark.slow  # the embedded model's tokenizer makes the prompts
def test_null_backend_run_counts_every_token_through_both_targets(tmp_path) -> None:
    payload = main(["--smoke", "--backend", "null", "--out-dir", str(tmp_path)])
    for run in (*payload["runs"]["direct"], *payload["runs"]["router"]):
        assert run["completed"] == _SMOKE["num_prompts"] and run["failed"] == 0
        assert run["total_output_tokens"] == _SMOKE["num_prompts"] * _SMOKE["output_len"]
    assert payload["parameters"]["backend"] == "null"
