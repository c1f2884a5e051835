"""Per-page key bounds and the upper bound they give on a query's attention logit.

For a page with elementwise key minimum ``lo`` and maximum ``hi`` and a query ``q``,
``max_k q.k <= sum_d max(q_d lo_d, q_d hi_d) = q+ . hi + q- . lo`` (Quest, arXiv 2406.10774; ArkVale).
Two matrix products give the bound of every page for every query at once.
"""

from __future__ import annotations

import torch


def page_bounds(k_pages: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Elementwise min and max of the valid keys of each page.

    Parameters
    ----------
    k_pages
        ``[..., page_size, dim]`` keys.
    counts
        ``[...]`` valid entries per page (the first `count` rows are valid).

    Returns
    -------
    ``lo, hi`` ``[..., dim]`` float32 (float64 for float64 keys: float32's nearest would not bound them).
    """
    page_size = k_pages.shape[-2]
    valid = torch.arange(page_size, device=k_pages.device) < counts.to(k_pages.device)[..., None]
    k = k_pages if k_pages.dtype == torch.float64 else k_pages.float()
    lo = torch.where(valid[..., None], k, float("inf")).amin(dim=-2)
    hi = torch.where(valid[..., None], k, float("-inf")).amax(dim=-2)
    return lo, hi


def upper_bounds(query: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """The largest logit any key of a page can give, maximised over a KV head's queries.

    Parameters
    ----------
    query
        ``[kv_heads, n_queries, dim]``: every query head of the group and every query token, float32.
    lo, hi
        ``[kv_heads, pages, dim]`` page bounds.

    Returns
    -------
    ``[kv_heads, pages]`` float32.
    """
    q = query.float()
    ub = torch.bmm(q.clamp(min=0), hi.float().transpose(1, 2)) + torch.bmm(q.clamp(max=0), lo.float().transpose(1, 2))
    return ub.amax(dim=1)


def round_outward(lo: torch.Tensor, hi: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`lo`, `hi` stored in `dtype` (the cache's), rounded down and up so they still bound every key."""
    lo_s, hi_s = lo.to(dtype), hi.to(dtype)
    if dtype == lo.dtype:
        return lo_s, hi_s
    lo_s = torch.where(lo_s.float() > lo, torch.nextafter(lo_s, torch.full_like(lo_s, float("-inf"))), lo_s)
    hi_s = torch.where(hi_s.float() < hi, torch.nextafter(hi_s, torch.full_like(hi_s, float("inf"))), hi_s)
    return lo_s, hi_s
