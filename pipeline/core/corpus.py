"""Build a sample corpus of real English text, offline, from the Python standard library.

The pipeline needs realistic prose to embed (demo, tests, benchmarks), but nothing may be
downloaded and no data set is committed.  Every machine that runs the project has a Python
interpreter, and its standard library carries thousands of hand-written English docstrings,
so the corpus is made from those on the spot.

Source files are parsed with :mod:`ast` instead of being imported: importing the whole
standard library would run module-level code (open windows, start threads, print, fail on
missing C extensions), while parsing is side-effect free and works for every module.

Output is JSONL, one object a line: ``{"id": "<module>:<n>", "text": "...", "source": "<path>"}``
where ``<n>`` counts the paragraphs kept from that module in source order, so an id names the
same paragraph whatever ``--seed`` or ``--limit`` is used.

`sample_texts()` gives the texts the precision gate (`pipeline model check`, `--precision
auto`) measures on, `calibration_texts()` those int8's smoothing is calibrated on;
`scripts/make_corpus.py` and `python -m pipeline.core.corpus` write the corpus.
"""

from __future__ import annotations

import argparse
import ast
import functools
import json
import pkgutil
import random
import re
import statistics
import sys
import sysconfig
import time
import tokenize
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO

# Sub-trees that are not wanted: test suites are full of fixture strings and
# deliberately odd text, GUI/IDE code (idlelib, tkinter, turtledemo) is mostly widget
# plumbing, lib2to3/ensurepip carry Python 2 sources or vendored wheels, and
# site-packages is third-party code, not the standard library.
SKIP_COMPONENTS: frozenset[str] = frozenset(
    {
        "test",
        "tests",
        "idle_test",
        "idlelib",
        "tkinter",
        "turtledemo",
        "lib2to3",
        "ensurepip",
        "site-packages",
        "dist-packages",
    }
)

# The generated codec modules (encodings/cp1252.py and ~100 siblings) share one
# boilerplate docstring that differs only by the codec name: near-duplicates that
# would skew a sample.  The package's hand-written modules are kept.
SKIP_MODULE_RE = re.compile(
    r"^encodings\.(cp\d+|iso8859_\d+|mac_\w+|koi8_\w+|hp_roman8|kz1048"
    r"|ptcp154|tis_620|palmos)$"
)

DEFAULT_MIN_CHARS = 40
DEFAULT_MAX_CHARS = 2000
MIN_WORDS = 6

_WORD_RE = re.compile(r"[A-Za-z][A-Za-z'-]*")
# A line made only of punctuation, such as a reST heading underline ("=====").
_RULE_RE = re.compile(r"^\s*([-=~^*#+_.`:])\1{2,}\s*$")
# A reST/field-list marker on its own (":param x:", ".. note::") is markup, not prose.
_DIRECTIVE_RE = re.compile(r"^\s*(\.\.\s|:\w[\w ]*:)")

# Lines that are Python rather than English: definitions, imports, decorators, comments,
# and assignments/calls with nothing else on the line.
_CODE_LINE_RE = re.compile(
    r"^(def\s+\w+\s*\(|class\s+\w+\s*[(:]|import\s+[\w.]+\s*$|from\s+[\w.]+\s+import\s"
    r"|@\w[\w.]*(\(|$)|#\s|\w[\w.\[\]]*\s*=\s*\S+$|[\w.]+\([^()]*\)\s*$)"
)


def stdlib_dir() -> Path:
    """The running interpreter's pure-Python standard library (the base one, even in a venv)."""
    return Path(sysconfig.get_paths()["stdlib"]).resolve()


def iter_stdlib_sources(root: Path | None = None) -> Iterator[tuple[str, Path]]:
    """Yield ``(module name, source file)`` for every pure-Python stdlib module.

    ``pkgutil.walk_packages`` would import each package to read its ``__path__``; walking
    the directories with ``pkgutil.iter_modules`` level by level finds the same modules
    without importing anything.
    """
    base = root if root is not None else stdlib_dir()

    def walk(directory: Path, prefix: str) -> Iterator[tuple[str, Path]]:
        for info in pkgutil.iter_modules([str(directory)]):
            if info.name in SKIP_COMPONENTS:
                continue
            name = prefix + info.name
            if info.ispkg:
                pkg_dir = directory / info.name
                init = pkg_dir / "__init__.py"
                if init.is_file():
                    yield name, init
                yield from walk(pkg_dir, name + ".")
            else:
                source = directory / (info.name + ".py")
                # iter_modules also reports extension modules (.so); they have no source.
                if source.is_file():
                    yield name, source

    yield from walk(base, "")


