"""`promote`: the host tier keeps disk pages that recall keeps bringing up, their disk records kept as clean copies.

Where a page lies never changes what attention reads, so the outputs must be the same bits with and without it.
What it changes: which pages the host holds (`plan_promotion`, held to its rules here), how many disk pages are
read, and what lies on disk (every disk record is a disk page or a host page's clean copy, none lost, none
leaked: through steps, resets, parking, copies and a full disk).
"""

from __future__ import annotations

import copy
import errno
import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier import TieredCache
from kvtier.errors import ConfigError
from kvtier.placement import plan_promotion
from kvtier.placement.page_table import DISK, HOST
from kvtier.placement.planner import _least_kept

from tiny_models import continue_greedy, greedy_logits, tiny_llama


def _plan(cands, uses, rank, on_host, budget, landed=None, clean=None):
    uses, rank, on_host = np.array(uses, dtype=np.int32), np.array(rank, dtype=np.float32), np.array(on_host, bool)
    landed = np.ones(uses.shape[1], bool) if landed is None else np.array(landed, bool)
    clean = np.zeros(uses.shape, bool) if clean is None else np.array(clean, bool)
    h, p = (np.array(x, dtype=np.int64) for x in zip(*cands))
    kept, dh, dp = plan_promotion(h, p, uses, rank, on_host, landed, clean, budget)
    return kept.tolist(), sorted(zip(dh.tolist(), dp.tolist()))


def test_free_room_takes_the_best_candidates_first():
    # head 0 holds pages 0, 1 (budget 3): one free place, for the candidate used most (page 3), then rank
    kept, down = _plan([(0, 2), (0, 3), (0, 4)], uses=[[0, 0, 1, 2, 1]], rank=[[5, 6, 0, 0, 1]],
                       on_host=[[1, 1, 0, 0, 0]], budget=3)
    # page 3 takes the free place; pages 4 then 2 (used once, rank 1 and 0) replace the unused pages 0 and 1
    assert kept == [True, True, True] and down == [(0, 0), (0, 1)]


def test_a_page_used_once_does_not_push_out_one_used_more():
    kept, down = _plan([(0, 2)], uses=[[3, 2, 1]], rank=[[0, 0, 9]], on_host=[[1, 1, 0]], budget=2)
    assert kept == [False] and down == []


def test_equal_use_goes_by_rank_and_a_host_page_worth_as_much_stays():
    kept, down = _plan([(0, 2), (0, 3)], uses=[[1, 1, 1, 1]], rank=[[2, 5, 3, 5]], on_host=[[1, 1, 0, 0]], budget=2)
    # candidate 3 (rank 5) beats host page 0 (rank 2); candidate 2 (rank 3) does not beat page 1 (rank 5)
    assert kept == [False, True] and down == [(0, 0)]


def test_clean_pages_go_first_among_the_equally_used_and_unlanded_pages_never():
    uses, rank, on_host = [[0, 0, 0, 2]], [[1, 9, 0, 0]], [[1, 1, 1, 0]]
    kept, down = _plan([(0, 3)], uses, rank, on_host, budget=3, clean=[[0, 1, 0, 0]])
    assert kept == [True] and down == [(0, 1)]   # page 1 has a copy on disk: it goes down unwritten
    kept, down = _plan([(0, 3)], uses, rank, on_host, budget=3, landed=[1, 0, 0, 1], clean=[[0, 1, 0, 0]])
    assert kept == [True] and down == [(0, 0)]   # pages 1 and 2 are still landing: only page 0 may go


def test_a_clean_page_goes_first_only_among_pages_worth_less_than_the_candidate():
    # all used once: page 0 (clean, rank 9) is worth more than the candidate (rank 5), page 1 (rank 1) less
    kept, down = _plan([(0, 2)], uses=[[1, 1, 1]], rank=[[9, 1, 5]], on_host=[[1, 1, 0]], budget=2,
                       clean=[[1, 0, 0]])
    assert kept == [True] and down == [(0, 1)]
    # both worth less: the clean one goes (unwritten), though its rank is the higher
    kept, down = _plan([(0, 2)], uses=[[1, 1, 1]], rank=[[2, 1, 5]], on_host=[[1, 1, 0]], budget=2,
                       clean=[[1, 0, 0]])
    assert kept == [True] and down == [(0, 0)]


