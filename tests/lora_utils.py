"""Tiny Hugging Face Llamas and random PEFT adapters for the LoRA tests: the reference is PEFT itself."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM

TINY_HF_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 96,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
}
"""A two-layer Llama with grouped-query attention, small enough for the quick tier."""

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_tiny_llama(folder: Path, seed: int = 0):
    """A random tiny `LlamaForCausalLM` saved as safetensors in `folder`, with a word-level tokenizer
    (token i is "t{i}"); returns the model (fp32, eval)."""
    torch.manual_seed(seed)
    config = {k: v for k, v in TINY_HF_LLAMA.items() if k not in ("architectures", "model_type")}
    model = LlamaForCausalLM(LlamaConfig(**config)).eval()
    with torch.no_grad():  # weights large enough that the adapters and the base both matter
        for p in model.parameters():
            p.normal_(0, 0.25)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(TINY_HF_LLAMA["vocab_size"])}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "config.json").write_text(json.dumps({**json.loads((folder / "config.json").read_text()),
                                                    "architectures": ["LlamaForCausalLM"]}))
    return model


def save_adapter(base, folder: Path, *, r: int, alpha: float, targets: list[str], seed: int,
                 use_rslora: bool = False, scale: float = 1.0):
    """A PEFT LoRA adapter of `base` (left untouched) with random non-zero A and B, saved in
    `folder`; returns the PEFT model to compare against."""
    torch.manual_seed(seed)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, init_lora_weights=False,
                        use_rslora=use_rslora)
    model = get_peft_model(copy.deepcopy(base), config).eval()
    if scale != 1.0:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.mul_(scale)
    model.save_pretrained(folder)
    return model


def greedy_reference(model, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and each one's logprob, from the reference model."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = [float(torch.log_softmax(logits[0].float(), -1)[t]) for logits, t in zip(out.logits, tokens)]
    return tokens, logprobs
