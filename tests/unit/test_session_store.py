"""Parked sessions stay within the store's budgets: host first, then disk, then the coldest are dropped."""

from __future__ import annotations

import os
import types

import pytest
import torch

from kvtier import ConfigError, TieredCache, cache_kwargs
from kvtier.integrations.sessions import SessionStore

CONFIG = types.SimpleNamespace(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                               hidden_size=32, vocab_size=10, _attn_implementation="sdpa")


def _session(tokens=200, seed=0, host_budget=0.25):
    cache = TieredCache(CONFIG, device_budget=0.25, host_budget=host_budget, scorer="keynorm")
    g = torch.Generator().manual_seed(seed)
    for layer in range(2):
        k = torch.randn(1, 2, tokens, 8, generator=g)
        cache.update(k, k, layer)
        cache.layers[layer].engine.commit()
    return cache


def test_coldest_sessions_go_to_disk_then_are_dropped():
    caches = {f"s{i}": _session(seed=i) for i in range(4)}
    stats = caches["s0"].stats()  # parked on the host: host pages + device entries + the recall index
    one_host = stats["host"]["bytes"] + stats["device"]["bytes"] + stats["device"]["index_bytes"]
    caches["s0"].park("host")
    assert caches["s0"].stats()["host"]["bytes"] == one_host and caches["s0"].stats()["device"]["index_bytes"] == 0
    held = caches["s0"].stats()["host"]["reserved_bytes"]   # what the budget counts: the memory held
    assert held >= one_host
    store = SessionStore(host_bytes=2 * held, disk_bytes=None)
    for name, cache in caches.items():
        store.park(name, cache)
    assert store.where() == {"s0": "disk", "s1": "disk", "s2": "host", "s3": "host"}
    assert store.host_bytes_used() <= 2 * held
    one_disk = caches["s0"].stats()["disk"]["reserved_bytes"]
    store.disk_bytes = int(2.5 * one_disk)
    store.park("s4", _session(seed=4))
    assert store.disk_bytes_used() <= store.disk_bytes
    assert store.dropped[0] == "s0" and caches["s0"].closed and "s4" in store.where()
    resumed = store.resume("s3")
    assert resumed.parked == "host"
    resumed.resume()
    assert resumed.parked is None and resumed.stats()["device"]["tokens"] > 0
    with pytest.raises(KeyError, match="no parked session 's3'; parked"):
        store.resume("s3")
    with pytest.raises(KeyError, match=f"no parked session 's0' \\(a session 's0' was closed to keep the parked "
                                       f"sessions within disk_bytes={store.disk_bytes:,}: see `dropped`\\)"):
        store.resume("s0")
    store.close()


def test_sessions_parked_on_the_host_count_their_pages_not_their_slabs():
    """A session parked on the host holds its pages at their size (the host pool's slabs, a few MiB each and mostly
    empty here, go): a store sized for four such sessions keeps all four on the host."""
    caches = {f"s{i}": _session(seed=i) for i in range(4)}
    stats = caches["s0"].stats()
    one_host = stats["host"]["bytes"] + stats["device"]["bytes"] + stats["device"]["index_bytes"]
    assert stats["host"]["reserved_bytes"] > 4 * one_host   # live, each layer holds a slab for keys and one for values
    store = SessionStore(host_bytes=4 * one_host)
    for name, cache in caches.items():
        store.park(name, cache)
    assert store.where() == {name: "host" for name in caches}
    assert store.host_bytes_used() == 4 * one_host
    store.close()


def test_bad_budget():
    with pytest.raises(ConfigError, match="host_bytes=-1"):
        SessionStore(host_bytes=-1)


def test_a_failed_push_to_disk_keeps_every_session_whole_and_says_how_far_over(monkeypatch):
    from kvtier import CapacityError

    first, second = _session(seed=0), _session(seed=1)
    store = SessionStore(host_bytes=1)   # any second session pushes the first to disk

    def disk_full(to="host"):
        raise CapacityError("disk full")

    store.park("a", first)
    assert store.where() == {"a": "disk"}
    first.resume()                                   # back live, then parked on the host again, but its
    store._parked["a"] = first                       # next push to disk will fail
    first.park("host")
    monkeypatch.setattr(first, "park", disk_full)
    with pytest.raises(CapacityError, match=r"session 'b' is parked in host memory, but moving session 'a' to "
                                            r"disk failed .*bytes over its host budget"):
        store.park("b", second)
    assert store.where() == {"a": "host", "b": "host"}   # both parked and kept, nothing half-moved
    monkeypatch.undo()
    first.resume()
    assert first.stats()["device"]["tokens"] > 0
    store.close()


