"""Incremental detokenization of one request's output, SGLang style.

Text is decoded from a *surrounding* offset (a few tokens before the new ones) and only the part
after the surrounding text is appended, so tokenizers that merge spaces or split multi-byte
characters over several tokens never emit broken text: while the new piece ends in U+FFFD
(an incomplete UTF-8 sequence) nothing is committed and the next token retries.
"""

from __future__ import annotations

# Prompt tokens kept as context for the first output tokens (SGLang's INIT_INCREMENTAL_DETOKENIZATION_OFFSET).
INIT_OFFSET = 5
REPLACEMENT_CHAR = "\ufffd"


def trim_matched_stop_text(text: str, finished_reason: dict | None, no_stop_trim: bool) -> str:
    """Cuts the output at the first occurrence of the matched stop string (SGLang's rule): before it,
    or just after it with no_stop_trim."""
    matched = (finished_reason or {}).get("matched")
    if not isinstance(matched, str) or not matched:
        return text
    pos = text.find(matched)
    if pos == -1:
        return text
    return text[: pos + len(matched)] if no_stop_trim else text[:pos]


def held_back_len(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string.

    A running request's streamed text withholds that suffix: it may turn out to be the start of a
    stop string, which the final text trims, and streamed text must only ever grow.
    """
    best = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:k]):
                best = k
                break
    return best


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool, spaces_between_special_tokens: bool
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        # decode_ids = prompt tail + every output token; [surr_offset, read_offset) is already in `text`.
        tail = list(prompt_ids[-INIT_OFFSET:])
        self.decode_ids: list[int] = tail
        self.surr_offset = 0
        self.read_offset = len(tail)
        self.text = ""  # committed output text (never ends in a partial character)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
        )

    def _new_text(self, read_end: int) -> str:
        surr = self._decode(self.decode_ids[self.surr_offset : self.read_offset])
        full = self._decode(self.decode_ids[self.surr_offset : read_end])
        return full[len(surr) :]

    def add(self, new_ids: list[int]) -> None:
        """Appends tokens; commits their text once it forms whole characters."""
        if not new_ids:
            return
        self.decode_ids.extend(new_ids)
        new_text = self._new_text(len(self.decode_ids))
        if new_text and not new_text.endswith(REPLACEMENT_CHAR):
            self.text += new_text
            self.surr_offset = self.read_offset
            self.read_offset = len(self.decode_ids)

    def finish(self, finished_reason: dict | None, no_stop_trim: bool) -> str:
        """The final output text: everything decoded, the matched stop string trimmed.
        (A matched stop *token* is never given to add(): see ReqState.update.)"""
        end = len(self.decode_ids)
        text = self.text + self._new_text(end) if end > self.read_offset else self.text
        return trim_matched_stop_text(text, finished_reason, no_stop_trim)