def test_a_host_overflow_sends_the_least_used_down_first():
    from kvtier.placement import plan_host_overflow

    rank = np.array([[1.0, 2.0, 3.0, 4.0]], dtype=np.float32)
    on_host = np.ones((1, 4), bool)
    count = np.full((1, 4), 4)
    assert plan_host_overflow(rank, count, on_host, 8, 0)[0].tolist() == [0, 1]   # rank alone
    uses = np.array([[3, 0, 2, 0]], dtype=np.int32)
    assert plan_host_overflow(rank, count, on_host, 8, 0, uses=uses)[0].tolist() == [1, 3]


def test_heads_are_planned_apart():
    kept, down = _plan([(0, 1), (1, 1)], uses=[[0, 1], [5, 1]], rank=[[0, 0], [0, 0]], on_host=[[1, 0], [1, 0]],
                       budget=1)
    assert kept == [True, False] and down == [(0, 0)]


@settings(max_examples=200, deadline=None)
@given(data=st.lists(st.tuples(st.integers(0, 3), st.integers(-2, 2)), min_size=1, max_size=40),
       m=st.integers(0, 45))
def test_least_kept_is_the_head_of_a_full_sort(data, m):
    first = np.array([a for a, _ in data], dtype=np.int64)
    rank = np.array([b for _, b in data], dtype=np.float32)
    full = np.lexsort((np.arange(len(data)), rank, first))
    assert _least_kept(first, rank, m).tolist() == full[:m].tolist()


def _disk_records(engine) -> np.ndarray:
    """The disk slots `engine`'s table holds: its disk pages' and its host pages' clean copies."""
    copies = engine.table.copy_slot
    assert (engine.table.tier[copies >= 0] == HOST).all(), "a clean copy of a page not on the host"
    return np.concatenate([engine.table.slot[engine.table.tier == DISK], copies[copies >= 0]])


def _accounted(engines, disk):
    """Every record of `disk` (shared by `engines`) is a disk page or a host page's clean copy, each once."""
    if disk is None:
        return
    slots = np.concatenate([_disk_records(e) for e in engines])
    assert len(np.unique(slots)) == len(slots), "a disk record is held twice"
    assert disk.pages() == len(slots), "a disk record is lost or leaked"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(chunks=st.lists(st.integers(1, 9), min_size=4, max_size=30), page_size=st.integers(1, 4),
       recall_pages=st.integers(1, 6), host_budget=st.integers(0, 24), seed=st.integers(0, 2**16))
def test_twin_engines_attend_alike_and_every_page_is_kept_once(make_engine, chunks, page_size, recall_pages,
                                                                host_budget, seed):
    heads, dim = 2, 4
    settings_ = dict(heads=heads, head_dim=dim, device_budget=12, host_budget=host_budget, page_size=page_size,
                     recall_pages=recall_pages, sink_tokens=1, recent_tokens=2, read_ahead=False)
    on, off = make_engine(promote=True, **settings_), make_engine(promote=False, **settings_)
    on.promote_every = 1
    g = torch.Generator().manual_seed(seed)
    seen = 0
    for q in chunks:
        k, v = torch.randn(1, heads, q, dim, generator=g), torch.randn(1, heads, q, dim, generator=g)
        query = torch.randn(1, heads * 2, q, dim, generator=g)
        outs = []
        for engine in (on, off):
            engine.write(k.clone(), v.clone())
            got = engine.attend(query.clone())
            outs.append(None if got is None else got[0])
            # the rounds run in attend: within budget before the commit's overflow could send anything down
            assert (engine.table.tokens(HOST) <= engine.cfg.host_tokens(seen + q)).all(), "host over budget"
            engine.commit()
        assert (outs[0] is None) == (outs[1] is None)
        if outs[0] is not None:
            assert torch.equal(outs[0], outs[1]), "where pages lie changed what attention read"
        seen += q
        assert (on.table.tokens(HOST) <= on.cfg.host_tokens(seen)).all(), "host tier over budget"
        assert on.table.n == off.table.n and on.pool.count == off.pool.count
        assert np.isin(on.table.tier, (HOST, DISK)).all()   # every demoted page in one tier below the device
        _accounted([on], on.disk)
    on.reset()   # every record goes, clean copies too
    assert on.disk is None or on.disk.pages() == 0


