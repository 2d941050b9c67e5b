"""Counter-based sampling noise: a pure function of (seed, position, token_id).

Every sampled token is argmax(logits + gumbel) with the Gumbel noise defined here, so a choice
depends only on (logits, seed, position): not on the batch, the row order, how many rows or
tokens are hashed at once, or the device. A speculative verifier that reuses the drafter's
(seed, position) therefore reproduces the drafter's choice whenever the logits agree.

The exact function (all arithmetic mod 2^64 on unsigned 64-bit values; `>>` is a logical shift):

    GAMMA = 0x9E3779B97F4A7C15
    mix(x)  = splitmix64 output for state x:
                z = x + GAMMA
                z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
                z = (z ^ (z >> 27)) * 0x94D049BB133111EB
                return z ^ (z >> 31)
    row_key(seed, position) = mix(mix(seed) ^ position)
    hash(seed, position, token) = mix(row_key(seed, position) ^ token)
    uniform (float64) = ((hash >> 12) + 0.5) * 2^-52          # top 52 bits, strictly inside (0, 1)
    uniform (float32) = ((hash >> 41) + 0.5) * 2^-23          # top 23 bits, strictly inside (0, 1)
    gumbel = -log(-log(uniform))

seed is in [0, 2^63); position and token are non-negative ints < 2^63. Torch int64 tensors hold
the same bits as the unsigned values: + and * wrap two's-complement (identical on CPU and CUDA),
^ is bitwise, and a logical right shift is an arithmetic shift with the sign-extended bits masked
off. The integer part and the uniform are therefore bit-identical on every device; the float64
log in the Gumbel transform is correctly rounded to within an ulp on both.
"""

from __future__ import annotations

import torch

_U64 = 1 << 64


def _signed(c: int) -> int:
    """The int64 with the same bits as the unsigned 64-bit constant c."""
    return c - _U64 if c >= 1 << 63 else c


GAMMA = 0x9E3779B97F4A7C15
MUL1 = 0xBF58476D1CE4E5B9
MUL2 = 0x94D049BB133111EB
_GAMMA_S, _MUL1_S, _MUL2_S = _signed(GAMMA), _signed(MUL1), _signed(MUL2)


def _xor_shift_right_(z: torch.Tensor, k: int, tmp: torch.Tensor) -> torch.Tensor:
    """z ^= z >>> k (logical shift), in place; tmp is scratch of z's shape."""
    torch.bitwise_right_shift(z, k, out=tmp)
    tmp.bitwise_and_((1 << (64 - k)) - 1)
    return z.bitwise_xor_(tmp)


def _mix_(z: torch.Tensor) -> torch.Tensor:
    """splitmix64 output for state z (int64 bits), in place."""
    tmp = torch.empty_like(z)
    z.add_(_GAMMA_S)
    _xor_shift_right_(z, 30, tmp).mul_(_MUL1_S)
    _xor_shift_right_(z, 27, tmp).mul_(_MUL2_S)
    return _xor_shift_right_(z, 31, tmp)


def row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """int64[rows]: mix(mix(seed) ^ position), the per-(seed, position) key."""
    k = _mix_(seeds.to(torch.int64).clone())
    return _mix_(k.bitwise_xor_(positions.to(device=k.device, dtype=torch.int64)))


def hash_tokens(seeds: torch.Tensor, positions: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """int64[rows, K]: hash(seed[r], position[r], token_ids[r, k]) as int64 bits."""
    return hash_keyed(row_keys(seeds, positions).unsqueeze(1), token_ids)


def hash_keyed(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """int64, shape of token_ids: mix(key ^ token) for precomputed row keys (broadcast)."""
    return _mix_(token_ids.to(torch.int64).bitwise_xor(keys))


def _to_uniform(h: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.float64:
        bits, scale = 52, 2.0**-52
    elif dtype == torch.float32:
        bits, scale = 23, 2.0**-23
    else:
        raise ValueError(f"noise dtype must be float32 or float64, got {dtype}")
    top = torch.bitwise_right_shift(h, 64 - bits).bitwise_and_((1 << bits) - 1)
    # Exact in `dtype`: top + 0.5 < 2^bits needs bits + 1 significant bits, which the type has
    # (53 for float64, 24 for float32); so u is never rounded to 0 or 1.
    return top.to(dtype).add_(0.5).mul_(scale)


def uniform_at(
    seeds: torch.Tensor, positions: torch.Tensor, token_ids: torch.Tensor, dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """[rows, K] uniforms in (0, 1) for the given token ids of each row."""
    return _to_uniform(hash_tokens(seeds, positions, token_ids), dtype)


def uniform_noise(
    seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int, dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """[rows, vocab_size] uniforms in (0, 1); row r, column t is uniform(seeds[r], positions[r], t)."""
    tokens = torch.arange(vocab_size, dtype=torch.int64, device=seeds.device).unsqueeze(0)
    return uniform_at(seeds, positions, tokens.expand(seeds.shape[0], vocab_size), dtype)


def _gumbel_(u: torch.Tensor) -> torch.Tensor:
    return u.log_().neg_().log_().neg_()


def gumbel_keyed(
    keys: torch.Tensor, token_ids: torch.Tensor, dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """Gumbel noise for (row key, token) pairs, e.g. a flat list of kept candidates."""
    return _gumbel_(_to_uniform(hash_keyed(keys, token_ids), dtype))


def gumbel_noise(
    seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int, dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """[rows, vocab_size] Gumbel(0, 1) noise over the whole vocabulary."""
    return _gumbel_(uniform_noise(seeds, positions, vocab_size, dtype))
