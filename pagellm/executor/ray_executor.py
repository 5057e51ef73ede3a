"""Ranks as Ray actors, one per bundle of a placement group: on this machine or across a Ray
cluster (`ray start --head` on one node, `ray start --address=HEAD:6379` on the others, then
`pagellm serve ... --distributed-executor-backend ray` on the head).

Actors run their calls in the order sent, so the engine can launch step N+1 before it collects
step N, as with the other executors. An actor that dies makes Ray raise, and a step whose results
do not come within its timeout (a rank stopped, or stuck in a kernel or a deadlock) times out:
either fails the engine with `WorkerFailedError`, and every actor is killed.
"""
from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable
from typing import Any

from pagellm.config import EngineConfig
from pagellm.core.outputs import ModelRunnerOutput, SchedulerOutput
from pagellm.executor.base import Executor, StepFuture, WorkerFailedError, hung_step_reason, step_timeout_s
from pagellm.worker.worker import Worker

logger = logging.getLogger(__name__)


def _import_ray():
    try:
        import ray
    except ImportError:
        raise ValueError("distributed_executor_backend 'ray' needs Ray: pip install 'pagellm[ray]'") from None
    return ray


class _RankActor:
    """One rank: a Worker built inside the actor's process once the ranks' meeting point is known."""

    def __init__(self) -> None:
        self.worker = None

    def meeting_point(self) -> str:
        """`tcp://ip:port` on this actor's node, for rank 0 to host the process group's store."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"tcp://{ray.util.get_node_ip_address()}:{port}"

    def start(self, config: EngineConfig, rank: int, init_method: str) -> None:
        logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s [rank {rank}] %(name)s: %(message)s")
        # Ray shows each actor only the GPU of its bundle.
        gpu_index = 0 if config.device.type == "cuda" else None
        self.worker = Worker(config, rank, init_method, gpu_index)

    def call(self, method: str, *args: Any) -> Any:
        return getattr(self.worker, method)(*args)

    def whereabouts(self) -> tuple[int, str]:
        """This actor's process id and Ray node."""
        import ray

        return os.getpid(), ray.get_runtime_context().get_node_id()


class RayExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        ray = self._ray = _import_ray()
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        world_size = config.parallel.world_size
        on_gpu = config.device.type == "cuda"
        if not ray.is_initialized():
            try:  # a running cluster: RAY_ADDRESS, or `ray start` on this machine
                ray.init(address="auto")
            except ConnectionError:
                # A local instance of our own. CPU ranks share this machine's cores, as with mp:
                # Ray is told of at least one logical CPU per rank.
                ray.init(num_cpus=None if on_gpu else max(os.cpu_count() or 1, world_size))
        bundle = {"GPU": 1} if on_gpu else {"CPU": 1}
        self._pg = placement_group([dict(bundle) for _ in range(world_size)], strategy="PACK")
        self._remove_pg = remove_placement_group
        if not self._pg.wait(timeout_seconds=120):
            remove_placement_group(self._pg)
            raise ValueError(f"the Ray cluster cannot place {world_size} ranks of {bundle}: "
                             f"available {ray.available_resources()}")
        actor_cls = ray.remote(num_cpus=0 if on_gpu else 1, num_gpus=1 if on_gpu else 0)(_RankActor)
        self._actors = [
            actor_cls.options(scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, rank)).remote()
            for rank in range(world_size)]
        self._driver = world_size - config.parallel.tensor_parallel_size
        try:
            init_method = self._get(self._actors[0].meeting_point.remote())
            self._get([a.start.remote(config, rank, init_method) for rank, a in enumerate(self._actors)])
            self.collective_rpc("load_model")
            whereabouts = self._get([a.whereabouts.remote() for a in self._actors])
            self.pids = [pid for pid, _ in whereabouts]
            # The pids of the ranks on this machine (None on other nodes): a hung step names the stopped ones.
            here = ray.get_runtime_context().get_node_id()
            self._local_pids = [pid if node == here else None for pid, node in whereabouts]
            logger.info("%d Ray ranks ready (pids %s)", world_size, " ".join(map(str, self.pids)))
        except BaseException:
            self.shutdown()
            raise

    def _get(self, refs, timeout_s: float | None = None, late: Callable[[], str] | None = None):
        """ray.get, with a rank's death or exception, or no result within `timeout_s` (then with
        `late()` as the reason), turned into WorkerFailedError."""
        try:
            return self._ray.get(refs, timeout=timeout_s)
        except self._ray.exceptions.GetTimeoutError:
            reason = late()
        except self._ray.exceptions.RayError as e:
            reason = f"a Ray rank failed: {e}"
        logger.error("distributed executor: %s; stopping every rank", reason)
        self.shutdown()
        raise WorkerFailedError(reason)

    def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        return self._get([a.call.remote(method, *args) for a in self._actors])

    def execute_model(self, so: SchedulerOutput) -> StepFuture:
        launched = [a.call.remote("execute_model", so) for a in self._actors]
        return StepFuture(lambda: self._collect(launched, so.total_num_scheduled_tokens))

    def _collect(self, launched: list, num_tokens: int) -> ModelRunnerOutput:
        parallel = self.config.parallel
        results = self._get(launched + [a.call.remote("collect") for a in self._actors],
                            step_timeout_s(parallel, num_tokens),
                            lambda: hung_step_reason(parallel, num_tokens, self._local_pids))
        return results[len(launched) + self._driver]

    def shutdown(self) -> None:
        for actor in getattr(self, "_actors", []):
            self._ray.kill(actor)
        self._actors = []
        if getattr(self, "_pg", None) is not None:
            self._remove_pg(self._pg)
            self._pg = None

