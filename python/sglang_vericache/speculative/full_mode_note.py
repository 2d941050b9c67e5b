"""Why adaptive VeriCache decodes as full mode: a log line saying so, with the measured step costs
and the throughputs the controller predicted, the first time a plan runs no round and then at most
once every FULL_MODE_NOTE_EVERY_S while plans keep running none (speculative/adaptive.py calls it
at each replan). Outputs are full mode's either way; the line says where the speed went."""

from __future__ import annotations

import logging
import time

from sglang_vericache.speculative.controller import (
    MIN_MEASURED,
    Decision,
    Plan,
    RequestView,
    StepCostModel,
    VeriCacheController,
)

logger = logging.getLogger(__name__)

FULL_MODE_NOTE_EVERY_S = 60.0


def best_rounds(controller: VeriCacheController, views: list[RequestView]) -> tuple[Decision, int] | None:
    """The best prediction with every request that can draft running rounds of one length x (the
    longest its budget allows, up to x) and the others decoding: (decision, x); None if none can draft."""
    cost = controller.cost
    best = None
    for x in controller.draft_lengths:
        plans = []
        for v in views:
            opts = controller.options(v)
            rounds = [p for p in opts if p.run and 0 < p.draft_len <= x]
            decode = next((p for p in opts if p.run and p.draft_len == 0), Plan(False, 0))
            plans.append(max(rounds, key=lambda p: p.draft_len) if rounds else decode)
        if not any(p.draft_len for p in plans):
            continue
        d = VeriCacheController._evaluate(plans, cost.coef[0], cost.draft_overhead)
        if best is None or d.throughput > best[0].throughput:
            best = (d, x)
    return best


def _duration(seconds: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if abs(seconds) >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def cost_text(cost: StepCostModel) -> str:
    c0, c_row, c_exact, c_comp, c_qk = cost.coef
    n, prefills = len(cost.samples), len(cost.anchors)
    source = (f"fitted to {n} forwards ({cost.draft_forwards} with drafts) and {prefills} prefills" if cost.measured
              else f"not measured yet ({n} of {MIN_MEASURED} decode forwards, {prefills} prefills)")
    return (f"step costs {source}: {_duration(c0)} per forward, {_duration(c_row)} per row, "
            f"{_duration(c_exact)} per exact key, {_duration(c_comp)} per compressed key, "
            f"{_duration(c_qk)} per query-key product, {_duration(cost.draft_overhead)} per forward with drafts")


def full_mode_reason(controller: VeriCacheController, views: list[RequestView], decision: Decision) -> str:
    """The note for a plan that runs no round: why, the costs, and the predictions."""
    n, drafters = len(views), [v for v in views if v.can_draft]
    if not drafters:
        why = (f"its {n} running request(s) were admitted decode-only (exact KV resident, no compressed tier: "
               f"at admission decoding was predicted at least as fast, or the step costs were not measured yet)")
    else:
        why = f"rounds are predicted slower than decoding for the {len(drafters)} of {n} request(s) that can draft"
        if len(drafters) < n:
            why += f" ({n - len(drafters)} admitted decode-only)"
    out = f"adaptive VeriCache decodes as full mode: {why}; {cost_text(controller.cost)}; " \
          f"predicted {decision.throughput:.1f} tok/s decoding"
    alt = best_rounds(controller, views) if drafters else None
    if alt is not None:
        accept = sum(v.accept_rate for v in drafters) / len(drafters)
        out += f" vs {alt[0].throughput:.1f} tok/s with rounds of up to {alt[1]} drafts (acceptance {accept:.2f})"
    return out


class FullModeNote:
    def __init__(self, every_s: float = FULL_MODE_NOTE_EVERY_S) -> None:
        self.every_s = every_s
        self.last: float | None = None

    def maybe_log(self, controller: VeriCacheController, views: list[RequestView], decision: Decision) -> bool:
        """Logs the note if due (the first time, then every every_s); -> whether it did."""
        now = time.monotonic()
        if self.last is not None and now - self.last < self.every_s:
            return False
        self.last = now
        logger.info(full_mode_reason(controller, views, decision))
        return True
