"""The attention kernels compile for Hopper (sm_90, through Triton's frontend and the ptxas its wheel ships)
on a machine without a GPU. The other CPU tests run the kernels in Triton's interpreter, which accepts code a
compiled kernel refuses (a global that is not a constexpr, say): this keeps every variant of the extras'
compile-time flags (window, soft-cap, sinks) compilable where no GPU test runs, and the 8-bit pools' variants
(int8 and fp8 codes with their scales) of the attentions and both KV stores. The compiles run in a child
process: the kernel tests' conftest sets TRITON_INTERPRET=1, under which triton's own helpers cannot compile."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import sizes

ROOT = Path(__file__).resolve().parents[2]
INT_POINTERS = {"bt_ptr", "sl_ptr", "qsl_ptr"}
FLOAT_POINTERS = {"part_m_ptr", "part_l_ptr", "part_acc_ptr", "sc_ptr"}
FLOATS = {"qk_scale", "cap_log2", "eps"}
NO_QUANT = {"KV_QUANT": False, "KV_INT8": False, "KV_QMAX": 1.0}
QUANTS = {"*i8": {"KV_QUANT": True, "KV_INT8": True, "KV_QMAX": 127.0},
          "*fp8e4nv": {"KV_QUANT": True, "KV_INT8": False, "KV_QMAX": 448.0}}
SHAPES = {  # Mistral-7B's attention in bf16 at the default tiles
    "_decode_kernel": {"GROUP": 4, "BLOCK_G": 16, "HEAD_DIM": 128, "BLOCK_D": 128, "PAGE": 16, "BLOCK_N": 64,
                       "DOT_PRECISION": "tf32", "UPCAST": False, **NO_QUANT},
    "_reduce_kernel": {"HEAD_DIM": 128, "BLOCK_D": 128, "BLOCK_S": 8, "BLOCK_N": 64},
    "_prefill_kernel": {"GROUP": 4, "HEAD_DIM": 128, "BLOCK_D": 128, "PAGE": 16, "BLOCK_M": 64, "BLOCK_N": 64,
                        "SEARCH_STEPS": 9, "DOT_PRECISION": "tf32", "UPCAST": False, **NO_QUANT},
    "_store_kv_kernel": {"HEAD_DIM": 128, "BLOCK_D": 128, "BLOCK_H": 8, "PAGE": 16},
    "_rotary_store_kv_kernel": {"HALF": 64, "BLOCK_HALF": 64, "BLOCK_HQ": 32, "BLOCK_HK": 8, "PAGE": 16,
                                "QK_NORM": False},
}


def _quant_variants() -> list[tuple[str, str, dict[str, object], str]]:
    """The 8-bit pools' kernels (no extras): (module, kernel, constexprs, the pool pointer's type)."""
    out: list[tuple[str, str, dict[str, object], str]] = []
    for kv_type, quant in QUANTS.items():
        out += [("decode_attention", "_decode_kernel", {**SHAPES["_decode_kernel"], "SPLIT": split,
                 "WINDOW": False, "SOFTCAP": False, "SINKS": False, **quant}, kv_type) for split in (False, True)]
        out.append(("prefill_attention", "_prefill_kernel", {**SHAPES["_prefill_kernel"], "WINDOW": False,
                    "SOFTCAP": False, "SINKS": False, **quant}, kv_type))
        out.append(("kv_store", "_store_kv_kernel", {**SHAPES["_store_kv_kernel"], **quant}, kv_type))
        out.append(("rotary", "_rotary_store_kv_kernel", {**SHAPES["_rotary_store_kv_kernel"], **quant}, kv_type))
    return out


def _arg_type(name: str, kv_type: str = "*bf16") -> str:
    if name == "kv_ptr":
        return kv_type
    if name == "slot_ptr":
        return "*i64"
    if name in INT_POINTERS:
        return "*i32"
    if name in FLOAT_POINTERS:
        return "*fp32"
    if name.endswith("_ptr"):
        return "*bf16"
    return "fp32" if name in FLOATS else "i32"


def _variants(flag_sets: list[list[bool]]) -> list[tuple[str, str, dict[str, object], str]]:
    """(module, kernel, constexprs, the pool pointer's type) of every kernel launch the flag sets make, and the
    8-bit pools' (`_quant_variants`)."""
    out: list[tuple[str, str, dict[str, object]]] = []
    for window, cap, sinks in flag_sets:
        flags = {"WINDOW": window, "SOFTCAP": cap, "SINKS": sinks}
        out += [("decode_attention", "_decode_kernel", {**SHAPES["_decode_kernel"], "SPLIT": split, **flags})
                for split in (False, True)]
        out.append(("decode_attention", "_reduce_kernel",
                    {**SHAPES["_reduce_kernel"], "WINDOW": window, "SINKS": sinks}))
        out.append(("prefill_attention", "_prefill_kernel", {**SHAPES["_prefill_kernel"], **flags}))
    return [(*v, "*bf16") for v in out] + _quant_variants()


def compile_for_hopper(flag_sets: list[list[bool]]) -> None:
    """The child's work: compile every variant (raises on the first that does not compile)."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    for module, name, constexprs, kv_type in _variants(flag_sets):
        fn = getattr(importlib.import_module(f"streamd.kernels.{module}"), name).compiled
        signature = {arg: "constexpr" if arg in constexprs else _arg_type(arg, kv_type) for arg in fn.arg_names}
        source = ASTSource(fn, signature, constexprs)
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 3})
        assert compiled.asm["cubin"], f"{name} {constexprs}: no binary"
        print(name, constexprs, "ok")


@pytest.mark.parametrize("flag_sets", sizes([[True, True, True]], [list(f) for f in itertools.product((False, True), repeat=3)]))
def test_attention_kernels_compile_for_hopper(flag_sets, tmp_path):
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1", PYTHONPATH=str(ROOT))
    code = f"from tests.kernels.test_compile import compile_for_hopper; compile_for_hopper({flag_sets!r})"
    result = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count(" ok") == 4 * len(flag_sets) + 5 * len(QUANTS)
