"""SchedulerOutputProcessorMixin: what the scheduler does with logits once a forward is done.

Input logprobs, sampling a prefill's or decode step's next token (emitted through the OutputSink,
managers/output_sink.py, which checks the stop conditions), and sending the outbox to the
TokenizerManager.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from sglang_vericache.constrained.grammar import vocab_mask
from sglang_vericache.layers.sampler import sample_with_logprobs
from sglang_vericache.managers.io_struct import BatchTokenIDOut

if TYPE_CHECKING:
    from sglang_vericache.managers.schedule_batch import Req


class SchedulerOutputProcessorMixin:
    def collect_input_logprobs(self, req: Req, logits: torch.Tensor, rows: list[int], lp_rows: list[int]):
        ids = req.origin_input_ids
        if not req.input_token_logprobs:  # the first entry (at logprob_start_len) has no logprob
            req.input_token_logprobs.append((None, ids[req.logprob_start_len]))
            if req.top_logprobs_num:
                req.input_top_logprobs.append(None)
        sel = torch.tensor([rows.index(j) for j in lp_rows], dtype=torch.int64, device=logits.device)
        logprobs = torch.log_softmax(logits[sel].float(), dim=-1)
        target_ids = [ids[j + 1] for j in lp_rows]
        targets = torch.tensor(target_ids, dtype=torch.int64, device=logprobs.device)  # gather: same device
        chosen = logprobs.gather(1, targets[:, None])[:, 0].tolist()
        req.input_token_logprobs.extend(zip(chosen, target_ids))
        if req.top_logprobs_num:
            vals, idx = logprobs.topk(req.top_logprobs_num, dim=-1)
            for v, i in zip(vals.tolist(), idx.tolist()):
                req.input_top_logprobs.append(list(zip(v, i)))

    def sample_and_append(self, reqs: list[Req], logits: torch.Tensor) -> None:
        from sglang_vericache.sampling.sampling_batch_info import SamplingBatchInfo, SamplingRow

        rows = [
            SamplingRow(
                params=r.sampling_params,
                seed=r.seed,
                position=len(r.output_ids),
                output_ids=r.output_ids,
                prompt_ids=r.origin_input_ids,
            )
            for r in reqs
        ]
        info = SamplingBatchInfo.from_rows(rows, self.vocab_size, logits.device, self.eos_token_ids)
        info.vocab_mask = vocab_mask([r.grammar and r.grammar.next_bitmask() for r in reqs], self.vocab_size)
        next_ids, lps, tops = sample_with_logprobs(self.sampler, logits, info, reqs)
        for i, (req, tok) in enumerate(zip(reqs, next_ids)):
            if req.grammar is not None and not req.grammar.accept(tok):
                self.output.grammar_dead_end(req)
                continue
            self.output.append_tokens(req, [tok], lps[i : i + 1] if lps else None, tops, i)
            if not req.finished:
                self.queues.start_running(req)
        self.output.finish_round(reqs)

    def flush_outbox(self) -> None:
        if not self.outbox:
            return
        outputs, self.outbox = self.outbox, []
        if self.send_socket is not None:
            self.send_socket.send_pyobj(BatchTokenIDOut(outputs))
