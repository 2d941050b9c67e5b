"""The sampling defaults of a model (SGLang's --sampling-defaults model): what an OpenAI request that
leaves temperature, top_p, top_k, min_p or repetition_penalty unset gets.

They come from the checkpoint's generation_config.json (a GGUF file's cached conversion); a GGUF file
carries none, so the default model gets its model card's recommendation (PackagedModel.sampling).
"""

from __future__ import annotations

import json
import os

from sglang_vericache.utils.default_model import DEFAULT_MODEL, default_model_path
from sglang_vericache.utils.gguf_files import ensure_config, gguf_file_of

KNOBS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def model_sampling_defaults(model_path: str) -> dict[str, float]:
    """The knobs of KNOBS the model's generation config sets (none: an empty dict)."""
    gguf = gguf_file_of(model_path)
    folder = ensure_config(gguf) if gguf else model_path
    path = os.path.join(folder, "generation_config.json")
    config = {}
    if os.path.isfile(path):
        with open(path) as f:
            config = json.load(f)
    defaults = {k: config[k] for k in KNOBS if config.get(k) is not None}
    if not defaults and os.path.realpath(model_path) == os.path.realpath(default_model_path()):
        defaults = dict(DEFAULT_MODEL.sampling)
    return defaults
