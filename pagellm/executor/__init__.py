"""Where a replica's workers run: in the engine's process (`uni`), one process per rank on this
machine (`mp`), or Ray actors on one machine or several (`ray`). Same Worker in all three.
`EXECUTOR_REGISTRY` lists them; `register_executor` adds one."""
from pagellm.executor.base import (
    EXECUTOR_REGISTRY,
    Executor,
    ExecutorEntry,
    StepFuture,
    create_executor,
    register_executor,
)

__all__ = ["EXECUTOR_REGISTRY", "Executor", "ExecutorEntry", "StepFuture", "create_executor", "register_executor"]
