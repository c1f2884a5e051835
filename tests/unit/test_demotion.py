"""A demotion either places its pages or leaves the layer as it was: a copy down that fails, or scores found
NaN when the deferred check reads them with the copies (as on a GPU), frees the host slots and places
nothing; and what it places comes down intact, the index and page table included."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtier.errors import ScorerError, TransferError
from kvtier.placement.page_table import HOST


def _state(engine):
    return (engine.table.n, engine.host.pages(), engine.index.n, list(engine.host._free), engine.host._next,
            engine.table.version)


def _fill(engine, g, tokens=60):
    k = torch.randn(1, engine.heads, tokens, engine.head_dim, generator=g)
    engine.write(k, -k)
    engine.commit()


def _next_token(g, engine):
    return torch.randn(1, engine.heads, 1, engine.head_dim, generator=g)


def _nan_step(engine, g, monkeypatch):
    """One step whose scores are all NaN (the check deferred: noted, not read back), then the real scorer."""
    real = engine.scorer.score
    monkeypatch.setattr(engine.scorer, "score", lambda *a, **kw: real(*a, **kw) * float("nan"))
    k = _next_token(g, engine)
    engine.write(k, -k)
    engine.commit()
    monkeypatch.setattr(engine.scorer, "score", real)


def _until_demotion(engine, g):
    """Step one token at a time until the next commit demotes; returns the state just before it."""
    for _ in range(200):
        before = _state(engine)
        k = _next_token(g, engine)
        engine.write(k, -k)
        n = engine.table.n
        engine.commit()
        if engine.table.n > n:
            return before
    raise AssertionError("no demotion in 200 steps")


@pytest.mark.parametrize("fail_at", [0, 1, 2, 4])
def test_a_copy_down_that_fails_places_nothing(make_engine, monkeypatch, fail_at):
    engine = make_engine(heads=2, head_dim=8, device_budget=32, page_size=4, recall_pages=4)
    g = torch.Generator().manual_seed(0)
    _fill(engine, g)
    _until_demotion(engine, g)     # the layer's pools exist and hold pages
    calls, real = [0], engine.transfer.submit

    def flaky(dst, src):
        calls[0] += 1
        if calls[0] > fail_at:
            raise TransferError("copy failed (injected)")
        return real(dst, src)

    monkeypatch.setattr(engine.transfer, "submit", flaky)
    for _ in range(200):
        before, demotions = _state(engine), engine.counters.demotions
        k = _next_token(g, engine)
        engine.write(k, -k)
        count = engine.pool.count
        try:
            engine.commit()
        except TransferError:
            break
    else:
        raise AssertionError("no demotion was attempted")
    assert _state(engine)[:4] == before[:4]          # no page, slot or index row taken
    assert engine.pool.count == count + 1             # the step's token stays on the device
    assert engine.counters.demotions == demotions     # and no demotion is counted
    monkeypatch.setattr(engine.transfer, "submit", real)
    k = _next_token(g, engine)
    engine.write(k, -k)
    engine.commit()                                   # the next step demotes what is due
    assert engine.table.n > before[0]


def test_nan_scores_are_caught_when_the_demotions_copies_land(make_engine, monkeypatch):
    """The GPU's deferred NaN check (forced here on the CPU): the flag goes down with the demotion's copies and
    is read when they land, at the layer's next step (which raises), or when the table is read."""
    engine = make_engine(heads=2, head_dim=8, device_budget=32, page_size=4, recall_pages=4)
    engine.defer_nan = True
    g = torch.Generator().manual_seed(1)
    _fill(engine, g)
    _until_demotion(engine, g)
    assert engine._nan is None and engine.table.unsettled > 0    # taken by that demotion's copies
    _nan_step(engine, g, monkeypatch)
    for _ in range(200):
        k = _next_token(g, engine)
        engine.write(k, -k)                           # lands the earlier copies: clean
        n = engine.table.n
        engine.commit()
        if engine.table.n > n:
            break
    with pytest.raises(ScorerError, match="NaN"):
        engine.write(_next_token(g, engine), _next_token(g, engine))
    with pytest.raises(ScorerError, match="NaN"):
        engine.table.rank                             # and on every later read of the table


def test_a_deferred_nan_check_in_evict_mode_raises_before_the_scores_place(make_engine, monkeypatch):
    """Evict mode reads the deferred flag at its next demotion: one NaN step among clean ones is enough (the
    running maximum keeps it), and the step that would place by those scores raises instead."""
    engine = make_engine(heads=2, head_dim=8, device_budget=32, page_size=4, recall_pages=4, mode="evict")
    engine.defer_nan = True
    g = torch.Generator().manual_seed(2)
    _fill(engine, g)
    dropped = engine.counters.tokens_dropped
    for _ in range(200):                              # to just after a demotion: the next ones are steps away
        k = _next_token(g, engine)
        engine.write(k, -k)
        engine.commit()
        if engine.counters.tokens_dropped > dropped:
            break
    _nan_step(engine, g, monkeypatch)
    assert engine._nan is not None
    dropped, steps = engine.counters.tokens_dropped, 0
    with pytest.raises(ScorerError, match="NaN"):
        for steps in range(200):                      # clean steps until the next demotion reads the flag
            k = _next_token(g, engine)
            engine.write(k, -k)
            engine.commit()
    assert steps > 0 and engine.counters.tokens_dropped == dropped and engine._nan is None


