"""Helpers for tests: tiny random-weight checkpoints of each supported family."""

from sglang_vericache.testing.random_checkpoints import FAMILIES, make_random_checkpoint

__all__ = ["FAMILIES", "make_random_checkpoint"]
