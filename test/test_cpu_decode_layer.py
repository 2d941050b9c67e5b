"""sgl_kernel_ext's llama_decode_layer (csrc/llama_layer.h): a Llama decoder layer of a DECODE step in
one call, its KV write and attention included, bitwise equal to the chain it replaces (llama_attn_in,
the pool's index_copy_, fixed_chunk_attention rounded to the hidden dtype, llama_mlp_block), in
bfloat16 and float32, one request or several of different lengths; and the model's decode with the
fused layers (llama_decode_layers, llama_decode_layer: layers/attention/cpu_decode.py's plan) gives the
same tokens and logprobs as without them."""

from __future__ import annotations

import pytest
import torch

from sgl_kernel_ext import cpu_attention, cpu_linear, cpu_rowwise

H, HKV, D, HIDDEN, INTER, SLOTS = 9, 3, 64, 576, 1536, 400


def layer_operands(dtype: torch.dtype, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)

    def w(*shape, scale=0.05):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    return dict(n1=w(HIDDEN, scale=1.0) + 1, qkv=cpu_linear.pack_weight(w((H + 2 * HKV) * D, HIDDEN)),
                qkv_bias=torch.randn((H + 2 * HKV) * D, generator=g), o=cpu_linear.pack_weight(w(HIDDEN, H * D)),
                n2=w(HIDDEN, scale=1.0) + 1, gu=cpu_linear.pack_weight(w(2 * INTER, HIDDEN)),
                down=cpu_linear.pack_weight(w(HIDDEN, INTER)), k_buf=w(SLOTS, HKV, D, scale=1.0),
                v_buf=w(SLOTS, HKV, D, scale=1.0))


def run_fused(p: dict, hidden, cos, sin, loc, index, allowed):
    ops, empty = torch.ops.sgl_kernel_ext_rowwise, torch.empty(0)
    return ops.llama_decode_layer(hidden, p["n1"], 1e-5, p["qkv"], p["qkv_bias"], H, HKV, D, cos, sin, p["k_buf"],
                                  p["v_buf"], loc, index, allowed, torch.empty(0, dtype=torch.int64), D**-0.5,
                                  p["o"], empty, p["n2"], 1e-6, p["gu"], empty, 2 * INTER, p["down"], empty)


def run_chain(p: dict, hidden, cos, sin, loc, index, allowed):
    ops, empty = torch.ops.sgl_kernel_ext_rowwise, torch.empty(0)
    q, k, v, _ = ops.llama_attn_in(hidden, p["n1"], 1e-5, p["qkv"], p["qkv_bias"], H, HKV, D, cos, sin)
    p["k_buf"].index_copy_(0, loc, k)
    p["v_buf"].index_copy_(0, loc, v)
    t = hidden.shape[0]
    att = cpu_attention.fixed_chunk_attention(q.view(t, 1, H, D), p["k_buf"], p["v_buf"], index,
                                              allowed if allowed.numel() else None, D**-0.5)
    att = att.to(hidden.dtype).reshape(t, H * D)
    return ops.llama_mlp_block(hidden, att, p["o"], empty, p["n2"], 1e-6, p["gu"], empty, 2 * INTER, p["down"], empty)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("lengths", [[1], [200], [5, 130, 64]])
