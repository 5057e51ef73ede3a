"""The step loop (EngineCore) and the caller-facing engine around it (LLMEngine)."""
