"""The native operations: check the arguments once, then run the kernel where it can run, else the twin.

A kernel runs when kernels are on (`loader.status`), every tensor it touches is on one CUDA device (or, for
the pages a gather reads, in pinned host memory mapped into it), the layouts are contiguous and, for the
copies, the row indices are given on the host (they are checked there, without a device round-trip). In
every other case the torch twin runs, on whatever device the tensors are. Both give the same bits.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Sequence

import numpy as np
import torch

from . import loader, twins
from .layout import CODES_PER_BYTE

_THREADS = 128
_MAX_BLOCKS = 1 << 20   # grid-stride loops cover the rest
_GRID_Y_MAX = 65535     # blocks a grid's second dimension takes (heads there, in the two-dimensional launches)
SHARED_MAX = 48 * 1024  # bytes of shared memory a block gets without opting in to more
# the kernel-name suffix of each cache dtype a templated kernel is built for
DTYPE_SUFFIX = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}


def _host_rows(rows: np.ndarray | torch.Tensor, what: str) -> tuple[np.ndarray | None, torch.Tensor]:
    """``(numpy rows or None if they live on a device, int64 tensor)``, the rows one-dimensional."""
    if rows.ndim != 1:
        raise ValueError(f"{what}: rows of shape {list(rows.shape)}; allowed: one dimension [n]")
    integral = np.issubdtype(rows.dtype, np.integer) if isinstance(rows, np.ndarray) else (
        not rows.dtype.is_floating_point and not rows.dtype.is_complex)
    if not integral or rows.dtype in (np.bool_, torch.bool):   # 2.9 would be row 2, and a mask rows 0 and 1
        raise ValueError(f"{what}: rows of {rows.dtype}; allowed: integer row numbers")
    if isinstance(rows, np.ndarray):
        r = np.ascontiguousarray(rows, dtype=np.int64)
        return r, torch.from_numpy(r)
    if rows.dtype != torch.int64:
        rows = rows.to(torch.int64)
    if rows.device.type == "cpu":
        rows = rows if rows.is_contiguous() else rows.contiguous()
        return rows.numpy(), rows
    return None, rows


def _check_rows(rows: np.ndarray | None, capacity: int, what: str, distinct: bool = False) -> None:
    if rows is None or len(rows) == 0:
        return
    lo, hi = int(rows.min()), int(rows.max())
    if lo < 0 or hi >= capacity:
        bad = lo if lo < 0 else hi
        raise IndexError(f"{what}: row {bad} is out of range; allowed: 0 to {capacity - 1} "
                         f"({capacity} rows in the storage)")
    if distinct and len(np.unique(rows)) != len(rows):
        raise ValueError(f"{what}: rows repeat; allowed: distinct rows (two writes to one row race)")


def _check_layout(slabs: Sequence[torch.Tensor], rows_per_slab: int, row_shape: tuple[int, ...],
                  dtype: torch.dtype, what: str) -> None:
    """The first slab against the pages (a storage makes all its slabs alike; checking one keeps this O(1))."""
    if not slabs:
        return
    slab = slabs[0]
    if slab.shape[0] != rows_per_slab:
        raise ValueError(f"{what}: slabs of {slab.shape[0]} rows for rows_per_slab={rows_per_slab}; "
                         "allowed: slabs of exactly rows_per_slab rows")
    if tuple(slab.shape[1:]) != row_shape or slab.dtype != dtype:
        raise ValueError(f"{what}: pages of {list(row_shape)} {dtype} for rows of {list(slab.shape[1:])} "
                         f"{slab.dtype}; allowed: pages of {list(slab.shape[1:])} {slab.dtype}")


def _check_pair(pair: tuple[Sequence[torch.Tensor], torch.Tensor, torch.Tensor | None] | None,
                slabs: Sequence[torch.Tensor], rows_per_slab: int, out: torch.Tensor, what: str) -> None:
    """A copy's second storage and output (values beside keys) laid out as its first."""
    if pair is None:
        return
    if (len(pair[0]) != len(slabs) or pair[1].shape != out.shape or pair[1].dtype != out.dtype
            or pair[1].device != out.device):
        raise ValueError(f"{what}: a pair of {len(pair[0])} slabs into {list(pair[1].shape)} {pair[1].dtype} on "
                         f"{pair[1].device}; allowed: {len(slabs)} slabs into {list(out.shape)} {out.dtype} on "
                         f"{out.device}")
    _check_layout(pair[0], rows_per_slab, tuple(out.shape[1:]), out.dtype, f"{what} pair")


def _why_not(device: torch.device, tensors: Sequence[torch.Tensor]) -> str | None:
    """Why the kernel cannot take these tensors on `device` (None if it can).

    A slab storage is passed as its first slab: a storage makes all its slabs alike (`SlabRows`, `DevicePool`),
    so one stands for them all and a call's checks do not grow with the context."""
    why = loader.status()
    if why is not None:
        return why
    if device.type != "cuda" and not loader.in_dry_run():
        return "tensors are not on a CUDA device"
    for t in tensors:
        if not t.is_contiguous():
            return "a tensor is not contiguous"
    return None


