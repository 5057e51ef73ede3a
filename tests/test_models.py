"""Llama / Qwen2 / Qwen3 against Hugging Face `transformers`, plus the tensor-parallel weight loaders."""
from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import transformers
from attn_utils import build_metadata

from pagellm.attention import get_attn_backend
from pagellm.config.arch import ModelArchConfig
from pagellm.distributed import init_tensor_parallel
from pagellm.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from pagellm.models import get_model_class

BLOCK_SIZE = 16
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
COMMON = dict(vocab_size=211, intermediate_size=160, max_position_embeddings=256)
CASES = {
    "llama-gqa-untied": (
        "LlamaForCausalLM",
        dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
    ),
    "llama-tied-llama3-rope": (
        "LlamaForCausalLM",
        dict(hidden_size=96, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
             tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE),
    ),
    "llama-linear-rope": (
        "LlamaForCausalLM",
        dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
             rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
    ),
    "qwen2-tied": (
        "Qwen2ForCausalLM",
        dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             tie_word_embeddings=True),
    ),
    # head_dim * heads != hidden_size, as in real Qwen3 checkpoints.
    "qwen3-untied": (
        "Qwen3ForCausalLM",
        dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32),
    ),
}


def build_pair(case: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(Hugging Face model with random weights, our model loaded from its state_dict)."""
    arch, kwargs = CASES[case]
    hf_config = getattr(transformers, arch.replace("ForCausalLM", "Config"))(architectures=[arch], **COMMON, **kwargs)
    torch.manual_seed(0)
    hf = getattr(transformers, arch)(hf_config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            # Non-trivial norms and weights large enough that a wrong shard shows up in the logits.
            p.normal_(1.0, 0.2) if "norm" in name else p.normal_(0.0, 0.1)
    config = ModelArchConfig.from_hf_dict(hf_config.to_dict())
    with torch.device("cpu"):
        model = get_model_class(config.architecture)(config, get_attn_backend("torch"))
    loaded = model.load_weights(hf.state_dict().items())
    assert loaded == {name for name, _ in model.named_parameters()}
    return hf, model


def hf_logits(hf: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


def random_sequences(lengths: list[int], vocab_size: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(sum(lengths))
    return [torch.randint(vocab_size, (n,), generator=gen).tolist() for n in lengths]


@pytest.mark.parametrize("case", sorted(CASES))
def test_flat_prefill_matches_hf(case: str) -> None:
    hf, model = build_pair(case)
    prompts = random_sequences([7, 19, 1, 12], hf.config.vocab_size)
    md = build_metadata([(0, len(p), [0, 1]) for p in prompts], BLOCK_SIZE)
    input_ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.cat([torch.arange(len(p)) for p in prompts])

    with torch.no_grad():
        logits = model.compute_logits(model(input_ids, positions, md))

    assert logits.dtype == torch.float32
    expected = torch.cat([hf_logits(hf, p) for p in prompts])
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("case", sorted(CASES))
def test_chunked_prefill_then_decode_through_paged_cache_matches_hf(case: str) -> None:
    hf, model = build_pair(case)
    cfg = model.config
    # New tokens per sequence per step: chunked prompts (one joins late), then three decode steps.
    schedule = [[8, 16, 0], [8, 16, 9], [7, 8, 0], [1, 1, 1], [1, 1, 1], [1, 1, 1]]
    lengths = [sum(step[i] for step in schedule) for i in range(3)]
    sequences = random_sequences(lengths, cfg.vocab_size)
    expected = [hf_logits(hf, s) for s in sequences]

    num_blocks = 12
    blocks_per_seq = -(-max(lengths) // BLOCK_SIZE)
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(3)).tolist()
    block_ids = [perm[i * blocks_per_seq : (i + 1) * blocks_per_seq] for i in range(3)]
    shape = (num_blocks, BLOCK_SIZE, cfg.num_key_value_heads, cfg.head_dim)
    for layer in model.attention_layers():
        layer.kv_cache = (torch.zeros(shape), torch.zeros(shape))

    done = [0, 0, 0]
    for step in schedule:
        active = [i for i in range(3) if step[i]]
        md = build_metadata([(done[i], step[i], block_ids[i]) for i in active], BLOCK_SIZE)
        input_ids = torch.tensor([t for i in active for t in sequences[i][done[i] : done[i] + step[i]]])
        positions = torch.cat([torch.arange(done[i], done[i] + step[i]) for i in active])
        with torch.no_grad():
            logits = model.compute_logits(model(input_ids, positions, md))
        want = torch.cat([expected[i][done[i] : done[i] + step[i]] for i in active])
        torch.testing.assert_close(logits, want, atol=1e-4, rtol=1e-4)
        for i in active:
            done[i] += step[i]


def test_load_weights_rejects_unknown_names() -> None:
    _, model = build_pair("qwen2-tied")
    with pytest.raises(ValueError, match="model.layers.0.self_attn.unknown.weight"):
        model.load_weights([("model.layers.0.self_attn.unknown.weight", torch.zeros(1))])


def test_tied_model_shares_embedding_and_skips_lm_head() -> None:
    hf, model = build_pair("llama-tied-llama3-rope")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert "lm_head.weight" in hf.state_dict()


def test_registry_and_rope_validation() -> None:
    assert get_model_class("MistralForCausalLM") is get_model_class("LlamaForCausalLM")
    with pytest.raises(ValueError, match="Qwen3ForCausalLM"):
        get_model_class("GPT2LMHeadModel")
    with pytest.raises(ValueError, match="rope_scaling"):
        RotaryEmbedding(64, 128, 10000.0, {"type": "dynamic", "factor": 4.0})


@pytest.fixture
def tp_rank_1_of_2() -> Iterator[None]:
    init_tensor_parallel(rank=1, world_size=2)
    try:
        yield
    finally:
        init_tensor_parallel(rank=0, world_size=1)


def test_weight_loaders_copy_this_ranks_shard(tp_rank_1_of_2: None) -> None:
    full = torch.arange(8 * 6, dtype=torch.float32).view(8, 6)

    row = RowParallelLinear(6, 8, bias=True)
    row.weight.weight_loader(row.weight, full)
    row.bias.weight_loader(row.bias, full[:, 0])
    assert torch.equal(row.weight, full[:, 3:]) and torch.equal(row.bias, full[:, 0])

    gate_up = MergedColumnParallelLinear(6, [8, 8])
    gate_up.weight.weight_loader(gate_up.weight, full, 0)
    gate_up.weight.weight_loader(gate_up.weight, full + 100, 1)
    assert torch.equal(gate_up.weight, torch.cat([full[4:], full[4:] + 100]))

    head_dim = 2
    # 4 query heads, 1 kv head over 2 ranks: rank 1 has query heads 2-3 and a replica of kv head 0.
    qkv = QKVParallelLinear(6, head_dim, num_heads=4, num_kv_heads=1)
    q, kv = torch.randn(8, 6), torch.randn(2, 6)
    qkv.weight.weight_loader(qkv.weight, q, "q")
    qkv.weight.weight_loader(qkv.weight, kv, "k")
    qkv.weight.weight_loader(qkv.weight, kv + 1, "v")
    assert torch.equal(qkv.weight, torch.cat([q[4:], kv, kv + 1]))
    # 4 kv heads over 2 ranks: rank 1 has kv heads 2-3.
    qkv = QKVParallelLinear(6, head_dim, num_heads=4, num_kv_heads=4, bias=True)
    qkv.bias.weight_loader(qkv.bias, torch.arange(8.0), "k")
    assert torch.equal(qkv.bias[4:8], torch.arange(4.0, 8.0))

    vocab = torch.randn(11, 6)
    for cls in (VocabParallelEmbedding, ParallelLMHead):
        emb = cls(11, 6)
        emb.weight.weight_loader(emb.weight, vocab)
        assert torch.equal(emb.weight[:5], vocab[6:]) and torch.equal(emb.weight[5], torch.zeros(6))


def test_qkv_rejects_indivisible_kv_heads(tp_rank_1_of_2: None) -> None:
    init_tensor_parallel(rank=1, world_size=4)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        QKVParallelLinear(64, 16, num_heads=4, num_kv_heads=3)
