"""The architecture description of a decoder-only model, independent of where it was loaded from.

Built from a Hugging Face `config.json` dict or from GGUF metadata. Deliberately not a
`transformers.PretrainedConfig`: importing transformers costs seconds of start-up time.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pagellm.config.registry import Registry


@dataclass(frozen=True, slots=True)
class ArchitectureEntry:
    """A model architecture the engine can run (`pagellm.models.register_model` adds one)."""

    name: str
    """The Hugging Face architecture name a `config.json` lists, e.g. `LlamaForCausalLM`."""
    cls: Any
    """The model class (implementing `pagellm.models.interface.CausalLM`), or its
    "package.module:Class" name, imported when a model of this architecture is built."""
    gguf_arch: str | None = None
    """The `general.architecture` of GGUF files holding this architecture (None: not loaded from
    GGUF). Several architectures may share one (llama.cpp files Mistral as llama): a file's
    `general.name` containing an entry's `model_type` picks that entry, else the one whose
    `model_type` is the GGUF name."""
    model_type: str | None = None
    """The Hugging Face `model_type` (a GGUF file's config gets it)."""


MODEL_REGISTRY: Registry[ArchitectureEntry] = Registry("model architecture", builtins=(
    ArchitectureEntry("LlamaForCausalLM", "pagellm.models.llama:LlamaForCausalLM", "llama", "llama"),
    ArchitectureEntry("MistralForCausalLM", "pagellm.models.llama:LlamaForCausalLM", "llama", "mistral"),
    ArchitectureEntry("Qwen2ForCausalLM", "pagellm.models.qwen2:Qwen2ForCausalLM", "qwen2", "qwen2"),
    ArchitectureEntry("Qwen3ForCausalLM", "pagellm.models.qwen3:Qwen3ForCausalLM", "qwen3", "qwen3"),
    ArchitectureEntry("MixtralForCausalLM", "pagellm.models.mixtral:MixtralForCausalLM", "llama", "mixtral"),
    ArchitectureEntry("Qwen2MoeForCausalLM", "pagellm.models.qwen2_moe:Qwen2MoeForCausalLM", "qwen2moe", "qwen2_moe"),
    ArchitectureEntry("Qwen3MoeForCausalLM", "pagellm.models.qwen3_moe:Qwen3MoeForCausalLM", "qwen3moe", "qwen3_moe"),
    ArchitectureEntry("Phi3ForCausalLM", "pagellm.models.phi3:Phi3ForCausalLM", "phi3", "phi3"),
    ArchitectureEntry("Gemma2ForCausalLM", "pagellm.models.gemma:Gemma2ForCausalLM", model_type="gemma2"),
    ArchitectureEntry("Gemma3ForCausalLM", "pagellm.models.gemma:Gemma3ForCausalLM", model_type="gemma3_text"),
    ArchitectureEntry("GptOssForCausalLM", "pagellm.models.gpt_oss:GptOssForCausalLM", model_type="gpt_oss"),
    ArchitectureEntry("LlavaForConditionalGeneration", "pagellm.models.llava:LlavaForConditionalGeneration",
                      model_type="llava"),
    ArchitectureEntry("Qwen2VLForConditionalGeneration", "pagellm.models.qwen2_vl:Qwen2VLForConditionalGeneration",
                      model_type="qwen2_vl"),
    ArchitectureEntry("Qwen2_5_VLForConditionalGeneration",
                      "pagellm.models.qwen2_vl:Qwen2_5_VLForConditionalGeneration", model_type="qwen2_5_vl"),
))
"""Every architecture the engine runs, by Hugging Face name."""

_TEXT_ONLY = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM"}
"""Multimodal architectures whose language model alone runs as another one."""


_TEXT_CONFIG_DEFAULTS = {
    "llama": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, max_position_embeddings=2048),
}
"""transformers' defaults of a language model's config class, by model_type: a vision-language
config.json's `text_config` lists only the fields that differ (llava-hf/llava-1.5-7b-hf's gives no
hidden_size)."""


