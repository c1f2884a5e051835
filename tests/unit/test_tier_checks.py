"""What the tiers refuse, and what a refused or interrupted call leaves: slot numbers that are not whole numbers
or hold no page, pages of the wrong shape, sizes that are not whole numbers, a store cut short by Ctrl-C. Each
case had been accepted (a float slot read as its floor, a freed slot's stale page read back) or had left slots
taken that nothing could give back."""

from __future__ import annotations

import itertools
import os
import re

import numpy as np
import pytest
import torch

import kvtier.tiers.disk as disk_module
from kvtier.errors import ConfigError, CorruptPageError
from kvtier.tiers.device import DevicePool
from kvtier.tiers.disk import DiskStore
from kvtier.tiers.host import HostPool
from kvtier.tiers.readahead import DiskReadAhead
from kvtier.transfer.base import TransferCounters
from kvtier.transfer.cuda_streams import CudaTransferManager
from kvtier.transfer.sync import SyncTransferManager

P, D = 4, 8


def pages(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, P, D, generator=g), torch.randn(n, P, D, generator=g)


@pytest.fixture
def disk(tmp_path):
    store = DiskStore(str(tmp_path), P, D, torch.float32, io_threads=2)
    yield store
    store.close()


def test_a_host_store_of_the_wrong_shape_takes_no_slot():
    pool = HostPool(P, D, torch.float32, pin=False)
    k, v = pages(3)
    for bad in ((k, v[:2]), (k[..., :-1], v[..., :-1]), (k[0], v[0])):
        with pytest.raises(ValueError, match=r"the host pool keeps pages \[n, 4, 8\]"):
            pool.store(*bad)
        assert pool.pages() == 0 and pool.nbytes() == 0
    assert pool.store(k, v).tolist() == [0, 1, 2]   # the first slots, as if nothing had been tried
    pool.close()


def test_a_host_load_refuses_slots_that_hold_no_page():
    pool = HostPool(P, D, torch.float32, pin=False)
    k, v = pages(4)
    slots = pool.store(k, v)
    pool.free(slots[2:3])
    with pytest.raises(ValueError, match="host slots must be whole numbers"):
        pool.load(np.array([0.9]))
    for slot in (2, 4, -1):   # freed (its stale page is still in the slab), never handed out, negative
        with pytest.raises(ValueError, match=f"host slot {slot} holds no page .*nothing was read"):
            pool.load(np.array([0, slot]))
    got = pool.load(np.array([3, 0, 0]))   # the same page twice is a fine read
    assert torch.equal(got[0], k[[3, 0, 0]]) and torch.equal(got[1], v[[3, 0, 0]])
    pool.close()


@pytest.mark.parametrize("make, size, value", [
    ("host", "page_size", 0), ("host", "head_dim", -8), ("host", "head_dim", 8.0),
    ("device", "heads", True), ("device", "head_dim", -8), ("device", "heads", 2.0), ("device", "heads", -1),
    ("disk", "page_size", 2.5), ("disk", "head_dim", 8.0), ("disk", "io_threads", 2.0), ("disk", "io_threads", 0)])
def test_sizes_are_whole_numbers(make, size, value, tmp_path):
    sizes = {"page_size": P, "head_dim": D, "heads": 2, "io_threads": 2, size: value}
    least = 0 if size == "heads" else 1   # a pool of no head holds nothing
    with pytest.raises(ConfigError, match=re.escape(f"{size}={value!r} is not allowed; allowed: a whole number >= "
                                                    f"{least}")):
        if make == "host":
            HostPool(sizes["page_size"], sizes["head_dim"], torch.float32, pin=False)
        elif make == "device":
            DevicePool(sizes["heads"], sizes["head_dim"], torch.float32, torch.device("cpu"), 16)
        else:
            DiskStore(str(tmp_path), sizes["page_size"], sizes["head_dim"], torch.float32, sizes["io_threads"])
    assert not os.listdir(tmp_path)   # no page file was made


