"""The recall buffer's plan in tensor ops on the device: which wanted pages to fetch, into which slots.

The same rule as `RecallBuffer.plan` (pages already held keep their slots; the k-th missing page of a head
takes that head's k-th free slot), written so that nothing is read back to the host: the result has a fixed
shape ``[heads, r]`` and a per-head count of how many of its entries are real. A GPU step can then queue the
choice of pages, the plan and the copy (`kvtier.native.recall_pages`) behind each other with no sync.
"""

from __future__ import annotations

import torch

from .. import native


def plan_on_device(want: torch.Tensor, held: torch.Tensor,
                   pages: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where the wanted pages go.

    Parameters
    ----------
    want
        ``[heads, w]`` page ids wanted (distinct per head), int64.
    held
        ``[heads, R]`` the page id each buffer slot holds, ``-1`` for an empty slot; ``R >= w`` (a buffer
        with room for pages brought up ahead of need has more slots than a step chooses).
    pages
        Pages the layer has demoted (every id is below it).

    Returns
    -------
    ``(fetch, slots, count, held_after)``: for head ``h`` and ``j < count[h]``, page ``fetch[h, j]`` goes to
    slot ``slots[h, j]`` (in the order `RecallBuffer.plan` gives); ``held_after`` is `held` once they are in.
    `fetch` and `slots` are ``[heads, w]``. On CUDA one kernel launch makes it (`kvtier.native.plan_recall`).
    """
    heads, w = want.shape
    if held.shape[0] != heads or held.shape[1] < w:
        raise ValueError(f"plan_on_device: want {list(want.shape)} and held {list(held.shape)}; allowed: as "
                         "many heads, and at least as many slots as wanted pages")
    return native.plan_recall(want, held, pages)


def slots_of(want: torch.Tensor, held: torch.Tensor, pages: int) -> torch.Tensor:
    """``[heads, w]``: the slot of `held` (``[heads, R]``) holding each page of `want` (every one is held)."""
    heads, slots = held.shape
    where = torch.zeros(heads, pages + 1, dtype=torch.int64, device=held.device)
    where.scatter_(1, _columns(held, pages), torch.arange(slots, device=held.device).expand(heads, -1))
    return where.gather(1, want)


def _columns(held: torch.Tensor, pages: int) -> torch.Tensor:
    """`held` with each empty slot (``-1``) as column `pages`, one past every page id."""
    return torch.where(held < 0, torch.full_like(held, pages), held)
