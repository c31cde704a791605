"""Fused decoder layers for the Llama family (Llama, Mistral, Qwen2, Qwen3; SmolLM2 is a Llama): `fuse_layers`.

Called once after loading, it replaces the causal LM's base model by a `FusedDecoder` that keeps the
embedding, the rotary tables and the final norm, and runs every layer as

    residual add + RMSNorm -> one QKV GEMM -> rotary + KV store -> paged attention -> output projection
    -> residual add + RMSNorm -> one gate/up GEMM -> SiLU-and-mul -> down projection

Q, K and V (and gate and up) are merged into one Linear at load, halving the GEMM launches. The residual
travels beside the hidden state (each layer returns both) so that every residual add sits in the norm
kernel after it; the last one goes into the final norm. Output and down projections stay the modules the
loader made. Modes (`model.fuse_layers`):

- ``off``: the model as transformers built it; nothing here runs.
- ``triton``: `streamd.kernels` (compiled on CUDA; Triton's interpreter on CPU tensors, for tests).
- ``reference``: the same rewiring on the torch references (transformers' arithmetic; CPU tests).
- ``cpu``: the same rewiring in the fewest torch operators a layer (`CpuPath`), transformers' arithmetic. On
  the CPU a one-stream decode step is bound by operator calls, not by the weights (benchmarks/NOTES.md, "Issue
  25, one stream").
- ``compile``: the same rewiring, with the two stretches between attention calls (norm, QKV, q/k norm and
  rotary; norm, gate/up, SiLU-and-mul) as `torch.compile`d functions of the references. Inductor fuses
  their elementwise work; it uses no CUDA graphs of its own, so the engine's decode graphs capture it.
  K/V are stored and attended by the engine's kernels.
- ``native``: ``cpu``, with its decode steps, speculative verifies and short prompt chunks run by
  `native_decode.NativeDecode` (the work between the matmuls in C, `kernels/native_cpu`): weight-only low-bit
  layers in bfloat16, float32 norms, no per-head q/k norms, and a C compiler at hand (or the library prebuilt).
- ``auto``: ``triton`` on CUDA for a supported architecture; on the CPU for a supported architecture whose
  weights are low-bit (the default model) ``native``, or ``cpu`` where `native` cannot run (the reason is
  logged); otherwise ``off``.

Low-bit weights (`quantized.QuantizedLinear`) merge too: q/k/v (gate/up) become one layer of concatenated rows,
each output row computed as its own layer computed it (`lowbit.concat_rows`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol, TypeVar, cast

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPast

from streamd.config import FUSE_MODES
from streamd.engine.worker import native_decode
from streamd.engine.worker.attention import AttentionMetadata, get_attention_metadata, paged_attend, store_kv
from streamd.engine.worker.families import attention_needs
from streamd.engine.worker.fp8 import Fp8Linear, has_fp8, merge_fp8_linears
from streamd.engine.worker.quantized import (
    QuantizedEmbedding,
    QuantizedLinear,
    W8A8Linear,
    merge_quantized,
    merge_reason,
)
from streamd.kernels import reference
from streamd.kernels.layout import Fp8Rows
from streamd.logs import get_logger

log = get_logger(__name__)

Normed = TypeVar("Normed", torch.Tensor, Fp8Rows)  # a norm's output: float rows, or e4m3 rows for an FP8 projection

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


# The parts of transformers' Llama-style modules that the fused layer reads (nn.Module's attribute access is
# untyped): checked at load by `unsupported_reason`, read here through these shapes.
class RMSNormModule(Protocol):
    weight: nn.Parameter
    variance_epsilon: float


class AttentionModule(Protocol):
    layer_idx: int
    scaling: float
    head_dim: int
    q_proj: nn.Linear
    k_proj: nn.Linear
    v_proj: nn.Linear
    o_proj: nn.Linear


class MLPModule(Protocol):
    gate_proj: nn.Linear
    up_proj: nn.Linear
    down_proj: nn.Linear


class DecoderLayerModule(Protocol):
    self_attn: AttentionModule
    mlp: MLPModule
    input_layernorm: RMSNormModule
    post_attention_layernorm: RMSNormModule


class DecoderModule(Protocol):
    """The causal LM's base model (`model.model`): embedding, layers, final norm, rotary tables."""

    config: PretrainedConfig
    embed_tokens: nn.Embedding
    layers: nn.ModuleList
    norm: RMSNormModule
    rotary_emb: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def fuse_layers(model: PreTrainedModel, mode: str, device: torch.device, compile_backend: str = "inductor") -> str:
    """Rewires `model` in place for `mode`; returns the mode applied ("off": untouched).

    `compile_backend` is torch.compile's backend in mode "compile" (tests pass a cheaper one)."""
    applied = resolve_mode(mode, model, device)
    if applied == "off":
        return applied
    if applied == "compile":
        path: LayerPath = CompiledPath(compile_backend)
    elif applied in ("cpu", "native"):
        path = CpuPath()
    else:
        path = KernelPath(_kernels(applied))
    prefix = model.base_model_prefix
    fused = FusedDecoder(getattr(model, prefix), path)
    if applied == "native":
        applied = _attach_native(fused, explicit=mode == "native")
    setattr(model, prefix, fused)
    log.info("model.layers_fused", mode=applied, layers=len(fused.layers))
    return applied


