"""Device-side state: the model, the KV cache, the flat batch, sampling."""
