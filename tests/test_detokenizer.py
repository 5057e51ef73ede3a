"""Streaming detokenization and stop strings: the detokenizer alone, then through the engine on SmolLM2."""
from __future__ import annotations

import pytest

from pagellm import LLM, EngineArgs, LLMEngine, SamplingParams
from pagellm.engine.detokenizer import IncrementalDetokenizer
from pagellm.sampling_params import RequestOutputKind
from pagellm.tokenizer import Tokenizer, load_tokenizer
from engine_utils import assert_no_leak

pytestmark = pytest.mark.slow  # the real model's tokenizer and engine

SMALL_KV = 64 << 20
DELTA = RequestOutputKind.DELTA
FINAL_ONLY = RequestOutputKind.FINAL_ONLY


@pytest.fixture(scope="module")
def tokenizer(smollm2_path) -> Tokenizer:
    return load_tokenizer(EngineArgs(smollm2_path, device="cpu").create_engine_config().model.source)


@pytest.fixture(scope="module")
def llm(smollm2_path) -> LLM:
    return LLM(smollm2_path, dtype="float32", quantization="none", device="cpu", kv_cache_memory_bytes=SMALL_KV, max_model_len=1024)


def stream(tokenizer: Tokenizer, token_ids: list[int], **params) -> tuple[list[str], IncrementalDetokenizer]:
    """Feed tokens one at a time; the text deltas reported after each (the last one as finished)."""
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(**params))
    deltas = []
    for i, token_id in enumerate(token_ids):
        taken, stop = detok.update([token_id])
        assert taken == 1
        finished = stop is not None or i == len(token_ids) - 1
        if finished and stop is None:
            detok.finish()
        deltas.append(detok.next_text(finished, delta=True))
        if stop is not None:
            break
    return deltas, detok


