"""The flashinfer attention backend, checked on CPU against FlashInfer 0.7.4's API as documented.

No GPU here and flashinfer cannot be imported (it needs CUDA packages), so:

1. Signatures: every call the backend makes (wrapper constructors, plan(), run()) is bound with
   inspect.Signature.bind to FlashInfer 0.7.4's real signatures, read from its sources by
   test/fixtures/extract_flashinfer_signatures.py into test/fixtures/flashinfer-0.7.4-signatures.json.
   The decode wrapper's plan(*deprecated_positional_args, **kwargs) forwards to the keyword-only
   _plan_impl, so decode plan calls are bound to both (and must pass nothing positionally after
   page_size). On a machine where flashinfer imports, the fixture is also compared to it.
2. Semantics: a fake `flashinfer` module (FakeFlashInfer, put in sys.modules) whose two wrappers take
   every call through those signatures and implement, in plain float32 torch, what 0.7.4's docstrings
   say: int32 indptr / indices / last_page_len (1 <= last_page_len <= page_size; kv_len =
   (pages - 1) * page_size + last_page_len), an NHD paged cache passed to run() as a (k, v) tuple of
   [num_pages, page_size, num_kv_heads, head_dim], q / kv dtypes checked against the planned
   q_data_type / kv_data_type, sm_scale given to plan() (None: 1/sqrt(head_dim)), GQA (query head h
   reads KV head h // group: the usual convention; the docstrings only say "grouped query
   attention"), causal aligned to the end of the KV (query i of qo_len sees keys
   j <= i + kv_len - qo_len: the docstring's tril(diagonal=kv_len - qo_len) example), and the decode
   wrapper's float workspace zero on first use. The real Scheduler then runs with
   attention_backend="flashinfer" and "torch": greedy tokens equal and every forward's logits close,
   in full mode (DECODE and EXTEND planned), VeriCache snapkv (TARGET_VERIFY planned, DRAFT_DECODE on
   the torch path), page size 8 with partly filled last pages, and a radix-cache hit (EXTEND with a
   nonzero prefix). Plan and run calls are counted, so a silent fallback to the torch path fails.

Not proven: that FlashInfer's CUDA kernels behave as documented (the fake is our reading of 0.7.4's
docstrings), fp16 / bf16 numerics (the fake runs float32, which the backend refuses outside these
tests since FlashInfer has no float32 kernels; bf16 gets a dtype plumbing test only), supported
head_dim values (the test model's is 16), performance, and any API change after 0.7.4. Run the
backend on a GPU before relying on it.
"""

from __future__ import annotations

import inspect
import json
import math
import sys
import types
from collections import Counter
from pathlib import Path
from typing import ClassVar

import pytest
import torch

from sglang_vericache.layers.attention import flashinfer_backend
from sglang_vericache.managers.scheduler import Scheduler
from sglang_vericache.server_args import ServerArgs
from sglang_vericache.testing.random_checkpoints import make_random_checkpoint
from sglang_vericache.testing.scheduler_harness import make_request, random_prompts, run_to_completion

REAL_DTYPES = flashinfer_backend.DTYPES
FI_VERSION = "0.7.4"
FIXTURE = Path(__file__).parent / "fixtures" / f"flashinfer-{FI_VERSION}-signatures.json"
DECODE, PREFILL = "BatchDecodeWithPagedKVCacheWrapper", "BatchPrefillWithPagedKVCacheWrapper"
PAGE = 8
PROMPT_LENS = [21, 30]  # page 8: last pages partly filled (5 and 6 of 8 tokens)
NEW = 8
LOGITS_ATOL = 2e-4  # float32, einsum vs SDPA softmax: logits (|x| up to ~20) agree to ~4e-5 (measured)
VERICACHE = {"kv_compressor": "snapkv", "speculative_algorithm": "VERICACHE",
             "speculative_num_draft_tokens": "3", "vericache_schedule": "lockstep"}
MODES = {"full": {}, "snapkv": VERICACHE}
# the forward modes each mode must plan on FlashInfer (the rest: torch path)
PLANNED = {"full": {"DECODE", "EXTEND"}, "snapkv": {"EXTEND", "TARGET_VERIFY"}}


