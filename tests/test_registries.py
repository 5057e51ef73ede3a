"""The registries (one table per seam, a register_* function each) and plugin loading, without a
model: what each register_* accepts and refuses, that flags, lookups and help read the tables, and
that a broken plugin is an error naming it. The plugin installed as a package and served is in
test_plugins.py."""
from __future__ import annotations

import json
from importlib.metadata import EntryPoint

import pytest
import torch
from torch import nn

from pagellm.attention import ATTENTION_BACKEND_REGISTRY, get_attn_backend, register_attention_backend
from pagellm.attention.torch_backend import TorchAttentionBackend
from pagellm.cli import build_parser
from pagellm.config.arch import MODEL_REGISTRY, ModelArchConfig
from pagellm.config.kv_transfer import KV_CONNECTOR_REGISTRY, KVTransferConfig, register_kv_connector
from pagellm.config.registry import Registry
from pagellm.engine.arg_utils import EngineArgs
from pagellm.entrypoints.openai.tool_parsers import (
    TOOL_PARSER_REGISTRY,
    ParsedOutput,
    ToolParser,
    get_tool_parser,
    register_tool_parser,
)
from pagellm.executor import EXECUTOR_REGISTRY, register_executor
from pagellm.executor.uniproc import UniProcExecutor
from pagellm.loader.gguf_loader import gguf_architecture
from pagellm.models import get_model_class, register_model
from pagellm.models.interface import CAUSAL_LM_METHODS, check_model_class
from pagellm.models.llama import LlamaForCausalLM
from pagellm.plugins import PLUGIN_GROUP, PluginError, call_plugin, load_plugins, selected_plugins
from pagellm.quantization import (
    QUANTIZATION_REGISTRY,
    build_quant_config,
    quantized_weight_bytes,
    register_quantization_method,
    resolve_quantization,
)
from pagellm.reasoning import REASONING_PARSER_REGISTRY, ReasoningTags, get_reasoning_tags, register_reasoning_parser
from pagellm.spec_decode import (
    PROPOSER_REGISTRY,
    DeviceProposer,
    HostProposer,
    NgramProposer,
    SpeculativeConfig,
    build_device_proposer,
    build_host_proposer,
    proposer_class,
    register_proposer,
)

REGISTRIES = (MODEL_REGISTRY, QUANTIZATION_REGISTRY, ATTENTION_BACKEND_REGISTRY, EXECUTOR_REGISTRY, PROPOSER_REGISTRY,
              TOOL_PARSER_REGISTRY, REASONING_PARSER_REGISTRY, KV_CONNECTOR_REGISTRY)
CPU = torch.device("cpu")
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 64, "hidden_size": 16,
    "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
    "max_position_embeddings": 64,
}


@pytest.fixture(autouse=True)
def restore_registries():
    """What a test registers is gone afterwards: the registries live as long as the process."""
    saved = [(registry, dict(registry._entries), dict(registry._aliases)) for registry in REGISTRIES]
    yield
    for registry, entries, aliases in saved:
        registry._entries, registry._aliases = entries, aliases


def _refused(call, *fragments: str) -> str:
    with pytest.raises(ValueError) as info:
        call()
    message = str(info.value)
    assert all(f in message for f in fragments), message
    return message


# -- the table --------------------------------------------------------------------------------------------------------

class _Entry:
    def __init__(self, name: str, aliases: tuple[str, ...] = ()) -> None:
        self.name, self.aliases, self.cls = name, aliases, "some.module:Thing"


def test_a_name_is_registered_once_unless_overridden():
    registry = Registry("widget", "widget (--widget)", builtins=[_Entry("a", aliases=("[a]",))])
    _refused(lambda: registry.register(_Entry("a")), "widget 'a' is already registered (some.module:Thing)",
             "override=True")
    _refused(lambda: registry.register(_Entry("b", aliases=("[a]",))), "widget '[a]' is already registered")
    replacement = _Entry("a")
    registry.register(replacement, override=True)
    assert registry.get("a") is replacement and "[a]" not in registry, "the replaced entry's aliases go with it"
    registry.register(_Entry("b", aliases=("bee",)))
    assert registry.get("bee").name == "b" and registry.names() == ("a", "b")
    _refused(lambda: registry.get("c"), "widget (--widget) must be one of a, b, got 'c'")
    _refused(lambda: registry.register(_Entry("")), "non-empty string")
    registry.unregister("b")
    assert "bee" not in registry and registry.names() == ("a",)
    assert Registry("gadget").unknown("x") == "gadget 'x' is not supported; supported: "


