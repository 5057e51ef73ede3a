"""`pagellm plan`: the ledger agrees with the engine's own KV sizing (on the CPU, and with the H200
measurements), its byte counts with real models, and its advice with its own what-ifs."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import transformers

from benchmarks.kv_sizing_gpu import SMOLLM2_135M
from pagellm.attention import get_attn_backend
from pagellm.benchmarks.memory import PlanSpec, compute_ledger, cuda_allocated_bytes
from pagellm.cli import main as cli_main
from pagellm.config.arch import ModelArchConfig
from pagellm.engine.arg_utils import EngineArgs
from pagellm.loader import resolve_model
from pagellm.models import get_model_class
from pagellm.worker.worker import Worker

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
H200_REFERENCE_BLOCKS = 55_636
"""KV blocks the engine allocated for Llama-3.1-8B at 0.9 utilization on an H200 (gpu_fast_path results)."""
TINY_QWEN2 = {
    "architectures": ["Qwen2ForCausalLM"], "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
    "tie_word_embeddings": True,
}


def _plan_json(args: list[str], capsys) -> dict:
    assert cli_main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_h200_reference_within_5_percent(capsys):
    """The H200 run of benchmarks/results/gpu_fast_path_20261129T190650Z.json, replayed by plan."""
    run = json.loads((RESULTS / "gpu_fast_path_20261129T190650Z.json").read_text())
    load = run["phases"]["engine.load"]["result"]
    assert load["num_kv_blocks"] == H200_REFERENCE_BLOCKS
    plan = _plan_json([load["model"], "--gpu-memory-gib", str(load["gpu_total_gib"]), "--dtype", load["dtype"],
                       "--gpu-memory-utilization", "0.9", "--max-model-len", str(load["max_model_len"]),
                       "--max-num-seqs", str(load["max_num_seqs"])], capsys)
    assert plan["num_kv_blocks"] == pytest.approx(H200_REFERENCE_BLOCKS, rel=0.05)
    assert plan["kv_bytes_per_token"] == 131072  # 2 x 32 layers x 8 KV heads x 128 x 2 bytes
    assert plan["kv_cache_tokens"] == plan["num_kv_blocks"] * 16
    assert plan["max_concurrent_seqs"] == 256 and plan["fits"]


def test_every_h200_measurement_within_2_percent():
    """Each configuration of the calibration run (one knob at a time, four models) agrees too."""
    measured = json.loads((RESULTS / "kv_sizing_h200_20261201T151500Z.json").read_text())["runs"]
    for run in measured:
        arch = (ModelArchConfig.from_hf_dict(SMOLLM2_135M) if run["model"].startswith("smollm2")
                else resolve_model(run["model"], "dummy").arch)
        ledger = compute_ledger(PlanSpec(arch, "cuda", 2, run["max_model_len"], run["max_num_seqs"],
                                         run["max_num_batched_tokens"], 1024, 128,
                                         total_memory_bytes=run["total_bytes"]))
        assert ledger.num_kv_blocks == pytest.approx(run["num_kv_blocks"], rel=0.02), run
        assert ledger.activation_peak_bytes == pytest.approx(run["activation_peak_bytes"], rel=0.02), run


@pytest.mark.slow
def test_cpu_plan_matches_the_engines_own_sizing(smollm2_path, capsys):
    """The engine's Worker sizes the cache for SmolLM2 on this CPU (model built on the meta device:
    the sizing reads only its shape) and plan predicts the same number of blocks."""
    config = EngineArgs(smollm2_path, device="cpu").create_engine_config()
    worker = Worker(config)
    with torch.device("meta"):
        worker.runner.model = get_model_class(config.model.source.arch.architecture)(config.model.source.arch,
                                                                                get_attn_backend("torch"))
    engine_blocks = worker.determine_num_blocks()
    plan = _plan_json([smollm2_path, "--device", "cpu"], capsys)
    assert plan["num_kv_blocks"] == pytest.approx(engine_blocks, rel=0.05)
    assert plan["kv_bytes_per_token"] * 16 == worker.runner.kv_bytes_per_block()


def test_weights_count_each_parameter_once_and_shard_with_tensor_parallelism():
    """Against a real (CPU) model: tied embeddings counted once; with TP 2, each rank holds half of
    every linear layer and of the vocabulary."""
    arch = ModelArchConfig.from_hf_dict(TINY_QWEN2)
    model = get_model_class(arch.architecture)(arch, get_attn_backend("torch"))
    real = sum(p.numel() * p.element_size() for p in model.parameters())
    spec = PlanSpec(arch, "cpu", 4, 256, 8, 256, 16, 16)
    assert compute_ledger(spec).weights_bytes == real
    tp2 = compute_ledger(PlanSpec(arch, "cpu", 4, 256, 8, 256, 16, 16, tensor_parallel_size=2))
    norms = (2 * 2 + 1) * 64 * 4  # replicated on every rank
    assert tp2.weights_bytes - norms == pytest.approx((real - norms) / 2, rel=0.01)


def test_mixture_of_experts_weights_held_and_read_per_decode_step(capsys):
    """Qwen3-30B-A3B holds every expert but a decode step reads 8 of a layer's 128 (and one row of
    the embedding); under expert parallelism a rank holds 64 whole experts and may have to read 8."""
    total = 30_532_122_624
    embedding, experts = 151936 * 2048, 48 * 128 * 3 * 2048 * 768
    one = _plan_json(["Qwen/Qwen3-30B-A3B", "--gpu-memory-gib", "80"], capsys)
    assert one["weights_bytes"] == 2 * total
    assert one["decode_weights_bytes"] == 2 * (total - embedding - experts * 120 // 128)
    args = ["Qwen/Qwen3-30B-A3B", "--gpu-memory-gib", "80", "--tensor-parallel-size", "2"]
    tp2, ep2 = _plan_json(args, capsys), _plan_json([*args, "--enable-expert-parallel"], capsys)
    assert tp2["weights_bytes"] == ep2["weights_bytes"] < one["weights_bytes"]
    # Eight whole experts on one rank against eight halves.
    assert ep2["decode_weights_bytes"] - tp2["decode_weights_bytes"] == 2 * experts // 128 * 8 // 2
    assert ep2["expert_parallel"] and not tp2["expert_parallel"]
    assert cli_main(["plan", "mistralai/Mixtral-8x7B-Instruct-v0.1", "--gpu-memory-gib", "80",
                     "--quantization", "fp8"]) == 2
    assert "mixture of experts" in capsys.readouterr().err


def test_gemma3_blocks_per_sequence_follow_the_window_arithmetic(capsys):
    """Gemma-3-12B at 8k context: 8 full-attention layers keep 8192 / 16 = 512 blocks, 40 sliding layers
    (window 1024) in 5 groups of 8 keep 65 each (the 1024 positions a decode's window spans reach
    over 65 blocks at most): 837 blocks of 8 layers, a quarter of what 48 full layers would hold."""
    plan = _plan_json(["google/gemma-3-12b-it", "--gpu-memory-gib", "80", "--max-model-len", "8192",
                       "--input-len", "8000", "--output-len", "192"], capsys)
    assert [(g["sliding_window"], len(g["layers"]), g["blocks_per_seq"]) for g in plan["kv_cache_groups"]] == \
        [(None, 8, 512)] + [(1024, 8, 65)] * 5
    assert plan["blocks_per_seq"] == 512 + 5 * 65 == 837
    assert plan["kv_bytes_per_block"] == 2 * 8 * 16 * 8 * 256 * 2  # a block: 8 layers' keys and values
    assert plan["kv_bytes_per_token"] == 2 * 48 * 8 * 256 * 2
    assert plan["kv_limited_seqs"] == plan["num_kv_blocks"] // 837
    assert cli_main(["plan", "google/gemma-3-12b-it", "--gpu-memory-gib", "80", "--max-model-len", "8192",
                     "--input-len", "8000", "--output-len", "192"]) == 0
    assert "837 blocks each of 8 layers: 1 group (8 layers) of full attention: 512 each; 5 groups (40 layers) " \
           "of window 1024: 65 each" in capsys.readouterr().out
    # Gemma 2: two groups of 21; its 4096 window reaches the whole of a 4096-token context.
    gemma2 = _plan_json(["google/gemma-2-9b-it", "--gpu-memory-gib", "80", "--input-len", "8000",
                         "--output-len", "192"], capsys)
    assert [g["blocks_per_seq"] for g in gemma2["kv_cache_groups"]] == [512, 257]
    short = _plan_json(["google/gemma-2-9b-it", "--gpu-memory-gib", "80", "--max-model-len", "4096"], capsys)
    assert [(g["sliding_window"], len(g["layers"])) for g in short["kv_cache_groups"]] == [(None, 42)]


def test_the_engines_block_size_is_the_plans_for_windowed_layers():
    """The worker sizes Gemma-3-12B's blocks (model on the meta device) as the plan does."""
    config = EngineArgs("google/gemma-3-12b-it", load_format="dummy", device="cpu", dtype="float32",
                        max_model_len=8192, kv_cache_memory_bytes=1 << 30).create_engine_config()
    worker = Worker(config)
    with torch.device("meta"):
        worker.runner.model = get_model_class(config.model.source.arch.architecture)(config.model.source.arch,
                                                                                get_attn_backend("torch"))
    ledger = compute_ledger(PlanSpec(config.model.source.arch, "cpu", 4, 8192, 8, 2048, 8000, 192,
                                     kv_cache_memory_bytes=1 << 30))
    assert worker.runner.kv_bytes_per_block() == ledger.kv_bytes_per_block == 2 * 8 * 16 * 8 * 256 * 4
    assert worker.determine_num_blocks() == ledger.num_kv_blocks == 512


