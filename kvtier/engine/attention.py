"""Exact softmax attention over parts computed apart: each part gives its output and log-sum-exp, and the
parts are merged with their log-sum-exps (as split-KV decoding kernels do). Recalled pages, each device slab
and the step's new tokens are separate parts, so nothing is concatenated and no mask is built: the only
causal part is the new tokens' own square.
"""

from __future__ import annotations

import torch

from .. import native

_CHUNK_ELEMENTS = 1 << 22   # logits per block in the plain-torch path


def logits_of(q: torch.Tensor, k: torch.Tensor, scale: float, softcap: float | None = None) -> torch.Tensor:
    """Attention logits in float32 as the model's eager attention makes them: ``q k^T * scale``, then
    ``softcap * tanh(logits / softcap)`` when the model soft-caps them (Gemma 2)."""
    logits = torch.matmul(q.float(), k.float().transpose(-1, -2)).mul_(scale)
    if softcap is not None:
        logits = torch.tanh(logits.div_(softcap)).mul_(softcap)
    return logits


def _plain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
           causal: bool, softcap: float | None = None,
           mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference path in float32, in blocks of query rows: ``out`` ``[1, h, L, d]``, ``lse`` ``[1, h, L]``."""
    L, S = q.shape[2], k.shape[2]
    kf, vf = k.float(), v.float()
    outs, lses = [], []
    step = max(1, _CHUNK_ELEMENTS // max(1, q.shape[1] * S))
    for r in range(0, L, step):
        logits = logits_of(q[:, :, r:r + step], kf, scale, softcap)
        if causal:  # row i of the square sees keys 0..i
            rows = torch.arange(r, min(L, r + step), device=q.device)[:, None]
            logits.masked_fill_(torch.arange(S, device=q.device)[None, :] > rows, float("-inf"))
        if mask is not None:
            logits.add_(mask.float())
        lse = torch.logsumexp(logits, dim=-1)
        outs.append(torch.matmul(torch.exp(logits - lse[..., None]), vf))
        lses.append(lse)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def attend_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    causal: bool = False, softcap: float | None = None,
                    mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of ``q`` ``[1, h, L, d]`` over ``k, v`` ``[1, h, S, d]`` and its log-sum-exp.

    `causal` aligns row ``i`` with key ``i`` (the part is a square of new tokens); `mask` ``[1, h, 1, S]`` is
    added to the logits (0, or -inf for a key left out: a recall buffer's slots not chosen). Uses the fused kernels
    that return the log-sum-exp (flash on CPU, memory-efficient on CUDA), else a blocked float32 path (also
    for soft-capped logits, which the fused kernels do not apply).
    Returns ``out`` ``[1, h, L, d]`` (float32) and ``lse`` ``[1, h, L]`` float32.
    """
    if k.shape[2] == 0:
        return (q.new_zeros(q.shape, dtype=torch.float32),
                torch.full(q.shape[:3], float("-inf"), device=q.device))
    k, v = k.to(q.dtype), v.to(q.dtype)
    if softcap is not None:
        return _plain(q, k, v, scale, causal, softcap, mask)
    if q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16, torch.float16):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=None if mask is None else mask.to(q.dtype), scale=scale)
        return out.float(), lse
    if mask is not None:
        return _plain(q, k, v, scale, causal, None, mask)
    if q.device.type == "cuda" and q.dtype in (torch.float32, torch.bfloat16, torch.float16):
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.0, causal, scale=scale)[:2]
        return out.float(), lse[..., :q.shape[2]]
    return _plain(q, k, v, scale, causal, None, mask)


