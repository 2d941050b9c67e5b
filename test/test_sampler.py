"""Specification of layers/sampler.py, sampling/sampling_batch_info.py and sampling/penalizers.py."""

from __future__ import annotations

import math

import pytest
import torch

from sglang_vericache.layers.sampler import Sampler, kept_mask
from sglang_vericache.sampling.sampling_batch_info import SamplingBatchInfo, SamplingRow
from sglang_vericache.sampling.sampling_params import SamplingParams

NEG_INF = float("-inf")


def row(seed: int = 0, position: int = 0, output_ids=(), prompt_ids=(), **params) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), seed, position, list(output_ids), list(prompt_ids))


def sample(logits, rows, eos=None, **kw):
    logits = torch.as_tensor(logits, dtype=torch.float32)
    if logits.dim() == 1:
        logits = logits.expand(len(rows), -1)
    info = SamplingBatchInfo.from_rows(rows, logits.shape[-1], "cpu", eos_token_ids=eos)
    return Sampler()(logits, info, **kw)


def tokens(logits, rows, eos=None) -> list[int]:
    return sample(logits, rows, eos).next_token_ids.tolist()


def penalized(logits, rows, eos=None) -> list[list[float]]:
    logits = torch.as_tensor(logits, dtype=torch.float32).expand(len(rows), -1)
    info = SamplingBatchInfo.from_rows(rows, logits.shape[-1], "cpu", eos_token_ids=eos)
    return info.apply_penalties(logits).tolist()


def kept(logits, **params) -> set[int]:
    """Token ids kept by top-k / top-p / min-p after temperature, for one row."""
    p = SamplingParams(**params)
    x = torch.tensor([logits], dtype=torch.float32) / p.temperature
    k = p.top_k if p.top_k > 0 else len(logits)
    mask = kept_mask(x, torch.tensor([k]), torch.tensor([p.top_p]), torch.tensor([p.min_p]))
    return set(mask[0].nonzero().flatten().tolist())


def log_probs(*probs: float) -> list[float]:
    return [math.log(p) for p in probs]


# ---------------------------------------------------------------- greedy


def test_greedy_is_argmax_and_lowest_id_on_ties():
    assert tokens([0.0, 2.0, 1.0, 2.0], [row(temperature=0.0)]) == [1]


def test_top_k_one_is_greedy_at_any_temperature():
    assert tokens([0.0, 2.0, 1.9], [row(seed=s, temperature=1.5, top_k=1) for s in range(5)]) == [1] * 5


def test_greedy_applies_frequency_penalty_before_argmax():
    # token 1: 3.0 - 2 * 0.5 = 2.0 < token 2's 2.5
    r = row(temperature=0.0, output_ids=[1, 1], frequency_penalty=0.5)
    assert tokens([1.0, 3.0, 2.5, -1.0], [r]) == [2]


def test_greedy_applies_repetition_penalty_to_prompt_tokens():
    # HF semantics: prompt tokens count; 3.0 / 2 = 1.5 < 2.5
    assert tokens([1.0, 3.0, 2.5], [row(temperature=0.0, prompt_ids=[1], repetition_penalty=2.0)]) == [2]


# ---------------------------------------------------------------- penalties, exact values


def test_frequency_and_presence_penalties_exact_values():
    r = row(output_ids=[2, 2, 3], frequency_penalty=0.5, presence_penalty=0.25)
    [got] = penalized([1.0, 1.0, 1.0, 1.0], [r])
    assert got == [1.0, 1.0, 1.0 - (2 * 0.5 + 0.25), 1.0 - (0.5 + 0.25)]


def test_frequency_and_presence_ignore_prompt_tokens():
    [got] = penalized([1.0, 1.0], [row(prompt_ids=[0, 0], frequency_penalty=1.0, presence_penalty=1.0)])
    assert got == [1.0, 1.0]


def test_negative_frequency_penalty_rewards_repeats():
    [got] = penalized([0.0, 0.0], [row(output_ids=[1, 1, 1], frequency_penalty=-0.5)])
    assert got == [0.0, 1.5]


def test_repetition_penalty_exact_values_once_per_token():
    # seen once or many times, the token is scaled once: positive / p, negative * p.
    r = row(prompt_ids=[0, 0], output_ids=[1, 1, 1], repetition_penalty=2.0)
    [got] = penalized([2.0, -2.0, 1.0, 0.5], [r])
    assert got == [1.0, -4.0, 1.0, 0.5]


