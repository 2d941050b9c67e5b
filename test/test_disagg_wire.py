"""The drafter <-> verifier wire format (disagg/wire.py): no pickle, typed headers, checked tensor
frames, optional HMAC, a version handshake.

Every message type round-trips exactly (bfloat16 tensors included). Hostile frames sent to a live
verifier's socket (a pickle payload that would create a file, truncated frames, random bytes, an
unknown version or message type, a tensor header that lies about its size, a missing or wrong HMAC)
are dropped and logged once per peer; the verifier keeps serving and a drafter verifying through it
meanwhile gets exactly full mode's outputs. Peers of different protocol versions refuse each other
with an error naming both versions.
"""

from __future__ import annotations

import functools
import logging
import pickle
import random
import threading
import time
import typing

import msgspec
import pytest
import torch
import zmq
from test_disagg import args, batch, free_port, full_greedy, llama, requests, run, wait_up  # noqa: F401

from sglang_vericache.disagg import messages as m
from sglang_vericache.disagg import verifier_link
from sglang_vericache.disagg.verifier import VerifierServer
from sglang_vericache.disagg.messages import TO_DRAFTER, TO_VERIFIER
from sglang_vericache.disagg.wire import PROTOCOL_VERSION, Codec, Header, VersionMismatch, WireError
from sglang_vericache.managers.io_struct import SchedulerError
from sglang_vericache.managers.scheduler import Scheduler
from sglang_vericache.sampling.sampling_params import SamplingParams
from sglang_vericache.server_args import ServerArgs

SECRET = "test-secret-0123"


def message_fields(cls) -> tuple[str, ...]:
    """The field names of a messages.py message."""
    return cls.__struct_fields__


def poll_until(cond, what: str, limit_s: float = 20.0) -> None:
    deadline = time.monotonic() + limit_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


# ---------------------------------------------------------------- round trip


def bf16(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


SP = SamplingParams(max_new_tokens=7, temperature=0.7, top_p=0.9, top_k=40, stop=["\n"], stop_token_ids=[2],
                    logit_bias={"5": -1.5}, sampling_seed=123)
MESSAGES = [
    m.Hello("drafter-1-2", 0),
    m.Hello("drafter-1-2", (1 << 62) - 1),
    m.OpenSession("r0", [1, 2, 3, 399], SP, 2**40 + 3, True, 5, 77, None, -1),
    m.OpenSession("r1", [9] * 17, SamplingParams(), 0, epoch=3, kv_from=16, logprob_start_len=4),
    m.VerifyRun("r0", 12, 3, [5, 6, 7], 77),
    m.CloseSession("r0", 77),
    m.Pong(77, 3),
    m.Refused(77, "no"),
    m.PrefillResult("r1", 77, 42, -0.25, [(-0.25, 42), (-1.5, 7)], [(None, 9), (-2.0, 9)],
                    [None, [(-0.5, 1)]],
                    bf16(2, 3, 2, 4), bf16(2, 3, 2, 4, seed=1), {"x": 1.5}),
    m.PrefillResult("r2", 77, -1),
    m.VerifyResult("r0", 12, 77, 2, 8, [-0.1, -0.2, float("-inf")],
                   ([[-0.1], [-0.2], [-0.3]], [[5], [6], [8]]),
                   torch.randn(2, 3, 1, 4), torch.randn(2, 3, 1, 4).half()),
    m.VerifyResult("r0", -1, 77, k=torch.zeros(2, 0, 1, 4, dtype=torch.bfloat16),
                   v=torch.zeros(2, 0, 1, 4, dtype=torch.bfloat16), error="out of sync"),
]


def assert_same(got, want) -> None:
    assert type(got) is type(want)
    for name in message_fields(type(want)):
        a, b = getattr(got, name), getattr(want, name)
        if isinstance(b, torch.Tensor):
            assert isinstance(a, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))  # bit for bit (NaNs too)
        else:
            assert a == b and type(a) is type(b), name


def test_the_wire_carries_every_message_declared_once():
    in_messages = {v for v in vars(m).values()
                   if isinstance(v, type) and v.__module__ == m.__name__ and v is not m.Message}
    assert set(TO_VERIFIER) | set(TO_DRAFTER) == in_messages
    assert set(typing.get_type_hints(Header)["msg"].__args__) == in_messages  # the header's union: these only


