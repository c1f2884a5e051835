"""`cuda_graphs`: the setting, and what it does where no CUDA graph can be captured (the launches run eagerly).

What a replay must equal is held on the GPU (`tests/cuda/test_cuda_cache.py`); that the launches a graph would
replay repeat wherever its key does is held on the CPU (`tests/integration/test_decode_launches_repeat.py`).
"""

from __future__ import annotations

import copy
import types
import weakref

import pytest
import torch

from kvtier import TieredCache, cache_kwargs
from kvtier.engine.graphs import StepGraphs, StepKey, _Captured
from kvtier.errors import ConfigError

from tiny_models import greedy_logits, tiny_llama


def test_cuda_graphs_must_be_a_bool():
    model = tiny_llama()
    with pytest.raises(ConfigError, match=r"cuda_graphs='yes'; allowed: True or False"):
        TieredCache(model.config, cuda_graphs="yes")


def test_cuda_graphs_are_on_by_default_and_can_be_turned_off():
    """Where a cache runs on CUDA its steps replay from graphs unless asked not to; on a CPU the setting is kept
    (a copy moved to a GPU would use it) and changes nothing."""
    model = tiny_llama()
    with TieredCache(model.config, device_budget=48, recall_pages=2).take_gpu_path() as cache:
        assert cache.settings.cuda_graphs is True
        greedy_logits(model, cache, steps=4)
        assert all(not e.graphs.enabled and not e.prefetch_graphs.enabled for e in cache._engines)
        assert cache.stats()["cuda_graphs"]["replays"] == 0 and cache.stats()["cuda_graphs"]["eager_steps"] > 0
    with TieredCache(model.config, cuda_graphs=False) as cache:
        assert cache.settings.cuda_graphs is False


def test_without_cuda_the_steps_run_eagerly_with_the_same_output():
    """Asked for graphs where there is no CUDA, a cache decodes exactly as without them, counts its device
    steps as eager (none captured, none replayed, no failure), and a copy keeps the setting."""
    model = tiny_llama()
    runs = {}
    for on in (False, True):
        with TieredCache(model.config, device_budget=48, recall_pages=2, cuda_graphs=on).take_gpu_path() as cache:
            runs[on] = (greedy_logits(model, cache), cache.stats()["cuda_graphs"])
            if on:
                assert copy.deepcopy(cache).settings.cuda_graphs is True
    assert torch.equal(runs[True][0], runs[False][0])
    graphs = runs[True][1]
    assert graphs["eager_steps"] > 0 and graphs["captures"] == graphs["replays"] == 0 and graphs["failed"] is None
    ahead = graphs["prefetch"]
    assert ahead["eager"] > 0 and ahead["captures"] == ahead["replays"] == 0
    assert runs[False][1]["eager_steps"] == graphs["eager_steps"]


def test_a_prefetch_at_the_end_of_the_step_brings_up_what_the_side_stream_one_does():
    """Where steps are captured, a step's prefetch is the end of its own launches (`prefetch_in_step`) instead of
    work on the side stream: the same plan and copy after the step's attention, so the same pages come up, the
    same ones are found there next step, and the output is the same bits."""
    model = tiny_llama()
    runs = {}
    for in_step in (False, True):
        with TieredCache(model.config, device_budget=48, recall_pages=2, prefetch_pages=3).take_gpu_path() as cache:
            for engine in cache._engines:
                engine.prefetch_in_step = in_step
            out = greedy_logits(model, cache)
            s = cache.stats()
            runs[in_step] = (out, s["prefetch"], s["pages_reused"], s["pages_recalled"], s["cuda_graphs"]["prefetch"])
    assert torch.equal(runs[True][0], runs[False][0])
    assert runs[True][1:4] == runs[False][1:4] and runs[True][1]["pages"] > 0 and runs[True][1]["used"] > 0, runs
    assert runs[True][4]["eager"] == 0 and runs[False][4]["eager"] > 0   # no prefetch work of its own in the step's


def test_prefetch_in_step_follows_the_graphs_unless_set():
    """By default a step prefetches at its end only where its work is captured (graphs on and none failed)."""
    model = tiny_llama()
    with TieredCache(model.config, device_budget=48, recall_pages=2).take_gpu_path() as cache:
        greedy_logits(model, cache, steps=2)
        engine = cache._engines[0]
        assert engine._prefetches_in_step() is False   # a CPU: no graph is captured
        engine.graphs.enabled = True
        assert engine._prefetches_in_step() is True
        engine.graphs.switch.failed = "a capture failed"
        assert engine._prefetches_in_step() is False
        engine.prefetch_in_step = True
        assert engine._prefetches_in_step() is True


