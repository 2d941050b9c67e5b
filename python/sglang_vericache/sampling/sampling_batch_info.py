"""SamplingBatchInfo: the per-step tensors the Sampler needs, built once from independent rows."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from sglang_vericache.sampling import penalizers
from sglang_vericache.sampling.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    """One token choice to make. Rows are independent: a speculative verifier passes several rows
    of one request at consecutive positions, each with its own output_ids history."""

    params: SamplingParams
    # The request's noise seed (its sampling_seed, or one the TokenizerManager drew).
    seed: int
    # Index of the output token being chosen: 0 for the first generated token.
    position: int
    # Tokens this request generated before `position` (frequency/presence/repetition, min_new_tokens).
    output_ids: Sequence[int] = ()
    # The prompt (repetition penalty only, as HF).
    prompt_ids: Sequence[int] = ()


def _eos_list(eos_token_ids: int | Iterable[int] | None) -> list[int]:
    if eos_token_ids is None:
        return []
    if isinstance(eos_token_ids, int):
        return [eos_token_ids]
    return [int(t) for t in eos_token_ids if t is not None]


@dataclass
class SamplingBatchInfo:
    vocab_size: int
    device: torch.device
    # Per row. Greedy rows (temperature ~0 or top_k == 1) hold temperature 1 and are never divided.
    temperatures: torch.Tensor  # float32[rows]
    top_ps: torch.Tensor  # float32[rows]
    top_ks: torch.Tensor  # int64[rows]; vocab_size when off (-1)
    min_ps: torch.Tensor  # float32[rows]
    seeds: torch.Tensor  # int64[rows]
    positions: torch.Tensor  # int64[rows]
    is_greedy: list[bool]
    # Which rows filter (top-k / top-p / min-p) among the sampled rows.
    needs_filter: list[bool]
    is_all_greedy: bool
    need_top_k_sampling: bool
    need_top_p_sampling: bool
    need_min_p_sampling: bool
    # Penalties, logit_bias and the min_new_tokens ban (see penalizers.py for the semantics).
    penalties: penalizers.SparsePenalties = field(default_factory=penalizers.SparsePenalties)
    # Grammar constraint, set by the grammar backend after from_rows: bool[rows, V], True = allowed.
    vocab_mask: torch.Tensor | None = None
    _index_cache: dict = field(default_factory=dict, repr=False)

    def __len__(self) -> int:
        return len(self.is_greedy)

    @classmethod
    def from_rows(
        cls,
        rows: Sequence[SamplingRow],
        vocab_size: int,
        device: torch.device | str = "cpu",
        eos_token_ids: int | Iterable[int] | None = None,
    ) -> SamplingBatchInfo:
        device = torch.device(device)
        params = [r.params for r in rows]
        is_greedy = [p.is_greedy for p in params]
        top_ks = [vocab_size if p.top_k < 0 else min(p.top_k, vocab_size) for p in params]
        needs_filter = [
            not g and (k < vocab_size or p.top_p < 1.0 or p.min_p > 0.0)
            for g, k, p in zip(is_greedy, top_ks, params)
        ]
        sampled = [p for p, g in zip(params, is_greedy) if not g]

        def f32(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        def i64(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        info = cls(
            vocab_size=vocab_size,
            device=device,
            temperatures=f32([1.0 if g else float(p.temperature) for p, g in zip(params, is_greedy)]),
            top_ps=f32([float(p.top_p) for p in params]),
            top_ks=i64(top_ks),
            min_ps=f32([float(p.min_p) for p in params]),
            seeds=i64([r.seed for r in rows]),
            positions=i64([r.position for r in rows]),
            is_greedy=is_greedy,
            needs_filter=needs_filter,
            is_all_greedy=all(is_greedy),
            need_top_k_sampling=any(k < vocab_size for k, g in zip(top_ks, is_greedy) if not g),
            need_top_p_sampling=any(p.top_p < 1.0 for p in sampled),
            need_min_p_sampling=any(p.min_p > 0.0 for p in sampled),
        )

        eos = _eos_list(eos_token_ids)
        info.penalties = penalizers.build_penalties(
            vocab_size,
            device,
            repetition=[
                (float(r.params.repetition_penalty),
                 [*r.prompt_ids, *r.output_ids] if r.params.repetition_penalty != 1.0 else ())
                for r in rows
            ],
            freq_presence=[
                (float(p.frequency_penalty), float(p.presence_penalty), r.output_ids)
                for p, r in zip(params, rows)
            ],
            biases=[{int(t): float(v) for t, v in (p.logit_bias or {}).items()} for p in params],
            stop_ids=[
                [*eos, *r.params.stop_token_ids] if len(r.output_ids) < r.params.min_new_tokens else []
                for r in rows
            ],
        )
        return info

    def apply_penalties(self, logits: torch.Tensor) -> torch.Tensor:
        """Penalized logits for every row (a new tensor when anything applies; input untouched)."""
        return penalizers.apply_penalties(logits, self.penalties, self.vocab_mask)

    def row_index(self, name: str) -> torch.Tensor:
        """int64 row indices of 'greedy', 'plain' (sampled, full vocab) or 'filtered' rows."""
        if name not in self._index_cache:
            if name == "greedy":
                pick = self.is_greedy
            elif name == "plain":
                pick = [not g and not f for g, f in zip(self.is_greedy, self.needs_filter)]
            elif name == "filtered":
                pick = self.needs_filter
            else:
                raise KeyError(name)
            idx = [i for i, on in enumerate(pick) if on]
            self._index_cache[name] = torch.tensor(idx, dtype=torch.int64, device=self.device)
        return self._index_cache[name]