def test_repetition_penalty_matches_hugging_face_processor():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    torch.manual_seed(0)
    logits = torch.randn(1, 40)
    prompt, output = [3, 5, 5, 9], [9, 11, 0]
    hf = RepetitionPenaltyLogitsProcessor(penalty=1.3)(torch.tensor([prompt + output]), logits.clone())
    [ours] = penalized(logits[0], [row(prompt_ids=prompt, output_ids=output, repetition_penalty=1.3)])
    assert ours == hf[0].tolist()


def test_logit_bias_adds_per_token():
    [got] = penalized([0.0, 0.0, 0.0], [row(logit_bias={"1": 5.0, "2": -100.0})])
    assert got == [0.0, 5.0, -100.0]


def test_penalties_are_per_row():
    rows = [row(output_ids=[0], frequency_penalty=1.0), row(output_ids=[1], presence_penalty=0.5)]
    got = penalized([1.0, 1.0], rows)
    assert got == [[0.0, 1.0], [1.0, 0.5]]


def test_penalties_leave_the_input_logits_untouched():
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    info = SamplingBatchInfo.from_rows([row(output_ids=[2], frequency_penalty=1.0)], 3, "cpu")
    info.apply_penalties(logits)
    assert logits.tolist() == [[1.0, 2.0, 3.0]]


def test_min_new_tokens_masks_eos_and_stop_ids_until_reached():
    r = dict(min_new_tokens=2, stop_token_ids=[3])
    rows = [row(output_ids=[], **r), row(output_ids=[0], **r), row(output_ids=[0, 1], **r)]
    got = penalized([1.0, 1.0, 1.0, 1.0, 1.0], rows, eos=[4, 2])
    assert got == [
        [1.0, 1.0, NEG_INF, NEG_INF, NEG_INF],
        [1.0, 1.0, NEG_INF, NEG_INF, NEG_INF],
        [1.0, 1.0, 1.0, 1.0, 1.0],
    ]


def test_min_new_tokens_zero_masks_nothing():
    assert penalized([1.0, 1.0], [row(stop_token_ids=[0])], eos=1) == [[1.0, 1.0]]


def test_greedy_never_picks_eos_before_min_new_tokens():
    assert tokens([0.0, 5.0, 1.0], [row(temperature=0.0, min_new_tokens=1)], eos=1) == [2]


def test_vocab_mask_bans_tokens_and_min_new_tokens_yields_when_only_eos_is_allowed():
    logits = torch.tensor([[3.0, 1.0, 2.0], [3.0, 1.0, 2.0]])
    rows = [row(temperature=0.0), row(temperature=0.0, min_new_tokens=3)]
    info = SamplingBatchInfo.from_rows(rows, 3, "cpu", eos_token_ids=2)
    info.vocab_mask = torch.tensor([[False, True, True], [False, False, True]])
    assert Sampler()(logits, info).next_token_ids.tolist() == [2, 2]


def test_a_row_with_every_token_banned_still_returns_a_token():
    info = SamplingBatchInfo.from_rows([row(temperature=0.0), row(temperature=1.0, top_p=0.5)], 3, "cpu")
    info.vocab_mask = torch.zeros(2, 3, dtype=torch.bool)
    assert Sampler()(torch.zeros(2, 3), info).next_token_ids.tolist() == [0, 0]


# ---------------------------------------------------------------- kept sets

# probabilities 0.5, 0.3, 0.15, 0.05 placed at scrambled token ids
PROBS = {2: 0.5, 0: 0.3, 3: 0.15, 1: 0.05}
LOGITS = [math.log(PROBS[t]) for t in range(4)]


def test_no_filter_keeps_everything():
    assert kept(LOGITS, min_p=1e-9) == {0, 1, 2, 3}


def test_top_k_keeps_the_k_best():
    assert kept(LOGITS, top_k=2) == {2, 0}
    assert kept(LOGITS, top_k=3) == {2, 0, 3}


def test_top_k_ties_keep_the_lowest_ids():
    assert kept([1.0, 2.0, 2.0, 2.0, 0.0], top_k=2) == {1, 2}


def test_top_p_keeps_the_smallest_set_reaching_top_p():
    assert kept(LOGITS, top_p=0.4) == {2}
    assert kept(LOGITS, top_p=0.75) == {2, 0}
    assert kept(LOGITS, top_p=0.81) == {2, 0, 3}
    assert kept(LOGITS, top_p=0.99) == {0, 1, 2, 3}


