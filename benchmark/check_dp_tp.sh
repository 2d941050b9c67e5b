#!/usr/bin/env bash
# By-hand check of data x tensor parallelism: launch_server --dp-size 2 --tp-size 2 (two replicas of two
# ranks each, behind sglang-router) on a random llama; 4 greedy requests through the front must equal
# the same prompts run in-process at tp 1, each replica must report tp_size 2, and SIGTERM must leave no
# process behind. Run from the repository root: bash benchmark/check_dp_tp.sh
set -euo pipefail
export PYTHONPATH="$PWD/python:$PWD/sgl-kernel-ext/python" OMP_NUM_THREADS=1
PY=.venv/bin/python
DIR=$(mktemp -d)
PORT=${PORT:-38517}
$PY -c "from sglang_vericache.testing.random_checkpoints import make_random_checkpoint as m; m('llama', '$DIR/ckpt')"
$PY -m sglang_vericache.launch_server --model-path "$DIR/ckpt" --dtype float32 --skip-tokenizer-init \
    --page-size 8 --dp-size 2 --tp-size 2 --port "$PORT" --log-level warning > "$DIR/server.log" 2>&1 &
SERVER=$!
for _ in $(seq 1 240); do curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break; sleep 1; done
rc=0
$PY - "$PORT" "$DIR/ckpt" <<'PY' || rc=$?
import sys

import requests
import torch

from sglang_vericache.managers.scheduler import Scheduler
from sglang_vericache.server_args import ServerArgs
from sglang_vericache.testing.scheduler_harness import make_request, run_to_completion

port, ckpt = sys.argv[1], sys.argv[2]
base = f"http://127.0.0.1:{port}"
replicas = requests.get(base + "/server_info", timeout=10).json()["replicas"]
tp = [requests.get(r["url"] + "/server_info", timeout=10).json()["tp_size"] for r in replicas]
print("replicas:", [r["state"] for r in replicas], "tp_size:", tp)
g = torch.Generator().manual_seed(0)
prompts = [torch.randint(3, 400, (n,), generator=g).tolist() for n in (9, 30, 17, 44)]
sp = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
got = [requests.post(base + "/generate", json={"input_ids": p, "sampling_params": sp}, timeout=120).json()["output_ids"]
       for p in prompts]
s = Scheduler(ServerArgs(model_path=ckpt, dtype="float32", skip_tokenizer_init=True, page_size=8))
res = run_to_completion(s, [make_request(f"r{i}", p, max_new_tokens=12, temperature=0.0, ignore_eos=True)
                            for i, p in enumerate(prompts)])
same = got == [res[f"r{i}"].output_ids for i in range(len(prompts))]
print("dp 2 x tp 2 tokens == tp 1 in-process:", same)
sys.exit(0 if same and tp == [2, 2] else 1)
PY
kill -TERM "$SERVER"; wait "$SERVER" || true
sleep 2
left=$(pgrep -f "$DIR/ckpt" | wc -l || true)
echo "processes left after SIGTERM: $left"
rm -rf "$DIR"
[ "$rc" = 0 ] && [ "$left" = 0 ]
