"""OutputSink: where a request's emitted tokens go, with their stop checks and logprobs.

Prefill, decode steps and VeriCache rounds all emit through one sink: append_tokens checks the
stop conditions token by token (so nothing is emitted past a stop), finish_round releases the
finished requests of a step and streams the others, emit queues a ReqOutput for the
TokenizerManager. RecordingSink is the verifier's (disagg/verifier.py): it records tokens and
logprobs on the request but checks no stop and streams to no client; the drafter decides where a
request ends and closes its session, so the verifier commits every token of a round.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sglang_vericache.managers.io_struct import ReqOutput

if TYPE_CHECKING:
    from sglang_vericache.managers.request_memory import RequestMemory
    from sglang_vericache.managers.request_queues import RequestQueues
    from sglang_vericache.managers.schedule_batch import Req
    from sglang_vericache.managers.stats import SchedulerMetrics


class OutputSink:
    def __init__(self, memory: RequestMemory, queues: RequestQueues, metrics: SchedulerMetrics,
                 eos_token_ids: set[int], tokenizer, context_len: int):
        self.memory = memory
        self.queues = queues
        self.metrics = metrics
        self.eos_token_ids = eos_token_ids
        self.tokenizer = tokenizer
        self.context_len = context_len
        self.outbox: list[ReqOutput] = []

    def append_tokens(self, req: Req, tokens: list[int], lps: list[float] | None, tops, row: int = 0) -> int:
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
            if self.stops(req):
                return k + 1
        return len(tokens)

    def stops(self, req: Req) -> bool:
        """Checks the stop conditions on req's last emitted token."""
        req.check_finished(self.eos_token_ids, self.tokenizer, self.context_len)
        return req.finished

    def grammar_dead_end(self, req: Req) -> None:
        """req's grammar refused a token sampled under its own mask: the mask left nothing to
        sample (e.g. min_new_tokens bans the EOS the grammar requires). The request ends with an
        error rather than an output that breaks the grammar."""
        req.finished_reason = {
            "type": "abort",
            "message": "constrained decoding reached a dead end: the grammar allows no token here "
            "(min_new_tokens may forbid the end of the grammar)",
        }

    def finish_round(self, reqs: list[Req]) -> None:
        """Releases the finished requests of a step and streams the others."""
        for req in reqs:
            if req.finished:
                self.queues.stop_running(req)
                self.release(req)
            elif req.stream:
                self.emit(req)

    def release(self, req: Req) -> None:
        """A finished request: cache its KV in the radix tree, free the rest, report it."""
        self.memory.free(req)
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
            meta=dict(req.meta),
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


class RecordingSink(OutputSink):
    """The verifier's sink: tokens and logprobs are recorded on the request; no stop is checked and
    nothing is queued for a client (the drafter streams, and ends the request)."""

    def stops(self, req: Req) -> bool:
        return False

    def emit(self, req: Req) -> None:
        req.sent_output_len = len(req.output_ids)
        if req.finished:
            self.metrics.on_finish(req)