@pytest.mark.parametrize("secret", [None, SECRET])
@pytest.mark.parametrize("msg", MESSAGES, ids=lambda x: type(x).__name__)
def test_every_message_round_trips_exactly(msg, secret):
    codec = Codec(secret)
    frames = [bytes(f) for f in codec.encode(msg)]
    n_tensors = sum(getattr(msg, f, None) is not None for f in ("k", "v"))
    assert len(frames) == 1 + n_tensors + (secret is not None)
    header = msgspec.msgpack.decode(frames[0])  # plain data: a version, a type name, fields
    assert header["v"] == PROTOCOL_VERSION and header["msg"]["type"] == type(msg).__name__
    got = codec.decode(frames)
    assert_same(got, msg)
    for name in ("k", "v"):
        t = getattr(got, name, None)
        if t is not None and t.numel():
            t.add_(1)  # owned, writable memory (no warning, the frame is untouched)
            assert_same(codec.decode(frames), msg)


# ---------------------------------------------------------------- hostile frames


class CreatesFile:
    """Unpickling this creates `path` (what a crafted frame could do to a pickle.loads verifier)."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def header(msg: dict, v=PROTOCOL_VERSION) -> bytes:
    return msgspec.msgpack.encode({"v": v, "msg": msg})


def hostile_cases(tmp_path) -> dict[str, tuple[list[list[bytes]], str]]:
    """peer name -> (the messages it sends, what the verifier's log line for it says)."""
    hello = [bytes(f) for f in Codec().encode(m.Hello("x"))]
    result = {"type": "PrefillResult", "rid": "r", "epoch": 1, "token": 3,
              "k": ["float32", [2, 3]], "v": None}
    rng = random.Random(0)
    return {
        "pickle": ([[pickle.dumps(CreatesFile(tmp_path / "pwned"))]], "a header that does not decode"),
        "pickle-multipart": ([[pickle.dumps(CreatesFile(tmp_path / "pwned")), b"x" * 24]],
                             "a header that does not decode"),
        "truncated": ([[hello[0][: len(hello[0]) // 2]], [b""]], "a header that does not decode"),
        "random": ([[rng.randbytes(rng.randrange(1, 300))] for _ in range(40)],
                   "a header that does not decode"),
        "empty-frame": ([[b""]], "a header that does not decode (Input data was truncated)"),
        "unknown-version": ([[header({"type": "Hello", "drafter_id": "x"}, v=99)]],
                            "disagg wire protocol version 99, expected version 1"),
        "no-version": ([[msgspec.msgpack.encode({"msg": {"type": "Hello", "drafter_id": "x"}})]],
                       "a header without a protocol version"),
        "unknown-type": ([[header({"type": "Exec", "code": "import os; os.system('touch x')"})]],
                         "Invalid value 'Exec' - at `$.msg.type`"),
        "class-field": ([[header({"type": "Hello", "drafter_id": "x", "__class__": "os.system"})]],
                        "Object contains unknown field `__class__` - at `$.msg`"),
        "wrong-types": ([[header({"type": "VerifyRun", "rid": "r", "round_id": 0, "output_len": 1,
                                  "tokens": [-5]})]], "Expected `int` >= 0 - at `$.msg.tokens[0]`"),
        "size-lie": ([[header(result), b"\0" * 25]],
                     "a float32 tensor of shape [2, 3] is 24 bytes; its frame has 25"),
        "truncated-tensor": ([[header(result), b"\0" * 23]],
                             "a float32 tensor of shape [2, 3] is 24 bytes; its frame has 23"),
        "missing-tensor": ([[header(result)]], "0 tensor frames for the 1 tensors its header names"),
        "bad-dtype": ([[header({**result, "k": ["object", [1]]}), b"\0" * 8]],
                      "tensor dtype 'object' is not one of float32"),
        "wrong-direction": ([[bytes(f) for f in Codec().encode(m.Pong(1))]],
                            "a Pong, which this side never receives"),
        "hmac-on-open-port": ([[bytes(f) for f in Codec(SECRET).encode(m.Hello("x"))]],
                              "1 tensor frames for the 0 tensors its header names (an HMAC? this side has no "
                              "--disagg-secret)"),
    }


def hmac_cases(tmp_path) -> dict[str, tuple[list[list[bytes]], str]]:
    good = [bytes(f) for f in Codec(SECRET).encode(m.Hello("x"))]
    tampered = [bytes([good[0][0]]) + good[0][1:-1] + bytes([good[0][-1] ^ 1]), good[1]]
    return {
        "no-hmac": ([[bytes(f) for f in Codec().encode(m.Hello("x"))]],
                    "no HMAC (this side has a --disagg-secret)"),
        "wrong-secret": ([[bytes(f) for f in Codec("another-secret").encode(m.Hello("x"))]], "a wrong HMAC"),
        "tampered": ([tampered], "a wrong HMAC"),
        "pickle-with-mac-sized-tail": ([[pickle.dumps(CreatesFile(tmp_path / "pwned")), b"\0" * 32]],
                                       "a wrong HMAC"),
        "other-version-unauthenticated": ([[header({"type": "Hello", "drafter_id": "x"}, v=99), b"\0" * 32]],
                                          "a wrong HMAC"),
    }


def test_codec_refuses_each_hostile_frame_with_its_reason(tmp_path):
    for cases, codec in ((hostile_cases(tmp_path), Codec(accept=TO_VERIFIER)),
                         (hmac_cases(tmp_path), Codec(SECRET))):
        for name, (messages, reason) in cases.items():
            for frames in messages:
                with pytest.raises(WireError) as e:
                    codec.decode(frames)
                assert reason in str(e.value), name
    with pytest.raises(WireError, match="an empty message"):
        Codec().decode([])
    assert not (tmp_path / "pwned").exists()
    pickle.loads(pickle.dumps(CreatesFile(tmp_path / "proof")))  # the payload is live under pickle
    assert (tmp_path / "proof").exists()


def drafter_sched(llama, addr, **kw) -> Scheduler:
    return Scheduler(args(llama, kv_compressor="streamingllm", speculative_algorithm="VERICACHE",
                          speculative_num_draft_tokens="6", disagg_role="drafter", verifier_addr=addr, **kw))


def start(server: VerifierServer) -> threading.Thread:
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    return thread


def attack(server: VerifierServer, thread: threading.Thread, cases, caplog, step) -> dict[str, zmq.Socket]:
    """Sends every case from its own peer, one at a time; after each, the verifier dropped exactly those
    frames, logged one line for that peer (with the case's reason) and is still serving."""
    socks = {}
    for name, (messages, reason) in cases.items():
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTING_ID, f"evil-{name}".encode())
        sock.connect(server.addr)
        socks[name] = sock
        before = server.stats["frames_dropped"]
        for frames in messages:
            sock.send_multipart(frames)
        want = before + len(messages)
        deadline = time.monotonic() + 20
        while server.stats["frames_dropped"] < want:
            assert time.monotonic() < deadline, f"{name}: frames not dropped"
            step()
        assert server.stats["frames_dropped"] == want, name
        assert thread.is_alive(), name
        lines = [r.getMessage() for r in caplog.records if f"peer {sock.getsockopt(zmq.ROUTING_ID).hex()}:"
                 in r.getMessage()]
        assert len(lines) == 1 and reason in lines[0], (name, lines)
    return socks


def run_while_attacked(d: Scheduler, server, thread, cases, caplog, batch, tag):
    """A drafter's requests, with every hostile case sent while its rounds are in flight."""
    for r in requests(batch, tag):
        assert d.handle_message(r) is None
    out = {f"{tag}{i}": [] for i in range(len(batch))}
    done = {}

    def step():
        d.step()
        for e in d.outbox:
            out[e.rid] += e.new_output_ids
            if e.finished_reason:
                done[e.rid] = e.finished_reason
        d.outbox = []

    poll_until(lambda: step() or d.spec_worker.stats["results_applied"] >= 2, "no round came back", 60)
    socks = attack(server, thread, cases, caplog, step)
    poll_until(lambda: step() or len(done) == len(batch), "the drafter's requests did not finish", 120)
    assert all(f["type"] == "length" for f in done.values()), done
    return [out[f"{tag}{i}"] for i in range(len(batch))], socks


@pytest.fixture
def warn_log(caplog):
    caplog.set_level(logging.WARNING, logger="sglang_vericache.disagg")
    return caplog


def test_hostile_frames_are_dropped_and_the_verifier_keeps_serving(llama, batch, full_greedy, tmp_path,
                                                                   warn_log):
    server = VerifierServer(args(llama, disagg_role="verifier", disagg_port=free_port()))
    thread = start(server)
    try:
        assert any("is unauthenticated (no --disagg-secret" in r.getMessage() for r in warn_log.records)
        d = drafter_sched(llama, server.addr)
        wait_up(d)
        outs, socks = run_while_attacked(d, server, thread, hostile_cases(tmp_path), warn_log, batch, "h")
        assert outs == full_greedy
        assert not (tmp_path / "pwned").exists()
        # Another version is told so (in this verifier's version, naming both); nothing else is answered.
        frames = socks["unknown-version"].recv_multipart()
        with pytest.raises(VersionMismatch):
            Codec(version=99).decode(frames)
        assert Codec().decode(frames) == m.Refused(server.epoch, (
            f"verifier at {server.addr} speaks disagg wire protocol version 1; the drafter sent version 99 "
            "(run the same sglang-vericache version on both instances)"))
        assert all(not s.poll(0) for n, s in socks.items() if n != "unknown-version")
        assert server.stats["sessions_opened"] == len(batch)
        for s in socks.values():
            s.close(0)
    finally:
        server.stop()
        thread.join(10)


def test_with_a_secret_only_authenticated_frames_are_served(llama, batch, full_greedy, tmp_path, warn_log):
    server = VerifierServer(args(llama, disagg_role="verifier", disagg_port=free_port(),
                                 disagg_secret=SECRET))
    thread = start(server)
    try:
        assert not any("unauthenticated" in r.getMessage() for r in warn_log.records)
        d = drafter_sched(llama, server.addr, disagg_secret=SECRET)
        wait_up(d)
        outs, socks = run_while_attacked(d, server, thread, hmac_cases(tmp_path), warn_log, batch, "s")
        assert outs == full_greedy
        assert not (tmp_path / "pwned").exists()
        # Unauthenticated peers get no answer at all, not even a version refusal.
        assert not any(s.poll(300) for s in socks.values())
        # A drafter without the secret never gets an answer: its requests are refused (503).
        plain = drafter_sched(llama, server.addr)
        err = plain.handle_message(requests(batch[:1], "p")[0])
        assert isinstance(err, SchedulerError) and err.status_code == 503
        assert err.message == f"verifier at {server.addr} is not reachable"
        for s in socks.values():
            s.close(0)
    finally:
        server.stop()
        thread.join(10)


# ---------------------------------------------------------------- version handshake


def test_a_newer_drafter_is_refused_with_both_versions(llama, batch, monkeypatch, warn_log):
    server = VerifierServer(args(llama, disagg_role="verifier", disagg_port=free_port()))
    thread = start(server)
    try:
        monkeypatch.setattr(verifier_link, "Codec", functools.partial(Codec, version=2))
        d = drafter_sched(llama, server.addr)
        want = (f"verifier at {server.addr} speaks disagg wire protocol version 1; this drafter speaks "
                "version 2 (run the same sglang-vericache version on both instances)")
        assert d.spec_worker.link.refused == want and not d.spec_worker.link.up
        err = d.handle_message(requests(batch[:1], "v")[0])
        assert isinstance(err, SchedulerError) and (err.status_code, err.message) == (503, want)
        assert [r.getMessage() for r in warn_log.records if r.levelno == logging.ERROR] == [want]
        assert thread.is_alive() and server.stats["sessions_opened"] == 0
        assert server.stats["frames_dropped"] >= 1
        lines = [r.getMessage() for r in warn_log.records
                 if "disagg wire protocol version 2, expected" in r.getMessage()]
        assert len(lines) == 1  # once for this peer, though it kept sending Hello
    finally:
        server.stop()
        thread.join(10)


def test_a_newer_verifier_is_refused_with_both_versions(llama, batch):
    server = VerifierServer(args(llama, disagg_role="verifier", disagg_port=free_port()))
    server.codec = Codec(version=2, accept=TO_VERIFIER)
    thread = start(server)
    try:
        d = drafter_sched(llama, server.addr)
        want = (f"verifier at {server.addr} speaks disagg wire protocol version 2; this drafter speaks "
                "version 1 (run the same sglang-vericache version on both instances)")
        err = d.handle_message(requests(batch[:1], "w")[0])
        assert isinstance(err, SchedulerError) and (err.status_code, err.message) == (503, want)
    finally:
        server.stop()
        thread.join(10)


# ---------------------------------------------------------------- flags


def test_disagg_secret_flag_and_environment(monkeypatch):
    monkeypatch.delenv("SGLANG_VERICACHE_DISAGG_SECRET", raising=False)
    v = dict(skip_tokenizer_init=True, disagg_role="verifier", disagg_port=5000)
    assert ServerArgs(**v).disagg_secret is None
    assert ServerArgs(**v, disagg_secret="abc").disagg_secret == "abc"
    assert "abc" not in repr(ServerArgs(**v, disagg_secret="abc"))
    monkeypatch.setenv("SGLANG_VERICACHE_DISAGG_SECRET", "from-env")
    assert ServerArgs(**v).disagg_secret == "from-env"
    assert ServerArgs(**v, disagg_secret="flag").disagg_secret == "flag"
    assert ServerArgs(skip_tokenizer_init=True).disagg_secret is None  # not a disagg role: env ignored
    with pytest.raises(ValueError, match="--disagg-secret is for --disagg-role drafter or verifier"):
        ServerArgs(skip_tokenizer_init=True, disagg_secret="x")
    with pytest.raises(ValueError, match="--disagg-secret must not be empty"):
        ServerArgs(**v, disagg_secret="")


def test_server_info_says_only_whether_the_secret_is_set(monkeypatch):
    """/server_info and Engine.get_server_info report ServerArgs.public_dict()."""
    monkeypatch.delenv("SGLANG_VERICACHE_DISAGG_SECRET", raising=False)
    v = dict(skip_tokenizer_init=True, disagg_role="verifier", disagg_port=5000)
    assert ServerArgs(**v, disagg_secret="abc").public_dict()["disagg_secret"] == "<set>"
    assert ServerArgs(**v).public_dict()["disagg_secret"] is None
    assert "abc" not in repr(ServerArgs(**v, disagg_secret="abc").public_dict())
