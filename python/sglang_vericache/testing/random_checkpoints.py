"""Tiny random-weight HF checkpoints (float32 safetensors + a tokenizer) for each supported family.

Every parameter is random, including norm weights and biases (HF initializes those to 1/0,
which would hide a loading bug), and the embedding / lm_head std is large so greedy argmax
has a clear margin rather than near-ties.
"""

from __future__ import annotations

import os
import shutil

import torch

BUNDLED_TOKENIZER = os.path.join(os.path.dirname(os.path.dirname(__file__)), "assets", "vericache-code-tiny")
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"
)
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
SPECIAL_TOKENS = [BOS, EOS, "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)

# family -> (config class name, architecture, family-specific config)
FAMILIES: dict[str, tuple[str, str, dict]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(
        rope_theta=10000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=64),
        tie_word_embeddings=False,
    )),
    "llama2": ("LlamaConfig", "LlamaForCausalLM", dict(
        num_key_value_heads=4, num_hidden_layers=3, rope_theta=10000.0, tie_word_embeddings=False,
    )),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(
        sliding_window=None, rope_theta=1000000.0, tie_word_embeddings=False,
    )),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(rope_theta=1000000.0, tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        head_dim=32, rope_theta=1000000.0, tie_word_embeddings=False,  # head_dim != hidden/heads (16)
    )),
    # Gemma 3 270M's shape in miniature: one KV head, sliding layers around a global one, a window
    # (12) shorter than most test prompts, local and global RoPE bases, query_pre_attn_scalar != head_dim.
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        head_dim=32, num_key_value_heads=1, num_hidden_layers=4, sliding_window=12,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        query_pre_attn_scalar=24, hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
    )),
}


# A family's seed offset, fixed: adding a family must not change another family's weights (every test's
# expected tokens rest on them). gemma3 shares 0 with llama: their shapes differ, so their weights do.
SEED_OFFSETS = {"llama": 0, "llama2": 1, "mistral": 2, "qwen2": 3, "qwen3": 4, "gemma3": 0}


def _training_text() -> list[str]:
    words = ("def return import class self value list dict for while if else print range len "
             "the a model token cache key query attention layer page batch request server").split()
    lines = []
    for i in range(400):
        w = [words[(i * 7 + j * 3) % len(words)] for j in range(6 + i % 5)]
        lines.append(f"{w[0]} f{i}(x, y={i % 13}):  # " + " ".join(w[1:]))
        lines.append(f"    return x * {i} + y  {i * 31 % 97}")
    return lines


def _write_tokenizer(out_dir: str):
    """Copy the bundled tokenizer if the package ships one, else train a tiny byte-level BPE."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if os.path.isfile(os.path.join(BUNDLED_TOKENIZER, "tokenizer.json")):
        for name in TOKENIZER_FILES:
            src = os.path.join(BUNDLED_TOKENIZER, name)
            if os.path.isfile(src):
                shutil.copy(src, out_dir)
        return AutoTokenizer.from_pretrained(out_dir)
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=480, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(_training_text(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=EOS)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


def _randomize(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith("bias"):
                p.copy_(0.2 * noise)
            elif "embed_tokens" in name or "lm_head" in name:
                p.copy_(0.5 * noise)
            else:
                p.copy_(0.25 * noise)  # large enough that tied lm_heads do not just echo the input
        if getattr(model.config, "model_type", "") == "gemma3_text":
            _gemma_scales(model, gen)


def _gemma_scales(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Gemma's norms scale by (1 + weight) and its embeddings by sqrt(hidden): with the scales above its
    tied head echoes the input, and q / k norms of ~3 make attention so sharp that bfloat16 rounding
    flips greedy tokens (logits off by ~10% of their spread). Here: embeddings 8x smaller, layer norms
    2 + 0.2 noise (the layers' outputs outweigh the embedding), q / k norms 1 + 0.2 noise, a final norm
    of 5 + 0.2 noise (wider logit margins): varied greedy text, bfloat16 logits within ~1.3% of float32's."""
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            base = 4.0 if name == "model.norm.weight" else 0.0 if name.endswith(("q_norm.weight", "k_norm.weight")) else 1.0
            p.copy_(base + 0.2 * torch.randn(p.shape, generator=gen))
        elif "embed_tokens" in name:
            p.mul_(0.125)


def make_random_checkpoint(family: str, out_dir: str, seed: int = 0, max_shard_size: str | None = None,
                           **overrides) -> str:
    """Write a tiny random `family` checkpoint (float32) to out_dir and return out_dir.

    overrides: config fields (e.g. sliding_window=16, num_hidden_layers=3).
    max_shard_size: e.g. "100KB" to write a sharded checkpoint with model.safetensors.index.json.
    """
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose from {sorted(FAMILIES)}")
    cfg_cls_name, arch, extra = FAMILIES[family]
    os.makedirs(out_dir, exist_ok=True)
    tokenizer = _write_tokenizer(out_dir)
    vocab = -(-len(tokenizer) // 64) * 64  # >= tokenizer vocab, a multiple of 64
    kwargs = {**_COMMON, **extra, "vocab_size": vocab, "architectures": [arch],
              "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id, **overrides}
    config = getattr(transformers, cfg_cls_name)(**kwargs)
    seed = seed * 1000 + SEED_OFFSETS[family]  # distinct weights per family
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed)
    save_kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out_dir, **save_kwargs)
    write_random_kvzap(out_dir, config, seed)
    return out_dir


def write_random_kvzap(out_dir: str, config, seed: int) -> None:
    """A random linear KVzap surrogate (compress/kvzap.py) for the checkpoint, so `--kv-compressor
    kvzap` runs on it (the rows it keeps are arbitrary; the bundled model ships a trained one)."""
    from sglang_vericache.compress.kvzap import SURROGATE_FILE, KVzapSurrogate

    g = torch.Generator().manual_seed(seed)
    layers, hidden, heads = config.num_hidden_layers, config.hidden_size, config.num_key_value_heads
    KVzapSurrogate({"w": torch.randn(layers, hidden, heads, generator=g) / hidden**0.5,
                    "b": torch.zeros(layers, heads)}).save(os.path.join(out_dir, SURROGATE_FILE))
