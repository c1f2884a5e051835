"""The recall index: what recall reads about every demoted page, kept beside the device entries.

Per KV head and page: the elementwise key bounds (cache dtype, rounded outward), 2-bit key codes inside
them and the number of valid entries. Columns are page ids of the page table; the index grows with it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from .bounds import page_bounds, round_outward
from .codes import code_width, encode


@dataclass
class PageIndex:
    lo: torch.Tensor       # [heads, capacity, dim]
    hi: torch.Tensor
    codes: torch.Tensor    # [heads, capacity, page_size, code_width(dim)] uint8
    counts: torch.Tensor   # [heads, capacity] int32

    @classmethod
    def empty(cls, heads: int, page_size: int, dim: int, dtype: torch.dtype, device: torch.device) -> PageIndex:
        lo = torch.empty(heads, 0, dim, dtype=dtype, device=device)
        return cls(lo, torch.empty_like(lo),
                   torch.empty(heads, 0, page_size, code_width(dim), dtype=torch.uint8, device=device),
                   torch.empty(heads, 0, dtype=torch.int32, device=device))

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def add(self, first: int, k_pages: torch.Tensor, counts: torch.Tensor, capacity: int) -> None:
        """Index pages ``first, first + 1, ...`` from their keys ``[heads, pages, page_size, dim]`` and valid
        entries ``[heads, pages]``, growing the columns to `capacity` when needed."""
        lo, hi = round_outward(*page_bounds(k_pages, counts), k_pages.dtype)
        new = {"lo": lo, "hi": hi, "codes": encode(k_pages, lo, hi), "counts": counts}
        grow = capacity - self.lo.shape[1]
        cols = slice(first, first + k_pages.shape[1])
        for name, t in self.tensors().items():
            if grow > 0:
                t = torch.cat([t, t.new_empty(t.shape[0], grow, *t.shape[2:])], dim=1)
                setattr(self, name, t)
            t[:, cols] = new[name]

    def first(self, n: int) -> PageIndex:
        """Views of the first `n` pages."""
        return PageIndex(**{name: t[:, :n] for name, t in self.tensors().items()})

    def to(self, device: torch.device | str) -> PageIndex:
        """A copy on `device` (always a copy, so the source's storage can be let go)."""
        return PageIndex(**{name: t.to(device, copy=True) for name, t in self.tensors().items()})

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())
