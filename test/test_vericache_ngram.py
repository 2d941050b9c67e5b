"""--speculative-ngram: n-gram proposals from a request's own prompt and output, checked by the
compressed-KV drafter several at a time in one draft forward. The drafts are the drafter's own
token-by-token drafts (the same rounds, drafted and accepted, as plain VeriCache), so the output is
deterministic full mode's bitwise in bfloat16 (tokens and logprobs), greedy and seeded, among other
requests, on a prefix hit, under a grammar, lock-step, staggered, adaptive and with a remote
verifier; only the number of draft forwards drops.
"""

from __future__ import annotations

import socket
import threading

import pytest
import torch

from sglang_vericache.managers.scheduler import Scheduler
from sglang_vericache.server_args import ServerArgs, bundled_model_path
from sglang_vericache.speculative.ngram import NgramConfig, NgramIndex
from sglang_vericache.testing.random_checkpoints import make_random_checkpoint
from sglang_vericache.testing.scheduler_harness import make_request, run_to_completion

NEW = 24
SEEDED = {"temperature": 0.9, "top_p": 0.95, "top_k": 40}
NGRAM = {"speculative_ngram": True, "speculative_ngram_min_match_window_size": 1}


# ---------------------------------------------------------------- the index


def test_longest_window_wins_and_its_latest_occurrence():
    idx = NgramIndex(1, 3)
    idx.sync([5, 6, 7, 1, 6, 7, 2, 9, 6, 7], [])
    assert idx.propose([], 4) == [2, 9, 6, 7]  # "6 7" last seen at 4..5, followed by 2 9 6 7
    idx.sync([5, 6, 7, 1, 6, 7, 2, 9, 6, 7], [1])
    assert idx.propose([], 3) == [6, 7, 2]  # "6 7 1" (window 3) beats "7 1", "1"
    assert idx.propose([8], 3) == []  # 8 never occurred


def test_the_continuation_runs_into_the_drafts_and_windows_span_them():
    idx = NgramIndex(2, 4)
    idx.sync([1, 2, 3], [4])
    assert idx.propose([1, 2], 5) == [3, 4, 1, 2]  # "1 2" at 0..1: 3 4, then the drafts 1 2
    assert idx.propose([], 2) == []  # the newest window "3 4" has no earlier occurrence
    assert idx.propose([1, 2], 0) == []


def test_min_window_bounds_what_matches():
    idx = NgramIndex(2, 2)
    idx.sync([1, 2, 3, 2], [])
    assert idx.propose([], 3) == []  # only "3 2" is the newest 2-gram: unseen; "2" alone is too short
    idx.sync([1, 2, 3, 2], [3])
    assert idx.propose([], 3) == [2, 3]


def test_the_proposal_length_doubles_when_taken_whole_and_shrinks_past_what_was_taken():
    idx = NgramIndex(1, 4, span=8)
    idx.adapt(proposed=8, taken=3, cap=8)
    assert idx.span == 4
    idx.adapt(proposed=4, taken=0, cap=8)
    assert idx.span == 1
    idx.adapt(proposed=1, taken=1, cap=8)
    idx.adapt(proposed=2, taken=2, cap=8)
    assert idx.span == 4
    idx.adapt(proposed=3, taken=3, cap=6)  # a shorter continuation taken whole still doubles, up to the cap
    assert idx.span == 6


def test_flags_are_checked():
    with pytest.raises(ValueError, match="--speculative-ngram checks n-gram proposals"):
        ServerArgs(speculative_ngram=True)
    with pytest.raises(ValueError, match="1 <= min <= max <= 64"):
        ServerArgs(kv_compressor="int8", speculative_algorithm="VERICACHE", speculative_ngram=True,
                   speculative_ngram_min_match_window_size=5, speculative_ngram_max_match_window_size=3)
    with pytest.raises(ValueError, match="branch-length must be 1..64"):
        NgramConfig(branch_length=0)
    args = ServerArgs(kv_compressor="int8", speculative_algorithm="VERICACHE", speculative_ngram=True)
    assert args.ngram_config() == NgramConfig(1, 12, 8)
    assert ServerArgs(kv_compressor="int8", speculative_algorithm="VERICACHE").ngram_config() is None


# ---------------------------------------------------------------- exactness


VOCAB = 64  # a random model over a small vocabulary repeats itself, so its outputs hold n-grams too


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_random_checkpoint("llama", str(tmp_path_factory.mktemp("llama")), vocab_size=VOCAB)


