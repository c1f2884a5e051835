"""The life of a cache: dropped caches are freed, a closed cache refuses every use, and a step that fails
midway marks the cache broken until `reset()`."""

from __future__ import annotations

import errno
import gc
import logging
import os
import threading
import types
import weakref

import psutil
import pytest
import torch
from transformers import DynamicCache

import kvtier.tiers.disk as disk_module
from tiny_models import continue_greedy, tiny_llama
from kvtier import CapacityError, ConfigError, ScorerError, TieredCache, UnsupportedError, cache_kwargs
from kvtier.errors import BrokenCacheError, ClosedCacheError, KVTierError
from kvtier.scoring.keynorm import KeyNormScorer

PROMPT = torch.randint(0, 128, (1, 60), generator=torch.Generator().manual_seed(2))
SETTINGS = dict(device_budget=24, host_budget=16, recall_pages=1000)


@torch.no_grad()
def generate(model, cache, ids=PROMPT, n=4) -> tuple[list[int], torch.Tensor]:
    return continue_greedy(model, cache, model(ids, **cache_kwargs(cache)).logits, n)


@pytest.fixture(scope="module")
def expected(model, tmp_path_factory):
    with TieredCache(model.config, disk_dir=tmp_path_factory.mktemp("ref"), scorer="keynorm", **SETTINGS) as c:
        return generate(model, c)


def same(result, expected) -> bool:
    return result[0] == expected[0] and torch.equal(result[1], expected[1])


def private_dirs(folder) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n.startswith("kvtier-"))


# ------------------------------------------------------------------------------------------------ dropped caches
def test_dropped_caches_are_freed(model, tmp_path, monkeypatch):
    """300 caches with a disk tier, made, used (I/O threads too), some parked on disk, some closed and
    some just dropped: open files, threads, private folders and memory stay flat."""
    monkeypatch.setattr(disk_module, "_MIN_TASK_BYTES", 1)   # any write of 2+ pages runs on the I/O threads
    proc = psutil.Process()
    ids = PROMPT[:, :40]
    peak_threads, refs = 0, []

    @torch.no_grad()
    def cycle(i: int) -> weakref.ref:
        nonlocal peak_threads
        cache = TieredCache(model.config, device_budget=20, host_budget=0, disk_dir=tmp_path, recall_pages=100,
                            scorer="keynorm")
        out = model(ids, **cache_kwargs(cache))
        model(out.logits[:, -1:].argmax(-1), **cache_kwargs(cache))
        peak_threads = max(peak_threads, threading.active_count())
        if i % 3 == 1:
            cache.park("disk")
        if i % 5 == 0:
            cache.close()
        return weakref.ref(cache)

    gc.collect()
    gc.freeze()   # the model and the libraries stay put: gc.collect() below then looks at new objects only
    try:
        for i in range(20):
            cycle(i)
        gc.collect()
        fds, threads, rss = proc.num_fds(), threading.active_count(), proc.memory_info().rss
        for i in range(20, 300):
            ref = cycle(i)
            gc.collect()
            refs.append(ref)
        assert all(r() is None for r in refs), "a dropped cache is still alive"
        assert private_dirs(tmp_path) == []
        assert proc.num_fds() == fds
        assert threading.active_count() == threads
        assert peak_threads > threads   # the I/O threads did run
        grown = (proc.memory_info().rss - rss) / 2**20
        assert grown < 40, f"RSS grew by {grown:.1f} MiB over 280 caches"
    finally:
        gc.unfreeze()


def test_a_cache_that_fails_to_build_leaves_no_folder(tmp_path):
    """The private folder is made while the settings are checked; a failure after it removes it."""
    config = types.SimpleNamespace(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   hidden_size=32, _attn_implementation={"text_config": "sdpa"})
    with pytest.raises(ConfigError, match="attn_implementation"):
        TieredCache(config, host_budget=0.1, disk_dir=tmp_path)
    assert private_dirs(tmp_path) == []


