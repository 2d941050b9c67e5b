"""GGUF checkpoints: tiny GGUF files written from random HF checkpoints (testing/gguf_checkpoints.py, the way
llama.cpp's converter writes them) load the same config, weights and tokenizer as the HF folder.

- F32 / F16 / BF16 files: every parameter bitwise equal to the safetensors load (rounded to the file's
  type first), in float32 and bfloat16; greedy tokens equal to the safetensors load's.
- Quantized files: every parameter equal to gguf's own dequantization of the stored blocks (read back
  with gguf.GGUFReader, llama's q/k rows un-permuted here).
- Bad files fail with errors naming the problem.
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch

from sglang_vericache.model_config import ModelConfig
from sglang_vericache.model_executor.model_runner import ModelRunner
from sglang_vericache.model_loader.loader import load_model
from sglang_vericache.server_args import ServerArgs
from sglang_vericache.testing.forward_batches import greedy_generate
from sglang_vericache.testing.gguf_checkpoints import unpermute_qk, write_gguf
from sglang_vericache.utils.gguf_files import SUPPORTED_TYPES, TensorEntry, cache_dir, check_tensor_table
from sglang_vericache.utils.hf_tokenizer import get_tokenizer

# family -> config overrides: llama with GQA (k rows permuted per KV head), no llama3 RoPE scaling
# (llama.cpp stores that as a rope_freqs tensor, refused); qwen2 ties its embeddings, qwen3's
# head_dim (32) is not hidden / heads
FAMILIES = {"llama": ("llama2", {"num_key_value_heads": 2}), "mistral": ("mistral", {}),
            "qwen2": ("qwen2", {}), "qwen3": ("qwen3", {})}
K_SHAPE = {"hidden_size": 256, "intermediate_size": 256, "num_key_value_heads": 2}  # K-quant rows: 256
# one file per kind of test, its tensors in several types (as llama.cpp's Q4_K_M mixes Q4_K and Q6_K)
LOSSLESS = {"attn_q": "F16", "attn_k": "BF16", "ffn_up": "F16", "token_embd": "BF16", "": "F32"}
QUANTIZED = {"attn_q": "Q4_K", "attn_k": "Q5_K", "attn_v": "Q6_K", "attn_output": "Q8_0", "ffn_gate": "Q4_0",
             "ffn_up": "Q4_1", "ffn_down": "Q5_0", "token_embd": "Q5_1", "output": "Q6_K"}
PROMPTS = [[5, 17, 99, 3, 42], [7, 300, 12, 8, 250, 61, 9, 77, 140, 31, 2]]
TEXTS = ["def f(x):\n    return x * 2  # the cache", "Hello world!  <|im_start|>user\nhi<|im_end|>",
         " leading  spaces\t\ttabs"]


@pytest.fixture(scope="module", autouse=True)
def gguf_cache_home(tmp_path_factory):
    """The GGUF cache folders of this module's files in a temporary $XDG_CACHE_HOME."""
    old = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg-cache"))
    yield
    if old is None:
        os.environ.pop("XDG_CACHE_HOME")
    else:
        os.environ["XDG_CACHE_HOME"] = old


@pytest.fixture(scope="module")
def ggufs(random_model_dir, tmp_path_factory):
    """(family, qtype) -> (HF folder, GGUF file written from it), written once."""
    out = tmp_path_factory.mktemp("gguf")
    made: dict[tuple[str, str], tuple[str, str]] = {}

    def get(family: str, kind: str = "F32") -> tuple[str, str]:
        """kind: F32, Q8_0, Q4_0 (every 2-D tensor), lossless (LOSSLESS), quantized (QUANTIZED)."""
        if (family, kind) not in made:
            base, overrides = FAMILIES[family]
            if kind == "quantized":
                base, overrides = "llama2", K_SHAPE
            qtype = {"lossless": LOSSLESS, "quantized": QUANTIZED}.get(kind, kind)
            hf_dir = random_model_dir(base, **overrides)
            made[family, kind] = hf_dir, write_gguf(hf_dir, str(out / f"{family}-{kind}.gguf"), qtype)
        return made[family, kind]

    return get


