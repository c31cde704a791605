"""FP8 weights (`streamd/engine/worker/fp8.py`) on the CPU, where the plain-torch reference of the FP8 GEMM runs: the FP8 Linear's
numerics against float references; `model.quantization = "fp8"` refused where FP8 cannot run (and, with the device
check forced open, quantizing a float model but its head); a compressed-tensors FP8 checkpoint written here from a
tiny Llama, loaded dequantized on the CPU (greedy tokens = transformers on the dequantized weights) and, forced,
kept FP8 as stored (the engine's greedy tokens = transformers' with the same FP8 layers)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from streamd import LLM, SamplingParams, kernels
from streamd.config import ConfigError, ModelConfig
from streamd.engine.worker import fp8, model_loader
from streamd.engine.worker.model_loader import load_model, weight_bytes
from streamd.kernels import reference
from tests.helpers import hf_greedy, register_engine, save_random_checkpoint, tiny_config

CPU = torch.device("cpu")
# Measured (rows 1..64, in/out 7..512, float32 and bfloat16 inputs), as relative norms of the error:
EXACT_F32 = 1e-5  # vs the quantized activations times the dequantized weight, float32 output (measured 3e-7)
EXACT_BF16 = 1e-2  # the same, bfloat16 output (its rounding: measured 3e-3)
DEQUANTIZED = 0.05  # vs float activations times the dequantized weight (activations' e4m3 rounding: measured 0.031)
FLOAT = 0.06  # vs the float Linear (weights' and activations' rounding: measured 0.041)
# The tiny random Llama's logits with FP8 layers vs its float (or dequantized) weights: the layers' errors compound
# (measured 0.113 quantized at load vs float; a checkpoint's FP8 vs its dequantized weights 0.075, static input
# scale 0.104). An FP8 layer computes exactly its simulation in float32 (quantized rows x dequantized weight).
MODEL = 0.2
# in/out not multiples of 16 (padded), and one of each
SHAPES = [(64, 48), (40, 24), (33, 7), (256, 512)]


def _relative(out: torch.Tensor, reference: torch.Tensor) -> float:
    return ((out.float() - reference).norm() / reference.norm()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_out", SHAPES)
@pytest.mark.parametrize("rows", [1, 3, 17])
def test_fp8_linear_matches_its_references(rows: int, in_out: tuple[int, int], dtype: torch.dtype) -> None:
    in_features, out_features = in_out
    gen = torch.Generator().manual_seed(rows * 1000 + in_features)
    weight = torch.randn(out_features, in_features, generator=gen) * 0.05
    bias = torch.randn(out_features, generator=gen) * 0.1
    x = torch.randn(2, rows, in_features, generator=gen).to(dtype)  # a batch dimension: reshaped and back
    stored = fp8.quantize_weight(weight)
    layer = fp8.Fp8Linear(stored, bias.to(dtype))
    out = layer(x)
    assert out.shape == (2, rows, out_features) and out.dtype == dtype
    dequantized = stored.dequantize(torch.float32)
    exact = (reference.quantize_fp8(x.reshape(-1, in_features)).dequantize(torch.float32) @ dequantized.T + bias).reshape(out.shape)
    assert _relative(out, exact) < (EXACT_F32 if dtype == torch.float32 else EXACT_BF16)
    assert _relative(out, x.float() @ dequantized.T + bias) < DEQUANTIZED
    assert _relative(out, x.float() @ weight.T + bias) < FLOAT


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows_given", [False, True])
def test_fp8_linear_through_the_kernels(dtype: torch.dtype, rows_given: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The layer's glue to `streamd.kernels` (what CUDA runs; the kernels run interpreted here): a padded output
    with a bias, float inputs or rows already quantized, every 16-bit dtype (float16 cannot hold the codes'
    product: it is taken in bfloat16)."""
    monkeypatch.setattr(fp8, "_ops", lambda device: kernels)
    gen = torch.Generator().manual_seed(11)
    weight, bias = torch.randn(40, 64, generator=gen) * 0.05, torch.randn(40, generator=gen) * 0.1
    layer = fp8.Fp8Linear(fp8.quantize_weight(weight), bias.to(dtype))
    assert layer.pad_out == 8 and layer.takes_rows
    x = torch.randn(5, 64, generator=gen).to(dtype)
    rows = reference.quantize_fp8(x)
    out = layer(rows if rows_given else x)
    assert out.dtype == dtype and out.shape == (5, 40) and torch.isfinite(out).all()
    exact = rows.dequantize(torch.float32) @ layer.fp8_weight().dequantize(torch.float32).T + bias.to(dtype).float()
    assert _relative(out, exact) < (EXACT_F32 if dtype == torch.float32 else EXACT_BF16)