# ------------------------------------------------------------------------------------------------ closed caches
@pytest.mark.parametrize("host_budget", [16, None])
def test_a_closed_cache_refuses_every_use_and_makes_no_folder(model, tmp_path, host_budget):
    cache = TieredCache(model.config, device_budget=24, host_budget=host_budget, disk_dir=tmp_path,
                        scorer="keynorm")
    generate(model, cache)
    cache.close()
    cache.close()   # twice is fine
    assert cache.closed and private_dirs(tmp_path) == []
    calls = {
        "forward": lambda: model(PROMPT[:, :3], **cache_kwargs(cache)),
        "generate": lambda: model.generate(PROMPT[:, :3], **cache_kwargs(cache), max_new_tokens=2,
                                           do_sample=False, pad_token_id=0),
        "update": lambda: cache.update(torch.zeros(1, 2, 1, 16), torch.zeros(1, 2, 1, 16), 0),
        "park host": lambda: cache.park("host"),
        "park disk": lambda: cache.park("disk"),
        "resume": cache.resume,
        "reset": cache.reset,
    }
    for name, call in calls.items():
        with pytest.raises(ClosedCacheError, match="closed"):
            call()
        assert private_dirs(tmp_path) == [], f"{name} made a folder"
    stats = cache.stats()   # still answers
    assert stats["device"]["tokens"] == 0 and stats["disk"]["tokens"] == 0


# ------------------------------------------------------------------------------------------------ broken caches
class FailingScorer(KeyNormScorer):
    """keynorm that raises once on one layer when armed."""

    def __init__(self, layer: int, error: BaseException) -> None:
        super().__init__()
        self.layer, self.error, self.armed = layer, error, False

    def score(self, keys, values, positions, layer_idx):
        if self.armed and layer_idx == self.layer:
            self.armed = False
            raise self.error
        return super().score(keys, values, positions, layer_idx)


def _check_broken_then_reset(model, cache, expected, words):
    assert cache.broken is not None and words in cache.broken
    for call in (lambda: generate(model, cache, n=1), lambda: cache.park("disk"), cache.resume,
                 lambda: cache.update(torch.zeros(1, 2, 1, 16), torch.zeros(1, 2, 1, 16), 0)):
        with pytest.raises(BrokenCacheError, match=f"broken.*{words}.*reset") as err:
            call()
        assert isinstance(err.value, KVTierError)
    assert cache.stats()["tokens_seen"] > 0   # still answers
    cache.reset()
    assert cache.broken is None
    assert same(generate(model, cache), expected)   # as good as new


def test_a_write_failing_after_an_earlier_layer_took_the_step_breaks_the_cache(model, tmp_path, expected):
    scorer = FailingScorer(1, RuntimeError("boom in layer 1"))
    cache = TieredCache(model.config, disk_dir=tmp_path, scorer=scorer, **SETTINGS)
    generate(model, cache)
    scorer.armed = True
    with pytest.raises(RuntimeError, match="boom in layer 1"):
        generate(model, cache, n=1)
    assert cache._engines[0].seen != cache._engines[1].seen   # what makes it broken
    _check_broken_then_reset(model, cache, expected, "RuntimeError: boom in layer 1")
    cache.close()


def test_attention_failing_breaks_the_cache(model, tmp_path, expected, monkeypatch):
    cache = TieredCache(model.config, disk_dir=tmp_path, scorer="keynorm", **SETTINGS)
    generate(model, cache)

    def fail(*args, **kwargs):
        raise ValueError("no attention today")

    monkeypatch.setattr(cache._engines[1], "attend", fail)
    with pytest.raises(ValueError, match="no attention today"):
        generate(model, cache, n=1)
    monkeypatch.undo()
    _check_broken_then_reset(model, cache, expected, "ValueError: no attention today")
    cache.close()