def run_stream(engine: LLMEngine, request_id: str, prompt, params: SamplingParams) -> list:
    engine.add_request(request_id, prompt, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(o for o in engine.step() if o.request_id == request_id)
    return outputs


# -- the detokenizer alone ---------------------------------------------------------------------------

@pytest.mark.parametrize("text", ["春天来了，花开了。你好世界", "Party time 😀🎉👍🏽 ok"])
def test_multibyte_characters_never_stream_as_replacement_chars(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.encode("utf-8")) // 4  # byte-level pieces: some characters span tokens
    deltas, detok = stream(tokenizer, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == detok.text == tokenizer.decode(ids) == text


def test_unfinished_character_at_the_end_matches_a_full_decode(tokenizer):
    ids = tokenizer.encode("ok 😀", add_special_tokens=False)[:-1]  # cut inside the emoji's bytes
    deltas, detok = stream(tokenizer, ids)
    assert "".join(deltas) == detok.text == tokenizer.decode(ids)
    assert detok.text.endswith("\ufffd")


def test_stop_string_spanning_tokens_is_cut_and_held_back(tokenizer):
    text = "The quick brown fox jumps over the lazy dog"
    ids = tokenizer.encode(text, add_special_tokens=False)
    stop = "fox jumps"  # spans the tokens ' fox' and ' jumps'
    deltas, detok = stream(tokenizer, ids, stop=[stop])
    assert "".join(deltas) == detok.text == "The quick brown "
    # ' fox' could begin the stop string, so nothing of it was ever streamed.
    assert all("fox" not in d for d in deltas)
    deltas, detok = stream(tokenizer, ids, stop=[stop], include_stop_str_in_output=True)
    assert "".join(deltas) == "The quick brown fox jumps"


def test_the_earliest_ending_stop_string_wins(tokenizer):
    ids = tokenizer.encode("one two three four", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(stop=["four", "two thr", "wo"]))
    taken, stop = detok.update(ids)  # several tokens at once: the ones after the match are dropped
    assert stop == "wo" and detok.text == "one t"
    assert taken == len(tokenizer.encode("one two", add_special_tokens=False))


def test_special_tokens_kept_with_and_without_spaces(tokenizer):
    ids = tokenizer.encode("<|im_start|>user\nHi<|im_end|>", add_special_tokens=False)
    assert "".join(stream(tokenizer, ids)[0]) == "user\nHi"
    kept = stream(tokenizer, ids, skip_special_tokens=False)[1].text
    assert kept == "<|im_start|> user\nHi <|im_end|>"  # as slow tokenizers join special tokens
    tight = stream(tokenizer, ids, skip_special_tokens=False, spaces_between_special_tokens=False)[1].text
    assert tight == tokenizer.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nHi<|im_end|>"


# -- through the engine ----------------------------------------------------------------------------

@pytest.mark.parametrize("prompt", ["请用中文写一首关于春天的诗：", "Reply only with emojis: 😀😀"])
def test_engine_deltas_of_multibyte_output(llm, prompt):
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=30, output_kind=DELTA)
    outputs = run_stream(engine, "mb", prompt, params)
    deltas = [o.outputs[0].text for o in outputs]
    token_ids = [t for o in outputs for t in o.outputs[0].token_ids]
    final = "".join(deltas)
    assert sum(ord(c) > 0x2FFF for c in final) >= 3  # the model did answer in CJK or emoji
    assert all("\ufffd" not in d for d in deltas[:-1])
    assert final == llm.get_tokenizer().decode(token_ids)
    assert outputs[-1].finished and all(not o.finished for o in outputs[:-1])


def test_engine_stop_string_stops_the_core_and_frees_blocks(llm):
    engine = llm.llm_engine
    prompt = "Count: one, two, three,"
    free = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    assert free.text.startswith(" four, five, six, seven,")
    stop = "six, sev"  # spans ' six', ',', ' seven'
    outputs = run_stream(engine, "stop", prompt, SamplingParams(
        temperature=0.0, max_tokens=20, ignore_eos=True, stop=[stop]))
    final = outputs[-1].outputs[0]
    assert final.text == " four, five, "
    assert final.finish_reason == "stop" and final.stop_reason == stop
    # Generation ended at ' seven', the token that completed the stop string.
    assert final.token_ids == free.token_ids[:7]
    assert len(outputs) == 7
    assert_no_leak(engine)
    kept = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop=[stop],
                                               include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    # Cut right after the stop string, even inside the token that completed it.
    assert kept.text == " four, five, six, sev" and kept.stop_reason == stop


def test_partial_stop_string_is_held_back_then_released(llm):
    engine = llm.llm_engine
    tokenizer = llm.get_tokenizer()
    stop = "five, six!"  # its first 9 characters appear, the whole never does
    outputs = run_stream(engine, "hold", "Count: one, two, three,", SamplingParams(
        temperature=0.0, max_tokens=12, ignore_eos=True, stop=[stop]))
    for out in outputs[:-1]:
        completion = out.outputs[0]
        # Everything but the last len(stop) - 1 characters: those could still start the stop string.
        assert completion.text == tokenizer.decode(completion.token_ids)[:-(len(stop) - 1)]
    final = outputs[-1].outputs[0]
    assert final.finish_reason == "length" and final.stop_reason is None
    assert final.text == tokenizer.decode(final.token_ids) and "five, six," in final.text
    assert_no_leak(engine)


def test_delta_and_final_only_kinds(llm):
    engine = llm.llm_engine
    prompt = "The weather today is"
    base = dict(temperature=0.0, max_tokens=10, ignore_eos=True)
    cumulative = run_stream(engine, "cum", prompt, SamplingParams(**base))
    deltas = run_stream(engine, "delta", prompt, SamplingParams(**base, output_kind=DELTA))
    final_only = run_stream(engine, "final", prompt, SamplingParams(**base, output_kind=FINAL_ONLY))
    reference = cumulative[-1].outputs[0]
    assert len(deltas) == 10 and all(len(o.outputs[0].token_ids) == 1 for o in deltas)
    assert [t for o in deltas for t in o.outputs[0].token_ids] == reference.token_ids
    assert "".join(o.outputs[0].text for o in deltas) == reference.text
    assert len(final_only) == 1 and final_only[0].finished
    assert final_only[0].outputs[0].text == reference.text
    assert final_only[0].outputs[0].token_ids == reference.token_ids
    assert_no_leak(engine)


def test_detokenize_false_and_truncated_prompt(llm):
    tokenizer = llm.get_tokenizer()
    prompt_ids = tokenizer.encode("A long preamble that will be cut. The weather today is")
    greedy = dict(temperature=0.0, max_tokens=6, ignore_eos=True)
    tail = llm.generate([prompt_ids[-5:]], SamplingParams(**greedy), use_tqdm=False)[0]
    truncated = llm.generate([prompt_ids], SamplingParams(**greedy, truncate_prompt_tokens=5), use_tqdm=False)[0]
    assert truncated.prompt_token_ids == prompt_ids[-5:]
    assert truncated.outputs[0].token_ids == tail.outputs[0].token_ids
    ids_only = llm.generate([prompt_ids], SamplingParams(**greedy, detokenize=False), use_tqdm=False)[0].outputs[0]
    assert ids_only.text == "" and len(ids_only.token_ids) == 6


def test_special_tokens_in_engine_output(llm):
    chat = [{"role": "user", "content": "Say hi."}]
    greedy = dict(temperature=0.0, max_tokens=60)
    prompt = llm.get_tokenizer().apply_chat_template(chat)
    # One batch: the three requests differ only in detokenization, so their tokens are the same.
    plain, spaced, tight = (o.outputs[0] for o in llm.generate([prompt] * 3, [
        SamplingParams(**greedy), SamplingParams(**greedy, skip_special_tokens=False),
        SamplingParams(**greedy, skip_special_tokens=False, spaces_between_special_tokens=False)], use_tqdm=False))
    assert plain.finish_reason == "stop" and plain.stop_reason is None  # ended on <|im_end|>
    assert spaced.text == plain.text + " <|im_end|>"
    assert tight.text == plain.text + "<|im_end|>"
