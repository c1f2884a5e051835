"""Every tier below the device through the same checks: the `Tier` protocol the engine relies on."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtier.tiers.base import Tier
from kvtier.tiers.disk import DiskStore
from kvtier.tiers.host import HostPool

P, D = 4, 8


@pytest.fixture(params=["host", "disk"])
def tier(request, tmp_path):
    made = HostPool(P, D, torch.bfloat16, pin=False, slab_bytes=3 * P * D * 2) if request.param == "host" \
        else DiskStore(str(tmp_path), P, D, torch.bfloat16)
    yield made
    made.close()


def test_a_tier_keeps_pages_exactly_and_gives_slots_back(tier):
    assert isinstance(tier, Tier) and tier.name in ("host", "disk")
    g = torch.Generator().manual_seed(0)
    k = torch.randn(10, P, D, generator=g).to(torch.bfloat16)
    v = torch.randn(10, P, D, generator=g).to(torch.bfloat16)
    slots = tier.store(k, v)
    assert slots.dtype == np.int64 and len(set(slots.tolist())) == 10
    assert tier.nbytes() == 10 * 2 * P * D * 2
    order = np.array([7, 2, 9, 0])
    got_k, got_v = tier.load(slots[order])
    assert torch.equal(got_k, k[order]) and torch.equal(got_v, v[order])
    out = (torch.empty(4, P, D, dtype=torch.bfloat16), torch.empty(4, P, D, dtype=torch.bfloat16))
    tier.load(slots[order], out=out)
    assert torch.equal(out[0], k[order]) and torch.equal(out[1], v[order])
    tier.free(slots[:5])
    assert tier.nbytes() == 5 * 2 * P * D * 2
    again = tier.store(k[:5], v[:5])       # freed slots are used again
    assert set(again.tolist()) <= set(slots.tolist())
    got_k, _ = tier.load(np.concatenate([again, slots[5:]]))
    assert torch.equal(got_k, torch.cat([k[:5], k[5:]]))
