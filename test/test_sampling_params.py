"""Specification of sampling/sampling_params.py: parsing and validation at the door."""

from __future__ import annotations

import pytest

from sglang_vericache.sampling.sampling_params import InvalidRequest, SamplingParams


def parse(d: dict | None, vocab_size: int | None = 100) -> SamplingParams:
    p = SamplingParams.from_dict(d)
    p.verify(vocab_size)
    return p


def test_defaults():
    p = parse(None)
    assert (p.max_new_tokens, p.min_new_tokens, p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (
        128, 0, 1, 1.0, 1.0, -1, 0.0)
    assert p.stop == [] and p.stop_token_ids == [] and p.sampling_seed is None and not p.is_greedy


def test_accepts_a_full_valid_request():
    p = parse({
        "max_new_tokens": 0, "min_new_tokens": 0, "n": 2, "temperature": 0, "top_p": 1, "top_k": 1,
        "min_p": 0.5, "frequency_penalty": -2, "presence_penalty": 2.0, "repetition_penalty": 1.2,
        "ignore_eos": True, "stop": "###", "stop_token_ids": [0, 99], "regex": "[a-z]+",
        "sampling_seed": 2**63 - 1, "logit_bias": {"5": -100, "6": 2.5}, "no_stop_trim": True,
    })
    assert p.stop == ["###"] and p.top_k == 1 and p.max_new_tokens == 0 and p.is_greedy


def test_none_values_mean_defaults():
    p = parse({"max_new_tokens": None, "top_k": None, "stop": None, "stop_token_ids": None})
    assert (p.max_new_tokens, p.top_k, p.stop, p.stop_token_ids) == (128, -1, [], [])


def test_greedy_means_temperature_zero_or_top_k_one():
    assert parse({"temperature": 0.0}).is_greedy
    assert parse({"temperature": 0.8, "top_k": 1}).is_greedy
    assert not parse({"temperature": 0.01, "top_k": 2}).is_greedy


BAD = [
    ({"temprature": 0.5}, "temprature"),
    ({"temperature": "0.5"}, "temperature"),
    ({"max_new_tokens": True}, "max_new_tokens"),
    ({"max_new_tokens": 1.5}, "max_new_tokens"),
    ({"max_new_tokens": -1}, "max_new_tokens"),
    ({"min_new_tokens": -1}, "min_new_tokens"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"top_p": float("nan")}, "top_p"),
    ({"top_k": 0}, "top_k"),
    ({"top_k": -2}, "top_k"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_p": -0.1}, "min_p"),
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"presence_penalty": -3}, "presence_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": 2.5}, "repetition_penalty"),
    ({"n": 0}, "n must"),
    ({"min_new_tokens": 5, "max_new_tokens": 4}, "min_new_tokens"),
    ({"stop_token_ids": [100]}, "stop_token_ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": ["1"]}, "stop_token_ids"),
    ({"stop": [1]}, "stop"),
    ({"regex": "a", "json_schema": "{}"}, "regex, json_schema and ebnf"),
    ({"sampling_seed": -1}, "sampling_seed"),
    ({"sampling_seed": "7"}, "sampling_seed"),
    ({"ignore_eos": 1}, "ignore_eos"),
    ({"logit_bias": {"x": 1.0}}, "logit_bias"),
    ({"logit_bias": {"²": 1.0}}, "logit_bias"),
    ({"logit_bias": {"1": "big"}}, "logit_bias"),
    ({"logit_bias": {"100": 1.0}}, "logit_bias"),
    ({"logit_bias": {"-1": 1.0}}, "logit_bias"),
    ({"logit_bias": {"1": 101.0}}, "logit_bias"),
]


@pytest.mark.parametrize("d, field", BAD, ids=[str(d) for d, _ in BAD])
def test_rejects_bad_input_naming_the_field(d, field):
    with pytest.raises(InvalidRequest, match=field.replace("(", r"\(")):
        parse(d)


def test_rejects_a_non_object():
    with pytest.raises(InvalidRequest, match="sampling_params must be an object"):
        SamplingParams.from_dict([1, 2])


def test_out_of_range_ids_are_rejected_even_without_a_vocabulary():
    with pytest.raises(InvalidRequest, match="stop_token_ids"):
        parse({"stop_token_ids": [-3]}, vocab_size=None)
    assert parse({"stop_token_ids": [10**6]}, vocab_size=None).stop_token_ids == [10**6]


def test_invalid_request_is_a_value_error():
    assert issubclass(InvalidRequest, ValueError)