def test_a_demotions_copies_land_at_the_next_step(make_engine):
    engine = make_engine(heads=2, head_dim=8, device_budget=32, page_size=4, recall_pages=4)
    g = torch.Generator().manual_seed(3)
    _fill(engine, g)
    _until_demotion(engine, g)
    assert engine.table.unsettled > 0                 # numbered and placed, ranks and positions to come
    assert (engine.table.tier[:, -1] == HOST).all()
    k = _next_token(g, engine)
    engine.write(k, -k)
    assert engine.table.unsettled == 0
    assert np.isfinite(engine.table.rank).all() and (engine.table.positions(0, engine.table.n - 1) >= 0).all()


def test_demoted_pages_arrive_intact_with_their_index_and_table_rows(make_engine):
    engine = make_engine(heads=2, head_dim=8, device_budget=24, page_size=4, recall_pages=4)
    g = torch.Generator().manual_seed(2)
    written_k = []
    for _ in range(30):
        k = torch.randn(1, 2, 3, 8, generator=g)
        written_k.append(k)
        engine.write(k, -k)
        engine.commit()
    keys = torch.cat(written_k, dim=2)[0]            # [heads, tokens, dim], by position
    heads, pids = engine.table.pages_in(HOST)
    assert len(pids) and engine.index.n == engine.table.n
    slots = engine.table.lookup(heads, pids)[1]
    k, v = engine.host.load(slots)
    for i, (h, pid) in enumerate(zip(heads.tolist(), pids.tolist())):
        pos = engine.table.positions(h, pid)
        assert torch.equal(k[i], keys[h, pos]) and torch.equal(v[i], -keys[h, pos])
    lo, hi, codes = engine.index.pick(torch.from_numpy(np.stack([pids[heads == h][:2] for h in range(2)])))
    assert (lo <= hi).all() and codes.dtype == torch.uint8


def test_a_host_under_its_budget_leaves_the_copies_landing(make_engine):
    """With a host budget the layer checks for overflow after each demotion; while the host holds less than its
    budget that check needs no ranks, so the copies are not waited for there."""
    engine = make_engine(heads=2, head_dim=8, device_budget=32, host_budget=10_000, page_size=4, recall_pages=4)
    g = torch.Generator().manual_seed(4)
    _fill(engine, g)
    _until_demotion(engine, g)
    assert engine.table.unsettled > 0 and engine.disk is None


