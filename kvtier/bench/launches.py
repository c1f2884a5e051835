"""How many tensor operations a decode step issues per layer, kvtier against DynamicCache, by part.

On a GPU every tensor operation is a kernel launch, which costs the host a few microseconds whatever the size
of the work; a decode step that issues more launches than its GPU work can hide behind is bound by the host,
not by memory bandwidth. The count is a property of the code, not of the machine, so it is measured here on
any device: every aten operation dispatched during the counted steps is one launch, except views and
allocations (no kernel) and the operations a native kernel's torch twin runs, where the native operation
counts once (on CUDA it is one kernel launch; `kvtier.native.backend()` counts the calls). kvtier plans its
recall on the device, and chooses pages and scores entries with the native kernels, as it does on a GPU, so
the path counted is the GPU's.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .. import native
from ..integrations.hf import cache_kwargs
from ..native import twins

_PACKAGE = str(Path(__file__).resolve().parents[1]) + "/"
_OUTSIDE = tuple(_PACKAGE + d for d in ("bench/", "cli/", "__main__.py"))   # what drives the model
_TWINS = str(Path(native.__file__).resolve().parent / "twins.py")
# views and allocations: no kernel runs for these
NO_KERNEL = frozenset({"view", "_unsafe_view", "expand", "reshape", "as_strided", "slice", "select", "unsqueeze",
                       "squeeze", "permute", "transpose", "t", "alias", "detach", "split", "split_with_sizes",
                       "unbind", "narrow", "_reshape_alias", "lift_fresh", "unflatten", "flatten", "view_as_real",
                       "view_as_complex", "diagonal", "expand_as", "movedim", "empty", "empty_like",
                       "empty_strided", "new_empty", "new_empty_strided"})
HOST_READS = frozenset({"_local_scalar_dense", "equal", "is_nonzero"})   # the host waits for the device
# the part of kvtier a file belongs to, by path prefix inside the package, first match wins
PARTS = (("scoring/", "scorer"), ("recall/selector", "page choice"), ("recall/index", "page choice"),
         ("recall/codes", "page choice"), ("recall/bounds", "page choice"), ("recall/", "recall and prefetch"),
         ("engine/fetch", "recall and prefetch"), ("engine/attention", "attention over the parts"),
         ("engine/weights", "attention over the parts"), ("native/", "native kernels"),
         ("integrations/", "cache interface"), ("", "placement and bookkeeping"))
MODEL = "model"


def part_of(path: str) -> str:
    rel = path[len(_PACKAGE):]
    return next(name for prefix, name in PARTS if rel.startswith(prefix))


try:   # leaves the dispatch modes for a while: the twins' own ops then skip the counter (and its cost)
    from torch.utils._python_dispatch import _disable_current_modes as _outside_modes
except ImportError:   # pragma: no cover - older torch: the twins' ops are dispatched to it, and skipped there
    _outside_modes = contextlib.nullcontext


def _twin_names() -> list[str]:
    return [n for n in dir(twins) if inspect.isfunction(getattr(twins, n))
            and getattr(twins, n).__module__ == twins.__name__]


def _uncounted(f: Callable) -> Callable:
    def run(*args: Any, **kwargs: Any) -> Any:
        with _outside_modes():
            return f(*args, **kwargs)
    return run


class LaunchCounter(TorchDispatchMode):
    """Counts the launches dispatched under it by part (the innermost kvtier file on the Python stack, else
    the model), and the host reads of device values. A native operation's twin runs outside it (its ops are
    not the launch, the native call is), which also spares the count the twins' many small ops."""

    def __enter__(self) -> LaunchCounter:
        self._twins = {n: getattr(twins, n) for n in _twin_names()}
        for n, f in self._twins.items():
            setattr(twins, n, _uncounted(f))
        try:
            return super().__enter__()
        except BaseException:
            self._put_twins_back()
            raise

    def __exit__(self, *exc: Any) -> Any:
        try:
            return super().__exit__(*exc)
        finally:
            self._put_twins_back()

    def _put_twins_back(self) -> None:
        for n, f in self._twins.items():
            setattr(twins, n, f)

    def __init__(self) -> None:
        super().__init__()
        self.parts: Counter[str] = Counter()
        self.ops: Counter[str] = Counter()
        self.host_reads = 0
        self.in_work = False   # inside a decode step's launches-only work (what a CUDA graph replays)
        self.captured = 0      # launches counted there (tensor ops; the native calls are counted apart)
        self.counted = 0       # every launch counted (tensor ops)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in NO_KERNEL:
            self._count(name)
        return func(*args, **(kwargs or {}))

    def _count(self, name: str) -> None:
        frame, part = sys._getframe(2), None
        while frame is not None:
            path = frame.f_code.co_filename
            if path == _TWINS:
                return   # inside a native twin: the native call is the launch
            if part is None and path.startswith(_PACKAGE) and not path.startswith(_OUTSIDE):
                part = part_of(path)
            frame = frame.f_back
        self.parts[part or MODEL] += 1
        self.ops[name] += 1
        self.host_reads += name in HOST_READS
        self.captured += self.in_work
        self.counted += 1


