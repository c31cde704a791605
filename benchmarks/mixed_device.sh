#!/usr/bin/env bash
# Issue 34 on one GPU: prompt chunks replayed in the decode graphs (items 3 and 4), sliding-window models (item 2).
# From the repository root on the device machine, with `.whl` (the wheels the image lacks), `.meta` (the default
# model's config and tokenizer files, from ~/.cache/streamd/gguf-meta/*) and `.ab/streamd` (the package before
# the change, `git archive <commit> streamd | tar -x -C .ab`, for the A/B phases) carried:
#   STREAMD_GIT_COMMIT=<the commit sent> benchmarks/mixed_device.sh PHASE...
# PHASES: tests (the CUDA tests of the engine, the hybrid layout and the graphs' rows); rows (a step with a prompt
# chunk beside decodes, eager against its graph replay: `mixed_rows_device.py`); hybrid (Gemma 3 and gpt-oss
# shapes: `hybrid_device.py`); gemma-steps (Gemma 3's decode step at two `max_model_len`s); fairness and serve (`streamd bench fairness` / `bench serve --offline-baseline` on
# a random-weight SmolLM2-135M-shaped checkpoint with the real tokenizer, before and after, alternating; SERVE_SIDES
# picks the serve sides); cuda-more (the CUDA tests of the cache engine, fused layers, FP8 and 8-bit KV); cuda-all
# (every CUDA test); throughput and multiturn (`streamd bench throughput` on the
# 135M and 1B shapes, `bench multiturn` on the 8B shape, with the prefill graphs on and off: `model.prefill_graphs`).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/results"
export PYTHONUNBUFFERED=1 STREAMD_LOG_FORMAT=json
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
model=/tmp/smol-random
if [ ! -d $model ]; then python3 - <<'PY'
import shutil, torch
from transformers import AutoModelForCausalLM
from streamd.bench.offline import model_config
with torch.device("cuda"):
    m = AutoModelForCausalLM.from_config(model_config("smollm2-135m"), dtype=torch.bfloat16)
m.save_pretrained("/tmp/smol-random")
for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
    shutil.copy(f".meta/{name}", "/tmp/smol-random")