def test_weight_quantization_is_per_output_channel() -> None:
    weight = torch.randn(24, 40) * torch.logspace(-3, 1, 24)[:, None]  # rows of very different sizes
    stored = fp8.quantize_weight(weight)
    assert stored.codes.dtype == fp8.FP8 and stored.scales.dtype == torch.float32
    torch.testing.assert_close(stored.codes.float().abs().amax(dim=1), torch.full((24,), fp8.FP8_MAX))
    torch.testing.assert_close(stored.scales, weight.abs().amax(dim=1) / fp8.FP8_MAX)
    relative = (stored.dequantize(torch.float32) - weight).abs() / weight.abs().amax(dim=1, keepdim=True)
    assert relative.max() < 2**-4  # half a step of e4m3's 3-bit mantissa at the row's largest value


def test_a_static_input_scale_quantizes_every_row_by_it() -> None:
    gen = torch.Generator().manual_seed(1)
    weight, x = torch.randn(32, 48, generator=gen), torch.randn(5, 48, generator=gen)
    scale = torch.tensor(0.01)
    stored = fp8.quantize_weight(weight)
    layer = fp8.Fp8Linear(fp8.Fp8Weight(stored.codes, stored.scales, scale), None)
    codes = (x / scale).clamp(-fp8.FP8_MAX, fp8.FP8_MAX).to(fp8.FP8)
    exact = (codes.float() * scale) @ stored.dequantize(torch.float32).T
    assert _relative(layer(x), exact) < EXACT_F32
    assert "static input scale" in repr(layer)


def test_an_all_zero_row_gives_zeros_not_nans() -> None:
    layer = fp8.Fp8Linear(fp8.quantize_weight(torch.randn(16, 16)), None)
    assert torch.equal(layer(torch.zeros(3, 16)), torch.zeros(3, 16))


# --- where FP8 cannot run ------------------------------------------------------------------------------------------


def test_fp8_is_a_setting_and_is_refused_on_the_cpu_with_what_it_needs() -> None:
    ModelConfig(quantization="fp8").validate()
    with pytest.raises(ConfigError, match="model.quantization"):
        ModelConfig(quantization="fp16").validate()
    with pytest.raises(ValueError, match=r"model.quantization = 'fp8' needs .*sm_89\+.*model.device is cpu"):
        load_model(tiny_config(), torch.float32, CPU, quantization="fp8")


