"""Shared fixtures: the real default model (loaded once), a factory of layer engines, CUDA skipping."""

from __future__ import annotations

import pytest
import torch

torch.set_num_threads(1)  # small tensor ops are faster single-threaded on 2-core machines


@pytest.fixture
def cuda_device():
    """The current CUDA device (tests using it are marked `cuda` and skipped without one)."""
    return torch.device("cuda", torch.cuda.current_device())


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run `pytest -m cuda` on a GPU machine)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def default_model():
    from kvtier import load_default_model
    from kvtier.errors import ModelNotInstalledError

    try:
        model, tokenizer = load_default_model()
    except ModelNotInstalledError as e:
        if torch.cuda.is_available():   # a GPU machine without the model's package: its CUDA tests skip
            pytest.skip(str(e))
        raise
    return model, tokenizer


@pytest.fixture
def fresh_attention(default_model):
    """Give the model its own attention back after a test that routed it through kvtier."""
    from kvtier.integrations.attention import restore_attention

    yield default_model
    restore_attention(default_model[0].config)


@pytest.fixture
def watch_fetches(monkeypatch):
    """``watch(engine)`` records ``(ids, k, v)`` for every page fetch of `engine` while `attend` runs."""

    def watch(engine):
        got, real = [], engine._fetch

        def spy(ids, shortlist, ahead=False):
            k, v, order = real(ids, shortlist, ahead)
            got.append((ids.clone(), k.clone(), v.clone()))
            return k, v, order

        monkeypatch.setattr(engine, "_fetch", spy)
        return got

    return watch


@pytest.fixture
def make_engine(tmp_path):
    """Build `LayerEngine`s on the CPU with a private disk folder; all are closed after the test."""
    from kvtier.config import ModelShape, TieredCacheConfig
    from kvtier.engine import LayerEngine
    from kvtier.engine.resources import SharedResources
    from kvtier.placement import Budget
    from kvtier.scoring import make_scorer

    made = []

    def build(heads=2, head_dim=8, device_budget=32, host_budget=None, mode="tier", recall_pages=4,
              page_size=4, sink_tokens=2, recent_tokens=4, scorer="keynorm", layer_idx=0, prefetch_pages=None,
              demote_pages=None, read_ahead=None, promote=False, retain_pages=0):
        cfg = TieredCacheConfig(
            shape=ModelShape(1, heads, head_dim),
            device_budget=Budget(device_budget, "device_budget"),
            host_budget=None if host_budget is None else Budget(host_budget, "host_budget", allow_zero=True),
            mode=mode, recall_pages=recall_pages, page_size=page_size, sink_tokens=sink_tokens,
            recent_tokens=recent_tokens, prefetch_pages=prefetch_pages, demote_pages=demote_pages,
            read_ahead=read_ahead, promote=promote, retain_pages=retain_pages)
        shared = SharedResources(str(tmp_path))
        engine = LayerEngine(layer_idx, cfg, make_scorer(scorer), shared)
        made.append((engine, shared))
        return engine

    yield build
    for engine, shared in made:
        engine.close()
        shared.close()