def slab_addresses(slabs: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor | None:
    """The address through which kernels on `device` reach each slab, as int64 ``[len(slabs)]`` on `device`;
    None when kernels cannot run there or a slab is out of their reach (pageable host memory, another GPU).

    A storage that keeps the result until its slabs change spares every call this lookup (`SlabRows` does).
    """
    if device.type != "cuda" or loader.status() is not None or not slabs:
        return None
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("slab_addresses: a table made during a CUDA graph capture would be copied from a "
                           "temporary the graph outlives; allowed: tables made before the capture")
    ptrs = [loader.device_address(s, device) for s in slabs]
    if any(p is None for p in ptrs):
        return None
    # from pinned memory without waiting: a step that grows a slab storage does not stall on the lookup
    return torch.tensor(ptrs, dtype=torch.int64).pin_memory().to(device, non_blocking=True)


def _addresses(slabs: Sequence[torch.Tensor], device: torch.device,
               given: torch.Tensor | None) -> torch.Tensor | None:
    if given is not None:   # the kernels read it as contiguous 64-bit addresses
        if given.shape != (len(slabs),) or given.device != device or given.dtype != torch.int64 or \
                not given.is_contiguous():
            raise ValueError(f"addresses are {given.dtype} {list(given.shape)} on {given.device}; allowed: contiguous "
                             f"torch.int64 [{len(slabs)}] on {device} (from slab_addresses of these slabs)")
        return given
    return slab_addresses(slabs, device)


_u64 = np.uint64   # launch arguments: addresses
_i64 = np.int64    # and 64-bit integers


def _ptr(t: torch.Tensor | None) -> np.uint64:
    """A launch's address argument for an optional tensor (0 for none)."""
    return _u64(0 if t is None else t.data_ptr())


def _check_q(q: torch.Tensor, what: str) -> None:
    if q.dim() != 3:
        raise ValueError(f"{what}: q is {list(q.shape)}; allowed: [heads, rows, dim]")


def _check_devices(what: str, first: torch.Tensor, **others: torch.Tensor | None) -> None:
    """Every tensor given on `first`'s device (the twins would fail on a mix with torch's own words)."""
    for name, t in others.items():
        if t is not None and t.device != first.device:
            raise ValueError(f"{what}: {name} on {t.device}; allowed: on {first.device}, with the others")


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` as a contiguous tensor of `dtype` (itself when it is one: no dispatch on the hot path)."""
    return t if t.dtype == dtype and t.is_contiguous() else t.to(dtype).contiguous()


def _out(out: torch.Tensor | None, shape: tuple[int, ...], device: torch.device, what: str) -> torch.Tensor:
    """`out` checked against the result it is to hold, or a new float32 tensor for it."""
    if out is None:
        return torch.empty(shape, dtype=torch.float32, device=device)
    if tuple(out.shape) != shape or out.dtype != torch.float32 or out.device != device or not out.is_contiguous():
        raise ValueError(f"{what}: out is {list(out.shape)} {out.dtype} on {out.device}; allowed: "
                         f"{list(shape)} torch.float32 on {device}, contiguous")
    return out


def _grid(n: int) -> tuple[int]:
    return (max(1, min(n, _MAX_BLOCKS)),)


# ---------------------------------------------------------------------------------------------- copies
def gather_pages(slabs: Sequence[torch.Tensor], rows_per_slab: int, rows: np.ndarray | torch.Tensor,
                 out: torch.Tensor, addresses: torch.Tensor | None = None,
                 pair: tuple[Sequence[torch.Tensor], torch.Tensor, torch.Tensor | None] | None = None) -> torch.Tensor:
    """``out[i] = row rows[i]`` of a slab storage (`kvtier.tiers.slabs.SlabRows`), ``out`` ``[n, *row]``.

    On CUDA the slabs may be pinned host memory: the kernel then reads the pages through the mapping,
    straight into `out` in device memory (no staging, no copy call per page). `addresses`: the slabs'
    `slab_addresses` on `out`'s device, when the caller keeps them. `pair`, ``(slabs, out, addresses)`` of a
    second storage laid out as the first (a layer's values beside its keys), is gathered by the same rows in the
    same launch.
    """
    r_np, r = _host_rows(rows, "gather_pages")
    row_shape = tuple(out.shape[1:])
    _check_layout(slabs, rows_per_slab, row_shape, out.dtype, "gather_pages")
    _check_rows(r_np, len(slabs) * rows_per_slab, "gather_pages")
    if out.shape[0] != r.shape[0]:
        raise ValueError(f"gather_pages: out has {out.shape[0]} rows for {r.shape[0]} requested; allowed: as many")
    _check_pair(pair, slabs, rows_per_slab, out, "gather_pages")
    if r.shape[0] == 0:
        return out
    why = _why_not(out.device, [out, *slabs[:1]] if pair is None else [out, *slabs[:1], pair[1], *pair[0][:1]])
    if why is None and r_np is None:
        why = "rows are on the device"
    if why is None:
        k = loader.kernel("gather_pages", "kvtier_gather_pages", out.device)
        base = _addresses(slabs, out.device, addresses) if k is not None else None
        base2 = _addresses(pair[0], out.device, pair[2]) if k is not None and pair is not None else None
        if base is not None and (pair is None or base2 is not None):
            rows_d = _rows_on(r, out.device)
            row_bytes = out[0].numel() * out.element_size()
            loader.launch(k, out.device, _grid(r.shape[0] * (1 if pair is None else 2)), (_THREADS,),
                          (_u64(base.data_ptr()), _i64(rows_per_slab), _u64(rows_d.data_ptr()),
                           _u64(out.data_ptr()), _i64(r.shape[0]), _i64(row_bytes), _ptr(base2),
                           _u64(0 if pair is None else pair[1].data_ptr())))
            loader.record("gather_pages", "kernel")
            return out
        why = loader.build_error("gather_pages", out.device) or "a slab is not reachable from the device"
    loader.record("gather_pages", "twin", why)
    if pair is not None:
        twins.gather_pages(pair[0], rows_per_slab, r, pair[1])
    return twins.gather_pages(slabs, rows_per_slab, r, out)


def _rows_on(rows: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host rows (int64) on `device` for a kernel to read: through pinned memory without a wait on CUDA (a
    pageable copy would stall the host until the copy is done)."""
    if device.type != "cuda" or rows.device == device:
        return rows.to(device)
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("host rows copied during a CUDA graph capture would be read from a temporary the graph "
                           "outlives; allowed: rows on the device, or a call outside the capture")
    return rows.pin_memory().to(device, non_blocking=True)


def recall_pages(slabs: Sequence[torch.Tensor], rows_per_slab: int, src_rows: torch.Tensor, dst_rows: torch.Tensor,
                 count: torch.Tensor, out: torch.Tensor, addresses: torch.Tensor | None = None,
                 pair: tuple[Sequence[torch.Tensor], torch.Tensor, torch.Tensor | None] | None = None) -> torch.Tensor:
    """For each head ``h`` and ``j < count[h]``: ``out[dst_rows[h, j]] = row src_rows[h, j]`` of a slab storage.

    The plan (``[heads, r]`` rows, ``[heads]`` counts) stays on the device: nothing is read back to the host,
    so a recall can be queued behind the attention that chose it. On CUDA the slabs may be pinned host
    memory, read through its mapping. Rows outside the storage or `out` are skipped, not raised: checking
    them would need the host; the caller's plan makes none. `pair`, ``(slabs, out, addresses)`` of a second
    storage laid out as the first (a layer's values beside its keys), is copied by the same plan in the same
    launch.
    """
    if src_rows.dim() != 2:
        raise ValueError(f"recall_pages: src_rows {list(src_rows.shape)}; allowed: [heads, r]")
    heads, r = src_rows.shape
    if dst_rows.shape != src_rows.shape or count.shape != (heads,):
        raise ValueError(f"recall_pages: src_rows {list(src_rows.shape)}, dst_rows {list(dst_rows.shape)}, "
                         f"count {list(count.shape)}; allowed: [heads, r], [heads, r] and [heads]")
    row_shape = tuple(out.shape[1:])
    _check_layout(slabs, rows_per_slab, row_shape, out.dtype, "recall_pages")
    _check_pair(pair, slabs, rows_per_slab, out, "recall_pages")
    _check_devices("recall_pages", out, src_rows=src_rows, dst_rows=dst_rows, count=count)
    if heads * r == 0 or not slabs or out.shape[0] == 0:   # no row of `out` to write: every row is skipped
        return out
    src_rows, dst_rows, count = _as(src_rows, torch.int64), _as(dst_rows, torch.int64), _as(count, torch.int64)
    why = _why_not(out.device, [out, slabs[0]] if pair is None else [out, slabs[0], pair[1], *pair[0][:1]])
    if why is None and not (src_rows.device == dst_rows.device == count.device == out.device):
        why = "the plan is not on the output's device"
    if why is None:
        k = loader.kernel("recall_pages", "kvtier_recall_pages", out.device)
        base = _addresses(slabs, out.device, addresses) if k is not None else None
        base2 = _addresses(pair[0], out.device, pair[2]) if k is not None and pair is not None else None
        if base is not None and (pair is None or base2 is not None):
            row_bytes = out[0].numel() * out.element_size()
            loader.launch(k, out.device, _grid(heads * r * (1 if pair is None else 2)), (_THREADS,),
                          (_u64(base.data_ptr()), _i64(rows_per_slab), _i64(len(slabs) * rows_per_slab),
                           _u64(src_rows.data_ptr()), _u64(dst_rows.data_ptr()), _u64(count.data_ptr()),
                           _i64(heads), _i64(r), _u64(out.data_ptr()), _i64(out.shape[0]), _i64(row_bytes),
                           _u64(0 if base2 is None else base2.data_ptr()),
                           _u64(0 if pair is None else pair[1].data_ptr())))
            loader.record("recall_pages", "kernel")
            return out
        why = loader.build_error("recall_pages", out.device) or "a slab is not reachable from the device"
    loader.record("recall_pages", "twin", why)
    if pair is not None:
        twins.recall_pages(pair[0], rows_per_slab, src_rows, dst_rows, count, pair[1])
    return twins.recall_pages(slabs, rows_per_slab, src_rows, dst_rows, count, out)


PLAN_MARKS_MAX = 1 << 22       # wanted pages x slots per head past which the plan runs as the twin


def plan_recall(want: torch.Tensor, held: torch.Tensor, pages: int, host_slots: torch.Tensor | None = None,
                ahead: torch.Tensor | None = None, counts: torch.Tensor | None = None,
                prefetch: bool = False, in_place: bool = False) -> twins.RecallPlan:
    """A recall step's plan and bookkeeping, all on the device (`twins.plan_recall` says what each argument
    and field is); one launch on CUDA instead of some forty tensor ops. `in_place` writes the plan's page
    table into `held` (then contiguous int64), which is the plan's ``held_after``.

    `want` holds distinct page ids below `pages` per head, `held` at least as many slots; neither is checked
    on the device (that would need the host). `want`'s rows may be a wider tensor's (a short list's first
    columns): the kernel reads them where they are.
    """
    if want.dim() != 2 or held.dim() != 2:
        raise ValueError(f"plan_recall: want {list(want.shape)} and held {list(held.shape)}; allowed: [heads, w] "
                         "and [heads, slots]")
    _check_devices("plan_recall", want, held=held, host_slots=host_slots, ahead=ahead, counts=counts)
    heads, w = want.shape
    R = held.shape[1]
    if held.shape[0] != heads or R < w:
        raise ValueError(f"plan_recall: want {list(want.shape)} and held {list(held.shape)}; allowed: as many "
                         "heads, and at least as many slots as wanted pages")
    if host_slots is not None and (tuple(host_slots.shape) != (heads, pages) or host_slots.dtype != torch.int64):
        raise ValueError(f"plan_recall: host_slots {list(host_slots.shape)} {host_slots.dtype}; allowed: "
                         f"[{heads}, {pages}] int64")
    if ahead is not None and (ahead.shape != held.shape or ahead.dtype != torch.bool):
        raise ValueError(f"plan_recall: ahead {list(ahead.shape)} {ahead.dtype}; allowed: {list(held.shape)} bool")
    if counts is not None and (counts.shape != (4,) or counts.dtype != torch.int64):
        raise ValueError(f"plan_recall: counts {list(counts.shape)} {counts.dtype}; allowed: [4] int64")
    if in_place and (held.dtype != torch.int64 or not held.is_contiguous()):
        raise ValueError(f"plan_recall: held {held.dtype}, contiguous={held.is_contiguous()}, for a plan in place; "
                         "allowed: a contiguous int64 held")
    if want.dtype != torch.int64 or (want.stride(1) != 1 and w > 1):   # else rows are read where they are
        want = _as(want, torch.int64)
    held = _as(held, torch.int64)
    given = [t for t in (host_slots, ahead, counts) if t is not None]
    why = _why_not(want.device, [held, *given])
    if why is None and (w * R > PLAN_MARKS_MAX or w + R > SHARED_MAX):
        why = f"{w} wanted pages x {R} slots is past the kernel's limit"
    k = loader.kernel("plan_recall", "kvtier_plan_recall", want.device) if why is None and heads and w else None
    if k is None:
        loader.record("plan_recall", "twin", why or loader.build_error("plan_recall", want.device) or "nothing to do")
        return twins.plan_recall(want, held, pages, host_slots, ahead, counts, prefetch, in_place)
    fetch, slots, where, src_rows, dst_rows = (torch.empty(heads, w, dtype=torch.int64, device=want.device)
                                               for _ in range(5))
    count = torch.empty(heads, dtype=torch.int64, device=want.device)
    held_after = held if in_place else torch.empty_like(held)
    loader.launch(k, want.device, (heads,), (_THREADS,),
                  (_u64(want.data_ptr()), _i64(want.stride(0)), _u64(held.data_ptr()), _ptr(host_slots), _i64(pages), _i64(w), _i64(R),
                   _u64(fetch.data_ptr()), _u64(slots.data_ptr()), _u64(count.data_ptr()),
                   _u64(held_after.data_ptr()), _u64(where.data_ptr()), _u64(src_rows.data_ptr()),
                   _u64(dst_rows.data_ptr()), _ptr(ahead), _ptr(counts), np.int32(prefetch)),
                  shared_mem=w + R)
    loader.record("plan_recall", "kernel")
    return twins.RecallPlan(fetch, slots, count, held_after, where, src_rows, dst_rows)


def scatter_pages(slabs: Sequence[torch.Tensor], rows_per_slab: int, rows: np.ndarray | torch.Tensor,
                  values: torch.Tensor, addresses: torch.Tensor | None = None) -> None:
    """Row ``rows[i]`` of a slab storage ``= values[i]`` (``[n, *row]``); rows must be distinct.
    `addresses`: as for `gather_pages`."""
    r_np, r = _host_rows(rows, "scatter_pages")
    row_shape = tuple(values.shape[1:])
    _check_layout(slabs, rows_per_slab, row_shape, slabs[0].dtype if slabs else values.dtype, "scatter_pages")
    _check_rows(r_np, len(slabs) * rows_per_slab, "scatter_pages", distinct=True)
    if values.shape[0] != r.shape[0]:
        raise ValueError(f"scatter_pages: {values.shape[0]} pages for {r.shape[0]} rows; allowed: as many")
    if r.shape[0] == 0:
        return
    if not slabs:   # only device-side rows get here unchecked
        raise IndexError(f"scatter_pages: {r.shape[0]} rows into a storage of none; allowed: rows it holds")
    device = slabs[0].device
    why = _why_not(device, [values, slabs[0]])
    if why is None:
        if r_np is None:
            why = "rows are on the device"
        elif values.device != device or values.dtype != slabs[0].dtype:
            why = "values and slabs differ in device or dtype"
    if why is None:
        k = loader.kernel("scatter_pages", "kvtier_scatter_pages", device)
        base = _addresses(slabs, device, addresses) if k is not None else None
        if base is not None:
            rows_d = _rows_on(r, device)
            row_bytes = values[0].numel() * values.element_size()
            loader.launch(k, device, _grid(r.shape[0]), (_THREADS,),
                          (_u64(base.data_ptr()), _i64(rows_per_slab), _u64(rows_d.data_ptr()),
                           _u64(values.data_ptr()), _i64(r.shape[0]), _i64(row_bytes)))
            loader.record("scatter_pages", "kernel")
            return
        why = loader.build_error("scatter_pages", device) or "a slab is not reachable from the device"
    loader.record("scatter_pages", "twin", why)
    twins.scatter_pages(slabs, rows_per_slab, r, values)


def index_pages(keys: torch.Tensor, bounds: Sequence[torch.Tensor], rows_per_slab: int, first: int,
                addresses: torch.Tensor | None = None) -> torch.Tensor:
    """The recall index of new pages in one launch: their key bounds written into rows ``first ..`` of the
    `bounds` storage (row ``first + j * heads + h`` = ``[hi, lo]`` of page j of head h), and their 2-bit key
    codes returned, ``[m * heads, page_size, ceil(dim / 4)]`` uint8 on the keys' device.

    `keys` ``[heads, m, page_size, dim]`` in the cache's dtype (the bounds storage's), channels contiguous; every
    entry valid. `addresses`: as for `gather_pages`. The bounds are the keys' own elements and the codes follow
    `kvtier.recall.codes` (``native/index_pages.cu`` states each rounding).
    """
    if keys.dim() != 4:
        raise ValueError(f"index_pages: keys {list(keys.shape)}; allowed: [heads, pages, page_size, dim]")
    H, m, P, D = keys.shape
    if P < 1 or D < 1:
        raise ValueError(f"index_pages: keys {list(keys.shape)}; allowed: pages of at least one entry and channel")
    _check_layout(bounds, rows_per_slab, (2 * D,), keys.dtype, "index_pages")
    if first < 0 or (first + m * H > len(bounds) * rows_per_slab and m * H):
        raise IndexError(f"index_pages: rows {first} to {first + m * H - 1}; allowed: 0 to "
                         f"{len(bounds) * rows_per_slab - 1} ({len(bounds) * rows_per_slab} rows in the storage)")
    if m * H == 0:
        return torch.empty(0, P, -(-D // CODES_PER_BYTE), dtype=torch.uint8, device=keys.device)
    device = keys.device
    why = _why_not(device, [bounds[0]])
    suffix = DTYPE_SUFFIX.get(keys.dtype)
    if why is None and (suffix is None or keys.stride(3) != 1 or bounds[0].device != device):
        why = "keys of another dtype, channels not contiguous, or bounds on another device"
    if why is None:
        k = loader.kernel("index_pages", f"kvtier_index_pages_{suffix}", device)
        base = _addresses(bounds, device, addresses) if k is not None else None
        if base is not None:
            width = -(-D // CODES_PER_BYTE)
            codes = torch.empty(m * H, P, width, dtype=torch.uint8, device=device)
            loader.launch(k, device, _grid(-(-(m * H * width) // _THREADS)), (_THREADS,),
                          (_u64(keys.data_ptr()), _i64(keys.stride(0)), _i64(keys.stride(1)), _i64(keys.stride(2)),
                           _i64(H), _i64(m * H), np.int32(P), np.int32(D), _u64(base.data_ptr()),
                           _i64(rows_per_slab), _i64(first), _u64(codes.data_ptr())))
            loader.record("index_pages", "kernel")
            return codes
        why = loader.build_error("index_pages", device) or "a slab is not reachable from the device"
    loader.record("index_pages", "twin", why)
    return twins.index_pages(keys, bounds, rows_per_slab, first)


def _entry_layout(slabs: Sequence[torch.Tensor], what: str) -> tuple[int, int, int]:
    """``(heads, slab_tokens, row bytes)`` of a device pool's slabs: ``[1, heads, slab_tokens, dim]`` (keys,
    values) or ``[heads, slab_tokens]`` (positions, scores)."""
    if not slabs:
        raise ValueError(f"{what}: the pool has no slab; allowed: a pool holding the entries")
    slab = slabs[0]
    if slab.dim() == 4 and slab.shape[0] == 1:
        return slab.shape[1], slab.shape[2], slab.shape[3] * slab.element_size()
    if slab.dim() == 2:
        return slab.shape[0], slab.shape[1], slab.element_size()
    raise ValueError(f"{what}: slabs of {list(slab.shape)}; allowed: [1, heads, slab_tokens, dim] or "
                     "[heads, slab_tokens]")


def _entry_ids(idx: torch.Tensor, heads: int, capacity: int, device: torch.device, checked: bool,
               what: str) -> torch.Tensor:
    if idx.dim() != 2 or idx.shape[0] != heads:
        raise ValueError(f"{what}: idx is {list(idx.shape)}; allowed: [{heads}, m] (one row per head)")
    idx = idx.to(device=device, dtype=torch.int64)
    if checked and idx.numel() and bool(((idx < 0) | (idx >= capacity)).any()):
        bad = int(idx.min()) if int(idx.min()) < 0 else int(idx.max())
        raise IndexError(f"{what}: entry {bad} is out of range; allowed: 0 to {capacity - 1}")
    return idx if idx.is_contiguous() else idx.contiguous()


def pack_entries(slabs: Sequence[torch.Tensor], idx: torch.Tensor, addresses: torch.Tensor | None = None,
                 out: torch.Tensor | None = None, checked: bool = True) -> torch.Tensor:
    """Entries ``idx`` ``[heads, m]`` of a device pool's slabs ``[1, heads, slab_tokens, dim]`` packed as
    ``[heads, m, dim]`` (demotion staging: whole pages, contiguous, ready for one large copy down), into
    `out` when given (a reused staging buffer). `addresses`: as for `gather_pages`. `checked=False` skips the
    range check of `idx`, which reads the device back: for indices the pool made itself."""
    heads, S, _ = _entry_layout(slabs, "pack_entries")
    if slabs[0].dim() != 4:
        raise ValueError(f"pack_entries: slabs of {list(slabs[0].shape)}; allowed: [1, heads, slab_tokens, dim]")
    dim = slabs[0].shape[3]
    device = slabs[0].device
    idx = _entry_ids(idx, heads, len(slabs) * S, device, checked, "pack_entries")
    shape = (heads, idx.shape[1], dim)
    if out is None:
        out = torch.empty(shape, dtype=slabs[0].dtype, device=device)
    elif tuple(out.shape) != shape or out.dtype != slabs[0].dtype or out.device != device or not out.is_contiguous():
        raise ValueError(f"pack_entries: out is {list(out.shape)} {out.dtype} on {out.device}; allowed: "
                         f"{list(shape)} {slabs[0].dtype} on {device}, contiguous")
    why = _why_not(device, [idx, slabs[0]])
    if why is None and idx.numel():
        k = loader.kernel("pack_entries", "kvtier_pack_entries", device)
        base = _addresses(slabs, device, addresses) if k is not None else None
        if base is not None:
            warps_per_block = _THREADS // 32
            loader.launch(k, device, _grid(-(-idx.numel() // warps_per_block)), (_THREADS,),
                          (_u64(base.data_ptr()), _i64(S), _i64(heads), _u64(idx.data_ptr()),
                           _i64(idx.shape[1]), _u64(out.data_ptr()), _i64(dim * out.element_size())))
            loader.record("pack_entries", "kernel")
            return out
        why = loader.build_error("pack_entries", device) or "a slab is not reachable from the device"
    loader.record("pack_entries", "twin", why or "nothing to copy")
    return out.copy_(twins.pack_entries(slabs, idx))


def move_entries(slabs: Sequence[torch.Tensor], src: torch.Tensor, dst: torch.Tensor,
                 addresses: torch.Tensor | None = None) -> None:
    """Entry ``src[h, j]`` of each head ``h`` of a device pool's slabs copied onto its entry ``dst[h, j]``
    (``[heads, m]`` each; slabs ``[1, heads, slab_tokens, dim]`` or ``[heads, slab_tokens]``), in one launch
    over every slab: the entries that fill the holes a demotion leaves (`DevicePool.remove`).

    Every ``dst[h, j]`` must be in range and either no entry of ``src[h]`` or ``src[h, j]`` itself (nothing is
    read that another lane writes). That is not checked, as it would read the device back: the pool makes
    them so. `addresses`: as for `gather_pages`."""
    heads, S, row_bytes = _entry_layout(slabs, "move_entries")
    if src.shape != dst.shape or src.dim() != 2 or src.shape[0] != heads:
        raise ValueError(f"move_entries: src {list(src.shape)} and dst {list(dst.shape)}; allowed: both "
                         f"[{heads}, m]")
    device = slabs[0].device
    src = _entry_ids(src, heads, 0, device, False, "move_entries")
    dst = _entry_ids(dst, heads, 0, device, False, "move_entries")
    if not src.numel():
        return
    why = _why_not(device, [src, dst, slabs[0]])
    if why is None:
        k = loader.kernel("pack_entries", "kvtier_move_entries", device)
        base = _addresses(slabs, device, addresses) if k is not None else None
        if base is not None:
            warps_per_block = _THREADS // 32
            loader.launch(k, device, _grid(-(-src.numel() // warps_per_block)), (_THREADS,),
                          (_u64(base.data_ptr()), _i64(S), _i64(heads), _u64(src.data_ptr()),
                           _u64(dst.data_ptr()), _i64(src.shape[1]), _i64(row_bytes)))
            loader.record("move_entries", "kernel")
            return
        why = loader.build_error("pack_entries", device) or "a slab is not reachable from the device"
    loader.record("move_entries", "twin", why)
    twins.move_entries(slabs, src, dst)


# -------------------------------------------------------------------------------------- page selection
_BOUND_KERNELS = {dtype: f"kvtier_page_upper_bounds_{suffix}" for dtype, suffix in DTYPE_SUFFIX.items()}


def page_upper_bounds(q: torch.Tensor, spans: Sequence[torch.Tensor], heads: int,
                      out: torch.Tensor | None = None, addresses: torch.Tensor | None = None,
                      rows_per_slab: int | None = None) -> torch.Tensor:
    """The largest logit any key of each page can give a KV head's queries, over every page.

    Parameters
    ----------
    q
        ``[heads, rows, dim]`` grouped queries (made float32).
    spans
        Bounds rows ``[pages_i * heads, 2 * dim]`` of consecutive pages (one per slab of the recall index):
        row ``page * heads + head`` is ``[hi | lo]``, in float32, float16 or bfloat16.
    out
        Where to write the result (float32, contiguous, on `q`'s device), if not a new tensor.
    addresses, rows_per_slab
        When the spans are the slabs of one storage (`SlabRows.spans`: every span but the last holds
        `rows_per_slab` rows), its slabs' addresses (`SlabRows.addresses`): one launch then covers them all,
        instead of one per span.

    Returns
    -------
    ``[heads, sum(pages_i)]`` float32, in the kernel's summation order (see `twins.page_upper_bounds`); equal
    to `kvtier.recall.bounds.upper_bounds` up to float rounding. No query rows give -inf.
    """
    _check_q(q, "page_upper_bounds")
    q = _as(q, torch.float32)
    H, R, D = q.shape
    if H != heads or heads < 1:
        raise ValueError(f"page_upper_bounds: q has {H} heads for heads={heads}; allowed: as many, at least one")
    # the slabs of one storage are alike: its first and last spans stand for them all (checks in O(1))
    one_storage = addresses is not None and len(spans) > 2
    for i, b in ((0, spans[0]), (len(spans) - 1, spans[-1])) if one_storage else enumerate(spans):
        if b.dim() != 2 or b.shape[1] != 2 * D or b.shape[0] % heads or b.dtype not in _BOUND_KERNELS:
            raise ValueError(f"page_upper_bounds: span {i} is {list(b.shape)} {b.dtype}; allowed: "
                             f"[pages * {heads}, {2 * D}] in float32, float16 or bfloat16")
    if one_storage:
        total = ((len(spans) - 1) * spans[0].shape[0] + spans[-1].shape[0]) // heads
    else:
        total = sum(b.shape[0] // heads for b in spans)
    out = _out(out, (H, total), q.device, "page_upper_bounds")
    if R == 0:
        return out.fill_(float("-inf"))
    if addresses is not None and total and _one_launch(q, spans, heads, out, addresses, rows_per_slab, total):
        return out
    col = 0
    for b in spans:
        n = b.shape[0] // heads
        why = _why_not(q.device, [q, b]) or (None if b.device == q.device else "bounds and queries differ in device")
        k = loader.kernel("page_select", _BOUND_KERNELS[b.dtype], q.device) if why is None and n else None
        if k is not None:
            _launch_bounds(k, q, heads, out, n, col, bounds=b)
        else:
            why = why or loader.build_error("page_select", q.device) or "no pages"
            loader.record("page_upper_bounds", "twin", why)
            twins.page_upper_bounds(q, b.to(q.device), heads, out=out[:, col:col + n])
        col += n
    return out


def _one_launch(q: torch.Tensor, spans: Sequence[torch.Tensor], heads: int, out: torch.Tensor,
                addresses: torch.Tensor, rows_per_slab: int | None, total: int) -> bool:
    """`page_upper_bounds` over every slab of one storage in one launch, if the kernel can take it."""
    if rows_per_slab is None or rows_per_slab % heads or spans[0].dtype != spans[-1].dtype or addresses.dim() != 1 \
            or addresses.shape[0] < len(spans) or addresses.dtype != torch.int64 or not addresses.is_contiguous() \
            or (len(spans) > 1 and spans[0].shape[0] != rows_per_slab) or spans[-1].shape[0] > rows_per_slab:
        raise ValueError(f"page_upper_bounds: addresses {list(addresses.shape)} {addresses.dtype} with "
                         f"rows_per_slab={rows_per_slab} for spans of {[b.shape[0] for b in spans]} rows; allowed: "
                         "contiguous int64 addresses of at least every span's slab, every span but the last holding "
                         "rows_per_slab rows (a multiple of heads) and the last at most that, one dtype")
    why = _why_not(q.device, [q, out, spans[0]]) or (None if addresses.device == q.device else "addresses elsewhere")
    if why is not None or spans[0].device != q.device:
        return False
    k = loader.kernel("page_select", _BOUND_KERNELS[spans[0].dtype], q.device)
    if k is None:
        return False
    _launch_bounds(k, q, heads, out, total, 0, slabs=addresses, pages_per_slab=rows_per_slab // heads)
    return True


def _launch_bounds(k, q: torch.Tensor, heads: int, out: torch.Tensor, pages: int, col: int,
                   bounds: torch.Tensor | None = None, slabs: torch.Tensor | None = None,
                   pages_per_slab: int = 0) -> None:
    """One launch of a `page_upper_bounds` kernel over `pages` pages, into columns from `col` of `out`: from
    one span of `bounds` rows, or from slabs of `pages_per_slab` pages through their address table `slabs`."""
    H, R, D = q.shape
    loader.launch(k, q.device, _grid(-(-(pages * heads) // (_THREADS // 32))), (_THREADS,),
                  (_u64(q.data_ptr()), _u64(0 if bounds is None else bounds.data_ptr()),
                   _u64(0 if slabs is None else slabs.data_ptr()), _i64(pages_per_slab), _i64(pages),
                   np.int32(heads), np.int32(R), np.int32(D), _u64(out.data_ptr()), _i64(out.shape[1]),
                   _i64(col)))
    loader.record("page_upper_bounds", "kernel")


def code_logits(q: torch.Tensor, lo: torch.Tensor, step: torch.Tensor, codes: torch.Tensor, scaling: float,
                out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of short-listed pages from their packed 2-bit codes, never unpacked in memory.

    Parameters
    ----------
    q
        ``[heads, rows, dim]`` grouped queries (made float32).
    lo, step
        ``[heads, c, dim]`` key minimum and code step of each candidate (made float32).
    codes
        ``[heads, c, page_size, ceil(dim / 4)]`` uint8 (`kvtier.recall.codes.encode`).
    scaling
        The attention's logit scale (rounded to float32).
    out
        ``(logits, base)`` to write into (float32, contiguous, on `q`'s device), if not new tensors.

    Returns
    -------
    ``(logits [heads, c, rows, page_size], base [heads, c, rows])`` float32: a key's estimated logit is
    ``base + logits`` (see `twins.code_logits` for the exact order of the sums).
    """
    _check_q(q, "code_logits")
    _check_devices("code_logits", q, lo=lo, step=step, codes=codes)
    q = q.float().contiguous()
    lo, step = lo.float().contiguous(), step.float().contiguous()
    codes = codes.contiguous()
    H, R, D = q.shape
    if lo.shape != step.shape or lo.dim() != 3 or lo.shape[0] != H or lo.shape[2] != D:
        raise ValueError(f"code_logits: lo {list(lo.shape)} and step {list(step.shape)}; allowed: "
                         f"[{H}, c, {D}] each")
    c = lo.shape[1]
    width = -(-D // 4)
    if codes.dim() != 4 or codes.shape[:2] != (H, c) or codes.shape[3] != width or codes.dtype != torch.uint8:
        raise ValueError(f"code_logits: codes {list(codes.shape)} {codes.dtype}; allowed: "
                         f"[{H}, {c}, page_size, {width}] uint8")
    s = float(np.float32(scaling))
    P = codes.shape[2]
    why = _why_not(q.device, [q, lo, step, codes])
    if why is None and c and R and not 1 <= H <= _GRID_Y_MAX:
        why = f"{H} heads: allowed 1 to {_GRID_Y_MAX} (a grid's second dimension)"
    logits = _out(None if out is None else out[0], (H, c, R, P), q.device, "code_logits")
    base = _out(None if out is None else out[1], (H, c, R), q.device, "code_logits")
    k = loader.kernel("page_select", "kvtier_code_logits", q.device) if why is None and c and R else None
    if k is None:
        loader.record("code_logits", "twin", why or loader.build_error("page_select", q.device) or "nothing to do")
        got = twins.code_logits(q, lo, step, codes, s)
        return logits.copy_(got[0]), base.copy_(got[1])
    loader.launch(k, q.device, (c, H), (_THREADS,),
                  (_u64(q.data_ptr()), _u64(lo.data_ptr()), _u64(step.data_ptr()), _u64(codes.data_ptr()),
                   _u64(logits.data_ptr()), _u64(base.data_ptr()), _i64(c), np.int32(R), np.int32(P),
                   np.int32(D), np.float32(s)))
    loader.record("code_logits", "kernel")
    return logits, base


_RANK_THREADS = 256
_RANK_TILE_MAX = 64


def _rank_shared(m: int, tile: int, rows: int, page: int, dim: int) -> int:
    """Bytes of shared memory `kvtier_rank_pages` lays out (``kv_rank_layout`` in native/rank_pages.cu)."""
    codes = -(-(tile * page * (-(-dim // 4))) // 16) * 16
    floats = 2 * tile * dim + tile * rows * page + tile * rows + m * rows + rows + m
    return codes + 4 * floats + 4 * m


@functools.lru_cache(maxsize=256)   # asked by the page choice and again by the op, every step of every layer
def rank_pages_tile(m: int, rows: int, page: int, dim: int) -> int:
    """Candidates per tile that `rank_pages`' kernel works in (the most that fit its shared memory, at most
    64), or 0 when even one does not: then the twin runs, and a caller on a GPU should rank another way."""
    fixed = 4 * (m * rows + rows + 2 * m) + 15                      # every candidate's rows, and the padding
    per = 4 * (2 * dim + rows * page + rows) + page * (-(-dim // 4))  # one candidate of a tile
    tile = max(0, min(m, _RANK_TILE_MAX, (SHARED_MAX - fixed) // per))
    while tile and _rank_shared(m, tile, rows, page, dim) > SHARED_MAX:
        tile -= 1
    return tile


def rank_pages(q: torch.Tensor, cand: torch.Tensor, pages: int, bounds: tuple[Sequence[torch.Tensor], int],
               codes: tuple[Sequence[torch.Tensor], int], page: int, scaling: float, keep: int,
               resident: torch.Tensor | None = None,
               addresses: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank short-listed pages by their estimated share of attention, from their 2-bit key codes, in one
    launch (what `kvtier.recall.selector` does after the bounds' short list).

    Parameters
    ----------
    q
        ``[heads, rows, dim]`` grouped queries (made float32).
    cand
        ``[heads, m]`` int64 distinct page ids (the short list).
    pages
        Pages in the index: the ids allowed.
    bounds, codes
        ``(slabs, rows_per_slab)`` of the recall index's storages: rows ``page * heads + head`` of ``[hi | lo]``
        ``[2 * dim]`` (the cache's dtype, on the device) and of codes ``[page, ceil(dim / 4)]`` uint8 (on the
        device or in pinned host memory, read through its mapping).
    page, scaling, keep
        Entries per page, the attention's logit scale (rounded to float32), pages to choose (1 to m).
    resident
        ``[heads, rows]`` float32: the log-sum-exp of the logits of the keys attention reads anyway.
    addresses
        The storages' slab address tables (`slab_addresses`), when the caller keeps them.

    Returns
    -------
    ``(chosen [heads, keep], ranked [heads, m], shares [heads, m])``: the `keep` pages of largest share in
    ascending id, all candidates best first (ties in short-list order), and the log shares (float32); see
    ``native/rank_pages.cu`` for every step, which the twin follows bit for bit.
    """
    _check_q(q, "rank_pages")
    q = _as(q, torch.float32)
    H, R, D = q.shape
    if cand.dim() != 2 or cand.shape[0] != H or cand.dtype != torch.int64 or cand.device != q.device:
        raise ValueError(f"rank_pages: cand {list(cand.shape)} {cand.dtype} on {cand.device}; allowed: "
                         f"[{H}, m] torch.int64 on {q.device}")
    if not (H and R):
        raise ValueError(f"rank_pages: q {list(q.shape)}; allowed: at least one head and one query row (a ranking "
                         "by the share of no query's attention has no order)")
    m = cand.shape[1]
    if not 1 <= keep <= m:
        raise ValueError(f"rank_pages: keep={keep}; allowed: 1 to {m} (the candidates)")
    if resident is not None and (tuple(resident.shape) != (H, R) or resident.dtype != torch.float32
                                 or resident.device != q.device):
        raise ValueError(f"rank_pages: resident {list(resident.shape)} {resident.dtype} on {resident.device}; "
                         f"allowed: [{H}, {R}] torch.float32 on {q.device}")
    (b_slabs, b_per), (c_slabs, c_per) = bounds, codes
    if not b_slabs or not c_slabs:
        raise ValueError("rank_pages: the index has no storage; allowed: at least one slab of each")
    _check_layout(b_slabs, b_per, (2 * D,), b_slabs[0].dtype, "rank_pages bounds")
    _check_layout(c_slabs, c_per, (page, -(-D // 4)), torch.uint8, "rank_pages codes")
    held = min(len(b_slabs) * b_per, len(c_slabs) * c_per) // H
    if pages > held:   # a candidate past the rows held would be read from no storage (the kernel: past its table)
        raise ValueError(f"rank_pages: pages={pages}; allowed: at most {held}, the pages the storages hold")
    s = float(np.float32(scaling))
    suffix = DTYPE_SUFFIX.get(b_slabs[0].dtype)
    why = _why_not(q.device, [q, cand])
    if why is None and suffix is None:
        why = f"bounds of dtype {b_slabs[0].dtype}"
    if why is None and resident is not None and resident.stride(1) != 1:
        why = "the resident log-sum-exps are not contiguous by row"
    tile = rank_pages_tile(m, R, page, D)
    if why is None and not tile:
        why = f"{m} candidates of {R} query rows do not fit a block's shared memory"
    b_addr = _addresses(b_slabs, q.device, addresses[0]) if why is None else None
    c_addr = _addresses(c_slabs, q.device, addresses[1]) if why is None else None
    if why is None and (b_addr is None or c_addr is None):
        why = "a storage is out of the kernel's reach (pageable host memory or another device)"
    k = loader.kernel("rank_pages", f"kvtier_rank_pages_{suffix}", q.device) if why is None else None
    if k is None:
        loader.record("rank_pages", "twin", why or loader.build_error("rank_pages", q.device))
        return twins.rank_pages(q, cand, pages, bounds, codes, page, s, keep, resident)
    chosen = torch.empty(H, keep, dtype=torch.int64, device=q.device)
    ranked = torch.empty(H, m, dtype=torch.int64, device=q.device)
    shares = torch.empty(H, m, dtype=torch.float32, device=q.device)
    loader.launch(k, q.device, (H,), (_RANK_THREADS,),
                  (_u64(q.data_ptr()), _u64(cand.data_ptr()), _i64(m), _i64(pages), _u64(b_addr.data_ptr()),
                   _i64(b_per), _u64(c_addr.data_ptr()), _i64(c_per),
                   _u64(0 if resident is None else resident.data_ptr()),
                   _i64(0 if resident is None else resident.stride(0)), np.int32(H), np.int32(R), np.int32(page),
                   np.int32(D), np.int32(tile), np.float32(s), _i64(keep), _u64(shares.data_ptr()),
                   _u64(ranked.data_ptr()), _u64(chosen.data_ptr())),
                  shared_mem=_rank_shared(m, tile, R, page, D))
    loader.record("rank_pages", "kernel")
    return chosen, ranked, shares


_KVP_THREADS_MAX = 1024


_fit_weights: list[tuple[twins.MLPWeights, torch.device]] = []   # the last networks found fit, per device


def _weights_unfit(weights: twins.MLPWeights, device: torch.device) -> bool:
    """Whether the networks' tensors are not all float32, contiguous, on `device` (checked once per set of
    weights and device: a scorer hands the same ones every step)."""
    if any(w is weights and d == device for w, d in _fit_weights):
        return False
    if any(w.dtype != torch.float32 or w.device != device or not w.is_contiguous() for w in weights):
        return True
    _fit_weights[:] = [*_fit_weights[-3:], (weights, device)]
    return False


def kvp_score(keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, weights: twins.MLPWeights,
              first: int) -> torch.Tensor:
    """KVP's scores of new entries in one launch (`kvtier.scoring.kvp.KVPAgents` for inference).

    Parameters
    ----------
    keys, values
        ``[heads, tokens, dim]`` in the cache's dtype (any strides with the channels contiguous).
    positions
        ``[tokens, f]`` float32: the entries' position features (`kvtier.scoring.features.position_features`).
    weights
        The networks' weights (float32, contiguous, on the keys' device).
    first
        The agent of head 0 (``layer * heads``).

    Returns
    -------
    ``[heads, tokens]`` float32; sums in the order ``native/kvp_score.cu`` gives, so they differ from the
    matrix products' by float rounding.
    """
    if keys.dim() != 3 or values.shape != keys.shape or values.dtype != keys.dtype:
        raise ValueError(f"kvp_score: keys {list(keys.shape)} {keys.dtype} and values {list(values.shape)} "
                         f"{values.dtype}; allowed: the same [heads, tokens, dim] shape and dtype")
    H, T, D = keys.shape
    agents, d_in, hidden = weights.w1.shape
    f = d_in - 2 * D
    if f < 0 or tuple(positions.shape) != (T, f):
        raise ValueError(f"kvp_score: position features {list(positions.shape)} for networks of {d_in} inputs; "
                         f"allowed: [{T}, {d_in - 2 * D}] (keys and values of {D} channels take the rest)")
    if not 0 <= first <= agents - H:
        raise ValueError(f"kvp_score: first={first}; allowed: 0 to {agents - H} ({agents} agents, {H} heads)")
    if values.device != keys.device or positions.device != keys.device:
        raise ValueError(f"kvp_score: keys on {keys.device}, values on {values.device}, position features on "
                         f"{positions.device}; allowed: all on one device")
    if any(w.dtype != torch.float32 for w in weights):   # the twin would answer in another dtype
        raise ValueError(f"kvp_score: weights of {sorted({str(w.dtype) for w in weights})}; allowed: torch.float32")
    positions = _as(positions, torch.float32)
    why = _why_not(keys.device, [positions])
    suffix = DTYPE_SUFFIX.get(keys.dtype)
    if why is None and (suffix is None or keys.stride(2) != 1 or values.stride(2) != 1):
        why = "keys and values of another dtype, or channels not contiguous"
    if why is None and _weights_unfit(weights, keys.device):
        why = "weights not float32, contiguous, on the keys' device"
    if why is None and not 1 <= H <= _GRID_Y_MAX:
        why = f"{H} heads: allowed 1 to {_GRID_Y_MAX} (a grid's second dimension)"
    if why is None and (hidden > _KVP_THREADS_MAX or 4 * (d_in + 2 * hidden) > SHARED_MAX):
        why = f"networks of {d_in} inputs and {hidden} hidden units: more than a block's threads or shared memory"
    k = loader.kernel("kvp_score", f"kvtier_kvp_score_{suffix}", keys.device) if why is None and T else None
    if k is None:
        loader.record("kvp_score", "twin", why or loader.build_error("kvp_score", keys.device) or "no tokens")
        return twins.kvp_score(keys, values, positions, weights, first)
    scores = torch.empty(H, T, dtype=torch.float32, device=keys.device)
    threads = min(_KVP_THREADS_MAX, max(32, -(-hidden // 32) * 32))
    loader.launch(k, keys.device, (T, H), (threads,),
                  (_u64(keys.data_ptr()), _i64(keys.stride(0)), _i64(keys.stride(1)), _u64(values.data_ptr()),
                   _i64(values.stride(0)), _i64(values.stride(1)), _u64(positions.data_ptr()), np.int32(D),
                   np.int32(f), np.int32(hidden), _i64(first),
                   *(_u64(w.data_ptr()) for w in weights), _u64(scores.data_ptr())),
                  shared_mem=4 * (d_in + 2 * hidden))
    loader.record("kvp_score", "kernel")
    return scores


_MERGE_THREADS = 256
_NO_PART = [np.uint64(0), np.int64(0), np.int64(0)] * 2   # a merge slot's null pointers and strides


def merge_parts(parts: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention over the union of disjoint key sets, from each set's attention output and log-sum-exp:
    one launch per `twins.MERGE_MAX` parts.

    Parameters
    ----------
    parts
        ``(out [heads, rows, dim], lse [heads, rows])`` per key set, float32, any strides with the channels
        contiguous; a set with no keys has lse -inf and weighs nothing.

    Returns
    -------
    ``(out [heads, rows, dim], lse [heads, rows])`` float32, contiguous; more than `twins.MERGE_MAX` parts are
    merged a group at a time, each group's result the first part of the next. A single part is returned as it is
    (no copy: its strides and storage are the caller's).
    """
    if not parts:
        raise ValueError("merge_parts: no parts; allowed: at least one (out, lse) pair")
    if parts[0][0].dim() != 3:
        raise ValueError(f"merge_parts: an out of {list(parts[0][0].shape)}; allowed: [heads, rows, dim]")
    H, R, D = parts[0][0].shape
    for o, lse in parts:
        if (tuple(o.shape) != (H, R, D) or tuple(lse.shape) != (H, R) or o.dtype != torch.float32
                or lse.dtype != torch.float32 or o.device != parts[0][0].device or lse.device != o.device):
            raise ValueError(f"merge_parts: a part of {list(o.shape)} {o.dtype} and {list(lse.shape)} {lse.dtype} "
                             f"on {o.device}; allowed: [{H}, {R}, {D}] and [{H}, {R}] torch.float32, all on "
                             f"{parts[0][0].device}")
    parts = list(parts)
    while len(parts) > 1:
        group, rest = parts[:twins.MERGE_MAX], parts[twins.MERGE_MAX:]
        parts = [_merge_group(group, H, R, D)] + rest
    return parts[0]


def _merge_group(group: list[tuple[torch.Tensor, torch.Tensor]], H: int, R: int,
                 D: int) -> tuple[torch.Tensor, torch.Tensor]:
    device = group[0][0].device
    why = _why_not(device, [])
    if why is None and any(o.stride(2) != 1 for o, _ in group):
        why = "an output whose channels are not contiguous"
    k = loader.kernel("merge_parts", "kvtier_merge_parts", device) if why is None and H * R * D else None
    if k is None:
        loader.record("merge_parts", "twin", why or loader.build_error("merge_parts", device) or "nothing to merge")
        return twins.merge_parts(group)
    out = torch.empty(H, R, D, dtype=torch.float32, device=device)
    lse = torch.empty(H, R, dtype=torch.float32, device=device)
    args: list = []
    for o, l_ in group:
        args += [_u64(o.data_ptr()), _i64(o.stride(0)), _i64(o.stride(1)),
                 _u64(l_.data_ptr()), _i64(l_.stride(0)), _i64(l_.stride(1))]
    args += _NO_PART * (twins.MERGE_MAX - len(group))   # slots past `count`: never read
    loader.launch(k, device, _grid(-(-(H * R * D) // _MERGE_THREADS)), (_MERGE_THREADS,),
                  (*args, np.int32(len(group)), np.int32(H), np.int32(R), np.int32(D), _u64(out.data_ptr()),
                   _u64(lse.data_ptr())))
    loader.record("merge_parts", "kernel")
    return out, lse


# ------------------------------------------------------------------------------ attention over the pool
_ATTEND_THREADS = 128
_ATTEND_CHUNK_MAX = 256    # entries per chunk: a chunk's logits stay in shared memory
_ATTEND_CHUNK_MIN = 32
_ATTEND_TILES = (128, 64, 32, 16, 8)   # keys staged at a time (divisors of the block's threads)
_ATTEND_BLOCKS = 512       # blocks `attend_chunk` aims for where no device says better (about 4 per SM)
# the default of `attend_slabs`' and `attend_pages`' `wide`: 16-byte loads several in flight, the values staged
# like the keys (same bits either way); off until a GPU's timings (`kvtier bench gpu`'s pool attention) say
ATTEND_WIDE = False


@functools.lru_cache(maxsize=16)
def _blocks_wanted(device: torch.device) -> int:
    if device.type == "cuda":
        return 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return _ATTEND_BLOCKS


def attend_chunk(count: int, heads: int, blocks: int | None = None, device: torch.device | None = None) -> int:
    """Entries per chunk for `attend_slabs` over `count` entries of `heads` heads: the largest power of two
    from 32 to 256 whose chunks still make `blocks` blocks (a long pool in long chunks, a short one split
    finely enough to fill the GPU); `blocks` defaults to four per SM of `device` (512 without a GPU)."""
    if blocks is None:
        blocks = _blocks_wanted(device or torch.device("cpu"))
    chunk = _ATTEND_CHUNK_MAX
    while chunk > _ATTEND_CHUNK_MIN and heads * -(-count // chunk) < blocks:
        chunk //= 2
    return chunk


def _attend_shared(rows: int, dim: int, chunk: int, tile: int, row_words: int, wide: bool) -> int:
    # `kv_attend_layout`: queries, logits, maxima and sums, a tile of words; with `wide`, the value sums
    return 4 * (rows * dim + rows * chunk + 2 * rows) + 4 * tile * (row_words + 1) + (4 * rows * dim if wide else 0)


@functools.lru_cache(maxsize=256)   # asked on every call, for a handful of shapes
def _attend_tile(rows: int, dim: int, chunk: int, row_words: int, wide: bool = False) -> tuple[int, int]:
    """The largest tile of keys a block stages within its shared memory (0 if none fits) and the bytes."""
    tile = next((t for t in _ATTEND_TILES if _attend_shared(rows, dim, chunk, t, row_words, wide) <= SHARED_MAX), 0)
    return tile, _attend_shared(rows, dim, chunk, tile, row_words, wide)


def _unaligned(tensors: Sequence[torch.Tensor]) -> str | None:
    """Why the attention kernels cannot read these keys or values (None if they can): they read each row as
    4-byte words, so a view starting between two words (an odd offset of 2-byte elements) would fault on the
    device. A slab storage is passed as its first slab, as for `_why_not`."""
    for t in tensors:
        if t.data_ptr() % 4:
            return f"keys or values at address {t.data_ptr():#x}, not 4-byte aligned"
    return None


def _wide_rows(base: int, head_stride: int, token_stride: int, itemsize: int, dim: int) -> bool:
    """Whether every entry's row is whole 16-byte words at a 16-byte aligned address (what `wide` reads)."""
    return not (base % 16 or head_stride * itemsize % 16 or token_stride * itemsize % 16 or dim * itemsize % 16)


def attend_slabs(q: torch.Tensor, k_slabs: Sequence[torch.Tensor], v_slabs: Sequence[torch.Tensor], count: int,
                 scale: float, chunk: int | None = None,
                 addresses: tuple[torch.Tensor, torch.Tensor] | None = None,
                 whole: tuple[torch.Tensor, torch.Tensor] | None = None,
                 counted: tuple[torch.Tensor, int] | None = None,
                 wide: bool | None = None, softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of a decoding step's queries over the first `count` entries of a device pool, in one launch
    (two where the pool spans several chunks or a `whole` part is merged in): in place of an attention call
    per slab and the log-sum-exp of their log-sum-exps.

    Parameters
    ----------
    q
        ``[heads, rows, dim]`` in the slabs' dtype, channels contiguous: each KV head's query rows (its query
        heads packed as rows, as `kvtier.engine.attention.attend_parts` packs them).
    k_slabs, v_slabs
        The pool's slabs, ``[1, heads, slab_tokens, dim]`` (or without the 1), contiguous, all alike.
    count
        Entries to attend to, 1 to the slabs' capacity.
    scale
        The logit scale.
    chunk
        Entries per chunk, 1 to 256 (default `attend_chunk` for the device); the result's bits depend on it.
    addresses
        The slabs' ``(keys, values)`` addresses from `slab_addresses` (a pool keeps them until it changes).
    whole
        ``(out [heads, rows, dim], lse [heads, rows])`` float32 of attention over other keys, merged in.
    counted
        ``(at, base)``: `count` as the device keeps it, ``base + at[0]`` (`at` int64 ``[1]`` on the queries'
        device). The kernels read it there, and so does the twin; their grid covers every entry the slabs hold
        (`chunk` defaults to what their capacity gives), so the launches are the same whatever the count: what
        a captured decode step needs (`DevicePool.at`). `count` is then the host's word for it, for the checks.
    wide
        Read the entries 16 bytes a load, several in flight, and stage the values like the keys, where their
        rows allow it (whole 16-byte words, aligned); the same bits either way. None: `ATTEND_WIDE`.
    softcap
        The model's logit soft-cap (Gemma 2): each logit ``softcap * tanh(logit / softcap)``, with the kernels'
        own tanh (`twins.tanh`, within 5 ulp of the exact one); None: none.

    Returns
    -------
    ``(out [heads, rows, dim], lse [heads, rows])`` float32: the attention and its log-sum-exp, summed in
    the order ``native/attend_slabs.cu`` gives, so they differ from an attention call's by float rounding.
    """
    if q.dim() != 3:
        raise ValueError(f"attend_slabs: q is {list(q.shape)}; allowed: [heads, rows, dim]")
    H, R, D = q.shape
    if not k_slabs or len(v_slabs) != len(k_slabs):
        raise ValueError(f"attend_slabs: {len(k_slabs)} key slabs and {len(v_slabs)} value slabs; allowed: the "
                         "same number, at least one")
    first = k_slabs[0]
    per = first.shape[-2]
    shape = (H, per, D)
    for s in (first, v_slabs[0]):   # a pool makes its slabs alike: the first of each stands for them all
        if tuple(s.shape[-3:]) != shape or s.dim() not in (3, 4) or s.dtype != first.dtype or s.device != q.device:
            raise ValueError(f"attend_slabs: a slab of {list(s.shape)} {s.dtype} on {s.device}; allowed: "
                             f"[1, {H}, {per}, {D}] {first.dtype} on {q.device}, like the first key slab")
    capacity = per * len(k_slabs)
    if not 1 <= count <= capacity:
        raise ValueError(f"attend_slabs: count={count}; allowed: 1 to {capacity} (the slabs' entries)")
    if counted is not None:
        at, base = counted
        if at.shape != (1,) or at.dtype != torch.int64 or at.device != q.device:
            raise ValueError(f"attend_slabs: counted at {list(at.shape)} {at.dtype} on {at.device}; allowed: [1] "
                             f"torch.int64 on {q.device}")
        if at.device.type == "cpu" and not 1 <= base + int(at[0]) <= capacity:   # free to read on the host
            raise ValueError(f"attend_slabs: a count of {base + int(at[0])} (base {base} + at {int(at[0])}); allowed: "
                             f"1 to {capacity} (the slabs' entries)")
    chunk = _check_attend(q, whole, capacity if counted is not None else count, chunk, "attend_slabs", softcap)

    def twin() -> tuple[torch.Tensor, torch.Tensor]:   # on a GPU, the host's count: reading the device's syncs
        on_host = counted is not None and counted[0].device.type == "cpu"
        if counted is not None and not on_host and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("attend_slabs: the twin takes the host's count, which a CUDA graph would replay "
                               "unchanged; allowed under capture: the kernel's path only")
        return twins.attend_slabs(q, k_slabs, v_slabs, count, scale, chunk, whole, counted if on_host else None,
                                  softcap)

    why = _why_not(q.device, [first, v_slabs[0]]) or _unaligned([first, v_slabs[0]])
    k_addr = v_addr = None
    if why is None:
        k_addr = _addresses(k_slabs, q.device, None if addresses is None else addresses[0])
        v_addr = _addresses(v_slabs, q.device, None if addresses is None else addresses[1])
        if k_addr is None or v_addr is None:
            why = "a slab out of the kernel's reach"
    where = (_ptr(k_addr), _ptr(v_addr), _u64(0), _u64(0), _i64(per), _i64(first.stride(-3)),
             _i64(first.stride(-2)), _u64(0), _i64(0), np.int32(0))
    wide = (ATTEND_WIDE if wide is None else wide) and all(   # a pool makes its slabs alike: the first ones tell
        _wide_rows(s.data_ptr(), s.stride(-3), s.stride(-2), s.element_size(), D) for s in (first, v_slabs[0]))
    return _attend(q, first.dtype, where, count, scale, chunk, whole, why, twin, "attend_slabs",
                   None if counted is None else (counted[0], counted[1], capacity), wide, softcap)


def attend_pages(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, pages: torch.Tensor,
                 page_size: int, scale: float, chunk: int | None = None,
                 whole: tuple[torch.Tensor, torch.Tensor] | None = None,
                 wide: bool | None = None, softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`attend_slabs` over pages where a recall buffer holds them, read through a page table (no gather).

    `k_buffer`, `v_buffer` are ``[heads, slots * page_size, dim]`` (contiguous, the queries' dtype), `pages`
    ``[heads, n]`` int64 on their device: the slot of each page to attend, in the order attention reads them
    (which fixes the result's bits, not which slots hold the pages). Entries read: ``n * page_size``. Slots
    are not checked on the device (that would need the host); the recall plan makes them. `whole`, `chunk`,
    `wide`, `softcap` and the result are as for `attend_slabs`.
    """
    if q.dim() != 3 or k_buffer.dim() != 3:
        raise ValueError(f"attend_pages: q {list(q.shape)} and buffer {list(k_buffer.shape)}; allowed: "
                         "[heads, rows, dim] and [heads, slots * page_size, dim]")
    H, R, D = q.shape
    if (tuple(k_buffer.shape) != tuple(v_buffer.shape) or k_buffer.shape[0] != H or k_buffer.shape[2] != D
            or k_buffer.dtype != v_buffer.dtype or k_buffer.device != q.device or v_buffer.device != q.device
            or not 1 <= page_size < 2 ** 31 or k_buffer.shape[1] % page_size or k_buffer.shape[1] == 0):
        raise ValueError(f"attend_pages: buffers {list(k_buffer.shape)} {k_buffer.dtype} and "
                         f"{list(v_buffer.shape)} {v_buffer.dtype} with page_size={page_size}; allowed: two "
                         f"[{H}, slots * page_size, {D}] buffers of one dtype on {q.device}, at least one slot, "
                         "page_size 1 to 2**31 - 1")
    if pages.dim() != 2 or pages.shape[0] != H or pages.shape[1] < 1 or pages.dtype != torch.int64 \
            or pages.device != q.device:
        raise ValueError(f"attend_pages: pages {list(pages.shape)} {pages.dtype} on {pages.device}; allowed: "
                         f"[{H}, n >= 1] torch.int64 on {q.device}")
    count = pages.shape[1] * page_size
    chunk = _check_attend(q, whole, count, chunk, "attend_pages", softcap)
    pages = _as(pages, torch.int64)

    def twin() -> tuple[torch.Tensor, torch.Tensor]:
        return twins.attend_pages(q, k_buffer, v_buffer, pages, page_size, scale, chunk, whole, softcap)

    why = _why_not(q.device, [k_buffer, v_buffer]) or _unaligned([k_buffer, v_buffer])
    where = (_u64(0), _u64(0), _u64(k_buffer.data_ptr()), _u64(v_buffer.data_ptr()), _i64(k_buffer.shape[1]),
             _i64(k_buffer.stride(0)), _i64(k_buffer.stride(1)), _u64(pages.data_ptr()), _i64(pages.shape[1]),
             np.int32(page_size))
    wide = (ATTEND_WIDE if wide is None else wide) and all(
        _wide_rows(b.data_ptr(), b.stride(0), b.stride(1), b.element_size(), D) for b in (k_buffer, v_buffer))
    return _attend(q, k_buffer.dtype, where, count, scale, chunk, whole, why, twin, "attend_pages", wide=wide,
                   softcap=softcap)


def _check_softcap(softcap: float, op: str) -> None:
    """A soft-cap as the kernels get it: a float32, finite and above 0 (1e39 would be infinite there, 1e-50 zero)."""
    with np.errstate(over="ignore"):
        cap = np.float32(softcap) if isinstance(softcap, numbers.Real) and not isinstance(softcap, bool) else None
    if not (cap is not None and math.isfinite(cap) and cap > 0):
        raise ValueError(f"{op}: softcap={softcap!r}; allowed: None or a number > 0 and finite in float32")


def _check_attend(q: torch.Tensor, whole: tuple[torch.Tensor, torch.Tensor] | None, count: int,
                  chunk: int | None, op: str, softcap: float | None = None) -> int:
    """The chunk to use (checked), after checking the part given whole and the soft-cap."""
    H, R, D = q.shape
    if softcap is not None:   # asked each layer and step: nothing to do in the usual case, no cap
        _check_softcap(softcap, op)
    if whole is not None and (tuple(whole[0].shape) != (H, R, D) or tuple(whole[1].shape) != (H, R)
                              or whole[0].dtype != torch.float32 or whole[1].dtype != torch.float32
                              or whole[0].device != q.device or whole[1].device != q.device
                              or whole[0].stride(2) != 1):
        raise ValueError(f"{op}: a whole part of {list(whole[0].shape)} {whole[0].dtype} and "
                         f"{list(whole[1].shape)} {whole[1].dtype}; allowed: [{H}, {R}, {D}] (channels contiguous) "
                         f"and [{H}, {R}] torch.float32 on {q.device}")
    if chunk is None:
        return attend_chunk(count, H, device=q.device)
    if not 1 <= chunk <= _ATTEND_CHUNK_MAX:
        raise ValueError(f"{op}: chunk={chunk}; allowed: 1 to {_ATTEND_CHUNK_MAX} entries (a chunk's logits stay "
                         "in a block's shared memory)")
    return chunk


def _attend(q: torch.Tensor, dtype: torch.dtype, where: tuple, count: int, scale: float, chunk: int,
            whole: tuple[torch.Tensor, torch.Tensor] | None, why: str | None, twin, op: str,
            counted: tuple[torch.Tensor, int, int] | None = None,
            wide: bool = False, softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The two launches of `attend_slabs` and `attend_pages` (`where`: the kernel's arguments saying where the
    entries are), or their twin; `counted` is ``(at, base, capacity)``: the count read on the device, the
    grid made for `capacity` entries; `wide` as checked by the caller (rows of aligned 16-byte words); `softcap`
    checked (None: 0 to the kernel, which then leaves the logits as they are)."""
    H, R, D = q.shape
    device = q.device
    chunks = -(-(count if counted is None else counted[2]) // chunk)
    count_arg, count_at = (_i64(count), _u64(0)) if counted is None else (_i64(counted[1]), _ptr(counted[0]))
    finish = chunks == 1 and whole is None
    launches = 1 if finish else 2
    row_bytes = D * dtype.itemsize
    row_words = row_bytes // 4
    suffix = DTYPE_SUFFIX.get(dtype)
    if why is None and (suffix is None or q.dtype != dtype or q.stride(2) != 1):
        why = "a query of another dtype than the keys', or channels not contiguous"
    if why is None and not (1 <= H <= _GRID_Y_MAX and R and D):   # grids of (chunks, H) and (R, H) blocks of D
        why = f"{H} heads of {R} query rows of {D} channels: allowed 1 to {_GRID_Y_MAX} heads, rows and channels"
    if why is None and (row_bytes % 4 or R > twins.ATTEND_ROWS):
        why = f"keys of {D} channels (not whole 4-byte words) or {R} query rows (over {twins.ATTEND_ROWS})"
    tile, shared = _attend_tile(R, D, chunk, row_words, True) if wide else (0, 0)
    if not tile:   # not asked for, or its value sums do not fit beside a tile: the narrow reads
        wide = False
        tile, shared = _attend_tile(R, D, chunk, row_words)
    if why is None and (not tile or 4 * (chunks + 3) > SHARED_MAX):
        why = f"{R} rows of {D} channels in chunks of {chunk} ({chunks} chunks): more than a block's shared memory"
    name = f"kvtier_attend_chunks_wide_{suffix}" if wide else f"kvtier_attend_chunks_{suffix}"   # its own reads
    k = loader.kernel("attend_slabs", name, device) if why is None else None
    c = loader.kernel("attend_slabs", "kvtier_attend_combine", device) if k is not None and not finish else None
    if k is None or (not finish and c is None):
        loader.record(op, "twin", why or loader.build_error("attend_slabs", device), launches=launches)
        return twin()
    out = torch.empty(H, R, D, dtype=torch.float32, device=device)
    lse = torch.empty(H, R, dtype=torch.float32, device=device)
    if finish:
        sums = (_u64(0),) * 3
    else:
        part_a = torch.empty(H, chunks, R, D, dtype=torch.float32, device=device)
        part_m = torch.empty(H, chunks, R, dtype=torch.float32, device=device)
        part_l = torch.empty_like(part_m)
        sums = (_u64(part_a.data_ptr()), _u64(part_m.data_ptr()), _u64(part_l.data_ptr()))
    loader.launch(k, device, (chunks, H), (_ATTEND_THREADS,),
                  (_u64(q.data_ptr()), _i64(q.stride(0)), _i64(q.stride(1)), *where, count_arg, count_at,
                   np.int32(R), np.int32(D), np.int32(chunk), np.int32(tile), np.int32(finish), np.float32(scale),
                   np.float32(softcap or 0.0), *sums, _u64(out.data_ptr()), _u64(lse.data_ptr())),
                  shared_mem=shared)
    if not finish:
        if whole is None:
            parts = (_u64(0), _i64(0), _i64(0), _u64(0), _i64(0), _i64(0))
        else:
            o, w = whole
            parts = (_u64(o.data_ptr()), _i64(o.stride(0)), _i64(o.stride(1)), _u64(w.data_ptr()),
                     _i64(w.stride(0)), _i64(w.stride(1)))
        threads = min(256, -(-D // 32) * 32)
        loader.launch(c, device, (R, H), (threads,),
                      (*sums, _i64(chunks), count_arg, count_at, np.int32(chunk), np.int32(R), np.int32(D), *parts,
                       _u64(out.data_ptr()), _u64(lse.data_ptr())),
                      shared_mem=4 * (chunks + 3))
    loader.record(op, "kernel", launches=launches)
    return out, lse
