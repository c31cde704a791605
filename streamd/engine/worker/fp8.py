"""FP8 weights (float8_e4m3fn) for GPUs with FP8 tensor cores (Ada, Hopper: compute capability 8.9+).

Why: a decode step reads every weight once, and e4m3 weights are half of bfloat16's bytes; Hopper's FP8 tensor cores
also run the matmul at twice bfloat16's rate. Two ways in, one module (`Fp8Linear`) out:

- `model.quantization = "fp8"`: a float checkpoint's Linear layers quantized at load (`quantize_fp8_linears`): one
  float32 scale per output channel (absmax / 448, e4m3's largest finite value), round to nearest. The head (and the
  embeddings, no Linear) stay in `model.dtype`, as vLLM keeps them by default.
- a compressed-tensors FP8 checkpoint (llm-compressor's `-FP8` / `-FP8-dynamic` models on the Hub): its e4m3
  weights and scales read from the safetensors as stored (`CheckpointTensors`, `load_fp8_linears`), never
  dequantized where FP8 runs. A per-tensor weight scale becomes one per channel (the same value on every row); a
  static `input_scale` is kept, otherwise activations are quantized per token (also for a weight-only FP8 scheme).

`Fp8Linear` multiplies through `kernels.fp8_matmul`: on CUDA, cuBLAS's per-tensor FP8 GEMM with unit scales (e4m3
x e4m3 on the tensor cores), then one Triton pass for the row and channel scales and the bias; the plain-torch
reference elsewhere. Its input is either rows already quantized (`layout.Fp8Rows`: the fused layer's norms and
SiLU-and-mul write them, `kernels.fp8`) or a float tensor, then quantized per row in one launch
(`kernels.quantize_fp8`) or by the static input scale. Measured on an H200 (benchmarks/fp8_gemm.py), torch's
rowwise-scaled `_scaled_mm` was slower than the bfloat16 GEMM below ~128 rows and its activation quantization took
four kernels; the per-tensor GEMM and its pass are faster than bfloat16 at every size of the 8B's Linears.
The inner dimension and the weight's output dimension are zero-padded to multiples of 16 once at build (the
activations padded per call, the output sliced); rows already quantized come unpadded (`takes_rows`).

Where FP8 cannot run (the CPU, CUDA below sm_89, a GPU the FP8 GEMM does not compile for): "fp8" is
refused at load with the reason, and a compressed-tensors FP8 checkpoint is dequantized to `model.dtype` (codes x
scale) with a log line. The reference runs on the CPU, which the tests use to check the numerics.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from streamd.kernels import layout, reference
from streamd.kernels.layout import FP8, FP8_MAX, Fp8Rows, product_dtype
from streamd.logs import get_logger

log = get_logger(__name__)

MIN_CAPABILITY = (8, 9)  # Ada (sm_89) and Hopper (sm_90): the GPUs with FP8 tensor cores
ALIGN = 16  # cuBLAS's FP8 GEMM: the inner dimension and the weight's output dimension multiples of 16
NEEDS = "a CUDA GPU with FP8 tensor cores (compute capability 8.9+: Ada, Hopper; sm_89+)"


def unsupported_reason(device: torch.device) -> str | None:
    """Why FP8 matmuls cannot run on `device` (None: they can)."""
    if device.type != "cuda":
        return f"model.device is {device}"
    return _cuda_reason(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_reason(index: int) -> str | None:
    major, minor = torch.cuda.get_device_capability(index)
    name = torch.cuda.get_device_name(index)
    if (major, minor) < MIN_CAPABILITY:
        return f"model.device is cuda:{index}, {name}: sm_{major}{minor}"
    try:  # one tiny matmul, eager: the FP8 GEMM and its Triton kernels run on this GPU
        from streamd import kernels

        rows = kernels.quantize_fp8(torch.ones(ALIGN, ALIGN, device=f"cuda:{index}"))
        kernels.fp8_matmul(rows, rows.codes, rows.scales, torch.bfloat16)
    except Exception as exc:  # Triton's compile errors have no common base
        return f"model.device is cuda:{index}, {name}: the FP8 matmul did not compile or run ({exc})"
    return None


def check_device(device: torch.device) -> None:
    """Refuses `model.quantization = "fp8"` where FP8 matmuls cannot run, naming the device and what is needed."""
    reason = unsupported_reason(device)
    if reason is not None:
        raise ValueError(f"model.quantization = 'fp8' needs {NEEDS}; {reason}")


@dataclass(frozen=True, slots=True)
class Fp8Weight:
    """A Linear's weight as e4m3 codes [out, in] and one float32 scale per output channel: w = codes * scales."""

    codes: torch.Tensor
    scales: torch.Tensor  # [out], float32
    input_scale: torch.Tensor | None = None  # a static per-tensor activation scale ([], float32); None: per token

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return layout.dequantize_rows(self.codes, self.scales, dtype)


