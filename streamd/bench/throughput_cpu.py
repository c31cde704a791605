"""`streamd bench throughput --device cpu`: the default model (SmolLM2-135M-Instruct) on the CPU, streamd's
offline engine against Hugging Face continuous batching (`paged|sdpa`) and static `generate`, all in this
process, on a CPU-sized workload; the median of alternating runs, then the same while a process this
benchmark starts keeps one core busy; and the time to first token of a long prompt against one plain
transformers forward of it. Ratios are taken within one invocation (the machine may be shared).
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from streamd.bench.hf_peer import run_continuous_batching
from streamd.bench.report import BenchError, report_header, results_dir, save_report
from streamd.bench.workloads import TokenWorkload

BUSY_LOOP = "while True: pass"


@dataclass(slots=True)
class CpuBenchSettings:
    dtype: str = "float32"
    num_requests: int = 32
    prompt_len: int = 96  # prompts are uniform in [prompt_len - 16, prompt_len + 16] tokens
    output_len: int = 48
    repeats: int = 3
    ttft_prompt_len: int = 2048
    contention: bool = True
    num_threads: int = 0


def cpu_workload(vocab: int, settings: CpuBenchSettings, seed: int = 0) -> TokenWorkload:
    rng = random.Random(seed)
    lo, hi = max(1, settings.prompt_len - 16), settings.prompt_len + 16
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(settings.num_requests)]
    return TokenWorkload(
        f"random-{settings.num_requests}x[{lo},{hi}]->{settings.output_len}",
        prompts,
        [settings.output_len] * settings.num_requests,
    )


# ---- the three engines, each loaded once and run several times ----------------------------------------


class Runner(Protocol):
    name: str

    def run(self, work: TokenWorkload) -> float:
        """Seconds for the whole workload."""
        ...


class StreamdRunner:
    name = "streamd"

    def __init__(self, settings: CpuBenchSettings) -> None:
        from streamd import LLM

        self.llm = LLM(device="cpu", dtype=settings.dtype, num_threads=settings.num_threads)
        self.engine = self.llm.engine

    def run(self, work: TokenWorkload) -> float:
        """Seconds for the whole workload (greedy, EOS ignored)."""
        from streamd import SamplingParams

        start = time.perf_counter()
        for i, (prompt, n) in enumerate(zip(work.prompts, work.output_lens)):
            self.engine.add_request(
                f"b{i}", prompt, SamplingParams(max_tokens=n, ignore_eos=True, detokenize=False, temperature=0.0)
            )
        while self.engine.has_unfinished_requests():
            self.engine.step()
        return time.perf_counter() - start

    def ttft(self, prompt: list[int]) -> float:
        from streamd import SamplingParams

        start = time.perf_counter()
        self.engine.add_request("ttft", prompt, SamplingParams(max_tokens=1, detokenize=False))
        while self.engine.has_unfinished_requests():
            self.engine.step()
        return time.perf_counter() - start


def _hf_model(settings: CpuBenchSettings, attn: str) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    from streamd.engine.worker.model_loader import default_model_dir

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[settings.dtype]
    return AutoModelForCausalLM.from_pretrained(default_model_dir(), dtype=dtype, attn_implementation=attn).eval()


def _hf_default_threads() -> None:
    """transformers at its own default: torch's threads on every core this process may use (streamd's governor
    sets its own count again at its next step)."""
    import torch

    from streamd.engine.worker.cpu_threads import usable_cores

    torch.set_num_threads(usable_cores())


class HfContinuousRunner:
    name = "hf_cb"

    def __init__(self, settings: CpuBenchSettings) -> None:
        self.model = _hf_model(settings, "paged|sdpa")

    def run(self, work: TokenWorkload) -> float:
        _hf_default_threads()
        seconds, produced = run_continuous_batching(self.model, work)
        if produced != work.output_tokens:
            raise RuntimeError(f"transformers continuous batching produced {produced} of {work.output_tokens} tokens")
        return seconds


class HfStaticRunner:
    name = "hf_static"

    def __init__(self, settings: CpuBenchSettings) -> None:
        self.model = _hf_model(settings, "sdpa")

    def run(self, work: TokenWorkload) -> float:
        """One left-padded batch of every request (the workload is CPU-sized), run to the longest output."""
        import torch

        _hf_default_threads()
        width = max(map(len, work.prompts))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in work.prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in work.prompts])
        n = max(work.output_lens)
        start = time.perf_counter()
        with torch.inference_mode():
            self.model.generate(
                ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0
            )
        return time.perf_counter() - start

    def ttft(self, prompt: list[int]) -> float:
        """One plain forward of the prompt (logits of its last position): transformers' time to first token."""
        import torch

        _hf_default_threads()
        ids = torch.tensor([prompt])
        start = time.perf_counter()
        with torch.inference_mode():
            self.model(ids, logits_to_keep=1)
        return time.perf_counter() - start


# ---- the measurement --------------------------------------------------------------------------------


def alternate(
    runners: Sequence[Runner], work: TokenWorkload, repeats: int, log: Callable[[str], None]
) -> dict[str, Any]:
    """`repeats` rounds, each running every engine once in turn; medians and ratios to streamd."""
    seconds: dict[str, list[float]] = {r.name: [] for r in runners}
    for round_ in range(repeats):
        for runner in runners:
            elapsed = runner.run(work)
            seconds[runner.name].append(elapsed)
            log(f"  round {round_ + 1}/{repeats} {runner.name}: {work.output_tokens / elapsed:.1f} tok/s")
    result: dict[str, Any] = {}
    result["load_average_after"] = os.getloadavg()[0]
    for name, values in seconds.items():
        result[name] = {
            "seconds": values,
            "tok_s": [work.output_tokens / s for s in values],
            "median_tok_s": work.output_tokens / statistics.median(values),
        }
    for name in seconds:
        if name != "streamd":
            result[f"streamd_vs_{name}"] = result["streamd"]["median_tok_s"] / result[name]["median_tok_s"]
    return result


