"""The recall buffer's plan in tensor ops on the device: which wanted pages to fetch, into which slots.

The same rule as `RecallBuffer.plan` (pages already held keep their slots; the k-th missing page of a head
takes that head's k-th free slot), written so that nothing is read back to the host: the result has a fixed
shape ``[heads, r]`` and a per-head count of how many of its entries are real. A GPU step can then queue the
choice of pages, the plan and the copy (`kvtier.native.recall_pages`) behind each other with no sync.
"""

from __future__ import annotations

import torch


def plan_on_device(want: torch.Tensor, held: torch.Tensor,
                   pages: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where the wanted pages go.

    Parameters
    ----------
    want
        ``[heads, r]`` page ids wanted (distinct per head), int64.
    held
        ``[heads, r]`` the page id each buffer slot holds, ``-1`` for an empty slot.
    pages
        Pages the layer has demoted (every id is below it).

    Returns
    -------
    ``(fetch, slots, count, held_after)``: for head ``h`` and ``j < count[h]``, page ``fetch[h, j]`` goes to
    slot ``slots[h, j]`` (in the order `RecallBuffer.plan` gives); ``held_after`` is `held` once they are in.
    """
    heads, r = want.shape
    empty = pages                                                   # the column standing for an empty slot
    held_col = torch.where(held < 0, torch.full_like(held, empty), held)
    wanted = torch.zeros(heads, pages + 1, dtype=torch.bool, device=want.device).scatter_(1, want, True)
    holding = torch.zeros(heads, pages + 1, dtype=torch.bool, device=want.device).scatter_(1, held_col, True)
    holding[:, empty] = False
    missing = ~holding.gather(1, want)                              # [heads, r]
    free = ~wanted.gather(1, held_col)                              # [heads, r]
    # the real entries first, each in its original order (a stable sort of a 0/1 key)
    fetch = want.gather(1, torch.argsort((~missing).to(torch.uint8), dim=1, stable=True))
    slots = torch.argsort((~free).to(torch.uint8), dim=1, stable=True)
    count = missing.sum(dim=1)
    real = torch.arange(r, device=want.device)[None, :] < count[:, None]
    held_after = held.scatter(1, slots, torch.where(real, fetch, held.gather(1, slots)))
    return fetch, slots, count, held_after
