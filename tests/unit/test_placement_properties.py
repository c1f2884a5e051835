"""Property-based: random writes, placements and recalls against a plain-Python model of where tokens live."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.placement import protected_count
from kvtier.placement.page_table import DISK, HOST


class HashScorer:
    """Deterministic scores with many ties, so tie-breaking is exercised."""

    name = "hash"

    def score(self, keys, values, positions, layer_idx):
        heads = torch.arange(keys.shape[1])[:, None]
        return (((positions[None, :] * 7919 + heads * 104729) % 13).float() / 13).unsqueeze(0)


def key_of(h, pos, dim):
    """The key written for head h at position pos (values are keys + 1000)."""
    g = torch.Generator().manual_seed(int(pos) * 31 + h)
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

    def step(self, new):  # new: per head [(pos, score)]
        cfg = self.cfg
        self.seen += len(new[0])
        budget = cfg.device_tokens(self.seen)
        n_prot = protected_count(self.seen, cfg.sink_tokens, cfg.recent_tokens)
        slack = max(0, min(cfg.page_size, budget - n_prot))
        first_page = self.next_page
        for h, head in enumerate(self.heads):
            head.device += new[h]
            if len(head.device) <= budget:
                continue
            def protected(e):
                return e[0] < cfg.sink_tokens or e[0] >= self.seen - cfg.recent_tokens
            target = max(budget - slack, n_prot)
            m = len(head.device) - target
            candidates = sorted((e for e in head.device if not protected(e)), key=lambda e: (e[1], e[0]))
            demoted = candidates[:m]
            head.device = sorted(set(head.device) - set(demoted))
            if cfg.mode == "evict":
                continue
            demoted.sort()  # pages are cut in position order
            for i in range(0, m, cfg.page_size):
                pid = first_page + i // cfg.page_size
                head.pages[pid], head.tier[pid] = demoted[i:i + cfg.page_size], "host"
                self.next_page = max(self.next_page, pid + 1)
            host_budget = cfg.host_tokens(self.seen)
            if host_budget is None:
                continue
            on_host = [p for p, t in head.tier.items() if t == "host"]
            held = sum(len(head.pages[p]) for p in on_host)
            if held <= host_budget:
                continue
            target = max(host_budget - min(cfg.page_size, host_budget), 0)
            for p in sorted(on_host, key=lambda p: (max(s for _, s in head.pages[p]), p)):
                if held <= target:
                    break
                head.tier[p] = "disk"
                held -= len(head.pages[p])


def _engine_view(engine, h):
    k, v, pos, _ = engine.pool.committed()
    device = sorted(pos[h].tolist())
    tiers = {"host": set(), "disk": set()}
    for p in range(engine.table.n):
        tier = engine.table.tier[h, p]
        if tier == HOST:
            got = engine.host.slot_positions(h, engine.table.slot[h, p])
        else:
            assert tier == DISK
            got = engine.disk.read(h, p, engine.table.crc[h, p])[2]
        tiers["host" if tier == HOST else "disk"] |= {(p, x) for x in got.tolist() if x >= 0}
    return device, tiers


settings_ = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@settings_
@given(
    chunks=st.lists(st.integers(1, 23), min_size=1, max_size=14),
    device_budget=st.one_of(st.integers(8, 40), st.floats(0.05, 1.0)),
    host_budget=st.one_of(st.none(), st.integers(0, 30), st.floats(0.0, 0.6)),
    page_size=st.integers(1, 6),
    sink=st.integers(0, 3), recent=st.integers(0, 5),
    mode=st.sampled_from(["tier", "evict"]),
    recall_pages=st.integers(0, 5),
    recall_after=st.lists(st.booleans(), min_size=14, max_size=14),
)
def test_engine_matches_reference(make_engine, chunks, device_budget, host_budget, page_size, sink, recent,
                                  mode, recall_pages, recall_after):
    if isinstance(device_budget, int) and device_budget < sink + recent:
        device_budget = sink + recent + 1
    if mode == "evict":
        host_budget = None
    heads, dim = 2, 4
    engine = make_engine(heads=heads, head_dim=dim, device_budget=device_budget, host_budget=host_budget,
                         mode=mode, recall_pages=recall_pages, page_size=page_size, sink_tokens=sink,
                         recent_tokens=recent, scorer=HashScorer())
    ref = Reference(engine.cfg, heads)
    seen = 0
    for step, q in enumerate(chunks):
        positions = list(range(seen, seen + q))
        k = torch.stack([torch.stack([key_of(h, p, dim) for p in positions]) for h in range(heads)])[None]
        returned_k, _ = engine.write(k, k + 1000)
        assert returned_k.shape[2] == engine.stored + q  # what attention reads: device entries + new
        scores = HashScorer().score(k, k, torch.tensor(positions), 0)[0]
        ref.step([[(p, float(s)) for p, s in zip(positions, scores[h].tolist())] for h in range(heads)])
        seen += q
        if recall_after[step]:
            rec = engine.recall(torch.randn(1, heads * 2, 1, dim))
            if rec is not None:  # recalled rows are the original entries of demoted pages
                for h in range(heads):
                    for row, x in zip(rec.k[h][rec.valid[h]], rec.v[h][rec.valid[h]]):
                        assert torch.equal(x, row + 1000)
                assert rec.page_ids.shape[1] == min(recall_pages, engine.table.n)
        engine.commit()
        budget = engine.cfg.device_tokens(seen)
        assert engine.pool.count <= budget, "device tier over budget"
        if host_budget is not None and mode == "tier":
            assert (engine.host.held_tokens() <= engine.cfg.host_tokens(seen)).all(), "host tier over budget"
        for h in range(heads):
            device, tiers = _engine_view(engine, h)
            assert device == sorted(p for p, _ in ref.heads[h].device)
            for tier in ("host", "disk"):
                expect = {(pid, p) for pid, entries in ref.heads[h].pages.items()
                          if ref.heads[h].tier[pid] == tier for p, _ in entries}
                assert tiers[tier] == expect, f"{tier} tier differs at step {step}, head {h}"
            # stored data is the data written for that position
            k_dev, v_dev, pos, _ = engine.pool.committed()
            for row, p in zip(k_dev[0, h], pos[h].tolist()):
                assert torch.equal(row, key_of(h, p, dim))
            if mode == "tier":
                assert len(device) + len(tiers["host"]) + len(tiers["disk"]) == seen
