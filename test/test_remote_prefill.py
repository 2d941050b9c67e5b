"""Remote prefix caching (--disagg-prefill verifier): the drafter moves compressed pages only.

Two documents of 48 tokens (6 pages of 8) are stored once, both tiers, by a single VeriCache
instance. Requests are a document + a question. The drafter takes each document's compressed pages
from the store the first time and from its CompressedPrefixCache after that; the verifier loads
the exact pages from its own store, prefills the question, and sends back the first token and the
exact KV of the question only. Outputs equal full mode (greedy and seeded); the KV that crossed to
the drafter is exactly the questions' KV; every pool is whole again when the requests are done.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time

import pytest
import requests
import torch

from sglang_vericache.disagg.verifier import VerifierServer
from sglang_vericache.managers.scheduler import Scheduler
from sglang_vericache.mem_cache.storage.hash_chain import page_keys
from sglang_vericache.server_args import ServerArgs
from sglang_vericache.testing.random_checkpoints import make_random_checkpoint
from sglang_vericache.testing.scheduler_harness import make_request, run_to_completion

P = 8
NEW = 24
DOC = 48
QUESTIONS = [13, 30, 5, 21]  # request i = docs[i % 2] + a question of this length
SAMPLING = {"temperature": 0.8, "top_p": 0.9, "top_k": 50}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def args(path, **kw) -> ServerArgs:
    return ServerArgs(model_path=path, dtype="float32", skip_tokenizer_init=True, page_size=P,
                      disagg_timeout=5.0, **kw)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_random_checkpoint("llama", str(tmp_path_factory.mktemp("llama")))


@pytest.fixture(scope="module")
def docs():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 400, (DOC,), generator=g).tolist() for _ in range(2)]


@pytest.fixture(scope="module")
def batch(docs):
    g = torch.Generator().manual_seed(2)
    return [docs[i % 2] + torch.randint(3, 400, (n,), generator=g).tolist() for i, n in enumerate(QUESTIONS)]


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory, llama, docs):
    """Both tiers of the documents' pages, written by one single-instance VeriCache run."""
    path = str(tmp_path_factory.mktemp("kvstore"))
    writer = Scheduler(args(llama, kv_compressor="int8", speculative_algorithm="VERICACHE",
                            vericache_schedule="lockstep", kv_store="file", kv_store_path=path))
    run_to_completion(writer, [make_request(f"w{i}", d, max_new_tokens=1) for i, d in enumerate(docs)])
    assert writer.prefix_store.stats["exact"].pages_written == 2 * DOC // P
    assert writer.prefix_store.stats["compressed"].pages_written == 2 * DOC // P
    return path


@pytest.fixture(scope="module")
def verifier(llama, store_dir):
    server = VerifierServer(args(llama, disagg_role="verifier", disagg_port=free_port(),
                                 kv_store="file", kv_store_path=store_dir))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.stop()
    thread.join(10)


def drafter(llama, verifier, **kw) -> Scheduler:
    d = Scheduler(args(llama, kv_compressor="int8", speculative_algorithm="VERICACHE",
                       speculative_num_draft_tokens="6", disagg_role="drafter", disagg_prefill="verifier",
                       verifier_addr=f"tcp://127.0.0.1:{verifier.args.disagg_port}", **kw))
    assert d.spec_worker.link.up
    return d


def run(sched, batch, tag, sampling=None, return_logprob=False, logprob_start_len=-1):
    sampling = sampling or {"temperature": 0.0}
    reqs = [make_request(f"{tag}{i}", ids, seed=100 + i, return_logprob=return_logprob, max_new_tokens=NEW,
                         ignore_eos=True, **sampling) for i, ids in enumerate(batch)]
    for r in reqs:
        r.logprob_start_len = logprob_start_len
    res = run_to_completion(sched, reqs)
    return [res[f"{tag}{i}"] for i in range(len(batch))]


@pytest.fixture(scope="module")
def full_greedy(llama, batch):
    return [r.output_ids for r in run(Scheduler(args(llama)), batch, "f")]


def assert_pools_whole(d: Scheduler) -> None:
    """Nothing held but the cache's pages: every exact slot free, chunks = free + cached pages."""
    assert d.allocator.available_size() == d.allocator.num_pages * P
    assert not d.remote_prefill.prefilling and not d.running and not d.waiting_queue
    assert all(p.ref == 0 for p in d.tree_cache.pages.values())
    pool = d.two_tier.pool
    assert pool.available_chunks() + len(d.tree_cache.pages) == pool.num_chunks