@dataclass
class LaunchCount:
    cache: str
    layers: int
    steps: int
    parts: dict[str, int]
    native_calls: dict[str, int]
    host_reads: int
    ops: dict[str, int] = field(default_factory=dict)
    host_us: float | None = None    # `time_cache_host`, when measured
    captured: int | None = None     # launches in the steps' launches-only work (None: the cache has none)
    captured_host_us: float | None = None   # `time_cache_host`'s share of it
    key_host_us: float | None = None        # and the host time of the graphs' keys, beside it
    demotion: dict[str, int] | None = None  # a layer's demotions: how many, their launches and native calls

    @property
    def total(self) -> int:
        return sum(self.parts.values()) + sum(self.native_calls.values())

    def as_dict(self) -> dict[str, Any]:
        per = self.layers * self.steps
        parts = dict(self.parts)
        if self.native_calls:
            parts["native kernels"] = parts.get("native kernels", 0) + sum(self.native_calls.values())
        return {"cache": self.cache, "steps": self.steps, "layers": self.layers,
                "launches_per_layer_step": round(self.total / per, 1),
                "by_part_per_layer_step": {k: round(v / per, 1) for k, v in sorted(parts.items(), key=lambda x: -x[1])},
                "native_calls_per_layer_step": {k: round(v / per, 2) for k, v in self.native_calls.items()},
                "host_reads_per_step": round(self.host_reads / self.steps, 1),
                "cache_host_us_per_layer_step": None if self.host_us is None else round(self.host_us, 1),
                # of which in the work a CUDA graph replays (`TieredCache(cuda_graphs=True)`)
                "captured_launches_per_layer_step": None if self.captured is None else round(self.captured / per, 1),
                "captured_host_us_per_layer_step": (None if self.captured_host_us is None
                                                    else round(self.captured_host_us, 1)),
                # what a replay costs the host beside it: the key saying which graph stands for the step
                "graph_key_host_us_per_layer_step": (None if self.key_host_us is None
                                                     else round(self.key_host_us, 1)),
                "top_ops_per_layer_step": {k: round(v / per, 1) for k, v in Counter(self.ops).most_common(12)},
                # what one layer's demotion launches (its tensor ops and native calls; on a GPU both are launches)
                "demotions": None if self.demotion is None else self.demotion["demotions"],
                "launches_per_demotion": _per_demotion(self.demotion, "ops", "native"),
                "native_calls_per_demotion": _per_demotion(self.demotion, "native")}


def _per_demotion(demotion: dict[str, int] | None, *keys: str) -> float | None:
    if not demotion or not demotion["demotions"]:
        return None
    return round(sum(demotion[k] for k in keys) / demotion["demotions"], 1)


