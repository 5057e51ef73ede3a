"""`pagellm warmup`: build the engine once with the flags a server will use, run a request through
it, and exit, leaving the cache folder (`pagellm.config.cache_dirs`) filled: Triton's compiled
kernels and autotuning results, the one-row tiles timed per weight shape, the CPU kernels. A later
`pagellm serve` with the same model shapes, flags and GPU model reads them instead of compiling and
timing; copy the folder into a Docker image (PAGELLM_CACHE_ROOT) to ship them."""
from __future__ import annotations

import argparse
import dataclasses

from pagellm.config.cache_dirs import cache_root
from pagellm.engine.arg_utils import EngineArgs
from pagellm.entrypoints.arg_types import set_handler
from pagellm.entrypoints.llm import LLM
from pagellm.metrics.startup import describe
from pagellm.sampling_params import SamplingParams

WARMUP_PROMPT = [1, 2, 3, 4]
"""Token ids of the request run after start-up (dummy weights have no tokenizer): its prefill,
decode and sampling kernels compile now rather than at a server's first request."""


def register(sub: argparse._SubParsersAction) -> None:
    warmup = sub.add_parser("warmup", help="build the engine once to fill the start-up cache (compiled kernels, "
                                           "timed tiles), then exit",
                            formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    warmup.add_argument("model", nargs="?", default=None,
                        help="model path; default: the embedded SmolLM2-135M-Instruct")
    EngineArgs.add_cli_args(warmup)
    set_handler(warmup, _warmup)


def _warmup(ns: argparse.Namespace) -> int:
    args = EngineArgs.from_cli_args(ns)
    llm = LLM(**dataclasses.asdict(args))
    if llm.llm_engine.config.is_pooling:
        llm.embed([WARMUP_PROMPT], use_tqdm=False)
    else:
        for params in (SamplingParams(temperature=0.0, max_tokens=4),
                       SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=4, seed=0)):
            llm.generate([WARMUP_PROMPT], params, use_tqdm=False)
    phases = llm.llm_engine.startup_phases
    llm.llm_engine.shutdown()
    print(f"engine built in {describe(phases)}")
    print(f"start-up cache: {cache_root()}")
    return 0
