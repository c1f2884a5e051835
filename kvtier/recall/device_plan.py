"""The recall buffer's plan on the device: which wanted pages to fetch, into which slots.

The same rule as `RecallBuffer.plan` (pages already held keep their slots; the k-th missing page of a head
takes that head's k-th free slot), made so that nothing is read back to the host: the result has a fixed
shape ``[heads, w]`` and a per-head count of how many of its entries are real. A GPU step can then queue the
choice of pages, the plan and the copy (`kvtier.native.recall_pages`) behind each other with no sync. On
CUDA the plan, the copy's rows, where each page sits afterwards, the buffer's prefetch flags and the recall
counters come out of one kernel launch (`kvtier.native.plan_recall`).
"""

from __future__ import annotations

import torch

from .. import native
from ..native import RecallPlan


def plan_on_device(want: torch.Tensor, held: torch.Tensor, pages: int, host_slots: torch.Tensor | None = None,
                   ahead: torch.Tensor | None = None, counts: torch.Tensor | None = None,
                   prefetch: bool = False, in_place: bool = False) -> RecallPlan:
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
    host_slots
        ``[heads, pages]`` the host slot of each page, so the plan gives the rows the copy reads.
    ahead, counts
        The buffer's prefetch flags ``[heads, R]`` and the recall counters ``[4]`` (fetched on demand, found
        in the buffer, prefetched, found thanks to a prefetch), updated in place; `prefetch` says whether the
        plan is a step's choice or a prefetch.
    in_place
        Write the new page table into `held` (the plan's ``held_after`` is then `held`): the buffer keeps one
        table, which every step's launches read at the same address.

    Returns
    -------
    A `RecallPlan`: for head ``h`` and ``j < count[h]``, page ``fetch[h, j]`` goes to slot ``slots[h, j]``
    (in the order `RecallBuffer.plan` gives); ``held_after`` is `held` once they are in; ``where`` the slot
    of each wanted page then. Shapes are checked there (a `ValueError` names them).
    """
    return native.plan_recall(want, held, pages, host_slots, ahead, counts, prefetch, in_place)
