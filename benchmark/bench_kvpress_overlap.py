"""Kept sets of our token droppers over a whole prompt against kvpress's presses, same model, same prompt.

    .venv/bin/python benchmark/bench_kvpress_overlap.py --model-path /tmp/models/smollm2-hf --context-tokens 1024

One Hugging Face forward of a held-out code prompt under each kvpress press (SnapKVPress,
ExpectedAttentionPress) at compression ratio 0.75; in the press's compress() hook, where kvpress has
every layer's post-RoPE keys, values and hidden states, the press's own kept indices (its scores'
top-k per KV head) are recorded beside what our compressor keeps of the same keys, values and queries
(`compress_segment` over the whole prompt as one segment: 4x, pages of 16). Overlap = |ours & kvpress|
/ kept, per layer and KV head. Our queries are the layer's q_proj of the same hidden states with the
same RoPE (kvpress's get_prerope_query_states), so the figure compares the selection rules.

KVzip end to end: our server (an in-process Scheduler, kvzip, segment scope, float32) folds the same
prompt through its own reconstruction passes (its model forward, kvpress's repeat prompts and chunks
of 2,048 tokens after the context); its kept set per KV head is read from the compressed tier.
KVzipPress runs on the HF model with the same inputs (the context is the raw prompt: no chat-template
prefix skipped, no chat suffix after the repeat prompt, as our replay has none; under transformers 5
the prefill is given its cache explicitly, else KVzipPress's replay reads no context). Two figures: against
the top-k of KVzipPress's scores per KV head (the same rule, per-head budgets as ours), and against
what KVzipPress keeps (`layerwise=True`: its budget ranked across the heads of a layer, so a head
keeps more or fewer than ours; overlap = |ours & kvpress| / ours); the latter also for ours with
`--kv-head-budget adaptive` (our budget ranked across a layer's heads too; overlap over the layer's cells).
And ours with `--kv-head-budget global` (the default: every layer's heads ranked at once) against KVzipPress's
default (`layerwise=False`): overlap over every layer's cells, and each layer's budget against kvpress's (ours
is rounded to whole chunks of the pool). Ours ranks the rule alone here (`--kv-keep-recent 0`), as a press does.

Writes benchmark/results/kvpress_overlap.{json,md,png}.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from transformers import AutoModelForCausalLM

from common import RESULTS, code_prompts, machine, write_results
from sglang_vericache.utils.hf_tokenizer import get_tokenizer
from sglang_vericache.compress.base import CompressorConfig
from sglang_vericache.compress.registry import get_compressor
from sglang_vericache.layers.rotary_embedding import get_rope_parameters
from sglang_vericache.server_args import bundled_model_path


def our_keep(comp, layer: int, module, hidden, keys, values, position_embeddings) -> torch.Tensor:
    """[H_kv, kept] what our compressor keeps of one layer's prompt (batch 1) as one segment."""
    from kvpress.utils import get_prerope_query_states
    from transformers.models.llama.modeling_llama import rotate_half

    q = get_prerope_query_states(module, hidden)  # [1, H_q, S, D]
    cos, sin = position_embeddings
    q = (q * cos.unsqueeze(1)) + (rotate_half(q) * sin.unsqueeze(1))
    s = keys.shape[2]
    k, v, q = keys[0].transpose(0, 1), values[0].transpose(0, 1), q[0].transpose(0, 1)  # [S, H, D]
    pos = torch.arange(s)
    idx = comp.compress_segment(layer, k.float(), v.float(), q=q.float(), q_positions=pos, positions=pos)["idx"]
    return idx.long().permute(2, 0, 1).flatten(1)


