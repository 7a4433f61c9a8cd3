"""Every path into the repository that the docs, the README, the code's comments and
the tests name exists: a module moved or split (pipeline/model/wordpiece.py into
pipeline/model/tokenize/, scripts/chaos.py into the scripts/chaos/ package) must take
its mentions along. No broker."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# A relative path starting at one of the repository's top folders; not a part of a
# longer path (~/.cache/embedding-pipeline/...) or of a URL (s3://bucket/...).
_PATH = re.compile(
    r"(?<![\w./~:$-])((?:pipeline|consumers|sinks|scripts|tests|docs|deploy)/[\w./-]*\w)"
)
_SOURCES = ("pipeline", "consumers", "sinks", "scripts", "tests")


def texts() -> Iterator[Path]:
    yield REPO / "README.md"
    yield from sorted((REPO / "docs").rglob("*.md"))
    for top in _SOURCES:
        for path in sorted((REPO / top).rglob("*")):
            wanted = path.suffix in (".py", ".sh", ".md") and "__pycache__" not in path.parts
            if wanted and path != Path(__file__).resolve():  # its examples are stale on purpose
                yield path


def missing_paths(text: str) -> list[str]:
    """The repository paths `text` names that do not exist."""
    named = {match.rstrip(".") for match in _PATH.findall(text)}
    return sorted(p for p in named if not (REPO / p).exists())


def test_the_scan_finds_stale_paths_and_only_those() -> None:
    text = (
        "the fast path (`pipeline/model/wordpiece.py`); see scripts/chaos.py and "
        "pipeline/model/tokenize/wordpiece.py, ~/.cache/embedding-pipeline/tiny-model, "
        "s3://bucket/pipeline/out, scripts/chaos/."
    )
    assert missing_paths(text) == ["pipeline/model/wordpiece.py", "scripts/chaos.py"]


def test_every_path_named_exists() -> None:
    stale = [
        f"{path.relative_to(REPO)}: {name}"
        for path in texts()
        for name in missing_paths(path.read_text(encoding="utf-8"))
    ]
    assert not stale, "\n".join(stale)
