"""tool_choice 'auto' without --tool-call-parser: the parser a chat template's tool format implies."""

from __future__ import annotations

import pytest

from sglang_vericache.entrypoints.openai.tool_parser_detect import detect_tool_call_parser

QWEN = "{%- if tools %}<|im_start|>system\n# Tools ... <tool_call>\n{\"name\": ...}\n</tool_call>{%- endif %}"
HERMES = "{% for tool in tools %}<tools>{{ tool }}</tools>{% endfor %} <tool_call>{...}</tool_call>"
MISTRAL = "{%- if message.tool_calls %}[TOOL_CALLS] [{{ ... }}]{%- endif %}"
LLAMA3 = "{%- if builtin_tools %}<|python_tag|>{{ ... }}{%- endif %}<|start_header_id|>ipython"
CHATML = "{% for message in messages %}{{ '<|im_start|>' + message['role'] }}{% endfor %}"


@pytest.mark.parametrize(("template", "parser"), [
    (QWEN, "qwen25"), (HERMES, "hermes"), (MISTRAL, "mistral"), (LLAMA3, "llama3"),
    (CHATML, None), ("", None), (None, None),
])
def test_template_markers_name_the_parser(template, parser):
    assert detect_tool_call_parser(template) == parser


def test_named_templates_use_the_tool_use_one():
    assert detect_tool_call_parser({"default": CHATML, "tool_use": HERMES}) == "hermes"
    assert detect_tool_call_parser({"default": MISTRAL}) == "mistral"
