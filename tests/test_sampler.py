"""The sampler on hand-built logits: greedy rows, filters, seeds, and the distribution it draws from."""
from __future__ import annotations

import torch

from pagellm.sample.metadata import SamplingMetadata
from pagellm.sample.sampler import apply_filters, in_float32, sample
from pagellm.sampling_params import SamplingParams

CPU = torch.device("cpu")


def metadata(params: list[SamplingParams], vocab: int, generator: torch.Generator | None = None) -> SamplingMetadata:
    resolved = [p.apply_model_defaults({}) for p in params]
    return SamplingMetadata.build(resolved, [0] * len(params), vocab, CPU, generator)


def test_greedy_rows_take_the_argmax_in_a_mixed_batch():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=1)]
    out = sample(logits, metadata(params, 50, torch.Generator().manual_seed(1)))
    argmax = logits.argmax(-1)
    assert out[0] == argmax[0] and out[2] == argmax[2]
    assert out[3] == argmax[3]  # top_k=1 is greedy


def test_greedy_batches_sample_bfloat16_logits_as_they_are_and_others_in_float32():
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    logits[1, 5] = logits[1, 9] = logits[1].max() + 1  # a tie: the first index wins in either dtype
    greedy = metadata([SamplingParams(temperature=0.0)] * 3, 64)
    assert in_float32(logits, greedy) is logits  # no float32 copy of an all-greedy batch
    assert sample(logits, greedy).tolist() == logits.float().argmax(-1).tolist()
    assert sample(logits, greedy)[1] == 5
    mixed = metadata([SamplingParams(temperature=0.0), SamplingParams(temperature=0.7)] * 2, 64)
    assert in_float32(logits, mixed).dtype == torch.float32


def test_filters_drop_the_right_tokens():
    # probabilities 0.5, 0.25, 0.125, 0.0625, 0.0625
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.125, 0.0625, 0.0625]] * 3))
    params = [SamplingParams(temperature=1.0, top_k=2), SamplingParams(temperature=1.0, top_p=0.7),
              SamplingParams(temperature=1.0, min_p=0.3)]
    kept = torch.isfinite(apply_filters(logits, metadata(params, 5)))
    assert kept[0].tolist() == [True, True, False, False, False]
    # top_p 0.7: 0.5 alone is below 0.7, so the 0.25 token is needed as well.
    assert kept[1].tolist() == [True, True, False, False, False]
    # min_p 0.3 of the top 0.5: tokens below 0.15 go.
    assert kept[2].tolist() == [True, True, False, False, False]


def test_top_p_keeps_the_top_token_even_when_it_exceeds_p():
    logits = torch.log(torch.tensor([[0.9, 0.05, 0.05]]))
    kept = torch.isfinite(apply_filters(logits, metadata([SamplingParams(temperature=1.0, top_p=0.1)], 3)))
    assert kept[0].tolist() == [True, False, False]


def test_draws_follow_the_filtered_tempered_distribution():
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    temperature, n = 0.5, 20000
    logits = torch.log(probs).repeat(n, 1)
    params = [SamplingParams(temperature=temperature, top_k=3)] * n
    out = sample(logits, metadata(params, 4, torch.Generator().manual_seed(3)))
    counts = torch.bincount(out, minlength=4).double()
    assert counts[3] == 0  # filtered by top_k
    expected = probs[:3].double() ** (1 / temperature)
    expected = expected / expected.sum() * n
    chi2 = float(((counts[:3] - expected) ** 2 / expected).sum())
    assert chi2 < 13.8  # 2 degrees of freedom, p = 0.001


def test_seeded_rows_repeat_and_ignore_the_rest_of_the_batch():
    logits = torch.zeros(3, 1000)
    seeded = SamplingParams(temperature=1.0, seed=99)
    first = sample(logits, metadata([SamplingParams(temperature=1.0), seeded, SamplingParams(temperature=1.0)], 1000,
                                    torch.Generator().manual_seed(0)))
    second = sample(logits[:1], metadata([seeded], 1000, torch.Generator().manual_seed(5)))
    assert first[1] == second[0]
