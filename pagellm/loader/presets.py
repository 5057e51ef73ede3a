"""Real model configs for `--load-format dummy` benchmarks, so no checkpoint is needed to size a run.

Values are those of the models' published `config.json` files; keys are Hugging Face ids plus short
aliases. A preset carries no tokenizer: benchmark callers pass token ids.
"""
from __future__ import annotations

import copy
from typing import Any

_LLAMA_3_1_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
}

_LLAMA_3_2_1B: dict[str, Any] = {
    **_LLAMA_3_1_8B,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "rope_scaling": {**_LLAMA_3_1_8B["rope_scaling"], "factor": 32.0},
    "tie_word_embeddings": True,
}
"""Llama-3.1-8B's tokenizer and vocabulary: its natural draft model (speculative decoding)."""

_QWEN2_5_7B: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "vocab_size": 152064,
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "rope_scaling": None,
    "sliding_window": 131072,
    "use_sliding_window": False,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}

_QWEN3_8B: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "rope_scaling": None,
    "attention_bias": False,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}

_QWEN3_30B_A3B: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "rope_scaling": None,
    "attention_bias": False,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}
"""30.5B parameters, 3.3B of them read per token (8 of 128 experts a layer)."""

_MIXTRAL_8X7B: dict[str, Any] = {
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
"""46.7B parameters, 12.9B of them read per token (2 of 8 experts a layer)."""

_QWEN1_5_MOE_A2_7B: dict[str, Any] = {
    "architectures": ["Qwen2MoeForCausalLM"],
    "model_type": "qwen2_moe",
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "moe_intermediate_size": 1408,
    "shared_expert_intermediate_size": 5632,
    "num_experts": 60,
    "num_experts_per_tok": 4,
    "norm_topk_prob": False,
    "decoder_sparse_step": 1,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "hidden_act": "silu",
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "use_sliding_window": False,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 151643,
    "eos_token_id": 151643,
}
"""14.3B parameters, 2.7B of them read per token (4 of 60 experts and a shared expert a layer)."""

_PHI_3_MINI_4K: dict[str, Any] = {
    "architectures": ["Phi3ForCausalLM"],
    "model_type": "phi3",
    "vocab_size": 32064,
    "hidden_size": 3072,
    "intermediate_size": 8192,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "original_max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "sliding_window": 2047,
    "attention_bias": False,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 32000,
}
"""3.8B parameters; q/k/v and gate/up stored fused."""

_PHI_3_5_MINI: dict[str, Any] = {
    **_PHI_3_MINI_4K,
    "max_position_embeddings": 131072,
    "rope_scaling": {
        "type": "longrope",
        "long_factor": [
            1.0800000429153442, 1.1100000143051147, 1.1399999856948853, 1.340000033378601, 1.5899999141693115,
            1.600000023841858, 1.6200000047683716, 2.620000123977661, 3.2300000190734863, 3.2300000190734863,
            4.789999961853027, 7.400000095367432, 7.700000286102295, 9.09000015258789, 12.199999809265137,
            17.670000076293945, 24.46000099182129, 28.57000160217285, 30.420001983642578, 30.840002059936523,
            32.590003967285156, 32.93000411987305, 42.320003509521484, 44.96000289916992, 50.340003967285156,
            50.45000457763672, 57.55000305175781, 57.93000411987305, 58.21000289916992, 60.1400032043457,
            62.61000442504883, 62.62000274658203, 62.71000289916992, 63.1400032043457, 63.1400032043457,
            63.77000427246094, 63.93000411987305, 63.96000289916992, 63.970001220703125, 64.02999877929688,
            64.06999969482422, 64.08000183105469, 64.12000274658203, 64.41000366210938, 64.4800033569336,
            64.51000213623047, 64.52999877929688, 64.83999633789062,
        ],
        "short_factor": [
            1.0, 1.0199999809265137, 1.0299999713897705, 1.0299999713897705, 1.0499999523162842, 1.0499999523162842,
            1.0499999523162842, 1.0499999523162842, 1.0499999523162842, 1.0699999332427979, 1.0999999046325684,
            1.1099998950958252, 1.1599998474121094, 1.1599998474121094, 1.1699998378753662, 1.2899998426437378,
            1.339999794960022, 1.679999828338623, 1.7899998426437378, 1.8199998140335083, 1.8499997854232788,
            1.8799997568130493, 1.9099997282028198, 1.9399996995925903, 1.9899996519088745, 2.0199997425079346,
            2.0199997425079346, 2.0199997425079346, 2.0199997425079346, 2.0199997425079346, 2.0199997425079346,
            2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0299997329711914,
            2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0799996852874756,
            2.0899996757507324, 2.189999580383301, 2.2199995517730713, 2.5899994373321533, 2.729999542236328,
            2.749999523162842, 2.8399994373321533,
        ],
    },
    "sliding_window": 262144,
}
"""Phi-3-mini's shapes with LongRoPE to 128k positions."""

_GEMMA_3_12B: dict[str, Any] = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "vocab_size": 262208,
    "hidden_size": 3840,
    "intermediate_size": 15360,
    "num_hidden_layers": 48,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "rope_local_base_freq": 10000.0,
    "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    "query_pre_attn_scalar": 256,
    "sliding_window": 1024,
    "sliding_window_pattern": 6,
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
    "attention_bias": False,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "bos_token_id": 2,
    "eos_token_id": 1,
}
"""Gemma-3-12B-it's language model (its `text_config`, as Gemma3ForCausalLM): 5 of every 6 layers attend
within 1024 tokens."""

