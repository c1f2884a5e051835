"""`kvtier bench launches`' figure for a step replayed whole (`time_decode_graph_host`): per planned step only."""

from __future__ import annotations

import torch

from kvtier import TieredCache
from kvtier.bench.launches import time_decode_graph_host


def test_steps_never_planned_whole_give_no_figure(model):
    """With a scorer that needs the query (H2O), no step is planned whole: the planning time of the steps that ran
    the ordinary way had been divided by one step and shown as a per-layer, per-step cost."""
    ids = torch.randint(0, 128, (1, 80), generator=torch.Generator().manual_seed(0))

    def make_cache():
        return TieredCache(model.config, device_budget=24, recall_pages=4, scorer="h2o").take_gpu_path()

    out = time_decode_graph_host(model, ids, make_cache, steps=3, warmup=1)
    assert out["planned_steps"] == 0 and out["steps"] == 3
    assert out["plan"] is None and out["key"] is None and out["take"] is None and out["total"] is None


def test_planned_steps_are_timed(model):
    ids = torch.randint(0, 128, (1, 80), generator=torch.Generator().manual_seed(0))

    def make_cache():
        return TieredCache(model.config, device_budget=24, recall_pages=4, scorer="keynorm").take_gpu_path()

    out = time_decode_graph_host(model, ids, make_cache, steps=3, warmup=1)
    assert out["planned_steps"] >= 1 and out["plan"] > 0 and out["total"] >= out["plan"]
