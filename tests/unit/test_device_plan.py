"""The recall buffer's device-side plan gives exactly the host plan's fetches and slots, and the recall copy
it drives (`native.recall_pages`) fills the buffer as the host path does."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier import native
from kvtier.native import twins
from kvtier.recall.buffer import RecallBuffer
from kvtier.recall.device_plan import plan_on_device
from kvtier.tiers.slabs import SlabRows

from engine_steps import drifting_queries, step_all


def _wants(rng, heads, r, pages):
    return np.stack([np.sort(rng.choice(pages, size=r, replace=False)) for _ in range(heads)]).astype(np.int64)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(heads=st.integers(1, 4), r=st.integers(1, 12), extra=st.integers(0, 30), steps=st.integers(1, 6),
       seed=st.integers(0, 2**16))
def test_device_plan_equals_the_host_plan_step_after_step(heads, r, extra, steps, seed):
    rng = np.random.default_rng(seed)
    pages = r + extra
    buf = RecallBuffer(heads, r, 2, 4, torch.float32, torch.device("cpu"))
    held = torch.full((heads, r), -1, dtype=torch.int64)
    for _ in range(steps):
        want = _wants(rng, heads, r, pages)
        h, pids, slots = buf.plan(want)
        plan = plan_on_device(torch.from_numpy(want), held, pages)
        fetch, to, count, held_after = plan.fetch, plan.slots, plan.count, plan.held_after
        assert count.tolist() == np.bincount(h, minlength=heads).tolist()
        got = [(hh, int(fetch[hh, j]), int(to[hh, j])) for hh in range(heads) for j in range(int(count[hh]))]
        assert got == list(zip(h.tolist(), pids.tolist(), slots.tolist()))
        buf.ids[h, slots] = pids
        held = held_after
        assert np.array_equal(held.numpy(), buf.ids)
        assert all(set(held[hh].tolist()) == set(want[hh].tolist()) for hh in range(heads))


@settings(max_examples=60, deadline=None, derandomize=True)
@given(heads=st.integers(1, 3), r=st.integers(1, 8), spare=st.integers(0, 8), extra=st.integers(0, 20),
       steps=st.integers(1, 8), seed=st.integers(0, 2**16))
def test_a_buffer_with_spare_slots_keeps_what_is_wanted_where_it_is(heads, r, spare, extra, steps, seed):
    """A step's choice (``r`` pages) then a prefetch (the choice and ``spare`` more) into ``r + spare`` slots:
    every wanted page ends up held, a held page that is wanted keeps its slot, only unwanted slots change, and
    `where` finds each wanted page; the copy's rows, the prefetch flags and the counters follow the plan."""
    rng = np.random.default_rng(seed)
    pages, R = r + spare + extra, r + spare
    held = torch.full((heads, R), -1, dtype=torch.int64)
    host_slots = torch.from_numpy(rng.permutation(heads * pages).reshape(heads, pages).astype(np.int64))
    ahead = torch.zeros(heads, R, dtype=torch.bool)
    counts = torch.zeros(4, dtype=torch.int64)
    want_ahead, want_counts = ahead.clone(), counts.clone()
    for _ in range(steps):
        ranked = np.stack([rng.permutation(pages)[:R] for _ in range(heads)]).astype(np.int64)
        for prefetch, want in ((False, np.sort(ranked[:, :r], axis=1)), (True, ranked)):
            want = torch.from_numpy(np.ascontiguousarray(want))
            plan = plan_on_device(want, held, pages, host_slots, ahead, counts, prefetch=prefetch)
            fetch, slots, count, after = plan.fetch, plan.slots, plan.count, plan.held_after
            assert fetch.shape == slots.shape == plan.where.shape == want.shape
            for h in range(heads):
                before, now, wanted = held[h].tolist(), after[h].tolist(), set(want[h].tolist())
                assert wanted <= set(now) and len(set(p for p in now if p >= 0)) == sum(p >= 0 for p in now)
                n = int(count[h])
                assert n == len(wanted - set(before))
                assert set(fetch[h, :n].tolist()) == wanted - set(before)
                for slot, (old, new) in enumerate(zip(before, now)):
                    if old in wanted:
                        assert new == old          # kept where it was
                    elif new != old:
                        assert slot in slots[h, :n].tolist()   # only planned slots change
                for j in range(n):                 # the prefetch flags of the slots filled
                    want_ahead[h, slots[h, j]] = prefetch
            assert torch.equal(after.gather(1, plan.where), want)
            assert torch.equal(plan.src_rows, host_slots.gather(1, fetch))
            assert torch.equal(plan.dst_rows, slots + torch.arange(heads)[:, None] * R)
            moved = int(count.sum())
            if prefetch:
                want_counts[2] += moved
            else:                                  # chosen pages a prefetch had brought: counted, flags cleared
                used = int(want_ahead.gather(1, plan.where).sum())
                want_ahead.scatter_(1, plan.where, False)
                want_counts += torch.tensor([moved, want.numel() - moved, 0, used])
            assert torch.equal(ahead, want_ahead) and torch.equal(counts, want_counts)
            held = after


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_recall_pages_fills_only_the_planned_slots(dtype):
    g = torch.Generator().manual_seed(0)
    store = SlabRows((4, 8), dtype, "cpu", 5)
    store.ensure(13)
    for slab in store.slabs:
        slab.copy_(torch.randn(slab.shape, generator=g).to(dtype))
    heads, r = 3, 4
    src = torch.randint(0, 13, (heads, r), generator=g)
    dst = torch.stack([torch.randperm(r, generator=g) + h * r for h in range(heads)])
    count = torch.tensor([4, 0, 2])
    out = torch.full((heads * r, 4, 8), float("nan"), dtype=dtype)
    native.recall_pages(store.slabs, 5, src, dst, count, out)
    for h in range(heads):
        for j in range(r):
            row = out[dst[h, j]]
            if j < count[h]:
                assert torch.equal(row, store.slabs[int(src[h, j]) // 5][int(src[h, j]) % 5])
            else:
                assert torch.isnan(row.float()).all()
    bad = src.clone()
    bad[0, 0] = 99                  # outside the storage: skipped, as the kernel skips it
    again = torch.zeros_like(out)
    twins.recall_pages(store.slabs, 5, bad, dst, count, again)
    assert torch.equal(again[dst[0, 0]], torch.zeros_like(again[0]))


@pytest.mark.parametrize("recall_pages", [3, 8])
def test_an_engine_recalling_on_the_device_attends_exactly_as_the_host_path(make_engine, recall_pages):
    """The device-planned recall (forced here on the CPU) picks, fetches and attends bit for bit as the
    host-planned one, through demotions, and the counters agree once settled."""
    engines = [make_engine(heads=2, head_dim=16, device_budget=48, recall_pages=recall_pages, page_size=4,
                           prefetch_pages=0) for _ in range(2)]
    engines[1].device_recall = True
    g = torch.Generator().manual_seed(0)
    step_all(engines, torch.randn(1, 2, 300, 16, generator=g))
    for step in range(60):
        k = torch.randn(1, 2, 1, 16, generator=g)
        outs = step_all(engines, k, torch.randn(1, 4, 1, 16, generator=g))
        assert torch.equal(outs[0], outs[1]), f"step {step}"
    assert engines[1].recalled.on_device and not engines[0].recalled.on_device
    for e in engines:
        e.settle_counts()
    a, b = (e.counters for e in engines)
    assert (a.pages_recalled, a.pages_reused, a.bytes_moved["host_to_device"]) == \
        (b.pages_recalled, b.pages_reused, b.bytes_moved["host_to_device"])
    assert a.pages_reused > 0 and a.pages_recalled["host"] > 0


def test_index_rows_by_device_ids_equal_the_host_gather():
    from kvtier.recall.index import PageIndex, _rows_by_device_ids

    index = PageIndex(2, 16, 32, torch.bfloat16, torch.device("cpu"), pages_per_slab=4)
    index.add(torch.randn(2, 11, 16, 32, generator=torch.Generator().manual_seed(5)))
    rows = torch.tensor([21, 0, 7, 8, 15, 3])
    for storage in (index.bounds, index.codes):
        assert torch.equal(_rows_by_device_ids(storage, rows, torch.device("cpu")), storage.gather(rows))


@pytest.mark.parametrize("spare", [2, 8])
def test_prefetch_changes_what_moves_never_what_attention_reads(make_engine, spare):
    """A device-planned engine that prefetches the next-ranked pages chooses the same pages as the host path
    at every step and attends to exactly them; it fetches fewer pages on demand, and counts what its
    prefetches brought and what of that was chosen later."""
    kw = dict(heads=2, head_dim=16, device_budget=48, recall_pages=6, page_size=4)
    host = make_engine(**kw)
    plain = make_engine(**kw, prefetch_pages=0)
    ahead = make_engine(**kw, prefetch_pages=spare)
    engines = (host, plain, ahead)
    plain.device_recall = ahead.device_recall = True
    g = torch.Generator().manual_seed(0)
    step_all(engines, torch.randn(1, 2, 400, 16, generator=g))
    for step, q in enumerate(drifting_queries(g, 80)):
        outs = step_all(engines, torch.randn(1, 2, 1, 16, generator=g), q)
        assert torch.equal(host.last_recall, ahead.last_recall), f"step {step}"
        assert torch.equal(outs[0], outs[1])
        torch.testing.assert_close(outs[2], outs[0], rtol=1e-6, atol=1e-6)
        assert ahead.recalled.pages == 6 + spare and ahead.recalled.pending is not None
    for e in engines:
        e.settle_counts()
    base, got = plain.counters, ahead.counters
    on_demand = got.pages_recalled["host"] - got.pages_prefetched
    assert got.recall_steps == base.recall_steps and base.pages_prefetched == 0
    assert got.pages_reused + on_demand == base.pages_reused + base.pages_recalled["host"]   # same choices
    assert on_demand < base.pages_recalled["host"] and got.pages_reused > base.pages_reused
    assert 0 < got.prefetch_used <= got.pages_prefetched
    # each prefetched page counts once, when first chosen; a page chosen again later is a plain reuse
    assert got.prefetch_used <= got.pages_reused - base.pages_reused


def test_a_step_that_chooses_every_page_has_no_spare_slots(make_engine):
    """Spare slots (the prefetch's) only while some pages go unchosen: asked to recall more pages than there are
    (`recall_pages` as "everything"), the buffer is exactly the pages, where half of `recall_pages` of prefetch
    slots by default would be tens of gigabytes on a real model; once pages outnumber the choice, the slots come."""
    kw = dict(heads=2, head_dim=16, device_budget=48, page_size=4)
    every = make_engine(**kw, recall_pages=100_000)
    some = make_engine(**kw, recall_pages=6, prefetch_pages=4)
    every.device_recall = some.device_recall = True
    g = torch.Generator().manual_seed(1)
    step_all((every, some), torch.randn(1, 2, 64, 16, generator=g))
    widths = []
    for q in drifting_queries(g, 60):
        n = every.index.n   # the pages a step's attention chooses from (its commit may demote more)
        assert some.index.n == n
        step_all((every, some), torch.randn(1, 2, 1, 16, generator=g), q)
        assert every.recalled.pages == n, (every.recalled.pages, n)
        widths.append((n, some.recalled.pages))
    assert all(w == (n if n <= 6 else 6 + 4) for n, w in widths), widths
    assert any(n <= 6 for n, _ in widths) and any(n > 6 for n, _ in widths)


def test_prefetch_settings_are_checked_and_follow_where_recall_is_planned():
    from kvtier.config import ModelShape, TieredCacheConfig
    from kvtier.errors import ConfigError
    from kvtier.placement import Budget

    def cfg(**kw):
        return TieredCacheConfig(shape=ModelShape(1, 1, 8), device_budget=Budget(0.5, "device_budget"), **kw)

    for bad in (-1, 1.5, True, "4"):
        with pytest.raises(ConfigError, match=r"prefetch_pages=.*allowed: a whole number >= 0"):
            cfg(prefetch_pages=bad)
    assert cfg(recall_pages=9).prefetch(on_device=True) == 4
    assert cfg(recall_pages=9).prefetch(on_device=False) == 0
    assert cfg(recall_pages=9, prefetch_pages=7).prefetch(on_device=True) == 7
    assert cfg(recall_pages=0, prefetch_pages=7).prefetch(on_device=True) == 0


def test_a_recall_copy_that_fails_after_the_plan_drops_the_buffer(make_engine, monkeypatch):
    """The plan writes the buffer's page table in place before the copy: a copy that fails leaves a table
    naming pages that never came, so the buffer is dropped, and the next steps attend as the host path does."""
    engines = [make_engine(heads=2, head_dim=16, device_budget=48, recall_pages=4, page_size=4,
                           prefetch_pages=0) for _ in range(2)]
    engines[1].device_recall = True
    g = torch.Generator().manual_seed(3)
    step_all(engines, torch.randn(1, 2, 300, 16, generator=g))
    for _ in range(3):
        step_all(engines, torch.randn(1, 2, 1, 16, generator=g), torch.randn(1, 4, 1, 16, generator=g))
    assert engines[1].recalled is not None
    real = native.recall_pages

    def fail(*args, **kwargs):
        raise RuntimeError("copy failed")

    k, q = torch.randn(1, 2, 1, 16, generator=g), torch.randn(1, 4, 1, 16, generator=g)
    engines[0].write(k, k.flip(-1))
    engines[0].attend(q)
    engines[0].commit()
    engines[1].write(k, k.flip(-1))
    monkeypatch.setattr(native, "recall_pages", fail)
    with pytest.raises(RuntimeError, match="copy failed"):
        engines[1].attend(q)
    monkeypatch.setattr(native, "recall_pages", real)
    assert engines[1].recalled is None
    engines[1].commit()
    for step in range(20):
        outs = step_all(engines, torch.randn(1, 2, 1, 16, generator=g), torch.randn(1, 4, 1, 16, generator=g))
        assert torch.equal(outs[0], outs[1]), f"step {step}"
