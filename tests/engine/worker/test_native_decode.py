"""`model.fuse_layers = "native"` (engine/worker/native_decode.py): a low-bit model's decode steps of few
sequences run the C glue between torch's matmuls and give the greedy tokens of the `cpu` path's torch operators
(prompt chunks and wider batches still take the torch path): on the default model exactly; on random tiny
models, whose bfloat16 logits often tie, up to a near-tie of the torch path's top two. `auto` picks it on the
CPU, and where the library cannot be built `auto` falls back to `cpu` while a named `native` says why."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from streamd import LLM, SamplingParams
from streamd.engine.worker import native_decode
from streamd.engine.worker.fusion import FusedDecoder, RotaryTable, fuse_layers
from streamd.kernels import native_cpu
from tests.helpers import register_engine, run_to_completion, tiny_arch_config

needs_library = pytest.mark.skipif(native_cpu.load() is None, reason=f"{native_cpu.unavailable_reason()}")
KWARGS = dict(device="cpu", dtype="float32", num_swap_blocks=0, max_step_ms=0, num_kv_blocks=120, block_size=8,
              seed=11)  # fmt: skip


def _config():
    return tiny_arch_config("llama", hidden_size=96, intermediate_size=200, num_attention_heads=6, qwen3_head_dim=24)


@needs_library
@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_native_decode_steps_give_the_cpu_paths_tokens(quantization: str, monkeypatch) -> None:
    """Six prompts of 1-150 tokens, at most 2 and then 6 at once, with the context bound lowered to 300 tokens:
    decode steps within it run natively (counted), wider ones and prompt chunks past it on the torch operators;
    the tokens are the same."""
    config = _config()
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, config.vocab_size, (int(n),), generator=gen).tolist()
               for n in torch.randint(1, 150, (6,), generator=gen)]  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, detokenize=False, logprobs=5)
    native_rows = _native_rows(monkeypatch, decode_steps=True)
    monkeypatch.setattr(native_decode, "MAX_CONTEXT_TOKENS", 300)
    wide: list[int] = []
    takes = native_decode.NativeDecode.takes

    def seen(md, rows, dtype):
        wide.append(int(md.decode_only and md.seq_lens.sum() > 300))
        return takes(md, rows, dtype)

    monkeypatch.setattr(native_decode.NativeDecode, "takes", staticmethod(seen))
    outs = {}
    for mode in ("cpu", "native"):
        for seqs in (2, 6):
            llm = LLM(config, fuse_layers=mode, quantization=quantization, max_num_seqs=seqs, **KWARGS)
            register_engine(llm.engine)
            assert (llm.engine.runner.model.model.native is not None) == (mode == "native")
            outs[mode, seqs] = [o.outputs[0] for o in run_to_completion(llm.engine, prompts, params)]
    for seqs in (2, 6):
        for torch_path, native in zip(outs["cpu", seqs], outs["native", seqs]):
            _same_up_to_a_near_tie(torch_path, native)
    assert len(native_rows) >= 20 and any(wide), "decode steps ran natively, and wider ones did not"
    assert len(native_rows) + sum(wide) >= 2 * 15, "every decode step was one or the other"


@needs_library
def test_an_int8_pool_runs_natively_and_gives_the_cpu_paths_tokens(monkeypatch) -> None:
    """`cache.kv_cache_dtype = "int8"`: decode steps and short prompt chunks read and write the 8-bit pool in C (codes
    and scales as the references store them), and the tokens are the torch path's over the same pool."""
    config = _config()
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, config.vocab_size, (int(n),), generator=gen).tolist() for n in (5, 40, 90)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, detokenize=False, logprobs=5)
    native_rows = _native_rows(monkeypatch, decode_steps=True)
    outs = {}
    for mode in ("cpu", "native"):
        llm = LLM(config, fuse_layers=mode, quantization="int4", kv_cache_dtype="int8", max_num_seqs=3, **KWARGS)
        register_engine(llm.engine)
        assert llm.engine.runner.pool is not None and llm.engine.runner.pool.kv_scales is not None
        outs[mode] = [o.outputs[0] for o in run_to_completion(llm.engine, prompts, params)]
    for torch_path, native in zip(outs["cpu"], outs["native"]):
        _same_up_to_a_near_tie(torch_path, native)
    assert len(native_rows) >= 15, "the int8 pool's decode steps ran natively"