def _layers(cache):
    return [None if e.parked is None else e.parked.where for e in cache._engines]


def test_a_layer_parked_on_disk_lets_its_host_slabs_go_and_takes_new_ones_back(tmp_path):
    cache = _session(tokens=400)
    assert cache.stats()["host"]["reserved_bytes"] > 0
    cache.park("disk")
    assert cache.stats()["host"]["reserved_bytes"] == 0 and cache.stats()["host"]["bytes"] == 0
    cache.resume()
    held = cache.stats()
    assert held["host"]["bytes"] > 0 and held["host"]["reserved_bytes"] >= held["host"]["bytes"]
    k = torch.randn(1, 2, 100, 8, generator=torch.Generator().manual_seed(9))
    for layer in range(2):                                 # the host tier takes pages again after the park
        cache.update(k, k, layer)
        cache.layers[layer].engine.commit()
    assert cache.stats()["host"]["bytes"] > held["host"]["bytes"]
    cache.close()


def test_an_evict_mode_cache_parked_on_disk_counts_its_pages():
    cache = TieredCache(CONFIG, device_budget=0.25, mode="evict", scorer="keynorm")
    k = torch.randn(1, 2, 200, 8, generator=torch.Generator().manual_seed(0))
    for layer in range(2):
        cache.update(k, k, layer)
        cache.layers[layer].engine.commit()
    cache.park("disk")
    store = cache._shared.disk_store
    assert cache.stats()["disk"]["bytes"] >= store.pages() * store.payload_size > 0
    cache.close()


def test_a_session_parked_partly_on_the_host_is_counted_and_pushed_to_disk():
    """A restore that failed at a later layer leaves the first layers back; parked again, they go to the host."""
    from kvtier import CorruptPageError

    cache = _session(tokens=400)
    cache.park("disk")
    path = cache._engines[1].parked.meta_file.path
    os.rename(path, path + ".away")
    with pytest.raises(CorruptPageError):
        cache.resume()
    os.rename(path + ".away", path)
    cache.park("host")
    assert _layers(cache) == ["host", "disk"] and cache.parked == "disk"
    store = SessionStore(host_bytes=0)
    store.park("s", cache)
    assert _layers(cache) == ["disk", "disk"] and store.host_bytes_used() == 0
    store.close()


def test_parking_under_a_name_in_use_closes_the_session_it_named():
    store = SessionStore(host_bytes=2**30)
    first, second = _session(seed=0), _session(seed=1)
    store.park("ada", first)
    store.park("ada", first)                               # the same session again: kept
    assert not first.closed and store.where() == {"ada": "host"}
    store.park("ada", second)
    assert first.closed and store.resume("ada") is second
    second.close()
    store.close()


def test_closing_the_store_closes_every_session_when_one_fails(monkeypatch):
    store = SessionStore(host_bytes=2**30)
    caches = [_session(seed=i) for i in range(3)]
    for i, cache in enumerate(caches):
        store.park(f"s{i}", cache)

    def fails():
        raise OSError("cannot close")

    monkeypatch.setattr(caches[0], "close", fails)
    with pytest.raises(OSError, match="cannot close"):
        store.close()
    assert caches[1].closed and caches[2].closed and store.where() == {}
    monkeypatch.undo()
    caches[0].close()


def test_a_layer_back_from_disk_with_no_host_page_has_a_host_slab_again_and_steps_on_the_gpu_path(tmp_path):
    """Every page of the layer on disk (`host_budget=0`): the park lets the host slabs go and the restore brings
    none back with pages. A layer's steps on the GPU's path read the first host slab (its recall key) whether or not
    a page is on the host: the restore takes one back, as a layer never parked has."""
    from tiny_models import continue_greedy, random_ids, small_llama

    lm = small_llama(layers=2)
    settings = dict(device_budget=24, host_budget=0, recall_pages=2, scorer="keynorm")
    caches = []
    for park in (False, True):
        cache = TieredCache(lm.config, disk_dir=tmp_path / str(park), **settings)
        with torch.no_grad():
            logits = lm(random_ids(lm, 150), **cache_kwargs(cache)).logits
        if park:
            cache.park("disk")
            assert [len(e.host.k.slabs) for e in cache._engines] == [0, 0]
            cache.resume()
        assert [len(e.host.k.slabs) for e in cache._engines] == [1, 1]
        cache.take_gpu_path()
        for engine in cache._engines:   # keys made as on CUDA, where steps are captured
            engine.graphs.enabled = engine.prefetch_graphs.enabled = True
        caches.append((cache, continue_greedy(lm, cache, logits, n=3)[1]))
    assert caches[1][0].broken is None and torch.equal(caches[0][1], caches[1][1])
    for cache, _ in caches:
        cache.close()


