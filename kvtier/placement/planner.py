"""Move plans: which device entries to demote and which host pages to push to disk.

Plans are pure functions of scores, positions and counts, so the rules can be read (and tested) apart
from the tiers that carry them out. Ties are broken by position (older first) so plans are deterministic.
"""

from __future__ import annotations

import numpy as np
import torch

from .budget import ceil_share


def recent_window(recent_tokens: int | float, budget_tokens: int) -> int:
    """The recent window in tokens for a device budget of `budget_tokens`.

    A whole number is a fixed window; a float in (0, 1) is that share of the device budget, rounded up, so
    the window grows with the budget (``0.25`` with a 410-token budget: the 103 latest tokens).
    """
    if isinstance(recent_tokens, float):
        return ceil_share(recent_tokens, max(budget_tokens, 0))
    return int(recent_tokens)


def protected_count(seen: int, sink_tokens: int, recent_tokens: int | float, budget_tokens: int | None = None) -> int:
    """How many of the `seen` tokens are sinks or in the recent window (they never leave the device).

    A fractional `recent_tokens` (a share of the device budget) needs `budget_tokens`.
    """
    if isinstance(recent_tokens, float) and budget_tokens is None:
        raise ValueError(f"recent_tokens={recent_tokens!r} is a share of the device budget; pass budget_tokens")
    return min(seen, sink_tokens + recent_window(recent_tokens, budget_tokens or 0))


def kept_first(scores: torch.Tensor, protected: torch.Tensor) -> torch.Tensor:
    """`scores` as float32 with the always-kept entries (`protected`) at +inf, above every other: a scorer's own
    +inf (allowed: `RecencyScorer` gives it to its sinks) is held just below, never tied with them."""
    return torch.where(protected, float("inf"), scores.float().clamp(max=torch.finfo(torch.float32).max))


