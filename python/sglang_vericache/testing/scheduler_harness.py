"""Drive a Scheduler in-process, without ZMQ: for tests and benchmarks that compare modes."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from sglang_vericache.managers.io_struct import AbortReq, SchedulerError, TokenizedGenerateReqInput
from sglang_vericache.managers.scheduler import Scheduler
from sglang_vericache.sampling.sampling_params import SamplingParams
from sglang_vericache.server_args import ServerArgs


@dataclass
class Result:
    output_ids: list[int] = field(default_factory=list)
    finished_reason: dict | None = None
    cached_tokens: int = 0
    meta: dict = field(default_factory=dict)
    output_token_logprobs: list = field(default_factory=list)
    input_token_logprobs: list | None = None
    first_token_s: float | None = None  # seconds from submission to the first output token


def make_request(
    rid: str, input_ids: list[int], seed: int = 0, return_logprob: bool = False, **sampling
) -> TokenizedGenerateReqInput:
    params = SamplingParams.from_dict(sampling)
    params.verify()
    return TokenizedGenerateReqInput(
        rid=rid, input_ids=list(input_ids), sampling_params=params, seed=seed, return_logprob=return_logprob
    )


def run_to_completion(
    scheduler: Scheduler, requests: list[TokenizedGenerateReqInput], max_steps: int = 100_000,
    abort_at: dict[int, list[str]] | None = None,
) -> dict[str, Result]:
    """Submits all requests at once and steps until every one has finished; abort_at: step -> rids
    aborted (as a client hanging up) before that step runs."""
    t0 = time.perf_counter()
    results = {r.rid: Result() for r in requests}
    for r in requests:
        err = scheduler.handle_message(r)
        if isinstance(err, SchedulerError):
            raise ValueError(err.message)
    pending = set(results)
    for step in range(max_steps):
        if not pending:
            return results
        for rid in (abort_at or {}).get(step, ()):
            scheduler.handle_message(AbortReq(rid=rid))
        scheduler.step()
        outputs, scheduler.outbox = scheduler.outbox, []
        for out in outputs:
            res = results[out.rid]
            if out.new_output_ids and res.first_token_s is None:
                res.first_token_s = time.perf_counter() - t0
            res.output_ids.extend(out.new_output_ids)
            res.cached_tokens = out.cached_tokens
            res.meta = out.meta
            if out.output_token_logprobs:
                res.output_token_logprobs.extend(out.output_token_logprobs)
            if out.input_token_logprobs is not None:
                res.input_token_logprobs = out.input_token_logprobs
            if out.finished_reason is not None:
                res.finished_reason = out.finished_reason
                pending.discard(out.rid)
    raise RuntimeError(f"requests did not finish in {max_steps} steps: {sorted(pending)}")


def random_prompts(lens: list[int], seed: int = 0) -> list[list[int]]:
    """Prompts of random ids in [3, 400) (below any special token of the test checkpoints)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 400, (n,), generator=g).tolist() for n in lens]


def run_batch(model_path: str, prompts: list[list[int]], max_new_tokens: int, **server) -> tuple[list, Scheduler]:
    """A deterministic scheduler over model_path (ServerArgs from **server) given every prompt at once, greedy,
    ignore_eos, with logprobs -> (each prompt's result, the scheduler)."""
    sched = Scheduler(ServerArgs(model_path=model_path, skip_tokenizer_init=True, enable_deterministic_inference=True,
                                 **server))
    reqs = [make_request(f"r{i}", ids, max_new_tokens=max_new_tokens, ignore_eos=True, temperature=0.0,
                         return_logprob=True) for i, ids in enumerate(prompts)]
    res = run_to_completion(sched, reqs)
    return [res[r.rid] for r in reqs], sched


def greedy_outputs(scheduler: Scheduler, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy, ignore_eos, all at once -> each prompt's output ids."""
    reqs = [make_request(f"r{i}", ids, max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
            for i, ids in enumerate(prompts)]
    res = run_to_completion(scheduler, reqs)
    return [res[r.rid].output_ids for r in reqs]


def outputs_alone_or_among(
    scheduler: Scheduler, targets: list[TokenizedGenerateReqInput], alone: bool = False,
    crowd: tuple[TokenizedGenerateReqInput, ...] | list[TokenizedGenerateReqInput] = (),
) -> list[tuple[list[int], list]]:
    """(output ids, output logprobs) of each target request: one at a time (alone), or all at once
    together with the crowd's requests (which are run but not returned)."""
    if alone:
        res = {}
        for r in targets:
            res.update(run_to_completion(scheduler, [r]))
    else:
        res = run_to_completion(scheduler, [*targets, *crowd])
    return [(res[r.rid].output_ids, res[r.rid].output_token_logprobs) for r in targets]


def record_forwards(runner) -> list[tuple[str, torch.Tensor]]:
    """Wraps runner.forward (a ModelRunner's): each forward appends (its mode's name, its logits)."""
    forwards, inner = [], runner.forward

    def recording_forward(fb):
        logits = inner(fb)
        forwards.append((fb.forward_mode.name, logits.clone()))
        return logits

    runner.forward = recording_forward
    return forwards
