"""A transformers model built straight from a GGUF file, its 4-bit and 8-bit tensors kept low-bit (CPU).

transformers' own GGUF loader dequantizes every tensor to float32 (540 MB for the default 98 MB file), and
a decode step then reads all of it per token. Here the model is made on the meta device from the file's
config, every Linear whose tensor is Q4_0 / Q4_1 / Q4_K / Q8_0 becomes a `QuantizedLinear` over its codes
(exact: `gguf_weights`), the token embedding a `QuantizedEmbedding`, and the remaining tensors (norms, biases,
other formats) are set in the model's dtype. A head tied to the embedding is a `QuantizedLinear` of the same
codes, read and packed from the file 1,024 rows at a time; the embedding then reads its rows from the head's
packed codes (`quantized.PackedTable`), so each code is held once. Nothing float32 of the size of the weights
exists at any point. With `model.low_bit_matmul` resolved to w8a8 the Linears are `W8A8Linear`s instead: the
codes requantized to int8 per output channel, a few thousand rows at a time, and q/k/v and gate/up quantize
their shared input once (`quantized.share_inputs`).

Only llama.cpp's Llama-style naming is mapped (`ARCHITECTURES`: Llama, Mistral, Qwen2, Qwen3); another
architecture loads through transformers' dequantizing path (`model_loader`), as before.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import cast

import numpy as np
import torch
from accelerate import init_empty_weights
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from streamd.engine.worker.gguf_weights import (
    BLOCK_FORMATS,
    Decoded,
    Int4Codes,
    Q8Codes,
    TensorInfo,
    decode,
    read,
    read_index,
)
from streamd.engine.worker.quantized import (
    REQUANTIZE_ROWS,
    WEIGHT_ONLY,
    PackedTable,
    QuantizedEmbedding,
    QuantizedLinear,
    linear_from_codes,
    packed_from_codes,
    share_inputs,
)
from streamd.heap import trim_c_heap
from streamd.kernels import lowbit

ARCHITECTURES = ("llama", "qwen2", "qwen3")  # general.architecture values mapped here (Mistral files say llama)
_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


def architecture(path: Path) -> str:
    return str(read_index(path)[0].get("general.architecture", ""))


def hf_name(gguf_name: str) -> str:
    """transformers' parameter name for a llama.cpp tensor name (KeyError for one this map does not know)."""
    if match := _BLOCK.match(gguf_name):
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{_LAYER[part]}.{kind}"
    stem, _, kind = gguf_name.rpartition(".")
    return f"{_GLOBAL[stem]}.{kind}"


def load_low_bit(
    path: Path, config: PretrainedConfig, dtype: torch.dtype, compute: torch.dtype, matmul: str = WEIGHT_ONLY
) -> PreTrainedModel:
    """The model of `config` in `dtype` with the file's tensors (see the module docstring), on the CPU; its
    low-bit matmuls run as `matmul` says (`quantized.WEIGHT_ONLY`: in `compute`, bfloat16 where the CPU has it,
    `cpu_threads.cpu_runs_bf16`; `quantized.W8A8`: requantized to int8 with int8 activations)."""
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    fields, infos = read_index(path)
    arch = str(fields.get("general.architecture", ""))
    tensors = {hf_name(t.name): t for t in infos}
    biases = {name: tensors.pop(name) for name in list(tensors) if name.endswith(".bias")}
    tied = "lm_head.weight" not in tensors
    for name, info in tensors.items():
        if tied and name == EMBEDDING and _install_tied_by_slices(model, path, info, _Numerics(dtype, compute, matmul)):
            tied = False  # the head is in place
            continue
        decoded = _row_order(arch, name, config, decode(read(path, info), info))
        bias = biases.pop(name[: -len("weight")] + "bias", None)
        bias_tensor = None if bias is None else _dense(decode(read(path, bias), bias)).to(dtype)
        _install(model, name, decoded, bias_tensor, _Numerics(dtype, compute, matmul))
        trim_c_heap()  # each tensor's transients (bytes, codes, int32 packing copies) back to the OS
    if tied:
        _tie_head(model, compute, matmul)
    _check_materialized(model, path)
    share_inputs(model)
    return model


@dataclass(frozen=True, slots=True)
class _Numerics:
    dtype: torch.dtype  # the model's
    compute: torch.dtype  # the weight-only kernels'
    matmul: str  # quantized.WEIGHT_ONLY | quantized.W8A8


