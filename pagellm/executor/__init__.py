"""Where a replica's workers run: in the engine's process (`uni`), one process per rank on this
machine (`mp`), or Ray actors on one machine or several (`ray`). Same Worker in all three."""
from pagellm.executor.base import Executor, StepFuture, create_executor

__all__ = ["Executor", "StepFuture", "create_executor"]
