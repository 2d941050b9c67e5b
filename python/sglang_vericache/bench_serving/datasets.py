"""Benchmark prompts (random token ids, or a local ShareGPT-format JSON) and the tokenizers that
measure them: the server's own (/v1/tokenize, /v1/detokenize) or a local one (--tokenizer).

random    --num-prompts prompts of token ids, input and output lengths drawn uniformly from
          [len * --random-range-ratio, len] (sglang.bench_serving's rule); the ids are consecutive
          from a random offset (sglang's random-ids). Native and completions backends send the ids
          (exact prompt lengths); chat backends send their text. With --dataset-path, the ids are
          instead a ShareGPT conversation's first turn, repeated or cut to the length (sglang's random).
sharegpt  conversations' first two turns from --dataset-path: the first is the prompt, the second's
          token count the output length (or --sharegpt-output-len); shuffled by --seed.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import requests


@dataclass
class DatasetRow:
    prompt: str | list[int]
    prompt_len: int
    output_len: int


class ServerTokenizer:
    """The served model's tokenizer, through the server's tokenize endpoints."""

    def __init__(self, base_url: str, headers: dict[str, str], vocab_size: int) -> None:
        self.base_url, self.headers, self.vocab_size = base_url, headers, vocab_size

    def _post(self, path: str, body: dict) -> Any:
        r = requests.post(self.base_url + path, json=body, headers=self.headers, timeout=600)
        if r.status_code != 200:
            raise RuntimeError(f"{path} failed ({r.status_code}): {r.text[:300]}")
        return r.json()

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        if not texts:
            return []
        return self._post("/v1/tokenize", {"prompt": texts, "add_special_tokens": False})["tokens"]

    def decode_batch(self, ids: list[list[int]]) -> list[str]:
        if not ids:
            return []
        return self._post("/v1/detokenize", {"tokens": ids, "skip_special_tokens": False})["text"]


class LocalTokenizer:
    """A Hugging Face tokenizer from a local path or hub name (--tokenizer)."""

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(path)
        self.vocab_size = len(self.tok)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.tok.encode(t, add_special_tokens=False) for t in texts]

    def decode_batch(self, ids: list[list[int]]) -> list[str]:
        return [self.tok.decode(x) for x in ids]


def compute_random_lens(full_len: int, range_ratio: float, num: int) -> list[int]:
    """sglang.bench_serving's lengths: uniform integers in [max(full_len * ratio, 1), full_len]."""
    if full_len <= 0:
        return [0] * num
    return np.random.randint(max(int(full_len * range_ratio), 1), full_len + 1, size=num).tolist()


def load_conversations(path: str) -> list[tuple[str, str]]:
    """(first turn, second turn) of each conversation with at least two, in ShareGPT's format:
    a JSON list of {"conversations": [{"from": ..., "value": ...}, ...]} ("conversation" also read)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as e:
        raise ValueError(f"--dataset-path {path!r} cannot be read: {e}") from e
    except json.JSONDecodeError as e:
        raise ValueError(f"--dataset-path {path!r} is not JSON: {e}") from e
    if not isinstance(data, list):
        raise ValueError(f"--dataset-path {path!r}: expected a JSON list of conversations")
    pairs = []
    for item in data:
        turns = item.get("conversations", item.get("conversation", [])) if isinstance(item, dict) else []
        if len(turns) >= 2:
            pairs.append((turns[0]["value"], turns[1]["value"]))
    if not pairs:
        raise ValueError(f"--dataset-path {path!r} has no conversation with two turns")
    return pairs


def sample_sharegpt_requests(path: str, num_requests: int, tokenizer, fixed_output_len: int | None = None,
                             context_len: int | None = None) -> list[DatasetRow]:
    if fixed_output_len is not None and fixed_output_len < 1:
        raise ValueError("--sharegpt-output-len must be at least 1")
    pairs = load_conversations(path)
    random.shuffle(pairs)
    rows: list[DatasetRow] = []
    batch = 64
    for i in range(0, len(pairs), batch):
        chunk = pairs[i:i + batch]
        prompts = tokenizer.encode_batch([p for p, _ in chunk])
        completions = tokenizer.encode_batch([c for _, c in chunk]) if fixed_output_len is None else None
        for j, (prompt, _) in enumerate(chunk):
            prompt_len = len(prompts[j])
            output_len = fixed_output_len if completions is None else len(completions[j])
            if prompt_len < 2 or (output_len < 2 and fixed_output_len is None):
                continue  # too short (sglang's pruning)
            if context_len and prompt_len + output_len > context_len:
                continue
            rows.append(DatasetRow(prompt, prompt_len, output_len))
            if len(rows) == num_requests:
                return rows
    return rows


def sample_random_requests(input_len: int, output_len: int, num_prompts: int, range_ratio: float, tokenizer,
                           as_text: bool, dataset_path: str = "") -> list[DatasetRow]:
    input_lens = compute_random_lens(input_len, range_ratio, num_prompts)
    output_lens = compute_random_lens(output_len, range_ratio, num_prompts)
    if dataset_path:
        pairs = load_conversations(dataset_path)
        random.shuffle(pairs)
        sources = [ids for ids in tokenizer.encode_batch([p for p, _ in pairs[:4 * num_prompts]]) if ids]
        if not sources:
            raise ValueError(f"--dataset-path {dataset_path!r}: every first turn tokenizes to nothing")
        ids = [(sources[i % len(sources)] * (n // len(sources[i % len(sources)]) + 1))[:n]
               for i, n in enumerate(input_lens)]
    else:
        offsets = np.random.randint(0, tokenizer.vocab_size, size=num_prompts)
        ids = [[int((offsets[i] + i + j) % tokenizer.vocab_size) for j in range(n)] for i, n in enumerate(input_lens)]
    prompts: list = tokenizer.decode_batch(ids) if as_text else ids
    return [DatasetRow(p, n, o) for p, n, o in zip(prompts, input_lens, output_lens)]
