"""GGUF files loaded as stored (`gguf_weights`, `gguf_model`, `quantized`), against independent references:
gguf-py's own dequantizer and reader, and transformers' dequantized model of the same file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGUFReader, GGUFWriter, quants
from gguf import GGMLQuantizationType as GGML
from transformers import AutoConfig, LlamaConfig

from streamd.engine.worker import gguf_model, gguf_weights, model_loader, quantized
from streamd.engine.worker.gguf_weights import Int4Codes, Q8Codes, TensorInfo
from streamd.kernels import lowbit, native_cpu

BLOCK_FORMATS = [GGML.Q4_0, GGML.Q4_1, GGML.Q8_0, GGML.Q4_K]


def random_blocks(kind: GGML, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random bytes in `kind`'s block layout, with finite float16 scales (any code bytes are valid)."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    scale_bytes = 4 if kind in (GGML.Q4_1, GGML.Q4_K) else 2
    scales = (rng.standard_normal((rows, cols // block, scale_bytes // 2)) * 0.02).astype(np.float16)
    raw[..., :scale_bytes] = scales.view(np.uint8).reshape(rows, cols // block, scale_bytes)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("kind", BLOCK_FORMATS)
def test_blocks_decode_to_gguf_pys_dequantization_exactly(kind: GGML) -> None:
    raw = random_blocks(kind, rows=5, cols=512, seed=int(kind))
    info = TensorInfo("t", kind, (5, 512), 0)
    decoded = gguf_weights.decode(raw.reshape(-1), info)
    assert isinstance(decoded, (Int4Codes, Q8Codes))
    expected = quants.dequantize(raw, kind).reshape(5, 512)
    np.testing.assert_array_equal(decoded.dequantize().numpy(), expected)


def test_q8_0_is_the_sum_of_its_two_int4_halves_exactly() -> None:
    raw = random_blocks(GGML.Q8_0, rows=3, cols=128, seed=1)
    codes = gguf_weights.decode(raw.reshape(-1), TensorInfo("t", GGML.Q8_0, (3, 128), 0))
    assert isinstance(codes, Q8Codes)
    hi, lo = list(codes.int4_halves())
    assert hi.codes.max() <= 15 and lo.codes.max() <= 15
    torch.testing.assert_close(hi.dequantize() + lo.dequantize(), codes.dequantize(), rtol=0, atol=0)


def test_the_index_reads_what_gguf_pys_reader_reads(tmp_path: Path) -> None:
    path = tmp_path / "mixed.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_array("tokenizer.ggml.tokens", ["a", "bb", "ccc"])  # arrays are skipped by the index
    writer.add_uint32("llama.block_count", 2)
    floats = np.arange(96, dtype=np.float32).reshape(3, 32)
    writer.add_tensor("f32", floats)
    writer.add_tensor("f16", floats.astype(np.float16))
    q8 = quants.quantize(np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32), GGML.Q8_0)
    writer.add_tensor("q8", q8, raw_dtype=GGML.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    fields, infos = gguf_weights.read_index(path)
    assert fields["general.architecture"] == "llama" and fields["llama.block_count"] == 2
    for info, tensor in zip(infos, GGUFReader(str(path)).tensors, strict=True):
        assert (info.name, info.kind) == (tensor.name, tensor.tensor_type)
        assert info.offset == tensor.data_offset
        decoded = gguf_weights.decode(gguf_weights.read(path, info), info)
        reference = quants.dequantize(np.asarray(tensor.data), tensor.tensor_type).reshape(info.shape)
        as_float = decoded if isinstance(decoded, torch.Tensor) else decoded.dequantize()
        np.testing.assert_array_equal(as_float.float().numpy(), reference.astype(np.float32))


@pytest.fixture(scope="module")
def low_bit_fp32() -> torch.nn.Module:
    """The default GGUF as stored, its low-bit matmuls in float32: the arithmetic of the dequantized model."""
    path = model_loader.default_gguf_path()
    config = AutoConfig.from_pretrained(model_loader.default_model_dir())
    return gguf_model.load_low_bit(path, config, torch.float32, torch.float32).eval()


def test_the_default_model_as_stored_computes_transformers_dequantized_model(low_bit_fp32, hf_smol) -> None:
    # Q4_1 layers, the Q8_0 embedding and the head tied to it (as two int4 halves), Q/K rows un-permuted
    kinds = {type(m).__name__ for m in low_bit_fp32.modules()}
    assert {"QuantizedLinear", "QuantizedEmbedding"} <= kinds and "Linear" not in kinds
    ids = torch.tensor([[1, 504, 3458, 314, 260, 1345, 28, 355, 2103, 4478, 12, 9876]])
    with torch.no_grad():
        ours, theirs = low_bit_fp32(ids).logits, hf_smol(ids).logits
    torch.testing.assert_close(ours, theirs, atol=2e-3, rtol=0)


@pytest.mark.parametrize("matmul, peak_bound, held_bound", [(quantized.WEIGHT_ONLY, 1.5, 1.4), (quantized.W8A8, 3.5, 2.9)])
def test_loading_the_default_model_holds_no_float_copy_of_its_weights(
    matmul: str, peak_bound: float, held_bound: float
) -> None:
    """Memory of the load, measured from after torch and transformers are imported. A float32 copy of the
    weights alone would be 5.7x the file. Peak: under 1.5x (measured 1.44x: the tied Q8_0 table is read, decoded
    and packed into the head's two int4 halves 1,024 rows at a time, its codes never whole; w8a8 requantizes
    1,024 rows at a time but decodes the table whole: under 3.5x, measured 2.7x); held once loaded and the C heap trimmed: under 1.4x (measured 1.28x: the embedding reads its codes
    from the head's packed halves, `PackedTable`), w8a8 under 2.9x (measured 2.6x: its layers hold int8 codes
    beside their packed 4-bit ones, the head int8 codes instead of two 4-bit halves, and the table its codes)."""
    script = f"""
