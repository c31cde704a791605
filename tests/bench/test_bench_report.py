"""`bench/report.py`'s markdown tables: the header's columns rule every row (a row of other width is a bug in
the benchmark, refused where it is made, not a misaligned table in a committed result)."""

from __future__ import annotations

import pytest

from streamd.bench.report import markdown_table


def test_markdown_table_lines() -> None:
    assert markdown_table(["a", "b"], [[1, "x"], [2.5, None]]) == ["| a | b |", "|---|---|", "| 1 | x |", "| 2.5 | None |"]
    assert markdown_table(["only"], []) == ["| only |", "|---|"]


def test_markdown_table_refuses_a_row_of_another_width() -> None:
    with pytest.raises(AssertionError, match="a row of 3 cells under 2 columns"):
        markdown_table(["a", "b"], [[1, 2, 3]])
