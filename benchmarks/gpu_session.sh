#!/usr/bin/env bash
# One device call of issue 18's measurements. Usage (from the repository root on the device machine):
#   benchmarks/gpu_session.sh PHASES...
#   PHASES: setup cuda-tests serve serve-rates serve-smoke offline-jitter offline-jitter-servers prefix-cache throughput fusion second-wave pack
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
      python3 -m pytest -q -m cuda -p no:cacheprovider tests/engine/test_cuda_engine.py tests/engine/worker/test_cache_engine.py \
        tests/kernels/test_cuda.py 2>&1 | tail -25 | tee "$OUT/cuda-tests.log" ;;
    serve)  # 256 streams, both layouts, both transports, median of 3
      python3 -m streamd.cli.main bench serve --offline-baseline --baseline-model /tmp/streamd-serve-model \
        --levels 256 --repeats 3 --requests-per-stream 2 \
        --prompt-words 200 --max-tokens 128 --set cache.num_kv_blocks=16384 --set model.dtype='"bfloat16"' \
        --out "$OUT/results" 2>"$OUT/serve-stderr.log" | tee "$OUT/serve.log" ;;
    serve-rates)  # three Poisson rates on the split layout (and 256 streams again), one run each
      python3 -m streamd.cli.main bench serve --offline-baseline --baseline-model /tmp/streamd-serve-model \
        --levels 256 --rates 32,128,512 --rate-requests 512 --repeats 1 --requests-per-stream 2 --layouts split \
        --prompt-words 200 --max-tokens 128 --set cache.num_kv_blocks=16384 --set model.dtype='"bfloat16"' \
        --out "$OUT/results/rates" 2>"$OUT/serve-rates-stderr.log" | tee "$OUT/serve-rates.log" ;;
    prefix-cache)
      python3 -m streamd.bench.throughput --shapes llama3.2-1b --peers none --prefix-lens 500,2048 \
        --out "$OUT/results/prefix" 2>"$OUT/prefix-stderr.log" | tail -30 | tee "$OUT/prefix.log" ;;
    serve-smoke)  # `streamd serve` itself with the default layout on this GPU
      python3 benchmarks/gpu_serve_smoke.py /tmp/streamd-serve-model 2>&1 | tee "$OUT/serve-smoke.log" ;;
    offline-jitter)  # the offline rate of one engine, eight times back to back (fresh prompts each)
      python3 - <<'PY' 2>"$OUT/jitter-stderr.log" | tee "$OUT/offline-jitter.log"
import time
from streamd import heap
from streamd.bench.load import synthetic_prompts
from streamd.bench.serve_baseline import DEFAULT_SETTINGS, offline_rate
from streamd.bench.serve_target import build_config, build_engine
settings = [*DEFAULT_SETTINGS, "cache.num_kv_blocks=16384", 'model.dtype="bfloat16"']
engine = build_engine("/tmp/streamd-serve-model", build_config("/tmp/streamd-serve-model", settings))
heap.settle()
for run in range(8):
    rate, cpu = offline_rate(engine, synthetic_prompts(512, 200, 7000 + run), 128, 256)
    print(f"offline run {run}: {rate:8.0f} tok/s  {cpu:5.1f} cpu us/token", flush=True)
PY
      ;;
    offline-jitter-servers)  # the same, with the serve benchmark's two (idle) servers on the same GPU and host
      python3 - <<'PY' 2>"$OUT/jitter-servers-stderr.log" | tee "$OUT/offline-jitter-servers.log"
from streamd import heap
from streamd.bench.load import synthetic_prompts
from streamd.bench.serve_baseline import DEFAULT_SETTINGS, ServerProcess, offline_rate
from streamd.bench.serve_target import build_config, build_engine
model = "/tmp/streamd-serve-model"
settings = [*DEFAULT_SETTINGS, "cache.num_kv_blocks=16384", 'model.dtype="bfloat16"']
engine = build_engine(model, build_config(model, settings))
heap.settle()
def runs(label, first):
    for run in range(first, first + 4):
        rate, cpu = offline_rate(engine, synthetic_prompts(512, 200, 7000 + run), 128, 256)
        print(f"{label} run {run}: {rate:8.0f} tok/s  {cpu:5.1f} cpu us/token", flush=True)
runs("alone", 0)
servers = [ServerProcess(model, settings, layout) for layout in ("thread", "split")]
try:
    runs("with two idle servers", 4)
finally:
    for server in servers:
        server.stop()
runs("alone again", 8)
PY
      ;;
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