def test_disk_full_while_placing_a_step_keeps_the_pages_on_the_host_and_the_step_goes_on(model, tmp_path,
                                                                                          monkeypatch, caplog):
    """Every layer's pages refused by a full disk in the middle of a step stay on the host, over its budget: the
    step goes through with the logits of a twin that had room, the stats say so, and with room again the next
    demotions bring the host back under its budget, the answers still the twin's."""
    settings = {**SETTINGS, "host_budget": 40}   # what waits on the host stays within twice the budget
    a, b = (TieredCache(model.config, disk_dir=tmp_path, scorer="keynorm", **settings) for _ in range(2))
    more = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(model(PROMPT, **cache_kwargs(a)).logits, model(PROMPT, **cache_kwargs(b)).logits)
        want = model(more, **cache_kwargs(b)).logits   # 40 more tokens: pages go to disk

        def full(*args):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(os, "pwritev", full)
        with caplog.at_level(logging.WARNING, logger="kvtier"):
            got = model(more, **cache_kwargs(a)).logits
        monkeypatch.undo()
    assert torch.equal(got, want) and a.broken is None
    refused = a.stats()["spills_deferred"]
    assert refused["rounds"] >= len(a._engines) and "disk full" in refused["last_error"]
    assert sum("could not go down to disk" in r.getMessage() for r in caplog.records) == 1   # said once a cache
    assert b.stats()["spills_deferred"] == {"rounds": 0, "last_error": None}
    over = a.stats()["host"]["tokens"] - b.stats()["host"]["tokens"]
    assert over > 0, "no page stayed on the host: the test tests nothing"
    (tokens, last), (tokens_b, last_b) = continue_greedy(model, a, got, 40), continue_greedy(model, b, want, 40)
    assert tokens == tokens_b and torch.equal(last, last_b)
    assert a.stats()["host"]["tokens"] == b.stats()["host"]["tokens"]   # moved down since, under the budget
    a.close()
    b.close()


