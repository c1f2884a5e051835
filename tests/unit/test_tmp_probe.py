import numpy as np, torch
from kvtier.placement.page_table import DISK, HOST

def _run(engine, seed, n=300, chunk=13, attend=True):
    g = torch.Generator().manual_seed(seed)
    outs = []
    for a in range(0, n, chunk):
        k = torch.randn(1, engine.heads, chunk, engine.head_dim, generator=g)
        engine.write(k, k * 3)
        if attend:
            outs.append(engine.attend(torch.randn(1, engine.heads * 2, chunk, engine.head_dim, generator=g)))
        engine.commit()
    return outs

def test_reset_then_reuse_matches_fresh(make_engine):
    a = make_engine(device_budget=16, host_budget=20, recall_pages=3)
    b = make_engine(device_budget=16, host_budget=20, recall_pages=3, layer_idx=1)
    _run(a, 0)
    a.reset()
    oa = _run(a, 1); ob = _run(b, 1)
    for x, y in zip(oa, ob):
        assert (x is None and y is None) or torch.equal(x, y)
    assert np.array_equal(a.table.tier, b.table.tier)

def test_park_cycles(make_engine):
    a = make_engine(device_budget=16, host_budget=20, recall_pages=3)
    b = make_engine(device_budget=16, host_budget=20, recall_pages=3, layer_idx=1)
    g = torch.Generator().manual_seed(5)
    for cycle in range(6):
        oa = _run(a, cycle, n=91); ob = _run(b, cycle, n=91)
        for x, y in zip(oa, ob):
            assert (x is None and y is None) or torch.equal(x, y), cycle
        a.park("disk" if cycle % 2 else "host")
        if cycle % 3 == 2:
            a.park("disk")
    a.restore()
    assert np.array_equal(a.table.tier, b.table.tier)