@dataclass(slots=True)
class ModelArchConfig:
    """Shape and numerics of a decoder-only transformer."""

    architecture: str
    """Hugging Face architecture name, e.g. `LlamaForCausalLM`."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    rope_scaling: dict[str, Any] | None = None
    """Hugging Face `rope_scaling` dict (`rope_type` / `type`: default, linear, llama3, longrope)."""
    torch_dtype: str | None = None
    """The dtype the checkpoint was trained/saved in, used by `dtype="auto"`."""
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    num_experts: int = 0
    """Routed experts of each mixture-of-experts layer (`num_experts`, Mixtral's `num_local_experts`);
    0: a dense model."""
    num_experts_per_tok: int = 0
    """Experts each token goes to (top-k)."""
    moe_intermediate_size: int = 0
    """Each routed expert's intermediate size (Mixtral's experts have `intermediate_size`)."""
    shared_expert_intermediate_size: int = 0
    """The intermediate size of an MLP every token goes through beside the routed experts (Qwen2-MoE);
    0: none."""
    norm_topk_prob: bool | None = None
    """Whether the chosen experts' weights are rescaled to sum to 1; None: the config does not say
    (the family's default applies)."""
    sliding_windows: tuple[int | None, ...] = ()
    """Each decoder layer's sliding window, the keys a query sees (itself included); None: full
    attention (every layer, when left empty)."""
    hf_config: dict[str, Any] = field(default_factory=dict)
    """The raw config dict, for architecture-specific fields the model class reads itself."""
    max_model_len: int | None = None
    """The longest sequence the engine runs the model for, set when the engine's configuration is
    resolved (None: max_position_embeddings). LongRoPE chooses its long or short factors by it."""

    def __post_init__(self) -> None:
        if not self.sliding_windows:
            self.sliding_windows = (None,) * self.num_hidden_layers
        elif len(self.sliding_windows) != self.num_hidden_layers:
            raise ValueError(f"{len(self.sliding_windows)} sliding windows for {self.num_hidden_layers} layers")

    def is_moe_layer(self, index: int) -> bool:
        """Whether decoder layer `index` is a mixture of experts (else a dense MLP of
        `intermediate_size`): every layer of an MoE model, but those Qwen-MoE's `mlp_only_layers`
        lists and those off its `decoder_sparse_step`."""
        if not self.num_experts:
            return False
        step = self.hf_config.get("decoder_sparse_step") or 1
        return index not in (self.hf_config.get("mlp_only_layers") or ()) and (index + 1) % step == 0

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "ModelArchConfig":
        archs = d.get("architectures") or []
        arch = next((a for a in archs if a in MODEL_REGISTRY), None)
        text_only = next((_TEXT_ONLY[a] for a in archs if a in _TEXT_ONLY), None)
        if arch is None and text_only is not None:
            raise ValueError(f"model architecture {archs!r} (text and images) is not supported; pagellm runs the "
                             f"text-only {text_only}: a checkpoint of its language model alone, its config.json "
                             f"the text_config with architectures [{text_only!r}]")
        if arch is None:
            raise ValueError(
                f"model architecture {archs or d.get('model_type')!r} is not supported; "
                f"supported: {', '.join(MODEL_REGISTRY.names())} (a plugin may register more: pagellm.plugins)"
            )
        if isinstance(d.get("text_config"), dict):
            # A vision-language model: the shape is its language model's; the vision fields
            # (vision_config, image_token_index, ...) stay beside them in hf_config.
            text = d["text_config"]
            d = {**d, **_TEXT_CONFIG_DEFAULTS.get(text.get("model_type"), {}), **text}
        num_heads = d["num_attention_heads"]
        eos = d.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        num_experts = d.get("num_experts") or d.get("num_local_experts") or 0
        if num_experts and not 0 < (d.get("num_experts_per_tok") or 0) <= num_experts:
            raise ValueError(f"config.json's num_experts_per_tok must be between 1 and the {num_experts} experts, "
                             f"got {d.get('num_experts_per_tok')!r}")
        rope_scaling = d.get("rope_scaling")
        # transformers >= 5 moves rope_theta / rope_scaling into `rope_parameters`.
        rope_params = d.get("rope_parameters") or {}
        if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
            rope_scaling = rope_params
        if rope_scaling is not None and "original_max_position_embeddings" in d:  # Phi-3 keeps it outside
            rope_scaling = {"original_max_position_embeddings": d["original_max_position_embeddings"], **rope_scaling}
        return cls(
            architecture=arch,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=d.get("num_key_value_heads") or num_heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // num_heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=d.get("rope_theta") or rope_params.get("rope_theta", 10000.0),
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            tie_word_embeddings=d.get("tie_word_embeddings", False),
            rope_scaling=rope_scaling,
            torch_dtype=d.get("torch_dtype") or d.get("dtype"),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            num_experts=num_experts,
            num_experts_per_tok=d.get("num_experts_per_tok", 0) if num_experts else 0,
            moe_intermediate_size=(d.get("moe_intermediate_size") or d["intermediate_size"]) if num_experts else 0,
            shared_expert_intermediate_size=(d.get("shared_expert_intermediate_size") or 0) if num_experts else 0,
            norm_topk_prob=d.get("norm_topk_prob"),
            sliding_windows=layer_sliding_windows(d),
            hf_config=dict(d),
        )


_READS_LAYER_TYPES = frozenset({"gemma2", "gemma3", "gemma3_text", "qwen2", "qwen3", "qwen2_moe", "gpt_oss"})
"""Families whose transformers attention takes each layer's kind from `layer_types` when given."""
_DEFAULT_SLIDING_LAYERS: dict[str, Callable[[dict[str, Any], int], bool]] = {
    "mistral": lambda d, i: True,
    "mixtral": lambda d, i: True,
    "qwen3_moe": lambda d, i: True,
    "phi3": lambda d, i: True,
    "qwen2": lambda d, i: i >= d.get("max_window_layers", 28),
    "qwen3": lambda d, i: i >= d.get("max_window_layers", 28),
    "qwen2_moe": lambda d, i: i % 2 == 0 and i < d.get("max_window_layers", 28),
    "gemma2": lambda d, i: i % 2 == 0,
    "gpt_oss": lambda d, i: i % 2 == 0,
    "gemma3": lambda d, i: (i + 1) % d.get("sliding_window_pattern", 6) != 0,
    "gemma3_text": lambda d, i: (i + 1) % d.get("sliding_window_pattern", 6) != 0,
}
"""Whether layer i of a family attends within `sliding_window` when the config has no `layer_types`,
as transformers decides; a family not listed attends in full."""
_QWEN = frozenset({"qwen2", "qwen3", "qwen2_moe", "qwen3_moe"})
"""Families that keep their `sliding_window` off unless `use_sliding_window` turns it on."""


def layer_sliding_windows(d: dict[str, Any]) -> tuple[int | None, ...]:
    """Each layer's window from a config.json (None: full attention): `sliding_window` applies to the
    layers its family's attention applies it to (transformers' rules); Qwen's only with
    `use_sliding_window`."""
    num_layers, window, model_type = d["num_hidden_layers"], d.get("sliding_window"), d.get("model_type")
    rule = _DEFAULT_SLIDING_LAYERS.get(model_type)
    if not window or rule is None or (model_type in _QWEN and not d.get("use_sliding_window", False)):
        return (None,) * num_layers
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"config.json's sliding_window must be a positive number of tokens, got {window!r}")
    layer_types = d.get("layer_types") if model_type in _READS_LAYER_TYPES else None
    if layer_types is None:
        return tuple(window if rule(d, i) else None for i in range(num_layers))
    kinds = {"sliding_attention": window, "full_attention": None}
    if len(layer_types) != num_layers or not set(layer_types) <= kinds.keys():
        raise ValueError(f"config.json's layer_types must name one of {sorted(kinds)} for each of the "
                         f"{num_layers} layers, got {layer_types!r}")
    return tuple(kinds[kind] for kind in layer_types)
