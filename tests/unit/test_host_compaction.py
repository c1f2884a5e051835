"""The host pool gives back the slabs that a prompt's demotion grew on its way to disk: the pages left on the host
move into the lowest free slots, and decoding goes on bit for bit as a twin's whose pool kept every slab."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtier import TieredCache, cache_kwargs
from kvtier.engine import LayerEngine
from kvtier.placement.page_table import HOST

PAGE_BYTES = 16 * 16 * 4   # 16 entries of head size 16, float32: the tiny Llama's pages
SLAB_PAGES = 8


def _cache(model, tmp_path, gpu_path: bool) -> TieredCache:
    cache = TieredCache(model.config, device_budget=32, host_budget=48, recall_pages=4, scorer="keynorm",
                        disk_dir=tmp_path)
    for engine in cache._engines:
        engine.host_slab_bytes = SLAB_PAGES * PAGE_BYTES
    return cache.take_gpu_path() if gpu_path else cache


@pytest.mark.parametrize("gpu_path", [False, True], ids=["cpu-path", "gpu-path"])
@torch.no_grad()
def test_the_slabs_a_prompt_grew_go_back_and_the_bits_stay(model, tmp_path, monkeypatch, gpu_path):
    real = LayerEngine._compact_host
    kept: set[int] = set()   # the twin's engines, whose pools keep every slab
    monkeypatch.setattr(LayerEngine, "_compact_host", lambda self: None if id(self) in kept else real(self))
    compacting, twin = _cache(model, tmp_path / "a", gpu_path), _cache(model, tmp_path / "b", gpu_path)
    kept.update(id(e) for e in twin._engines)
    prompt = torch.randint(0, 128, (1, 400), generator=torch.Generator().manual_seed(5))
    outs = [model(prompt, **cache_kwargs(c)).logits for c in (compacting, twin)]
    assert torch.equal(outs[0], outs[1])
    for engine, other in zip(compacting._engines, twin._engines):
        pages = engine.host.pages()
        assert pages == other.host.pages() > 0 and engine.table.pages(HOST) == pages
        need = max(1, -(-(pages + SLAB_PAGES // 2) // SLAB_PAGES))
        assert len(engine.host.k.slabs) == need < len(other.host.k.slabs)   # the prompt's slabs went back
        slots = engine.table.lookup(*engine.table.pages_in(HOST))[1]
        assert slots.max() < need * SLAB_PAGES and len(np.unique(slots)) == pages
    grown = compacting.stats()["host"]["reserved_bytes"]
    assert grown < twin.stats()["host"]["reserved_bytes"]
    for _ in range(40):   # decoding: demotions, spills to disk, recalls from both tiers
        token = outs[0][:, -1:].argmax(-1)
        outs = [model(token, **cache_kwargs(c)).logits for c in (compacting, twin)]
        assert torch.equal(outs[0], outs[1])
    mine, theirs = compacting.stats(), twin.stats()
    assert mine["pages_recalled_from"] == theirs["pages_recalled_from"] and mine["pages_recalled_from"]["disk"] > 0
    assert mine["host"]["tokens"] == theirs["host"]["tokens"] and mine["disk"]["tokens"] == theirs["disk"]["tokens"]
    assert mine["host"]["reserved_bytes"] <= grown   # decoding's demotions took no slab back
    for cache in (compacting, twin):
        cache.close()


def test_no_memory_for_the_move_leaves_the_pool_as_it_was(model, tmp_path, monkeypatch):
    """The pages' copy cannot be made (torch's CPU allocator error): the pool keeps its slabs and the step goes on,
    with the same bits as a twin's."""
    from kvtier.tiers.host import HostPool
    from kvtier.tiers.slabs import SlabRows

    moving, gather, compact = [], SlabRows.gather, HostPool.compact

    def refused(self, *args, **kwargs):
        if moving:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8192 bytes")
        return gather(self, *args, **kwargs)

    def watched(self):
        moving.append(1)
        try:
            return compact(self)
        finally:
            moving.pop()

    caches = [_cache(model, tmp_path / name, False) for name in "ab"]
    prompt = torch.randint(0, 128, (1, 400), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        monkeypatch.setattr(SlabRows, "gather", refused)
        monkeypatch.setattr(HostPool, "compact", watched)
        first = model(prompt, **cache_kwargs(caches[0])).logits
        monkeypatch.undo()
        assert torch.equal(first, model(prompt, **cache_kwargs(caches[1])).logits)
        for a, b in zip(caches[0]._engines, caches[1]._engines):
            assert len(a.host.k.slabs) > len(b.host.k.slabs) and a.host.pages() == b.host.pages()
        tokens = [[], []]
        for i, cache in enumerate(caches):
            logits = first
            for _ in range(10):
                token = logits[:, -1:].argmax(-1)
                tokens[i].append(int(token))
                logits = model(token, **cache_kwargs(cache)).logits
            tokens[i].append(logits)
    assert tokens[0][:-1] == tokens[1][:-1] and torch.equal(tokens[0][-1], tokens[1][-1])
    for cache in caches:
        cache.close()
