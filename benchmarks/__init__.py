"""Benchmark scripts and their shared helpers (datasets, Hugging Face baseline, result metadata)."""
