"""The OpenAI-compatible endpoints through the official `openai` client: completions and chat,
streaming and not, exact usage numbers, logprobs, n, and /v1/models, /v1/tokenize, /v1/detokenize."""

from __future__ import annotations

import openai
import pytest
import requests
from transformers import AutoTokenizer

PROMPT = "def return import class self value"
MESSAGES = [{"role": "system", "content": "You write code."}, {"role": "user", "content": "print a list"}]
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def tok(default_model_dir):
    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused")


@pytest.fixture(scope="module")
def model(client, default_model_dir):
    return default_model_dir


def native_greedy(n: int) -> dict:
    return {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}


def native(base_url: str, **body) -> dict:
    r = requests.post(base_url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def chat_prompt_ids(tok, messages) -> list[int]:
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


def test_models_lists_the_served_model(client, default_model_dir):
    models = client.models.list()
    assert [m.id for m in models.data] == [default_model_dir]
    assert models.data[0].max_model_len == 2048


def test_models_retrieve_the_served_model_or_404(client, default_model_dir):
    card = client.models.retrieve(default_model_dir)
    assert (card.id, card.max_model_len) == (default_model_dir, 2048)
    with pytest.raises(openai.NotFoundError, match="The model `other` does not exist."):
        client.models.retrieve("other")


# ---------------------------------------------------------------- completions


def test_completion_matches_native_generate_with_exact_usage(client, model, base_url, tok):
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=7, **GREEDY)
    ref = native(base_url, text=PROMPT, sampling_params=native_greedy(7))
    assert out.object == "text_completion" and out.model == model
    assert len(out.choices) == 1
    assert out.choices[0].text == ref["text"]
    assert out.choices[0].finish_reason == "length"
    n_prompt = len(tok.encode(PROMPT))
    usage = (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens)
    assert usage == (n_prompt, 7, n_prompt + 7)


def test_completion_stream_concatenates_to_the_same_text(client, model):
    full = client.completions.create(model=model, prompt=PROMPT, max_tokens=9, **GREEDY)
    chunks = list(
        client.completions.create(
            model=model,
            prompt=PROMPT,
            max_tokens=9,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 9
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_stream_without_include_usage_has_no_usage_chunk(client, model):
    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=3, stream=True, **GREEDY))
    assert all(c.choices and c.usage is None for c in chunks)


def test_completion_n_and_prompt_list_usage_counts_each_prompt_once(client, model, tok):
    prompts = [PROMPT, "while if else"]
    out = client.completions.create(model=model, prompt=prompts, max_tokens=4, n=2, **GREEDY)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert out.choices[0].text == out.choices[1].text and out.choices[2].text == out.choices[3].text
    n_prompt = sum(len(tok.encode(p)) for p in prompts)
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (n_prompt, 16)


def test_completion_stream_with_n_keeps_choices_apart(client, model):
    full = client.completions.create(model=model, prompt=PROMPT, max_tokens=5, **GREEDY).choices[0].text
    chunks = list(
        client.completions.create(model=model, prompt=PROMPT, max_tokens=5, n=2, stream=True, **GREEDY)
    )
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert "".join(ch.text for ch in mine) == full
        assert mine[-1].finish_reason == "length"


def test_chat_stream_with_n_keeps_choices_apart(client, model):
    full = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=5, **GREEDY)
    chunks = list(
        client.chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=5, n=2, stream=True, **GREEDY
        )
    )
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert mine[0].delta.role == "assistant"
        assert "".join(ch.delta.content or "" for ch in mine) == full.choices[0].message.content
        assert mine[-1].finish_reason == "length"


def test_completion_accepts_token_id_prompts(client, model, tok):
    by_text = client.completions.create(model=model, prompt=PROMPT, max_tokens=5, **GREEDY)
    by_ids = client.completions.create(model=model, prompt=tok.encode(PROMPT), max_tokens=5, **GREEDY)
    assert by_ids.choices[0].text == by_text.choices[0].text


