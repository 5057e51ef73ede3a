"""Tiny random Hugging Face models of a family saved as safetensors, and the check that the engine's
greedy tokens and logprobs are Hugging Face's (the model-family tests)."""
from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers


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
