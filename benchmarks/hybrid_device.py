"""Issues 27 and 34 on one GPU: sliding-window models with the hybrid KV layout and without it, random bf16 weights of
real shapes (Gemma-3-1B's, gpt-oss-20b's), one engine after the other on the same requests:

- decode speed: 32 requests (8 of 4,096 prompt tokens, 24 of 1,024), 256 greedy tokens each;
- the KV held by one long request (`--long`, default 32,768 prompt tokens) while it decodes, read from the
  engine's stats (`KVCacheStats.bytes_used`), against what the plain layout holds for it.

    python benchmarks/hybrid_device.py OUT.json [gemma-3-1b,gpt-oss-20b] [LONG] [MAX_MODEL_LEN]

`MAX_MODEL_LEN` (default LONG + 512) sets the engines' context, hence the decode graphs' table width.

Writes JSON to OUT. Run from the repository root on the device machine (benchmarks/NOTES.md).
"""

import json
import os
import sys
import time

import torch
from transformers import Gemma3TextConfig, GptOssConfig, PretrainedConfig

from streamd import LLM, SamplingParams
from streamd.bench.offline import free_cuda

SHAPES = {
    "gemma-3-1b": lambda: Gemma3TextConfig(
        vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, sliding_window=512, max_position_embeddings=40960,
        query_pre_attn_scalar=256),
    "gpt-oss-20b": lambda: GptOssConfig(
        num_hidden_layers=24, num_local_experts=32, num_experts_per_tok=4, max_position_embeddings=40960,
        layer_types=["sliding_attention", "full_attention"] * 12),
}
REQUESTS, OUTPUT = [4096] * 8 + [1024] * 24, 256
DEVICE = os.environ.get("HYBRID_DEVICE", "cuda")  # cpu: a dry run of the script with tiny shapes


def _engine(config: PretrainedConfig, plain: bool, max_len: int) -> LLM:
    """Random weights made on the device (seed 0: both layouts get the same ones)."""
    return LLM(config, device=DEVICE, dtype="bfloat16", disable_hybrid_kv_cache_manager=plain, max_model_len=max_len,
               gpu_memory_utilization=0.8, num_swap_blocks=0, seed=0)


def _decode_speed(llm: LLM, vocab: int) -> tuple[dict, list]:
    """The requests to the end on the engine's own steps: the time until every request has its first token
    (the prompts, in chunks) and the time and step count after it (decode steps)."""
    prompts = [[(31 * i + 7 * j) % (vocab - 200) + 100 for j in range(n)] for i, n in enumerate(REQUESTS)]
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT, ignore_eos=True, detokenize=False)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, detokenize=False))
    engine, tokens = llm.engine, {}
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"h{i}", prompt, params)
    prefill_s, decode_steps = None, 0
    while engine.has_unfinished_requests():
        for delta in engine.step():
            for choice in delta.outputs:
                if choice.token_ids:
                    tokens.setdefault(delta.request_id, []).extend(choice.token_ids)
        if prefill_s is None and len(tokens) == len(prompts):
            prefill_s = time.perf_counter() - start
        elif prefill_s is not None:
            decode_steps += 1
    seconds = time.perf_counter() - start
    kv = engine.stats().kv
    speed = {"seconds": round(seconds, 3), "output_tok_s": round(len(prompts) * OUTPUT / seconds, 1),
             "until_first_tokens_s": round(prefill_s or 0.0, 3), "decode_steps": decode_steps,
             "ms_per_decode_step": round((seconds - (prefill_s or 0.0)) * 1e3 / max(1, decode_steps), 3),
             "blocks_total": kv.blocks_total, "window_blocks_total": kv.window_blocks_total,
             "block_bytes": kv.block_bytes, "window_block_bytes": kv.window_block_bytes}
    return speed, [tokens[f"h{i}"] for i in range(len(prompts))]


def _long_request_bytes(llm: LLM, vocab: int, length: int) -> dict:
    """Steps one `length`-token request into its decode and reads the KV bytes it holds then."""
    engine = llm.engine
    prompt = [(13 * j) % (vocab - 200) + 100 for j in range(length)]
    engine.add_request("long", prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False))
    peak, decoding = 0, 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        kv = engine.stats().kv
        peak = max(peak, kv.bytes_used)
        decoding = kv.bytes_used or decoding  # the last step's, before the request finishes and frees its blocks
    return {"prompt_tokens": length, "kv_bytes_decoding": decoding, "kv_bytes_peak": peak,
            "seconds": round(time.perf_counter() - start, 3)}


def main() -> None:
    shapes = sys.argv[2].split(",") if len(sys.argv) > 2 else list(SHAPES)
    long = int(sys.argv[3]) if len(sys.argv) > 3 else 32768
    max_len = int(sys.argv[4]) if len(sys.argv) > 4 else long + 512
    device = torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE
    results: dict = {"device": device, "torch": torch.__version__, "command": " ".join(sys.argv)}
    for shape in shapes:
        config = SHAPES[shape]()
        row: dict = {"shape": f"{shape} (random bf16)"}
        tokens = {}
        for name, plain in (("hybrid", False), ("plain", True)):
            llm = _engine(config, plain, max_len)
            row[name], tokens[name] = _decode_speed(llm, config.vocab_size)
            row[name]["long"] = _long_request_bytes(llm, config.vocab_size, long)
            print(shape, name, json.dumps(row[name]), flush=True)
            del llm
            if DEVICE == "cuda":
                free_cuda()
        row["same_tokens_fraction"] = sum(a == b for a, b in zip(tokens["hybrid"], tokens["plain"])) / len(REQUESTS)
        row["hybrid_vs_plain"] = round(row["hybrid"]["output_tok_s"] / row["plain"]["output_tok_s"], 3)
        row["long_kv_hybrid_over_plain"] = round(
            row["hybrid"]["long"]["kv_bytes_decoding"] / max(1, row["plain"]["long"]["kv_bytes_decoding"]), 3)
        results[shape] = row
    print(json.dumps(results, indent=1))
    with open(sys.argv[1], "w") as fh:
        json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
