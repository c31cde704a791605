"""One owner per piece of engine state, checked on the source: every statement in `streamd/` that writes a
sequence's `status` or `num_computed_tokens` is in the scheduler, every one that writes a `block_table` is in
the block manager (a `window_table` in the hybrid layout's view of a sequence, which the block manager writes
through), and every one that changes a `token_ids` list in place is in `sequence.py` (through
`Sequence` methods everyone else calls). A write is an assignment (plain, augmented, in a tuple, through a
subscript), a `del`, a mutating list method called on the attribute, or `setattr` with the name."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "streamd"
MUTATORS = frozenset({"append", "extend", "insert", "pop", "remove", "clear", "sort", "reverse", "__setitem__"})
OWNERS = {
    "status": "engine/core/scheduler.py",
    "num_computed_tokens": "engine/core/scheduler.py",
    "block_table": "engine/core/block_manager.py",
    "window_table": "engine/core/hybrid_blocks.py",  # (`WindowSide`, the window group's view, which only the
    # block manager writes through)
    "token_ids": "engine/core/sequence.py",
}
# Attributes of these names on objects that are not sequences: the outputs handed to users (folded as they
# arrive) and an HTTP response's status code.
NOT_SEQUENCES = {
    ("engine/outputs.py", "choice.token_ids"),
    ("server/logprobs.py", "pending.token_ids"),
    ("bench/load.py", "self.status"),
    ("bench/load.py", "self.response.status"),
}


def _attribute(node: ast.expr) -> ast.Attribute | None:
    """The `x.attr` a write target goes through (`x.attr`, `x.attr[i]`, `x.attr[a:b]`)."""
    while isinstance(node, ast.Subscript):
        node = node.value
    return node if isinstance(node, ast.Attribute) else None


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        found = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        found = [node.target]
    elif isinstance(node, ast.Delete):
        found = list(node.targets)
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
        found = [node.func.value]
    else:
        return []
    flat: list[ast.expr] = []
    while found:
        target = found.pop()
        if isinstance(target, (ast.Tuple, ast.List)):
            found.extend(target.elts)
        elif isinstance(target, ast.Starred):
            found.append(target.value)
        else:
            flat.append(target)
    return flat


def writes(source: str) -> list[tuple[str, str, int]]:
    """(attribute, the written expression, line) of every write of an owned attribute in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
            name = node.args[1] if len(node.args) > 1 else None
            if isinstance(name, ast.Constant) and name.value in OWNERS:
                found.append((str(name.value), ast.unparse(node), node.lineno))
        for target in _targets(node):
            attribute = _attribute(target)
            if attribute is not None and attribute.attr in OWNERS:
                found.append((attribute.attr, ast.unparse(attribute), target.lineno))
    return found


def strays() -> list[str]:
    out = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for attr, expr, line in writes(path.read_text(encoding="utf-8")):
            if OWNERS[attr] != rel and (rel, expr) not in NOT_SEQUENCES:
                out.append(f"streamd/{rel}:{line}: {expr} is written outside {OWNERS[attr]}")
    return out


def test_each_piece_of_sequence_state_has_one_writer() -> None:
    assert len(list(ROOT.rglob("*.py"))) > 40, "the package was not read"
    assert strays() == []


def test_the_owners_do_write_their_state() -> None:
    """The scan sees the owners' own writes (so an empty list above means something)."""
    seen = {(attr, path.relative_to(ROOT).as_posix()) for path in ROOT.rglob("*.py")
            for attr, _, _ in writes(path.read_text(encoding="utf-8"))}
    assert {(attr, owner) for attr, owner in OWNERS.items()} <= seen


def test_the_scan_finds_every_kind_of_write() -> None:
    source = """
seq.status = RUNNING
a.num_computed_tokens += 1
child.status, child.num_computed_tokens = parent.status, 0
seq.block_table[0] = 7
del seq.block_table[-1]
seq.block_table.append(3)
seq.token_ids.pop()
seq.token_ids[-1] = token
seq.token_ids[:] = []
setattr(seq, "status", FINISHED)
x = seq.status
seq.status == RUNNING
len(seq.token_ids)
"""
    got = sorted((attr, line) for attr, _, line in writes(source))
    assert got == sorted([("status", 2), ("num_computed_tokens", 3), ("status", 4), ("num_computed_tokens", 4),
                          ("block_table", 5), ("block_table", 6), ("block_table", 7), ("token_ids", 8),
                          ("token_ids", 9), ("token_ids", 10), ("status", 11)])