def quantize_weight(weight: torch.Tensor) -> Fp8Weight:
    """Per output channel: scale = absmax / 448, codes = round(w / scale) in e4m3 (the 8-bit KV cache's row
    quantizer, `layout.quantize_rows`: a weight's rows are its output channels)."""
    return Fp8Weight(*layout.quantize_rows(weight.detach(), FP8))


def quantize_static(rows: torch.Tensor, scale: torch.Tensor) -> Fp8Rows:
    """Quantization by a checkpoint's static per-tensor scale (the same scale on every row), divided in float32 (a
    16-bit quotient would round twice)."""
    return Fp8Rows(_to_fp8(rows.float() / scale), scale.reshape(1).expand(rows.shape[0]).contiguous(), rows.dtype)


def _to_fp8(values: torch.Tensor) -> torch.Tensor:
    # torch's cast to e4m3fn does not saturate (out of range is NaN): clamp first.
    return values.float().clamp(-FP8_MAX, FP8_MAX).to(FP8)


def _ops(device: torch.device) -> ModuleType:
    """The FP8 kernels for tensors on `device`: Triton on CUDA, the plain-torch reference elsewhere."""
    if device.type == "cuda":
        from streamd import kernels

        return kernels
    return reference


class Fp8Linear(nn.Module):
    """y = (x quantized) @ (codes * scales).T + bias through `kernels.fp8_matmul`.

    `codes` (e4m3) and `scales` (float32) are buffers, so `.to(device)` moves them; never cast the module to
    another dtype (`.to(torch.bfloat16)` would turn the codes into plain numbers)."""

    def __init__(self, weight: Fp8Weight, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.codes.shape
        self.pad_in, self.pad_out = -self.in_features % ALIGN, -self.out_features % ALIGN
        codes = nn.functional.pad(weight.codes.view(torch.uint8), (0, self.pad_in, 0, self.pad_out)).view(FP8)
        scales = nn.functional.pad(weight.scales.float(), (0, self.pad_out), value=1.0)
        self.codes: torch.Tensor
        self.scales: torch.Tensor
        self.input_scale: torch.Tensor | None
        self.register_buffer("codes", codes)  # [out + pad_out, in + pad_in]
        self.register_buffer("scales", scales.reshape(1, -1).contiguous())  # [1, out + pad_out]
        scale = weight.input_scale
        self.register_buffer("input_scale", None if scale is None else scale.float().reshape(()))
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @property
    def takes_rows(self) -> bool:
        """Whether `forward` takes rows its caller quantized (dynamic scales, no padding of the inner dimension)."""
        return self.input_scale is None and not self.pad_in

    def forward(self, x: torch.Tensor | Fp8Rows) -> torch.Tensor:
        """x [..., in] float, or quantized rows [tokens, in] (`takes_rows`) -> [..., out] in the activations'
        dtype."""
        if isinstance(x, Fp8Rows):
            return self._matmul(x, x.dtype)
        rows = x.reshape(-1, self.in_features)
        if self.pad_in:
            rows = nn.functional.pad(rows, (0, self.pad_in))
        quantized = (
            _ops(x.device).quantize_fp8(rows) if self.input_scale is None else quantize_static(rows, self.input_scale)
        )
        return self._matmul(quantized, x.dtype).reshape(*x.shape[:-1], self.out_features)

    def unscaled(self, x: torch.Tensor | Fp8Rows) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]] | None:
        """(the codes' product [tokens, out] in x's dtype, its (row, channel) scales) for a kernel after this layer
        that applies the scales itself (`kernels.silu_and_mul_fp8`); None where x is not quantized rows or the output
        is more than that (a bias, a padded output) or the product is not in x's dtype (float16: `product_dtype`)."""
        if not isinstance(x, Fp8Rows) or self.bias is not None or self.pad_out or product_dtype(x.dtype) != x.dtype:
            return None
        return _ops(x.codes.device).fp8_product(x, self.codes, x.dtype), (x.scales, self.scales[0])

    def _matmul(self, x: Fp8Rows, out_dtype: torch.dtype) -> torch.Tensor:
        bias = self.bias if self.bias is None or not self.pad_out else nn.functional.pad(self.bias, (0, self.pad_out))
        out = _ops(x.codes.device).fp8_matmul(x, self.codes, self.scales[0], out_dtype, bias)
        return out[:, : self.out_features] if self.pad_out else out

    def fp8_weight(self) -> Fp8Weight:
        """The weight as held, without the padding."""
        codes = self.codes[: self.out_features, : self.in_features]
        return Fp8Weight(codes, self.scales[0, : self.out_features], self.input_scale)

    @property
    def nbytes(self) -> int:
        """The codes and scales (buffers: `weight_bytes` counts parameters, the bias among them, separately)."""
        held = self.codes.nbytes + self.scales.nbytes
        return held + (0 if self.input_scale is None else self.input_scale.nbytes)

    def extra_repr(self) -> str:
        static = ", static input scale" if self.input_scale is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3{static}"


