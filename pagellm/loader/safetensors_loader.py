"""Hugging Face safetensors checkpoints: single file or sharded, read lazily one tensor at a time."""
from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator

import torch

INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(directory: str) -> list[str]:
    """The checkpoint's shard files: those the index names, else every `*.safetensors` in the folder."""
    index_path = os.path.join(directory, INDEX_FILE)
    if os.path.isfile(index_path):
        with open(index_path, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map") or {}
        files = sorted({os.path.join(directory, name) for name in weight_map.values()})
        missing = [p for p in files if not os.path.isfile(p)]
        if missing:
            raise ValueError(f"{index_path!r} names shard files that do not exist: {missing}")
        return files
    return sorted(glob.glob(os.path.join(directory, "*.safetensors")))


def iter_safetensors_weights(directory: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(name, CPU tensor)` in the stored dtype; only one tensor is materialized at a time."""
    from safetensors import safe_open

    files = safetensors_files(directory)
    if not files:
        raise ValueError(f"no *.safetensors files in {directory!r}")
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
