"""The engine flags `pagellm plan` takes, apart from the planner itself: the command line declares
them without importing the planner (and its GGUF and Triton modules) for every `pagellm` command."""

PLAN_ENGINE_ARGS = ("dtype", "tensor_parallel_size", "enable_expert_parallel", "max_model_len",
                    "gpu_memory_utilization", "max_num_seqs", "max_num_batched_tokens", "block_size",
                    "kv_cache_memory_bytes", "enforce_eager")
"""The engine flags that change how the KV cache is sized."""
PLAN_HOST_ARGS = ("kv_offloading_size",)
"""Engine flags about host memory, planned but not checked against this machine's."""