def merge_fp8_linears(*parts: Fp8Linear) -> Fp8Linear:
    """One `Fp8Linear` whose output is the parts' side by side (the fused layer's q/k/v and gate/up): codes and
    per-channel scales concatenated, exact; dynamic activation scales only (a static one would differ per part)."""
    if any(p.input_scale is not None for p in parts):
        raise ValueError("FP8 layers with static input scales do not merge")
    weights = [p.fp8_weight() for p in parts]
    codes = torch.cat([w.codes.view(torch.uint8) for w in weights]).view(FP8)
    merged = Fp8Weight(codes, torch.cat([w.scales for w in weights]))
    if all(p.bias is None for p in parts):
        return Fp8Linear(merged, None)
    ref = next(p.bias for p in parts if p.bias is not None)
    assert ref is not None
    bias = torch.cat([p.bias if p.bias is not None else ref.new_zeros(p.out_features) for p in parts])
    return Fp8Linear(merged, bias)


def has_fp8(model: nn.Module) -> bool:
    return any(isinstance(m, Fp8Linear) for m in model.modules())


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent), attr, module)


def _kept_float(model: nn.Module) -> set[int]:
    """The Linears that stay in model.dtype: the output embeddings (the head)."""
    head = getattr(model, "get_output_embeddings", lambda: None)()
    return {id(head)} if head is not None else set()


def quantize_fp8_linears(model: nn.Module, device: torch.device) -> int:
    """Replaces every nn.Linear but the head by its `Fp8Linear` (per output channel, quantized on `device`, where it
    then lives); returns how many. A model already holding FP8 layers (a checkpoint stored FP8) keeps the
    checkpoint's choice of layers: nothing is quantized."""
    if has_fp8(model):
        return 0
    kept = _kept_float(model)
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear) and id(m) not in kept]
    for name, linear in linears:
        bias = None if linear.bias is None else linear.bias.detach().to(device)
        _replace(model, name, Fp8Linear(quantize_weight(linear.weight.detach().to(device)), bias))
    return len(linears)


# --- compressed-tensors checkpoints -------------------------------------------------------------------------------

COMPRESSED_TENSORS = "compressed-tensors"
_FORMATS = ("float-quantized", "naive-quantized")  # e4m3 values stored as such
_WEIGHT_STRATEGIES = ("channel", "tensor")
_INPUT_STRATEGIES = ("token", "tensor")


def is_compressed_tensors(raw: dict[str, Any]) -> bool:
    """Whether a checkpoint's `config.json` names a compressed-tensors quantization."""
    return (raw.get("quantization_config") or {}).get("quant_method") == COMPRESSED_TENSORS


