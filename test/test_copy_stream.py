"""CopyStream (mem_cache/copy_stream.py): what waits on what when the host tier's exact KV is copied.

The CUDA implementation runs here against a fake torch.cuda that records every stream and event
call with the thread that made it, so the ordering is checked without a GPU: a copy waits for
the compute stream's mark, the compute stream waits for the copy's event, only the transfer
thread ever synchronizes (never the compute thread, never the device), and host-side bounce
buffers are pinned. The CPU emulation (the link's throttle) runs the same engine and stager.
"""

from __future__ import annotations

import threading

import pytest
import torch

from sglang_vericache.mem_cache import kv_stager as kv_stager_mod
from sglang_vericache.mem_cache.copy_stream import CudaCopyStream, EmulatedCopyStream, copy_stream_for
from sglang_vericache.mem_cache.kv_stager import LayerwiseKVStager
from sglang_vericache.mem_cache.memory_pool import MHATokenToKVPool
from sglang_vericache.mem_cache.transfer_engine import TransferEngine


class FakeCuda:
    """The torch.cuda calls CudaCopyStream makes, logged as (thread, call, args)."""

    def __init__(self):
        self.log: list[tuple[str, str, str]] = []
        self.lock = threading.Lock()
        self.n_events = 0
        self.compute = self.Stream(None, name="compute")
        self._current = threading.local()

    def note(self, call: str, arg: str) -> None:
        with self.lock:
            self.log.append((threading.current_thread().name, call, arg))

    def Stream(self, device, name="side"):  # noqa: N802 (torch's name)
        cuda = self

        class _Stream:
            def __init__(self):
                self.name = name

            def wait_event(self, ev):
                cuda.note(f"{self.name}.wait_event", ev.name)

        return _Stream()

    def Event(self):  # noqa: N802
        cuda = self
        with self.lock:
            self.n_events += 1
            n = self.n_events

        class _Event:
            name = f"e{n}"

            def record(self, stream):
                cuda.note(f"{stream.name}.record", self.name)

            def synchronize(self):
                cuda.note("synchronize", self.name)

            def query(self):
                return True

        return _Event()

    def current_stream(self, device=None):
        return getattr(self._current, "stream", self.compute)

    def stream(self, s):
        cuda = self

        class _Ctx:
            def __enter__(self):
                cuda._current.stream = s

            def __exit__(self, *exc):
                cuda._current.stream = cuda.compute

        return _Ctx()


def test_a_copy_waits_for_compute_and_compute_waits_for_the_copy_event_never_the_host():
    cuda = FakeCuda()
    eng = TransferEngine(None, "cpu", stream=CudaCopyStream(torch.device("cuda"), cuda=cuda))
    dst = torch.zeros(3)
    h = eng.submit(lambda: (cuda.note("copy", ""), dst.copy_(torch.ones(3))), 12, "L0")
    h.wait()
    eng.shutdown()
    main = threading.current_thread().name
    by_thread = {t: [(c, a) for tt, c, a in cuda.log if tt == t] for t in (main, "kv-transfer")}
    assert by_thread[main] == [("compute.record", "e1"),  # the point on the compute stream the copy follows
                               ("compute.wait_event", "e2")]  # the compute stream waits on the copy's event
    assert by_thread["kv-transfer"] == [("side.wait_event", "e1"), ("copy", ""), ("side.record", "e2"),
                                        ("synchronize", "e2")]  # the transfer thread, before its next job
    assert cuda.log.index((main, "compute.wait_event", "e2")) > cuda.log.index(("kv-transfer", "side.record", "e2"))
    assert torch.equal(dst, torch.ones(3))
    assert not any(t == main and call == "synchronize" for t, call, _ in cuda.log)


