"""A plugin as users ship one: a package built and installed here (pip --target, on PYTHONPATH of
the processes started, never into this environment) declaring a `pagellm.plugins` entry point that
registers a model architecture and a tool parser. `pagellm serve` of a model whose config.json names
that architecture answers, building the plugin's class in its worker process, and its
--tool-call-parser reads the tool calls; a plugin that fails is an error naming it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import httpx
import pytest
from server_utils import RemoteServer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PLUGIN_FILES = {
    "pyproject.toml": """
        [build-system]
        requires = ["setuptools>=64"]
        build-backend = "setuptools.build_meta"

        [project]
        name = "pagellm-tiny-plugin"
        version = "0.1.0"

        [project.entry-points."pagellm.plugins"]
        tiny = "pagellm_tiny_plugin:register"

        [tool.setuptools]
        packages = ["pagellm_tiny_plugin"]
    """,
    "pagellm_tiny_plugin/__init__.py": """
        def register():
            # Names, not classes: the model (torch) and the parser load only where they are used.
            from pagellm.entrypoints.openai.tool_parsers import register_tool_parser
            from pagellm.models import register_model

            register_model("TinyPluginForCausalLM", "pagellm_tiny_plugin.model:TinyPluginForCausalLM")
            register_tool_parser("tiny_calls", "pagellm_tiny_plugin.parser:TinyToolParser",
                                 description="one call of plugin_probe, whatever the text")
    """,
    "pagellm_tiny_plugin/model.py": """
        import os

        from pagellm.models.llama import LlamaForCausalLM


        class TinyPluginForCausalLM(LlamaForCausalLM):
            def __init__(self, config, attn_backend):
                super().__init__(config, attn_backend)
                marker = os.environ.get("TINY_PLUGIN_MARKER")
                if marker:  # which process built it
                    with open(marker, "a") as f:
                        f.write(f"{os.getpid()}\\n")
    """,
    "pagellm_tiny_plugin/parser.py": """
        from pagellm.entrypoints.openai.tool_parsers import ParsedCall, ParsedOutput, ToolParser


        class TinyToolParser(ToolParser):
            def parse(self, text, final):
                return ParsedOutput("", [ParsedCall("plugin_probe", '{"source": "tiny_plugin"}', True)])
    """,
}

BROKEN_PLUGIN_FILES = {
    "pyproject.toml": """
        [build-system]
        requires = ["setuptools>=64"]
        build-backend = "setuptools.build_meta"

        [project]
        name = "pagellm-broken-plugin"
        version = "0.1.0"

        [project.entry-points."pagellm.plugins"]
        broken = "pagellm_broken_plugin:register"

        [tool.setuptools]
        packages = ["pagellm_broken_plugin"]
    """,
    "pagellm_broken_plugin/__init__.py": """
        def register():
            raise RuntimeError("this plugin is broken on purpose")
    """,
}

TINY_PLUGIN_CONFIG = {
    "architectures": ["TinyPluginForCausalLM"], "model_type": "llama", "vocab_size": 64, "hidden_size": 32,
    "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
    "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2,
}
PROBE_TOOL = {"type": "function", "function": {"name": "plugin_probe", "parameters": {
    "type": "object", "properties": {"source": {"type": "string"}}}}}


def _write_project(folder, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip())


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory) -> str:
    """Both plugins installed into a folder of their own (their .dist-info carries the entry points)."""
    root = tmp_path_factory.mktemp("plugins")
    site = root / "site"
    for name, files in (("tiny", PLUGIN_FILES), ("broken", BROKEN_PLUGIN_FILES)):
        _write_project(root / name, files)
        # Offline and with this environment's setuptools: nothing is downloaded or installed here.
        done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation",
                               "--no-index", "--quiet", "--target", str(site), str(root / name)],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
    return str(site)


def _env(site: str, **extra: str) -> dict[str, str]:
    path = [site, REPO, *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path), **extra}


@pytest.fixture(scope="module")
def tiny_plugin_model(tmp_path_factory) -> str:
    """A config.json naming the plugin's architecture, a word-level tokenizer, a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = tmp_path_factory.mktemp("tiny-plugin-model")
    (folder / "config.json").write_text(json.dumps(TINY_PLUGIN_CONFIG))
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(64)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "t1", "eos_token": "t2",
        "chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}"}))
    return str(folder)


