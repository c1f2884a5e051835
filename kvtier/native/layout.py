"""How kvtier lays out rows and codes, shared by the twins and the storages above them.

Kept apart from the twins because `kvtier bench launches` counts a twin's whole call as one launch: a helper
written there would hide the launches of its other callers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

CODE_LEVELS = 3     # 2-bit codes 0 .. 3 between a channel's bounds
CODES_PER_BYTE = 4


def write_rows(slabs: Sequence[torch.Tensor], rows_per_slab: int, first: int, values: torch.Tensor) -> None:
    """Rows ``first ..`` of the storage ``= values`` ``[n, *row]``, slab by slab (no index tensor)."""
    done, n = 0, values.shape[0]
    while done < n:
        s, o = divmod(first + done, rows_per_slab)
        take = min(n - done, rows_per_slab - o)
        slabs[s][o:o + take].copy_(values[done:done + take], non_blocking=True)
        done += take


def pack_codes(c: torch.Tensor) -> torch.Tensor:
    """2-bit codes ``[..., dim]`` (uint8, 0 .. 3) packed four to a byte, channel ``4b + i`` in bits ``2i`` of byte
    ``b`` (channels past `dim` coded 0): ``[..., ceil(dim / 4)]``."""
    pad = -c.shape[-1] % CODES_PER_BYTE
    if pad:
        c = torch.cat([c, c.new_zeros(*c.shape[:-1], pad)], dim=-1)
    c = c.view(*c.shape[:-1], -1, CODES_PER_BYTE)
    return c[..., 0] | (c[..., 1] << 2) | (c[..., 2] << 4) | (c[..., 3] << 6)