import gc, torch, transformers
from streamd import heap
from streamd.engine.worker import model_loader
path = model_loader.default_gguf_path()
config = transformers.AutoConfig.from_pretrained(model_loader._gguf_meta(path, model_loader.cache_path(None)))
from streamd.engine.worker.gguf_model import load_low_bit
def status(key): return int(open("/proc/self/status").read().split(key + ":")[1].split()[0]) * 1024
base = status("VmRSS")
model = load_low_bit(path, config, torch.float32, torch.bfloat16, {matmul!r})
peak = status("VmHWM")
heap.settle()
print(peak - base, status("VmRSS") - base, path.stat().st_size)
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    peak, held, file_size = map(int, result.stdout.split()[-3:])
    assert peak < peak_bound * file_size, f"loading peaked {peak / 2**20:.0f} MiB above the imports (file {file_size / 2**20:.0f})"
    assert held < held_bound * file_size, f"the model holds {held / 2**20:.0f} MiB (file {file_size / 2**20:.0f})"


def tiny_llama() -> LlamaConfig:
    return LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


@pytest.mark.parametrize(
    "mode, matmul, tolerance",
    [("int8", quantized.WEIGHT_ONLY, 0.02), ("int8", quantized.W8A8, 0.02), ("int4", quantized.W8A8, 0.25)],
)
def test_a_float_model_quantized_at_load_stays_close_to_it(mode: str, matmul: str, tolerance: float) -> None:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_llama(), dtype=torch.float32).eval()
    ids = torch.randint(0, 256, (1, 24))
    with torch.no_grad():
        reference = model(ids).logits
        assert quantized.quantize_linears(model, mode, torch.bfloat16, matmul) == 2 * 7 + 1
        ours = model(ids).logits
    kind = quantized.W8A8Linear if (mode, matmul) == ("int8", quantized.W8A8) else quantized.QuantizedLinear
    assert sum(isinstance(m, kind) for m in model.modules()) == 2 * 7 + 1
    error = (ours - reference).abs().max() / reference.abs().max()
    assert error < tolerance, f"{mode}: relative error {error:.3f}"


