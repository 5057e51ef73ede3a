"""Chat messages whose content carries images (OpenAI's `image_url` parts), the one path for `LLM.chat`
and the server: the parts split from the text, each image's placeholder put where the chat template
expects it, and the rendered prompt prepared with its images by the model's processor.

A template that loops over a message's content (multimodal processors' templates, as LLaVA's) gets
the content as typed parts, {"type": "image"} for each image; one that prints the content as text
gets the image token written before the text, one a line (vLLM's "openai" and "string" formats)."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from PIL import Image

from pagellm.config import MultiModalConfig
from pagellm.core.multimodal import MultiModalItem
from pagellm.engine.multimodal import TEXT_ONLY, ImageProcessor
from pagellm.tokenizer import Tokenizer
from pagellm.tokenizer.chat_template import iterates_message_content

IMAGE_PART = "image_url"


@dataclass(slots=True)
class ChatContent:
    """A conversation as the chat template takes it, and the images its messages point to."""

    messages: list[dict[str, Any]]
    image_urls: list[tuple[str, str]] = field(default_factory=list)
    """(URL, the part it came from, e.g. "messages[0].content[1]") in the conversation's order."""


def image_url_of(part: Mapping[str, Any], where: str) -> str:
    """The URL of an image part: {"type": "image_url", "image_url": {"url": ..., "detail": ...}} (or the
    URL as a string, as vLLM also takes it)."""
    value = part.get("image_url")
    url = value.get("url") if isinstance(value, Mapping) else value
    if not isinstance(url, str) or not url:
        raise ValueError(f"{where}: an image part needs image_url.url, a data:, http(s):// or file:// URL")
    return url


def split_images(messages: Sequence[Mapping[str, Any]], template: str | None,
                 image_token: str | None) -> ChatContent:
    """The conversation with its content lists as the template takes them: without images, text parts
    joined by newlines (as before images existed); with images, as typed parts or as text with
    `image_token` placeholders (see the module's docstring). A part of another type is a ValueError."""
    parsed: list[tuple[dict[str, Any], list[dict[str, Any]] | None]] = []
    urls: list[tuple[str, str]] = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            parsed.append((dict(message), None))
            continue
        parts = []
        for j, part in enumerate(content):
            where = f"messages[{i}].content[{j}]"
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind == "text" and isinstance(part.get("text"), str):
                parts.append({"type": "text", "text": part["text"]})
            elif kind == IMAGE_PART:
                urls.append((image_url_of(part, where), where))
                parts.append({"type": "image"})
            else:
                raise ValueError(f"{where}: unsupported content part {kind!r}: send text or image_url parts")
        parsed.append((dict(message), parts))
    as_parts = bool(urls) and template is not None and iterates_message_content(template)
    result = []
    for message, parts in parsed:
        if parts is not None:
            message["content"] = parts if as_parts else _as_text(parts, image_token)
        elif as_parts and isinstance(message.get("content"), str):
            message["content"] = [{"type": "text", "text": message["content"]}]
        result.append(message)
    return ChatContent(result, urls)


def check_images(content: ChatContent, images: ImageProcessor | None, config: MultiModalConfig) -> None:
    """A ValueError for images sent to a text-only model, or more than --limit-mm-per-prompt allows
    (before any is fetched)."""
    if not content.image_urls:
        return
    if images is None:
        raise ValueError(f"{content.image_urls[0][1]}: {TEXT_ONLY}")
    config.check_count("image", len(content.image_urls))


def _as_text(parts: list[dict[str, Any]], image_token: str | None) -> str:
    # A text-only model (no image token) gets no placeholder: check_images refuses its images.
    placeholders = [image_token] * sum(part["type"] == "image" for part in parts) if image_token else []
    return "\n".join(placeholders + [part["text"] for part in parts if part["type"] == "text"])


def image_token_text(images: ImageProcessor | None, tokenizer: Tokenizer) -> str | None:
    """The text of the model's image token (what a text template gets per image); None without one."""
    if images is None or images.image_token_id is None:
        return None
    return tokenizer.backend.id_to_token(images.image_token_id)


def prepare(images: ImageProcessor, tokenizer: Tokenizer, text: str, pictures: list[Image.Image]
            ) -> tuple[list[int], tuple[MultiModalItem, ...]]:
    """The rendered prompt's token ids (each image token expanded) and its images, prepared by the
    model's processor. As transformers' processors do for a rendered chat, special tokens (BOS) are
    added unless the text already starts with one."""
    bos = tokenizer.bos_token
    return images.process(text, {"image": pictures}, add_special_tokens=not (bos and text.startswith(bos)))
