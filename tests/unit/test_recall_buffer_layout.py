"""A cache parked and resumed, or deep-copied, between decode steps goes on bit for bit as a twin that was not.

With partial recall the recall buffer holds the chosen pages in the slots they happened to land in, and attention
over it sums in slot order (planned on the host; planned on the device, a step of several tokens over a buffer
without spare slots); a buffer rebuilt in another order rounds otherwise (1e-8 here, enough to flip a near-tie).
The buffer's layout is therefore kept across a park or a copy and the next buffer takes the same pages into the
same slots.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier import TieredCache, cache_kwargs
from kvtier.recall.buffer import RecallBuffer

# 51 prompt tokens at 20% on the device: three demoted pages a layer and head, two recalled a step, so the
# buffer's slots come to hold the pages out of their id order
SETTINGS = dict(device_budget=0.2, recall_pages=2, scorer="keydiff", page_size=16, demote_pages=3)


def _twins(model, disk_dir, **extra):
    return [TieredCache(model.config, disk_dir=disk_dir, **{**SETTINGS, **extra}) for _ in range(2)]


@torch.no_grad()
def _decode_side_by_side(model, caches, ops, on_device=False):
    """Feed both caches the same tokens; between steps apply `ops` (`park:host`, `park:disk`, `resume`, `copy`)
    to the first only (`chunk`: a few tokens at once to both). Every step's logits must be the same bits."""
    a, b = (c.take_gpu_path() for c in caches) if on_device else caches
    ids = torch.randint(0, 128, (1, 51), generator=torch.Generator().manual_seed(0))
    x = model(ids, **cache_kwargs(a)).logits[:, -1]
    assert torch.equal(x, model(ids, **cache_kwargs(b)).logits[:, -1])
    for step, op in enumerate(["step"] * 5 + ops + ["step"] * 6):
        if op == "copy":
            if a.parked is not None:   # a parked cache is resumed before it is copied (a copy of one is refused)
                a.resume()
            a2 = copy.deepcopy(a)
            a.close()
            a = a2   # a copy takes the path its original took
            assert all((e.device_recall, e.select_kernels, e.defer_nan, e.index is None or e.index.native_select)
                       == ((True,) * 4 if on_device else (None, None, None, None)) for e in a._engines)
        elif op.startswith("park:"):
            a.park(op[5:])
        elif op == "resume":
            a.resume()
        else:
            tokens = x.argmax(-1, keepdim=True) if op == "step" else torch.arange(7)[None] + step
            x = model(tokens, **cache_kwargs(a)).logits[:, -1]
            y = model(tokens, **cache_kwargs(b)).logits[:, -1]
            assert torch.equal(x, y), f"step {step} after {ops}: logits differ by {(x - y).abs().max():.1e}"
    return a, b


OPS = [["park:host"], ["park:disk"], ["park:host", "resume"], ["copy"], ["park:host", "park:disk", "resume", "copy"],
       ["park:disk", "chunk"], ["copy", "chunk"]]


@pytest.mark.parametrize("retain", [0, 2])
@pytest.mark.parametrize("ops", OPS, ids="-".join)
def test_decoding_goes_on_bit_for_bit(model, tmp_path, ops, retain):
    a, b = _decode_side_by_side(model, _twins(model, tmp_path, retain_pages=retain), ops)
    try:
        for x, y in zip(a._engines, b._engines):   # the same pages in the same slots, at the end as well
            assert (x.recalled.ids == y.recalled.ids).all()
            assert x.recalled.ids.shape == (x.heads, 2 + retain) and (x.recalled.ids >= 0).any()
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("prefetch", [0, None])
@pytest.mark.parametrize("ops", OPS, ids="-".join)
def test_decoding_planned_on_the_device_goes_on_bit_for_bit(model, tmp_path, ops, prefetch):
    """Planned on the device, a decode step reads the pages in page-id order wherever they sit, but a step of
    several tokens (a turn's prefill) reads a buffer without spare slots (`prefetch_pages=0`) whole, in slot
    order, as the host-planned path does: its layout (the table read back) is kept across a park or a copy too."""
    a, b = _decode_side_by_side(model, _twins(model, tmp_path, prefetch_pages=prefetch), ops, on_device=True)
    try:
        for x, y in zip(a._engines, b._engines):   # the same pages in the same slots, as the device's tables say
            assert x.recalled.on_device and torch.equal(x.recalled.held, y.recalled.held)
    finally:
        a.close()
        b.close()


