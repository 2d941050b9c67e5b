"""--reasoning-parser: SGLang's ReasoningParser splits a reasoning model's thinking (e.g. <think>...
</think>) from its answer; chat responses carry the thinking as reasoning_content."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest

from sglang_vericache.entrypoints.openai.tool_calls import ToolPlan

if TYPE_CHECKING:
    from sglang.srt.parser.reasoning_parser import ReasoningParser

    from sglang_vericache.managers.tokenizer_manager import TokenizerManager


def _constrained(req: ChatCompletionRequest, plan: ToolPlan | None) -> bool:
    """A grammar decides the whole output (required / named tools, JSON formats, regex, ebnf):
    there is no thinking to split off."""
    fmt = req.response_format
    return bool((plan is not None and plan.constrained) or req.regex or req.ebnf
                or (fmt is not None and fmt.type != "text"))


def new_reasoning_parser(
    tm: TokenizerManager, req: ChatCompletionRequest, plan: ToolPlan | None, stream: bool
) -> ReasoningParser | None:
    """A parser for one choice, or None when the server has no --reasoning-parser, the request
    asks for separate_reasoning=false, or a grammar constrains the output."""
    name = tm.server_args.reasoning_parser
    if name is None or not req.separate_reasoning or _constrained(req, plan):
        return None
    from sglang.srt.parser.reasoning_parser import ReasoningParser

    return ReasoningParser(
        model_type=name,
        stream_reasoning=stream and req.stream_reasoning,
        request=req,
        tokenizer=tm.tokenizer,
        tool_call_parser_active=plan is not None,
    )


def split_whole_output(parser: ReasoningParser, tokenizer, out: dict) -> tuple[str | None, str]:
    """A finished native output -> (thinking or None, the rest of its text); its meta_info gets
    "reasoning_tokens" for usage."""
    thought, text = parser.parse_non_stream(out["text"])
    out["meta_info"]["reasoning_tokens"] = count_reasoning_tokens(
        parser, tokenizer, out.get("output_ids", []), bool(thought))
    return thought, text or ""


def split_stream_delta(parser: ReasoningParser, delta: str, final: bool) -> tuple[str, str]:
    """(thinking, content) of one stream delta; on the final one, with whatever the parser held
    back (a partial tag) flushed."""
    thinking, content = parser.parse_stream_chunk(delta) if delta else (None, None)
    thinking, content = thinking or "", content or ""
    if final:
        more, rest = parser.parse_stream_end()
        thinking, content = thinking + (more or ""), content + (rest or "")
    return thinking, content


def count_reasoning_tokens(parser: ReasoningParser, tokenizer, output_ids: list[int], thought: bool) -> int:
    """usage.reasoning_tokens, counted as SGLang's scheduler does: the output tokens up to and
    including the end-of-thinking tokens, or all of them when the thinking never ended; 0 when
    the output had no thinking (thought=False) or there is no tokenizer to find the end with."""
    if not thought or tokenizer is None:
        return 0
    end = parser.detector.get_think_end_token_ids(tokenizer)
    n = len(end)
    for i in range(len(output_ids) - n + 1):
        if n and output_ids[i : i + n] == end:
            return i + n
    return len(output_ids)
