#!/usr/bin/env bash
# Issue 26 on a 4-GPU box (nvidia-h100-x4), two calls of <= 9.5 minutes on the same warm machine, no network:
#   benchmarks/multi_gpu_device.sh tp         the symmetric-memory all-reduce probe (benchmarks/symm_mem_probe.py)
#                                             and `streamd bench throughput --tp 1,2,4 --shapes llama3.1-8b`
#   benchmarks/multi_gpu_device.sh replicas   `streamd bench replicas --replicas 1,2,4` on the 8B checkpoint
#                                             (saved here unless the first call did; 256 SSE streams behind vllm-router;
#                                             MODES="router direct scaled": through the router, clients on the
#                                             replicas directly, 256 streams per replica)
# The device tool's $OUT receives everything (default /tmp/out). Carry [".whl"] (vllm-router's wheel is there).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 STREAMD_LOG_FORMAT=json STREAMD_BENCH_CKPT=/tmp/streamd-ckpt
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
fi
nvidia-smi -L | tee "$OUT/gpus.txt"
echo "nginx: $(command -v nginx || echo absent)" | tee -a "$OUT/gpus.txt"
gpus=$(nvidia-smi -L | grep -c '^GPU ')
sizes=1,2; [ "$gpus" -ge 4 ] && sizes=1,2,4

case "${1:-tp}" in
tp)
  echo "=== symm-mem probe $(date -u +%T)"
  timeout 120 python3 benchmarks/symm_mem_probe.py "$OUT" 2 > "$OUT/symm-mem.log" 2>&1; echo "rc=$?" >> "$OUT/symm-mem.log"
  tail -40 "$OUT/symm-mem.log"
  echo "=== throughput tp $sizes $(date -u +%T)"
  timeout 420 python3 -m streamd.cli.main bench throughput --device cuda --tp "$sizes" --shapes llama3.1-8b \
    --num-kv-blocks 20000 --out "$OUT/results" > "$OUT/throughput-tp.log" 2> "$OUT/throughput-tp-stderr.log"
  echo "rc=$?" >> "$OUT/throughput-tp.log"; tail -30 "$OUT/throughput-tp.log"; tail -5 "$OUT/throughput-tp-stderr.log"
  ;;
replicas)
  echo "=== replicas $sizes $(date -u +%T)"
  ckpt=/tmp/streamd-ckpt/llama3.1-8b
  python3 -c "from pathlib import Path; from streamd.bench.offline import model_config; \
from streamd.bench.tensor_parallel import save_checkpoint; save_checkpoint(model_config('llama3.1-8b', 8192), Path('$ckpt'))"
  for mode in ${MODES:-router direct}; do
    flag=; [ $mode = direct ] && flag=--direct; [ $mode = scaled ] && flag=--scale-load
    timeout 280 python3 -m streamd.cli.main bench replicas --replicas "$sizes" --concurrency 256 $flag \
      --requests-per-stream 6 --max-tokens 512 --prompt-words 200 --clients 8 --out "$OUT/results" \
      -- "$ckpt" --set model.dtype=bfloat16 > "$OUT/replicas-$mode.log" 2>&1
    echo "rc=$?" >> "$OUT/replicas-$mode.log"; grep -A12 '"replicas": ' "$OUT/replicas-$mode.log" | grep -E 'replicas|tok_s|vs_first|failed'
  done
  ;;
esac