@dataclass(frozen=True, slots=True)
class NativeLogits:
    """A causal LM's decode steps on the native path with transformers' wrappers skipped: the fused decoder's
    `native_hidden`, then `head` over the rows that sample."""

    decoder: FusedDecoder
    head: nn.Module

    def __call__(
        self, md: AttentionMetadata, input_ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor
    ) -> torch.Tensor | None:
        """float32 logits of the `keep` rows (None: the native path does not take this step)."""
        hidden = self.decoder.native_hidden(md, input_ids, positions)
        return None if hidden is None else self.head(hidden[keep]).float()


def native_logits(model: PreTrainedModel) -> NativeLogits | None:
    """`model`'s decode steps without transformers' wrappers, where that computes what its forward does (None:
    it does not): the decoder runs natively, and the causal LM (one of `SUPPORTED_MODEL_TYPES`, text only) takes
    its logits as `lm_head` over the decoder's output and nothing else (no scaling, no soft-capping)."""
    decoder = getattr(model, model.base_model_prefix, None)
    head = getattr(model, "lm_head", None)
    if not isinstance(decoder, FusedDecoder) or decoder.native is None or not isinstance(head, nn.Module):
        return None
    return NativeLogits(decoder, head) if model.config.model_type in SUPPORTED_MODEL_TYPES else None


def resolve_mode(mode: str, model: PreTrainedModel, device: torch.device) -> str:
    """The mode `fuse_layers` applies; a mode that names a fused path on an unsupported model is an error."""
    if mode not in FUSE_MODES:
        raise ValueError(f"model.fuse_layers must be one of {', '.join(FUSE_MODES)}, got {mode!r}")
    reason = unsupported_reason(model)
    if reason is None and mode == "compile" and has_fp8(model):
        reason = (
            "its FP8 layers run through cuBLAS's FP8 GEMM and Triton kernels, which the compiled stretch does not take"
        )
    if reason is None and mode == "compile" and _low_bit(model):
        reason = "its low-bit layers run through torch's packed kernels, which the compiled stretch does not take"
    if mode == "auto":
        return _auto_mode(model, device) if reason is None else "off"
    if mode != "off" and reason is not None:
        raise ValueError(f"model.fuse_layers = {mode!r}: {reason}")
    return mode


def _auto_mode(model: PreTrainedModel, device: torch.device) -> str:
    if device.type == "cuda":
        return "triton"
    return "native" if device.type == "cpu" and _low_bit(model) else "off"