def count_launches(model: Any, input_ids: torch.Tensor, make_cache: Callable[[], Any], name: str, steps: int,
                   warmup: int = 2) -> tuple[LaunchCount, torch.Tensor]:
    """Prefill `input_ids` into a new cache, decode `warmup` steps, then count the launches of `steps` greedy
    decode steps; returns the count and the counted steps' tokens."""
    cache = make_cache()
    try:
        with torch.no_grad():
            logits = model(input_ids, **cache_kwargs(cache)).logits[:, -1]
            for _ in range(warmup):
                logits = model(logits.argmax(-1, keepdim=True), **cache_kwargs(cache)).logits[:, -1]
            before = _native_calls()
            counter, tokens = LaunchCounter(), []
            native_in_work = [0]

            def enter() -> None:
                counter.in_work = True
                native_in_work[0] -= sum(_native_calls().values())

            def leave() -> None:
                counter.in_work = False
                native_in_work[0] += sum(_native_calls().values())

            with _work_watched(cache, enter, leave) as watched, _demotions_watched(cache, counter) as demotion:
                for _ in range(steps):
                    nxt = logits.argmax(-1, keepdim=True)
                    tokens.append(nxt)
                    with counter:
                        logits = model(nxt, **cache_kwargs(cache)).logits[:, -1]
            after = _native_calls()
    finally:
        if hasattr(cache, "close"):
            cache.close()
    calls = {op: after[op] - before.get(op, 0) for op in after if after[op] - before.get(op, 0)}
    layers = model.config.get_text_config().num_hidden_layers
    return LaunchCount(name, layers, steps, dict(counter.parts), calls, counter.host_reads, dict(counter.ops),
                       captured=counter.captured + native_in_work[0] if watched else None,
                       demotion=demotion if hasattr(cache, "_engines") else None), torch.cat(tokens, dim=1)


@contextlib.contextmanager
def _demotions_watched(cache: Any, counter: LaunchCounter) -> Iterator[dict[str, int]]:
    """Counts, while within, the demotions of `cache`'s layers and what each launched (`counter`'s tensor ops
    and the native calls made within it); yields the counts (filled in as they come), put back on leaving."""
    got = {"demotions": 0, "ops": 0, "native": 0}
    engines = getattr(cache, "_engines", [])
    for engine in engines:
        def demote(_real=engine._demote, _counters=engine.counters) -> None:
            before, ops, calls = _counters.demotions, counter.counted, sum(_native_calls().values())
            try:
                _real()
            finally:
                if _counters.demotions > before:
                    got["demotions"] += _counters.demotions - before
                    got["ops"] += counter.counted - ops
                    got["native"] += sum(_native_calls().values()) - calls
        engine._demote = demote
    try:
        yield got
    finally:
        for engine in engines:
            engine.__dict__.pop("_demote", None)


@contextlib.contextmanager
def _work_watched(cache: Any, enter: Callable[[], None], leave: Callable[[], None],
                  keyed: Callable[[Callable[[], object]], None] | None = None) -> Iterator[bool]:
    """`enter()` and `leave()` around each decode step's launches-only work (`kvtier.engine.graphs.StepGraphs`,
    what a CUDA graph replays: the step's, and its prefetch's on the side stream) of `cache`'s layers, put back
    on leaving; yields whether the cache has any. Where its graphs are off, `keyed(key)` is called first with
    the key a graph would be looked up by (where they are on, `StepGraphs.run` computes it itself)."""
    graphs = [g for e in getattr(cache, "_engines", []) for g in (getattr(e, "graphs", None),
                                                                   getattr(e, "prefetch_graphs", None))
              if g is not None]
    for g in graphs:
        def run(key, inputs, work, *rest, _run=g.run, _g=g, **kw):
            if keyed is not None and not (_g.enabled and _g.failed is None):
                keyed(key)

            def watched(*args):
                enter()
                try:
                    return work(*args)
                finally:
                    leave()
            return _run(key, inputs, watched, *rest, **kw)
        g.run = run
    try:
        yield bool(graphs)
    finally:
        for g in graphs:
            g.__dict__.pop("run", None)


