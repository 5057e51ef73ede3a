"""Content hashes of full KV blocks, chained so a hash names the whole prefix up to its block."""
from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from pagellm.core.multimodal import MultiModalItem, block_content_keys

BlockHash = bytes

_ROOT = b"pagellm-prefix-root"


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple = ()) -> BlockHash:
    """SHA-256 of (parent hash, token ids, extra keys such as a cache salt or adapter id).

    A cryptographic hash, not Python's `hash`: a collision would silently serve another
    prompt's KV, and 64-bit hashes of attacker-chosen prompts are not safe.
    """
    h = hashlib.sha256(parent if parent is not None else _ROOT)
    h.update(array("q", token_ids).tobytes())
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return h.digest()


def extend_block_hashes(
    hashes: list[BlockHash], token_ids: Sequence[int], block_size: int, extra_keys: tuple = (),
    multi_modal: tuple[MultiModalItem, ...] = (),
) -> None:
    """Append the hashes of every full block of `token_ids` not hashed yet. A block holding
    placeholder tokens of a `multi_modal` item also chains in that item's content hash (its tokens
    alone say nothing of the image)."""
    num_full = len(token_ids) // block_size
    for i in range(len(hashes), num_full):
        parent = hashes[i - 1] if i else None
        start, end = i * block_size, (i + 1) * block_size
        keys = extra_keys
        if multi_modal:
            keys = (*extra_keys, *block_content_keys(multi_modal, start, end))
        hashes.append(hash_block(parent, token_ids[start:end], keys))


def group_block_hash(block_hash: BlockHash, group: int) -> BlockHash:
    """The prefix-cache key of a block of KV cache group `group` (its layers' keys and values of
    the prefix `block_hash` names): the hash itself for group 0, tagged for the others."""
    return block_hash if group == 0 else block_hash + group.to_bytes(2, "little")
