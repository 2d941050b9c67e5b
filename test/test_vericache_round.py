"""VeriCacheRound with fakes for its collaborators: plan, the rows of one forward, accept, commit.

The round is handed a memory (slots), an output sink, a forward function, and optionally the two
tiers and the link; these tests hand it small fakes and a forward whose logits pick known tokens,
and check exact values. The exactness against full mode is test_vericache_exactness.py's.
"""

from __future__ import annotations

import pytest
import torch

from sglang_vericache.layers.sampler import Sampler
from sglang_vericache.managers.output_sink import OutputSink, RecordingSink
from sglang_vericache.managers.request_queues import RequestQueues
from sglang_vericache.managers.schedule_batch import Req
from sglang_vericache.managers.stats import SchedulerMetrics
from sglang_vericache.model_executor.forward_batch import ForwardMode
from sglang_vericache.sampling.sampling_params import SamplingParams
from sglang_vericache.speculative.acceptance import DraftLengthPolicy
from sglang_vericache.speculative.vericache_round import Targets, Verdict, VeriCacheRound

VOCAB = 32
EOS = 2


class FakeMemory:
    """Slots numbered in allocation order; records truncations and frees."""

    def __init__(self):
        self.next_slot = 100
        self.truncated: list[tuple[str, int]] = []
        self.freed: list[str] = []

    def alloc_slots(self, req: Req, n: int) -> torch.Tensor:
        slots = torch.arange(self.next_slot, self.next_slot + n, dtype=torch.int64)
        self.next_slot += n
        req.kv_allocated_len += n
        return slots

    def truncate_slots(self, req: Req, new_len: int) -> None:
        self.truncated.append((req.rid, new_len))
        req.kv_allocated_len = new_len

    def free(self, req: Req) -> None:
        self.freed.append(req.rid)


class FakeTwoTier:
    needs_queries = False

    def __init__(self):
        self.folded: list[str] = []

    def draft_context(self, reqs, draft_pool, draft_slots):
        return ("draft_ctx", [r.rid for r in reqs], [s.tolist() for s in draft_slots])

    def fold(self, req: Req) -> bool:
        self.folded.append(req.rid)
        return True

    def keeps_queries(self, reqs) -> bool:
        return False


class FakeLink:
    def staged(self, group):
        return ("staged", [r.rid for r in group])


class FakeGrammar:
    stop_token_ids: set = set()
    terminated = False

    def __init__(self, accepts: bool):
        self.accepts = accepts
        self.rolled_back: list[int] = []
        self.accepted: list[int] = []

    def rollback(self, n: int) -> None:
        self.rolled_back.append(n)

    def accept(self, tok: int) -> bool:
        self.accepted.append(tok)
        return self.accepts

    def next_bitmask(self):
        return None


def make_req(rid: str, prompt_len: int = 10, out: list[int] | None = None, max_new: int = 20, **params) -> Req:
    req = Req(rid, list(range(3, 3 + prompt_len)), SamplingParams(max_new_tokens=max_new, temperature=0.0, **params),
              seed=0, output_ids=list(out or [7]))
    req.req_pool_idx = 0
    req.kv_committed_len = req.kv_allocated_len = req.seqlen - 1
    return req


def make_round(sink_cls=OutputSink, forward=None, max_draft=4, fixed=True, two_tier=None, link=None):
    memory, metrics, queues = FakeMemory(), SchedulerMetrics(), RequestQueues()
    running = queues.running
    sink = sink_cls(memory, queues, metrics, {EOS}, None, 10_000)
    policy = DraftLengthPolicy(max_draft if fixed else None, max_draft)
    rnd = VeriCacheRound(policy, Sampler(), VOCAB, {EOS}, memory, sink, metrics, forward, two_tier, link)
    return rnd, memory, sink, running


def picking(tokens: list[int]):
    """A forward whose logits row i peaks at tokens[i] (greedy sampling picks it); it records fb."""
    seen = []

    def forward(fb, tag):
        seen.append((fb, tag))
        logits = torch.zeros(len(tokens), VOCAB)
        logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 10.0
        return logits

    forward.seen = seen
    return forward


def test_plan_is_the_policy_length_cut_to_the_tokens_left():
    rnd, *_ = make_round(max_draft=4)
    assert rnd.plan(make_req("a", max_new=20)) == 4
    assert rnd.plan(make_req("b", out=[7, 8, 9], max_new=5)) == 1  # 2 tokens left: 1 draft + the verifier's
    assert rnd.plan(make_req("c", out=[7], max_new=1)) == 0