def test_what_if_sizes_follow_the_byte_counts():
    arch = resolve_model("llama-3.1-8b", "dummy").arch
    base = PlanSpec(arch, "cuda", 2, 4096, 256, 8192, 1024, 128, total_memory_bytes=80 << 30)
    none, fp8, gptq = (compute_ledger(dataclasses.replace(base, quantization=q)) for q in ("none", "fp8", "gptq"))
    assert gptq.weights_bytes < fp8.weights_bytes < none.weights_bytes
    # Only linear layers shrink: the 2 x 525M-parameter embeddings stay 16-bit.
    assert fp8.weights_bytes > none.weights_bytes / 2
    assert gptq.num_kv_blocks > fp8.num_kv_blocks > none.num_kv_blocks
    fp8_kv = compute_ledger(dataclasses.replace(base, kv_cache_dtype="fp8"))
    assert fp8_kv.kv_bytes_per_token * 2 == none.kv_bytes_per_token
    assert fp8_kv.num_kv_blocks == pytest.approx(2 * none.num_kv_blocks, abs=1)


def test_advice_when_the_model_does_not_fit(capsys):
    plan = _plan_json(["llama-3.1-8b", "--gpu-memory-gib", "16", "--max-model-len", "8192"], capsys)
    assert not plan["fits"] and plan["num_kv_blocks"] == 0 and plan["max_concurrent_seqs"] == 0
    assert plan["advice"][0].startswith("nothing is left for the KV cache")
    # Every what-if offered is one that makes room, checked by planning it.
    what_ifs = [a for a in plan["advice"] if a.startswith("what-if")]
    assert any("--tensor-parallel-size 2" in a for a in what_ifs)
    tp2 = _plan_json(["llama-3.1-8b", "--gpu-memory-gib", "16", "--max-model-len", "8192",
                      "--tensor-parallel-size", "2"], capsys)
    assert tp2["num_kv_blocks"] > 0 and f"{tp2['num_kv_blocks']} blocks" in next(
        a for a in what_ifs if "--tensor-parallel-size 2" in a)


