#!/usr/bin/env bash
# Issue 28 on one GPU (H100/H200): the CUDA tests of the 8-bit KV cache and FP8 weights, then `streamd bench
# quantized` on the shapes given. From the repository root on the device machine, with `.whl` carried:
#   STREAMD_GIT_COMMIT=<the commit sent> benchmarks/quantized_device.sh SHAPES [VARIANTS] [TESTS:1|0]
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 STREAMD_LOG_FORMAT=json
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if [ "${3:-1}" = 1 ]; then
  timeout 240 python3 -m pytest -q -m cuda -p no:cacheprovider tests/kernels/test_kv_quant.py tests/kernels/test_fp8_ops.py \
    tests/engine/worker/test_fp8_cuda.py 2>&1 | tail -25 | tee "$OUT/cuda-tests.log"
fi
VARIANTS=${2:-bf16,kv-int8,kv-fp8,w-fp8,w-fp8+kv-fp8}
python3 -m streamd.cli.main bench quantized --shapes "$1" --variants "$VARIANTS" --out "$OUT/results" \
  2>"$OUT/quantized-stderr.log" | tee "$OUT/quantized.log"
echo "bench rc=${PIPESTATUS[0]}"; grep -v '^{' "$OUT/quantized-stderr.log" | tail -5
