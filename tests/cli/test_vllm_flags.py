"""`streamd serve` takes `vllm serve`'s command line: a positional model and vLLM's flags, generated from the
config's keys, parse into the configuration they name; vLLM flags streamd does not support are refused by
name with the reason; `--help` groups the flags by config section. No test here loads a model."""

from __future__ import annotations

import argparse

import pytest

from streamd.cli.main import build_parser
from streamd.cli.serve import positional_model
from streamd.cli.settings import REFUSED, load_settings
from streamd.config import SECTIONS, Config, ConfigError
from tests.cli.test_cli import assert_one_line_error, streamd

VLLM_LINE = ("serve Qwen/Qwen2.5-0.5B-Instruct --max-model-len 8192 -tp 2 --api-key K --served-model-name a b "
             "--gpu-memory-utilization 0.85 --dtype bfloat16 --chat-template T --enable-prefix-caching "
             "--host 0.0.0.0 --port 9000 --max-num-seqs 64 --max-num-batched-tokens 4096 --block-size 32 "
             "--swap-space 2 --seed 7 --enforce-eager --trust-remote-code --uvicorn-log-level warning "
             "--reasoning-parser deepseek_r1")


def parse(line: str) -> tuple[argparse.Namespace, Config]:
    args = build_parser().parse_args(line.split())
    return args, load_settings(args, {"model.name": positional_model(args)})


@pytest.fixture(autouse=True)
def _no_settings_in_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in [n for n in os.environ if n.startswith("STREAMD_") or n == "VLLM_API_KEY"]:
        monkeypatch.delenv(name)


def test_a_vllm_serve_line_parses_into_the_settings_it_names() -> None:
    _, config = parse(VLLM_LINE)
    assert config.model.name == "Qwen/Qwen2.5-0.5B-Instruct"
    assert (config.model.max_model_len, config.model.dtype, config.model.chat_template) == (8192, "bfloat16", "T")
    assert (config.model.seed, config.model.enforce_eager) == (7, True)
    assert config.parallel.tensor_parallel_size == 2
    assert config.server.api_keys == ["K"] and config.server.served_model_name == ["a", "b"]
    assert (config.server.host, config.server.port) == ("0.0.0.0", 9000)
    assert (config.cache.gpu_memory_utilization, config.cache.block_size, config.cache.swap_space_gib) == (0.85, 32, 2.0)
    assert config.cache.enable_prefix_caching is True
    assert (config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens) == (64, 4096)
    assert config.logging.level == "warning"


def test_flags_beat_set_and_keep_the_other_spellings() -> None:
    _, config = parse("serve --set cache.block_size=64 --block-size 8 --no-enable-prefix-caching --tp 3 "
                      "--dtype half --uvicorn-log-level trace --allowed-origins [\"*\"] --api-key k1,k2 --api-key k3")
    assert config.cache.block_size == 8 and config.cache.enable_prefix_caching is False
    assert config.parallel.tensor_parallel_size == 3 and config.model.dtype == "float16"
    assert config.logging.level == "debug"  # vLLM's trace: the most detailed level streamd has
    assert config.server.allowed_origins == ["*"] and config.server.api_keys == ["k1", "k2", "k3"]
    _, config = parse("serve --set cache.block_size=64 --model /m")
    assert config.cache.block_size == 64 and config.model.name == "/m"


def test_every_config_key_has_a_flag() -> None:
    args = build_parser().parse_args(["serve"])
    flags = {key for key in vars(args) if "." in key}
    assert flags == {f"{s}.{k}" for s, keys in Config().to_dict().items() for k in keys}


def test_two_different_models_are_refused() -> None:
    with pytest.raises(ConfigError, match="two models"):
        parse("serve /a --model /b")


@pytest.mark.parametrize("flag", ["--pipeline-parallel-size 2", "-pp 2",
                                  "--enable-lora", "--tokenizer other/tok"])
def test_an_unsupported_vllm_flag_is_refused_by_name(flag: str) -> None:
    name = flag.split(maxsplit=1)[0]
    result = streamd("serve", "/no/such/model", *flag.split())
    assert_one_line_error(result, name, "not supported by streamd")
    reason = next(why for names, why in REFUSED.items() if name in names)
    assert reason.split()[0] in result.stderr


