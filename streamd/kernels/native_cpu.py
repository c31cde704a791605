"""The CPU decode glue in C (`native/cpu_decode.c`), built with the system's C compiler and loaded with ctypes.

Why C, and why this way: on the CPU a one-stream decode step of the default model pays ~45 torch operator
calls a layer between its four matmuls, which cost more than the matmuls (benchmarks/NOTES.md, "Issue 25, one
stream"); one C call per stretch removes them. The source is plain C99 without torch headers, so it builds in
about a second where a C compiler exists, and there is nothing to build at install time: `load()` compiles it on
first use into `STREAMD_NATIVE_DIR` (default ~/.cache/streamd/native), named by the source's and flags' hash,
or finds it prebuilt there or beside the source (the CPU image builds it so: Dockerfile). Without a compiler
`load()` returns None and says why (`unavailable_reason`); the engine then runs the torch path.

Flags: -O3 with AVX2 where the CPU has it (the sums vectorize), and -ffp-contract=off (no fused multiply-adds:
each product rounds as torch's does).
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
_P, _I, _I64, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
SIGNATURES = {
    "add_rmsnorm": [_I, _I, _P, _P, _I64, _P, _F, _P, _P],
    "silu_and_mul": [_I, _I, _P, _I64, _P],
    "rope_store_attend": [_I, _I, _I, _I, _P, _I64, _P, _P, _P, _P, _I, _P, _P, _I, _P, _I, _F, _P, _P],
    "int4_rows": [_P, _I64, _I64, _I, _P, _I, _I, _P],
}


def flags() -> list[str]:
    simd = ["-mavx2"] if "avx2" in _cpu_flags() else []
    return ["-O3", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared", *simd]


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def library_name() -> str:
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(flags()).encode()).hexdigest()[:16]
    return f"cpu_decode-{digest}.so"


def cache_dir() -> Path:
    return Path(os.environ.get("STREAMD_NATIVE_DIR") or Path.home() / ".cache" / "streamd" / "native")


@functools.cache
def load() -> ctypes.CDLL | None:
    """The library, built if need be; None where it cannot be (then `unavailable_reason` says why)."""
    try:
        lib = ctypes.CDLL(str(_find() or build(cache_dir())))
    except (OSError, subprocess.CalledProcessError, RuntimeError):  # (a library it may not read: OSError too)
        return None
    for name, args in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, None
    return lib


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
        subprocess.run([compiler, *flags(), str(SOURCE), "-o", tmp, "-lm"], check=True, capture_output=True)
        os.chmod(tmp, 0o755)  # (mkstemp's file is the owner's alone: a library built as root is read by others)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target
