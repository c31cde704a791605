"""`streamd bench memory --sharing --sharing-model`: the KV blocks the engine's real beam search saves.

Where `sharing.py` draws beam parents uniformly, here the default model's scores pick them: the real
`LLMEngine` (CPU, float32, prefix caching off so only sharing within a request counts) runs beam search
requests of widths 2, 4, 6 over a fixed set of Alpaca-like instructions, all at once, with max_tokens from
the Alpaca-like output lengths. After every step it counts the device blocks in use (shared ones once)
and the blocks the same beams would hold without sharing (each beam's own table).
"""

from __future__ import annotations

from collections.abc import Callable

from streamd.bench.sharing import WIDTHS
from streamd.bench.simulate import Progress
from streamd.bench.workloads import RequestStream, Workload
from streamd.engine.sampling_params import SamplingParams
from streamd.llm import LLM

# Short instructions in the style of the Alpaca data set (written here; no data set is downloaded).
INSTRUCTIONS = (
    "Give three tips for staying healthy.",
    "What are the three primary colors?",
    "Describe the structure of an atom.",
    "How can we reduce air pollution?",
    "Explain why the sky is blue.",
    "Write a short story about a lost key.",
    "Generate a list of five fruits.",
    "Summarize the water cycle in two sentences.",
    "Translate 'thank you' into French.",
    "Suggest a name for a coffee shop.",
    "What is the difference between weather and climate?",
    "Give an example of a renewable energy source.",
    "Explain what a noun is.",
    "Write a haiku about autumn.",
    "List three benefits of reading books.",
    "Describe a sunset in one sentence.",
)


def measure_engine_beams(
    workload: Workload, seed: int, progress_line: Callable[[str, str], Progress], num_blocks: int = 4096
) -> dict[str, object]:
    llm = LLM(device="cpu", dtype="float32", num_kv_blocks=num_blocks, num_swap_blocks=0, enable_prefix_caching=False)
    engine, bm = llm.engine, llm.engine.block_manager
    stream = RequestStream(workload, seed)
    prompts = [engine.apply_chat_template([{"role": "user", "content": text}]) for text in INSTRUCTIONS]
    runs = []
    for width in WIDTHS:
        progress = progress_line("engine", f"beam-{width}")
        for i, ids in enumerate(prompts):
            params = SamplingParams(use_beam_search=True, beam_width=width, max_tokens=stream[i][1], detokenize=False)
            engine.add_request(f"beam{width}-{i}", None, params, prompt_token_ids=ids)
        used = unshared = steps = 0
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
            used += bm.num_blocks - bm.num_free_blocks()
            unshared += sum(len(seq.block_table) for group in engine.scheduler.running for seq in group.seqs)
            progress(min(0.99, steps / max(stream[i][1] for i in range(len(prompts)))))
        progress(1.0)
        runs.append(
            {
                "width": width,
                "steps": steps,
                "blocks_used": used / steps,
                "blocks_unshared": unshared / steps,
                "saving": 1 - used / max(1, unshared),
            }
        )
    return {"model": engine.model_name, "requests": len(prompts), "runs": runs}
