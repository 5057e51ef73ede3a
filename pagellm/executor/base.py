"""The executor boundary: the engine hands over scheduler outputs and gets back futures of plain
data. Workers keep their own state; nothing outside a worker touches its runner."""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pagellm.config import EngineConfig, ParallelConfig
from pagellm.config.registry import Registry, check_ref, resolve
from pagellm.core.outputs import ModelRunnerOutput, SchedulerOutput
from pagellm.metrics.startup import slowest


class WorkerFailedError(RuntimeError):
    """A rank died, or raised, while the engine needed it; the replica cannot go on."""


class StepFuture:
    """The results of one launched step, read once and in launch order."""

    __slots__ = ("_resolve", "_output")

    def __init__(self, resolve: Callable[[], ModelRunnerOutput]) -> None:
        self._resolve = resolve
        self._output: ModelRunnerOutput | None = None

    def result(self) -> ModelRunnerOutput:
        if self._output is None:
            self._output = self._resolve()
        return self._output


class Executor(ABC):
    """Runs one replica's ranks. Subclasses differ only in where the workers live."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    @abstractmethod
    def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        """Call `Worker.<method>(*args)` on every rank and return the results in rank order."""

    @abstractmethod
    def execute_model(self, so: SchedulerOutput) -> StepFuture:
        """Launch one step on every rank without waiting for it."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop every rank; safe to call more than once."""

    def check_health(self) -> None:
        """Raise WorkerFailedError if a rank is gone (the engine calls this while idle, when no
        step would notice)."""

    @property
    def max_concurrent_batches(self) -> int:
        """Steps that can usefully be in flight at once: one per pipeline stage."""
        return self.config.parallel.pipeline_parallel_size

    def determine_num_blocks(self) -> int:
        """The smallest rank's KV capacity: every rank holds the same blocks."""
        return min(self.collective_rpc("determine_num_blocks"))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.collective_rpc("initialize_kv_cache", (num_blocks,))

    def startup_phases(self) -> dict[str, float]:
        """Each start-up phase's seconds on the slowest rank (the others waited for it)."""
        return slowest(self.collective_rpc("startup_phases"))

    def num_host_blocks(self) -> int:
        """The KV connector's blocks outside the device, on the smallest rank (0: none)."""
        return min(self.collective_rpc("num_host_blocks"))

    def add_lora(self, adapter: Any) -> None:
        """Hand every rank a LoRA adapter the engine core loaded (`pagellm.lora.adapter.LoRAAdapter`)."""
        self.collective_rpc("add_lora", (adapter,))

    def remove_lora(self, lora_id: int) -> None:
        """Every rank forgets an adapter no live request uses."""
        self.collective_rpc("remove_lora", (lora_id,))


@dataclass(frozen=True, slots=True)
class ExecutorEntry:
    """A `--distributed-executor-backend`: where a replica's ranks run."""

    name: str
    cls: Any
    """An `Executor` subclass (constructed with the `EngineConfig`, its workers loaded and ready when
    it returns), or its "package.module:Class" name."""
    description: str = ""
    """What `--help` says of it."""
    max_world_size: int | None = None
    """The most ranks (tensor x pipeline parallel) it runs; None: any number."""


EXECUTOR_REGISTRY: Registry[ExecutorEntry] = Registry(
    "executor", "distributed_executor_backend (--distributed-executor-backend)", builtins=(
        ExecutorEntry("uni", "pagellm.executor.uniproc:UniProcExecutor", "in the engine's process; one rank only",
                      max_world_size=1),
        ExecutorEntry("mp", "pagellm.executor.multiproc:MultiprocExecutor", "one process per rank, this machine"),
        ExecutorEntry("ray", "pagellm.executor.ray_executor:RayExecutor", "Ray actors, one machine or several"),
    ))
"""Every executor, by `--distributed-executor-backend` name."""


def register_executor(name: str, executor_cls: type[Executor] | str, *, description: str = "",
                      max_world_size: int | None = None, override: bool = False) -> None:
    """Make `name` a `--distributed-executor-backend`: `executor_cls` (an `Executor` subclass, or its
    "package.module:Class" name, imported when chosen) runs at most `max_world_size` ranks (None:
    any). A name already registered is refused unless `override`."""
    check_ref(executor_cls, f"register_executor({name!r})")
    if not isinstance(executor_cls, str):
        _check_executor_class(executor_cls, name)
    if max_world_size is not None and (not isinstance(max_world_size, int) or max_world_size < 1):
        raise ValueError(f"register_executor({name!r}): max_world_size must be a positive integer or None, "
                         f"got {max_world_size!r}")
    EXECUTOR_REGISTRY.register(ExecutorEntry(name, executor_cls, description, max_world_size), override=override)


def create_executor(config: EngineConfig) -> Executor:
    """Start the executor of `config.parallel.executor_backend`, its workers loaded and ready."""
    name = config.parallel.executor_backend
    return _check_executor_class(resolve(EXECUTOR_REGISTRY.get(name).cls), name)(config)


def step_timeout_s(parallel: ParallelConfig, num_tokens: int) -> float | None:
    """Longest wait for the results of a step of `num_tokens` scheduled tokens before its ranks
    count as hung (None: no limit)."""
    if parallel.step_timeout_s is None:
        return None
    return parallel.step_timeout_s + parallel.step_timeout_per_token_s * num_tokens


def hung_step_reason(parallel: ParallelConfig, num_tokens: int, pids: list[int | None]) -> str:
    """Why a step of `num_tokens` tokens counts as hung, naming the stopped ranks among those whose
    `pids` are on this machine (None: elsewhere)."""
    stopped = [f"rank {rank} (pid {pid}) is stopped (SIGSTOP or a debugger)"
               for rank, pid in enumerate(pids) if pid is not None and _process_state(pid) in ("T", "t")]
    return (f"no result for a step of {num_tokens} token{'s' * (num_tokens != 1)} within "
            f"{step_timeout_s(parallel, num_tokens):.1f} s (engine_step_timeout (--engine-step-timeout) "
            f"{parallel.step_timeout_s:g} s + {parallel.step_timeout_per_token_s * 1000:g} ms a token): "
            f"{'; '.join(stopped) or 'a rank is stuck (in a kernel or a deadlock)'}")


def _process_state(pid: int) -> str | None:
    """The state letter of a local process (R, S, D, T...; Linux), None where unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return None


def _check_executor_class(cls: Any, name: str) -> type[Executor]:
    if not (isinstance(cls, type) and issubclass(cls, Executor)):
        raise ValueError(f"executor {name!r} must be a subclass of pagellm.executor.base.Executor, got {cls!r}")
    return cls