def test_a_copy_made_while_pages_wait_for_the_disk_places_them_as_its_original(model, tmp_path, monkeypatch):
    """`copy.deepcopy` of a cache whose host pages wait for room on disk carries the wait: fed the same tokens,
    the copy and its original hold the same pages in each tier at every step."""
    import copy

    a = TieredCache(model.config, disk_dir=tmp_path, scorer="keynorm", **{**SETTINGS, "host_budget": 40})
    more = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        model(PROMPT, **cache_kwargs(a))
        monkeypatch.setattr(os, "pwritev", lambda *args: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full")))
        x = model(more, **cache_kwargs(a)).logits[:, -1:]
        monkeypatch.undo()
        assert a.stats()["spills_deferred"]["rounds"] > 0
        c = copy.deepcopy(a)
        for _ in range(24):
            token = x.argmax(-1)
            x, y = model(token, **cache_kwargs(a)).logits, model(token, **cache_kwargs(c)).logits
            assert torch.equal(x, y)
            assert [(a.stats()[t]["tokens"], c.stats()[t]["tokens"]) for t in ("device", "host", "disk")] == \
                [(a.stats()[t]["tokens"],) * 2 for t in ("device", "host", "disk")]
    a.close()
    c.close()


@pytest.mark.parametrize("op", ["resume", "deepcopy", "park"])
def test_resume_copy_and_park_under_inference_mode_leave_a_cache_that_steps_outside_it(model, tmp_path, op):
    """What `resume`, `copy.deepcopy` and `park` make under `torch.inference_mode()` is kept as plain tensors, as
    a step's guard keeps what it makes: the next steps may run outside inference mode, with a twin's logits."""
    import copy

    a, b = (TieredCache(model.config, disk_dir=tmp_path, scorer="keynorm", **SETTINGS) for _ in range(2))
    with torch.no_grad():
        x = model(PROMPT, **cache_kwargs(a)).logits
        assert torch.equal(x, model(PROMPT, **cache_kwargs(b)).logits)
    if op == "resume":
        a.park("disk")
    with torch.inference_mode():
        if op == "resume":
            a.resume()
        elif op == "deepcopy":
            a2 = copy.deepcopy(a)
            a.close()
            a = a2
        else:
            a.park("host")
            a.resume()
    assert same(continue_greedy(model, a, x.clone(), 8), continue_greedy(model, b, x.clone(), 8))
    a.close()
    b.close()


@pytest.mark.parametrize("fault", ["file missing", "no host memory"])
def test_a_parked_layer_that_cannot_be_restored_fails_the_step_before_any_layer_takes_it(model, tmp_path,
                                                                                        monkeypatch, fault):
    """Every parked layer comes back at the start of a step: with layer 1's parked file missing, or no host memory
    for the host pages it parked on disk, the step raises, no layer took it, so the cache is not broken (layer 0
    is back; layer 1 still parked, holding nothing on the device); with the fault gone, the same step gives the
    logits of a twin that was never parked."""
    from kvtier.tiers.host import HostPool

    a, b = (TieredCache(model.config, disk_dir=tmp_path, scorer="keynorm", **SETTINGS) for _ in range(2))
    nxt = torch.tensor([[7]])
    with torch.no_grad():
        assert torch.equal(model(PROMPT, **cache_kwargs(a)).logits, model(PROMPT, **cache_kwargs(b)).logits)
        assert a.stats()["host"]["tokens"] > 0   # parked on disk with the layer: they come back to the host
        a.park("disk")
        layer1 = a._engines[1]
        path = layer1.parked.meta_file.path
        data = open(path, "rb").read()
        if fault == "file missing":
            os.remove(path)
        else:
            store = HostPool.store

            def no_memory(pool, k, v):
                if pool is layer1.host:
                    raise CapacityError("could not allocate a host slab (injected)")
                return store(pool, k, v)

            monkeypatch.setattr(HostPool, "store", no_memory)
        with pytest.raises(KVTierError, match=r"parked layer file .*layer001" if fault == "file missing" else
                           "could not allocate a host slab"):
            model(nxt, **cache_kwargs(a))
        assert a.broken is None and [e.parked is None for e in a._engines] == [True, False]
        assert layer1.pool.count == 0 and a.get_seq_length() == b.get_seq_length()
        if fault == "file missing":
            open(path, "wb").write(data)
        monkeypatch.undo()
        assert torch.equal(model(nxt, **cache_kwargs(a)).logits, model(nxt, **cache_kwargs(b)).logits)
    assert a.parked is None and a.stats()["host"]["tokens"] == b.stats()["host"]["tokens"]
    a.close()
    b.close()


@pytest.mark.parametrize("site", ["place", "forget", "free"])
def test_a_restore_interrupted_in_its_bookkeeping_breaks_the_cache(model, tmp_path, monkeypatch, site):
    """Once a parked layer's host pages are back, its restore only updates the page table and lets the disk slots
    go; an interruption there (Ctrl-C between two of those calls) leaves the page table and the parked layer
    disagreeing, so the cache says it is broken from then on (where before it went on as if unparked), and
    reset() makes it usable again."""
    from kvtier.placement.page_table import PageTable
    from kvtier.tiers.disk import DiskStore
    from kvtier.tiers.readahead import DiskReadAhead

    settings = dict(device_budget=24, host_budget=64, recall_pages=8, scorer="keynorm")   # a ring of one page
    cache = TieredCache(model.config, disk_dir=tmp_path, read_ahead=True, **settings)
    ids = torch.randint(0, 128, (1, 200), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        model(ids, **cache_kwargs(cache))
        assert cache.stats()["host"]["tokens"] > 0   # host pages parked on disk: the release puts them back
        cache.park("disk")
        layer1 = cache._engines[1]
        owner, name = {"place": (PageTable, "place"), "forget": (DiskReadAhead, "forget"),
                       "free": (DiskStore, "free")}[site]
        real = getattr(owner, name)
        restoring = [False]

        def interrupted(obj, *args, **kwargs):
            if restoring[0]:
                raise KeyboardInterrupt
            return real(obj, *args, **kwargs)

        real_release = type(layer1.parked).release

        def release(parked, *args, **kwargs):
            restoring[0] = parked is layer1.parked
            try:
                return real_release(parked, *args, **kwargs)
            finally:
                restoring[0] = False

        monkeypatch.setattr(owner, name, interrupted)
        monkeypatch.setattr(type(layer1.parked), "release", release)
        if site == "forget":
            assert layer1.readahead is not None
        with pytest.raises(KeyboardInterrupt):
            model(torch.tensor([[7]]), **cache_kwargs(cache))
        monkeypatch.undo()
        assert cache.broken is not None and "restoring layer 1 was interrupted midway" in cache.broken
        with pytest.raises(BrokenCacheError, match="restoring layer 1"):
            model(torch.tensor([[7]]), **cache_kwargs(cache))
        cache.reset()
        assert cache.broken is None and not layer1.torn
        with TieredCache(model.config, disk_dir=tmp_path, read_ahead=True, **settings) as fresh:
            assert same(generate(model, cache, ids), generate(model, fresh, ids))
    cache.close()


def test_a_gpu_out_of_memory_in_the_first_layers_slab_is_a_capacity_error_and_changes_nothing(model, tmp_path,
                                                                                               expected, monkeypatch):
    """The device running out of memory between a slab's key and value tensors, in the first tiered layer of the
    prompt's step: nothing moved, so the cache is not broken, says why in words, and the same prompt then gives
    the same tokens."""
    import kvtier.tiers.device as device_module

    class OutOfMemoryAtValues:
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def empty_like(*args, **kwargs):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
                                         "capacity of 139.81 GiB of which 1.02 GiB is free.")

    cache = TieredCache(model.config, disk_dir=tmp_path, scorer="keynorm", **SETTINGS)
    monkeypatch.setattr(device_module, "torch", OutOfMemoryAtValues())
    with pytest.raises(CapacityError, match="could not allocate a device slab .* CUDA out of memory"):
        generate(model, cache, n=1)
    monkeypatch.undo()
    assert cache.broken is None and cache.get_seq_length() == 0
    assert same(generate(model, cache), expected)
    cache.close()


def test_an_interruption_between_layers_is_caught_at_the_next_step(model, tmp_path, expected, monkeypatch):
    """An exception outside kvtier (here in layer 0's MLP, as a Ctrl-C would land) leaves layer 0 ahead of
    layer 1; the next step sees the layers disagree and refuses."""
    cache = TieredCache(model.config, disk_dir=tmp_path, scorer="keynorm", **SETTINGS)
    generate(model, cache)
    mlp = model.model.layers[0].mlp

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(mlp, "forward", interrupted)
    with pytest.raises(KeyboardInterrupt):
        generate(model, cache, n=1)
    monkeypatch.undo()
    with pytest.raises(BrokenCacheError, match="disagree on their length"):
        generate(model, cache, n=1)
    _check_broken_then_reset(model, cache, expected, "disagree on their length")
    cache.close()


@pytest.mark.parametrize("bad", ["heads", "batch", "scorer on layer 0"])
def test_errors_before_any_change_do_not_break_the_cache(model, tmp_path, expected, bad):
    scorer = FailingScorer(0, ScorerError("scores of the wrong shape"))
    cache = TieredCache(model.config, disk_dir=tmp_path, scorer=scorer, **SETTINGS)
    twin = TieredCache(model.config, disk_dir=tmp_path, scorer="keynorm", **SETTINGS)
    generate(model, cache, n=2)
    generate(model, twin, n=2)
    with pytest.raises((UnsupportedError, ScorerError)):
        if bad == "heads":
            cache.update(torch.zeros(1, 3, 1, 16), torch.zeros(1, 3, 1, 16), 0)
        elif bad == "batch":
            with torch.no_grad():
                model(PROMPT[:, :2].repeat(2, 1), **cache_kwargs(cache))
        else:
            scorer.armed = True
            with torch.no_grad():
                model(PROMPT[:, :2], **cache_kwargs(cache))
    assert cache.broken is None
    ids = PROMPT[:, 10:14]
    assert same(generate(model, cache, ids), generate(model, twin, ids))
    cache.close()
    twin.close()


def test_a_full_cache_still_matches_dynamic_cache_through_the_guards(model, tmp_path):
    """With budgets that hold everything the guarded cache is still bit-identical to DynamicCache."""
    cache = TieredCache(model.config, device_budget=1.0, disk_dir=tmp_path, scorer="keynorm")
    assert same(generate(model, cache), generate(model, DynamicCache(config=model.config)))
    cache.close()


def test_a_forward_without_no_grad_works_and_matches(model, tmp_path):
    """A plain ``model(ids, past_key_values=cache)`` (autograd on) used to fail at the first demotion
    (``numpy()`` of scores that required grad); stored entries now never carry a graph."""
    results = []
    for grad in (False, True):
        cache = TieredCache(model.config, disk_dir=tmp_path, scorer="keynorm", **SETTINGS)
        with torch.set_grad_enabled(grad):
            logits = model(PROMPT, **cache_kwargs(cache)).logits
            logits = model(logits[:, -1:].argmax(-1), **cache_kwargs(cache)).logits
        assert cache.stats()["disk"]["tokens"] > 0
        results.append(logits.detach())
        cache.close()
    assert torch.equal(results[0], results[1])


def test_a_cache_built_from_a_copy_of_the_config_refuses_instead_of_skipping_recall():
    """A copy of the config is routed through kvtier, the model is not: the model's next step raises instead
    of decoding silently without recall."""
    import copy

    model = tiny_llama()
    cache = TieredCache(copy.deepcopy(model.config), device_budget=24, recall_pages=1_000)
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids, **cache_kwargs(cache)).logits
        with pytest.raises(UnsupportedError, match="on any step.*or the cache was built with a copy of the model"):
            model(logits[:, -1:].argmax(-1), **cache_kwargs(cache))
    cache.close()