# ---- FlashInfer 0.7.4's signatures --------------------------------------------------------------
def _signatures() -> dict[str, inspect.Signature]:
    data = json.loads(FIXTURE.read_text())
    assert data["flashinfer_version"] == FI_VERSION
    sigs = {}
    for name, params in data["signatures"].items():
        sigs[name] = inspect.Signature([
            inspect.Parameter(n, getattr(inspect.Parameter, kind),
                              default=inspect.Parameter.empty if d == "<required>" else d)
            for n, kind, d in params])
    return sigs


SIGS = _signatures()


def _bind(method: str, *args, **kwargs) -> dict:
    """Binds a call (self first) to FlashInfer's signature -> every parameter, defaults applied."""
    b = SIGS[method].bind(*args, **kwargs)  # TypeError: our call does not fit the real API
    b.apply_defaults()
    return b.arguments


def _dtype(d) -> torch.dtype:
    return getattr(torch, d) if isinstance(d, str) else d


# ---- the fake: FlashInfer's documented semantics in plain torch ------------------------------
class _FakeWrapper:
    NAME = ""

    def __init__(self, *args, **kwargs):
        a = _bind(f"{self.NAME}.__init__", self, *args, **kwargs)
        ws = a["float_workspace_buffer"]
        assert ws.dtype == torch.uint8 and ws.dim() == 1
        assert a["kv_layout"] == "NHD" and not a["use_cuda_graph"] and a["backend"] == "auto"
        self.init_args, self.plan_args, self.calls = a, None, Counter()
        FakeFlashInfer.wrappers.append(self)

    def _plan(self, a: dict, qo_indptr, indptr, indices, last, heads, kv_heads, head_dim, page_size):
        for t in (qo_indptr, indptr, indices, last):
            assert t.dtype == torch.int32 and t.dim() == 1, "FlashInfer's page table is int32 1-D"
        bs = len(last)
        assert len(indptr) == len(qo_indptr) == bs + 1 and indptr[0] == 0 and qo_indptr[0] == 0
        assert len(indices) == indptr[-1], "indices: shape [indptr[-1]]"
        pages = (indptr[1:] - indptr[:-1]).tolist()
        assert all(n >= 1 for n in pages) and all(1 <= x <= page_size for x in last.tolist())
        assert heads % kv_heads == 0
        assert a["pos_encoding_mode"] == "NONE" and a["window_left"] == -1 and not a["logits_soft_cap"]
        self.plan_args = a
        self.table = (qo_indptr.tolist(), indptr.tolist(), indices.long(),
                      [(n - 1) * page_size + x for n, x in zip(pages, last.tolist())])  # kv lens
        self.shape = (heads, kv_heads, head_dim, page_size)
        self.q_dtype = _dtype(a["q_data_type"])
        self.kv_dtype = _dtype(a["kv_data_type"]) if a["kv_data_type"] is not None else self.q_dtype
        self.o_dtype = _dtype(a["o_data_type"]) if a["o_data_type"] is not None else self.q_dtype
        self.sm_scale = a["sm_scale"] if a["sm_scale"] is not None else 1 / math.sqrt(head_dim)
        self.calls["plan"] += 1

    def run(self, *args, **kwargs):
        a = _bind(f"{self.NAME}.run", self, *args, **kwargs)
        assert a["args"] == () and not a["return_lse"] and a["out"] is None
        assert self.plan_args is not None, "run() before plan()"
        q, cache = a["q"], a["paged_kv_cache"]
        heads, kv_heads, d, ps = self.shape
        k_cache, v_cache = cache if isinstance(cache, tuple) else cache.unbind(1)
        assert k_cache.shape[1:] == (ps, kv_heads, d) and v_cache.shape[1:] == (ps, kv_heads, d), "NHD"
        assert q.dtype == self.q_dtype and k_cache.dtype == v_cache.dtype == self.kv_dtype
        qo_indptr, indptr, indices, kv_lens = self.table
        assert q.shape == (qo_indptr[-1], heads, d)
        group = heads // kv_heads
        out = torch.empty(q.shape, dtype=self.o_dtype)
        for i, kv_len in enumerate(kv_lens):
            pages = indices[indptr[i] : indptr[i + 1]]
            k = k_cache[pages].reshape(-1, kv_heads, d)[:kv_len].float().repeat_interleave(group, 1)
            v = v_cache[pages].reshape(-1, kv_heads, d)[:kv_len].float().repeat_interleave(group, 1)
            qi = q[qo_indptr[i] : qo_indptr[i + 1]].float()  # [L, H, D]
            scores = torch.einsum("lhd,shd->hls", qi, k) * self.sm_scale
            if self.causal:
                qo_len = qi.shape[0]
                assert qo_len <= kv_len
                j, r = torch.arange(kv_len), torch.arange(qo_len)[:, None]
                scores = scores.masked_fill(j > r + kv_len - qo_len, float("-inf"))
            out[qo_indptr[i] : qo_indptr[i + 1]] = torch.einsum("hls,shd->lhd", scores.softmax(-1), v)
        self.calls["run"] += 1
        return out


