"""HTTP server (where and how requests arrive) and API (chat templates, parsers, sampling defaults)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from sglang_vericache.server_args_groups.base import ArgsGroup, arg

DEFAULT_CUDA_WATCHDOG_S = 300.0  # SGLang's default


@dataclass
class HttpArgs(ArgsGroup):
    TITLE = "HTTP server"

    host: str = arg("127.0.0.1", help="HTTP host to bind.")
    port: int = arg(30000, help="HTTP port to bind.")
    api_key: str | None = arg(None,
        help="Require 'Authorization: Bearer KEY' on every request (/health and /metrics stay open). "
             "Default: no key.")
    served_model_name: str | None = arg(None, help="Model name reported by /v1/models (default: --model-path).")
    stream_interval: int = arg(1,  # SGLang's --stream-interval
        help="Output tokens per streaming event (the first token and the finish are always sent at "
             "once).")
    watchdog_timeout: float | None = arg(None,  # None: watchdog_timeout_s's default
        help="Seconds one scheduler iteration (a forward) may run before the server counts it as hung: "
             "the scheduler dumps its threads' stacks and exits, and requests fail with an error "
             "instead of waiting forever. Default: 300 on CUDA; off on a CPU, where one prefill chunk "
             "of a large model can take minutes.")

    def check(self) -> None:
        self.check_at_least("stream_interval")
        if self.watchdog_timeout is not None and self.watchdog_timeout <= 0:
            raise ValueError(f"--watchdog-timeout must be > 0 seconds, got {self.watchdog_timeout}")

    @property
    def watchdog_timeout_s(self) -> float | None:
        """The watchdog timeout in force: --watchdog-timeout, else 300 s on CUDA and none on a CPU."""
        if self.watchdog_timeout is not None:
            return self.watchdog_timeout
        return DEFAULT_CUDA_WATCHDOG_S if self.device.startswith("cuda") else None


@dataclass
class ApiArgs(ArgsGroup):
    TITLE = "API: chat, parsers and sampling"

    chat_template: str | None = arg(None,
        help="A Jinja chat template file that overrides the tokenizer's own (default: the tokenizer's).")
    # Tool calling and reasoning models (SGLang's parsers).
    tool_call_parser: str | None = arg(None,
        help="SGLang function-call parser for OpenAI tools (qwen25, llama3, mistral, pythonic, hermes, "
             "...). Default: none (tool calls are not parsed out of the text).")
    reasoning_parser: str | None = arg(None,
        help="SGLang reasoning parser (qwen3, deepseek-r1, ...): chat completions return the model's "
             "thinking as message.reasoning_content, apart from content (and in stream deltas). Default: "
             "none (thinking stays in content).")
    sampling_defaults: str = arg("model", choices=("openai", "model"),
        help="What an OpenAI request that leaves temperature / top_p / top_k / min_p / "
             "repetition_penalty unset gets: model: the checkpoint's generation_config.json (for the "
             "default model, its model card's temperature 0.2, top_p 0.9), else OpenAI's; openai: "
             "OpenAI's (temperature 1, top_p 1).")
    random_seed: int = arg(0, help="Seed for the server's random choices (seeds of unseeded requests).")
    enable_cache_report: bool = arg(False,
        help="OpenAI responses report prefix-cache hits as usage.prompt_tokens_details.cached_tokens.")

    def check(self) -> None:
        if self.chat_template is not None:
            self.check_chat_template()
        if self.sampling_defaults not in ("openai", "model"):
            raise ValueError(f"--sampling-defaults must be openai or model, got {self.sampling_defaults!r}")
        if self.reasoning_parser is not None:
            from sglang.srt.parser.reasoning_parser import ReasoningParser

            if self.reasoning_parser not in ReasoningParser.DetectorMap:
                names = ", ".join(sorted(ReasoningParser.DetectorMap))
                raise ValueError(f"--reasoning-parser must be one of {names}; got {self.reasoning_parser!r}")

    def check_chat_template(self) -> None:
        """--chat-template must be a readable Jinja file: checked at launch, not on the first chat."""
        path = self.chat_template
        if not os.path.isfile(path):
            raise ValueError(f"--chat-template {path}: no such file (give a Jinja chat template file)")
        import jinja2

        try:
            with open(path) as f:
                jinja2.Environment().parse(f.read())
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--chat-template {path}: cannot be read: {e}") from None
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"--chat-template {path}: not a valid Jinja template: {e.message} "
                             f"(line {e.lineno})") from None
