"""One engine step of a mixture-of-experts model against a dense model of equal active parameters, on the CPU
(issue 27, item 5): what running MoE families (Qwen3-MoE, Mixtral, gpt-oss) through transformers' own expert
modules costs, and so what a fused MoE path could gain.

    python benchmarks/moe_step.py [--rounds 7] [--batch 16] [--chunk 256] [--threads 0]

The models are SmolLM2-135M's shape (hidden 576, 30 layers, 9 query heads over 3 KV heads, head_dim 64,
vocabulary 49152) as Qwen3 (q/k norm): dense with an MLP of 1536, and Qwen3-MoE with every layer's MLP
replaced by E experts of which k run per token, k x the expert width = 1536, so each token computes the same
MLP FLOPs as the dense model (equal active parameters; the router adds 576 x E per token). Two splits:
8 experts top-2 (Mixtral's ratio) and 32 experts top-8 (finer, as Qwen3-30B-A3B's 128 top-8). Random
float32 weights, one engine per model (prefix caching off, no step budget), each run through each of
transformers' expert implementations (`eager`: a Python loop over the experts hit; `batched_mm`: every token
against its k experts' weights gathered, timed decoding only, since it copies k expert matrices per token;
`grouped_mm`: tokens sorted by expert, one grouped GEMM per projection).

Timed: a decode step of `--batch` sequences at ~128 tokens of context, and a prefill step of one
`--chunk`-token prompt (each after an untimed step under the same implementation); medians over `--rounds`
rounds, each round timing every variant in turn, so that a shared machine's slow spells fall on all of them
alike (they do: the dense decode step alone ranged 380-690 ms over one run done model by model). Ratio = MoE
step / dense step: a fused MoE path (routing, gather, one grouped GEMM per projection, no per-expert Python)
would bring the MoE step to about the dense one plus the router, so (ratio - 1) x the dense step is about
the most it can save. Results and their reading: benchmarks/NOTES.md (issue 27).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from transformers import PretrainedConfig, Qwen3Config, Qwen3MoeConfig

from streamd import LLM, SamplingParams

SHAPE = dict(
    hidden_size=576,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    vocab_size=49152,
    tie_word_embeddings=True,
    max_position_embeddings=2048,
)
DENSE_MLP = 1536
IMPLEMENTATIONS = ("eager", "batched_mm", "grouped_mm")


def dense() -> PretrainedConfig:
    return Qwen3Config(**SHAPE, intermediate_size=DENSE_MLP)


def moe(experts: int, top_k: int) -> PretrainedConfig:
    return Qwen3MoeConfig(
        **SHAPE,
        intermediate_size=DENSE_MLP,
        moe_intermediate_size=DENSE_MLP // top_k,
        num_experts=experts,
        num_experts_per_tok=top_k,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
    )


def params(llm: LLM) -> tuple[float, float]:
    """(total, active per token) parameters in millions; active counts k of the E experts."""
    model = llm.engine.runner.model
    config = model.config
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    e = getattr(config, "num_experts", 0)
    active = total - experts + (experts * config.num_experts_per_tok // e if e else 0)
    return total / 1e6, active / 1e6


def median_ms(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1e3, 1)


def engine_of(config: PretrainedConfig, args: argparse.Namespace) -> LLM:
    return LLM(
        config,
        device="cpu",
        dtype="float32",
        num_kv_blocks=256,
        max_num_batched_tokens=args.chunk,
        enable_prefix_caching=False,
        max_step_ms=0,
        num_swap_blocks=0,
        num_threads=args.threads,
    )


def use_experts(llm: LLM, implementation: str) -> None:
    if implementation != "-":
        llm.engine.runner.model.set_experts_implementation(implementation)


def timed_step(llm: LLM, implementation: str) -> float:
    """One untimed step after switching the experts' implementation (its first call), then one timed."""
    use_experts(llm, implementation)
    llm.engine.step()
    start = time.perf_counter()
    llm.engine.step()
    return time.perf_counter() - start


