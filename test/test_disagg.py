"""Dual-instance VeriCache (disagg/): a drafter Scheduler verifying on a verifier over ZMQ tcp.

The output equals full mode (greedy and seeded sampling, ragged prompts, page_size 8); the drafter
drafts other requests while a verification is in flight; a killed verifier ends every request with
either the exact output or a clear error, in bounded time, and a restarted one serves new requests;
a drafter that goes silent loses its sessions on the verifier.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch
import zmq

from sglang_vericache.disagg.messages import Hello, OpenSession, Pong
from sglang_vericache.disagg.verifier import VerifierServer
from sglang_vericache.disagg.wire import Codec
from sglang_vericache.managers.io_struct import SchedulerError
from sglang_vericache.managers.scheduler import Scheduler
from sglang_vericache.server_args import ServerArgs
from sglang_vericache.testing.random_checkpoints import make_random_checkpoint
from sglang_vericache.testing.scheduler_harness import make_request, run_to_completion

P = 8
NEW = 32
LENS = [40, 71, 9, 100, 23]
TIMEOUT = 2.0  # --disagg-timeout of every instance here
SAMPLING = {"temperature": 0.8, "top_p": 0.9, "top_k": 50}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def args(path, **kw) -> ServerArgs:
    return ServerArgs(model_path=path, dtype="float32", skip_tokenizer_init=True, page_size=P,
                      disagg_timeout=TIMEOUT, **kw)


def drafter(path, port, compressor="streamingllm") -> Scheduler:
    d = Scheduler(args(path, kv_compressor=compressor, speculative_algorithm="VERICACHE",
                       speculative_num_draft_tokens="6", disagg_role="drafter",
                       verifier_addr=f"tcp://127.0.0.1:{port}"))
    wait_up(d)
    return d


def wait_up(d: Scheduler, not_epoch: int | None = None, limit_s: float = 60.0) -> int:
    """Steps d's link until a verifier (other than not_epoch) answers; -> its epoch."""
    link, deadline = d.spec_worker.link, time.monotonic() + limit_s
    while not (link.up and link.epoch != not_epoch):
        assert time.monotonic() < deadline, "the verifier never answered"
        d.spec_worker.poll_verifier()
        time.sleep(0.02)
    return link.epoch


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_random_checkpoint("llama", str(tmp_path_factory.mktemp("llama")))


@pytest.fixture(scope="module")
def batch():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 400, (n,), generator=g).tolist() for n in LENS]


@pytest.fixture(scope="module")
def verifier(llama):
    """A verifier in a thread of this process, on a loopback port."""
    server = VerifierServer(args(llama, disagg_role="verifier", disagg_port=free_port()))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.stop()
    thread.join(10)


def requests(batch, tag, sampling=None, new=NEW):
    sampling = sampling or {"temperature": 0.0}
    return [make_request(f"{tag}{i}", ids, seed=100 + i, max_new_tokens=new, ignore_eos=True, **sampling)
            for i, ids in enumerate(batch)]


def run(sched, batch, tag="r", sampling=None):
    res = run_to_completion(sched, requests(batch, tag, sampling))
    return [res[f"{tag}{i}"] for i in range(len(batch))]


@pytest.fixture(scope="module")
def full_greedy(llama, batch):
    return [r.output_ids for r in run(Scheduler(args(llama)), batch)]


@pytest.fixture(scope="module")
def full_sampled(llama, batch):
    return [r.output_ids for r in run(Scheduler(args(llama)), batch, sampling=SAMPLING)]


def test_greedy_equals_full_and_drafts_while_verifying(llama, batch, verifier, full_greedy):
    d = drafter(llama, verifier.args.disagg_port)
    w = d.spec_worker
    w.trace = []
    out = run(d, batch)
    assert [r.output_ids for r in out] == full_greedy
    assert all(r.finished_reason == {"type": "length", "length": NEW} for r in out)
    # Every emitted token after the first came from a remote round.
    assert sum(r.meta["spec_rounds"] + r.meta["spec_accepted_tokens"] for r in out) == len(batch) * (NEW - 1)
    assert w.stats["runs_sent"] == w.stats["results_applied"] == d.metrics.spec_rounds_total
    assert w.stats["requests_failed"] == 0 and not w.sessions and not w.inflight
    # Staggering: some draft forward ran between a request's VerifyRun and its result, for others.
    overlapped = 0
    for k, (t, event, rids) in enumerate(w.trace):
        if event != "send":
            continue
        end = next(i for i in range(k + 1, len(w.trace))
                   if w.trace[i][1] == "result" and w.trace[i][2] == rids)
        overlapped += any(e == "draft" and rids[0] not in rs for _, e, rs in w.trace[k + 1 : end])
    assert overlapped > 0
    assert w.stats["draft_forwards_while_inflight"] > 0


