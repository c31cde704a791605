"""Which layer of `streamd` may import which, checked on the source (tests/import_scan.py: every import
statement, inside functions and under TYPE_CHECKING included) and, for the torch-free core, in a fresh
interpreter as well.

The layers: `streamd.engine.core` is plain Python (scheduling and memory decisions testable in
milliseconds), so nothing it reaches imports torch or its kin. The engine serves the server, the CLI and
the benchmarks and knows none of them. The kernels know nothing of the engine that calls them. The server
sees the engine only through its public package (`from streamd.engine import X`), so the engine's rooms
can move without touching it. The benchmarks are a leaf: the CLI names them as a string for importlib,
which no import statement shows. No cycles: tests/test_import_graph.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tests.import_scan import ROOT, edges, graph, imports, modules


@dataclass(frozen=True, slots=True)
class Rule:
    """Modules under `importers` (the package itself included) import nothing under `forbidden`, except
    the modules named in `allowed`; importers under `exempt` are left alone."""

    importers: str
    forbidden: tuple[str, ...]
    allowed: tuple[str, ...] = ()
    exempt: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class LightRule:
    """Nothing reachable from the modules under `package` (its own modules included) imports `heavy`."""

    package: str
    heavy: tuple[str, ...]


RULES = (
    Rule("streamd.engine", ("streamd.server", "streamd.cli", "streamd.bench")),
    Rule("streamd.kernels", ("streamd.engine", "streamd.server", "streamd.cli", "streamd.bench")),
    Rule("streamd.server", ("streamd.engine", "streamd.cli", "streamd.bench"), allowed=("streamd.engine",)),
    Rule("streamd", ("streamd.bench",), exempt=("streamd.bench",)),
)
CORE_IS_LIGHT = LightRule("streamd.engine.core", ("torch", "triton", "transformers", "numpy"))

def _under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _under_any(name: str, packages: tuple[str, ...]) -> bool:
    return any(_under(name, p) for p in packages)


def broken(rule: Rule, import_graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """The (importer, imported) edges that break `rule`."""
    return {
        (importer, target)
        for importer, targets in import_graph.items()
        if _under(importer, rule.importers) and not _under_any(importer, rule.exempt)
        for target in targets
        if _under_any(target, rule.forbidden) and target not in rule.allowed
    }


def heavy_chains(rule: LightRule, known: dict[str, Path]) -> list[list[str]]:
    """For each module reached from `rule.package` that imports a heavy package: the import chain from a
    module of the package to it, ending with the heavy name it imports."""
    import_graph = graph(known)
    chain = {name: [name] for name in known if _under(name, rule.package)}
    todo = sorted(chain)
    while todo:
        name = todo.pop()
        for target in sorted(import_graph[name] - chain.keys()):
            chain[target] = chain[name] + [target]
            todo.append(target)
    found = []
    for name in sorted(chain):
        heavy = sorted(t for t in imports(name, known[name], known) if t.split(".")[0] in rule.heavy)
        found += [chain[name] + [h] for h in heavy]
    return found


def test_the_layers_keep_their_rules() -> None:
    import_graph = graph(modules())
    assert len(import_graph) > 40 and any(import_graph.values()), "the graph was not read"
    assert {rule.importers: broken(rule, import_graph) for rule in RULES} == {rule.importers: set() for rule in RULES}


def test_nothing_the_core_reaches_imports_torch() -> None:
    known = modules()
    assert sum(_under(name, CORE_IS_LIGHT.package) for name in known) > 5, "the core was not found"
    assert heavy_chains(CORE_IS_LIGHT, known) == []


def test_the_core_imports_without_torch_in_a_fresh_interpreter() -> None:
    """What the source scan cannot see: the packages Python initialises on the way (`streamd`,
    `streamd.engine`) and anything an import runs."""
    core = sorted(name for name in modules() if _under(name, CORE_IS_LIGHT.package))
    code = (
        f"import {', '.join(core)}\nimport sys\n"
        f"loaded = [m for m in {CORE_IS_LIGHT.heavy!r} if m in sys.modules]\nassert not loaded, loaded\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT.parent), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr


# ---- the checker itself, on a package of known imports ----------------------------------------------------

_SYNTHETIC = {
    "streamd/__init__.py": "",
    "streamd/config.py": "import json\n",
    "streamd/engine/__init__.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .worker import gpu\n",
    "streamd/engine/sampling_params.py": "import math\n",
    "streamd/engine/core/__init__.py": "",
    # keeps every rule: the vocabulary and the config
    "streamd/engine/core/ok.py": "from ..sampling_params import X\nfrom streamd import config\n",
    # reach torch and triton: a function-level import of a module that imports torch under TYPE_CHECKING;
    # the engine package, whose TYPE_CHECKING imports count like any other
    "streamd/engine/core/heavy.py": "def f():\n    from streamd.engine.worker.runner import Runner\n",
    "streamd/engine/core/public.py": "from streamd.engine import SamplingParams\n",
    "streamd/engine/worker/__init__.py": "",
    "streamd/engine/worker/runner.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch.nn\n",
    "streamd/engine/worker/gpu.py": "from triton import language as tl\n",
    "streamd/engine/leak.py": "from ..server import app\n",  # engine -> server
    "streamd/kernels/__init__.py": "import triton\n",  # heavy, but the core does not reach it
    "streamd/kernels/k.py": "import streamd.engine.sampling_params\n",  # kernels -> engine
    "streamd/server/__init__.py": "",
    # the public package is fine, a room of the engine is not
    "streamd/server/app.py": "from streamd.engine import LLMEngine\nfrom streamd.engine.core import ok\n",
    "streamd/server/ws.py": "def g():\n    import streamd.cli.main\n",  # server -> cli
    "streamd/cli/__init__.py": "",
    "streamd/cli/main.py": (
        "import importlib\nCOMMANDS = {'bench': 'streamd.bench'}\n"  # a string for importlib: no import
        "def h():\n    from streamd.bench import x\n"  # outside bench -> bench
    ),
    "streamd/bench/__init__.py": "from . import x\n",
    "streamd/bench/x.py": "from streamd.engine import core\nimport numpy\n",
}


def _synthetic(tmp_path: Path) -> dict[str, Path]:
    for rel, text in _SYNTHETIC.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return modules(tmp_path / "streamd")


def test_the_checker_finds_each_broken_rule(tmp_path: Path) -> None:
    import_graph = graph(_synthetic(tmp_path))
    assert {rule.importers: broken(rule, import_graph) for rule in RULES} == {
        "streamd.engine": {("streamd.engine.leak", "streamd.server.app")},
        "streamd.kernels": {("streamd.kernels.k", "streamd.engine.sampling_params")},
        "streamd.server": {("streamd.server.app", "streamd.engine.core.ok"), ("streamd.server.ws", "streamd.cli.main")},
        "streamd": {("streamd.cli.main", "streamd.bench.x")},
    }


def test_the_checker_follows_the_core_to_torch(tmp_path: Path) -> None:
    known = _synthetic(tmp_path)
    assert edges("streamd.engine.core.ok", known["streamd.engine.core.ok"], known) == {
        "streamd.config",
        "streamd.engine.sampling_params",
    }
    assert heavy_chains(CORE_IS_LIGHT, known) == [
        ["streamd.engine.core.public", "streamd.engine", "streamd.engine.worker.gpu", "triton"],
        ["streamd.engine.core.heavy", "streamd.engine.worker.runner", "torch.nn"],
    ]
