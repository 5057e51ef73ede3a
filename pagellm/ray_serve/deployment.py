"""The Ray Serve deployment: one engine per replica, serving pagellm's OpenAI app (`api_server.build_app`),
with Ray Serve's autoscaling on the requests each replica holds."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI
from ray import serve
from ray.serve import Application

from pagellm.engine.arg_utils import EngineArgs
from pagellm.engine.async_llm import AsyncLLM
from pagellm.entrypoints.openai import api_server, server_start
from pagellm.entrypoints.openai.served_models import ServedModels
from pagellm.entrypoints.openai.traffic import SEQS_IN_FLIGHT_PER_SEQ, TrafficLimits, TrafficState
from pagellm.metrics.log_stats import LoggingStatLogger

DEPLOYMENT_NAME = "pagellm"


@serve.ingress()
class EngineReplica:
    """One replica: an AsyncLLM built from `engine_args` (EngineArgs' fields) and the OpenAI routes of
    `pagellm serve` over it. Ray Serve restarts a replica whose engine core died (`check_health`)."""

    def __init__(self, engine_args: dict[str, Any], served_model_name: Sequence[str] | None = None,
                 api_key: str | None = None, chat_template: str | None = None, web_ui: bool = False) -> None:
        args = engine_args_from_dict(engine_args)
        config = args.create_engine_config()
        names = list(served_model_name or [api_server.default_served_name(args.model)])
        self._models = ServedModels.for_engine(names, config)
        self._traffic = TrafficState(TrafficLimits.for_engine(args.max_num_seqs * args.data_parallel_size))
        self._metrics = api_server.server_metrics(args, config, names[0], self._traffic)
        self._api_key = api_key
        self._chat_template = chat_template
        self._web_ui = web_ui
        self._engine = AsyncLLM(config, stat_loggers=[self._metrics,
                                                      LoggingStatLogger(num_engines=args.data_parallel_size)])

    def __serve_build_asgi_app__(self) -> FastAPI:
        """Ray Serve's late-bound ingress: the app needs the engine this replica has just built."""
        return api_server.build_app(self._engine, self._models, api_key=self._api_key,
                                    chat_template=self._chat_template, metrics=self._metrics,
                                    traffic=self._traffic, web_ui=self._web_ui)

    def check_health(self) -> None:
        """Ray Serve's health check: a replica whose engine core died, froze or stalled is replaced."""
        if not self._engine.is_running:
            raise RuntimeError("the engine core is not running (it died, froze or stalled)")

    def __del__(self) -> None:
        # Ray Serve calls it when it stops the replica: the engine-core process goes with it.
        engine = getattr(self, "_engine", None)
        if engine is not None:
            engine.shutdown()


def engine_args_from_dict(engine_args: dict[str, Any]) -> EngineArgs:
    """EngineArgs of a dict of its fields, checked (a ValueError names a wrong key or value)."""
    unknown = sorted(set(engine_args) - EngineArgs.field_names())
    if unknown:
        raise ValueError(f"engine_args: unknown field(s) {', '.join(unknown)} (see docs/engine-args.md)")
    args = EngineArgs(**engine_args)
    args.validate()
    return args


def autoscaling_config(max_num_seqs: int, min_replicas: int = 1, max_replicas: int = 1,
                       target_ongoing_requests: int | None = None) -> dict[str, Any]:
    """Ray Serve's autoscaling of replicas running `max_num_seqs` sequences each: it adds replicas while
    the requests per replica (running, queued in the replica and waiting at Ray Serve's router) stay above
    `target_ongoing_requests` (default `max_num_seqs`: a replica's batch is full and requests queue), and
    removes them while below, between `min_replicas` and `max_replicas`."""
    target = max_num_seqs if target_ongoing_requests is None else target_ongoing_requests
    if min_replicas < 0:
        raise ValueError(f"min_replicas must be >= 0, got {min_replicas}")
    if max_replicas < max(min_replicas, 1):
        raise ValueError(f"max_replicas must be >= min_replicas and >= 1, got {max_replicas}")
    if target <= 0:
        raise ValueError(f"target_ongoing_requests must be > 0, got {target}")
    return {"min_replicas": min_replicas, "max_replicas": max_replicas, "target_ongoing_requests": target}


def build_app(engine_args: dict[str, Any], *, served_model_name: str | Sequence[str] | None = None,
              min_replicas: int = 1, max_replicas: int = 1, target_ongoing_requests: int | None = None,
              max_ongoing_requests: int | None = None, ray_actor_options: dict[str, Any] | None = None,
              api_key: str | None = None, chat_template: str | None = None, web_ui: bool = False,
              name: str = DEPLOYMENT_NAME) -> Application:
    """The Ray Serve application of pagellm: `serve.run(build_app({"model": ...}))` serves the OpenAI routes
    on Ray Serve's HTTP port. `max_ongoing_requests` (default: the requests a replica's own admission takes
    in flight, SEQS_IN_FLIGHT_PER_SEQ x max_num_seqs) caps what Ray Serve sends one replica: more wait at
    its router, counted as queue depth by the autoscaling (`autoscaling_config`). `ray_actor_options`:
    each replica's resources, e.g. {"num_gpus": 1}. `chat_template`: a Jinja template's text or file."""
    args = engine_args_from_dict(engine_args)
    seqs = args.max_num_seqs * args.data_parallel_size
    scaling = autoscaling_config(seqs, min_replicas, max_replicas, target_ongoing_requests)
    max_ongoing = SEQS_IN_FLIGHT_PER_SEQ * seqs if max_ongoing_requests is None else max_ongoing_requests
    if max_ongoing < scaling["target_ongoing_requests"]:
        raise ValueError(f"max_ongoing_requests ({max_ongoing}) must be >= target_ongoing_requests "
                         f"({scaling['target_ongoing_requests']})")
    names = [served_model_name] if isinstance(served_model_name, str) else served_model_name
    template = server_start.load_chat_template(chat_template)  # read and checked here, not in every replica
    deployment = serve.deployment(EngineReplica, name=name, autoscaling_config=scaling,
                                  max_ongoing_requests=max_ongoing, ray_actor_options=ray_actor_options or {})
    return deployment.bind(dict(engine_args), names, api_key, template, web_ui)
