"""Staged (streamed) attention and MIXED forwards on the torch backend.

Staged rows read their context from a StagedKV (exact KV streamed from the host pool layer by
layer) instead of the pool, so every staged forward is checked against the same forward over the
pool: TARGET_VERIFY (streamed verify), DECODE (full mode with offloaded KV), and a MIXED batch of
drafting + verifying requests against its two groups run apart. In every case the new tokens'
K/V must still land in the exact pool. Tiny random llama (GQA: 4 query heads, 2 KV heads),
float32, page 4. Each comparison runs two identical sets of requests side by side.
"""

from __future__ import annotations

import pytest
import torch

from sglang_vericache.mem_cache.kv_stager import LayerwiseKVStager
from sglang_vericache.mem_cache.memory_pool import MHATokenToKVPool
from sglang_vericache.model_executor.forward_batch import ForwardMode, StagedVerify
from sglang_vericache.model_executor.model_runner import ModelRunner
from sglang_vericache.server_args import ServerArgs
from sglang_vericache.testing import make_random_checkpoint
from sglang_vericache.testing.draft_batches import (
    DraftPool,
    compress_prefix,
    make_compressed_pool,
    prepare_draft_batch,
)
from sglang_vericache.testing.forward_batches import new_req, prepare_forward_batch
from sglang_vericache.testing.staged_batches import mixed_batch, prepare_staged_batch, staged_slots

PAGE = 4
ATOL = 5e-5  # float32: matmuls over a different number of rows differ in the last bits (CPU_INSTALL.md)
MAX_STAGED = 128


@pytest.fixture(scope="module")
def runner(tmp_path_factory) -> ModelRunner:
    path = make_random_checkpoint("llama", str(tmp_path_factory.mktemp("ckpt") / "llama"))
    args = ServerArgs(model_path=path, dtype="float32", page_size=PAGE, max_total_tokens=2048,
                      max_running_requests=40, link_bandwidth="50MB")
    r = ModelRunner(args)
    r.init_kv_stager(max_tokens=MAX_STAGED)
    assert r.transfer_engine.bandwidth == 50e6  # --link-bandwidth 50MB: 5e7 bytes/s
    yield r
    r.transfer_engine.shutdown()


@pytest.fixture(autouse=True)
def empty_pools(runner):
    """Each test starts with every request row and KV page free (the module shares one runner)."""
    runner.req_to_token_pool.free_slots = list(range(runner.req_to_token_pool.size))
    runner.token_to_kv_pool_allocator.clear()


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 400, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def prefill(runner, seqs: list[list[int]]) -> list:
    reqs = [new_req(runner) for _ in seqs]
    runner.forward(prepare_forward_batch(runner, reqs, seqs))
    return reqs


def new_slots(runner, reqs, n_new: list[int]) -> torch.Tensor:
    """The slots of each request's last n_new positions, request by request."""
    r2t = runner.req_to_token_pool.req_to_token
    return torch.cat([r2t[r.pool_idx, r.kv_len - n : r.kv_len] for r, n in zip(reqs, n_new)])


def assert_same_kv(pool, slots_a, slots_b) -> None:
    for layer in range(pool.num_layers):
        for buf in (pool.k_buffer[layer], pool.v_buffer[layer]):
            torch.testing.assert_close(buf[slots_a], buf[slots_b], atol=ATOL, rtol=0)


PROMPTS = [tokens(9, 1), tokens(14, 2), tokens(23, 3)]  # different lengths, partial last pages
VERIFY = [tokens(4, 11), tokens(4, 12), tokens(4, 13)]  # [t_n, d_1..d_3] per request


def verify_all_rows(runner, reqs, new_ids, staged: bool) -> torch.Tensor:
    rows = torch.arange(sum(len(x) for x in new_ids))
    if staged:
        fb = prepare_staged_batch(runner, runner.kv_stager, reqs, new_ids, ForwardMode.TARGET_VERIFY, rows)
    else:
        fb = prepare_forward_batch(runner, reqs, new_ids, ForwardMode.TARGET_VERIFY, rows)
    return runner.forward(fb)


