#!/usr/bin/env bash
# Issue 26 on a 2-GPU box (<= 9.5 minutes, no network). From the repository root on the device machine:
#   benchmarks/tp_device.sh            (the device tool's $OUT receives everything; default /tmp/out)
# 1. the CUDA tensor-parallel test (TP=2 greedy == TP=1 on a float32 Llama-3.2-1B shape; graphs and eager),
#    watched for hangs (it once hung in teardown: NCCL's abort waits for CUDA graphs that hold the
#    communicator, `cuda_graphs` module docstring): pytest's faulthandler dumps rank 0's stacks at 120 s,
#    STREAMD_TP_HANG_DUMP_S the worker rank's (workers.py, `_arm_hang_dump`), both into cuda-tests.log, and
#    NCCL_DEBUG=WARN shows a communicator's abort or destroy going wrong;
# 2. `streamd bench throughput --tp 1,2 --shapes llama3.1-8b`: random bf16 weights saved once as a checkpoint,
#    nano-vllm's workload at TP=1 then TP=2 in one process, the 4k-prompt TTFT of each, the NCCL probe and the
#    two-GPU roofline (JSON: tp1_tok_s, tp2_tok_s, roofline_tok_s, nccl_bus_gb_s, ...);
# 3. a torch-profiler look at a few TP=2 decode steps on rank 0 (top kernels, NCCL time, GPU idle gaps).
# Each part has its own time limit; a part that fails or runs out of time does not stop the next.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 STREAMD_LOG_FORMAT=json STREAMD_BENCH_CKPT=/tmp/streamd-ckpt
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
fi
nvidia-smi -L | tee "$OUT/gpus.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'nccl', torch.cuda.nccl.version())" | tee -a "$OUT/gpus.txt"

echo "=== cuda tests $(date -u +%T)"
start=$(date +%s)
STREAMD_TP_HANG_DUMP_S=120 NCCL_DEBUG=WARN timeout 150 python3 -X faulthandler -m pytest -x -q -s -m cuda \
  -p no:cacheprovider -o faulthandler_timeout=120 tests/engine/worker/test_tensor_parallel_cuda.py \
  > "$OUT/cuda-tests.log" 2>&1
echo "rc=$? seconds=$(( $(date +%s) - start ))" >> "$OUT/cuda-tests.log"
grep -E "passed|failed|error|Timeout|group_close_failed|rc=" "$OUT/cuda-tests.log" | tail -20

echo "=== throughput tp 1,2 $(date -u +%T)"
timeout 280 python3 -m streamd.cli.main bench throughput --device cuda --tp 1,2 --shapes llama3.1-8b \
  --num-kv-blocks 20000 --out "$OUT/results" > "$OUT/throughput-tp.log" 2> "$OUT/throughput-tp-stderr.log"
echo "rc=$?" >> "$OUT/throughput-tp.log"; tail -30 "$OUT/throughput-tp.log"

echo "=== profile tp2 decode $(date -u +%T)"
# (a file, not stdin: the spawned worker rank re-imports the main module by its path)
cat > /tmp/tp_profile.py <<'PY'
import json, sys, torch
from torch.profiler import ProfilerActivity, profile
from streamd import LLM, SamplingParams


def main(out):
    llm = LLM("/tmp/streamd-ckpt/llama3.1-8b", dtype="bfloat16", tensor_parallel_size=2, num_kv_blocks=4096,
              max_num_seqs=128)
    engine = llm.engine
    params = SamplingParams(max_tokens=200, ignore_eos=True, detokenize=False, temperature=0.0)
    for i in range(128):
        engine.add_request(str(i), [(7 * i + j) % 128000 for j in range(512)], params)
    for _ in range(40):  # past the prefills: every step a 128-row decode
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(8):
            engine.step()
        torch.cuda.synchronize()
    prof.export_chrome_trace(f"{out}/tp2-decode-trace.json")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20))
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    busy = nccl = 0.0
    end = None
    for e in kernels:
        s, t = e.time_range.start, e.time_range.end
        nccl += (t - s) if "nccl" in e.name.lower() else 0
        if end is None or s >= end:
            busy += t - s; end = t
        elif t > end:
            busy += t - end; end = t
    span = kernels[-1].time_range.end - kernels[0].time_range.start if kernels else 0
    summary = {"steps": 8, "batch": 128, "kernels": len(kernels), "span_us": span, "busy_us": busy,
               "idle_gap_us": span - busy, "nccl_us": nccl, "graph_replays": engine.runner.graphs.replays
               if engine.runner.graphs else 0}
    print(json.dumps(summary, indent=2))
    json.dump(summary, open(f"{out}/tp2-decode-profile.json", "w"), indent=2)
    engine.executor.shutdown()


if __name__ == "__main__":  # the worker rank imports this file again (spawn)
    main(sys.argv[1])
PY
timeout 100 python3 /tmp/tp_profile.py "$OUT" > "$OUT/profile.log" 2> "$OUT/profile-stderr.log"
echo "rc=$?" >> "$OUT/profile.log"; tail -12 "$OUT/profile.log"
echo "=== done $(date -u +%T)"
