"""The slot-based disk page store: layout, round trips, integrity checks, write failures, file hygiene."""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.errors import CapacityError, CorruptPageError
from kvtier.tiers.disk import DiskStore

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def make(tmp_path):
    """Build stores under `tmp_path`; every one is closed after the test."""
    stores = []

    def make(page_size=16, head_dim=64, dtype=torch.bfloat16, **kw):
        kw.setdefault("name", f"pages{len(stores)}")
        store = DiskStore(str(tmp_path), page_size, head_dim, dtype, **kw)
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close()


def pages(n, store, seed=0):
    """Random bit patterns (NaNs and all) as ``[n, page_size, head_dim]`` keys and values."""
    g = torch.Generator().manual_seed(seed)
    esize = torch.empty((), dtype=store.dtype).element_size()
    shape = (n, store.page_size, store.head_dim * esize)
    return tuple(torch.randint(0, 256, shape, dtype=torch.uint8, generator=g).view(store.dtype) for _ in range(2))


def same(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.contiguous().view(torch.uint8),
                                                                     b.contiguous().view(torch.uint8))


def record(store, slot):
    with open(store.path, "rb") as f:
        f.seek(slot * store.record_size)
        return f.read(store.record_size)


def overwrite(store, slot, data, at=0):
    with open(store.path, "r+b") as f:
        f.seek(slot * store.record_size + at)
        f.write(data)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_round_trip_is_bit_exact(make, dtype):
    store = make(page_size=8, head_dim=32, dtype=dtype)
    k, v = pages(37, store)
    slots = store.store(k, v)
    assert slots.dtype == np.int64 and sorted(slots.tolist()) == list(range(37))
    assert store.pages() == 37 and store.nbytes() == 37 * store.payload_size
    perm = np.random.default_rng(1).permutation(37)
    lk, lv = store.load(slots[perm])
    assert same(lk, k[perm]) and same(lv, v[perm]) and lk.is_contiguous()
    sub = np.array([5, 6, 7, 20, 3, 30, 31, 6])  # consecutive runs, gaps, out of order, a repeat
    lk, lv = store.load(slots[sub])
    assert same(lk, k[sub]) and same(lv, v[sub])
    staging = (torch.empty(len(sub), 8, 32, dtype=dtype), torch.empty(len(sub), 8, 32, dtype=dtype))
    got = store.load(slots[sub], out=staging)
    assert got[0] is staging[0] and got[1] is staging[1] and same(staging[0], k[sub]) and same(staging[1], v[sub])
    strided = torch.empty(8, 32, len(sub), dtype=dtype).permute(2, 0, 1)  # not contiguous: filled by a copy
    got = store.load(slots[sub], out=(strided, staging[1]))
    assert got[0] is strided and same(strided, k[sub])
    k2, v2 = pages(5, store, seed=2)
    slots2 = store.store(k2, v2)
    assert sorted(slots2.tolist()) == list(range(37, 42))
    lk, lv = store.load(np.concatenate([slots2, slots[:3]]))
    assert same(lk, torch.cat([k2, k[:3]])) and same(lv, torch.cat([v2, v[:3]]))
    assert [t.shape for t in store.load(np.array([], dtype=np.int64))] == [(0, 8, 32)] * 2


def test_many_pages_spread_over_threads_and_load_async(make):
    store = make(io_threads=3)
    k, v = pages(300, store)  # 300 records of 4 KiB: several tasks, the pool is used
    slots = store.store(k, v)
    perm = np.random.default_rng(0).permutation(300)
    expect = store.load(slots[perm])
    assert same(expect[0], k[perm]) and same(expect[1], v[perm])
    ak, av = store.load_async(slots[perm]).result(timeout=10)
    assert same(ak, expect[0]) and same(av, expect[1])
    ak, av = store.load_async(slots[:2]).result(timeout=10)
    assert same(ak, k[:2]) and same(av, v[:2])
    assert any(t.name.startswith("kvtier-disk") for t in threading.enumerate())
    store.close()
    assert not any(t.name.startswith("kvtier-disk") for t in threading.enumerate())