def test_staged_verify_equals_pool_verify(runner):
    ref_reqs, reqs = prefill(runner, PROMPTS), prefill(runner, PROMPTS)
    ref = verify_all_rows(runner, ref_reqs, VERIFY, staged=False)
    eng = runner.transfer_engine
    eng.reset_stats()
    got = verify_all_rows(runner, reqs, VERIFY, staged=True)
    assert got.shape == ref.shape == (12, ref.shape[1])
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)
    # the link carried each layer of the three prefixes exactly once
    n_staged = sum(len(p) for p in PROMPTS)
    assert eng.bytes_total == runner.kv_stager.transfer_bytes(n_staged)
    n_layers = runner.model_config.num_hidden_layers
    assert [iv[3] for iv in eng.busy_intervals] == [f"L{i}" for i in range(n_layers)]
    assert runner.kv_stager._active is None  # the forward consumed every layer
    assert_same_kv(runner.token_to_kv_pool, new_slots(runner, reqs, [4] * 3),
                   new_slots(runner, ref_reqs, [4] * 3))


def test_staged_verify_reads_its_context_from_the_staged_kv_not_the_pool(runner):
    """Stage from a copy of the pool (the host tier), then overwrite the prefix rows in the pool."""
    ref_reqs, reqs = prefill(runner, PROMPTS), prefill(runner, PROMPTS)
    ref = verify_all_rows(runner, ref_reqs, VERIFY, staged=False)
    pool = runner.token_to_kv_pool
    host = MHATokenToKVPool(pool.num_slots, pool.num_layers, pool.num_kv_heads, pool.head_dim, pool.dtype)
    for layer in range(pool.num_layers):
        host.k_buffer[layer].copy_(pool.k_buffer[layer])
        host.v_buffer[layer].copy_(pool.v_buffer[layer])
    stager = LayerwiseKVStager(host, runner.transfer_engine, MAX_STAGED)
    slots, offsets, prefix_lens = staged_slots(runner, reqs)
    for layer in range(pool.num_layers):
        pool.k_buffer[layer][slots] = 1e3
        pool.v_buffer[layer][slots] = -1e3
    staged = StagedVerify(stager.begin(slots), offsets, prefix_lens)
    fb = prepare_forward_batch(runner, reqs, VERIFY, ForwardMode.TARGET_VERIFY, torch.arange(12))
    fb.staged = staged
    torch.testing.assert_close(runner.forward(fb), ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("lens", [[9, 14, 23], [11, 11, 11]], ids=["ragged", "equal"])
def test_staged_decode_equals_decode(runner, lens):
    """The naive-offload baseline of full mode: a plain decode whose whole context streams in."""
    prompts = [tokens(n, 20 + n) for n in lens]
    ref_reqs, reqs = prefill(runner, prompts), prefill(runner, prompts)
    step = [[5], [6], [7]]
    ref = runner.forward(prepare_forward_batch(runner, ref_reqs, step, ForwardMode.DECODE))
    got = runner.forward(prepare_staged_batch(runner, runner.kv_stager, reqs, step, ForwardMode.DECODE))
    assert got.shape == ref.shape == (3, ref.shape[1])
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)
    assert_same_kv(runner.token_to_kv_pool, new_slots(runner, reqs, [1] * 3),
                   new_slots(runner, ref_reqs, [1] * 3))


DRAFT_PROMPTS = [tokens(10, 31), tokens(17, 32)]  # drafting requests: 2 and 4 pages compressed
STAGED_PROMPTS = [tokens(12, 33), tokens(7, 34)]
STAGED_NEW = [tokens(3, 41), tokens(5, 42)]  # verifying 2 and 4 drafts
VERIFY_MODE = ForwardMode.TARGET_VERIFY