def test_auto_plan_starts_from_the_policy_prior_and_learns_from_the_round():
    rnd, *_ = make_round(max_draft=8, fixed=False)
    req = make_req("a")
    assert rnd.plan(req) == 8  # ema 4.0: ceil(1.5 * 4) + 2
    rnd.account(req, drafted=8, accepted=0, draft_s=0.0, verify_s=0.0)
    assert req.spec.accept_ema == 2.0 and rnd.plan(req) == 5


def test_accept_slices_each_requests_rows():
    rnd, *_ = make_round()
    a, b = make_req("a"), make_req("b", prompt_len=4)
    a.spec.drafts, b.spec.drafts = [5, 6], [1]
    tops = ([[0.0]] * 5, [[10 + i] for i in range(5)])
    targets = Targets([5, 6, 8, 3, 4], [-0.1, -0.2, -0.3, -0.4, -0.5], tops)
    va, vb = rnd.accept([a, b], targets)
    assert (va.drafted, va.accepted, va.tokens, va.logprobs, va.kv_start) == (2, 2, [5, 6, 8], [-0.1, -0.2, -0.3], 10)
    assert va.top_logprobs == ([[0.0]] * 3, [[10], [11], [12]]) and va.correction == 8
    assert (vb.drafted, vb.accepted, vb.tokens, vb.logprobs, vb.kv_start) == (1, 0, [3], [-0.4, -0.5], 4)


def test_commit_emits_to_the_first_stop_and_truncates_past_it():
    rnd, memory, sink, running = make_round()
    req = make_req("a")
    running.append(req)
    req.spec.drafts = [5, EOS, 6]
    rnd.commit([Verdict(req, 3, 3, [5, EOS, 6, 9], kv_start=10)])
    assert req.output_ids == [7, 5, EOS] and req.finished_reason == {"type": "stop", "matched": EOS}
    assert req.kv_committed_len == 12 and memory.truncated == [("a", 12)]
    assert memory.freed == ["a"] and running == []  # released through the sink
    assert [o.new_output_ids for o in sink.outbox] == [[7, 5, EOS]]
    assert (req.meta["spec_rounds"], req.meta["spec_drafted_tokens"], req.meta["spec_accepted_tokens"]) == (1, 3, 3)
    assert req.meta["spec_accept_length"] == 4.0 and rnd.metrics.spec_rounds_total == 1
    assert req.spec.drafts == [] and req.spec.draft_masks == []


def test_recording_sink_commits_every_token_of_the_round():
    rnd, memory, sink, running = make_round(sink_cls=RecordingSink)
    req = make_req("a")
    running.append(req)
    rnd.commit([Verdict(req, 3, 3, [5, EOS, 6, 9], kv_start=10)])
    assert req.output_ids == [7, 5, EOS, 6, 9] and not req.finished
    assert req.kv_committed_len == 14 and memory.truncated == [("a", 14)]
    assert sink.outbox == [] and running == [req]


def test_commit_rolls_the_grammar_back_to_the_accepted_drafts():
    rnd, *_ = make_round()
    req = make_req("a")
    req.grammar = FakeGrammar(accepts=True)
    rnd.commit([Verdict(req, 3, 1, [5, 8], kv_start=10)])
    assert req.grammar.rolled_back == [2] and req.grammar.accepted == [8]
    assert req.output_ids == [7, 5, 8] and req.kv_committed_len == 12


def test_a_correction_the_grammar_refuses_ends_the_request_without_it():
    rnd, memory, *_ = make_round()
    req = make_req("a")
    req.grammar = FakeGrammar(accepts=False)
    rnd.commit([Verdict(req, 2, 1, [5, 8], kv_start=10)])
    assert req.output_ids == [7, 5] and req.finished_reason["type"] == "abort"
    assert "dead end" in req.finished_reason["message"] and memory.freed == ["a"]


def test_commit_folds_the_unfinished_requests_pages():
    tt = FakeTwoTier()
    rnd, *_ = make_round(two_tier=tt)
    a, b = make_req("a"), make_req("b")
    rnd.commit([Verdict(a, 0, 0, [EOS], kv_start=10), Verdict(b, 0, 0, [9], kv_start=10)])
    assert a.finished and tt.folded == ["b"]


