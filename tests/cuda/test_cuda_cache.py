"""The whole cache on a GPU, in bfloat16, on tiny random-weight models (nothing to download): exact at full
budget, exact (float32) or within rounding (bfloat16) with every page recalled across many decode steps with
demotions and disk pages, the split attention over partly recalled pages against a float64 reference,
parking and `SessionStore`, the hybrid (sliding-window) path, and whole decode steps replayed from one CUDA graph
(`DecodeGraph`)."""

from __future__ import annotations

import contextlib
import gc
import sys
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

from kvtier import TieredCache, cache_kwargs
from kvtier.integrations.sessions import SessionStore

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from tiny_models import random_kvp  # noqa: E402 - the tiny models' helpers live beside the unit tests

pytestmark = pytest.mark.cuda


@contextlib.contextmanager
def _never_syncs():
    """Within it, a sync `torch.cuda.set_sync_debug_mode("error")` catches raises, and so does a host wait on an
    event or a stream that has not completed (which that mode does not see: `cudaEventSynchronize`)."""
    event_wait, stream_wait = torch.cuda.Event.synchronize, torch.cuda.Stream.synchronize

    def on_event(self):
        assert self.query(), "the host waited on an event the device had not reached"
        return event_wait(self)

    def on_stream(self):
        assert self.query(), "the host waited on a stream with work queued"
        return stream_wait(self)

    torch.cuda.synchronize()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda.Event, "synchronize", on_event)
        mp.setattr(torch.cuda.Stream, "synchronize", on_stream)
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")


def _llama(device, dtype=torch.bfloat16):
    torch.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=4, hidden_size=256, num_attention_heads=8, num_key_value_heads=2,
                      intermediate_size=512, vocab_size=512, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()


def _gemma3(device, dtype=torch.bfloat16):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(num_hidden_layers=4, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=32, intermediate_size=256, vocab_size=512, sliding_window=64,
                           layer_types=["sliding_attention", "full_attention"] * 2, attn_implementation="eager")
    return AutoModelForCausalLM.from_config(cfg).to(device=device, dtype=dtype).eval()


def _prompt(n, device, seed=1):
    return torch.randint(0, 512, (1, n), generator=torch.Generator().manual_seed(seed)).to(device)


@torch.no_grad()
def _greedy(model, cache, ids, n):
    return model.generate(ids, max_new_tokens=n, do_sample=False, **cache_kwargs(cache))


@pytest.mark.parametrize("build", [_llama, _gemma3], ids=["llama", "gemma3-hybrid"])
def test_full_budget_is_bit_identical_on_gpu(build, cuda_device):
    model = build(cuda_device)
    ids = _prompt(600, cuda_device)
    ref = _greedy(model, DynamicCache(config=model.config), ids, 24)
    with TieredCache(model.config, device_budget=1.0) as cache:
        assert torch.equal(_greedy(model, cache, ids, 24), ref)


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("build", [_llama, _gemma3], ids=["llama", "gemma3-hybrid"])
def test_every_page_recalled_over_many_steps_with_disk_pages(build, dtype, cuda_device):
    """200 decode steps at a 64-token device budget: pages demoted every few steps, some pushed to disk, all
    recalled. In float32 the greedy tokens equal DynamicCache's on the same GPU. In bfloat16 the split
    attention sums in another order than one pass over everything, and over 200 greedy steps a near-tie can
    flip a token (the Llama model did once, at step 136, on the GPU and on the CPU alike), so both caches are
    fed the same tokens and their logits must agree to bfloat16 rounding at every step."""
    model = build(cuda_device, dtype)
    ids = _prompt(700, cuda_device)
    with TieredCache(model.config, device_budget=64, host_budget=256, recall_pages=100_000, prefetch_pages=0) as cache:
        if dtype == torch.float32:
            ref = _greedy(model, DynamicCache(config=model.config), ids, 200)
            assert torch.equal(_greedy(model, cache, ids, 200), ref)
        else:
            ref_cache = DynamicCache(config=model.config)
            ref = model(ids, **cache_kwargs(ref_cache)).logits[:, -1:]
            got = model(ids, **cache_kwargs(cache)).logits[:, -1:]
            same = 0
            for _ in range(200):
                torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=2e-2)
                same += int(torch.equal(got.argmax(-1), ref.argmax(-1)))
                step = ref.argmax(-1)
                ref = model(step, **cache_kwargs(ref_cache)).logits
                got = model(step, **cache_kwargs(cache)).logits
            assert same >= 196, f"{same} of 200 greedy tokens agree"
        s = cache.stats()
        assert s["pages_recalled_from"]["host"] > 0 and s["pages_recalled_from"]["disk"] > 0
        assert s["device"]["tokens"] <= (64 + 15) * 2 * s["layers"]


