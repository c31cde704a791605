#!/usr/bin/env bash
# One device call of issue 18's measurements. Usage (from the repository root on the device machine):
#   benchmarks/gpu_session.sh PHASES...
#   PHASES: setup cuda-tests serve serve-rates prefix-cache throughput fusion second-wave pack
# Writes logs and results under $OUT (the device tool's folder) and benchmarks/results/.
# `setup` installs the carried wheels (.whl) and makes a random-weight SmolLM2-135M-shaped model (bf16) with
# the real tokenizer from .assets at /tmp/streamd-serve-model.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" benchmarks/results
export PYTHONUNBUFFERED=1 STREAMD_LOG_FORMAT=json
for phase in "$@"; do
  echo "=== $phase $(date -u +%T)"
  case $phase in
    setup)
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
      python3 - <<'PY'
import shutil, torch
from transformers import AutoModelForCausalLM
from streamd.bench.throughput import model_config
with torch.device("cuda"):
    m = AutoModelForCausalLM.from_config(model_config("smollm2-135m"), dtype=torch.bfloat16)
m.save_pretrained("/tmp/streamd-serve-model")
for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
    shutil.copy(f".assets/{name}", "/tmp/streamd-serve-model")
print(torch.cuda.get_device_name(0), torch.__version__)
PY
      ;;
    cuda-tests)
      python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_cuda_engine.py tests/test_cache_engine.py \
        tests/kernels/test_cuda.py 2>&1 | tail -25 | tee "$OUT/cuda-tests.log" ;;
    serve)  # 256 streams, both layouts, both transports, median of 3
      python3 -m streamd.cli bench serve --offline-baseline --baseline-model /tmp/streamd-serve-model \
        --levels 256 --repeats 3 --requests-per-stream 2 \
        --prompt-words 200 --max-tokens 128 --set cache.num_kv_blocks=16384 --set model.dtype='"bfloat16"' \
        --out "$OUT/results" 2>"$OUT/serve-stderr.log" | tee "$OUT/serve.log" ;;
    serve-rates)  # three Poisson rates on the split layout (and 256 streams again), one run each
      python3 -m streamd.cli bench serve --offline-baseline --baseline-model /tmp/streamd-serve-model \
        --levels 256 --rates 32,128,512 --rate-requests 512 --repeats 1 --requests-per-stream 2 --layouts split \
        --prompt-words 200 --max-tokens 128 --set cache.num_kv_blocks=16384 --set model.dtype='"bfloat16"' \
        --out "$OUT/results/rates" 2>"$OUT/serve-rates-stderr.log" | tee "$OUT/serve-rates.log" ;;
    prefix-cache)
      python3 -m streamd.bench.throughput --shapes llama3.2-1b --peers none --prefix-lens 500,2048 \
        --out "$OUT/results/prefix" 2>"$OUT/prefix-stderr.log" | tail -30 | tee "$OUT/prefix.log" ;;
    pack)  # results as one file (the device tool brings back at most 8)
      tar czf "$OUT/results.tgz" -C "$OUT" results && rm -rf "$OUT/results" ;;
    throughput)
      python3 -m streamd.bench.throughput --shapes llama3.2-1b,smollm2-135m --peers hf_cb \
        --out benchmarks/results 2>"$OUT/throughput-stderr.log" | tail -40 | tee "$OUT/throughput.log"
      cp benchmarks/results/throughput-*.json benchmarks/results/throughput-*.md "$OUT/" 2>/dev/null ;;
    fusion)
      python3 benchmarks/fusion.py --out "$OUT" 2>&1 | tail -30 | tee "$OUT/fusion.log" ;;
    second-wave)
      python3 benchmarks/second_wave_gpu.py --out benchmarks/results 2>"$OUT/second-wave-stderr.log" \
        | tee "$OUT/second-wave.log"
      cp benchmarks/results/second-wave-*.json benchmarks/results/second-wave-*.md "$OUT/" ;;
  esac
done
