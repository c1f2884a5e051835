"""A decode step's launches do not grow with the number of slabs the device pool spans.

The device pool grows slab by slab (`SLAB_TOKENS` entries each): a 128K context at 10% spans four slabs, a
million tokens twenty-five. Every per-slab loop of torch ops in a step or a demotion is a run of launches
that grows with the context, each costing the host on a GPU. This test decodes the same prompt with one slab
and with many, on the GPU's path as `kvtier bench launches` counts it, and holds that the launches are the
same op for op (the native operations counted once each: one launch over every slab), except the two
concatenations a demotion makes of the pool's positions and scores to rank them, and the generated tokens are
the same.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import torch

import kvtier.engine.layer as layer
from kvtier import TieredCache
from kvtier.bench.launches import count_launches

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from tiny_models import random_ids, random_kvp, small_llama  # noqa: E402


def test_launches_of_decode_steps_and_demotions_do_not_grow_with_slabs(monkeypatch):
    model = small_llama()   # the launches counted are the cache's own: a small model of the default one's heads
    ids = random_ids(model, 700)

    def tiered():
        cache = TieredCache(model.config, device_budget=0.1, recall_pages=16, scorer=random_kvp(model))
        return cache.take_gpu_path()   # the GPU's path, as `kvtier bench launches` counts it

    runs = {}
    for slab in (4096, 16):   # one slab, then about five
        monkeypatch.setattr(layer, "SLAB_TOKENS", slab)
        runs[slab] = count_launches(model, ids, tiered, f"{slab}", steps=16)
    (one, tokens), (many, many_tokens) = runs[4096], runs[16]
    assert torch.equal(tokens, many_tokens)
    assert many.native_calls == one.native_calls
    demotions = many.native_calls["move_entries"] // 4   # one launch per kind of slab: keys, values, positions,
    assert demotions >= len(model.model.layers)          # scores; every layer demoted in the 16 steps
    # each demotion, counted where it happens: the entries packed (keys, values), the pool's holes filled (four
    # kinds) and the pages indexed, one native launch each
    assert one.demotion["demotions"] == many.demotion["demotions"] == demotions
    assert one.demotion["native"] == many.demotion["native"] == 7 * demotions
    differ = Counter(many.ops)
    differ.subtract(one.ops)
    differ = +differ | Counter({op: -n for op, n in differ.items() if n < 0})
    # the pool's positions and scores as one tensor each, to rank them (`DevicePool.meta`), at a demotion only
    assert differ.pop("cat", 0) == 2 * demotions
    # where the decode step's entry goes moves on one fewer times: it starts again at each new slab
    assert differ.pop("add_", 0) < 2 * demotions
    assert not differ, f"launches that grew with the pool's slabs: {dict(differ)}"
