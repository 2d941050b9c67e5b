"""Adaptive VeriCache (speculative/adaptive.py, --vericache-schedule adaptive): whatever the controller
chooses -- decode like full mode, rounds over resident exact KV, rounds over streamed exact KV,
host-tier requests waiting -- the output is deterministic full mode's, tokens and logprobs,
bitwise, in bfloat16.

The controller's costs are pinned in most tests (its fit disabled), so each test drives one known
policy; one test lets it fit as served.
"""

from __future__ import annotations

import pytest
import torch

from sglang_vericache.managers.scheduler import Scheduler
from sglang_vericache.server_args import ServerArgs
from sglang_vericache.speculative.controller import StepCostModel
from sglang_vericache.testing.random_checkpoints import make_random_checkpoint
from sglang_vericache.testing.scheduler_harness import make_request, run_to_completion

PROMPT_LENS = [40, 71, 9, 100, 23, 64]
NEW = 24
PAGE = 8
# Pinned costs: decoding cheapest (matrix products dominate), rounds cheapest (KV reads dominate).
DECODE_WINS = (1e-4, 1e-3, 1e-10, 1e-10, 1e-10)
ROUNDS_WIN = (1e-4, 1e-6, 1e-5, 1e-7, 1e-9)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_random_checkpoint("llama", str(tmp_path_factory.mktemp("llama")))


