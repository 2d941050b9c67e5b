"""Llama (2/3, llama3 RoPE scaling) and Mistral; the building blocks Qwen2 and Qwen3 reuse.

Weights are stored fused: qkv_proj = [q; k; v] rows, gate_up_proj = [gate; up] rows.
`load_weights` maps Hugging Face names (q_proj, k_proj, ...) onto them.

Tensor parallelism (distributed/parallel_state.py, --tp-size): each rank holds its attention heads
(q heads and KV heads split alike, so each rank's q heads use its own KV heads), its share of the
MLP's intermediate features, and its vocabulary range (layers/vocab_parallel_embedding.py);
o_proj and down_proj all-reduce. `load_weights` keeps this rank's part of each checkpoint tensor.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from sglang_vericache.layers.activation import SiluAndMul
from sglang_vericache.layers import batch_invariant
from sglang_vericache.layers.attention.cpu_decode import EMPTY_START, CpuDecodePlan
from sglang_vericache.layers.layernorm import RMSNorm
from sglang_vericache.distributed.parallel_state import get_tp_group
from sglang_vericache.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear, divide
from sglang_vericache.layers.radix_attention import RadixAttention
from sglang_vericache.layers.rotary_embedding import (
    RotaryEmbedding,
    apply_rotary_pos_emb,
    get_rope_parameters,
)
from sglang_vericache.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
    load_vocab_rows,
)
from sglang_vericache.model_executor.forward_batch import ForwardBatch


@dataclass(frozen=True)
class AttentionFlags:
    qkv_bias: bool = False  # bias on q/k/v projections
    o_bias: bool = False  # bias on o_proj
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)


def layer_sliding_window(config, layer_id: int) -> int | None:
    """Layer layer_id's sliding window (keys visible to a query: the last `window` positions) or None:
    config.sliding_window on the layers config.layer_types calls "sliding_attention", on every layer
    where there is no layer_types (Mistral); Qwen2 / Qwen3 configs clear sliding_window unless
    use_sliding_window."""
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and layer_types[layer_id] != "sliding_attention":
        return None
    return int(window)


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False):
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(hidden_size, [intermediate_size, intermediate_size], bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_id: int, flags: AttentionFlags):
        super().__init__()
        tp = get_tp_group().size
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // total_heads
        self.num_heads = divide(total_heads, tp, "num_attention_heads")  # this rank's heads
        self.num_kv_heads = divide(total_kv_heads, tp, "num_key_value_heads")
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        d = self.head_dim
        self.qkv_proj = ColumnParallelLinear(config.hidden_size, [total_heads * d, total_kv_heads * d,
                                                                  total_kv_heads * d], bias=flags.qkv_bias)
        self.o_proj = RowParallelLinear(total_heads * d, config.hidden_size, bias=flags.o_bias)
        self.qk_norm = flags.qk_norm
        if flags.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.attn = RadixAttention(self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads, layer_id,
                                   sliding_window=layer_sliding_window(config, layer_id))

    def forward(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        t = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        out = self.attn(q, k, v.reshape(t, self.num_kv_heads, self.head_dim), forward_batch, hidden=hidden)
        return self.o_proj(out)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_id: int, flags: AttentionFlags):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id, flags)
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, getattr(config, "mlp_bias", False))
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    fused_cpu = False  # set by enable_cpu_fusion: forward_fused

    def enable_cpu_fusion(self) -> None:
        """Called by batch_invariant.enable_batch_invariance on a CPU, once the linear layers are packed:
        forward through forward_fused where it computes what forward does (plain RMSNorm, SiLU MLP,
        no q / k norms, one rank)."""
        a, mlp = self.self_attn, self.mlp
        self.fused_cpu = (type(self.input_layernorm) is RMSNorm and type(self.post_attention_layernorm) is RMSNorm
                          and type(mlp.act_fn) is SiluAndMul and not a.qk_norm and get_tp_group().size == 1)

    def forward(self, hidden, cos, sin, forward_batch: ForwardBatch) -> torch.Tensor:
        if self.fused_cpu and self.mlp.down_proj.packed_op is not None and hidden.device.type == "cpu" \
                and hidden.dtype == self.input_layernorm.weight.dtype == self.post_attention_layernorm.weight.dtype:
            return self.forward_fused(hidden, cos, sin, forward_batch)
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, forward_batch)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))

    def forward_fused(self, hidden, cos, sin, forward_batch: ForwardBatch) -> torch.Tensor:
        """forward's ops in two calls around attention (sgl_kernel_ext.cpu_rowwise.llama_attn_in /
        llama_mlp_block: the same kernels in the same order, so the same bits, without ~20 Python-level
        calls per layer); in a DECODE step whose attention the backend planned (layers/attention/cpu_decode.py)
        in one call, llama_decode_layer (the same kernels and the same KV writes as the attention path)."""
        ops = torch.ops.sgl_kernel_ext_rowwise
        a, mlp, n1, n2 = self.self_attn, self.mlp, self.input_layernorm, self.post_attention_layernorm
        qkv, o, gate_up, down = a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj
        plan = getattr(forward_batch.attn_backend, "cpu_decode", None)
        kv = None
        if plan is not None and a.attn.sliding_window is None:
            kv = plan.buffers(forward_batch, a.attn.layer_id, hidden.dtype)
        if kv is not None:  # a DECODE step: the whole layer, its KV write and attention included, in one call
            return ops.llama_decode_layer(hidden, n1.weight, n1.variance_epsilon, qkv.packed, qkv.packed_bias_arg,
                                          a.num_heads, a.num_kv_heads, a.head_dim, cos, sin, kv[0], kv[1], plan.loc,
                                          plan.kv_index, plan.allowed, EMPTY_START, a.attn.scaling, o.packed,
                                          o.packed_bias_arg, n2.weight, n2.variance_epsilon, gate_up.packed,
                                          gate_up.packed_bias_arg, gate_up.out_features, down.packed,
                                          down.packed_bias_arg)
        q, k, v, normed = ops.llama_attn_in(hidden, n1.weight, n1.variance_epsilon, qkv.packed, qkv.packed_bias_arg,
                                            a.num_heads, a.num_kv_heads, a.head_dim, cos, sin)
        out = a.attn(q, k, v, forward_batch, hidden=normed)
        return ops.llama_mlp_block(hidden, out, o.packed, o.packed_bias_arg, n2.weight, n2.variance_epsilon,
                                   gate_up.packed, gate_up.packed_bias_arg, gate_up.out_features, down.packed,
                                   down.packed_bias_arg)


class LlamaModel(nn.Module):
    def __init__(self, config, max_position: int, flags: AttentionFlags):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [LlamaDecoderLayer(config, i, flags) for i in range(config.num_hidden_layers)]
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.rotary_emb = RotaryEmbedding(head_dim, max_position, get_rope_parameters(config))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch):
        hidden = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb.get_cos_sin(positions, hidden.dtype)
        plan = getattr(forward_batch.attn_backend, "cpu_decode", None)
        fused = None if plan is None or plan.forward_batch is not forward_batch else self.decode_operands(hidden, plan)
        if fused is not None:  # a DECODE step on a CPU: every layer in one call, as forward_fused does each
            weights, eps, dims = fused
            hidden = torch.ops.sgl_kernel_ext_rowwise.llama_decode_layers(
                hidden, cos, sin, weights, eps, plan.k_buffer, plan.v_buffer, *dims, plan.loc, plan.kv_index,
                plan.allowed, EMPTY_START)
        else:
            for layer in self.layers:
                hidden = layer(hidden, cos, sin, forward_batch)
        return self.norm(hidden)

    _decode_operands: tuple | None = None  # (batch_invariant.pack_version, dtype, operands or None)

    def decode_operands(self, hidden: torch.Tensor, plan: CpuDecodePlan) -> tuple | None:
        """llama_decode_layers' operands that do not change between steps (weights, norms' eps, shapes), or
        None where some layer would not run LlamaDecoderLayer.forward_fused's decode call. Built once per
        packing of the weights (norm weights are updated in place)."""
        layers = self.layers
        if not all(layer.fused_cpu for layer in layers):
            return None
        cached = self._decode_operands
        if cached is None or cached[0] != batch_invariant.pack_version:
            cached = self._decode_operands = (batch_invariant.pack_version, *self._build_decode_operands())
        _, dtype, operands = cached
        if operands is None or hidden.dtype != dtype or plan.dtype != dtype or hidden.device.type != "cpu" \
                or len(plan.k_buffer) != len(layers):
            return None
        return operands

    def _build_decode_operands(self) -> tuple[torch.dtype | None, tuple | None]:
        weights, eps, dims = [], [], set()
        dtype = self.layers[0].input_layernorm.weight.dtype
        for i, layer in enumerate(self.layers):
            a, mlp, n1, n2 = layer.self_attn, layer.mlp, layer.input_layernorm, layer.post_attention_layernorm
            if type(layer) is not LlamaDecoderLayer or a.attn.sliding_window is not None or a.attn.layer_id != i \
                    or mlp.down_proj.packed_op is None or not n1.weight.dtype == n2.weight.dtype == dtype:
                return None, None
            qkv, o, gate_up, down = a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj
            weights += [n1.weight, qkv.packed, qkv.packed_bias_arg, o.packed, o.packed_bias_arg, n2.weight,
                        gate_up.packed, gate_up.packed_bias_arg, down.packed, down.packed_bias_arg]
            eps += [n1.variance_epsilon, n2.variance_epsilon]
            dims.add((a.num_heads, a.num_kv_heads, a.head_dim, gate_up.out_features, a.attn.scaling))
        if len(dims) != 1:
            return None, None
        return dtype, (weights, eps, dims.pop())


class LlamaForCausalLM(nn.Module):
    # (fused param, HF name, shard id): q/k/v rows of qkv_proj, gate/up rows of gate_up_proj.
    stacked_params_mapping = [
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    ]

    @classmethod
    def attention_flags(cls, config) -> AttentionFlags:
        bias = bool(getattr(config, "attention_bias", False))
        return AttentionFlags(qkv_bias=bias, o_bias=bias)

    def __init__(self, config, context_len: int | None = None):
        super().__init__()
        self.config = config
        context_len = context_len or config.max_position_embeddings
        self.model = LlamaModel(config, context_len + 64, self.attention_flags(config))
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size)
        if getattr(config, "tie_word_embeddings", False):
            self.tie_weights()

    def tie_weights(self) -> None:
        self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch):
        """-> hidden states [num_tokens, hidden] after the final norm."""
        return self.model(input_ids, positions, forward_batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.logits(hidden)

    # ---- weights --------------------------------------------------------------------------
    def _shard_rows(self, param_name: str, shard_id, layer: LlamaDecoderLayer) -> slice:
        """The rows of fused param_name that segment shard_id fills (this rank's part of it)."""
        if param_name == "qkv_proj":
            return layer.self_attn.qkv_proj.local_rows("qkv".index(shard_id))
        return layer.mlp.gate_up_proj.local_rows(shard_id)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into our (fused) parameters; every parameter must be covered."""
        params = dict(self.named_parameters())
        filled: dict[str, int] = {}  # param name -> rows (or 1) filled
        tied = getattr(self.config, "tie_word_embeddings", False)
        for name, w in weights:
            if "rotary_emb.inv_freq" in name or (tied and name == "lm_head.weight"):
                continue
            for fused, hf, shard_id in self.stacked_params_mapping:
                if f".{hf}." in name:
                    name = name.replace(f".{hf}.", f".{fused}.")
                    param = self._param(params, name)
                    layer_id = int(name.split(".layers.")[1].split(".")[0])
                    rows = self._shard_rows(fused, shard_id, self.model.layers[layer_id])
                    _copy(param.data[rows], ColumnParallelLinear.rank_part(w), name)
                    filled[name] = filled.get(name, 0) + (rows.stop - rows.start)
                    break
            else:
                param = self._param(params, name)
                if name in ("model.embed_tokens.weight", "lm_head.weight") and get_tp_group().size > 1:
                    load_vocab_rows(param.data, w)
                else:
                    _copy(param.data, RowParallelLinear.rank_part(w) if _row_parallel(name) else w, name)
                filled[name] = param.shape[0]
        if "lm_head.weight" not in filled and "lm_head.weight" in params:
            self.tie_weights()  # checkpoint without lm_head: tied embeddings
            params.pop("lm_head.weight")
        missing = [n for n, p in params.items() if filled.get(n, 0) != p.shape[0]]
        if missing:
            more = " ..." if len(missing) > 8 else ""
            raise ValueError(f"checkpoint is missing weights for: {missing[:8]}{more}")

    @staticmethod
    def _param(params: dict[str, nn.Parameter], name: str) -> nn.Parameter:
        if name not in params:
            raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in the model")
        return params[name]


def _row_parallel(name: str) -> bool:
    return ".o_proj." in name or ".down_proj." in name


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(
            f"shape mismatch for {name}: checkpoint {tuple(src.shape)} vs model {tuple(dst.shape)}"
        )
    dst.copy_(src.to(dst.dtype))


class MistralForCausalLM(LlamaForCausalLM):
    """Same architecture as Llama; every layer has config.sliding_window (when set)."""