def test_promote_must_be_a_bool_and_is_off_by_default():
    with pytest.raises(ConfigError, match=r"promote='yes'; allowed: True or False"):
        TieredCache(tiny_llama().config, host_budget=0.2, promote="yes")
    with TieredCache(tiny_llama().config, host_budget=0.2) as cache:
        assert cache.settings.promote is False


_SETTINGS = dict(device_budget=0.1, host_budget=0.25, recall_pages=4, page_size=8, read_ahead=False)


def _engines_accounted(cache):
    _accounted(cache._engines, cache._shared.disk_store)


def _same(a, b):
    """Two `continue_greedy` results: the same tokens, and the same bits of the last logits."""
    assert a[0] == b[0] and torch.equal(a[1], b[1])


def _promoting(model, tmp_path, **kw):
    cache = TieredCache(model.config, disk_dir=tmp_path, promote=True, **{**_SETTINGS, **kw})
    for engine in cache._engines:
        engine.promote_every = 1
    return cache


def test_logits_are_the_same_bits_with_and_without_and_the_disk_is_read_less(tmp_path):
    model = tiny_llama()
    with TieredCache(model.config, disk_dir=tmp_path, promote=False, **_SETTINGS) as off:
        expect = greedy_logits(model, off, prompt=400, steps=48, seed=5)
        before = off.stats()
    with _promoting(model, tmp_path) as on:
        assert on.settings.promote is True
        assert torch.equal(greedy_logits(model, on, prompt=400, steps=48, seed=5), expect)
        st_ = on.stats()
        _engines_accounted(on)
        assert st_["promotion"]["pages"] > 0 and st_["promotion"]["rounds_skipped"] == 0
        assert st_["pages_recalled_from"]["disk"] < before["pages_recalled_from"]["disk"]
        assert st_["host"]["tokens"] <= before["host"]["tokens"]   # within the same budget
        assert sum(int((e.table.copy_slot >= 0).sum()) for e in on._engines) > 0
        disk = on._shared.disk_store
        on.reset()
        assert disk.pages() == 0, "reset left disk records (clean copies)"
    assert before["promotion"] == {"pages": 0, "moved_down_unwritten": 0, "rounds_skipped": 0}


def test_disk_bytes_count_the_clean_copies(tmp_path):
    model = tiny_llama()
    with _promoting(model, tmp_path) as cache:
        greedy_logits(model, cache, prompt=400, steps=24, seed=5)
        st_ = cache.stats()
        entry = 2 * cache._engines[0].head_dim * 4   # float32 keys and values
        copies = sum(int((e.table.copy_slot >= 0).sum()) for e in cache._engines) * cache.settings.page_size
        assert copies > 0
        assert st_["disk"]["bytes"] == (st_["disk"]["tokens"] + copies) * entry