def prompts(vocab=400, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


def scheduler(path, coef=None, dtype="bfloat16", **server) -> Scheduler:
    server.setdefault("verify_staging_tokens", 512)
    sched = Scheduler(ServerArgs(model_path=path, dtype=dtype, skip_tokenizer_init=True, page_size=PAGE,
                                 enable_deterministic_inference=True, max_running_requests=8, **server))
    if coef is not None:
        sched.spec_worker.controller.cost.pin(coef)
    return sched


def run(sched, batch, sampling=None):
    sampling = sampling or {"temperature": 0.0}
    reqs = [make_request(f"r{i}", ids, seed=100 + i, max_new_tokens=NEW, ignore_eos=True, return_logprob=True,
                         **sampling) for i, ids in enumerate(batch)]
    res = run_to_completion(sched, reqs)
    return [res[f"r{i}"] for i in range(len(batch))]


@pytest.fixture(scope="module")
def reference(llama):
    """Deterministic full mode: greedy and seeded."""
    batch = prompts()
    greedy = run(scheduler(llama), batch)
    seeded = run(scheduler(llama), batch, {"temperature": 0.8, "top_k": 40})
    return batch, greedy, seeded


def assert_same(full, other):
    assert [r.output_ids for r in other] == [r.output_ids for r in full]
    assert [r.output_token_logprobs for r in other] == [r.output_token_logprobs for r in full]


VC = dict(kv_compressor="snapkv", kv_compression_ratio=4, speculative_algorithm="VERICACHE",
          vericache_schedule="adaptive")


def test_the_adaptive_schedule_drives_the_rounds(llama):
    sched = scheduler(llama, **VC)
    assert type(sched.spec_worker).__name__ == "AdaptiveVeriCache"
    assert sched.admission_gate == sched.spec_worker.admits


def test_decoding_like_full_mode(llama, reference):
    batch, greedy, _ = reference
    sched = scheduler(llama, DECODE_WINS, **VC)
    assert_same(greedy, run(sched, batch))
    # Rounds only where the controller explores (at most one request per EXPLORE_EVERY iterations).
    assert sched.metrics.spec_rounds_total <= 2


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_rounds_over_resident_exact_kv(llama, reference, sampling):
    batch, greedy, seeded = reference
    sched = scheduler(llama, ROUNDS_WIN, **VC)
    out = run(sched, batch, None if sampling == "greedy" else {"temperature": 0.8, "top_k": 40})
    assert_same(greedy if sampling == "greedy" else seeded, out)
    assert sched.metrics.spec_rounds_total > 0
    assert sched.link.engine.bytes_total == 0  # every request resident: nothing crossed the link


def test_host_tier_requests_stream_and_resident_ones_do_not(llama, reference):
    """A device budget holding everyone's compressed tier, scratch and staging, and about the shortest
    request's exact KV: rounds pay, so the others run from the host tier."""
    batch, greedy, _ = reference
    link = dict(link_bandwidth="1GB", verify_staging_tokens=128)  # the longest request has 124 positions
    probe = scheduler(llama, **VC, **link)
    pl = probe.spec_worker.placement
    comp = sum((n + NEW) // PAGE for n in PROMPT_LENS) * probe.two_tier.pool.bytes_per_chunk()
    budget = comp + pl.staging + len(batch) * pl.scratch + pl.exact_bytes(9 + NEW)
    assert sum(pl.exact_bytes(n + NEW) for n in PROMPT_LENS) > budget - comp - len(batch) * pl.scratch
    sched = scheduler(llama, ROUNDS_WIN, **VC, device_kv_budget=str(budget), **link)
    out = run(sched, batch)
    assert_same(greedy, out)
    assert sched.metrics.spec_rounds_total > 0
    assert sched.link.engine.bytes_total > 0  # host-tier verifications streamed
    assert sched.spec_worker.max_resident < len(batch)  # and not everyone was resident


def test_no_exact_kv_goes_to_the_host_tier_before_draft_forwards_are_measured(llama, reference):
    """The budget of the test above and a prior under which rounds win, not pinned (fitted as served):
    a host-tier admission is not undone, so none is made on a draft cost no draft forward has
    measured (StepCostModel.drafts_measured); until then every request runs resident, and the output
    is full mode's."""
    batch, greedy, _ = reference
    link = dict(link_bandwidth="1GB", verify_staging_tokens=128)
    probe = scheduler(llama, **VC, **link)
    pl = probe.spec_worker.placement
    comp = sum((n + NEW) // PAGE for n in PROMPT_LENS) * probe.two_tier.pool.bytes_per_chunk()
    budget = comp + pl.staging + len(batch) * pl.scratch + pl.exact_bytes(9 + NEW)
    sched = scheduler(llama, **VC, device_kv_budget=str(budget), **link)
    worker = sched.spec_worker
    worker.controller.cost = StepCostModel(ROUNDS_WIN)
    seen = []
    update = worker.placement.update

    def recording(running):
        resident = update(running)
        seen.append((not all(resident), worker.controller.cost.drafts_measured))
        return resident

    worker.placement.update = recording
    assert_same(greedy, run(sched, batch))
    assert seen and all(measured for host, measured in seen if host)


def test_a_link_that_cannot_pay_keeps_host_requests_waiting(llama, reference):
    """A slow link and decoding cheap: host-tier rounds would cost more than they give, so requests
    beyond the resident ones are not admitted (or wait) instead of crawling over the link."""
    batch, greedy, _ = reference
    sched = scheduler(llama, DECODE_WINS, **VC, device_kv_budget="3MB", link_bandwidth="1MB")
    assert_same(greedy, run(sched, batch))


def test_fitted_as_served(llama, reference):
    batch, greedy, _ = reference
    sched = scheduler(llama, **VC, device_kv_budget="3MB", link_bandwidth="50MB")
    assert_same(greedy, run(sched, batch))
    assert len(sched.spec_worker.controller.cost.samples) > 0


def test_a_request_whose_compressed_tier_would_push_a_decoding_one_off_the_device_waits(llama, reference):
    """A device budget that holds the longest of three requests' exact KV alone: the first decodes
    resident (decode-only, as full mode would); admitting a second as VeriCache would put its
    compressed chunks, a drafter's scratch and the staging ring in the budget and push the first's
    exact KV onto the host, streamed over a slow link at every step. Admission compares the batch's
    predicted throughput with and without it, so it waits: nothing is demoted, nothing crosses the
    link, and the requests run one at a time as in full mode."""
    batch, greedy, _ = reference
    probe = scheduler(llama, **VC, link_bandwidth="1MB")
    budget = probe.spec_worker.placement.exact_bytes(max(PROMPT_LENS[:3]) + NEW) + 1024
    sched = scheduler(llama, DECODE_WINS, **VC, device_kv_budget=str(budget), link_bandwidth="1MB")
    assert_same(greedy[:3], run(sched, batch[:3]))
    worker = sched.spec_worker
    assert worker.placement.stats["demotions"] == 0
    assert sched.link.engine.bytes_total == 0
    assert worker.max_resident == 1


def test_requests_arriving_before_any_decode_is_measured_are_admitted_as_full_mode_would(llama, reference):
    """A prior under which rounds win, not pinned (it fits as served), a device budget that holds
    everyone: all six requests are admitted during the first prefills, before the fit has measured a
    decode-time forward (StepCostModel.measured), so each is admitted decode-only (no fold, no
    compressed chunk, no round) as full mode runs it, whatever the prior says."""
    batch, greedy, _ = reference
    sched = scheduler(llama, **VC)
    sched.spec_worker.controller.cost = StepCostModel(ROUNDS_WIN)
    folded = []
    fold = sched.two_tier.fold
    sched.two_tier.fold = lambda req, **kw: (folded.append((req.rid, req.spec.decode_only)), fold(req, **kw))[1]
    assert not sched.spec_worker.controller.cost.measured
    assert_same(greedy, run(sched, batch))
    assert {rid for rid, _ in folded} == {f"r{i}" for i in range(len(batch))}
    assert all(decode_only for _, decode_only in folded)
    assert sched.metrics.spec_rounds_total == 0
    assert sched.spec_worker.controller.cost.measured
