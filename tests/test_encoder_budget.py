"""The scheduler's encoder budget: a step starts at most max_num_encoder_input_tokens of images'
placeholders (each image counted once, however many requests share it; one larger than the budget
alone), cutting a prompt chunk before the first image that does not fit; the rest of the prompt
follows in later steps and every request completes."""
from __future__ import annotations

import msgspec
from test_scheduler import Driver, Result, limits, make_record, prompt, reference

from pagellm.core.multimodal import MultiModalItem
from pagellm.core.scheduler import Scheduler

OFFSET, LENGTH, PROMPT = 4, 16, 30


def with_image(rid: str, key: str) -> object:
    """A 30-token prompt whose positions 4-19 are an image's placeholders (content hash `key`)."""
    item = MultiModalItem(modality="image", content_hash=key, offset=OFFSET, length=LENGTH, data=b"", shape=(0,))
    return msgspec.structs.replace(make_record(rid, prompt(int(rid[1:]), PROMPT), max_tokens=2), multi_modal=(item,))


def first_step(budget: int, keys: list[str]) -> dict[str, int]:
    s = Scheduler(limits(max_num_batched_tokens=64, max_num_encoder_input_tokens=budget))
    for i, key in enumerate(keys):
        s.add_request(with_image(f"r{i}", key))
    return s.schedule().num_scheduled_tokens


def test_a_step_starts_no_more_image_tokens_than_the_encoder_budget():
    # r0's image takes 16 of 20; r1's and r2's chunks stop before theirs.
    assert first_step(20, ["a", "b", "c"]) == {"r0": PROMPT, "r1": OFFSET, "r2": OFFSET}
    # The same image in three requests is encoded once: all three whole.
    assert first_step(20, ["a", "a", "b"]) == {"r0": PROMPT, "r1": PROMPT, "r2": OFFSET}
    # Two fit; without the budget (the token budget's default) the step holds the 64 tokens it may.
    assert first_step(32, ["a", "b", "c"]) == {"r0": PROMPT, "r1": PROMPT, "r2": OFFSET}
    assert first_step(None, ["a", "b", "c"]) == {"r0": PROMPT, "r1": PROMPT, "r2": 64 - 2 * PROMPT}


def test_an_image_larger_than_the_budget_runs_alone_and_every_request_completes():
    assert first_step(8, ["a", "b"]) == {"r0": PROMPT, "r1": OFFSET}
    d = Driver(limits(max_num_batched_tokens=64, max_num_encoder_input_tokens=8))
    records = [with_image(f"r{i}", key) for i, key in enumerate("abc")]
    for record in records:
        d.s.add_request(record)
        d.results[record.request_id] = Result()
    results = d.run()
    for record in records:  # the fake model's continuation of each whole prompt
        assert results[record.request_id].tokens == reference(record.prompt_token_ids, 2)
    # Each image's placeholders computed in a step of its own (the others' chunks stop before theirs).
    assert max(sum(n > OFFSET for n in step.num_scheduled_tokens.values()) for step in d.steps) == 1