@pytest.mark.parametrize("budget", [24, 1.0])
def test_left_padding_gives_the_full_caches_tokens(model, budget):
    """A left-padded prompt with its attention mask: the padding is never attended (it leaves the cache when
    placed), so greedy tokens equal DynamicCache's with the same mask, with pages demoted and recalled."""
    pad = 9
    ids = torch.cat([torch.zeros(1, pad, dtype=torch.long), PROMPT], dim=1)
    mask = torch.cat([torch.zeros(1, pad, dtype=torch.long), torch.ones_like(PROMPT)], dim=1)
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                         **cache_kwargs(DynamicCache(config=model.config)))
    cache = TieredCache(model.config, device_budget=budget, recall_pages=1_000)
    got = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, **cache_kwargs(cache))
    assert torch.equal(got, ref)
    s = cache.stats()
    assert s["tokens_masked"] == pad * s["layers"] * s["kv_heads"]
    if budget == 24:
        assert s["pages_recalled"] > 0
    cache.close()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("where", ["inside the prompt", "in a later step"])
def test_padding_after_a_real_token_is_refused_and_the_cache_goes_on(model, attn, where):
    """Padding is dropped when placed, and later steps read their mask at an offset of the tokens dropped: right
    only for left padding. Padding after a real token (inside the prompt, or in a later step, at full budget) had
    been taken, and every later step's mask fell on other entries (logits off DynamicCache's by 2e-2, no error).
    It is refused before any layer took the step, so the cache is not broken and goes on as a twin never asked."""
    model.set_attn_implementation(attn)
    try:
        a, b = TieredCache(model.config, device_budget=1.0), TieredCache(model.config, device_budget=1.0)
        with torch.no_grad():
            if where == "in a later step":
                for c in (a, b):
                    model(PROMPT[:, :30], **cache_kwargs(c))
                ids = torch.cat([torch.zeros(1, 2, dtype=torch.long), PROMPT[:, 30:34]], dim=1)
                mask = torch.ones(1, 36, dtype=torch.long)
                mask[0, 30:32] = 0
            else:
                ids = torch.cat([PROMPT[:, :20], torch.zeros(1, 2, dtype=torch.long), PROMPT[:, 20:30]], dim=1)
                mask = torch.ones_like(ids)
                mask[0, 20:22] = 0
            with pytest.raises(UnsupportedError, match="left padding"):
                model(ids, attention_mask=mask, **cache_kwargs(a))
            assert a.broken is None and a.get_seq_length() == b.get_seq_length()
            nxt = PROMPT[:, 34:40] if where == "in a later step" else PROMPT[:, :30]
            assert torch.equal(model(nxt, **cache_kwargs(a)).logits, model(nxt, **cache_kwargs(b)).logits)
        a.close()
        b.close()
    finally:
        model.set_attn_implementation("sdpa")


