"""The router's configuration: a YAML file (the names users' configs rely on) plus flag overrides.

Every check raises a `ValueError` naming the key at fault (`models[1].backends[0].url`), so a bad
file fails at start-up (or a reload is refused, keeping the running config) with a message the
user can act on.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import yaml

LENGTH_POLICIES = ("reject", "truncate_left", "truncate_right", "truncate_middle")
BACKEND_SCHEMES = ("http", "https")
CACHE_SCHEMES = ("memory", "redis")


@dataclass(slots=True, frozen=True)
class BackendConfig:
    url: str
    """Base URL of an OpenAI-compatible server (`http://host:port`, no `/v1`)."""
    weight: float = 1.0
    """Share of the model's traffic. Backends of one model with unequal weights are a canary split
    (each its own version unless `version` groups them); equal weights form one balanced pool."""
    version: str | None = None
    """Backends of one version share its traffic and are balanced by prefix affinity and load."""
    api_key: str | None = None
    """Bearer key the router sends to this backend (the client's key is never forwarded)."""


@dataclass(slots=True, frozen=True)
class ModelConfig:
    name: str
    """What clients send as `model`."""
    backends: tuple[BackendConfig, ...]
    max_input_tokens: int | None = None
    max_output_tokens: int | None = None
    length_policy: str = "reject"
    """reject | truncate_left | truncate_right | truncate_middle."""
    tokenizer: str | None = None
    """A `.gguf` file or a directory with `tokenizer.json`: counts tokens for limits."""


@dataclass(slots=True, frozen=True)
class KeyConfig:
    key: str
    name: str
    requests_per_minute: int | None = None
    input_tokens_per_minute: int | None = None
    output_tokens_per_minute: int | None = None
    max_concurrent: int | None = None
    max_input_tokens: int | None = None
    """Caps this key's prompts below the model's limit."""
    max_output_tokens: int | None = None


@dataclass(slots=True, frozen=True)
class CacheConfig:
    url: str = "memory://"
    """memory:// (this process) or redis://host:port/db (shared; also holds the rate-limit counters)."""
    ttl_s: float = 600.0
    max_entries: int = 10_000
    """Bound of the in-memory cache (least recently used entries go first)."""
    max_entry_bytes: int = 1 << 20
    """Larger responses are not cached (with Redis, its `maxmemory` bounds the total)."""
    enabled: bool = True
    deterministic_only: bool = True
    """Cache only requests with temperature 0 or a seed."""
    shared_across_keys: bool = False
    """Let one API key's cached responses answer another's identical request."""


@dataclass(slots=True, frozen=True)
class RouterConfig:
    models: tuple[ModelConfig, ...]
    keys: tuple[KeyConfig, ...] = ()
    cache: CacheConfig = field(default_factory=CacheConfig)
    admin_key: str | None = None
    """Bearer key of the /admin routes (reload, backend states); absent: the admin routes are off."""
    sticky_header: str | None = None
    """A request header (e.g. `x-session-id`) whose value pins a client to one canary version."""
    health_interval_s: float = 5.0
    eject_after_failures: int = 3
    """Consecutive failures (requests or health checks) that take a backend out until a probe passes."""
    request_timeout_s: float = 600.0
    max_imbalance: int = 8
    """Prefix affinity yields when its backend has this many more requests in flight than the least loaded."""
    prefill: tuple[BackendConfig, ...] = ()
    """Disaggregated prefill/decode: the engines that compute prompts (kv_producer). Empty: no P/D."""
    decode: tuple[BackendConfig, ...] = ()
    """The engines that pull a prompt's KV from a prefill engine and decode (kv_consumer)."""

    @property
    def disaggregated(self) -> bool:
        return bool(self.prefill)


def load_config(path: str | None, overrides: dict[str, Any] | None = None,
                extra_backends: list[str] | None = None) -> RouterConfig:
    """Read `path` (YAML; None: empty), apply top-level `overrides` (flags) and `NAME=URL[@WEIGHT]` backends."""
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, encoding="utf-8") as f:
                raw = yaml.safe_load(f) or {}
        except OSError as e:
            raise ValueError(f"--config: cannot read {path!r}: {e.strerror}") from e
        except yaml.YAMLError as e:
            raise ValueError(f"--config: {path!r} is not valid YAML: {e}") from e
        if not isinstance(raw, dict):
            raise ValueError(f"--config: {path!r} must hold a mapping with `models`")
    for name, value in (overrides or {}).items():
        if value is None:
            continue
        if name == "cache_url":
            raw["cache"] = {**(raw.get("cache") or {}), "url": value}
        else:
            raw[name] = value
    models = list(raw.get("models") or [])
    for spec in extra_backends or []:
        _add_flag_backend(models, spec)
    raw["models"] = models
    return parse_config(raw)


