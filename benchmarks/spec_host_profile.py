"""Issue 34 item 1: where a speculating stream's host time goes. One edit request of `bench spec` (prompt lookup on,
one stream) under cProfile, after an untimed pass; prints the engine step's heaviest calls (cumulative and own).

Usage (device): python3 benchmarks/spec_host_profile.py MODEL [OUT.txt]
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time

from streamd import LLM
from streamd.bench import spec
from streamd.engine.sampling_params import SamplingParams


def main() -> None:
    engine = LLM(sys.argv[1], max_num_seqs=32).engine
    instruction, _text = spec.edit_requests(spec.FULL)[0]
    prompt = engine.apply_chat_template([{"role": "user", "content": instruction}])
    params = [SamplingParams(temperature=0, max_tokens=160)]
    lines = []
    for lookup in (False, True):
        spec._speculation(engine, lookup)
        spec.run_mode(engine, [prompt], params, 1)  # untimed: compiles, prefix cache
        began = time.perf_counter()
        result = spec.run_mode(engine, [prompt], params, 1)
        lines.append(f"lookup={lookup}: {result.tpot_ms} ms/token, {time.perf_counter() - began:.3f} s, "
                     f"drafted {result.draft_tokens}, accepted {result.accepted_tokens}")
    profile = cProfile.Profile()
    profile.enable()
    spec.run_mode(engine, [prompt], params, 1)
    profile.disable()
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text)
    stats.sort_stats("cumulative").print_stats(60)
    stats.sort_stats("tottime").print_stats(30)
    report = "\n".join(lines) + "\n" + text.getvalue()
    print(report)
    if len(sys.argv) > 2:
        with open(sys.argv[2], "w") as out:
            out.write(report)


if __name__ == "__main__":
    main()