def test_int4_quantization_is_round_to_nearest_per_group() -> None:
    weight = torch.randn(20, 70)
    codes = quantized.quantize_int4(weight)
    back = lowbit.dequantize_int4(codes.codes, codes.scales, codes.zeros, 32)
    step = codes.scales[:, torch.arange(70) // 32]
    assert ((back - weight).abs() <= step / 2 + 1e-6).all()


def test_the_plan_keeps_gguf_low_bit_only_where_it_pays(monkeypatch) -> None:
    cpu, gguf = torch.device("cpu"), str(model_loader.default_gguf_path())
    monkeypatch.setattr(model_loader, "cpu_runs_bf16", lambda: True)
    assert model_loader.low_bit_plan(gguf, "auto", cpu).gguf is not None
    assert model_loader.low_bit_plan(None, "auto", cpu).gguf is not None  # the default model
    assert model_loader.low_bit_plan(gguf, "none", cpu) == model_loader.LowBitPlan()
    assert model_loader.low_bit_plan(tiny_llama(), "auto", cpu) == model_loader.LowBitPlan()
    assert model_loader.low_bit_plan(tiny_llama(), "int4", cpu).quantize == "int4"
    with pytest.raises(ValueError, match="CPU only"):
        model_loader.low_bit_plan(tiny_llama(), "int8", torch.device("cuda"))
    with pytest.raises(ValueError, match="is a GGUF file"):
        model_loader.low_bit_plan(gguf, "int4", cpu)
    monkeypatch.setattr(model_loader, "cpu_runs_bf16", lambda: False)  # torch's kernels would crawl there
    assert model_loader.low_bit_plan(gguf, "auto", cpu).gguf is None


def test_the_bfloat16_low_bit_model_keeps_the_float_models_perplexity(hf_smol) -> None:
    """What the served path computes (matmuls in bfloat16): its perplexity of a fixed English text within 1% of
    the float model's (measured on ARCHITECTURE.md's first 1,024 tokens: 0.25%; greedy agreement over 64
    tokens, which bfloat16 rounding moves, is in benchmarks/NOTES.md)."""
    from transformers import AutoTokenizer

    path, folder = model_loader.default_gguf_path(), model_loader.default_model_dir()
    model = gguf_model.load_low_bit(path, AutoConfig.from_pretrained(folder), torch.float32, torch.bfloat16).eval()
    text = (Path(__file__).parents[3] / "docs" / "models.md").read_text()[:2500]
    ids = AutoTokenizer.from_pretrained(folder)(text, return_tensors="pt").input_ids[:, :400]

    def perplexity(m: torch.nn.Module) -> float:
        with torch.no_grad():
            logits = m(ids).logits[0, :-1].float()
        return torch.exp(torch.nn.functional.cross_entropy(logits, ids[0, 1:])).item()

    assert perplexity(model) == pytest.approx(perplexity(hf_smol), rel=0.01)


@pytest.mark.parametrize("kind", [GGML.Q4_1, GGML.Q8_0])
def test_a_quantized_linear_takes_the_dense_path_from_dense_rows_on(kind: GGML, monkeypatch) -> None:
    """Rows just below and from `DENSE_ROWS` on (3-D input, odd output width) against the float reference; the
    dense path is the one taken from there on (a wrong multi-row path fails the comparison)."""
    rows, cols = 77, 96
    codes = gguf_weights.decode(random_blocks(kind, rows, cols, seed=7), TensorInfo("w", kind, (rows, cols), 0))
    assert isinstance(codes, Int4Codes | Q8Codes)
    linear = quantized.linear_from_codes(codes, torch.randn(rows), torch.bfloat16)

    def bf16(t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.bfloat16).float()  # the kernels read the scales (and zeros) in bfloat16

    rounded = (
        Int4Codes(codes.codes, bf16(codes.scales), bf16(codes.zeros))
        if isinstance(codes, Int4Codes)
        else Q8Codes(codes.codes, bf16(codes.scales))
    )
    reference = rounded.dequantize()
    taken = []
    dense = lowbit.dense_linear
    monkeypatch.setattr(lowbit, "dense_linear", lambda *args: taken.append(1) or dense(*args))
    for n in (quantized.DENSE_ROWS - 1, quantized.DENSE_ROWS, quantized.DENSE_ROWS + 5):
        x = torch.randn(1, n, cols)
        with torch.no_grad():
            out = linear(x)
        ref = x.to(torch.bfloat16).float() @ reference.t() + linear.bias
        torch.testing.assert_close(out, ref, atol=2e-2 * ref.abs().max().item(), rtol=0)
    assert len(taken) == 2


@pytest.mark.parametrize("rows, direct", [(128, True), (77, False)])
def test_few_rows_of_an_unpadded_int4_weight_take_the_kernel_alone(rows: int, direct: bool) -> None:
    """A Q4_1 weight of its own widths calls a kernel directly for a 2-D input of few rows (what the CPU decode
    step's matmuls take): the C matmul where this CPU runs it (whole 64-row blocks), else torch's (`int4_mm`); its
    output is that kernel's, bit for bit, and the float reference's within bfloat16 rounding. A weight padded for
    packing (77 rows) keeps torch's generic path."""
    cols = 96
    codes = gguf_weights.decode(random_blocks(GGML.Q4_1, rows, cols, seed=3), TensorInfo("w", GGML.Q4_1, (rows, cols), 0))
    assert isinstance(codes, Int4Codes)
    linear = quantized.linear_from_codes(codes, None, torch.bfloat16)
    assert (linear.int4 is not None) == direct
    assert (linear.native is not None) == (direct and native_cpu.int4_matmul() is not None)
    x = torch.randn(3, cols)
    with torch.no_grad():
        out = linear(x)
    kernel = linear.native(x.to(torch.bfloat16)) if linear.native is not None else None
    assert torch.equal(out, (quantized._packed(x.to(torch.bfloat16), linear.parts) if kernel is None else kernel).float())
    reference = Int4Codes(codes.codes, codes.scales.bfloat16().float(), codes.zeros.bfloat16().float()).dequantize()
    ref = x.to(torch.bfloat16).float() @ reference.t()
    torch.testing.assert_close(out, ref, atol=2e-2 * ref.abs().max().item(), rtol=0)


def test_a_vocabulary_sized_head_stays_packed() -> None:
    codes = Int4Codes(torch.zeros(1 << 14, 512, dtype=torch.uint8), torch.ones(1 << 14, 16), torch.zeros(1 << 14, 16))
    assert quantized.linear_from_codes(codes, None, torch.bfloat16).dense_rows is None
    small = quantized.linear_from_codes(codes.rows(torch.arange(64)), None, torch.bfloat16)
    in_c = native_cpu.int4_matmul() is not None  # the C matmul's crossover is its own
    assert small.dense_rows == (quantized.NATIVE_DENSE_ROWS if in_c else quantized.DENSE_ROWS)


@pytest.mark.parametrize("kind", BLOCK_FORMATS)
def test_gguf_codes_requantize_to_int8_within_half_a_step_per_channel(kind: GGML, monkeypatch) -> None:
    """|w - w8| <= scale / 2 in every output channel, w the GGUF's dequantized weight (plus w / scale's float32
    rounding: up to 127 * 2^-24 of a step); a few rows at a time (three here: the chunks and a short last one)."""
    monkeypatch.setattr(quantized, "REQUANTIZE_ROWS", 3)
    rows, cols = 11, 256
    codes = gguf_weights.decode(random_blocks(kind, rows, cols, seed=3), TensorInfo("w", kind, (rows, cols), 0))
    assert isinstance(codes, Int4Codes | Q8Codes)
    weight = quantized.w8a8_from_codes(codes)
    step = weight.scales[:, None].double()
    error = (weight.codes.double() * step - codes.dequantize().double()).abs()
    assert (error <= step * (0.5 + 2**-16)).all()


def w8a8_layer(rows: int, cols: int, seed: int, kind: GGML = GGML.Q4_1) -> quantized.W8A8Linear:
    codes = gguf_weights.decode(random_blocks(kind, rows, cols, seed), TensorInfo("w", kind, (rows, cols), 0))
    assert isinstance(codes, Int4Codes | Q8Codes)
    layer = quantized.linear_from_codes(codes, torch.randn(rows), torch.bfloat16, quantized.W8A8)
    assert isinstance(layer, quantized.W8A8Linear)
    return layer


@pytest.mark.parametrize("kind", [GGML.Q4_1, GGML.Q8_0])
@pytest.mark.parametrize("batch", [1, 3, quantized.INT_MM_ROWS, 17, 130])
def test_a_w8a8_linear_matches_its_references_on_either_side_of_int_mm_rows(kind: GGML, batch: int, monkeypatch) -> None:
    """Below `INT_MM_ROWS` rows the weight-only layer (a Q4_1 weight's packed codes, a Q8_0 weight's int8 codes;
    bfloat16 activations and scales: 2% of the output's largest magnitude, as for the packed layers above); from
    there on the int8 x int8 path (its float64 reference, 1e-5). A 3-D input, an odd output width and a bias;
    which path ran is counted."""
    layer, taken = w8a8_layer(77, 96, seed=batch, kind=kind), []
    int_mm = lowbit.w8a8_linear
    monkeypatch.setattr(lowbit, "w8a8_linear", lambda *args: taken.append(1) or int_mm(*args))
    x = torch.randn(1, batch, 96)
    x[0, 0, 5] = 300.0  # an outlier in the first row
    with torch.no_grad():
        out = layer(x)
    weight = layer.weight8
    assert out.shape == (1, batch, 77) and out.dtype == torch.float32
    if batch < quantized.INT_MM_ROWS:
        assert not taken and layer.few_rows is not None
        few = layer.few_rows.parts
        expected = lowbit.Int4Weight if kind == GGML.Q4_1 else lowbit.Int8Weight
        assert [type(p) for p in few] == [expected]
        reference = lowbit.dequantize_t(few[0])[:96, :77].t()  # the weight as the kernel reads it
        ref = lowbit.linear_reference(x.to(torch.bfloat16), reference) + layer.bias
        torch.testing.assert_close(out, ref, atol=2e-2 * ref.abs().max().item(), rtol=0)
        return
    ref = lowbit.w8a8_reference(x[0], weight.codes, weight.scales).float() + layer.bias
    assert taken == [1]
    torch.testing.assert_close(out[0], ref, atol=1e-5 * ref.abs().max().item(), rtol=0)


def test_siblings_fed_one_input_quantize_it_once(monkeypatch) -> None:
    """q/k/v (and gate/up) share one `SharedInput`: one quantization per input tensor, a new tensor quantized
    anew, and the outputs those of unshared layers."""
    attention = torch.nn.Module()
    for name, seed in (("q_proj", 1), ("k_proj", 2), ("v_proj", 3)):
        setattr(attention, name, w8a8_layer(64, 96, seed))
    lone = w8a8_layer(64, 96, 2)
    lone.bias = attention.k_proj.bias
    assert quantized.share_inputs(attention) == 1
    calls = []
    quantize = lowbit.quantize_rows
    monkeypatch.setattr(lowbit, "quantize_rows", lambda x: calls.append(1) or quantize(x))
    with torch.no_grad():
        for x in (torch.randn(20, 96), torch.randn(2, 10, 96)):
            outs = [getattr(attention, name)(x) for name in ("q_proj", "k_proj", "v_proj")]
            torch.testing.assert_close(outs[1], lone(x), rtol=0, atol=0)
    assert len(calls) == 2 + 2  # one per input for the three siblings, one per call of the lone layer


@pytest.fixture(scope="module")
def default_int4_and_w8a8() -> tuple[torch.nn.Module, torch.nn.Module]:
    """The default GGUF as the server runs it (matmuls in bfloat16 / int8), weight-only and requantized."""
    path, config = model_loader.default_gguf_path(), AutoConfig.from_pretrained(model_loader.default_model_dir())
    return tuple(  # type: ignore[return-value]
        gguf_model.load_low_bit(path, config, torch.float32, torch.bfloat16, matmul).eval()
        for matmul in (quantized.WEIGHT_ONLY, quantized.W8A8)
    )


def test_the_default_model_requantized_keeps_the_int4_paths_quality(default_int4_and_w8a8) -> None:
    """The perplexity of a fixed text within 3% of the weight-only path's (measured 56.08 against 56.54; the
    exactly dequantized model's 56.29), and greedy tokens of 3 chat prompts (32 each) agreeing over their first 4
    tokens, 2 of them over their first 16 (measured: 18, 23 and 6 tokens in common). Over 20 prompts
    (benchmarks/NOTES.md) the two paths agree about as well as the weight-only path agrees with exact
    arithmetic: 9 of 20 identical, a mean common prefix of 23.7 tokens (26.9 for weight-only against exact)."""
    from transformers import AutoTokenizer

    int4, w8a8 = default_int4_and_w8a8
    assert sum(isinstance(m, quantized.W8A8Linear) for m in w8a8.modules()) == 30 * 7 + 1
    tokenizer = AutoTokenizer.from_pretrained(model_loader.default_model_dir())
    text = (Path(__file__).parents[3] / "docs" / "models.md").read_text()[:2500]
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :400]
    assert perplexity(w8a8, ids) == pytest.approx(perplexity(int4, ids), rel=0.03)
    common = []
    for prompt in ("The capital of France is", "Write a haiku about the sea.", "def fibonacci(n):"):
        chat = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        prompt_ids = torch.tensor([chat if isinstance(chat, list) else chat["input_ids"]])
        ours, theirs = (greedy(m, prompt_ids, 32) for m in (w8a8, int4))
        common.append(next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), len(ours)))
    assert min(common) >= 4 and sorted(common)[1] >= 16, f"tokens in common: {common}"


