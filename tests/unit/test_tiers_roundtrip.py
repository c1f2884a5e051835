"""Entries go device -> host -> disk and come back bit-exact; a damaged disk page is an error."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch

from kvtier import CorruptPageError
from kvtier.placement.page_table import DISK, HOST


def _feed(engine, tokens, dtype=torch.float32, seed=0, chunk=7):
    """Write `tokens` random entries in chunks (placing after each) and return all K and V."""
    g = torch.Generator().manual_seed(seed)
    H, D = engine.heads, engine.head_dim
    k_all = torch.randn(1, H, tokens, D, generator=g).to(dtype)
    v_all = torch.randn(1, H, tokens, D, generator=g).to(dtype)
    for start in range(0, tokens, chunk):
        engine.write(k_all[:, :, start:start + chunk], v_all[:, :, start:start + chunk])
        engine.commit()
    return k_all, v_all


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_every_tier_is_bit_exact(make_engine, watch_fetches, dtype):
    engine = make_engine(device_budget=16, host_budget=12, page_size=4, recall_pages=10_000)
    k_all, v_all = _feed(engine, 120, dtype)
    n, P = engine.table.n, engine.cfg.page_size
    tier = engine.table.tier
    assert (tier == DISK).any() and (tier == HOST).any()
    # device tier: stored rows equal the originals at their positions
    k, v = engine.pool.contiguous(engine.pool.count)
    pos, _ = engine.pool.meta()
    for h in range(engine.heads):
        assert torch.equal(k[0, h], k_all[0, h, pos[h]]) and torch.equal(v[0, h], v_all[0, h, pos[h]])
    # each tier's slot holds exactly the page the table says, and the tiers partition the positions seen
    for h in range(engine.heads):
        positions = []
        for p in range(n):
            t, slot = engine.table.lookup(np.array([h]), np.array([p]))
            store = engine.host if t[0] == HOST else engine.disk
            pk, pv = store.load(slot)
            at = torch.from_numpy(engine.table.positions(h, p).copy())
            assert len(at) == P and (at >= 0).all()  # every page below the device is full
            assert torch.equal(pk[0], k_all[0, h, at]) and torch.equal(pv[0], v_all[0, h, at])
            positions.append(at)
        everything = torch.cat([pos[h], *positions]).sort().values
        assert torch.equal(everything, torch.arange(120)), "a position is lost or held twice"
    # every demoted page comes back through recall (the budget covers all), bit-exact, from host and disk
    fetched = watch_fetches(engine)
    k_new = torch.randn(1, engine.heads, 1, engine.head_dim).to(dtype)
    engine.write(k_new, k_new)
    out, _ = engine.attend(torch.randn(1, engine.heads * 2, 1, engine.head_dim).to(dtype))
    assert out is not None and out.shape == (1, 1, engine.heads * 2, engine.head_dim)
    assert len(fetched) == 1
    ids, rk, rv = fetched[0]
    assert ids.shape == (engine.heads, n)
    P, D = engine.cfg.page_size, engine.head_dim
    for h in range(engine.heads):
        assert sorted(ids[h].tolist()) == list(range(n))
        at = torch.from_numpy(np.stack([engine.table.positions(h, int(p)) for p in ids[h]]))   # [n, P]
        expect = torch.cat([k_all[0, h, at], v_all[0, h, at]], dim=2)                          # [n, P, 2D]
        got = torch.cat([rk[h].view(n, P, D), rv[h].view(n, P, D)], dim=2)
        assert _same_pages(got, expect)
    assert engine.counters.pages_recalled["disk"] > 0 and engine.counters.pages_recalled["host"] > 0
    assert engine.counters.pages_recalled["disk"] + engine.counters.pages_recalled["host"] == engine.heads * n


def _same_pages(got, expect):
    """Whether ``got`` ``[r, P, ...]`` holds exactly the pages of ``expect``, each once, in any order (a head's
    recalled pages are a set: `_fetch` may order them as the tiers store them)."""
    left = list(range(expect.shape[0]))
    for page in got:
        match = next((i for i in left if torch.equal(page, expect[i])), None)
        if match is None:
            return False
        left.remove(match)
    return not left


def _first_disk_slot(engine):
    h, p = np.argwhere(engine.table.tier == DISK)[0]
    return int(engine.table.lookup(np.array([h]), np.array([p]))[1][0])


def _attend_all(engine):
    k = torch.randn(1, engine.heads, 1, engine.head_dim)
    engine.write(k, k)
    result = engine.attend(torch.randn(1, engine.heads * 2, 1, engine.head_dim))
    return None if result is None else result[0]


def test_corrupted_disk_page_is_detected(make_engine):
    engine = make_engine(device_budget=16, host_budget=8, recall_pages=10_000)
    _feed(engine, 80)
    slot = _first_disk_slot(engine)
    offset = slot * engine.disk.record_size + 5  # a byte inside the keys
    with open(engine.disk.path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))
    with pytest.raises(CorruptPageError, match=rf"checksum mismatch .* at slot {slot}\b"):
        _attend_all(engine)


def test_truncated_disk_file_is_detected(make_engine):
    engine = make_engine(device_budget=16, host_budget=8, recall_pages=10_000)
    _feed(engine, 80)
    os.truncate(engine.disk.path, engine.disk.record_size // 2)
    with pytest.raises(CorruptPageError, match="missing or truncated"):
        _attend_all(engine)


def test_misplaced_page_is_detected(make_engine):
    """A record that is intact but not the one written to that slot (another slot's page) is refused."""
    engine = make_engine(device_budget=16, host_budget=8, recall_pages=10_000)
    _feed(engine, 80)
    slots = engine.table.lookup(*engine.table.pages_in(DISK))[1]
    assert len(slots) >= 2
    a, b = int(slots[0]), int(slots[1])
    rs = engine.disk.record_size
    with open(engine.disk.path, "r+b") as f:
        f.seek(b * rs)
        record = f.read(rs)
        f.seek(a * rs)
        f.write(record)
    with pytest.raises(CorruptPageError, match=rf"slot {a}: expected"):
        _attend_all(engine)


def test_evict_mode_drops(make_engine):
    engine = make_engine(device_budget=16, mode="evict")
    _feed(engine, 100)
    # whole pages go; with 10 unprotected entries under the budget a page can always be found, so the
    # device never sits above its budget here
    assert engine.pool.count <= 16
    assert (100 - engine.pool.count) % engine.cfg.page_size == 0
    assert engine.table.n == 0 and engine.host is None and engine.disk is None
    assert engine.counters.tokens_dropped == engine.heads * (100 - engine.pool.count)
    assert _attend_all(engine) is None


def test_close_frees_pages_and_closing_the_cache_removes_files(make_engine):
    engine = make_engine(device_budget=16, host_budget=0)
    _feed(engine, 60)
    disk, path, folder = engine.disk, engine.disk.path, engine.shared.private_path
    assert os.path.exists(path) and disk.pages() > 0
    engine.close()
    assert disk.pages() == 0  # the layer gave its slots back to the cache's shared store
    engine.shared.close()
    assert not os.path.exists(path) and not os.path.exists(folder)


def _decode_with_few_recall_pages(engine, watch_fetches, total=1200, prefill=600):
    """Prefill, then decode one token at a time with queries near stored keys (recall keeps coming back to
    the same region); check that every recalled page is exactly the page the table names."""
    g = torch.Generator().manual_seed(9)
    k_all = torch.randn(1, engine.heads, total, engine.head_dim, generator=g)
    v_all = torch.randn(1, engine.heads, total, engine.head_dim, generator=g)
    fetched = watch_fetches(engine)
    engine.write(k_all[:, :, :prefill], v_all[:, :, :prefill])
    engine.commit()
    P, D = engine.cfg.page_size, engine.head_dim
    for t in range(prefill, total):
        engine.write(k_all[:, :, t:t + 1], v_all[:, :, t:t + 1])
        near = k_all[0, :, (t * 7) % prefill].repeat_interleave(2, dim=0)[None, :, None] * 3
        fetched.clear()
        engine.attend(near + 0.1 * torch.randn(1, engine.heads * 2, 1, D, generator=g))
        engine.commit()
        ids, rk, rv = fetched[0]
        for h in range(engine.heads):
            at = torch.from_numpy(np.stack([engine.table.positions(h, int(p)) for p in ids[h]]))
            expect = torch.cat([k_all[0, h, at], v_all[0, h, at]], dim=2)
            got = torch.cat([rk[h].view(-1, P, D), rv[h].view(-1, P, D)], dim=2)
            assert _same_pages(got, expect), f"step {t}, head {h}"


def test_recall_through_the_read_ahead_cache_is_bit_exact(make_engine, watch_fetches):
    engine = make_engine(heads=2, head_dim=8, device_budget=32, host_budget=64, page_size=4, recall_pages=3)
    _decode_with_few_recall_pages(engine, watch_fetches)
    ra = engine.readahead
    assert ra is not None and ra.hits > 0 and ra.pages() <= ra.capacity
    assert engine.counters.pages_recalled["disk"] > 0


def test_read_ahead_goes_on_in_a_steady_decode(make_engine, watch_fetches):
    """The ring is small (about half a step's recall here); every step reads ahead short-listed disk pages
    that were not taken, replacing the oldest, and never holds more than its capacity (``read_ahead=True``:
    never paused, though the temporary folder's disk answers from memory)."""
    engine = make_engine(heads=2, head_dim=8, device_budget=32, host_budget=64, page_size=4, recall_pages=3,
                         read_ahead=True)
    _decode_with_few_recall_pages(engine, watch_fetches)
    ra = engine.readahead
    assert not ra.adaptive and ra.steps_paused == 0
    assert ra.read_ahead > ra.capacity * 50, "reading ahead stopped once the ring was full"
    assert 0 < ra.pages() <= ra.capacity and ra.hits > 0


def test_read_ahead_off_gives_the_host_tier_its_whole_budget(make_engine, watch_fetches):
    """``read_ahead=False``: no ring, every disk page read on demand (bit-exact, as checked step by step), and
    the host tier holds the whole host budget where the ring would have taken a share of it."""
    from kvtier.placement.page_table import HOST

    held = {}
    for setting in (None, False):
        engine = make_engine(heads=2, head_dim=8, device_budget=32, host_budget=64, page_size=4, recall_pages=3,
                             read_ahead=setting)
        _decode_with_few_recall_pages(engine, watch_fetches, total=700)
        assert engine.counters.pages_recalled["disk"] > 0
        held[setting] = (engine.table.tier == HOST).sum(axis=1) * engine.cfg.page_size
        budget = engine.cfg.host_tokens(engine.seen)
        ring = engine._readahead_pages() * engine.cfg.page_size   # the host room set aside for the ring
        if setting is False:
            assert engine.readahead is None and ring == 0
        else:
            assert ring > 0 and engine.readahead.capacity == engine.heads * ring // engine.cfg.page_size
        assert (held[setting] <= budget - ring).all()
    assert (held[False] > held[None]).all()


def test_the_host_sets_aside_what_the_ring_holds(make_engine):
    """The ring is sized when the layer first spills to disk. As a fractional host budget grows, the host
    tier sets aside exactly the ring's pages, not what a ring made now would take, and fills the rest."""
    from kvtier.placement.page_table import HOST

    engine = make_engine(heads=2, head_dim=8, device_budget=0.1, host_budget=0.25, page_size=4, recall_pages=16)
    g = torch.Generator().manual_seed(4)
    for _ in range(10):
        k = torch.randn(1, 2, 200, 8, generator=g)
        engine.write(k, torch.randn(1, 2, 200, 8, generator=g))
        engine.commit()
        if engine.readahead is not None and engine.seen == 200:
            made = engine.readahead.capacity // engine.heads
    P = engine.cfg.page_size
    assert made == engine.cfg.read_ahead_pages(200) == 3   # a quarter of the host budget of 50 tokens a head
    assert engine.cfg.read_ahead_pages(engine.seen) == 8 and engine._readahead_pages() == made
    target = engine.cfg.host_tokens(engine.seen) - made * P
    held = (engine.table.tier == HOST).sum(axis=1) * P
    assert ((held > target - P) & (held <= target)).all(), (held, target)


def _steps_with_read_ahead(ra, slots, steps, use):
    """`steps` steps: each offers two new slots to read ahead, then loads one page read ahead (if `use`)
    and one not; returns the steps whose candidates were asked for. Each step ends with its reads ahead done,
    as a decode step's model work would give them time to be: the steps here take microseconds, and reads still
    under way when the next step offers would leave it nothing to read (a window with nothing to judge)."""
    asked = []
    for t in range(steps):
        ahead = slots[2 * t % len(slots):2 * t % len(slots) + 2]
        ra.offer(lambda: (asked.append(t), ahead)[1])
        wanted = [ahead[0]] if use else []
        ra.load(np.array(wanted + [slots[(2 * t + 7) % len(slots)]]))
        ra.settle()
    return asked


@pytest.fixture
def pages_on_disk(tmp_path):
    """A disk store of ``[4, 8]`` float32 pages holding 40 random ones (values = keys): ``(disk, k, slots)``."""
    from kvtier.tiers.disk import DiskStore

    disk = DiskStore(str(tmp_path), 4, 8, torch.float32)
    k = torch.randn(40, 4, 8)
    yield disk, k, disk.store(k, k)
    disk.close()


def test_read_ahead_pauses_where_it_does_not_pay(pages_on_disk, monkeypatch):
    """Reading ahead is judged every `WINDOW` steps: it goes on where the hits save more than it costs (a
    slow disk), and pauses for `PAUSE` steps, then tries again, where nothing it read was used; each pause
    after another loss is twice as long, up to `MAX_PAUSE`."""
    from kvtier.tiers.readahead import DiskReadAhead

    monkeypatch.setattr(DiskReadAhead, "WINDOW", 4)
    monkeypatch.setattr(DiskReadAhead, "PAUSE", 6)
    monkeypatch.setattr(DiskReadAhead, "MAX_PAUSE", 12)
    disk, _, slots = pages_on_disk
    slow = DiskReadAhead(disk, 8, 4, 8, torch.float32, pin=False)
    load = disk.load

    def slow_load(*args, **kwargs):   # a cold disk: each read on demand waits for the device
        time.sleep(0.02)
        return load(*args, **kwargs)

    monkeypatch.setattr(disk, "load", slow_load)
    assert len(_steps_with_read_ahead(slow, slots, 12, use=True)) == 12
    assert slow.steps_paused == 0 and slow.hits == 12
    slow.close()
    monkeypatch.setattr(disk, "load", load)
    idle = DiskReadAhead(disk, 8, 4, 8, torch.float32, pin=False)
    asked = _steps_with_read_ahead(idle, slots, 16, use=False)
    # steps 0-3 judged (no hit: a loss), 4-9 paused, 10-13 judged again, then paused twice as long
    assert asked == [0, 1, 2, 3, 10, 11, 12, 13] and idle.steps_paused == 8
    # pages other than those the ring still holds from the steps above (a page it holds, asked for on demand,
    # would be a hit, and one hit can make a window pay, by timing)
    assert _steps_with_read_ahead(idle, np.roll(slots, 8), 16, use=False) == [10, 11, 12, 13]
    assert idle.hits == 0
    idle.close()


def test_read_ahead_is_not_judged_without_evidence(pages_on_disk, monkeypatch):
    """A window with nothing on disk to read ahead, or before any demand read was timed, is no loss: reading
    ahead goes on (a perfect read ahead, every page a hit, is never paused); a read that cannot be queued leaves
    its ring positions free for later ones."""
    from kvtier.tiers.readahead import DiskReadAhead

    monkeypatch.setattr(DiskReadAhead, "WINDOW", 4)
    disk, k, slots = pages_on_disk
    ra = DiskReadAhead(disk, 8, 4, 8, torch.float32, pin=False)
    for _ in range(20):
        ra.offer(lambda: np.empty(0, np.int64))
    assert ra.steps_paused == 0 and ra.read_ahead == 0
    for t in range(20):   # every page wanted was read ahead: no demand read to price a hit against
        ahead = slots[2 * t:2 * t + 2]
        ra.offer(lambda: ahead)
        ra.load(ahead)
    assert ra.steps_paused == 0 and ra.misses == 0 and ra.hits == 40
    monkeypatch.setattr(disk, "load_async", lambda *a, **kw: (_ for _ in ()).throw(RuntimeError("no I/O")))
    with pytest.raises(RuntimeError, match="no I/O"):
        ra.prefetch(slots[[0, 1]])
    monkeypatch.undo()
    ra.prefetch(slots[[0, 1]])   # not taken for pages on their way
    got = ra.load(slots[[0, 1]])
    assert ra.hits == 42 and torch.equal(got[0], k[[0, 1]])
    ra.close()


def test_read_ahead_ring_serves_verified_pages(tmp_path):
    """The ring on its own: pages read ahead are served from memory, bit-exact, in the order asked and into
    the rows given; at most half the ring is read a call; demand reads are not kept; newer reads replace the
    oldest; forgotten slots are read again; a page that fails its check is an error, not a wrong page."""
    from kvtier.errors import CorruptPageError
    from kvtier.tiers.disk import DiskStore
    from kvtier.tiers.readahead import DiskReadAhead

    disk = DiskStore(str(tmp_path), 4, 8, torch.float32)
    try:
        g = torch.Generator().manual_seed(10)
        k, v = torch.randn(20, 4, 8, generator=g), torch.randn(20, 4, 8, generator=g)
        slots = disk.store(k, v)
        ra = DiskReadAhead(disk, 8, 4, 8, torch.float32, pin=False)
        ra.prefetch(slots[[3, 5, 3, 7, 9, 11, 13]])
        assert ra.read_ahead == 4          # at most half the ring a call, each page once, best first
        ra.prefetch(slots[[3, 5]])         # held or on their way: nothing to read
        assert ra.read_ahead == 4
        out = torch.full((2, 4, 8), float("nan")), torch.full((2, 4, 8), float("nan"))
        got = ra.load(slots[[9, 3]], out=out)
        assert got[0] is out[0] and torch.equal(out[0], k[[9, 3]]) and torch.equal(out[1], v[[9, 3]])
        assert (ra.hits, ra.misses, ra.pages()) == (2, 0, 4)
        got = ra.load(slots[[0, 5, 1]])    # a mix: 5 from the ring, 0 and 1 from the disk, not kept
        assert torch.equal(got[0], k[[0, 5, 1]]) and torch.equal(got[1], v[[0, 5, 1]])
        assert (ra.hits, ra.misses, ra.pages()) == (3, 2, 4)
        ra.prefetch(slots[[0, 1, 2, 4]])
        ra.load(slots[[2]])                # waits for that read
        ra.prefetch(slots[[6, 8, 10, 12]])   # the ring is full: these replace the oldest (3, 5, 7, 9)
        ra.load(slots[[6]])
        assert ra.pages() == 8 and ra.read_ahead == 12
        hits, misses = ra.hits, ra.misses
        got = ra.load(slots[[12, 3, 0]])
        assert (ra.hits, ra.misses) == (hits + 2, misses + 1)
        assert torch.equal(got[0], k[[12, 3, 0]]) and torch.equal(got[1], v[[12, 3, 0]])
        ra.forget(slots[[12]])
        assert ra.pages() == 7
        got = ra.load(slots[[12, 10]])
        assert (ra.hits, ra.misses) == (hits + 3, misses + 2) and torch.equal(got[0], k[[12, 10]])
        # a record changed on disk after it was written: neither the read ahead nor the demand read serve it
        rs = disk.record_size
        with open(disk.path, "r+b") as f:
            f.seek(int(slots[15]) * rs + 5)
            f.write(b"\xff\xff")
        ra.prefetch(slots[[15]])
        with pytest.raises(CorruptPageError, match="checksum"):
            ra.load(slots[[15]])
        assert int(slots[15]) not in ra._where
        ra.close()
        assert ra.reserved_bytes() == 0 and ra.pages() == 0
    finally:
        disk.close()
