#!/usr/bin/env bash
# The CUDA tensor-parallel test that hung after its TP=2 run (branch tp-hang), on a 2-GPU box, <= 4 minutes,
# no network. From the repository root on the device machine:
#   benchmarks/tp_hang_device.sh        (logs to $OUT; default /tmp/out)
# Cause fixed here: rank 0's process group died in its destructor while CUDA graphs holding its captured
# all-reduces were alive (the test keeps `runner.graphs`), and NCCL's abort waits for such graphs forever.
# Should it still hang: pytest's faulthandler dumps rank 0's stacks at 150 s, and STREAMD_TP_HANG_DUMP_S
# makes the worker rank dump its own (workers.py, `_arm_hang_dump`) every 120 s, both into cuda-test.log;
# NCCL_DEBUG=WARN shows a communicator's abort or destroy going wrong.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 STREAMD_LOG_FORMAT=json STREAMD_TP_HANG_DUMP_S=120 NCCL_DEBUG=WARN
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
fi
nvidia-smi -L | tee "$OUT/gpus.txt"
python3 -c "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version())" | tee -a "$OUT/gpus.txt"
echo "=== cuda test $(date -u +%T)"
start=$(date +%s)
timeout 200 python3 -X faulthandler -m pytest -x -q -s -m cuda -p no:cacheprovider -o faulthandler_timeout=150 \
  tests/engine/worker/test_tensor_parallel_cuda.py > "$OUT/cuda-test.log" 2>&1
rc=$?
echo "rc=$rc seconds=$(( $(date +%s) - start ))" >> "$OUT/cuda-test.log"
grep -E "passed|failed|error|Timeout|group_close_failed|destroy_process_group|rc=" "$OUT/cuda-test.log" | tail -20
