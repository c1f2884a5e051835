"""Recall planned on the device for a layer with pages on disk: one read back a step, the chosen disk pages read
into pinned memory, the same plan and copy as with every page in host memory, then the disk pages into the slots
the plan gave them.

Forced on the CPU here (`device_recall`), it must choose, read and attend exactly as the host-planned recall
does, count the same pages from each tier, keep what promotion keeps, feed the read-ahead ring, and leave the
host pool as the host plan does; a damaged disk page is an error that changes nothing.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtier import CorruptPageError, TieredCache, native
from kvtier.placement.page_table import DISK, HOST

from engine_steps import drifting_queries, step_all
from tiny_models import greedy_logits, tiny_llama


def _twins(make_engine, **kw):
    """A host-planned engine and a device-planned one, alike otherwise (no device prefetch, so that the
    recall buffers are laid out alike and attention sums in the same order)."""
    settings = {**dict(heads=2, head_dim=16, device_budget=48, host_budget=24, recall_pages=6, page_size=4,
                       prefetch_pages=0, read_ahead=False), **kw}
    host, dev = make_engine(**settings), make_engine(**settings)
    dev.device_recall = True
    return host, dev


def _run(engines, seed=0, prompt=300, steps=60):
    g = torch.Generator().manual_seed(seed)
    step_all(engines, torch.randn(1, 2, prompt, 16, generator=g))
    for step, q in enumerate(drifting_queries(g, steps, keep=0.8, noise=0.6)):
        yield step, step_all(engines, torch.randn(1, 2, 1, 16, generator=g), q)


def _counts(engine):
    engine.settle_counts()
    c = engine.counters
    return dict(c.pages_recalled), c.pages_reused, dict(c.bytes_moved), c.recall_steps


def test_the_device_plan_reads_disk_pages_and_attends_as_the_host_plan(make_engine):
    host, dev = _twins(make_engine)
    for step, (a, b) in _run((host, dev)):
        assert torch.equal(host.last_recall, dev.last_recall), f"step {step}"
        assert torch.equal(a, b), f"step {step}"
    assert dev.holds_disk_pages() and dev.recalls_on_device() and dev.recalled.on_device
    got, expect = _counts(dev), _counts(host)
    assert got == expect
    assert got[0]["disk"] > 0 and got[0]["host"] > 0 and got[1] > 0


def test_the_multi_token_path_reads_disk_pages_too(make_engine):
    """Query blocks of a prefill with pages already demoted go through `_fetch` on the device as well."""
    host, dev = _twins(make_engine)
    g = torch.Generator().manual_seed(4)
    step_all((host, dev), torch.randn(1, 2, 300, 16, generator=g))
    for _ in range(3):
        a, b = step_all((host, dev), torch.randn(1, 2, 40, 16, generator=g), torch.randn(1, 4, 40, 16, generator=g))
        assert torch.equal(a, b)
    assert dev.holds_disk_pages()
    assert _counts(dev) == _counts(host) and _counts(dev)[0]["disk"] > 0


def test_with_promotion_it_keeps_the_pages_the_host_plan_keeps(make_engine):
    host, dev = _twins(make_engine, promote=True)
    host.promote_every = dev.promote_every = 1
    for step, (a, b) in _run((host, dev), seed=2):
        assert torch.equal(a, b), f"step {step}"
    assert dev.counters.pages_promoted == host.counters.pages_promoted > 0
    assert np.array_equal(dev.table.tier, host.table.tier)
    assert np.array_equal(dev.table.copy_slot >= 0, host.table.copy_slot >= 0)
    assert _counts(dev) == _counts(host)


def _buffer_holds_what_it_names(engine) -> int:
    """Every page the recall buffer names is that page's keys and values as stored in its tier; returns how many
    it names."""
    buf, P = engine.recalled, engine.cfg.page_size
    named = 0
    for h, row in enumerate(buf.held.tolist()):
        for s, pid in enumerate(row):
            if pid < 0:
                continue
            tier, slot = (int(x[0]) for x in engine.table.lookup(np.array([h]), np.array([pid])))
            store = engine.host if tier == HOST else engine.disk
            k, v = store.load(np.array([slot]))
            assert torch.equal(buf.k[h, s * P:(s + 1) * P], k[0]), f"head {h} slot {s}: page {pid} is not there"
            assert torch.equal(buf.v[h, s * P:(s + 1) * P], v[0])
            named += 1
    return named


def test_a_prefetch_takes_host_pages_only_and_never_names_a_page_it_did_not_copy(make_engine):
    """With spare slots a device-planned step prefetches the next-ranked pages, on a layer with disk pages too:
    the plan skips those without a host slot (a copy from no slot would leave a slot named for a page it does
    not hold). Every page the buffer names is that page, and the choices stay the host plan's."""
    settings = dict(heads=2, head_dim=16, device_budget=48, host_budget=24, recall_pages=6, page_size=4,
                    read_ahead=False)
    host = make_engine(prefetch_pages=0, **settings)
    dev = make_engine(prefetch_pages=6, **settings)
    dev.device_recall = True
    g = torch.Generator().manual_seed(1)
    step_all((host, dev), torch.randn(1, 2, 300, 16, generator=g))
    assert dev.holds_disk_pages()
    for q in drifting_queries(g, 40):
        a, b = step_all((host, dev), torch.randn(1, 2, 1, 16, generator=g), q)
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        assert torch.equal(host.last_recall, dev.last_recall)
        assert dev.recalled.pending is not None   # a prefetch queued
        assert _buffer_holds_what_it_names(dev) > 6 * 2
    dev.settle_counts()
    c = dev.counters
    assert c.pages_prefetched > 0 and c.prefetch_used > 0 and c.pages_recalled["disk"] > 0