def draft_group(runner, cpool, draft_pool):
    reqs = prefill(runner, DRAFT_PROMPTS)
    dreqs = [compress_prefix(runner, cpool, r, r.kv_len // PAGE) for r in reqs]
    return prepare_draft_batch(runner, cpool, dreqs, [101, 102], draft_pool), dreqs


def test_mixed_batch_equals_its_groups_run_apart(runner):
    cpool = make_compressed_pool(runner, "streamingllm", ratio=1, num_chunks=32)
    assert cpool.layouts[0].kind == "token_drop" and cpool.layouts[0].rows == PAGE  # keeps every token
    draft_pool = DraftPool(runner, num_slots=16)
    n_staged_rows = sum(len(x) for x in STAGED_NEW)
    rows = torch.arange(n_staged_rows)

    # apart: one DRAFT_DECODE forward, one staged TARGET_VERIFY forward
    ref_draft_fb, ref_dreqs = draft_group(runner, cpool, draft_pool)
    ref_draft = runner.forward(ref_draft_fb)
    ref_staged_reqs = prefill(runner, STAGED_PROMPTS)
    ref_staged = runner.forward(
        prepare_staged_batch(runner, runner.kv_stager, ref_staged_reqs, STAGED_NEW, VERIFY_MODE, rows)
    )

    # together: one MIXED forward (draft rows first, then every row of the verifying requests)
    draft_fb, dreqs = draft_group(runner, cpool, draft_pool)
    staged_reqs = prefill(runner, STAGED_PROMPTS)
    staged_fb = prepare_staged_batch(runner, runner.kv_stager, staged_reqs, STAGED_NEW, VERIFY_MODE, rows)
    fb = mixed_batch(draft_fb, staged_fb)
    assert fb.forward_mode == ForwardMode.MIXED and fb.num_draft == 2 and fb.num_tokens == 2 + n_staged_rows
    got = runner.forward(fb)
    assert got.shape == (2 + n_staged_rows, ref_draft.shape[1])
    torch.testing.assert_close(got[:2], ref_draft, atol=ATOL, rtol=0)
    torch.testing.assert_close(got[2:], ref_staged, atol=ATOL, rtol=0)
    # new K/V: the drafts' in the draft pool, the verified tokens' in the exact pool
    d_got = torch.tensor([d.draft_slots[-1] for d in dreqs])
    d_ref = torch.tensor([d.draft_slots[-1] for d in ref_dreqs])
    assert_same_kv(draft_pool.kv, d_got, d_ref)
    n_new = [len(x) for x in STAGED_NEW]
    assert_same_kv(runner.token_to_kv_pool, new_slots(runner, staged_reqs, n_new),
                   new_slots(runner, ref_staged_reqs, n_new))


RESIDENT_PROMPTS = [tokens(13, 35), tokens(6, 36), tokens(9, 37)]
RESIDENT_NEW = [tokens(4, 43), tokens(1, 44), tokens(2, 45)]  # verifying 3 drafts, a decode row, 1 draft


def three_groups(runner, cpool, draft_pool, together: bool):
    """Draft rows, resident rows (context in the pool) and staged rows: one MIXED forward, or three."""
    draft_fb, _ = draft_group(runner, cpool, draft_pool)
    res_reqs = prefill(runner, RESIDENT_PROMPTS)
    res_rows = torch.arange(sum(len(x) for x in RESIDENT_NEW))
    staged_reqs = prefill(runner, STAGED_PROMPTS)
    st_rows = torch.arange(sum(len(x) for x in STAGED_NEW))
    if together:
        res_fb = prepare_forward_batch(runner, res_reqs, RESIDENT_NEW, VERIFY_MODE, res_rows)
        staged_fb = prepare_staged_batch(runner, runner.kv_stager, staged_reqs, STAGED_NEW, VERIFY_MODE, st_rows)
        fb = mixed_batch(draft_fb, staged_fb, res_fb)
        assert fb.num_draft == 2 and fb.num_resident == 3 and fb.batch_size == 7
        return runner.forward(fb), res_reqs
    out = [runner.forward(draft_fb),
           runner.forward(prepare_forward_batch(runner, res_reqs, RESIDENT_NEW, VERIFY_MODE, res_rows)),
           runner.forward(prepare_staged_batch(runner, runner.kv_stager, staged_reqs, STAGED_NEW, VERIFY_MODE,
                                               st_rows))]
    return torch.cat(out), res_reqs


def test_mixed_batch_with_resident_rows_equals_its_groups_run_apart(runner):
    """Resident rows (a request whose exact KV stays in device memory verifies, or decodes, over the
    pool: no link) sit between the draft rows and the staged rows of one MIXED forward."""
    cpool = make_compressed_pool(runner, "streamingllm", ratio=1, num_chunks=64)
    draft_pool = DraftPool(runner, num_slots=16)
    ref, ref_res = three_groups(runner, cpool, draft_pool, together=False)
    eng = runner.transfer_engine
    eng.reset_stats()
    got, res = three_groups(runner, cpool, draft_pool, together=True)
    assert got.shape == ref.shape == (2 + 7 + 8, ref.shape[1])
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)
    # only the staged requests' prefixes crossed the link
    assert eng.bytes_total == runner.kv_stager.transfer_bytes(sum(len(p) for p in STAGED_PROMPTS))
    n_new = [len(x) for x in RESIDENT_NEW]
    assert_same_kv(runner.token_to_kv_pool, new_slots(runner, res, n_new), new_slots(runner, ref_res, n_new))


def test_mixed_batch_resident_rows_are_bitwise_their_own_forward_under_deterministic_inference(tmp_path):
    path = make_random_checkpoint("llama", str(tmp_path / "llama"))
    args = ServerArgs(model_path=path, dtype="bfloat16", page_size=PAGE, max_total_tokens=2048,
                      max_running_requests=40, link_bandwidth="50MB", enable_deterministic_inference=True)
    r = ModelRunner(args)
    r.init_kv_stager(max_tokens=MAX_STAGED)
    try:
        cpool = make_compressed_pool(r, "streamingllm", ratio=1, num_chunks=64)
        draft_pool = DraftPool(r, num_slots=16)
        ref, _ = three_groups(r, cpool, draft_pool, together=False)
        got, _ = three_groups(r, cpool, draft_pool, together=True)
        assert torch.equal(got, ref)
    finally:
        r.transfer_engine.shutdown()


def test_mixed_batch_default_logits_rows_are_each_requests_last_token(runner):
    """logits_indices None -> row i = request i's last token: draft rows, then each staged request's last."""
    cpool = make_compressed_pool(runner, "streamingllm", ratio=1, num_chunks=32)
    draft_pool = DraftPool(runner, num_slots=16)
    outs = []
    for rows in (torch.arange(2 + sum(len(x) for x in STAGED_NEW)), None):  # two identical sets of requests
        draft_fb, _ = draft_group(runner, cpool, draft_pool)
        staged_reqs = prefill(runner, STAGED_PROMPTS)
        staged_fb = prepare_staged_batch(runner, runner.kv_stager, staged_reqs, STAGED_NEW)
        fb = mixed_batch(draft_fb, staged_fb)
        fb.logits_indices = rows
        outs.append(runner.forward(fb))
    every_row, last_rows = outs
    assert last_rows.shape[0] == 4
    last_of_each = torch.tensor([0, 1, 2 + 3 - 1, 2 + 3 + 5 - 1])
    torch.testing.assert_close(last_rows, every_row[last_of_each], atol=ATOL, rtol=0)


def test_the_forward_takes_each_layer_right_before_its_attention_and_releases_it_after(runner):
    reqs = prefill(runner, PROMPTS[:2])
    fb = prepare_staged_batch(runner, runner.kv_stager, reqs, VERIFY[:2])
    kv, calls = fb.staged.kv, []
    take, release = kv.layer, kv.release
    kv.layer = lambda layer: (calls.append(("layer", layer, kv.in_flight)), take(layer))[1]
    kv.release = lambda layer: (calls.append(("release", layer, kv.in_flight)), release(layer))[1]
    runner.forward(fb)
    n_layers = runner.model_config.num_hidden_layers
    # depth 2: while layer l is used, layer l+1 is already staged or in flight (except the last layer)
    want = []
    for layer in range(n_layers):
        staged_now = min(2, n_layers - layer)
        want += [("layer", layer, staged_now), ("release", layer, staged_now)]
    assert calls == want


def test_mixed_batch_groups_must_cover_the_batch(runner):
    cpool = make_compressed_pool(runner, "streamingllm", ratio=1, num_chunks=32)
    draft_fb, _ = draft_group(runner, cpool, DraftPool(runner, num_slots=16))
    fb = mixed_batch(draft_fb, prepare_staged_batch(runner, runner.kv_stager, prefill(runner, STAGED_PROMPTS),
                                                    STAGED_NEW))
    fb.staged.offsets, fb.staged.prefix_lens = fb.staged.offsets[:1], fb.staged.prefix_lens[:1]
    with pytest.raises(ValueError, match="2 draft \\+ 0 resident \\+ 1 staged requests != batch size 4"):
        runner.forward(fb)
    assert runner.kv_stager._active is None


def test_a_failed_forward_frees_the_stager(runner):
    reqs = prefill(runner, PROMPTS[:2])
    fb = prepare_staged_batch(runner, runner.kv_stager, reqs, VERIFY[:2])
    fb.staged.prefix_lens = [1, 1]  # disagrees with extend_prefix_lens
    with pytest.raises(ValueError, match="extend_prefix_lens"):
        runner.forward(fb)
    assert runner.kv_stager._active is None
    runner.kv_stager.begin(torch.tensor([1, 2], dtype=torch.int64)).close()


def test_staging_more_than_max_tokens_is_refused(runner):
    reqs = prefill(runner, [tokens(MAX_STAGED + 1, 5)])
    with pytest.raises(ValueError, match="exceed the stager's max_tokens"):
        prepare_staged_batch(runner, runner.kv_stager, reqs, [[1]], ForwardMode.DECODE)