def _chosen_in_buffer(engine) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pages a device-planned step chose, as its recall buffer holds them: ``(ids, k, v)``."""
    buf, ids = engine.recalled, engine.last_recall
    where = (buf.held[:, None, :] == ids[:, :, None]).to(torch.int8).argmax(-1)
    assert (buf.held.gather(1, where) == ids).all(), "a chosen page is not in the recall buffer"
    return (ids, *buf.chosen(where))


@torch.no_grad()
@pytest.mark.parametrize("on_device", [False, True], ids=["planned-on-host", "planned-on-device"])
def test_partial_recall_attends_exactly_to_what_it_chose(make_engine, cuda_device, watch_fetches, on_device):
    """With a few pages recalled of many, some on disk, the output equals float64 attention over the device
    entries, the pages the engine fetched (read back from its recall buffer) and the new token: recall planned
    on the host, and on the device (the GPU's default, its step reading the choice back for the disk pages)."""
    engine = make_engine(heads=2, head_dim=64, device_budget=128, host_budget=512, page_size=16, recall_pages=8,
                         sink_tokens=4, recent_tokens=16)
    engine.device_recall = on_device
    g = torch.Generator(device=cuda_device).manual_seed(0)
    for _ in range(16):
        k = torch.randn(1, 2, 256, 64, generator=g, device=cuda_device).to(torch.bfloat16)
        engine.write(k, k.flip(-1))
        engine.commit()
    fetched = watch_fetches(engine)
    for step in range(40):
        k = torch.randn(1, 2, 1, 64, generator=g, device=cuda_device).to(torch.bfloat16)
        engine.write(k, k.flip(-1))
        q = torch.randn(1, 6, 1, 64, generator=g, device=cuda_device).to(torch.bfloat16)
        out, _ = engine.attend(q)
        # after the attention: a device-planned step may stage its entry in its own launches
        keys, values = engine.pool.contiguous(engine.pool.count + 1)
        ids, rk, rv = _chosen_in_buffer(engine) if on_device else fetched[-1]
        assert ids.shape == (2, 8) and engine.recalled.on_device == on_device
        k_all = torch.cat([keys[0], rk], dim=1).double()
        v_all = torch.cat([values[0], rv], dim=1).double()
        ref = torch.softmax(q[0].double().reshape(2, 3, 64) @ k_all.transpose(1, 2) / 8.0, dim=-1) @ v_all
        torch.testing.assert_close(out[0, 0].double(), ref.reshape(6, 64), rtol=2e-2, atol=2e-2)
        engine.commit()
    assert engine.table.n > 100 and engine.counters.pages_recalled["disk"] > 0


@pytest.mark.parametrize("build", [_llama, _gemma3], ids=["llama", "gemma3-hybrid"])
@pytest.mark.parametrize("to", ["host", "disk"])
def test_parking_on_gpu_continues_bit_identically(cuda_device, to, tmp_path, build):
    """The hybrid model's windows leave the GPU too: to host memory, or to their files on disk."""
    model = build(cuda_device)
    ids = _prompt(500, cuda_device)
    follow = _prompt(40, cuda_device, seed=2)
    settings = dict(device_budget=64, host_budget=200, recall_pages=16, disk_dir=tmp_path, scorer="keynorm")
    with TieredCache(model.config, **settings) as parked, TieredCache(model.config, **settings) as twin:
        first = _greedy(model, parked, ids, 8)
        assert torch.equal(first, _greedy(model, twin, ids, 8))
        windows = parked.stats()["window"]["bytes"]
        before = torch.cuda.memory_allocated(cuda_device)
        parked.park(to)
        assert parked.stats()["device"]["tokens"] == 0
        assert torch.cuda.memory_allocated(cuda_device) <= before - windows
        assert parked.stats()["window"]["bytes"] == (windows if to == "host" else 0)
        owned = "allocated_bytes.current"   # pinned bytes torch's host allocator owns, in use or cached
        if owned in getattr(torch.cuda, "host_memory_stats", dict)():
            held = torch.cuda.host_memory_stats()[owned]
            twin.park(to)   # its pinned slabs go (on the host, its pages wait in memory of their size), to the system
            assert torch.cuda.host_memory_stats()[owned] < held
            twin.resume()
        more = torch.cat([first, follow], dim=1)
        assert torch.equal(_greedy(model, parked, more, 16), _greedy(model, twin, more, 16))


@pytest.mark.parametrize("op", ["host", "disk", "copy"])
@pytest.mark.parametrize("plan, prefetch", [("device", 0), ("device", None), ("host", 0)],
                         ids=["device-no-spare", "device-prefetch", "host"])
@torch.no_grad()
def test_parked_or_copied_caches_go_on_bit_for_bit_with_partial_recall(cuda_device, tmp_path, op, plan, prefetch):
    """Every step's logits (decode steps and a turn's prompt after the park or copy) equal a twin's bit for bit:
    the recall buffer comes back with the same pages in the same slots (its tables read back, where planned on the
    device), which attention over a buffer without spare slots reads in slot order."""
    import copy

    model = _llama(cuda_device)
    settings = dict(device_budget=64, host_budget=200 if op == "disk" else None, recall_pages=4, page_size=16,
                    prefetch_pages=prefetch, disk_dir=tmp_path, scorer="keynorm")
    a, b = (TieredCache(model.config, **settings) for _ in range(2))
    if plan == "host":
        for c in (a, b):
            for engine in c._engines:
                engine.device_recall = False
    try:
        logits = [model(_prompt(500, cuda_device), **cache_kwargs(c)).logits[:, -1] for c in (a, b)]
        for step in range(14):
            if step == 6:
                if op == "copy":
                    a2 = copy.deepcopy(a)
                    a.close()
                    a = a2
                    if plan == "host":
                        for engine in a._engines:
                            engine.device_recall = False
                else:
                    a.park(op)
            ids = logits[1].argmax(-1, keepdim=True) if step != 9 else _prompt(12, cuda_device, seed=step)
            logits = [model(ids, **cache_kwargs(c)).logits[:, -1] for c in (a, b)]
            assert torch.equal(logits[0], logits[1]), f"step {step}: {(logits[0] - logits[1]).abs().max()}"
        for x, y in zip(a._engines, b._engines):
            assert x.recalled.on_device == (plan == "device")
            if plan == "device":
                assert torch.equal(x.recalled.held, y.recalled.held)
            else:
                assert (x.recalled.ids == y.recalled.ids).all()
    finally:
        a.close()
        b.close()


@torch.no_grad()
def test_promotion_on_gpu_keeps_the_output_and_every_disk_record(cuda_device, tmp_path):
    """`promote=True` on the GPU (layers with disk pages: a step reads its choice back and reads the chosen disk
    pages into pinned memory): the kept pages come from those reads; the logits are the same bits as without,
    and every disk record is a disk page or a host page's clean copy."""
    import numpy as np

    from kvtier.placement.page_table import DISK, HOST

    model = _llama(cuda_device)
    ids = _prompt(500, cuda_device)
    settings = dict(device_budget=64, host_budget=120, recall_pages=16, scorer="keynorm", read_ahead=False)
    logits = []
    for promote in (False, True):
        with TieredCache(model.config, disk_dir=tmp_path / str(promote), promote=promote, **settings) as cache:
            for engine in cache._engines:
                engine.promote_every = 1
            out = [model(ids, **cache_kwargs(cache)).logits[:, -1:]]
            for _ in range(40):
                out.append(model(out[-1].argmax(-1), **cache_kwargs(cache)).logits[:, -1:])
            logits.append(torch.cat(out))
            s = cache.stats()
            assert s["pages_recalled_from"]["disk"] > 0
            if promote:
                assert s["promotion"]["pages"] > 0
                held = []
                for e in cache._engines:
                    copies = e.table.copy_slot
                    assert (e.table.tier[copies >= 0] == HOST).all()
                    held += [e.table.slot[e.table.tier == DISK], copies[copies >= 0]]
                slots = np.concatenate(held)
                assert len(np.unique(slots)) == len(slots) == cache._shared.disk_store.pages()
    assert torch.equal(logits[0], logits[1])


def test_session_store_on_gpu(cuda_device, tmp_path):
    model = _llama(cuda_device)
    caches = []
    for seed in range(3):
        cache = TieredCache(model.config, device_budget=64, host_budget=200, disk_dir=tmp_path, scorer="keynorm")
        _greedy(model, cache, _prompt(400, cuda_device, seed=seed), 2)
        caches.append(cache)
    one = caches[0].stats()
    store = SessionStore(host_bytes=one["host"]["bytes"] + one["device"]["bytes"] + one["device"]["index_bytes"])
    for i, cache in enumerate(caches):
        store.park(f"s{i}", cache)
    assert list(store.where().values()).count("disk") >= 1
    back = store.resume("s0")
    back.resume()
    assert back.parked is None and back.stats()["device"]["tokens"] > 0
    store.close()
    back.close()


@torch.no_grad()
@pytest.mark.parametrize("to", ["disk", "host"])
def test_a_cache_read_back_ahead_on_gpu_goes_on_as_one_never_parked(cuda_device, tmp_path, to):
    """`prefetch_parked` on a GPU: parked on disk, the entries are read into pinned memory on the thread, copied
    whole to the device and cut there; either way the host pages go into new pinned slabs there, which the host
    pools take; the steps after give the logits of a copy never parked, bit for bit."""
    model = _llama(cuda_device)
    settings = dict(device_budget=64, host_budget=120, recall_pages=16, scorer="keynorm")
    twin = TieredCache(model.config, disk_dir=tmp_path / "twin", **settings)
    cache = TieredCache(model.config, disk_dir=tmp_path / "parked", **settings)
    ids = _prompt(453, cuda_device)
    first = [model(ids, **cache_kwargs(c)).logits[:, -1:] for c in (twin, cache)]
    cache.park(to)
    assert cache.prefetch_parked()
    cache._state.reads.wait()
    got = next(iter(cache._state.reads._got.values()))[1]
    if to == "disk":
        assert got["pinned"][0].is_pinned() and got["k"].shape[1] <= got["pinned"][0].shape[1]
    slabs = got["slabs"]
    assert slabs.k.slabs[0].is_pinned() and slabs.v.slabs[0].is_pinned()
    made = slabs.k.slabs[0].data_ptr()
    cache.resume()
    assert cache._engines[0].host.k.slabs[0].data_ptr() == made
    out = []
    for c, logits in zip((twin, cache), first):
        steps = [logits]
        for _ in range(12):
            steps.append(model(steps[-1].argmax(-1), **cache_kwargs(c)).logits[:, -1:])
        out.append(torch.cat(steps))
    assert torch.equal(out[0], out[1]) and cache.stats()["resume_prefetch"]["layers"] == len(cache._engines)
    twin.close()
    cache.close()


def _before_a_step_that_demotes_nowhere(model, cache, token):
    """Decode from `token` until the next step demotes in no layer; returns the token that step takes."""
    for _ in range(32):
        if all(e.pool.count + 1 <= e.cfg.device_tokens(e.seen + 1) for e in cache._engines):
            break
        token = model(token, **cache_kwargs(cache)).logits[:, -1:].argmax(-1)
    return token


@torch.no_grad()
def test_a_decode_step_with_disk_pages_reads_back_once_a_layer(cuda_device):
    """Every layer with pages on disk: a decode step that does not demote waits for the GPU once a layer (the
    read back of its choice; the disk pages and their rows go up from pinned memory without a wait), with recall
    planned on the device."""
    import warnings

    from kvtier import native

    if native.kernel_status() is not None:
        pytest.skip(f"native kernels are off ({native.kernel_status()}); the twins read indices on the host")
    model = _llama(cuda_device)
    with TieredCache(model.config, device_budget=64, host_budget=120, recall_pages=8, scorer="keynorm",
                     read_ahead=False) as cache:
        out = _greedy(model, cache, _prompt(600, cuda_device), 4)
        token = _before_a_step_that_demotes_nowhere(model, cache, out[:, -1:])
        engines = cache._engines
        assert all(e.recalls_on_device() and e.holds_disk_pages() for e in engines)
        before = cache.stats()["pages_recalled_from"]["disk"]
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                logits = model(token, **cache_kwargs(cache)).logits
        finally:
            torch.cuda.set_sync_debug_mode("default")
        syncs = [str(w.message) for w in seen if "synchroniz" in str(w.message)]
        assert len(syncs) == len(engines), syncs
        assert torch.isfinite(logits).all() and cache.stats()["pages_recalled_from"]["disk"] >= before


@torch.no_grad()
def test_disk_pages_planned_on_the_device_decode_as_planned_on_the_host(cuda_device, tmp_path):
    """Layers with pages on disk, recall planned on the device (the GPU's default) and on the host, float32, no
    prefetch: the same greedy tokens over 60 steps, logits to float rounding, the same pages from each tier."""
    model = _llama(cuda_device, torch.float32)
    ids = _prompt(700, cuda_device)
    settings = dict(device_budget=64, host_budget=200, recall_pages=16, scorer="keynorm", read_ahead=False,
                    prefetch_pages=0)
    runs = []
    for on_device in (True, False):
        with TieredCache(model.config, disk_dir=tmp_path / str(on_device), **settings) as cache:
            for engine in cache._engines:
                engine.device_recall = on_device
            out = [model(ids, **cache_kwargs(cache)).logits[:, -1:]]
            for _ in range(60):
                out.append(model(out[-1].argmax(-1), **cache_kwargs(cache)).logits[:, -1:])
            runs.append((torch.cat(out), cache.stats()))
            assert all(e.holds_disk_pages() for e in cache._engines)
            assert all(e.recalled.on_device == on_device for e in cache._engines)
    (dev, dev_stats), (host, host_stats) = runs
    assert torch.equal(dev.argmax(-1), host.argmax(-1))
    torch.testing.assert_close(dev, host, rtol=1e-4, atol=1e-4)
    assert dev_stats["pages_recalled_from"] == host_stats["pages_recalled_from"]
    assert dev_stats["pages_recalled_from"]["disk"] > 0


@torch.no_grad()
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "cuda-graphs"])
def test_a_decode_step_with_host_pages_never_syncs(cuda_device, graphs):
    """With every demoted page in host memory, a decode step that recalls (and does not demote: demotion
    still waits for its copy) reads nothing back from the GPU: page choice, the recall buffer's plan and the
    copy from pinned memory all stay queued on the device, issued one by one or replayed from graphs."""
    from kvtier import native

    if native.kernel_status() is not None:
        pytest.skip(f"native kernels are off ({native.kernel_status()}); the twins read indices on the host")
    model = _llama(cuda_device)
    with TieredCache(model.config, device_budget=64, recall_pages=8, scorer="keynorm", cuda_graphs=graphs) as cache:
        out = _greedy(model, cache, _prompt(600, cuda_device), 4)
        token = _before_a_step_that_demotes_nowhere(model, cache, out[:, -1:])
        engines = cache._engines
        assert all(e.recalls_on_device() for e in engines)
        with _never_syncs():
            logits = model(token, **cache_kwargs(cache)).logits
        assert cache.stats()["pages_recalled"] > 0 and torch.isfinite(logits).all()
        assert cache.stats()["cuda_graphs"]["failed"] is None


