"""`serve run pagellm.ray_serve:app_builder model=PATH max-model-len=1024 max-replicas=4`: Ray Serve's
application builder, whose `key=value` arguments are `pagellm serve`'s engine flags and the deployment's."""
from __future__ import annotations

import argparse

from ray.serve import Application

from pagellm.engine.arg_utils import EngineArgs
from pagellm.ray_serve.deployment import DEPLOYMENT_NAME, build_app


def app_builder(args: dict[str, str]) -> Application:
    """The application of `serve run`'s arguments: each `key=value` is the flag `--key value` (a boolean
    flag takes true or false); a wrong one is a ValueError naming it."""
    parser = _parser()
    ns = parser.parse_args(_argv(parser, args))
    engine_args = {k: v for k, v in vars(ns).items() if k in EngineArgs.field_names()}
    resources = {k: v for k, v in (("num_cpus", ns.num_cpus), ("num_gpus", ns.num_gpus)) if v is not None}
    return build_app(engine_args, served_model_name=ns.served_model_name, min_replicas=ns.min_replicas,
                     max_replicas=ns.max_replicas, target_ongoing_requests=ns.target_ongoing_requests,
                     max_ongoing_requests=ns.max_ongoing_requests, ray_actor_options=resources,
                     api_key=ns.api_key, chat_template=ns.chat_template, web_ui=ns.web_ui, name=ns.name)


class _ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        # argparse would exit the `serve run` process; a ValueError reaches its error report.
        raise ValueError(f"pagellm.ray_serve: {message}")


def _parser() -> argparse.ArgumentParser:
    parser = _ArgumentParser(prog="pagellm.ray_serve:app_builder", add_help=False)
    parser.add_argument("--model", default=None)
    EngineArgs.add_cli_args(parser)
    group = parser.add_argument_group("deployment")
    group.add_argument("--name", default=DEPLOYMENT_NAME)
    group.add_argument("--served-model-name", nargs="+", default=None)
    group.add_argument("--min-replicas", type=int, default=1)
    group.add_argument("--max-replicas", type=int, default=1)
    group.add_argument("--target-ongoing-requests", type=int, default=None)
    group.add_argument("--max-ongoing-requests", type=int, default=None)
    group.add_argument("--num-cpus", type=float, default=None)
    group.add_argument("--num-gpus", type=float, default=None)
    group.add_argument("--api-key", default=None)
    group.add_argument("--chat-template", default=None)
    group.add_argument("--web-ui", action=argparse.BooleanOptionalAction, default=False)
    return parser


def _argv(parser: argparse.ArgumentParser, args: dict[str, str]) -> list[str]:
    """`serve run`'s key=value pairs as a command line; keys may use - or _."""
    booleans = {option for action in parser._actions if isinstance(action, argparse.BooleanOptionalAction)
                for option in action.option_strings}
    argv: list[str] = []
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if flag in booleans:
            if str(value).lower() not in ("true", "false"):
                raise ValueError(f"pagellm.ray_serve: {key} takes true or false, got {value!r}")
            argv.append(flag if str(value).lower() == "true" else "--no-" + flag[2:])
        else:
            argv += [flag, str(value)]
    return argv
