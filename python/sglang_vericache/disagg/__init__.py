"""Dual-instance VeriCache (issue 8): a drafter instance and a verifier instance over ZMQ.

    drafter  (--disagg-role drafter --verifier-addr tcp://HOST:PORT)
             the serving instance: HTTP/OpenAI, tokenizer, its own prefill (exact KV computed
             locally, folded into the compressed tier), drafting over the compressed tier.
             Verification is a VerifyRun message; it never blocks: requests waiting for a
             result are skipped while the others keep drafting (remote_verify.py).
    verifier (--disagg-role verifier --disagg-port PORT)
             owns exact KV only (full-mode pools, its own radix cache, --kv-store exact tier):
             prefills each session's prompt (or loads it from the store), verifies the runs that
             arrived, batched in one TARGET_VERIFY forward per iteration, and returns accepted
             length, the correction token, logprobs and the exact KV of the committed positions
             (verifier.py).

Exactness: both sides sample with the same counter-based noise of (seed, position, logits), so the
drafter's first token (from its own exact prefill) and the verifier's choices are what full mode
picks; the drafter commits each result with VeriCacheRound.commit, the single-instance commit.

Faults: every message carries the verifier's epoch. A verifier that goes silent for
--disagg-timeout seconds, or answers with a new epoch (a restart), fails the drafter's requests
that held sessions with "verifier at ADDR went away"; new requests then open sessions on the new
instance. A drafter silent for --disagg-timeout loses its sessions on the verifier.
"""