def test_step_graphs_on_a_cpu_never_ask_for_the_key():
    """Off (or on a CPU), `StepGraphs.run` is the work itself: the key, which costs the host, is not made."""
    graphs = StepGraphs(torch.device("cpu"), enabled=True)
    assert not graphs.enabled

    def key():
        raise AssertionError("the key was asked for")

    x = torch.arange(3.0)
    assert torch.equal(graphs.run(key, (x,), lambda t: (t * 2,))[0], x * 2)
    assert graphs.eager == 1 and graphs.replays == graphs.captures == 0


def test_step_keys_name_tensors_by_identity_and_hold_them():
    """A `StepKey` compares its held tensors by identity (never by value: no elementwise compare, no read back)
    and its values by equality, hashes alike, and keeps its tensors alive."""
    a, b = torch.zeros(4), torch.zeros(4)
    key = StepKey((a, None), (3, (torch.Size([4]), (1,), torch.float32)))
    assert key == StepKey((a, None), (3, (torch.Size([4]), (1,), torch.float32)))
    assert hash(key) == hash(StepKey((a, None), (3, ((4,), (1,), torch.float32))))
    assert key != StepKey((b, None), key.values)           # equal contents, another tensor
    assert key != StepKey((a[:], None), key.values)        # a view of it is another tensor too
    assert key != StepKey((a, None), (4, key.values[1]))   # another scalar
    assert key != StepKey((a,), key.values) and key != None   # noqa: E711 - a first step's `_last_key`
    gone = weakref.ref(b)
    held = StepKey((b,), ())
    del b
    assert gone() is not None   # held by the key: its id cannot be another tensor's while the key stands
    del held
    assert gone() is None


def test_decode_keys_repeat_until_a_demotion():
    """On the GPU's path each layer's decode step and prefetch ask for a key (here asked on the CPU too); it is
    the same from step to step, so that a captured graph is replayed, and changes where a demotion changed
    the state the launches read (the page count, a slab)."""
    model = tiny_llama()
    keys: dict[tuple, list] = {}
    run = StepGraphs.run

    def keyed(self, key, inputs, work, **kwargs):
        keys.setdefault((id(self), len(inputs)), []).append(key())
        return run(self, key, inputs, work, **kwargs)

    with TieredCache(model.config, device_budget=48, recall_pages=2).take_gpu_path() as cache:
        StepGraphs.run = keyed
        try:
            greedy_logits(model, cache, steps=60)
        finally:
            StepGraphs.run = run
        demotions = cache.stats()["demotions"]
    assert len(keys) == 2 * len(model.model.layers)   # a step's and a prefetch's, per layer
    same = sum(a == b for ks in keys.values() for a, b in zip(ks, ks[1:]))
    changed = sum(a != b for ks in keys.values() for a, b in zip(ks, ks[1:]))
    assert same >= 40 * len(keys), (same, changed)
    assert 0 < changed <= 4 * demotions + len(keys), (changed, demotions)


def test_a_decode_step_whose_write_fails_before_its_attention_is_not_taken(monkeypatch):
    """On the GPU's path a decode step's write waits for its attention (`LayerEngine.write_in_attention`); a
    failure in what it does first (making room in the pool) leaves the layer as it was: the step can be taken
    again, and decoding goes on exactly as without the failure."""
    from kvtier.errors import CapacityError
    from kvtier.tiers.device import DevicePool

    model = tiny_llama()
    with TieredCache(model.config, device_budget=48, recall_pages=2).take_gpu_path() as cache:
        want = greedy_logits(model, cache, steps=12)
    ensure, failed = DevicePool.ensure, []

    def fails_once(self, n):
        if not failed and cache._engines[0].pending is not None and cache._engines[0].pending.k.shape[2] == 1 \
                and not cache._engines[0].pending.staged and cache._engines[0].pool is self:
            failed.append(n)
            raise CapacityError("no room (injected)")
        return ensure(self, n)

    with TieredCache(model.config, device_budget=48, recall_pages=2).take_gpu_path() as cache:
        ids = torch.randint(0, 128, (1, 200), generator=torch.Generator().manual_seed(3))
        got = []
        with torch.no_grad():
            logits = model(ids, **cache_kwargs(cache)).logits[:, -1:]
            monkeypatch.setattr(DevicePool, "ensure", fails_once)
            for _ in range(12):
                token = logits.argmax(-1)
                try:
                    logits = model(token, **cache_kwargs(cache)).logits[:, -1:]
                except CapacityError:
                    assert cache._engines[0].pending is None and cache._engines[0].seen == ids.shape[1] + len(got)
                    logits = model(token, **cache_kwargs(cache)).logits[:, -1:]
                got.append(logits)
    assert failed, "no decode step's write was left to its attention"
    assert torch.equal(torch.cat(got), want)


