#!/usr/bin/env bash
# Issue 26 on a 4-GPU box (nvidia-h100-x4), two calls of <= 9.5 minutes on the same warm machine, no network:
#   benchmarks/multi_gpu_device.sh tp         the symmetric-memory all-reduce probe (benchmarks/symm_mem_probe.py)
#                                             and `streamd bench throughput --tp 1,2,4 --shapes llama3.1-8b`
#   benchmarks/multi_gpu_device.sh replicas   `streamd bench replicas --replicas 1,2,4` on the 8B checkpoint
#                                             (saved here unless the first call did; 256 SSE streams behind vllm-router;
#                                             MODES="router direct scaled": through the router, clients on the
#                                             replicas directly, 256 streams per replica)
#   benchmarks/multi_gpu_device.sh symm       issue 26's symmetric-memory all-reduce, one call of ~400 s on nvidia-h100-x2:
#                                             (a) the CUDA tests (test_all_reduce_cuda.py: sums equal NCCL's, eager and
#                                             in a graph; test_tensor_parallel_cuda.py: TP=2 greedy == TP=1 with
#                                             all_reduce symm_mem and nccl), then (b) `streamd bench throughput --tp 1,2
#                                             --shapes llama3.1-8b --all-reduce $ALL_REDUCE` (default auto; auto,nccl adds
#                                             the TP=2 NCCL row, ~80 s more); each under its own timeout, so one
#                                             failing still lets the other run; the ranks' all-reduce choice (or
#                                             auto's fallback and its reason) is printed from the log
# The device tool's $OUT receives everything (default /tmp/out). Carry [".whl"] (vllm-router's wheel is there;
# for symm: structlog, gguf, xgrammar and its pydantic/tvm-ffi, which the device image lacks).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 STREAMD_LOG_FORMAT=json STREAMD_BENCH_CKPT=/tmp/streamd-ckpt
# NVLink multicast stays off (the device's rule; symmetric memory's one-/two-shot kernels do not need it)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
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
symm)
  python3 -c "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version())" | tee -a "$OUT/gpus.txt"
  echo "=== cuda tests $(date -u +%T)"; start=$(date +%s)
  timeout "${TESTS_TIMEOUT:-150}" python3 -X faulthandler -m pytest -x -q -s -m cuda -p no:cacheprovider \
    -o faulthandler_timeout=120 tests/engine/worker/test_all_reduce_cuda.py tests/engine/worker/test_tensor_parallel_cuda.py \
    > "$OUT/symm-tests.log" 2>&1
  echo "rc=$? seconds=$(( $(date +%s) - start ))" >> "$OUT/symm-tests.log"
  grep -E "passed|failed|skipped|Error|error|assert|tensor_parallel.all_reduce|rc=" "$OUT/symm-tests.log" | tail -20
  echo "=== throughput tp 1,2 all-reduce ${ALL_REDUCE:-auto} $(date -u +%T)"; start=$(date +%s)
  timeout "${BENCH_TIMEOUT:-250}" python3 -m streamd.cli.main bench throughput --device cuda --tp 1,2 \
    --shapes llama3.1-8b --num-kv-blocks 20000 --all-reduce "${ALL_REDUCE:-auto}" --out "$OUT/results" \
    > "$OUT/throughput-tp.log" 2> "$OUT/throughput-tp-stderr.log"
  echo "rc=$? seconds=$(( $(date +%s) - start ))" >> "$OUT/throughput-tp.log"
  grep -h '"tensor_parallel.all_reduce' "$OUT/throughput-tp-stderr.log" | tail -4
  tail -30 "$OUT/throughput-tp.log"; tail -3 "$OUT/throughput-tp-stderr.log"
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
