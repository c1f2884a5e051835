"""The scorer contract: rank newly written cache entries once, from their key, value and position.

A scorer is any object with ``score(keys, values, positions, layer_idx) -> Tensor``:

- ``keys``, ``values``: ``[batch, kv_heads, tokens, head_dim]``, keys post-RoPE as cached;
- ``positions``: ``[tokens]`` int64, the absolute positions of those entries;
- ``layer_idx``: the layer they belong to (learned scorers keep one agent per layer and head);
- returns ``[batch, kv_heads, tokens]`` floats; higher means more important.

Ranking, budgets and movement belong to other modules.

A scorer that needs attention weights (TOVA, SnapKV, H2O) sets ``needs_query = True``; it is then called
after attention, with the keyword arguments ``query`` ``[batch, q_heads, tokens, head_dim]``,
``context_keys`` (the keys attention read, new ones last) and ``scaling``.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from ..errors import ScorerError


@runtime_checkable
class Scorer(Protocol):
    """Anything that ranks cache entries (see the module docstring for shapes)."""

    name: str

    def score(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
              layer_idx: int) -> torch.Tensor: ...


def checked_scores(scorer: Scorer, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                   layer_idx: int, **query_kwargs: Any) -> torch.Tensor:
    """Call `scorer` and verify its output, so a faulty scorer fails loudly instead of mis-ranking."""
    out = scorer.score(keys, values, positions, layer_idx, **query_kwargs)
    expected = tuple(keys.shape[:3])
    name = getattr(scorer, "name", type(scorer).__name__)
    if not isinstance(out, torch.Tensor):
        raise ScorerError(f"scorer {name!r} returned {type(out).__name__}; expected a tensor of shape "
                          f"[batch, kv_heads, tokens] = {list(expected)}")
    if tuple(out.shape) != expected:
        raise ScorerError(f"scorer {name!r} returned shape {list(out.shape)}; expected "
                          f"[batch, kv_heads, tokens] = {list(expected)}")
    if not out.is_floating_point():
        raise ScorerError(f"scorer {name!r} returned dtype {out.dtype}; expected a floating-point tensor")
    out = out.float()
    if torch.isnan(out).any():
        raise ScorerError(f"scorer {name!r} returned NaN scores at layer {layer_idx}; scores must be "
                          "ordered numbers (+inf/-inf are allowed)")
    return out
