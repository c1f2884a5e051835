"""Property-based: the host pool's slots under random batches of reserves and frees, against a plain-Python model.

The rule modelled: a batch takes the freed slots first, the most recently freed batch's lowest first (a stack of
freed batches, each pushed lowest on top), then never used slots in order; a freed batch that ends at the last
slot ever handed out gives that tail back to the never-used range (a failed demotion returns its slots and leaves
the pool as it was). Slabs are added only when the free slots cannot hold a batch. `compact` keeps the slabs the
pages need plus half a slab, moving the pages past them into the lowest free slots below, in order.
"""

from __future__ import annotations

import numpy as np
import pytest
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

    def compact(self, slabs: int) -> tuple[int, dict[int, int]]:
        """The slabs kept and the moves (old slot -> new slot) of a pool of `slabs` slabs."""
        keep = max(1, -(-(len(self.held) + PER_SLAB // 2) // PER_SLAB))
        if slabs <= keep:
            return slabs, {}
        cut = keep * PER_SLAB
        old = sorted(s for s in self.held if s >= cut)
        moves = dict(zip(old, [s for s in range(cut) if s not in self.held]))
        self.held = (self.held - set(old)) | set(moves.values())
        self.next = max(self.held) + 1 if self.held else 0
        self.stack = [s for s in range(self.next) if s not in self.held][::-1]
        return keep, moves


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


def test_a_free_interrupted_before_its_slots_reach_the_stack_leaves_the_pool_as_it_was():
    """Ctrl-C between marking the slots free and putting them on the stack lost them (and a retried free was
    refused: they held no page)."""
    pool = HostPool(4, 8, torch.float32, pin=False)
    k = torch.randn(4, 4, 8)
    slots = pool.store(k, k)

    class Interrupting(list):
        def extend(self, items):
            super().extend(items)
            raise KeyboardInterrupt

    real = pool._free
    pool._free = Interrupting(real)
    with pytest.raises(KeyboardInterrupt):
        pool.free(slots[:2])
    pool._free = list(pool._free)
    assert pool.pages() == 4 and not pool._free
    pool.free(slots[:2])
    assert sorted(pool.store(k[:2], k[:2]).tolist()) == sorted(slots[:2].tolist())
    assert torch.equal(pool.load(slots[2:])[0], k[2:])
    pool.close()


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["store", "adopt", "free", "compact"]), st.integers(1, 20),
                          st.randoms(use_true_random=False)), max_size=30))
def test_compaction_follows_the_model_and_keeps_every_page(ops):
    """Stores, adoptions of slabs filled apart, frees and compactions in any order: the slots follow the model,
    every page held reads back what was stored, a compaction lets go of every slab past those it keeps, and an
    empty pool takes adopted slabs themselves (a pool holding pages stores copies)."""
    pool = HostPool(2, 4, torch.float32, pin=False, slab_bytes=PER_SLAB * 2 * 4 * 4)
    model = Model()
    pages: dict[int, float] = {}   # slot -> the value its page was filled with
    made = 0
    for op, n, rnd in ops:
        if op in ("store", "adopt") or not pages and op == "free":
            values = torch.arange(made, made + n, dtype=torch.float32)
            made += n
            k = values[:, None, None].expand(n, 2, 4).contiguous()
            if op == "adopt":
                filled = pool.new_slabs(n)
                filled.k.write_range(0, k)
                filled.v.write_range(0, -k)
                empty, slabs = pool._next == 0, [t.data_ptr() for t in filled.k.slabs]
                got = pool.adopt(filled)
                ptrs = [t.data_ptr() for t in pool.k.slabs]
                if empty:   # the slabs themselves, as many as `store` would have grown
                    assert ptrs == slabs and len(ptrs) == -(-n // PER_SLAB)
                else:       # copies, in the pool's own slabs
                    assert not set(ptrs) & set(slabs)
            else:
                got = pool.store(k, -k)
            assert got.tolist() == model.take(n)
            pages.update(zip(got.tolist(), values.tolist()))
        elif op == "free":
            gone = [s for s in pages if rnd.random() < 0.5] or [rnd.choice(sorted(pages))]
            pool.free(np.array(gone, dtype=np.int64))
            model.free(gone)
            for s in gone:
                del pages[s]
        else:
            slabs = len(pool.k.slabs)
            old, new = pool.compact()
            keep, moves = model.compact(slabs)
            assert dict(zip(old.tolist(), new.tolist())) == moves
            assert len(pool.k.slabs) == len(pool.v.slabs) == keep
            pages = {moves.get(s, s): value for s, value in pages.items()}
        assert pool.pages() == len(model.held) == len(pages) and set(pages) == model.held
        if pages:
            slots = np.array(sorted(pages), dtype=np.int64)
            k, v = pool.load(slots)
            want = torch.tensor([pages[s] for s in slots.tolist()])
            assert torch.equal(k[:, 0, 0], want) and torch.equal(v[:, 1, 3], -want)
            assert slots.max() < pool.k.capacity


@pytest.mark.parametrize("failing_call", [1, 2, 3, 4])
def test_a_compaction_that_runs_out_of_memory_leaves_the_pool_as_it_was(monkeypatch, failing_call):
    """No memory at any of the slot arrays a compaction works out (numpy's `flatnonzero`, 4 calls): every one is
    made before the pool changes, so the pool is as it was, and the next compaction goes through."""
    from kvtier.tiers import host as host_module

    pool = HostPool(2, 4, torch.float32, pin=False, slab_bytes=PER_SLAB * 2 * 4 * 4)
    k = torch.arange(40, dtype=torch.float32)[:, None, None].expand(40, 2, 4).contiguous()
    slots = pool.store(k, -k)
    pool.free(slots[5:35])
    kept = np.concatenate([slots[:5], slots[35:]])
    before = (pool._held.copy(), pool._next, list(pool._free), len(pool.k.slabs), pool.load(kept)[0].clone())

    class ShortOfMemory:
        calls = 0

        def __getattr__(self, name):
            return getattr(np, name)

        def flatnonzero(self, a):
            self.calls += 1
            if self.calls == failing_call:
                raise MemoryError()
            return np.flatnonzero(a)

    monkeypatch.setattr(host_module, "np", ShortOfMemory())
    with pytest.raises(MemoryError):
        pool.compact()
    monkeypatch.undo()
    after = (pool._held, pool._next, pool._free, len(pool.k.slabs), pool.load(kept)[0])
    assert np.array_equal(before[0], after[0]) and before[1:4] == after[1:4] and torch.equal(before[4], after[4])
    old, new = pool.compact()
    assert len(old) == 5 and len(pool.k.slabs) < before[3]
    assert torch.equal(pool.load(np.concatenate([kept[:5], new]))[0], before[4])
