"""Render Hugging Face chat templates (Jinja) the way `transformers` does, without importing it.

Templates are model-supplied code, so they run in jinja2's immutable sandbox (no attribute that
starts with `_`, no Python internals, no mutation of the values passed in), and a template is one
self-contained string: `include`, `import`, `extends` and `from` are refused when it is compiled, so
no template reads a file. The environment matches what template authors write against:
`trim_blocks`/`lstrip_blocks`, the `loopcontrols` extension, a `{% generation %}` block (rendered as
its body), `raise_exception()`, `strftime_now()` and a `tojson` that keeps non-ASCII text as is.
"""
from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class _GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; here it is a no-op."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


_TEMPLATE_LOADING = (nodes.Include, nodes.Import, nodes.FromImport, nodes.Extends)
"""Statements that load another template by name: a chat template may not use them."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja2's built-in tojson HTML-escapes and sorts keys, which changes the prompt text.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@functools.lru_cache(maxsize=16)
def compile_chat_template(source: str) -> jinja2.Template:
    """Compile once per distinct template string; a server renders the same one for every request."""
    env = _environment()
    try:
        tree = env.parse(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ValueError(f"chat template has a syntax error (line {e.lineno}): {e.message}") from e
    loading = next(tree.find_all(_TEMPLATE_LOADING), None)
    if loading is not None:
        raise ValueError(f"chat template loads another template (line {loading.lineno}): `include`, `import`, "
                         "`extends` and `from` are not allowed; a chat template is one self-contained string")
    return env.from_string(tree)


@functools.lru_cache(maxsize=16)
def iterates_message_content(source: str) -> bool:
    """Whether the template loops over a message's `content` (`{% for part in message['content'] %}`,
    filtered or not): it then takes content as a list of typed parts ({"type": "image"} among them,
    as multimodal processors' templates do) rather than as one text (vLLM's "openai" and "string"
    content formats)."""
    compile_chat_template(source)  # refuses a bad template with its own message
    for loop in _environment().parse(source).find_all(nodes.For):
        target = loop.iter
        while isinstance(target, (nodes.Filter, nodes.Test)):
            target = target.node
        if isinstance(target, nodes.Getitem) and isinstance(target.arg, nodes.Const) and target.arg.value == "content":
            return True
        if isinstance(target, nodes.Getattr) and target.attr == "content":
            return True
    return False


def render_chat_template(
    source: str,
    conversation: list[dict[str, Any]],
    add_generation_prompt: bool,
    special_tokens: dict[str, str],
    **kwargs: Any,
) -> str:
    """The prompt text for `conversation`; template errors (e.g. `raise_exception`) become ValueError."""
    template = compile_chat_template(source)
    variables: dict[str, Any] = {"tools": None, "documents": None, **special_tokens, **kwargs}
    try:
        return template.render(messages=conversation, add_generation_prompt=add_generation_prompt, **variables)
    except jinja2.exceptions.TemplateError as e:
        raise ValueError(f"chat template rejected the conversation: {e}") from e
