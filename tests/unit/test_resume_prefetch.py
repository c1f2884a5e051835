"""Reading parked layers back ahead of their restore (`TieredCache.prefetch_parked`, `SessionStore.prefetch`) changes
when the disk is read, never what a restore does: the same logits, bit for bit, the same errors, and nothing
left reading once the cache is parked again, reset or closed."""

from __future__ import annotations

import gc
import os
import threading

import pytest
import torch

import kvtier.engine.parking as parking
from kvtier import CorruptPageError, TieredCache, UnsupportedError, cache_kwargs
from kvtier.integrations.sessions import SessionStore
from tiny_models import continue_greedy, random_ids, small_llama

SETTINGS = dict(device_budget=24, host_budget=32, recall_pages=2, scorer="keynorm")   # partial recall, disk pages


@pytest.fixture(scope="module")
def llama():
    from kvtier.integrations.attention import restore_attention

    m = small_llama(layers=3)
    yield m
    restore_attention(m.config)


@torch.no_grad()
def _prefilled(model, tmp_path, park=None):
    cache = TieredCache(model.config, disk_dir=tmp_path, **SETTINGS)
    logits = model(random_ids(model, 150), **cache_kwargs(cache)).logits
    if park:
        cache.park(park)
    return cache, logits


@pytest.fixture(scope="module")
def never_parked(llama, tmp_path_factory):
    cache, logits = _prefilled(llama, tmp_path_factory.mktemp("twin"))
    with cache:
        return continue_greedy(llama, cache, logits, n=6)


def _readers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "kvtier-unpark"]


def _wait_for_reads(cache):
    if cache._state.reads is not None:
        cache._state.reads.wait()


def test_read_ahead_restores_the_same_state_bit_for_bit(llama, tmp_path, never_parked):
    cache, logits = _prefilled(llama, tmp_path, park="disk")
    assert cache.prefetch_parked() is True
    assert cache.prefetch_parked() is False                      # under way already
    _wait_for_reads(cache)
    held = cache.stats()["resume_prefetch"]
    assert held["held_bytes"] > 0 and not held["in_flight"] and held["layers"] == 0
    assert cache.parked == "disk"                         # read, not restored: nothing changed yet
    tokens, last = continue_greedy(llama, cache, logits, n=6)
    assert (tokens, last.tolist()) == (never_parked[0], never_parked[1].tolist())
    assert torch.equal(last, never_parked[1])
    done = cache.stats()["resume_prefetch"]
    assert done["layers"] == 3 and done["failed"] == 0 and done["held_bytes"] == 0
    assert cache.stats()["bytes_moved"]["disk_to_device"] > 0
    cache.close()


def test_resume_waits_for_reads_under_way(llama, tmp_path, never_parked, monkeypatch):
    cache, logits = _prefilled(llama, tmp_path, park="disk")
    gate = threading.Event()
    real = parking.ParkedLayer.read

    def slow_read(self, *args, **kwargs):
        gate.wait(5)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(parking.ParkedLayer, "read", slow_read)
    assert cache.prefetch_parked()
    assert cache.stats()["resume_prefetch"]["in_flight"]
    threading.Timer(0.2, gate.set).start()
    cache.resume()                                        # waits for the reads, then takes them
    monkeypatch.undo()
    stats = cache.stats()["resume_prefetch"]
    assert cache.parked is None and stats["layers"] == 3 and stats["wait_seconds"] > 0.05
    tokens, last = continue_greedy(llama, cache, logits, n=6)
    assert torch.equal(last, never_parked[1])
    cache.close()


def test_nothing_to_do_ahead(llama, tmp_path, monkeypatch):
    live, _ = _prefilled(llama, tmp_path / "a")
    monkeypatch.setattr(parking, "SPARE_SHARE", 1.0)     # the host pools keep their slabs through the park
    on_host, _ = _prefilled(llama, tmp_path / "b", park="host")
    assert all(e.parked.host_pages is None for e in on_host._engines)
    assert live.prefetch_parked() is False
    assert on_host.prefetch_parked() is False            # host-parked entries are in memory already
    assert _readers() == []
    live.close()
    on_host.close()
    live.close()
    with pytest.raises(Exception, match="closed"):
        live.prefetch_parked()


