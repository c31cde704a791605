"""The weights' identity keys the disk tier's files: two models under one folder name, or one file rewritten,
must not share it; the same files must keep it (a restart finds its KV)."""

from __future__ import annotations

import os
from pathlib import Path

from streamd.engine.worker.weights_identity import random_identity, weights_identity
from tests.helpers import tiny_config


def checkpoint(parent: Path, weights: bytes) -> Path:
    folder = parent / "model"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(weights)
    return folder


def test_two_folders_of_one_name_differ_and_each_keeps_its_identity(tmp_path: Path) -> None:
    a, b = checkpoint(tmp_path / "a", b"x" * 10), checkpoint(tmp_path / "b", b"x" * 10)
    assert weights_identity(a) != weights_identity(b)
    assert weights_identity(a) == weights_identity(str(a))


def test_rewritten_weights_change_the_identity(tmp_path: Path) -> None:
    folder = checkpoint(tmp_path, b"x" * 10)
    file = folder / "model.safetensors"
    before, file_before = weights_identity(folder), weights_identity(file)
    file.write_bytes(b"y" * 11)
    assert weights_identity(folder) != before and weights_identity(file) != file_before
    rewritten = weights_identity(file)
    stat = file.stat()
    os.utime(file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))  # the same size, written again later
    assert weights_identity(file) != rewritten


def test_random_weights_are_named_by_config_and_seed() -> None:
    config = tiny_config()
    assert random_identity(config, 5) == random_identity(tiny_config(), 5)
    assert random_identity(config, 5) != random_identity(config, 6)