class HostClock:
    """Host time spent inside the cache's own methods during a step, less the time inside the native kernels'
    torch twins (on a GPU each is a kernel launch instead; what that costs the host, cupy's launch, is what
    `kvtier bench gpu` measures as `launch_cost`). On a CPU the rest is what the GPU's path costs the host
    in kvtier's Python, its wrappers' checks and its torch ops' dispatch, plus the CPU's own work in those ops,
    which at decode sizes is small next to their dispatch."""

    def __init__(self) -> None:
        self.inside = 0.0      # seconds inside the cache's methods
        self.twins = 0.0       # of which inside the twins
        self.work = 0.0        # of which inside the steps' launches-only work (what a CUDA graph replays)
        self.work_twins = 0.0  # and of that inside the twins
        self.keys = 0.0        # computing the keys a CUDA graph would be looked up by, outside the work
        self._work_since: float | None = None
        self._depth = 0        # cache methods nest (update runs the engine's write): count the outermost
        self._twin_depth = 0

    def method(self, f: Callable) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            self._depth += 1
            t0 = time.perf_counter()
            try:
                return f(*args, **kwargs)
            finally:
                self._depth -= 1
                if not self._depth:
                    self.inside += time.perf_counter() - t0
        return timed

    def twin(self, f: Callable) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            self._twin_depth += 1
            t0 = time.perf_counter()
            try:
                return f(*args, **kwargs)
            finally:
                self._twin_depth -= 1
                if not self._twin_depth and self._depth:
                    self.twins += time.perf_counter() - t0
                    if self._work_since is not None:
                        self.work_twins += time.perf_counter() - t0
        return timed

    def key(self, key: Callable[[], object]) -> None:
        """Time `key()`: on a GPU with `cuda_graphs` each step computes it before its replay."""
        t0 = time.perf_counter()
        key()
        self.keys += time.perf_counter() - t0

    def enter_work(self) -> None:
        self._work_since = time.perf_counter()

    def leave_work(self) -> None:
        self.work += time.perf_counter() - self._work_since
        self._work_since = None

    @property
    def host(self) -> float:
        """The cache's host time as its eager path costs it: the keys timed here (graphs off) left out."""
        return self.inside - self.twins - self.keys

    @property
    def work_host(self) -> float:
        return self.work - self.work_twins


# the methods a model calls on a cache's layers in a step (the attention function calls the last two)
_LAYER_METHODS = ("update", "attend", "commit")


@contextlib.contextmanager
def _clocked(cache: Any, clock: HostClock) -> Iterator[None]:
    """`clock` around the step methods of `cache`'s layers and around every twin, put back on leaving."""
    layers = [layer for layer in getattr(cache, "layers", []) if layer is not None]
    names = _twin_names()
    saved = {n: getattr(twins, n) for n in names}
    try:
        for layer in layers:
            for m in _LAYER_METHODS:
                if hasattr(layer, m):
                    setattr(layer, m, clock.method(getattr(layer, m)))
        for n in names:
            setattr(twins, n, clock.twin(saved[n]))
        yield
    finally:
        for n, f in saved.items():
            setattr(twins, n, f)
        for layer in layers:
            for m in _LAYER_METHODS:
                layer.__dict__.pop(m, None)


