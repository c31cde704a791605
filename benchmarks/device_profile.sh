#!/usr/bin/env bash
# Issues 26 and 34: where the steps' time goes, on a 2-GPU device (nvidia-h200-x2), one call, no network.
#   benchmarks/device_profile.sh PHASES...   (carry [".whl"]; the device tool's $OUT receives everything)
# PHASES:
#   tp          benchmarks/tp_profile.py on a random bf16 Llama-3.1-8B-shaped checkpoint: decode step ms at TP = 1
#               and TP = 2 (batch 256 and 64), torch-profiler traces of both ranks at TP = 2
#   throughput  `streamd.bench.throughput` for llama3.2-1b and smollm2-135m (no peers): tok/s and roofline share
#   small       benchmarks/profile_step.py for smollm2-135m and llama3.2-1b (decode step at batch 256, host ops)
#   warmup      the throughput bench for both shapes with every Triton compile logged (benchmarks/triton_compiles.py),
#               for an older tree first where BEFORE names its directory (a copy of its streamd/ package)
#   phases      benchmarks/workload_phases.py for both shapes: the throughput workload's time, prefill steps and decode
#               steps by batch, and the kernels of three prefill steps
#   host        benchmarks/step_batches.py for both shapes (a step's wall time against its graph replay, batch 1-256),
#               then py-spy (carried as a wheel) sampling the engine's Python at smollm2 batch 256 and 1B batch 32
# Each phase has its own time limit; one that fails or runs out still lets the next run.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/results"
export PYTHONUNBUFFERED=1 STREAMD_LOG_FORMAT=json STREAMD_BENCH_CKPT=/tmp/streamd-ckpt
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # (the device's rule)
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
fi
nvidia-smi -L | tee "$OUT/gpus.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpus.txt"
for phase in "$@"; do
  echo "=== $phase $(date -u +%T)"; start=$(date +%s)
  case $phase in
    tp)
      ckpt=/tmp/streamd-ckpt/llama3.1-8b
      python3 -c "from pathlib import Path; from streamd.bench.offline import model_config; \
from streamd.bench.tensor_parallel import save_checkpoint; save_checkpoint(model_config('llama3.1-8b', 8192), Path('$ckpt'))"
      timeout "${TP_TIMEOUT:-260}" python3 benchmarks/tp_profile.py "$ckpt" "$OUT" > "$OUT/tp-profile.log" \
        2> "$OUT/tp-profile-stderr.log"
      echo "rc=$?" >> "$OUT/tp-profile.log"; grep -E "ms/step|speedup|_us|rc=" "$OUT/tp-profile.log"
      grep -h '"tensor_parallel.all_reduce' "$OUT/tp-profile-stderr.log" | tail -2 ;;
    throughput)
      timeout "${THROUGHPUT_TIMEOUT:-200}" python3 -m streamd.bench.throughput --device cuda \
        --shapes llama3.2-1b,smollm2-135m --peers none --out "$OUT/results" 2> "$OUT/throughput-stderr.log" \
        | tail -20 | tee "$OUT/throughput.log" ;;
    small)
      for shape in smollm2-135m llama3.2-1b; do
        timeout 100 python3 benchmarks/profile_step.py --shape $shape --out "$OUT" > "$OUT/profile-$shape.log" \
          2> "$OUT/profile-$shape-stderr.log"
        echo "rc=$?" >> "$OUT/profile-$shape.log"; grep -E "ms/step|prefill|rc=" "$OUT/profile-$shape.log"
      done ;;
    warmup)  # the throughput bench with Triton's compiles logged, this tree and (BEFORE=dir) an older one
      for tree in ${BEFORE:-} .; do
        label=$(basename "$(cd "$tree" && pwd)")
        PYTHONPATH=/tmp/site:$(cd "$tree" && pwd) timeout 200 python3 benchmarks/triton_compiles.py \
          streamd.bench.throughput --device cuda --shapes smollm2-135m,llama3.2-1b --peers none \
          --out "$OUT/results-$label" > "$OUT/warmup-$label.log" 2> "$OUT/warmup-$label-stderr.log"
        echo "rc=$? ($label)"; grep -E '^\| (smollm2|llama)' "$OUT/warmup-$label.log"
        grep -E 'triton compile|engine.warmed_up|throughput' "$OUT/warmup-$label-stderr.log" | \
          grep -E 'warmed_up|compile' | awk '/warmed_up/{w++} {print w+0, substr($0, 1, 150)}' | tail -40
      done ;;
    phases)
      for shape in smollm2-135m llama3.2-1b; do
        timeout 150 python3 benchmarks/workload_phases.py --shape $shape --out "$OUT" > "$OUT/phases-$shape.log" \
          2> "$OUT/phases-$shape-stderr.log"; echo "rc=$?" >> "$OUT/phases-$shape.log"
        grep -v '^ *{"ms"' "$OUT/phases-$shape.log" | head -40
      done ;;
    host)
      for shape in smollm2-135m llama3.2-1b; do
        timeout 150 python3 benchmarks/step_batches.py --shape $shape --out "$OUT" > "$OUT/steps-$shape.log" \
          2> "$OUT/steps-$shape-stderr.log"; echo "rc=$?" >> "$OUT/steps-$shape.log"; cat "$OUT/steps-$shape.log"
      done
      for spec in smollm2-135m:256 llama3.2-1b:32; do
        shape=${spec%:*} batch=${spec#*:}; mkdir -p "$OUT/spy-$shape"; rm -f "$OUT/spy-$shape/steady"
        timeout 150 python3 benchmarks/step_batches.py --shape $shape --batches $batch --hold 12 --max-tokens 3000 --out "$OUT/spy-$shape" \
          > "$OUT/spy-$shape/run.log" 2>&1 &
        pid=$!
        for _ in $(seq 300); do [ -f "$OUT/spy-$shape/steady" ] && break; sleep 0.5; done  # (the run's marker file)
        py-spy record -p $pid -d 8 -r 200 -f raw -o "$OUT/spy-$shape/pyspy.txt" > "$OUT/spy-$shape/pyspy.log" 2>&1
        wait $pid; tail -2 "$OUT/spy-$shape/run.log"; tail -2 "$OUT/spy-$shape/pyspy.log"
      done ;;
  esac
  echo "--- $phase took $(( $(date +%s) - start )) s"
done
# (at most 8 files come back: everything in one archive)
cd "$OUT" && tar czf /tmp/all.tgz --exclude=all.tgz . && find . -mindepth 1 -delete && mv /tmp/all.tgz .
