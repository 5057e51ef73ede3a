"""Tiny random Hugging Face models of a family saved as safetensors, and the check that the engine's
greedy tokens and logprobs are Hugging Face's (the model-family tests)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lora_utils import greedy_reference
from peft import LoraConfig, get_peft_model
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers

from pagellm import LLM, LoRARequest, SamplingParams


def save_with_tokenizer(model, folder: Path) -> None:
    """`model` saved as safetensors in `folder` beside a word-level tokenizer of its vocabulary
    (token i is "t{i}")."""
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(model.config.vocab_size)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(folder / "tokenizer.json"))


def assert_matches_hf(model, outs, prompts: list[list[int]], new_tokens: int) -> None:
    """Each output is Hugging Face's greedy continuation: at every position the token is the argmax of
    HF's logits over the prompt and the tokens before it, and its logprob HF's (one HF forward pass
    per sequence, the same logits its greedy generation computes step by step)."""
    for prompt, out in zip(prompts, outs):
        seq = out.outputs[0]
        assert len(seq.token_ids) == new_tokens
        with torch.no_grad():
            logits = model(torch.tensor([prompt + seq.token_ids[:-1]])).logits[0, len(prompt) - 1:].float()
        assert logits.argmax(dim=-1).tolist() == seq.token_ids, f"prompt of {len(prompt)} tokens"
        ref_logprobs = logits.log_softmax(dim=-1).gather(1, torch.tensor(seq.token_ids)[:, None])[:, 0]
        logprobs = torch.tensor([lp[t].logprob for lp, t in zip(seq.logprobs, seq.token_ids)])
        torch.testing.assert_close(logprobs, ref_logprobs, atol=1e-4, rtol=0)


def assert_attention_adapter_served_and_moe_adapter_refused(base_model, folder: Path, tmp_path: Path,
                                                            prompt: list[int], moe_module: str, moe_in: int,
                                                            moe_out: int, **engine_kwargs) -> None:
    """A mixture-of-experts model: a random PEFT adapter of q/v gives `peft`'s greedy tokens; one of
    `moe_module` (a layer-0 MoE part, `moe_in` -> `moe_out`) is refused naming the MoE block."""
    torch.manual_seed(5)
    peft_model = get_peft_model(base_model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                                       init_lora_weights=False)).eval()
    peft_model.save_pretrained(tmp_path / "attention")
    llm = LLM(str(folder), **engine_kwargs, enable_lora=True, max_lora_rank=8)
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=8, logprobs=0),
                       lora_request=LoRARequest("attention", 1, str(tmp_path / "attention")), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == greedy_reference(peft_model, prompt, 8)[0]

    moe = tmp_path / "moe"
    moe.mkdir()
    (moe / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 16}))
    key = f"base_model.model.model.layers.0.mlp.{moe_module}.lora_A.weight"
    save_file({key: torch.zeros(8, moe_in), key.replace("lora_A", "lora_B"): torch.zeros(moe_out, 8)},
              moe / "adapter_model.safetensors")
    with pytest.raises(ValueError, match="adapts part of a mixture-of-experts block"):
        llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=2),
                     lora_request=LoRARequest("moe", 2, str(moe)), use_tqdm=False)


def assert_prefix_hits_keep_the_tokens(folder: Path, model, prompts: list[list[int]], min_hits: int, params,
                                       new_tokens: int, **engine_kwargs) -> None:
    """The first prompt alone, then the others (which share its prefix) from the prefix cache: at
    least `min_hits` tokens hit, and every output is still HF's."""
    first, *rest = prompts
    llm = LLM(str(folder), **engine_kwargs)
    outs = llm.generate([{"prompt_token_ids": first}], params, use_tqdm=False)
    outs += llm.generate([{"prompt_token_ids": p} for p in rest], params, use_tqdm=False)
    assert llm.llm_engine.get_stats().prefix_cache_hits >= min_hits
    assert_matches_hf(model, outs, prompts, new_tokens)