def test_unknown_names_name_the_flag_and_list_the_registered_ones():
    for field, value, message in [
        ("quantization", "fp4", "quantization (--quantization) must be one of fp8, int8, compressed-tensors, gptq, "
                                "awq, rtn, gguf, mxfp4, none, got 'fp4'"),
        ("attention_backend", "flash", "attention_backend (--attention-backend) must be one of torch, triton, cpu, "
                                       "got 'flash'"),
        ("distributed_executor_backend", "slurm", "distributed_executor_backend (--distributed-executor-backend) "
                                                  "must be one of uni, mp, ray, got 'slurm'"),
        ("reasoning_parser", "o1", "reasoning_parser (--reasoning-parser) must be one of qwen3, deepseek_r1, "
                                   "got 'o1'"),
        ("speculative_config", {"method": "eagle", "num_speculative_tokens": 2},
         "speculative_config (--speculative-config) method must be one of ngram, draft_model, suffix, got 'eagle'"),
    ]:
        assert _refused(lambda: EngineArgs(**{field: value}).validate()) == message
    _refused(lambda: get_model_class("GPT2LMHeadModel"), "model architecture 'GPT2LMHeadModel' is not supported; "
             "supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM")
    _refused(lambda: ModelArchConfig.from_hf_dict({**TINY_LLAMA, "architectures": ["GPT2LMHeadModel"]}),
             "['GPT2LMHeadModel'] is not supported", "LlamaForCausalLM")
    _refused(lambda: get_tool_parser("pythonic"), "--tool-call-parser must be one of hermes, llama3_json, mistral")
    _refused(lambda: get_reasoning_tags("o1"), "qwen3, deepseek_r1")
    assert get_model_class("MistralForCausalLM") is LlamaForCausalLM
    assert isinstance(get_attn_backend("torch"), TorchAttentionBackend)


# -- models -----------------------------------------------------------------------------------------------------------

class PluginLlama(LlamaForCausalLM):
    """Llama's graph under another architecture name."""


class NoLogits(nn.Module):
    def __init__(self, config, attn_backend) -> None:
        super().__init__()

    def forward(self, input_ids, positions, attn_metadata, intermediate=None):
        return input_ids

    def load_weights(self, weights):
        return set()


class OneArgument(LlamaForCausalLM):
    def __init__(self, config) -> None:
        super().__init__(config, TorchAttentionBackend())


def test_the_model_interface_is_what_the_callers_call():
    assert set(CAUSAL_LM_METHODS) >= {"forward", "compute_logits", "load_weights", "attention_layers",
                                      "decoder_layers", "checkpoint_names", "named_parameters", "named_modules"}
    for architecture in MODEL_REGISTRY.names():
        assert check_model_class(get_model_class(architecture), architecture)