@pytest.mark.parametrize("drafting, resident, staged, mode", [
    (["d"], [], [], ForwardMode.DRAFT_DECODE),
    ([], ["r"], [], ForwardMode.TARGET_VERIFY),
    ([], [], ["s"], ForwardMode.TARGET_VERIFY),
    (["d"], [], ["s"], ForwardMode.MIXED),
    (["d"], ["r"], ["s"], ForwardMode.MIXED),
    ([], ["r"], ["s"], ForwardMode.MIXED),
])
def test_one_forward_takes_draft_then_resident_then_staged_rows(drafting, resident, staged, mode):
    rnd, memory, *_ = make_round(two_tier=FakeTwoTier(), link=FakeLink())
    reqs = {"d": make_req("d", prompt_len=5), "r": make_req("r", prompt_len=8), "s": make_req("s", prompt_len=12)}
    reqs["d"].spec.drafts = [4]
    reqs["r"].spec.drafts = [5, 6]
    reqs["s"].spec.drafts = []
    reqs["r"].req_pool_idx, reqs["s"].req_pool_idx = 1, 2
    pick = lambda names: [reqs[n] for n in names]  # noqa: E731
    batch = rnd.build(pick(drafting), pick(resident), pick(staged))
    fb = batch.fb
    assert fb.forward_mode == mode and batch.verifiers == pick(resident) + pick(staged)
    ids, pos, ext, prefix = [], [], [], []
    for n in drafting:  # one row: the last draft, at its position; its prefix is that position
        ids += [4]
        pos += [reqs[n].seqlen]
        ext += [1]
        prefix += [reqs[n].seqlen]
    for n in resident + staged:  # [t_n, drafts] at positions n-1.., over the committed KV
        r = reqs[n]
        ids += [7] + r.spec.drafts
        pos += list(range(r.seqlen - 1, r.seqlen + len(r.spec.drafts)))
        ext += [len(r.spec.drafts) + 1]
        prefix += [r.kv_committed_len]
    assert fb.input_ids.tolist() == ids and fb.positions.tolist() == pos
    assert fb.extend_seq_lens_cpu == ext and fb.extend_prefix_lens_cpu == prefix
    assert fb.draft_ctx == (("draft_ctx", ["d"], [[1, 2]]) if drafting else None)  # row 0's slots 1, 2
    assert fb.staged == (("staged", staged) if staged else None)
    assert fb.num_resident == (len(resident) if mode == ForwardMode.MIXED else 0)
    assert (fb.logits_indices is None) == (not resident and not staged)
    assert [r.kv_allocated_len - r.kv_committed_len for r in batch.verifiers] == [
        len(r.spec.drafts) + 1 for r in batch.verifiers]


def test_a_round_of_drafts_then_its_verification():
    """Drafts 7, 8 (from draft logits); the verifier picks 7 then 9: one accepted, 9 emitted."""
    rnd, memory, sink, running = make_round(two_tier=FakeTwoTier(), max_draft=2)
    req = make_req("a", out=[6])
    running.append(req)
    rnd.start(req, rnd.plan(req))
    for tok in (7, 8):
        assert rnd.is_drafting(req)
        rnd.forward = picking([tok])
        assert rnd.run(drafting=[req]) == []
    assert not rnd.is_drafting(req) and req.spec.drafts == [7, 8]
    rnd.forward = picking([7, 9, 4])
    (v,) = rnd.run(resident=[req])
    assert (v.accepted, v.tokens, v.kv_start) == (1, [7, 9], 10)
    assert rnd.forward.seen[0][1] == "verify"
    assert req.output_ids == [6, 7, 9] and req.kv_committed_len == 12 and memory.truncated == [("a", 12)]


def test_a_round_without_drafts_is_a_plain_decode_row():
    rnd, memory, *_ = make_round(forward=picking([11]))
    req = make_req("a")
    rnd.start(req, 0)
    assert not rnd.is_drafting(req)
    (v,) = rnd.run(resident=[req])
    fb, tag = rnd.forward.seen[0]
    assert (fb.forward_mode, fb.input_ids.tolist(), fb.positions.tolist(), tag) == (
        ForwardMode.TARGET_VERIFY, [7], [10], "verify")
    assert (v.drafted, v.accepted, v.tokens) == (0, 0, [11])
    assert req.output_ids == [7, 11] and req.kv_committed_len == 11


def test_drafting_stops_after_a_draft_that_would_end_the_request():
    rnd, *_ = make_round()
    req = make_req("a")
    rnd.start(req, 4)
    req.spec.drafts = [5, EOS]
    assert not rnd.is_drafting(req)
    req.sampling_params.ignore_eos = True
    assert rnd.is_drafting(req)
