"""User-facing entry points: the offline LLM class and (later) the CLI and the OpenAI server."""
