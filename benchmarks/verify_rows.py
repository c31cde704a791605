"""Issue 29 on the CPU: what a verify step's rows cost against a decode step (the default model, one edit request).

Usage: python3 benchmarks/verify_rows.py on|off   (prompt lookup on or off)
Runs `streamd bench spec`'s first edit request (40 sentences, 160 greedy tokens) offline and prints the decode
steps' median time grouped by their draft count, and the time per output token.
"""

from __future__ import annotations

import statistics
import sys
import time

from streamd import LLM, SamplingParams
from streamd.bench.offline import schedules
from streamd.bench.spec import Sizes, edit_requests


def main(lookup: bool) -> None:
    engine = LLM(enable_prefix_caching=False, **{"speculative.prompt_lookup": lookup}).engine
    instruction, _ = edit_requests(Sizes(edit_requests=1))[0]
    ids = engine.apply_chat_template([{"role": "user", "content": instruction}])
    engine.add_request("edit", None, SamplingParams(max_tokens=160, temperature=0.0), prompt_token_ids=ids)
    tokens, steps = 0, []  # (draft tokens, prompt tokens, ms) a step
    with schedules(engine) as planned:
        while engine.has_unfinished_requests():
            began = time.perf_counter()
            tokens += sum(delta.num_new_tokens for delta in engine.step())
            out = planned[-1]
            steps.append((out.num_draft_tokens, out.num_prefill_tokens, (time.perf_counter() - began) * 1e3))
    decodes = [s for s in steps if not s[1]]
    by_drafts: dict[int, list[float]] = {}
    for drafts, _, ms in decodes:
        by_drafts.setdefault(drafts, []).append(ms)
    print(f"prompt {len(ids)} tokens, {tokens} generated in {len(decodes)} decode steps")
    for drafts in sorted(by_drafts):
        times = by_drafts[drafts]
        print(f"drafts {drafts}: {len(times)} steps, median {statistics.median(times):.2f} ms")
    print(f"{sum(s[2] for s in decodes) / tokens:.2f} ms per output token")


if __name__ == "__main__":
    main(sys.argv[1] == "on")