@torch.no_grad()
def test_a_default_cache_replays_its_steps_from_cuda_graphs(cuda_device):
    """Made with no setting, a cache on CUDA captures its steps' work and replays it (what `cuda_graphs=True`
    does), and its logits equal those of the same cache made with `cuda_graphs=False`, bit for bit."""
    from kvtier import native

    if native.kernel_status() is not None:
        pytest.skip(f"native kernels are off ({native.kernel_status()}): no step runs as launches only")
    model = _llama(cuda_device)
    ids = _prompt(700, cuda_device)
    runs = {}
    for name, kwargs in (("default", {}), ("eager", {"cuda_graphs": False})):
        with TieredCache(model.config, device_budget=96, recall_pages=6, scorer="keynorm", **kwargs) as cache:
            runs[name] = (_decode_logits(model, cache, ids, 24), cache.stats()["cuda_graphs"])
    assert torch.equal(runs["default"][0], runs["eager"][0])
    got = runs["default"][1]
    assert got["failed"] is None and got["replays"] > got["eager_steps"], got
    assert runs["eager"][1]["replays"] == runs["eager"][1]["captures"] == 0


@torch.no_grad()
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "cuda-graphs"])
def test_decode_steps_that_demote_never_sync(cuda_device, graphs):
    """Steps that demote too: the planner's counts come from the host, the pool's take and remove are
    fixed-shape, the copies down are waited for only once they have landed (at the layer's next step). With
    CUDA graphs, capturing a step's work and replaying it read nothing back either."""
    from kvtier import native

    if native.kernel_status() is not None:
        pytest.skip(f"native kernels are off ({native.kernel_status()}); the twins read indices on the host")
    model = _llama(cuda_device)
    with TieredCache(model.config, device_budget=64, recall_pages=8, scorer="keynorm", cuda_graphs=graphs) as cache:
        token = _greedy(model, cache, _prompt(600, cuda_device), 4)[:, -1:]
        before = cache.counters.bytes_moved["device_to_host"]
        with _never_syncs():
            for _ in range(40):    # a page per head is demoted every 16 steps at a 64-token budget
                token = model(token, **cache_kwargs(cache)).logits[:, -1:].argmax(-1)
        assert cache.counters.bytes_moved["device_to_host"] > before
        s = cache.stats()
        assert s["prefetch"]["pages"] > 0 and s["pages_recalled"] > 0
        g = s["cuda_graphs"]
        assert g["failed"] is None and (g["replays"] > 0) == graphs, g