def test_load_async_reports_errors_in_the_future(make):
    store = make()
    k, v = pages(2, store)
    store.store(k, v)
    overwrite(store, 1, b"\xff\x00")
    with pytest.raises(CorruptPageError, match="checksum"):
        store.load_async(np.array([0, 1])).result(timeout=10)
    with pytest.raises(CorruptPageError, match="holds no page"):
        store.load_async(np.array([7])).result(timeout=10)


@pytest.mark.parametrize("shape, size", [((16, 64, torch.bfloat16), 4096), ((3, 5, torch.float32), 4096),
                                           ((20, 100, torch.float32), 16384), ((16, 128, torch.float64), 32768)])
def test_records_are_4k_aligned_raw_payloads(make, shape, size):
    store = make(*shape)
    assert store.record_size == size and store.record_size % 4096 == 0
    assert store.payload_size == 2 * shape[0] * shape[1] * torch.empty((), dtype=shape[2]).element_size()
    k, v = pages(3, store)
    slots = store.store(k, v)
    assert store.file_bytes() == 3 * size
    pad = size - store.payload_size
    for i, slot in enumerate(slots.tolist()):
        payload = k[i].view(torch.uint8).numpy().tobytes() + v[i].view(torch.uint8).numpy().tobytes()
        assert record(store, slot) == payload + b"\0" * pad


def test_freed_slots_are_reused_lowest_first(make):
    store = make()
    k, v = pages(6, store)
    slots = store.store(k[:4], v[:4])
    assert slots.tolist() == [0, 1, 2, 3]
    store.free(np.array([2, 1]))
    assert store.pages() == 2 and store.nbytes() == 2 * store.payload_size
    with pytest.raises(CorruptPageError, match="slot 1 .*holds no page"):
        store.load(np.array([0, 1]))
    with pytest.raises(CorruptPageError):
        store.free(np.array([3, 1]))  # 1 is already free: nothing is freed
    with pytest.raises(CorruptPageError, match="twice"):
        store.free(np.array([3, 3]))
    assert store.pages() == 2
    assert store.store(k[4:5], v[4:5]).tolist() == [1]
    assert store.store(k[4:6], v[4:6]).tolist() == [2, 4]
    assert store.file_bytes() == 5 * store.record_size
    lk, _ = store.load(np.array([0, 1, 2, 3, 4]))
    assert same(lk, torch.stack([k[0], k[4], k[4], k[3], k[5]]))


def test_the_free_slots_at_the_file_s_end_go_back_to_the_disk(make):
    """The file had kept its largest size until close: a conversation read back from disk held its parked size."""
    store = make()
    k, v = pages(6, store)
    store.store(k, v)
    store.free(np.array([1, 2]))   # inside: kept, reused later
    assert store.file_bytes() == 6 * store.record_size
    store.free(np.array([5, 3]))
    assert store.file_bytes() == 5 * store.record_size   # 4 is still in use
    store.free(np.array([4]))
    assert store.file_bytes() == store.record_size and store.pages() == 1   # down to slot 0, the last in use
    assert store.store(k[:3], v[:3]).tolist() == [1, 2, 3]   # the freed end is handed out again, in order
    lk, lv = store.load(np.array([0, 1, 2, 3]))
    assert same(lk, torch.stack([k[0], k[0], k[1], k[2]])) and same(lv, torch.stack([v[0], v[0], v[1], v[2]]))
    store.free(np.array([3, 1, 0, 2]))
    assert store.file_bytes() == 0 and store.pages() == 0


