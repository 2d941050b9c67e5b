"""On a CPU the torch backend's DECODE step reads the KV pool in place through the batch-invariant
kernel whether or not inference is deterministic (TorchNativeAttnBackend.kernel_decode): its attention
is bitwise the deterministic step's, within float rounding of SDPA over the gathered KV, and where the
kernel cannot be loaded the step gathers for SDPA as before."""

from __future__ import annotations

import pytest
import torch

from sglang_vericache.layers.attention import torch_attend
from sglang_vericache.model_executor.forward_batch import ForwardMode
from sglang_vericache.model_executor.model_runner import ModelRunner
from sglang_vericache.server_args import ServerArgs
from sglang_vericache.testing import make_random_checkpoint
from sglang_vericache.testing.forward_batches import new_req, prepare_forward_batch

LENS = [5, 40, 71, 130]  # mixed lengths: the decode rows need a mask over the padded keys


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_random_checkpoint("llama", str(tmp_path_factory.mktemp("llama")))


def decode_batch(path, dtype):
    """A runner whose pool holds prompts of LENS tokens, and one DECODE batch over them."""
    runner = ModelRunner(ServerArgs(model_path=path, dtype=dtype, page_size=8, max_total_tokens=1024,
                                    max_running_requests=8, enable_deterministic_inference=False))
    g = torch.Generator().manual_seed(0)
    reqs = [new_req(runner) for _ in LENS]
    runner.forward(prepare_forward_batch(runner, reqs, [torch.randint(3, 400, (n,), generator=g).tolist()
                                                        for n in LENS]))
    fb = prepare_forward_batch(runner, reqs, [[7], [8], [9], [10]], ForwardMode.DECODE)
    fb.req_to_token_pool, fb.token_to_kv_pool = runner.req_to_token_pool, runner.token_to_kv_pool
    fb.attn_backend = runner.attn_backend
    return runner, fb


def attention(runner, fb, **flags):
    """Layer 0's attention output for fixed random q / k / v (the new tokens' K / V are written first)."""
    backend, cfg = runner.attn_backend, runner.model_config
    for name, value in flags.items():
        setattr(backend, name, value)
    g = torch.Generator().manual_seed(1)
    hd, bs = cfg.head_dim, fb.batch_size
    q = torch.randn(bs, cfg.num_attention_heads * hd, generator=g).to(runner.dtype)
    k = torch.randn(bs, cfg.num_key_value_heads * hd, generator=g).to(runner.dtype)
    v = torch.randn(bs, cfg.num_key_value_heads * hd, generator=g).to(runner.dtype)
    layer = runner.model.model.layers[0].self_attn.attn
    with torch.inference_mode():
        backend.init_forward_metadata(fb)
        return backend.forward(q, k, v, layer, fb).float()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_reads_the_pool_through_the_kernel_without_deterministic_inference(checkpoint, dtype):
    runner, fb = decode_batch(checkpoint, dtype)
    assert not runner.attn_backend.deterministic
    in_place = attention(runner, fb)
    assert runner.attn_backend.kernel_decode is True
    deterministic = attention(runner, fb, deterministic=True)
    assert torch.equal(in_place, deterministic)
    sdpa = attention(runner, fb, deterministic=False, kernel_decode=False)
    assert not torch.equal(in_place, sdpa)  # a different reduction: the switch did change the path
    tol = 1e-5 if dtype == "float32" else 1e-2  # bf16: the outputs are rounded to bf16
    torch.testing.assert_close(in_place, sdpa, atol=tol, rtol=tol)


def test_decode_gathers_for_sdpa_where_the_kernel_does_not_load(checkpoint, monkeypatch, caplog):
    """A kernel that cannot be built (no compiler): one warning, then SDPA's decode step, bitwise."""
    import sgl_kernel_ext.cpu_attention as ca

    runner, fb = decode_batch(checkpoint, "float32")
    sdpa = attention(runner, fb, kernel_decode=False)

    def no_compiler():
        raise RuntimeError("could not build the CPU kernel fixed_chunk_attention.cpp: g++ not found")

    monkeypatch.delitem(torch_attend._loaded, "cpu_attention", raising=False)  # tried again
    monkeypatch.setattr(ca, "load", no_compiler)
    monkeypatch.setattr(ca, "fixed_chunk_attention", None)  # calling the kernel would fail loudly
    runner.attn_backend.kernel_decode = None  # decided again at this DECODE
    with caplog.at_level("WARNING", logger=torch_attend.__name__):
        assert torch.equal(attention(runner, fb), sdpa)
    assert runner.attn_backend.kernel_decode is False
    assert "fixed-chunk kernel is unavailable" in caplog.text and "g++ not found" in caplog.text