def test_parking_on_disk_goes_back_to_the_clean_copies_and_resumes_bit_identically(tmp_path):
    model = tiny_llama()
    with _promoting(model, tmp_path / "a") as cache, _promoting(model, tmp_path / "b") as twin:
        for c in (cache, twin):
            greedy_logits(model, c, prompt=400, steps=24, seed=5)
        disk, P = cache._shared.disk_store, cache.settings.page_size
        clean = sum(int((e.table.copy_slot >= 0).sum()) for e in cache._engines)
        dirty = sum(int(((e.table.tier == HOST) & (e.table.copy_slot < 0)).sum()) for e in cache._engines)
        entries = sum(-(-e.pool.count // P) * e.heads for e in cache._engines)
        assert clean > 0
        before = disk.pages()
        cache.park("disk")
        # only the device entries and the host pages without a clean copy were written: the others went back to it
        assert disk.pages() == before + entries + dirty
        assert sum(e.table.pages(HOST) for e in cache._engines) == 0
        cache.resume()
        _engines_accounted(cache)
        assert sum(int((e.table.copy_slot >= 0).sum()) for e in cache._engines) == 0   # back without copies
        last = torch.zeros(1, 1, model.config.vocab_size)
        last[..., 7] = 1.0
        _same(continue_greedy(model, cache, last, n=12), continue_greedy(model, twin, last, n=12))
        cache.reset()
        assert disk.pages() == 0


def test_a_copy_is_independent_and_decodes_alike(tmp_path):
    model = tiny_llama()
    with _promoting(model, tmp_path) as cache:
        greedy_logits(model, cache, prompt=400, steps=24, seed=5)
        assert sum(int((e.table.copy_slot >= 0).sum()) for e in cache._engines) > 0
        twin = copy.deepcopy(cache)
        try:
            _engines_accounted(twin)   # the copy's host pages have no clean copies of their own
            assert sum(int((e.table.copy_slot >= 0).sum()) for e in twin._engines) == 0
            assert twin.stats()["promotion"] == cache.stats()["promotion"]
            last = torch.zeros(1, 1, model.config.vocab_size)
            last[..., 3] = 1.0
            _same(continue_greedy(model, twin, last, n=12), continue_greedy(model, cache, last, n=12))
            _engines_accounted(cache)
            _engines_accounted(twin)
        finally:
            twin.close()


def _failing_in_rounds(tmp_path, monkeypatch, target, name, failure):
    """Decode with promotion, `target.name` raising `failure` while a promotion round runs (and only then), next to
    a cache without promotion: the stats, after checking the logits are the same bits and nothing is lost."""
    model = tiny_llama()
    with TieredCache(model.config, disk_dir=tmp_path, promote=False, **_SETTINGS) as off:
        expect = greedy_logits(model, off, prompt=400, steps=32, seed=5)
    with _promoting(model, tmp_path) as cache:
        real, in_round = getattr(target, name), []

        def failing(*args):
            if in_round:
                raise failure
            return real(*args)

        for engine in cache._engines:
            def keep(heads, pids, from_disk, _real=engine._keep_on_host):
                in_round.append(1)
                try:
                    return _real(heads, pids, from_disk)
                finally:
                    in_round.pop()
            monkeypatch.setattr(engine, "_keep_on_host", keep)
        monkeypatch.setattr(target, name, failing)
        got = greedy_logits(model, cache, prompt=400, steps=32, seed=5)
        assert torch.equal(got, expect) and cache.broken is None
        _engines_accounted(cache)
        for engine in cache._engines:
            assert (engine.table.tokens(HOST) <= cache.settings.host_tokens(cache.get_seq_length())).all()
        return cache.stats()["promotion"]


def test_no_memory_for_a_kept_page_stops_the_round_after_its_moves_down(tmp_path, monkeypatch):
    """The host pages sent down for room went (each move all or nothing); the pages to keep stay on disk."""
    from kvtier.errors import CapacityError
    from kvtier.tiers.host import HostPool

    got = _failing_in_rounds(tmp_path, monkeypatch, HostPool, "store",
                             CapacityError("could not allocate a pinned host slab"))
    assert got["rounds_skipped"] > 0 and got["pages"] == 0


def test_a_full_disk_stops_a_round_and_nothing_else(tmp_path, monkeypatch):
    """A round's writes (the host pages it sends down without a clean copy) fail: the round stops, the step goes on."""
    got = _failing_in_rounds(tmp_path, monkeypatch, os, "pwritev", OSError(errno.ENOSPC, "No space left on device"))
    assert got["rounds_skipped"] > 0, "no round needed the disk: the test tests nothing"