def test_a_store_under_way_keeps_the_file_s_end(make, monkeypatch):
    """A store's slots look free until its pages are written and booked: a free meanwhile leaves the end alone."""
    import kvtier.tiers.disk as disk

    store = make()
    k, v = pages(4, store)
    store.store(k[:2], v[:2])
    transfer = disk._transfer

    def freeing_meanwhile(op, fd, bufs, offset):
        if op is os.pwritev:
            monkeypatch.setattr(disk, "_transfer", transfer)
            store.free(np.array([1]))   # the top slot in use before this store took 2 and 3
        return transfer(op, fd, bufs, offset)

    monkeypatch.setattr(disk, "_transfer", freeing_meanwhile)
    assert store.store(k[2:4], v[2:4]).tolist() == [2, 3]
    lk, _ = store.load(np.array([0, 2, 3]))
    assert same(lk, torch.stack([k[0], k[2], k[3]])) and store.file_bytes() == 4 * store.record_size


@pytest.mark.parametrize("fail", [False, True])
def test_a_free_while_a_store_writes_trims_when_the_store_ends(make, monkeypatch, fail):
    """The trim a free skips while a store is under way is made when the store ends (it had waited for some later
    free): whether the store reused a slot below the end, or failed and gave its slots back."""
    import kvtier.tiers.disk as disk

    store = make()
    k, v = pages(4, store)
    store.store(k[:3], v[:3])
    store.free(np.array([0]))
    transfer = disk._transfer

    def freeing_meanwhile(op, fd, bufs, offset):
        if op is os.pwritev:
            monkeypatch.setattr(disk, "_transfer", transfer)
            store.free(np.array([2]))   # the last slot in use
            if fail:
                raise OSError(errno.ENOSPC, "No space left on device")
        return transfer(op, fd, bufs, offset)

    monkeypatch.setattr(disk, "_transfer", freeing_meanwhile)
    if fail:
        with pytest.raises(CapacityError, match="disk full"):
            store.store(k[3:], v[3:])
        assert store.file_bytes() == 2 * store.record_size   # slot 1 the last in use
    else:
        assert store.store(k[3:], v[3:]).tolist() == [0]
        assert store.file_bytes() == 2 * store.record_size   # slots 0 and 1


def test_two_stores_that_fail_together_leave_no_free_end(make, monkeypatch):
    """A full disk fails every writer: the first store to fail could not shorten the file (the second held the
    slots above its own), the second shortened it to its own start only, and the first's record stayed, free."""
    import kvtier.tiers.disk as disk

    store = make(io_threads=1)
    k, v = pages(2, store)
    transfer, failed = disk._transfer, []
    second_writing, second_go = threading.Event(), threading.Event()

    def second():
        try:
            store.store(k, v)
        except CapacityError:
            failed.append("second")

    def full(op, fd, bufs, offset):
        if op is not os.pwritev:
            return transfer(op, fd, bufs, offset)
        if threading.current_thread().name == "second":
            second_writing.set()
            second_go.wait(10)
            return 0   # nothing written
        other = threading.Thread(target=second, name="second")
        full.other = other
        other.start()
        second_writing.wait(10)
        return transfer(op, fd, bufs[:1], offset)   # a short write: one record lands

    monkeypatch.setattr(disk, "_transfer", full)
    with pytest.raises(CapacityError, match="short write"):
        store.store(k, v)
    second_go.set()
    full.other.join(10)
    assert failed == ["second"] and store.pages() == 0 and os.path.getsize(store.path) == 0


def test_a_store_interrupted_anywhere_leaves_the_trim_working(make, monkeypatch):
    """Ctrl-C on the line after a store took its slots (its checksums' array) had left it counted as under way for
    good: its slots never came back and no free trimmed the file again."""
    import types

    import kvtier.tiers.disk as disk

    class Interrupting(types.ModuleType):
        def __getattr__(self, name):
            return getattr(np, name)

        def empty(self, shape, dtype=float, *args, **kwargs):
            if dtype is np.uint32:   # the checksums' array
                monkeypatch.setattr(disk, "np", np)
                raise KeyboardInterrupt
            return np.empty(shape, dtype, *args, **kwargs)

    store = make()
    k, v = pages(2, store)
    store.store(k, v)
    monkeypatch.setattr(disk, "np", Interrupting("numpy"))
    with pytest.raises(KeyboardInterrupt):
        store.store(k, v)
    assert store.file_bytes() == 2 * store.record_size
    store.free(np.array([0, 1]))
    assert store.file_bytes() == 0 and store.store(k[:1], v[:1]).tolist() == [0]


