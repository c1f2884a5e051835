"""Choose which demoted pages to bring back for a query.

Two stages. The key bounds of every page give an upper bound on its largest logit (cheap: one number per
page); the pages with the highest bounds (`shortlist` times the budget, at least `SHORTLIST_MIN`) are then
ranked by their estimated share of the query's attention, computed from the pages' 2-bit key codes. A bound
says what one key could do, the estimate what the whole page does, so the final choice follows attention
mass; the shortlist keeps the cost independent of the context length. The bounds rank well only near the
top, so the shortlist keeps a generous floor.
"""

from __future__ import annotations

import torch

from .bounds import upper_bounds
from .codes import decode

SHORTLIST = 2
SHORTLIST_MIN = 128
_CHUNK_ELEMENTS = 1 << 22   # decoded keys per chunk (floats), bounds the working memory


def _grouped(query: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[1, q_heads, q_len, dim]`` -> ``[kv_heads, group * q_len, dim]`` float32 (q head j -> kv head j // group)."""
    q_heads, q_len, dim = query.shape[1], query.shape[2], query.shape[3]
    return query[0].reshape(kv_heads, (q_heads // kv_heads) * q_len, dim).float()


def page_shares(q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, codes: torch.Tensor, counts: torch.Tensor,
                scaling: float, resident: torch.Tensor | None = None) -> torch.Tensor:
    """Log of each page's estimated share of attention, the largest over a KV head's query rows.

    Parameters
    ----------
    q
        ``[kv_heads, rows, dim]`` grouped queries.
    lo, hi, codes, counts
        ``[kv_heads, pages, dim]`` bounds, ``[kv_heads, pages, page_size, dim/4]`` codes, ``[kv_heads, pages]``
        valid entries of the candidate pages.
    resident
        ``[kv_heads, n, dim]`` keys attention reads anyway; their mass counts in the total.

    Returns
    -------
    ``[kv_heads, pages]`` float32. Works in chunks of pages and of query rows, so the working memory stays
    near ``_CHUNK_ELEMENTS`` floats whatever the context and query lengths.
    """
    kv_heads, pages, page_size = codes.shape[0], codes.shape[1], codes.shape[2]
    rows, dim = q.shape[1], lo.shape[2]
    n_res = 0 if resident is None else resident.shape[1]
    page_step = max(1, _CHUNK_ELEMENTS // (kv_heads * page_size * dim))
    row_step = max(1, _CHUNK_ELEMENTS // (kv_heads * max(min(pages, page_step) * page_size, n_res, 1)))
    best = None
    for r0 in range(0, rows, row_step):
        qr = q[:, r0:r0 + row_step]
        parts = []
        for s in range(0, pages, page_step):
            k = decode(codes[:, s:s + page_step], lo[:, s:s + page_step], hi[:, s:s + page_step])  # [H, c, P, D]
            c = k.shape[1]
            logits = torch.bmm(qr, k.reshape(kv_heads, c * page_size, dim).transpose(1, 2)).mul_(scaling)
            valid = torch.arange(page_size, device=q.device) < counts[:, s:s + page_step, None]
            logits = logits.view(kv_heads, -1, c, page_size).masked_fill_(~valid[:, None], float("-inf"))
            parts.append(torch.logsumexp(logits, dim=3))                              # [H, rows, c]
        page_lse = torch.cat(parts, dim=2)
        total = torch.logsumexp(page_lse, dim=2)
        if n_res:
            res = torch.bmm(qr, resident.float().transpose(1, 2)).mul_(scaling)
            total = torch.logaddexp(total, torch.logsumexp(res, dim=2))
        shares = (page_lse - total[..., None]).amax(dim=1)
        best = shares if best is None else torch.maximum(best, shares)
    return best


def select_pages(query: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, codes: torch.Tensor,
                 counts: torch.Tensor, budget: int, scaling: float | None = None,
                 resident: torch.Tensor | None = None, shortlist: int = SHORTLIST,
                 shortlist_min: int = SHORTLIST_MIN) -> torch.Tensor:
    """The `budget` pages per KV head with the largest estimated share of the query's attention.

    Parameters
    ----------
    query
        ``[1, q_heads, q_len, dim]`` (post-RoPE, as attention sees it).
    lo, hi, codes, counts
        Bounds ``[kv_heads, pages, dim]``, codes ``[kv_heads, pages, page_size, dim/4]`` and valid entries
        ``[kv_heads, pages]`` of the demoted pages.
    budget
        Pages per KV head (capped by how many there are).
    scaling
        The attention's logit scale (default ``dim ** -0.5``).
    resident
        ``[kv_heads, n, dim]`` keys on the device, which attention reads anyway.

    Returns
    -------
    ``[kv_heads, min(budget, pages)]`` page ids, ascending.
    """
    kv_heads, pages = lo.shape[0], lo.shape[1]
    n = min(budget, pages)
    if n == pages:
        return torch.arange(pages, device=lo.device).expand(kv_heads, -1)
    q = _grouped(query, kv_heads)
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    m = min(pages, max(shortlist * n, shortlist_min))
    cand = torch.topk(upper_bounds(q, lo, hi), m, dim=1).indices if m < pages else None
    if cand is not None:
        pick = [torch.gather(t, 1, cand.view(kv_heads, m, *([1] * (t.dim() - 2))).expand(-1, -1, *t.shape[2:]))
                for t in (lo, hi, codes, counts)]
    else:
        pick = [lo, hi, codes, counts]
    best = torch.topk(page_shares(q, *pick, scaling, resident), n, dim=1).indices
    ids = best if cand is None else torch.gather(cand, 1, best)
    return torch.sort(ids, dim=1).values