def _read_source(path: Path) -> str | None:
    # tokenize.open honours PEP 263 coding cookies, which a few stdlib files still use.
    try:
        with tokenize.open(path) as fh:
            return fh.read()
    except (OSError, SyntaxError, UnicodeDecodeError):
        return None


def iter_docstrings(source: str) -> Iterator[tuple[int, str]]:
    """Yield ``(line number, cleaned docstring)`` for the module, classes and functions."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        doc = ast.get_docstring(node, clean=True)
        if not doc:
            continue
        # The docstring is the first statement; its own line number orders paragraphs by
        # position in the file (ast.walk is breadth-first, not in source order).
        first = node.body[0]
        found.append((getattr(first, "lineno", 0), doc))
    found.sort(key=lambda item: item[0])
    yield from found


def split_paragraphs(doc: str) -> list[list[str]]:
    """Split a cleaned docstring into paragraphs (lists of raw lines) at blank lines."""
    paragraphs: list[list[str]] = []
    current: list[str] = []
    for line in doc.splitlines():
        if line.strip():
            current.append(line.rstrip())
        elif current:
            paragraphs.append(current)
            current = []
    if current:
        paragraphs.append(current)
    return paragraphs


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def prose_paragraphs(doc: str) -> Iterator[list[str]]:
    """Paragraphs of a docstring, less the literal blocks introduced by a trailing colon.

    reST and most docstrings introduce an example with "...::" or "For example:" and then
    indent it; such blocks are often split by blank lines into several paragraphs, each of
    which may look harmless on its own (``class C:`` / ``x: int``), so they are dropped
    until the text comes back to the introducing paragraph's indentation.
    """
    block_indent: int | None = None
    for lines in split_paragraphs(doc):
        indent = _indent(lines[0])
        if block_indent is not None and indent > block_indent:
            continue
        block_indent = indent if lines[-1].endswith(":") else None
        yield lines


def normalise(lines: Sequence[str]) -> str:
    """Join a paragraph's lines and collapse every run of whitespace to one space."""
    return " ".join(" ".join(lines).split())


def looks_like_prose(lines: Sequence[str], text: str) -> bool:
    """Heuristic: keep English sentences, drop code, doctests, tables and markup.

    Checked on the raw lines first, because indentation and prompts are the clearest sign
    of a code block and they are lost once whitespace is normalised.
    """
    stripped = [line.lstrip() for line in lines]
    # Doctest sessions and their continuation lines.
    if any(s.startswith((">>>", "... ")) or s == "..." for s in stripped):
        return False
    # Literal blocks are indented relative to the paragraph; prose mostly is not.
    indented = sum(1 for line in lines if line.startswith(("    ", "\t")))
    if indented * 2 > len(lines):
        return False
    if any(_RULE_RE.match(line) for line in lines):
        return False
    if _DIRECTIVE_RE.match(lines[0]):
        return False
    if any(_CODE_LINE_RE.match(s) for s in stripped):
        return False

    words = text.split()
    if len(words) < MIN_WORDS:
        return False
    # Most tokens should be ordinary words (possibly with trailing punctuation), not
    # identifiers like foo_bar(x), paths, numbers or operators.
    wordlike = sum(1 for w in words if _WORD_RE.fullmatch(w.strip(".,;:!?\"'()[]")))
    if wordlike < 0.6 * len(words):
        return False
    # Mostly (ASCII) letters among the visible characters: rules out tables, regexes,
    # format strings and non-English samples.
    visible = [c for c in text if not c.isspace()]
    letters = sum(1 for c in visible if c.isascii() and c.isalpha())
    if letters < 0.75 * len(visible):
        return False
    # Shouting (all-caps constant lists, licence banners) is not the prose we want.
    upper = sum(1 for c in visible if c.isupper())
    if upper > 0.3 * max(letters, 1):
        return False
    return any(c.islower() for c in text)


def iter_module_paragraphs(
    root: Path | None = None,
    min_chars: int = DEFAULT_MIN_CHARS,
    max_chars: int = DEFAULT_MAX_CHARS,
) -> Iterator[tuple[str, str, str]]:
    """Yield ``(module, source path, paragraph)`` in deterministic source order."""
    base = root if root is not None else stdlib_dir()
    modules = [
        (name, path) for name, path in iter_stdlib_sources(base) if not SKIP_MODULE_RE.match(name)
    ]
    # Sorted by path relative to the stdlib root so the order (and so the ids and the
    # seeded shuffle) is the same on every machine with the same Python version.
    modules.sort(key=lambda item: item[1].relative_to(base).as_posix())
    for name, path in modules:
        source = _read_source(path)
        if source is None:
            continue
        rel = path.relative_to(base).as_posix()
        for _lineno, doc in iter_docstrings(source):
            for lines in prose_paragraphs(doc):
                text = normalise(lines)
                if not min_chars <= len(text) <= max_chars:
                    continue
                if looks_like_prose(lines, text):
                    yield name, rel, text