def test_a_store_interrupted_as_it_lets_go_of_its_lock_gives_its_slots_back(make):
    """Ctrl-C as the lock's release returned, after the slots were taken and before the `try` that gives them
    back: they had stayed taken, and the store counted as under way for good (no trim again)."""
    store = make()
    k, v = pages(2, store)
    lock = store._lock

    class Interrupting:
        def __enter__(self):
            return lock.__enter__()

        def __exit__(self, *exc):
            lock.__exit__(*exc)
            store._lock = lock
            raise KeyboardInterrupt

    store._lock = Interrupting()
    with pytest.raises(KeyboardInterrupt):
        store.store(k, v)
    assert store.pages() == 0 and store.file_bytes() == 0 and store._storing == 0
    assert store.store(k, v).tolist() == [0, 1]
    store.free(np.array([1, 0]))
    assert store.file_bytes() == 0


@pytest.mark.parametrize("op", ["store", "free"])
def test_a_store_or_free_interrupted_right_after_marking_its_slots_leaves_the_store_as_it_was(make, op):
    """Ctrl-C between marking the slots and counting them: a store's slots stayed marked used but were never
    returned (lost, and counted out of `pages()`); a free's slots not yet pushed onto the heap were lost."""
    store = make()
    k, v = pages(3, store)
    store.store(k, v)
    meta = store._meta

    class Interrupting:
        def __getattr__(self, name):
            return getattr(meta, name)

        def set(self, slots, **fields):
            meta.set(slots, **fields)
            if "used" in fields and store._meta is self:   # once: the undo's own set goes through
                store._meta = meta
                raise KeyboardInterrupt

    store._meta = Interrupting()
    with pytest.raises(KeyboardInterrupt):
        store.store(k[:2], v[:2]) if op == "store" else store.free(np.array([0, 1]))
    assert store.pages() == 3 and store.file_bytes() == 3 * store.record_size
    store.free(np.array([0, 1]))   # as it was: the free goes through now
    assert store.store(k[:2], v[:2]).tolist() == [0, 1]
    assert same(store.load(np.array([2]))[0], k[2:])


def test_a_store_interrupted_while_it_takes_freed_slots_takes_none(make, monkeypatch):
    """Ctrl-C among the pops of freed slots off the heap: those popped were lost for good."""
    import heapq
    import types

    import kvtier.tiers.disk as disk

    store = make()
    k, v = pages(4, store)
    store.store(k, v)
    store.free(np.array([0, 1, 2]))
    calls = []

    def pop(heap):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return heapq.heappop(heap)

    monkeypatch.setattr(disk, "heapq", types.SimpleNamespace(heappop=pop, heappush=heapq.heappush,
                                                              heapify=heapq.heapify))
    with pytest.raises(KeyboardInterrupt):
        store.store(k[:3], v[:3])
    monkeypatch.undo()
    assert store.pages() == 1 and store.store(k[:3], v[:3]).tolist() == [0, 1, 2]


def test_stale_or_misplaced_record_is_rejected(make):
    store = make()
    k, v = pages(3, store)
    slot = int(store.store(k[:1], v[:1])[0])
    old = record(store, slot)
    store.free(np.array([slot]))
    assert int(store.store(k[1:2], v[1:2])[0]) == slot
    overwrite(store, slot, old)  # the earlier write at this slot comes back
    with pytest.raises(CorruptPageError, match=f"{store.path}.*slot {slot}.*expected 0x[0-9a-f]{{8}}, read 0x"):
        store.load(np.array([slot]))
    other = int(store.store(k[2:3], v[2:3])[0])
    overwrite(store, other, record(store, slot))  # a valid record, but of another slot
    with pytest.raises(CorruptPageError, match=f"slot {other}"):
        store.load(np.array([other]))


