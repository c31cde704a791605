"""Configuration: defaults documented in config/streamd.toml, precedence, errors naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from streamd.config import Config, ConfigError, load_config

ROOT = Path(__file__).resolve().parent.parent


def test_shipped_toml_documents_every_default() -> None:
    assert load_config(ROOT / "config" / "streamd.toml", environ={}) == Config()
    text = (ROOT / "config" / "streamd.toml").read_text()
    for section, values in Config().to_dict().items():
        assert f"[{section}]" in text
        for key in values:
            assert f"{key} =" in text, f"{section}.{key} is not documented in config/streamd.toml"


def test_precedence_defaults_file_env_overrides(tmp_path: Path) -> None:
    file = tmp_path / "s.toml"
    file.write_text("[cache]\nblock_size = 32\nwatermark = 0.05\n[server]\nport = 9000\n")
    env = {"STREAMD_CACHE__BLOCK_SIZE": "64", "STREAMD_SERVER__API_KEYS": "a,b"}
    config = load_config(file, overrides={"cache.block_size": 128}, environ=env)
    assert config.cache.block_size == 128  # flag beats env beats file
    assert config.cache.watermark == 0.05  # from the file
    assert config.server.port == 9000
    assert config.server.api_keys == ["a", "b"]  # from the environment
    assert load_config(file, environ=env).cache.block_size == 64
    assert load_config(overrides={"max_num_seqs": 3}, environ={}).scheduler.max_num_seqs == 3


@pytest.mark.parametrize("kwargs, needle", [
    ({"overrides": {"cache.blok_size": 16}}, "cache.blok_size"),
    ({"overrides": {"nonsense": 1}}, "nonsense"),
    ({"overrides": {"block_size": 17}}, "cache.block_size"),
    ({"overrides": {"watermark": "high"}}, "cache.watermark"),
    ({"overrides": {"preemption_mode": "pray"}}, "scheduler.preemption_mode"),
    ({"overrides": {"dtype": "int3"}}, "model.dtype"),
    ({"environ": {"STREAMD_SCHEDULER__MAX_NUM_SEQS": "0"}}, "scheduler.max_num_seqs"),
    ({"environ": {"STREAMD_BOGUS__X": "1"}}, "bogus"),
])
def test_bad_keys_and_values_name_the_key(kwargs: dict, needle: str) -> None:
    kwargs.setdefault("environ", {})
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        load_config(**kwargs)


def test_bad_file_is_named(tmp_path: Path) -> None:
    file = tmp_path / "bad.toml"
    file.write_text("[cache]\nblock_size = 16\n[nope]\nx = 1\n")
    with pytest.raises(ConfigError, match="nope"):
        load_config(file, environ={})
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml", environ={})


def test_engine_process_auto_is_on_only_with_one_cuda_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """`server.engine_process = "auto"` (the default) puts the engine in its own process where the model runs on
    CUDA with one GPU; on the CPU and under tensor parallelism it stays on a thread; a bool decides alone."""
    import torch

    assert load_config(environ={}).server.engine_process == "auto"
    assert load_config(overrides={"model.device": "cpu"}, environ={}).engine_in_own_process() is False
    assert load_config(overrides={"model.device": "cpu", "server.engine_process": True},
                       environ={}).engine_in_own_process() is True
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert load_config(environ={}).engine_in_own_process() is True  # model.device "auto" resolves to cuda
    assert load_config(overrides={"server.engine_process": False}, environ={}).engine_in_own_process() is False
    assert load_config(overrides={"parallel.tensor_parallel_size": 2}, environ={}).engine_in_own_process() is False
    with pytest.raises(ConfigError, match=r"server\.engine_process"):
        load_config(overrides={"server.engine_process": "sometimes"}, environ={})
    with pytest.raises(ConfigError, match=r"server\.engine_process does not support parallel\.tensor_parallel_size"):
        load_config(overrides={"server.engine_process": True, "parallel.tensor_parallel_size": 2}, environ={})