ROUND = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def stored_type(hf_name: str) -> torch.dtype:
    """The torch dtype LOSSLESS stores `hf_name` in (q/k/v rows of a fused qkv_proj checked separately)."""
    for hf, kind in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("up_proj", "ffn_up"), ("embed_tokens", "token_embd")):
        if hf in hf_name and hf_name.endswith(".weight"):
            return ROUND[LOSSLESS[kind]]
    return torch.float32


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_lossless_weights_equal_safetensors_bitwise(ggufs, family):
    """F32, F16 and BF16 tensors (LOSSLESS) give the checkpoint's weights rounded to the stored type, bitwise,
    in float32 and in bfloat16."""
    from safetensors.torch import load_file

    hf_dir, gguf_path = ggufs(family, "lossless")
    checkpoint = load_file(os.path.join(hf_dir, "model.safetensors"))
    for dtype in ("float32", "bfloat16"):
        model = load_model(ModelConfig.from_path(gguf_path, dtype=dtype))
        loaded = dict(model.named_parameters())
        for hf_name, w in checkpoint.items():
            if hf_name == "lm_head.weight" and model.config.tie_word_embeddings:
                continue
            expected = w.to(stored_type(hf_name)).to(getattr(torch, dtype))
            assert torch.equal(hf_view(model, loaded, hf_name), expected), (family, dtype, hf_name)


def hf_view(model, loaded: dict, hf_name: str) -> torch.Tensor:
    """Our parameter's rows that checkpoint tensor hf_name fills (a slice of a fused one)."""
    for fused, hf, shard_id in model.stacked_params_mapping:
        if f".{hf}." in hf_name:
            name = hf_name.replace(f".{hf}.", f".{fused}.")
            layer = model.model.layers[int(hf_name.split(".layers.")[1].split(".")[0])]
            return loaded[name].detach()[model._shard_rows(fused, shard_id, layer)]
    return loaded[hf_name].detach()


def expected_from_file(gguf_path: str, hf_config) -> dict[str, np.ndarray]:
    """{GGUF name: float32 values} from gguf's own reader and dequantizer, q/k rows un-permuted (llama)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    out = {}
    for t in GGUFReader(gguf_path).tensors:
        w = dequantize(t.data, t.tensor_type)
        if ".attn_q." in t.name:
            w = unpermute_qk(w, hf_config.num_attention_heads)
        elif ".attn_k." in t.name:
            w = unpermute_qk(w, hf_config.num_key_value_heads)
        out[t.name] = w
    return out


def test_quantized_weights_equal_gguf_dequantize(ggufs):
    """Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 (the checkpoint quantized) and Q4_K, Q5_K, Q6_K (random blocks) in one
    llama file: every parameter equals gguf's dequantization of what the file stores."""
    from gguf import GGUFReader

    hf_dir, gguf_path = ggufs("llama", "quantized")
    assert {t.tensor_type.name for t in GGUFReader(gguf_path).tensors} == set(QUANTIZED.values()) | {"F32"}
    cfg = ModelConfig.from_path(gguf_path, dtype="float32")
    model = load_model(cfg)
    got = dict(model.named_parameters())
    expected = expected_from_file(gguf_path, cfg.hf_config)
    layer = model.model.layers
    for i in range(cfg.num_hidden_layers):
        attn, mlp = layer[i].self_attn, layer[i].mlp
        qkv = np.concatenate([expected[f"blk.{i}.attn_{x}.weight"] for x in "qkv"])
        gate_up = np.concatenate([expected[f"blk.{i}.ffn_{x}.weight"] for x in ("gate", "up")])
        for ours, want in ((attn.qkv_proj.weight, qkv), (attn.o_proj.weight, expected[f"blk.{i}.attn_output.weight"]),
                           (mlp.gate_up_proj.weight, gate_up), (mlp.down_proj.weight, expected[f"blk.{i}.ffn_down.weight"]),
                           (layer[i].input_layernorm.weight, expected[f"blk.{i}.attn_norm.weight"])):
            assert torch.equal(ours.detach(), torch.from_numpy(np.array(want))), i
    assert torch.equal(got["model.embed_tokens.weight"].detach(), torch.from_numpy(expected["token_embd.weight"]))
    assert torch.equal(got["lm_head.weight"].detach(), torch.from_numpy(expected["output.weight"]))
    assert cfg.dtype == torch.float32 and ModelConfig.from_path(gguf_path).dtype == torch.bfloat16  # auto


