"""The tool-call parser a chat template implies, so tool_choice 'auto' works without --tool-call-parser.

A chat template that renders tools writes calls in one family's format; its markers name the parser
(SGLang's names) that reads them back. A template with no tool format (SmolLM2's, the bundled model's)
implies none: 'auto' then answers 400 naming the flag, while 'required' and named functions work
through constrained decoding with any template.
"""

from __future__ import annotations

# (marker in the template, parser), first match wins: Qwen's chatml <tool_call> before hermes' plain one.
TEMPLATE_MARKERS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("<tool_call>", "<|im_start|>"), "qwen25"),
    (("<tool_call>",), "hermes"),
    (("[TOOL_CALLS]",), "mistral"),
    (("<|python_tag|>",), "llama3"),
    (("<｜tool▁calls▁begin｜>",), "deepseekv3"),
)


def detect_tool_call_parser(chat_template: str | dict | None) -> str | None:
    """SGLang's parser name for the tool-call format `chat_template` writes, or None if it writes none."""
    if isinstance(chat_template, dict):  # named templates: the one used with tools, else the default
        chat_template = chat_template.get("tool_use") or chat_template.get("default")
    if not chat_template:
        return None
    for markers, parser in TEMPLATE_MARKERS:
        if all(m in chat_template for m in markers):
            return parser
    return None
