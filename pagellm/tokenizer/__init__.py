"""Tokenizers built from GGUF metadata or `tokenizer.json`, and chat-template rendering."""
from pagellm.tokenizer.tokenizer import Tokenizer, load_tokenizer

__all__ = ["Tokenizer", "load_tokenizer"]