def plan_device_demotion(
    scores: torch.Tensor,
    positions: torch.Tensor,
    seen: int,
    budget_tokens: int,
    sink_tokens: int,
    recent_tokens: int | float,
    page_size: int,
    kept: int | None = None,
    min_pages: int = 1,
) -> torch.Tensor | None:
    """Choose the device entries to demote, in whole pages, so the device tier fits its budget.

    Parameters
    ----------
    scores, positions
        ``[heads, n]``: the entries on the device (and the ones just written), in any order.
    seen
        Tokens written so far (the logical length).
    budget_tokens
        Device budget per head, in tokens, already resolved for `seen`.
    sink_tokens, recent_tokens
        The always-kept set: the first `sink_tokens` positions and the latest ones; `recent_tokens` is a
        token count, or a float in (0, 1): that share of `budget_tokens` (see `recent_window`).
    page_size
        Entries per page: demotions come in whole pages, which is also the least hysteresis (after a
        demotion the tier sits up to a page under its budget, so a decoding layer demotes at most once every
        page of steps; `min_pages` widens it).
    kept
        How many of a head's entries are in the always-kept set, when the caller knows it (the engine counts
        it on the host, so a GPU step reads nothing back); None counts it from `positions`.
    min_pages
        Pages to move at least once the tier is over its budget, where that many may move: the tier then
        sits up to that many pages under its budget, and the next demotion comes that many pages later.

    Returns
    -------
    None when nothing is to move; else ``[heads, m]`` indices into the entries, ``m`` a multiple of
    `page_size`, in position order per head. Pages are cut from them in that order: neighbouring tokens have
    alike keys (same rotary phase, related content), so a page's key range stays tight and recall can tell
    pages apart. When the unprotected entries do not fill the pages the budget asks for, only whole pages
    move and the rest wait on the device until they fill one: a demoted page is never partly filled.
    """
    heads, n = scores.shape
    if n <= budget_tokens:
        return None
    recent = recent_window(recent_tokens, budget_tokens)
    protected = (positions < sink_tokens) | (positions >= seen - recent)
    movable = n - (int(protected[0].sum()) if kept is None else kept)
    pages = min(max(-(-(n - budget_tokens) // page_size), min_pages), movable // page_size)
    if pages <= 0:
        return None
    m = pages * page_size
    ranked = kept_first(scores, protected)
    # lowest score first; among equal scores the older position first
    order = torch.argsort(positions, dim=1)
    by_score = torch.sort(torch.gather(ranked, 1, order), dim=1, stable=True).indices
    chosen = torch.gather(order, 1, by_score[:, :m])
    return torch.gather(chosen, 1, torch.argsort(torch.gather(positions, 1, chosen), dim=1))


def page_rank(scores: torch.Tensor) -> torch.Tensor:
    """A page's rank is the best score among its entries: ``[..., page_size]`` -> ``[...]``."""
    return scores.amax(dim=-1)


def plan_host_overflow(
    page_rank: np.ndarray,
    page_count: np.ndarray,
    on_host: np.ndarray,
    budget_tokens: int,
    slack: int,
    movable: np.ndarray | None = None,
    uses: np.ndarray | None = None,
) -> list[np.ndarray]:
    """Choose, per head, the host pages to push down to disk: the least used lately first (`uses`, where the
    host keeps pages recall brought up from disk), then the lowest-ranked.

    Parameters
    ----------
    page_rank
        ``[heads, pages]``: a page's rank is the best score among its entries.
    page_count
        ``[heads, pages]``: valid entries per page.
    on_host
        ``[heads, pages]`` bool: which pages live on the host now.
    budget_tokens, slack
        Host budget per head in tokens; when over it, pages go down until ``budget_tokens - slack`` holds.
    movable
        ``[heads, pages]`` bool: which host pages may go (default: all); the others count toward the budget
        but stay. When the movable pages cannot make room, all of them go.

    Returns
    -------
    One array of page ids per head (lowest-ranked first), possibly empty.
    """
    plans = []
    target = max(budget_tokens - slack, 0)
    for h in range(page_rank.shape[0]):
        ids = np.flatnonzero(on_host[h])
        held = int(page_count[h, ids].sum())
        if held <= budget_tokens:
            plans.append(np.empty(0, dtype=np.int64))
            continue
        if movable is not None:
            ids = ids[movable[h, ids]]
        # least used first, then lowest rank, older page first among ties (lexsort: last key is primary)
        keys = (ids, page_rank[h, ids]) if uses is None else (ids, page_rank[h, ids], uses[h, ids])
        order = ids[np.lexsort(keys)]
        freed = np.cumsum(page_count[h, order])
        k = int(np.searchsorted(freed, held - target, side="left")) + 1
        plans.append(order[: min(k, len(order))])
    return plans


def _least_kept(first: np.ndarray, rank: np.ndarray, m: int) -> np.ndarray:
    """Indices of the `m` entries least worth keeping, by ``(first, rank, index)`` ascending, in that order:
    linear in the entries, then a sort of the `m` taken (a host tier holds thousands of pages a head)."""
    n = len(first)
    if m >= n:
        return np.lexsort((np.arange(n), rank, first))
    if m <= 0:
        return np.empty(0, dtype=np.int64)
    t = np.partition(first, m - 1)[m - 1]
    below = np.flatnonzero(first < t)
    tie = np.flatnonzero(first == t)
    need = m - len(below)
    if need < len(tie):   # among the ties the lowest ranks, the first (oldest) among equal ranks
        rt = np.partition(rank[tie], need - 1)[need - 1]
        low = tie[rank[tie] < rt]
        tie = np.concatenate([low, tie[rank[tie] == rt][:need - len(low)]])
    taken = np.concatenate([below, tie])
    return taken[np.lexsort((taken, rank[taken], first[taken]))]


def plan_promotion(
    cand_heads: np.ndarray,
    cand_pids: np.ndarray,
    uses: np.ndarray,
    page_rank: np.ndarray,
    on_host: np.ndarray,
    landed: np.ndarray,
    clean: np.ndarray,
    budget_pages: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Which disk pages just brought up by recall (``(cand_heads[i], cand_pids[i])``) the host tier keeps, and
    which host pages go down to make room for them.

    A host under `budget_pages` pages a head takes the best candidates into its free room. Past it, a candidate
    takes the place of a host page worth less: fewer recent uses (`uses`, the candidates' own use counted),
    then a lower rank. So the host keeps the pages recall keeps coming back for (the least used lately goes
    first, and a page used once does not push out one used more), and the placement by rank holds among the
    pages recall has not asked for. Of the host pages worth less than the candidates kept, the least used go
    first, and among as often used ones those with a `clean` copy on disk (they go down unwritten). Only pages
    whose copies have `landed` (``[pages]``) may go.

    Returns ``(kept, down_heads, down_pids)``: a bool per candidate, and the host pages to move down.
    """
    kept = np.zeros(len(cand_pids), dtype=bool)
    down_h, down_p = [], []
    held = on_host.sum(axis=1)
    for h in np.unique(cand_heads):
        at = np.flatnonzero(cand_heads == h)
        c = cand_pids[at]
        best = np.lexsort((-c, page_rank[h, c], uses[h, c]))[::-1]   # most worth keeping first, older first
        at, c = at[best], c[best]
        free = min(max(0, budget_pages - int(held[h])), len(c))
        kept[at[:free]] = True
        rest = c[free:]
        if len(rest) == 0:
            continue
        ids = np.flatnonzero(on_host[h] & landed)
        u, r = uses[h, ids], page_rank[h, ids]
        low = _least_kept(u, r, len(rest))   # the host pages worth least, ascending: paired with the best candidates
        m = len(low)
        cu, cr = uses[h, rest[:m]], page_rank[h, rest[:m]]
        worse = (u[low] < cu) | ((u[low] == cu) & (r[low] < cr))
        swaps = m if worse.all() else int(np.argmin(worse))   # up to the first host page worth as much
        if swaps == 0:
            continue
        kept[at[free:free + swaps]] = True
        # every host page worth less than the last candidate kept may go in its place; among those, the least
        # used first, and among equally used the ones with a clean copy (they go down unwritten), then rank
        wu, wr = uses[h, rest[swaps - 1]], page_rank[h, rest[swaps - 1]]
        under = np.flatnonzero((u < wu) | ((u == wu) & (r < wr)))
        pick = under[_least_kept(2 * u[under].astype(np.int64) + ~clean[h, ids[under]], r[under], swaps)]
        down_h.append(np.full(swaps, h, dtype=np.int64))
        down_p.append(ids[pick])
    if not down_p:
        return kept, np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
    return kept, np.concatenate(down_h), np.concatenate(down_p).astype(np.int64)