def test_register_model_checks_the_class_and_feeds_config_and_gguf():
    message = _refused(lambda: register_model("NoLogitsForCausalLM", NoLogits), "NoLogits", "lacks",
                       "compute_logits", "attention_layers", "decoder_layers", "checkpoint_names", "CausalLM")
    assert "load_weights" not in message.split("lacks")[1].split("of pagellm")[0]
    _refused(lambda: register_model("DictForCausalLM", dict), "must be a torch.nn.Module subclass")
    _refused(lambda: register_model("OneForCausalLM", OneArgument), "cls(config, attn_backend)")
    _refused(lambda: register_model("LlamaForCausalLM", PluginLlama), "'LlamaForCausalLM' is already registered")
    _refused(lambda: register_model("NoModuleForCausalLM", "no_colon_here"), "package.module:Name")
    assert "NoLogitsForCausalLM" not in MODEL_REGISTRY

    register_model("PluginLlamaForCausalLM", PluginLlama, gguf_arch="pluginllama")
    assert get_model_class("PluginLlamaForCausalLM") is PluginLlama
    arch = ModelArchConfig.from_hf_dict({**TINY_LLAMA, "architectures": ["GPT2LMHeadModel", "PluginLlamaForCausalLM"]})
    assert arch.architecture == "PluginLlamaForCausalLM"
    assert gguf_architecture("f.gguf", "pluginllama", "Plugin Llama 1B").name == "PluginLlamaForCausalLM"
    assert gguf_architecture("f.gguf", "llama", "Mistral 7B Instruct").name == "MistralForCausalLM"
    assert gguf_architecture("f.gguf", "llama", "SmolLM2 135M").name == "LlamaForCausalLM"
    assert gguf_architecture("f.gguf", "llama", "SmolLM2 135M", has_experts=True).name == "MixtralForCausalLM"
    _refused(lambda: gguf_architecture("f.gguf", "gpt2", ""), "GGUF architecture 'gpt2' is not supported",
             "llama, qwen2, qwen3, qwen2moe, qwen3moe, phi3, pluginllama")
    register_model("PluginLlamaForCausalLM", LlamaForCausalLM, override=True)
    assert get_model_class("PluginLlamaForCausalLM") is LlamaForCausalLM

    # A "module:Class" name is imported, and checked, when a model of it is built.
    register_model("LazyForCausalLM", f"{__name__}:NoLogits")
    assert "LazyForCausalLM" in MODEL_REGISTRY
    _refused(lambda: get_model_class("LazyForCausalLM"), "lacks", "compute_logits")
    register_model("LazyLlamaForCausalLM", f"{__name__}:PluginLlama")
    assert get_model_class("LazyLlamaForCausalLM") is PluginLlama


# -- quantization -----------------------------------------------------------------------------------------------------

def test_register_quantization_method():
    built = []

    def build(method, model_path, hf_config):
        built.append((method, model_path))
        return "the config"

    register_quantization_method("int3", build, description="three bits", bytes_per_weight=0.375)
    EngineArgs(quantization="int3").validate()
    assert build_quant_config("int3", "/m", {}) == "the config" and built == [("int3", "/m")]
    assert quantized_weight_bytes("int3", 2) == 0.375 and quantized_weight_bytes("none", 2) == 2.0
    assert quantized_weight_bytes("gptq", 2) == 0.5 + 3 / 128
    assert resolve_quantization("int3", "safetensors", "/m", CPU) == "int3"
    _refused(lambda: quantized_weight_bytes("gguf", 2), "no size per weight for quantization 'gguf'")
    _refused(lambda: register_quantization_method("int3", build), "'int3' is already registered")
    _refused(lambda: register_quantization_method("int2", 42), "build must be callable")
    _refused(lambda: register_quantization_method("int2", build, bytes_per_weight=0), "bytes_per_weight")
    assert "int3 (three bits)" in EngineArgs.__dataclass_fields__["quantization"].metadata["help"]()

    register_quantization_method("marlin", build, from_checkpoint_only=True, in_checkpoints=True,
                                 dense_alternative="rtn")
    _refused(lambda: resolve_quantization("marlin", "safetensors", "/m", CPU),
             "'marlin' loads a checkpoint quantized with marlin", "use rtn")
    hf = {"quantization_config": {"quant_method": "Marlin"}}
    assert resolve_quantization(None, "safetensors", "/m", CPU, hf) == "marlin"


# -- attention backends and executors ---------------------------------------------------------------------------------

class PluginAttention(TorchAttentionBackend):
    name = "plugin"


class PluginExecutor(UniProcExecutor):
    pass


def test_register_attention_backend(tmp_path):
    register_attention_backend("gpu_only", PluginAttention, devices=("cuda",), description="a GPU's")
    assert isinstance(get_attn_backend("gpu_only"), PluginAttention)
    EngineArgs(attention_backend="gpu_only").validate()
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    args = dict(model=str(tmp_path), load_format="dummy", device="cpu", dtype="float32")
    _refused(lambda: EngineArgs(**args, attention_backend="gpu_only").create_engine_config(),
             "attention_backend (--attention-backend) gpu_only runs on CUDA GPUs only, and the device is cpu: "
             "use torch")
    register_attention_backend("anywhere", PluginAttention)
    _refused(lambda: EngineArgs(**args, attention_backend="anywhere", kv_cache_dtype="fp8").create_engine_config(),
             "kv_cache_dtype (--kv-cache-dtype) fp8: the anywhere attention backend reads no float8 caches")
    assert EngineArgs(**args, attention_backend="anywhere").create_engine_config().model.attention_backend == "anywhere"
    _refused(lambda: register_attention_backend("dict", dict), "must be a subclass of", "AttentionBackend")
    _refused(lambda: register_attention_backend("tpu", PluginAttention, devices=("tpu",)), "devices")
    register_attention_backend("lazy", f"{__name__}:PluginExecutor")
    _refused(lambda: get_attn_backend("lazy"), "attention backend 'lazy' must be a subclass")