def test_reads_across_gaps_duplicates_and_long_runs(make, monkeypatch):
    """Pages a few records apart are read in one call (the records between read and dropped, whatever they
    hold: a freed, damaged page here); a page asked twice comes twice; runs longer than a read's cap are cut;
    every page still comes back as written, in the order asked."""
    import kvtier.tiers.disk as disk_module

    monkeypatch.setattr(disk_module, "_RUN_RECORDS", 4)
    store = make(page_size=4, head_dim=8, dtype=torch.float32)
    k, v = pages(30, store)
    slots = store.store(k, v)
    store.free(slots[[6]])
    overwrite(store, int(slots[6]), b"\xff" * 64)
    reads = []
    pread_into = disk_module._pread_into
    monkeypatch.setattr(disk_module, "_pread_into", lambda *a: reads.append(a[2]) or pread_into(*a))
    ask = np.array([9, 5, 7, 5, 20, 0, 1, 2, 3, 4, 24, 29])
    got = store.load(slots[ask])
    assert same(got[0], k[ask]) and same(got[1], v[ask])
    rs = store.record_size
    # 0-3 (cap 4), 4-7 (5 twice, 6 freed and damaged: read, dropped), 9 (8 apart from 5: cap), 20-29 in pieces
    assert sorted(reads) == [0, 4 * rs, 9 * rs, 20 * rs, 24 * rs, 29 * rs]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 60), min_size=1, max_size=80), st.integers(1, 9), st.integers(0, 4),
       st.integers(1, 4))
def test_read_plan_covers_every_page_in_bounded_runs(tmp_path_factory, slots, cap, gap, threads):
    """`_plan`'s runs, over all tasks, are the sorted positions in order, each once; within a run the slots
    rise by 1 (writes) or by at most ``1 + gap`` (reads), and span fewer than `cap` records."""
    store = DiskStore(str(tmp_path_factory.mktemp("plan")), 4, 8, torch.float32, io_threads=threads)
    try:
        order, s, tasks = store._plan(np.array(slots, dtype=np.int64), cap, gap)
        assert s.tolist() == sorted(slots) and sorted(order.tolist()) == list(range(len(slots)))
        runs = [r for task in tasks for r in task]
        assert [x for lo, hi in runs for x in range(lo, hi)] == list(range(len(slots)))
        for lo, hi in runs:
            d = np.diff(s[lo:hi])
            assert ((d >= 0) & (d <= 1 + gap)).all() if gap else (d == 1).all()
            assert s[hi - 1] - s[lo] < cap
    finally:
        store.close()


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="posix_fadvise is Linux's")
def test_drop_cached_keeps_the_data(make):
    """Dropping the file from the page cache (a cold disk for a benchmark) writes it back first: every page
    still loads, verified; a closed store says so."""
    store = make()
    k, v = pages(5, store)
    slots = store.store(k, v)
    store.drop_cached()
    got = store.load(slots[::-1].copy())
    assert same(got[0], k.flip(0)) and same(got[1], v.flip(0))
    store.close()
    with pytest.raises(CorruptPageError, match="is closed"):
        store.drop_cached()


def test_flipped_byte_truncated_file_and_free_slot(make):
    store = make()
    k, v = pages(3, store)
    slots = store.store(k, v)
    byte = record(store, 1)[100]
    overwrite(store, 1, bytes([byte ^ 0x01]), at=100)
    assert same(store.load(slots[[0, 2]])[0], k[[0, 2]])
    with pytest.raises(CorruptPageError, match="checksum mismatch.*slot 1"):
        store.load(slots)
    os.truncate(store.path, 2 * store.record_size + 10)
    with pytest.raises(CorruptPageError, match="truncated.*slot 2"):
        store.load(np.array([0, 2]))
    with pytest.raises(CorruptPageError, match="holds no page"):
        store.load(np.array([3]))
    with pytest.raises(CorruptPageError, match="holds no page"):
        store.load(np.array([-1]))


