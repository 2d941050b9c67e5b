"""Our ModelRunner (model code + torch attention backend + paged KV) vs Hugging Face transformers.

Tiny random float32 checkpoints of every supported family. Tolerances: logits within 1e-4 of
HF (float32 rounding differs only in op grouping), argmax identical, greedy tokens identical.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from sglang_vericache.model_executor.forward_batch import ForwardMode
from sglang_vericache.model_executor.model_runner import ModelRunner
from sglang_vericache.server_args import ServerArgs
from sglang_vericache.testing import FAMILIES, make_random_checkpoint
from sglang_vericache.testing.forward_batches import greedy_generate, new_req, prepare_forward_batch

PROMPTS = [[5, 17, 99, 3, 42], [7, 300, 12, 8, 250, 61, 9, 77, 140, 31, 2], list(range(100, 123))]
LOGIT_ATOL = 1e-4
NUM_GREEDY = 16


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("ckpt")
    return {f: make_random_checkpoint(f, str(root / f)) for f in FAMILIES}


@pytest.fixture(scope="module")
def hf_models(checkpoints):
    from transformers import AutoModelForCausalLM

    models = {}
    for family, path in checkpoints.items():
        m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
        m.eval()
        m.generation_config.eos_token_id = None  # always generate NUM_GREEDY tokens
        models[family] = m
    return models


@pytest.fixture(scope="module")
def hf_greedy(hf_models) -> dict[str, list[list[int]]]:
    """HF generate(do_sample=False) continuations of each prompt, one prompt at a time."""
    out = {}
    for family, model in hf_models.items():
        with torch.no_grad():
            out[family] = [
                model.generate(torch.tensor([p]), max_new_tokens=NUM_GREEDY, do_sample=False)[0, len(p) :].tolist()
                for p in PROMPTS
            ]
    return out


def make_runner(path: str, page_size: int = 4, dtype: str = "float32") -> ModelRunner:
    return ModelRunner(
        ServerArgs(
            model_path=path, dtype=dtype, page_size=page_size, max_total_tokens=1024, max_running_requests=8
        )
    )


def hf_logits(hf_model, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([prompt])).logits[0].float()


def all_rows_logits(runner: ModelRunner, prompts: list[list[int]]) -> torch.Tensor:
    reqs = [new_req(runner) for _ in prompts]
    n = sum(len(p) for p in prompts)
    return runner.forward(prepare_forward_batch(runner, reqs, prompts, logits_indices=torch.arange(n)))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_prefill_logits_match_hf(family, checkpoints, hf_models):
    logits = all_rows_logits(make_runner(checkpoints[family]), PROMPTS)
    assert logits.dtype == torch.float32
    ref = torch.cat([hf_logits(hf_models[family], p) for p in PROMPTS])
    assert logits.shape == ref.shape
    assert (logits - ref).abs().max().item() < LOGIT_ATOL
    assert torch.equal(logits.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_decode_matches_hf_generate(family, page_size, checkpoints, hf_greedy):
    ours = greedy_generate(make_runner(checkpoints[family], page_size), PROMPTS, NUM_GREEDY)
    assert ours == hf_greedy[family]


def test_greedy_outputs_are_not_degenerate(hf_greedy):
    """The random checkpoints must make greedy decoding informative (not one repeated token)."""
    for family, outs in hf_greedy.items():
        for out in outs:
            assert len(set(out)) >= 4, (family, out)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_extend_on_cached_prefix_matches_one_shot_prefill(family, checkpoints):
    """Prefill 8 tokens (two pages of 4), then extend the remaining 15 next to a fresh request."""
    prompt, other = PROMPTS[2], PROMPTS[1]
    one_shot = all_rows_logits(make_runner(checkpoints[family]), [prompt])
    runner = make_runner(checkpoints[family])
    a, b = new_req(runner), new_req(runner)
    runner.forward(prepare_forward_batch(runner, [a], [prompt[:8]]))
    n = len(prompt) - 8 + len(other)
    fb = prepare_forward_batch(runner, [a, b], [prompt[8:], other], logits_indices=torch.arange(n))
    assert fb.extend_prefix_lens_cpu == [8, 0]
    logits = runner.forward(fb)
    # float32 matmuls over a different number of rows differ in the last bits (measured <= 1.1e-5).
    assert (logits[: len(prompt) - 8] - one_shot[8:]).abs().max().item() < 5e-5
    assert torch.equal(logits[: len(prompt) - 8].argmax(-1), one_shot[8:].argmax(-1))


def test_target_verify_scores_every_token_like_prefill(checkpoints, hf_models):
    """TARGET_VERIFY: [last token, drafts] per request, causal over the exact prefix, logits for all rows."""
    runner = make_runner(checkpoints["llama"])
    reqs = [new_req(runner) for _ in PROMPTS]
    runner.forward(prepare_forward_batch(runner, reqs, [p[:-4] for p in PROMPTS]))
    tails = [p[-4:] for p in PROMPTS]
    fb = prepare_forward_batch(
        runner, reqs, tails, ForwardMode.TARGET_VERIFY, logits_indices=torch.arange(12)
    )
    logits = runner.forward(fb)
    ref = torch.cat([hf_logits(hf_models["llama"], p)[-4:] for p in PROMPTS])
    assert (logits - ref).abs().max().item() < LOGIT_ATOL
    assert torch.equal(logits.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("layout", ["padded", "ragged"])
def test_both_extend_layouts_match_hf(layout, checkpoints, hf_models):
    runner = make_runner(checkpoints["mistral"])
    runner.attn_backend.force_layout = layout
    # ragged layout: the 23-token prompt attends in query blocks of 3 rows
    runner.attn_backend.max_score_bytes = 4 * 4 * 23 * 3
    logits = all_rows_logits(runner, PROMPTS)
    ref = torch.cat([hf_logits(hf_models["mistral"], p) for p in PROMPTS])
    assert (logits - ref).abs().max().item() < LOGIT_ATOL


@pytest.mark.parametrize("layout", ["padded", "ragged"])
def test_prompts_from_position_zero_take_the_causal_kernel_and_match_the_masked_one(layout, checkpoints):
    """Prompts with no cached prefix attend with SDPA's is_causal kernel (no mask); prompts after
    a prefix, and padded batches of unequal prompts, keep the explicit mask. Both agree."""
    runner = make_runner(checkpoints["llama"])
    backend = runner.attn_backend
    backend.force_layout = layout
    prompt = PROMPTS[2]  # 23 tokens: 8 cached, then 15

    def causal_flags() -> list[bool]:  # the metadata the last forward attended with
        md = backend.forward_metadata
        return [md.causal] if layout == "padded" else [b.causal for b in md.blocks]

    fast = runner.forward(prepare_forward_batch(runner, [new_req(runner)], [prompt],
                                                logits_indices=torch.arange(len(prompt))))
    assert causal_flags() == [True]
    req = new_req(runner)
    runner.forward(prepare_forward_batch(runner, [req], [prompt[:8]]))
    masked = runner.forward(prepare_forward_batch(runner, [req], [prompt[8:]],
                                                  logits_indices=torch.arange(len(prompt) - 8)))
    assert causal_flags() == [False]
    assert (masked - fast[8:]).abs().max().item() < 5e-5
    assert torch.equal(masked.argmax(-1), fast[8:].argmax(-1))
    if layout == "padded":
        assert len(PROMPTS[0]) != len(PROMPTS[1])
        runner.forward(prepare_forward_batch(runner, [new_req(runner), new_req(runner)], PROMPTS[:2]))
        assert causal_flags() == [False]


def test_sharded_checkpoint_loads_identical_weights(checkpoints, tmp_path):
    sharded = make_random_checkpoint("llama", str(tmp_path / "sharded"), max_shard_size="100KB")
    with open(os.path.join(sharded, "model.safetensors.index.json")) as f:
        assert len(set(json.load(f)["weight_map"].values())) > 1
    assert torch.equal(all_rows_logits(make_runner(sharded), PROMPTS),
                       all_rows_logits(make_runner(checkpoints["llama"]), PROMPTS))


def test_tied_checkpoint_shares_lm_head_with_embeddings(checkpoints):
    runner = make_runner(checkpoints["qwen2"])
    assert runner.model_config.tie_word_embeddings
    assert runner.model.lm_head.weight.data_ptr() == runner.model.model.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_runs_and_agrees_with_float32_on_first_token(dtype, checkpoints):
    """Half precision: weights and KV in `dtype`, logits float32, first greedy token = float32's
    (these prompts' top-2 gaps are >= 0.49), and every logit within a quarter of the float32
    logits' std (about 1.05 here; measured: bf16 0.54, fp16 0.03)."""
    name = str(dtype).removeprefix("torch.")
    runner = make_runner(checkpoints["llama"], dtype=name)
    assert runner.model.lm_head.weight.dtype == dtype
    assert runner.token_to_kv_pool.dtype == dtype
    reqs = [new_req(runner) for _ in PROMPTS]
    half = runner.forward(prepare_forward_batch(runner, reqs, PROMPTS))
    reqs32 = make_runner(checkpoints["llama"])
    full = reqs32.forward(prepare_forward_batch(reqs32, [new_req(reqs32) for _ in PROMPTS], PROMPTS))
    assert half.dtype == torch.float32
    assert torch.equal(half.argmax(-1), full.argmax(-1))
    assert (half - full).abs().max().item() < 0.25 * full.std().item()