def test_table_and_bad_flags(capsys):
    assert cli_main(["plan", "qwen3-8b", "--gpu-memory-gib", "80", "--input-len", "2000", "--output-len", "500"]) == 0
    out = capsys.readouterr().out
    assert "KV cache" in out and "max concurrent sequences" in out and "--max-num-seqs 256" in out
    # Bad values argparse finds (--input-len 0, ...): tests/test_cli_errors.py.
    for args, flag in ((["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
                       (["--tensor-parallel-size", "3"], "--tensor-parallel-size 3")):
        assert cli_main(["plan", "qwen3-8b", "--device", "cuda", "--gpu-memory-gib", "80", *args]) == 2
        err = capsys.readouterr().err
        assert err.startswith("pagellm plan: error:") and flag in err and err.count("\n") == 1


def test_cuda_allocator_rounding():
    assert cuda_allocated_bytes(1) == 512
    assert cuda_allocated_bytes(3 << 20) == 3 << 20  # below 10 MiB: its segment is split
    assert cuda_allocated_bytes((31 << 20) + (1 << 19)) == 32 << 20  # 0.5 MiB left over: charged
    assert cuda_allocated_bytes((28 << 20) + (1 << 19)) == (28 << 20) + (1 << 19)  # 1.5 MiB left: split


def test_gguf_weights_count_the_blocks_the_engine_keeps(tmp_path, capsys):
    """A GGUF model's weights as the engine keeps them: on the CPU the loaded model's own bytes (its
    C kernels' types as stored, Q4_K and Q6_K dequantized); on a GPU every kept tensor's converted
    layout, summed from the real conversion of the file's blocks."""
    from benchmarks.gguf_gpu import write_synthetic_gguf
    from pagellm.loader.gguf_loader import iter_gguf_weights
    from pagellm.quantization import gguf_blocks
    from pagellm.quantization.gguf import GGUFConfig
    from pagellm.worker.loading import build_model

    types = {"attn_q": gguf_blocks.Q4_K, "attn_k": gguf_blocks.Q4_K, "attn_v": gguf_blocks.Q6_K,
             "attn_output": gguf_blocks.Q4_0, "ffn_gate": gguf_blocks.Q4_1, "ffn_up": gguf_blocks.Q4_1,
             "ffn_down": gguf_blocks.Q5_K, "token_embd": gguf_blocks.Q8_0, "output": gguf_blocks.Q6_K}
    config = dict(vocab_size=300, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    path = str(tmp_path / "tiny.gguf")
    write_synthetic_gguf(path, config, types)

    engine = EngineArgs(path, device="cpu").create_engine_config()
    assert engine.model.quantization == "gguf"
    model = build_model(engine.model.source, engine.model.quantization, engine.model.dtype, torch.device("cpu"),
                        "torch", 0)
    loaded = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    cpu = _plan_json([path, "--device", "cpu"], capsys)
    assert cpu["weights_bytes"] == loaded

    qtypes = GGUFConfig.from_file(path).qtypes
    gpu_bytes = 0
    blocks = {name for name, qtype in qtypes.items() if qtype in gguf_blocks.BLOCKS}  # all but the norms
    for name, tensor in iter_gguf_weights(path, keep_quantized=blocks):
        if name in blocks:  # every block type here is kept on a GPU
            values, nbytes = gguf_blocks.BLOCKS[qtypes[name]]
            g = gguf_blocks.to_grouped(qtypes[name], tensor, tensor.shape[1] // nbytes * values)
            gpu_bytes += sum(t.numel() * t.element_size() for t in (g.codes, g.scale, g.offset) if t is not None)
        else:  # the float32 norms, in the GPU's bfloat16
            gpu_bytes += tensor.numel() * 2
    gpu = _plan_json([path, "--device", "cuda", "--gpu-memory-gib", "80"], capsys)
    assert gpu["weights_bytes"] == gpu_bytes
    dense = _plan_json([path, "--device", "cuda", "--gpu-memory-gib", "80", "--quantization", "none"], capsys)
    assert dense["weights_bytes"] > 2 * gpu_bytes
    args = ["plan", "llama-3.1-8b", "--device", "cuda", "--gpu-memory-gib", "80", "--quantization", "gguf"]
    assert cli_main(args) == 2
    assert "--quantization gguf plans a .gguf model" in capsys.readouterr().err


def test_a_quantized_checkpoint_is_planned_as_the_engine_loads_it(tmp_path, capsys):
    """Its quantization_config is the default (compressed-tensors at its weights' size); a flag the
    engine would refuse is refused. A dense model takes any method as a what-if."""
    from pagellm.loader.presets import get_preset

    dense = get_preset("llama-3.1-8b")[0]
    int4 = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}
    configs = {"gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128},
               "ct_int8": {"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {
                   "g": {"weights": {**int4, "num_bits": 8, "strategy": "channel"}}}},
               "ct_int4": {"quant_method": "compressed-tensors", "format": "pack-quantized",
                           "config_groups": {"g": {"weights": int4}}}}
    paths = {"dense": tmp_path / "dense.json"}
    paths["dense"].write_text(json.dumps(dense))
    for name, qc in configs.items():
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps({**dense, "quantization_config": qc}))
    gpu = ["--device", "cuda", "--gpu-memory-gib", "80"]

    def weights(name: str, *flags: str) -> int:
        return _plan_json([str(paths[name]), *gpu, *flags], capsys)["weights_bytes"]

    assert weights("gptq") == weights("dense", "--quantization", "gptq") < weights("dense")
    assert weights("ct_int4") == weights("dense", "--quantization", "gptq")
    assert weights("ct_int8") == weights("dense", "--quantization", "int8")
    assert weights("gptq", "--quantization", "gptq") == weights("gptq")
    for name, flag, message in (("gptq", "none", "holds gptq weights"), ("gptq", "awq", "holds gptq weights"),
                                ("dense", "compressed-tensors", "checkpoint's own quantization_config")):
        assert cli_main(["plan", str(paths[name]), *gpu, "--quantization", flag]) == 2
        err = capsys.readouterr().err
        assert err.startswith("pagellm plan: error: --quantization") and message in err, err


def test_a_vision_model_plans_its_encoders_peak_and_feature_cache(tmp_path, capsys):
    vision = {"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
              "num_attention_heads": 2, "image_size": 32, "patch_size": 8}  # tests/test_llava.py's tower
    text = {**TINY_QWEN2, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "tie_word_embeddings": False}
    llava = tmp_path / "llava.json"
    llava.write_text(json.dumps({"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava",
                                 "image_token_index": 999, "text_config": text, "vision_config": vision}))
    flags = ["--dtype", "float32", "--max-num-batched-tokens", "64", "--max-num-seqs", "4", "--gpu-memory-gib", "1",
             "--max-model-len", "256", "--input-len", "128", "--output-len", "64"]
    plan = _plan_json([str(llava), *flags], capsys)
    # 64 placeholder tokens: four images of 16 start at once. A real tower's hidden states alone
    # (every layer's, as LLaVA reads its feature layer off them) are a lower bound of its peak.
    tower = transformers.CLIPVisionModel(transformers.CLIPVisionConfig(**vision)).eval()
    with torch.no_grad():
        out = tower(torch.zeros(4, 3, 32, 32), output_hidden_states=True)
    kept = sum(h.numel() * h.element_size() for h in out.hidden_states)
    assert kept < plan["encoder_peak_bytes"] < 4 * kept
    assert plan["encoder_cache_bytes"] == 4 * 16 * text["hidden_size"] * 4  # the projected features
    # The same language model without the tower: the step's peak grows by the features at least, and
    # the KV budget gives that up (and the tower's weights).
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps(text))
    without = _plan_json([str(plain), *flags], capsys)
    assert without["encoder_peak_bytes"] == 0
    grown = plan["activation_peak_bytes"] - without["activation_peak_bytes"]
    assert grown >= plan["encoder_cache_bytes"]
    assert without["kv_budget_bytes"] - plan["kv_budget_bytes"] >= grown