def test_seeded_sampling_equals_full_with_in_process_acceptance(llama, batch, verifier, full_sampled):
    """int8 drafts accept most tokens; the same rounds and acceptance as single-instance VeriCache
    show that the drafter's tail is the verifier's exact KV."""
    d = drafter(llama, verifier.args.disagg_port, compressor="int8")
    d.spec_worker.stagger = False  # rounds of the same lengths as single-instance VeriCache
    out = run(d, batch, sampling=SAMPLING)
    assert [r.output_ids for r in out] == full_sampled
    single = run(Scheduler(args(llama, kv_compressor="int8", speculative_algorithm="VERICACHE",
                                speculative_num_draft_tokens="6", vericache_schedule="lockstep")),
                 batch, sampling=SAMPLING)
    for key in ("spec_rounds", "spec_drafted_tokens", "spec_accepted_tokens"):
        assert [r.meta[key] for r in out] == [r.meta[key] for r in single]
    assert sum(r.meta["spec_accepted_tokens"] for r in out) > len(batch) * NEW // 2


def test_logprobs_come_from_the_verifier(llama, batch, verifier):
    full = Scheduler(args(llama))
    d = drafter(llama, verifier.args.disagg_port)

    def reqs():
        return [make_request("lp", batch[1], max_new_tokens=12, ignore_eos=True, temperature=0.0,
                             return_logprob=True)]

    want = run_to_completion(full, reqs())["lp"].output_token_logprobs
    got = run_to_completion(d, reqs())["lp"].output_token_logprobs
    assert [t for _, t in got] == [t for _, t in want]
    assert [lp for lp, _ in got] == pytest.approx([lp for lp, _ in want], abs=1e-4)


def test_constrained_request_is_refused_with_400(llama, batch, verifier):
    d = drafter(llama, verifier.args.disagg_port)
    err = d.handle_message(make_request("c", batch[0], max_new_tokens=4, regex="[0-9]+"))
    assert isinstance(err, SchedulerError) and err.status_code == 400
    assert "not supported in the dual-instance mode" in err.message


def test_silent_drafter_loses_its_sessions(llama, batch, verifier):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, b"ghost")
    sock.connect(f"tcp://127.0.0.1:{verifier.args.disagg_port}")
    wire = Codec()  # the verifier's wire format (disagg/wire.py), as a drafter speaks it
    sock.send_multipart(wire.encode(Hello("ghost")))
    assert sock.poll(10_000)
    pong = wire.decode(sock.recv_multipart())
    assert isinstance(pong, Pong) and pong.epoch == verifier.epoch
    epoch = pong.epoch
    params = requests(batch[:2], "g")
    for p in params:
        sock.send_multipart(wire.encode(OpenSession(p.rid, p.input_ids, p.sampling_params, p.seed, epoch=epoch)))
    sched = verifier.sched
    deadline = time.monotonic() + 20
    while verifier.stats["sessions_dropped"] < 2:  # opened, prefilled, then dropped after TIMEOUT
        assert time.monotonic() < deadline, "the verifier kept a silent drafter's sessions"
        time.sleep(0.05)
    sock.close(0)
    ctx.term()
    deadline = time.monotonic() + 20
    ghost = b"ghost".hex()
    while any(k.startswith(ghost) for k in list(verifier.sessions)) or sched.tree_cache.protected_size():
        assert time.monotonic() < deadline, "the verifier kept a dropped drafter's sessions"
        time.sleep(0.05)  # a later verifier iteration releases them
    assert sched.allocator.available_size() + sched.tree_cache.evictable_size() == sched.allocator.size


def start_verifier(path, port) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "sglang_vericache.launch_server", "--model-path", path, "--dtype", "float32",
           "--skip-tokenizer-init", "--page-size", str(P), "--disagg-role", "verifier",
           "--disagg-port", str(port),
           "--disagg-timeout", str(TIMEOUT), "--max-total-tokens", "8192", "--num-threads", "1",
           "--log-level", "warning"]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=os.environ.copy())


