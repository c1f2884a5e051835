"""The KVP objective and its two optimisers.

For a ranking ``sigma`` (best first) of entries with future-attention importance ``c``, keeping the top
``b`` loses ``sum_{i >= b} c[sigma_i]``; summed over every budget ``b = 1 .. n-1`` the loss is
``C(sigma) = sum_i i * c[sigma_i]`` (0-based rank ``i``). The reward is ``-C(sigma) / C(oracle)``, where
the oracle sorts by ``c``: the oracle scores -1, every other ranking less, the reversed one the least.

- `reinforce_loss`: REINFORCE over Plackett-Luce permutations sampled by Gumbel-sort, with a
  leave-one-out baseline (the paper's method).
- `listwise_loss`: a differentiable alternative, cross-entropy between ``softmax(scores)`` and the
  importance distribution ``c / sum(c)`` (ListNet).
"""

from __future__ import annotations

import torch


def ranking_cost(importance: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """``C = sum_i i * c[order_i]`` over the last axis; `order` lists indices best first."""
    ranks = torch.arange(order.shape[-1], device=importance.device, dtype=importance.dtype)
    return (torch.gather(importance.expand_as(order), -1, order) * ranks).sum(-1)


def reward(importance: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """``-C(order) / C(oracle)``: -1 for the oracle ranking, lower for worse ones."""
    oracle = torch.argsort(importance, dim=-1, descending=True)
    best = ranking_cost(importance, oracle).clamp_min(1e-12)  # broadcasts over sampled orders
    return -ranking_cost(importance, order) / best


def plackett_luce_log_prob(scores: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Log-probability of drawing `order` (best first) item by item, each by softmax over what is left."""
    s = torch.gather(scores.expand_as(order), -1, order)
    tail = torch.logcumsumexp(s.flip(-1), dim=-1).flip(-1)  # logsumexp of s[i:], for each i
    return (s - tail).sum(-1)


def reinforce_loss(scores: torch.Tensor, importance: torch.Tensor, samples: int,
                   generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE with a leave-one-out baseline.

    Parameters
    ----------
    scores, importance
        ``[..., n]``.
    samples
        Permutations drawn per ranking problem (>= 2 for the baseline).

    Returns
    -------
    ``(loss, mean reward of the samples)``.
    """
    expanded = scores.unsqueeze(-2).expand(*scores.shape[:-1], samples, scores.shape[-1])
    u = torch.rand(expanded.shape, generator=generator, device=scores.device).clamp(1e-9, 1 - 1e-9)
    gumbel = -torch.log(-torch.log(u))
    order = torch.argsort(expanded.detach() + gumbel, dim=-1, descending=True)
    imp = importance.unsqueeze(-2)
    r = reward(imp, order)                                          # [..., samples]
    baseline = (r.sum(-1, keepdim=True) - r) / (samples - 1)
    advantage = r - baseline
    advantage = advantage / (advantage.std() + 1e-8)
    log_p = plackett_luce_log_prob(expanded, order)
    return -(advantage.detach() * log_p).mean(), r.mean()


def listwise_loss(scores: torch.Tensor, importance: torch.Tensor) -> torch.Tensor:
    """Cross-entropy between the importance distribution and ``softmax(scores)``."""
    target = importance / importance.sum(-1, keepdim=True).clamp_min(1e-12)
    return -(target * torch.log_softmax(scores, dim=-1)).sum(-1).mean()