def measure(model, ids, press_cls, press_kwargs, comp) -> list[list[float]]:
    """Overlap per layer and KV head of press_cls's kept set and comp's."""
    overlaps: dict[int, list[float]] = {}

    class Recording(press_cls):
        def forward_hook(self, module, input, kwargs, output):
            # transformers 5 passes no cache_position to attention layers (kvpress 0.5.5 reads it): a
            # prefill from position 0.
            kwargs = dict(kwargs)
            kwargs.setdefault("cache_position", torch.arange(kwargs["hidden_states"].shape[1]))
            return super().forward_hook(module, input, kwargs, output)

        def compress(self, module, hidden_states, keys, values, attentions, kwargs):
            from kvpress.utils import compute_n_kept

            scores = self.score(module, hidden_states, keys, values, attentions, kwargs)
            n_kept = compute_n_kept(keys.shape[2], self.compression_ratio)
            theirs = scores.topk(n_kept, dim=-1).indices[0]  # [H, n_kept]
            ours = our_keep(comp, module.layer_idx, module, hidden_states, keys, values,
                            kwargs["position_embeddings"])
            assert ours.shape == theirs.shape, f"{ours.shape} kept, kvpress {theirs.shape}"
            overlaps[module.layer_idx] = [len(set(a.tolist()) & set(b.tolist())) / n_kept
                                          for a, b in zip(ours, theirs)]
            return super().compress(module, hidden_states, keys, values, attentions, kwargs)

    with torch.no_grad(), Recording(compression_ratio=0.75, **press_kwargs)(model):
        model(torch.tensor([ids]))
    return [overlaps[i] for i in sorted(overlaps)]


def kvzip_ours(model_path: str, ids: list[int], head_budget: str = "uniform") -> list[torch.Tensor]:
    """Per layer [H_kv, S] bool: what our server's kvzip keeps of the prompt (one segment, float32)."""
    from sglang_vericache.managers.scheduler import Scheduler
    from sglang_vericache.server_args import ServerArgs
    from sglang_vericache.testing.scheduler_harness import make_request, run_to_completion

    sched = Scheduler(ServerArgs(model_path=model_path, dtype="float32", page_size=16, kv_compressor="kvzip",
                                 kv_compression_ratio=4, speculative_algorithm="VERICACHE",
                                 vericache_schedule="lockstep", kv_compress_scope="segment",
                                 kv_head_budget=head_budget, kv_keep_recent=0))  # the rule alone, as a press ranks
    tt, kept = sched.two_tier, []
    fold = tt.fold

    def recording(req, **kw):
        c = len(req.comp_indices)
        ok = fold(req, **kw)
        if c == 0 and len(req.comp_indices):
            for layer in range(tt.pool.num_layers):
                if req.comp_layer_chunks is None:
                    cells = tt.pool.read(layer, req.comp_indices).tensors  # idx [n, k_l, H] segment indices
                else:  # global budgets: the layer's flat chunks
                    cells = {name: buf[req.comp_layer_chunks[layer]] for name, buf in tt.pool.flat.items()}
                idx = cells["idx"].long()
                head = cells["head"].long() if "head" in cells else torch.arange(idx.shape[-1]).expand_as(idx)
                mask = torch.zeros(idx.shape[-1], len(ids) // 16 * 16, dtype=torch.bool)
                mask[head.flatten(), idx.flatten()] = True  # head-adaptive: cell (j, c) is head[j, c]'s
                kept.append(mask)
        return ok

    tt.fold = recording
    run_to_completion(sched, [make_request("kvzip", ids, max_new_tokens=1)])
    assert kept, "the prompt was not folded"
    return kept


def kvzip_theirs(model_path: str, ids: list[int], layerwise: bool = True):
    """(per layer [H_kv, ctx] KVzipPress's scores, per layer [H_kv, ctx] bool what it keeps); layerwise=False:
    KVzipPress's default, one top-k over every layer."""
    from kvpress import KVzipPress

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, attn_implementation="sdpa")
    captured = {}

    class Recording(KVzipPress):
        def prepare(self, model, tokenizer, prev_postfix_size=8):
            self.prefix_length = 0  # the raw prompt is the context (no chat template around it)
            self._suffix_ids = self._suffix_ids[:, :0]  # our replay has no chat suffix
            return super().prepare(model, tokenizer, prev_postfix_size)

        def compress_post(self, model):
            super().compress_post(model)
            captured["scores"] = self.score_val[:, 0].clone()
            captured["pruned"] = [layer.self_attn.masked_key_indices for layer in model.model.layers]

    # Under transformers 5 the model creates its cache inside LlamaModel.forward, so KVzipPress's hook
    # records past_key_values=None and its replay would read no context: hand it the cache.
    from transformers import DynamicCache

    with torch.no_grad(), Recording(compression_ratio=0.75, layerwise=layerwise, n_sink=4, chunk_size=2048)(model):
        model(torch.tensor([ids]), past_key_values=DynamicCache(config=model.config))
    keeps = []
    for scores, (_, heads, seqs) in zip(captured["scores"], captured["pruned"]):
        keep = torch.ones_like(scores, dtype=torch.bool)
        keep[heads, seqs] = False
        keeps.append(keep)
    return captured["scores"], keeps


