"""The cost of structured output: JSON-schema requests against the same requests unconstrained.

64 concurrent requests (the 32 schemas of benchmarks/data/json_schemas.json, each asked twice in
different words), greedy, in one `LLM.generate` call. The unconstrained run gets, per request, the
same number of output tokens as its constrained run produced (EOS ignored), so both runs do the
same model work and the ratio of output tokens/s is the cost of grammars: compile wait, bitmask
filling on the host, masking on the device, steps without overlap. Runs alternate (constrained,
unconstrained, twice) with prefix caching off. Also reported: every constrained output validates
against its schema (jsonschema), and the compile time of each schema (p50, p99, max) with a
fresh, cache-less xgrammar compiler over the model's vocabulary.

The engine runs on the default device (CUDA when present, else the CPU), with its default settings.

    .venv/bin/python -m benchmarks.structured_output
    .venv/bin/python -m benchmarks.structured_output --repeats 1 --no-save
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jsonschema

from pagellm import LLM, SamplingParams, StructuredOutputsParams
from pagellm.benchmarks.results import default_result_path, format_table, run_metadata, summarize, write_json
from pagellm.structured_output.manager import build_tokenizer_info
from pagellm.structured_output.source import GrammarSource

SUITE_PATH = Path(__file__).resolve().parent / "data" / "json_schemas.json"
PHRASINGS = ("{prompt} Answer in JSON.", "Reply with JSON only. {prompt}")
GOAL = 0.9


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--repeats", type=int, default=2, help="alternating constrained/unconstrained pairs")
    parser.add_argument("--num-prompts-factor", type=int, default=1,
                        help="ask each schema 2 x this many times (64 requests x this factor)")
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args(argv)

    suite = json.loads(SUITE_PATH.read_text())
    llm = LLM(args.model, enable_prefix_caching=False, max_model_len=1024)
    tokenizer = llm.get_tokenizer()
    cases = [(case, tokenizer.apply_chat_template([{"role": "user", "content": p.format(prompt=case["prompt"])}]))
             for _ in range(args.num_prompts_factor) for p in PHRASINGS for case in suite]
    prompts = [prompt for _, prompt in cases]
    constrained = [SamplingParams(temperature=0, max_tokens=args.max_tokens,
                                  structured_outputs=StructuredOutputsParams(json=case["schema"])) for case, _ in cases]
    llm.generate(prompts[:2], constrained[:2], use_tqdm=False)  # warm-up: xgrammar import, first compile

    runs: dict[str, list[float]] = {"constrained": [], "unconstrained": []}
    valid = lengths = None
    for _ in range(args.repeats):
        start = time.perf_counter()
        outputs = llm.generate(prompts, constrained, use_tqdm=False)
        elapsed = time.perf_counter() - start
        lengths = [len(o.outputs[0].token_ids) for o in outputs]
        runs["constrained"].append(sum(lengths) / elapsed)
        valid = sum(_validates(o.outputs[0].text, case["schema"]) for o, (case, _) in zip(outputs, cases))
        free = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
        start = time.perf_counter()
        free_outputs = llm.generate(prompts, free, use_tqdm=False)
        elapsed = time.perf_counter() - start
        runs["unconstrained"].append(sum(len(o.outputs[0].token_ids) for o in free_outputs) / elapsed)

    compile_s = _compile_times(llm, suite)
    constrained_tps = sum(runs["constrained"]) / len(runs["constrained"])
    free_tps = sum(runs["unconstrained"]) / len(runs["unconstrained"])
    payload = {
        "benchmark": "structured_output", "device": str(llm.llm_engine.config.device), **run_metadata(),
        "parameters": {"num_requests": len(cases), "num_schemas": len(suite), "max_tokens": args.max_tokens,
                       "repeats": args.repeats, "prefix_caching": False},
        "output_tokens_per_s": runs,
        "total_output_tokens": sum(lengths),
        "ratio_constrained_over_unconstrained": constrained_tps / free_tps,
        "goal": GOAL,
        "valid_outputs": valid,
        "compile_s": {**summarize(compile_s), "max": max(compile_s)},
    }
    print(format_table(["run", "output tok/s (mean)", "ratio"],
                       [["unconstrained", free_tps, 1.0], ["json schema", constrained_tps, constrained_tps / free_tps]]))
    stats = payload["compile_s"]
    print(f"valid JSON: {valid}/{len(cases)}; compile per schema: p50 {stats['p50'] * 1e3:.1f} ms, "
          f"p99 {stats['p99'] * 1e3:.1f} ms, max {stats['max'] * 1e3:.1f} ms")
    if not args.no_save:
        print("wrote", write_json(payload, default_result_path(f"structured_output_{llm.llm_engine.config.device.type}")))
    return payload


def _validates(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def _compile_times(llm: LLM, suite: list[dict]) -> list[float]:
    """Seconds to compile each schema against the vocabulary, with no cache."""
    import xgrammar as xgr

    engine = llm.llm_engine
    info = build_tokenizer_info(engine.tokenizer, engine.config.model.source.arch.vocab_size,
                                sorted(engine.processor.eos_token_ids))
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    times = []
    for case in suite:
        grammar = GrammarSource.of(StructuredOutputsParams(json=case["schema"])).parse()
        start = time.perf_counter()
        compiler.compile_grammar(grammar)
        times.append(time.perf_counter() - start)
    return times


if __name__ == "__main__":
    main()
