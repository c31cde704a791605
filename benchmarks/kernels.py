"""GPU benchmark of streamd's paged-attention kernels (one device run; see benchmarks/KERNELS.md).

Owns the measurements behind the issue's targets: HBM bandwidth and bf16 matmul rate measured in the
same run; paged decode vs torch SDPA on contiguous K/V of equal lengths (flash backend) and vs the
torch paged reference; a mixed-length batch vs padded contiguous SDPA; causal prefill vs SDPA in
TFLOP/s; optionally a sweep of tile configurations. Every timed call is captured in a CUDA graph (the
engine replays decode that way) and rotates over enough input copies that L2 (50-60 MB) cannot hold
them, so times are HBM times. Prints a short table last and writes JSON + markdown to ``--out``.

    python benchmarks/kernels.py --out DIR [--sweep] [--quick]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import streamd.kernels as K  # noqa: E402
from streamd.bench.cuda_timing import copies_for, time_graph  # noqa: E402
from streamd.kernels import reference as R  # noqa: E402

DEV = "cuda"
PAGE = 16
MODELS = {"llama3-8b": (32, 8, 128), "llama3.2-1b": (32, 8, 64)}  # q heads, kv heads, head dim
MIB = 1 << 20


def log(*a: Any) -> None:
    print(*a, flush=True)


def measure_hbm() -> dict[str, float]:
    n = 1 << 30  # 1 GiB each way
    a = torch.empty(n, dtype=torch.uint8, device=DEV).random_()
    b = torch.empty_like(a)
    ms = triton.testing.do_bench(lambda: b.copy_(a), warmup=50, rep=300, return_mode="median")
    bw = 2 * n / (ms * 1e-3)
    del a, b
    m = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    mm = triton.testing.do_bench(lambda: m @ m, warmup=50, rep=300, return_mode="median")
    tflops = 2 * 8192**3 / (mm * 1e-3) / 1e12
    del m
    return {"copy_bytes_per_s": bw, "bf16_matmul_tflops": tflops}


def paged_pool(lens: list[int], hkv: int, d: int, shuffle: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A one-layer pool holding exactly these contexts in shuffled blocks (table width = longest)."""
    need = [-(-n // PAGE) for n in lens]
    num_blocks = sum(need) + 1
    kv = torch.randn(num_blocks, 1, 2, hkv, PAGE, d, device=DEV, dtype=torch.bfloat16)
    order = torch.randperm(num_blocks - 1, device=DEV) if shuffle else torch.arange(num_blocks - 1, device=DEV)
    tables = torch.zeros(len(lens), max(need), dtype=torch.int32, device=DEV)
    at = 0
    for i, nb in enumerate(need):
        tables[i, :nb] = order[at : at + nb].int()
        at += nb
    return kv, tables, torch.tensor(lens, dtype=torch.int32, device=DEV)


def sdpa_decode(q4: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                mask: torch.Tensor | None = None) -> torch.Tensor:
    # GQA folded: the G query heads of a KV head are G query rows over that head's keys.
    return F.scaled_dot_product_attention(q4, k, v, attn_mask=mask, scale=scale)


def bench_decode(model: str, batch: int, ctx: int, hbm: float, with_ref: bool = True,
                 **overrides: Any) -> dict[str, Any]:
    h, hkv, d = MODELS[model]
    g = h // hkv
    scale = d**-0.5
    kv_bytes = batch * ctx * hkv * d * 2 * 2
    n = copies_for(kv_bytes)
    pools = [paged_pool([ctx] * batch, hkv, d) for _ in range(n)]
    qs = [torch.randn(batch, h, d, device=DEV, dtype=torch.bfloat16) for _ in range(n)]
    outs = [torch.empty_like(q) for q in qs]
    ours = [
        (lambda p=p, q=q, o=o: K.paged_decode_attention(q, p[0], 0, p[1], p[2], scale, out=o, **overrides))
        for p, q, o in zip(pools, qs, outs)
    ]
    t_ours = time_graph(ours)
    # Correctness on the timed shapes (first copy).
    ref_out = R.paged_decode_attention(qs[0], pools[0][0], 0, pools[0][1], pools[0][2], scale)
    err = ((outs[0].float() - ref_out.float()).norm() / ref_out.float().norm()).item()
    t_ref = None
    if with_ref and kv_bytes <= 512 * MIB and not overrides:
        refs = [(lambda p=p, q=q: R.paged_decode_attention(q, p[0], 0, p[1], p[2], scale)) for p, q in zip(pools, qs)]
        t_ref = time_graph(refs)
    del pools, ref_out
    contig = [
        (torch.randn(batch, hkv, ctx, d, device=DEV, dtype=torch.bfloat16),
         torch.randn(batch, hkv, ctx, d, device=DEV, dtype=torch.bfloat16),
         torch.randn(batch, hkv, g, d, device=DEV, dtype=torch.bfloat16))
        for _ in range(n)
    ]
    t_sdpa = None
    if not overrides:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            t_sdpa = time_graph([(lambda c=c: sdpa_decode(c[2], c[0], c[1], scale)) for c in contig])
    del contig
    moved = kv_bytes + 2 * batch * h * d * 2 + batch * (ctx // PAGE) * 4
    return {
        "kind": "decode", "model": model, "batch": batch, "context": ctx, "overrides": overrides,
        "copies": n, "t_paged_s": t_ours, "t_sdpa_flash_s": t_sdpa, "t_paged_reference_s": t_ref,
        "paged_over_sdpa": t_ours / t_sdpa if t_sdpa else None,
        "bytes": moved, "paged_bytes_per_s": moved / t_ours, "paged_frac_hbm": moved / t_ours / hbm,
        "sdpa_frac_hbm": moved / t_sdpa / hbm if t_sdpa else None, "rel_err_vs_reference": err,
    }


def bench_mixed(model: str, batch: int, lo: int, hi: int, hbm: float) -> dict[str, Any]:
    h, hkv, d = MODELS[model]
    g = h // hkv
    scale = d**-0.5
    gen = torch.Generator().manual_seed(batch * 7919 + hi)
    lens = torch.randint(lo, hi + 1, (batch,), generator=gen).tolist()
    lens[0] = hi  # the padded width is the longest context
    real_bytes = sum(lens) * hkv * d * 2 * 2
    pad_bytes = batch * hi * hkv * d * 2 * 2
    n = copies_for(pad_bytes, cap=16)
    pools = [paged_pool(lens, hkv, d) for _ in range(n)]
    qs = [torch.randn(batch, h, d, device=DEV, dtype=torch.bfloat16) for _ in range(n)]
    outs = [torch.empty_like(q) for q in qs]
    t_ours = time_graph([(lambda p=p, q=q, o=o: K.paged_decode_attention(q, p[0], 0, p[1], p[2], scale, out=o))
                         for p, q, o in zip(pools, qs, outs)])
    del pools
    mask = (torch.arange(hi, device=DEV)[None, :] < torch.tensor(lens, device=DEV)[:, None])[:, None, None, :]
    contig = [
        (torch.randn(batch, hkv, hi, d, device=DEV, dtype=torch.bfloat16),
         torch.randn(batch, hkv, hi, d, device=DEV, dtype=torch.bfloat16),
         torch.randn(batch, hkv, g, d, device=DEV, dtype=torch.bfloat16))
        for _ in range(n)
    ]
    # Correct padded attention needs the mask (efficient backend); flash without it is the speed of
    # reading the padding at all (its results would be wrong), a lower bound for any padded kernel.
    t_masked = time_graph([(lambda c=c: sdpa_decode(c[2], c[0], c[1], scale, mask)) for c in contig])
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        t_flash_pad = time_graph([(lambda c=c: sdpa_decode(c[2], c[0], c[1], scale)) for c in contig])
    del contig
    return {
        "kind": "mixed", "model": model, "batch": batch, "len_range": [lo, hi], "mean_len": sum(lens) / batch,
        "t_paged_s": t_ours, "t_sdpa_padded_masked_s": t_masked, "t_sdpa_flash_padded_unmasked_s": t_flash_pad,
        "paged_frac_hbm": (real_bytes / t_ours) / hbm, "real_kv_bytes": real_bytes, "padded_kv_bytes": pad_bytes,
    }


def bench_prefill(model: str, seqs: int, tokens: int, peak: float, **overrides: Any) -> dict[str, Any]:
    h, hkv, d = MODELS[model]
    scale = d**-0.5
    total = seqs * tokens
    flops = seqs * 2.0 * tokens * tokens * h * d  # causal: half of 4 * T^2 * H * D
    n = copies_for(total * (h + 2 * hkv) * d * 2, cap=8)
    pools = [paged_pool([tokens] * seqs, hkv, d) for _ in range(n)]
    qsl = torch.arange(0, total + 1, tokens, dtype=torch.int32, device=DEV)
    qs = [torch.randn(total, h, d, device=DEV, dtype=torch.bfloat16) for _ in range(n)]
    outs = [torch.empty_like(q) for q in qs]
    t_ours = time_graph([(lambda p=p, q=q, o=o: K.paged_prefill_attention(q, p[0], 0, p[1], qsl, p[2], scale,
                                                                          out=o, **overrides))
                         for p, q, o in zip(pools, qs, outs)], min_calls=8)
    err = None
    if total <= 8192:
        ref_out = R.paged_prefill_attention(qs[0], pools[0][0], 0, pools[0][1], qsl, pools[0][2], scale)
        err = ((outs[0].float() - ref_out.float()).norm() / ref_out.float().norm()).item()
    del pools
    t_sdpa, how = None, None
    if not overrides:
        q4 = [torch.randn(seqs, h, tokens, d, device=DEV, dtype=torch.bfloat16) for _ in range(n)]
        k4 = [torch.randn(seqs, hkv, tokens, d, device=DEV, dtype=torch.bfloat16) for _ in range(n)]
        v4 = [torch.randn(seqs, hkv, tokens, d, device=DEV, dtype=torch.bfloat16) for _ in range(n)]
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            try:
                t_sdpa = time_graph([(lambda i=i: F.scaled_dot_product_attention(
                    q4[i], k4[i], v4[i], is_causal=True, scale=scale, enable_gqa=True)) for i in range(n)], min_calls=8)
                how = "flash, enable_gqa"
            except RuntimeError:
                # Flash without GQA support: give it K/V already expanded (outside the timing).
                k4 = [k.repeat_interleave(h // hkv, 1) for k in k4]
                v4 = [v.repeat_interleave(h // hkv, 1) for v in v4]
                t_sdpa = time_graph([(lambda i=i: F.scaled_dot_product_attention(
                    q4[i], k4[i], v4[i], is_causal=True, scale=scale)) for i in range(n)], min_calls=8)
                how = "flash, K/V pre-expanded"
        del q4, k4, v4
    return {
        "kind": "prefill", "model": model, "seqs": seqs, "tokens": tokens, "overrides": overrides,
        "t_paged_s": t_ours, "t_sdpa_s": t_sdpa, "sdpa_how": how,
        "paged_tflops": flops / t_ours / 1e12, "sdpa_tflops": flops / t_sdpa / 1e12 if t_sdpa else None,
        "paged_over_sdpa_rate": (t_sdpa / t_ours) if t_sdpa else None, "paged_frac_peak": flops / t_ours / 1e12 / peak,
        "rel_err_vs_reference": err,
    }


def sweep(hbm: float, peak: float, rows: list[dict[str, Any]], save: Callable[[], Any]) -> None:
    dec = [
        ("llama3-8b", 8, 8192, [dict(block_n=bn, num_warps=w, num_stages=s)
                                 for bn, w, s in [(64, 4, 3), (32, 4, 3), (128, 4, 3), (64, 4, 2), (64, 4, 4),
                                                  (128, 8, 3), (64, 8, 3)]]
         + [dict(num_splits=s) for s in (4, 8, 16, 32)]),
        ("llama3-8b", 64, 2048, [dict(block_n=bn, num_warps=w, num_stages=s)
                                  for bn, w, s in [(64, 4, 3), (32, 4, 3), (128, 4, 3), (64, 4, 2), (64, 4, 4),
                                                   (128, 8, 3)]]
         + [dict(num_splits=s) for s in (1, 2, 4)]),
        ("llama3.2-1b", 64, 2048, [dict(block_n=bn, num_warps=w, num_stages=s)
                                    for bn, w, s in [(128, 4, 3), (64, 4, 3), (256, 4, 3), (128, 4, 2), (128, 8, 3),
                                                     (64, 4, 4)]]),
    ]
    for model, b, c, variants in dec:
        for ov in variants:
            try:
                r = bench_decode(model, b, c, hbm, with_ref=False, **ov)
                rows.append(r)
                save()
                log(f"sweep decode {model} b={b} ctx={c} {ov}: {r['t_paged_s']*1e6:.1f} us "
                    f"{r['paged_frac_hbm']*100:.0f}% HBM")
            except Exception as e:  # a config that does not compile (smem) is a result too
                log(f"sweep decode {model} b={b} ctx={c} {ov}: FAILED {e!r}"[:300])
    pre = [
        ("llama3-8b", [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3), (128, 64, 8, 4),
                       (128, 32, 8, 3), (64, 128, 4, 3), (128, 128, 8, 2)]),
        ("llama3.2-1b", [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3), (128, 128, 4, 3)]),
    ]
    for model, cfgs in pre:
        for bm, bn, w, s in cfgs:
            ov = dict(block_m=bm, block_n=bn, num_warps=w, num_stages=s)
            try:
                r = bench_prefill(model, 1, 4096, peak, **ov)
                rows.append(r)
                save()
                log(f"sweep prefill {model} T=4096 {ov}: {r['paged_tflops']:.0f} TFLOP/s")
            except Exception as e:
                log(f"sweep prefill {model} T=4096 {ov}: FAILED {e!r}"[:300])


def fmt_us(t: float | None) -> str:
    return "-" if t is None else f"{t * 1e6:.1f}"


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    out = [f"# Kernel benchmark, {meta['date']}, {meta['gpu']}", "",
           f"torch {meta['torch']}, triton {meta['triton']}; HBM copy {meta['hbm_copy_bytes_per_s']/1e12:.2f} TB/s "
           f"(read+write), bf16 matmul {meta['bf16_matmul_tflops']:.0f} TFLOP/s. Times: CUDA-graph replay, "
           "median, L2 rotated out. Block size 16, bf16.", "",
           "## Decode (paged vs contiguous SDPA flash at equal lengths)", "",
           "| model | batch | ctx | paged us | SDPA us | paged/SDPA | torch ref us | paged %HBM | SDPA %HBM | rel err |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["kind"] == "decode" and not r["overrides"]:
            out.append(f"| {r['model']} | {r['batch']} | {r['context']} | {fmt_us(r['t_paged_s'])} | "
                       f"{fmt_us(r['t_sdpa_flash_s'])} | {r['paged_over_sdpa']:.2f} | {fmt_us(r['t_paged_reference_s'])} | "
                       f"{r['paged_frac_hbm']*100:.0f}% | {r['sdpa_frac_hbm']*100:.0f}% | {r['rel_err_vs_reference']:.1e} |")
    rep = [r for r in rows if r["kind"] == "decode-repeat"]
    if rep:
        out += ["", "Repeated cells (run-to-run spread): " + "; ".join(
            f"{r['model']} b={r['batch']} ctx={r['context']}: paged {fmt_us(r['t_paged_s'])} us, SDPA {fmt_us(r['t_sdpa_flash_s'])} us"
            for r in rep)]
    out += ["", "## Mixed lengths (paged vs padded contiguous SDPA)", "",
            "| model | batch | lens | mean | paged us | SDPA masked us | flash padded (no mask) us | paged %HBM |",
            "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["kind"] == "mixed":
            out.append(f"| {r['model']} | {r['batch']} | {r['len_range']} | {r['mean_len']:.0f} | {fmt_us(r['t_paged_s'])} | "
                       f"{fmt_us(r['t_sdpa_padded_masked_s'])} | {fmt_us(r['t_sdpa_flash_padded_unmasked_s'])} | "
                       f"{r['paged_frac_hbm']*100:.0f}% |")
    out += ["", "## Prefill (causal, TFLOP/s)", "",
            "| model | seqs x tokens | paged TFLOP/s | SDPA TFLOP/s | paged/SDPA | SDPA how | rel err |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["kind"] == "prefill" and not r["overrides"]:
            err = "-" if r["rel_err_vs_reference"] is None else f"{r['rel_err_vs_reference']:.1e}"
            out.append(f"| {r['model']} | {r['seqs']}x{r['tokens']} | {r['paged_tflops']:.0f} | {r['sdpa_tflops']:.0f} | "
                       f"{r['paged_over_sdpa_rate']:.2f} | {r['sdpa_how']} | {err} |")
    sw = [r for r in rows if r.get("overrides")]
    if sw:
        out += ["", "## Sweep", "", "| kernel | model | shape | overrides | us | %HBM or TFLOP/s |", "|---|---|---|---|---|---|"]
        for r in sw:
            if r["kind"] == "decode":
                out.append(f"| decode | {r['model']} | b={r['batch']} ctx={r['context']} | {r['overrides']} | "
                           f"{fmt_us(r['t_paged_s'])} | {r['paged_frac_hbm']*100:.0f}% |")
            else:
                out.append(f"| prefill | {r['model']} | {r['seqs']}x{r['tokens']} | {r['overrides']} | "
                           f"{fmt_us(r['t_paged_s'])} | {r['paged_tflops']:.0f} |")
    return "\n".join(out) + "\n"


def targets(rows: list[dict[str, Any]]) -> str:
    """The issue's four targets, each with the cells that miss it."""
    dec = [r for r in rows if r["kind"] == "decode" and not r["overrides"]]
    slow = [f"{r['model']} b={r['batch']} ctx={r['context']} ({r['paged_over_sdpa']:.2f}x)" for r in dec
            if r["paged_over_sdpa"] > 1.10]
    big = [r for r in dec if r["batch"] >= 64 and r["context"] >= 2048]
    low_bw = [f"{r['model']} b={r['batch']} ctx={r['context']} ({r['paged_frac_hbm']*100:.0f}%)" for r in big
              if r["paged_frac_hbm"] < 0.70]
    mixed = [r for r in rows if r["kind"] == "mixed"]
    mixed_slow = [f"{r['model']} b={r['batch']}" for r in mixed
                  if r["t_paged_s"] >= min(r["t_sdpa_padded_masked_s"], r["t_sdpa_flash_padded_unmasked_s"])]
    pre = [r for r in rows if r["kind"] == "prefill" and not r["overrides"]]
    pre_slow = [f"{r['model']} {r['seqs']}x{r['tokens']} ({r['paged_over_sdpa_rate']:.2f})" for r in pre
                if r["paged_over_sdpa_rate"] < 0.60]
    lines = ["## Targets", "",
             f"- decode within 10% of contiguous SDPA: {len(dec) - len(slow)}/{len(dec)} cells"
             + (f"; missed: {', '.join(slow)}" if slow else ""),
             f"- decode >= 70% of measured HBM at batch >= 64, ctx >= 2048: {len(big) - len(low_bw)}/{len(big)}"
             + (f"; missed: {', '.join(low_bw)}" if low_bw else ""),
             f"- mixed lengths faster than padded SDPA (masked and unmasked flash): {len(mixed) - len(mixed_slow)}/{len(mixed)}"
             + (f"; missed: {', '.join(mixed_slow)}" if mixed_slow else ""),
             f"- prefill >= 60% of SDPA TFLOP/s: {len(pre) - len(pre_slow)}/{len(pre)}"
             + (f"; missed: {', '.join(pre_slow)}" if pre_slow else "")]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--sweep", action="store_true", help="also time tile/split variants")
    ap.add_argument("--quick", action="store_true", help="a few shapes only")
    ap.add_argument("--repeat", action="store_true", help="time a few cells again (run-to-run spread)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    props = torch.cuda.get_device_properties(0)
    meta: dict[str, Any] = {"date": dt.date.today().isoformat(), "gpu": props.name, "sms": props.multi_processor_count,
                            "torch": torch.__version__, "triton": triton.__version__}
    meta.update({f"hbm_{k}" if k.startswith("copy") else k: v for k, v in measure_hbm().items()})
    hbm, peak = meta["hbm_copy_bytes_per_s"], meta["bf16_matmul_tflops"]
    log(f"{meta}")
    rows: list[dict[str, Any]] = []
    gpu_tag = props.name.replace("NVIDIA ", "").replace(" ", "-").lower()
    stem = os.path.join(args.out, f"kernels-{meta['date']}-{gpu_tag}")

    def save() -> str:
        meta["elapsed_s"] = time.time() - t0
        with open(stem + ".json", "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        summary = targets(rows)
        with open(stem + ".md", "w") as f:
            f.write(markdown(meta, rows) + "\n" + summary)
        return summary

    batches, ctxs = ([1, 64], [512, 8192]) if args.quick else ([1, 8, 64, 256], [128, 512, 2048, 8192])
    for model in MODELS:
        for b in batches:
            for c in ctxs:
                try:
                    r = bench_decode(model, b, c, hbm)
                except Exception as e:  # one failing cell must not lose the others
                    log(f"decode {model} b={b} ctx={c}: FAILED {e!r}"[:400])
                    continue
                rows.append(r)
                save()
                log(f"decode {model} b={b} ctx={c}: paged {fmt_us(r['t_paged_s'])} sdpa {fmt_us(r['t_sdpa_flash_s'])} "
                    f"ref {fmt_us(r['t_paged_reference_s'])} us, {r['paged_frac_hbm']*100:.0f}% HBM, err {r['rel_err_vs_reference']:.1e}")
    for model, b, lo, hi in [("llama3-8b", 64, 128, 4096), ("llama3-8b", 256, 64, 2048), ("llama3.2-1b", 64, 128, 8192)]:
        try:
            r = bench_mixed(model, b, lo, hi, hbm)
        except Exception as e:
            log(f"mixed {model} b={b}: FAILED {e!r}"[:400])
            continue
        rows.append(r)
        save()
        log(f"mixed {model} b={b} [{lo},{hi}]: paged {fmt_us(r['t_paged_s'])} masked sdpa {fmt_us(r['t_sdpa_padded_masked_s'])} "
            f"flash padded {fmt_us(r['t_sdpa_flash_padded_unmasked_s'])} us")
    for model in MODELS:
        for seqs, tokens in [(1, 512), (1, 1024), (1, 2048), (1, 4096), (1, 8192), (8, 1024)]:
            try:
                r = bench_prefill(model, seqs, tokens, peak)
            except Exception as e:
                log(f"prefill {model} {seqs}x{tokens}: FAILED {e!r}"[:400])
                continue
            rows.append(r)
            save()
            log(f"prefill {model} {seqs}x{tokens}: paged {r['paged_tflops']:.0f} sdpa {r['sdpa_tflops']:.0f} TFLOP/s "
                f"({r['sdpa_how']}), err {r['rel_err_vs_reference']}")
    save()  # the main results survive a sweep cut short by the time limit
    if args.repeat:
        for model, b, c in [("llama3-8b", 8, 8192), ("llama3-8b", 64, 2048), ("llama3.2-1b", 8, 8192)]:
            r = bench_decode(model, b, c, hbm, with_ref=False)
            r["kind"] = "decode-repeat"
            rows.append(r)
            log(f"repeat decode {model} b={b} ctx={c}: paged {fmt_us(r['t_paged_s'])} sdpa {fmt_us(r['t_sdpa_flash_s'])} us")
        save()
    if args.sweep:
        sweep(hbm, peak, rows, save)
    summary = save()
    # The sweep rows are in the files and were logged above; the tail of the output is the main table.
    log(markdown(meta, [r for r in rows if not r.get("overrides")]) + "\n" + summary)


if __name__ == "__main__":
    main()
