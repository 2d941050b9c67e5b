"""Token streams for training and evaluation, shared by train.py and evaluate.py."""

from __future__ import annotations

import ast
import hashlib
import json
import textwrap
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

CHAT_USER_PROMPT = "Complete this Python function.\n\n"


@dataclass(frozen=True, slots=True)
class FunctionHeader:
    """A function split into its header (signature + docstring) and its full dedented source."""

    path: str
    name: str
    lineno: int
    header: str  # dedented, ends with the docstring's closing line and a newline
    source: str  # dedented full function text


def load_split(work: Path, split: str) -> list[str]:
    return json.loads((work / f"{split}.json").read_text())


def function_headers(text: str, path: str = "") -> list[FunctionHeader]:
    """Functions (incl. methods) that have a docstring and a body after it, in source order."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    lines = text.splitlines(keepends=True)
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.decorator_list:
            continue
        body = node.body
        if len(body) < 2 or ast.get_docstring(node, clean=False) is None:
            continue
        doc = body[0]
        header = textwrap.dedent("".join(lines[node.lineno - 1 : doc.end_lineno]))
        source = textwrap.dedent("".join(lines[node.lineno - 1 : node.end_lineno]))
        out.append(FunctionHeader(path, node.name, node.lineno, header, source))
    out.sort(key=lambda f: f.lineno)  # ast.walk is breadth-first; source order is stabler
    return out


def chat_example(fn: FunctionHeader) -> str:
    """ChatML text (the tokenizer's chat template) asking for a function given its header."""
    return (
        f"<|im_start|>user\n{CHAT_USER_PROMPT}{fn.header}<|im_end|>\n"
        f"<|im_start|>assistant\n{fn.source}<|im_end|>\n"
    )


def chat_examples(texts: list[str], seed: int, per_mille: int, max_chars: int = 2000) -> list[str]:
    """A seeded-hash-selected share of the train split's functions as chat examples."""
    out = []
    for i, text in enumerate(texts):
        for fn in function_headers(text, str(i)):
            key = hashlib.sha256(f"{seed}:{i}:{fn.name}:{fn.header}".encode()).digest()
            if len(fn.source) <= max_chars and int.from_bytes(key[:8], "big") % 1000 < per_mille:
                out.append(chat_example(fn))
    return out


def encode_documents(tok: Tokenizer, docs: list[str], add_bos: bool) -> list[list[int]]:
    """Each document becomes [<s>] + tokens + [</s>]; chat documents carry no <s> (as served)."""
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    encs = tok.encode_batch(docs, add_special_tokens=False)
    return [([bos] if add_bos else []) + e.ids + [eos] for e in encs]


def epoch_batches(docs: list[list[int]], seq_len: int, epoch: int, seed: int) -> torch.Tensor:
    """All [n, seq_len] windows of one epoch: documents shuffled by (seed, epoch), concatenated,
    cut into consecutive windows, then the windows shuffled.  Deterministic for a given seed."""
    g = torch.Generator().manual_seed(seed * 1000 + epoch)
    order = torch.randperm(len(docs), generator=g).tolist()
    stream = torch.tensor([t for i in order for t in docs[i]], dtype=torch.long)
    n = stream.numel() // seq_len
    windows = stream[: n * seq_len].view(n, seq_len)
    return windows[torch.randperm(n, generator=g)]
