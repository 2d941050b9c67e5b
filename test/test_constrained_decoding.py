"""Constrained decoding (regex, JSON schema, EBNF on xgrammar), in-process: the grammar backend's
error messages, matcher rollback, and VeriCache's output under a grammar equal to full mode's for
the two-tier compressors, with greedy and seeded sampling, including drafts the grammar cuts short.

The grammars are bounded (enums, counted repeats, maxLength) so a random-weight model reaches
their end: every output must then be complete and match the grammar, not just agree across modes.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from transformers import AutoTokenizer

from sglang_vericache.compress.registry import COMPRESSOR_NAMES
from sglang_vericache.constrained.grammar import bitmask_to_bool, vocab_mask
from sglang_vericache.constrained.grammar_backend import GrammarBackend
from sglang_vericache.managers.scheduler import Scheduler
from sglang_vericache.sampling.sampling_params import InvalidRequest, SamplingParams
from sglang_vericache.server_args import ServerArgs
from sglang_vericache.testing.random_checkpoints import make_random_checkpoint
from sglang_vericache.testing.scheduler_harness import make_request, run_to_completion

REGEX = r"(yes|no), [0-9]{2,4} [a-z]{2,5}\."
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 30},
        "note": {"type": "string", "maxLength": 6},
    },
    "required": ["city", "days", "note"],
    "additionalProperties": False,
}
EBNF = 'root ::= "[" item ("," item){0,3} "]"\nitem ::= [a-c] [0-9]'
CONSTRAINTS = {"regex": REGEX, "json_schema": json.dumps(SCHEMA), "ebnf": EBNF}
PROMPTS = ["def parse(text):\n    return", "x = {'a': 1}\nprint(x)\n" * 3, "import os\n"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_random_checkpoint("llama", str(tmp_path_factory.mktemp("llama")))


@pytest.fixture(scope="module")
def tokenizer(llama):
    return AutoTokenizer.from_pretrained(llama)


@pytest.fixture(scope="module")
def backend(tokenizer):
    return GrammarBackend(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


# ---------------------------------------------------------------- the grammar backend


@pytest.mark.parametrize("kind,spec,message", [
    ("regex", "(ab", "invalid regex: Regex parsing error at position 4: The parenthesis is not closed."),
    ("json_schema", '{"type": "objectx"}', 'invalid JSON schema: Unsupported type "objectx"'),
    ("json_schema", "{bad", "invalid JSON schema: not valid JSON (Expecting property name enclosed in "
                            "double quotes: line 1 column 2 (char 1))"),
    ("ebnf", 'root ::= "a" |', "invalid EBNF grammar: EBNF parser error at line 1, column 15: "
                               "Expect element, but got"),
])
def test_invalid_constraints_name_the_problem(backend, kind, spec, message):
    with pytest.raises(InvalidRequest) as e:
        backend.validate(SamplingParams(**{kind: spec}))
    assert str(e.value) == message


def test_bitmask_bits_map_to_token_ids():
    words = torch.tensor([[0b101, -(2**31)]], dtype=torch.int32)  # tokens 0, 2 and 63
    assert bitmask_to_bool(words, 64)[0].nonzero().flatten().tolist() == [0, 2, 63]
    assert vocab_mask([None, None], 64) is None
    mixed = vocab_mask([None, words[0]], 40)  # an unconstrained row allows everything
    assert mixed.shape == (2, 40) and mixed[0].all() and mixed[1].nonzero().flatten().tolist() == [0, 2]


def test_rollback_returns_the_matcher_to_an_earlier_mask(backend, tokenizer):
    g = backend.new_grammar(SamplingParams(regex=REGEX))
    ids = tokenizer.encode("yes, 12 ab.", add_special_tokens=False)
    masks = []
    for tok in ids:
        masks.append(g.next_bitmask())
        assert g.accept(tok)
    assert g.next_bitmask().tolist() != masks[2].tolist()
    g.rollback(len(ids) - 2)
    assert g.num_accepted == 2 and g.next_bitmask().tolist() == masks[2].tolist()
    bad = tokenizer.encode("Z", add_special_tokens=False)[0]
    assert not g.accept(bad) and g.num_accepted == 2  # a refused token changes nothing


def test_the_model_eos_ends_a_complete_grammar(backend, tokenizer):
    g = backend.new_grammar(SamplingParams(regex="ab"))
    for tok in tokenizer.encode("ab", add_special_tokens=False):
        assert g.accept(tok)
    allowed = bitmask_to_bool(g.next_bitmask()[None], len(tokenizer))[0].nonzero().flatten().tolist()
    assert allowed == [tokenizer.eos_token_id]
    assert g.accept(tokenizer.eos_token_id) and g.terminated


# ---------------------------------------------------------------- through the scheduler


def run(path, sampling, **server):
    server.setdefault("vericache_schedule", "lockstep")  # grammars inside rounds (adaptive may decode instead)
    sched = Scheduler(ServerArgs(model_path=path, dtype="float32", page_size=8, **server))
    tok = AutoTokenizer.from_pretrained(path)
    reqs = [
        make_request(f"{kind}{i}", tok.encode(p), seed=11 + i, max_new_tokens=64, **{kind: spec}, **sampling)
        for kind, spec in CONSTRAINTS.items()
        for i, p in enumerate(PROMPTS)
    ]
    return run_to_completion(sched, reqs)


def assert_complete_and_valid(results, tokenizer):
    eos = tokenizer.eos_token_id
    for rid, res in results.items():
        assert res.finished_reason == {"type": "stop", "matched": eos}, rid
        assert res.output_ids[-1] == eos
        text = tokenizer.decode(res.output_ids[:-1])
        if rid.startswith("regex"):
            assert re.fullmatch(REGEX, text), (rid, text)
        elif rid.startswith("json_schema"):
            obj = json.loads(text)
            assert set(obj) == {"city", "days", "note"} and obj["city"] in ("Paris", "Rome", "Oslo"), text
            assert 1 <= obj["days"] <= 30 and len(obj["note"]) <= 6, text
        else:
            assert re.fullmatch(r"\[[a-c][0-9](,[a-c][0-9]){0,3}\]", text), (rid, text)


SAMPLINGS = {"greedy": {"temperature": 0.0}, "seeded": {"temperature": 0.9, "top_p": 0.95}}


@pytest.fixture(scope="module")
def full_runs(llama, tokenizer):
    out = {name: run(llama, s) for name, s in SAMPLINGS.items()}
    for res in out.values():
        assert_complete_and_valid(res, tokenizer)
    return out


def ids_of(results):
    return {rid: (r.output_ids, r.finished_reason) for rid, r in results.items()}


# kvzip_proxy, kvzap: kvzip's layout and rounds with other scorers (test_vericache_exactness runs them)
@pytest.mark.parametrize("compressor,sampling", [(c, "greedy") for c in COMPRESSOR_NAMES
                                                 if c not in ("kvzip_proxy", "kvzap")]
                         + [(c, "seeded") for c in ("snapkv", "kivi2", "int8")])
def test_vericache_constrained_output_equals_full(llama, full_runs, compressor, sampling):
    vc = run(llama, SAMPLINGS[sampling], speculative_algorithm="VERICACHE", kv_compressor=compressor,
             kv_compression_ratio=4, speculative_num_draft_tokens=5)
    assert ids_of(vc) == ids_of(full_runs[sampling])


def test_staggered_vericache_constrained_output_equals_full(llama, full_runs):
    vc = run(llama, SAMPLINGS["greedy"], speculative_algorithm="VERICACHE", kv_compressor="snapkv",
             kv_compression_ratio=4, speculative_num_draft_tokens=5, vericache_schedule="staggered",
             link_bandwidth="20MB", verify_staging_tokens=512)
    assert ids_of(vc) == ids_of(full_runs["greedy"])


def test_lossy_mode_output_fits_the_grammar(llama, tokenizer):
    assert_complete_and_valid(run(llama, SAMPLINGS["greedy"], kv_compressor="snapkv", kv_compression_ratio=4),
                              tokenizer)


def test_drafts_stop_where_the_grammar_ends(llama, tokenizer):
    """Three digits then EOS: after the prefill's first digit at most two digits and the EOS are
    left, so no round drafts more than 3 tokens although 8 are asked for."""
    def go(**server):
        sched = Scheduler(ServerArgs(model_path=llama, dtype="float32", page_size=8, **server))
        reqs = [make_request(f"r{i}", tokenizer.encode(p), max_new_tokens=32, temperature=0.0, regex="[0-9]{3}")
                for i, p in enumerate(PROMPTS)]
        return run_to_completion(sched, reqs)

    full = go()
    vc = go(speculative_algorithm="VERICACHE", kv_compressor="int8", speculative_num_draft_tokens=8,
            vericache_schedule="lockstep")
    assert ids_of(vc) == ids_of(full)
    for res in vc.values():
        assert res.output_ids[-1] == tokenizer.eos_token_id  # digits may share a token: "12" is one
        assert re.fullmatch("[0-9]{3}", tokenizer.decode(res.output_ids[:-1]))
        m = res.meta
        assert m["spec_rounds"] >= 1 and m["spec_drafted_tokens"] <= 3 * m["spec_rounds"]