class _StandIn(StepGraphs):
    """`StepGraphs` with stand-ins for what needs CUDA (the capture, its stream): which step it runs how, and
    what a failed capture turns off, are its own."""

    def __init__(self, fail_at=(), first_use_at=(), **kwargs):
        super().__init__(torch.device("cpu"), enabled=False, **kwargs)
        self.enabled = True
        self.fail_at, self.first_use_at, self.done, self.steps = set(fail_at), set(first_use_at), [], 0

    def _aside(self, inputs, work):
        self.done[-1] = "aside"
        return work(*inputs)

    def _record(self, inputs, work):
        if self.steps in self.first_use_at:
            from kvtier.native.loader import FirstUseInCapture

            raise FirstUseInCapture("a kernel first asked for inside the capture")
        if self.steps in self.fail_at:
            raise RuntimeError("refused during capture")
        self.done[-1] = "capture"
        return _Captured(types.SimpleNamespace(replay=lambda: None), tuple(map(torch.clone, inputs)),
                         tuple(work(*inputs)))

    def step(self, state):
        self.done.append("eager")
        self.run(lambda: StepKey((), (state,)), (torch.zeros(1),), lambda x: (x + 1,))
        if self.done[-1] == "eager" and self.replays > self._replays:
            self.done[-1] = "replay"
        self._replays, self.steps = self.replays, self.steps + 1
        return self.done[-1]

    _replays = 0


def _steps(graphs, states):
    return [graphs.step(s) for s in states]


def test_a_state_is_captured_its_second_step_or_at_once_after_a_first_capture():
    """A layer's state is captured the second step in a row it is seen; a whole model's step (`at_once`) captures
    its first state so, its first step a warm-up on the capture stream, and each later state the first step it
    is seen."""
    states = "AAABBBCD"
    assert _steps(_StandIn(), states) == \
        ["eager", "capture", "replay", "eager", "capture", "replay", "eager", "eager"]
    assert _steps(_StandIn(warm_aside=True, at_once=True), states) == \
        ["aside", "capture", "replay", "capture", "replay", "replay", "capture", "capture"]


def test_a_capture_at_once_that_fails_falls_back_to_second_step_captures():
    """A capture at a state's first step that fails is not final: the step runs eagerly on the capture stream
    (a warm-up), the state is captured the next step, and so are later ones; a capture at a second step that
    fails turns graphs off, as it always has."""
    graphs = _StandIn(fail_at={3}, warm_aside=True, at_once=True)
    assert _steps(graphs, "AAABBBCC") == \
        ["aside", "capture", "replay", "aside", "capture", "replay", "aside", "capture"]
    assert graphs.failed is None and graphs.at_once is False
    graphs = _StandIn(fail_at={3, 4}, warm_aside=True, at_once=True)
    assert _steps(graphs, "AAABBBCC") == \
        ["aside", "capture", "replay", "aside", "eager", "eager", "eager", "eager"]
    assert graphs.failed == "RuntimeError: refused during capture"


def test_a_capture_that_meets_a_kernels_first_use_waits_a_step_and_turns_nothing_off():
    """A kernel first asked for inside a capture cannot be loaded there: that capture fails, the step runs eagerly
    (loading it), the state is captured the next step, and neither graphs nor capturing at once are turned off."""
    for at in (3, 1):   # a state's first step (captured at once), a state's second step
        graphs = _StandIn(first_use_at={at}, warm_aside=True, at_once=True)
        done = _steps(graphs, "AAABBBCC")
        assert graphs.failed is None and graphs.at_once is True, at
        assert done[at] in ("eager", "aside") and done[at + 1] == "capture", (at, done)
        assert done[-2:] == ["capture", "replay"], (at, done)


def test_a_kernel_is_never_loaded_inside_a_capture(monkeypatch):
    """Asked for a kernel not loaded yet while its stream captures, the loader raises `FirstUseInCapture` and
    marks nothing: the source is not counted as failed to build, and the next ask (outside) may load it."""
    from kvtier.native import loader

    for table in ("_kernels", "_ready", "_modules"):   # as in a process that never loaded it (on a GPU one may have)
        monkeypatch.setattr(loader, table, {})
    monkeypatch.setattr(loader, "_failed", set())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    gpu = torch.device("cuda", 0)
    with pytest.raises(loader.FirstUseInCapture, match="merge_parts.cu's kvtier_merge_parts"):
        loader.kernel("merge_parts", "kvtier_merge_parts", gpu)
    assert loader.build_error("merge_parts", gpu) is None and not loader.build_failed(gpu, "merge_parts")


def test_a_state_that_ends_with_its_step_is_not_captured_at_once():
    """A state the caller says ends with its step (`lasting=False`: the step fills the pool's last slab, so the
    next adds one) runs eagerly rather than be captured for one replay; the next state is captured at once."""
    graphs = _StandIn(warm_aside=True, at_once=True)
    done = _steps(graphs, "AAA")
    graphs.done.append("eager")
    graphs.run(lambda: StepKey((), ("B",)), (torch.zeros(1),), lambda x: (x + 1,), lasting=False)
    graphs.steps += 1
    done += [graphs.done[-1]] + _steps(graphs, "CC")
    assert done == ["aside", "capture", "replay", "aside", "capture", "replay"]