@pytest.mark.slow
def test_a_broken_plugin_is_an_error_naming_it(plugin_site):
    cli = [sys.executable, "-m", "pagellm.cli", "serve", "--help"]
    done = subprocess.run(cli, env=_env(plugin_site), capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and not done.stdout, done.stderr
    assert done.stderr.startswith("pagellm: error: pagellm plugin 'broken' (pagellm_broken_plugin:register, from the "
                                  "package pagellm-broken-plugin) failed: RuntimeError: this plugin is broken on "
                                  "purpose; uninstall it, or set PAGELLM_PLUGINS"), done.stderr

    # The same error again on a later call in that process, not a registry without the plugin.
    script = ("from pagellm.plugins import load_plugins, PluginError\n"
              "for _ in range(2):\n"
              "    try:\n        load_plugins()\n    except PluginError as e:\n        print('refused:', e)\n")
    done = subprocess.run([sys.executable, "-c", script], env=_env(plugin_site), capture_output=True, text=True,
                          timeout=300)
    assert done.stdout.count("refused: pagellm plugin 'broken'") == 2, done.stdout + done.stderr

    # PAGELLM_PLUGINS leaves it out; the other plugin's names are flag choices.
    done = subprocess.run(cli, env=_env(plugin_site, PAGELLM_PLUGINS="tiny"), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert "{hermes,llama3_json,mistral,tiny_calls}" in done.stdout
    assert "tiny_calls (one call of plugin_probe, whatever the text)" in " ".join(done.stdout.split())


@pytest.mark.slow
def test_serve_a_plugin_architecture_with_the_plugin_tool_parser(plugin_site, tiny_plugin_model, tmp_path):
    marker = tmp_path / "built-by"
    env = _env(plugin_site, PAGELLM_PLUGINS="tiny", TINY_PLUGIN_MARKER=str(marker))
    # mp: the model is built in a worker process of its own, which must load the plugin too.
    server = RemoteServer(tiny_plugin_model, "--served-model-name", "tiny", "--load-format", "dummy", "--device", "cpu",
                          "--dtype", "float32", "--distributed-executor-backend", "mp", "--kv-cache-memory-bytes",
                          str(4 << 20), "--max-num-seqs", "4", "--enable-auto-tool-choice", "--tool-call-parser",
                          "tiny_calls", env=env)
    try:
        with httpx.Client(base_url=server.url, timeout=60.0) as http:
            models = http.get("/v1/models")
            assert models.status_code == 200 and [m["id"] for m in models.json()["data"]] == ["tiny"]

            completion = http.post("/v1/completions", json={"model": "tiny", "prompt": "t5 t6 t7", "max_tokens": 4,
                                                            "temperature": 0.0, "ignore_eos": True})
            assert completion.status_code == 200, completion.text
            assert completion.json()["usage"]["completion_tokens"] == 4

            chat = http.post("/v1/chat/completions", json={
                "model": "tiny", "messages": [{"role": "user", "content": "t5 t6 t7"}], "tools": [PROBE_TOOL],
                "max_tokens": 3, "temperature": 0.0})
            assert chat.status_code == 200, chat.text
            message = chat.json()["choices"][0]["message"]
            calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]]
            assert calls == [("plugin_probe", {"source": "tiny_plugin"})] and not message["content"]

        builders = {int(pid) for pid in marker.read_text().split()}
        assert builders and server.process.pid not in builders and server.engine_pid() not in builders, \
            "the plugin's model class is built in the worker process"
    finally:
        server.stop()
