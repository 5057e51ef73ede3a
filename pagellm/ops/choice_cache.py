"""Kernel choices timed at start-up (a one-row GEMV's tile per weight shape, the one-row kernel
against cuBLAS), kept in a JSON file so that the next start on the same GPU reads them instead of
timing again.

A file holds the choices of one GPU model, Triton version and pagellm version (its `identity`):
a choice timed on another GPU, or for other kernels, may be wrong there, so those go to another
file. Within it, each section (one kind of choice) maps a key (a shape, layout and dtypes, as text)
to a JSON value. Writes go to a temporary file renamed over the old one, so a reader never sees a
half-written file; a file that cannot be read, or that belongs to another identity, is ignored
with a warning (and replaced at the next save), never an error: the choices are then timed again.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

FORMAT = 1
"""Bumped when the file's layout changes: files of other formats are ignored."""


def choice_cache_path(root: Path, identity: dict[str, str]) -> Path:
    """The file of `identity`'s choices under the cache folder: readable names plus a digest of
    the whole identity (names alone could collide once sanitized)."""
    text = json.dumps(identity, sort_keys=True)
    readable = "-".join(re.sub(r"[^A-Za-z0-9.]+", "_", value) for value in identity.values())
    return root / "kernel_choices" / f"{readable[:120]}-{hashlib.sha256(text.encode()).hexdigest()[:12]}.json"


@dataclass
class ChoiceCache:
    """The stored choices of one identity, read once, written back by `save`."""

    path: Path
    identity: dict[str, str]
    sections: dict[str, dict[str, object]] = field(default_factory=dict)
    """Section -> key -> value."""
    dirty: bool = False
    """Whether choices were added since the last read or save."""

    @classmethod
    def load(cls, path: Path, identity: dict[str, str]) -> ChoiceCache:
        """The choices stored at `path`; none where there is no file, or an unusable one (warned)."""
        return cls(path, identity, _read(path, identity))

    def get(self, section: str, key: str) -> object | None:
        return self.sections.get(section, {}).get(key)

    def put(self, section: str, key: str, value: object) -> None:
        self.sections.setdefault(section, {})[key] = value
        self.dirty = True

    def save(self) -> None:
        """Write the choices (merged over what another process may have written since the read:
        ranks of one engine time the same shapes), atomically. A folder that cannot be written is
        warned about: the engine runs on, timing again at its next start."""
        if not self.dirty:
            return
        merged = _read(self.path, self.identity, warn=False)
        for section, choices in self.sections.items():
            merged.setdefault(section, {}).update(choices)
        payload = {"format": FORMAT, "identity": self.identity, "sections": merged}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=self.path.parent, suffix=".tmp", delete=False) as tmp:
                json.dump(payload, tmp, indent=1, sort_keys=True)
            os.replace(tmp.name, self.path)
        except OSError as e:
            logger.warning("could not store kernel choices in %s (%s): they will be timed again at the next start",
                           self.path, e)
            return
        self.sections = merged
        self.dirty = False


def _read(path: Path, identity: dict[str, str], warn: bool = True) -> dict[str, dict[str, object]]:
    try:
        payload = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        problem = f"it cannot be read ({e})"
    else:
        problem = _problem(payload, identity)
        if problem is None:
            return {section: dict(choices) for section, choices in payload["sections"].items()}
    if warn:
        logger.warning("ignoring the kernel choices in %s: %s; they are timed again", path, problem)
    return {}


def _problem(payload: object, identity: dict[str, str]) -> str | None:
    """Why a parsed file is not this identity's choices (None: it is)."""
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        return f"not a kernel-choice file of format {FORMAT}"
    if payload.get("identity") != identity:
        return f"it was written for {payload.get('identity')!r}, not {identity!r}"
    sections = payload.get("sections")
    if not isinstance(sections, dict) or not all(isinstance(s, dict) for s in sections.values()):
        return "its sections are malformed"
    return None
