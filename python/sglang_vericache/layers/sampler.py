"""Sampler: one token per row, a deterministic function of (logits, seed, position).

For each row, after the penalties of SamplingBatchInfo (sampling/penalizers.py):
- greedy rows (temperature ~0 or top_k == 1): argmax, the lowest token id on ties;
- sampled rows: x = logits / temperature. Rank tokens by x descending, ties by lower token id.
  Keep the first top_k; of those keep the shortest prefix whose probability (softmax over the
  top-k set; the whole vocabulary when top_k is off) sums to >= top_p (the top token always
  stays); keep tokens with prob >= min_p * max prob. Choose the argmax over the kept set of
  x + gumbel(seed, position, token) (sampling/noise.py), the lowest token id on ties.
Nothing about a row's choice depends on the other rows: the noise is per (seed, position, token)
and the kept set is computed per row, over a candidate window set by the row's own top_k (so its
float32 normalizer and cumulative sums are the same whatever shares the batch). Only kept tokens
are hashed, which gives the same result as hashing the whole vocabulary.

Logprobs are log_softmax of the RAW logits (before penalties, temperature and filtering) at the
chosen token, i.e. the model's own distribution; top logprobs likewise, sorted descending, lower
token id first among equal values inside the returned k.

Row reductions: log_softmax and logsumexp are torch's (per row on a CPU). With
--enable-deterministic-inference on the triton backend on a GPU, `Sampler(batch_invariant_triton=True)`
computes them with sgl_kernel_ext's batch-invariant Triton kernels instead (torch's CUDA reductions
choose their split from the tensor's shape, so a row's bits could follow the batch size).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from sglang_vericache.sampling.noise import gumbel_keyed, gumbel_noise, row_keys
from sglang_vericache.sampling.sampling_batch_info import SamplingBatchInfo

# Candidates examined before falling back to a full sort, for rows without top_k whose top-p /
# min-p set is not decided inside this window (flat distributions).
_WINDOW = 1024
_NEG_INF = float("-inf")


@dataclass
class SampleOutput:
    next_token_ids: torch.Tensor  # int64[rows]
    logprobs: torch.Tensor | None = None  # float32[rows]
    top_logprobs: tuple[torch.Tensor, torch.Tensor] | None = None  # (float32[rows, k], int64[rows, k])


def _sample_plain(x: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Gumbel-max over the whole vocabulary (torch.argmax returns the first maximum)."""
    return gumbel_noise(seeds, positions, x.shape[-1]).add_(x).argmax(dim=-1)


def _prefix_len(
    sorted_x: torch.Tensor,
    lse: torch.Tensor,
    top_ks: torch.Tensor,
    top_ps: torch.Tensor,
    min_ps: torch.Tensor,
) -> torch.Tensor:
    """int64[rows]: how many best-ranked tokens survive top-k, top-p and min-p, given the values
    ranked descending (a window of them or all) and the log normalizer of the top-k set."""
    width = sorted_x.shape[-1]
    rank = torch.arange(width, device=sorted_x.device).unsqueeze(0)
    in_top_k = rank < top_ks.unsqueeze(1)
    probs = torch.exp(sorted_x - lse.unsqueeze(1)).masked_fill_(~in_top_k, 0.0)
    cum = torch.cumsum(probs, dim=-1)
    mass_before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=-1)
    # Keep while the better tokens' mass is short of top_p; top_p == 1 keeps everything.
    in_top_p = (mass_before < top_ps.unsqueeze(1)) | (top_ps.unsqueeze(1) >= 1.0)
    # p_i >= min_p * p_max  <=>  x_i - x_max >= log(min_p)   (min_p == 0: log = -inf keeps all)
    in_min_p = sorted_x - sorted_x[:, :1] >= torch.log(min_ps).unsqueeze(1)
    keep = in_top_k & in_top_p & in_min_p & (sorted_x > _NEG_INF)
    keep[:, 0] = True
    # Every filter keeps a prefix of the ranking: the first rejected rank is the kept length.
    return torch.where(keep, width, rank).min(dim=-1).values