@torch.no_grad()
def _decode_logits(model, cache, ids, steps):
    """The logits of `steps` greedy decode steps after the prompt, ``[steps, vocab]`` float32 on the host."""
    logits = model(ids, **cache_kwargs(cache)).logits[:, -1:]
    seen = []
    for _ in range(steps):
        logits = model(logits.argmax(-1), **cache_kwargs(cache)).logits[:, -1:]
        seen.append(logits[0, 0].float().cpu())
    return torch.stack(seen)


@pytest.mark.parametrize("scorer", ["keynorm", "kvp"])
def test_decode_steps_replayed_from_cuda_graphs_equal_eager_ones(cuda_device, scorer):
    """Decode steps whose work (the write, attention and recall) is replayed from CUDA graphs (captured per
    layer and state, again after each demotion) give the same logits, bit for bit, as the same steps run
    eagerly, and as eager steps written before their attention, over enough steps for several demotions and
    recaptures; most steps are replays, and no capture failed. With KVP too, whose position features are
    computed by a step's first layer and read by the others."""
    from kvtier import native

    if native.kernel_status() is not None:
        pytest.skip(f"native kernels are off ({native.kernel_status()}): no step runs as launches only")
    model = _llama(cuda_device)
    ids = _prompt(900, cuda_device)
    runs = {}
    for name, graphs, in_attention, in_step in (("written before", False, False, None), ("eager", False, None, None),
                                                ("graphs", True, None, None), ("graphs, side prefetch", True, None,
                                                                               False)):
        kind = scorer if scorer == "keynorm" else random_kvp(model)
        with TieredCache(model.config, device_budget=96, recall_pages=6, prefetch_pages=6, scorer=kind,
                         cuda_graphs=graphs) as cache:
            for engine in cache._engines:
                engine.write_in_attention = in_attention
                engine.prefetch_in_step = in_step
            logits = _decode_logits(model, cache, ids, 64)
            s = cache.stats()
            runs[name] = (logits, s["cuda_graphs"], (s["prefetch"], s["pages_reused"], s["pages_recalled"]))
    assert torch.equal(runs["graphs"][0], runs["eager"][0])
    assert torch.equal(runs["graphs, side prefetch"][0], runs["eager"][0])
    assert torch.equal(runs["eager"][0], runs["written before"][0])
    # the same pages prefetched and found, whether on the side stream or at the end of the replayed step
    assert runs["graphs"][2] == runs["eager"][2] == runs["graphs, side prefetch"][2], runs
    assert runs["eager"][2][0]["pages"] > 0
    eager, graphs = runs["eager"][1], runs["graphs"][1]
    assert eager["replays"] == eager["captures"] == 0 and eager["eager_steps"] > 0
    assert graphs["failed"] is None, graphs["failed"]
    assert graphs["captures"] >= 2 * len(model.model.layers), graphs   # recaptured after demotions
    assert graphs["replays"] > graphs["eager_steps"], graphs
    # by default the prefetch is replayed within the step's graph; asked to, on its side stream from its own
    assert eager["prefetch"]["replays"] == 0 and graphs["prefetch"] == {"captures": 0, "replays": 0, "eager": 0}
    side = runs["graphs, side prefetch"][1]
    assert side["failed"] is None and side["prefetch"]["replays"] > side["prefetch"]["eager"], side