def test_a_host_park_has_its_new_slabs_filled_ahead_and_the_restore_takes_them(llama, tmp_path, never_parked):
    """Parked on the host with its host pages out of its pool's slabs, a layer has them put into new slabs ahead;
    the restore's pool takes those very slabs (nothing copied at the step), and decoding goes on bit for bit."""
    cache, logits = _prefilled(llama, tmp_path, park="host")
    engines = cache._engines
    assert all(e.parked.host_pages is not None and e.host.reserved_bytes() == 0 for e in engines)
    assert cache.prefetch_parked() is True
    _wait_for_reads(cache)
    made = [cache._state.reads._got[id(e)][1]["slabs"] for e in engines]
    assert cache.stats()["resume_prefetch"]["held_bytes"] == sum(m.nbytes() for m in made) > 0
    assert all(e.host.reserved_bytes() == 0 for e in engines) and cache.parked == "host"   # nothing changed yet
    addresses = [[t.data_ptr() for t in (*m.k.slabs, *m.v.slabs)] for m in made]
    cache.resume()
    assert [[t.data_ptr() for t in (*e.host.k.slabs, *e.host.v.slabs)] for e in engines] == addresses
    tokens, last = continue_greedy(llama, cache, logits, n=6)
    assert (tokens, last.tolist()) == (never_parked[0], never_parked[1].tolist())
    assert torch.equal(last, never_parked[1])
    done = cache.stats()["resume_prefetch"]
    assert done["layers"] == 3 and done["failed"] == 0 and done["held_bytes"] == 0
    cache.close()


def test_a_read_that_failed_ahead_is_made_again_by_the_restore(llama, tmp_path, never_parked, monkeypatch):
    cache, logits = _prefilled(llama, tmp_path, park="disk")
    real, calls = parking.ParkedLayer.read, []

    def fail_once(self, *args, **kwargs):
        calls.append(threading.current_thread().name)
        if len(calls) == 2:
            raise OSError(5, "Input/output error")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(parking.ParkedLayer, "read", fail_once)
    cache.prefetch_parked()
    _wait_for_reads(cache)
    tokens, last = continue_greedy(llama, cache, logits, n=6)
    assert calls == ["kvtier-unpark"] * 3 + ["MainThread"]   # the failed layer read again, on demand
    assert torch.equal(last, never_parked[1])
    stats = cache.stats()["resume_prefetch"]
    assert (stats["layers"], stats["failed"]) == (2, 1)
    cache.close()


