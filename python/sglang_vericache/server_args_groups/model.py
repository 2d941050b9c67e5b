"""Model and tokenizer: which checkpoint, how its weights are read, and in which dtype on which device."""

from __future__ import annotations

import os
from dataclasses import dataclass

from sglang_vericache.server_args_groups.base import ArgsGroup, arg
from sglang_vericache.utils.default_model import default_model_path

DTYPES = ("auto", "float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
# --quantization values honoured: gguf (SGLang's name for weights read from a GGUF file; here they are
# dequantized into --dtype when loaded).
QUANTIZATIONS = ("gguf",)


@dataclass
class ModelArgs(ArgsGroup):
    TITLE = "Model and tokenizer"

    model_path: str = arg(default_factory=default_model_path,
        help="Local Hugging Face model folder (config.json, *.safetensors, tokenizer files), or a GGUF "
             "file (or a folder holding one .gguf and no config.json): config, weights and tokenizer "
             "come from the file, converted once into ~/.cache/sglang_vericache/gguf/. Default: "
             "SmolLM2-135M-Instruct (a GGUF file), fetched by scripts/setup_cpu.sh into "
             "~/.cache/sglang_vericache/models.")
    tokenizer_path: str | None = arg(None, help="Tokenizer folder or GGUF file (default: --model-path).")
    load_format: str = arg("auto", choices=LOAD_FORMATS,
        help="How weights are loaded: safetensors reads the folder's *.safetensors; gguf dequantizes a "
             "GGUF file into --dtype; auto is whichever --model-path holds; dummy draws seeded random "
             "weights from the config alone (--random-seed), to benchmark a model's shape without its "
             "checkpoint (pair with --skip-tokenizer-init or --tokenizer-path).")
    skip_tokenizer_init: bool = arg(False,
        help="Do not load a tokenizer: requests carry input_ids and responses carry output_ids only.")
    trust_remote_code: bool = arg(False,
        help="Let transformers run code shipped with the model folder's config or tokenizer.")
    context_length: int | None = arg(None,
        help="Longest prompt + output a request may have (default: the model's max_position_embeddings).")
    dtype: str = arg("auto", choices=DTYPES,
        help="Weight and activation dtype ('auto' = the checkpoint's torch_dtype, float32 for float32 "
             "checkpoints; for GGUF: float32 if every weight is stored F32, else bfloat16).")
    kv_cache_dtype: str = arg("auto", choices=DTYPES,
        help="Dtype the exact KV is stored in ('auto' = --dtype). E.g. --dtype float32 --kv-cache-dtype "
             "bfloat16 computes in float32 over bfloat16 KV: half the KV memory and link bytes; every "
             "mode (full, VeriCache, lossy) reads the same rounded KV, so VeriCache stays identical to "
             "full.")
    quantization: str | None = arg(None,
        help="Weight quantization, SGLang's flag: gguf (the weights of a GGUF --model-path, dequantized "
             "into --dtype when loaded; implies --load-format gguf). Any other value is refused with an "
             "error (quantized KV: --kv-compressor). Default: none (the checkpoint's own weights).")
    device: str = arg("cpu", help="Device to run on: cpu or cuda.")

    def check(self) -> None:
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"--load-format must be auto, safetensors, gguf or dummy, got {self.load_format!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.kv_cache_dtype not in DTYPES:
            raise ValueError(f"--kv-cache-dtype must be one of {DTYPES}, got {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype != "auto" and self.attention_backend != "torch":
            raise ValueError(f"--kv-cache-dtype {self.kv_cache_dtype} needs --attention-backend torch "
                             f"(the {self.attention_backend} backend reads KV in the compute dtype)")
        if self.quantization is not None:
            self.check_quantization()

    def check_quantization(self) -> None:
        """--quantization gguf (SGLang sets it for a GGUF checkpoint): the weights must come from a GGUF file."""
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"--quantization {self.quantization}: quantized weights are not supported, except a "
                             "GGUF file's (--quantization gguf, dequantized into --dtype when loaded); serve "
                             "a float32/bfloat16/float16 checkpoint (quantized KV: --kv-compressor kivi4)")
        if self.load_format not in ("auto", "gguf"):
            raise ValueError(f"--quantization gguf reads a GGUF file: not with --load-format {self.load_format}")
        from sglang_vericache.utils.gguf_files import gguf_file_of

        if os.path.exists(self.model_path) and gguf_file_of(self.model_path) is None:
            raise ValueError(f"--quantization gguf: --model-path {self.model_path} is a Hugging Face folder, "
                             "not a GGUF file")
        self.load_format = "gguf"
