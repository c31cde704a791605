"""What identifies a model's weights, cheaply: the disk tier's files are keyed by it (issue 31), so a server
never reads KV another model wrote. The display label is not enough: two checkpoints in folders named
`model`, or a fine-tune saved over its base's folder, share a label but not their KV.

Cheap because it runs at every start: a local file is named by its resolved path, size and modification
time (a rewritten file changes them); a directory by its resolved path and those of its weight and config
files (their names, sizes and times, not their bytes: hashing gigabytes would cost seconds); a Hugging Face
Hub id by the commit of the locally cached snapshot it loads (the Hub's own content address); random weights
by their architecture's config and seed.
"""

from __future__ import annotations

from pathlib import Path

import xxhash
from huggingface_hub import try_to_load_from_cache
from transformers import PretrainedConfig

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".json", ".model")


def weights_identity(source: str | Path) -> str:
    """The identity of the weights `source` (a path or a Hub id) loads."""
    path = Path(source).expanduser()
    if path.is_file():
        return f"file:{_stamp(path.resolve())}"
    if path.is_dir():
        resolved = path.resolve()
        files = sorted(p for p in resolved.iterdir() if p.is_file() and p.suffix in _WEIGHT_SUFFIXES)
        listing = ";".join(f"{p.name}={_stamp(p)}" for p in files)
        return f"dir:{resolved}:{xxhash.xxh64_hexdigest(listing.encode())}"
    return f"hub:{source}@{_hub_commit(str(source))}"


def random_identity(config: PretrainedConfig, seed: int) -> str:
    """Random weights: the same config and seed give the same weights."""
    return f"random:{seed}:{xxhash.xxh64_hexdigest(config.to_json_string(use_diff=False).encode())}"


def _stamp(path: Path) -> str:
    """A file's resolved path (a Hub snapshot's link leads to its content-addressed blob), size and time."""
    real = path.resolve()
    stat = real.stat()
    return f"{real}:{stat.st_size}:{stat.st_mtime_ns}"


def _hub_commit(repo_id: str) -> str:
    """The commit of the cached snapshot a Hub id loads from (its folder's name), or "unknown"."""
    found = try_to_load_from_cache(repo_id, "config.json")
    return Path(found).parent.name if isinstance(found, str) else "unknown"
