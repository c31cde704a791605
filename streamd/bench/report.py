"""Where benchmark reports go: `<out>/<name>-<date>-<gpu>.json` plus a markdown summary beside it."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any


def save_report(report: dict[str, Any], out: str, name: str, markdown: str) -> Path:
    """Writes the JSON and the markdown; `report` needs `date` and `device`. Returns the common stem."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    gpu = report["device"].replace("NVIDIA ", "").replace(" ", "-").lower()
    stem = folder / f"{name}-{report['date']}-{gpu}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=2, default=str))
    stem.with_suffix(".md").write_text(markdown)
    return stem


def git_commit() -> str:
    """The short commit of the working tree (\"unknown\" where git or the repository is missing)."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
