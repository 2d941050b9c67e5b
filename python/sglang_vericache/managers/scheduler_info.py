"""SchedulerInfoMixin: what the scheduler reports of itself: the longest request it takes, the
ready message the TokenizerManager waits for (sizes, dtype, modes) and each KV tier's budget."""

from __future__ import annotations

from sglang_vericache.managers.io_struct import SchedulerReady


class SchedulerInfoMixin:
    @property
    def max_req_len(self) -> int:
        """Longest prompt + output one request may reach: the context, the pool less a page,
        (when exact KV streams over a link) what one verification may stage, and (two-tier modes with
        a fixed schedule) what the compressed tier holds for one request alone (its whole pages fold
        into it: TwoTierKV.can_admit / fold). Adaptive VeriCache admits a request too long for the
        compressed tier decode-only, so it is not limited by it."""
        limit = min(self.context_len, self.max_total_num_tokens - self.page_size)
        if self.server_args.uses_link:
            limit = min(limit, self.server_args.verify_staging_tokens)
        tt = self.two_tier
        if tt is not None and not self.server_args.adaptive:
            limit = min(limit, (tt.pool.num_chunks + 1) * self.page_size - 1)
        return limit

    def mode_line(self) -> str:
        """The startup line saying what decodes: the KV mode, and in the two-tier modes the compressor
        and its ratio; in VeriCache mode the draft tokens and the schedule."""
        args = self.server_args
        if self.two_tier is None:
            where = "host memory, streamed every step (--kv-offload)" if args.kv_offload else "the KV pool"
            return f"KV mode: full (exact KV only, in {where}; no VeriCache)"
        comp = (f"compressor {args.kv_compressor} "
                f"(effective ratio {self.two_tier.compressor.effective_ratio():.2f}x)")
        if self.mode == "lossy":
            return f"KV mode: lossy ({comp}; decodes from the compressed tier alone: outputs differ from full mode)"
        draft = f"auto (up to {args.max_draft_tokens} per round)" if args.draft_tokens is None else \
            f"{args.draft_tokens} per round"
        schedule = {"adaptive": "adaptive (rounds only where the measured costs predict them faster than "
                                "decoding as full mode; else it decodes as full mode)",
                    "staggered": "staggered", "lockstep": "lock-step"}.get(args.schedule, str(args.schedule))
        role = f", disagg role {args.disagg_role}" if args.disagg_role != "none" else ""
        ngram = ", n-gram proposals on" if args.speculative_ngram else ""
        return (f"KV mode: vericache (VeriCache: draft over the compressed KV, verify over the exact KV; "
                f"outputs equal full mode's), {comp}, draft tokens {draft}, schedule {schedule}{ngram}{role}")

    def ready_message(self) -> SchedulerReady:
        mc = self.model_runner.model_config
        return SchedulerReady(
            max_total_num_tokens=self.max_total_num_tokens,
            max_req_input_len=self.max_req_len - 1,
            context_length=self.context_len,
            vocab_size=self.vocab_size,
            server_info={
                "max_total_num_tokens": self.max_total_num_tokens,
                "page_size": self.page_size,
                "context_length": self.context_len,
                "vocab_size": self.vocab_size,
                "dtype": str(mc.dtype).replace("torch.", ""),
                "num_hidden_layers": mc.num_hidden_layers,
                "kv_bytes_per_token": self.model_runner.token_to_kv_pool.bytes_per_token(),
                "grammar_backend": "xgrammar" if self.grammar_backend is not None else None,
                "enable_deterministic_inference": bool(self.server_args.enable_deterministic_inference),
                "batch_invariant_linear": self.model_runner.batch_invariant_linear_name(),
                **self.tier_info(),
            },
        )

    def tier_info(self) -> dict:
        """Each KV tier's budget: where it lives, and how much it holds."""
        exact = self.model_runner.token_to_kv_pool
        info = {
            "kv_mode": self.mode,
            "exact_tier": {
                "where": "device" if self.mode == "full" else "host",
                "tokens": self.max_total_num_tokens,
                "bytes": self.max_total_num_tokens * exact.bytes_per_token(),
                "memory": str(exact.get_key_buffer(0).device),  # --exact-kv-pool host: cpu on CUDA too
            },
        }
        cache = self.model_runner.exact_cache
        if cache is not None:  # --exact-kv-pool host: the accelerator's page cache of it
            info["exact_tier"]["device_cache"] = {"tokens": cache.num_pages * self.page_size,
                                                  "bytes": cache.num_pages * self.page_size * exact.bytes_per_token(),
                                                  **cache.stats}
        if self.two_tier is not None:
            pool = self.two_tier.pool
            info["compressed_tier"] = {
                "where": "device",
                "compressor": self.server_args.kv_compressor,
                "chunks": pool.num_chunks,
                "tokens": pool.num_chunks * self.page_size,
                "bytes": pool.num_chunks * pool.bytes_per_chunk(),
                "effective_ratio": round(self.two_tier.compressor.effective_ratio(), 3),
            }
        if self.prefix_store is not None:
            info["kv_store"] = self.prefix_store.info()
        if self.spec_worker is not None:  # the schedule reports itself (and the drafter its verifier)
            info.update(self.spec_worker.server_info(self.server_args))
        return info
