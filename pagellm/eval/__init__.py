"""`pagellm eval`: perplexity and distribution drift of quantized weights against a reference."""