def test_top_p_always_keeps_the_top_token():
    assert kept(LOGITS, top_p=1e-6) == {2}


def test_top_p_renormalizes_over_the_top_k_set():
    # over {2, 0}: 0.625, 0.375; the top token alone already reaches 0.6
    assert kept(LOGITS, top_p=0.6) == {2, 0}
    assert kept(LOGITS, top_k=2, top_p=0.6) == {2}
    # over {2, 0, 3}: 0.526, 0.316, 0.158; the first two reach 0.81
    assert kept(LOGITS, top_p=0.81) == {2, 0, 3}
    assert kept(LOGITS, top_k=3, top_p=0.81) == {2, 0}


def test_temperature_applies_before_top_p():
    # T = 2: probs ~ sqrt(p) = 0.379, 0.294, 0.208, 0.120 -> 0.75 needs three tokens
    assert kept(LOGITS, temperature=2.0, top_p=0.75) == {2, 0, 3}


def test_min_p_is_relative_to_the_top_probability():
    assert kept(LOGITS, min_p=0.25) == {2, 0, 3}  # p >= 0.125
    assert kept(LOGITS, min_p=0.7) == {2}  # p >= 0.35
    assert kept(LOGITS, min_p=0.1) == {0, 1, 2, 3}  # p >= 0.05


def test_masked_tokens_are_never_kept():
    assert kept([0.0, NEG_INF, 0.0], min_p=1e-9) == {0, 2}


def test_top_p_beyond_the_candidate_window_falls_back_to_a_full_ranking():
    # 3000 equal tokens: mass before rank i is i/3000, so top_p 0.4999 keeps ranks 0..1499, which
    # among ties are the lowest ids (the candidate window is 1024)
    assert kept([0.0] * 3000, top_p=0.4999) == set(range(1500))


def test_sampled_tokens_stay_in_the_kept_set():
    rows = [row(seed=s, top_k=3, top_p=0.9) for s in range(300)]
    assert set(tokens(LOGITS, rows)) == {2, 0, 3}
    rows = [row(seed=s, min_p=0.7) for s in range(50)]
    assert set(tokens(LOGITS, rows)) == {2}
    # min_p acts on tempered probabilities: at T = 3 the ratio of token 0 is 0.6^(1/3) = 0.84
    rows = [row(seed=s, min_p=0.7, temperature=3.0) for s in range(50)]
    assert set(tokens(LOGITS, rows)) == {2, 0}


# ---------------------------------------------------------------- determinism


MIXED = [
    dict(temperature=0.0),
    dict(temperature=1.0),
    dict(temperature=0.7, top_p=0.9),
    dict(temperature=1.3, top_k=5),
    dict(temperature=1.0, min_p=0.05, frequency_penalty=0.3),
    dict(temperature=2.0, top_p=0.95, top_k=50, repetition_penalty=1.2),
]


def _mixed_batch(vocab: int):
    torch.manual_seed(1)
    logits = torch.randn(len(MIXED), vocab) * 2
    rows = [
        row(seed=100 + i, position=7 + i, output_ids=[1, 2, 2], prompt_ids=[3], **p)
        for i, p in enumerate(MIXED)
    ]
    return logits, rows


@pytest.mark.parametrize("vocab", [64, 5000])
def test_choice_is_independent_of_batch_composition_and_order(vocab):
    logits, rows = _mixed_batch(vocab)
    together = tokens(logits, rows)
    alone = [tokens(logits[i : i + 1], [rows[i]])[0] for i in range(len(rows))]
    assert together == alone
    order = [5, 2, 0, 4, 1, 3]
    assert tokens(logits[order], [rows[i] for i in order]) == [together[i] for i in order]
    # duplicated in a bigger batch with other rows
    extra = torch.randn(3, vocab)
    both = torch.cat([extra, logits])
    others = [row(seed=9, top_p=0.5), row(seed=10), row(temperature=0.0)]
    assert tokens(both, others + rows)[3:] == together


def test_same_seed_and_position_repeat_the_choice():
    rows = [row(seed=5, position=3, temperature=1.0)] * 2
    a, b = tokens([0.0] * 1000, rows)
    assert a == b


def test_different_positions_and_seeds_give_different_choices():
    flat = [0.0] * 1000
    by_position = tokens(flat, [row(seed=5, position=p) for p in range(20)])
    by_seed = tokens(flat, [row(seed=s, position=3) for s in range(20)])
    assert len(set(by_position)) > 15 and len(set(by_seed)) > 15
    assert by_position != by_seed