def _attach_native(fused: FusedDecoder, explicit: bool) -> str:
    """`fused` runs its decode steps natively ("native"), or, where it cannot, with torch operators ("cpu"; an
    explicit `native` is then an error)."""
    reason = native_decode.unsupported_reason(fused)
    if reason is None:
        fused.native = native_decode.NativeDecode(fused)
        return "native"
    if explicit:
        raise ValueError(f"model.fuse_layers = 'native': {reason}")
    log.info("model.native_decode_off", reason=reason)
    return "cpu"


def _low_bit(model: nn.Module) -> bool:
    return any(isinstance(m, (QuantizedLinear, W8A8Linear)) for m in model.modules())


def unsupported_reason(model: PreTrainedModel) -> str | None:
    """Why the fused layer cannot run this model (None: it can)."""
    config = model.config.get_text_config()
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        return f"model type {config.model_type!r} is not one of {', '.join(SUPPORTED_MODEL_TYPES)}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r} is not silu"
    needs = attention_needs(model).features()  # Mistral 7B v0.1's window too, which no `layer_types` names
    if needs:
        return f"the fused layer attends without {', '.join(needs)}"
    base = getattr(model, model.base_model_prefix, None)
    if not all(hasattr(base, part) for part in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return f"{type(base).__name__} is not a Llama-style decoder"
    low_bit = _low_bit_reason(cast(DecoderModule, base))
    if low_bit is not None:
        return low_bit
    if any(isinstance(m, Fp8Linear) and m.input_scale is not None for m in model.modules()):
        return "an FP8 layer has a static input scale: merged projections would share one"
    return None


def _low_bit_reason(base: DecoderModule) -> str | None:
    """Why the layers' low-bit siblings (q/k/v, gate/up) cannot be merged into one layer each (None: they can,
    or none is low-bit)."""
    for layer in cast(list[DecoderLayerModule], list(base.layers)):
        attn, mlp = layer.self_attn, layer.mlp
        for group in ((attn.q_proj, attn.k_proj, attn.v_proj), (mlp.gate_proj, mlp.up_proj)):
            if any(isinstance(m, (QuantizedLinear, W8A8Linear)) for m in group):
                reason = merge_reason(group)
                if reason is not None:
                    return reason
    return None


def _kernels(mode: str) -> ModuleType:
    if mode == "triton":
        from streamd import kernels

        return kernels
    return reference


def merge_linears(*parts: nn.Module) -> nn.Module:
    """One Linear whose output is the parts' outputs side by side (missing biases are zeros); FP8 parts (dynamic
    activation scales, one weight scale per output channel) merge exactly into one `Fp8Linear`, low-bit parts
    into one `QuantizedLinear`."""
    if all(isinstance(p, Fp8Linear) for p in parts):
        return merge_fp8_linears(*cast(tuple[Fp8Linear, ...], parts))
    if all(isinstance(p, QuantizedLinear) for p in parts):
        return merge_quantized(cast(tuple[QuantizedLinear, ...], parts))
    linears = cast(tuple[nn.Linear, ...], parts)
    weight = torch.cat([p.weight for p in linears])
    bias = None
    if any(p.bias is not None for p in parts):
        bias = torch.cat([p.bias if p.bias is not None else weight.new_zeros(p.weight.shape[0]) for p in linears])
    merged = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    merged.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        merged.bias = nn.Parameter(bias, requires_grad=False)
    return merged


def split_qkv(qkv: torch.Tensor, sizes: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[tokens, q + 2 kv] -> q [tokens, heads, head_dim], k and v [tokens, kv_heads, head_dim] (views);
    sizes = (q, kv, head_dim)."""
    q_size, kv_size, head_dim = sizes
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    return q.unflatten(-1, (-1, head_dim)), k.unflatten(-1, (-1, head_dim)), v.unflatten(-1, (-1, head_dim))


class FusedLayer(nn.Module):
    """One decoder layer's weights, merged; `forward` is (hidden, residual) -> (hidden, residual)."""

    def __init__(self, layer: nn.Module, path: LayerPath) -> None:
        super().__init__()
        parts = cast(DecoderLayerModule, layer)
        attn, mlp = parts.self_attn, parts.mlp
        self.layer_idx: int = attn.layer_idx
        self.scale: float = attn.scaling
        # (q, kv, head_dim) widths; from the weights, not the config: a tensor-parallel shard holds only its heads.
        self.qkv_sizes: tuple[int, int, int] = (attn.q_proj.out_features, attn.k_proj.out_features, attn.head_dim)
        self.qkv_proj = merge_linears(attn.q_proj, attn.k_proj, attn.v_proj)
        self.o_proj = attn.o_proj
        self.gate_up_proj = merge_linears(mlp.gate_proj, mlp.up_proj)
        self.down_proj = mlp.down_proj
        self.input_layernorm = parts.input_layernorm
        self.post_attention_layernorm = parts.post_attention_layernorm
        self.q_norm: RMSNormModule | None = getattr(attn, "q_norm", None)
        self.k_norm: RMSNormModule | None = getattr(attn, "k_norm", None)
        self.path = path

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v, residual = self.path.qkv(self, hidden, residual, cos, sin)
        attn = self.path.attend(self, q, k, v, cos, sin)
        act, residual = self.path.mlp_in(self, self.o_proj(attn.flatten(1)), residual)
        return self.down_proj(act), residual


class LayerPath(Protocol):
    """How a `FusedLayer`'s stretches between its projections run (kernels, or compiled torch)."""

    def qkv(
        self,
        layer: FusedLayer,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]: ...

    def attend(
        self, layer: FusedLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor: ...

    def mlp_in(
        self, layer: FusedLayer, hidden: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor | Fp8Rows, torch.Tensor]: ...

    def final_norm(self, hidden: torch.Tensor, residual: torch.Tensor, norm: RMSNormModule) -> torch.Tensor: ...


def _norm_in(
    alone: Callable[[torch.Tensor, torch.Tensor, float], Normed],
    added: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[Normed, torch.Tensor]],
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
) -> tuple[Normed, torch.Tensor]:
    """A layer's norm before a projection (`alone`), with the residual add before it (`added`): the first layer's
    first norm has no residual yet (its input is the residual)."""
    if residual is None:
        return alone(hidden, weight, eps), hidden
    return added(hidden, residual, weight, eps)


def _activation(kernels: Any, layer: FusedLayer, x: torch.Tensor | Fp8Rows) -> torch.Tensor | Fp8Rows:
    """SiLU-and-mul of x's gate/up projection; quantized for an FP8 down projection that takes rows, and then an FP8
    gate/up hands over its codes' product unscaled (`Fp8Linear.unscaled`) for the SiLU-and-mul to scale on the way
    (no pass over the product of its own)."""
    gate_up = layer.gate_up_proj
    if not _takes_rows(layer.down_proj):
        return kernels.silu_and_mul(gate_up(x))
    unscaled = gate_up.unscaled(x) if isinstance(gate_up, Fp8Linear) else None
    if unscaled is None:
        return kernels.silu_and_mul_fp8(gate_up(x))
    product, scales = unscaled
    return kernels.silu_and_mul_fp8(product, scales=scales)


def _takes_rows(linear: nn.Module) -> bool:
    """Whether `linear` is an FP8 layer that takes quantized rows, so the kernel before it writes them."""
    return isinstance(linear, Fp8Linear) and linear.takes_rows


def _qk_norm_weights(layer: FusedLayer) -> tuple[torch.Tensor | None, torch.Tensor | None, float]:
    if layer.q_norm is None or layer.k_norm is None:
        return None, None, 1e-6
    return layer.q_norm.weight, layer.k_norm.weight, layer.q_norm.variance_epsilon


class KernelPath:
    """Every stretch through one kernels module: `streamd.kernels` (Triton) or its references."""

    def __init__(self, kernels: ModuleType) -> None:
        self.kernels = kernels

    def qkv(
        self,
        layer: FusedLayer,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        norm = layer.input_layernorm
        alone, added = self._norms(layer.qkv_proj)
        x, residual = _norm_in(alone, added, hidden, residual, norm.weight, norm.variance_epsilon)
        return (*split_qkv(layer.qkv_proj(x), layer.qkv_sizes), residual)

    def _norms(self, projection: nn.Module) -> tuple[Any, Any]:
        """The norm and add+norm kernels before `projection`: writing e4m3 rows where it is FP8 and takes them."""
        k = self.kernels
        return (k.rmsnorm_fp8, k.fused_add_rmsnorm_fp8) if _takes_rows(projection) else (k.rmsnorm, k.fused_add_rmsnorm)

    def attend(
        self, layer: FusedLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        md = get_attention_metadata()
        q_norm, k_norm, eps = _qk_norm_weights(layer)
        q = self.kernels.rotary_store_kv(
            q,
            k,
            v,
            cos,
            sin,
            md.kv_cache,
            layer.layer_idx,
            md.slot_mapping,
            q_norm,
            k_norm,
            eps,
            kv_scales=md.kv_scales,
        )
        return paged_attend(md, q, layer.layer_idx, layer.scale, None, None)  # the rotated key stayed on chip

    def mlp_in(
        self, layer: FusedLayer, hidden: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor | Fp8Rows, torch.Tensor]:
        norm = layer.post_attention_layernorm
        x, residual = self._norms(layer.gate_up_proj)[1](hidden, residual, norm.weight, norm.variance_epsilon)
        return _activation(self.kernels, layer, x), residual

    def final_norm(self, hidden: torch.Tensor, residual: torch.Tensor, norm: RMSNormModule) -> torch.Tensor:
        return self.kernels.fused_add_rmsnorm(hidden, residual, norm.weight, norm.variance_epsilon)[0]


def _qkv_stretch(
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    qkv_weight: torch.Tensor,
    qkv_bias: torch.Tensor | None,
    sizes: tuple[int, int, int],
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    qk_eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Norm, QKV projection, q/k norm and rotary in plain torch (what `CompiledPath` compiles)."""
    x, residual = _norm_in(reference.rmsnorm, reference.fused_add_rmsnorm, hidden, residual, norm_weight, eps)
    q, k, v = split_qkv(F.linear(x, qkv_weight, qkv_bias), sizes)
    q, k = reference.rotary(q, k, cos, sin, q_norm, k_norm, qk_eps)
    return q, k, v, residual


def _mlp_stretch(
    hidden: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    gate_up_weight: torch.Tensor,
    gate_up_bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    x, residual = reference.fused_add_rmsnorm(hidden, residual, norm_weight, eps)
    return reference.silu_and_mul(F.linear(x, gate_up_weight, gate_up_bias)), residual


class CompiledPath:
    """The stretches between attention calls as torch.compile'd reference code, shared by all layers.

    They are functions of tensors (weights included) and of sizes equal in every layer, so one compiled
    graph serves every layer (no per-layer recompiles). Shapes are dynamic after the first new size."""

    def __init__(self, backend: str = "inductor") -> None:
        # Dynamo keeps its compiled variants per code object, and every layer shares these: (first layer
        # without a residual, the others with one) x (first size static, then dynamic, size 1 specialised)
        # and a few shape relations exceed the default limit of 8, after which it would run them eagerly.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)

        def compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
            return torch.compile(fn, backend=backend, fullgraph=True, dynamic=None)

        self._qkv = compiled(_qkv_stretch)
        self._mlp = compiled(_mlp_stretch)
        self._final = compiled(reference.fused_add_rmsnorm)

    def qkv(
        self,
        layer: FusedLayer,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        norm = layer.input_layernorm
        q_norm, k_norm, qk_eps = _qk_norm_weights(layer)
        return self._qkv(
            hidden,
            residual,
            norm.weight,
            norm.variance_epsilon,
            layer.qkv_proj.weight,
            layer.qkv_proj.bias,
            layer.qkv_sizes,
            q_norm,
            k_norm,
            qk_eps,
            cos,
            sin,
        )

    def attend(
        self, layer: FusedLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        md = get_attention_metadata()  # q and k come rotated from the compiled stretch
        md.ops.store_kv(k, v, md.kv_cache, layer.layer_idx, md.slot_mapping, kv_scales=md.kv_scales)
        return paged_attend(md, q, layer.layer_idx, layer.scale, k, v)

    def mlp_in(
        self, layer: FusedLayer, hidden: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        norm, gate_up = layer.post_attention_layernorm, layer.gate_up_proj
        return self._mlp(hidden, residual, norm.weight, norm.variance_epsilon, gate_up.weight, gate_up.bias)

    def final_norm(self, hidden: torch.Tensor, residual: torch.Tensor, norm: RMSNormModule) -> torch.Tensor:
        return self._final(hidden, residual, norm.weight, norm.variance_epsilon)[0]


class CpuPath(KernelPath):
    """The references' path (`KernelPath` over `reference`) in the fewest torch operators, for the CPU (where a
    decode step pays per operator call): q and k rotated as one tensor (they sit side by side in the QKV output),
    K/V stored and attended through the step's plan (`attention.store_kv`, `paged_attend`: the index arithmetic
    done once for all layers) instead of the reference `rotary_store_kv` (the Triton kernel's spec: argument
    checks, q and k apart, an unplanned store). The norms and SiLU are the references'."""

    def __init__(self) -> None:
        super().__init__(reference)

    def qkv(
        self,
        layer: FusedLayer,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        norm = layer.input_layernorm
        x, residual = _norm_in(
            reference.rmsnorm, reference.fused_add_rmsnorm, hidden, residual, norm.weight, norm.variance_epsilon
        )
        qkv = layer.qkv_proj(x)
        if layer.q_norm is not None:  # Qwen3: each head normalised before its rotation
            q, k, v = split_qkv(qkv, layer.qkv_sizes)
            q, k = reference.rotary(q, k, cos, sin, *_qk_norm_weights(layer))
            return q, k, v, residual
        q_size, kv_size, head_dim = layer.qkv_sizes
        qk = reference.rotate(qkv[:, : q_size + kv_size].unflatten(-1, (-1, head_dim)), cos, sin)
        heads = q_size // head_dim
        return qk[:, :heads], qk[:, heads:], qkv[:, q_size + kv_size :].unflatten(-1, (-1, head_dim)), residual

    def attend(
        self, layer: FusedLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        md = get_attention_metadata()
        store_kv(md, k, v, layer.layer_idx)
        return paged_attend(md, q, layer.layer_idx, layer.scale, k, v)


# Rotary kinds whose tables depend on the position alone (not on the longest position of the batch, as "dynamic"
# and "longrope" scaling do), so that rows computed once serve every later step.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class RotaryTable:
    """cos/sin rows [tokens, head_dim] of a decoder's rotary module for the positions asked, from a table the module
    computed once for positions [0, size), grown by doubling: a decode step indexes two rows instead of running
    the module (~0.1 ms on the CPU). Each row is the module's own output for that position (a product per position,
    then elementwise functions: tested bit for bit); a module of another rope type is called each time."""

    def __init__(self, rotary: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.rotary = rotary
        self.static = getattr(rotary, "rope_type", "default") in STATIC_ROPE_TYPES
        self.cos: torch.Tensor | None = None
        self.sin: torch.Tensor | None = None

    def __call__(self, hidden: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [tokens, dim] (its dtype and device), positions [tokens] -> (cos, sin)."""
        if not self.static:
            cos, sin = self.rotary(hidden[None], positions[None])
            return cos[0], sin[0]
        last = int(positions.max())
        if not self._covers(hidden, last):
            self._grow(hidden, last + 1)
        assert self.cos is not None and self.sin is not None
        return self.cos[positions], self.sin[positions]

    def _covers(self, hidden: torch.Tensor, position: int) -> bool:
        table = self.cos
        return (
            table is not None and (table.dtype, table.device) == (hidden.dtype, hidden.device) and position < len(table)
        )

    def _grow(self, hidden: torch.Tensor, needed: int) -> None:
        size = max(needed, 2 * (len(self.cos) if self.cos is not None else 512))
        every = torch.arange(size, device=hidden.device)[None]
        cos, sin = self.rotary(hidden.new_empty(1, 1, 1), every)  # (the module reads its input's dtype and device)
        self.cos, self.sin = cos[0], sin[0]


class FusedDecoder(nn.Module):
    """Stands in for the causal LM's base model (`model.model`) over streamd's flattened batch [1, tokens]."""

    def __init__(self, base: nn.Module, path: LayerPath) -> None:
        super().__init__()
        parts = cast(DecoderModule, base)
        self.config = parts.config
        self.embed_tokens = parts.embed_tokens
        self.rotary_emb = parts.rotary_emb
        self.norm = parts.norm
        self.layers = nn.ModuleList(FusedLayer(layer, path) for layer in parts.layers)
        self.path = path
        self.native: native_decode.NativeDecode | None = None  # mode "native": its decode steps (`_attach_native`)
        self.rotary_rows = RotaryTable(self.rotary_emb)  # the native steps' cos/sin, rows of a table

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        **_: Any,
    ) -> BaseModelOutputWithPast:
        """The arguments the causal LM passes; attention masks and KV caches of transformers' own are unused."""
        if (input_ids is None) == (inputs_embeds is None) or position_ids is None:
            raise ValueError("the fused decoder takes input_ids or inputs_embeds, and position_ids")
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if hidden.shape[0] != 1:
            raise ValueError(f"the fused decoder runs one flattened batch [1, tokens], got {tuple(hidden.shape[:2])}")
        if self.native is not None and self.native.takes(md := get_attention_metadata(), hidden.shape[1], hidden.dtype):
            return BaseModelOutputWithPast(last_hidden_state=self._run_native(md, hidden[0], position_ids[0])[None])
        cos, sin = self.rotary_emb(hidden, position_ids)
        hidden, cos, sin = hidden[0], cos[0], sin[0]
        residual: torch.Tensor | None = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, cos, sin)
        assert residual is not None, "a decoder has at least one layer"
        return BaseModelOutputWithPast(last_hidden_state=self.path.final_norm(hidden, residual, self.norm)[None])

    def native_hidden(
        self, md: AttentionMetadata, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor | None:
        """The final norm's output [tokens, dim] of a step the native path takes (None: it does not take it),
        from the flattened batch's token ids and positions, without transformers' model wrappers around it: what
        `NativeLogits` runs."""
        if self.native is None or not self.native.takes(md, input_ids.shape[0], self.embedding_dtype):
            return None
        return self._run_native(md, self.embed_tokens(input_ids), positions)

    def _run_native(self, md: AttentionMetadata, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """hidden [tokens, dim] (the embeddings) -> the final norm's output, on `NativeDecode` (it takes the step)."""
        assert self.native is not None
        cos, sin = self.rotary_rows(hidden, positions)
        return self.native.run(md, hidden, cos, sin)

    @property
    def embedding_dtype(self) -> torch.dtype:
        table = self.embed_tokens
        return table.dtype if isinstance(table, QuantizedEmbedding) else table.weight.dtype
