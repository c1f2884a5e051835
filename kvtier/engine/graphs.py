"""A layer's decode-step device work as CUDA graphs: captured once per state it depends on, then replayed.

A decode step's device work in kvtier is some twenty launches a layer, each costing the host its Python, checks
and dispatch, while the GPU work behind them is small: the step is bound by the host. A CUDA graph replays
captured launches for the cost of one. It replays exactly what it captured: kernels, shapes, addresses and scalar
arguments, reading and writing memory at those addresses at replay time. So a graph stands for a step wherever
every address and scalar the step's launches would use is the one captured: the caller says which those are, as a
key, and copies the step's inputs (the query, keys and values; the pages a prefetch brings up) into the graph's
fixed input buffers. The work must read nothing back to the host and change no host state (the caller keeps its
bookkeeping outside it), and everything it reads outside its inputs must stay allocated where the key says.

A state is captured the second step in a row it is seen (a state that lasts one step is not worth a capture; a whole
model's step, whose state lasts from one demotion to the next, is captured the first step once a capture has
succeeded: `at_once`), on a side stream, without the synchronisation and cache emptying `torch.cuda.graph` does (a
layer captures again after each demotion), and replaces the layer's graph before it (a state does not come back: a
layer's page count only grows). Each layer's graphs draw on a memory pool of their own. A pool shared by every layer
would hold less, but a graph captured after another may place its outputs where the earlier one keeps its
temporaries, and a layer's outputs are read after the next layer's replay (the prefetch on its side stream copies
the short list in, `last_recall` reads the choice): they would be overwritten. A layer's prefetch (its plan and
copy, on the side stream) is replayed from graphs of its own likewise, with a pool of its own: it runs beside the
next layers' work. Within a layer, a replay comes only once the step before is done with its outputs (its prefetch
is waited for first). A capture that fails turns the cache's graphs off for good (logged, the reason kept; one at a
state's first step only ends `at_once`): the work then runs eagerly, as it does wherever graphs are off, on a CPU, or
without CUDA.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import operator
from typing import Any, Callable

import torch

from ..native.loader import FirstUseInCapture

log = logging.getLogger(__name__)


def shapes(t: torch.Tensor) -> tuple:
    """What a graph bakes in of a tensor copied into its fixed input buffers: the buffer's shape, strides, dtype."""
    return t.shape, t.stride(), t.dtype   # a torch.Size is a tuple: it compares and hashes as one


class StepKey:
    """Which graph stands for a step: `held`, the tensors (and other objects) its launches read or write outside
    its inputs, by identity, and `values`, its scalars and its inputs' `shapes`, by equality.

    A tensor stands for what a launch bakes in of it, its address, shape, strides and dtype: kvtier changes none of
    those of a tensor in place (no ``resize_``, ``set_`` or ``.data =``), and a new tensor is a new object, even
    at a freed one's address. The key holds its objects, so none is freed while a graph keyed by it may replay, and
    no other takes its id meanwhile (a graph whose state is gone keeps its key, and what that names, until the next
    capture or `clear`: at most a slab a demotion trimmed). Comparing two keys is two C loops, where taking every
    tensor's address, shape and strides cost the host some 0.8 us a tensor, about 35 a step."""

    __slots__ = ("held", "values")

    def __init__(self, held: tuple, values: tuple) -> None:
        self.held, self.values = held, values

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StepKey):
            return NotImplemented
        return (len(self.held) == len(other.held) and all(map(operator.is_, self.held, other.held))
                and self.values == other.values)

    def __hash__(self) -> int:
        return hash((tuple(map(id, self.held)), self.values))

    def __repr__(self) -> str:
        return f"StepKey({len(self.held)} held, values={self.values!r})"