def test_a_step_cut_short_by_ctrl_c_never_leaves_a_routing_error_behind(monkeypatch):
    """Ctrl-C in a layer's write, before its length moved: the stale step had made every later step raise 'the
    model's attention did not run through kvtier', for good; it is dropped now and the cache goes on as its twin.
    Ctrl-C after the first layer's update returned (its length moved, the next layer's not): the next step says
    the cache is broken (it had raised the routing error too)."""
    import kvtier.integrations.tiered_layer as tiered_layer
    from kvtier import BrokenCacheError, TieredCache, cache_kwargs
    from tiny_models import tiny_llama

    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), TieredCache(model.config, device_budget=8) as cache, \
            TieredCache(model.config, device_budget=8) as twin:
        for c in (cache, twin):
            model(ids[:, :10], **cache_kwargs(c))
        engine = cache._engines[0]
        engine.write(*(torch.randn(1, engine.heads, 1, engine.head_dim) for _ in range(2)))
        engine.seen -= 1   # as a Ctrl-C between staging the step and moving the length leaves it
        assert torch.equal(model(ids[:, 10:11], **cache_kwargs(cache)).logits,
                           model(ids[:, 10:11], **cache_kwargs(twin)).logits)
        real = tiered_layer.claim

        def interrupted(*args):
            monkeypatch.setattr(tiered_layer, "claim", real)
            raise KeyboardInterrupt

        monkeypatch.setattr(tiered_layer, "claim", interrupted)
        with pytest.raises(KeyboardInterrupt):
            model(ids[:, 11:12], **cache_kwargs(cache))
        with pytest.raises(BrokenCacheError, match="interrupted between layers"):
            model(ids[:, 11:12], **cache_kwargs(cache))


