"""Prompts with images: the model's own Hugging Face processor expands each image token to the
image's feature count and preprocesses the pixels; the result is the request's `multi_modal` items."""
from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from pagellm.config.arch import ModelArchConfig
from pagellm.core.multimodal import MultiModalItem

TEXT_ONLY = ("this model takes text only; images need a model with a vision tower (LLaVA-1.5, Qwen2-VL, "
             "Qwen2.5-VL: docs/models.md)")
"""What a request with images hears from a text-only model."""


def takes_images(arch: ModelArchConfig) -> bool:
    """Whether the model has a vision tower (its config.json a `vision_config`)."""
    return "vision_config" in arch.hf_config


class ImageProcessor:
    """Runs the model folder's `AutoProcessor` (loaded on the first image: importing transformers
    costs seconds, which text-only requests never pay). A dynamic-resolution model (Qwen2-VL: its
    vision_config has `spatial_merge_size`) runs the folder's image processor and tokenizer instead
    and expands each image token itself, as its processor would: that processor also builds a
    video processor, which needs torchvision, for images alone."""

    def __init__(self, model_path: str, arch: ModelArchConfig) -> None:
        self.model_path = model_path
        hf = arch.hf_config
        self.image_token_id: int = hf.get("image_token_id", hf.get("image_token_index"))
        self.merge_size: int | None = hf["vision_config"].get("spatial_merge_size")
        """Patches per side that merge into one image feature (None: a fixed-size tower, LLaVA)."""
        self._hf_processor: Any = None
        self._tokenizer: Any = None

    def process(self, text: str, media: Mapping, add_special_tokens: bool = True,
                ) -> tuple[list[int], tuple[MultiModalItem, ...]]:
        """(prompt token ids with each image token expanded, the images as items), for a prompt's
        text and its `multi_modal_data` ({"image": a PIL image or a list of them}); the tokenizer adds
        special tokens (BOS) if `add_special_tokens`."""
        unknown = set(media) - {"image"}
        if unknown:
            raise ValueError(f"multi_modal_data holds {sorted(unknown)}; this model takes only 'image'")
        images = media.get("image")
        images = list(images) if isinstance(images, (list, tuple)) else [images]
        if not images:
            raise ValueError("multi_modal_data's 'image' is empty: give a PIL image or a list of them")
        for image in images:
            if not (hasattr(image, "convert") and hasattr(image, "size")):
                raise ValueError(f"multi_modal_data's 'image' must be PIL images, got {type(image).__name__}")
        processor = self._processor()
        image_token = self._image_token(processor)
        if image_token is not None and text.count(image_token) != len(images):
            raise ValueError(f"multi_modal_data: the prompt has {text.count(image_token)} image tokens "
                             f"({image_token!r}) for {len(images)} images; give one per image")
        rgb = [image.convert("RGB") for image in images]
        if self.merge_size is not None:
            return self._process_dynamic(text, image_token, rgb, add_special_tokens)
        try:
            out = processor(text=text, images=rgb, return_tensors="np", add_special_tokens=add_special_tokens)
        except ValueError as e:  # the processor's own check: image tokens in the text vs images given
            raise ValueError(f"multi_modal_data: {e}") from None
        token_ids = [int(t) for t in out["input_ids"][0]]
        pixels = np.ascontiguousarray(out["pixel_values"], dtype=np.float32)
        # A fixed-size tower: each image's placeholders are as many (the runs' total shared).
        total = token_ids.count(self.image_token_id)
        if total % len(pixels):
            raise ValueError(f"the prompt has {total} image placeholder tokens for {len(pixels)} images")
        return token_ids, self._items(token_ids, list(pixels), [total // len(pixels)] * len(pixels),
                                      [None] * len(pixels))

    def _process_dynamic(self, text: str, image_token: str, images: list, add_special_tokens: bool,
                         ) -> tuple[list[int], tuple[MultiModalItem, ...]]:
        """Qwen2-VL's processing: each image's patches [t x h x w, channels x patch size] and grid,
        its image token repeated t x h x w / merge_size^2 times (its merged features)."""
        try:
            out = self._hf_processor(images=images, return_tensors="np")
        except ValueError as e:  # an image it cannot resize within its bounds (an extreme aspect ratio)
            raise ValueError(f"multi_modal_data: {e}") from None
        pixels = np.ascontiguousarray(out["pixel_values"], dtype=np.float32)
        grids = [tuple(int(n) for n in grid) for grid in out["image_grid_thw"]]
        lengths = [t * h * w // self.merge_size ** 2 for t, h, w in grids]
        parts = text.split(image_token)
        expanded = parts[0] + "".join(image_token * n + part for n, part in zip(lengths, parts[1:]))
        token_ids = [int(t) for t in self._tokenizer(expanded, add_special_tokens=add_special_tokens)["input_ids"]]
        bounds = np.cumsum([0] + [t * h * w for t, h, w in grids])
        per_image = [pixels[bounds[i]:bounds[i + 1]] for i in range(len(grids))]
        return token_ids, self._items(token_ids, per_image, lengths, grids)

    def _items(self, token_ids: list[int], pixels: list[np.ndarray], lengths: list[int],
               grids: list[tuple[int, int, int] | None]) -> tuple[MultiModalItem, ...]:
        """One item per image: its placeholders are the next `lengths[i]` tokens of the prompt's
        runs of the image token (adjacent images' placeholders form one run)."""
        positions = [pos for pos, token in enumerate(token_ids) if token == self.image_token_id]
        if len(positions) != sum(lengths):
            raise ValueError(f"the prompt has {len(positions)} image placeholder tokens for {len(pixels)} images "
                             f"of {sum(lengths)} features")
        items, first = [], 0
        for image, length, grid in zip(pixels, lengths, grids, strict=True):
            start = positions[first]
            if positions[first + length - 1] != start + length - 1:
                raise ValueError(f"an image's {length} placeholder tokens from position {start} are not contiguous")
            first += length
            digest = hashlib.sha256(repr((image.shape, grid)).encode())
            digest.update(image.tobytes())
            items.append(MultiModalItem(modality="image", content_hash=digest.hexdigest(), offset=start,
                                        length=length, data=image.tobytes(), shape=tuple(image.shape),
                                        grid_thw=grid))
        return tuple(items)

    def _image_token(self, processor: Any) -> str | None:
        if self.merge_size is None:
            return getattr(processor, "image_token", None)
        return self._tokenizer.convert_ids_to_tokens(self.image_token_id)

    def _processor(self) -> Any:
        if self._hf_processor is None:
            import transformers  # costs seconds: only prompts with images pay it

            try:
                if self.merge_size is None:
                    self._hf_processor = transformers.AutoProcessor.from_pretrained(self.model_path)
                else:
                    self._tokenizer = transformers.AutoTokenizer.from_pretrained(self.model_path)
                    self._hf_processor = transformers.AutoImageProcessor.from_pretrained(self.model_path)
            except (OSError, ValueError) as e:
                raise ValueError(f"multi_modal_data: the model {self.model_path!r} has no Hugging Face processor "
                                 f"to prepare images with (processor_config.json, preprocessor_config.json): {e}"
                                 ) from None
            if self.merge_size is None and not callable(getattr(self._hf_processor, "image_processor", None)):
                raise ValueError(f"multi_modal_data: the model {self.model_path!r} has a tokenizer but no image "
                                 "processor (preprocessor_config.json)")
        return self._hf_processor
