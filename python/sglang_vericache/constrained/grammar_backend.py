"""GrammarBackend: compiles a request's regex / json_schema / ebnf with xgrammar and hands out
per-request Grammar matchers.

The tokenizer manager compiles once to reject a bad pattern with a 400 before any work starts;
the scheduler compiles again (xgrammar caches compiled grammars) to build the matcher.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable

import xgrammar as xgr

from sglang_vericache.constrained.grammar import Grammar
from sglang_vericache.sampling.sampling_params import InvalidRequest, SamplingParams

GRAMMAR_KINDS = ("regex", "json_schema", "ebnf")
ANY_JSON = "$$ANY$$"  # SGLang's json_schema value for "any JSON value"
_CPP_PREFIX = re.compile(r"^\[[\d:. ]+\]\s*\S+:\d+:\s*")  # "[16:34:14] /project/cpp/x.cc:83: "


def grammar_key(params: SamplingParams) -> tuple[str, str] | None:
    """(kind, spec) of the request's constraint, or None. SamplingParams.verify allows one."""
    for kind in GRAMMAR_KINDS:
        spec = getattr(params, kind)
        if spec is not None:
            return kind, spec
    return None


def _error_text(e: Exception) -> str:
    lines = [_CPP_PREFIX.sub("", line).strip() for line in str(e).strip().splitlines()]
    return " ".join(line for line in lines if line) or type(e).__name__


class GrammarBackend:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Iterable[int]):
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(set(stop_token_ids))
        )
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True)

    def compile(self, kind: str, spec: str) -> xgr.CompiledGrammar:
        """Raises InvalidRequest naming the problem for a bad pattern, schema or grammar."""
        try:
            if kind == "regex":
                return self.compiler.compile_regex(spec)
            if kind == "json_schema":
                if spec == ANY_JSON:
                    return self.compiler.compile_builtin_json_grammar()
                try:
                    json.loads(spec)
                except ValueError as e:
                    raise ValueError(f"not valid JSON ({e})") from None
                return self.compiler.compile_json_schema(spec, any_whitespace=False)
            if kind == "ebnf":
                return self.compiler.compile_grammar(spec)
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError subclasses
            what = {"regex": "regex", "json_schema": "JSON schema", "ebnf": "EBNF grammar"}[kind]
            raise InvalidRequest(f"invalid {what}: {_error_text(e)}") from None
        raise ValueError(f"unknown grammar kind {kind!r}")

    def validate(self, params: SamplingParams) -> None:
        key = grammar_key(params)
        if key is not None:
            self.compile(*key)

    def new_grammar(self, params: SamplingParams) -> Grammar | None:
        key = grammar_key(params)
        if key is None:
            return None
        return Grammar(xgr.GrammarMatcher(self.compile(*key)), self.vocab_size, key)
