#!/usr/bin/env bash
# End-to-end recipe for the bundled model. Run from the repository root:
#   PYTHON=.venv/bin/python bash recipes/code_model/run_all.sh [extra train.py args]
# Deterministic given --seed (default 0). Writes recipes/code_model/work/ and
# python/sglang_vericache/assets/vericache-code-tiny/.
set -euo pipefail
PY=${PYTHON:-python}
if [[ $PY == */* && $PY != /* ]]; then PY="$PWD/$PY"; fi  # a relative path must survive the cd
cd "$(dirname "$0")"
WORK=work
$PY make_corpus.py --out "$WORK"
$PY train_tokenizer.py --work "$WORK"
$PY train.py --work "$WORK" "$@"
$PY evaluate.py --work "$WORK"
$PY make_card.py --work "$WORK" --dest ../../python/sglang_vericache/assets/vericache-code-tiny
cp "$WORK/corpus_manifest.json" corpus_manifest.json