PY
fi
rm -rf /tmp/streamd-after && cp -r streamd /tmp/streamd-after
use() { rm -rf streamd; if [ "$1" = before ]; then cp -r .ab/streamd .; else cp -r /tmp/streamd-after streamd; fi; }
for phase in "$@"; do
  echo "=== $phase $(date -u +%T)"
  case $phase in
    tests)
      timeout 300 python3 -m pytest -q -m cuda -p no:cacheprovider tests/engine/test_cuda_engine.py \
        tests/engine/test_hybrid_cuda.py 2>&1 | tail -15 | tee "$OUT/cuda-tests.log" ;;
    rows)
      timeout 300 python3 benchmarks/mixed_rows_device.py "$OUT/results/mixed-rows.json" "${ROWS_SHAPES:-smollm2-135m,llama3.2-1b,llama3.1-8b}" \
        2>"$OUT/rows-stderr.log" | tee "$OUT/rows.log"; tail -3 "$OUT/rows-stderr.log" ;;
    hybrid)
      timeout 400 python3 benchmarks/hybrid_device.py "$OUT/results/hybrid.json" "${HYBRID_SHAPES:-gemma-3-1b,gpt-oss-20b}" \
        2>"$OUT/hybrid-stderr.log" | grep -v '^ ' | tee "$OUT/hybrid.log"; grep -v '^{' "$OUT/hybrid-stderr.log" | tail -5 ;;
    gemma-steps)  # one decode step of the Gemma-3-1B shape with 8k- and 33k-wide decode graphs, both layouts
      for ctx in "7680 8192" "32768 33280"; do
        set -- $ctx
        timeout 250 python3 benchmarks/hybrid_device.py "$OUT/results/gemma-$2.json" gemma-3-1b $1 $2 \
          2>"$OUT/gemma-stderr.log" | grep '^gemma' | tee -a "$OUT/gemma-steps.log"
      done ;;
    fairness)
      i=0; for side in ${FAIR_SIDES:-before after before after}; do
        use $side; i=$((i + 1))
        timeout 120 python3 -m streamd.cli.main bench fairness --models default --device cuda --window-s 1 \
          --set "model.name=\"$model\"" --rounds 2 --out "$OUT/results/fairness-$i-$side" 2>"$OUT/fairness-stderr.log" \
          | grep -E "p99|tokens/s|steps with" | sed "s/^/$side /" | tee -a "$OUT/fairness.log"
        grep -v '^{' "$OUT/fairness-stderr.log" | tail -3
      done; use after ;;
    cuda-more)  # the CUDA tests of the cache engine, the fused layers, FP8 weights and 8-bit KV
      timeout 420 python3 -m pytest -q -m cuda -p no:cacheprovider tests/engine/worker/test_cache_engine.py \
        tests/engine/worker/test_fusion.py tests/engine/worker/test_fp8_cuda.py tests/kernels/test_kv_quant.py \
        tests/kernels/test_cuda.py 2>&1 | tail -15 | tee "$OUT/cuda-more.log" ;;
    cuda-all)
      timeout 420 python3 -m pytest -q -m cuda -p no:cacheprovider tests 2>&1 | tail -25 | tee "$OUT/cuda-all.log" ;;
    throughput)
      for side in ${THROUGHPUT_SIDES:-on off on off}; do  # before: .ab's package; on, off: the prefill graphs
        if [ "$side" = before ]; then use before; else use after; fi
        flags=(); [ "$side" = off ] && flags=(STREAMD_MODEL__PREFILL_GRAPHS=false)
        env "${flags[@]}" timeout 200 python3 -m streamd.cli.main bench throughput --device cuda \
          --shapes "${THROUGHPUT_SHAPES:-smollm2-135m,llama3.2-1b}" --peers none --no-prefix-cache \
          --out "$OUT/results/throughput-$side" 2>"$OUT/throughput-stderr.log" | grep -E "^\| (smollm|llama)" \
          | sed "s/^/$side /" | tee -a "$OUT/throughput.log"
        grep -v '^{' "$OUT/throughput-stderr.log" | tail -3
      done; use after ;;
    multiturn)
      for side in ${MULTITURN_SIDES:-on off}; do
        flag=true; [ "$side" = off ] && flag=false
        STREAMD_MODEL__PREFILL_GRAPHS=$flag timeout 240 python3 -m streamd.cli.main bench multiturn --device cuda \
          --shape "${MULTITURN_SHAPE:-llama3.1-8b}" --conversations "${MULTITURN_CONVERSATIONS:-32}" --turns "${MULTITURN_TURNS:-8}" \
          --system-tokens 2048 --turn-tokens 300 --restarts 0 --out "$OUT/results/multiturn-$side" \
          2>"$OUT/multiturn-stderr.log" | grep -E "^\| (device|disk|host)|lower" | sed "s/^/$side /" | tee -a "$OUT/multiturn.log"
        grep -v '^{' "$OUT/multiturn-stderr.log" | tail -3
      done ;;
    serve)
      for side in ${SERVE_SIDES:-before after}; do
        use $side
        timeout ${SERVE_TIMEOUT:-240} python3 -m streamd.cli.main bench serve --offline-baseline --baseline-model $model \
          --levels 256 --repeats "${SERVE_REPEATS:-3}" --requests-per-stream 2 --layouts split \
          --prompt-words 200 --max-tokens 128 --set cache.num_kv_blocks=16384 --set 'model.dtype="bfloat16"' \
          --out "$OUT/results/serve-$side" 2>"$OUT/serve-stderr.log" | grep -E "^\| (ws|sse)" | sed "s/^/$side /" \
          | tee -a "$OUT/serve.log"
        grep -v '^{' "$OUT/serve-stderr.log" | tail -3
      done; use after ;;
  esac
done