def test_greedy_equals_full_and_only_question_kv_crosses(llama, batch, verifier, full_greedy):
    d = drafter(llama, verifier, kv_store="file", kv_store_path=verifier.args.kv_store_path)
    # One at a time, so the second use of a document finds it in the drafter's cache.
    out = [run(d, [ids], f"g{i}")[0] for i, ids in enumerate(batch)]
    assert [r.output_ids for r in out] == full_greedy
    assert all(r.finished_reason == {"type": "length", "length": NEW} for r in out)
    st = d.remote_prefill.stats
    # Each document's 6 pages come from the store once, then from the cache; every request drafts
    # over its document's 6 compressed pages.
    assert st["store_pages_loaded"] == 2 * DOC // P
    assert st["prefix_pages"] == len(batch) * DOC // P
    assert [r.meta["compressed_prefix_tokens"] for r in out] == [DOC] * len(batch)
    assert d.prefix_store.stats["compressed"].bytes_read > 0
    assert "exact" not in d.prefix_store.stats  # the drafter never reads exact pages
    kv = d.model_runner.token_to_kv_pool
    assert st["kv_bytes_received"] == sum(QUESTIONS) * kv.bytes_per_token()
    assert st["prefills_applied"] == len(batch)
    assert_pools_whole(d)


def test_seeded_batch_equals_full_and_prefetch_moves_each_page_once(llama, batch, verifier):
    """All requests at once: their pages are fetched ahead of admission, and a request whose pages
    another's fetch is bringing waits for it, so each stored page crosses the slow link once."""
    full = [r.output_ids for r in run(Scheduler(args(llama)), batch, "fs", SAMPLING)]
    d = drafter(llama, verifier, kv_store="file", kv_store_path=verifier.args.kv_store_path)
    comp = d.prefix_store.comp
    stored = set()
    for ids in batch:
        keys = page_keys(ids[: (len(ids) - 1) // P * P], d.remote_prefill.namespace)
        stored.update(keys[: comp.match_prefix(keys)])
    out = run(d, batch, "s", SAMPLING)
    assert [r.output_ids for r in out] == full
    assert d.remote_prefill.stats["store_pages_loaded"] == len(stored) >= 2 * DOC // P
    assert d.prefix_store.stats["compressed"].pages_hit == len(stored)
    assert_pools_whole(d)


def test_without_a_store_the_verifier_sends_the_whole_prompt_once_per_document(llama, batch, verifier,
                                                                               full_greedy):
    """No store on the drafter: the first request of a document gets all its KV from the verifier;
    its folded pages are adopted by the cache, so the document's next request needs the question's
    KV only."""
    d = drafter(llama, verifier)
    out = [run(d, [ids], f"n{i}")[0] for i, ids in enumerate(batch)]
    assert [r.output_ids for r in out] == full_greedy
    assert [r.meta["compressed_prefix_tokens"] for r in out] == [0, 0, DOC, DOC]
    n = [len(ids) for ids in batch]
    # From position 0 for the first two; the last partial page is never adopted.
    expected = n[0] + n[1] + QUESTIONS[2] + QUESTIONS[3]
    assert d.remote_prefill.stats["kv_bytes_received"] == expected * d.model_runner.token_to_kv_pool.bytes_per_token()
    assert_pools_whole(d)


def test_logprobs_and_input_logprobs_come_from_the_verifier(llama, batch, verifier):
    full = run(Scheduler(args(llama)), batch[:2], "fl", return_logprob=True, logprob_start_len=DOC)
    d = drafter(llama, verifier)
    out = run(d, batch[:2], "l", return_logprob=True, logprob_start_len=DOC)
    for a, b, ids in zip(out, full, batch):
        assert a.output_ids == b.output_ids
        assert len(a.input_token_logprobs) == len(ids) - DOC
        assert [t for _, t in a.input_token_logprobs] == [t for _, t in b.input_token_logprobs]
        assert [t for _, t in a.output_token_logprobs] == [t for _, t in b.output_token_logprobs]
        torch.testing.assert_close(torch.tensor([lp for lp, _ in a.output_token_logprobs]),
                                   torch.tensor([lp for lp, _ in b.output_token_logprobs]), atol=1e-4, rtol=0)


def test_remote_prefill_flags_are_checked():
    with pytest.raises(ValueError, match="--disagg-prefill verifier is for --disagg-role drafter"):
        ServerArgs(model_path="x", disagg_prefill="verifier")
    with pytest.raises(ValueError, match="--disagg-prefill must be one of local, verifier"):
        ServerArgs(model_path="x", disagg_prefill="remote")
    with pytest.raises(ValueError, match="--disagg-bandwidth is for --disagg-role drafter"):
        ServerArgs(model_path="x", disagg_bandwidth="1GB")
    drafter_flags = dict(model_path="x", kv_compressor="int8", speculative_algorithm="VERICACHE",
                         disagg_role="drafter", verifier_addr="tcp://127.0.0.1:5")
    with pytest.raises(ValueError, match="--disagg-bandwidth"):
        ServerArgs(disagg_bandwidth="fast", **drafter_flags)
    assert ServerArgs(disagg_prefill="verifier", kv_store="file", **drafter_flags).kv_store_tier_set == ("compressed",)
    with pytest.raises(ValueError, match="can only be compressed"):
        ServerArgs(model_path="x", kv_compressor="int8", speculative_algorithm="VERICACHE", disagg_role="drafter",
                   verifier_addr="tcp://127.0.0.1:5", disagg_prefill="verifier", kv_store="file",
                   kv_store_tiers="both")


def test_verifier_gone_while_prefilling_fails_requests_and_frees_their_memory(llama, batch, store_dir):
    server = VerifierServer(args(llama, disagg_role="verifier", disagg_port=free_port(),
                                 kv_store="file", kv_store_path=store_dir))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    d = drafter(llama, server, kv_store="file", kv_store_path=store_dir)
    server.stop()  # before it answers any OpenSession
    thread.join(10)
    out = run(d, batch, "x")
    for r in out:
        assert r.finished_reason["type"] == "abort"
        assert "went away" in r.finished_reason["message"] or "not reachable" in r.finished_reason["message"]
    assert_pools_whole(d)


def test_disagg_bandwidth_delays_the_verifiers_kv_by_its_size(llama, batch, verifier, full_greedy):
    """--disagg-bandwidth: the KV the verifier sends is usable only once the drafter's link carried
    it, so the run lasts at least (bytes sent) / bandwidth; the output does not change. Equal to
    --kv-store-bandwidth, the store and the verifier share the drafter's one link."""
    store = dict(kv_store="file", kv_store_path=verifier.args.kv_store_path)
    free = drafter(llama, verifier, **store)
    run(free, batch, "b0")
    sent = free.remote_prefill.stats["kv_bytes_received"] + free.spec_worker.stats["round_kv_bytes"]
    rate = int(sent / 0.5)  # half a second of link time
    d = drafter(llama, verifier, disagg_bandwidth=str(rate), kv_store_bandwidth=str(rate), **store)
    assert d.spec_worker.rx_link is None
    t0 = time.perf_counter()
    out = run(d, batch, "b1")
    wall = time.perf_counter() - t0
    assert [r.output_ids for r in out] == full_greedy
    assert d.remote_prefill.stats["kv_bytes_received"] + d.spec_worker.stats["round_kv_bytes"] == sent
    assert d.spec_worker.rx_link is d.prefix_store.store.link  # one link for the store and the verifier
    assert wall >= sent / rate
    assert_pools_whole(d)


def test_http_drafter_with_remote_prefill_serves_full_mode_text(tmp_path, server):
    """launch_server end to end: a verifier process and an HTTP drafter with --disagg-prefill
    verifier answer /generate (plain and streamed) with full mode's tokens; the second prompt on
    the same document drafts over the document's cached compressed pages."""
    from sglang_vericache.server_args import bundled_model_path

    model, store = bundled_model_path(), str(tmp_path / "store")
    port = free_port()
    verifier_proc = subprocess.Popen(
        [sys.executable, "-m", "sglang_vericache.launch_server", "--model-path", model, "--dtype", "float32",
         "--disagg-role", "verifier", "--disagg-port", str(port), "--kv-store", "file", "--kv-store-path", store],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert "verifier ready" in verifier_proc.stdout.readline()
        drafter_srv = server(model, "--dtype", "float32", "--kv-compressor", "int8", "--speculative-algorithm",
                             "VERICACHE", "--disagg-role", "drafter", "--verifier-addr", f"tcp://127.0.0.1:{port}",
                             "--disagg-prefill", "verifier", "--kv-store", "file", "--kv-store-path", store)
        full_srv = server(model, "--dtype", "float32")
        doc = "".join(f"def f{i}(x):\n    return x * {i} + {i * i}\n\n" for i in range(24))
        prompts = [doc + "def main():\n", doc + "class Point:\n"]
        params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
        for i, text in enumerate(prompts):
            body = {"text": text, "sampling_params": params}
            want = requests.post(full_srv.base_url + "/generate", json=body, timeout=120).json()
            got = requests.post(drafter_srv.base_url + "/generate", json=body, timeout=120).json()
            assert got["output_ids"] == want["output_ids"], drafter_srv.log_tail()
            assert got["text"] == want["text"]
            # The second prompt shares 385 tokens with the first: 24 whole pages of 16, adopted
            # from the first request's prefill.
            assert got["meta_info"]["compressed_prefix_tokens"] == [0, 24 * 16][i]
            streamed = ""
            with requests.post(drafter_srv.base_url + "/generate", json={**body, "stream": True}, stream=True,
                               timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith(b"data: ") and line != b"data: [DONE]":
                        streamed = json.loads(line[6:])["text"]
            assert streamed == want["text"]
        info = requests.get(drafter_srv.base_url + "/server_info", timeout=30).json()
        assert info["disagg"] == {"role": "drafter", "verifier_addr": f"tcp://127.0.0.1:{port}",
                                  "prefill": "verifier", "bandwidth": None}
        metrics = requests.get(drafter_srv.base_url + "/metrics", timeout=30).text
        values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1])
                  for line in metrics.splitlines() if line.startswith("sglang:remote_")}
        assert values["sglang:remote_prefills_total"] == 4  # two prompts, plain and streamed
        assert values["sglang:remote_prefill_pending"] == 0
    finally:
        verifier_proc.terminate()
        verifier_proc.wait(30)
