"""What `stats()` says, against what the cache holds and did: the recall buffer a resumed cache or a copy puts
back is not counted as recalled, a park to disk counts what it writes, the host's reserved bytes cover what it
holds, the read-ahead counts only reads that were served and outlive `close()`, and a copy keeps the graphs'
counts. Each had been otherwise."""

from __future__ import annotations

import copy
import os

import pytest
import torch

from kvtier import CorruptPageError, TieredCache, cache_kwargs
from tiny_models import random_ids, tiny_llama


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


@torch.no_grad()
def _run(model, cache, prompt=200, steps=5):
    logits = model(random_ids(model, prompt, 2), **cache_kwargs(cache)).logits
    for _ in range(steps):
        logits = model(logits[:, -1:].argmax(-1), **cache_kwargs(cache)).logits
    return logits


def _one_step(model, cache, logits):
    before = cache.stats()
    with torch.no_grad():
        out = model(logits[:, -1:].argmax(-1), **cache_kwargs(cache)).logits
    after = cache.stats()
    return {k: after[k] - before[k] for k in ("pages_recalled", "pages_reused")}, out


@pytest.mark.parametrize("how", ["host", "disk", "copy"])
def test_a_resumed_cache_or_a_copy_counts_its_next_step_as_a_twin_does(model, tmp_path, how):
    """The recall buffer put back (the pages it held) had been counted as pages recalled on demand: reused plus
    on demand came to twice the pages chosen, and the reuse rate to half the twin's."""
    def make():
        cache = TieredCache(model.config, device_budget=48, scorer="keynorm", recall_pages=3, disk_dir=tmp_path)
        return cache, _run(model, cache)

    twin, logits = make()
    want, out = _one_step(model, twin, logits)
    cache, logits = make()
    if how == "copy":
        cache = copy.deepcopy(cache)
    else:
        cache.park(how)
        cache.resume()
    got, got_out = _one_step(model, cache, logits)
    assert got == want and torch.equal(got_out, out)


def test_a_park_to_disk_counts_what_it_writes(model, tmp_path):
    cache = TieredCache(model.config, device_budget=48, host_budget=64, scorer="keynorm", disk_dir=tmp_path)
    _run(model, cache)
    before = cache.stats()["bytes_moved"]
    cache.park("disk")
    after = cache.stats()["bytes_moved"]
    written = sum(os.path.getsize(os.path.join(cache.disk_path, f)) for f in os.listdir(cache.disk_path)
                  if f.startswith("layer"))   # the index files
    store = cache._shared.disk_store
    moved = after["host_to_disk"] - before["host_to_disk"]
    assert moved > written and moved <= store.nbytes() + written   # pages and files, no more than the disk holds
    entries = sum(e.parked.count * e.heads for e in cache._engines) * 2 * 16 * 4   # k and v, head size 16, float32
    assert after["device_to_host"] - before["device_to_host"] == entries
    cache.resume()
    assert cache.stats()["bytes_moved"]["disk_to_device"] - after["disk_to_device"] == entries
    cache.close()


@pytest.mark.parametrize("mode", ["evict", "tier"])
def test_the_host_s_reserved_bytes_cover_a_layer_parked_there(model, mode):
    cache = TieredCache(model.config, device_budget=48, scorer="keynorm", mode=mode)
    _run(model, cache, steps=3)
    cache.park("host")
    host = cache.stats()["host"]
    parked = sum(e.parked.host_bytes() for e in cache._engines)
    pools = sum(0 if e.host is None else e.host.reserved_bytes() for e in cache._engines)
    assert host["reserved_bytes"] >= host["bytes"] and host["reserved_bytes"] >= pools + parked
    cache.close()


def test_read_ahead_counts_served_reads_and_keeps_them_after_close(model, tmp_path):
    cache = TieredCache(model.config, device_budget=48, host_budget=64, scorer="keynorm", recall_pages=4,
                        read_ahead=True, disk_dir=tmp_path)
    logits = _run(model, cache, prompt=300, steps=4)
    start = cache.stats()
    assert start["pages_recalled_from"]["disk"] == start["read_ahead"]["hits"] + start["read_ahead"]["misses"] > 0
    for e in cache._engines:
        e.readahead.clear()   # every disk read goes to the file, which now fails its checksums
    path = os.path.join(cache.disk_path, "pages.kvtp")
    with open(path, "r+b") as f:
        f.write(b"\x55" * os.path.getsize(path))
    with pytest.raises(CorruptPageError):
        with torch.no_grad():
            model(logits[:, -1:].argmax(-1), **cache_kwargs(cache))
    failed = cache.stats()
    assert failed["read_ahead"]["hits"] + failed["read_ahead"]["misses"] == failed["pages_recalled_from"]["disk"]
    cache.close()
    closed = cache.stats()["read_ahead"]
    assert {k: closed[k] for k in ("hits", "misses", "pages_read_ahead", "steps_paused")} == \
        {k: failed["read_ahead"][k] for k in ("hits", "misses", "pages_read_ahead", "steps_paused")}


def test_a_copy_keeps_what_ran_how(model):
    cache = TieredCache(model.config, device_budget=48, scorer="keynorm", recall_pages=3).take_gpu_path()
    _run(model, cache, steps=6)
    assert copy.deepcopy(cache).stats()["cuda_graphs"] == cache.stats()["cuda_graphs"]
    assert cache.stats()["cuda_graphs"]["eager_steps"] > 0


def test_the_recall_buffers_count_as_device_bytes(model):
    """The pages brought up for attention sit on the device beside the pool and the index: `recall_bytes` counts
    them (they were in no figure), zero before the first recall and after a park."""
    cache = TieredCache(model.config, device_budget=48, scorer="keynorm", recall_pages=3)
    with torch.no_grad():
        model(random_ids(model, 40, 2), **cache_kwargs(cache))
    assert cache.stats()["device"]["recall_bytes"] == 0   # nothing demoted: nothing recalled
    _run(model, cache, prompt=160, steps=2)
    buffers = [e.recalled for e in cache._engines]
    held = sum(b.k.nbytes + b.v.nbytes for b in buffers)
    got = cache.stats()["device"]["recall_bytes"]
    assert held > 0 and held <= got <= held * 1.1
    cache.park("host")
    assert cache.stats()["device"]["recall_bytes"] == 0


def test_the_wait_on_copies_outlives_close_and_goes_with_a_copy(model):
    """`transfer_wait_seconds` read the transfer managers held now: a close, which lets them go, lost their
    waits, and a copy (its own managers) started from none, where its other counters carry the original's."""
    cache = TieredCache(model.config, device_budget=48, scorer="keynorm", recall_pages=3)
    _run(model, cache)
    managers = list(cache._shared.transfers.values())
    assert managers   # a CPU's synchronous manager never waits: give it a wait, as a GPU's streams would
    managers[0].counters.wait_seconds += 1.5
    waited = cache.stats()["transfer_wait_seconds"]
    assert waited >= 1.5
    twin = copy.deepcopy(cache)
    assert twin.stats()["transfer_wait_seconds"] == waited
    cache.close()
    assert cache.stats()["transfer_wait_seconds"] == waited
    twin.close()