def merge(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Combine ``(out, lse)`` of disjoint key sets into the attention over their union (float32)."""
    return merge_with_lse(parts)[0]


def merge_with_lse(parts: list[tuple[torch.Tensor, torch.Tensor]],
                   kernels: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`merge`, with the log-sum-exp of the union (the softmax's normaliser, for attention weights).

    `kernels`: merge through `kvtier.native.merge_parts` (one launch per four parts where its kernel runs,
    against some seven here; its exp and log round their own way)."""
    if len(parts) == 1:
        return parts[0]
    if kernels:
        out, lse = native.merge_parts([(o[0], lse[0]) for o, lse in parts])
        return out[None], lse[None]
    lse = torch.stack([p[1] for p in parts])
    total = torch.logsumexp(lse, dim=0)
    weights = torch.exp(lse - total).nan_to_num_(0.0)    # a part with no keys has weight 0
    out = parts[0][0] * weights[0][..., None]
    for (o, _), w in zip(parts[1:], weights[1:]):
        out.addcmul_(o, w[..., None])
    return out, total


def sink_part(sinks: torch.Tensor, kv_heads: int, rows: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A learned sink logit per query head (GPT-OSS) as a part: it takes softmax mass and adds nothing.

    ``sinks`` ``[q_heads]``; returns ``(out, lse)`` ``[1, kv_heads, group * rows, dim]``, ``[1, kv_heads, group * rows]``
    in the packed layout of `attend_parts` (row ``g * rows + t``).
    """
    group = sinks.shape[0] // kv_heads
    lse = sinks.detach().float().reshape(kv_heads, group, 1).expand(kv_heads, group, rows)
    lse = lse.reshape(1, kv_heads, group * rows)
    return lse.new_zeros(1, kv_heads, group * rows, dim), lse


def attend_parts(query: torch.Tensor, past: list[tuple[torch.Tensor, torch.Tensor]], new_k: torch.Tensor | None,
                 new_v: torch.Tensor | None, new_from: int, scale: float, softcap: float | None = None,
                 sinks: torch.Tensor | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Attention of a block of queries over each of several key sets: ``(out, lse)`` per set, to be merged.

    Parameters
    ----------
    query
        ``[1, q_heads, L, dim]``: the block's queries, the tokens at rows ``new_from .. new_from + L`` of the
        step's new tokens.
    past
        ``(k, v)`` ``[1, kv_heads, n_i, dim]`` key sets older than every query (recalled pages, device slabs).
    new_k, new_v
        ``[1, kv_heads, new_from + L, dim]``: the step's new tokens up to the end of the block; None when a
        single query's own token is already in `past` (no part needs a causal mask then).
    new_from
        How many new tokens come before the block (all visible to it).
    scale
        The logit scale.
    softcap, sinks
        The model's logit soft-cap and learned per-query-head sink logits ``[q_heads]``, if it has them.

    Returns
    -------
    ``(out, lse)`` per non-empty key set: ``[1, kv_heads, group * L, dim]`` and ``[1, kv_heads, group * L]``
    float32, the query heads of a KV head packed as rows (row ``g * L + t``).
    """
    _, q_heads, L, dim = query.shape
    kv_heads = past[0][0].shape[1] if new_k is None else new_k.shape[1]
    group = q_heads // kv_heads
    packed = query.reshape(1, kv_heads, group * L, dim)   # a KV head's query heads become extra rows
    parts = [attend_with_lse(packed, k, v, scale, softcap=softcap) for k, v in past if k.shape[2]]
    if new_k is not None:
        if new_from:
            parts.append(attend_with_lse(packed, new_k[:, :, :new_from], new_v[:, :, :new_from], scale,
                                         softcap=softcap))
        if L == 1:
            parts.append(attend_with_lse(packed, new_k[:, :, new_from:], new_v[:, :, new_from:], scale,
                                         softcap=softcap))
        else:  # the causal square, one query head at a time against its KV head
            sq_k = new_k[:, :, new_from:].repeat_interleave(group, dim=1)
            sq_v = new_v[:, :, new_from:].repeat_interleave(group, dim=1)
            out, lse = attend_with_lse(query, sq_k, sq_v, scale, causal=True, softcap=softcap)
            parts.append((out.reshape(1, kv_heads, group * L, dim), lse.reshape(1, kv_heads, group * L)))
    if sinks is not None:
        parts.append(sink_part(sinks, kv_heads, L, dim))
    return parts


def finish(parts: list[tuple[torch.Tensor, torch.Tensor]], query: torch.Tensor) -> torch.Tensor:
    """Merge `attend_parts` results into ``[1, L, q_heads, dim]`` in the query's dtype (transformers' layout)."""
    return finish_with_lse(parts, query)[0]


def finish_with_lse(parts: list[tuple[torch.Tensor, torch.Tensor]], query: torch.Tensor,
                    kernels: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`finish`, with the union's log-sum-exp ``[1, kv_heads, group * L]`` (packed rows); `kernels` as in
    `merge_with_lse`."""
    _, q_heads, L, dim = query.shape
    out, lse = merge_with_lse(parts, kernels)
    out = out.reshape(1, q_heads, L, dim)
    return out.transpose(1, 2).to(query.dtype).contiguous(), lse


def attend_split(query: torch.Tensor, past: list[tuple[torch.Tensor, torch.Tensor]], new_k: torch.Tensor | None,
                 new_v: torch.Tensor | None, new_from: int, scale: float, softcap: float | None = None,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Exact attention of a block of queries over `past` key sets and the step's new tokens (see
    `attend_parts`): ``[1, L, q_heads, dim]``."""
    return finish(attend_parts(query, past, new_k, new_v, new_from, scale, softcap, sinks), query)