def kvzip_row(model_path: str, ids: list[int]) -> dict:
    """Ours (uniform) against the top-k of KVzipPress's scores per head and against what KVzipPress(layerwise=True)
    keeps; ours with --kv-head-budget adaptive (the layer's budget ranked across heads) against the latter, cell by
    cell: |ours & kvpress| / |ours| over the layer."""
    ours = kvzip_ours(model_path, ids)
    adaptive = kvzip_ours(model_path, ids, "adaptive")
    n_kept = int(ours[0][0].sum())
    scores, keeps = kvzip_theirs(model_path, ids)
    rule, kept, across = [], [], []
    for mine, ada, score, keep in zip(ours, adaptive, scores, keeps):
        top = score.float().topk(n_kept, dim=-1).indices
        rule.append([len(set(a.nonzero().flatten().tolist()) & set(b.tolist())) / n_kept for a, b in zip(mine, top)])
        keep = keep[:, : mine.shape[1]]
        kept.append([float(keep[h][mine[h]].float().mean()) for h in range(len(mine))])
        across.append([float(keep[ada].float().mean())])
    # global budgets (the default): ours against KVzipPress's default (layerwise=False), cells of every layer
    glob = kvzip_ours(model_path, ids, "global")
    _, glob_keeps = kvzip_theirs(model_path, ids, layerwise=False)
    glob_keeps = [keep[:, : mine.shape[1]] for keep, mine in zip(glob_keeps, glob)]
    over_global = [[float(keep[mine].float().mean()) if mine.any() else 1.0]
                   for mine, keep in zip(glob, glob_keeps)]
    row = {"compressor": "kvzip", "press": "KVzipPress", "press_kwargs": {"chunk_size": 2048, "n_sink": 4},
           "global_kept_all": sum(int(k[m].sum()) for m, k in zip(glob, glob_keeps)) / sum(int(m.sum()) for m in glob),
           "global_layer_share_ours": [int(m.sum()) / int(glob[0].numel() / 4) for m in glob],
           "global_layer_share_kvpress": [int(k.sum()) / int(glob[0].numel() / 4) for k in glob_keeps]}
    for key, per_layer in (("", rule), ("kept_", kept), ("adaptive_kept_", across), ("global_kept_", over_global)):
        flat = [x for layer in per_layer for x in layer]
        row |= {f"{key}mean_overlap": statistics.mean(flat), f"{key}min_overlap": min(flat),
                f"{key}per_layer_mean": [statistics.mean(layer) for layer in per_layer],
                f"{key}per_layer_head": per_layer}
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", required=True, help="A Hugging Face model folder (Llama-like).")
    p.add_argument("--context-tokens", type=int, default=1024, help="Prompt length (a multiple of 16).")
    p.add_argument("--out", default="kvpress_overlap", help="Results name under benchmark/results.")
    args = p.parse_args()
    from kvpress import ExpectedAttentionPress, SnapKVPress

    if args.context_tokens % 16:
        raise SystemExit("--context-tokens must be a multiple of 16 (whole pages)")
    tok = get_tokenizer(args.model_path)
    ids = code_prompts(tok, 1, args.context_tokens, args.context_tokens, model_path=bundled_model_path())[0].ids
    model = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=torch.float32, attn_implementation="eager")
    hf = model.config

    def ours(name: str, **options):
        cfg = CompressorConfig(name, ratio=4, chunk_size=16, num_layers=hf.num_hidden_layers,
                               num_kv_heads=hf.num_key_value_heads, num_q_heads=hf.num_attention_heads,
                               head_dim=hf.head_dim, dtype=torch.float32, rope_parameters=get_rope_parameters(hf),
                               keep_recent=0, **options)  # each rule alone, as a press ranks (no --kv-keep-recent)
        return get_compressor(name, cfg)

    cases = [
        ("snapkv", SnapKVPress, {"window_size": 64, "kernel_size": 5}, ours("snapkv", kernel_size=5)),
        ("expected_attention", ExpectedAttentionPress, {"n_future_positions": 512, "n_sink": 4},
         ours("expected_attention", n_future_positions=512, num_sink_tokens=4)),
    ]
    rows = []
    for name, press, kwargs, comp in cases:
        per_layer = measure(model, ids, press, kwargs, comp)
        flat = [x for layer in per_layer for x in layer]
        rows.append({"compressor": name, "press": press.__name__, "press_kwargs": kwargs,
                     "mean_overlap": statistics.mean(flat), "min_overlap": min(flat),
                     "per_layer_mean": [statistics.mean(layer) for layer in per_layer], "per_layer_head": per_layer})
    del model
    rows.append(kvzip_row(args.model_path, ids))
    report = {"model_path": args.model_path, "machine": machine(), "prompt_tokens": len(ids), "args": vars(args),
              "rows": rows}
    lines = [
        f"Kept sets, ours vs kvpress, on {args.model_path}: one held-out code prompt of {len(ids)} tokens, "
        "compression 4x (kvpress compression_ratio 0.75), the whole prompt as one segment, float32; "
        f"machine: {machine()}",
        "",
        "| ours | kvpress press | press options | mean overlap | min overlap (a layer's head) "
        "| overlap with what the press keeps (budget across a layer's heads) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        across = f"{r['kept_mean_overlap']:.1%} (min {r['kept_min_overlap']:.1%})" if "kept_mean_overlap" in r else "-"
        if "adaptive_kept_mean_overlap" in r:
            across += (f"; with --kv-head-budget adaptive {r['adaptive_kept_mean_overlap']:.1%} "
                       f"(min {r['adaptive_kept_min_overlap']:.1%}, a layer)")
        if "global_kept_all" in r:
            share = [abs(a - b) for a, b in zip(r["global_layer_share_ours"], r["global_layer_share_kvpress"])]
            across += (f"; with --kv-head-budget global (the default) against KVzipPress's default (layerwise=False: "
                       f"one top-k over every layer) {r['global_kept_all']:.1%} of every layer's cells (min "
                       f"{r['global_kept_min_overlap']:.1%}, a layer; each layer's budget within "
                       f"{max(share):.2f} of the mean budget of kvpress's)")
        lines.append(f"| {r['compressor']} | {r['press']} | {r['press_kwargs']} | {r['mean_overlap']:.1%} "
                     f"| {r['min_overlap']:.1%} | {across} |")
    write_results(args.out, report, "\n".join(lines))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in rows:
        ax.plot(range(len(r["per_layer_mean"])), r["per_layer_mean"], marker="o", label=f"{r['compressor']} vs {r['press']}")
    ax.set_xlabel("layer")
    ax.set_ylabel("kept-set overlap (mean over KV heads)")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"Our token droppers vs kvpress, {len(ids)}-token prompt, 4x")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(RESULTS / f"{args.out}.png", dpi=120)
    print(f"wrote {RESULTS / args.out}.png")


if __name__ == "__main__":
    main()