def test_past_its_disk_budget_the_store_closes_only_sessions_that_hold_disk():
    """A session parked in host memory with nothing on disk is not closed to make room on disk (closing it freed
    no byte of disk, and the conversation was lost); the coldest sessions holding disk are."""
    on_host = _session(seed=9, host_budget=None)   # no host budget: no disk page
    store = SessionStore(host_bytes=2 ** 30, disk_bytes=None)
    store.park("host-only", on_host)
    store.park("disky", _session(seed=1))
    store.park("disky2", _session(seed=2))
    for name in ("disky", "disky2"):   # their pages past the host budget are on disk
        assert store._parked[name].stats()["disk"]["bytes"] > 0
    assert on_host.stats()["disk"]["bytes"] == 0
    store.disk_bytes = store._parked["disky2"].stats()["disk"]["reserved_bytes"]
    store.park("disky3", _session(seed=3))
    assert store.dropped == ["disky", "disky2"] and not on_host.closed and "host-only" in store.where()
    store.close()


def test_one_cache_under_two_names_and_what_is_no_tiered_cache_are_refused():
    """Parked under a second name, one cache was counted twice, and a later resume of one name left it in the store
    under the other, to be closed or pushed to disk while in use."""
    from transformers import DynamicCache

    store = SessionStore(host_bytes=2 ** 30)
    cache = _session()
    store.park("ada", cache)
    used = store.host_bytes_used()
    with pytest.raises(ConfigError, match="parked already, as 'ada'"):
        store.park("bob", cache)
    assert store.where() == {"ada": "host"} and store.host_bytes_used() == used
    store.park("ada", cache)   # again under its own name: fine
    with pytest.raises(ConfigError, match="given a DynamicCache; allowed: a TieredCache"):
        store.park("eve", DynamicCache())
    store.close()


def _held_on_host(cache) -> int:
    """Host bytes a cache's tensors occupy: its host pool's slabs, its key codes' slabs, a copy parked there."""
    total = 0
    for e in cache._engines:
        if e.host is not None:
            total += sum(t.numel() * t.element_size() for t in (*e.host.k.slabs, *e.host.v.slabs))
        if e.index is not None:
            total += e.index.codes.nbytes()
        if e.parked is not None and e.parked.where == "host":
            total += e.parked.host_bytes()
    return total


def test_the_host_budget_counts_the_memory_the_sessions_hold():
    """A session on the host holds its host pool's slabs whole: the store had counted the bytes its pages use
    (four sessions held 20 times the budget they were counted within)."""
    store = SessionStore(host_bytes=2 ** 30)
    caches = [_session(seed=i) for i in range(4)]
    store.park("s0", caches[0])
    store.host_bytes = 2 * store.host_bytes_used() + 1   # room for two
    for i, cache in enumerate(caches[1:], 1):
        store.park(f"s{i}", cache)
    on_host = [c for c, where in zip(caches, store.where().values()) if where == "host"]
    assert len(on_host) == 2 and sum(_held_on_host(c) for c in on_host) <= store.host_bytes
    assert store.host_bytes_used() == sum(_held_on_host(c) for c in on_host)
    store.close()


def test_the_disk_budget_counts_the_files_and_a_file_gives_back_its_free_end():
    """Read back from disk, a session's page file had kept its parked size until close, counted as no disk. The
    free slots at a file's end now go back to the disk as they are freed, and the budget counts the files."""
    cache = _session(seed=1, host_budget=None)   # nothing on disk but what a park writes
    store = SessionStore(host_bytes=0)
    store.park("s", cache)
    size = os.path.getsize(os.path.join(cache.disk_path, "pages.kvtp"))
    assert cache.parked == "disk" and size > 0 and store.disk_bytes_used() >= size
    store.resume("s").resume()
    assert os.path.getsize(os.path.join(cache.disk_path, "pages.kvtp")) == 0
    store.host_bytes = 2 ** 30
    store.park("s", cache)
    assert store.where() == {"s": "host"} and store.disk_bytes_used() == 0
    store.close()


