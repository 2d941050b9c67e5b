"""Logit penalties: built once per step as sparse (row, token) lists, applied with one gather/scatter.

Semantics, applied in this order to the raw model logits (never in place):
1. repetition_penalty (Hugging Face RepetitionPenaltyLogitsProcessor): every token occurring in
   prompt_ids + output_ids, counted once, gets logit * p if the logit is < 0, else logit / p.
   (SGLang 0.5.23 scopes it to output tokens only; we follow HF, whose generate() is the
   exactness reference.)
2. frequency_penalty / presence_penalty (OpenAI): logit -= count * frequency + (count > 0) * presence,
   count = occurrences in output_ids only.  logit_bias (OpenAI): logit += bias[token].
3. grammar vocab_mask (bool [rows, V], True = allowed): disallowed tokens -> -inf.
4. min_new_tokens: while len(output_ids) < min_new_tokens, EOS ids and stop_token_ids -> -inf
   (as SGLang: also with ignore_eos). If that leaves a row no finite logit (a grammar that only
   allows EOS), the row keeps its logits from step 3.
Work is O(rows * history) to build and one [rows, V] copy to apply: no dense count tensors.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class SparsePenalties:
    """Per-(row, token) edits, as flat indices row * vocab_size + token (each pair at most once)."""

    rep_index: torch.Tensor | None = None  # int64[n]
    rep_scale: torch.Tensor | None = None  # float32[n]: the row's repetition penalty
    add_index: torch.Tensor | None = None  # int64[m]
    add_value: torch.Tensor | None = None  # float32[m]: -(count*freq + presence) + bias
    stop_index: torch.Tensor | None = None  # int64[s]: banned until min_new_tokens


def _flat(pairs: list[tuple[int, int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    # Out-of-vocabulary ids would land in another row; callers drop them first.
    return torch.tensor([r * vocab_size + t for r, t in pairs], dtype=torch.int64, device=device)


def _in_vocab(ids: Sequence[int], vocab_size: int) -> set[int]:
    return {t for t in set(ids) if 0 <= t < vocab_size}


def build_penalties(
    vocab_size: int,
    device: torch.device,
    repetition: Sequence[tuple[float, Sequence[int]]],
    freq_presence: Sequence[tuple[float, float, Sequence[int]]],
    biases: Sequence[dict[int, float] | None],
    stop_ids: Sequence[Sequence[int]],
) -> SparsePenalties:
    """One entry per row in each list: (penalty, seen ids), (frequency, presence, output ids),
    {token: bias}, and the ids to ban now (empty once min_new_tokens is reached)."""
    out = SparsePenalties()

    pairs, scales = [], []
    for r, (penalty, seen) in enumerate(repetition):
        if penalty != 1.0:
            for t in sorted(_in_vocab(seen, vocab_size)):
                pairs.append((r, t))
                scales.append(penalty)
    if pairs:
        out.rep_index = _flat(pairs, vocab_size, device)
        out.rep_scale = torch.tensor(scales, dtype=torch.float32, device=device)

    additive: dict[tuple[int, int], float] = {}
    for r, (freq, presence, ids) in enumerate(freq_presence):
        if freq != 0.0 or presence != 0.0:
            for t, c in Counter(ids).items():
                if 0 <= t < vocab_size:
                    additive[(r, t)] = -(c * freq + presence)
    for r, bias in enumerate(biases):
        for t, v in (bias or {}).items():
            if 0 <= t < vocab_size:
                additive[(r, t)] = additive.get((r, t), 0.0) + v
    if additive:
        keys = sorted(additive)
        out.add_index = _flat(keys, vocab_size, device)
        out.add_value = torch.tensor([additive[k] for k in keys], dtype=torch.float32, device=device)

    stops = sorted({(r, t) for r, ids in enumerate(stop_ids) for t in _in_vocab(ids, vocab_size)})
    if stops:
        out.stop_index = _flat(stops, vocab_size, device)
    return out


def apply_penalties(
    logits: torch.Tensor, pen: SparsePenalties, vocab_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Penalized logits: a new tensor when anything applies; `logits` itself is never modified."""
    if pen.rep_index is None and pen.add_index is None and pen.stop_index is None and vocab_mask is None:
        return logits
    out = logits.clone()
    flat = out.view(-1)
    if pen.rep_index is not None:
        x = flat[pen.rep_index]
        flat[pen.rep_index] = torch.where(x < 0, x * pen.rep_scale, x / pen.rep_scale)
    if pen.add_index is not None:
        flat[pen.add_index] += pen.add_value
    if vocab_mask is not None:
        out.masked_fill_(~vocab_mask.to(out.device), float("-inf"))  # grammars build masks on the host
    if pen.stop_index is not None:
        before = flat[pen.stop_index]
        flat[pen.stop_index] = float("-inf")
        stuck = ~torch.isfinite(out).any(dim=-1)
        if bool(stuck.any()):
            rows = pen.stop_index // out.shape[1]
            undo = stuck[rows]
            flat[pen.stop_index[undo]] = before[undo]
    return out
