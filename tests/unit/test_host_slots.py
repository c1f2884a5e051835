"""Property-based: the host pool's slots under random batches of reserves and frees, against a plain-Python model.

The rule modelled: a batch takes the freed slots first, the most recently freed batch's lowest first (a stack of
freed batches, each pushed lowest on top), then never used slots in order; a freed batch that ends at the last
slot ever handed out gives that tail back to the never-used range (a failed demotion returns its slots and leaves
the pool as it was). Slabs are added only when the free slots cannot hold a batch.
"""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.tiers.host import HostPool

PER_SLAB = 8


class Model:
    def __init__(self) -> None:
        self.stack: list[int] = []   # freed slots, the top last
        self.next = 0
        self.held: set[int] = set()
        self.peak = 0

    def take(self, n: int) -> list[int]:
        got = []
        while self.stack and len(got) < n:
            got.append(self.stack.pop())
        while len(got) < n:
            got.append(self.next)
            self.next += 1
        self.held |= set(got)
        self.peak = max(self.peak, self.next)
        return got

    def free(self, slots: list[int]) -> None:
        self.held -= set(slots)
        s = sorted(slots)
        while s and s[-1] == self.next - 1:
            self.next -= 1
            s.pop()
        self.stack.extend(reversed(s))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 20), st.randoms(use_true_random=False)), max_size=30))
def test_slots_follow_the_model(ops):
    pool = HostPool(2, 4, torch.float32, pin=False, slab_bytes=PER_SLAB * 2 * 4 * 4)
    model = Model()
    held: list[np.ndarray] = []
    for take, n, rnd in ops:
        if take or not held:
            got = pool.reserve(n)
            assert got.tolist() == model.take(n)
            held.append(got)
        else:   # give back one batch, or a random part of one
            batch = held.pop(rnd.randrange(len(held)))
            keep = [s for s in batch.tolist() if rnd.random() < 0.3]
            gone = np.array([s for s in batch.tolist() if s not in keep], dtype=np.int64)
            if keep:
                held.append(np.array(keep, dtype=np.int64))
            pool.free(gone)
            model.free(gone.tolist())
        assert pool.pages() == len(model.held) == sum(len(b) for b in held)
        every = np.concatenate(held) if held else np.empty(0, dtype=np.int64)
        assert len(np.unique(every)) == len(every)                         # no slot held twice
        assert pool.k.capacity == -(-model.peak // PER_SLAB) * PER_SLAB    # a slab only when needed
        assert every.size == 0 or every.max() < pool.k.capacity


def test_a_slot_that_holds_no_page_is_refused_by_free():
    """A slot freed twice, never handed out, or given twice in one call had gone onto the free stack again, to
    be handed to two pages (one page's load then returned the other's data); each is refused before anything
    changes, as the disk store refuses them."""
    import pytest

    pool = HostPool(4, 8, torch.float32, pin=False)
    k = torch.randn(4, 4, 8)
    slots = pool.store(k, k)
    pool.free(slots[1:2])
    for bad in (slots[1:2], np.array([7]), np.array([-1]), np.array([2, 2]), np.array([2.0])):
        with pytest.raises(ValueError, match="holds no page|whole numbers"):
            pool.free(bad)
    assert pool.pages() == 3
    a, b = torch.full((1, 4, 8), 1.0), torch.full((1, 4, 8), 2.0)
    sa, sb = pool.store(a, a), pool.store(b, b)
    assert sa[0] != sb[0] and torch.equal(pool.load(sa)[0], a) and torch.equal(pool.load(sb)[0], b)
    pool.clear()
    with pytest.raises(ValueError, match="holds no page"):
        pool.free(sa)
    pool.close()
