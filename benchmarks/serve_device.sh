#!/usr/bin/env bash
# Serving under load on the device: `streamd serve` with a random-weight SmolLM2-135M-shaped model (bf16, the
# real SmolLM2 tokenizer from ASSETS), then `streamd bench serve` over WebSocket at three Poisson rates.
# Usage: benchmarks/serve_device.sh ASSETS OUT [RATES]
set -euo pipefail
assets=$1 out=$2 rates=${3:-"8 32 128"}
model=/tmp/streamd-serve-model
python3 - "$assets" "$model" <<'PY'
import shutil, sys, torch
from transformers import AutoModelForCausalLM
from streamd.bench.throughput import model_config
assets, model = sys.argv[1], sys.argv[2]
with torch.device("cuda"):
    m = AutoModelForCausalLM.from_config(model_config("smollm2-135m"), dtype=torch.bfloat16)
m.save_pretrained(model)
for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
    shutil.copy(f"{assets}/{name}", model)
PY
python3 -m streamd.cli.main serve --model "$model" --port 8123 > "$out/serve-server.log" 2>&1 &
server=$!
python3 - <<'PY'
import time, urllib.request
for _ in range(600):
    try:
        if urllib.request.urlopen("http://127.0.0.1:8123/ready", timeout=1).status == 200:
            break
    except Exception:
        time.sleep(0.5)
else:
    raise SystemExit("server did not become ready")
PY
for rate in $rates; do
  python3 -m streamd.cli.main bench serve --url http://127.0.0.1:8123 --transport ws --rate "$rate" \
    --num-requests 256 --prompt-words 200 --max-tokens 128 --json "$out/serve-rate$rate.json"
done
kill -TERM $server; wait $server || true