def _torch_logsumexp(x: torch.Tensor) -> torch.Tensor:
    return torch.logsumexp(x, dim=-1)


def _torch_log_softmax(x: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(x, dim=-1)


def kept_mask(
    x: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor, min_ps: torch.Tensor,
    logsumexp=_torch_logsumexp,
) -> torch.Tensor:
    """bool[rows, V]: the kept set of each row (see the module docstring)."""
    vocab = x.shape[-1]
    # Each row's window depends on its own top_k only (not on the batch's largest), so its
    # normalizer and cumulative sums are computed alike whatever shares the batch.
    widths = torch.where(top_ks < vocab, top_ks, torch.full_like(top_ks, _WINDOW)).clamp(max=vocab)
    groups = widths.unique().tolist()
    if len(groups) == 1:
        return _kept_mask_window(x, top_ks, top_ps, min_ps, groups[0], logsumexp)
    keep = torch.empty(x.shape, dtype=torch.bool, device=x.device)
    for w in groups:
        rows = (widths == w).nonzero().squeeze(1)
        keep[rows] = _kept_mask_window(x[rows], top_ks[rows], top_ps[rows], min_ps[rows], w, logsumexp)
    return keep


def _kept_mask_window(
    x: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor, min_ps: torch.Tensor, window: int,
    logsumexp=_torch_logsumexp,
) -> torch.Tensor:
    """kept_mask for rows whose candidate window is `window` tokens (top_k, or _WINDOW without one)."""
    vocab = x.shape[-1]
    has_k = top_ks < vocab
    # topk's values are well defined even where the order of equal values is not.
    vals = torch.topk(x, window, dim=-1, sorted=True).values
    in_k = torch.arange(window, device=x.device).unsqueeze(0) < top_ks.unsqueeze(1)
    lse = logsumexp(vals.masked_fill(~in_k, _NEG_INF))
    if not bool(has_k.all()):
        lse = torch.where(has_k, lse, logsumexp(x))
    n = _prefix_len(vals, lse, top_ks, top_ps, min_ps)
    boundary = vals.gather(1, (n - 1).clamp(max=window - 1).unsqueeze(1)).squeeze(1)
    undecided = (n >= window) & (window < top_ks)
    if bool(undecided.any()):
        rows = undecided.nonzero().squeeze(1)
        full = torch.sort(x[rows], dim=-1, descending=True).values
        n_full = _prefix_len(full, lse[rows], top_ks[rows], top_ps[rows], min_ps[rows])
        n[rows] = n_full
        boundary[rows] = full.gather(1, (n_full - 1).unsqueeze(1)).squeeze(1)
    # The kept set is the first n by (value desc, id asc): all above the boundary value, then the
    # lowest ids among the tokens equal to it.
    above = x > boundary.unsqueeze(1)
    tied = x == boundary.unsqueeze(1)
    room = (n - above.sum(dim=-1)).unsqueeze(1)
    if bool((tied.sum(dim=-1, keepdim=True) > room).any()):
        tied &= torch.cumsum(tied, dim=-1) <= room
    return above | tied


def _sample_masked(
    x: torch.Tensor, keep: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """Gumbel-max over the kept (row, token) pairs only, lowest token id on ties."""
    rows, tokens = keep.nonzero(as_tuple=True)
    scores = gumbel_keyed(row_keys(seeds, positions)[rows], tokens).add_(x[rows, tokens])
    n_rows = x.shape[0]
    best = torch.full((n_rows,), _NEG_INF, dtype=scores.dtype, device=x.device)
    best = best.scatter_reduce(0, rows, scores, reduce="amax")
    win = scores == best[rows]
    big = torch.full((n_rows,), x.shape[-1], dtype=torch.int64, device=x.device)
    chosen = big.scatter_reduce(0, rows[win], tokens[win], reduce="amin")
    # Only a row of NaN logits keeps nothing; give it an in-range id rather than vocab_size.
    return chosen.masked_fill_(chosen == x.shape[-1], 0)


class Sampler:
    def __init__(self, batch_invariant_triton: bool = False) -> None:
        """batch_invariant_triton: log_softmax / logsumexp through sgl_kernel_ext's Triton kernels."""
        self.log_softmax, self.logsumexp = _torch_log_softmax, _torch_logsumexp
        if batch_invariant_triton:
            from sgl_kernel_ext.batch_invariant_softmax import log_softmax, logsumexp

            self.log_softmax, self.logsumexp = log_softmax, logsumexp

    def __call__(
        self,
        logits: torch.Tensor,
        info: SamplingBatchInfo,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
    ) -> SampleOutput:
        if logits.shape[-1] != info.vocab_size:
            raise ValueError(f"logits have {logits.shape[-1]} columns, the batch info {info.vocab_size}")
        logits = logits.float()
        penalized = info.apply_penalties(logits)
        if info.is_all_greedy:
            next_ids = penalized.argmax(dim=-1)
        else:
            next_ids = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
            greedy = info.row_index("greedy")
            if greedy.numel():
                next_ids[greedy] = penalized[greedy].argmax(dim=-1)
            plain = info.row_index("plain")
            if plain.numel():
                x = penalized[plain] / info.temperatures[plain].unsqueeze(1)
                next_ids[plain] = _sample_plain(x, info.seeds[plain], info.positions[plain])
            filtered = info.row_index("filtered")
            if filtered.numel():
                x = penalized[filtered] / info.temperatures[filtered].unsqueeze(1)
                keep = kept_mask(x, info.top_ks[filtered], info.top_ps[filtered], info.min_ps[filtered],
                                 self.logsumexp)
                next_ids[filtered] = _sample_masked(x, keep, info.seeds[filtered], info.positions[filtered])

        out = SampleOutput(next_token_ids=next_ids)
        if return_logprob or top_logprobs_num > 0:
            logprobs = self.log_softmax(logits)
            if return_logprob:
                out.logprobs = logprobs.gather(1, next_ids.unsqueeze(1)).squeeze(1)
            if top_logprobs_num > 0:
                k = min(top_logprobs_num, logits.shape[-1])
                ids = torch.topk(logprobs, k, dim=-1).indices.sort(dim=-1).values
                values = logprobs.gather(1, ids)
                values, order = torch.sort(values, dim=-1, descending=True, stable=True)
                out.top_logprobs = (values, ids.gather(1, order))
        return out


class RankZeroSampler:
    """Tensor parallelism: every rank samples (the logits are the same bits on every rank), then
    takes rank 0's token ids, so rank 0 decides what every rank emits and drafts from."""

    def __init__(self, inner: Sampler, tp_group) -> None:
        self.inner, self.tp = inner, tp_group

    def __call__(self, logits: torch.Tensor, info: SamplingBatchInfo, return_logprob: bool = False,
                 top_logprobs_num: int = 0) -> SampleOutput:
        out = self.inner(logits, info, return_logprob, top_logprobs_num)
        out.next_token_ids = self.tp.broadcast(out.next_token_ids.contiguous())
        return out


class WantsLogprobs(Protocol):
    """What sample_with_logprobs reads of a request (the scheduler's Req)."""

    return_logprob: bool
    top_logprobs_num: int


def sample_with_logprobs(sampler: Sampler | RankZeroSampler, logits: torch.Tensor, info: SamplingBatchInfo,
                         reqs: Sequence[WantsLogprobs]):
    """The sampler's choice per row -> (token ids, logprobs, (top values, top ids)): logprobs when a
    request of reqs wants them, top logprobs as many as the most any of them wants."""
    want_lp = any(r.return_logprob for r in reqs)
    top_n = max((r.top_logprobs_num for r in reqs if r.return_logprob), default=0)
    out = sampler(logits, info, return_logprob=want_lp, top_logprobs_num=top_n)
    tops = None
    if top_n:
        vals, idx = out.top_logprobs
        tops = (vals.tolist(), idx.tolist())
    return out.next_token_ids.tolist(), out.logprobs.tolist() if want_lp else None, tops