def test_completion_logprobs(client, model, base_url):
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, logprobs=2, **GREEDY)
    lp = out.choices[0].logprobs
    ref = native(
        base_url,
        text=PROMPT,
        sampling_params=native_greedy(4),
        return_logprob=True,
        return_text_in_logprobs=True,
    )
    entries = ref["meta_info"]["output_token_logprobs"]
    assert lp.tokens == [e[2] for e in entries]
    assert lp.token_logprobs == pytest.approx([e[0] for e in entries])
    assert len(lp.top_logprobs) == 4 and all(len(row) <= 2 for row in lp.top_logprobs)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]


def test_completion_echo_prepends_the_prompt(client, model):
    plain = client.completions.create(model=model, prompt=PROMPT, max_tokens=3, **GREEDY)
    echoed = client.completions.create(model=model, prompt=PROMPT, max_tokens=3, echo=True, **GREEDY)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text


def test_completion_stop_reports_stop(client, model):
    full = client.completions.create(model=model, prompt=PROMPT, max_tokens=20, **GREEDY).choices[0].text
    pairs = [full[i : i + 2] for i in range(2, len(full) - 2)]
    stop = next(p for p in pairs if p.strip() and p.isascii() and p.isprintable())
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=20, stop=[stop], **GREEDY)
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == full[: full.find(stop)]


# ---------------------------------------------------------------- chat


def test_chat_uses_the_tokenizer_chat_template(client, model, base_url, tok):
    out = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=6, **GREEDY)
    ids = chat_prompt_ids(tok, MESSAGES)
    ref = native(base_url, input_ids=ids, sampling_params=native_greedy(6))
    assert out.object == "chat.completion"
    msg = out.choices[0].message
    assert msg.role == "assistant" and msg.content == ref["text"]
    assert out.choices[0].finish_reason == "length"
    usage = (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens)
    assert usage == (len(ids), 6, len(ids) + 6)


def test_chat_stream_role_then_content_then_usage(client, model):
    full = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, **GREEDY)
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=MESSAGES,
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    with_choices = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in with_choices) == full.choices[0].message.content
    assert with_choices[-1].choices[0].finish_reason == "length"
    assert chunks[-1].choices == []
    assert chunks[-1].usage.model_dump(
        include={"prompt_tokens", "completion_tokens", "total_tokens"}
    ) == full.usage.model_dump(include={"prompt_tokens", "completion_tokens", "total_tokens"})


def test_chat_n_returns_n_choices(client, model):
    out = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=3, n=2, **GREEDY)
    assert [c.index for c in out.choices] == [0, 1]
    assert out.usage.completion_tokens == 6
    assert (
        out.usage.prompt_tokens
        == client.chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=3, **GREEDY
        ).usage.prompt_tokens
    )


def test_chat_logprobs(client, model):
    out = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=3, logprobs=True, top_logprobs=2, **GREEDY
    )
    content = out.choices[0].logprobs.content
    assert len(content) == 3
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert entry.bytes == list(entry.token.encode("utf-8"))


def test_chat_seed_makes_sampling_reproducible(client, model):
    kwargs = {
        "model": model,
        "messages": MESSAGES,
        "max_tokens": 10,
        "temperature": 1.0,
        "seed": 7,
        "extra_body": {"ignore_eos": True},
    }
    a = client.chat.completions.create(**kwargs).choices[0].message.content
    b = client.chat.completions.create(**kwargs).choices[0].message.content
    assert a == b


# ---------------------------------------------------------------- tokenize / detokenize


def test_tokenize_and_detokenize_round_trip(base_url, tok):
    r = requests.post(base_url + "/v1/tokenize", json={"prompt": PROMPT}, timeout=30).json()
    assert r == {"tokens": tok.encode(PROMPT), "count": len(tok.encode(PROMPT)), "max_model_len": 2048}
    d = requests.post(base_url + "/v1/detokenize", json={"tokens": r["tokens"]}, timeout=30).json()
    assert d == {"text": PROMPT}
