"""streamd's C for the CPU, built with the system's C compiler and loaded with ctypes: the decode glue
(`native/cpu_decode.c`) and the int4 matmul (`native/int4_matmul.c`, `lowbit.NativeInt4`), one library.

Why C, and why this way: on the CPU a one-stream decode step of the default model pays ~45 torch operator
calls a layer between its four matmuls, which cost more than the matmuls (benchmarks/NOTES.md, "Issue 25, one
stream"); one C call per stretch removes them. The source is plain C99 without torch headers, so it builds in
about a second where a C compiler exists, and there is nothing to build at install time: `load()` compiles it on
first use into `STREAMD_NATIVE_DIR` (default ~/.cache/streamd/native), named by the source's and flags' hash,
or finds it prebuilt there or beside the source (the CPU image builds it so: Dockerfile). Without a compiler
`load()` returns None and says why (`unavailable_reason`); the engine then runs the torch path.

Flags: -O3 with AVX2 where the CPU has it (the sums vectorize), -ffp-contract=off (no fused multiply-adds: each
product rounds as torch's does; the matmul's and the AVX-512 attention's intrinsics say where they fuse) and
-fopenmp (the matmul's threads: dlopen finds torch's libgomp.so.1 already loaded, so both share one OpenMP runtime
and its pool).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("native") / "cpu_decode.c"
SOURCES = (SOURCE, SOURCE.with_name("int4_matmul.c"))
HEADERS = (SOURCE.with_name("bf16.h"),)  # included by the sources: part of what names the library
_P, _I, _I64, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
SIGNATURES: dict[str, tuple[list[type], type | None]] = {
    "add_rmsnorm": ([_I, _I, _P, _P, _I64, _P, _F, _P, _P], None),
    "silu_and_mul": ([_I, _I, _P, _I64, _P], None),
    "rope_store_attend": (
        [_I, _I, _I, _I, _P, _I64, _P, _P, _P, _P, _P, _P, _I, _P, _P, _I, _P, _I, _F, _I, _P, _P],
        None,
    ),
    "int4_rows": ([_P, _I64, _I64, _I, _P, _I, _I, _P], None),
    "table_rows": ([_P, _I, _I64, _I64, _I, _P, _I, _I64, _I, _P, _P, _I, _P], _I),
    "attention_portable": ([_I], _I),
    "int4_matmul": ([_P, _P, _I, _I, _I64, _I64, _P, _I, _P, _I], _I),
    "int4_matmul_available": ([], _I),
    "decode_layer": ([_P, _P, _P, _F, _P], _I),
}
# OpenMP for int4_matmul's threads: the library then shares torch's OpenMP runtime (libgomp.so.1, already loaded
# by torch) and its thread pool; without it (a compiler that cannot link OpenMP) the same source builds serial.
OPENMP = ["-fopenmp"]


def flags(openmp: bool = True) -> list[str]:
    simd = ["-mavx2"] if "avx2" in _cpu_flags() else []
    return ["-O3", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared", *simd, *(OPENMP if openmp else [])]


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def library_name() -> str:
    text = b"".join(path.read_bytes() for path in (*SOURCES, *HEADERS)) + " ".join(flags()).encode()
    return f"cpu_decode-{hashlib.sha256(text).hexdigest()[:16]}.so"


def cache_dir() -> Path:
    return Path(os.environ.get("STREAMD_NATIVE_DIR") or Path.home() / ".cache" / "streamd" / "native")


@functools.cache
def load() -> ctypes.CDLL | None:
    """The library, built if need be; None where it cannot be (then `unavailable_reason` says why)."""
    try:
        lib = ctypes.CDLL(str(_find() or build(cache_dir())))
    except (OSError, subprocess.CalledProcessError, RuntimeError):  # (a library it may not read: OSError too)
        return None
    for name, (args, result) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, result
    return lib


@functools.cache
def int4_matmul() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """The library's int4 x bfloat16 matmul where this CPU runs it (AVX-512 BF16), else None."""
    lib = load()
    return lib.int4_matmul if lib is not None and lib.int4_matmul_available() else None


def unavailable_reason() -> str | None:
    """Why `load()` returns None (None: it does not)."""
    if load() is not None:
        return None
    if _compiler() is None:
        return "no C compiler (cc, gcc or $CC) to build streamd/kernels/native/cpu_decode.c"
    return f"building streamd/kernels/native/cpu_decode.c into {cache_dir()} failed"


def _find() -> Path | None:
    name = library_name()
    for folder in (SOURCE.parent, cache_dir()):
        if (folder / name).is_file():
            return folder / name
    return None


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def build(folder: Path) -> Path:
    """Compiles the source into `folder` (atomically: concurrent builders each write their own file and rename
    it into place); returns the library's path."""
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C compiler")
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / library_name()
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
    os.close(fd)
    try:
        sources = [str(source) for source in SOURCES]
        try:
            subprocess.run([compiler, *flags(), *sources, "-o", tmp, "-lm"], check=True, capture_output=True)
        except subprocess.CalledProcessError:
            subprocess.run([compiler, *flags(False), *sources, "-o", tmp, "-lm"], check=True, capture_output=True)
        os.chmod(tmp, 0o755)  # (mkstemp's file is the owner's alone: a library built as root is read by others)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target