class KeyOnce:
    """A `StepKey` made on the first call and kept: a step's key is asked only where a graph may stand for the
    step, and then more than once (`functools.cache` of a new function each step would also wrap and copy the
    function's metadata, in every layer)."""

    __slots__ = ("make", "value")

    def __init__(self, make: Callable[[], StepKey]) -> None:
        self.make, self.value = make, None

    def __call__(self) -> StepKey:
        if self.make is not None:
            self.value, self.make = self.make(), None
        return self.value


class GraphSwitch:
    """Whether a cache's layers may still capture: off for all of them once a capture failed in one (a failure
    is rarely particular to a layer, and each failed capture costs a warning and a step); and the one stream
    their captures run on."""

    def __init__(self) -> None:
        self.failed: str | None = None
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def stream(self, device: torch.device) -> torch.cuda.Stream:
        """The capture stream on `device` of every graph under this switch, made on first use (the graphs'
        captures and warm-ups run one at a time). torch hands streams out of a pool of 32 in turn: a stream for
        each layer was bound to share its CUDA stream with the transfer manager's, so that a step waiting for a
        capture's warm-up also waited for the demotion copies queued there."""
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]


def _fresh_blas_workspaces() -> None:
    """Drop cuBLAS's workspaces before a capture, so that the graph's matrix products make theirs inside the
    graph's own pool. cuBLAS keeps one workspace per handle and stream, and torch builds since early 2026 drop
    every workspace of a stream when any graph captured on that stream is destroyed (pytorch/pytorch#193402): a
    graph still replaying with a workspace made outside its pool would then write into memory the allocator has
    handed to another tensor. Inside the pool, a dropped workspace is reused only by the next capture into
    that pool, which replaces the graph."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


def capture_into(graph: Any, device: torch.device, pool: Any, work: Callable[[], Any]) -> Any:
    """``work()`` captured into `graph` on the current stream, its allocations in `pool`; returns what it
    returned. A capture that fails once begun is ended and released (`release_failed_capture`) before the error
    is raised: what `work` raised, where it raised (the capture it invalidated makes `capture_end` raise one of
    its own, which would hide it)."""
    graph.capture_begin(pool=pool, capture_error_mode="thread_local")
    try:
        try:
            out = work()
        except BaseException:
            with contextlib.suppress(Exception):
                graph.capture_end()   # the stream stops capturing
            raise
        graph.capture_end()
    except BaseException:
        release_failed_capture(device, pool)
        raise
    return out


def release_failed_capture(device: torch.device, pool: Any) -> None:
    """After a capture into `pool` that failed once begun (its stream no longer capturing): stop routing the
    device's allocations to the pool and give back the capture's hold on it, which torch's `capture_end` does only
    when the capture itself ended (then the graph gives its hold back when it goes), and take the device's random
    generator out of capture mode."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        torch._C._cuda_endAllocateToPool(index, pool)
    except RuntimeError:   # capture_end got that far: the graph holds the pool, and lets it go
        pass
    else:
        torch._C._cuda_releasePool(index, pool)
    _leave_capture_rng(index)


def _leave_capture_rng(index: int) -> None:
    """Take the device's default random generator out of capture mode after a capture that failed.

    `capture_begin` puts the generator's state in capture mode and only a capture that ends takes it out, so after
    a failed one every random draw on the device outside a capture (sampling in `generate`, `torch.randn`) raises
    "Offset increment outside graph capture encountered unexpectedly". Where a draw shows it so (torch builds
    that keep a state per capture do not leave it), a copy of the state (the same seed and offset, not in capture
    mode) takes its place; graphs captured before keep the state they hold. Where the draw works, the state it
    moved on is put back, so that seeded sampling draws what it would have drawn had no capture failed."""
    generator = torch.cuda.default_generators[index]
    with torch.cuda.device(index):
        if torch.cuda.is_current_stream_capturing():
            return   # the caller's own capture: a draw would be part of it
        try:
            state = generator.get_state()
            torch.empty(1, device=torch.device("cuda", index)).uniform_()
        except RuntimeError:
            pass
        else:
            generator.set_state(state)   # draws work: the state is left as it was before the probe
            return
    try:
        generator.graphsafe_set_state(generator.clone_state())
    except (AttributeError, NotImplementedError, RuntimeError) as e:   # a torch without graph-safe states
        log.warning("after a failed CUDA graph capture, the random generator of cuda:%d could not be taken out of "
                    "capture mode (%s: %s); random draws on it may fail", index, type(e).__name__, e)


