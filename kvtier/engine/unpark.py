"""Reading parked layers back ahead of their restore, on a thread of their own.

A conversation parked on disk between turns comes back when its next step starts; what makes that step wait
is reading the layers' pages and index files from disk and checking them, and putting the host pages back into
host-pool slabs (on a GPU, pinned memory: allocating it costs time of its own). Started when the application
knows the conversation is coming back (its user has started typing, its request is queued behind others), the
reads run while the application does something else, and the restore then only takes what was read. A layer
parked on the host that moved its host pages out of its pool's slabs has them put into new slabs the same way.

The reads change nothing (`ParkedLayer.read` is a pure read), so the results stand only while each layer is
still parked as it was: the cache waits for the thread and lets them go before anything changes its layers
(park, reset, close), and a restore uses a layer's result only where the layer is the one that was read. A
read that failed is simply made again by the restore, which then raises what a restore without reading ahead
would: reading ahead never changes what a restore does, only when the disk is read.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import torch

from ..tiers.host import FilledSlabs


def _nbytes(got: Any) -> int:
    """Bytes of the tensors a read holds (a layer's ``pinned`` whole tensors are counted as its cut ``k``, ``v``)."""
    if isinstance(got, torch.Tensor):
        return got.numel() * got.element_size()
    if isinstance(got, FilledSlabs):
        return got.nbytes()
    if isinstance(got, dict):
        return sum(_nbytes(value) for name, value in got.items() if name != "pinned")
    if isinstance(got, (tuple, list)):
        return sum(_nbytes(value) for value in got)
    return 0


def ahead(engine: Any) -> bool:
    """Whether `engine`'s layer has work a restore can have done ahead: parked on disk, or parked on the host with
    its host pages out of its pool's slabs (`ParkedLayer.with_host_pages`)."""
    parked = engine.parked
    if parked is None:
        return False
    return parked.where == "disk" or (parked.host_pages is not None and engine.host is not None)


class ParkedReads:
    """The reads of every layer parked on disk among `engines` and sliding-window `windows`, made on one thread
    (`start`), and the new host slabs of the layers parked on the host apart from their pool's (`ahead`).

    Layers parked on the host are not read: their entries already wait in host memory. Where the layers pin their
    host memory (a GPU), the entries are read into pinned memory, so that the restore's copy to the device runs at
    the link's speed and the pinning's own cost falls on the thread; the host slabs are pinned as the pool's are.
    """

    def __init__(self, engines: list[Any], windows: list[Any] = ()) -> None:
        self._jobs = [(e, e.parked) for e in engines if ahead(e)]
        self._windows = [(w, w.stored) for w in windows if w.stored is not None]   # their files (`ParkedFile`)
        # layer id -> (what it was parked as when read, what was read, the host bytes the read made)
        self._got: dict[int, tuple[Any, dict, int]] = {}
        self._stop = threading.Event()
        self.failed = 0                               # layers whose read failed (the restore reads them again)
        self._thread = threading.Thread(target=self._run, name="kvtier-unpark", daemon=True)

    def start(self) -> None:
        """Start the reads (apart from making the object, so that its owner holds it first: the owner's finalizer
        may run on the thread itself, even before the thread's first read, and must find it)."""
        self._thread.start()

    def _run(self) -> None:
        with torch.no_grad():   # a new thread is outside inference mode: its tensors are plain ones
            for window, stored in self._windows:
                if self._stop.is_set():
                    return
                try:
                    got = stored.read()
                    self._got[id(window)] = (stored, got, _nbytes(got))
                except BaseException:
                    self.failed += 1
            for engine, parked in self._jobs:
                if self._stop.is_set():
                    break
                try:   # pinned memory is made in the layer's device's context (a new thread's is device 0's)
                    with torch.cuda.device(engine.device) if engine.pin else contextlib.nullcontext():
                        got = parked.read(engine.disk, engine.table, engine.cfg.page_size, pin=engine.pin,
                                          host=engine.host)
                except BaseException:   # no exception is kept (it would hold frames): the restore meets it again
                    self.failed += 1
                    continue
                # a layer parked on the host: its new slabs (its entries are the parked layer's own)
                made = _nbytes(got) if parked.where == "disk" else got["slabs"].nbytes()
                self._got[id(engine)] = (parked, got, made)

    @property
    def layers(self) -> int:
        """Layers this read ahead covers."""
        return len(self._jobs) + len(self._windows)

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> float:
        """Wait for the thread; returns the seconds waited."""
        start = time.perf_counter()
        self._join()
        return time.perf_counter() - start

    def _join(self) -> None:
        # the cache's finalizer may run on this very thread (a garbage collection its reads set off): it cannot
        # wait for itself, and the stop already set ends the reads at the next layer (a read cut short by the
        # cache's close fails, and failures are kept by no one)
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def take(self, layer: Any, parked: Any) -> dict | None:
        """What was read for `layer`, if it is still `parked` as it was when read (after `wait`)."""
        read_as, got, _ = self._got.pop(id(layer), (None, None, 0))
        return got if read_as is not None and read_as is parked else None

    def held_bytes(self) -> int:
        """Host memory the reads hold now (results not yet taken; read while the thread runs)."""
        return sum(made for _, _, made in list(self._got.values()))

    def cancel(self) -> None:
        """Stop after the layer being read, wait, and let every result go."""
        self._stop.set()
        self._join()
        self._got.clear()
