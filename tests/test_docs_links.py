"""The user docs hold together: every relative link in README.md and docs/*.md reaches a file or folder
of the repository (and, with `#anchor`, a heading of that page, by GitHub's slug rules), and
docs/configuration.md names every key that config/streamd.toml documents, so a new setting cannot ship
undocumented, and every flag it names is one `streamd serve` takes (in a key's row: that key's, or another
key's the row names)."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from streamd.cli.main import build_parser

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
CODE_SPAN = re.compile(r"`[^`]*`")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
TOML_KEY = re.compile(r"^#?\s?([a-z_]+)\s*=")
TOML_SECTION = re.compile(r"^\[([a-z_]+)\]")
FLAG = re.compile(r"`(--?[a-z][a-z0-9-]*)`")
SETTING = re.compile(r"`([a-z]+\.[a-z_]+)`")
# vLLM flags the configuration page names only to say streamd has none like them.
VLLM_ONLY_FLAGS = frozenset({"--compilation-config"})


@dataclass(frozen=True, slots=True)
class Link:
    page: Path
    line: int
    target: str

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}: {self.target}"


def prose_lines(page: Path) -> list[tuple[int, str]]:
    """The page's lines outside fenced code blocks, numbered from 1."""
    lines, fenced = [], False
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append((number, line))
    return lines


def links(page: Path) -> list[Link]:
    found = []
    for number, line in prose_lines(page):
        for match in LINK.finditer(CODE_SPAN.sub("", line)):
            found.append(Link(page, number, match.group(1)))
    return found


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The page's heading anchors; a repeated heading's later anchors end in -1, -2, ... as on GitHub."""
    found: set[str] = set()
    repeats: dict[str, int] = {}
    for _, line in prose_lines(page):
        if match := HEADING.match(line):
            base = slug(match.group(2))
            found.add(f"{base}-{repeats[base]}" if base in repeats else base)
            repeats[base] = repeats.get(base, 0) + 1
    return found


def broken(link: Link) -> str | None:
    """Why `link` does not resolve (None: it does)."""
    path, _, anchor = link.target.partition("#")
    target = (link.page.parent / path).resolve() if path else link.page
    if not target.exists():
        return "no such file"
    if ROOT not in (target, *target.parents):
        return "outside the repository"
    if anchor and target.suffix == ".md" and anchor not in anchors(target):
        return f"no heading #{anchor}"
    return None


def test_relative_links_and_anchors_resolve() -> None:
    relative = [link for page in PAGES for link in links(page) if not re.match(r"[a-z]+:", link.target)]
    assert len(relative) > 20  # the parser found the pages' links
    problems = [f"{link} ({why})" for link in relative if (why := broken(link))]
    assert problems == []


def test_the_readme_links_every_user_page() -> None:
    readme = {link.target for link in links(ROOT / "README.md")}
    assert [page.name for page in PAGES[1:] if f"docs/{page.name}" not in readme] == []


def toml_keys() -> list[str]:
    """`section.key` for every key config/streamd.toml documents, set or commented out."""
    keys, section = [], ""
    for line in (ROOT / "config" / "streamd.toml").read_text().splitlines():
        if match := TOML_SECTION.match(line):
            section = match.group(1)
        elif section and (match := TOML_KEY.match(line)):
            keys.append(f"{section}.{match.group(1)}")
    return keys


def test_configuration_page_names_every_key() -> None:
    keys = toml_keys()
    assert "model.name" in keys and "server.max_queue_time_s" in keys  # commented-out keys count
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert [key for key in keys if f"`{key}`" not in page] == []


def serve_options() -> dict[str, argparse.Action]:
    """`streamd serve`'s option strings -> their actions."""
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(commands.choices["serve"]._option_string_actions)


def test_configuration_page_flags_are_the_generated_ones() -> None:
    options = serve_options()
    page = (ROOT / "docs" / "configuration.md").read_text()
    named = set(FLAG.findall(page)) - VLLM_ONLY_FLAGS
    assert {"--max-model-len", "-tp", "--api-key", "--no-enable-prefix-caching"} <= named  # the parser found them
    assert sorted(named - options.keys()) == []
    wrong = []
    for line in page.splitlines():
        if line.startswith("| `") and (settings := SETTING.findall(line)):
            for flag in set(FLAG.findall(line)) - VLLM_ONLY_FLAGS:
                dest = options[flag].dest
                if "." in dest and dest not in settings:  # (a refused or no-effect vLLM flag has no setting)
                    wrong.append(f"{flag} sets {dest}, not {settings[0]}")
    assert wrong == []


@pytest.mark.parametrize(
    ("heading", "anchor"),
    [
        ("WebSocket protocol (`/v1/stream`)", "websocket-protocol-v1stream"),
        ("3. Get a model", "3-get-a-model"),
        ("`make docker-test`", "make-docker-test"),
    ],
)
def test_slug_follows_github(heading: str, anchor: str) -> None:
    assert slug(heading) == anchor