def test_fp8_is_refused_on_a_gpu_older_than_ada(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA A100-SXM4-80GB")
    fp8._cuda_reason.cache_clear()
    try:
        with pytest.raises(ValueError, match=r"needs .*compute capability 8.9\+.*A100-SXM4-80GB: sm_80"):
            fp8.check_device(torch.device("cuda:0"))
    finally:
        fp8._cuda_reason.cache_clear()


@pytest.fixture
def fp8_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The device check forced open on the CPU: the FP8 layers then run through the reference FP8 GEMM."""
    monkeypatch.setattr(fp8, "unsupported_reason", lambda device: None)


def test_fp8_quantizes_every_linear_but_the_head_at_load(fp8_runs: None) -> None:
    config = tiny_config(vocab_size=256)
    model = load_model(config, torch.float32, CPU, quantization="fp8").model
    float_model = load_model(config, torch.float32, CPU, quantization="none").model  # the same seed: same weights
    layers = [m for m in model.modules() if isinstance(m, fp8.Fp8Linear)]
    assert len(layers) == 2 * 7 and isinstance(model.lm_head, nn.Linear)
    assert weight_bytes(model) < weight_bytes(float_model)
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        got, want = model(ids).logits, float_model(ids).logits
    assert _relative(got, want) < MODEL


def test_tensor_parallelism_refuses_fp8() -> None:
    from streamd.config import load_config
    from streamd.engine.builder import load

    config = load_config(None, {"device": "cpu", "quantization": "fp8", "tensor_parallel_size": 2})
    with pytest.raises(ValueError, match="model.quantization = 'fp8' is for one process, not tensor parallelism"):
        load(config, tiny_config())


# --- compressed-tensors checkpoints --------------------------------------------------------------------------------


def _ct_config(strategy: str, static: bool) -> dict:
    inputs = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor" if static else "token",
              "dynamic": not static}
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy, "dynamic": False}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": inputs}},
            "ignore": ["lm_head"], "kv_cache_scheme": None}


def _fp8_checkpoint(
    path: Path, strategy: str = "channel", static: bool = False, intermediate: int = 72
) -> dict[str, torch.Tensor]:
    """A tiny random Llama (hidden 64, 2 layers, vocabulary 256; intermediate 72 by default, so the MLP's layers are
    padded to 16) saved, then its Linears but the head rewritten as llm-compressor stores FP8: e4m3 `weight`, its
    `weight_scale` (channel: [out, 1] in bfloat16; tensor: [1] in float32) and a static `input_scale` ([1]).
    Returns each such weight dequantized (codes x stored scale) in float32."""
    save_random_checkpoint(tiny_config(vocab_size=256, intermediate_size=intermediate), path, seed=3)
    tensors, dequantized = load_file(path / "model.safetensors"), {}
    for name in [n for n in tensors if n.endswith("_proj.weight")]:
        weight, prefix = tensors[name].float(), name.removesuffix(".weight")
        if strategy == "channel":
            scale = (weight.abs().amax(dim=1, keepdim=True) / fp8.FP8_MAX).to(torch.bfloat16)
        else:
            scale = (weight.abs().amax() / fp8.FP8_MAX).reshape(1)
        codes = (weight / scale.float()).clamp(-fp8.FP8_MAX, fp8.FP8_MAX).to(fp8.FP8)
        tensors[name], tensors[f"{prefix}.weight_scale"] = codes, scale
        if static:
            tensors[f"{prefix}.input_scale"] = torch.tensor([4.0 / fp8.FP8_MAX])
        dequantized[name] = codes.float() * scale.float()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = _ct_config(strategy, static)
    (path / "config.json").write_text(json.dumps(config))
    return dequantized


def _dequantized_reference(path: Path, dequantized: dict[str, torch.Tensor]) -> nn.Module:
    """transformers' model of the checkpoint (config without its quantization) holding the dequantized weights."""
    config = AutoConfig.from_pretrained(path)
    del config.quantization_config
    model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.float32)
    with torch.no_grad():
        for name, value in dequantized.items():
            model.get_parameter(name).copy_(value)
    model.generation_config.eos_token_id = None
    return model.eval()


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(10, 256, (n,), generator=gen).tolist() for n in (1, 9, 23)]