def busy_core() -> subprocess.Popen[bytes]:
    """A process that keeps one core busy until killed."""
    return subprocess.Popen([sys.executable, "-c", BUSY_LOOP])


def measure_ttft(
    streamd: StreamdRunner, hf: HfStaticRunner, prompt_len: int, repeats: int, vocab: int
) -> dict[str, Any]:
    """Median seconds to the first token of a fresh `prompt_len`-token prompt, streamd and one transformers
    forward alternating (after one warm-up each); fresh tokens every time, so no prefix-cache hit."""
    rng = random.Random(1)
    times: dict[str, list[float]] = {"streamd": [], "hf_forward": []}
    for i in range(repeats + 1):
        for name, fn in (("streamd", streamd.ttft), ("hf_forward", hf.ttft)):
            elapsed = fn([rng.randrange(vocab) for _ in range(prompt_len)])
            if i:
                times[name].append(elapsed)
    result: dict[str, Any] = {"prompt_tokens": prompt_len}
    for name, values in times.items():
        result[f"{name}_s"] = statistics.median(values)
        result[f"{name}_all_s"] = values
    result["streamd_vs_hf_forward"] = result["streamd_s"] / result["hf_forward_s"]
    return result


def run_cpu_benchmark(settings: CpuBenchSettings, log: Callable[[str], None] = print) -> dict[str, Any]:
    import torch

    from streamd.engine.worker.cpu_threads import cpu_model_name, usable_cores

    streamd = StreamdRunner(settings)
    hf_static = HfStaticRunner(settings)
    runners: list[Runner] = [streamd, HfContinuousRunner(settings), hf_static]
    vocab = streamd.engine.vocab_size
    work = cpu_workload(vocab, settings)
    streamd.run(cpu_workload(vocab, CpuBenchSettings(num_requests=4, output_len=4), seed=9))  # warm-up
    report: dict[str, Any] = {
        **report_header("cpu"),
        "cpu": cpu_model_name() or platform.processor() or platform.machine(),
        "usable_cores": usable_cores(),
        "torch_threads": torch.get_num_threads(),
        "dtype": settings.dtype,
        "workload": work.name,
        "output_tokens": work.output_tokens,
        "repeats": settings.repeats,
        "load_average_before": os.getloadavg()[0],
    }
    log(f"machine as found ({work.name}, {settings.dtype}, {torch.get_num_threads()} threads)")
    report["idle"] = alternate(runners, work, settings.repeats, log)
    if settings.contention:
        log("one core kept busy by another process")
        load = busy_core()
        try:
            report["contention"] = alternate(runners, work, settings.repeats, log)
        finally:
            load.kill()
            load.wait()
    log(f"time to first token, {settings.ttft_prompt_len}-token prompt")
    report["ttft"] = measure_ttft(streamd, hf_static, settings.ttft_prompt_len, settings.repeats, vocab)
    return report


def summary_markdown(report: dict[str, Any]) -> str:
    lines = [
        f"# Throughput on CPU, {report['date']} (commit {report['git_commit']})",
        "",
        f"{report['cpu']}, {report['usable_cores']} usable cores, torch {report['torch']} with "
        f"{report['torch_threads']} threads, {report['dtype']}. Default model (SmolLM2-135M-Instruct), "
        f"workload {report['workload']} ({report['output_tokens']} output tokens), greedy, EOS ignored. "
        f"Median of {report['repeats']} alternating runs.",
        "",
        "| machine | streamd tok/s | HF continuous batching tok/s | HF static tok/s | vs HF CB | vs HF static "
        "| load avg after |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, key in (("as found", "idle"), ("+ a process keeping one core busy", "contention")):
        if key in report:
            r = report[key]
            lines.append(
                f"| {label} | {r['streamd']['median_tok_s']:.1f} | {r['hf_cb']['median_tok_s']:.1f} | "
                f"{r['hf_static']['median_tok_s']:.1f} | {r['streamd_vs_hf_cb']:.2f}x | "
                f"{r['streamd_vs_hf_static']:.2f}x | {r.get('load_average_after', float('nan')):.1f} |"
            )
    t = report["ttft"]
    lines += [
        "",
        f"Time to first token of a {t['prompt_tokens']}-token prompt: streamd {t['streamd_s'] * 1000:.0f} ms, "
        f"one plain transformers forward {t['hf_forward_s'] * 1000:.0f} ms "
        f"({t['streamd_vs_hf_forward']:.2f}x).",
    ]
    return "\n".join(lines) + "\n"


def main(args: argparse.Namespace) -> int:
    """Runs the CPU benchmark with the command line's settings and writes `<out>/throughput-<date>-cpu.*`."""
    if args.repeats < 1:
        raise BenchError(f"--repeats must be >= 1, got {args.repeats}")
    if args.num_requests is not None and args.num_requests < 1:
        raise BenchError(f"--num-requests must be >= 1, got {args.num_requests}")
    out = results_dir(args.out)  # checked before minutes of measuring
    settings = CpuBenchSettings(
        dtype=args.dtype,
        num_requests=args.num_requests or 32,
        repeats=args.repeats,
        contention=args.contention,
        num_threads=args.threads,
    )
    report = run_cpu_benchmark(settings, log=lambda line: print(line, file=sys.stderr, flush=True))
    markdown = summary_markdown(report)
    stem = save_report(report, out, "throughput", markdown)
    print(markdown)
    print(f"wrote {stem}.json and {stem}.md")
    return 0
