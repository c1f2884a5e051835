"""Offline English text for traces: the prose (docstrings) of Python's own standard library, and the
documentation that installed Python packages ship (READMEs, guides, changelogs in Markdown, reST or text).

Both are on any machine where kvtier is installed, so traces can be recorded without a download. Documents
are split by a stable hash of their name into a training and an evaluation part, so the two never overlap.
License texts are kept out: files named like licenses, notices or copyright statements are skipped, and so is
any text that carries a license's wording (GPL, GFDL, MPL, Apache, BSD, MIT, ...), wherever it sits.
"""

from __future__ import annotations

import ast
import hashlib
import sysconfig
from pathlib import Path
from typing import Any, Sequence

from ..errors import ConfigError

SPLITS = ("train", "eval")
CORPORA = ("stdlib", "packages", "both")
DOC_SUFFIXES = (".md", ".rst", ".txt")
# file names (lower case, without suffix) that hold legal text, never prose to learn from
_LEGAL_NAMES = ("license", "licence", "copying", "copyright", "notice", "authors", "patents", "unlicense",
                "third_party", "thirdparty", "credits")
# wording that only license texts carry: a document with any of it is skipped whole
_LEGAL_WORDS = ("gnu general public license", "gnu lesser general public license", "gnu free documentation",
                "mozilla public license", "apache license", "permission is hereby granted",
                "redistribution and use in source and binary forms", "creative commons", "the software is provided",
                "warranty of merchantability", "eclipse public license", "common development and distribution",
                "artistic license", "merchantibility", 'provided "as is"', "provided 'as is'", "without warranty")


def _split_of(name: str, eval_share: float = 0.25) -> str:
    h = int(hashlib.sha1(name.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return "eval" if h < eval_share else "train"


def stdlib_prose(split: str, min_chars: int = 400) -> list[tuple[str, str]]:
    """``(module name, prose)`` for the standard-library modules of `split`, sorted by name.

    The prose is the module's docstrings (module, classes, functions) joined in source order.
    """
    if split not in SPLITS:
        raise ValueError(f"split={split!r}; allowed: {SPLITS}")
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in sorted(root.glob("*.py")):
        name = path.stem
        if name.startswith("_") or _split_of(name) != split:
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        docs = [ast.get_docstring(node) for node in ast.walk(tree)
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
        text = "\n\n".join(d.strip() for d in docs if d and len(d) > 80)
        if len(text) >= min_chars:
            out.append((name, text))
    return out


def is_legal_text(name: str, text: str) -> bool:
    """Whether a file is license or copyright text (by its name or its wording): never training material."""
    stem = name.lower().rsplit("/", 1)[-1].split(".", 1)[0]
    if any(stem.startswith(word) or stem.endswith(word) for word in _LEGAL_NAMES):
        return True
    low = text.lower()
    return any(words in low for words in _LEGAL_WORDS)


def looks_like_prose(text: str) -> bool:
    """Sentences rather than tables, word lists or data: most lines hold several words, and sentences end."""
    lines = [line for line in text[:20000].splitlines() if line.strip()]
    if not lines:
        return False
    wordy = sum(len(line.split()) >= 5 for line in lines) / len(lines)
    sentences = text[:20000].count(". ") + text[:20000].count(".\n")
    return wordy >= 0.4 and sentences * 400 >= min(len(text), 20000)


def package_prose(split: str, min_chars: int = 1500, max_chars: int = 200_000) -> list[tuple[str, str]]:
    """``(package/file, text)`` of the documentation installed packages ship, for `split`, sorted by name.

    Reads Markdown, reST and plain-text files inside the installed packages (site-packages, not the
    standard library), skipping license texts (`is_legal_text`), package metadata folders and files that
    are too short to hold a prompt or so long they are data.
    """
    if split not in SPLITS:
        raise ValueError(f"split={split!r}; allowed: {SPLITS}")
    roots = {Path(sysconfig.get_paths()[key]) for key in ("purelib", "platlib")}
    out = []
    for root in sorted(roots):
        if not root.is_dir():
            continue
        for path in sorted(p for p in root.rglob("*") if p.suffix.lower() in DOC_SUFFIXES):
            rel = path.relative_to(root).as_posix()
            if ".dist-info/" in rel or ".egg-info/" in rel or "/tests/" in f"/{rel}" or _split_of(rel) != split:
                continue
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            if not min_chars <= len(text) <= max_chars or is_legal_text(rel, text):
                continue
            if not looks_like_prose(text):
                continue
            out.append((rel, text))
    return out


def corpus_prose(corpus: str, split: str) -> list[tuple[str, str]]:
    """``(name, text)`` of a corpus (`CORPORA`): each document's name says where it comes from."""
    if corpus not in CORPORA:
        raise ValueError(f"corpus={corpus!r}; allowed: {', '.join(CORPORA)}")
    out = []
    if corpus in ("stdlib", "both"):
        out += [(f"stdlib:{name}", text) for name, text in stdlib_prose(split)]
    if corpus in ("packages", "both"):
        out += [(f"package:{name}", text) for name, text in package_prose(split)]
    return out


def joined_ids(tokenizer: Any, docs: list[tuple[str, str]]) -> Any:
    """The documents' token ids as one stream ``[1, n]``, blank lines between them: windows longer than one
    document are cut from it."""
    return tokenizer("\n\n".join(text for _, text in docs), return_tensors="pt",
                     add_special_tokens=False)["input_ids"]


def window_start(rng: Any, tokens: int, need: int, what: str) -> int:
    """A random start of `need` tokens in a stream of `tokens` (`rng`: a `random.Random`), or a `ConfigError`
    saying `what` asked for more than the corpus holds."""
    if need >= tokens:
        raise ConfigError(f"{what} of {need} tokens does not fit the corpus, {tokens} tokens in all; allowed: "
                          f"at most {tokens - 1} tokens")
    return rng.randrange(0, tokens - need)


def in_turn(lengths: int | Sequence[int]) -> list[int]:
    """One length, or several to take in turn, as a list."""
    return [lengths] if isinstance(lengths, int) else list(lengths)