def test_help_groups_the_flags_by_section() -> None:
    result = streamd("serve", "--help")
    assert result.returncode == 0
    sections = [line.split("]")[0] + "]" for line in result.stdout.splitlines() if line.startswith("[")]
    assert sections == [f"[{s}]" for s in SECTIONS]
    text = result.stdout
    server = text[text.index("[server] settings"):text.index("[logging] settings")]
    assert "--api-key" in server and "--served-model-name" in server and "--max-model-len" not in server
    assert "--enable-lora" not in text  # refused flags are not offered
    cache = text[text.index("[cache] settings"):text.index("[scheduler] settings")]
    assert "--kv-cache-dtype" in cache


def test_generate_shares_the_engine_flags() -> None:
    args = build_parser().parse_args(["generate", "--max-model-len", "512", "--block-size", "32", "-tp", "1", "--threads", "2", "hi"])
    config = load_settings(args)
    assert (config.model.max_model_len, config.cache.block_size, config.model.num_threads) == (512, 32, 2)
    assert not hasattr(args, "server.port")
    assert_one_line_error(streamd("generate", "--enable-lora", "hi"), "--enable-lora")


@pytest.mark.parametrize("flags, value", [(["--kv-cache-dtype", "fp8_e4m3"], "fp8"), (["--kv-cache-dtype", "int8"], "int8"),
                                          ([], "auto")])
def test_kv_cache_dtype_takes_vllms_flag_and_its_fp8_spelling(flags: list[str], value: str) -> None:
    assert load_settings(build_parser().parse_args(["generate", *flags, "hi"])).cache.kv_cache_dtype == value


def test_a_kv_cache_dtype_streamd_lacks_is_refused_naming_the_key() -> None:
    assert_one_line_error(streamd("generate", "--kv-cache-dtype", "fp8_e5m2", "hi"), "cache.kv_cache_dtype")


@pytest.mark.parametrize("flags, value", [(["--quantization", "int4"], "int4"), (["-q", "int8"], "int8"),
                                          (["--quantization", "gguf"], "auto"), ([], "auto")])
def test_quantization_takes_vllms_flag_and_its_gguf_spelling(flags: list[str], value: str) -> None:
    assert load_settings(build_parser().parse_args(["generate", *flags, "hi"])).model.quantization == value


def test_a_quantization_method_streamd_lacks_is_named_with_the_ones_it_has() -> None:
    assert_one_line_error(streamd("generate", "--quantization", "awq", "hi"), "model.quantization", "int4")


@pytest.mark.parametrize("variable, needle", [
    ("STREAMD_SERVER__API_KEY", "did you mean server.api_keys"),
    ("STREAMD_SERVER_API_KEYS", "did you mean STREAMD_SERVER__API_KEYS"),
    ("STREAMD_API_KEYS", "did you mean STREAMD_SERVER__API_KEYS"),
])
def test_a_misspelled_setting_in_the_environment_stops_the_start(variable: str, needle: str) -> None:
    result = streamd("serve", "--set", "model.name=/no/such/model", env={variable: "secret"})
    assert_one_line_error(result, variable, needle)


@pytest.mark.parametrize("flags, expected", [
    (["--draft-model", "/d"], ("/d", False, 8)),
    (["--speculative-model", "/d"], ("/d", False, 8)),
    (["--speculative-config", '{"model": "/d", "num_speculative_tokens": 5}'], ("/d", False, 5)),
    (["--speculative-config", '{"method": "draft_model", "model": "/d"}'], ("/d", False, 8)),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}'], ("", True, 3)),
])
def test_a_draft_model_is_named_by_its_flag_or_vllms_speculative_config(flags: list[str], expected: tuple) -> None:
    args = build_parser().parse_args(["serve", "/m", *flags])
    spec = load_settings(args, {"model.name": positional_model(args)}).speculative
    assert (spec.draft_model, spec.prompt_lookup, spec.num_speculative_tokens) == expected


@pytest.mark.parametrize("value, needle", [('{"method": "eagle", "model": "/d"}', "'eagle'"),
                                           ('{"model": "/d", "draft_tensor_parallel_size": 1}', "draft_tensor_parallel_size"),
                                           ("/d", "JSON")])
def test_a_speculative_config_streamd_cannot_run_is_refused_by_name(value: str, needle: str) -> None:
    assert_one_line_error(streamd("serve", "/no/such/model", "--speculative-config", value), "--speculative-config", needle)