def _add_flag_backend(models: list[Any], spec: str) -> None:
    name, sep, rest = spec.partition("=")
    if not sep or not name or not rest:
        raise ValueError(f"--backend must be NAME=URL[@WEIGHT], got {spec!r}")
    url, _, weight = rest.partition("@")
    backend = {"url": url, **({"weight": _number(weight, "--backend weight")} if weight else {})}
    for m in models:
        if isinstance(m, dict) and m.get("name") == name:
            m["backends"] = [*(m.get("backends") or []), backend]
            return
    models.append({"name": name, "backends": [backend]})


def _number(text: str, where: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{where} must be a number, got {text!r}") from None


def parse_config(raw: dict[str, Any]) -> RouterConfig:
    """The validated config of a YAML document's content."""
    _check_keys(raw, "", ("models", "keys", "cache", "admin_key", "sticky_header", "health_interval_s",
                          "eject_after_failures", "request_timeout_s", "max_imbalance", "prefill", "decode"))
    prefill, decode = _pools(raw)
    models_raw = raw.get("models")
    if prefill:
        if models_raw:
            raise ValueError("models: not with prefill/decode (--prefill/--decode): in P/D mode the two pools serve "
                             "every model their engines serve; drop `models` and --backend")
        if raw.get("sticky_header") is not None:
            raise ValueError("sticky_header: not with prefill/decode (--prefill/--decode): it pins clients to canary "
                             "versions, which the P/D pools do not have")
        models_raw = []
    elif not isinstance(models_raw, list) or not models_raw:
        raise ValueError("models: at least one model with backends is required (or --backend NAME=URL, or "
                         "--prefill URL... --decode URL...)")
    models = tuple(_model(m, f"models[{i}]") for i, m in enumerate(models_raw))
    seen: dict[str, int] = {}
    for i, m in enumerate(models):
        if m.name in seen:
            raise ValueError(f"models[{i}].name: {m.name!r} duplicates models[{seen[m.name]}]; list a model's "
                             "versions as backends of one entry with weights (and `version`)")
        seen[m.name] = i
    keys_raw = raw.get("keys") or []
    if not isinstance(keys_raw, list):
        raise ValueError("keys: must be a list of {key, name, ...}")
    keys = tuple(_key(k, f"keys[{i}]") for i, k in enumerate(keys_raw))
    for field_name in ("key", "name"):
        values = [getattr(k, field_name) for k in keys]
        for i, v in enumerate(values):
            if v in values[:i]:
                raise ValueError(f"keys[{i}].{field_name}: {v!r} is listed twice")
    return RouterConfig(
        models=models, keys=keys, cache=_cache(raw.get("cache") or {}),
        admin_key=_opt_str(raw, "admin_key", ""), sticky_header=_opt_str(raw, "sticky_header", ""),
        health_interval_s=_positive(raw, "health_interval_s", "", 5.0, float),
        eject_after_failures=_positive(raw, "eject_after_failures", "", 3, int),
        request_timeout_s=_positive(raw, "request_timeout_s", "", 600.0, float),
        max_imbalance=_positive(raw, "max_imbalance", "", 8, int), prefill=prefill, decode=decode,
    )


def _pools(raw: dict[str, Any]) -> tuple[tuple[BackendConfig, ...], tuple[BackendConfig, ...]]:
    """The P/D pools (both empty without P/D): lists of URLs or {url, api_key}, disjoint."""
    present = {name: raw.get(name) not in (None, []) for name in ("prefill", "decode")}
    if not any(present.values()):
        return (), ()
    for name, other in (("prefill", "decode"), ("decode", "prefill")):
        if not present[name]:
            raise ValueError(f"{name}: required with {other} (--{name} URL... with --{other} URL...): P/D mode "
                             "needs both pools")
    pools = []
    for name in ("prefill", "decode"):
        entries = raw[name]
        if not isinstance(entries, list):
            raise ValueError(f"{name}: must be a list of URLs or {{url, api_key}} (--{name} URL...)")
        pool = []
        for j, entry in enumerate(entries):
            where = f"{name}[{j}]"
            if isinstance(entry, dict):
                # One balanced pool: weights and versions would split P from D by model version.
                _check_keys(entry, where, ("url", "api_key"))
            pool.append(_backend(entry, where))
        pools.append(tuple(pool))
    seen: dict[str, str] = {}
    for name, pool in zip(("prefill", "decode"), pools):
        for j, b in enumerate(pool):
            if b.url in seen:
                raise ValueError(f"{name}[{j}].url: {b.url!r} is also {seen[b.url]} (--prefill and --decode take "
                                 "distinct engines: one is a kv_producer, the other a kv_consumer)")
            seen[b.url] = f"{name}[{j}]"
    return pools[0], pools[1]


def _model(raw: Any, where: str) -> ModelConfig:
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: must be a mapping with name and backends")
    _check_keys(raw, where, ("name", "backends", "max_input_tokens", "max_output_tokens", "length_policy",
                             "tokenizer"))
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}.name: must be a non-empty string")
    backends_raw = raw.get("backends")
    if not isinstance(backends_raw, list) or not backends_raw:
        raise ValueError(f"{where}.backends: at least one {{url, weight}} is required")
    backends = tuple(_backend(b, f"{where}.backends[{j}]") for j, b in enumerate(backends_raw))
    policy = raw.get("length_policy", "reject")
    if policy not in LENGTH_POLICIES:
        raise ValueError(f"{where}.length_policy: must be one of {', '.join(LENGTH_POLICIES)}, got {policy!r}")
    max_in = _positive(raw, "max_input_tokens", where, None, int)
    max_out = _positive(raw, "max_output_tokens", where, None, int)
    tokenizer = _opt_str(raw, "tokenizer", where)
    if max_in is not None and tokenizer is None:
        raise ValueError(f"{where}.tokenizer: max_input_tokens counts tokens with the model's tokenizer; "
                         "give its .gguf file or tokenizer.json directory")
    return ModelConfig(name, backends, max_in, max_out, policy, tokenizer)


