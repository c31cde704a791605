"""Model families: what a loaded model asks of streamd, read off transformers' modules and checked once at load.

streamd runs transformers' own modules for everything but attention, so a family's embedding scale (Gemma),
RMSNorm on 1 + w (Gemma), rotary tables per layer type (Gemma 3's local base), YaRN (gpt-oss), mixture-of-experts
routing (gpt-oss, Mixtral, Qwen3-MoE) and the head's logit soft cap (Gemma 2; every logit streamd samples comes
out of the causal LM's own forward) are transformers' arithmetic, not a copy of it. What it replaces is the
attention: `attention.py` stores K/V into the paged pool (one slot per `layer_idx`, `num_hidden_layers` of them)
and attends causally over it. So a model runs if

- every one of its layers is an attention layer owning its slot of the pool: a recurrent, state-space or
  linear-attention layer keeps state between steps that the pool does not hold (streamd calls the model with
  `use_cache=False` every step), so Mamba, Jamba, Qwen3-Next or LFM2 would silently forget it;
- its attention is causal (an embedding model's bidirectional attention is not what the kernels compute), with
  keys and values of one head width (not DeepSeek's multi-head latent attention, whose pool would differ);
- what its attention layers ask beyond plain causal attention (`AttentionNeeds`: a sliding window per layer,
  a soft cap on the scores, learned sinks) is in `ATTENTION_FEATURES`, what streamd's attention computes.

`check_runnable` refuses anything else at load, with the reason, before a KV pool is sized or a
tensor-parallel worker is started: never a failure at the first forward, and never a different result.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

SLIDING_WINDOW = "sliding windows"
SOFT_CAP = "attention logit soft-capping"
SINKS = "attention sinks"
# What streamd's paged attention computes beyond causal attention over the whole context: each layer's
# extras reach the kernels (`attention.LayerExtras`, `kernels/attention_extras.py`).
ATTENTION_FEATURES: frozenset[str] = frozenset({SLIDING_WINDOW, SOFT_CAP, SINKS})
# Layer types (`config.layer_types`) whose state is the KV cache alone.
ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})


@dataclass(frozen=True, slots=True)
class AttentionNeeds:
    """What a model's attention layers ask of the attention beyond causal attention over the whole context."""

    windows: tuple[int | None, ...]  # per layer (by layer_idx): its sliding window, None where it sees everything
    softcap: float | None  # the scores' soft cap (Gemma 2: `attn_logit_softcapping`)
    sinks: bool  # learned per-head sinks in the softmax's denominator (gpt-oss)

    def features(self) -> dict[str, str]:
        """The features needed, each with what asks for it (for messages)."""
        needed: dict[str, str] = {}
        windowed = sorted({w for w in self.windows if w is not None})
        if windowed:
            layers = sum(w is not None for w in self.windows)
            needed[SLIDING_WINDOW] = f"{layers} of {len(self.windows)} layers, window {', '.join(map(str, windowed))}"
        if self.softcap is not None:
            needed[SOFT_CAP] = f"attn_logit_softcapping {self.softcap}"
        if self.sinks:
            needed[SINKS] = "a learned sink per head"
        return needed


def attention_layers(model: PreTrainedModel) -> list[nn.Module]:
    """The text decoder's attention modules, in layer order: transformers' attention classes know their
    `layer_idx` (a vision tower's do not count: streamd serves text)."""
    decoder = model.get_decoder()
    found = [
        module
        for module in decoder.modules()
        if isinstance(getattr(module, "layer_idx", None), int) and type(module).__name__.endswith("Attention")
    ]
    return sorted(found, key=_layer_idx)


def attention_needs(model: PreTrainedModel) -> AttentionNeeds:
    """Read off the attention modules: each layer's window (its own `sliding_window`, or the config's for
    families whose layers read it from there: Mistral, Mixtral, Phi-3, Starcoder2), the soft cap, sinks."""
    config = model.config.get_text_config()
    layers = attention_layers(model)
    return AttentionNeeds(
        windows=tuple(_window(layer, config) for layer in layers),
        softcap=_softcap(layers, config),
        sinks=any(getattr(layer, "sinks", None) is not None for layer in layers),
    )


def refusal(model: PreTrainedModel) -> str | None:
    """Why streamd cannot run `model` (None: it can)."""
    config = model.config.get_text_config()
    return (
        _stateful_layers(model, config)
        or _bidirectional(model, config)
        or _latent_attention(config)
        or _missing_features(model)
    )


def check_runnable(model: PreTrainedModel) -> None:
    """Raises ValueError naming the reason when streamd cannot run `model`."""
    reason = refusal(model)
    if reason is not None:
        raise ValueError(f"streamd cannot run this {model.config.model_type} model: {reason}")


def _layer_idx(module: nn.Module) -> int:
    idx = getattr(module, "layer_idx", None)
    assert isinstance(idx, int)
    return idx


def _window(layer: nn.Module, config: PretrainedConfig) -> int | None:
    source = layer if hasattr(layer, "sliding_window") else config
    window = getattr(source, "sliding_window", None)
    if not getattr(layer, "is_sliding", True):  # Cohere2-style layers keep the window and a flag
        return None
    return int(window) if window else None


def _softcap(layers: list[nn.Module], config: PretrainedConfig) -> float | None:
    caps = [getattr(source, "attn_logit_softcapping", None) for source in (*layers, config)]
    return next((float(cap) for cap in caps if cap is not None), None)


def _stateful_layers(model: PreTrainedModel, config: PretrainedConfig) -> str | None:
    other = sorted(set(getattr(config, "layer_types", None) or ()) - ATTENTION_LAYER_TYPES)
    if other:
        return (
            f"its layer types {other} keep state between steps outside the KV cache (recurrent, "
            "state-space, linear or chunked attention); streamd's paged KV cache holds attention keys and values only"
        )
    owned = [_layer_idx(layer) for layer in attention_layers(model)]
    if owned != list(range(config.num_hidden_layers)):
        return (
            f"it has {len(owned)} attention layers for {config.num_hidden_layers} layers; streamd's paged KV cache "
            "holds one attention layer's keys and values per layer, not the state of recurrent, state-space or "
            "cross-attention layers"
        )
    return None


def _bidirectional(model: PreTrainedModel, config: PretrainedConfig) -> str | None:
    if getattr(config, "use_bidirectional_attention", False) or not all(
        getattr(layer, "is_causal", True) for layer in attention_layers(model)
    ):
        return "its attention is bidirectional (an embedding model); streamd generates with causal attention"
    return None


def _latent_attention(config: PretrainedConfig) -> str | None:
    if getattr(config, "kv_lora_rank", None):
        return (
            "its attention is multi-head latent attention (DeepSeek V2/V3, Kimi K2: keys and values of different "
            "widths, cached compressed); streamd's KV pool holds keys and values of one head width"
        )
    return None


def _missing_features(model: PreTrainedModel) -> str | None:
    missing = {k: v for k, v in attention_needs(model).features().items() if k not in ATTENTION_FEATURES}
    if not missing:
        return None
    listed = "; ".join(f"{feature} ({why})" for feature, why in missing.items())
    return f"its attention needs {listed}, which streamd's paged attention does not compute yet"