def _engine_greedy(
    path: Path, prompts: list[list[int]], tokens: int, fuse_layers: str = "auto"
) -> tuple[LLM, list[list[int]]]:
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=8, max_num_batched_tokens=64, seed=5,
              fuse_layers=fuse_layers)
    register_engine(llm.engine)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, detokenize=False)
    return llm, [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_a_compressed_tensors_fp8_checkpoint_is_dequantized_on_the_cpu(tmp_path: Path, strategy: str) -> None:
    """On the CPU FP8 cannot run: the checkpoint loads dequantized to model.dtype (never asking for the
    compressed-tensors package), every value codes x scale, and the engine's greedy tokens are transformers'."""
    dequantized = _fp8_checkpoint(tmp_path / "fp8", strategy)
    loaded = load_model(str(tmp_path / "fp8"), torch.float32, CPU, quantization="auto")
    assert not fp8.has_fp8(loaded.model) and loaded.weights.count("checkpoint_fp8=dequantized") == 1
    for name, value in dequantized.items():
        assert torch.equal(loaded.model.get_parameter(name), value), name
    reference = _dequantized_reference(tmp_path / "fp8", dequantized)
    llm, got = _engine_greedy(tmp_path / "fp8", _prompts(), 12)
    for prompt, tokens in zip(_prompts(), got):
        assert tokens == hf_greedy(reference, prompt, 12), prompt
    assert not fp8.has_fp8(llm.engine.runner.model)


def test_load_fp8_linears_keeps_the_stored_codes_and_scales(tmp_path: Path) -> None:
    """`runnable=True` (the GPU's path, forced here): each FP8 Linear becomes an `Fp8Linear` over the codes exactly
    as stored and the stored scales; its outputs stay close to the dequantized model's."""
    dequantized = _fp8_checkpoint(tmp_path / "fp8", static=True)
    reference = _dequantized_reference(tmp_path / "fp8", dequantized)
    config = AutoConfig.from_pretrained(tmp_path / "fp8")
    del config.quantization_config
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "fp8", config=config, dtype=torch.float32)
    stored = fp8.CheckpointTensors(tmp_path / "fp8")
    assert fp8.load_fp8_linears(model, stored, runnable=True) == 2 * 7
    for name in dequantized:
        layer = model.get_submodule(name.removesuffix(".weight"))
        assert isinstance(layer, fp8.Fp8Linear), name
        held = layer.fp8_weight()
        assert torch.equal(held.codes.view(torch.uint8), stored[name].view(torch.uint8)), name
        assert torch.equal(held.scales, stored[f"{name}_scale"].float().reshape(-1)), name
        assert held.input_scale is not None and held.input_scale.item() == pytest.approx(4.0 / fp8.FP8_MAX)
    assert isinstance(model.lm_head, nn.Linear)
    ids = torch.tensor([_prompts()[2]])
    with torch.inference_mode():
        assert _relative(model(ids).logits, reference(ids).logits) < MODEL


def test_a_compressed_tensors_fp8_checkpoint_runs_fp8_where_fp8_runs(tmp_path: Path, fp8_runs: None) -> None:
    """With the device check forced open, the loader keeps the checkpoint FP8 (no dequantization, nothing
    quantized again under "fp8") and the engine's greedy tokens are transformers' with the same FP8 layers."""
    _fp8_checkpoint(tmp_path / "fp8")
    loaded = load_model(str(tmp_path / "fp8"), torch.float32, CPU, quantization="fp8")
    assert sum(isinstance(m, fp8.Fp8Linear) for m in loaded.model.modules()) == 2 * 7
    assert "checkpoint_fp8=fp8" in loaded.weights and isinstance(loaded.model.lm_head, nn.Linear)
    loaded.model.generation_config.eos_token_id = None
    llm, got = _engine_greedy(tmp_path / "fp8", _prompts(), 12)
    assert sum(isinstance(m, fp8.Fp8Linear) for m in llm.engine.runner.model.modules()) == 2 * 7
    for prompt, tokens in zip(_prompts(), got):
        assert tokens == hf_greedy(loaded.model, prompt, 12), prompt


