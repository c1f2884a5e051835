"""The user's cache folder, where kvtier keeps what it can make again (converted model copies, built kernels)."""

from __future__ import annotations

import os
from pathlib import Path


def user_cache_base() -> Path:
    """``$XDG_CACHE_HOME`` where it is an absolute path (a relative one is invalid, and ignored, says the XDG spec:
    it would name a folder under wherever the program runs), else ``~/.cache``."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    return Path(base) if os.path.isabs(base) else Path(os.path.expanduser("~")) / ".cache"
