"""Choose which demoted pages to bring back for a block of queries.

Two stages. The key bounds of every page give an upper bound on its largest logit (cheap: one number per
page); the pages with the highest bounds (`shortlist` times the budget, at least `SHORTLIST_MIN`) are then
ranked by their estimated share of the queries' attention, computed from the pages' 2-bit key codes. A bound
says what one key could do, the estimate what the whole page does, so the final choice follows attention
mass; the shortlist keeps the cost independent of the context length. The bounds rank well only near the
top, so the shortlist keeps a generous floor.

A long query (a prefill chunk, a chat turn) is handled in blocks of query tokens by the caller: each block
gets its own pages, chosen by the largest share over the block's rows, so recall for token 4,000 of a turn
is not decided by token 1.
"""

from __future__ import annotations

import torch

from .. import native
from .codes import step as code_step
from .codes import unpacked
from .index import PageIndex

SHORTLIST = 1.5
SHORTLIST_MIN = 96
_CHUNK_ELEMENTS = 1 << 22   # floats per product chunk, bounds the working memory


def grouped(query: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[1, q_heads, q_len, dim]`` -> ``[kv_heads, group * q_len, dim]`` float32 (q head j -> kv head j // group)."""
    q_heads, q_len, dim = query.shape[1], query.shape[2], query.shape[3]
    return query[0].reshape(kv_heads, (q_heads // kv_heads) * q_len, dim).float()


def _resident_lse(q: torch.Tensor, resident: list[torch.Tensor], scaling: float) -> torch.Tensor | None:
    """Log-sum-exp of the logits of the keys attention reads anyway, per row: ``[heads, rows]``."""
    total = None
    for keys in resident:
        n = keys.shape[1]
        if n == 0:
            continue
        step = max(1, _CHUNK_ELEMENTS // max(1, q.shape[0] * q.shape[1]))
        for s in range(0, n, step):
            lse = torch.logsumexp(torch.bmm(q, keys[:, s:s + step].float().transpose(1, 2)).mul_(scaling), dim=2)
            total = lse if total is None else torch.logaddexp(total, lse)
    return total


def page_shares(q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, codes: torch.Tensor, scaling: float,
                resident: list[torch.Tensor] | None = None, resident_lse: torch.Tensor | None = None,
                kernels: bool = False) -> torch.Tensor:
    """Log of each page's estimated share of attention, the largest over a KV head's query rows.

    Parameters
    ----------
    q
        ``[kv_heads, rows, dim]`` grouped queries.
    lo, hi, codes
        ``[kv_heads, pages, dim]`` bounds and ``[kv_heads, pages, page_size, dim/4]`` codes of the candidates.
    resident
        Keys ``[kv_heads, n, dim]`` attention reads anyway; their mass counts in the total.
    resident_lse
        ``[kv_heads, rows]``: the log-sum-exp of those keys' logits when attention already computed it (then
        `resident` is not needed).
    kernels
        Estimate the logits with the native `code_logits` (one launch, its own order of sums) instead of the
        matrix products.

    Returns
    -------
    ``[kv_heads, pages]`` float32. Works in chunks of pages and of query rows, so the working memory stays
    near ``_CHUNK_ELEMENTS`` floats whatever the context and query lengths.
    """
    kv_heads, pages, page_size = codes.shape[0], codes.shape[1], codes.shape[2]
    rows, dim = q.shape[1], lo.shape[2]
    page_step = max(1, _CHUNK_ELEMENTS // (kv_heads * page_size * dim))
    row_step = max(1, _CHUNK_ELEMENTS // (kv_heads * min(pages, page_step) * max(page_size, dim)))
    best = None
    for r0 in range(0, rows, row_step):
        qr = q[:, r0:r0 + row_step]
        parts = []
        for s in range(0, pages, page_step):
            lo_s = lo[:, s:s + page_step].float()
            if kernels:
                logits, base = native.code_logits(qr, lo_s, code_step(lo_s, hi[:, s:s + page_step]),
                                                  codes[:, s:s + page_step], scaling)   # [H, c, rows, P], [H, c, rows]
                parts.append((torch.logsumexp(logits, dim=3) + base).transpose(1, 2))
                continue
            # a decoded key is lo + code * step, so q . key = q . lo + (q * step) . code: the codes are
            # multiplied as they are, never turned into keys
            c, order = unpacked(codes[:, s:s + page_step], dim)                 # [H, c, P, D]
            step, qo = code_step(lo_s, hi[:, s:s + page_step]), qr
            if order is not None:   # put the query and steps in the codes' channel order
                step, qo = step.index_select(2, order), qr.index_select(2, order)
            w = qo[:, None] * step[:, :, None, :]                                 # [H, c, rows, D]
            logits = torch.matmul(w, c.transpose(-1, -2)).mul_(scaling)          # [H, c, rows, P]
            base = torch.bmm(qr, lo_s.transpose(1, 2)).mul_(scaling)             # [H, rows, c]
            parts.append(torch.logsumexp(logits, dim=3).transpose(1, 2) + base)  # [H, rows, c]
        page_lse = torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]
        total = torch.logsumexp(page_lse, dim=2)
        res = resident_lse[:, r0:r0 + row_step] if resident_lse is not None else \
            _resident_lse(qr, resident or [], scaling)
        if res is not None:
            total = torch.logaddexp(total, res)
        shares = (page_lse - total[..., None]).amax(dim=1)
        best = shares if best is None else torch.maximum(best, shares)
    return best


def select_pages(q: torch.Tensor, index: PageIndex, budget: int, scaling: float,
                 resident: list[torch.Tensor] | None = None, resident_lse: torch.Tensor | None = None,
                 shortlist: int = SHORTLIST, shortlist_min: int = SHORTLIST_MIN,
                 note: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The `budget` pages per KV head with the largest estimated share of the queries' attention.

    Parameters
    ----------
    q
        ``[kv_heads, rows, dim]`` grouped queries (post-RoPE, as attention sees them; see `grouped`).
    index
        The layer's recall index. Without `note`, a read of its pinned codes is not noted (`PageIndex.rank`):
        the caller notes it.
    budget
        Pages per KV head (capped by how many there are).
    scaling
        The attention's logit scale.
    resident, resident_lse
        Keys ``[kv_heads, n, dim]`` on the device, which attention reads anyway, or the log-sum-exp of their
        logits ``[kv_heads, rows]``.

    Returns
    -------
    ``(chosen, shortlist)``: ``[kv_heads, min(budget, pages)]`` page ids, ascending, and the shortlisted ids
    ``[kv_heads, m]`` they were chosen from, best estimated share first (so ``shortlist[:, :budget]`` is the
    chosen set): the pages likeliest to be wanted next, in the order a prefetch should bring them.
    """
    kv_heads, pages = q.shape[0], index.n
    n = min(budget, pages)
    if n == pages:
        ids = torch.arange(pages, device=q.device).expand(kv_heads, -1)
        return ids, ids
    m = min(pages, max(int(shortlist * n), shortlist_min))
    cand = torch.topk(index.upper_bounds(q), m, dim=1).indices if m < pages else \
        torch.arange(pages, device=q.device).expand(kv_heads, -1).contiguous()
    if index.ranks_in_one_launch(m, q.shape[1]):   # the rest of the choice in one kernel
        if resident_lse is None:
            resident_lse = _resident_lse(q, resident or [], scaling)
        return index.rank(q, cand, n, scaling, resident_lse, note=note)
    lo, hi, codes = index.pick(cand, note=note)
    shares = page_shares(q, lo, hi, codes, scaling, resident, resident_lse, kernels=index.uses_kernels)
    ranked = torch.gather(cand, 1, torch.sort(shares, dim=1, descending=True, stable=True).indices)
    return torch.sort(ranked[:, :n], dim=1).values, ranked