@torch.no_grad()
def test_steps_across_a_slab_boundary_with_a_long_short_list_replay_as_eager_and_never_sync(cuda_device):
    """A long prompt at half the device: steps that fill the first device slab, add a second, write into it at a
    base past the first, and demote back into one slab; some 250 demoted pages a head, so the short list is cut
    by `topk`; KVP scores every entry. Eager and replayed steps give the same logits bit for bit, and neither
    reads anything back from the GPU. (On the CPU, the same prompt takes the pool from 4,088 entries in one slab
    to 4,097 in two at the ninth step, and back to one slab by the thirty-second.)"""
    from kvtier import native
    from kvtier.recall.selector import SHORTLIST_MIN

    if native.kernel_status() is not None:
        pytest.skip(f"native kernels are off ({native.kernel_status()}); the twins read indices on the host")
    model = _llama(cuda_device)
    ids = _prompt(8200, cuda_device)
    scorer = random_kvp(model)
    runs = {}
    for graphs in (False, True):
        with TieredCache(model.config, device_budget=0.5, recall_pages=6, prefetch_pages=6, scorer=scorer,
                         cuda_graphs=graphs) as cache:
            logits = model(ids, **cache_kwargs(cache)).logits[:, -1:]
            pool = cache._engines[0].pool
            assert len(pool.k) == 1 and pool.count < pool.slab_tokens
            assert min(e.index.n for e in cache._engines) > SHORTLIST_MIN
            slabs, seen = set(), []
            with _never_syncs():
                for _ in range(40):
                    logits = model(logits.argmax(-1), **cache_kwargs(cache)).logits[:, -1:]
                    seen.append(logits[0, 0])
                    slabs.add(len(pool.k))
            assert slabs == {1, 2}, slabs          # a slab added, and given back after a demotion
            runs[graphs] = (torch.stack(seen).float().cpu(), cache.stats()["cuda_graphs"])
    assert torch.equal(runs[True][0], runs[False][0])
    g = runs[True][1]
    assert g["failed"] is None and g["replays"] > g["eager_steps"], g


def test_demotions_of_several_pages_keep_replays_exact_and_capture_less_often(cuda_device):
    """With a demotion moving three pages at once (`demote_pages=3`) the replayed steps still equal the eager
    ones bit for bit, and a layer demotes, and so captures again, less often than at one page a demotion."""
    from kvtier import native

    if native.kernel_status() is not None:
        pytest.skip(f"native kernels are off ({native.kernel_status()}): no step runs as launches only")
    model = _llama(cuda_device)
    ids = _prompt(900, cuda_device)
    got = {}
    for pages in (1, 3):
        for graphs in (False, True):
            with TieredCache(model.config, device_budget=96, recall_pages=6, prefetch_pages=6, scorer="keynorm",
                             demote_pages=pages, cuda_graphs=graphs) as cache:
                got[pages, graphs] = (_decode_logits(model, cache, ids, 64), cache.stats())
    for pages in (1, 3):
        assert torch.equal(got[pages, True][0], got[pages, False][0]), pages
        assert got[pages, True][1]["cuda_graphs"]["failed"] is None, got[pages, True][1]["cuda_graphs"]
    one, three = got[1, True][1], got[3, True][1]
    assert three["demotions"] < one["demotions"]
    assert three["cuda_graphs"]["captures"] < one["cuda_graphs"]["captures"], (one["cuda_graphs"],
                                                                                three["cuda_graphs"])