def perplexity(model: torch.nn.Module, ids: torch.Tensor) -> float:
    with torch.no_grad():
        logits = model(ids).logits[0, :-1].float()
    return torch.exp(torch.nn.functional.cross_entropy(logits, ids[0, 1:])).item()


def greedy(model, prompt_ids: torch.Tensor, tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(prompt_ids, max_new_tokens=tokens, do_sample=False, pad_token_id=0)
    return out[0, prompt_ids.shape[1] :].tolist()


def test_the_plan_picks_the_matmul(monkeypatch) -> None:
    """auto keeps the weights as stored (weight-only) even where the CPU has VNNI: w8a8 is asked for."""
    cpu, gguf = torch.device("cpu"), str(model_loader.default_gguf_path())
    monkeypatch.setattr(model_loader, "cpu_runs_bf16", lambda: True)
    plan = model_loader.low_bit_plan(gguf, "auto", cpu, "w8a8")
    assert plan.matmul == quantized.W8A8 and "int8 activations" in plan.describe()
    weight_only = model_loader.low_bit_plan(gguf, "auto", cpu)
    assert weight_only.matmul == quantized.WEIGHT_ONLY and weight_only.describe() != plan.describe()
    assert model_loader.low_bit_plan(tiny_llama(), "int8", cpu, "w8a8").w8a8
    assert not model_loader.low_bit_plan(tiny_llama(), "int8", cpu).w8a8
    assert not model_loader.low_bit_plan(tiny_llama(), "int4", cpu, "w8a8").w8a8  # 4-bit codes stay 4-bit
    with pytest.raises(ValueError, match="model.low_bit_matmul must be"):
        model_loader.low_bit_plan(gguf, "auto", cpu, "int2")


@pytest.mark.parametrize("kind", [GGML.Q8_0, GGML.Q4_1])
def test_a_w8a8_layer_counts_each_held_byte_once(kind: GGML) -> None:
    """`weight_bytes` (the load's log line): a Q8_0 weight's int8 codes serve both paths (its width is whole
    32-blocks: no padding) and are counted once; a Q4_1 weight's few-rows form is its own packed codes."""
    layer = w8a8_layer(77, 96, seed=3, kind=kind)
    tensors = [layer.weight8.codes, layer.weight8.scales, layer.bias]
    assert layer.few_rows is not None
    for part in layer.few_rows.parts:
        tensors += [part.packed, part.scales_and_zeros] if isinstance(part, lowbit.Int4Weight) else [
            part.codes, part.scales]
    unique = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    assert model_loader.weight_bytes(layer) == sum(unique.values())


def _sibling(kind: GGML | str, rows: int, seed: int) -> quantized.QuantizedLinear:
    """A low-bit layer of `rows` outputs: GGUF blocks of `kind` (96 inputs), or a float layer of 72 inputs (not a
    multiple of the 32-wide group) quantized at load ("int4", "int8")."""
    if isinstance(kind, GGML):
        codes = gguf_weights.decode(random_blocks(kind, rows, 96, seed), TensorInfo("w", kind, (rows, 96), 0))
        assert isinstance(codes, Int4Codes | Q8Codes)
        return quantized.packed_from_codes(codes, None, torch.bfloat16)
    torch.manual_seed(seed)
    layer = quantized._quantized(torch.nn.Linear(72, rows), kind, torch.bfloat16, quantized.WEIGHT_ONLY)
    assert isinstance(layer, quantized.QuantizedLinear)
    return layer


@pytest.mark.parametrize("kind", [GGML.Q4_1, GGML.Q8_0, "int4", "int8"])
def test_merged_siblings_compute_every_row_as_their_own_layers(kind: GGML | str) -> None:
    """q, k and v of 40, 24 and 24 rows (not whole blocks of torch's packing) merged into one layer (as the fused
    layer merges them): each output row bit for bit what its own layer gives, on the packed path and the dense
    one, with a zero bias where a layer had none."""
    layers = [_sibling(kind, rows, seed) for seed, rows in enumerate((40, 24, 24))]
    layers[1].bias = torch.nn.Parameter(torch.randn(24), requires_grad=False)
    merged = quantized.merge_quantized(layers)
    assert (merged.out_features, len(merged.parts)) == (88, len(layers[0].parts))
    for rows in (1, 5, quantized.DENSE_ROWS + 3):
        x = torch.randn(rows, layers[0].in_features)
        with torch.no_grad():
            assert torch.equal(merged(x), torch.cat([layer(x) for layer in layers], dim=-1)), f"{rows} rows"


def test_siblings_in_different_formats_are_not_merged() -> None:
    q4, q8 = _sibling(GGML.Q4_1, 32, 0), _sibling(GGML.Q8_0, 32, 1)
    reason = quantized.merge_reason([q4, q8])
    assert reason is not None and "different low-bit formats" in reason
    with pytest.raises(ValueError, match="different low-bit formats"):
        quantized.merge_quantized([q4, q8])


@pytest.mark.parametrize("rows", [80, 1030])
def test_rows_unpack_from_torchs_packing_alone(rows: int) -> None:
    """`lowbit.int4_rows` gives the codes of any rows (whole blocks of the packing and the pairwise tail) as packed."""
    codes = torch.randint(0, 16, (rows, 96), generator=torch.Generator().manual_seed(rows), dtype=torch.uint8)
    weight = lowbit.pack_int4(codes, torch.rand(rows, 3), torch.rand(rows, 3), 32, torch.bfloat16)
    ids = torch.tensor([0, 1, 31, 32, 63, 64, 65, rows - 2, rows - 1, 5, 5])
    assert torch.equal(lowbit.int4_rows(weight, ids), codes[ids])
    assert torch.equal(lowbit.int4_rows_reference(weight, ids), codes[ids]), "the C path and its reference"
    assert lowbit.int4_rows(weight, ids[:0]).shape == (0, 96)
    with pytest.raises(IndexError, match="row ids"):
        lowbit.int4_rows(weight, torch.tensor([rows]))


def test_slices_of_whole_blocks_concatenate_as_packed_and_others_are_packed_again(monkeypatch) -> None:
    """`concat_rows` of slices in whole blocks of torch's packing concatenates their packed bytes (nothing unpacked)
    and equals packing the whole weight; slices in another order (a short one first) are packed again and equal
    packing their rows in that order."""
    codes = torch.randint(0, 16, (200, 64), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    scales, zeros = torch.rand(200, 2), torch.rand(200, 2)
    cuts = (slice(0, 128), slice(128, 192), slice(192, 200))
    parts = [lowbit.pack_int4(codes[s], scales[s], zeros[s], 32, torch.bfloat16) for s in cuts]
    unpacked = lowbit.int4_codes
    with monkeypatch.context() as patched:
        patched.setattr(lowbit, "int4_codes", lambda w: pytest.fail("whole blocks were unpacked"))
        joined = lowbit.concat_rows(parts)
    whole = lowbit.pack_int4(codes, scales, zeros, 32, torch.bfloat16)
    assert isinstance(joined, lowbit.Int4Weight) and (joined.out_features, joined.in_features) == (200, 64)
    assert torch.equal(joined.packed, whole.packed) and torch.equal(joined.scales_and_zeros, whole.scales_and_zeros)
    calls = []
    monkeypatch.setattr(lowbit, "int4_codes", lambda w: calls.append(w) or unpacked(w))
    reordered = lowbit.concat_rows([parts[2], parts[0]])
    rows = torch.cat([torch.arange(192, 200), torch.arange(0, 128)])
    expected = lowbit.pack_int4(codes[rows], scales[rows], zeros[rows], 32, torch.bfloat16)
    assert len(calls) == 2 and isinstance(reordered, lowbit.Int4Weight)
    assert torch.equal(reordered.packed, expected.packed)
    assert torch.equal(reordered.scales_and_zeros, expected.scales_and_zeros)


def test_a_tied_table_installed_by_slices_is_the_whole_tables_head_and_lookup(tmp_path: Path) -> None:
    """The loader's tied table, read 1,024 rows at a time (1,100 rows: a short last slice at its own offset): the
    head packs exactly as the whole table would, and the embedding's rows are gguf-py's values."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    rows, cols = 1100, 64
    q8 = quants.quantize(np.random.default_rng(5).standard_normal((rows, cols)).astype(np.float32), GGML.Q8_0)
    path = tmp_path / "tied.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_tensor("token_embd.weight", q8, raw_dtype=GGML.Q8_0)
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        step()
    writer.close()
    (info,) = gguf_weights.read_index(path)[1]
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=rows, hidden_size=cols, num_hidden_layers=1,
                                                             num_attention_heads=2, intermediate_size=32))
    numerics = gguf_model._Numerics(torch.float32, torch.bfloat16, quantized.WEIGHT_ONLY)
    assert gguf_model._install_tied_by_slices(model, path, info, numerics)
    whole = gguf_weights.decode(gguf_weights.read(path, info), info)
    assert isinstance(whole, Q8Codes)
    expected = quantized.packed_from_codes(whole, None, torch.bfloat16)
    for ours, theirs in zip(model.lm_head.parts, expected.parts, strict=True):
        assert torch.equal(ours.packed, theirs.packed) and torch.equal(ours.scales_and_zeros, theirs.scales_and_zeros)
    ids = torch.tensor([[0, 1023, 1024, 1099, 17]])
    reference = torch.from_numpy(quants.dequantize(q8, GGML.Q8_0).reshape(rows, cols))
    assert torch.equal(model.model.embed_tokens(ids)[0], reference[ids[0]])


@pytest.mark.parametrize("kind", [GGML.Q4_1, GGML.Q8_0])
def test_a_tied_table_read_from_the_packed_head_dequantizes_as_the_file_does(kind: GGML) -> None:
    """The embedding of a tied head holds no codes of its own (`PackedTable`): its rows, read from the head's packed
    halves, dequantize to the file's values bit for bit (rows in whole blocks and in the tail)."""
    rows = 1030  # (over `REQUANTIZE_ROWS`: the head is packed in slices, then stacked)
    table = gguf_weights.decode(random_blocks(kind, rows, 96, seed=3), TensorInfo("t", kind, (rows, 96), 0))
    assert isinstance(table, Int4Codes | Q8Codes)
    head = quantized.packed_from_codes(table, None, torch.bfloat16)
    packed = quantized.PackedTable.of(head, table.scales, table.zeros if isinstance(table, Int4Codes) else None)
    assert packed.shape == (rows, 96)
    ids = torch.tensor([0, 63, 64, 1023, 1024, 1029, 7])
    assert torch.equal(packed.rows(ids).dequantize(), table.rows(ids).dequantize())
    embedding = quantized.QuantizedEmbedding(packed, torch.float32)
    assert torch.equal(embedding(ids[None]), table.rows(ids).dequantize()[None])
    assert packed.nbytes < table.nbytes / 4  # the scales alone
    if native_cpu.load() is not None:  # the lookup is one C call (`lowbit.table_rows`), the same floats
        found = lowbit.table_rows(packed.parts, ids, packed.scales, packed.zeros, 32)
        assert found is not None and torch.equal(found, table.rows(ids).dequantize())
        for bad in (rows, -1):
            with pytest.raises(IndexError, match="row ids"):
                embedding(torch.tensor([[3, bad]]))
