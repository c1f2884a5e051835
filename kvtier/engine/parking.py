"""Parking a layer between conversation turns: its device entries (and host pages) go to host memory or
disk, and come back before the layer's next write, exactly as they were.

A layer parked on the host keeps its device entries (pinned) and its recall index in host memory. A layer
parked on disk writes the entries as checksummed pages to a parking file and the index to a checksummed file
beside it, and moves its host pages into its disk store, remembering which they were so resuming puts them
back on the host: the resumed layer is in the very state it was parked in, so decoding continues
bit-identically. Resuming is lazy: each layer restores at its own first write, so restoring interleaves with
the next turn's prefill, layer by layer.
"""

from __future__ import annotations

import math
import os
import zlib
from dataclasses import dataclass

import numpy as np
import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from ..errors import ConfigError, CorruptPageError
from ..placement.page_table import DISK, HOST
from ..recall import PageIndex
from ..tiers.disk import DiskStore

PARK_TARGETS = ("host", "disk")


@dataclass
class Parked:
    """Where a parked layer's entries are."""

    where: str
    count: int                                    # device entries per head when parked
    host: tuple[torch.Tensor, ...] | None = None  # k, v [heads, n, dim]; pos, score [heads, n]
    crcs: np.ndarray | None = None                # [heads, pages] of the parking file
    was_on_host: np.ndarray | None = None         # [heads, pages] page-table cells to bring back to the host
    index: PageIndex | None = None                # the recall index, in host memory
    index_crc: int | None = None                  # ... or in a file of the private folder, with its CRC-32
    index_file_bytes: int = 0


def park(engine, to: str) -> None:
    """Move everything the layer holds on the device (and, for disk, on the host) down to `to`."""
    if to not in PARK_TARGETS:
        raise ConfigError(f"park to {to!r}; allowed: {', '.join(map(repr, PARK_TARGETS))}")
    engine.flush()
    if engine.pool is None:
        return
    current: Parked | None = engine.parked
    if current is not None and (current.where == to or current.where == "disk"):
        return
    if current is None:
        k, v, pos, score = engine.pool.committed()
        pin = engine.device.type == "cuda"
        staged = [torch.empty(t.shape[-3:] if t.dim() == 4 else t.shape, dtype=t.dtype, pin_memory=pin)
                  for t in (k, v, pos, score)]
        sources = (k[0], v[0], pos, score)
        engine.transfer.wait([engine.transfer.submit(d, s) for d, s in zip(staged, sources)])
        index = engine.index.first(engine.table.n).to("cpu")
        current = Parked("host", engine.pool.count, tuple(staged), index=index)
        engine.counters.bytes_moved["device_to_host"] += _bytes(staged[:2]) + index.nbytes()
        engine.pool.clear()
        engine.index = engine.index.first(0).to(engine.device)   # a copy: the old storage is let go
    if to == "disk":
        current = _to_disk(engine, current)
    engine.parked = current


def _to_disk(engine, parked: Parked) -> Parked:
    k, v, pos, score = parked.host
    H, n = pos.shape
    P = engine.cfg.page_size
    pages = max(1, math.ceil(n / P))
    pad = pages * P - n

    def paged(t: torch.Tensor, fill: float) -> torch.Tensor:
        if pad:
            t = torch.cat([t, t.new_full((H, pad, *t.shape[2:]), fill)], dim=1)
        return t.reshape(H * pages, P, *t.shape[2:])

    heads = np.repeat(np.arange(H), pages)
    ids = np.tile(np.arange(pages), H)
    counts = np.clip(n - ids * P, 0, P)
    store = _parking_store(engine)
    crcs = store.write_many(heads, ids, counts, paged(k, 0), paged(v, 0), paged(pos, -1), paged(score, float("-inf")))
    was_on_host = None
    if engine.host is not None and engine.table.n:
        was_on_host = engine.table.tier[:, :engine.table.n] == HOST
        h, p = np.nonzero(was_on_host)
        if len(h):
            engine.move_host_pages_to_disk(h, p)
        engine.host.clear()
    crc, size = _index_to_disk(engine, parked.index)
    return Parked("disk", n, None, crcs.reshape(H, pages), was_on_host, None, crc, size)


def _index_path(engine) -> str:
    return os.path.join(engine._disk_dir(), f"layer{engine.layer_idx}.parked-index.safetensors")


def _index_to_disk(engine, index: PageIndex) -> tuple[int, int]:
    data = save_tensors({name: t.contiguous() for name, t in index.tensors().items()})
    with open(_index_path(engine), "wb") as f:
        f.write(data)
    return zlib.crc32(data), len(data)


def _index_from_disk(engine, crc: int) -> PageIndex:
    path = _index_path(engine)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError as e:
        raise CorruptPageError(f"the parked recall index of layer {engine.layer_idx} is missing ({path})") from e
    if zlib.crc32(data) != crc:
        raise CorruptPageError(f"the parked recall index of layer {engine.layer_idx} fails its CRC-32 check "
                               f"({path})")
    os.remove(path)
    return PageIndex(**load_tensors(data))


def _parking_store(engine) -> DiskStore:
    if engine.parking is None:
        engine.parking = DiskStore(engine._disk_dir(), engine.layer_idx, engine.heads, engine.cfg.page_size,
                                   engine.head_dim, engine.dtype, name="parked")
    return engine.parking


def restore(engine) -> None:
    """Bring a parked layer back to the state it was parked in."""
    parked: Parked | None = engine.parked
    if parked is None:
        return
    if parked.where == "host":
        k, v, pos, score = parked.host
    else:
        H, pages = parked.crcs.shape
        heads = np.repeat(np.arange(H), pages)
        ids = np.tile(np.arange(pages), H)
        rk, rv, rpos, rscore, _ = engine.parking.read_many(heads, ids, parked.crcs.reshape(-1))
        n = parked.count
        k = rk.reshape(H, pages * engine.cfg.page_size, -1)[:, :n]
        v = rv.reshape(H, pages * engine.cfg.page_size, -1)[:, :n]
        pos = rpos.reshape(H, -1)[:, :n]
        score = rscore.reshape(H, -1)[:, :n]
        engine.parking.discard()
        if parked.was_on_host is not None:
            h, p = np.nonzero(parked.was_on_host)
            if len(h):
                engine.bring_disk_pages_to_host(h, p)
    engine.pool.replace(k.to(engine.device), v.to(engine.device), pos.to(engine.device), score.to(engine.device))
    index = parked.index if parked.index is not None else _index_from_disk(engine, parked.index_crc)
    engine.index = index.to(engine.device)
    engine.counters.bytes_moved["host_to_device" if parked.where == "host" else "disk_to_device"] += \
        _bytes((k, v)) + index.nbytes()
    engine.parked = None


def forget(engine) -> None:
    """Drop what a parked layer left in its parking files (the layer is being reset)."""
    parked: Parked | None = engine.parked
    if engine.parking is not None:
        engine.parking.discard()
    if parked is not None and parked.index_crc is not None and os.path.exists(_index_path(engine)):
        os.remove(_index_path(engine))
    engine.parked = None


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
