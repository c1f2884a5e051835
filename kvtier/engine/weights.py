"""Attention weights over what a step attended, for ``output_attentions`` with eager attention.

The split attention never forms the softmax matrix; when the model asks for it, the weights are rebuilt
from each key set's logits and the union's log-sum-exp, and laid out by token position: column ``j`` is
the token at position ``j``, so with every page recalled the matrix equals the one a plain cache gives.
Entries that stayed in a lower tier this step have weight 0.
"""

from __future__ import annotations

import torch

from .attention import logits_of


def weights_by_position(packed: torch.Tensor, key_sets: list[tuple[torch.Tensor, torch.Tensor]],
                        lse: torch.Tensor, query_pos: torch.Tensor, length: int, scale: float,
                        softcap: float | None = None) -> torch.Tensor:
    """Softmax weights ``[kv_heads, group * L, length]`` of packed queries over several key sets.

    Parameters
    ----------
    packed
        ``[1, kv_heads, group * L, dim]`` queries, a KV head's query heads as rows (row ``g * L + t``).
    key_sets
        ``(keys [kv_heads, n, dim], positions [kv_heads, n])`` per attended set; a key after a row's own
        position is masked out (the causal rule, for the step's new tokens).
    lse
        ``[1, kv_heads, group * L]`` the log-sum-exp of the whole attention (sinks included).
    query_pos
        ``[L]`` the positions of the queries.
    length
        Columns: the tokens seen so far.
    """
    _, kv_heads, rows, _ = packed.shape
    L = query_pos.shape[0]
    out = torch.zeros(kv_heads, rows, length, dtype=torch.float32, device=packed.device)
    row_pos = query_pos.repeat(rows // L)                        # [rows]: the position of each packed row
    for keys, pos in key_sets:
        if keys.shape[1] == 0:
            continue
        w = torch.exp(logits_of(packed[0], keys, scale, softcap) - lse[0][..., None])   # [kv, rows, n]
        w.masked_fill_(pos[:, None, :] > row_pos[None, :, None], 0.0)
        out.scatter_(2, pos[:, None, :].expand(-1, rows, -1), w)
    return out


def unpack_rows(weights: torch.Tensor, q_heads: int) -> torch.Tensor:
    """``[kv_heads, group * L, S]`` -> ``[1, q_heads, L, S]`` (transformers' layout)."""
    kv_heads, rows, S = weights.shape
    return weights.reshape(q_heads, rows * kv_heads // q_heads, S)[None]
