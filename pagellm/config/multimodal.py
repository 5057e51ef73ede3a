"""What a prompt may carry besides text (images) and where the server may read them from."""
from __future__ import annotations

import os
from dataclasses import dataclass

from pagellm.config.json_flags import json_object

MODALITIES = ("image",)
DEFAULT_LIMIT_PER_PROMPT = 16
"""Images one prompt may carry unless --limit-mm-per-prompt says otherwise."""


@dataclass(slots=True, frozen=True)
class MultiModalConfig:
    """--limit-mm-per-prompt, --allowed-local-media-path and --allowed-media-domains, checked."""

    limit_per_prompt: dict[str, int]
    """Most items of each modality in one prompt (vLLM's JSON form: {"image": 4})."""
    allowed_local_media_path: str | None = None
    """The folder (absolute, resolved) whose files `file://` URLs may name; None: no file URLs."""
    allowed_media_domains: tuple[str, ...] | None = None
    """The hosts http(s) URLs may name; None: any."""

    @classmethod
    def parse(cls, limit_mm_per_prompt: str | dict | None, allowed_local_media_path: str | None,
              allowed_media_domains: str | list[str] | None) -> MultiModalConfig:
        """The config from the flags' values; a ValueError naming the flag for a bad one."""
        flag = "limit_mm_per_prompt (--limit-mm-per-prompt)"
        limits = {m: DEFAULT_LIMIT_PER_PROMPT for m in MODALITIES}
        for modality, n in json_object(limit_mm_per_prompt or {}, flag, MODALITIES).items():
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ValueError(f"{flag} {modality} must be a non-negative integer, got {n!r}")
            limits[modality] = n
        folder = None
        if allowed_local_media_path is not None:
            folder = os.path.realpath(allowed_local_media_path)
            if not os.path.isdir(folder):
                raise ValueError("allowed_local_media_path (--allowed-local-media-path) must be an existing folder, "
                                 f"got {allowed_local_media_path!r}")
        domains = None
        if allowed_media_domains is not None:
            items = [allowed_media_domains] if isinstance(allowed_media_domains, str) else allowed_media_domains
            domains = tuple(d.strip().lower() for item in items for d in item.split(",") if d.strip())
        return cls(limits, folder, domains)

    def check_count(self, modality: str, count: int) -> None:
        """A ValueError when one prompt carries more items of `modality` than allowed."""
        limit = self.limit_per_prompt.get(modality, 0)
        if count > limit:
            raise ValueError(f"this prompt carries {count} {modality}s, more than the {limit} allowed per prompt "
                             f"(--limit-mm-per-prompt '{{\"{modality}\": N}}')")