def test_read_error_is_a_corrupt_page(make, monkeypatch):
    store = make()
    k, v = pages(1, store)
    store.store(k, v)

    def fail(*args):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "preadv", fail)
    with pytest.raises(CorruptPageError, match="EIO"):
        store.load(np.array([0]))


@pytest.mark.parametrize("contiguous", [True, False])
def test_pages_read_into_given_rows_leave_the_others_as_they_are(make, contiguous):
    """With `rows`, page i lands at out[rows[i]] (straight into contiguous memory of the store's dtype, else
    through a copy), and the rows not named keep what they held."""
    store = make(page_size=4, head_dim=8, dtype=torch.float32)
    k, v = pages(10, store)
    slots = store.store(k, v)
    width = 8
    if contiguous:
        out = (torch.full((width, 4, 8), 7.0), torch.full((width, 4, 8), 7.0))
    else:   # every other page of a larger tensor: not read into directly
        out = tuple(torch.full((2 * width, 4, 8), 7.0)[::2] for _ in range(2))
    ask, rows = np.array([9, 2, 5]), np.array([6, 0, 3])
    got = store.load(slots[ask], out=out, rows=rows)
    assert got[0].data_ptr() == out[0].data_ptr()
    for i, r in zip(ask, rows):
        assert same(out[0][r], k[i]) and same(out[1][r], v[i])
    untouched = np.setdiff1d(np.arange(width), rows)
    assert (out[0][untouched] == 7).all() and (out[1][untouched] == 7).all()


def test_rows_that_do_not_place_each_page_are_refused(make):
    store = make(page_size=4, head_dim=8, dtype=torch.float32)
    k, v = pages(3, store)
    slots = store.store(k, v)
    out = (torch.zeros(4, 4, 8), torch.zeros(4, 4, 8))
    for rows in (np.array([0, 1]), np.array([0, 1, 4]), np.array([-1, 0, 1])):
        with pytest.raises(CapacityError, match="rows must place each of the 3 pages in out"):
            store.load(slots, out=out, rows=rows)
    with pytest.raises(CapacityError, match="rows needs out, the two tensors the pages are placed in"):
        store.load(slots, rows=np.array([0, 1, 2]))


def test_slot_numbers_that_are_not_whole_are_refused(make):
    """A float slot had been truncated: load([0.9]) read page 0 and free([2.5]) freed page 2."""
    store = make(page_size=4, head_dim=8, dtype=torch.float32)
    k, v = pages(3, store)
    slots = store.store(k, v)
    for call in (lambda: store.load(np.array([0.9])), lambda: store.free(np.array([2.5])),
                 lambda: store.load(np.array([True])),
                 lambda: store.load(slots, out=(torch.zeros(3, 4, 8),) * 2, rows=np.array([0.0, 1.0, 2.0]))):
        with pytest.raises(CorruptPageError, match="must be whole numbers"):
            call()
    assert store.pages() == 3 and same(store.load(slots)[0], k)