def check_compressed_fp8(raw: dict[str, Any]) -> None:
    """Refuses a compressed-tensors scheme other than FP8 weights per channel or per tensor (int8, int4, NVFP4,
    block-wise FP8), naming what it has; streamd reads FP8 ones without the compressed-tensors package."""
    config = raw["quantization_config"]
    groups = config.get("config_groups") or {}
    if not groups:
        raise ValueError("this compressed-tensors checkpoint names no config_groups: streamd reads FP8 ones only")
    for name, group in groups.items():
        problem = _group_problem(group, group.get("format") or config.get("format"))
        if problem is not None:
            raise ValueError(
                f"compressed-tensors group {name!r}: {problem}; streamd reads FP8 checkpoints only (8-bit float "
                f"weights, strategy {' or '.join(_WEIGHT_STRATEGIES)}; activations per token or per tensor)"
            )


def _group_problem(group: dict[str, Any], fmt: str | None) -> str | None:
    weights = group.get("weights") or {}
    if fmt is not None and fmt not in _FORMATS:
        return f"format {fmt!r}"
    if (weights.get("num_bits"), weights.get("type")) != (8, "float"):
        return f"weights of {weights.get('num_bits')} bits, type {weights.get('type')!r}"
    if weights.get("strategy") not in _WEIGHT_STRATEGIES:
        return f"weight strategy {weights.get('strategy')!r}"
    inputs = group.get("input_activations")
    if inputs is not None and inputs.get("strategy") not in _INPUT_STRATEGIES:
        return f"input activation strategy {inputs.get('strategy')!r}"
    return None


class CheckpointTensors(Mapping[str, torch.Tensor]):
    """A safetensors checkpoint's tensors by name, each read from its file when asked for (as stored: e4m3 stays
    e4m3), so at most one layer's tensors are held at a time beyond what the caller keeps."""

    def __init__(self, directory: Path) -> None:
        index = directory / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self._files = {name: directory / file for name, file in weight_map.items()}
        else:
            self._files = {name: path for path in sorted(directory.glob("*.safetensors")) for name in _keys(path)}

    def __getitem__(self, name: str) -> torch.Tensor:
        with safe_open(str(self._files[name]), framework="pt") as handle:
            tensor: torch.Tensor = handle.get_tensor(name)
            return tensor

    def __contains__(self, name: object) -> bool:  # Mapping's would read the tensor
        return name in self._files

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)


def _keys(path: Path) -> list[str]:
    with safe_open(str(path), framework="pt") as handle:
        return list(handle.keys())


def stored_weight(tensors: Mapping[str, torch.Tensor], name: str) -> Fp8Weight | None:
    """The FP8 weight of Linear `name` as the checkpoint stores it (None: that layer is not FP8): codes, the weight
    scale ([out, 1] per channel; [1] or [] per tensor, broadcast to every channel), a static input scale if any."""
    if f"{name}.weight_scale" not in tensors:
        return None
    codes = tensors[f"{name}.weight"]
    if codes.dtype != FP8:
        raise ValueError(f"{name}.weight is {codes.dtype}, not {FP8}: not an FP8 checkpoint as streamd reads them")
    scale = tensors[f"{name}.weight_scale"].float().reshape(-1)
    scales = scale.expand(codes.shape[0]).contiguous() if scale.numel() == 1 else scale
    input_scale = tensors.get(f"{name}.input_scale")
    return Fp8Weight(codes, scales, None if input_scale is None else input_scale.float().reshape(()))


def load_fp8_linears(model: nn.Module, tensors: Mapping[str, torch.Tensor], runnable: bool) -> int:
    """Gives every nn.Linear of `model` that `tensors` stores as FP8 its stored weight; returns how many. `runnable`:
    as an `Fp8Linear` of the codes and scales as stored; otherwise dequantized into the Linear (codes x scale, in
    the Linear's dtype), for where FP8 matmuls cannot run."""
    count = 0
    for name, linear in [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]:
        weight = stored_weight(tensors, name)
        if weight is None:
            continue
        if tuple(weight.codes.shape) != tuple(linear.weight.shape):
            raise ValueError(
                f"{name}.weight is {tuple(weight.codes.shape)} in the checkpoint, the model's is "
                f"{tuple(linear.weight.shape)}"
            )
        if runnable:
            _replace(model, name, Fp8Linear(weight, None if linear.bias is None else linear.bias.detach()))
        else:
            with torch.no_grad():
                linear.weight.copy_(weight.dequantize(linear.weight.dtype))
        count += 1
    return count
