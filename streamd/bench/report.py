"""Where benchmark reports go: `<out>/<name>-<date>-<device>.json` plus a markdown summary beside it.

`--out` names the folder; by default `./benchmarks/results` when run from a checkout (the current
directory holds `benchmarks/` and `pyproject.toml`), else `./streamd-results`. Never inside the installed
package. `BenchError` is a benchmark that cannot run as asked: the command prints its message on one line.
`markdown_table` writes the summaries' tables, so a header and its rows never disagree on the columns.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Iterable, Sequence
from datetime import date
from pathlib import Path
from typing import Any

# The model name of every report made with the benchmark-only null executor (null_model.py); here, not there,
# so that building `streamd bench`'s parser loads no engine.
NULL_MODEL = "null"
PACKAGE_DIR = Path(__file__).resolve().parent.parent


class BenchError(ValueError):
    """A benchmark cannot run as asked (bad argument, missing device); the message says why."""


def add_out_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out",
        "--out-dir",
        dest="out",
        metavar="DIR",
        default=None,
        help="folder for the JSON and markdown report (default: ./benchmarks/results in a "
        "checkout, else ./streamd-results)",
    )


def add_json_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", metavar="PATH", help="also write the report as JSON here ('-' for stdout)")


def write_json(report: dict[str, Any], path: str | None) -> None:
    """What `--json PATH` asks for: the report as JSON at PATH, on stdout for '-', nowhere for None."""
    if path == "-":
        json.dump(report, sys.stdout, indent=2)
        print()
    elif path:
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(report, fh, indent=2)


def results_dir(out: str | os.PathLike[str] | None) -> Path:
    """The folder reports go to (see the module docstring); refuses one inside the package's source."""
    if out is None:
        cwd = Path.cwd()
        in_checkout = (cwd / "benchmarks").is_dir() and (cwd / "pyproject.toml").is_file()
        folder = cwd / ("benchmarks/results" if in_checkout else "streamd-results")
    else:
        folder = Path(out).expanduser()
    if folder.resolve().is_relative_to(PACKAGE_DIR):
        raise BenchError(
            f"--out {str(folder)!r} is inside the streamd package ({PACKAGE_DIR}); give a folder outside it"
        )
    return folder


def save_report(report: dict[str, Any], out: str | os.PathLike[str] | None, name: str, markdown: str) -> Path:
    """Writes the JSON and the markdown (each atomically); `report` needs `date` and `device`. Returns the
    common stem."""
    folder = results_dir(out)
    folder.mkdir(parents=True, exist_ok=True)
    device = report["device"].replace("NVIDIA ", "").replace(" ", "-").lower()
    stem = folder / f"{name}-{report['date']}-{device}"
    # Names may hold dots ("llama3.2-1b"): append the suffixes, never replace one.
    for path, text in (
        (Path(f"{stem}.json"), json.dumps(report, indent=2, default=str) + "\n"),
        (Path(f"{stem}.md"), markdown),
    ):
        tmp = Path(f"{path}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)  # a half-written report never replaces a good one
    return stem


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> list[str]:
    """A markdown table's lines: the header, its rule, then one line per row (each cell as `str` gives it)."""
    widths = len(header)
    lines = [f"| {' | '.join(header)} |", "|" + "---|" * widths]
    for row in rows:
        assert len(row) == widths, f"a row of {len(row)} cells under {widths} columns: {row}"
        lines.append(f"| {' | '.join(map(str, row))} |")
    return lines


def report_header(device: str) -> dict[str, Any]:
    """The fields a device benchmark's report starts with: today's date, the commit, the device and torch's
    version (`save_report` names the files by the first and the third)."""
    import torch

    return {"date": date.today().isoformat(), "git_commit": git_commit(), "device": device, "torch": torch.__version__}


def git_commit() -> str:
    """The short commit of the working tree: `STREAMD_GIT_COMMIT` when set (a copy of the tree without its
    repository, as on a device machine), else git's, else "unknown"."""
    if os.environ.get("STREAMD_GIT_COMMIT"):
        return os.environ["STREAMD_GIT_COMMIT"]
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
