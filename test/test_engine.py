"""The in-process Engine (like sglang.Engine): sync and async generate, streaming, shutdown."""

from __future__ import annotations

import asyncio
import itertools
import sys
import time

import pytest

import sglang_vericache

PROMPT = "def return import class self value"
GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(default_model_dir):
    eng = sglang_vericache.Engine(model_path=default_model_dir, max_total_tokens=4096, stream_interval=3)
    yield eng
    eng.shutdown()


def test_importing_the_package_does_not_import_torch():
    import subprocess

    code = "import sys, sglang_vericache; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False).stdout
    assert out.strip() == "False"


def test_generate_single_prompt(engine):
    out = engine.generate(PROMPT, GREEDY)
    assert len(out["output_ids"]) == 6
    assert out["text"] == engine.tokenizer.decode(out["output_ids"], skip_special_tokens=True)
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    assert out["meta_info"]["prompt_tokens"] == len(engine.tokenizer.encode(PROMPT))


def test_generate_list_returns_a_list(engine):
    outs = engine.generate([PROMPT, "while if else"], GREEDY)
    assert isinstance(outs, list) and len(outs) == 2
    assert outs[0]["output_ids"] == engine.generate(PROMPT, GREEDY)["output_ids"]


def test_generate_from_input_ids_with_logprobs(engine):
    ids = engine.tokenizer.encode(PROMPT)
    out = engine.generate(
        input_ids=ids, sampling_params=GREEDY, return_logprob=True, logprob_start_len=0, top_logprobs_num=2
    )
    meta = out["meta_info"]
    assert [e[1] for e in meta["input_token_logprobs"]] == ids
    assert [e[1] for e in meta["output_token_logprobs"]] == out["output_ids"]
    assert len(meta["output_top_logprobs"]) == 6


def test_stream_yields_cumulative_chunks(engine):
    full = engine.generate(PROMPT, GREEDY)
    chunks = list(engine.generate(PROMPT, GREEDY, stream=True))
    assert len(chunks) >= 2
    for prev, cur in itertools.pairwise(chunks):
        assert cur["text"].startswith(prev["text"])
    assert chunks[-1]["text"] == full["text"] and chunks[-1]["output_ids"] == full["output_ids"]


def test_stream_interval_groups_tokens_into_events(engine):
    params = {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True}
    counts = [c["meta_info"]["completion_tokens"] for c in engine.generate(PROMPT, params, stream=True)]
    assert counts[0] >= 1 and counts[-1] == 20
    # --stream-interval 3: after the first token, a running event carries at least 3 new tokens.
    assert all(b - a >= 3 for a, b in itertools.pairwise(counts[:-1]))
    assert len(counts) <= 1 + 19 // 3 + 1


def test_bad_input_raises_value_error(engine):
    with pytest.raises(ValueError, match="temperature"):
        engine.generate(PROMPT, {"temperature": -1})
    with pytest.raises(ValueError, match="empty"):
        engine.generate("", GREEDY)


def test_async_generate_and_async_stream(engine):
    async def run():
        single = await engine.async_generate(PROMPT, GREEDY)
        both = await asyncio.gather(
            engine.async_generate(PROMPT, GREEDY), engine.async_generate("while if else", GREEDY)
        )
        chunks = [c async for c in await engine.async_generate(PROMPT, GREEDY, stream=True)]
        return single, both, chunks

    single, both, chunks = asyncio.run(run())
    assert single["output_ids"] == both[0]["output_ids"] == chunks[-1]["output_ids"]
    assert both[1]["meta_info"]["prompt_tokens"] == len(engine.tokenizer.encode("while if else"))


def test_abandoning_a_stream_aborts_the_request(engine):
    before = engine.get_server_info()["internal_states"][0]["num_generation_tokens_total"]
    params = {"max_new_tokens": 1500, "temperature": 0, "ignore_eos": True}
    stream = engine.generate(PROMPT, params, stream=True)
    next(stream)
    stream.close()  # aborts in the scheduler, which frees the request's KV
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        info = engine.get_server_info()["internal_states"][0]
        if info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0:
            break
        time.sleep(0.1)
    assert info["num_running_reqs"] == 0
    assert info["num_generation_tokens_total"] - before < 1500
    assert engine.flush_cache()


def test_shutdown_stops_the_scheduler_and_context_manager(default_model_dir):
    with sglang_vericache.Engine(model_path=default_model_dir, max_total_tokens=1024) as eng:
        proc = eng.tokenizer_manager.scheduler_proc
        assert eng.generate(PROMPT, GREEDY)["meta_info"]["completion_tokens"] == 6
    assert not proc.is_alive()
    with pytest.raises(RuntimeError, match="shut down"):
        eng.generate(PROMPT, GREEDY)


def test_missing_model_folder_raises(tmp_path):
    with pytest.raises(FileNotFoundError, match="model folder not found"):
        sglang_vericache.Engine(model_path=str(tmp_path / "nope"))
