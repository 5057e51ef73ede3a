"""Tool-call parsers, by the names vLLM's `--tool-call-parser` uses: each reads the calls a model
family writes into its text (for `tool_choice: "auto"`), plus the parsers for the outputs that
`required` and a named `tool_choice` constrain with a grammar."""
from __future__ import annotations

from pagellm.entrypoints.openai.tool_parsers.base import ParsedCall, ParsedOutput, ToolParser
from pagellm.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from pagellm.entrypoints.openai.tool_parsers.json_array import JsonArrayToolParser, MistralToolParser
from pagellm.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from pagellm.entrypoints.openai.tool_parsers.named import NamedToolParser
from pagellm.entrypoints.openai.tool_parsers.streaming import ToolCallStreamer, tool_call_id

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
}
"""`--tool-call-parser` name -> parser class (constructed without arguments)."""

__all__ = ["TOOL_PARSERS", "HermesToolParser", "JsonArrayToolParser", "Llama3JsonToolParser", "MistralToolParser",
           "NamedToolParser", "ParsedCall", "ParsedOutput", "ToolCallStreamer", "ToolParser", "tool_call_id"]
