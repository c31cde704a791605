"""`make test` runs `pytest -m "not slow"`, so every slow test must keep a light form there: a slow size comes
only from `tests.helpers.sizes` (its light twin runs in `make test`, the full one in `make test-all`), never
from a bare `@pytest.mark.slow` that would drop a behaviour from `make test` entirely."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parent
HELPERS = TESTS / "helpers.py"


def test_slow_marks_come_only_from_sizes() -> None:
    bare = [f"{path.relative_to(TESTS.parent)}:{number}"
            for path in sorted(TESTS.rglob("*.py")) if path not in (HELPERS, Path(__file__).resolve())
            for number, line in enumerate(path.read_text().splitlines(), 1) if "mark.slow" in line]
    assert bare == [], f"slow without a light form in make test (use tests.helpers.sizes): {bare}"
