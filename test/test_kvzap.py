"""KVzap (compress/kvzap.py): the surrogate's arithmetic and the keys it keeps, a checkpoint
without one refused with the recipe named, and VeriCache over kvzap on the bundled model (its
shipped surrogate, hidden states captured from prefill and verify) equal to deterministic full
mode bitwise in bfloat16, greedy and seeded."""

from __future__ import annotations

import re

import pytest
import torch

from sglang_vericache.compress import CompressorConfig
from sglang_vericache.compress.base import surrogate_owner, surrogate_path
from sglang_vericache.compress.kvzap import SURROGATE_FILE, KVzapCompressor, KVzapSurrogate
from sglang_vericache.managers.scheduler import Scheduler
from sglang_vericache.server_args import ServerArgs, bundled_model_path
from sglang_vericache.testing.scheduler_harness import make_request, run_to_completion

NEW = 12
SEEDED = {"temperature": 0.9, "top_p": 0.95, "top_k": 40}


def test_the_surrogate_is_a_linear_map_or_a_gelu_mlp_per_layer():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, 5, 6, generator=g)
    w, b = torch.randn(3, 6, 2, generator=g), torch.randn(3, 2, generator=g)
    assert torch.equal(KVzapSurrogate({"w": w, "b": b}).predict(1, h), h @ w[1] + b[1])
    w1, b1, w2, b2 = torch.randn(3, 6, 4), torch.randn(3, 4), torch.randn(3, 4, 2), torch.randn(3, 2)
    mlp = KVzapSurrogate({"w1": w1, "b1": b1, "w2": w2, "b2": b2})
    assert (mlp.kind, mlp.num_layers, mlp.hidden_size, mlp.num_kv_heads) == ("mlp", 3, 6, 2)
    assert torch.equal(mlp.predict(2, h), torch.nn.functional.gelu(h @ w1[2] + b1[2]) @ w2[2] + b2[2])
    with pytest.raises(ValueError, match="holds w, b"):
        KVzapSurrogate({"w": w})


def test_kvzap_keeps_the_sinks_and_the_highest_predicted_keys():
    # one KV head, hidden 3: the surrogate reads channel 0; k = 8 / 4 = 2 rows
    surrogate = KVzapSurrogate({"w": torch.tensor([[[1.0], [0.0], [0.0]]]), "b": torch.zeros(1, 1)})
    cfg = CompressorConfig("kvzap", 4, chunk_size=8, num_layers=1, num_kv_heads=1, num_q_heads=1, head_dim=4,
                           dtype=torch.float32, num_sink_tokens=1)
    comp = KVzapCompressor(cfg, surrogate)
    h = torch.zeros(8, 3)
    h[[2, 6], 0] = torch.tensor([5.0, 3.0])
    h[:, 1] = 100.0  # channel 1 is not read
    k = torch.randn(8, 1, 4)
    kept = lambda pos: comp.compress(0, k, k, q=h, positions=pos)["idx"].t().tolist()  # noqa: E731
    assert kept(torch.arange(8, 16)) == [[2, 6]]
    assert kept(torch.arange(8)) == [[0, 2]]  # position 0 is a sink
    with pytest.raises(ValueError, match="needs the chunk's hidden states"):
        comp.compress(0, k, k, q=torch.zeros(8, 4), positions=torch.arange(8))


def test_a_checkpoint_without_a_surrogate_is_refused_with_the_recipe(tmp_path):
    cfg = CompressorConfig("kvzap", 4, chunk_size=8, num_layers=1, num_kv_heads=1, num_q_heads=1, head_dim=4,
                           kvzap_path=str(tmp_path / SURROGATE_FILE))
    comp = KVzapCompressor(cfg)  # the layout needs no surrogate
    assert comp.layout(0).rows == 2
    with pytest.raises(ValueError, match=r"has no KVzap surrogate .*recipes/kvzap/train.py --model-path"):
        comp.surrogate  # noqa: B018 (TwoTierKV reads it at startup)


def test_a_gguf_files_surrogate_sits_beside_it_named_after_it(tmp_path):
    gguf = str(tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf")
    path = surrogate_path(gguf)
    assert path == str(tmp_path / "kvzap" / "SmolLM2-135M-Instruct.Q4_1.safetensors")
    assert surrogate_owner(path) == gguf
    assert surrogate_path(str(tmp_path)) == str(tmp_path / SURROGATE_FILE)
    assert surrogate_owner(surrogate_path(str(tmp_path))) == str(tmp_path)
    cfg = CompressorConfig("kvzap", 4, chunk_size=8, num_layers=1, num_kv_heads=1, num_q_heads=1, head_dim=4,
                           kvzap_path=path)
    with pytest.raises(ValueError, match=re.escape(f"{gguf} has no KVzap surrogate ({path}); train one with "
                                                   f"`python recipes/kvzap/train.py --model-path {gguf}`")):
        KVzapCompressor(cfg).surrogate  # noqa: B018


def run(**server):
    """Request 0 greedy, request 1 seeded, in one batch."""
    sched = Scheduler(ServerArgs(model_path=bundled_model_path(), dtype="bfloat16", page_size=16,
                                 enable_deterministic_inference=True, **server))
    g = torch.Generator().manual_seed(5)
    batch = [torch.randint(3, 6000, (n,), generator=g).tolist() for n in (41, 50)]
    reqs = [make_request(f"r{i}", ids, seed=7 + i, return_logprob=True, max_new_tokens=NEW, ignore_eos=True,
                         **(SEEDED if i else {"temperature": 0.0})) for i, ids in enumerate(batch)]
    res = run_to_completion(sched, reqs)
    return [(res[r.rid].output_ids, res[r.rid].output_token_logprobs) for r in reqs], sched


def test_vericache_over_the_bundled_models_kvzap_equals_deterministic_full():
    full, _ = run()
    vc, sched = run(kv_compressor="kvzap", kv_compression_ratio=4, speculative_algorithm="VERICACHE",
                    speculative_num_draft_tokens="6", vericache_schedule="lockstep")
    assert vc == full
    assert sched.model_runner.capture_hidden and sched.two_tier.compressor.surrogate.hidden_size == 256
    assert sched.two_tier.segment_scope and sched.two_tier.compressor.head_adaptive  # --kv-head-budget auto
    assert sched.metrics.spec_rounds_total > 0