def test_killed_verifier_process_fails_cleanly_and_a_new_one_serves(llama, batch, full_greedy):
    port = free_port()
    proc = start_verifier(llama, port)
    try:
        d = drafter(llama, port)
        first_epoch = d.spec_worker.link.epoch
        for r in requests(batch, "k", new=NEW):
            assert d.handle_message(r) is None
        out = {f"k{i}": {"ids": [], "reason": None} for i in range(len(batch))}

        def step():
            d.step()
            emitted, d.outbox = d.outbox, []
            for e in emitted:
                out[e.rid]["ids"] += e.new_output_ids
                out[e.rid]["reason"] = e.finished_reason or out[e.rid]["reason"]

        deadline = time.monotonic() + 60
        while d.spec_worker.stats["results_applied"] < 3:
            assert time.monotonic() < deadline, "no verification result came back"
            step()
        proc.kill()
        killed = time.monotonic()
        while not all(o["reason"] for o in out.values()):
            assert time.monotonic() - killed < TIMEOUT + 10, "requests hung after the verifier died"
            step()
        gone = f"verifier at tcp://127.0.0.1:{port} went away"
        for i, o in enumerate(out.values()):
            assert o["ids"] == full_greedy[i][: len(o["ids"])]  # whatever was streamed is exact
            if o["reason"]["type"] == "abort":
                assert o["reason"]["message"].startswith(gone)
            else:
                assert o["ids"] == full_greedy[i]
        assert any(o["reason"]["type"] == "abort" for o in out.values())
        # A request while it is down is refused at once (503), never queued.
        err = d.handle_message(requests(batch[:1], "down")[0])
        assert isinstance(err, SchedulerError) and err.status_code == 503

        # Restarted on the same port (in this process: one subprocess start is enough for the test).
        second = VerifierServer(args(llama, disagg_role="verifier", disagg_port=port))
        thread = threading.Thread(target=second.serve_forever, daemon=True)
        thread.start()
        assert wait_up(d, not_epoch=first_epoch) == second.epoch
        again = run(d, batch, tag="a")
        assert [r.output_ids for r in again] == full_greedy
        second.stop()
        thread.join(10)
    finally:
        proc.kill()
        proc.wait(10)


def test_restarted_verifier_fails_held_requests_then_serves(llama, batch, full_greedy):
    port = free_port()
    first = VerifierServer(args(llama, disagg_role="verifier", disagg_port=port))
    thread = threading.Thread(target=first.serve_forever, daemon=True)
    thread.start()
    # Loaded ahead, so the restart is fast (the drafter sees the new epoch before its timeout).
    second_sched = Scheduler(args(llama, disagg_role="verifier", disagg_port=port))
    d = drafter(llama, port)
    for r in requests(batch, "h"):
        assert d.handle_message(r) is None
    while d.spec_worker.stats["results_applied"] < 2 or not d.spec_worker.inflight:
        d.step()
    first.stop()
    thread.join(10)
    second = VerifierServer(second_sched.server_args, scheduler=second_sched)
    thread = threading.Thread(target=second.serve_forever, daemon=True)
    thread.start()
    try:
        started = time.monotonic()
        outs = {}
        while len(outs) < len(batch):
            assert time.monotonic() - started < TIMEOUT + 10
            d.step()
            outs.update({e.rid: e.finished_reason for e in d.outbox if e.finished_reason})
            d.outbox = []
        gone = f"verifier at tcp://127.0.0.1:{port} went away"
        # Held sessions fail when the new epoch answers (runs sent in the gap: when the send fails).
        assert all(f["type"] == "abort" and f["message"].startswith(gone) for f in outs.values())
        assert f"{gone} (it restarted)" in [f["message"] for f in outs.values()]
        assert d.spec_worker.link.epoch == second.epoch != first.epoch
        assert [r.output_ids for r in run(d, batch, tag="n")] == full_greedy
    finally:
        second.stop()
        thread.join(10)


@pytest.mark.parametrize("kwargs, message", [
    ({"disagg_role": "drafter"}, "--disagg-role drafter needs --verifier-addr"),
    ({"disagg_role": "drafter", "verifier_addr": "localhost:5000"},
     "--verifier-addr must look like tcp://HOST:PORT"),
    ({"disagg_role": "drafter", "verifier_addr": "tcp://h:1"}, "needs --speculative-algorithm VERICACHE"),
    ({"disagg_role": "verifier"}, "--disagg-role verifier needs --disagg-port"),
    ({"disagg_role": "verifier", "disagg_port": 5000, "kv_compressor": "int8"}, "keeps exact KV only"),
    ({"verifier_addr": "tcp://h:1"}, "--verifier-addr is for --disagg-role drafter"),
    ({"disagg_port": 5000}, "--disagg-port is for --disagg-role verifier"),
    ({"disagg_role": "both"}, "--disagg-role must be one of none, drafter, verifier"),
    ({"disagg_role": "drafter", "verifier_addr": "tcp://h:1", "kv_compressor": "int8",
      "speculative_algorithm": "VERICACHE", "link_bandwidth": "1GB"}, "verifies remotely"),
])
def test_bad_disagg_flags_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ServerArgs(skip_tokenizer_init=True, **kwargs)


def test_query_scored_compressor_is_refused_on_the_drafter(llama, verifier):
    with pytest.raises(ValueError, match="--kv-compressor snapkv: it scores pages with the verify pass"):
        drafter(llama, verifier.args.disagg_port, compressor="snapkv")
