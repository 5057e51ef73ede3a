"""Checks shared by the engine-level tests."""
from __future__ import annotations

import asyncio

from pagellm.engine.llm_engine import LLMEngine

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 16, "intermediate_size": 32,
    "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 512,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
}
"""config.json of a one-layer Llama for `load_format="dummy"` engines: no tokenizer, milliseconds a step."""


def assert_no_leak(engine: LLMEngine) -> None:
    """Nothing left to run, every KV block back in the pool, no proposer state left behind."""
    core = engine.engine_core
    assert not core.has_unfinished_requests()
    if core.scheduler.proposer is not None:
        assert core.scheduler.proposer.num_requests_kept == 0
    assert core.scheduler.kv.pool.num_free_blocks == core.num_blocks
    assert core.stats().kv_cache_usage == 0.0


async def wait_for(predicate, timeout_s: float = 30.0) -> None:
    """Poll (the engine reports every step or heartbeat) until `predicate()`, failing at the deadline."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        assert loop.time() < deadline, "condition not reached before the deadline"
        await asyncio.sleep(0.05)