def test_filtered_path_equals_full_vocab_gumbel_max():
    # min_p tiny keeps every token: hashing only kept tokens must pick what the full-vocab path picks
    torch.manual_seed(2)
    logits = torch.randn(40, 300)
    full = tokens(logits, [row(seed=s, position=s % 4) for s in range(40)])
    filtered = tokens(logits, [row(seed=s, position=s % 4, min_p=1e-30) for s in range(40)])
    assert full == filtered


def test_speculative_rows_of_one_request_equal_separate_calls():
    # a verifier passes consecutive positions with different histories in one batch
    torch.manual_seed(3)
    logits = torch.randn(3, 200)
    rows = [row(seed=77, position=4 + i, output_ids=[5] * (4 + i), temperature=0.9, top_k=20,
                frequency_penalty=0.4) for i in range(3)]
    assert tokens(logits, rows) == [tokens(logits[i : i + 1], [rows[i]])[0] for i in range(3)]


# ---------------------------------------------------------------- distribution


def _chi2(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs))


def _counts(logits: list[float], n: int, **params) -> list[int]:
    got = tokens(logits, [row(seed=s, position=s % 3, **params) for s in range(n)])
    return [got.count(t) for t in range(len(logits))]


LOGITS8 = [1.0, 0.2, 2.0, -0.5, 1.5, 0.0, -1.0, 0.7]


def _softmax(xs: list[float], t: float = 1.0) -> list[float]:
    e = [math.exp(x / t) for x in xs]
    return [v / sum(e) for v in e]


def test_plain_sampling_matches_softmax_over_temperature():
    counts = _counts(LOGITS8, 20000, temperature=1.5)
    assert _chi2(counts, _softmax(LOGITS8, 1.5)) < 24.3  # 7 dof, p = 0.001
    assert _chi2(counts, _softmax(LOGITS8, 1.0)) > 200  # the test sees a missing temperature


def test_top_p_sampling_matches_renormalized_softmax():
    # T = 0.7: probs by rank 0.485, 0.238, 0.116, 0.076, 0.037, ...; cumulative 0.839 before the
    # 4th token, 0.915 before the 5th -> top_p 0.85 keeps 4 tokens
    p = _softmax(LOGITS8, 0.7)
    keep = sorted(range(8), key=lambda t: -p[t])[:4]
    counts = _counts(LOGITS8, 20000, temperature=0.7, top_p=0.85)
    assert sum(counts[t] for t in keep) == 20000
    expected = [p[t] / sum(p[u] for u in keep) for t in keep]
    assert _chi2([counts[t] for t in keep], expected) < 16.3  # 3 dof, p = 0.001
    plain = _softmax(LOGITS8, 1.0)
    wrong = [plain[t] / sum(plain[u] for u in keep) for t in keep]
    assert _chi2([counts[t] for t in keep], wrong) > 100


# ---------------------------------------------------------------- logprobs


def test_logprob_is_of_the_raw_logits_not_the_penalized_or_tempered_ones():
    out = sample([0.0, math.log(3.0)], [row(temperature=0.0, output_ids=[1], frequency_penalty=2.0)],
                 return_logprob=True)
    assert out.next_token_ids.tolist() == [0]
    assert out.logprobs.tolist() == pytest.approx([math.log(0.25)], abs=1e-6)
    assert out.top_logprobs is None


def test_top_logprobs_sorted_descending_from_raw_logits():
    logits = log_probs(0.1, 0.4, 0.2, 0.3)
    out = sample(logits, [row(temperature=0.0, logit_bias={"0": 50.0})], top_logprobs_num=3)
    values, ids = out.top_logprobs
    assert ids.tolist() == [[1, 3, 2]]
    assert values[0].tolist() == pytest.approx(log_probs(0.4, 0.3, 0.2), abs=1e-6)
    assert out.logprobs is None
    assert out.next_token_ids.tolist() == [0]


def test_top_logprobs_ties_list_lower_ids_first():
    out = sample([0.0, 1.0, 1.0, 1.0], [row(temperature=0.0)], top_logprobs_num=4)
    assert out.top_logprobs[1].tolist() == [[1, 2, 3, 0]]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_picks_the_same_tokens_as_cpu():
    logits, rows = _mixed_batch(5000)
    cpu = tokens(logits, rows)
    info = SamplingBatchInfo.from_rows(rows, 5000, "cuda")
    assert Sampler()(logits.cuda(), info).next_token_ids.tolist() == cpu