def test_register_executor():
    register_executor("solo", PluginExecutor, max_world_size=1, description="one rank here")
    EngineArgs(distributed_executor_backend="solo").validate()
    _refused(lambda: EngineArgs(distributed_executor_backend="solo", tensor_parallel_size=2).validate(),
             "'solo' runs one rank, but tensor_parallel_size x pipeline_parallel_size is 2: use 'mp' or 'ray'")
    _refused(lambda: EngineArgs(distributed_executor_backend="uni", tensor_parallel_size=3).validate(),
             "'uni' runs one rank", "use 'mp' or 'ray'")
    _refused(lambda: register_executor("bad", TorchAttentionBackend), "must be a subclass of", "Executor")
    _refused(lambda: register_executor("bad", PluginExecutor, max_world_size=0), "max_world_size")
    assert "solo (one rank here)" in EngineArgs.__dataclass_fields__["distributed_executor_backend"].metadata["help"]()


# -- speculative proposers --------------------------------------------------------------------------------------------

class RepeatProposer(HostProposer):
    """Proposes the last token again."""

    def propose(self, token_ids, max_tokens, req_id=None, num_prompt_tokens=0):
        return token_ids[-1:] * min(max_tokens, self.config.num_speculative_tokens)


class NothingOnDevice(DeviceProposer):
    def load(self):
        pass

    def kv_bytes_per_block(self, block_size, dtype):
        return 0

    def initialize_kv_cache(self, num_blocks):
        pass

    def propose(self, states):
        return {}


def test_one_proposer_interface_and_registry():
    assert proposer_class("ngram") is NgramProposer and NgramProposer.runs_in == "scheduler"
    assert proposer_class("draft").runs_in == "worker" and issubclass(proposer_class("draft_model"), DeviceProposer)

    register_proposer("repeat", RepeatProposer, aliases=("[repeat]",))
    config = SpeculativeConfig.parse({"method": "[repeat]", "num_speculative_tokens": 3})
    assert config.method == "repeat"
    proposer = build_host_proposer(config)
    assert isinstance(proposer, RepeatProposer) and proposer.propose([1, 2, 7], 2) == [7, 7]
    proposer.forget("r")  # the default: nothing kept
    _refused(lambda: SpeculativeConfig.parse({"method": "repeat", "num_speculative_tokens": 3, "model": "d"}),
             "key(s) model do not apply to method 'repeat'")

    register_proposer("tiny_draft", f"{__name__}:NothingOnDevice", runs_in="worker", keys=("model",))
    config = SpeculativeConfig.parse({"method": "tiny_draft", "num_speculative_tokens": 2, "model": "d.gguf"})
    assert build_host_proposer(config) is None and proposer_class("tiny_draft") is NothingOnDevice
    _refused(lambda: SpeculativeConfig.parse({"method": "tiny_draft", "num_speculative_tokens": 2}),
             "method 'tiny_draft' needs model")
    _refused(lambda: register_proposer("x", "some.module:Proposer"), "runs_in must be 'scheduler' or 'worker'")
    _refused(lambda: register_proposer("x", NgramProposer, keys=("temperature",)), "'temperature'")
    _refused(lambda: register_proposer("x", dict), "must be a subclass of", "HostProposer or DeviceProposer")
    _refused(lambda: register_proposer("ngram", RepeatProposer), "'ngram' is already registered")
    register_proposer("mislabeled", f"{__name__}:RepeatProposer", runs_in="worker")
    _refused(lambda: proposer_class("mislabeled"), "must be a subclass of pagellm.spec_decode.DeviceProposer")
    assert build_device_proposer(type("Config", (), {"speculative": None})()) is None