class FakeDecodeWrapper(_FakeWrapper):
    NAME = DECODE
    causal = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        ws = self.init_args["float_workspace_buffer"]
        assert not ws.any(), "float_workspace_buffer: must be initialized to 0 for its first use"

    def plan(self, *args, **kwargs):
        a = _bind(f"{DECODE}.plan", self, *args, **kwargs)
        assert a["deprecated_positional_args"] == (), "0.7.4: pass options after page_size by keyword"
        head = [a[n] for n in ("indptr", "indices", "last_page_len", "num_qo_heads", "num_kv_heads",
                               "head_dim", "page_size")]
        impl = _bind(f"{DECODE}._plan_impl", self, *head, **a["kwargs"])
        assert impl["q_len_per_req"] == 1
        bs = len(impl["last_page_len"])
        qo_indptr = torch.arange(bs + 1, dtype=torch.int32)  # one query per request
        self._plan(impl, qo_indptr, *head)


class FakePrefillWrapper(_FakeWrapper):
    NAME = PREFILL

    def plan(self, *args, **kwargs):
        a = _bind(f"{PREFILL}.plan", self, *args, **kwargs)
        assert a["custom_mask"] is None and a["packed_custom_mask"] is None
        assert a["head_dim_vo"] in (None, a["head_dim_qk"])
        self.causal = a["causal"]
        self._plan(a, *[a[n] for n in ("qo_indptr", "paged_kv_indptr", "paged_kv_indices",
                                       "paged_kv_last_page_len", "num_qo_heads", "num_kv_heads",
                                       "head_dim_qk", "page_size")])


class FakeFlashInfer:
    wrappers: ClassVar[list[_FakeWrapper]] = []  # every wrapper made, in order

    @classmethod
    def module(cls) -> types.ModuleType:
        m = types.ModuleType("flashinfer")
        m.__version__ = f"{FI_VERSION}+cpu-fake"
        m.BatchDecodeWithPagedKVCacheWrapper = FakeDecodeWrapper
        m.BatchPrefillWithPagedKVCacheWrapper = FakePrefillWrapper
        return m


@pytest.fixture(scope="module")
def fake_flashinfer():
    """sys.modules["flashinfer"] = the fake; the backend's CUDA check off; a 1 MiB workspace; float32
    let through (real FlashInfer refuses it; the fake computes in float32, so logits compare tightly)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "flashinfer", FakeFlashInfer.module())
        mp.setattr(flashinfer_backend, "_check_device", lambda device: None)
        mp.setattr(flashinfer_backend, "DTYPES", (*REAL_DTYPES, torch.float32))
        mp.setattr(flashinfer_backend, "WORKSPACE_BYTES", 1 << 20)
        yield FakeFlashInfer


# ---- running the scheduler ---------------------------------------------------------------
@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_random_checkpoint("llama", str(tmp_path_factory.mktemp("llama")))  # 4 heads, 2 KV heads


def _scheduler(path: str, backend: str, **server):
    server = {"dtype": "float32", **server}
    return Scheduler(ServerArgs(model_path=path, skip_tokenizer_init=True, page_size=PAGE,
                                attention_backend=backend, **server))


def _record(sched) -> list:
    """-> [(forward mode, extend prefix lens, logits)], appended to by every forward."""
    runner, forwards = sched.model_runner, []
    inner = runner.forward

    def recording_forward(fb):
        logits = inner(fb)
        forwards.append((fb.forward_mode.name, list(fb.extend_prefix_lens_cpu), logits.clone()))
        return logits

    runner.forward = recording_forward
    return forwards


def _generate(sched, prompts, tag="r"):
    reqs = [make_request(f"{tag}{i}", ids, max_new_tokens=NEW, temperature=0.0, ignore_eos=True)
            for i, ids in enumerate(prompts)]
    res = run_to_completion(sched, reqs)
    return [res[r.rid] for r in reqs]


def _run_batch(path, backend, server):
    """Both prompts at once. -> (output ids, forwards, the backend)."""
    sched = _scheduler(path, backend, **server)
    forwards = _record(sched)
    out = _generate(sched, random_prompts(PROMPT_LENS))
    return [r.output_ids for r in out], forwards, sched.model_runner.attn_backend


def _run_prefix_hit(path, backend):
    """Request a, then (after a finished) b sharing a's first 40 tokens: b hits the radix cache."""
    sched = _scheduler(path, backend)
    forwards = _record(sched)
    a, tail = random_prompts([45, 9], seed=1)
    first = _generate(sched, [a], "a")[0]
    second = _generate(sched, [a[:40] + tail], "b")[0]
    return [first.output_ids, second.output_ids], forwards, second.cached_tokens