def test_decode_layer_equals_the_chain_bitwise(dtype, lengths):
    cpu_rowwise.load(), cpu_attention.load(), cpu_linear.load()
    g = torch.Generator().manual_seed(len(lengths))
    t, s = len(lengths), max(lengths)
    hidden = (torch.randn(t, HIDDEN, generator=g) * 2).to(dtype)
    angles = torch.rand(t, D, generator=g) * 100
    cos, sin = angles.cos().to(dtype).unsqueeze(1), angles.sin().to(dtype).unsqueeze(1)
    slots = torch.randperm(SLOTS - 1, generator=g)[: sum(lengths)] + 1  # each request's keys, scattered
    index = torch.zeros(t, s, dtype=torch.int64)
    allowed = torch.zeros(t, 1, s, dtype=torch.bool)
    at = 0
    for i, n in enumerate(lengths):
        index[i, :n] = slots[at : at + n]
        allowed[i, 0, :n] = True
        at += n
    loc = torch.tensor([index[i, n - 1].item() for i, n in enumerate(lengths)])  # the new token: the last key
    if len(set(lengths)) == 1:
        allowed = torch.empty(0, dtype=torch.bool)  # every key visible, as the backend passes it
    fused_ops, chain_ops = layer_operands(dtype, 0), layer_operands(dtype, 0)
    got = run_fused(fused_ops, hidden, cos, sin, loc, index, allowed)
    want = run_chain(chain_ops, hidden, cos, sin, loc, index, allowed)
    assert got.dtype == dtype and torch.equal(got, want)
    assert torch.equal(fused_ops["k_buf"], chain_ops["k_buf"]) and torch.equal(fused_ops["v_buf"], chain_ops["v_buf"])
    alone = [run_fused(layer_operands(dtype, 0), hidden[i : i + 1], cos[i : i + 1], sin[i : i + 1], loc[i : i + 1],
                       index[i : i + 1, : lengths[i]], torch.empty(0, dtype=torch.bool)) for i in range(t)]
    assert torch.equal(torch.cat(alone), got)  # a request's row alone (its keys only) = in the batch


def test_bad_operands_are_refused():
    cpu_rowwise.load(), cpu_attention.load(), cpu_linear.load()
    p = layer_operands(torch.bfloat16, 0)
    hidden = torch.randn(1, HIDDEN).bfloat16()
    cs = torch.ones(1, 1, D).bfloat16()
    index = torch.tensor([[3, 4]])
    with pytest.raises(RuntimeError, match="outside the pool"):
        run_fused(p, hidden, cs, cs, torch.tensor([SLOTS]), index, torch.empty(0, dtype=torch.bool))
    p["k_buf"] = p["k_buf"].float()
    with pytest.raises(RuntimeError, match="dtype"):
        run_fused(p, hidden, cs, cs, torch.tensor([4]), index, torch.empty(0, dtype=torch.bool))


def test_model_decode_with_the_fused_layers_gives_the_same_tokens_and_logprobs(monkeypatch):
    """The bundled (Llama) model in bfloat16, prompts decoded as a batch and alone: all layers in one call
    (llama_decode_layers), one call per layer (llama_decode_layer), and the attention path of the module
    chain give the same tokens and logprobs."""
    from sglang_vericache.layers.attention import torch_backend
    from sglang_vericache.managers.scheduler import Scheduler
    from sglang_vericache.models.llama import LlamaModel
    from sglang_vericache.server_args import ServerArgs
    from sglang_vericache.testing.scheduler_harness import make_request, run_to_completion

    sched = Scheduler(ServerArgs(skip_tokenizer_init=True, dtype="bfloat16", max_total_tokens=2048))
    whole = []
    operands = LlamaModel.decode_operands

    def counted(self, hidden, plan):
        whole.append(operands(self, hidden, plan))
        return whole[-1]

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, sched.vocab_size, (n,), generator=g).tolist() for n in (37, 5, 90)]

    def generate(tag: str) -> list:
        out = []
        for batch in (prompts, prompts[:1]):
            reqs = [make_request(f"{tag}{len(batch)}-{i}", p, return_logprob=True, max_new_tokens=10, temperature=0.0,
                                 ignore_eos=True) for i, p in enumerate(batch)]
            res = run_to_completion(sched, reqs)
            out += [(res[r.rid].output_ids, res[r.rid].output_token_logprobs) for r in reqs]
        return out

    monkeypatch.setattr(LlamaModel, "decode_operands", counted)
    fused = generate("all")
    assert whole and all(w is not None for w in whole)  # every decode step: all layers in one call
    monkeypatch.setattr(LlamaModel, "decode_operands", lambda self, hidden, plan: None)
    assert generate("layer") == fused  # one call per layer
    monkeypatch.setattr(torch_backend, "cpu_decode_plan", lambda *args: None)
    assert generate("chain") == fused  # attention through RadixAttention and the backend
