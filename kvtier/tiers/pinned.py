"""Giving pinned host memory back to the system once kvtier has let it go.

Pinned slabs come from torch's caching host allocator, which keeps a freed block for reuse instead of freeing
it: a parked layer, a host pool that gave back slabs after a spill to disk, or a closed cache would leave the
process's page-locked memory as large as it was (page-locked memory is scarce: the memlock limit, and the system
cannot swap it). After such a release the cache asks torch to free its unused cached blocks. That frees every
unused cached pinned block of the process, not only kvtier's; what other code frees goes back to the system too,
and is allocated again when needed.
"""

from __future__ import annotations

import torch


def empty_pinned_cache() -> bool:
    """Free torch's cached, unused pinned host blocks; False where there is nothing to ask (no CUDA in use, or a
    torch without the call)."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return False
    accelerator = getattr(torch, "accelerator", None)
    call = getattr(accelerator, "empty_host_cache", None) or getattr(torch._C, "_host_emptyCache", None)
    if call is None:
        return False
    call()
    return True
