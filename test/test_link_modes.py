"""Modes that stream exact KV over the (throttled) link emit exactly what full mode emits:
VeriCache lock-step and staggered with layer-wise streamed verification, and naive offload."""

from __future__ import annotations

import pytest
import torch

from sglang_vericache.managers.scheduler import Scheduler
from sglang_vericache.server_args import ServerArgs
from sglang_vericache.testing.random_checkpoints import make_random_checkpoint
from sglang_vericache.testing.scheduler_harness import make_request, run_to_completion

LENS = [40, 70, 9, 100, 55, 23]
NEW = 30


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_random_checkpoint("llama", str(tmp_path_factory.mktemp("llama")))


def run(path, sampling=None, **server):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 400, (n,), generator=g).tolist() for n in LENS]
    sched = Scheduler(ServerArgs(model_path=path, dtype="float32", skip_tokenizer_init=True, page_size=8, **server))
    sampling = sampling or {"temperature": 0.0}
    reqs = [make_request(f"r{i}", p, seed=100 + i, max_new_tokens=NEW, ignore_eos=True, **sampling)
            for i, p in enumerate(prompts)]
    res = run_to_completion(sched, reqs)
    return [res[f"r{i}"].output_ids for i in range(len(prompts))], sched


VC = dict(speculative_algorithm="VERICACHE", speculative_num_draft_tokens="5")


@pytest.mark.parametrize("server", [
    dict(kv_offload=True, link_bandwidth="200MB"),
    dict(kv_compressor="int8", vericache_schedule="lockstep", link_bandwidth="200MB", **VC),
    dict(kv_compressor="int8", vericache_schedule="staggered", link_bandwidth="200MB", **VC),
    dict(kv_compressor="snapkv", vericache_schedule="staggered", **VC),  # unthrottled link
    dict(kv_compressor="kivi4", vericache_schedule="staggered", link_bandwidth="20MB", verify_staging_tokens=160, **VC),
], ids=["offload", "lockstep", "staggered-int8", "staggered-snapkv-unthrottled", "staggered-small-staging"])
def test_link_modes_equal_full(llama, server):
    full, _ = run(llama)
    out, sched = run(llama, **server)
    assert out == full
    link = sched.link.engine
    # Every streamed byte went over the link once per layer-copy; the link really moved data.
    assert link.bytes_total > 0 and link.busy_seconds > 0


def test_staggered_seeded_sampling_equals_full(llama):
    sampling = {"temperature": 0.8, "top_p": 0.9}
    full, _ = run(llama, sampling)
    out, _ = run(llama, sampling, kv_compressor="kivi2", vericache_schedule="staggered", link_bandwidth="100MB", **VC)
    assert out == full


def test_offload_streams_every_context_at_every_step(llama):
    _, sched = run(llama, kv_offload=True)
    per_token_all_layers = sched.model_runner.token_to_kv_pool.bytes_per_token()
    # Step t of request i streams its committed prefix (len_i + t tokens) once: sum over steps.
    expected = sum(sum(n + t for t in range(NEW - 1)) for n in LENS) * per_token_all_layers
    assert sched.link.engine.bytes_total == expected


def test_staggered_iterations_mix_drafting_and_verifying(llama):
    # A slow link admits about one verification per iteration, so requests take turns: most
    # forwards carry drafting and verifying requests at once. Lock-step never mixes them.
    def tags(**server):
        g = torch.Generator().manual_seed(0)
        sched = Scheduler(ServerArgs(model_path=llama, dtype="float32", skip_tokenizer_init=True, page_size=8,
                                     kv_compressor="int8", link_bandwidth="2MB", **VC, **server))
        sched.timeline = []
        reqs = [make_request(f"r{i}", torch.randint(3, 400, (n,), generator=g).tolist(), max_new_tokens=NEW,
                             temperature=0.0, ignore_eos=True) for i, n in enumerate(LENS)]
        run_to_completion(sched, reqs)
        return [tag for _, _, tag in sched.timeline]

    staggered = tags(vericache_schedule="staggered")
    lockstep = tags(vericache_schedule="lockstep")
    assert staggered.count("mixed") > staggered.count("verify")
    assert "mixed" not in lockstep and lockstep.count("verify") > 0
