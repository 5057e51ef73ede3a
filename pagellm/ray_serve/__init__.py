"""pagellm as a Ray Serve application: engine replicas behind Ray Serve's HTTP ingress, each serving
pagellm's OpenAI routes, their number scaled on queue depth (docs/deployment.md, "Ray Serve").

`build_app(engine_args, ...)` gives the application for `serve.run`; `app_builder` is the same for
`serve run pagellm.ray_serve:app_builder model=... max-replicas=4`. Needs `pip install "pagellm[ray-serve]"`.
"""
from pagellm.ray_serve.builder import app_builder
from pagellm.ray_serve.deployment import EngineReplica, autoscaling_config, build_app

__all__ = ["EngineReplica", "app_builder", "autoscaling_config", "build_app"]