def _native_rows(monkeypatch, decode_steps: bool) -> list[int]:
    """The rows of every step `NativeDecode.run` runs from now on (`decode_steps` False: only steps that are not
    decode steps: verifies, prompt chunks), in order."""
    rows: list[int] = []
    run = native_decode.NativeDecode.run

    def counted(self, md, hidden, cos, sin):
        if decode_steps or not md.decode_only:
            rows.append(hidden.shape[0])
        return run(self, md, hidden, cos, sin)

    monkeypatch.setattr(native_decode.NativeDecode, "run", counted)
    return rows


def _same_up_to_a_near_tie(torch_path, native, margin: float = 0.05) -> None:
    """The tokens are equal, or first differ where the torch path gave the native token a log-probability within
    `margin` of its best (a near-tie: a bfloat16 logit's rounding step is 0.03 near 4, 0.125 near 20)."""
    for i, (want, got) in enumerate(zip(torch_path.token_ids, native.token_ids)):
        if want != got:
            top = torch_path.logprobs[i]
            assert got in top and top[want] - top[got] <= margin, f"diverged at {i}: {got} against {top}"
            return


@needs_library
def test_the_default_models_greedy_tokens_equal_the_cpu_paths() -> None:
    """The default GGUF (Q4_1 layers, Q8_0 head): five prompts x 48 tokens, natively and on torch's operators.
    Its head's logits are bfloat16 (a step of 0.125-0.25 at their size), so the two likeliest tokens often tie
    exactly, and one path's last-bit difference breaks the tie the other way: the first difference is at most one
    step of 0.25 apart (the native attention's outputs equal the exactly rounded ones as often as the torch path's:
    benchmarks/NOTES.md, "Issue 25, nineteenth session")."""
    prompts = ["The capital of France is", "Write a short poem about the sea.", "def fibonacci(n):",
               "List three colors:", "Once upon a time, in a land far away,"]  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, logprobs=5)
    outs = {}
    for mode in ("cpu", "native"):
        llm = LLM(device="cpu", num_swap_blocks=0, num_kv_blocks=128, max_step_ms=0, fuse_layers=mode, seed=3)
        register_engine(llm.engine)
        decode = llm.engine.runner.model.model.native
        assert (decode is not None and decode.whole) == (mode == "native" and native_cpu.int4_matmul() is not None)
        outs[mode] = [o.outputs[0] for o in llm.generate(prompts, params)]
    for torch_path, native in zip(outs["cpu"], outs["native"]):
        _same_up_to_a_near_tie(torch_path, native, margin=0.26)


@needs_library
@pytest.mark.skipif(native_cpu.int4_matmul() is None, reason="no AVX-512 BF16: the matmuls stay torch's")
def test_whole_layers_in_one_call_give_the_seven_calls_bits(monkeypatch) -> None:
    """A model whose widths are whole 64-row blocks (every matmul in C): each layer as one `decode_layer` call
    gives the Python loop's tokens and log-probabilities bit for bit (the same C, in the same order), and the
    default model runs that way."""
    config = tiny_arch_config("llama", hidden_size=128, intermediate_size=256, num_attention_heads=4,
                              qwen3_head_dim=32)  # fmt: skip
    config.num_key_value_heads = 2  # q/k/v 128 + 64 + 64 rows
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, config.vocab_size, (int(n),), generator=gen).tolist() for n in (5, 40, 17)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, detokenize=False, logprobs=3)
    outs = []
    for whole in (True, False):
        if not whole:
            monkeypatch.setattr(native_decode, "_layer_args", lambda *args: None)
        llm = LLM(config, fuse_layers="native", quantization="int4", max_num_seqs=3, **KWARGS)
        register_engine(llm.engine)
        decode = llm.engine.runner.model.model.native
        assert decode is not None and decode.whole == whole
        outs.append([o.outputs[0] for o in run_to_completion(llm.engine, prompts, params)])
    for one_call, seven_calls in zip(*outs):
        assert one_call.token_ids == seven_calls.token_ids and one_call.logprobs == seven_calls.logprobs


