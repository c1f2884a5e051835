"""Offline English text for traces: the prose (docstrings) of Python's own standard library.

Every Python installation has it, so traces can be recorded on any machine without a download. Modules
are split by a stable hash of their name into a training and an evaluation part, so the two never overlap.
"""

from __future__ import annotations

import ast
import hashlib
import sysconfig
from pathlib import Path

SPLITS = ("train", "eval")


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
