"""Steps of several `LayerEngine`s fed alike, for the tests that hold two ways of recalling to the same output."""

from __future__ import annotations

import torch


def step_all(engines, k, q=None):
    """One step of every engine: write ``k`` (values ``k`` reversed), attend with `q` when given, commit."""
    outs = []
    for e in engines:
        e.write(k, k.flip(-1))
        if q is not None:
            outs.append(e.attend(q)[0])
        e.commit()
    return outs


def drifting_queries(g, steps, heads=4, dim=16, keep=0.9, noise=0.45):
    """Decode queries that move slowly, as a model's do: each is mostly the one before."""
    q = torch.randn(1, heads, 1, dim, generator=g)
    for _ in range(steps):
        q = keep * q + noise * torch.randn(1, heads, 1, dim, generator=g)
        yield q