def test_a_failed_capture_reports_what_the_work_raised_and_the_step_runs_eagerly(cuda_device):
    """Work that breaks its capture (a device-wide sync, illegal while a stream captures) and then raises: the
    reason kept is the work's own error, not the one `capture_end` raises for the invalidated capture; the step
    runs eagerly with the right result, graphs are off for good after it, and random draws on the device work."""
    import contextlib

    from kvtier.engine.graphs import StepGraphs

    def work(x):
        y = x * 2
        if torch.cuda.is_current_stream_capturing():
            assert not gc.isenabled()   # no finalizer of collected garbage runs inside a capture
            with contextlib.suppress(RuntimeError):
                torch.cuda.synchronize()   # invalidates the capture
            raise LookupError("the work's own failure")
        return (y,)

    graphs = StepGraphs(cuda_device, enabled=True)
    x = torch.arange(8.0, device=cuda_device)
    rng = torch.cuda.get_rng_state(cuda_device)
    for _ in range(3):   # first sight eager, second captured (fails, then eager), third eager
        (y,) = graphs.run(lambda: "key", (x,), work)
        assert torch.equal(y, x * 2)
    assert graphs.failed == "LookupError: the work's own failure", graphs.failed
    assert graphs.captures == graphs.replays == 0 and graphs.eager == 3
    assert gc.isenabled()
    torch.cuda.synchronize()   # the failed capture left no stream capturing
    # nor the device's random generator in capture mode (torch leaves it so after a capture that failed): a draw
    # outside a capture works, as sampling in `generate` must; and the generator is where it was, so seeded
    # sampling draws what it would have drawn without the failed capture (the check's own probe draw undone)
    assert torch.equal(torch.cuda.get_rng_state(cuda_device), rng)
    assert torch.randn(4, device=cuda_device).isfinite().all()


@pytest.mark.parametrize("case", ["reset", "narrow"])
def test_cuda_graphs_capture_again_after_their_layer_lets_them_go(cuda_device, case):
    """A layer lets its graph go when its recall buffer is remade (while it has fewer pages than it recalls,
    the buffer widens) or the cache is reset; it captures again afterwards (a new memory pool: torch releases
    one no graph holds), decoding as the eager steps do, and no capture fails."""
    from kvtier import native

    if native.kernel_status() is not None:
        pytest.skip(f"native kernels are off ({native.kernel_status()}): no step runs as launches only")
    model = _llama(cuda_device)
    prompt, budget, steps = (900, 96, 40) if case == "reset" else (40, 32, 150)
    ids = _prompt(prompt, cuda_device)
    with TieredCache(model.config, device_budget=budget, recall_pages=8, prefetch_pages=6) as cache:
        want = _decode_logits(model, cache, ids, steps)
    with TieredCache(model.config, device_budget=budget, recall_pages=8, prefetch_pages=6, cuda_graphs=True) as cache:
        if case == "reset":
            _decode_logits(model, cache, ids, steps)
            before = cache.stats()["cuda_graphs"]["captures"]
            cache.reset()
        got = _decode_logits(model, cache, ids, steps)
        g = cache.stats()["cuda_graphs"]
    assert torch.equal(got, want)
    assert g["failed"] is None, g["failed"]
    assert g["captures"] > (before if case == "reset" else 2 * len(model.model.layers)), g


@torch.no_grad()
@pytest.mark.parametrize("graphs, in_step", [(False, None), (True, False), (True, None)],
                         ids=["eager", "cuda-graphs-side-prefetch", "cuda-graphs-prefetch-in-step"])
def test_prefetch_on_a_delayed_side_stream_into_poisoned_slots(cuda_device, monkeypatch, graphs, in_step):
    """The prefetch runs on its own stream, here held back by a long sleep before each one, into recall
    buffers whose slots start as NaN: a step that read a slot before its prefetch landed would decode NaN or
    other tokens. The tokens equal those of the same cache run with neither, and the prefetch is counted;
    also where the steps are replayed from CUDA graphs, with the prefetch replayed on its stream from graphs of
    its own, or (the default with graphs) within the step's graph, where nothing runs on the side stream."""
    from kvtier.recall.buffer import RecallBuffer
    from kvtier.transfer.cuda_streams import CudaTransferManager

    model = _llama(cuda_device)
    ids = _prompt(900, cuda_device)
    with TieredCache(model.config, device_budget=96, recall_pages=6, prefetch_pages=6) as cache:
        want = _greedy(model, cache, ids, 48)
    made, run_ahead = RecallBuffer.__init__, CudaTransferManager.run_ahead

    def poisoned(self, *args, **kwargs):
        made(self, *args, **kwargs)
        self.k.fill_(float("nan"))
        self.v.fill_(float("nan"))

    def delayed(self, work, uses=()):
        def late():
            torch.cuda._sleep(2_000_000)     # a few milliseconds on the side stream, before the copies
            work()
        return run_ahead(self, late, uses)

    monkeypatch.setattr(RecallBuffer, "__init__", poisoned)
    monkeypatch.setattr(CudaTransferManager, "run_ahead", delayed)
    with TieredCache(model.config, device_budget=96, recall_pages=6, prefetch_pages=6, cuda_graphs=graphs) as cache:
        for engine in cache._engines:
            engine.prefetch_in_step = in_step
        got = _greedy(model, cache, ids, 48)
        s = cache.stats()
    assert torch.equal(got, want)
    assert s["prefetch"]["pages"] > 0 and s["prefetch"]["used"] > 0
    assert (s["cuda_graphs"]["replays"] > 0) == graphs, s["cuda_graphs"]
    # replayed behind the sleep on the side stream, or within the step's own graph
    assert (s["cuda_graphs"]["prefetch"]["replays"] > 0) == (graphs and in_step is False), s["cuda_graphs"]


@pytest.mark.parametrize("impl", ["flash_attention_2", "flash_attention_3"])
def test_flash_attention_decodes_like_dynamic_cache(cuda_device, impl):
    """Flash attention, where installed: the model's own attention at full budget and the 2D padding mask."""
    import importlib.util

    if importlib.util.find_spec({"flash_attention_2": "flash_attn",
                                 "flash_attention_3": "flash_attn_interface"}[impl]) is None:
        pytest.skip(f"{impl} is not installed")
    model = _llama(cuda_device)
    model.config._attn_implementation = impl
    ids = _prompt(600, cuda_device)
    ref_cache = DynamicCache(config=model.config)
    with TieredCache(model.config, device_budget=64, recall_pages=100_000, prefetch_pages=0) as cache, torch.no_grad():
        model(ids, **cache_kwargs(ref_cache))
        model(ids, **cache_kwargs(cache))
        step = ids[:, -1:]
        for _ in range(8):   # decode steps that recall every page: the same logits as flash over everything
            ref = model(step, **cache_kwargs(ref_cache)).logits
            got = model(step, **cache_kwargs(cache)).logits
            torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2)
            step = ref[:, -1:].argmax(-1)
        assert cache.stats()["pages_recalled"] > 0