def time_cache_host(model: Any, input_ids: torch.Tensor, make_cache: Callable[[], Any], steps: int,
                    warmup: int = 2) -> tuple[float, float | None, float | None]:
    """Prefill `input_ids`, decode `warmup` steps, then return the host microseconds per layer and decode step
    spent in the cache's own code over `steps` greedy steps (`HostClock`), of those the microseconds in the
    steps' launches-only work, and the microseconds computing the keys their graphs are looked up by (what a
    step with `cuda_graphs` costs the host besides; timed here where the graphs are off, and then left out of
    the first figure), both None for a cache without such work."""
    cache = make_cache()
    clock = HostClock()
    try:
        with torch.no_grad():
            logits = model(input_ids, **cache_kwargs(cache)).logits[:, -1]
            for _ in range(warmup):
                logits = model(logits.argmax(-1, keepdim=True), **cache_kwargs(cache)).logits[:, -1]
            with _clocked(cache, clock), \
                    _work_watched(cache, clock.enter_work, clock.leave_work, clock.key) as watched:
                for _ in range(steps):
                    logits = model(logits.argmax(-1, keepdim=True), **cache_kwargs(cache)).logits[:, -1]
    finally:
        if hasattr(cache, "close"):
            cache.close()
    per = 1e6 / (model.config.get_text_config().num_hidden_layers * steps)
    if not watched:
        return per * clock.host, None, None
    return per * clock.host, per * clock.work_host, per * clock.keys


def time_decode_graph_host(model: Any, input_ids: torch.Tensor, make_cache: Callable[[], Any], steps: int,
                           warmup: int = 2) -> dict[str, Any]:
    """What a step replayed whole by `DecodeGraph` costs the host besides the replay itself: planning every
    layer's step, the step's key (what a replay is looked up by; made here though no graph is captured), and
    taking every layer's step after, in microseconds per layer and step, over the planned steps among `steps`
    greedy steps (the others run the ordinary way and are not counted); and `states`, how many runs of planned
    steps under one key there were (on a GPU, a capture each: the first state's at its second step, the others'
    at their first), with `demotions`, those the steps made."""
    from ..integrations.model_graph import DecodeGraph

    cache = make_cache()
    times = {"plan": 0.0, "key": 0.0, "take": 0.0}
    planned, keys = 0, []
    try:
        graph = DecodeGraph(model, cache)
        plan, take = graph._plan, type(cache._engines[0]).take_steady

        def timed_plan() -> Any:
            nonlocal planned
            t0 = time.perf_counter()
            plans = plan()
            if plans is not None:   # a step not planned runs the ordinary way: its planning is not counted
                times["plan"] += time.perf_counter() - t0
                planned += 1
                t0 = time.perf_counter()
                key = graph._key(plans, token)
                times["key"] += time.perf_counter() - t0
                if not keys or keys[-1] != key:
                    keys.append(key)
            return plans

        def timed_take(engine: Any, step: Any) -> None:
            t0 = time.perf_counter()
            take(engine, step)
            times["take"] += time.perf_counter() - t0

        with torch.no_grad():
            token = graph(input_ids)[:, -1:].argmax(-1)
            for _ in range(warmup):
                token = graph(token)[:, -1:].argmax(-1)
            graph._plan = timed_plan
            for engine in cache._engines:
                engine.take_steady = functools.partial(timed_take, engine)
            demotions = cache.stats()["demotions"]
            for _ in range(steps):
                token = graph(token)[:, -1:].argmax(-1)
            demotions = cache.stats()["demotions"] - demotions
    finally:
        if hasattr(cache, "close"):
            cache.close()
    if not planned:   # no step was planned whole: there is no per-step figure
        return {**dict.fromkeys(times), "total": None, "planned_steps": 0, "steps": steps, "states": 0,
                "demotions": demotions}
    per = 1e6 / (len(cache._engines) * planned)
    out = {k: round(v * per, 1) for k, v in times.items()}
    return {**out, "total": round(sum(out.values()), 1), "planned_steps": planned, "steps": steps,
            "states": len(keys), "demotions": demotions}


def _native_calls() -> dict[str, int]:
    return {op: s["kernel"] + s["twin"] for op, s in native.backend()["ops"].items()}
