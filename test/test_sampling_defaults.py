"""--sampling-defaults model: an OpenAI request's unset sampling knobs come from the checkpoint's
generation_config.json; the default model (a GGUF file, which carries none) gets its model card's."""

from __future__ import annotations

import json

from sglang_vericache.entrypoints.openai.utils import unset_knobs
from sglang_vericache.utils import default_model
from sglang_vericache.utils.sampling_defaults import model_sampling_defaults


class Req:
    temperature = None
    top_p = 0.5
    top_k = None
    min_p = None
    repetition_penalty = None


def test_generation_config_knobs_are_the_defaults(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": True, "max_new_tokens": 9}))
    assert model_sampling_defaults(str(tmp_path)) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}


def test_a_folder_without_knobs_has_no_defaults(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    assert model_sampling_defaults(str(tmp_path)) == {}
    assert model_sampling_defaults(str(tmp_path / "missing-is-fine")) == {}


def test_the_default_model_gets_its_model_cards_sampling(monkeypatch, tmp_path):
    monkeypatch.setenv("SGLANG_VERICACHE_CACHE", str(tmp_path))
    monkeypatch.setattr("sglang_vericache.utils.sampling_defaults.gguf_file_of", lambda path: None)
    assert model_sampling_defaults(default_model.default_model_path()) == {"temperature": 0.2, "top_p": 0.9}


def test_a_request_keeps_what_it_sets():
    assert unset_knobs(Req(), {"temperature": 0.2, "top_p": 0.9}) == {
        "temperature": 0.2, "top_p": 0.5, "top_k": None, "min_p": None, "repetition_penalty": None}