@pytest.mark.parametrize("family,dtype", [(f, "bfloat16") for f in sorted(FAMILIES)]
                         + [("llama", "float32"), ("qwen3", "float32")])
def test_greedy_tokens_equal_safetensors(ggufs, family, dtype):
    hf_dir, gguf_path = ggufs(family, "F32")
    outs = []
    for path in (hf_dir, gguf_path):
        runner = ModelRunner(ServerArgs(model_path=path, dtype=dtype, page_size=4, max_total_tokens=256,
                                        max_running_requests=4))
        outs.append(greedy_generate(runner, PROMPTS, 8))
    assert outs[0] == outs[1]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_model_config_equals_the_folders(ggufs, family):
    hf_dir, gguf_path = ggufs(family, "F32")
    ours, ref = ModelConfig.from_path(gguf_path), ModelConfig.from_path(hf_dir)
    fields = ("architecture", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "context_len", "dtype", "eos_token_ids", "tie_word_embeddings")
    want = {f: getattr(ref, f) for f in fields}
    if family == "mistral":  # llama.cpp writes Mistral as llama; the same model class serves both
        want["architecture"] = "LlamaForCausalLM"
    assert {f: getattr(ours, f) for f in fields} == want
    for key in ("rope_parameters", "intermediate_size"):
        assert getattr(ours.hf_config, key) == getattr(ref.hf_config, key), key
    # GGUF stores the epsilon as float32, which is what float32 and bfloat16 RMSNorm add anyway
    assert np.float32(ours.hf_config.rms_norm_eps) == np.float32(ref.hf_config.rms_norm_eps)
    assert ours.gguf_file == gguf_path and ref.gguf_file is None


def test_end_of_turn_token_stops_generation(random_model_dir, tmp_path):
    """eos ids: the config's and the file's end-of-turn token (llama.cpp stops on both)."""
    path = write_gguf(random_model_dir("qwen2"), str(tmp_path / "eot.gguf"), eot_token_id=4)
    cfg = ModelConfig.from_path(path)
    assert cfg.eos_token_ids == {cfg.hf_config.eos_token_id, 4} and cfg.hf_config.eos_token_id == 2


def test_tokenizer_and_chat_template_come_from_the_file(ggufs):
    """A llama file (transformers gives a qwen2/qwen3 file Qwen's pre-tokenizer split, which real Qwen files
    state anyway; our test tokenizer splits the GPT-2 way)."""
    hf_dir, gguf_path = ggufs("llama", "F32")
    ours, ref = get_tokenizer(gguf_path), get_tokenizer(hf_dir)
    for text in TEXTS:
        assert ours(text).input_ids == ref(text).input_ids
    assert ours.chat_template == ref.chat_template and ours.chat_template
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    assert ours.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == \
        ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert (ours.bos_token_id, ours.eos_token_id) == (ref.bos_token_id, ref.eos_token_id)
    folder = cache_dir(gguf_path)  # converted once, then read from the cache folder
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "chat_template.jinja", "tensors.json"} <= set(os.listdir(folder))