def test_a_verify_forward_waits_on_each_layers_event_in_layer_order():
    """The stager's walk (begin, then layer / release per layer, as the forward does) under the CUDA
    stream: every layer's copy follows a compute mark taken when it was submitted (after the
    release of the layer whose ring slot it reuses), and the compute stream waits on that layer's
    copy event before reading it."""
    cuda = FakeCuda()
    layers, n = 4, 5
    pool = MHATokenToKVPool(16, layers, 2, 4, torch.float32)
    for layer in range(layers):
        pool.k_buffer[layer].copy_(torch.arange(16 * 8, dtype=torch.float32).view(16, 2, 4) + 1000 * layer)
    eng = TransferEngine(None, "cpu", stream=CudaCopyStream(torch.device("cuda"), cuda=cuda))
    stager = LayerwiseKVStager(pool, eng, max_tokens=8, depth=2)
    slots = torch.tensor([3, 1, 4, 1, 5], dtype=torch.int64)
    staged = stager.begin(slots)
    for layer in range(layers):
        k, _ = staged.layer(layer)
        assert torch.equal(k, pool.k_buffer[layer][slots])
        cuda.note("read", f"L{layer}")
        staged.release(layer)
    eng.shutdown()
    main = threading.current_thread().name
    mine = [(call, arg) for t, call, arg in cuda.log if t == main]
    copies = [(call, arg) for t, call, arg in cuda.log if t == "kv-transfer" and call != "synchronize"]
    # Compute thread: marks for layers 0 and 1 at begin, then per layer: wait on its copy's event,
    # read it, and at release mark the compute stream for the copy of layer + 2 into its slot.
    marks = [a for c, a in mine if c == "compute.record"]
    waits = [a for c, a in mine if c == "compute.wait_event"]
    assert len(marks) == layers and [c for c, _ in mine[:2]] == ["compute.record"] * 2
    side_waits = [a for c, a in copies if c == "side.wait_event"]
    copy_events = [a for c, a in copies if c == "side.record"]
    assert side_waits == marks  # copy of layer l waits for the l-th mark, in layer order
    for layer in range(layers):  # the layer's read comes after the compute stream waits on its event
        i_wait = mine.index(("compute.wait_event", copy_events[layer]))
        assert mine[i_wait + 1] == ("read", f"L{layer}")
    assert set(waits) == set(copy_events)
    assert not any(t == main and c == "synchronize" for t, c, _ in cuda.log)


def test_bounce_buffers_are_pinned_on_cuda_and_not_in_the_emulation(monkeypatch):
    """A host exact pool and a device ring: the stager gathers into host bounce buffers, page-locked
    under the CUDA stream (so the H2D copy can be asynchronous)."""
    asked = []
    real = kv_stager_mod.host_buffer

    def host_buffer(shape, dtype, pin):
        asked.append(pin)
        return real(shape, dtype, False)

    monkeypatch.setattr(kv_stager_mod, "host_buffer", host_buffer)
    pool = MHATokenToKVPool(16, 2, 2, 4, torch.float32)
    for stream, pinned in ((CudaCopyStream(torch.device("cuda"), cuda=FakeCuda()), True),
                           (EmulatedCopyStream(), False)):
        asked.clear()
        eng = TransferEngine(None, "meta", stream=stream)  # a ring on another device than the pool
        stager = LayerwiseKVStager(pool, eng, max_tokens=8)
        assert stager.k_bounce is not None and asked == [pinned, pinned]
        eng.shutdown()
    asked.clear()
    eng = TransferEngine(None, "cpu")  # pool and ring in one memory: gathered straight into the ring
    assert LayerwiseKVStager(pool, eng, max_tokens=8).k_bounce is None and asked == []
    eng.shutdown()


def test_the_cpu_emulation_is_the_default_stream_off_cuda():
    assert type(copy_stream_for(torch.device("cpu"))) is EmulatedCopyStream
    eng = TransferEngine(1e9, "cpu")
    h = eng.submit(lambda: None, 10, "x")
    h.wait()
    assert h.done() and h.ready() and h.event is None
    eng.shutdown()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_copy_stream_on_a_gpu():
    """A real side stream: pinned host rows copied to the device, read after compute_wait."""
    eng = TransferEngine(None, "cuda")
    src = torch.arange(1 << 20, dtype=torch.float32).pin_memory()
    dst = torch.empty_like(src, device="cuda")
    h = eng.submit(lambda: dst.copy_(src, non_blocking=True), src.numel() * 4, "x")
    h.wait()
    assert torch.equal(dst.cpu(), src)
    eng.shutdown()
