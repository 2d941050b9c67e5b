"""--load-format dummy: a model built from config.json alone, with seeded random weights, that
serves like a loaded one (the device benchmark's 8B model has no checkpoint)."""

from __future__ import annotations

import shutil

import pytest
import torch

from sglang_vericache.managers.scheduler import Scheduler
from sglang_vericache.model_executor.model_runner import ModelRunner
from sglang_vericache.server_args import ServerArgs, prepare_server_args
from sglang_vericache.testing import make_random_checkpoint
from sglang_vericache.testing.scheduler_harness import greedy_outputs, random_prompts


@pytest.fixture(scope="module")
def config_only(tmp_path_factory) -> str:
    """A folder holding a random llama's config.json and nothing else."""
    ckpt = make_random_checkpoint("llama", str(tmp_path_factory.mktemp("ckpt") / "llama"))
    bare = tmp_path_factory.mktemp("bare")
    shutil.copy(f"{ckpt}/config.json", bare / "config.json")
    return str(bare)


def _runner(path: str, **kw) -> ModelRunner:
    return ModelRunner(ServerArgs(model_path=path, page_size=4, max_total_tokens=256, dtype="float32",
                                  skip_tokenizer_init=True, load_format="dummy", **kw))


def test_dummy_weights_are_seeded_and_shaped_like_hf_init(config_only):
    a, b, c = _runner(config_only), _runner(config_only), _runner(config_only, random_seed=1)
    pa, pb, pc = ({n: p.detach() for n, p in r.model.named_parameters()} for r in (a, b, c))
    assert pa.keys() == pb.keys() and len(pa) > 0
    for name, p in pa.items():
        assert torch.equal(p, pb[name]), name
        if name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p)), name
        else:
            assert p.dim() == 2 and not torch.equal(p, pc[name]), name
            assert abs(float(p.std()) - 0.02) < 0.002, name  # initializer_range, ~8k+ samples each
            assert abs(float(p.mean())) < 0.002, name


def test_dummy_model_serves_and_full_equals_vericache(config_only):
    """The whole runtime runs on it; VeriCache emits exactly what full mode does."""
    out = {}
    vericache = dict(kv_compressor="snapkv", speculative_algorithm="VERICACHE",
                     speculative_num_draft_tokens="3", vericache_schedule="lockstep")
    for mode, kw in (("full", {}), ("vericache", vericache)):
        sched = Scheduler(ServerArgs(model_path=config_only, dtype="float32", skip_tokenizer_init=True,
                                     page_size=8, load_format="dummy", **kw))
        out[mode] = greedy_outputs(sched, random_prompts([29, 17]), 12)
    assert [len(o) for o in out["full"]] == [12, 12]
    assert out["vericache"] == out["full"]
    assert all(len(set(o)) > 1 for o in out["full"])  # not one token repeated


def test_load_format_flag():
    assert prepare_server_args(["--load-format", "dummy"]).load_format == "dummy"
    with pytest.raises(ValueError, match="--load-format must be auto, safetensors, gguf or dummy"):
        ServerArgs(load_format="pt")