def test_folder_holding_one_gguf_is_the_file(ggufs, tmp_path):
    _, gguf_path = ggufs("qwen2", "F32")
    folder = tmp_path / "one"
    folder.mkdir()
    shutil.copy(gguf_path, folder)
    cfg = ModelConfig.from_path(str(folder))
    assert cfg.gguf_file == str(folder / os.path.basename(gguf_path)) and cfg.architecture == "Qwen2ForCausalLM"
    shutil.copy(gguf_path, folder / "second.gguf")
    with pytest.raises(ValueError, match=r"holds 2 GGUF files .*pass one of them as --model-path"):
        ModelConfig.from_path(str(folder))


@pytest.mark.parametrize("keep", [200, -1000])  # inside the header; inside the last tensor
def test_truncated_file_is_named_truncated(ggufs, tmp_path, keep):
    _, gguf_path = ggufs("qwen2", "Q8_0")
    data = open(gguf_path, "rb").read()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:keep])
    size = len(data[:keep])
    with pytest.raises(ValueError, match=rf"cut.gguf' is truncated or damaged: gguf cannot read it from its "
                                         rf"{size} bytes \(.*\); download or copy it again"):
        ModelConfig.from_path(str(cut))


def test_tensor_table_past_the_end_is_named_truncated(tmp_path):
    table = [TensorEntry("blk.0.attn_q.weight", "Q8_0", (32, 32), 1024, 1088)]
    with pytest.raises(ValueError, match=r"x.gguf' is truncated: its tensors need 2112 bytes \(blk.0.attn_q.weight "
                                         r"ends there\) but the file has 2000"):
        check_tensor_table(str(tmp_path / "x.gguf"), table, 2000)


def test_non_gguf_file_is_refused(tmp_path):
    bogus = tmp_path / "model.gguf"
    bogus.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(ValueError, match=r"is not a GGUF file \(it starts with b'PK\\x03\\x04'"):
        ModelConfig.from_path(str(bogus))


def test_unsupported_architecture_lists_supported(random_model_dir, tmp_path):
    path = write_gguf(random_model_dir("qwen2"), str(tmp_path / "gpt2.gguf"), architecture="gpt2")
    with pytest.raises(ValueError, match="GGUF architecture 'gpt2' is not supported; supported: gemma3, llama, "
                                         "qwen2, qwen3"):
        ModelConfig.from_path(path)


def test_unsupported_tensor_type_lists_supported(ggufs, tmp_path):
    """A Q4_0 file with one tensor relabelled IQ4_NL (blocks of 32 in 18 bytes, like Q4_0)."""
    from gguf import GGMLQuantizationType, GGUFReader

    _, gguf_path = ggufs("qwen2", "Q4_0")
    reader = GGUFReader(gguf_path)
    t = next(t for t in reader.tensors if t.tensor_type == GGMLQuantizationType.Q4_0)
    offset = t.field.parts[4].ctypes.data - reader.data.ctypes.data  # the tensor info's ggml type (uint32)
    data = bytearray(open(gguf_path, "rb").read())
    assert int.from_bytes(data[offset : offset + 4], "little") == GGMLQuantizationType.Q4_0
    data[offset : offset + 4] = int(GGMLQuantizationType.IQ4_NL).to_bytes(4, "little")
    bad = tmp_path / "iq4.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=rf"holds tensors of type IQ4_NL \(e.g. \['{t.name}'\]\).*supported: "
                                         + ", ".join(SUPPORTED_TYPES)):
        ModelConfig.from_path(str(bad))


def test_load_format_must_match_the_checkpoint(ggufs):
    hf_dir, gguf_path = ggufs("qwen2", "F32")
    with pytest.raises(ValueError, match="--load-format gguf needs --model-path naming a .gguf file"):
        load_model(ModelConfig.from_path(hf_dir), load_format="gguf")
    with pytest.raises(ValueError, match="--load-format safetensors, but --model-path .* is a GGUF checkpoint"):
        load_model(ModelConfig.from_path(gguf_path), load_format="safetensors")
