"""SchedulerOutputProcessorMixin: what the scheduler does with logits once a forward is done.

Sampling, emitting tokens with stop checks, logprobs, and the messages to the TokenizerManager.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from sglang_vericache.constrained.grammar import vocab_mask
from sglang_vericache.managers.io_struct import BatchTokenIDOut, ReqOutput

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
        want_lp = any(r.return_logprob for r in reqs)
        top_n = max((r.top_logprobs_num for r in reqs if r.return_logprob), default=0)
        out = self.sampler(logits, info, return_logprob=want_lp, top_logprobs_num=top_n)
        next_ids = out.next_token_ids.tolist()
        lps = out.logprobs.tolist() if want_lp else None
        tops = None
        if top_n:
            vals, idx = out.top_logprobs
            tops = (vals.tolist(), idx.tolist())
        for i, (req, tok) in enumerate(zip(reqs, next_ids)):
            if req.grammar is not None and not req.grammar.accept(tok):
                self.grammar_dead_end(req)
                continue
            self.append_tokens(req, [tok], lps[i : i + 1] if lps else None, tops, i)
            if req not in self.running and not req.finished:
                self.running.append(req)
        self.finish_round(reqs)

    def grammar_dead_end(self, req: Req) -> None:
        """req's grammar refused a token sampled under its own mask: the mask left nothing to
        sample (e.g. min_new_tokens bans the EOS the grammar requires). The request ends with an
        error rather than an output that breaks the grammar."""
        req.finished_reason = {
            "type": "abort",
            "message": "constrained decoding reached a dead end: the grammar allows no token here "
            "(min_new_tokens may forbid the end of the grammar)",
        }

    def append_tokens(self, req: Req, tokens: list[int], lps: list[float] | None, tops, row: int) -> int:
        """Emits tokens in order until one finishes the request; returns how many were emitted.
        lps[k] / tops row+k are the logprobs of tokens[k]."""
        for k, tok in enumerate(tokens):
            req.output_ids.append(tok)
            self.metrics.num_generation_tokens_total += 1
            if req.return_logprob:
                req.output_token_logprobs.append((lps[k], tok))
                if req.top_logprobs_num:
                    n = req.top_logprobs_num
                    req.output_top_logprobs.append(list(zip(tops[0][row + k][:n], tops[1][row + k][:n])))
            req.check_finished(self.eos_token_ids, self.tokenizer, self.context_len)
            if req.finished:
                return k + 1
        return len(tokens)

    def finish_round(self, reqs: list[Req]) -> None:
        """Releases the finished requests of a step and streams the others."""
        for req in reqs:
            if req.finished:
                if req in self.running:
                    self.running.remove(req)
                self.release(req)
            elif req.stream:
                self.emit(req)

    def emit(self, req: Req) -> None:
        """Queues what `req` produced since its last report."""
        n = len(req.output_ids)
        new_ids = req.output_ids[req.sent_output_len : n]
        out = ReqOutput(
            rid=req.rid,
            new_output_ids=new_ids,
            finished_reason=req.finished_reason,
            prompt_tokens=len(req.origin_input_ids),
            completion_tokens=n,
            cached_tokens=req.cached_tokens,
            meta={k: v for k, v in req.meta.items() if not k.startswith("_")},
        )
        if req.return_logprob:
            if req.sent_output_len == 0:
                out.input_token_logprobs = req.input_token_logprobs
                out.input_top_logprobs = req.input_top_logprobs if req.top_logprobs_num else None
            out.output_token_logprobs = req.output_token_logprobs[req.sent_output_len : n]
            if req.top_logprobs_num:
                out.output_top_logprobs = req.output_top_logprobs[req.sent_output_len : n]
        if req.sent_output_len == 0 or new_ids or req.finished:
            self.outbox.append(out)
        req.sent_output_len = n
        if req.finished:
            self.metrics.on_finish(req)

    def flush_outbox(self) -> None:
        if not self.outbox:
            return
        outputs, self.outbox = self.outbox, []
        if self.send_socket is not None:
            self.send_socket.send_pyobj(BatchTokenIDOut(outputs))
