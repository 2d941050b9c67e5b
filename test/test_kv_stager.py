"""LayerwiseKVStager: a ring of `depth` one-layer staging slots over the exact (host) pool.

A random 5-layer pool (GQA-shaped: 2 KV heads, head_dim 4, v_head_dim 6 so K and V sizes differ),
a recording engine that logs every submit, and a consumer that walks layers as a forward does.
"""

from __future__ import annotations

import pytest
import torch

from sglang_vericache.mem_cache.kv_stager import LayerwiseKVStager
from sglang_vericache.mem_cache.memory_pool import MHATokenToKVPool
from sglang_vericache.mem_cache.transfer_engine import TransferEngine

LAYERS, HKV, D, DV = 5, 2, 4, 6
BYTES_PER_TOKEN_LAYER = HKV * (D + DV) * 4  # float32 K + V of one token in one layer


class RecordingEngine(TransferEngine):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.log: list[tuple[str, str]] = []

    def submit(self, copy_fn, nbytes, tag=""):
        self.log.append(("submit", tag))
        return super().submit(copy_fn, nbytes, tag)


@pytest.fixture
def pool() -> MHATokenToKVPool:
    p = MHATokenToKVPool(64, LAYERS, HKV, D, torch.float32, v_head_dim=DV)
    g = torch.Generator().manual_seed(0)
    for layer in range(LAYERS):
        p.k_buffer[layer].copy_(torch.randn(p.k_buffer[layer].shape, generator=g))
        p.v_buffer[layer].copy_(torch.randn(p.v_buffer[layer].shape, generator=g))
    return p


@pytest.fixture
def engine():
    eng = RecordingEngine(None)
    yield eng
    eng.shutdown()


def consume(staged, log) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Walk every layer like a forward: take it, copy it out, release it."""
    out = []
    for layer in range(LAYERS):
        k, v = staged.layer(layer)
        out.append((k.clone(), v.clone()))
        log.append(("release", f"L{layer}"))  # as it happens: the ring slot frees, then L+depth submits
        staged.release(layer)
    return out


def max_outstanding(log) -> int:
    n = worst = 0
    for kind, _ in log:
        n += 1 if kind == "submit" else -1
        worst = max(worst, n)
    return worst


SLOTS = torch.tensor([17, 3, 40, 41, 42, 9, 9, 63], dtype=torch.int64)  # any order, repeats allowed


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_staged_layers_equal_the_pool_rows(pool, engine, depth):
    stager = LayerwiseKVStager(pool, engine, max_tokens=16, depth=depth)
    got = consume(stager.begin(SLOTS), engine.log)
    for layer, (k, v) in enumerate(got):
        assert torch.equal(k, pool.k_buffer[layer][SLOTS])
        assert torch.equal(v, pool.v_buffer[layer][SLOTS])


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_at_most_depth_layers_in_flight_each_copied_once_in_order(pool, engine, depth):
    stager = LayerwiseKVStager(pool, engine, max_tokens=16, depth=depth)
    staged = stager.begin(SLOTS)
    assert staged.in_flight == depth
    # the next layers load before layer 0 is used
    assert engine.log == [("submit", f"L{i}") for i in range(depth)]
    consume(staged, engine.log)
    assert max_outstanding(engine.log) == depth
    assert [tag for kind, tag in engine.log if kind == "submit"] == [f"L{i}" for i in range(LAYERS)]
    assert staged.in_flight == 0 and staged.finished


def test_bytes_counted_per_layer(pool, engine):
    stager = LayerwiseKVStager(pool, engine, max_tokens=16)
    consume(stager.begin(SLOTS), engine.log)
    n = len(SLOTS)
    assert [iv[2] for iv in engine.busy_intervals] == [n * BYTES_PER_TOKEN_LAYER] * LAYERS
    assert engine.bytes_total == LAYERS * n * BYTES_PER_TOKEN_LAYER == stager.transfer_bytes(n)


def test_staging_memory_is_depth_layers_of_max_tokens(pool, engine):
    stager = LayerwiseKVStager(pool, engine, max_tokens=16, depth=2)
    assert stager.bytes_per_token_layer() == BYTES_PER_TOKEN_LAYER
    assert stager.staging_bytes() == 2 * 16 * BYTES_PER_TOKEN_LAYER
    assert stager.k_ring.numel() * 4 + stager.v_ring.numel() * 4 == stager.staging_bytes()


def test_more_tokens_than_max_tokens_is_an_error(pool, engine):
    stager = LayerwiseKVStager(pool, engine, max_tokens=7)
    with pytest.raises(ValueError, match="8 staged tokens exceed the stager's max_tokens=7"):
        stager.begin(SLOTS)
    assert engine.log == []


def test_one_staged_kv_at_a_time_and_close_frees_the_ring(pool, engine):
    stager = LayerwiseKVStager(pool, engine, max_tokens=16)
    first = stager.begin(SLOTS)
    with pytest.raises(RuntimeError, match="still active"):
        stager.begin(SLOTS)
    first.layer(0)
    first.close()  # e.g. the forward failed after layer 0
    second = stager.begin(SLOTS[:3])
    k, _ = second.layer(0)
    assert torch.equal(k, pool.k_buffer[0][SLOTS[:3]])


def test_layers_are_released_in_order_and_only_when_staged(pool, engine):
    stager = LayerwiseKVStager(pool, engine, max_tokens=16, depth=2)
    staged = stager.begin(SLOTS)
    with pytest.raises(RuntimeError, match="layer 2 is not staged"):
        staged.layer(2)
    with pytest.raises(RuntimeError, match="out of order"):
        staged.release(1)


def test_throttled_layers_take_their_link_time():
    eng = TransferEngine(2e5)  # 8 rows * 80 B = 640 B per layer -> 3.2 ms per layer
    p = MHATokenToKVPool(64, LAYERS, HKV, D, torch.float32, v_head_dim=DV)
    stager = LayerwiseKVStager(p, eng, max_tokens=16)
    consume(stager.begin(SLOTS), [])
    assert len(eng.busy_intervals) == LAYERS
    assert min(e - s for s, e, _, _ in eng.busy_intervals) >= 0.0032 - 1e-9
    eng.shutdown()
