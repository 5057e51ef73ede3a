"""Random vision-language models of real models' shapes, for benchmarks.vlm_serving: each family's
config (transformers' config classes), its processor (a word-level tokenizer holding the family's
special tokens, the family's image processor), its prompt layout around one image and Hugging Face's
batched inputs, so nothing is downloaded."""
from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from PIL import Image
from tokenizers import Tokenizer, models, pre_tokenizers

QWEN_VISION = "<|vision_start|><|image_pad|><|vision_end|>"
"""One image in a Qwen-VL prompt: the processor repeats <|image_pad|> once per merged feature."""
_QWEN_7B_TOKENS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645,
                   "<|vision_start|>": 151652, "<|vision_end|>": 151653, "<|image_pad|>": 151655,
                   "<|video_pad|>": 151656}
"""Qwen2.5-VL's tokenizer's ids of its special tokens."""

SHAPES: dict[str, dict[str, Any]] = {
    "llava-1.5-7b": {
        "family": "llava",
        "text": dict(vocab_size=32064, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096),
        "vision": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                       image_size=336, patch_size=14, projection_dim=768),
        "special_tokens": {"<image>": 32000},
    },
    "tiny": {  # tests/test_llava.py's shapes
        "family": "llava",
        "text": dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=512),
        "vision": dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                       image_size=32, patch_size=8),
        "special_tokens": {"<image>": 127},
    },
    "qwen2.5-vl-7b": {  # Qwen/Qwen2.5-VL-7B-Instruct's config.json and preprocessor_config.json
        "family": "qwen2.5-vl",
        "text": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                     num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=128000,
                     rms_norm_eps=1e-6,
                     rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}),
        "vision": dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                       patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                       fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2),
        # Any image from 56x56 to 28*28*1280 pixels keeps its size rounded to 28 (336x336: 144 features).
        "pixels": dict(min_pixels=56 * 56, max_pixels=28 * 28 * 1280),
        "special_tokens": _QWEN_7B_TOKENS,
    },
    "tiny-qwen2.5-vl": {  # tests/test_qwen_vl.py's shapes
        "family": "qwen2.5-vl",
        "text": dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=512,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}),
        "vision": dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, patch_size=4,
                       spatial_merge_size=2, temporal_patch_size=2, window_size=16, fullatt_block_indexes=[1]),
        "pixels": dict(min_pixels=8 * 8, max_pixels=64 * 64),
        "special_tokens": {"<|endoftext|>": 121, "<|im_start|>": 122, "<|im_end|>": 123, "<|vision_start|>": 126,
                           "<|vision_end|>": 125, "<|image_pad|>": 127, "<|video_pad|>": 124},
    },
}
"""Model shapes by name: the family, its language model's and vision tower's config fields, the
special tokens' ids (prompt words are the ids from 3 to the lowest of them) and, for dynamic
resolution, the image processor's pixel bounds."""

HFInputs = Callable[[list[str], list[Image.Image]], transformers.BatchFeature]
"""Prompts and their images (one each) to Hugging Face `generate`'s batched, left-padded inputs."""


@dataclass(frozen=True)
class Family:
    """What a model family's benchmark model differs in."""

    model_class: type[transformers.PreTrainedModel]
    config: Callable[[dict[str, Any]], transformers.PretrainedConfig]
    save_processor: Callable[[dict[str, Any], Path], None]
    prompt: Callable[[list[str]], str]
    """Words of text to a prompt with one image in the model's layout."""
    hf_inputs: Callable[[str], HFInputs]
    """The saved folder to a function preparing Hugging Face's inputs."""


def word_tokenizer(vocab_size: int, fixed: dict[str, int], special: list[str],
                   **roles: str) -> transformers.PreTrainedTokenizerFast:
    """Whitespace-split words: `fixed` tokens at their ids, "t<i>" at every other id below
    `vocab_size`; `special` ones are added tokens, whole wherever they stand in text."""
    taken = set(fixed.values())
    vocab = {f"t{i}": i for i in range(vocab_size) if i not in taken} | fixed
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>",
                                                extra_special_tokens=special, padding_side="left", **roles)


def _llava_config(spec: dict[str, Any]) -> transformers.LlavaConfig:
    text = transformers.LlamaConfig(**spec["text"], bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return transformers.LlavaConfig(vision_config=transformers.CLIPVisionConfig(**spec["vision"]), text_config=text,
                                    image_token_index=spec["special_tokens"]["<image>"],
                                    architectures=["LlavaForConditionalGeneration"])


def _llava_processor(spec: dict[str, Any], folder: Path) -> None:
    tokenizer = word_tokenizer(spec["text"]["vocab_size"], {"<unk>": 0, "<s>": 1, "</s>": 2, **spec["special_tokens"]},
                               ["<image>"], bos_token="<s>", eos_token="</s>", pad_token="<unk>")
    size = spec["vision"]["image_size"]
    images = transformers.CLIPImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size})
    processor = transformers.LlavaProcessor(image_processor=images, tokenizer=tokenizer,
                                            patch_size=spec["vision"]["patch_size"],
                                            vision_feature_select_strategy="default", num_additional_image_tokens=1)
    processor.save_pretrained(folder)


