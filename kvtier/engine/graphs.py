"""A layer's decode-step device work as CUDA graphs: captured once per state it depends on, then replayed.

A decode step's device work in kvtier is some twenty launches a layer, each costing the host its Python,
checks and dispatch, while the GPU work behind them is small: the step is bound by the host. A CUDA graph
replays captured launches for the cost of one. It replays exactly what it captured: kernels, shapes,
addresses and scalar arguments, reading and writing memory at those addresses at replay time. So a graph
stands for a step wherever every address and scalar the step's launches would use is the one captured: the
caller says which those are, as a key, and copies the step's inputs (the query) into the graph's fixed input
buffers. The work must read nothing back to the host and change no host state (the caller keeps its
bookkeeping outside it), and everything it reads outside its inputs must stay allocated where the key says.

A state is captured the second step in a row it is seen (a state that lasts one step is not worth a
capture), on a side stream, without the synchronisation and cache emptying `torch.cuda.graph` does (a layer
captures again after each demotion). The graphs of a cache share one memory pool: they run one after another
on one stream, and what one returns is held until it is replaced. A capture that fails turns the layer's
graphs off for good (logged once, the reason kept): the work then runs eagerly, as it does wherever graphs
are off, on a CPU, or without CUDA.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any, Callable

import torch

log = logging.getLogger(__name__)

KEEP = 2   # graphs kept per layer: the current state's and the one before (a state may come back)


class GraphPool:
    """The memory pool a cache's graphs share on each device (made with the first capture there)."""

    def __init__(self) -> None:
        self._handles: dict[torch.device, Any] = {}

    def handle(self, device: torch.device) -> Any:
        if device not in self._handles:
            self._handles[device] = torch.cuda.graph_pool_handle()
        return self._handles[device]


class _Captured:
    def __init__(self, graph: Any, inputs: tuple[torch.Tensor, ...], outputs: tuple[torch.Tensor, ...]) -> None:
        self.graph, self.inputs, self.outputs = graph, inputs, outputs


class StepGraphs:
    """One layer's captured decode steps, by key; counts what ran how (`captures`, `replays`, `eager`)."""

    def __init__(self, device: torch.device, pool: GraphPool, enabled: bool) -> None:
        self.device, self.pool = device, pool
        self.enabled = bool(enabled) and device.type == "cuda"
        self.failed: str | None = None   # why capture is off for this layer, once one failed
        self._graphs: OrderedDict[tuple, _Captured] = OrderedDict()
        self._last_key: tuple | None = None
        self._stream: torch.cuda.Stream | None = None
        self.captures = self.replays = self.eager = 0

    def run(self, key: Callable[[], tuple], inputs: tuple[torch.Tensor, ...],
            work: Callable[..., tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
        """``work(*inputs)``, replayed from a graph captured under ``key()`` where there is one (its outputs are
        then the graph's own tensors, rewritten by its next replay: read them within the step). `key` is
        asked only where graphs are on."""
        if not self.enabled or self.failed is not None:
            self.eager += 1
            return work(*inputs)
        key = key()
        captured = self._graphs.get(key)
        if captured is None:
            if key != self._last_key:   # first seen: run eagerly, capture if the next step is alike
                self._last_key = key
                self.eager += 1
                return work(*inputs)
            captured = self._capture(key, inputs, work)
            if captured is None:
                self.eager += 1
                return work(*inputs)
        else:
            self._graphs.move_to_end(key)
        for fixed, given in zip(captured.inputs, inputs):
            fixed.copy_(given)
        captured.graph.replay()
        self.replays += 1
        return captured.outputs

    def _capture(self, key: tuple, inputs: tuple[torch.Tensor, ...],
                 work: Callable[..., tuple[torch.Tensor, ...]]) -> _Captured | None:
        current = torch.cuda.current_stream(self.device)
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        fixed = tuple(torch.empty_like(t) for t in inputs)
        graph = torch.cuda.CUDAGraph()
        self._stream.wait_stream(current)   # the capture reads what the step queued before it
        try:
            with torch.cuda.stream(self._stream):
                graph.capture_begin(pool=self.pool.handle(self.device), capture_error_mode="thread_local")
                try:
                    outputs = tuple(work(*fixed))
                finally:
                    graph.capture_end()
        except Exception as e:   # noqa: BLE001 - any failure to capture leaves the eager path, which is exact
            self.failed = f"{type(e).__name__}: {e}"
            self._graphs.clear()
            log.warning("CUDA graph capture of a decode step failed on %s; this layer's steps run eagerly: %s",
                        self.device, self.failed)
            return None
        finally:
            current.wait_stream(self._stream)
        captured = self._graphs[key] = _Captured(graph, fixed, outputs)
        while len(self._graphs) > KEEP:
            self._graphs.popitem(last=False)
        self.captures += 1
        return captured

    def clear(self) -> None:
        """Let every graph go (the state they read is going: a reset, a park, a close)."""
        self._graphs.clear()
        self._last_key = None
