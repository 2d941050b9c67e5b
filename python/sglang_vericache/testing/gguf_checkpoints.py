"""Tiny GGUF files written from a Hugging Face checkpoint folder the way llama.cpp's convert_hf_to_gguf.py
writes them (gguf.GGUFWriter): its metadata keys, tensor names, llama's q/k row permutation, the
tokenizer (gpt2-style BPE) and chat template, 1-D tensors in F32 and 2-D ones in the asked type.

Types gguf can quantize (F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) quantize the checkpoint's weights;
K-quants (Q4_K, Q5_K, Q6_K) are random valid blocks, since gguf cannot quantize them: their values
are then unrelated to the checkpoint and only their dequantization can be checked.
"""

from __future__ import annotations

import json
import os

import numpy as np

# HF model_type -> GGUF general.architecture (llama.cpp writes Mistral as llama)
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")
# where each K-quant block keeps its float16 scales (byte offsets): d/dmin first, or d last
_K_SCALE_OFFSETS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute`: q/k rows from HF's rotate-half order to interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse of permute_qk (interleaved pairs back to rotate-half order)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_k_blocks(shape: tuple[int, ...], qtype: str, rng: np.random.Generator) -> np.ndarray:
    """Random K-quant blocks for a float tensor of `shape` (rows, cols), uint8 (rows, row bytes), with
    finite small scales so every value dequantizes to a finite float."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    rows, cols = shape
    blocks = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    for off in _K_SCALE_OFFSETS[qtype]:
        scales = rng.uniform(1e-3, 2e-2, size=blocks.shape[0]).astype(np.float16)
        blocks[:, off : off + 2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, cols // block * size)


def _tokenizer_metadata(writer, model_dir: str, vocab_size: int) -> None:
    """gpt2-style BPE tokenizer keys from the folder's tokenizer.json (+ chat template, special ids)."""
    with open(os.path.join(model_dir, "tokenizer.json")) as f:
        tok = json.load(f)
    with open(os.path.join(model_dir, "tokenizer_config.json")) as f:
        tok_cfg = json.load(f)
    vocab = dict(tok["model"]["vocab"])
    special = {t["content"]: t["id"] for t in tok["added_tokens"]}
    vocab.update(special)
    by_id = {i: t for t, i in vocab.items()}
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(vocab_size)]
    types = [3 if t in special else (5 if i not in by_id else 1) for i, t in enumerate(tokens)]  # 3 control, 5 unused
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for key, add in (("bos_token", writer.add_bos_token_id), ("eos_token", writer.add_eos_token_id),
                     ("pad_token", writer.add_pad_token_id)):
        if tok_cfg.get(key) in vocab:
            add(vocab[tok_cfg[key]])
    writer.add_add_bos_token(bool(tok_cfg.get("add_bos_token", False)))
    template = tok_cfg.get("chat_template")
    if template is None and os.path.isfile(os.path.join(model_dir, "chat_template.jinja")):
        with open(os.path.join(model_dir, "chat_template.jinja")) as f:
            template = f.read()
    if template:
        writer.add_chat_template(template)


def _type_of(name: str, qtype: str | dict[str, str]) -> str:
    if isinstance(qtype, str):
        return qtype
    return next(t for kind, t in qtype.items() if f".{kind}." in name or name.startswith(f"{kind}.") or not kind)


def write_gguf(model_dir: str, out_path: str, qtype: str | dict[str, str] = "F32", seed: int = 0,
               architecture: str | None = None, eot_token_id: int | None = None) -> str:
    """Write `model_dir` (a float32 HF checkpoint of a GGUF_ARCH family) as a GGUF file whose 2-D tensors
    are `qtype`, or per tensor kind ({"attn_q": "Q4_K", ..., "": default}: the first key found in the
    GGUF name). architecture: override general.architecture (to test an unsupported one);
    eot_token_id: an end-of-turn token (tokenizer.ggml.eot_token_id), as chat models' files state."""
    import gguf
    from safetensors.numpy import load_file

    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    arch = GGUF_ARCH[cfg["model_type"]]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    writer = gguf.GGUFWriter(out_path, architecture or arch)
    writer.add_name(os.path.basename(os.path.normpath(model_dir)))
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim)
    _tokenizer_metadata(writer, model_dir, cfg["vocab_size"])
    if eot_token_id is not None:
        writer.add_eot_token_id(eot_token_id)

    name_map = gguf.get_tensor_name_map(
        next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch), cfg["num_hidden_layers"])
    rng = np.random.default_rng(seed)
    for hf_name, w in sorted(load_file(os.path.join(model_dir, "model.safetensors")).items()):
        base, _, suffix = hf_name.rpartition(".")
        name = f"{name_map.get_name(base)}.{suffix}"
        if arch == "llama" and ".attn_q." in name:
            w = permute_qk(w, heads)
        elif arch == "llama" and ".attn_k." in name:
            w = permute_qk(w, kv_heads)
        t = _type_of(name, qtype) if w.ndim == 2 else "F32"
        ggml_type = gguf.GGMLQuantizationType[t]
        if t in K_QUANTS:
            writer.add_tensor(name, random_k_blocks(w.shape, t, rng), raw_dtype=ggml_type)
        elif t in ("F32", "F16"):
            writer.add_tensor(name, gguf.quants.quantize(w.astype(np.float32), ggml_type))
        else:
            writer.add_tensor(name, gguf.quants.quantize(w.astype(np.float32), ggml_type), raw_dtype=ggml_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path