_GEMMA_2_9B: dict[str, Any] = {
    "architectures": ["Gemma2ForCausalLM"],
    "model_type": "gemma2",
    "vocab_size": 256000,
    "hidden_size": 3584,
    "intermediate_size": 14336,
    "num_hidden_layers": 42,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "final_logit_softcapping": 30.0,
    "attn_logit_softcapping": 50.0,
    "attention_bias": False,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "bos_token_id": 2,
    "eos_token_id": 1,
}
"""Every other layer attends within 4096 tokens; scores and logits soft-capped."""

_GPT_OSS_20B: dict[str, Any] = {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "vocab_size": 201088,
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "num_local_experts": 32,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 24,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 150000,
    "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                     "original_max_position_embeddings": 4096},
    "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "attention_bias": True,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]},
    "torch_dtype": "bfloat16",
    "bos_token_id": 199998,  # generation_config.json's (config.json names none)
    "eos_token_id": 200002,
    "pad_token_id": 199999,
}
"""20.9B parameters, 3.6B of them read per token (4 of 32 experts a layer); layers alternate a
128-token window and full attention. Its MXFP4 experts load dequantized: random dense ones here."""

_GPT_OSS_120B: dict[str, Any] = {
    **_GPT_OSS_20B,
    "num_local_experts": 128,
    "num_hidden_layers": 36,
    "layer_types": ["sliding_attention", "full_attention"] * 18,
}
"""116.8B parameters, 5.1B of them read per token (4 of 128 experts a layer)."""

