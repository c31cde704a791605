"""Where benchmark reports go: `<out>/<name>-<date>-<gpu>.json` plus a markdown summary beside it."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any


def save_report(report: dict[str, Any], out: str, name: str, markdown: str) -> Path:
    """Writes the JSON and the markdown; `report` needs `date` and `device`. Returns the common stem."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    gpu = report["device"].replace("NVIDIA ", "").replace(" ", "-").lower()
    stem = folder / f"{name}-{report['date']}-{gpu}"
    # Names may hold dots ("llama3.2-1b"): append the suffixes, never replace one.
    Path(f"{stem}.json").write_text(json.dumps(report, indent=2, default=str))
    Path(f"{stem}.md").write_text(markdown)
    return stem


def git_commit() -> str:
    """The short commit of the working tree: `STREAMD_GIT_COMMIT` when set (a copy of the tree without its
    repository, as on a device machine), else git's, else "unknown"."""
    if os.environ.get("STREAMD_GIT_COMMIT"):
        return os.environ["STREAMD_GIT_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