@pytest.mark.parametrize("op", ["store", "load"])
def test_an_interrupted_call_returns_only_once_its_io_threads_are_done(make, monkeypatch, op):
    """A Ctrl-C while a call waits for its I/O threads: the call raises only once no thread writes the file (a
    store's rollback frees its slots, which a later store reuses: a late write had landed on that store's
    records, which then failed their checksum) or the caller's buffers (a load's `out`)."""
    import signal
    import time

    store = make(page_size=16, head_dim=64, dtype=torch.float16, io_threads=2)   # records of 4 KiB
    k = torch.randn(1024, 16, 64, dtype=torch.float16)                       # two tasks of 512 records
    slots = store.store(k, k) if op == "load" else None
    name = "pwritev" if op == "store" else "preadv"
    real, late = getattr(os, name), []

    def slow(*args):
        if threading.current_thread() is not threading.main_thread() and not late:
            late.append("started")
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)   # Ctrl-C while the call waits
            time.sleep(0.5)
            late.append("done")
        return real(*args)

    monkeypatch.setattr(os, name, slow)
    with pytest.raises(KeyboardInterrupt):
        store.store(k, k) if op == "store" else store.load(slots, out=(torch.empty_like(k), torch.empty_like(k)))
    assert late == ["started", "done"]   # the thread's I/O ended before the call returned
    monkeypatch.undo()
    k2 = torch.randn(1024, 16, 64, dtype=torch.float16)
    again = store.store(k2, k2)
    time.sleep(0.6)
    assert torch.equal(store.load(again)[0], k2)


def test_short_reads_are_read_on_until_whole(make, monkeypatch):
    """A read the system returns in pieces (a signal, a network file system) is continued where it stopped."""
    store = make(page_size=4, head_dim=8, dtype=torch.float32)
    k, v = pages(12, store)
    slots = store.store(k, v)
    real, calls = os.preadv, []

    def in_pieces(fd, bufs, offset):   # at most 1,000 bytes a call
        calls.append(offset)
        return real(fd, [memoryview(bufs[0])[:1000]], offset)

    monkeypatch.setattr(os, "preadv", in_pieces)
    ask = np.array([11, 0, 1, 2, 7, 3])
    got = store.load(slots[ask])
    assert same(got[0], k[ask]) and same(got[1], v[ask])
    assert len(calls) > len(ask)


@pytest.mark.parametrize("err, message", [(errno.ENOSPC, "disk full.*ENOSPC"), (errno.EDQUOT, "disk full"),
                                          (errno.EFBIG, "could not write.*EFBIG"), (None, "short write")])
def test_write_failure_leaves_the_store_unchanged(make, monkeypatch, err, message):
    store = make()
    k, v = pages(10, store)
    slots = store.store(k[:4], v[:4])
    store.free(slots[1:2])
    size, real = store.file_bytes(), os.pwritev

    def failing(fd, bufs, offset):
        if offset < 4 * store.record_size:  # the write into the freed slot 1 goes through
            return real(fd, bufs, offset)
        if err is None:
            return 0
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(os, "pwritev", failing)
    with pytest.raises(CapacityError, match=message):
        store.store(k[4:8], v[4:8])
    monkeypatch.undo()
    assert store.pages() == 3 and store.file_bytes() == size
    lk, lv = store.load(slots[[0, 2, 3]])
    assert same(lk, k[[0, 2, 3]]) and same(lv, v[[0, 2, 3]])
    with pytest.raises(CorruptPageError):
        store.load(slots[1:2])
    again = store.store(k[4:8], v[4:8])
    assert again.tolist() == [1, 4, 5, 6]
    lk, lv = store.load(np.concatenate([again, slots[[0, 2, 3]]]))
    assert same(lk, torch.cat([k[4:8], k[[0, 2, 3]]])) and same(lv, torch.cat([v[4:8], v[[0, 2, 3]]]))


def test_failure_in_one_of_several_parallel_writes(make, monkeypatch):
    store = make(io_threads=4)
    k, v = pages(300, store)
    slots = store.store(k[:10], v[:10])
    real = os.pwritev

    def failing(fd, bufs, offset):  # the last of the parallel pieces fails, the others are written
        if offset >= 200 * store.record_size:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, bufs, offset)

    monkeypatch.setattr(os, "pwritev", failing)
    with pytest.raises(CapacityError, match="disk full"):
        store.store(k[10:], v[10:])
    monkeypatch.undo()
    assert store.pages() == 10 and store.file_bytes() == 10 * store.record_size
    assert same(store.load(slots)[0], k[:10])
    strided = k[10:].transpose(1, 2).contiguous().transpose(1, 2)  # any layout is accepted
    assert store.store(strided, v[10:]).tolist() == list(range(10, 300))
    lk, lv = store.load(np.arange(300))
    assert same(lk, k) and same(lv, v)