PRESETS: dict[str, dict[str, Any]] = {
    "meta-llama/Llama-3.1-8B-Instruct": _LLAMA_3_1_8B,
    "meta-llama/Llama-3.1-8B": {**_LLAMA_3_1_8B, "eos_token_id": 128001},
    "llama-3.1-8b": _LLAMA_3_1_8B,
    "meta-llama/Llama-3.2-1B-Instruct": _LLAMA_3_2_1B,
    "llama-3.2-1b": _LLAMA_3_2_1B,
    "Qwen/Qwen2.5-7B-Instruct": _QWEN2_5_7B,
    "Qwen/Qwen2.5-7B": {**_QWEN2_5_7B, "eos_token_id": 151643},
    "qwen2.5-7b": _QWEN2_5_7B,
    "Qwen/Qwen3-8B": _QWEN3_8B,
    "qwen3-8b": _QWEN3_8B,
    "microsoft/Phi-3-mini-4k-instruct": _PHI_3_MINI_4K,
    "phi-3-mini-4k": _PHI_3_MINI_4K,
    "microsoft/Phi-3.5-mini-instruct": _PHI_3_5_MINI,
    "phi-3.5-mini": _PHI_3_5_MINI,
    "Qwen/Qwen3-30B-A3B": _QWEN3_30B_A3B,
    "qwen3-30b-a3b": _QWEN3_30B_A3B,
    "mistralai/Mixtral-8x7B-Instruct-v0.1": _MIXTRAL_8X7B,
    "mixtral-8x7b": _MIXTRAL_8X7B,
    "Qwen/Qwen1.5-MoE-A2.7B": _QWEN1_5_MOE_A2_7B,
    "qwen1.5-moe-a2.7b": _QWEN1_5_MOE_A2_7B,
    "google/gemma-3-12b-it": _GEMMA_3_12B,
    "gemma-3-12b": _GEMMA_3_12B,
    "google/gemma-2-9b-it": _GEMMA_2_9B,
    "gemma-2-9b": _GEMMA_2_9B,
    "openai/gpt-oss-20b": _GPT_OSS_20B,
    "gpt-oss-20b": _GPT_OSS_20B,
    "openai/gpt-oss-120b": _GPT_OSS_120B,
    "gpt-oss-120b": _GPT_OSS_120B,
}

# Generation defaults published next to the configs; only what the engine reads (stop ids).
_GENERATION_EOS: dict[str, list[int]] = {
    "meta-llama/Llama-3.1-8B-Instruct": [128001, 128008, 128009],
    "llama-3.1-8b": [128001, 128008, 128009],
    "meta-llama/Llama-3.1-8B": [128001],
    "meta-llama/Llama-3.2-1B-Instruct": [128001, 128008, 128009],
    "llama-3.2-1b": [128001, 128008, 128009],
    "Qwen/Qwen2.5-7B-Instruct": [151645, 151643],
    "qwen2.5-7b": [151645, 151643],
    "Qwen/Qwen2.5-7B": [151643],
    "Qwen/Qwen3-8B": [151645, 151643],
    "qwen3-8b": [151645, 151643],
    "microsoft/Phi-3-mini-4k-instruct": [32000, 32001, 32007],
    "phi-3-mini-4k": [32000, 32001, 32007],
    "microsoft/Phi-3.5-mini-instruct": [32007, 32001, 32000],
    "phi-3.5-mini": [32007, 32001, 32000],
    "Qwen/Qwen3-30B-A3B": [151645, 151643],
    "qwen3-30b-a3b": [151645, 151643],
    "mistralai/Mixtral-8x7B-Instruct-v0.1": [2],
    "mixtral-8x7b": [2],
    "Qwen/Qwen1.5-MoE-A2.7B": [151643],
    "qwen1.5-moe-a2.7b": [151643],
    "google/gemma-3-12b-it": [1, 106],
    "gemma-3-12b": [1, 106],
    "google/gemma-2-9b-it": [1, 107],
    "gemma-2-9b": [1, 107],
    "openai/gpt-oss-20b": [200002, 199999, 200012],
    "gpt-oss-20b": [200002, 199999, 200012],
    "openai/gpt-oss-120b": [200002, 199999, 200012],
    "gpt-oss-120b": [200002, 199999, 200012],
}


def get_preset(name: str) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """`(config, generation_config)` of a preset, matched case-insensitively, or None if unknown."""
    key = next((k for k in PRESETS if k.lower() == name.lower()), None)
    if key is None:
        return None
    config = PRESETS[key]
    generation_config = {"bos_token_id": config["bos_token_id"], "eos_token_id": _GENERATION_EOS[key]}
    return copy.deepcopy(config), generation_config