@pytest.mark.parametrize("intermediate", [72, 80])
@pytest.mark.parametrize("mode", ["reference", "triton"])
def test_the_fused_layer_hands_fp8_projections_quantized_rows(
    tmp_path: Path, fp8_runs: None, mode: str, intermediate: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fused, the norms before the QKV and gate/up projections, and the SiLU-and-mul before a down projection of
    unpadded width, write e4m3 rows (one kernel each, `kernels.fp8`) that the FP8 layers take as they are; that
    SiLU-and-mul also scales the gate/up's unscaled product itself. The greedy tokens stay transformers' with the
    same FP8 layers (which quantize their float inputs themselves)."""
    from tests.kernels.paged_testlib import interpreter_runs_dynamic_loops

    if mode == "triton" and not interpreter_runs_dynamic_loops():
        pytest.skip("this triton's interpreter cannot run the FP8 kernels' loops")
    _fp8_checkpoint(tmp_path / "fp8", intermediate=intermediate)
    loaded = load_model(str(tmp_path / "fp8"), torch.float32, CPU, quantization="fp8")
    loaded.model.generation_config.eos_token_id = None
    calls: list[str] = []
    module = reference if mode == "reference" else kernels  # (the package: the fused layer reads its exports)
    for name in ("rmsnorm_fp8", "fused_add_rmsnorm_fp8", "silu_and_mul_fp8"):
        monkeypatch.setattr(module, name, _counted(getattr(module, name), name, calls))
    # the FP8 layers' own GEMMs run through the reference off CUDA, whatever the layer's mode
    monkeypatch.setattr(reference, "fp8_product", _counted(reference.fp8_product, "fp8_product", calls))
    llm, got = _engine_greedy(tmp_path / "fp8", _prompts(), 6, fuse_layers=mode)
    layers = llm.engine.runner.model.model.layers
    assert "rmsnorm_fp8" in calls and calls.count("fused_add_rmsnorm_fp8") >= 2 * len(layers) - 1
    if intermediate % 16:  # the down projection's inner width is padded (`takes_rows` False): its input stays float
        assert not layers[0].down_proj.takes_rows and "silu_and_mul_fp8" not in calls
    else:
        assert calls.count("silu_and_mul_fp8") >= len(layers) and calls.count("fp8_product") >= len(layers)
    for prompt, tokens in zip(_prompts(), got):
        assert tokens == hf_greedy(loaded.model, prompt, 6), prompt


def _counted(fn: Callable[..., Any], name: str, calls: list[str]) -> Callable[..., Any]:
    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(name)
        return fn(*args, **kwargs)

    return counted


def test_quantization_none_dequantizes_an_fp8_checkpoint_even_where_fp8_runs(tmp_path: Path, fp8_runs: None) -> None:
    _fp8_checkpoint(tmp_path / "fp8")
    assert not fp8.has_fp8(load_model(str(tmp_path / "fp8"), torch.float32, CPU, quantization="none").model)


def test_other_compressed_tensors_schemes_are_refused_by_name(tmp_path: Path) -> None:
    _fp8_checkpoint(tmp_path / "int4")
    config = json.loads((tmp_path / "int4" / "config.json").read_text())
    group = config["quantization_config"]["config_groups"]["group_0"]
    group["weights"].update(num_bits=4, type="int", strategy="group", group_size=128)
    config["quantization_config"]["format"] = "pack-quantized"
    (tmp_path / "int4" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"group_0.*format 'pack-quantized'.*FP8 checkpoints only"):
        load_model(str(tmp_path / "int4"), torch.float32, CPU)


def test_the_plan_names_fp8(fp8_runs: None) -> None:
    plan = model_loader.low_bit_plan(tiny_config(), "fp8", CPU)
    assert plan.quantize == "fp8" and "fp8 e4m3 per channel" in plan.describe()


def test_fp8_projections_merge_exactly_for_the_fused_layer() -> None:
    """q/k/v (and gate/up) of FP8 layers merge into one FP8 layer whose output is theirs side by side: the input is
    quantized once per row either way, and codes and per-channel scales are concatenated."""
    from streamd.engine.worker.fusion import merge_linears

    parts = [fp8.Fp8Linear(fp8.quantize_weight(torch.randn(out, 40)), torch.randn(out) if out != 24 else None)
             for out in (32, 24, 24)]
    merged = merge_linears(*parts)
    assert isinstance(merged, fp8.Fp8Linear) and merged.out_features == 80
    x = torch.randn(5, 40)
    torch.testing.assert_close(merged(x), torch.cat([p(x) for p in parts], dim=-1), rtol=1e-6, atol=1e-6)
    static = fp8.Fp8Linear(fp8.Fp8Weight(parts[0].fp8_weight().codes, parts[0].fp8_weight().scales,
                                         torch.tensor(0.01)), None)
    with pytest.raises(ValueError, match="static input scales"):
        merge_linears(static, parts[1])