def test_file_size_limit_is_a_capacity_error(tmp_path):
    script = textwrap.dedent(f"""
        import resource, signal, torch
        from kvtier.errors import CapacityError
        from kvtier.tiers.disk import DiskStore
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        store = DiskStore({str(tmp_path)!r}, 16, 64, torch.bfloat16)
        k = torch.ones(8, 16, 64, dtype=torch.bfloat16)
        first = store.store(k[:2], k[:2])
        resource.setrlimit(resource.RLIMIT_FSIZE, (3 * 4096 + 100, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        try:
            store.store(k, k)
        except CapacityError as e:
            print("CAPACITY", e)
        assert store.pages() == 2 and store.file_bytes() == 2 * 4096, (store.pages(), store.file_bytes())
        assert torch.equal(store.load(first)[0], k[:2])
        store.close()
        print("OK")
    """)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "CAPACITY" in proc.stdout and "EFBIG" in proc.stdout and "OK" in proc.stdout, proc.stdout


def test_file_is_private_never_follows_a_symlink_and_is_removed(make, tmp_path):
    store = make()
    assert store.path == str(tmp_path / "pages0.kvtp")
    assert stat.S_IMODE(os.stat(store.path).st_mode) == 0o600
    store.close()
    assert not os.path.exists(store.path) and store.file_bytes() == 0
    store.close()
    for call in (lambda: store.store(*pages(1, store)), lambda: store.load(np.array([0])),
                 lambda: store.free(np.array([0]))):
        with pytest.raises(CorruptPageError, match="is closed"):
            call()
    with pytest.raises(CorruptPageError, match="is closed"):
        store.load_async(np.array([0])).result(timeout=10)

    target = tmp_path / "target"
    target.write_bytes(b"keep me")
    os.symlink(target, tmp_path / "linked.kvtp")
    broken = DiskStore.__new__(DiskStore)
    with pytest.raises(CapacityError, match="symlink"):
        broken.__init__(str(tmp_path), 16, 64, torch.bfloat16, name="linked")
    broken.close()
    broken.close()
    assert target.read_bytes() == b"keep me" and os.path.islink(tmp_path / "linked.kvtp")
    (tmp_path / "left.kvtp").write_bytes(b"old")
    with pytest.raises(CapacityError, match="already exists"):
        DiskStore(str(tmp_path), 16, 64, torch.bfloat16, name="left")
    assert (tmp_path / "left.kvtp").read_bytes() == b"old"


def test_bad_dtype_and_shapes(make):
    with pytest.raises(CapacityError, match=r"torch\.int8.*bfloat16"):
        make(dtype=torch.int8)
    store = make(dtype=torch.float16)
    with pytest.raises(CapacityError, match="holds"):
        store.store(torch.zeros(2, 16, 32, dtype=torch.float16), torch.zeros(2, 16, 32, dtype=torch.float16))
    with pytest.raises(CapacityError, match="holds"):
        store.store(torch.zeros(2, 16, 64), torch.zeros(2, 16, 64))
    assert store.store(torch.zeros(0, 16, 64, dtype=torch.float16),
                       torch.zeros(0, 16, 64, dtype=torch.float16)).tolist() == []
    assert store.pages() == 0 and store.file_bytes() == 0


def test_no_pages_load_into_an_empty_out_whatever_its_strides(make):
    """An empty tensor calls itself contiguous whatever its strides: it was read into directly, and its byte view
    raised torch's error."""
    store = make(page_size=2, head_dim=4, dtype=torch.float32)
    out = tuple(torch.empty(0, 4, 2).transpose(1, 2) for _ in range(2))
    k, v = store.load(np.empty(0, dtype=np.int64), out=out)
    assert k.shape == v.shape == (0, 2, 4)
