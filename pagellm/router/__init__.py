"""`pagellm router`: an OpenAI-compatible gateway over many engines and other OpenAI-compatible servers.

It never imports the engine: only the tokenizer (length governance) and its own HTTP, limit, cache
and balancing pieces. Its only shared state lives in Redis when one is configured.
"""
