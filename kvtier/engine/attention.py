"""Exact softmax attention over the device entries, the recalled pages and the new tokens."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def attend_union(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, rec_k: torch.Tensor,
                 rec_v: torch.Tensor, rec_valid: torch.Tensor, scaling: float | None) -> torch.Tensor:
    """One softmax over recalled + device + new entries.

    Parameters
    ----------
    query
        ``[1, q_heads, q_len, dim]``.
    key, value
        ``[1, kv_heads, n, dim]``: device entries then the `q_len` new tokens (last), as the cache returned.
    rec_k, rec_v
        ``[kv_heads, r, dim]`` recalled entries (all older than every query).
    rec_valid
        ``[kv_heads, r]`` bool: which recalled rows are real (pages may be partly filled).

    Returns
    -------
    ``[1, q_len, q_heads, dim]``, the layout transformers' attention functions return.
    """
    q_heads, q_len, dim = query.shape[1], query.shape[2], query.shape[3]
    kv_heads, n = key.shape[1], key.shape[2]
    group = q_heads // kv_heads
    r = rec_k.shape[1]
    keys = torch.cat([rec_k.unsqueeze(0).to(key.dtype), key], dim=2)
    values = torch.cat([rec_v.unsqueeze(0).to(value.dtype), value], dim=2)
    past = n - q_len
    causal = torch.ones(q_len, past + q_len, dtype=torch.bool, device=key.device)
    causal[:, past:] = torch.tril(causal[:, past:])
    mask = torch.cat([rec_valid[:, None, :].expand(kv_heads, q_len, r),
                      causal.expand(kv_heads, q_len, past + q_len)], dim=2)
    # run on the KV heads: the `group` query heads of a KV head become extra query rows (no K/V copies)
    packed_q = query.reshape(1, kv_heads, group * q_len, dim)
    packed_mask = mask[:, None].expand(kv_heads, group, q_len, r + n).reshape(1, kv_heads, group * q_len, r + n)
    out = F.scaled_dot_product_attention(packed_q, keys, values, attn_mask=packed_mask, scale=scaling)
    return out.reshape(1, q_heads, q_len, dim).transpose(1, 2).contiguous()
