"""The user's cache folder, where kvtier keeps what it can make again (converted model copies, built kernels)."""

from __future__ import annotations

import os
from pathlib import Path


def user_cache_base() -> Path | None:
    """``$XDG_CACHE_HOME`` where it is an absolute path (a relative one is invalid, and ignored, says the XDG spec:
    it would name a folder under wherever the program runs), else ``~/.cache``; None where the user has no home
    folder (HOME unset and no passwd entry, as in a container run under a bare uid: ``~`` stays ``~``)."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    if os.path.isabs(base):
        return Path(base)
    home = os.path.expanduser("~")
    return Path(home) / ".cache" if os.path.isabs(home) else None
