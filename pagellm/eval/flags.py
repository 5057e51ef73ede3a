"""The settings `pagellm eval` declares on its command line and its run reads (`cli`, `run`)."""

EVAL_ENGINE_ARGS = ("load_format", "dtype", "device", "attention_backend", "seed", "kv_cache_dtype")
"""The engine flags that decide how a model is built (the rest is about serving)."""
SHAREGPT_CHARS = 90_000
"""The size of the `--text sharegpt` text."""
SHAREGPT_MIN_CHARS = 400
"""Its answers are at least this long (not one-line replies)."""