def test_a_prefetch_after_a_promotion_round_reads_the_table_as_the_round_left_it(make_engine):
    """A step's promotion round moves pages between host and disk (and reuses the host slots it frees); the
    prefetch queued after it must read the host slots as they are then, not as the step found them."""
    settings = dict(heads=2, head_dim=16, device_budget=48, host_budget=24, recall_pages=6, page_size=4,
                    prefetch_pages=6, read_ahead=False)
    on, off = make_engine(promote=True, **settings), make_engine(promote=False, **settings)
    for e in (on, off):
        e.device_recall = True
    on.promote_every = 1
    for step, (a, b) in _run((on, off), seed=6, steps=50):
        assert torch.equal(a, b), f"step {step}"
        _buffer_holds_what_it_names(on)
    assert on.counters.pages_promoted > 0 and on.recalled.pending is not None


def test_read_ahead_is_offered_the_short_list(make_engine):
    host, dev = _twins(make_engine, read_ahead=True)
    for step, (a, b) in _run((host, dev), seed=3, steps=40):
        assert torch.equal(a, b), f"step {step}"
    # how many pages a ring reads ahead depends on when its reads finish: not compared between the engines
    assert dev.readahead is not None and dev.readahead.read_ahead > 0


def test_a_damaged_disk_page_is_an_error_and_changes_nothing(make_engine):
    _, dev = _twins(make_engine, recall_pages=10_000 // 4)
    g = torch.Generator().manual_seed(5)
    step_all([dev], torch.randn(1, 2, 300, 16, generator=g))
    assert dev.holds_disk_pages()
    slot = int(dev.table.slot[dev.table.tier == DISK][0])
    with open(dev.disk.path, "r+b") as f:
        f.seek(slot * dev.disk.record_size + 5)
        byte = f.read(1)
        f.seek(slot * dev.disk.record_size + 5)
        f.write(bytes([byte[0] ^ 0x40]))
    host_pages, tiers = dev.host.pages(), dev.table.tier.copy()
    dev.write(*(torch.randn(1, 2, 1, 16, generator=g),) * 2)
    with pytest.raises(CorruptPageError, match=rf"at slot {slot}\b"):
        dev.attend(torch.randn(1, 4, 1, 16, generator=g))
    assert dev.host.pages() == host_pages and np.array_equal(dev.table.tier, tiers)
    assert dev.recalled is None   # the buffer's table may name pages never copied: dropped


def test_a_cache_recalling_on_the_device_with_disk_pages_gives_the_host_plans_logits(tmp_path):
    model = tiny_llama()
    settings = dict(device_budget=0.1, host_budget=0.25, recall_pages=4, page_size=8, read_ahead=False,
                    prefetch_pages=0)
    runs = []
    for on_device in (False, True):
        with TieredCache(model.config, disk_dir=tmp_path, **settings) as cache:
            for engine in cache._engines:
                engine.device_recall = on_device
            native.reset_stats()
            logits = greedy_logits(model, cache, prompt=400, steps=32, seed=5)
            runs.append((logits, cache.stats(), native.backend()["ops"]))
            assert all(e.holds_disk_pages() for e in cache._engines)
    (host_logits, host_stats, _), (dev_logits, dev_stats, dev_ops) = runs
    assert {"plan_recall", "recall_pages"} <= set(dev_ops)
    assert torch.equal(host_logits, dev_logits)
    assert dev_stats["pages_recalled_from"] == host_stats["pages_recalled_from"]
    assert dev_stats["pages_recalled_from"]["disk"] > 0
    assert dev_stats["host"]["tokens"] == host_stats["host"]["tokens"]


def test_the_gpu_decode_step_with_disk_pages_answers_as_the_cpu_path(tmp_path, monkeypatch):
    """The whole GPU decode step (pool attention, page choice and the recalled pages' attention by the kernels'
    twins, the step's write in its attention) on layers with disk pages: run eagerly, never from a graph, with
    the CPU path's choices and tokens, its logits to float rounding."""
    from kvtier.engine.graphs import StepGraphs
    from kvtier.engine.layer import LayerEngine

    model = tiny_llama()
    settings = dict(device_budget=0.1, host_budget=0.25, recall_pages=4, page_size=8, read_ahead=False,
                    prefetch_pages=0)
    eager_with_disk = []
    launches = LayerEngine._decode_launches

    def spy(self, run, *inputs):
        eager_with_disk.append(self.holds_disk_pages())
        return launches(self, run, *inputs)

    monkeypatch.setattr(LayerEngine, "_decode_launches", spy)
    through_graphs = []
    graphs_run = StepGraphs.run
    monkeypatch.setattr(StepGraphs, "run", lambda self, *a, **k: through_graphs.append(1) or graphs_run(self, *a, **k))
    runs = []
    for gpu_path in (False, True):
        with TieredCache(model.config, disk_dir=tmp_path, **settings) as cache:
            if gpu_path:
                cache.take_gpu_path()
            native.reset_stats()
            through_graphs.clear()
            logits = greedy_logits(model, cache, prompt=400, steps=24, seed=6)
            runs.append((logits, cache.stats(), native.backend()["ops"]))
            if gpu_path:   # never handed to a layer's graphs (whose replay could not read back), counted as eager
                assert not through_graphs and cache.stats()["cuda_graphs"]["eager_steps"] == 24 * 2
    (cpu_logits, cpu_stats, _), (gpu_logits, gpu_stats, gpu_ops) = runs
    assert {"plan_recall", "recall_pages", "attend_slabs", "attend_pages"} <= set(gpu_ops)
    assert len(eager_with_disk) == 24 * 2 and all(eager_with_disk)
    assert torch.equal(cpu_logits.argmax(-1), gpu_logits.argmax(-1))
    torch.testing.assert_close(gpu_logits, cpu_logits, rtol=0, atol=1e-4)
    assert gpu_stats["pages_recalled_from"]["disk"] > 0


def test_a_disk_step_leaves_the_host_pool_alone(make_engine):
    """Disk pages go from their pinned reads straight into the recall buffer: the host pool holds exactly the
    host pages, its budget and its slabs as on the host plan, at every step."""
    host, dev = _twins(make_engine)
    for step, (a, b) in _run((host, dev), seed=8, steps=30):
        assert torch.equal(a, b), f"step {step}"
        assert dev.host.pages() == host.host.pages() == int((dev.table.tier == HOST).sum())
        assert dev.host.reserved_bytes() == host.host.reserved_bytes()
        assert (dev.table.tokens(HOST) <= dev.cfg.host_tokens(dev.seen)).all()
    assert dev.counters.pages_recalled["disk"] > 0


def test_a_step_that_brings_nothing_up_counts_no_recall_for_promotion(make_engine):
    """Promotion's clock counts the recalls that bring pages up, on either plan: a query that stays put brings
    nothing up after its first steps, and the use counts and tiers stay the host plan's."""
    host, dev = _twins(make_engine, promote=True)
    g = torch.Generator().manual_seed(9)
    step_all((host, dev), torch.randn(1, 2, 300, 16, generator=g))
    q = torch.randn(1, 4, 1, 16, generator=g)
    for step in range(40):
        k = torch.randn(1, 2, 1, 16, generator=g) if step % 10 == 0 else torch.zeros(1, 2, 1, 16)
        a, b = step_all((host, dev), k, q)
        assert torch.equal(a, b), f"step {step}"
    assert dev._recall_clock == host._recall_clock < 40
    assert np.array_equal(dev.table.uses, host.table.uses) and np.array_equal(dev.table.tier, host.table.tier)


def test_the_gpu_decode_step_notes_its_host_read_before_promotion_stores_pages(tmp_path, monkeypatch):
    """A GPU decode step on a layer with disk pages promotes what it brought up in the same step that queued the
    copy out of the host slabs; the host pool waits before a store only for the reads it was told of, so the
    copy's read must be noted before any store (else a store could overwrite a slot the copy still reads)."""
    from kvtier.engine.layer import LayerEngine
    from kvtier.tiers.host import HostPool

    unnoted: dict[int, bool] = {}
    stores = []
    copy_up, read_on, store = LayerEngine._copy_up, HostPool.read_on, HostPool.store

    def spy_copy(self, buf, sources, plan, note=True):
        unnoted[id(self.host)] = True
        return copy_up(self, buf, sources, plan, note)

    def spy_read_on(self, device):
        unnoted[id(self)] = False
        return read_on(self, device)

    def spy_store(self, k, v):
        stores.append(unnoted.get(id(self), False))
        return store(self, k, v)

    monkeypatch.setattr(LayerEngine, "_copy_up", spy_copy)
    monkeypatch.setattr(HostPool, "read_on", spy_read_on)
    monkeypatch.setattr(HostPool, "store", spy_store)
    model = tiny_llama()
    with TieredCache(model.config, disk_dir=tmp_path, device_budget=0.1, host_budget=0.25, recall_pages=4,
                     page_size=8, read_ahead=False, prefetch_pages=0, promote=True) as cache:
        cache.take_gpu_path()
        for engine in cache._engines:
            engine.promote_every = 1
        greedy_logits(model, cache, prompt=400, steps=24, seed=6)
        assert cache.stats()["promotion"]["pages"] > 0
    assert stores and not any(stores), f"{sum(stores)} of {len(stores)} stores came before the copy's read was noted"


@pytest.mark.parametrize("fails", ["_copy_up", "_scatter_disk_pages"])
def test_a_copy_that_fails_counts_nothing(make_engine, monkeypatch, fails):
    """The copy of a device-planned step with disk pages fails once (the step is then attended again): the counters
    are those of a twin that only let its recall buffer go at that step. The plan's counts had stayed (pages
    counted as recalled that never moved), and the disk pages a failed scatter left were booked as host recalls."""
    clean, failed = _twins(make_engine, device_budget=32, recall_pages=4)
    clean.device_recall = True
    g = torch.Generator().manual_seed(0)
    step_all([clean, failed], torch.randn(1, 2, 200, 16, generator=g))
    for s in range(10):
        k, q = torch.randn(1, 2, 1, 16, generator=g), torch.randn(1, 4, 1, 16, generator=g)
        outs = []
        for e in (clean, failed):
            e.write(k, k.flip(-1))
            if s == 5 and e is clean:
                e._forget_recalled()   # as the failure does: only the failed try differs
            if s == 5 and e is failed:
                def broken(*args, **kwargs):
                    raise RuntimeError("the copy failed")

                monkeypatch.setattr(e, fails, broken)
                with pytest.raises(RuntimeError, match="the copy failed"):
                    e.attend(q)
                monkeypatch.undo()
            outs.append(e.attend(q)[0])
            e.commit()
        assert torch.equal(*outs), s
    for e in (clean, failed):
        e.settle_counts()
    assert clean.counters.pages_recalled["disk"] > 0
    assert failed.counters.pages_recalled == clean.counters.pages_recalled
    assert failed.counters.pages_reused == clean.counters.pages_reused