@pytest.fixture(scope="module")
def runs(llama, fake_flashinfer):
    cache: dict[str, tuple] = {}

    def get(mode: str):
        if mode not in cache:
            start = len(fake_flashinfer.wrappers)
            want = _run_batch(llama, "torch", MODES[mode])
            got = _run_batch(llama, "flashinfer", MODES[mode])
            cache[mode] = (want, got, fake_flashinfer.wrappers[start:])
        return cache[mode]

    return get


def _assert_logits_close(got, want):
    assert [(m, p) for m, p, _ in got] == [(m, p) for m, p, _ in want]
    for i, ((m, _, a), (_, _, b)) in enumerate(zip(got, want)):
        assert a.shape == b.shape, f"forward {i} ({m})"
        torch.testing.assert_close(a, b, atol=LOGITS_ATOL, rtol=0, msg=f"forward {i} ({m})")


# ---- tests --------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_tokens_equal_torch_backend(runs, mode):
    (want, _, _), (got, _, _), _ = runs(mode)
    assert [len(o) for o in got] == [NEW] * len(PROMPT_LENS)
    assert got == want


@pytest.mark.parametrize("mode", list(MODES))
def test_every_forward_logits_close_to_torch_backend(runs, mode):
    (_, want, _), (_, got, _), _ = runs(mode)
    _assert_logits_close(got, want)


@pytest.mark.parametrize("mode", list(MODES))
def test_flashinfer_ran_every_planned_forward(runs, mode):
    """No silent fallback: one plan per planned forward, one run per layer of each; the torch path
    (forward_metadata not FlashInfer's) only for the other modes."""
    _, (_, forwards, backend), wrappers = runs(mode)
    decode, prefill = wrappers
    assert isinstance(decode, FakeDecodeWrapper) and isinstance(prefill, FakePrefillWrapper)
    modes = Counter(m for m, _, _ in forwards)
    assert set(modes) >= PLANNED[mode]
    layers = backend.model_runner.model_config.num_hidden_layers
    n_decode = modes["DECODE"]
    n_prefill = modes["EXTEND"] + modes["TARGET_VERIFY"]
    assert decode.calls == Counter({"plan": n_decode, "run": layers * n_decode} if n_decode else {})
    assert prefill.calls == Counter(plan=n_prefill, run=layers * n_prefill)
    assert prefill.causal and prefill.plan_args["q_data_type"] == torch.float32
    if mode == "snapkv":
        assert modes["DRAFT_DECODE"] > 0  # ... on the torch path: not counted above


def test_radix_cache_hit_extends_a_nonzero_prefix(llama, fake_flashinfer):
    """The second request reuses 40 tokens (5 pages) of the first's KV: its EXTEND plans a causal
    prefill over [prefix pages | new tokens], aligned to the end of the KV."""
    start = len(fake_flashinfer.wrappers)
    want, want_fwd, want_cached = _run_prefix_hit(llama, "torch")
    got, got_fwd, got_cached = _run_prefix_hit(llama, "flashinfer")
    assert got_cached == want_cached == 40
    assert any(m == "EXTEND" and any(p) for m, p, _ in got_fwd), "no EXTEND with a prefix"
    assert got == want
    _assert_logits_close(got_fwd, want_fwd)
    _, prefill = fake_flashinfer.wrappers[start:]
    assert prefill.calls["plan"] == sum(m == "EXTEND" for m, _, _ in got_fwd)