def _install(model: nn.Module, name: str, decoded: Decoded, bias: torch.Tensor | None, how: _Numerics) -> None:
    module_name, _, _ = name.rpartition(".")
    module = model.get_submodule(module_name)
    if isinstance(decoded, BLOCK_FORMATS) and isinstance(module, nn.Linear):
        _replace(model, module_name, linear_from_codes(decoded, bias, how.compute, how.matmul))
        return
    if isinstance(decoded, BLOCK_FORMATS) and isinstance(module, nn.Embedding):
        _replace(model, module_name, QuantizedEmbedding(decoded, how.dtype))
        return
    module.weight = nn.Parameter(_dense(decoded).to(how.dtype), requires_grad=False)  # a norm, or another module
    if bias is not None:
        module.bias = nn.Parameter(bias.to(how.dtype), requires_grad=False)


EMBEDDING = "model.embed_tokens.weight"


def _install_tied_by_slices(model: nn.Module, path: Path, info: TensorInfo, how: _Numerics) -> bool:
    """A tied vocabulary table in a block format, weight-only: the head packed from the file's bytes
    `REQUANTIZE_ROWS` rows at a time (`lowbit.concat_rows`) and the embedding reading its codes from it
    (`PackedTable`), so the table's codes are never held whole (the load's peak: benchmarks/NOTES.md). False
    where that does not apply (the caller installs the table as it is)."""
    if how.matmul != WEIGHT_ONLY or not info.low_bit:
        return False
    rows, cols = info.shape
    slices = [cast(Int4Codes | Q8Codes, decode(read(path, part), part)) for part in _row_slices(info)]
    packed = [packed_from_codes(codes, None, how.compute).parts for codes in slices]
    head = QuantizedLinear([lowbit.concat_rows(same) for same in zip(*packed)], None, cols, rows)
    zeros = [codes.zeros for codes in slices if isinstance(codes, Int4Codes)]
    table = PackedTable.of(head, torch.cat([codes.scales for codes in slices]), torch.cat(zeros) if zeros else None)
    _replace(model, "lm_head", head)
    _replace(model, "model.embed_tokens", QuantizedEmbedding(table, how.dtype))
    return True


def _row_slices(info: TensorInfo) -> list[TensorInfo]:
    """A 2-D tensor's rows, `REQUANTIZE_ROWS` at a time, each a tensor of its own in the file."""
    rows, cols = info.shape
    row_bytes = info.nbytes // rows
    return [
        replace(info, shape=(min(REQUANTIZE_ROWS, rows - start), cols), offset=info.offset + start * row_bytes)
        for start in range(0, rows, REQUANTIZE_ROWS)
    ]


def _dense(decoded: Decoded) -> torch.Tensor:
    return decoded if isinstance(decoded, torch.Tensor) else decoded.dequantize()


def _replace(model: nn.Module, module_name: str, module: nn.Module) -> None:
    parent, _, attr = module_name.rpartition(".")
    setattr(model.get_submodule(parent), attr, module)


def _tie_head(model: PreTrainedModel, compute: torch.dtype, matmul: str) -> None:
    """A file without `output.weight` ties the head to the token embedding (SmolLM2's does)."""
    embedding = model.get_submodule("model.embed_tokens")
    if isinstance(embedding, QuantizedEmbedding):  # (a weight-only table was installed with its head, by slices)
        table = cast(Int4Codes | Q8Codes, embedding.table)
        _replace(model, "lm_head", linear_from_codes(table, None, compute, matmul))
    else:
        model.get_submodule("lm_head").weight = embedding.weight


def _row_order(arch: str, name: str, config: PretrainedConfig, decoded: Decoded) -> Decoded:
    """llama.cpp's converter interleaves the rows of Llama's Q and K projections for its rotary layout
    (`permute` in convert_hf_to_gguf.py); transformers' rotate-half layout wants them back."""
    if arch != "llama" or not re.search(r"\.self_attn\.[qk]_proj\.weight$", name):
        return decoded
    heads = config.num_attention_heads if ".q_proj." in name else config.num_key_value_heads
    rows = decoded.shape[0] if isinstance(decoded, torch.Tensor) else decoded.codes.shape[0]
    index = torch.from_numpy(np.arange(rows).reshape(heads, rows // heads // 2, 2).swapaxes(1, 2).reshape(rows))
    return decoded[index] if isinstance(decoded, torch.Tensor) else decoded.rows(index)


def _check_materialized(model: nn.Module, path: Path) -> None:
    missing = [name for name, p in model.named_parameters() if p.device.type == "meta"]
    if missing:
        raise ValueError(f"{path.name} has no tensor for {', '.join(missing[:5])} (of {len(missing)} missing)")
