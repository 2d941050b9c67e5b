"""SamplingParams: one request's decoding settings, validated once at the door."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

_GREEDY_EPS = 1e-6
# SGLang sampling parameters this server cannot honour: accepted while unset (null, or beam_width 1),
# a 400 naming them when set. Any other name SGLang does not know is a 400 too, as in SGLang.
_REFUSED_IF_SET = {
    "beam_width": "beam search is not implemented",
    "structural_tag": "structural tags are not supported (use json_schema, regex or ebnf)",
    "custom_params": "custom logit processors are not supported",
    "watermark": "watermarked sampling is not implemented",
}


class InvalidRequest(ValueError):
    """Bad input: the HTTP layer answers it with a 4xx naming the problem."""


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    stop_regex: list[str] = field(default_factory=list)
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None
    logit_bias: dict[str, float] | None = None
    stream_interval: int | None = None  # tokens per streamed event; None: the server's --stream-interval

    @classmethod
    def from_dict(cls, d: dict | None) -> SamplingParams:
        """Builds from a JSON object; unknown keys and wrong types are errors, not silently dropped."""
        if d is not None and not isinstance(d, dict):
            raise InvalidRequest(f"sampling_params must be an object, got {type(d).__name__}")
        d = dict(d or {})
        for name, why in _REFUSED_IF_SET.items():
            value = d.pop(name, None)
            if value is not None and not (name == "beam_width" and value == 1 and value is not True):
                raise InvalidRequest(f"sampling_params.{name} is not supported by this server: {why}")
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(d) - set(known))
        if unknown:
            raise InvalidRequest(f"unknown sampling_params field(s): {', '.join(unknown)}")
        if d.get("max_new_tokens", 0) is None:
            d.pop("max_new_tokens")
        for key in ("stop", "stop_regex"):
            if isinstance(d.get(key), str):
                d[key] = [d[key]]
            if d.get(key) is None:
                d.pop(key, None)
        if d.get("stop_token_ids") is None:
            d.pop("stop_token_ids", None)
        for key in ("top_k",):
            if d.get(key) is None:
                d.pop(key, None)
        params = cls(**d)
        params.check_types()
        return params

    def check_types(self) -> None:
        def need(name: str, ok: bool, what: str) -> None:
            if not ok:
                raise InvalidRequest(f"sampling_params.{name} must be {what}, got {getattr(self, name)!r}")

        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v: object) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool)

        for name in ("max_new_tokens", "min_new_tokens", "n", "top_k"):
            need(name, is_int(getattr(self, name)), "an integer")
        for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty",
                     "repetition_penalty"):
            need(name, is_num(getattr(self, name)), "a number")
        need("stop", isinstance(self.stop, list) and all(isinstance(s, str) for s in self.stop),
             "a string or a list of strings")
        need("stop_regex", isinstance(self.stop_regex, list)
             and all(isinstance(s, str) for s in self.stop_regex), "a string or a list of strings")
        need("stop_token_ids", isinstance(self.stop_token_ids, list)
             and all(is_int(t) for t in self.stop_token_ids), "a list of integers")
        for name in ("regex", "json_schema", "ebnf"):
            v = getattr(self, name)
            need(name, v is None or isinstance(v, str), "a string")
        need("sampling_seed", self.sampling_seed is None or is_int(self.sampling_seed), "an integer")
        need("stream_interval", self.stream_interval is None or is_int(self.stream_interval), "an integer")

        def is_token_key(k: object) -> bool:
            return is_int(k) or (isinstance(k, str) and k.strip().removeprefix("-").isdecimal())

        need("logit_bias", self.logit_bias is None or (
            isinstance(self.logit_bias, dict)
            and all(is_token_key(k) and is_num(v) for k, v in self.logit_bias.items())
        ), "an object mapping token ids to numbers")
        for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"):
            need(name, isinstance(getattr(self, name), bool), "a boolean")

    def verify(self, vocab_size: int | None = None) -> None:
        """Range checks: impossible values are rejected, not clamped."""
        if self.max_new_tokens < 0:
            raise InvalidRequest(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.min_new_tokens < 0:
            raise InvalidRequest(f"min_new_tokens must be >= 0, got {self.min_new_tokens}")
        if self.min_new_tokens > self.max_new_tokens:
            raise InvalidRequest(
                f"min_new_tokens ({self.min_new_tokens}) must be <= max_new_tokens ({self.max_new_tokens})"
            )
        if not 1 <= self.n <= 64:
            raise InvalidRequest(f"n must be in [1, 64], got {self.n}")
        if not 0.0 <= self.temperature <= 100.0:
            raise InvalidRequest(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1 or self.top_k == 0:
            raise InvalidRequest(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequest(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise InvalidRequest(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise InvalidRequest(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise InvalidRequest(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        bad = [t for t in self.stop_token_ids if t < 0 or (vocab_size is not None and t >= vocab_size)]
        if bad:
            raise InvalidRequest(f"stop_token_ids outside the vocabulary [0, {vocab_size or 'vocab'}): {bad}")
        if self.logit_bias:
            bad = [k for k, v in self.logit_bias.items() if not -100.0 <= v <= 100.0]
            if bad:
                raise InvalidRequest(f"logit_bias values must be in [-100, 100], bad for token(s) {bad}")
            limit = vocab_size if vocab_size is not None else float("inf")
            bad = [k for k in self.logit_bias if not 0 <= int(k) < limit]
            if bad:
                raise InvalidRequest(
                    f"logit_bias token ids outside the vocabulary [0, {vocab_size or 'vocab'}): {bad}"
                )
        if sum(x is not None for x in (self.regex, self.json_schema, self.ebnf)) > 1:
            raise InvalidRequest("only one of regex, json_schema and ebnf may be set")
        if self.stream_interval is not None and self.stream_interval < 1:
            raise InvalidRequest(f"stream_interval must be >= 1, got {self.stream_interval}")
        if self.sampling_seed is not None and not 0 <= self.sampling_seed < 2**63:
            raise InvalidRequest(f"sampling_seed must be in [0, 2^63), got {self.sampling_seed}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS or self.top_k == 1