def test_a_model_of_another_layer_count_is_refused_by_name_and_a_changed_cache_says_so():
    """A model of more layers than the cache's config had met a bare IndexError after its first layers had taken
    the step, the cache not marked broken; one of fewer layers ran, and the next step's error spoke only of an
    interruption."""
    from tiny_models import small_llama

    built_for, more, fewer = small_llama(layers=2), small_llama(layers=3), small_llama(layers=1)
    ids = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), TieredCache(built_for.config, device_budget=8, page_size=4) as cache:
        with pytest.raises(UnsupportedError, match="layer 2 of the model: this TieredCache was made for a config "
                                                   "of 2 layers"):
            more(ids, **cache_kwargs(cache))
        with pytest.raises(BrokenCacheError, match="layer 2 of the model"):
            built_for(ids, **cache_kwargs(cache))
        cache.reset()
        assert torch.equal(built_for(ids, **cache_kwargs(cache)).logits, built_for(ids).logits)
    with torch.no_grad(), TieredCache(built_for.config, device_budget=8, page_size=4) as cache:
        fewer(ids, **cache_kwargs(cache))
        with pytest.raises(BrokenCacheError, match="a model of fewer layers than the config"):
            fewer(ids[:, :1], **cache_kwargs(cache))


def test_a_model_whose_attention_never_runs_through_kvtier_is_named_as_such():
    """MPT computes its attention in its own code: the prompt ran, and the next step blamed a copied config or
    detach_attention(), neither of which had happened."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("mpt", d_model=64, n_layers=2, n_heads=4, vocab_size=256, max_seq_len=512)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    ids = torch.randint(3, 256, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), TieredCache(model.config, device_budget=16, scorer="keynorm") as cache:
        model(ids, **cache_kwargs(cache))
        with pytest.raises(UnsupportedError, match="has not run through kvtier on any step: its architecture "
                                                   "computes attention in its own code"):
            model(ids[:, :1], **cache_kwargs(cache))


@pytest.mark.parametrize("failing_layer", [0, 1])
def test_a_layer_whose_first_write_runs_out_of_memory_is_made_again_by_the_retry_or_the_reset(monkeypatch,
                                                                                                failing_layer):
    """The device pool was set before the host pool was made: a MemoryError there left a half-made layer whose
    retry (layer 0: the cache not broken) or first step after reset() (layer 1: broken) failed with an
    AttributeError for good."""
    import kvtier.engine.layer as layer_module

    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    settings = dict(device_budget=16, host_budget=16, page_size=4, scorer="keynorm")
    with torch.no_grad(), TieredCache(model.config, **settings) as twin, \
            TieredCache(model.config, **settings) as cache:
        want = model(ids, **cache_kwargs(twin)).logits
        real, calls = layer_module.HostPool, []

        def failing(*args, **kwargs):
            calls.append(1)
            if len(calls) == failing_layer + 1:
                raise MemoryError("no memory for the host pool")
            return real(*args, **kwargs)

        monkeypatch.setattr(layer_module, "HostPool", failing)
        with pytest.raises(CapacityError):
            model(ids, **cache_kwargs(cache))
        monkeypatch.setattr(layer_module, "HostPool", real)
        assert (cache.broken is not None) == (failing_layer == 1)
        if cache.broken:
            cache.reset()
        assert torch.equal(model(ids, **cache_kwargs(cache)).logits, want)


def test_a_move_to_disk_interrupted_before_its_pages_are_named_gives_their_records_back(monkeypatch, tmp_path):
    """Ctrl-C between the disk store's write and the page table's naming the pages broke the cache (as it should),
    but the records stayed booked in the shared store for the cache's life: reset() frees the slots tables name.
    Cut short after naming some (the table writes chunk by chunk), the pages go back to the host, then the
    records to the store: freeing them while the table still named some had made reset() fail."""
    from kvtier.placement.page_table import DISK, PageTable

    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 80), generator=torch.Generator().manual_seed(2))
    real = PageTable.place

    def place(self, heads, pids, tier, slots, copies=None):
        if tier == DISK:   # the first page named, then the interruption
            real(self, heads[:1], pids[:1], tier, slots[:1], None if copies is None else copies[:1])
            raise KeyboardInterrupt
        return real(self, heads, pids, tier, slots, copies)

    with TieredCache(model.config, device_budget=24, host_budget=16, page_size=4, recall_pages=2, scorer="keynorm",
                     disk_dir=str(tmp_path)) as cache:
        monkeypatch.setattr(PageTable, "place", place)
        with torch.no_grad(), pytest.raises(KeyboardInterrupt):
            model(ids, **cache_kwargs(cache))
        monkeypatch.setattr(PageTable, "place", real)
        assert cache.broken is not None and cache._shared.disk_store.pages() == 0
        cache.reset()
        with torch.no_grad():
            model(ids, **cache_kwargs(cache))
        named = sum(int((e.table.tier == DISK).sum()) for e in cache._engines)
        assert named and cache._shared.disk_store.pages() == named


def test_a_reset_cache_sizes_its_read_ahead_ring_as_a_fresh_one(tmp_path):
    """reset() kept each layer's ring at the size the old sequence's first spill gave it: with a fractional host
    budget a reset cache set more host room aside and held fewer pages on the host than a fresh one."""
    model = tiny_llama()
    settings = dict(device_budget=16, host_budget=0.5, page_size=4, recall_pages=8, scorer="keynorm",
                    recent_tokens=4, sink_tokens=0, disk_dir=str(tmp_path))

    def feed(cache, n, seed):
        with torch.no_grad():
            model(torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(seed)), **cache_kwargs(cache))
        return {t: cache.stats()[t]["tokens"] for t in ("device", "host", "disk")}

    with TieredCache(model.config, **settings) as used, TieredCache(model.config, **settings) as fresh:
        feed(used, 400, 5)   # a long first sequence: its ring is sized at its first spill
        used.reset()
        assert feed(used, 60, 7) == feed(fresh, 60, 7)
        assert [e.readahead.capacity for e in used._engines] == [e.readahead.capacity for e in fresh._engines]


def test_a_copy_that_runs_short_of_memory_says_so_and_leaves_its_original_as_it_was(monkeypatch):
    """copy.deepcopy let a raw MemoryError out, where a step or a park says CapacityError and what ran short."""
    import copy

    from kvtier.tiers.host import HostPool

    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 90), generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), TieredCache(model.config, device_budget=24, page_size=4, recall_pages=2,
                                      scorer="keynorm") as cache:
        model(ids, **cache_kwargs(cache))

        def store(self, k, v):
            raise MemoryError("host memory exhausted")

        monkeypatch.setattr(HostPool, "store", store)
        with pytest.raises(CapacityError, match="copy.deepcopy could not copy the cache: out of memory"):
            copy.deepcopy(cache)
        monkeypatch.undo()
        assert cache.broken is None and cache.get_seq_length() == 90
