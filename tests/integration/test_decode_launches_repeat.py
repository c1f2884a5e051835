"""Which launches of a decode step change from one step to the next: what stands between the step and a CUDA
graph.

A CUDA graph replays the launches it captured: the same kernels, shapes, addresses and scalar arguments. A
decode step can be captured once and replayed on later steps only where its launches repeat, the step's own
inputs (the model's query, keys and values, copied into fixed buffers before a replay) aside. This test records
every launch of kvtier's part of a layer's decode step on the GPU's path (recall planned on the device, pages
chosen, entries scored and the pool attended by the native kernels, whose launches are recorded as one call
each), on the CPU through the twins, and compares consecutive steps of each layer in which nothing was
demoted. A tensor an earlier launch of the same layer's step made is named by that launch's place in the step
(a graph's own allocations repeat); any other tensor by its address.

`DYNAMIC` is what still changes, each by the function that issues it: the launches a captured step would have
to take as inputs or make repeat. It is exact both ways, so a change that adds one fails here, and so does
one that removes one without saying so. A native operation's host-side arguments that never reach its launch
(`attend_slabs`' count when the device keeps it) are left out.
"""

from __future__ import annotations

import functools
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

import kvtier
from kvtier import TieredCache, native
from kvtier.bench.launches import NO_KERNEL
from kvtier.engine.layer import LayerEngine
from kvtier.integrations.hf import cache_kwargs

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from tiny_models import random_ids, random_kvp, small_llama  # noqa: E402

_PACKAGE = str(Path(kvtier.__file__).resolve().parent) + "/"
_LAYER = _PACKAGE + "engine/layer.py"
_NATIVE_OPS = ("attend_pages", "attend_slabs", "code_logits", "gather_pages", "kvp_score", "merge_parts",
               "pack_entries", "page_upper_bounds", "plan_recall", "rank_pages", "recall_pages", "scatter_pages")

# (launch, the kvtier function issuing it): what differs between two decode steps without a demotion, and why
DYNAMIC = {
    ("fill_", "resources.py:positions"): "the step's position, written into the tensor kept for it: an input "
                                         "of the step (once a step, at its first layer)",
}


def _layer_of(frame) -> int | None:
    while frame is not None:
        if frame.f_code.co_filename == _LAYER:
            owner = frame.f_locals.get("self")
            if isinstance(owner, LayerEngine):
                return owner.layer_idx
        frame = frame.f_back
    return None


def _issuer(frame) -> str:
    """``file:function`` of the innermost kvtier frame (the CLI and native wrappers are not issuers)."""
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(_PACKAGE) and not path.startswith(_PACKAGE + "native/"):
            return f"{Path(path).name}:{frame.f_code.co_name}"
        frame = frame.f_back
    return "?"


