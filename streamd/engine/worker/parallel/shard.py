"""Cuts a loaded transformers model into the shard of one tensor-parallel rank, in place.

Which linear layer is split how comes from transformers' own plan for the architecture
(`config.base_model_tp_plan`: "colwise" for q/k/v/gate/up, "rowwise" for o/down); the cutting itself is
done here on plain tensors rather than through transformers' DTensor path (`from_pretrained(tp_plan=...)`):
that path loads only through `from_pretrained` (no random-weight models), wraps every weight in a DTensor
whose per-op dispatch slows every forward on the CPU (benchmarks/NOTES.md), and forces every rank to run the
replicated `lm_head` and gather its output, while here only rank 0 computes logits. A row-parallel layer sums
its partial outputs with one all-reduce (a forward hook calling the rank's `LayerAllReduce`: the group's
backend or symmetric memory, `all_reduce.py`); its bias is added by rank 0 alone.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedModel

from streamd.engine.worker.parallel.all_reduce import LayerAllReduce

COLWISE = "colwise"
ROWWISE = "rowwise"
# Styles that only matter for training (gradients) or leave the module whole: nothing to do for inference.
# Some transformers releases plan the input embedding as "embedding_rowwise" (vocabulary-parallel); here it
# stays whole on every rank: a lookup reads one row per token, so splitting it would save memory only, at the
# price of one more all-reduce per step.
_REPLICATED = frozenset({"replicated_with_grad_allreduce", "embedding_rowwise"})


@dataclass(slots=True, frozen=True)
class ShardSpec:
    rank: int
    world_size: int
    all_reduce: LayerAllReduce  # sums the row-parallel layers' partial outputs over the ranks


def check_divisible(model: PreTrainedModel, world_size: int) -> None:
    """Raises ValueError unless every head count and the MLP width split evenly over `world_size` ranks."""
    config = model.config.get_text_config()
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    for name, value in (
        ("num_key_value_heads", kv_heads),
        ("num_attention_heads", heads),
        ("intermediate_size", getattr(config, "intermediate_size", 0)),
    ):
        if value % world_size:
            raise ValueError(
                f"parallel.tensor_parallel_size {world_size} does not divide the model's "
                f"{name} ({value}): every rank must hold whole heads and an equal MLP slice"
            )


def shard_model(model: PreTrainedModel, spec: ShardSpec) -> None:
    """Replaces each planned linear layer's weight (and bias) by this rank's slice; hooks row-parallel ones."""
    for linear, style in planned_splits(model, spec.world_size):
        if style == COLWISE:
            _split_columns(linear, spec)
        else:
            _split_rows(linear, spec)


def planned_splits(model: PreTrainedModel, world_size: int) -> list[tuple[nn.Linear, str]]:
    """The linear layers transformers' plan splits, each with its style; raises ValueError where streamd
    cannot follow the plan (rank 0 asks before it starts any worker)."""
    check_divisible(model, world_size)
    plan = model.config.get_text_config().base_model_tp_plan
    if not plan:
        raise ValueError(f"transformers has no tensor-parallel plan for model type {model.config.model_type!r}")
    decoder = model.get_decoder()  # the text model: an image-text wrapper's own names miss the text plan's
    planned = [(name, module, _style_of(plan, name)) for name, module in decoder.named_modules()]
    splits = [(name, module, style) for name, module, style in planned if style and style not in _REPLICATED]
    if not splits:  # gpt-oss plans its embedding only
        raise ValueError(
            f"transformers' tensor-parallel plan for model type {model.config.model_type!r} splits none of its "
            f"layers ({plan}): every rank would run the whole model"
        )
    return [(_splittable(name, module, style), style) for name, module, style in splits]


def _splittable(name: str, module: nn.Module, style: str) -> nn.Linear:
    if not isinstance(module, nn.Linear):
        raise ValueError(
            f"tensor-parallel plan style {style!r} on {name} ({type(module).__name__}) "
            "is not supported: only plain linear layers are split"
        )
    if style not in (COLWISE, ROWWISE):
        raise ValueError(
            f"tensor-parallel plan style {style!r} (on {name}) is not supported; supported: {COLWISE}, {ROWWISE}"
        )
    return module


def _style_of(plan: dict[str, str], name: str) -> str | None:
    for pattern, style in plan.items():
        if fnmatch.fnmatchcase(name, pattern):
            return style
    return None


def _split_columns(linear: nn.Linear, spec: ShardSpec) -> None:
    """Output features (heads, MLP columns) split into `world_size` contiguous slices."""
    linear.weight = nn.Parameter(_slice(linear.weight, 0, spec), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(_slice(linear.bias, 0, spec), requires_grad=False)
    linear.out_features = linear.weight.shape[0]


def _split_rows(linear: nn.Linear, spec: ShardSpec) -> None:
    """Input features split; the partial outputs are summed over the ranks after the matmul."""
    linear.weight = nn.Parameter(_slice(linear.weight, 1, spec), requires_grad=False)
    linear.in_features = linear.weight.shape[1]
    if linear.bias is not None and spec.rank != 0:
        linear.register_parameter("bias", None)  # added once, by rank 0, before the sum (`bias = None`)
    all_reduce = spec.all_reduce
    linear.register_forward_hook(lambda _module, _args, output: all_reduce(output))


def _slice(tensor: torch.Tensor, dim: int, spec: ShardSpec) -> torch.Tensor:
    return tensor.detach().chunk(spec.world_size, dim)[spec.rank].contiguous()