@needs_library
def test_prompt_chunks_of_up_to_max_query_rows_run_natively(monkeypatch) -> None:
    """Three prompts of 40, 60 and 30 tokens admitted together: their chunks (130 rows, each over its own prefix)
    run natively in one step; with the bound lowered below 130 the same step runs on the torch operators. The
    tokens are the `cpu` path's up to a near-tie."""
    config = _config()
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in (40, 60, 30)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False, logprobs=5)
    prompt_rows = _native_rows(monkeypatch, decode_steps=False)
    outs = {}
    for mode, bound in (("native", native_decode.MAX_QUERY_ROWS), ("native", 129), ("cpu", 0)):
        monkeypatch.setattr(native_decode, "MAX_QUERY_ROWS", bound)
        llm = LLM(config, fuse_layers=mode, quantization="int4", max_num_seqs=3, **KWARGS)
        register_engine(llm.engine)
        outs[mode, bound] = [o.outputs[0] for o in run_to_completion(llm.engine, prompts, params)]
        if mode == "native":
            assert (130 in prompt_rows) == (bound >= 130), prompt_rows
            prompt_rows.clear()
    for native in (outs["native", native_decode.NATIVE_DENSE_ROWS], outs["native", 129]):
        for torch_path, got in zip(outs["cpu", 0], native):
            _same_up_to_a_near_tie(torch_path, got)


@needs_library
@pytest.mark.parametrize("model_type", ["llama", "mistral"])
def test_decode_steps_skip_transformers_wrappers_and_keep_the_bits(model_type: str, monkeypatch) -> None:
    """The runner's native decode steps go from the token ids to the logits without the causal LM's and the base
    model's forwards (counted: they run only for prompt chunks), and give the tokens and log-probabilities that
    the same native layers give called through those wrappers, bit for bit. A short prompt that asks for its
    prompt logprobs (a chunk the native path would take) goes through the wrappers, which compute them."""
    config = tiny_arch_config(model_type, hidden_size=96, intermediate_size=200, num_attention_heads=6,
                              qwen3_head_dim=24)  # fmt: skip
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, config.vocab_size, (int(n),), generator=gen).tolist() for n in (3, 30, 11)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, detokenize=False, logprobs=4)
    outs, wrapped = [], []
    for direct in (True, False):
        llm = LLM(config, fuse_layers="native", quantization="int4", max_num_seqs=3, **KWARGS)
        runner = register_engine(llm.engine).runner
        assert runner.native is not None
        if not direct:
            runner.native = None
        forward = type(runner.model).forward
        monkeypatch.setattr(type(runner.model), "forward", _counted(forward, wrapped, direct))
        outs.append(run_to_completion(llm.engine, prompts, params))
        outs[-1] += run_to_completion(llm.engine, prompts[:1], replace(params, prompt_logprobs=2))  # alone in its step
        monkeypatch.undo()
    assert wrapped.count(True) <= len(prompts) + 1 < wrapped.count(False), "only prompts went through transformers"
    assert outs[0][-1].prompt_logprobs is not None and outs[0][-1].prompt_logprobs == outs[1][-1].prompt_logprobs
    for direct_out, wrapped_out in zip(*outs):
        one, other = direct_out.outputs[0], wrapped_out.outputs[0]
        assert one.token_ids == other.token_ids and one.logprobs == other.logprobs