@torch.no_grad()
def test_page_choice_by_the_kernels_chooses_as_the_matrix_products(cuda_device):
    """On CUDA with cupy, page choice runs the native kernels (the bounds of every index slab, the code
    estimates of the short list), with nothing read back, and chooses what the matrix products choose (their
    sums round in other orders, so a near-tie may differ; nearly every page must agree)."""
    from kvtier import native

    if native.kernel_status() is not None:
        pytest.skip(f"native kernels are off ({native.kernel_status()})")
    model = _llama(cuda_device)
    ids = _prompt(2400, cuda_device)     # 146 pages per head: past the 96-page short list
    chosen = {}
    for kernels in (False, True):
        with TieredCache(model.config, device_budget=64, recall_pages=8, scorer="keynorm") as cache:
            token = model(ids, **cache_kwargs(cache)).logits[:, -1:].argmax(-1)
            for e in cache._engines:
                e.index.native_select = kernels
            # one step first: the first recall after a prefill makes per-device tables (a blocking copy once)
            token = model(token, **cache_kwargs(cache)).logits[:, -1:].argmax(-1)
            native.reset_stats()
            with _never_syncs():
                model(token, **cache_kwargs(cache))
            chosen[kernels] = [e.last_recall.cpu() for e in cache._engines]
            ran = native.backend()["ops"]
            # the short list's estimates: `rank_pages` (one launch) where it fits a block, else `code_logits`
            estimates = sum(ran.get(op, {}).get("kernel", 0) for op in ("rank_pages", "code_logits"))
            if kernels:
                assert ran["page_upper_bounds"]["kernel"] >= len(cache._engines)
                assert estimates >= len(cache._engines), ran
            else:
                assert not {"rank_pages", "code_logits", "page_upper_bounds"} & set(ran), ran
    same = sum(len(set(a[h].tolist()) & set(b[h].tolist())) for a, b in zip(chosen[False], chosen[True])
               for h in range(a.shape[0]))
    total = sum(a.numel() for a in chosen[False])
    assert same >= 0.9 * total, f"{same} of {total} chosen pages agree"


def _steps_through(step, ids, steps):
    """`_decode_logits` through a callable that takes a token and returns logits (a `DecodeGraph`)."""
    with torch.no_grad():
        logits = step(ids)[:, -1:]
        seen = []
        for _ in range(steps):
            logits = step(logits.argmax(-1))[:, -1:]
            seen.append(logits[0, 0].float().cpu())
    return torch.stack(seen)


@pytest.mark.parametrize("scorer", ["keynorm", "kvp"])
def test_whole_decode_steps_replayed_from_one_graph_equal_ordinary_ones(cuda_device, scorer):
    """`DecodeGraph`: the model's decode step and every layer's captured as one CUDA graph, replayed where the step
    is steady, gives the logits of ordinary steps bit for bit (and of the same steps launched eagerly), with the
    same counters, over enough steps for several demotions and captures; every step but the first two replays."""
    from kvtier import DecodeGraph, native

    if native.kernel_status() is not None:
        pytest.skip(f"native kernels are off ({native.kernel_status()}): no step runs as launches only")
    model = _llama(cuda_device)
    ids = _prompt(900, cuda_device)
    runs = {}
    for name in ("ordinary", "one graph", "planned, eager"):
        kind = scorer if scorer == "keynorm" else random_kvp(model)
        with TieredCache(model.config, device_budget=96, recall_pages=6, prefetch_pages=6, scorer=kind) as cache:
            step = (lambda t: model(t, **cache_kwargs(cache)).logits) if name == "ordinary" else \
                DecodeGraph(model, cache, enabled=name == "one graph")
            logits = _steps_through(step, ids, 64)
            s = cache.stats()
            s.pop("cuda_graphs")            # the layers' own graphs count the steps they ran
            s.pop("transfer_wait_seconds")  # a time, not a count
            runs[name] = (logits, s, None if name == "ordinary" else step.stats())
    assert torch.equal(runs["one graph"][0], runs["ordinary"][0])
    assert torch.equal(runs["planned, eager"][0], runs["ordinary"][0])
    assert runs["one graph"][1] == runs["ordinary"][1] == runs["planned, eager"][1]
    g = runs["one graph"][2]
    assert g["failed"] is None, g["failed"]
    assert g["replays"] > g["eager"] + g["ordinary"] and g["captures"] >= 2, g
    # the prompt and the first step ran the ordinary way, the first state's first step as a warm-up; every later
    # state (one a demotion: the demoting steps were replayed) was captured the first step it was seen
    assert g["ordinary"] == 2 and g["eager"] == 1, g
    assert gc.isenabled()   # off during each capture only
    e = runs["planned, eager"][2]
    assert e["replays"] == e["captures"] == 0 and e["eager"] > 0, e