def test_a_broken_session_is_passed_over_and_the_others_still_move(monkeypatch):
    """A session left broken (its push to disk cut short by Ctrl-C as its layers let go) made every later park
    raise about it: nothing else moved to disk, and the disk budget was never enforced."""
    a, b, c = (_session(seed=i) for i in range(3))
    store = SessionStore(host_bytes=2 ** 30)
    store.park("a", a)
    store.park("b", b)
    store.host_bytes = store.host_bytes_used()   # full: the next park pushes the coldest to disk
    engine = a._engines[1]
    settle = engine.settle_park

    def interrupted():
        monkeypatch.setattr(engine, "settle_park", settle)
        raise KeyboardInterrupt

    monkeypatch.setattr(engine, "settle_park", interrupted)
    with pytest.raises(KeyboardInterrupt):
        store.park("c", c)
    assert a.broken is not None
    store.park("c", c)   # 'a' cannot move: 'b' goes instead
    assert store.where()["b"] == "disk" and store.where()["c"] == "host"
    with pytest.raises(Exception, match="broken"):
        store.resume("a").resume()
    store.close()


def test_a_session_over_the_disk_budget_by_itself_closes_no_other():
    """Every other session holding disk had been closed for it, in vain, and the store ended over its budget
    saying nothing."""
    from kvtier import CapacityError

    store = SessionStore(host_bytes=0)
    small = [_session(seed=i, tokens=64) for i in range(2)]
    for i, cache in enumerate(small):
        store.park(f"small{i}", cache)
    store.disk_bytes = store.disk_bytes_used()
    with pytest.raises(CapacityError, match="'big' is parked, but it holds .* by itself; no other session"):
        store.park("big", _session(seed=5, tokens=2000))
    assert store.dropped == [] and set(store.where()) == {"small0", "small1", "big"}
    store.close()


def test_a_name_dropped_then_parked_again_is_no_longer_dropped():
    """A name stayed in `dropped` once a new session was parked under it, and once that one was resumed, a
    second resume said it had been closed for the disk budget; with no disk budget left, that message raised a
    TypeError."""
    store = SessionStore(host_bytes=0)
    store.park("ada", _session(seed=0))
    store.disk_bytes = store.disk_bytes_used()
    store.park("bob", _session(seed=1))
    assert store.dropped == ["ada"]
    store.park("ada", _session(seed=2))
    assert "ada" not in store.dropped
    store.resume("ada").close()
    with pytest.raises(KeyError) as e:
        store.resume("ada")
    assert "closed to keep" not in str(e.value)
    store.dropped.clear()   # the caller's list too: handled and drained, then the name parked again (a ValueError)
    store.park("bob", _session(seed=3))
    assert store.where() == {"bob": "disk"} and store.dropped == []
    store.park("cy", _session(seed=4))
    store.disk_bytes = None
    assert store.dropped == ["bob"]
    with pytest.raises(KeyError, match=r"'bob' was closed to keep the parked sessions within disk_bytes=[0-9,]+"):
        store.resume("bob")
    store.close()


def test_a_park_that_needs_room_lets_reads_ahead_go_before_pushing_a_session_to_disk():
    """A session parked on the host and prefetched (`SessionStore.prefetch`) has whole host slabs filled ahead,
    which count in the store's host memory: the next park pushed that very session to disk to make room (its
    prefetch lost too). The reads ahead go first now, and every session stays on the host."""
    probe = _session(seed=9)
    probe.park("host")
    one = probe.stats()["host"]["reserved_bytes"]
    probe.close()
    store = SessionStore(host_bytes=4 * one)
    store.park("a", _session(seed=1))
    store.park("b", _session(seed=2))
    assert store.prefetch("a")
    reads = store._parked["a"]._state.reads
    reads.wait()
    assert store.host_bytes_used() > store.host_bytes       # whole slabs, filled ahead
    store.park("c", _session(seed=3))
    assert store.where() == {"a": "host", "b": "host", "c": "host"}
    assert store._parked["a"]._state.reads is None and store.host_bytes_used() <= store.host_bytes
    back = store.resume("a")
    back.resume()
    assert back.parked is None
    back.close()
    store.close()