def test_a_disk_store_interrupted_before_its_writes_gives_its_slots_back(disk, monkeypatch):
    k, v = pages(4)
    disk.free(disk.store(k, v)[:2])   # slots 0 and 1 free for reuse
    before = (disk._next, sorted(disk._free), disk.pages())
    real, calls = disk_module._seed, itertools.count()

    def seed(slot, gen):   # Ctrl-C while the records' seeds are worked out, after the slots were taken
        if next(calls) == 2:
            raise KeyboardInterrupt
        return real(slot, gen)

    monkeypatch.setattr(disk_module, "_seed", seed)
    with pytest.raises(KeyboardInterrupt):
        disk.store(*pages(5, seed=1))
    monkeypatch.undo()
    assert (disk._next, sorted(disk._free), disk.pages()) == before
    assert disk.store(*pages(2, seed=2)).tolist() == [0, 1]


def test_reads_refuse_slots_that_are_not_whole_numbers(disk):
    disk.store(*pages(4))
    with pytest.raises(CorruptPageError, match="must be whole numbers; got an array of float64"):
        disk.load_async(np.array([0.9])).result()
    with pytest.raises(CorruptPageError, match="must be whole numbers; got an array of bool"):
        disk.load_async(np.array([True])).result()
    ring = DiskReadAhead(disk, 8, P, D, torch.float32, pin=False)
    for where in ("on disk", "read ahead"):
        if where == "read ahead":
            ring.prefetch(np.arange(4))
            ring.settle()
        for call in (ring.load, ring.prefetch, ring.forget):
            with pytest.raises(CorruptPageError, match="must be whole numbers"):
                call(np.array([0.9]))
    ring.close()


def test_a_read_ahead_load_checks_out_whatever_was_read_ahead(disk):
    """`out` of another dtype: refused whether the pages are read ahead or not (it had been converted on a miss and
    refused by a gather on a hit, so the call's fate hung on what happened to be read ahead)."""
    k, v = pages(4)
    slots = disk.store(k, v)
    ring = DiskReadAhead(disk, 8, P, D, torch.float32, pin=False)
    for ahead in (0, 1, 2):
        if ahead:
            ring.prefetch(slots[:ahead])
            ring.settle()
        wrong = (torch.zeros(2, P, D, dtype=torch.float64), torch.zeros(2, P, D, dtype=torch.float64))
        with pytest.raises(ValueError, match=r"out must be two torch.float32 tensors \[2, 4, 8\] in host memory"):
            ring.load(slots[:2], out=wrong)
        got = ring.load(slots[:2], out=(torch.empty(2, P, D), torch.empty(2, P, D)))
        assert torch.equal(got[0], k[:2]) and torch.equal(got[1], v[:2])
    ring.close()


def test_a_short_page_file_names_the_page_asked_for_and_the_file_s_end(disk):
    disk.store(*pages(6))
    size = 4 * disk.record_size + 10   # slot 4 cut short, slot 5 gone
    os.truncate(disk.path, size)
    for asked in ([5], [3, 5]):   # a read from past the end; a read that spans slot 4 as a gap
        with pytest.raises(CorruptPageError, match=f"truncated in .* at slot 5 \\(the file ends at byte {size}\\)"):
            disk.load(np.array(asked))


def test_a_device_pool_replace_checks_every_shape_before_writing():
    pool = DevicePool(2, D, torch.float32, torch.device("cpu"), 16)
    k, v = torch.randn(2, 3, D), torch.randn(2, 3, D)
    pos, score = torch.arange(3).repeat(2, 1), torch.ones(2, 3)
    pool.replace(k, v, pos, score)
    for bad in ((k[:, :2], v[:, :2], pos, score[:, :2]), (k[:, :2], v[:, :2], pos[:, :2], score[:, :1]),
                (k[:1], v[:1], pos[:1], score[:1])):
        with pytest.raises(ValueError, match=r"the device pool takes k, v \[2, n, 8\] and pos, score \[2, n\]"):
            pool.replace(*bad)
        assert pool.count == 3
        got_k, got_v = pool.contiguous(3)
        assert torch.equal(got_k[0], k) and torch.equal(got_v[0], v)
        assert torch.equal(pool.meta()[0], pos) and torch.equal(pool.meta()[1], score)


def test_both_transfer_managers_count_a_host_copy_alike():
    cuda = object.__new__(CudaTransferManager)   # its host-to-host copy makes no CUDA call
    cuda.counters, cuda._ids, cuda._jobs = TransferCounters(), itertools.count(1), {}
    sync = SyncTransferManager()
    for manager in (cuda, sync):
        manager.submit(torch.empty(4, 4), torch.ones(4, 4))
    assert cuda.counters.jobs == sync.counters.jobs == 1 and cuda.counters.bytes == sync.counters.bytes