def repetitive_prompts(seed=3):
    """Random phrases repeated: the n-gram index finds continuations from the first tokens on."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for phrase, times in ((7, 3), (12, 4), (5, 9), (30, 3)):
        p = torch.randint(3, VOCAB, (phrase,), generator=g).tolist()
        out.append((p * times)[:-2])
    return out


def scheduler(path, **server) -> Scheduler:
    server.setdefault("page_size", 8)
    return Scheduler(ServerArgs(model_path=path, dtype="bfloat16", skip_tokenizer_init=True,
                                enable_deterministic_inference=True, **server))


def requests(prompts, sampling, tag="t"):
    """The targets (one sampling mode) and a crowd: greedy and seeded, short and long outputs."""
    targets = [make_request(f"{tag}{i}", ids, seed=100 + i, return_logprob=True, max_new_tokens=NEW,
                            ignore_eos=True, **(sampling or {"temperature": 0.0}))
               for i, ids in enumerate(prompts)]
    crowd = [make_request(f"{tag}c{i}", ids[::-1], seed=i, return_logprob=True, max_new_tokens=5 + 6 * i,
                          ignore_eos=True, **(SEEDED if i % 2 else {"temperature": 0.0}))
             for i, ids in enumerate(prompts[:3])]
    return targets, crowd


def outputs(sched, prompts, sampling, tag="t"):
    targets, crowd = requests(prompts, sampling, tag)
    res = run_to_completion(sched, targets + crowd)
    return [(res[r.rid].output_ids, res[r.rid].output_token_logprobs) for r in targets + crowd], res


@pytest.fixture(scope="module")
def full(llama):
    prompts = repetitive_prompts()
    return {name: outputs(scheduler(llama), prompts, sampling)[0]
            for name, sampling in (("greedy", None), ("seeded", SEEDED))}


ROUNDS_WIN = (1e-4, 1e-6, 1e-5, 1e-7, 1e-9)  # adaptive: pinned costs under which rounds beat decoding


def vericache(path, schedule, **extra):
    sched = scheduler(path, kv_compressor="int8", speculative_algorithm="VERICACHE",
                      speculative_num_draft_tokens="6", vericache_schedule=schedule, **extra)
    if schedule == "adaptive":
        sched.spec_worker.controller.cost.pin(ROUNDS_WIN)
    return sched


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
@pytest.mark.parametrize("schedule", ["lockstep", "staggered", "adaptive"])
def test_ngram_vericache_equals_deterministic_full_in_bfloat16(llama, full, schedule, sampling):
    vc = vericache(llama, schedule, **NGRAM)
    vc.metrics.round_trace = []
    got, _ = outputs(vc, repetitive_prompts(), None if sampling == "greedy" else SEEDED)
    assert got == full[sampling], f"{schedule} {sampling}"
    m = vc.metrics
    assert m.spec_rounds_total > 0
    assert m.spec_ngram_accepted_total > 0, "no proposal was taken: the test would not exercise n-gram drafting"
    if schedule == "lockstep":  # the same rounds (drafts, acceptance) as plain VeriCache, in no more draft forwards
        plain = vericache(llama, schedule)
        plain.metrics.round_trace = []
        assert outputs(plain, repetitive_prompts(), None if sampling == "greedy" else SEEDED)[0] == got
        assert m.round_trace == plain.metrics.round_trace
        assert m.spec_draft_forwards_total <= plain.metrics.spec_draft_forwards_total  # lock-step: the slowest request


def test_a_prefix_hit_drafts_with_proposals_from_the_whole_prompt(llama, full):
    vc = vericache(llama, "lockstep", **NGRAM)
    prompts = repetitive_prompts()
    first, _ = outputs(vc, prompts, None, tag="a")
    taken = vc.metrics.spec_ngram_accepted_total
    again, res = outputs(vc, prompts, None, tag="b")  # the radix tree holds every prompt now
    assert first == again == full["greedy"]
    assert res["b3"].cached_tokens > 0
    assert vc.metrics.spec_ngram_accepted_total > taken


@pytest.fixture(scope="module")
def verifier(llama):
    """A bfloat16 verifier in a thread of this process, on a loopback port."""
    from sglang_vericache.disagg.verifier import VerifierServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = VerifierServer(ServerArgs(model_path=llama, dtype="bfloat16", skip_tokenizer_init=True, page_size=8,
                                       disagg_role="verifier", disagg_port=port))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.stop()
    thread.join(10)


def test_remote_drafter_with_ngram_equals_deterministic_full(llama, full, verifier):
    d = scheduler(llama, kv_compressor="int8", speculative_algorithm="VERICACHE", speculative_num_draft_tokens="6",
                  disagg_role="drafter", verifier_addr=f"tcp://127.0.0.1:{verifier.args.disagg_port}", **NGRAM)
    assert outputs(d, repetitive_prompts(), SEEDED)[0] == full["seeded"]
    assert d.metrics.spec_ngram_accepted_total > 0


def test_a_verifier_refuses_the_flag():
    with pytest.raises(ValueError, match="a verifier never drafts"):
        ServerArgs(disagg_role="verifier", disagg_port=31999, speculative_ngram=True)


# ---------------------------------------------------------------- fewer draft forwards


def test_fewer_draft_forwards_per_token_on_a_repetitive_code_prompt():
    """The bundled code model, greedy, one request on repetitive code (it goes on repeating
    `self.tk.call(self._w, ...`): n-gram drafting runs exactly plain VeriCache's rounds, 7 for 40
    tokens, in 22 draft forwards instead of 53."""
    from transformers import AutoTokenizer

    path = bundled_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    names = ["pack", "grid", "place", "lift", "lower", "bind"]
    prompt = tok("".join(f"        self.tk.call(self._w, '{n}')\n" for n in names) + "        self.tk.call(").input_ids
    runs = {}
    for ngram in (False, True):
        s = Scheduler(ServerArgs(model_path=path, dtype="bfloat16", skip_tokenizer_init=True, page_size=16,
                                 kv_compressor="snapkv", kv_compression_ratio=4, speculative_algorithm="VERICACHE",
                                 speculative_num_draft_tokens="8", speculative_ngram=ngram,
                                 vericache_schedule="lockstep", kv_compress_scope="page"))
        s.metrics.round_trace = []
        res = run_to_completion(s, [make_request("r", prompt, max_new_tokens=40, temperature=0.0, ignore_eos=True)])
        m = s.metrics
        runs[ngram] = (res["r"].output_ids, m.round_trace, m.spec_draft_forwards_total, m.spec_ngram_accepted_total)
    (out0, trace0, fwd0, _), (out1, trace1, fwd1, taken) = runs[False], runs[True]
    assert out1 == out0 and trace1 == trace0 and len(trace0) == 7
    assert (fwd0, fwd1, taken) == (53, 22, 31)
    assert fwd0 - fwd1 == taken  # each proposal token taken is one draft step not run


# ---------------------------------------------------------------- under a grammar


GRAMMARS = {"regex": r"(ab ){2,9}(cd|ef)\.", "ebnf": 'root ::= ("x = " [0-9] "\\n"){2,6}'}
GRAMMAR_PROMPTS = ["ab ab ab ab ab ab cd. ab ab ab ab ab ef. ab ab", "x = 1\nx = 2\nx = 1\nx = 2\n"]


@pytest.fixture(scope="module")
def llama_tok(tmp_path_factory):
    return make_random_checkpoint("llama", str(tmp_path_factory.mktemp("llama_tok")))


def constrained(path, sampling, **server):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    sched = Scheduler(ServerArgs(model_path=path, dtype="bfloat16", page_size=8, enable_deterministic_inference=True,
                                 **server))
    reqs = [make_request(f"{kind}{i}", tok.encode(p), seed=11 + i, max_new_tokens=40, return_logprob=True,
                         **{kind: spec}, **sampling)
            for kind, spec in GRAMMARS.items() for i, p in enumerate(GRAMMAR_PROMPTS)]
    res = run_to_completion(sched, reqs)
    return {rid: (r.output_ids, r.output_token_logprobs, r.finished_reason) for rid, r in res.items()}, sched


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, SEEDED], ids=["greedy", "seeded"])
def test_constrained_requests_check_proposals_the_grammar_allows(llama_tok, sampling):
    full, _ = constrained(llama_tok, sampling)
    got, vc = constrained(llama_tok, sampling, kv_compressor="int8", speculative_algorithm="VERICACHE",
                          speculative_num_draft_tokens="6", vericache_schedule="lockstep", **NGRAM)
    assert got == full
    assert all(reason == {"type": "stop", "matched": 2} for _, _, reason in got.values())  # the grammar's end
    assert vc.metrics.spec_ngram_accepted_total > 0  # proposals taken under the mask
