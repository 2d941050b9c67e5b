"""Specification of sampling/noise.py: counter-based uniform / Gumbel noise per (seed, position, token)."""

from __future__ import annotations

import math

import pytest
import torch

from sglang_vericache.sampling import noise

MASK64 = (1 << 64) - 1


# An independent pure-Python statement of the documented hash.
def ref_mix(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def ref_hash(seed: int, position: int, token: int) -> int:
    return ref_mix(ref_mix(ref_mix(seed) ^ position) ^ token)


def ref_uniform64(seed: int, position: int, token: int) -> float:
    return ((ref_hash(seed, position, token) >> 12) + 0.5) * 2.0**-52


def ref_uniform32(seed: int, position: int, token: int) -> float:
    return ((ref_hash(seed, position, token) >> 41) + 0.5) * 2.0**-23


TRIPLES = [
    (0, 0, 0), (1, 0, 0), (0, 1, 0), (0, 0, 1),
    (42, 7, 151935), (2**63 - 1, 2**40 + 3, 5), (123456789, 65535, 31),
]


def t64(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def test_reference_mix_is_splitmix64():
    # splitmix64 seeded with 0 yields 0xE220A8397B1DCDAF first: our mix(0) is that output.
    assert ref_mix(0) == 0xE220A8397B1DCDAF


def test_hash_matches_pure_python_reference_bit_for_bit():
    seeds, positions, tokens = (t64([t[i] for t in TRIPLES]) for i in range(3))
    got = noise.hash_tokens(seeds, positions, tokens.unsqueeze(1)).squeeze(1)
    assert [h & MASK64 for h in got.tolist()] == [ref_hash(*t) for t in TRIPLES]


def test_uniform64_exact_values():
    seeds, positions, tokens = (t64([t[i] for t in TRIPLES]) for i in range(3))
    got = noise.uniform_at(seeds, positions, tokens.unsqueeze(1)).squeeze(1)
    assert got.dtype == torch.float64
    assert got.tolist() == [ref_uniform64(*t) for t in TRIPLES]


def test_uniform32_exact_values():
    seeds, positions, tokens = (t64([t[i] for t in TRIPLES]) for i in range(3))
    got = noise.uniform_at(seeds, positions, tokens.unsqueeze(1), dtype=torch.float32).squeeze(1)
    assert got.dtype == torch.float32
    assert got.tolist() == [ref_uniform32(*t) for t in TRIPLES]


def test_uniform_noise_row_equals_reference_over_vocab():
    u = noise.uniform_noise(t64([99]), t64([3]), 50)
    assert u.shape == (1, 50)
    assert u[0].tolist() == [ref_uniform64(99, 3, t) for t in range(50)]


def test_uniform_is_strictly_inside_unit_interval_at_extreme_hashes():
    extremes = torch.tensor([0, -1], dtype=torch.int64)  # all bits clear, all bits set
    u64 = noise._to_uniform(extremes, torch.float64).tolist()
    u32 = noise._to_uniform(extremes, torch.float32).tolist()
    assert u64 == [2.0**-53, 1.0 - 2.0**-53]
    assert u32 == [2.0**-24, 1.0 - 2.0**-24]
    g = noise.gumbel_keyed(torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64))
    assert torch.isfinite(g).all()


def test_noise_independent_of_batch_composition_and_row_order():
    seeds, positions = t64([5, 6, 5, 2**62]), t64([0, 0, 1, 9])
    batch = noise.uniform_noise(seeds, positions, 300)
    for r in range(4):
        alone = noise.uniform_noise(seeds[r : r + 1], positions[r : r + 1], 300)
        assert torch.equal(alone[0], batch[r])
    perm = t64([3, 1, 0, 2])
    assert torch.equal(noise.uniform_noise(seeds[perm], positions[perm], 300), batch[perm])


def test_noise_at_a_token_subset_equals_the_full_vocab_columns():
    seeds, positions = t64([11, 12]), t64([4, 5])
    full = noise.gumbel_noise(seeds, positions, 1000)
    subset = t64([[999, 0, 500], [7, 7, 123]])
    at_subset = noise.uniform_at(seeds, positions, subset).log_().neg_().log_().neg_()  # -log(-log(u))
    assert torch.equal(at_subset, full.gather(1, subset))
    keys = noise.row_keys(seeds, positions)
    rows, toks = t64([1, 0]), t64([123, 500])
    assert torch.equal(noise.gumbel_keyed(keys[rows], toks), full[rows, toks])


def _draws() -> torch.Tensor:
    """1e5 uniforms: seeds 0..99 x positions 0..9 x tokens 0..99."""
    seeds = torch.arange(100).repeat_interleave(10)
    positions = torch.arange(10).repeat(100)
    return noise.uniform_noise(seeds, positions, 100)


def test_uniform_mean_and_chi_square_over_1e5_draws():
    u = _draws().flatten()
    assert u.numel() == 100_000
    assert abs(u.mean().item() - 0.5) < 0.003  # sd of the mean: 0.00091
    counts = torch.histc(u, bins=20, min=0.0, max=1.0)
    chi2 = ((counts - 5000.0) ** 2 / 5000.0).sum().item()
    assert chi2 < 43.8  # chi-square, 19 dof, p = 0.001


def _corr(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.flatten() - a.mean(), b.flatten() - b.mean()
    return (a @ b / (a.norm() * b.norm())).item()


def test_neighbouring_positions_seeds_and_tokens_are_uncorrelated():
    seeds = torch.arange(1000)
    zeros = torch.zeros(1000, dtype=torch.int64)
    base = noise.uniform_noise(seeds, zeros, 101)
    next_position = noise.uniform_noise(seeds, zeros + 1, 101)
    next_seed = noise.uniform_noise(seeds + 1, zeros, 101)
    # sd of a correlation over ~1e5 independent pairs: 0.0032
    assert abs(_corr(base, next_position)) < 0.015
    assert abs(_corr(base, next_seed)) < 0.015
    assert abs(_corr(base[:, :-1], base[:, 1:])) < 0.015  # neighbouring tokens


def test_gumbel_mean_is_euler_gamma():
    seeds = torch.arange(1000)
    g = noise.gumbel_noise(seeds, torch.zeros(1000, dtype=torch.int64), 100)
    assert abs(g.mean().item() - 0.5772156649) < 0.02  # sd of the mean: 0.0041
    assert abs(g.var().item() - math.pi**2 / 6) < 0.05


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_noise_is_bit_identical_to_cpu():
    seeds, positions = t64([0, 7, 2**63 - 1]), t64([0, 3, 2**40])
    for dtype in (torch.float64, torch.float32):
        cpu = noise.uniform_noise(seeds, positions, 4096, dtype)
        gpu = noise.uniform_noise(seeds.cuda(), positions.cuda(), 4096, dtype).cpu()
        assert torch.equal(cpu, gpu)
