"""Issue 27 on one GPU: decode speed of a Gemma-3-1B-shaped model (random bf16 weights) with the hybrid KV layout
(eager decode: the graphs bind one pool) and without it (decode graphs), on the same requests. Writes JSON to
the path given. Run from the repository root on the device machine (see benchmarks/NOTES.md)."""

import json
import sys
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig

from streamd import LLM, SamplingParams
from streamd.bench.offline import free_cuda

config = Gemma3TextConfig(vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
                          num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
                          max_position_embeddings=32768, query_pre_attn_scalar=256)
torch.manual_seed(0)
results = {"device": torch.cuda.get_device_name(), "shape": "gemma-3-1b (random bf16)"}
with tempfile.TemporaryDirectory() as tmp:
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(tmp)
    prompts = [[(31 * i + 7 * j) % 262000 + 100 for j in range(n)] for i, n in enumerate([4096] * 8 + [1024] * 24)]
    params = SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True, detokenize=False)
    tokens = {}
    for name, disabled in (("hybrid", False), ("plain", True)):
        llm = LLM(tmp, device="cuda", dtype="bfloat16", disable_hybrid_kv_cache_manager=disabled,
                  max_model_len=8192, gpu_memory_utilization=0.5)
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, detokenize=False))
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        seconds = time.perf_counter() - start
        kv = llm.engine.stats().kv
        tokens[name] = [o.outputs[0].token_ids for o in outs]
        results[name] = {"seconds": round(seconds, 3), "output_tok_s": round(32 * 256 / seconds, 1),
                         "blocks_total": kv.blocks_total, "window_blocks_total": kv.window_blocks_total,
                         "block_bytes": kv.block_bytes, "window_block_bytes": kv.window_block_bytes}
        del llm, outs
        free_cuda()
results["same_tokens_fraction"] = sum(a == b for a, b in zip(tokens["hybrid"], tokens["plain"])) / 32
results["hybrid_vs_plain"] = round(results["hybrid"]["output_tok_s"] / results["plain"]["output_tok_s"], 3)
print(json.dumps(results, indent=1))
with open(sys.argv[1], "w") as fh:
    json.dump(results, fh, indent=1)