@torch.no_grad()
def test_graphs_replaced_after_demotions_write_nothing_outside_their_memory(cuda_device):
    """Each demotion replaces the `DecodeGraph`'s graph by one captured on the same stream. Memory freed then and
    handed to a new tensor (after `empty_cache`, as an allocation near the device's limit would) is never written
    by a graph still replaying: on torch builds where a destroyed graph drops the cuBLAS workspace of its stream
    (pytorch/pytorch#193402), a live graph whose products used a workspace made outside its pool would write
    into it. Sentinel tensors keep their bytes, and the logits are the ordinary steps'. On a torch build without
    that change (2.11 is one) the sentinels cannot tell, and only the logits hold the graphs to account."""
    from kvtier import DecodeGraph, native

    if native.kernel_status() is not None:
        pytest.skip(f"native kernels are off ({native.kernel_status()}): no step runs as launches only")
    model = _llama(cuda_device)
    ids = _prompt(900, cuda_device)
    kwargs = {"device_budget": 96, "recall_pages": 6, "prefetch_pages": 6, "scorer": "keynorm"}
    with TieredCache(model.config, **kwargs) as cache:
        want = _steps_through(lambda t: model(t, **cache_kwargs(cache)).logits, ids, 64)
    sentinels = []
    with TieredCache(model.config, **kwargs) as cache:
        graph = DecodeGraph(model, cache)
        logits, seen = graph(ids)[:, -1:], []
        for _ in range(64):
            logits = graph(logits.argmax(-1))[:, -1:]
            seen.append(logits[0, 0].float().cpu())
            if graph.stats()["captures"] > len(sentinels):   # a graph was just captured, the one before it gone
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
                sentinels.append(torch.full((32 << 20,), 0x5A, dtype=torch.uint8, device=cuda_device))
        torch.cuda.synchronize()
        assert graph.stats()["captures"] >= 2 and graph.stats()["failed"] is None, graph.stats()
    assert all(bool((s == 0x5A).all()) for s in sentinels)
    assert torch.equal(torch.stack(seen), want)


def test_a_caches_captures_share_one_stream_apart_from_its_transfers(cuda_device):
    """Every layer's step and prefetch graphs capture on the cache's one capture stream, which here (nothing
    else takes streams) is none of the transfer manager's (torch hands streams out of a pool of 32 in turn: a
    stream for each layer and its prefetch was bound to share)."""
    model = _llama(cuda_device)
    with TieredCache(model.config, device_budget=96, recall_pages=6, scorer="keynorm") as cache:
        _decode_logits(model, cache, _prompt(700, cuda_device), 8)
        engines = cache._engines
        captures = {g._side_stream().cuda_stream for e in engines for g in (e.graphs, e.prefetch_graphs)}
        transfers = {s.cuda_stream for m in cache._shared.transfers.values() for s in m._streams.values()}
        assert len(captures) == 1 and not captures & transfers, (captures, transfers)
        assert cache.stats()["cuda_graphs"]["replays"] > 0


def test_whole_steps_captured_under_inference_mode_go_on_outside_it(cuda_device):
    """A `DecodeGraph` made and captured while the model runs under `torch.inference_mode()` copies each step's
    token and position into plain tensors: later steps under `no_grad` only replay (the cache is not broken),
    with the logits of ordinary steps. (The layers' own graphs capture under the cache's guard, which leaves
    inference mode: a whole step's capture does not.)"""
    from kvtier import DecodeGraph, native

    if native.kernel_status() is not None:
        pytest.skip(f"native kernels are off ({native.kernel_status()}): no step runs as launches only")
    model = _llama(cuda_device)
    ids = _prompt(700, cuda_device)
    runs = {}
    for whole in (False, True):
        with TieredCache(model.config, device_budget=96, recall_pages=6, scorer="keynorm") as cache:
            seen = []
            with torch.inference_mode():
                step = DecodeGraph(model, cache) if whole else (lambda t: model(t, **cache_kwargs(cache)).logits)
                logits = step(ids)[:, -1:]
                for _ in range(16):
                    logits = step(logits.argmax(-1))[:, -1:]
                    seen.append(logits[0, 0].float().cpu())
                replays = step.stats()["replays"] if whole else None
            with torch.no_grad():
                for _ in range(16):
                    logits = step(logits.argmax(-1))[:, -1:]
                    seen.append(logits[0, 0].float().cpu())
            runs[whole] = torch.stack(seen)
            if whole:
                g = step.stats()
                assert g["failed"] is None and replays > 0 and g["replays"] > replays, g
    assert torch.equal(runs[True], runs[False])


@torch.no_grad()
def test_a_whole_step_replayed_from_one_graph_never_syncs(cuda_device):
    """A replayed whole step (planning every layer's step, copying the token and its position in, the replay,
    taking the steps after) reads nothing back from the GPU."""
    from kvtier import DecodeGraph, native

    if native.kernel_status() is not None:
        pytest.skip(f"native kernels are off ({native.kernel_status()})")
    model = _llama(cuda_device)
    with TieredCache(model.config, device_budget=64, recall_pages=8, scorer="keynorm") as cache:
        graph = DecodeGraph(model, cache)
        token = graph(_prompt(600, cuda_device))[:, -1:].argmax(-1)
        for _ in range(40):   # until a step replays, and the next one would too (no demotion ahead)
            token = graph(token)[:, -1:].argmax(-1)
            if graph.stats()["replays"] and all(e.pool.count + 1 <= e.cfg.device_tokens(e.seen + 1)
                                                for e in cache._engines):
                break
        replays = graph.stats()["replays"]
        assert replays > 0, graph.stats()
        with _never_syncs():
            logits = graph(token)
        assert graph.stats()["replays"] == replays + 1 and torch.isfinite(logits).all()


@torch.no_grad()
def test_generate_with_whole_steps_replayed_equals_generate(cuda_device):
    """`DecodeGraph.generate` on a GPU: `model.generate` over the cache with its one-token steps replayed from one
    graph each; the same tokens and logits as `model.generate`, most steps replayed."""
    from kvtier import DecodeGraph, native

    if native.kernel_status() is not None:
        pytest.skip(f"native kernels are off ({native.kernel_status()})")
    model = _llama(cuda_device)
    ids = _prompt(700, cuda_device)
    kwargs = dict(max_new_tokens=48, min_new_tokens=48, do_sample=False, output_logits=True,
                  return_dict_in_generate=True)
    with TieredCache(model.config, device_budget=96, recall_pages=6, scorer="keynorm") as cache:
        want = model.generate(ids, **kwargs, **cache_kwargs(cache))
    with TieredCache(model.config, device_budget=96, recall_pages=6, scorer="keynorm") as cache:
        graph = DecodeGraph(model, cache)
        got = graph.generate(ids, **kwargs)
    assert torch.equal(got.sequences, want.sequences)
    assert torch.equal(torch.stack(got.logits), torch.stack(want.logits))
    s = graph.stats()
    assert s["failed"] is None and s["replays"] > s["eager"] + s["ordinary"], s