def test_a_prefetch_failing_midway_drops_the_buffer_and_the_next_step_is_right(make_engine, monkeypatch):
    """The value copy of a prefetch fails after the key copy went in: the buffer no longer says what its slots
    hold, so it is let go; later steps rebuild it and attend exactly as the host path does."""
    from kvtier import native

    kw = dict(heads=2, head_dim=16, device_budget=48, recall_pages=4, page_size=4, prefetch_pages=4)
    host, dev = make_engine(**kw), make_engine(**kw)
    dev.device_recall = True
    g = torch.Generator().manual_seed(5)
    k = torch.randn(1, 2, 300, 16, generator=g)
    for e in (host, dev):
        e.write(k, k.flip(-1))
        e.commit()
    real, calls, failed = native.recall_pages, [0], []

    def flaky(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 2:    # the first prefetch's copy (after the step's own): the keys land, the values fail
            real(*args, **{k: v for k, v in kwargs.items() if k != "pair"})
            failed.append(True)
            raise RuntimeError("copy failed (injected)")
        return real(*args, **kwargs)

    import kvtier.engine.fetch as fetch
    monkeypatch.setattr(fetch.native, "recall_pages", flaky)
    for step in range(12):
        k = torch.randn(1, 2, 1, 16, generator=g)
        q = torch.randn(1, 4, 1, 16, generator=g)
        outs = []
        for e in (host, dev):
            e.write(k, k.flip(-1))
            try:
                outs.append(e.attend(q)[0])
            except RuntimeError:
                assert e is dev and step == 0 and e.recalled is None
                outs.append(None)
            e.commit()
        if outs[1] is not None:
            torch.testing.assert_close(outs[1], outs[0], rtol=1e-6, atol=1e-6)
    assert failed


def _copies_land_a_step_late(engine, monkeypatch):
    """Make the CPU's transfer manager report each step's copies as under way until the next step, as a GPU's
    would be; returns ``(waited, land)``: the jobs still under way that something waited for, and a function
    that lands every copy made so far."""
    t = engine.transfer
    issued, waited, landed = [0], [], [0]
    submit = t.submit

    def late_submit(dst, src):
        issued.append(submit(dst, src))
        return issued[-1]

    monkeypatch.setattr(t, "submit", late_submit)
    monkeypatch.setattr(t, "done", lambda job: job <= landed[0])
    monkeypatch.setattr(t, "wait", lambda jobs: waited.extend(j for j in jobs if j > landed[0]))

    def land():
        landed[0] = max(issued)

    return waited, land


@pytest.mark.parametrize("host_budget", [24, 40])
def test_a_host_over_its_budget_sends_landed_pages_down_without_waiting(make_engine, monkeypatch, host_budget):
    """Over its budget, the host sends pages to disk after a demotion; it picks them among the pages whose ranks
    are known, the lowest-ranked first, so the step waits for none of the copies it just queued, and the host
    still ends the step within its budget."""
    engine = make_engine(heads=2, head_dim=8, device_budget=16, host_budget=host_budget, page_size=4,
                         recall_pages=4)
    g = torch.Generator().manual_seed(5)
    _fill(engine, g, tokens=40)
    waited, land = _copies_land_a_step_late(engine, monkeypatch)
    moved_steps = 0
    for _ in range(60):
        land()                                     # the last step's copies are done by the next step
        k = _next_token(g, engine)
        engine.write(k, -k)
        on_host_before = engine.table.tier == HOST
        rank_before, known_before = engine.table.landed_rank()
        n = engine.table.n
        engine.commit()
        assert waited == []
        assert (engine.table.tokens(HOST) <= host_budget).all()
        went = on_host_before & (engine.table.tier[:, :n] != HOST)
        if went.any():
            moved_steps += 1
            assert engine.table.unsettled > 0      # the new pages were placed without waiting for their ranks
            for h in range(engine.heads):
                stayed = on_host_before[h] & ~went[h] & known_before
                assert known_before[went[h]].all()
                if went[h].any() and stayed.any():  # the lowest-ranked landed pages went
                    assert rank_before[h, went[h]].max() <= rank_before[h, stayed].min()
    assert moved_steps >= 3


def test_a_host_that_only_landing_pages_could_empty_waits_for_them(make_engine, monkeypatch):
    """When the pages already landed cannot bring the host within budget (a budget below one demotion's pages),
    the layer waits for the copies under way and picks among every host page: the budget holds either way."""
    engine = make_engine(heads=2, head_dim=8, device_budget=16, host_budget=0, page_size=4, recall_pages=4)
    g = torch.Generator().manual_seed(6)
    _fill(engine, g, tokens=40)
    waited, land = _copies_land_a_step_late(engine, monkeypatch)
    for _ in range(12):
        land()
        _until_demotion(engine, g)
        assert (engine.table.tokens(HOST) == 0).all()
    assert waited and engine.table.unsettled == 0


def test_demote_pages_by_default_and_as_set():
    """What a demotion moves at least: 4 pages in tier mode by default, at most an eighth of the budget (small
    budgets stay exact to the page); 1 in evict mode, where what leaves is lost; what is set, as set."""
    from kvtier.config import DEFAULT_DEMOTE_PAGES, ModelShape, TieredCacheConfig
    from kvtier.placement import Budget

    def cfg(**kw):
        return TieredCacheConfig(shape=ModelShape(1, 2, 8), device_budget=Budget(0.1, "device_budget"), **kw)

    assert DEFAULT_DEMOTE_PAGES == 4
    assert cfg().demotion_pages(819) == 4 and cfg().demotion_pages(8 * 16 * 3) == 3
    assert cfg().demotion_pages(100) == 1 and cfg(page_size=4).demotion_pages(100) == 3
    assert cfg(mode="evict").demotion_pages(819) == 1
    assert cfg(demote_pages=2).demotion_pages(10) == 2 and cfg(demote_pages=7, mode="evict").demotion_pages(9) == 7


@pytest.mark.parametrize("demote_pages", [1, 3])
def test_a_decoding_layer_demotes_once_every_demote_pages_pages_of_steps(make_engine, demote_pages):
    """Past its budget a decoding layer moves `demote_pages` pages at once, so it demotes once every that many
    pages of steps, and sits between its budget less that many pages and its budget."""
    P, budget = 4, 48
    engine = make_engine(heads=2, head_dim=8, device_budget=budget, page_size=P, recall_pages=4, sink_tokens=2,
                         recent_tokens=4, demote_pages=demote_pages)
    g = torch.Generator().manual_seed(5)
    _fill(engine, g, tokens=budget)
    demotions, counts = [], []
    for step in range(120):
        k = _next_token(g, engine)
        engine.write(k, -k)
        n = engine.table.n
        engine.commit()
        if engine.table.n > n:
            demotions.append((step, engine.table.n - n))
        counts.append(engine.pool.count)
    assert all(pages == demote_pages for _, pages in demotions)
    gaps = {b - a for (a, _), (b, _) in zip(demotions, demotions[1:])}
    assert gaps == {demote_pages * P}
    assert min(counts) == budget - demote_pages * P + 1 and max(counts) == budget
    assert engine.counters.demotions == len(demotions)