def test_a_layout_fits_only_a_buffer_like_the_one_it_came_from():
    """A buffer of another width, or retaining otherwise, or planned on the device, starts empty (as the twin's
    then does); `adopt` refuses a buffer that does not hold the layout's pages in its slots."""
    buf = RecallBuffer(2, 3, 4, 8, torch.float32, torch.device("cpu"), retain=1)
    assert buf.layout() is None   # nothing held, nothing to keep
    k = torch.arange(2 * 4 * 8, dtype=torch.float32).view(2, 4, 8)
    buf.fill(np.array([0, 1]), np.array([7, 9]), np.array([2, 0]), k, -k)
    buf.plan(np.array([[7], [9]]))   # a step that chooses them: their ages and the mask
    layout = buf.layout()
    assert layout.ids.tolist() == [[-1, -1, 7], [9, -1, -1]] and layout.retain == 1
    assert [a.tolist() for a in layout.filled()] == [[0, 1], [7, 9], [2, 0]]
    same = RecallBuffer(2, 3, 4, 8, torch.float32, torch.device("cpu"), retain=1)
    assert same.fits(layout)
    with pytest.raises(ValueError, match="does not hold the layout's pages"):
        same.adopt(layout)
    heads, pids, slots = layout.filled()
    same.fill(heads, pids, slots, k, -k)
    same.adopt(layout)
    assert torch.equal(same.mask, buf.mask) and (same._last == buf._last).all() and same._clock == buf._clock
    assert same.plan(np.array([[3], [9]]))[2].tolist() == buf.plan(np.array([[3], [9]]))[2].tolist()
    for other in (RecallBuffer(2, 4, 4, 8, torch.float32, torch.device("cpu"), retain=1),
                  RecallBuffer(2, 3, 4, 8, torch.float32, torch.device("cpu")),
                  RecallBuffer(2, 3, 4, 8, torch.float32, torch.device("cpu"), on_device=True)):
        assert not other.fits(layout)


def test_an_engine_lets_a_layout_go_that_does_not_fit(model, tmp_path):
    """The next buffer made after a park is empty where the kept layout is of another width, and the layout is
    gone (it says nothing of any later buffer)."""
    cache, twin = _twins(model, tmp_path)
    try:
        _decode_side_by_side(model, (cache, twin), [])
        engine = cache._engines[0]
        cache.park("host")
        assert engine.recalled is None and engine.layout_kept is not None
        cache.resume()
        buf = engine._recall_buffer(1, on_device=False)   # one page chosen a step: a buffer of another width
        assert engine.layout_kept is None and (buf.ids == -1).all()
    finally:
        cache.close()
        twin.close()


OP = st.one_of(st.sampled_from(["park:host", "park:disk", "resume", "copy", "chunk"]), st.just("step"))


@settings(max_examples=24, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(ops=st.lists(OP, min_size=1, max_size=8), on_device=st.booleans(), retain=st.sampled_from([0, 2]),
       prefetch=st.sampled_from([None, 0, 2]), host_budget=st.sampled_from([None, 16]),
       recall=st.sampled_from([1, 2, 4]), page_size=st.sampled_from([4, 16]))
def test_random_sequences_go_on_bit_for_bit(model, tmp_path, ops, on_device, retain, prefetch, host_budget, recall,
                                             page_size):
    """Any run of parks, resumes, copies and chunks between decode steps, with recall planned on either side,
    pages retained or prefetched or not, some on disk or none."""
    extra = dict(prefetch_pages=prefetch, host_budget=host_budget, recall_pages=recall, page_size=page_size,
                 retain_pages=0 if on_device else retain)
    caches = _twins(model, tmp_path, **extra)
    try:
        caches = _decode_side_by_side(model, caches, ops, on_device=on_device)
    finally:
        for c in caches:
            c.close()
