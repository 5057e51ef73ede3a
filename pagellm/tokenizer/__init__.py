"""Tokenizers built from GGUF metadata or `tokenizer.json`, and chat-template rendering."""
from pagellm.tokenizer.tokenizer import Tokenizer, load_tokenizer, load_tokenizer_at

__all__ = ["Tokenizer", "load_tokenizer", "load_tokenizer_at"]