class StepRecorder(TorchDispatchMode):
    """Every launch of kvtier's part of each layer's step, with its arguments named as in the module's
    docstring; the native operations are recorded as one launch each (their twins' ops are not)."""

    def __init__(self, inputs: dict[int, str]) -> None:
        super().__init__()
        self.inputs = inputs                       # storage address -> the step input's name
        self.made: dict[int, tuple[int, int]] = {}  # storage address -> (layer, launch index in its step)
        self.launches: dict[int, list[tuple]] = defaultdict(list)
        self.inside_native = 0

    def name(self, a: Any, layer: int) -> Any:
        if isinstance(a, torch.Tensor):
            base = a.untyped_storage().data_ptr()
            offset = a.data_ptr() - base
            if base in self.inputs:
                where = ("input", self.inputs[base], offset)
            elif self.made.get(base, (None,))[0] == layer:
                where = ("made", self.made[base][1], offset)
            else:
                where = ("address", base, offset)
            return tuple(a.shape), tuple(a.stride()), a.dtype, where
        if isinstance(a, (list, tuple)):
            return tuple(self.name(x, layer) for x in a)
        if isinstance(a, dict):
            return tuple((k, self.name(v, layer)) for k, v in a.items())
        if isinstance(a, float) and a != a:
            return "nan"
        return a

    def note(self, op: str, issuer: str, layer: int, args: Any, kwargs: Any, out: Any) -> None:
        step = self.launches[layer]
        step.append((op, issuer, self.name(args, layer), self.name(kwargs, layer)))
        for o in out if isinstance(out, (list, tuple)) else (out,):
            if isinstance(o, torch.Tensor):   # the latest to hold an address names it (memory is reused)
                base = o.untyped_storage().data_ptr()
                self.made[base] = (layer, len(step))
                self.inputs.pop(base, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        op = func.overloadpacket.__name__
        if self.inside_native or op in NO_KERNEL:
            return out
        layer = _layer_of(sys._getframe(1))
        if layer is not None:
            self.note(op, _issuer(sys._getframe(1)), layer, args, kwargs or {}, out)
        return out


def _recorded(recorder: list[StepRecorder | None], name: str):
    real = getattr(native, name)

    @functools.wraps(real)
    def call(*args, **kwargs):
        rec = recorder[0]
        if rec is None or rec.inside_native:
            return real(*args, **kwargs)
        layer = _layer_of(sys._getframe(1))
        rec.inside_native += 1
        try:
            with _disable_current_modes():   # the twin's own ops are not launches: they skip the recorder
                out = real(*args, **kwargs)
        finally:
            rec.inside_native -= 1
        if layer is not None:
            if name == "attend_slabs" and kwargs.get("counted") is not None:
                args = (*args[:3], "count on the device", *args[4:])   # the host's count: checks and twin only
            rec.note(name, _issuer(sys._getframe(1)), layer, args, kwargs, out)
        return out
    return call


def _watch_inputs(monkeypatch, recorder: list[StepRecorder | None], inputs: dict[int, str]) -> None:
    """Name the step's inputs as the engine takes them: the keys and values `write` takes, the query `attend`
    takes (a captured step would copy them into fixed buffers first)."""
    write, attend = LayerEngine.write, LayerEngine.attend

    def name(t: torch.Tensor, what: str) -> None:
        base = t.untyped_storage().data_ptr()
        inputs[base] = what
        if recorder[0] is not None:
            recorder[0].made.pop(base, None)

    def watched_write(self, k, v):
        name(k, "keys")
        name(v, "values")
        return write(self, k, v)

    def watched_attend(self, query, *args, **kwargs):
        name(query, "query")
        return attend(self, query, *args, **kwargs)

    monkeypatch.setattr(LayerEngine, "write", watched_write)
    monkeypatch.setattr(LayerEngine, "attend", watched_attend)


def test_what_changes_between_decode_steps_is_known(monkeypatch):
    model = small_llama()   # the launches recorded are the cache's own: a small model of the default one's heads
    ids = random_ids(model, 1500, seed=4)
    recorder: list[StepRecorder | None] = [None]
    for name in _NATIVE_OPS:
        monkeypatch.setattr(native, name, _recorded(recorder, name))
    inputs: dict[int, str] = {}
    _watch_inputs(monkeypatch, recorder, inputs)
    cache = TieredCache(model.config, device_budget=0.1, recall_pages=8, scorer=random_kvp(model))
    cache.take_gpu_path()   # the GPU's path, as `kvtier bench launches` counts it
    steps, pages = [], [[True] * len(cache._engines)]   # the prefill demoted: its pages land in the next step
    try:
        with torch.no_grad():
            logits = model(ids, **cache_kwargs(cache)).logits[:, -1]
            for _ in range(6):
                inputs.clear()
                recorder[0] = StepRecorder(inputs)
                before = [e.table.n for e in cache._engines]
                with recorder[0]:
                    logits = model(logits.argmax(-1, keepdim=True), **cache_kwargs(cache)).logits[:, -1]
                steps.append(recorder[0].launches)
                pages.append([a != b.table.n for a, b in zip(before, cache._engines)])   # a demotion
                recorder[0] = None
    finally:
        cache.close()

    compared, differ = 0, Counter()
    for t in range(len(steps) - 1):
        for layer, launches in steps[t].items():
            if any(p[layer] for p in pages[t:t + 3]):
                # a step that demotes, or the next, which notes where the demoted pages landed, runs launches
                # of its own (a captured step would not be replayed on it)
                continue
            later = steps[t + 1][layer]
            assert [x[:2] for x in launches] == [x[:2] for x in later], \
                f"layer {layer}, steps {t} and {t + 1}: other launches"
            compared += 1
            differ.update({(op, issuer) for (op, issuer, *rest), other in zip(launches, later)
                           if tuple(rest) != tuple(other[2:])})
    assert compared >= len(cache._engines) * 3, compared   # most layer-steps demote nothing
    assert set(differ) == set(DYNAMIC), {"new": set(differ) - set(DYNAMIC), "gone": set(DYNAMIC) - set(differ)}


def _host_state(engine: LayerEngine) -> dict:
    """What the host keeps of a layer: each attribute of the engine and of the parts a step touches, by value
    for numbers and by identity otherwise, with the shared counters."""
    def of(obj: Any) -> dict:
        return {k: v if isinstance(v, (int, float, str, bool, type(None))) else id(v) for k, v in vars(obj).items()}
    parts = {"engine": engine, "pool": engine.pool, "index": engine.index, "table": engine.table,
             "buffer": engine.recalled, "host": engine.host, "graphs": engine.graphs}
    state = {name: of(obj) for name, obj in parts.items() if obj is not None}
    state["counters"] = {k: v if v is None or isinstance(v, (int, float, str)) else dict(v)
                         for k, v in vars(engine.counters).items()}
    return state


@pytest.mark.parametrize("in_step", [False, True], ids=["prefetch-on-side-stream", "prefetch-in-step"])
def test_decode_steps_with_one_graph_key_issue_the_same_launches(monkeypatch, in_step):
    """What a captured decode step stands for: every two steps of a layer whose keys (`_decode_key`: the
    addresses and scalars the step's device work uses; `_prefetch_key` for its prefetch) are equal issue the
    same launches, with the same arguments, at the same addresses; the work reads nothing back to the host and
    changes no host state (the bookkeeping stays outside it, so a replay skips none; the events that note reads
    of pinned memory are recorded after it, never in it). On the CPU the work runs eagerly, as it would on a
    GPU where no graph is captured; every step is compared, demoting ones included. The prefetch runs on the side
    stream from work of its own, or as the end of the step's work (`prefetch_in_step`, the default with graphs)."""
    from kvtier.bench.launches import HOST_READS
    from kvtier.engine.graphs import StepGraphs
    from kvtier.recall.index import PageIndex
    from kvtier.tiers.host import HostPool

    model = small_llama()
    ids = random_ids(model, 900, seed=5)
    recorder: list[StepRecorder | None] = [None]
    for name in _NATIVE_OPS:
        monkeypatch.setattr(native, name, _recorded(recorder, name))
    by_key: dict[tuple, dict[tuple, tuple]] = defaultdict(dict)   # layer, key -> step -> its launches
    reads: list[tuple] = []
    run = StepGraphs.run
    inside: list[bool] = [False]

    def outside_only(real):   # what notes a read of pinned memory with an event: after a replay, never in it
        def noted(*args, **kwargs):
            assert not inside[0], f"{real.__qualname__} inside the device work"
            return real(*args, **kwargs)
        return noted

    for owner, name in ((PageIndex, "note_reads"), (HostPool, "read_on")):
        monkeypatch.setattr(owner, name, outside_only(getattr(owner, name)))

    def watched(self, key, inputs, work, **kwargs):
        engine = next(e for e in cache._engines if self in (e.graphs, e.prefetch_graphs))
        k = ("step" if self is engine.graphs else "prefetch", key())

        def recorded(*args):
            before = _host_state(engine)
            # the inputs, copied into a graph's fixed buffers before a replay: the query, and the keys and values
            # where the step's write is part of the work; the pages a prefetch brings up
            names = ("query", "keys", "values") if k[0] == "step" else ("pages to prefetch",)
            recorder[0] = StepRecorder({t.untyped_storage().data_ptr(): name for t, name in zip(inputs, names)})
            inside[0] = True
            try:
                with recorder[0]:
                    out = work(*args)
            finally:
                inside[0] = False
                launches, recorder[0] = recorder[0].launches[engine.layer_idx], None
            assert _host_state(engine) == before, f"layer {engine.layer_idx}: the device work changed host state"
            reads.extend(x for x in launches if x[0] in HOST_READS)
            by_key[engine.layer_idx, k][len(by_key[engine.layer_idx, k])] = tuple(launches)
            return out

        return run(self, lambda: k, inputs, recorded, **kwargs)

    monkeypatch.setattr(StepGraphs, "run", watched)
    cache = TieredCache(model.config, device_budget=0.1, recall_pages=8, scorer=random_kvp(model))
    cache.take_gpu_path()   # the GPU's path, as `kvtier bench launches` counts it
    for engine in cache._engines:
        engine.prefetch_in_step = in_step
    try:
        with torch.no_grad():
            logits = model(ids, **cache_kwargs(cache)).logits[:, -1]
            for _ in range(20):
                logits = model(logits.argmax(-1, keepdim=True), **cache_kwargs(cache)).logits[:, -1]
    finally:
        cache.close()

    assert not reads, reads
    repeated, keys = Counter(), Counter()
    for (layer, key), steps in by_key.items():
        first = steps[0]
        assert first, f"layer {layer}: a step without launches"
        ops = Counter(x[0] for x in first)
        if key[0] == "step":   # the step's write is in it: its scores, its entry's three copies and its score's
            assert ops["kvp_score"] == 1 and ops["index_copy_"] == 4, (layer, ops)
            # its recall's plan and copy, and the prefetch's where it ends the step
            assert ops["plan_recall"] == ops["recall_pages"] == (2 if in_step else 1), (layer, ops)
        else:                  # the prefetch's: the plan and the copy, launches only
            assert ops == Counter({"plan_recall": 1, "recall_pages": 1}), (layer, ops)
        for n, launches in steps.items():
            assert [x[:2] for x in launches] == [x[:2] for x in first], f"layer {layer}: other launches, one key"
            assert launches == first, (f"layer {layer}, one key: launches differ",
                                       [(a[:2], a, b) for a, b in zip(first, launches) if a != b][:2])
        repeated[key[0]] += len(steps) - 1
        keys[key[0]] += 1
    layers = len(cache._engines)
    # most steps and prefetches find their key again (a graph would be replayed), and demotions gave new keys
    assert repeated["step"] >= layers * 10 and keys["step"] >= layers * 2, (repeated, keys)
    if in_step:
        assert keys["prefetch"] == 0, keys
    else:
        assert repeated["prefetch"] >= layers * 10 and keys["prefetch"] >= layers, (repeated, keys)