def test_bf16_dtypes_reach_flashinfer(llama, fake_flashinfer):
    """Real FlashInfer takes fp16 / bf16: q and the paged cache arrive in the planned dtypes."""
    start = len(fake_flashinfer.wrappers)
    sched = _scheduler(llama, "flashinfer", dtype="bfloat16")
    out = _generate(sched, random_prompts([13]))
    assert len(out[0].output_ids) == NEW
    decode, prefill = fake_flashinfer.wrappers[start:]
    for w in (decode, prefill):
        assert w.calls["run"] > 0
        assert (w.q_dtype, w.kv_dtype, w.o_dtype) == (torch.bfloat16,) * 3


def test_float32_is_a_clear_error(llama, fake_flashinfer, monkeypatch):
    """FlashInfer has no float32 kernels: refused when the backend is made, not deep in plan()."""
    monkeypatch.setattr(flashinfer_backend, "DTYPES", REAL_DTYPES)
    with pytest.raises(RuntimeError, match="needs --dtype float16 or bfloat16"):
        _scheduler(llama, "flashinfer")


def test_page_table_matches_flashinfer_definitions(llama, fake_flashinfer):
    """_page_table on a hand-made batch: int32, indptr = cumsum(pages), indices = page ids of the
    request's slots, last_page_len in [1, page_size] (a full last page is page_size, not 0)."""
    sched = _scheduler(llama, "flashinfer")
    backend = sched.model_runner.attn_backend
    r2t = sched.model_runner.req_to_token_pool.req_to_token
    r2t[3, :16] = torch.arange(5 * PAGE, 7 * PAGE)  # 16 tokens: pages 5, 6 (last one full)
    r2t[7, :9] = torch.cat([torch.arange(2 * PAGE, 3 * PAGE), torch.tensor([9 * PAGE])])  # pages 2, 9
    fb = types.SimpleNamespace(seq_lens_cpu=[16, 9], seq_lens=torch.tensor([16, 9]),
                               req_pool_indices=torch.tensor([3, 7]),
                               req_to_token_pool=sched.model_runner.req_to_token_pool)
    indptr, indices, last = backend._page_table(fb, torch.device("cpu"))
    assert indptr.tolist() == [0, 2, 4] and indices.tolist() == [5, 6, 2, 9] and last.tolist() == [8, 1]
    assert indptr.dtype == indices.dtype == last.dtype == torch.int32


def test_signature_binding_rejects_calls_flashinfer_would_reject():
    """The binder is not vacuous: decode plan's **kwargs land on the keyword-only _plan_impl, which
    refuses an unknown name; options after page_size go by keyword only; run() takes no sm_scale."""
    head = (None,) * 8  # self, indptr, indices, last_page_len, qo / kv heads, head_dim, page_size
    _bind(f"{DECODE}._plan_impl", *head, q_data_type="bfloat16", sm_scale=0.25)
    with pytest.raises(TypeError):
        _bind(f"{DECODE}._plan_impl", *head, q_dtype="bfloat16")
    with pytest.raises(TypeError):
        _bind(f"{DECODE}._plan_impl", *head, "NONE")
    assert _bind(f"{DECODE}.plan", *head, "NONE")["deprecated_positional_args"] == ("NONE",)
    with pytest.raises(TypeError):
        _bind(f"{PREFILL}.run", None, "q", "kv", sm_scale=0.25)
    prefill = _bind(f"{PREFILL}.plan", None, *head, causal=True)  # + qo_indptr first
    assert prefill["q_data_type"] == "float16" and prefill["sm_scale"] is None  # the real defaults


def test_fixture_is_the_installed_flashinfer():
    """Where flashinfer imports (a GPU machine with flashinfer-python==0.7.4), the recorded signatures
    are the live ones."""
    fi = pytest.importorskip("flashinfer")
    if fi.BatchDecodeWithPagedKVCacheWrapper is FakeDecodeWrapper:
        pytest.skip("flashinfer is this test's fake here")
    if fi.__version__ != FI_VERSION:
        pytest.skip(f"flashinfer {fi.__version__} installed; the fixture is {FI_VERSION}")
    for name, sig in SIGS.items():
        cls_name, meth = name.split(".")
        live = inspect.signature(getattr(getattr(fi, cls_name), meth))
        assert [p.name for p in live.parameters.values()] == [p.name for p in sig.parameters.values()]
