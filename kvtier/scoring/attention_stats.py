"""Attention that newly written entries receive from the queries written with them.

The attention-based baselines (TOVA, SnapKV, H2O) need it; attention-free scorers never do. It is computed
explicitly, in chunks of queries, from the query and the keys attention saw (the device entries, then the
new ones): ``O(q * k)`` extra work per layer, ``O(q^2)`` at prefill, which is the cost those methods carry.

A chunk of queries reads only the keys causally visible to its last query, and only its diagonal block is
masked, so a prefill's attention costs half the full square. H2O needs only the sum over queries:
`received_attention_sum` adds chunk by chunk and never holds the ``q x q`` matrix, whose size (2 GiB per
layer at 7,680 tokens for a 9-head model) made allocation, not arithmetic, the cost. For the same reason a
chunk's logits stay under `CHUNK_BYTES`: larger blocks are mapped and unmapped by the allocator on every
chunk, which cost as much time in the kernel as the arithmetic took (2x slower at 7,680 tokens).
"""

from __future__ import annotations

from typing import Iterator

import torch

from .base import check_one_sequence

CHUNK_BYTES = 16 << 20          # float32 logits of one chunk of queries, in host memory
DEVICE_CHUNK_BYTES = 256 << 20  # on an accelerator: its caching allocator reuses blocks, and fewer launches pay


def chunk_rows(q_heads: int, keys: int, device: torch.device | str = "cpu") -> int:
    """Queries per chunk so that their logits over `keys` keys fit `CHUNK_BYTES` (`DEVICE_CHUNK_BYTES` off the
    CPU); at least 1, at most 512."""
    budget = CHUNK_BYTES if torch.device(device).type == "cpu" else DEVICE_CHUNK_BYTES
    return max(1, min(512, budget // (4 * q_heads * max(keys, 1))))


def _chunks(query: torch.Tensor, keys: torch.Tensor, new: int, scaling: float, queries: slice,
            chunk: int | None, softcap: float | None = None) -> Iterator[tuple[int, int, torch.Tensor]]:
    """Per chunk of the selected queries, ``(first, count, probs)``: the chunk is rows ``first..first+count-1``
    of the step, ``probs`` ``[kv_heads, group, count, seen]`` its causal softmax over the first ``seen`` of the
    `new` last keys (every later key is masked for every row of the chunk, so it is left out). `softcap`: the
    logits capped as the model's attention caps them, ``softcap * tanh(logits / softcap)``."""
    for t in (query, keys):
        check_one_sequence(t, "attention-based scoring")
    q_heads, q_len, dim = query.shape[1], query.shape[2], query.shape[3]
    kv_heads, n = keys.shape[1], keys.shape[2]
    if not q_len <= new <= n:
        raise ValueError(f"new={new} with {q_len} queries and {n} keys; allowed: from the number of queries "
                         "(each query's own key is among the new ones) to the number of keys")
    start, stop, stride = queries.indices(q_len)
    if stride != 1:
        raise ValueError(f"queries must be a contiguous slice; got step {stride}")
    group = q_heads // kv_heads
    older = n - q_len                                # entries written before the step's first query
    k = keys[0].float()
    chunk = chunk or chunk_rows(q_heads, n, query.device)
    for first in range(start, stop, chunk):
        count = min(chunk, stop - first)
        visible = older + first + count
        q = query[0, :, first:first + count].float().reshape(kv_heads, group, count, dim)
        logits = torch.einsum("hgqd,hkd->hgqk", q, k[:, :visible]).mul_(scaling)
        if softcap:
            logits = logits.div_(softcap).tanh_().mul_(softcap)
        diagonal = logits[..., visible - count:]    # row i sees diagonal column j only when j <= i
        later = torch.ones(count, count, dtype=torch.bool, device=query.device).triu_(1)
        diagonal.masked_fill_(later, float("-inf"))
        yield first, count, torch.softmax(logits, dim=-1)[..., n - new:]


def received_attention(query: torch.Tensor, keys: torch.Tensor, new: int, scaling: float,
                       queries: slice = slice(None), chunk: int | None = None,
                       softcap: float | None = None) -> torch.Tensor:
    """Causal softmax attention from (a contiguous slice of) the step's queries to the `new` last keys.

    Parameters
    ----------
    query
        ``[1, q_heads, q, dim]``, the step's queries, written with the last ``q`` keys (``q <= new``: with
        ``new`` above ``q`` the result also covers older keys, as a trace's continuation reads its prompt).
    keys
        ``[1, kv_heads, n, dim]``, what attention read: older entries, then the `new` ones.

    Returns
    -------
    ``[kv_heads, group, q_selected, new]`` float32.
    """
    kv_heads = keys.shape[1]
    start, stop, _ = queries.indices(query.shape[2])
    out = torch.zeros(kv_heads, query.shape[1] // kv_heads, max(stop - start, 0), new, device=query.device)
    for first, count, probs in _chunks(query, keys, new, scaling, queries, chunk, softcap):
        out[:, :, first - start:first - start + count, :probs.shape[-1]] = probs
    return out


def received_attention_sum(query: torch.Tensor, keys: torch.Tensor, new: int, scaling: float,
                           queries: slice = slice(None), chunk: int | None = None,
                           softcap: float | None = None) -> torch.Tensor:
    """`received_attention` summed over the selected queries, ``[kv_heads, group, new]`` float32, in memory
    for one chunk of queries only."""
    kv_heads = keys.shape[1]
    total = torch.zeros(kv_heads, query.shape[1] // kv_heads, new, device=query.device)
    for _, _, probs in _chunks(query, keys, new, scaling, queries, chunk, softcap):
        total[..., :probs.shape[-1]] += probs.sum(dim=2)
    return total
