"""GenerateReqInput: the /generate body (SGLang's native request), checked field by field.

Every field of SGLang's GenerateReqInput is accepted with its type checked; what each one does here
(used, ignored with a warning, or refused when set) is managers/field_policy.py's table. Keys SGLang
does not know are ignored with a warning, as SGLang's server ignores them. Wrong types and
impossible values are errors that name the field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sglang_vericache.managers.field_policy import (
    GENERATE_FIELDS,
    SILENT_EXTRA_FIELDS,
    check_dp_rank,
    check_field,
    warn_unknown,
)
from sglang_vericache.sampling.sampling_params import InvalidRequest


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_ids(v: Any) -> bool:
    return isinstance(v, list) and all(_is_int(t) for t in v)


# Set by normalize(), never read from the body.
_NORMALIZED = ("is_single", "batch_size")


@dataclass
class GenerateReqInput:
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict | list[dict] | None = None
    rid: str | list[str] | None = None
    stream: bool = False
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    return_text_in_logprobs: bool = False
    log_metrics: bool = True  # false: left out of the request metrics (health checks)
    no_logs: bool = False  # true: no --log-requests lines (zero data retention)
    return_prompt_token_ids: bool = False  # true: the response carries "prompt_token_ids"
    routed_dp_rank: int | None = None  # SGLang's DP routing; this server is rank 0 of 1
    # Filled by normalize(): one entry per prompt.
    is_single: bool = field(default=True, init=False)
    batch_size: int = field(default=1, init=False)

    @classmethod
    def from_json(cls, body: Any) -> GenerateReqInput:
        if not isinstance(body, dict):
            raise InvalidRequest(f"the request body must be a JSON object, got {type(body).__name__}")
        warn_unknown(sorted(k for k in body if k not in GENERATE_FIELDS and k not in SILENT_EXTRA_FIELDS),
                     "/generate")
        for name, value in body.items():
            if name in GENERATE_FIELDS:
                check_field(name, value, "/generate")
        for name in ("routed_dp_rank", "data_parallel_rank"):
            check_dp_rank(name, body.get(name))
        fields = {k: v for k, v in body.items() if k in cls.__dataclass_fields__ and k not in _NORMALIZED}
        if body.get("routed_dp_rank") is None:
            fields["routed_dp_rank"] = body.get("data_parallel_rank")  # the old name, still sent by routers
        obj = cls(**fields)
        obj.normalize()
        return obj

    def normalize(self) -> None:
        """Checks types and decides single vs batch; prompts are later read with prompt(i)."""
        if (self.text is None) == (self.input_ids is None):
            raise InvalidRequest("exactly one of text and input_ids must be given")
        if self.text is not None:
            if isinstance(self.text, str):
                self.is_single, self.batch_size = True, 1
            elif isinstance(self.text, list) and all(isinstance(t, str) for t in self.text):
                self.is_single, self.batch_size = False, len(self.text)
            else:
                raise InvalidRequest("text must be a string or a list of strings")
        else:
            if _is_ids(self.input_ids):
                self.is_single, self.batch_size = True, 1
            elif isinstance(self.input_ids, list) and all(_is_ids(x) for x in self.input_ids):
                self.is_single, self.batch_size = False, len(self.input_ids)
            else:
                raise InvalidRequest("input_ids must be a list of integers or a list of lists of integers")
        if not self.is_single and self.batch_size == 0:
            raise InvalidRequest("the batch of prompts is empty")
        flags = ("stream", "return_text_in_logprobs", "log_metrics", "no_logs", "return_prompt_token_ids")
        for name in flags:
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequest(f"{name} must be a boolean, got {getattr(self, name)!r}")
        check_dp_rank("routed_dp_rank", self.routed_dp_rank)
        self._check_per_item("return_logprob", lambda v: v is None or isinstance(v, bool), "a boolean")
        self._check_per_item("logprob_start_len", lambda v: v is None or _is_int(v), "an integer")
        self._check_per_item(
            "top_logprobs_num",
            lambda v: v is None or (_is_int(v) and 0 <= v <= 100),
            "an integer in [0, 100]",
        )
        self._check_per_item("sampling_params", lambda v: v is None or isinstance(v, dict), "a JSON object")
        self._check_per_item("rid", lambda v: v is None or isinstance(v, str), "a string")

    def _check_per_item(self, name: str, ok, what: str) -> None:
        value = getattr(self, name)
        if isinstance(value, list) and not self.is_single:
            if len(value) != self.batch_size:
                raise InvalidRequest(f"{name} has {len(value)} entries for {self.batch_size} prompts")
            values = value
        else:
            values = [value]
        for v in values:
            if not ok(v):
                raise InvalidRequest(f"{name} must be {what}, got {v!r}")

    def item(self, name: str, i: int) -> Any:
        value = getattr(self, name)
        if isinstance(value, list) and not self.is_single:
            return value[i]
        return value

    def prompt(self, i: int) -> tuple[str | None, list[int] | None]:
        if self.text is not None:
            return (self.text if self.is_single else self.text[i]), None
        return None, (self.input_ids if self.is_single else self.input_ids[i])