def _llava_prompt(words: list[str]) -> str:
    half = len(words) // 2
    return " ".join([*words[:half], "<image>", *words[half:]])


def _llava_inputs(folder: str) -> HFInputs:
    processor = transformers.AutoProcessor.from_pretrained(folder)
    processor.tokenizer.padding_side = "left"
    return lambda texts, images: processor(text=texts, images=images, padding=True, return_tensors="pt")


def _qwen_config(spec: dict[str, Any]) -> transformers.Qwen2_5_VLConfig:
    ids = spec["special_tokens"]
    tokens = dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                  vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
                  bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"])
    return transformers.Qwen2_5_VLConfig(text_config={**spec["text"], "bos_token_id": ids["<|endoftext|>"],
                                                      "eos_token_id": ids["<|im_end|>"],
                                                      "pad_token_id": ids["<|endoftext|>"]},
                                         vision_config=spec["vision"], **tokens,
                                         architectures=["Qwen2_5_VLForConditionalGeneration"])


def _qwen_processor(spec: dict[str, Any], folder: Path) -> None:
    """The tokenizer and Qwen2-VL's image processor, saved apart: transformers' Qwen2.5-VL processor
    also builds a video processor, which needs torchvision (pagellm loads the two as well)."""
    special = spec["special_tokens"]
    tokenizer = word_tokenizer(spec["text"]["vocab_size"], {"<unk>": 0, "user": 1, "assistant": 2, **special},
                               list(special), eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.save_pretrained(folder)
    vision = spec["vision"]
    transformers.Qwen2VLImageProcessorPil(patch_size=vision["patch_size"], merge_size=vision["spatial_merge_size"],
                                          temporal_patch_size=vision["temporal_patch_size"], **spec["pixels"],
                                          ).save_pretrained(folder)


def _qwen_prompt(words: list[str]) -> str:
    """Qwen's chat layout (its template's default system turn left out): the image, then the text."""
    return f"<|im_start|>user {QWEN_VISION} {' '.join(words)} <|im_end|> <|im_start|>assistant"


_MM_TOKEN_TYPES = "mm_token_type_ids" in inspect.signature(transformers.Qwen2_5_VLModel.get_rope_index).parameters
"""Whether this transformers places M-RoPE positions by `mm_token_type_ids` (its processor's output;
generate without it turns image features by text positions) rather than by the image token's id."""


def _qwen_inputs(folder: str) -> HFInputs:
    """What Qwen2.5-VL's processor returns for images, which it cannot build here (see
    `_qwen_processor`): each <|image_pad|> repeated once per merged feature of its image."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, padding_side="left")
    images_processor = transformers.AutoImageProcessor.from_pretrained(folder)
    image_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")

    def prepare(texts: list[str], images: list[Image.Image]) -> transformers.BatchFeature:
        pixels = images_processor(images=images, return_tensors="pt")
        features = (pixels["image_grid_thw"].prod(-1) // images_processor.merge_size ** 2).tolist()
        texts = [text.replace("<|image_pad|>", "<|image_pad|>" * n) for text, n in zip(texts, features, strict=True)]
        inputs = tokenizer(texts, padding=True, return_tensors="pt")
        if _MM_TOKEN_TYPES:
            inputs["mm_token_type_ids"] = (inputs["input_ids"] == image_id).int()
        return transformers.BatchFeature({**inputs, **pixels})

    return prepare


FAMILIES: dict[str, Family] = {
    "llava": Family(transformers.LlavaForConditionalGeneration, _llava_config, _llava_processor, _llava_prompt,
                    _llava_inputs),
    "qwen2.5-vl": Family(transformers.Qwen2_5_VLForConditionalGeneration, _qwen_config, _qwen_processor,
                         _qwen_prompt, _qwen_inputs),
}


def family(shape: str) -> Family:
    """The family of the model shape `shape` (a key of SHAPES)."""
    return FAMILIES[SHAPES[shape]["family"]]


def build_model(shape: str, folder: Path, dtype: torch.dtype, device: str) -> None:
    """A random model of `shape` and its processor, saved to `folder`."""
    spec = SHAPES[shape]
    config = family(shape).config(spec)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in its dtype: a 7B model in float32 would take 28 GB
    try:
        with torch.device(device):
            model = family(shape).model_class(config).eval()
    finally:
        torch.set_default_dtype(default)
    model.save_pretrained(folder)
    del model
    family(shape).save_processor(spec, folder)
