"""Structured output: requests constrained to a JSON schema, regex, choice or grammar.

The frontend checks a request's `StructuredOutputsParams` (size limit, and xgrammar parses it:
milliseconds) so that a bad spec is refused before it reaches the engine (`source.py`). The engine
core compiles it in a small thread pool, cached by spec, while the request waits without holding
up others, and keeps a matcher per request beside it in the scheduler (`manager.py`), which fills
the token bitmask of each step's grammar rows; the sampler applies it on the device
(`bitmask.py`). xgrammar is imported only when the first such request arrives.
"""
from pagellm.structured_output.errors import GrammarError

__all__ = ["GrammarError"]
