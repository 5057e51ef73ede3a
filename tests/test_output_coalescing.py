"""Outputs merged for a reader that fell behind: several engine steps read at once by the API
process, DELTA chunks a stream has not taken yet, and the chunks of a model without a tokenizer."""
from __future__ import annotations

import asyncio

from pagellm.core.outputs import EngineCoreOutput, TokenLogprobs, merge_step_outputs
from pagellm.engine.mailbox import OutputMailbox, merge_deltas
from pagellm.entrypoints.openai.serving_base import OpenAIServing
from pagellm.outputs import CompletionOutput, Logprob, RequestOutput


def test_steps_merge_per_request_in_order_with_logprobs_and_the_last_finish():
    lp = lambda t: TokenLogprobs([[t]], [[-0.5]], [1])  # noqa: E731
    steps = [
        [EngineCoreOutput("a", [1], new_logprobs=lp(1)), EngineCoreOutput("b", [7], first_scheduled_time=3.0)],
        [EngineCoreOutput("b", [8], first_scheduled_time=4.0), EngineCoreOutput("c", [9])],
        [EngineCoreOutput("a", [2, 3], "stop", 2, new_logprobs=lp(2))],
    ]
    merged = {o.req_id: o for o in merge_step_outputs(steps)}
    assert list(merged) == ["a", "b", "c"]
    assert merged["a"].new_token_ids == [1, 2, 3] and merged["a"].finish_reason == "stop"
    assert merged["a"].stop_reason == 2 and merged["a"].new_logprobs.token_ids == [[1], [2]]
    assert merged["b"].new_token_ids == [7, 8] and merged["b"].first_scheduled_time == 3.0
    assert merged["b"].finish_reason is None and merged["c"].new_token_ids == [9]
    assert merge_step_outputs(steps[:1]) is steps[0]


def delta(text: str, ids: list[int], finish: str | None = None, index: int = 0,
          logprobs: bool = False) -> RequestOutput:
    entries = [{i: Logprob(-1.0)} for i in ids] if logprobs else None
    return RequestOutput("r", None, [5], [CompletionOutput(index, text, ids, -1.0 * len(ids), entries, finish)],
                         finish is not None)


def test_mailbox_merges_what_the_reader_has_not_taken():
    async def run():
        box = OutputMailbox(coalesce=True)
        box.put(delta("He", [1], logprobs=True))
        box.put(delta("llo", [2], logprobs=True))
        first = await box.get()  # both, as one chunk
        box.put(delta(" wor", [3]))
        box.put(delta("ld", [4], finish="length"))
        box.put(ValueError("after the end"))  # never merged into an output
        return first, await box.get(), await box.get()

    first, second, error = asyncio.run(run())
    o = first.outputs[0]
    assert (o.text, o.token_ids, len(o.logprobs), first.finished) == ("Hello", [1, 2], 2, False)
    o = second.outputs[0]
    assert (o.text, o.token_ids, o.finish_reason, second.finished) == (" world", [3, 4], "length", True)
    assert isinstance(error, ValueError)


def test_deltas_of_different_sequences_or_after_the_end_stay_apart():
    assert merge_deltas(delta("a", [1], index=0), delta("b", [2], index=1)) is None
    assert merge_deltas(delta("a", [1], finish="stop"), delta("b", [2])) is None

    async def run():
        box = OutputMailbox(coalesce=False)  # FINAL_ONLY or CUMULATIVE outputs: every one as it came
        box.put(delta("a", [1]))
        box.put(delta("b", [2]))
        return [await box.get(), await box.get()]

    assert [o.outputs[0].text for o in asyncio.run(run())] == ["a", "b"]


class _Textless:
    tokenizer = None


def test_a_model_without_a_tokenizer_streams_every_step():
    serving = OpenAIServing.__new__(OpenAIServing)
    serving.engine = _Textless()

    async def rest():
        yield delta("", [2])
        yield delta("", [3], finish="length")

    async def run():
        num_tokens = {}
        return [(i, o.token_ids) async for i, _, o in serving.deltas([(delta("", [1]), rest())], num_tokens, 1)]

    assert asyncio.run(run()) == [(0, [1]), (0, [2]), (0, [3])]
