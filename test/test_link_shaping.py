"""Real shaped links: the KV store and disagg traffic through network namespaces shaped with `tc`.

Each test creates its own namespaces (`ip netns add`, see netns.py) and puts a tbf qdisc (rate R
bytes/s, burst B bytes) on the devices its traffic leaves by: `lo` for Redis and its clients on
127.0.0.1 inside one namespace, or both ends of a veth pair (10.213.0.1/30 - .2) joining two.
Processes run inside via `ip netns exec`. tbf lets at most B + R * T bytes through in any T
seconds, so moving n payload bytes takes at least (n - B) / R however loaded the machine. Asserted:
  - the KV store backend's put and get of n bytes each take >= (n - B) / R and < 2 n / R on the
    shaped link, and the same transfers on that link without the qdisc take < 1/4 of that;
  - a scheduler writing prefixes through to Redis over the shaped link, and a fresh one in another
    process loading them, emit exactly the tokens of a run without a store (computed here, outside
    the namespaces), every stored page is found, no store call fails, and each run lasts at least
    (store bytes it moved - B) / R;
  - a disagg drafter verifying on a verifier in another namespace, over the shaped veth, emits
    exactly the full-mode tokens, every token after the first from a remote round, and the run
    lasts at least (KV bytes the verifier returned - B) / R.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import netns
from sglang_vericache.managers.scheduler import Scheduler
from sglang_vericache.server_args import ServerArgs
from sglang_vericache.testing.random_checkpoints import make_random_checkpoint
from sglang_vericache.testing.scheduler_harness import make_request, run_to_completion

BURST = 16384  # bytes; above the 1500-byte MTU a shaped device gets, so every packet fits
P = 8
NEW = 16
TAILS = [40, 71, 9, 100, 23]
SHARED = 33  # 4 whole pages every prompt shares

# Scripts run inside a namespace; each prints one JSON line on stdout.

# argv: url, n. Puts n bytes under one key with the runtime's store and reads them back, timed.
_STORE_CLIENT = """
import dataclasses, json, sys, time
from sglang_vericache.mem_cache.storage import create_store
url, n = sys.argv[1], int(sys.argv[2])
store = create_store("redis", url=url, timeout_s=10.0, prefix="shaping")
data = bytes(range(256)) * (n // 256) + bytes(n % 256)
t0 = time.perf_counter()
stored = store.put("blob", data)
t1 = time.perf_counter()
got = store.get(["blob"])
t2 = time.perf_counter()
store.clear()
print(json.dumps({"put_s": t1 - t0, "get_s": t2 - t1, "stored": stored, "equal": got == [data],
                  "stats": dataclasses.asdict(store.stats)}))
"""

# argv: JSON {model, url, page_size, new, prompts}. A fresh Scheduler with the Redis KV store runs
# the prompts greedily -> outputs, cached tokens, store counters, seconds the run took.
_SCHEDULER_RUN = """
import json, sys, time
from sglang_vericache.managers.scheduler import Scheduler
from sglang_vericache.server_args import ServerArgs
from sglang_vericache.testing.scheduler_harness import make_request, run_to_completion
cfg = json.loads(sys.argv[1])
sched = Scheduler(ServerArgs(model_path=cfg["model"], dtype="float32", skip_tokenizer_init=True,
                             page_size=cfg["page_size"], kv_store="redis", kv_store_url=cfg["url"],
                             kv_store_timeout=10.0))
reqs = [make_request(f"r{i}", ids, max_new_tokens=cfg["new"], temperature=0.0, ignore_eos=True)
        for i, ids in enumerate(cfg["prompts"])]
t0 = time.perf_counter()
res = run_to_completion(sched, reqs)
seconds = time.perf_counter() - t0
out = [res[f"r{i}"] for i in range(len(reqs))]
print(json.dumps({"output_ids": [r.output_ids for r in out], "cached_tokens": [r.cached_tokens for r in out],
                  "stats": sched.get_stats().extra, "seconds": seconds}))
"""

# argv: JSON {model, verifier, page_size, new, prompts}. A disagg drafter waits for the verifier,
# then runs the prompts greedily -> outputs, finish reasons, remotely emitted tokens, worker stats.
_DRAFTER_RUN = """
import json, sys, time
from sglang_vericache.managers.scheduler import Scheduler
from sglang_vericache.server_args import ServerArgs
from sglang_vericache.testing.scheduler_harness import make_request, run_to_completion
cfg = json.loads(sys.argv[1])
d = Scheduler(ServerArgs(model_path=cfg["model"], dtype="float32", skip_tokenizer_init=True,
                         page_size=cfg["page_size"], kv_compressor="streamingllm",
                         speculative_algorithm="VERICACHE", speculative_num_draft_tokens="6",
                         disagg_role="drafter", verifier_addr=cfg["verifier"]))
link, deadline = d.spec_worker.link, time.monotonic() + 60
while not link.up:
    if time.monotonic() > deadline:
        sys.exit("the verifier never answered")
    d.spec_worker.poll_verifier()
    time.sleep(0.02)
reqs = [make_request(f"r{i}", ids, max_new_tokens=cfg["new"], temperature=0.0, ignore_eos=True)
        for i, ids in enumerate(cfg["prompts"])]
t0 = time.perf_counter()
res = run_to_completion(d, reqs)
seconds = time.perf_counter() - t0
out = [res[f"r{i}"] for i in range(len(reqs))]
print(json.dumps({"output_ids": [r.output_ids for r in out], "finished": [r.finished_reason for r in out],
                  "remote_tokens": sum(r.meta["spec_rounds"] + r.meta["spec_accepted_tokens"] for r in out),
                  "worker": d.spec_worker.stats, "seconds": seconds}))
"""


def run_json(ns: netns.NetNS, script: str, *args: str, log_path=None, timeout: float = 120.0) -> dict:
    """Runs script in ns; -> its last stdout line as JSON (stderr, and log_path, in any failure)."""
    r = ns.run([sys.executable, "-c", script, *args], timeout=timeout)
    lines = r.stdout.strip().splitlines()
    log = f"\n{log_path}:\n{log_path.read_text(errors='replace')[-4000:]}" if log_path else ""
    assert r.returncode == 0 and lines, f"exit {r.returncode} in {ns.name}:\n{r.stderr[-4000:]}{log}"
    return json.loads(lines[-1])


@pytest.fixture
def namespaces():
    """Creates namespaces on demand; every one is emptied of processes and deleted at teardown."""
    why = netns.missing()
    if why:
        pytest.skip(why)
    made: list[netns.NetNS] = []

    def make() -> netns.NetNS:
        try:
            ns = netns.NetNS.create()
        except netns.NetnsUnavailable as e:
            pytest.skip(str(e))
        made.append(ns)
        return ns

    yield make
    errors = []
    for ns in made:
        try:
            ns.close()
        except Exception as e:  # still close the others
            errors.append(e)
    if errors:
        raise errors[0]


@pytest.fixture
def ns_redis(namespaces, tmp_path):
    """(namespace, url): a namespace running redis-server on its loopback, not yet shaped."""
    if netns.REDIS_BIN is None:
        pytest.skip("redis-server is not installed (bash scripts/start_redis.sh --install)")
    ns = namespaces()
    return ns, ns.start_redis(str(tmp_path))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_random_checkpoint("llama", str(tmp_path_factory.mktemp("llama")))


@pytest.fixture(scope="module")
def batch():
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(3, 400, (SHARED,), generator=g).tolist()
    return [shared + torch.randint(3, 400, (n,), generator=g).tolist() for n in TAILS]


@pytest.fixture(scope="module")
def full(llama, batch):
    """Greedy output ids of a full-mode run without a store, in this process (no namespace)."""
    sched = Scheduler(ServerArgs(model_path=llama, dtype="float32", skip_tokenizer_init=True, page_size=P))
    reqs = [make_request(f"r{i}", ids, max_new_tokens=NEW, temperature=0.0, ignore_eos=True)
            for i, ids in enumerate(batch)]
    res = run_to_completion(sched, reqs)
    return {"output_ids": [res[f"r{i}"].output_ids for i in range(len(batch))],
            "kv_bytes_per_token": sched.model_runner.token_to_kv_pool.bytes_per_token()}


def test_store_transfers_take_at_least_size_over_rate_on_the_shaped_link(ns_redis):
    ns, url = ns_redis
    rate, n = 2_000_000, 1_600_000  # 16 Mbit/s; 0.8 s per direction
    ns.set_mtu("lo", 1500)  # the MTU shape() sets: the qdisc is the only difference
    free = run_json(ns, _STORE_CLIENT, url, str(n))
    ns.shape("lo", rate, BURST)
    shaped = run_json(ns, _STORE_CLIENT, url, str(n))
    for r in (free, shaped):
        assert (r["stored"], r["equal"], r["stats"]["errors"]) == (True, True, 0), r

    floor = (n - BURST) / rate
    assert shaped["put_s"] >= floor and shaped["get_s"] >= floor, (shaped, floor)
    # Headers add ~7%; twice n / rate would mean the link is not running at the configured rate.
    assert shaped["put_s"] < 2 * n / rate and shaped["get_s"] < 2 * n / rate, shaped
    free_s, shaped_s = free["put_s"] + free["get_s"], shaped["put_s"] + shaped["get_s"]
    assert free_s < 0.25 * shaped_s, (free, shaped)


def test_scheduler_over_a_shaped_link_reuses_stored_prefixes_exactly(ns_redis, llama, batch, full):
    ns, url = ns_redis
    rate = 125_000  # 1 Mbit/s: the ~140 kB of pages each run moves take about a second
    ns.shape("lo", rate, BURST)
    cfg = json.dumps({"model": llama, "url": url, "page_size": P, "new": NEW, "prompts": batch})
    writer = run_json(ns, _SCHEDULER_RUN, cfg)
    reader = run_json(ns, _SCHEDULER_RUN, cfg)  # another process: only the store carries pages over

    w, r = writer["stats"], reader["stats"]
    assert writer["output_ids"] == full["output_ids"]
    assert (w["kv_store_exact_pages_written_total"], w["kv_store_exact_pages_hit_total"]) == (34, 0), w
    assert reader["output_ids"] == full["output_ids"]
    # Every whole page before a prompt's last token is loaded from the store or found in the tree.
    assert reader["cached_tokens"] == [(len(p) - 1) // P * P for p in batch] == [72, 96, 40, 128, 48]
    assert (r["kv_store_exact_pages_hit_total"], r["kv_store_exact_pages_missed_total"]) == (32, 0), r
    assert r["kv_store_loaded_tokens_total"] == 32 * P, r
    assert w["kv_store_errors_total"] == r["kv_store_errors_total"] == 0, (w, r)
    # The pages crossed the shaped link: each run lasted at least its store bytes over the rate.
    assert writer["seconds"] >= (w["kv_store_exact_bytes_written_total"] - BURST) / rate, w
    assert reader["seconds"] >= (r["kv_store_exact_bytes_read_total"] - BURST) / rate, r


def test_disagg_across_a_shaped_veth_link_equals_full_mode(namespaces, llama, batch, full, tmp_path):
    vns, dns = namespaces(), namespaces()
    vns.link(dns, "10.213.0.1/30", "10.213.0.2/30")
    rate = 32_000  # 256 kbit/s: the KV the verifier returns takes about a second
    vns.shape("vc0", rate, BURST)
    dns.shape("vc0", rate, BURST)
    log_path = tmp_path / "verifier.log"
    with open(log_path, "wb") as log:
        verifier = vns.popen(
            [sys.executable, "-m", "sglang_vericache.launch_server", "--model-path", llama,
             "--dtype", "float32", "--skip-tokenizer-init", "--page-size", str(P),
             "--disagg-role", "verifier", "--host", "10.213.0.1", "--disagg-port", "5555",
             "--max-total-tokens", "8192", "--num-threads", "1", "--log-level", "warning"],
            stdout=log, stderr=subprocess.STDOUT)
    cfg = json.dumps({"model": llama, "verifier": "tcp://10.213.0.1:5555", "page_size": P, "new": NEW,
                      "prompts": batch})
    out = run_json(dns, _DRAFTER_RUN, cfg, log_path=log_path)
    assert verifier.poll() is None, log_path.read_text(errors="replace")[-4000:]

    assert out["output_ids"] == full["output_ids"]
    assert out["finished"] == [{"type": "length", "length": NEW}] * len(batch)
    # Every token after the first came from a remote round, and every run sent got its result.
    assert out["remote_tokens"] == len(batch) * (NEW - 1)
    w = out["worker"]
    assert w["runs_sent"] == w["results_applied"] > 0 and w["requests_failed"] == 0, w
    # Each result carries the exact KV of its committed positions, so the verifier's end of the
    # link sent at least that much, and the run lasted at least that much over the rate.
    kv_bytes = out["remote_tokens"] * full["kv_bytes_per_token"]
    assert vns.qdisc_bytes("vc0") >= kv_bytes
    assert out["seconds"] >= (kv_bytes - BURST) / rate, (out["seconds"], kv_bytes)
