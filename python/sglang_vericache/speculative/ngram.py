"""N-gram proposals for VeriCache drafting (--speculative-ngram): a request's own prompt and output,
indexed by n-gram, propose what followed the last time its newest n tokens occurred.

A proposal is not a draft. The round (vericache_round.py) feeds it to the compressed-KV drafter as a
causal chain of rows in ONE draft forward and keeps the longest prefix the drafter's own sampler
agrees with, plus the drafter's token after it (see VeriCacheRound.sample_drafts). So every draft is
still the token the drafter samples at its position, as it would one step at a time; proposals only
let it take several in one forward. Verification, acceptance and exactness are unchanged.

NgramIndex covers the committed tokens (prompt + output): for every n in [min_window, max_window]
it maps each n-gram to the position right after its latest occurrence that has a token after it.
It is caught up lazily (sync) before a lookup; drafts are never indexed (they may be rejected), but
the n-gram looked up is the newest n tokens of committed + drafts, and the continuation read may run
from committed tokens into the drafts. The longest window that matches wins; of its occurrences the
latest does (SGLang's NGRAM keeps a cross-request trie with BFS branches; this is one chain per
request, breadth 1).

A request's proposal length adapts (NgramIndex.adapt): twice as long after a proposal the drafter
took whole, one past the taken prefix otherwise, within [1, branch length]. A proposal's rows cost
whether taken or not (on a CPU about a fifth of a one-row forward each); this keeps the draft forwards
about as few as fixed-length proposals do (221 vs 218 on four code prompts) with less than half the
rows (1010 vs 2303). Under a grammar, chain_proposals cuts a proposal where the grammar refuses or
ends it, and chain_masks gives each row the mask the drafter's step there is sampled under.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sglang_vericache.server_args_groups.speculative import NgramConfig  # noqa: F401 (the flags' settings, checked there)

if TYPE_CHECKING:
    from sglang_vericache.managers.schedule_batch import Req


@dataclass(slots=True)
class NgramIndex:
    min_window: int
    max_window: int
    span: int = 8  # the proposal length to try next (adapt; starts at the branch length)
    tokens: list[int] = field(default_factory=list)  # the committed tokens indexed so far
    last: dict[tuple[int, ...], int] = field(default_factory=dict)  # n-gram -> position after it

    def sync(self, prompt: Sequence[int], output: Sequence[int]) -> None:
        """Indexes committed tokens prompt + output beyond those already indexed (they only grow)."""
        n, p = len(self.tokens), len(prompt)
        if n < p:
            self.extend(prompt[n:])
        self.extend(output[max(0, n - p):])

    def extend(self, new: Sequence[int]) -> None:
        toks, last, lo, hi = self.tokens, self.last, self.min_window, self.max_window
        for tok in new:
            t = len(toks)  # tok is the continuation of every n-gram ending right before it
            for n in range(lo, min(hi, t) + 1):
                last[tuple(toks[t - n : t])] = t
            toks.append(tok)

    def adapt(self, proposed: int, taken: int, cap: int) -> None:
        """After a check of `proposed` tokens of which the drafter took `taken`: twice the span when
        all were taken, else one past what was (a proposal's rows are paid for whether taken or not)."""
        self.span = min(cap, 2 * self.span) if taken == proposed else max(1, taken + 1)

    def propose(self, drafts: Sequence[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest window of
        committed + drafts' newest tokens; [] when no window of at least min_window matches."""
        if k < 1:
            return []
        toks = self.tokens
        tail = (toks[-self.max_window:] + list(drafts))[-self.max_window:]
        for n in range(len(tail), self.min_window - 1, -1):
            t = self.last.get(tuple(tail[-n:]))
            if t is not None:
                out = toks[t : t + k]
                if len(out) < k:  # the continuation runs on into this round's drafts
                    out += drafts[: k - len(out)]
                return out
        return []


def chain_proposals(req: Req, cfg: NgramConfig) -> list[int]:
    """The proposals checked in req's next draft forward: [] when the round has fewer than two drafts
    left (one needs no chain); at most req's span (NgramIndex.adapt) and the drafts left less one,
    so the drafts never pass the round's target (nor its X+1 draft slots). Under a grammar, cut
    before the first token it refuses and after the one that ends it (no row past its end)."""
    st = req.spec
    if st.ngram is None:
        st.ngram = NgramIndex(cfg.min_window, cfg.max_window, cfg.branch_length)
    k = min(st.ngram.span, st.draft_target - len(st.drafts) - 1)
    if k < 1:
        return []
    st.ngram.sync(req.origin_input_ids, req.output_ids)
    q = st.ngram.propose(st.drafts, k)
    if req.grammar is None or not q:
        return q
    g, n, ended = req.grammar, 0, False
    while n < len(q) and not ended and g.accept(q[n]):
        n, ended = n + 1, g.terminated
    g.rollback(n)
    return q[: n - 1] if ended else q[:n]  # q_n may still be drafted: it is sampled at row n-1


def chain_masks(req: Req, q: list[int]) -> list:
    """The grammar mask of each row of req's chain [last token, q_1..q_k]: row i's is the matcher's
    after q_1..q_i, what the drafter's step after them is sampled under; the matcher is left as it was."""
    g = req.grammar
    masks = [g.next_bitmask()]
    for tok in q:
        assert g.accept(tok), "chain_proposals keeps only what the grammar accepts"
        masks.append(g.next_bitmask())
    g.rollback(len(q))
    return masks
