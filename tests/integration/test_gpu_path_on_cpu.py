"""The decode path a GPU takes, run on the CPU through the native kernels' twins, answers as the CPU's own path
does on the default model.

On a GPU: recall is planned on the device (`plan_recall`, `recall_pages`), pages are chosen by
`page_upper_bounds` and `rank_pages`, KVP scores by `kvp_score`, the device entries are attended by
`attend_slabs` and the recalled pages, where the recall buffer holds them, by `attend_pages`, which merges
the two. Forced here on the CPU, the twins give each kernel's bits. Their sums round in their own order, so logits agree to float rounding and the greedy
answer is the same. What holds bit for bit between two ways of running that path is held on a small random model
of the default one's heads.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from kvtier import TieredCache, native
from kvtier.integrations.hf import cache_kwargs
from kvtier.tasks import make_needle_task

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from tiny_models import random_ids, random_kvp, small_llama  # noqa: E402

STEPS = 12


@torch.no_grad()
def _decode(model, ids: torch.Tensor, cache: TieredCache) -> tuple[list[int], list[torch.Tensor]]:
    logits = model(ids, **cache_kwargs(cache)).logits[:, -1]
    tokens, seen = [], [logits]
    for _ in range(STEPS):
        nxt = logits.argmax(-1, keepdim=True)
        tokens.append(int(nxt))
        logits = model(nxt, **cache_kwargs(cache)).logits[:, -1]
        seen.append(logits)
    return tokens, seen


@pytest.mark.slow
def test_the_gpu_decode_path_answers_as_the_cpu_path(default_model):
    model, tok = default_model
    task = make_needle_task(tok, 1500, depth=0.3, seed=4)
    runs = []
    for gpu_path in (False, True):
        cache = TieredCache(model.config, device_budget=0.1, recall_pages=8)
        if gpu_path:   # the NaN check deferred too, as on CUDA: a decode step's write then joins its attention
            cache.take_gpu_path()
        native.reset_stats()
        try:
            runs.append((_decode(model, task.input_ids, cache), native.backend()["ops"], cache.stats()))
        finally:
            cache.close()
    (plain, plain_logits), plain_ops, _ = runs[0]
    (gpu, gpu_logits), gpu_ops, stats = runs[1]
    # the GPU path ran every kernel's stand-in, and recalled pages
    assert {"plan_recall", "recall_pages", "rank_pages", "kvp_score", "attend_slabs", "attend_pages"} <= set(gpu_ops)
    assert not {"rank_pages", "kvp_score", "merge_parts", "attend_slabs", "attend_pages"} & set(plain_ops)
    assert stats["pages_recalled"] > 0
    assert gpu == plain
    for a, b in zip(gpu_logits, plain_logits):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)   # about 3e-5 apart on logits of 10 to 30


def test_the_gpu_decode_path_runs_under_inference_mode():
    """Under `torch.inference_mode` (tensors without a version counter, read-only outside it) the GPU's decode
    path, with its tensors kept from step to step (the step's position and KVP's features, the pool's count
    on the device, the NaN check's running maximum), answers as it does under `torch.no_grad`."""
    model = small_llama()
    ids = random_ids(model, 900)
    runs = []
    for mode in (torch.no_grad, torch.inference_mode):
        cache = TieredCache(model.config, device_budget=0.1, recall_pages=4, scorer=random_kvp(model)).take_gpu_path()
        try:
            with mode():
                logits = model(ids, **cache_kwargs(cache)).logits[:, -1]
                tokens = []
                for _ in range(6):
                    nxt = logits.argmax(-1, keepdim=True)
                    tokens.append(int(nxt))
                    logits = model(nxt, **cache_kwargs(cache)).logits[:, -1]
            runs.append((tokens, logits, cache.stats()["pages_recalled"]))
        finally:
            cache.close()
    assert runs[0][0] == runs[1][0] and runs[1][2] > 0
    torch.testing.assert_close(runs[0][1], runs[1][1], rtol=0, atol=0)


def test_a_decode_step_written_by_its_attention_equals_one_written_before_it(monkeypatch):
    """On the GPU's path a decode step's scoring and staging wait for its attention, so that the launches a CUDA
    graph replays hold them too (`LayerEngine.write_in_attention`). Moved there, they give the same bits: the
    same tokens, logits, scores and pool as a step written before its attention, over steps that demote."""
    from kvtier.engine.layer import LayerEngine

    model = small_llama()
    ids = random_ids(model, 900, seed=7)
    written_by_attention = []
    launches = LayerEngine._decode_launches

    def spy(self, run, query, k=None, v=None):
        written_by_attention.append(k is not None)
        return launches(self, run, query, k, v)

    monkeypatch.setattr(LayerEngine, "_decode_launches", spy)
    runs = []
    for later in (None, False):
        cache = TieredCache(model.config, device_budget=0.1, recall_pages=4, scorer=random_kvp(model)).take_gpu_path()
        for engine in cache._engines:
            engine.write_in_attention = later
        written_by_attention.clear()
        try:
            tokens, logits = _decode(model, ids, cache)
            pools = [(e.pool.count, *e.pool.meta()) for e in cache._engines]
            runs.append((tokens, logits, pools, cache.stats(), list(written_by_attention)))
        finally:
            cache.close()
    (tokens, logits, pools, stats, by_attention), (tokens0, logits0, pools0, stats0, by_attention0) = runs
    assert all(by_attention) and len(by_attention) == STEPS * len(model.model.layers)
    assert not any(by_attention0) and len(by_attention0) == len(by_attention)
    assert tokens == tokens0 and stats["pages_recalled"] == stats0["pages_recalled"] > 0
    assert stats["bytes_moved"] == stats0["bytes_moved"] and stats["bytes_moved"]["device_to_host"] > 0
    for a, b in zip(logits, logits0):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for (n, pos, score), (n0, pos0, score0) in zip(pools, pools0):
        assert n == n0 and torch.equal(pos, pos0) and torch.equal(score, score0)


def test_take_gpu_path_sets_every_switch_of_every_layer_and_refuses_a_closed_cache():
    """`TieredCache.take_gpu_path`: recall planned on the device (or not, as asked), the kernels' page choice,
    including an index made before the call, the deferred NaN check and KVP's one-launch scoring; a scorer with
    no such form is left as it is."""
    from kvtier.errors import ClosedCacheError

    model = small_llama()
    ids = random_ids(model, 300)
    with TieredCache(model.config, device_budget=0.1, recall_pages=4, scorer=random_kvp(model)) as cache:
        with torch.no_grad():
            model(ids, **cache_kwargs(cache))   # the layers' indexes are made, from the switches as they were
        assert all(e.index is not None and e.index.native_select is None for e in cache._engines)
        assert cache.take_gpu_path() is cache
        for e in cache._engines:
            assert e.device_recall is e.select_kernels is e.defer_nan is True
            assert e.index.native_select is True and e.scorer.native_score is True
        cache.take_gpu_path(plan_on_device=False)
        assert not any(e.device_recall for e in cache._engines)
    with pytest.raises(ClosedCacheError, match="closed"):
        cache.take_gpu_path()
    with TieredCache(model.config, device_budget=0.1, scorer="keynorm") as plain:
        plain.take_gpu_path()
        assert all(not hasattr(e.scorer, "native_score") and e.select_kernels for e in plain._engines)


def test_a_failed_step_on_a_layer_with_disk_pages_is_no_eager_step_and_plan_on_device_is_a_bool():
    """A step on a layer with disk pages was counted among the eager steps before its launches ran, so one that
    failed counted as run (a layer without disk pages counts once the work returned); take_gpu_path took any
    value ("False" planned on the device)."""
    from kvtier import ConfigError
    from kvtier.native import twins

    from tiny_models import tiny_llama

    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 150), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        for host_budget in (None, 32):
            with TieredCache(model.config, device_budget=48, host_budget=host_budget, recall_pages=3, page_size=8,
                             scorer="keynorm") as cache:
                with pytest.raises(ConfigError, match="plan_on_device='False'; allowed: True or False"):
                    cache.take_gpu_path("False")
                cache.take_gpu_path()
                x = model(ids, **cache_kwargs(cache)).logits[:, -1:]
                x = model(x.argmax(-1), **cache_kwargs(cache)).logits[:, -1:]
                assert cache._engines[0].holds_disk_pages() == (host_budget is not None)
                before = cache.stats()["cuda_graphs"]["eager_steps"]
                real = twins.attend_pages

                def boom(*args, **kwargs):
                    raise RuntimeError("injected")

                twins.attend_pages = boom
                try:
                    with pytest.raises(RuntimeError):
                        model(x.argmax(-1), **cache_kwargs(cache))
                finally:
                    twins.attend_pages = real
                assert cache.broken and cache.stats()["cuda_graphs"]["eager_steps"] == before
