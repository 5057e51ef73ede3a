"""The engine core's LoRA adapters in host memory (`AdapterStore`): loaded in a thread when a
request first needs one, handed to the workers, and dropped least recently used first when
`max_cpu_loras` are loaded, never while a running request uses one."""
from __future__ import annotations

import concurrent.futures
from collections import OrderedDict
from collections.abc import Callable, Collection

from pagellm.config.arch import ModelArchConfig
from pagellm.config.lora import LoRAConfig
from pagellm.lora.adapter import LoRAAdapter, load_adapter
from pagellm.lora_request import LoRARequest


class HostAdapterStore:
    """`pagellm.core.interfaces.AdapterStore` over PEFT folders, telling the workers what it loads
    (`on_load`) and drops (`on_evict`)."""

    def __init__(self, arch: ModelArchConfig, config: LoRAConfig, on_load: Callable[[LoRAAdapter], None],
                 on_evict: Callable[[int], None]) -> None:
        self.arch, self.config = arch, config
        self.max_loras = config.max_loras
        self.num_loads = 0
        self.num_evictions = 0
        self._on_load, self._on_evict = on_load, on_evict
        self._loaded: OrderedDict[int, LoRAAdapter] = OrderedDict()
        """Least recently used first."""
        self._loading: dict[int, concurrent.futures.Future[LoRAAdapter]] = {}
        self._paths: dict[int, str] = {}
        """Each adapter id's path: one id names one adapter."""
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lora-load")

    def ready(self, lora: LoRARequest, in_use: Collection[int]) -> bool:
        lora_id = lora.lora_int_id
        known = self._paths.setdefault(lora_id, lora.lora_path)
        if known != lora.lora_path:
            raise ValueError(f"lora_int_id {lora_id} already names the adapter at {known!r}, not {lora.lora_path!r}: "
                             "give each adapter its own id")
        if lora_id in self._loaded:
            self._loaded.move_to_end(lora_id)
            return True
        future = self._loading.get(lora_id)
        if future is None:
            self._loading[lora_id] = self._pool.submit(load_adapter, lora, self.arch, self.config)
            return False
        if not future.done():
            return False
        del self._loading[lora_id]
        try:
            adapter = future.result()
        except ValueError:
            del self._paths[lora_id]  # the folder may be fixed and the adapter asked for again
            raise
        self._make_room(in_use)
        self._on_load(adapter)
        self._loaded[lora_id] = adapter
        self.num_loads += 1
        return True

    def _make_room(self, in_use: Collection[int]) -> None:
        # The scheduler asks only while fewer than max_loras adapters run and max_cpu_loras >=
        # max_loras, so an unused adapter is always there to drop.
        while len(self._loaded) >= self.config.max_cpu_loras:
            victim = next(i for i in self._loaded if i not in in_use)
            del self._loaded[victim]
            self._on_evict(victim)
            self.num_evictions += 1

    def wait(self, timeout_s: float) -> None:
        if self._loading:
            concurrent.futures.wait(list(self._loading.values()), timeout_s,
                                    return_when=concurrent.futures.FIRST_COMPLETED)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