def test_the_rotary_table_gives_the_modules_rows_bit_for_bit() -> None:
    """`RotaryTable`: rows for scattered positions, before and after the table grows past its first size, equal the
    rotary module's own output for those positions alone; a rope type whose rows depend on the batch ("dynamic")
    calls the module every time."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = tiny_arch_config("llama", hidden_size=96, intermediate_size=200, num_attention_heads=6, qwen3_head_dim=24)
    rotary = LlamaRotaryEmbedding(config)
    table = RotaryTable(rotary)
    hidden = torch.zeros(3, 96)
    for positions in ([0, 5, 511], [700, 3, 1500]):
        cos, sin = table(hidden, torch.tensor(positions))
        for i, p in enumerate(positions):
            want_cos, want_sin = rotary(hidden[None, :1], torch.tensor([[p]]))
            assert torch.equal(cos[i], want_cos[0, 0]) and torch.equal(sin[i], want_sin[0, 0])
    assert table.cos is not None and len(table.cos) >= 1501
    rotary.rope_type = "dynamic"
    dynamic = RotaryTable(rotary)
    cos, _ = dynamic(hidden, torch.tensor([1, 2, 3]))
    assert (
        not dynamic.static
        and dynamic.cos is None
        and torch.equal(cos, rotary(hidden[None], torch.tensor([[1, 2, 3]]))[0][0])
    )


def _counted(forward, calls: list[bool], label: bool):
    def counted(*args, **kwargs):
        calls.append(label)
        return forward(*args, **kwargs)

    return counted


def test_row_view_makes_each_query_token_a_row_over_its_own_prefix() -> None:
    """Three sequences of 3, 1 and 5 query tokens with 10, 1 and 5 tokens of context (this step's included):
    each token attends over its position + 1, through its sequence's block table."""
    tables = torch.tensor([[4, 5], [6, 0], [7, 8]], dtype=torch.int32)
    md = native_decode.AttentionMetadata(
        kv_cache=torch.empty(0), slot_mapping=torch.arange(9), block_tables=tables,
        seq_lens=torch.tensor([10, 1, 5], dtype=torch.int32), query_start_loc=torch.tensor([0, 3, 4, 9], dtype=torch.int32),
        decode_only=False, ops=torch,
    )  # fmt: skip
    rows, lens = native_decode.row_view(md)
    assert lens.tolist() == [8, 9, 10, 1, 1, 2, 3, 4, 5] and lens.dtype == torch.int32
    assert torch.equal(rows, tables[[0, 0, 0, 1, 2, 2, 2, 2, 2]])


@needs_library
def test_speculative_verifies_run_natively_and_keep_the_tokens(monkeypatch) -> None:
    """Prompt lookup on prompts that repeat themselves: the verify steps (k + 1 query tokens a sequence) run
    natively, and the greedy tokens are those of the `cpu` path with speculation on, up to a near-tie."""
    config = _config()
    gen = torch.Generator().manual_seed(2)
    motifs = [torch.randint(0, config.vocab_size, (int(n),), generator=gen).tolist() for n in (6, 9)]
    prompts = [motif * 8 for motif in motifs]  # n-grams to look up
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, detokenize=False, logprobs=5)
    wide_rows = _native_rows(monkeypatch, decode_steps=False)
    outs = {}
    for mode in ("cpu", "native"):
        llm = LLM(config, fuse_layers=mode, quantization="int4", prompt_lookup=True, **KWARGS)
        register_engine(llm.engine)
        outs[mode] = [o.outputs[0] for o in run_to_completion(llm.engine, prompts, params)]
    assert any(rows > len(prompts) for rows in wide_rows), "a verify of several query tokens ran natively"
    for torch_path, native in zip(outs["cpu"], outs["native"]):
        _same_up_to_a_near_tie(torch_path, native)


@needs_library
def test_auto_picks_native_on_the_cpu_for_a_low_bit_model() -> None:
    llm = register_engine(LLM(_config(), quantization="int4", **KWARGS).engine)
    decoder = llm.runner.model.model
    assert isinstance(decoder, FusedDecoder) and decoder.native is not None


def test_without_the_library_auto_runs_the_cpu_path_and_native_says_why(monkeypatch, tmp_path) -> None:
    """No compiler: `load()` gives None, `auto` keeps the torch operators, a named `native` is refused with the
    reason."""
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("STREAMD_NATIVE_DIR", str(tmp_path))
    monkeypatch.setattr(native_cpu, "SOURCE", tmp_path / "native" / "cpu_decode.c")  # no library beside it either
    monkeypatch.setattr(native_cpu, "SOURCES", (native_cpu.SOURCE,))
    (tmp_path / "native").mkdir()
    (tmp_path / "native" / "cpu_decode.c").write_text("void f(void) {}\n")
    native_cpu.load.cache_clear()
    try:
        assert native_cpu.load() is None and "failed" in str(native_cpu.unavailable_reason())
        llm = register_engine(LLM(_config(), quantization="int4", fuse_layers="off", **KWARGS).engine)
        model = llm.runner.model
        with pytest.raises(ValueError, match="native"):
            fuse_layers(model, "native", torch.device("cpu"))
        assert fuse_layers(model, "auto", torch.device("cpu")) == "cpu"
        assert model.model.native is None
    finally:
        native_cpu.load.cache_clear()
