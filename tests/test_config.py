"""Configuration: defaults documented in config/streamd.toml, precedence, errors naming the key."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from streamd.config import RENAMED, Config, ConfigError, DeprecatedConfigKey, load_config

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
    ({"overrides": {"scheduler.catch_up_decodes": "wait"}}, "scheduler.catch_up_decodes"),
    ({"overrides": {"low_bit_matmul": "int4"}}, "model.low_bit_matmul"),
])
def test_bad_keys_and_values_name_the_key(kwargs: dict, needle: str) -> None:
    kwargs.setdefault("environ", {})
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        load_config(**kwargs)


@pytest.mark.parametrize("key, bad, edge", [
    ("scheduler.max_step_ms", -1.0, 0.0),  # 0: no step budget
    ("cache.swap_space_gib", -0.5, 0.0),
    ("cache.num_swap_blocks", -1, 0),
    ("server.max_connections_per_client", -1, 0),  # 0: no cap per address
    ("server.resume_grace_s", -1.0, 0.0),
    ("grammar.compile_timeout_s", 0.0, 0.1),
    ("server.ws_close_timeout_s", 0.0, 0.1),
    ("server.responses_store_ttl_s", 0.0, 0.1),
    ("server.keep_alive_timeout_s", 0, 1),
    ("grammar.max_concurrent_compiles_per_key", 0, 1),
])
def test_each_bound_refuses_past_its_edge(key: str, bad: float, edge: float) -> None:
    section, _, name = key.partition(".")
    assert getattr(getattr(load_config(overrides={key: edge}, environ={}), section), name) == edge
    with pytest.raises(ConfigError) as info:
        load_config(overrides={key: bad}, environ={})
    assert f"{key} must be {'>=' if edge == 0 else '>'} 0, got {bad!r}" in str(info.value)


def test_bad_file_is_named(tmp_path: Path) -> None:
    file = tmp_path / "bad.toml"
    file.write_text("[cache]\nblock_size = 16\n[nope]\nx = 1\n")
    with pytest.raises(ConfigError, match="nope"):
        load_config(file, environ={})
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml", environ={})


def test_engine_keys_are_checked() -> None:
    """`engine.process` is "auto" (the default) or a bool; with tensor parallelism it cannot be true yet (where
    "auto" puts the engine is the server's decision: tests/server/test_engine_layout.py). `engine.overlap_steps`
    likewise, "auto" resolving by the device."""
    assert load_config(environ={}).engine.process == "auto"
    assert load_config(overrides={"engine.process": True}, environ={}).engine.process is True
    assert load_config(environ={"STREAMD_ENGINE__BATCHES_AHEAD": "4"}).engine.batches_ahead == 4
    with pytest.raises(ConfigError, match=r"engine\.process"):
        load_config(overrides={"engine.process": "sometimes"}, environ={})
    with pytest.raises(ConfigError, match=r"engine\.batches_ahead"):
        load_config(overrides={"batches_ahead": 0}, environ={})
    with pytest.raises(ConfigError, match=r"engine\.process does not support parallel\.tensor_parallel_size"):
        load_config(overrides={"engine.process": True, "parallel.tensor_parallel_size": 2}, environ={})
    overlap = load_config(environ={}).engine
    assert overlap.overlaps_steps("cuda") and not overlap.overlaps_steps("cpu"), "auto: overlap on a GPU only"
    forced = load_config(overrides={"engine.overlap_steps": True}, environ={}).engine
    assert forced.overlaps_steps("cpu")
    with pytest.raises(ConfigError, match=r"engine\.overlap_steps"):
        load_config(overrides={"engine.overlap_steps": "sometimes"}, environ={})


@pytest.mark.parametrize("old, new, value", [
    ("server.engine_process", "engine.process", False),
    ("server.engine_batches_ahead", "engine.batches_ahead", 3),
])
def test_renamed_keys_still_work_with_a_warning_naming_the_new_one(tmp_path: Path, old: str, new: str,
                                                                   value: object) -> None:
    """An old name works for one release, in every place a key can be given, and warns naming the new key; its
    errors name the new key too. The new name is the only one in a loaded Config."""
    section, _, key = old.partition(".")
    new_section, _, new_key = new.partition(".")
    file = tmp_path / "old.toml"
    file.write_text(f"[{section}]\n{key} = {str(value).lower()}\n")
    given = [
        {"path": file},
        {"environ": {f"STREAMD_{section.upper()}__{key.upper()}": str(value).lower()}},
        {"overrides": {old: value}},
        {"overrides": {key: value}},  # bare
    ]
    for kwargs in given:
        with pytest.warns(DeprecatedConfigKey, match=rf"{old}.*deprecated.*{new}"):
            config = load_config(**{"environ": {}, **kwargs})
        assert getattr(getattr(config, new_section), new_key) == value, kwargs
    assert not hasattr(config.server, key)
    with pytest.warns(DeprecatedConfigKey), pytest.raises(ConfigError, match=new.replace(".", r"\.")):
        load_config(overrides={old: "nonsense"}, environ={})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new name: no warning
        assert getattr(getattr(load_config(overrides={new: value}, environ={}), new_section), new_key) == value


def test_renamed_keys_are_documented_under_their_new_names() -> None:
    text = (ROOT / "config" / "streamd.toml").read_text()
    for old, new in RENAMED.items():
        section, _, key = new.partition(".")
        assert key in Config().to_dict()[section], new
        assert old in text  # the note on the old name
        assert not any(line.startswith(f"{old.partition('.')[2]} =") for line in text.splitlines()), old


def test_the_config_module_is_plain_python() -> None:
    """Reading settings never loads torch or the engine: config.py imports nothing of the engine, not even
    inside a function, and importing it (and loading a Config) in a fresh interpreter loads no torch and no
    engine module beyond the vocabulary `import streamd` itself brings."""
    tree = ast.parse((ROOT / "streamd" / "config.py").read_text(encoding="utf-8"))
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not {m for m in imported if m.startswith(("streamd", "torch"))}, imported
    heavy, with_config = _fresh_modules("import streamd.config as c; c.load_config(environ={})")
    _, package_only = _fresh_modules("import streamd")
    assert heavy == "[]"
    assert with_config == package_only


def _fresh_modules(statement: str) -> tuple[str, str]:
    """After `statement` in a fresh interpreter: the torch/transformers modules loaded, the streamd.engine ones."""
    probe = (
        f"import sys; {statement}; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers'))); "
        "print(sorted(m for m in sys.modules if m.startswith('streamd.engine')))"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    heavy, engine = result.stdout.splitlines()
    return heavy, engine


def test_api_key_variables_add_to_the_server_keys() -> None:
    """STREAMD_API_KEY (what `streamd chat` reads) and vLLM's VLLM_API_KEY turn authentication on; a flag's keys
    replace them, as a flag beats the environment."""
    assert load_config(environ={"STREAMD_API_KEY": "s"}).server.api_keys == ["s"]
    both = {"VLLM_API_KEY": "v", "STREAMD_API_KEY": "s", "STREAMD_SERVER__API_KEYS": "a,b"}
    assert sorted(load_config(environ=both).server.api_keys) == ["a", "b", "s", "v"]
    assert load_config(overrides={"server.api_keys": ["f"]}, environ=both).server.api_keys == ["f"]
    assert load_config(environ={"STREAMD_API_KEY": "  "}).server.api_keys == []


@pytest.mark.parametrize("name, needle", [
    ("STREAMD_SERVER_API_KEYS", "did you mean STREAMD_SERVER__API_KEYS"),
    ("STREAMD_MAX_MODEL_LEN", "did you mean STREAMD_MODEL__MAX_MODEL_LEN"),
    ("STREAMD_CACHE_BLOCKSIZE", "did you mean STREAMD_CACHE__BLOCK_SIZE"),
    ("STREAMD_SERVER_NOTHING_LIKE_IT", "STREAMD_<SECTION>__<KEY>"),
    ("STREAMD_SERVER__API_KEY", "did you mean server.api_keys"),
])
def test_a_variable_that_looks_like_a_setting_is_refused(name: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=name) as info:
        load_config(environ={name: "x"})
    assert needle in str(info.value)


def test_other_streamd_variables_pass() -> None:
    from streamd.config import OTHER_VARIABLES

    load_config(environ={name: "1" for name in OTHER_VARIABLES} | {"STREAMD_MY_OWN_THING": "1"})


def test_caches_follow_xdg_cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from streamd.config import cache_path

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_path(None) == tmp_path / "streamd"
    assert cache_path("~/elsewhere") == Path("~/elsewhere").expanduser()
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")  # the XDG spec: only absolute paths count
    assert cache_path(None) == Path("~/.cache/streamd").expanduser()
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_path(None) == Path("~/.cache/streamd").expanduser()


@pytest.mark.parametrize(
    ("seqs", "budget", "rows"),
    [(256, 8192, 288), (8, 1024, 256), (8, 64, 64), (256, 128, 128)],  # seats and lent seats; GRAPH_ROWS; the budget
)
def test_the_decode_graphs_take_every_seat_and_at_least_graph_rows_within_the_step_budget(seqs, budget, rows) -> None:
    from streamd.config import SchedulerConfig

    assert SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=budget).graph_rows() == rows