def start_decoding(llm: LLM, batch: int, chunk: int) -> None:
    """`batch` sequences of 128-token prompts, prefilled (in chunks), decoding from then on."""
    gen = torch.Generator().manual_seed(0)
    params_ = SamplingParams(temperature=0.0, max_tokens=1500, ignore_eos=True, detokenize=False)
    for i in range(batch):
        prompt = torch.randint(0, SHAPE["vocab_size"], (128,), generator=gen).tolist()
        llm.engine.add_request(f"d{i}", prompt, params_)
    use_experts(llm, "grouped_mm" if isinstance(llm.engine.runner.model.config, Qwen3MoeConfig) else "-")
    for _ in range(-(-batch * 128 // chunk) + 1):
        llm.engine.step()


def stop(llm: LLM) -> None:
    for request_id in [f"d{i}" for i in range(256)]:
        llm.engine.abort(request_id)
    while llm.engine.has_unfinished_requests():
        llm.engine.step()


def prefill_step(llm: LLM, implementation: str, chunk: int, seed: int) -> float:
    """The step that prefills one fresh `chunk`-token prompt (after an untimed one under `implementation`)."""
    use_experts(llm, implementation)
    once = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)
    gen = torch.Generator().manual_seed(seed)
    took = []
    for i in range(2):
        llm.engine.add_request(
            f"p{seed}-{i}", torch.randint(0, SHAPE["vocab_size"], (chunk,), generator=gen).tolist(), once
        )
        start = time.perf_counter()
        llm.engine.step()
        took.append(time.perf_counter() - start)
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
    return took[1]


VARIANTS = [
    ("dense", "-"),
    ("moe 8x top-2", "eager"),
    ("moe 8x top-2", "grouped_mm"),
    ("moe 32x top-8", "eager"),
    ("moe 32x top-8", "grouped_mm"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: streamd's default)")
    args = parser.parse_args()
    engines = {
        "dense": engine_of(dense(), args),
        "moe 8x top-2": engine_of(moe(8, 2), args),
        "moe 32x top-8": engine_of(moe(32, 8), args),
    }
    decode: dict[tuple[str, str], list[float]] = {v: [] for v in VARIANTS}
    prefill: dict[tuple[str, str], list[float]] = {v: [] for v in VARIANTS}
    for llm in engines.values():
        start_decoding(llm, args.batch, args.chunk)
    # Rounds over every variant in turn: a shared machine's slow spells fall on all of them alike.
    for _ in range(args.rounds):
        for name, impl in VARIANTS:
            decode[(name, impl)].append(timed_step(engines[name], impl))
    batched = {
        name: median_ms([timed_step(engines[name], "batched_mm") for _ in range(2)])
        for name in engines
        if name != "dense"
    }
    for llm in engines.values():
        stop(llm)
    for r in range(args.rounds):
        for name, impl in VARIANTS:
            prefill[(name, impl)].append(prefill_step(engines[name], impl, args.chunk, seed=r))
    base_d, base_p = median_ms(decode[VARIANTS[0]]), median_ms(prefill[VARIANTS[0]])
    print(
        f"\n{args.rounds} rounds; decode: {args.batch} sequences at ~128 tokens; prefill: one {args.chunk}-token "
        f"prompt; torch threads {torch.get_num_threads()}"
    )
    print("| model | experts | params total / active (M) | decode step (ms) | ratio | prefill step (ms) | ratio |")
    print("|---|---|---|---|---|---|---|")
    for name, impl in VARIANTS:
        total, active = params(engines[name])
        d, p = median_ms(decode[(name, impl)]), median_ms(prefill[(name, impl)])
        print(f"| {name} | {impl} | {total:.0f} / {active:.0f} | {d} | {d / base_d:.2f} | {p} | {p / base_p:.2f} |")
    for name, ms in batched.items():
        total, active = params(engines[name])
        print(f"| {name} | batched_mm | {total:.0f} / {active:.0f} | {ms} | {ms / base_d:.2f} | - | - |")


if __name__ == "__main__":
    main()
