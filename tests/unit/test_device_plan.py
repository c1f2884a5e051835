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
        fetch, to, count, held_after = plan_on_device(torch.from_numpy(want), held, pages)
        assert count.tolist() == np.bincount(h, minlength=heads).tolist()
        got = [(hh, int(fetch[hh, j]), int(to[hh, j])) for hh in range(heads) for j in range(int(count[hh]))]
        assert got == list(zip(h.tolist(), pids.tolist(), slots.tolist()))
        buf.ids[h, slots] = pids
        held = held_after
        assert np.array_equal(held.numpy(), buf.ids)
        assert all(set(held[hh].tolist()) == set(want[hh].tolist()) for hh in range(heads))


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
    engines = [make_engine(heads=2, head_dim=16, device_budget=48, recall_pages=recall_pages, page_size=4)
               for _ in range(2)]
    engines[1].device_recall = True
    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, 2, 300, 16, generator=g)
    for e in engines:
        e.write(k, k.flip(-1))
        e.commit()
    for step in range(60):
        k = torch.randn(1, 2, 1, 16, generator=g)
        q = torch.randn(1, 4, 1, 16, generator=g)
        outs = []
        for e in engines:
            e.write(k, k.flip(-1))
            outs.append(e.attend(q)[0])
            e.commit()
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