def test_a_damaged_layer_fails_the_restore_as_without_reading_ahead(llama, tmp_path, never_parked):
    cache, logits = _prefilled(llama, tmp_path, park="disk")
    path = cache._engines[1].parked.meta_file.path
    data = open(path, "rb").read()
    with open(path, "r+b") as f:
        f.seek(len(data) // 2)
        f.write(bytes([data[len(data) // 2] ^ 0xFF]))
    cache.prefetch_parked()
    with pytest.raises(CorruptPageError, match="fails its CRC-32 check"):
        continue_greedy(llama, cache, logits, n=1)
    assert cache.broken is None and [e.parked is None for e in cache._engines] == [True, False, False]
    with open(path, "wb") as f:                           # repaired: the step goes through, reading on demand
        f.write(data)
    tokens, last = continue_greedy(llama, cache, logits, n=6)
    assert torch.equal(last, never_parked[1])
    assert cache.stats()["resume_prefetch"]["failed"] == 1
    cache.close()


@pytest.mark.parametrize("then", ["park host", "park disk", "reset", "close"])
def test_park_reset_and_close_stop_the_reads_and_let_them_go(llama, tmp_path, never_parked, then):
    cache, logits = _prefilled(llama, tmp_path, park="disk")
    folder = cache.disk_path
    cache.prefetch_parked()
    if then == "close":
        cache.close()
        assert _readers() == [] and not os.path.exists(folder)
        return
    if then == "reset":
        cache.reset()
        assert cache.parked is None and cache.get_seq_length() == 0
    else:
        cache.park(then.split()[1])                        # already on disk: nothing moves, the reads go
        assert cache.parked == "disk"
    assert _readers() == [] and cache._state.reads is None
    assert cache.stats()["resume_prefetch"]["held_bytes"] == 0
    if then != "reset":
        tokens, last = continue_greedy(llama, cache, logits, n=6)
        assert torch.equal(last, never_parked[1]) and cache.stats()["resume_prefetch"]["layers"] == 0
    cache.close()


def test_a_copy_of_a_cache_reading_ahead_is_refused_as_for_any_parked_cache(llama, tmp_path):
    import copy

    cache, _ = _prefilled(llama, tmp_path, park="disk")
    cache.prefetch_parked()
    with pytest.raises(UnsupportedError, match="parked"):
        copy.deepcopy(cache)
    cache.close()


def test_a_dropped_cache_reading_ahead_is_closed(llama, tmp_path):
    cache, _ = _prefilled(llama, tmp_path, park="disk")
    folder = cache.disk_path
    cache.prefetch_parked()
    del cache
    gc.collect()
    assert _readers() == [] and not os.path.exists(folder)


def test_session_store_reads_back_on_resume_and_ahead_of_it(llama, tmp_path, never_parked):
    store = SessionStore(host_bytes=0)                     # every session goes on to disk
    cache, logits = _prefilled(llama, tmp_path)
    store.park("ada", cache)
    assert store.where() == {"ada": "disk"}
    parked_bytes = store.host_bytes_used()
    assert store.prefetch("ada") is True
    _wait_for_reads(cache)
    assert store.host_bytes_used() > parked_bytes         # the reads' host memory counts until the resume
    with pytest.raises(KeyError, match="no parked session 'bob'"):
        store.prefetch("bob")
    back = store.resume("ada")                             # reads under way (or done) are kept
    tokens, last = continue_greedy(llama, back, logits, n=6)
    assert torch.equal(last, never_parked[1]) and back.stats()["resume_prefetch"]["layers"] == 3
    store.park("ada", back)
    again = store.resume("ada")                            # resume starts the reads itself
    assert again.stats()["resume_prefetch"]["in_flight"] or again._state.reads is not None
    again.resume()
    assert again.parked is None and again.stats()["resume_prefetch"]["layers"] == 6
    store.close()
    again.close()


@pytest.mark.parametrize("thread_first", [False, True])
def test_a_cache_collected_on_its_own_reading_thread_is_closed_without_waiting_for_itself(llama, tmp_path,
                                                                                          monkeypatch, thread_first):
    """A garbage collection that the reads set off may run the cache's finalizer on the reading thread; even before
    the thread that started the reads holds them (`thread_first`: the reads done before `start` returns), the
    finalizer finds and drops them (the cache had been left holding reads its finalizer never saw)."""
    if thread_first:
        start = threading.Thread.start

        def start_and_finish(thread):
            start(thread)
            if thread.name == "kvtier-unpark":
                thread.join()

        monkeypatch.setattr(threading.Thread, "start", start_and_finish)
    cache, _ = _prefilled(llama, tmp_path, park="disk")
    folder, state = cache.disk_path, cache._state
    real, closed = parking.ParkedLayer.read, []

    def read_then_collect(self, *args, **kwargs):
        got = real(self, *args, **kwargs)
        if not closed:
            closed.append(threading.current_thread().name)
            cache_ref[0]._finalizer()                      # as a collection on this thread would
        return got

    cache_ref = [cache]
    monkeypatch.setattr(parking.ParkedLayer, "read", read_then_collect)
    cache.prefetch_parked()
    for thread in _readers():
        thread.join(5)
    assert closed == ["kvtier-unpark"] and state.closed and not os.path.exists(folder)
    assert state.reads is None and all(e.tiers == [None, None] for e in state.engines)   # every layer closed
    assert _readers() == []


def test_no_thread_for_the_reads_leaves_them_to_the_restore(llama, tmp_path, never_parked, monkeypatch):
    cache, logits = _prefilled(llama, tmp_path, park="disk")

    def refuse(self):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    assert cache.prefetch_parked() is False and cache._state.reads is None
    monkeypatch.undo()
    tokens, last = continue_greedy(llama, cache, logits, n=6)
    assert torch.equal(last, never_parked[1]) and cache.stats()["resume_prefetch"]["layers"] == 0
    cache.close()


def test_a_broken_or_closed_session_comes_back_from_the_store_to_say_so_itself(llama, tmp_path):
    from kvtier import BrokenCacheError, ClosedCacheError

    store = SessionStore(host_bytes=0)
    broken, _ = _prefilled(llama, tmp_path / "a")
    closed, _ = _prefilled(llama, tmp_path / "b")
    store.park("broken", broken)
    store.park("closed", closed)
    broken._state.break_with("a failure for the test")
    closed.close()
    assert store.resume("broken") is broken and store.resume("closed") is closed
    with pytest.raises(BrokenCacheError):
        broken.resume()
    with pytest.raises(ClosedCacheError):
        closed.resume()
    broken.close()
    store.close()
