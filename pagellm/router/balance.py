"""Which backend serves a request: canary versions by weight, then prefix affinity, then load.

A model's backends form versions (`version`, or each backend its own when the weights differ).
A version is drawn by weight (a point fixed by the sticky header's value, when the request has
one); within it, the backend that most recently saw the longest block-aligned prefix of this
prompt takes it (its prefix cache holds that prefix), unless it has `max_imbalance` more requests
in flight than the least loaded; otherwise the backend with the fewest outstanding tokens.
"""
from __future__ import annotations

import hashlib
import random
from collections import OrderedDict
from dataclasses import dataclass, field

from pagellm.router.config import BackendConfig, ModelConfig

PREFIX_BLOCK_CHARS = 128
"""Prompt text per prefix block: fine enough that a shared system prompt spans several blocks."""
PREFIXES_PER_BACKEND = 50_000
"""Prefix hashes remembered per backend (least recently seen go first)."""


def prefix_hashes(model: str, text: str) -> list[int]:
    """Chained hashes of the prompt's full blocks: entry i stands for the first i+1 blocks."""
    hashes, h = [], hash(model)
    for start in range(0, len(text) - PREFIX_BLOCK_CHARS + 1, PREFIX_BLOCK_CHARS):
        h = hash((h, text[start:start + PREFIX_BLOCK_CHARS]))
        hashes.append(h)
    return hashes


@dataclass(eq=False, slots=True)
class Backend:
    """One server's live state, shared by every model it serves and kept across config reloads."""

    url: str
    in_flight: int = 0
    outstanding_tokens: int = 0
    """Prompt plus allowed output tokens of the requests in flight (an estimate of its work)."""
    consecutive_failures: int = 0
    ejected: bool = False
    """Out of rotation after repeated failures, until a health probe passes."""
    prefixes: OrderedDict[int, None] = field(default_factory=OrderedDict)

    def longest_prefix(self, hashes: list[int]) -> int:
        for i in range(len(hashes) - 1, -1, -1):
            if hashes[i] in self.prefixes:
                return i + 1
        return 0

    def remember(self, hashes: list[int]) -> None:
        for h in hashes:
            self.prefixes[h] = None
            self.prefixes.move_to_end(h)
        while len(self.prefixes) > PREFIXES_PER_BACKEND:
            self.prefixes.popitem(last=False)

    def succeeded(self) -> None:
        self.consecutive_failures = 0
        self.ejected = False

    def failed(self, eject_after: int) -> bool:
        """Count a failure; True when this one takes the backend out."""
        self.consecutive_failures += 1
        newly = not self.ejected and self.consecutive_failures >= eject_after
        self.ejected = self.ejected or newly
        return newly


@dataclass(slots=True)
class Version:
    name: str
    weight: float
    backends: list[tuple[Backend, BackendConfig]]


class ModelRoute:
    """A model's versions and backends; `choose` picks one backend for a request."""

    def __init__(self, config: ModelConfig, backends: dict[str, Backend], max_imbalance: int) -> None:
        self.config = config
        self.max_imbalance = max_imbalance
        canary = len({b.weight for b in config.backends}) > 1
        versions: dict[str, Version] = {}
        for b in config.backends:
            name = b.version or (b.url if canary else "")
            version = versions.setdefault(name, Version(name, 0.0, []))
            version.weight += b.weight
            version.backends.append((backends[b.url], b))
        self.versions = list(versions.values())

    def choose(self, hashes: list[int], sticky: str | None,
               exclude: frozenset[Backend] = frozenset()) -> tuple[Backend, BackendConfig] | None:
        """The backend for a request whose prompt has prefix `hashes`; None when all are excluded."""
        def usable(v: Version, healthy: bool) -> list[tuple[Backend, BackendConfig]]:
            return [(b, c) for b, c in v.backends if b not in exclude and not (healthy and b.ejected)]

        for healthy in (True, False):  # all out: try the ejected ones rather than fail outright
            versions = [v for v in self.versions if usable(v, healthy)]
            if versions:
                version = self._draw(versions, sticky)
                return self._balance(usable(version, healthy), hashes)
        return None

    def _draw(self, versions: list[Version], sticky: str | None) -> Version:
        total = sum(v.weight for v in versions)
        if sticky is not None:
            digest = hashlib.blake2b(f"{self.config.name}\0{sticky}".encode(), digest_size=8).digest()
            point = int.from_bytes(digest, "big") / 2**64 * total
        else:
            point = random.random() * total
        for v in versions:
            point -= v.weight
            if point < 0:
                return v
        return versions[-1]

    def _balance(self, candidates: list[tuple[Backend, BackendConfig]],
                 hashes: list[int]) -> tuple[Backend, BackendConfig]:
        least_in_flight = min(b.in_flight for b, _ in candidates)
        best, best_len = None, 0
        for b, c in candidates:
            if b.in_flight - least_in_flight >= self.max_imbalance:
                continue  # overloaded: its cached prefix is not worth the queue
            n = b.longest_prefix(hashes)
            if n > best_len or (n == best_len and best is not None and n and
                                b.outstanding_tokens < best[0].outstanding_tokens):
                best, best_len = (b, c), n
        if best is not None and best_len > 0:
            return best
        least = min(b.outstanding_tokens for b, _ in candidates)
        return random.choice([bc for bc in candidates if bc[0].outstanding_tokens == least])
