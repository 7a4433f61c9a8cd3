"""Corpora for benchmarks, built on this machine (nothing downloaded):

english  paragraphs of the standard library's docstrings (pipeline.core.corpus);
chinese  the Simplified and Traditional Chinese translations of this machine's
         gettext catalogues (/usr/share/locale/zh_*), else Python's CJK test files;
code     runs of four lines of the standard library's source;
logs     generated log lines: timestamps, hex request ids, IPs, paths (a new word
         in nearly every field);
mixed    a Chinese and an English text in turn, and code-switched lines.
"""

from __future__ import annotations

import gettext
import glob
import random
import sysconfig
from pathlib import Path


def english(count: int) -> list[str]:
    from pipeline.core.corpus import sample_texts

    return sample_texts(count, seed=11)


def chinese(count: int) -> list[str]:
    texts: list[str] = []
    for lang in ("zh_CN", "zh_TW"):
        for path in sorted(glob.glob(f"/usr/share/locale/{lang}/LC_MESSAGES/*.mo")):
            try:
                with open(path, "rb") as fh:
                    catalog = gettext.GNUTranslations(fh)._catalog  # type: ignore[attr-defined]
            except (OSError, ValueError):
                continue
            texts += [v.replace("\n", " ") for v in catalog.values() if isinstance(v, str)]
    texts = [t for t in dict.fromkeys(texts) if len(t) >= 12 and not t.isascii()]
    if len(texts) < 100:
        stdlib = Path(sysconfig.get_paths()["stdlib"]) / "test" / "cjkencodings"
        for path in sorted(stdlib.glob("*-utf8.txt")):
            texts += [line for line in path.read_text(errors="replace").splitlines() if line]
    random.Random(2).shuffle(texts)
    return _cycle(texts, count)


def code(count: int) -> list[str]:
    texts: list[str] = []
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.glob("*.py")):
        lines = path.read_text(errors="replace").splitlines()
        for i in range(0, len(lines), 4):
            chunk = "\n".join(lines[i : i + 4])
            if len(chunk.strip()) > 30:
                texts.append(chunk)
        if len(texts) >= count:
            break
    random.Random(3).shuffle(texts)
    return _cycle(texts, count)


def logs(count: int) -> list[str]:
    rng = random.Random(4)
    levels, services = ["INFO", "WARN", "ERROR", "DEBUG"], ["api", "db", "auth", "cache"]
    return [
        f"2026-11-{rng.randint(1, 30):02d}T{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:"
        f"{rng.randint(0, 59):02d}.{rng.randint(0, 999):03d}Z {rng.choice(levels)} "
        f"[{rng.choice(services)}-{rng.randint(1, 40)}] req={rng.getrandbits(64):016x} "
        f"user={rng.randint(1000, 999999)} ip=10.{rng.randint(0, 255)}.{rng.randint(0, 255)}."
        f"{rng.randint(0, 255)} path=/v{rng.randint(1, 3)}/items/{rng.getrandbits(32):08x} "
        f"status={rng.choice([200, 201, 404, 500, 503])} took={rng.random() * 900:.2f}ms"
        for _ in range(count)
    ]


def mixed(count: int) -> list[str]:
    zh, en = chinese(count), english(count)
    if not zh:
        return []
    rng = random.Random(5)
    out = []
    for i in range(count):
        if i % 3 == 2:
            words = en[i].split()[:8]
            out.append(f"{zh[i][:20]} {' '.join(words)} {zh[(i + 7) % count][:10]}")
        else:
            out.append(zh[i] if i % 2 else en[i])
    rng.shuffle(out)
    return out


CORPORA = {"english": english, "chinese": chinese, "code": code, "logs": logs, "mixed": mixed}


def _cycle(texts: list[str], count: int) -> list[str]:
    if not texts:
        return []
    out = list(texts[:count])
    while len(out) < count:
        out += [f"{t} ({len(out)})" for t in texts[: count - len(out)]]
    return out


def paragraphs(n: int) -> list[str]:
    """n real paragraphs; past what the corpus holds, repeats with a suffix."""
    from pipeline.core.corpus import sample_texts

    base = sample_texts(n)
    texts = list(base[:n])
    rounds = 1
    while len(texts) < n:
        texts += [f"{t} ({rounds})" for t in base[: n - len(texts)]]
        rounds += 1
    return texts
