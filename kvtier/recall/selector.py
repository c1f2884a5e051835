"""Choose which demoted pages to bring back for a query."""

from __future__ import annotations

import torch

from .bounds import upper_bounds


def select_pages(query: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, budget: int) -> torch.Tensor:
    """The `budget` pages per KV head with the largest logit upper bound.

    Parameters
    ----------
    query
        ``[1, q_heads, q_len, dim]`` (post-RoPE, as attention sees it).
    lo, hi
        ``[kv_heads, pages, dim]`` bounds of the demoted pages.
    budget
        Pages per KV head (capped by how many there are).

    Returns
    -------
    ``[kv_heads, min(budget, pages)]`` page ids, ascending.
    """
    kv_heads, pages = lo.shape[0], lo.shape[1]
    q_heads, q_len, dim = query.shape[1], query.shape[2], query.shape[3]
    group = q_heads // kv_heads
    grouped = query[0].reshape(kv_heads, group * q_len, dim)  # q head j belongs to kv head j // group
    n = min(budget, pages)
    if n == pages:
        return torch.arange(pages, device=lo.device).expand(kv_heads, -1)
    ub = upper_bounds(grouped, lo, hi)
    return torch.sort(torch.topk(ub, n, dim=1).indices, dim=1).values
