"""Attention that newly written entries receive from the queries written with them.

The attention-based baselines (TOVA, SnapKV, H2O) need it; attention-free scorers never do. It is computed
explicitly, in chunks of queries, from the query and the keys attention saw (the device entries, then the
new ones): ``O(q * k)`` extra work per layer, ``O(q^2)`` at prefill, which is the cost those methods carry.
"""

from __future__ import annotations

import torch


def received_attention(query: torch.Tensor, keys: torch.Tensor, new: int, scaling: float,
                       queries: slice = slice(None), chunk: int = 512) -> torch.Tensor:
    """Causal softmax attention from (a slice of) the step's queries to its `new` last keys.

    Parameters
    ----------
    query
        ``[1, q_heads, q, dim]``, the step's queries (``q == new``).
    keys
        ``[1, kv_heads, n, dim]``, what attention read: older entries, then the `new` ones.

    Returns
    -------
    ``[kv_heads, group, q_selected, new]`` float32.
    """
    q_heads, q_len, dim = query.shape[1], query.shape[2], query.shape[3]
    kv_heads, n = keys.shape[1], keys.shape[2]
    group = q_heads // kv_heads
    rows = torch.arange(q_len, device=query.device)[queries]
    k = keys[0].float()
    out = []
    for start in range(0, len(rows), chunk):
        r = rows[start:start + chunk]
        q = query[0, :, r].float().reshape(kv_heads, group, len(r), dim)
        logits = torch.einsum("hgqd,hkd->hgqk", q, k) * scaling
        key_pos = torch.arange(n, device=query.device) - (n - q_len)      # new keys at 0..q-1
        logits = logits.masked_fill(key_pos[None, :] > r[:, None], float("-inf"))
        out.append(torch.softmax(logits, dim=-1)[..., n - new:])
    return torch.cat(out, dim=2)
