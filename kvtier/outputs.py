"""Files written for the user (trained weights, traces): readable as the user's umask says, as any file they make.

safetensors' `save_file` creates its file private (mode 0600) whatever the umask, so weights trained to share
could not be read by another user of the machine. The cache's own files (pages, parked layers) stay private.
"""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file


def _umask() -> int:
    """The process's umask, read without changing it where Linux says it (setting it to read it would give a file
    another thread makes meanwhile the widest mode)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o077)   # elsewhere: set and put back at once, the narrowest mode meanwhile
    os.umask(mask)
    return mask


def save_tensors(tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None) -> None:
    """`save_file`, then the file's mode as an ordinary file the user makes (0666 less the umask). A failed write
    (a full disk, a file-size limit) is an `OSError`, as for any file, where safetensors raises its own error."""
    try:
        save_file(tensors, str(path), metadata=metadata)
    except SafetensorError as e:
        found = re.search(r"os error (\d+)|code: (\d+)", str(e))   # the system's error number, if it says one
        code = int(found.group(1) or found.group(2)) if found else errno.EIO
        raise OSError(code, f"could not write {path}: {os.strerror(code)} ({e})", str(path)) from e
    os.chmod(path, 0o666 & ~_umask())