class _Captured:
    def __init__(self, graph: Any, inputs: tuple[torch.Tensor, ...], outputs: tuple[torch.Tensor, ...]) -> None:
        self.graph, self.inputs, self.outputs = graph, inputs, outputs


class StepGraphs:
    """One layer's captured decode steps, by key; counts what ran how (`captures`, `replays`, `eager`)."""

    def __init__(self, device: torch.device, enabled: bool, switch: GraphSwitch | None = None, *,
                 warm_aside: bool = False, passthrough: tuple[type, ...] = (),
                 at_once: bool = False) -> None:
        self.device = device
        # for a whole model's step: run a state's first (eager) step on the capture stream, as a warm-up of what
        # its launches set up lazily (cuBLAS handles and workspaces); `passthrough`: exceptions of the work's own
        # that are not a capture's failure (raised as they are, graphs left on)
        self.warm_aside, self.passthrough = warm_aside, passthrough
        # once a capture succeeded, capture a state the first step it is seen (where states last: a whole model's
        # step changes state only at a demotion); a capture made so that fails is not final: that state's step
        # runs eagerly (on the capture stream, with `warm_aside`), and states are captured the second step
        # again, where a failure turns graphs off as any other
        self.at_once = at_once
        # the memory pool of the layer's graphs, made with a capture; let go with its last graph (a pool no graph
        # holds is released by torch and cannot be captured into again)
        self._pool: Any = None
        self.enabled = bool(enabled) and device.type == "cuda"
        self.switch = switch if switch is not None else GraphSwitch()
        self._graph: tuple[StepKey, _Captured] | None = None   # (key, the graph captured under it)
        self._last_key: StepKey | None = None
        self._stream: torch.cuda.Stream | None = None
        self.captures = self.replays = self.eager = 0

    def run(self, key: Callable[[], StepKey], inputs: tuple[torch.Tensor, ...],
            work: Callable[..., tuple[torch.Tensor, ...]], lasting: bool = True) -> tuple[torch.Tensor, ...]:
        """``work(*inputs)``, replayed from a graph captured under ``key()`` where there is one (its outputs are
        then the graph's own tensors, rewritten by its next replay: read them within the step). `key` is
        asked only where graphs are on. `lasting=False` says the state ends with this step: with `at_once`, it
        is then not captured at its first step."""
        if not self.enabled or self.switch.failed is not None:
            return self._eager(inputs, work, aside=False)
        key = key()
        if self._graph is not None and self._graph[0] == key:
            captured = self._graph[1]
        elif key != self._last_key and not (self.at_once and self.captures and lasting):
            self._last_key = key   # first seen: run eagerly, capture if the next step is alike
            return self._eager(inputs, work, aside=self.warm_aside)
        else:
            first_seen, self._last_key = key != self._last_key, key
            captured = self._capture(key, inputs, work, final=not first_seen)
            if captured is None:
                return self._eager(inputs, work, aside=self.warm_aside and first_seen)
        for fixed, given in zip(captured.inputs, inputs):
            fixed.copy_(given)
        captured.graph.replay()
        self.replays += 1
        return captured.outputs

    def _eager(self, inputs: tuple[torch.Tensor, ...], work: Callable[..., tuple[torch.Tensor, ...]],
               aside: bool) -> tuple[torch.Tensor, ...]:
        """``work(*inputs)`` run as it is (on the capture stream where `aside`), counted once it returned: a step
        that failed, or that its work refused before any launch, is not one that ran."""
        out = self._aside(inputs, work) if aside else work(*inputs)
        self.eager += 1
        return out

    def _aside(self, inputs: tuple[torch.Tensor, ...],
               work: Callable[..., tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
        """``work(*inputs)`` on the capture stream, ordered after what the current stream queued and before what
        it queues next."""
        current = torch.cuda.current_stream(self.device)
        stream = self._side_stream()
        stream.wait_stream(current)
        try:
            with torch.cuda.stream(stream):
                return work(*inputs)
        finally:
            current.wait_stream(self._stream)

    def _side_stream(self) -> torch.cuda.Stream:
        """The stream captures (and a state's first step, with `warm_aside`) run on: the switch's."""
        if self._stream is None:
            self._stream = self.switch.stream(self.device)
        return self._stream

    @property
    def failed(self) -> str | None:
        """Why capture is off, once one failed (in this layer or another of the cache)."""
        return self.switch.failed

    def _capture(self, key: StepKey, inputs: tuple[torch.Tensor, ...],
                 work: Callable[..., tuple[torch.Tensor, ...]], final: bool = True) -> _Captured | None:
        """The graph of `work` under `key`, or None where the capture failed: then graphs are off for good if
        the failure is `final`; else states are captured the second step they are seen from then on."""
        try:
            captured = self._record(inputs, work)
        except Exception as e:   # noqa: BLE001 - any failure to capture leaves the eager path, which is exact
            self._graph = None
            if isinstance(e, self.passthrough):   # the work's own: this step does not count as the state's sight
                self._last_key = None
                raise
            if isinstance(e, FirstUseInCapture):   # a kernel's first use: the eager step loads it, the next captures
                log.info("CUDA graph capture of a decode step on %s waits a step: %s", self.device, e)
                return None
            if not final:
                self.at_once = False
                log.info("CUDA graph capture of a decode step at its state's first step failed on %s; states are "
                         "captured at their second step from now on: %s: %s", self.device, type(e).__name__, e)
                return None
            self.switch.failed = f"{type(e).__name__}: {e}"
            log.warning("CUDA graph capture of a decode step failed on %s; the cache's steps run eagerly: %s",
                        self.device, self.switch.failed)
            return None
        self._graph = (key, captured)   # the graph before goes (its replays are queued before this one's)
        self.captures += 1
        return captured

    def _record(self, inputs: tuple[torch.Tensor, ...],
                work: Callable[..., tuple[torch.Tensor, ...]]) -> _Captured:
        """``work`` captured on the side stream into the layer's pool, reading fixed copies of `inputs`; raises
        what the capture raised, its hold on the pool given back."""
        current = torch.cuda.current_stream(self.device)
        self._side_stream()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode(False):   # plain tensors: a later step outside inference mode copies into them
            fixed = tuple(torch.empty_like(t) for t in inputs)
        graph = torch.cuda.CUDAGraph()
        self._stream.wait_stream(current)   # the capture reads what the step queued before it
        # Python's garbage collector is off during a capture: a finalizer of collected garbage (another cache's
        # close, which reads back and waits on events) would run on this thread inside the capture and break it.
        # `torch.cuda.graph` collects before every capture instead, a walk over every Python object of a process
        # holding a model, and layers capture again after every demotion
        collecting = gc.isenabled()
        if collecting:
            gc.disable()
        try:
            with torch.cuda.stream(self._stream):
                _fresh_blas_workspaces()
                outputs = tuple(capture_into(graph, self.device, self._pool, lambda: work(*fixed)))
        except BaseException:
            self._pool = None   # given back by a capture that failed (a pool no graph holds is not captured into)
            raise
        finally:
            if collecting:
                gc.enable()
            current.wait_stream(self._stream)
        return _Captured(graph, fixed, outputs)

    def clear(self) -> None:
        """Let the graph go (the state it reads is going: a new recall buffer, a reset, a park, a close)."""
        self._graph = None
        self._pool = None
        self._last_key = None
