"""Working memory of a step is bounded whatever the query and context lengths; host memory stays flat."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import psutil
import torch

LONG_TURN = textwrap.dedent("""
    import json, resource, torch
    from kvtier.config import ModelShape, TieredCacheConfig
    from kvtier.engine import LayerEngine
    from kvtier.engine.resources import SharedResources
    from kvtier.placement import Budget
    from kvtier.scoring import make_scorer
    torch.set_num_threads(1)
    H, G, D = 3, 3, 64
    cfg = TieredCacheConfig(shape=ModelShape(1, H, D), device_budget=Budget(0.1, "device_budget"))
    shared = SharedResources(None)
    engine = LayerEngine(0, cfg, make_scorer("keynorm"), shared)
    g = torch.Generator().manual_seed(0)
    for _ in range(4):                       # an 8K context, demoted to 10%%
        k = torch.randn(1, H, 2048, D, generator=g)
        engine.write(k, torch.randn(1, H, 2048, D, generator=g))
        engine.attend(torch.randn(1, H * G, 2048, D, generator=g))
        engine.commit()
    q_len = %(q_len)d
    k, v = torch.randn(1, H, q_len, D, generator=g), torch.randn(1, H, q_len, D, generator=g)
    query = torch.randn(1, H * G, q_len, D, generator=g)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    engine.write(k, v)
    out, _ = engine.attend(query)
    engine.commit()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"extra_kib": peak - before, "out": list(out.shape)}))
    engine.close(); shared.close()
""")


def _extra_peak_kib(q_len: int) -> int:
    done = subprocess.run([sys.executable, "-c", LONG_TURN % {"q_len": q_len}], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["out"] == [1, q_len, 9, 64]
    return result["extra_kib"]


def test_a_long_turn_into_a_tiered_cache_runs_in_bounded_memory():
    """A 4K-token turn into an 8K cache at 10%: the step's own working memory is a few MiB, not the
    query x context mask (about 0.9 GB of float logits here) that attention over a concatenation builds."""
    extra = _extra_peak_kib(4096)
    # the turn's K/V and query are 4096 x (3 + 3 + 9) x 64 floats = 15 MiB; recall and attention per block
    # of 128 query tokens add a few MiB on top, whatever the lengths
    assert extra < 64 * 1024, f"peak memory grew by {extra / 1024:.0f} MiB during a 4K-token turn"


def test_host_memory_is_flat_over_a_long_decode(make_engine):
    """10,000 decode steps with a fixed host budget (the rest on disk): host pools stop growing and the
    process' resident memory stays flat once the hierarchy is full."""
    torch.manual_seed(0)
    engine = make_engine(heads=2, head_dim=16, device_budget=64, host_budget=256, page_size=16,
                         recall_pages=4, sink_tokens=4, recent_tokens=16)
    proc = psutil.Process()
    samples, reserved = [], []
    for step in range(10_000):
        k = torch.randn(1, 2, 1, 16)
        engine.write(k, k)
        engine.attend(torch.randn(1, 4, 1, 16))
        engine.commit()
        if step % 1000 == 999:
            samples.append(proc.memory_info().rss)
            reserved.append(engine.host.reserved_bytes())
    held_host = int(engine.table.tokens(1).max())
    assert held_host <= 256
    assert len(set(reserved[2:])) == 1, f"the host pool kept growing: {reserved}"
    growth = samples[-1] - samples[2]
    assert growth < 8 << 20, f"resident memory grew by {growth / 2**20:.1f} MiB over 7,000 steps"
