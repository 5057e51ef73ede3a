"""The router's live state: the routing table built from a config, swapped whole on reload.

A request takes the table once and uses it to the end, so a reload (SIGHUP or the admin route)
never drops or changes a request in flight. Backends are kept by URL across reloads with their
load, health and remembered prefixes; tokenizers by path (loading one costs a second).
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import aiohttp

from pagellm.router.balance import Backend, ModelRoute
from pagellm.router.cache import ResponseCache
from pagellm.router.client import UPSTREAM_ERRORS, make_session
from pagellm.router.config import KeyConfig, ModelConfig, RouterConfig, load_config
from pagellm.router.limits import RateLimiter
from pagellm.router.metrics import RouterMetrics
from pagellm.router.store import RedisStore, Store, make_store
from pagellm.tokenizer import Tokenizer, load_tokenizer_at

logger = logging.getLogger(__name__)
HEALTH_TIMEOUT = aiohttp.ClientTimeout(total=2.0)


@dataclass(slots=True, frozen=True)
class PDPools:
    """Disaggregated prefill/decode: each pool one balanced route, named after it (the `model` label of
    its metrics: P/D serves whatever models its engines serve)."""

    prefill: ModelRoute
    decode: ModelRoute


@dataclass(slots=True, frozen=True)
class RoutingTable:
    config: RouterConfig
    routes: dict[str, ModelRoute]
    backends: dict[str, Backend]
    """By URL: each server once, however many models it serves."""
    tokenizers: dict[str, Tokenizer]
    """By model name, for the models that name a tokenizer."""
    keys: dict[str, KeyConfig]
    """By secret."""
    store: Store
    limiter: RateLimiter
    cache: ResponseCache
    pd: PDPools | None = None
    """Set in P/D mode, where `routes` is empty."""


class RouterState:
    """Everything a request handler needs; `reload` swaps the table."""

    def __init__(self, config_path: str | None, overrides: dict, extra_backends: list[str]) -> None:
        self.config_path, self.overrides, self.extra_backends = config_path, overrides, extra_backends
        self.metrics = RouterMetrics()
        self._tokenizers_by_path: dict[str, Tokenizer] = {}
        self.table = self._build(load_config(config_path, overrides, extra_backends), None)
        self._http: aiohttp.ClientSession | None = None
        self._health_task: asyncio.Task | None = None

    def _build(self, config: RouterConfig, old: RoutingTable | None) -> RoutingTable:
        # Backends keep their state across reloads; those the new config drops are forgotten (requests
        # in flight hold their own reference).
        kept = old.backends if old is not None else {}
        urls = [b.url for m in config.models for b in m.backends] + [b.url for b in config.prefill + config.decode]
        backends = {url: kept.get(url) or Backend(url) for url in urls}
        tokenizers = {}
        for i, m in enumerate(config.models):
            if m.tokenizer is not None:
                if m.tokenizer not in self._tokenizers_by_path:
                    try:
                        self._tokenizers_by_path[m.tokenizer] = load_tokenizer_at(m.tokenizer)
                    except (ValueError, OSError) as e:
                        raise ValueError(f"models[{i}].tokenizer: {e}") from e
                tokenizers[m.name] = self._tokenizers_by_path[m.tokenizer]
        routes = {m.name: ModelRoute(m, backends, config.max_imbalance) for m in config.models}
        pd = None
        if config.disaggregated:
            pd = PDPools(*(ModelRoute(ModelConfig(name, pool), backends, config.max_imbalance)
                           for name, pool in (("prefill", config.prefill), ("decode", config.decode))))
        same_store = old is not None and old.config.cache.url == config.cache.url
        store = old.store if same_store else make_store(config.cache.url, config.cache.max_entries)
        return RoutingTable(config, routes, backends, tokenizers, {k.key: k for k in config.keys}, store,
                            RateLimiter(store), ResponseCache(config.cache, store), pd)

    async def check_store(self) -> None:
        """ValueError naming cache.url when the configured Redis does not answer."""
        if isinstance(self.table.store, RedisStore):
            await self.table.store.check()

    @property
    def http(self) -> aiohttp.ClientSession:
        """The backends' client, from `start` on."""
        if self._http is None:
            raise RuntimeError("RouterState.start() has not run")
        return self._http

    async def start(self) -> None:
        """Open the backends' client and start the health checks (on the serving loop: an aiohttp
        session belongs to the loop it was made on)."""
        self._http = make_session(self.table.config.request_timeout_s)
        self._health_task = asyncio.create_task(self._health_loop())

    async def stop(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
        if self._http is not None:
            await self._http.close()
        await self.table.store.close()

    async def reload(self) -> RoutingTable:
        """Read the config again and swap the table; a bad config raises ValueError and changes nothing."""
        config = await asyncio.to_thread(load_config, self.config_path, self.overrides, self.extra_backends)
        table = await asyncio.to_thread(self._build, config, self.table)
        if isinstance(table.store, RedisStore) and table.store is not self.table.store:
            await table.store.check()
        self.table = table
        logger.info("router config reloaded: %d model(s), %d key(s)", len(config.models), len(config.keys))
        return table

    def backend_failed(self, backend: Backend) -> None:
        if backend.failed(self.table.config.eject_after_failures):
            logger.warning("backend %s taken out after %d failures", backend.url, backend.consecutive_failures)
        self.metrics.healthy.labels(backend.url).set(0 if backend.ejected else 1)

    def backend_succeeded(self, backend: Backend) -> None:
        if backend.ejected:
            logger.warning("backend %s is back in rotation", backend.url)
        backend.succeeded()
        self.metrics.healthy.labels(backend.url).set(1)

    async def check_health(self) -> None:
        """Probe every backend of the current table once."""
        await asyncio.gather(*(self._probe(b) for b in self.table.backends.values()))

    async def _probe(self, backend: Backend) -> None:
        try:
            async with self.http.get(f"{backend.url}/health", timeout=HEALTH_TIMEOUT) as response:
                ok = response.status == 200
        except UPSTREAM_ERRORS:
            ok = False
        if ok:
            self.backend_succeeded(backend)
        else:
            self.backend_failed(backend)

    async def _health_loop(self) -> None:
        while True:
            await self.check_health()
            await asyncio.sleep(self.table.config.health_interval_s)