def _backend(raw: Any, where: str) -> BackendConfig:
    if isinstance(raw, str):
        raw = {"url": raw}
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: must be a URL or a mapping with url and weight")
    _check_keys(raw, where, ("url", "weight", "version", "api_key"))
    url = raw.get("url")
    if not isinstance(url, str):
        raise ValueError(f"{where}.url: required, e.g. http://10.0.0.5:8000")
    parsed = urlparse(url)
    if parsed.scheme not in BACKEND_SCHEMES or not parsed.netloc:
        raise ValueError(f"{where}.url: {url!r} must be http:// or https:// with a host")
    weight = raw.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight <= 0:
        raise ValueError(f"{where}.weight: must be a number > 0, got {weight!r}")
    return BackendConfig(url.rstrip("/"), float(weight), _opt_str(raw, "version", where),
                         _opt_str(raw, "api_key", where))


def _key(raw: Any, where: str) -> KeyConfig:
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: must be a mapping with key and name")
    limits = ("requests_per_minute", "input_tokens_per_minute", "output_tokens_per_minute", "max_concurrent",
              "max_input_tokens", "max_output_tokens")
    _check_keys(raw, where, ("key", "name", *limits))
    key, name = raw.get("key"), raw.get("name")
    if not isinstance(key, str) or not key:
        raise ValueError(f"{where}.key: must be a non-empty string")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}.name: must be a non-empty string")
    return KeyConfig(key, name, *(_positive(raw, n, where, None, int) for n in limits))


def _cache(raw: Any) -> CacheConfig:
    if not isinstance(raw, dict):
        raise ValueError("cache: must be a mapping with url and ttl_s")
    _check_keys(raw, "cache", ("url", "ttl_s", "max_entries", "max_entry_bytes", "enabled", "deterministic_only",
                               "shared_across_keys"))
    url = raw.get("url", "memory://")
    if not isinstance(url, str) or urlparse(url).scheme not in CACHE_SCHEMES:
        raise ValueError(f"cache.url: must be memory:// or redis://host:port/db, got {url!r}")
    flags = {}
    for name in ("enabled", "deterministic_only", "shared_across_keys"):
        if name in raw:
            if not isinstance(raw[name], bool):
                raise ValueError(f"cache.{name}: must be true or false, got {raw[name]!r}")
            flags[name] = raw[name]
    return CacheConfig(url=url, ttl_s=_positive(raw, "ttl_s", "cache", 600.0, float),
                       max_entries=_positive(raw, "max_entries", "cache", 10_000, int),
                       max_entry_bytes=_positive(raw, "max_entry_bytes", "cache", 1 << 20, int), **flags)


def _check_keys(raw: dict[str, Any], where: str, known: tuple[str, ...]) -> None:
    for k in raw:
        if k not in known:
            raise ValueError(f"{where + '.' if where else ''}{k}: unknown key; known: {', '.join(known)}")


def _positive(raw: dict[str, Any], name: str, where: str, default: Any, kind: type) -> Any:
    value = raw.get(name)
    if value is None:
        return default
    ok = (not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value > 0
          and (kind is float or float(value).is_integer()))
    if not ok:
        what = "an integer >= 1" if kind is int else "a number > 0"
        raise ValueError(f"{where + '.' if where else ''}{name}: must be {what}, got {value!r}")
    return kind(value)


def _opt_str(raw: dict[str, Any], name: str, where: str) -> str | None:
    value = raw.get(name)
    if value is not None and (not isinstance(value, str) or not value):
        raise ValueError(f"{where + '.' if where else ''}{name}: must be a non-empty string, got {value!r}")
    return value
