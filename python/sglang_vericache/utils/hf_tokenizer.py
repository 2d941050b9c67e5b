"""The Hugging Face tokenizer of a model folder or GGUF file (the GGUF's is converted once and cached
beside its config: utils/gguf_files.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sglang_vericache.utils.gguf_files import ensure_tokenizer, gguf_file_of

if TYPE_CHECKING:
    from sglang_vericache.server_args import ServerArgs


def get_tokenizer(tokenizer_path: str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    gguf_file = gguf_file_of(tokenizer_path)
    folder = ensure_tokenizer(gguf_file) if gguf_file else tokenizer_path
    return AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)


def load_tokenizer(server_args: ServerArgs):
    """--tokenizer-path's tokenizer (it defaults to --model-path)."""
    return get_tokenizer(server_args.tokenizer_path, server_args.trust_remote_code)