# -- parsers ----------------------------------------------------------------------------------------------------------

class EverythingIsContent(ToolParser):
    def parse(self, text, final):
        return ParsedOutput(text)


def test_register_tool_and_reasoning_parsers(capsys):
    register_tool_parser("plain", EverythingIsContent, description="no calls ever")
    assert get_tool_parser("plain") is EverythingIsContent
    ns = build_parser().parse_args(["serve", "--enable-auto-tool-choice", "--tool-call-parser", "plain"])
    assert ns.tool_call_parser == "plain"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    assert "plain (no calls ever)" in " ".join(capsys.readouterr().out.split())
    _refused(lambda: register_tool_parser("hermes", EverythingIsContent), "'hermes' is already registered")
    _refused(lambda: register_tool_parser("bad", dict), "must be a subclass of", "ToolParser")

    register_reasoning_parser("brackets", ReasoningTags("[think]", "[/think]"))
    EngineArgs(reasoning_parser="brackets").validate()
    assert get_reasoning_tags("brackets").end == "[/think]"
    _refused(lambda: register_reasoning_parser("bad", ("<a>", "</a>")), "ReasoningTags")


# -- plugins ----------------------------------------------------------------------------------------------------------

def test_plugins_that_fail_are_named(tmp_path, monkeypatch):
    (tmp_path / "broken_plugins.py").write_text(
        "raise_now = 42\n"
        "def fails():\n    raise RuntimeError('boom')\n"
        "def registers():\n"
        "    from pagellm.reasoning import ReasoningTags, register_reasoning_parser\n"
        "    register_reasoning_parser('from_a_plugin', ReasoningTags('<r>', '</r>'))\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    def entry_point(name: str, value: str) -> EntryPoint:
        return EntryPoint(name, value, PLUGIN_GROUP)

    _refused_plugin = lambda ep, *fragments: _refused_as(PluginError, lambda: call_plugin(ep), *fragments)  # noqa: E731
    _refused_plugin(entry_point("gone", "no_such_module_here:register"), "pagellm plugin 'gone'",
                    "failed to import: ModuleNotFoundError", "PAGELLM_PLUGINS")
    _refused_plugin(entry_point("boom", "broken_plugins:fails"), "pagellm plugin 'boom' (broken_plugins:fails)",
                    "failed: RuntimeError: boom")
    _refused_plugin(entry_point("number", "broken_plugins:raise_now"), "'number'", "not a function")
    call_plugin(entry_point("good", "broken_plugins:registers"))
    assert get_reasoning_tags("from_a_plugin").start == "<r>"

    installed = [entry_point("b", "x:y"), entry_point("a", "x:z")]
    assert [ep.name for ep in selected_plugins(installed, None)] == ["a", "b"]
    assert [ep.name for ep in selected_plugins(installed, " b, ")] == ["b"]
    assert selected_plugins(installed, "") == []
    _refused_as(PluginError, lambda: selected_plugins(installed, "a,c"), "PAGELLM_PLUGINS names 'c'",
                "installed plugins: a, b")
    assert load_plugins() is load_plugins(), "once per process"


def _refused_as(error: type[Exception], call, *fragments: str) -> str:
    with pytest.raises(error) as info:
        call()
    message = str(info.value)
    assert all(f in message for f in fragments), message
    return message


def test_register_kv_connector():
    _refused(lambda: register_kv_connector("Bad", "no_colon", "pagellm.worker.kv_offload:OffloadingWorker"),
             "scheduler_cls", "package.module:Name")
    _refused(lambda: register_kv_connector("OffloadingConnector", "a.b:C", "a.b:D"), "already registered")
    register_kv_connector("LazyConnector", "my_pkg.sched:Scheduler", "my_pkg.worker:Worker", description="lazy")
    assert "LazyConnector" in KV_CONNECTOR_REGISTRY  # nothing imported until chosen
    assert KVTransferConfig.parse({"kv_connector": "LazyConnector", "kv_role": "kv_consumer"}).is_consumer
    assert "LazyConnector (lazy)" in KV_CONNECTOR_REGISTRY.describe()
    _refused(lambda: KVTransferConfig.parse('{"kv_connector": "Nope"}'), "--kv-transfer-config",
             "OffloadingConnector", "LazyConnector")
