"""SamplingParams: validation with actionable errors, model defaults, greedy detection."""
from __future__ import annotations

import math

import pytest

from pagellm.sampling_params import SamplingParams


def test_defaults_are_valid_and_unset():
    sp = SamplingParams()
    assert sp.n == 1
    assert sp.temperature is None and sp.top_p is None and sp.top_k is None and sp.min_p is None
    assert sp.stop_token_ids == []
    assert sp.ignore_eos is False
    # Each instance has its own list.
    SamplingParams().stop_token_ids.append(3)
    assert SamplingParams().stop_token_ids == []


@pytest.mark.parametrize("field,value", [
    ("n", 0),
    ("n", 1.0),
    ("temperature", -0.01),
    ("temperature", -1),
    ("temperature", math.nan),
    ("top_p", 0.0),
    ("top_p", -0.5),
    ("top_p", 1.0001),
    ("top_p", math.nan),
    ("top_k", -2),
    ("top_k", 2.5),
    ("min_p", -0.1),
    ("min_p", 1.5),
    ("min_p", math.nan),
    ("max_tokens", 0),
    ("max_tokens", -3),
    ("max_tokens", 2.0),
    ("seed", 1.5),
    ("seed", "42"),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", [1, "2"]),
    ("stop_token_ids", [1.0]),
    # Wrong types must be ValueErrors naming the field too, not a TypeError from a comparison.
    ("temperature", "0.7"),
    ("top_p", "1"),
    ("min_p", "0"),
    ("stop_token_ids", 7),
])
def test_invalid_values_raise_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("kw", [
    dict(temperature=0.0),
    dict(temperature=0),
    dict(temperature=2.5),
    dict(top_p=1.0),
    dict(top_p=1e-6),
    dict(top_k=-1),
    dict(top_k=0),
    dict(top_k=50),
    dict(min_p=0.0),
    dict(min_p=1.0),
    dict(max_tokens=1),
    dict(max_tokens=None),
    dict(seed=0),
    dict(seed=-7),
    dict(stop_token_ids=[0, 5, 151643]),
    dict(ignore_eos=True, skip_special_tokens=False),
])
def test_valid_edge_values_accepted(kw):
    sp = SamplingParams(**kw)
    for k, v in kw.items():
        assert getattr(sp, k) == v


def test_apply_model_defaults_fills_only_unset_fields():
    config = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05}
    unset = SamplingParams(max_tokens=32, seed=3, stop_token_ids=[7], ignore_eos=True,
                           skip_special_tokens=False)
    filled = unset.apply_model_defaults(config)
    assert (filled.temperature, filled.top_p, filled.top_k, filled.min_p) == (0.6, 0.9, 20, 0.05)
    # Fields that are not model defaults are carried over unchanged.
    assert filled.max_tokens == 32 and filled.seed == 3 and filled.stop_token_ids == [7]
    assert filled.ignore_eos is True and filled.skip_special_tokens is False and filled.n == 1
    # It is a copy: the original is untouched and doesn't share the list.
    assert unset.temperature is None and unset.top_p is None
    filled.stop_token_ids.append(8)
    assert unset.stop_token_ids == [7]

    explicit = SamplingParams(temperature=1.3, top_p=0.5, top_k=-1, min_p=0.2)
    kept = explicit.apply_model_defaults(config)
    assert (kept.temperature, kept.top_p, kept.top_k, kept.min_p) == (1.3, 0.5, -1, 0.2)


def test_apply_model_defaults_keeps_explicit_zeros():
    # 0 is a value, not "unset": greedy stays greedy even if the model's default samples.
    sp = SamplingParams(temperature=0.0, top_k=0, min_p=0.0)
    filled = sp.apply_model_defaults({"temperature": 0.7, "top_k": 40, "min_p": 0.1})
    assert filled.temperature == 0.0 and filled.top_k == 0 and filled.min_p == 0.0
    assert filled.is_greedy


def test_apply_model_defaults_without_config_uses_neutral_values():
    filled = SamplingParams().apply_model_defaults({})
    assert filled.temperature == 1.0
    assert filled.top_p == 1.0
    assert filled.top_k in (0, -1)  # disabled
    assert filled.min_p == 0.0
    assert not filled.is_greedy


def test_apply_model_defaults_ignores_unrelated_and_null_config_keys():
    # generation_config.json files commonly carry other keys, and sometimes explicit nulls.
    config = {"temperature": None, "top_p": None, "bos_token_id": 1, "do_sample": True}
    filled = SamplingParams().apply_model_defaults(config)
    assert filled.temperature == 1.0
    assert filled.top_p == 1.0


def test_apply_model_defaults_validates_config_values():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams().apply_model_defaults({"top_p": 0.0})


def test_is_greedy():
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(temperature=0.0).is_greedy
    assert not SamplingParams(temperature=0.5).is_greedy
    assert not SamplingParams(temperature=1.0).is_greedy
    # Unset means "model default" (1.0 when the model has none): not greedy.
    assert not SamplingParams().is_greedy