def build_corpus(
    limit: int | None = None,
    seed: int = 0,
    min_chars: int = DEFAULT_MIN_CHARS,
    max_chars: int = DEFAULT_MAX_CHARS,
    *,
    shuffle: bool = True,
    root: Path | None = None,
) -> list[dict[str, str]]:
    """Return the corpus as a list of ``{"id", "text", "source"}`` dicts.

    Paragraphs are de-duplicated exactly (the first occurrence in source order wins), given
    ids, then shuffled with ``random.Random(seed)`` so that a ``limit`` takes a sample from
    the whole standard library rather than its first few modules alphabetically.
    """
    if min_chars < 1 or max_chars < min_chars:
        raise ValueError(f"need 1 <= min_chars <= max_chars, got {min_chars}, {max_chars}")
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")

    seen: set[str] = set()
    counters: dict[str, int] = {}
    records: list[dict[str, str]] = []
    for module, rel, text in iter_module_paragraphs(root, min_chars, max_chars):
        if text in seen:
            continue
        seen.add(text)
        n = counters.get(module, 0)
        counters[module] = n + 1
        records.append({"id": f"{module}:{n}", "text": text, "source": rel})

    if shuffle:
        random.Random(seed).shuffle(records)
    if limit is not None:
        records = records[:limit]
    return records


@functools.lru_cache(maxsize=2)
def _cached_texts(seed: int) -> tuple[str, ...]:
    # Parsing the stdlib takes ~2 s: do it once per process and slice.
    return tuple(r["text"] for r in build_corpus(seed=seed))


def sample_texts(limit: int, seed: int = 0) -> list[str]:
    """A deterministic sample of real English paragraphs from this Python's stdlib."""
    texts = list(_cached_texts(seed)[:limit])
    if not texts:
        raise RuntimeError("no standard-library sources found to sample text from")
    return texts


def calibration_texts(limit: int) -> list[str]:
    """The last `limit` paragraphs of sample_texts' order: apart from the leading ones
    that the precision gate and the benchmarks judge by, where the stdlib holds
    enough (thousands of paragraphs)."""
    pool = _cached_texts(0)
    texts = list(pool[max(0, len(pool) - limit) :])
    if not texts:
        raise RuntimeError("no standard-library sources found to sample text from")
    return texts


def write_jsonl(records: Sequence[dict[str, str]], out: IO[str]) -> None:
    for record in records:
        # ensure_ascii=False keeps the text readable; the file is written as UTF-8.
        out.write(json.dumps(record, ensure_ascii=False) + "\n")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Write a JSONL corpus of English paragraphs taken from the docstrings of "
        "this Python's standard library (offline; nothing is downloaded)."
    )
    parser.add_argument("--out", type=Path, default=None, help="output file (default: stdout)")
    parser.add_argument(
        "--limit", type=int, default=None, help="keep the first N paragraphs after the shuffle"
    )
    parser.add_argument("--seed", type=int, default=0, help="shuffle seed (default: 0)")
    parser.add_argument(
        "--no-shuffle", action="store_true", help="keep source order (sorted by path, position)"
    )
    parser.add_argument("--min-chars", type=int, default=DEFAULT_MIN_CHARS)
    parser.add_argument("--max-chars", type=int, default=DEFAULT_MAX_CHARS)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    try:
        records = build_corpus(
            limit=args.limit,
            seed=args.seed,
            min_chars=args.min_chars,
            max_chars=args.max_chars,
            shuffle=not args.no_shuffle,
        )
    except ValueError as exc:
        print(f"make_corpus: {exc}", file=sys.stderr)
        return 2

    if args.out is None:
        write_jsonl(records, sys.stdout)
        sys.stdout.flush()
    else:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        # Write to a temporary name first so a reader never sees a half-written corpus.
        tmp = args.out.with_name(args.out.name + ".tmp")
        with tmp.open("w", encoding="utf-8") as fh:
            write_jsonl(records, fh)
        tmp.replace(args.out)

    median = statistics.median(len(r["text"]) for r in records) if records else 0
    print(
        f"make_corpus: {len(records)} paragraphs, median {median:g} characters, "
        f"from {stdlib_dir()} in {time.monotonic() - started:.1f}s",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
