"""sglang-vericache: an SGLang-style serving runtime. Importing the package stays cheap (no torch)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sglang_vericache.engine import Engine

__all__ = ["Engine"]


def __getattr__(name: str):
    if name == "Engine":
        from sglang_vericache.engine import Engine

        return Engine
    raise AttributeError(f"module 'sglang_vericache' has no attribute {name!r}")
