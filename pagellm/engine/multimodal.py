"""Prompts with images: the model's own Hugging Face processor expands each image token to the
image's feature count and preprocesses the pixels; the result is the request's `multi_modal` items."""
from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from pagellm.config.arch import ModelArchConfig
from pagellm.core.multimodal import MultiModalItem


def takes_images(arch: ModelArchConfig) -> bool:
    """Whether the model has a vision tower (its config.json a `vision_config`)."""
    return "vision_config" in arch.hf_config


class ImageProcessor:
    """Runs the model folder's `AutoProcessor` (loaded on the first image: importing transformers
    costs seconds, which text-only requests never pay)."""

    def __init__(self, model_path: str, arch: ModelArchConfig) -> None:
        self.model_path = model_path
        hf = arch.hf_config
        self.image_token_id: int = hf.get("image_token_id", hf.get("image_token_index"))
        self._hf_processor: Any = None

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
        image_token = getattr(processor, "image_token", None)
        if image_token is not None and text.count(image_token) != len(images):
            raise ValueError(f"multi_modal_data: the prompt has {text.count(image_token)} image tokens "
                             f"({image_token!r}) for {len(images)} images; give one per image")
        try:
            out = processor(text=text, images=[image.convert("RGB") for image in images], return_tensors="np",
                            add_special_tokens=add_special_tokens)
        except ValueError as e:  # the processor's own check: image tokens in the text vs images given
            raise ValueError(f"multi_modal_data: {e}") from None
        token_ids = [int(t) for t in out["input_ids"][0]]
        pixels = np.ascontiguousarray(out["pixel_values"], dtype=np.float32)
        return token_ids, self._items(token_ids, pixels)

    def _items(self, token_ids: list[int], pixels: np.ndarray) -> tuple[MultiModalItem, ...]:
        """One item per image: its placeholders are the prompt's runs of the image token, which the
        processor made each as long as that image's features."""
        runs: list[tuple[int, int]] = []
        for pos, token in enumerate(token_ids):
            if token != self.image_token_id:
                continue
            if runs and runs[-1][1] == pos:
                runs[-1] = (runs[-1][0], pos + 1)
            else:
                runs.append((pos, pos + 1))
        if len(runs) != len(pixels):
            # Adjacent images' placeholders form one run; split it by the (fixed) per-image count.
            total = sum(end - start for start, end in runs)
            if total % len(pixels):
                raise ValueError(f"the prompt has {total} image placeholder tokens for {len(pixels)} images")
            per_image = total // len(pixels)
            runs = [(start + k, start + k + per_image) for start, end in runs
                    for k in range(0, end - start, per_image)]
        items = []
        for (start, end), image in zip(runs, pixels, strict=True):
            digest = hashlib.sha256(repr(image.shape).encode())
            digest.update(image.tobytes())
            items.append(MultiModalItem(modality="image", content_hash=digest.hexdigest(), offset=start,
                                        length=end - start, data=image.tobytes(), shape=tuple(image.shape)))
        return tuple(items)

    def _processor(self) -> Any:
        if self._hf_processor is None:
            import transformers  # costs seconds: only prompts with images pay it

            try:
                self._hf_processor = transformers.AutoProcessor.from_pretrained(self.model_path)
            except (OSError, ValueError) as e:
                raise ValueError(f"multi_modal_data: the model {self.model_path!r} has no Hugging Face processor "
                                 f"to prepare images with (processor_config.json, preprocessor_config.json): {e}"
                                 ) from None
            if not callable(getattr(self._hf_processor, "image_processor", None)):
                raise ValueError(f"multi_modal_data: the model {self.model_path!r} has a tokenizer but no image "
                                 "processor (preprocessor_config.json)")
        return self._hf_processor
