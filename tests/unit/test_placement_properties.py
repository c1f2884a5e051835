"""Property-based: random writes, placements and recalls against a plain-Python model of where tokens live.

The rule modelled: per head, when the device holds more than its budget, ceil(over / page_size) whole pages
of the lowest-scored unprotected entries (older first among ties) are demoted, or the config's
`demotion_pages` if more, but only as many pages as the unprotected entries fill; the demoted entries are cut into pages in position order. After a demotion,
when the host holds more than its budget minus the read-ahead pages, its lowest-ranked pages (rank = best
score in the page, older page first among ties) go to disk until it fits. (Here every copy lands at once; where
the last demotion's copies are still under way its pages are spared, see test_demotion.py.) The reference
knows nothing of `promote` (disk pages recall brings up kept on the host): with it, the device tier must still
match, the host and disk tiers together hold the reference's pages, the host stays within its budget, and every
disk record is a disk page or a host page's clean copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvtier.placement.page_table import DISK, HOST


class HashScorer:
    """Deterministic scores with many ties, so tie-breaking is exercised."""

    name = "hash"

    def score(self, keys, values, positions, layer_idx):
        heads = torch.arange(keys.shape[1])[:, None]
        return (((positions[None, :] * 7919 + heads * 104729) % 13).float() / 13).unsqueeze(0)


def key_of(h, pos, dim):
    """The key written for head h at position pos."""
    g = torch.Generator().manual_seed(int(pos) * 31 + h)
    return torch.randn(dim, generator=g)


def value_of(h, pos, dim):
    """The value written for head h at position pos (independent of the key)."""
    g = torch.Generator().manual_seed(int(pos) * 31 + h + 7_000_000)
    return torch.randn(dim, generator=g)


@dataclass
class RefHead:
    """One KV head: positions with scores on the device, pages on the host and on disk."""

    device: list = field(default_factory=list)          # [(pos, score)]
    pages: dict = field(default_factory=dict)           # page id -> [(pos, score)]
    tier: dict = field(default_factory=dict)            # page id -> "host" | "disk"


class Reference:
    def __init__(self, cfg, heads):
        self.cfg, self.heads, self.seen = cfg, [RefHead() for _ in range(heads)], 0
        self.next_page = 0
        self.ring = None   # the read-ahead ring's pages per head, once made

    def readahead_pages(self):
        """Host pages per head set aside for the read-ahead ring: its size once the first spill made it."""
        if self.ring is not None:
            return self.ring
        host = self.cfg.host_tokens(max(self.seen, 1))
        return 0 if host is None else min(self.cfg.recall_pages // 2, host // (4 * self.cfg.page_size))

    def step(self, new):  # new: per head [(pos, score)]
        cfg, P = self.cfg, self.cfg.page_size
        self.seen += len(new[0])
        budget = cfg.device_tokens(self.seen)
        first_page = self.next_page
        for h, head in enumerate(self.heads):
            head.device += new[h]
            n = len(head.device)
            if n <= budget:
                continue

            def protected(e):
                return e[0] < cfg.sink_tokens or e[0] >= self.seen - cfg.recent_tokens

            candidates = sorted((e for e in head.device if not protected(e)), key=lambda e: (e[1], e[0]))
            pages = min(max(-(-(n - budget) // P), cfg.demotion_pages(budget)), len(candidates) // P)
            if pages <= 0:
                continue
            demoted = candidates[:pages * P]
            head.device = sorted(set(head.device) - set(demoted))
            if cfg.mode == "evict":
                continue
            demoted.sort()  # pages are cut in position order
            for i in range(pages):
                pid = first_page + i
                head.pages[pid], head.tier[pid] = demoted[i * P:(i + 1) * P], "host"
                self.next_page = max(self.next_page, pid + 1)
            host_budget = cfg.host_tokens(self.seen)
            if host_budget is None:
                continue
            ring = self.readahead_pages()
            target = max(0, host_budget - ring * P)
            on_host = [p for p, t in head.tier.items() if t == "host"]
            held = sum(len(head.pages[p]) for p in on_host)
            for p in sorted(on_host, key=lambda p: (max(s for _, s in head.pages[p]), p)):
                if held <= target:
                    break
                head.tier[p] = "disk"
                held -= len(head.pages[p])
                self.ring = ring   # the first spill makes the ring, sized as set aside for it


def _engine_view(engine, h):
    """Device positions and ``{(page id, position)}`` per tier of head `h`, checking the stored data too."""
    dim, P = engine.head_dim, engine.cfg.page_size
    k_dev, v_dev = engine.pool.contiguous(engine.pool.count)
    pos, _ = engine.pool.meta()
    for row_k, row_v, p in zip(k_dev[0, h], v_dev[0, h], pos[h].tolist()):
        assert torch.equal(row_k, key_of(h, p, dim)) and torch.equal(row_v, value_of(h, p, dim))
    tiers = {"host": set(), "disk": set()}
    for p in range(engine.table.n):
        tier, slot = engine.table.lookup(np.array([h]), np.array([p]))
        assert tier[0] in (HOST, DISK)
        got = engine.table.positions(h, p).tolist()
        assert len(got) == P and min(got) >= 0, "a page below the device is not full"
        store = engine.host if tier[0] == HOST else engine.disk
        pk, pv = store.load(slot)
        for row_k, row_v, x in zip(pk[0], pv[0], got):
            assert torch.equal(row_k, key_of(h, x, dim)) and torch.equal(row_v, value_of(h, x, dim))
        tiers["host" if tier[0] == HOST else "disk"] |= {(p, x) for x in got}
    return sorted(pos[h].tolist()), tiers


def _exact_attention(ref, query, positions, heads, dim, scale):
    """Softmax over every entry seen (device, host and disk in the reference before this step, plus the step's
    new ones), causal by position."""
    group = query.shape[1] // heads
    out = torch.empty(1, len(positions), query.shape[1], dim, dtype=torch.float64)
    for h in range(heads):
        held = sorted([p for p, _ in ref.heads[h].device] + list(positions) +
                      [p for entries in ref.heads[h].pages.values() for p, _ in entries])
        assert held == list(range(positions[-1] + 1))  # the reference lost nothing
        ks = torch.stack([key_of(h, p, dim) for p in held]).double()
        vs = torch.stack([value_of(h, p, dim) for p in held]).double()
        future = torch.tensor(held)[None, :] > torch.tensor(positions)[:, None]
        for j in range(h * group, (h + 1) * group):
            logits = (query[0, j].double() @ ks.T * scale).masked_fill(future, float("-inf"))
            out[0, :, j] = torch.softmax(logits, dim=-1) @ vs
    return out


settings_ = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@settings_
@given(
    chunks=st.lists(st.integers(1, 23), min_size=1, max_size=14),
    device_budget=st.one_of(st.integers(8, 40), st.floats(0.05, 1.0)),
    host_budget=st.one_of(st.none(), st.integers(0, 30), st.floats(0.0, 0.6)),
    page_size=st.integers(1, 6),
    sink=st.integers(0, 3), recent=st.integers(0, 5),
    mode=st.sampled_from(["tier", "evict"]),
    recall_pages=st.one_of(st.integers(0, 5), st.just(10_000)),
    recall_after=st.lists(st.booleans(), min_size=14, max_size=14),
    demote_pages=st.one_of(st.none(), st.integers(1, 4)),
    promote=st.booleans(),
)
@example(chunks=[23, 1, 9, 23, 2, 2, 2, 2, 17, 23, 1, 1, 5, 23], device_budget=16, host_budget=20, page_size=4,
         sink=2, recent=3, mode="tier", recall_pages=10_000, recall_after=[True] * 14, demote_pages=None, promote=False)
@example(chunks=[5, 23, 7, 1, 1, 1, 1, 1, 23, 3, 11, 1, 1, 23], device_budget=0.3, host_budget=0.25, page_size=3,
         sink=1, recent=5, mode="tier", recall_pages=2, recall_after=[True, False] * 7, demote_pages=None,
         promote=False)
@example(chunks=[1, 1, 1, 1, 1], device_budget=0.5, host_budget=None, page_size=1, sink=0, recent=0, mode="tier",
         recall_pages=10_000, recall_after=[False] * 4 + [True] * 10, demote_pages=None, promote=False)
@example(chunks=[23, 23, 4, 1, 1, 1], device_budget=10, host_budget=None, page_size=5, sink=3, recent=5,
         mode="evict", recall_pages=3, recall_after=[True] * 14, demote_pages=None, promote=False)
@example(chunks=[5, 23, 7, 1, 1, 1, 1, 1, 23, 3, 11, 1, 1, 23], device_budget=0.3, host_budget=0.25, page_size=1,
         sink=1, recent=5, mode="tier", recall_pages=3, recall_after=[True] * 14, demote_pages=None, promote=True)
def test_engine_matches_reference(make_engine, chunks, device_budget, host_budget, page_size, sink, recent,
                                  mode, recall_pages, recall_after, demote_pages, promote, watch_fetches):
    if isinstance(device_budget, int) and device_budget < sink + recent:
        device_budget = sink + recent + 1
    if mode == "evict":
        host_budget = None
    heads, dim = 2, 4
    engine = make_engine(heads=heads, head_dim=dim, device_budget=device_budget, host_budget=host_budget,
                         mode=mode, recall_pages=recall_pages, page_size=page_size, sink_tokens=sink,
                         recent_tokens=recent, scorer=HashScorer(), demote_pages=demote_pages, promote=promote)
    engine.promote_every = 1   # a round every recall, so that short runs move pages up and down
    fetched = watch_fetches(engine)
    ref = Reference(engine.cfg, heads)
    seen = 0
    for step, q in enumerate(chunks):
        positions = list(range(seen, seen + q))
        k = torch.stack([torch.stack([key_of(h, p, dim) for p in positions]) for h in range(heads)])[None]
        v = torch.stack([torch.stack([value_of(h, p, dim) for p in positions]) for h in range(heads)])[None]
        returned_k, _ = engine.write(k, v)
        assert returned_k.shape[2] == engine.stored + q  # what attention reads: device entries + new
        if recall_after[step]:
            query = torch.randn(1, heads * 2, q, dim)
            fetched.clear()
            result = engine.attend(query)
            out = None if result is None else result[0]
            if mode == "evict" or recall_pages == 0 or engine.table.n == 0:
                assert out is None and not fetched
            else:
                assert out is not None and out.shape == (1, q, heads * 2, dim)
                assert len(fetched) == -(-q // 128)
                for ids, rk, rv in fetched:  # recalled rows are the original entries of demoted pages
                    assert ids.shape == (heads, min(recall_pages, engine.table.n))
                    for h in range(heads):  # a head's pages come as a set, in any order
                        assert len(set(ids[h].tolist())) == ids.shape[1]
                        expect = sorted(torch.cat([torch.stack([key_of(h, x, dim), value_of(h, x, dim)])
                                                   for x in engine.table.positions(h, pid).tolist()]).tolist()
                                        for pid in ids[h].tolist())
                        got = torch.cat([rk[h].view(-1, page_size, 1, dim), rv[h].view(-1, page_size, 1, dim)], 2)
                        assert sorted(page.reshape(-1, dim).tolist() for page in got) == expect
                if recall_pages >= engine.table.n:  # every page recalled: exact attention over all entries
                    exact = _exact_attention(ref, query, positions, heads, dim, dim ** -0.5)
                    torch.testing.assert_close(out.double(), exact, rtol=1e-5, atol=1e-5)
        scores = HashScorer().score(k, k, torch.tensor(positions), 0)[0]
        ref.step([[(p, float(s)) for p, s in zip(positions, scores[h].tolist())] for h in range(heads)])
        seen += q
        engine.commit()
        budget = engine.cfg.device_tokens(seen)
        assert engine.pool.count <= budget + page_size - 1, "device tier over budget by a page or more"
        if host_budget is not None and mode == "tier":
            held = engine.table.tokens(HOST)
            assert (held <= engine.cfg.host_tokens(seen)).all(), "host tier over budget"
            readahead = 0 if engine.readahead is None else engine.readahead.capacity
            assert held.sum() + readahead * page_size <= heads * engine.cfg.host_tokens(seen), \
                "host pages plus the read-ahead cache exceed the host budget"
        for h in range(heads):
            device, tiers = _engine_view(engine, h)
            assert device == sorted(p for p, _ in ref.heads[h].device), f"device differs at step {step}, head {h}"
            for tier in ("host", "disk"):
                expect = {(pid, p) for pid, entries in ref.heads[h].pages.items()
                          if ref.heads[h].tier[pid] == tier for p, _ in entries}
                if not promote:   # with it, where pages lie below the device is the host's own choice
                    assert tiers[tier] == expect, f"{tier} tier differs at step {step}, head {h}"
            if promote:   # both tiers together hold exactly the reference's pages, each once
                below = {(pid, p) for pid, entries in ref.heads[h].pages.items() for p, _ in entries}
                assert tiers["host"] | tiers["disk"] == below and not tiers["host"] & tiers["disk"]
            if mode == "tier":
                assert len(device) + len(tiers["host"]) + len(tiers["disk"]) == seen
        if engine.disk is not None:   # every disk record is a disk page or a host page's clean copy, and no more
            copies = engine.table.copy_slot
            assert engine.disk.pages() == engine.table.pages(DISK) + int((copies >= 0).sum())
            assert (engine.table.tier[copies >= 0] == HOST).all()
