#!/usr/bin/env bash
# Issue 34 item 1 on one GPU: speculative decoding with its verify steps replayed in the decode CUDA graphs.
# From the repository root on the device machine, with `.whl` (the wheels the image lacks) and the default
# model's GGUF carried in three pieces (`split -b 31M` into .g1/, .g2/, .g3/: a call carries ~46 MiB besides the
# tree, so the calls carrying .g1 and .g2 come first on the same warm machine):
#   STREAMD_GIT_COMMIT=<the commit sent> benchmarks/spec_device.sh [TESTS:1|0] [ROUNDS] [STEPS:1|0]
# 1. the CUDA tests of the engine (a verify replayed as decode rows keeps greedy tokens) and of the FP8 kernels;
# 2. `streamd bench spec` on the default model in bfloat16: edit and chat at one stream, chat at 256 streams, and
#    the chat workload with an oracle keeping 70% of its drafts;
# 3. what a verify costs against a decode: the decode graph's replay at B and at B x (k + 1) rows (the rows a
#    verify of k drafts a sequence runs), random-weight SmolLM2-135M shape (`step_batches.py`);
# 4. one speculating edit stream's host time under cProfile (`spec_host_profile.py`).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 STREAMD_LOG_FORMAT=json
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
cat .g1/* .g2/* .g3/* > /tmp/smol.gguf && sha256sum /tmp/smol.gguf | tee "$OUT/gguf.sha256"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if [ "${1:-1}" = 1 ]; then
  timeout 200 python3 -m pytest -q -m cuda -p no:cacheprovider tests/engine/test_cuda_engine.py \
    tests/kernels/test_kv_quant.py tests/kernels/test_fp8_ops.py tests/engine/worker/test_fp8_cuda.py 2>&1 \
    | tail -25 | tee "$OUT/cuda-tests.log"
fi
timeout 240 python3 -m streamd.cli.main bench spec --model /tmp/smol.gguf --edit-requests 3 --edit-sentences 40 \
  --edit-max-tokens 160 --chat-requests 4 --chat-max-tokens 96 --streams 256 --oracle-acceptance 0.7 \
  --rounds "${2:-2}" --out "$OUT/results" 2>"$OUT/spec-stderr.log" | tail -40 | tee "$OUT/spec.log"
echo "spec rc=${PIPESTATUS[0]}"; grep -v '^{' "$OUT/spec-stderr.log" | tail -5
timeout 120 python3 benchmarks/spec_host_profile.py /tmp/smol.gguf "$OUT/results/spec-host-profile.txt" \
  2>"$OUT/profile-stderr.log" | head -12; echo "profile rc=${PIPESTATUS[0]}"
[ "${3:-1}" = 1 ] && timeout 110 python3 benchmarks/step_batches.py --shape smollm2-135m --batches 1,3,5,9,8,24,40,72,32,96,160,64,192 \
  --out "$OUT/results" 2>"$OUT/steps-stderr.log" | tee "$OUT/steps.log"
echo "steps rc=${PIPESTATUS[0]}"; tail -3 "$OUT/steps-stderr.log"
