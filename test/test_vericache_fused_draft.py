"""VeriCache with kvquant / rotatekv tiers drafting through the fused CPU kernel (pre-RoPE keys, exact
outliers, the Hadamard basis, a dropper's per-head positions): output tokens and logprobs equal
deterministic full mode's bitwise, in bfloat16 and float32, and every draft layer read the kernel."""

from __future__ import annotations

import pytest

from sglang_vericache.server_args import bundled_model_path
from sglang_vericache.testing.random_checkpoints import make_random_checkpoint
from sglang_vericache.testing.scheduler_harness import random_prompts, run_batch

PROMPT_LENS = [40, 71, 9, 33]
NEW = 16


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_random_checkpoint("llama", str(tmp_path_factory.mktemp("llama")))


def run(path, dtype="bfloat16", page_size=8, **server):
    return run_batch(path, random_prompts(PROMPT_LENS, seed=3), NEW, dtype=dtype, page_size=page_size, **server)


@pytest.fixture(scope="module")
def full(llama):
    return {dtype: run(llama, dtype)[0] for dtype in ("bfloat16", "float32")}


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("compressor", ["kvquant4", "kvquant3", "rotatekv2", "snapkv+rotatekv4"])
def test_fused_kernel_drafts_and_output_equals_deterministic_full_mode(llama, full, compressor, dtype, monkeypatch):
    import sgl_kernel_ext.cpu_draft_attention as cda

    calls, kernel = [], cda.draft_decode_attention
    monkeypatch.setattr(cda, "draft_decode_attention", lambda *a: calls.append(1) or kernel(*a))
    vc, sched = run(llama, dtype, kv_compressor=compressor, kv_compression_ratio=2, speculative_algorithm="VERICACHE",
                    speculative_num_draft_tokens="4", vericache_schedule="lockstep")
    assert [r.output_ids for r in vc] == [r.output_ids for r in full[dtype]]
    assert [r.output_token_logprobs for r in vc] == [r.output_token_logprobs for r in full[dtype]]
    assert sched.metrics.spec_rounds_total > 0
    assert sched.model_runner.attn_backend.fused_draft is True
    assert calls  # drafts went through the kernel (a layout it did not read would take the torch path)


@pytest.fixture(scope="module")
def bundled_full():
    return {dtype: run(bundled_model_path(), dtype, page_size=16)[0] for dtype in ("bfloat16", "float32")}


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("compressor", ["kvquant4", "rotatekv4", "kivi4"])
def test_keys_scored_from_codes_and_output_equals_deterministic_full_mode(bundled_full, compressor, dtype,
                                                                          monkeypatch):
    """The bundled model (head dim 64) with pages of 16, a mixed batch (prompts of 40, 71, 9 and 33 tokens): under
    AVX-512 the kernel scores these tiers' keys from their codes (kvquant_key_scores / rotatekv_key_scores /
    kivi_key_scores; elsewhere its row path); VeriCache's tokens and logprobs are still deterministic full mode's
    bitwise, in bfloat16 and float32."""
    import sgl_kernel_ext.cpu_draft_attention as cda

    calls, kernel = [], cda.draft_decode_attention
    monkeypatch.setattr(cda, "draft_decode_attention", lambda *a: calls.append(1) or kernel(*a))
    vc, sched = run(bundled_model_path(), dtype, page_size=16, kv_compressor=compressor, kv_compression_ratio=2,
                    speculative_algorithm="VERICACHE", speculative_num_draft_tokens="4", vericache_schedule="lockstep")
    assert [r.output_ids for r in vc] == [r.output_ids for r in bundled_full[dtype]]
    assert [r.output_token_logprobs for r in vc] == [r.output_token_logprobs for r in bundled_full[dtype]]
    assert sched.metrics.spec_rounds_total > 0
    assert calls
