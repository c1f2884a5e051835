"""Torch twins of the native kernels: the same results, bit for bit, on any device.

A twin runs wherever its kernel does not (no CUDA, no cupy, kernels switched off, inputs the kernel does not
take), and it is what each kernel is tested against. Copies are exact by nature. The float reductions of
``native/page_select.cu`` are only reproducible in a fixed order, so their twins follow the kernel's order
step by step: one torch multiply or add per kernel operation, each rounding to nearest in float32 on its
own (separate torch ops are never fused into multiply-adds). Their results differ from a matrix product's
by float rounding, which sums in its own, unspecified order.

Storage arguments follow `kvtier.tiers.slabs.SlabRows`: a list of slabs ``[rows_per_slab, *row_shape]``
whose rows are numbered across slabs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from .layout import CODE_LEVELS, pack_codes, write_rows

LANES = 32                   # threads of a warp: the upper-bound sum is split over them
_CHUNK_ELEMENTS = 1 << 22    # elements of a twin's largest temporary


# ------------------------------------------------------------------------------------------------- copies
def _runs(rows: np.ndarray, rows_per_slab: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Slab and offset of each row, and the ``[start, end)`` of each run of rows in one slab."""
    slab, off = np.divmod(rows, rows_per_slab)
    edges = np.flatnonzero(np.diff(slab)) + 1
    return slab, off, np.r_[0, edges], np.r_[edges, len(rows)]


def _groups(rows: torch.Tensor, rows_per_slab: int, slabs: int) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """``(slab, positions in rows, offsets in the slab)`` for each slab that `rows` touches."""
    slab, off = np.divmod(rows.cpu().numpy(), rows_per_slab)
    order = np.argsort(slab, kind="stable")
    edges = np.searchsorted(slab[order], np.arange(slabs + 1))
    out = []
    for s in range(slabs):
        a, b = edges[s], edges[s + 1]
        if a < b:
            pos = order[a:b]
            out.append((s, torch.from_numpy(pos).to(rows.device), torch.from_numpy(off[pos]).to(rows.device)))
    return out


def gather_pages(slabs: Sequence[torch.Tensor], rows_per_slab: int, rows: torch.Tensor,
                 out: torch.Tensor) -> torch.Tensor:
    """``out[i] = row rows[i]`` of the storage (twin of ``kvtier_gather_pages``).

    Copies run by run of rows in one slab, so rows sorted by slab (or mostly so) gather in a few calls; a
    scattered request takes one grouped pass per slab instead. When `out` lives on another device than the
    slabs (host pages recalled into device memory) the rows are gathered where the slabs are, then copied.
    """
    where = slabs[0].device if slabs else out.device
    if out.device != where:
        staged = torch.empty(out.shape, dtype=out.dtype, device=where)
        return out.copy_(gather_pages(slabs, rows_per_slab, rows, staged))
    rows = rows.to(where)
    if len(slabs) == 1:
        return torch.index_select(slabs[0], 0, rows, out=out)
    slab, off, starts, ends = _runs(rows.cpu().numpy(), rows_per_slab)
    if len(starts) > 8 + 2 * len(slabs):   # scattered: one grouped pass per slab instead
        for s, pos, o in _groups(rows, rows_per_slab, len(slabs)):
            out.index_copy_(0, pos, torch.index_select(slabs[s], 0, o))
        return out
    off_t = torch.from_numpy(off).to(where)
    for a, b in zip(starts.tolist(), ends.tolist()):
        if a < b:
            torch.index_select(slabs[int(slab[a])], 0, off_t[a:b], out=out[a:b])
    return out


def scatter_pages(slabs: Sequence[torch.Tensor], rows_per_slab: int, rows: torch.Tensor,
                  values: torch.Tensor) -> None:
    """Row ``rows[i]`` of the storage ``= values[i]`` (twin of ``kvtier_scatter_pages``); rows are distinct."""
    where = slabs[0].device
    values = values.to(dtype=slabs[0].dtype, device=where)
    rows = rows.to(where)
    if len(slabs) == 1:
        slabs[0].index_copy_(0, rows, values)
        return
    for s, pos, off in _groups(rows, rows_per_slab, len(slabs)):
        slabs[s].index_copy_(0, off, torch.index_select(values, 0, pos))


# ------------------------------------------------------------------------------------------ recall index
def index_pages(keys: torch.Tensor, bounds: Sequence[torch.Tensor], rows_per_slab: int, first: int) -> torch.Tensor:
    """The recall index of pages ``keys`` ``[heads, m, page_size, dim]`` (twin of ``kvtier_index_pages``, whose
    header in ``native/index_pages.cu`` states the rule): bounds rows ``first + j * heads + h`` = ``[hi, lo]``
    written into the `bounds` storage; returns the codes ``[m * heads, page_size, ceil(dim / 4)]`` uint8. A NaN
    bound's payload may differ from the kernel's (it keeps the NaN key's own)."""
    H, m, P, D = keys.shape
    k = keys.float()
    zero = torch.zeros((), device=k.device)
    lo, hi = k.amin(dim=2), k.amax(dim=2)                          # [H, m, D]; a NaN wins
    lo, hi = torch.where(lo == 0, zero, lo), torch.where(hi == 0, zero, hi)
    step = ((hi - lo) / torch.full_like(lo, float(CODE_LEVELS))).clamp_(min=torch.finfo(torch.float32).tiny)
    c = ((k - lo[:, :, None]) / step[:, :, None]).round_().clamp_(0, CODE_LEVELS).nan_to_num_(0).to(torch.uint8)
    codes = pack_codes(c)
    if keys.dtype == torch.float64:   # no kernel: the bounds are the keys' own elements (float32's might not bound)
        lo, hi = keys.amin(dim=2), keys.amax(dim=2)
        lo, hi = torch.where(lo == 0, zero.double(), lo), torch.where(hi == 0, zero.double(), hi)
    rows = torch.cat([hi, lo], dim=-1).to(bounds[0].dtype if bounds else keys.dtype)
    write_rows(bounds, rows_per_slab, first, rows.transpose(0, 1).reshape(m * H, 2 * D))
    return codes.transpose(0, 1).reshape(m * H, P, -1)


def _entry_rows(slab: torch.Tensor) -> torch.Tensor:
    """A device pool's slab as ``[heads, slab_tokens, ...]``."""
    return slab[0] if slab.dim() == 4 else slab


def _reads_free(rows: Sequence[torch.Tensor]) -> bool:
    """Whether the entry twins may read their indices on the host: on the CPU it costs nothing, and grouping
    the lanes by slab copies each entry once, where the way that reads nothing back passes over every lane once
    per slab (a prefill's demotion from a pool of many slabs: seconds). Slabs are whole, contiguous tensors."""
    return rows[0].device.type == "cpu" and all(r.is_contiguous() for r in rows)


def _entry_groups(idx: torch.Tensor, slab_tokens: int, slabs: int) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """``(slab, lanes of idx.view(-1), rows of the slab seen as [heads * slab_tokens, ...])`` for each slab that
    the entries ``idx`` ``[heads, m]`` touch."""
    m = idx.shape[1]
    return [(s, lanes, off + torch.div(lanes, m, rounding_mode="floor") * slab_tokens)
            for s, lanes, off in _groups(idx.reshape(-1), slab_tokens, slabs)]


def pack_entries(slabs: Sequence[torch.Tensor], idx: torch.Tensor) -> torch.Tensor:
    """Entries ``idx`` ``[heads, m]`` of a device pool's slabs (``[1, heads, slab_tokens, dim]`` or ``[heads,
    slab_tokens]``) as ``[heads, m, ...]`` (twin of ``kvtier_pack_entries``): on the CPU, each slab's entries
    copied once (`_reads_free`); elsewhere a gather per slab, nothing read back to the host."""
    rows = [_entry_rows(t) for t in slabs]
    S = rows[0].shape[1]
    shape = (*idx.shape, *rows[0].shape[2:])
    tail = [1] * (len(shape) - 2)
    if len(rows) == 1:
        return torch.gather(rows[0], 1, idx.view(*idx.shape, *tail).expand(shape))
    if _reads_free(rows):
        out = torch.empty(idx.numel(), *shape[2:], dtype=rows[0].dtype)
        for s, lanes, at in _entry_groups(idx, S, len(rows)):
            out.index_copy_(0, lanes, rows[s].reshape(rows[s].shape[0] * S, *shape[2:]).index_select(0, at))
        return out.view(shape)
    slab, off = torch.div(idx, S, rounding_mode="floor"), idx % S
    at = off.view(*idx.shape, *tail).expand(shape)
    out = torch.gather(rows[0], 1, at)
    for s in range(1, len(rows)):
        sel = (slab == s).view(*idx.shape, *tail)
        out = torch.where(sel, torch.gather(rows[s], 1, at), out)
    return out


def unpack_entries(slabs: Sequence[torch.Tensor], idx: torch.Tensor, values: torch.Tensor) -> None:
    """Write ``values`` ``[heads, m, ...]`` onto entries ``idx`` ``[heads, m]`` (distinct per head) of a device
    pool's slabs: on the CPU, each slab's entries copied once (`_reads_free`); elsewhere a scatter per slab,
    nothing read back to the host.

    Without reading back, over several slabs, each slab gets a scatter of all `m` lanes: a lane meant for
    another slab repeats the first lane of its head that is meant for this one (same place, same bytes), or,
    with none, writes back what the slab holds at its first entry.
    """
    rows = [_entry_rows(t) for t in slabs]
    S = rows[0].shape[1]
    extra = [1] * (values.dim() - 2)
    if len(rows) == 1:
        rows[0].scatter_(1, idx.view(*idx.shape, *extra).expand(values.shape), values)
        return
    if _reads_free(rows):
        flat = values.reshape(idx.numel(), *values.shape[2:])
        for s, lanes, at in _entry_groups(idx, S, len(rows)):
            rows[s].view(rows[s].shape[0] * S, *values.shape[2:]).index_copy_(0, at, flat.index_select(0, lanes))
        return
    slab, off = torch.div(idx, S, rounding_mode="floor"), idx % S
    for s, r in enumerate(rows):
        mine = slab == s
        first = mine.to(torch.uint8).argmax(dim=1, keepdim=True)        # 0 when the head has none here
        has = mine.any(dim=1, keepdim=True)
        at = torch.where(mine, off, torch.where(has, off.gather(1, first), 0))
        at_v = at.view(*idx.shape, *extra).expand(values.shape)
        ref = torch.where(has.view(-1, 1, *extra),
                          values.gather(1, first.view(-1, 1, *extra).expand(-1, 1, *values.shape[2:])),
                          r[:, :1])
        r.scatter_(1, at_v, torch.where(mine.view(*idx.shape, *extra), values, ref))


def move_entries(slabs: Sequence[torch.Tensor], src: torch.Tensor, dst: torch.Tensor) -> None:
    """Entry ``src[h, j]`` of each head copied onto its entry ``dst[h, j]`` (twin of ``kvtier_move_entries``):
    every source read before anything is written."""
    unpack_entries(slabs, dst, pack_entries(slabs, src))


# ---------------------------------------------------------------------------------------- page selection
def _lane_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last axis in the kernel's warp order: lane ``l`` adds ``x[l], x[l + 32], ...`` from +0,
    then lanes combine as a tree (lane ``l`` adds lane ``l + off`` for off = 16, 8, 4, 2, 1)."""
    dim = x.shape[-1]
    acc = torch.zeros(*x.shape[:-1], LANES, dtype=torch.float32, device=x.device)
    for j in range(0, dim, LANES):
        seg = x[..., j:j + LANES]
        w = seg.shape[-1]
        acc[..., :w] = acc[..., :w] + seg
    off = LANES // 2
    while off:
        acc = acc[..., :off] + acc[..., off:2 * off]
        off //= 2
    return acc[..., 0]


def page_upper_bounds(q: torch.Tensor, bounds: torch.Tensor, heads: int,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """Upper bound of each page's logit for a KV head's queries (twin of ``kvtier_page_upper_bounds_*``).

    Parameters
    ----------
    q
        ``[heads, rows, dim]`` float32 grouped queries.
    bounds
        ``[pages * heads, 2 * dim]`` rows ``page * heads + head`` of ``[hi | lo]`` key bounds (any float dtype).

    Returns
    -------
    ``[heads, pages]`` float32 (in `out` when given): the maximum over rows of ``sum_d (q >= 0 ? q * hi :
    q * lo)``, summed in the kernel's warp order (`_lane_sum`); the maximum propagates NaN.
    """
    H, R, D = q.shape
    pages = bounds.shape[0] // heads
    b = bounds.view(pages, heads, 2, D)
    if out is None:
        out = torch.empty(H, pages, dtype=torch.float32, device=q.device)
    step = max(1, _CHUNK_ELEMENTS // max(1, H * R * D))
    qe = q[:, :, None, :]                                               # [H, R, 1, D]
    for p0 in range(0, pages, step):
        hi = b[p0:p0 + step, :, 0].float().permute(1, 0, 2)[:, None]   # [H, 1, c, D]
        lo = b[p0:p0 + step, :, 1].float().permute(1, 0, 2)[:, None]
        prod = torch.where(qe >= 0, qe * hi, qe * lo)                   # [H, R, c, D]
        out[:, p0:p0 + hi.shape[2]] = _lane_sum(prod).amax(dim=1)
    return out


def unpack_codes(codes: torch.Tensor, dim: int) -> torch.Tensor:
    """2-bit codes ``[..., ceil(dim / 4)]`` uint8 as floats ``[..., dim]`` in channel order (channel ``d`` is
    bits ``2 (d % 4)`` and ``2 (d % 4) + 1`` of byte ``d // 4``, as `kvtier.recall.codes.encode` packs them)."""
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=codes.device)
    c = (codes[..., None] >> shifts) & 3
    return c.reshape(*codes.shape[:-1], 4 * codes.shape[-1])[..., :dim].float()


def code_logits(q: torch.Tensor, lo: torch.Tensor, step: torch.Tensor, codes: torch.Tensor,
                scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of short-listed pages from their codes (twin of ``kvtier_code_logits``).

    Parameters
    ----------
    q
        ``[heads, rows, dim]`` float32 grouped queries.
    lo, step
        ``[heads, c, dim]`` float32: each candidate's key minimum and code step (`kvtier.recall.codes.step`).
    codes
        ``[heads, c, page_size, ceil(dim / 4)]`` uint8.
    scaling
        The logit scale; taken as float32.

    Returns
    -------
    ``logits`` ``[heads, c, rows, page_size]`` = ``scaling * sum_d (q * step) * code`` and ``base``
    ``[heads, c, rows]`` = ``scaling * sum_d q * lo``, both float32, each sum over d = 0, 1, ... in order.
    """
    H, R, D = q.shape
    c, P = codes.shape[1], codes.shape[2]
    s = float(np.float32(scaling))   # a float32 value: multiplying by it rounds as the kernel's product
    logits = torch.empty(H, c, R, P, dtype=torch.float32, device=q.device)
    base = torch.empty(H, c, R, dtype=torch.float32, device=q.device)
    chunk = max(1, _CHUNK_ELEMENTS // max(1, H * R * max(P, D)))
    for c0 in range(0, c, chunk):
        sl = slice(c0, c0 + chunk)
        code = unpack_codes(codes[:, sl], D)                      # [H, k, P, D]
        w = q[:, None] * step[:, sl, None, :]                     # [H, k, R, D]
        q_lo = q[:, None] * lo[:, sl, None, :]                    # [H, k, R, D]
        acc = torch.zeros(H, code.shape[1], R, P, dtype=torch.float32, device=q.device)
        acc_b = torch.zeros(H, code.shape[1], R, dtype=torch.float32, device=q.device)
        for d in range(D):
            acc = acc + w[..., d, None] * code[:, :, None, :, d]
            acc_b = acc_b + q_lo[..., d]
        logits[:, sl] = acc * s
        base[:, sl] = acc_b * s
    return logits, base


# ----------------------------------------------------------------------------- exp, log and log-sum-exp
def _f32(*values: str) -> list[float]:
    """The kernels' float32 constants from their hexadecimal literals, as Python floats: each is exact in
    float32, so a float32 tensor times, plus or minus one of them rounds as with the constant in float32; and
    no tensor is made, so a twin on a GPU copies nothing up. (Divisions take a device tensor instead: CUDA
    divides by a host scalar as a multiply by its reciprocal.)"""
    return [float.fromhex(v) for v in values]


def _bits_float(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int32).view(torch.float32)


def exp(x: torch.Tensor) -> torch.Tensor:
    """e^x of float32 `x` as ``kv_exp`` in ``native/kvtier_native.cuh`` computes it, bit for bit (its comment
    gives the method); within 2 ulp of e^x, 0 below log(FLT_MIN)."""
    x = x.float()
    log2e, magic, ln2_hi, ln2_lo, top, bottom = _f32("0x1.715476p+0", "0x1.8p+23", "0x1.62e400p-1",
                                                     "0x1.7f7d1cp-20", "0x1.62e430p+6", "-0x1.5d589ep+6")
    k = ((x * log2e) + magic) - magic
    r = (x - k * ln2_hi) - k * ln2_lo
    p = torch.full_like(x, float.fromhex("0x1.a01a02p-13"))
    for c in ("0x1.6c16c2p-10", "0x1.111112p-7", "0x1.555556p-5", "0x1.555556p-3", "0x1p-1", "0x1p+0", "0x1p+0"):
        p = p * r + float.fromhex(c)
    ki = torch.nan_to_num(k, nan=0.0).clamp(-126, 128).to(torch.int32)
    k1 = ki >> 1
    out = (p * _bits_float((k1 + 127) << 23)) * _bits_float((ki - k1 + 127) << 23)
    out = torch.where(x < bottom, torch.zeros_like(x), out)
    out = torch.where(x > top, torch.full_like(x, float("inf")), out)
    return torch.where(torch.isnan(x), x, out)


def log(x: torch.Tensor) -> torch.Tensor:
    """log x of float32 `x` as ``kv_log`` in ``native/kvtier_native.cuh`` computes it, bit for bit."""
    x = x.float()
    tiny, sqrt2, ln2_hi, ln2_lo = _f32("0x1p-126", "0x1.6a09e6p+0", "0x1.62e400p-1", "0x1.7f7d1cp-20")
    sub = x < tiny
    xs = torch.where(sub, x * float.fromhex("0x1p+23"), x)
    b = xs.view(torch.int32)
    e = torch.where(sub, -23, 0) + ((b >> 23) & 0xFF) - 127
    m = _bits_float((b & 0x7FFFFF) | 0x3F800000)
    big = m > sqrt2
    m = torch.where(big, m * 0.5, m)
    e = e + big.to(torch.int32)
    one = torch.ones_like(m)
    f = (m - one) / (m + one)
    f2 = f * f
    p = torch.full_like(x, float.fromhex("0x1.3b13b2p-4"))
    for c in ("0x1.745d18p-4", "0x1.c71c72p-4", "0x1.24924ap-3", "0x1.99999ap-3", "0x1.555556p-2"):
        p = p * f2 + float.fromhex(c)
    p = p * f2
    t = f + f
    ef = e.float()
    out = ef * ln2_hi + (ef * ln2_lo + (t + t * p))
    out = torch.where(x == float("inf"), x, out)
    out = torch.where(x == 0, torch.full_like(x, float("-inf")), out)
    return torch.where(torch.isnan(x) | (x < 0), torch.full_like(x, float("nan")), out)


def tanh(y: torch.Tensor) -> torch.Tensor:
    """tanh y of float32 `y` as ``kv_tanh`` in ``native/kvtier_native.cuh`` computes it, bit for bit (its comment
    gives the method); within 5 ulp of tanh y."""
    y = y.float()
    a = y.abs()
    y2 = y * y
    p = torch.full_like(y, float.fromhex("-0x1.ba1ba2p-5"))
    for c in ("0x1.111112p-3", "-0x1.555556p-2", "0x1p+0"):
        p = p * y2 + float.fromhex(c)
    small = y * p
    t = exp(a * -2.0)
    r = (1.0 - t) / (1.0 + t)
    big = torch.where(y < 0, -r, r)
    return torch.where(torch.isnan(y), y, torch.where(a < 0.125, small, big))


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``kv_softcap``: float32 logits `x` capped as ``cap tanh(x / cap)`` (`cap` None or 0: unchanged)."""
    if not cap:
        return x
    c = torch.full((), cap, dtype=torch.float32, device=x.device)   # a device tensor: CUDA would divide by a host
    return tanh(x / c) * c                                           # scalar as a multiply by its reciprocal


def _running_max(x: torch.Tensor) -> torch.Tensor:
    """The maximum over the last axis taken in order from the first element, NaN winning (as the kernels)."""
    m = x[..., 0]
    for i in range(1, x.shape[-1]):
        v = x[..., i]
        m = torch.where(torch.isnan(v) | (v > m), v, m)
    return m


def logsumexp(x: torch.Tensor) -> torch.Tensor:
    """``kv_logsumexp`` over the last axis of float32 `x` (at least one element), bit for bit: the maximum
    m, then the sum of e^(x - m) from +0 in order, then m + log(sum); m itself when it is NaN or infinite."""
    m = _running_max(x)
    s = torch.zeros_like(m)
    for i in range(x.shape[-1]):
        s = s + exp(x[..., i] - m)
    out = m + log(s)
    return torch.where(torch.isnan(m) | torch.isinf(m), m, out)


# ------------------------------------------------------------------------------------------ page ranking
def rank_pages(q: torch.Tensor, cand: torch.Tensor, pages: int, bounds: tuple[Sequence[torch.Tensor], int],
               codes: tuple[Sequence[torch.Tensor], int], page: int, scaling: float, keep: int,
               resident: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The short list's shares of attention and its ranking (twin of ``kvtier_rank_pages_*``, whose header
    in ``native/rank_pages.cu`` states every step).

    Parameters
    ----------
    q
        ``[heads, rows, dim]`` float32 grouped queries.
    cand
        ``[heads, m]`` int64 distinct candidate page ids.
    pages
        Pages in the index (a candidate outside it reads nothing, and its head's shares come out NaN).
    bounds, codes
        ``(slabs, rows_per_slab)`` of the index's storages: rows ``page * heads + head`` of ``[hi | lo]``
        ``[2 * dim]`` (any float dtype) and of codes ``[page, ceil(dim / 4)]`` uint8.
    resident
        ``[heads, rows]`` float32: the log-sum-exp of the keys attention reads anyway, if any.

    Returns
    -------
    ``(chosen [heads, keep], ranked [heads, m], shares [heads, m])``: the `keep` best candidates in
    ascending id, every candidate best first, and the shares (float32).
    """
    H, R, D = q.shape
    m = cand.shape[1]
    valid = (cand >= 0) & (cand < pages)
    rows = (torch.where(valid, cand, 0) * H + torch.arange(H, device=cand.device)[:, None]).reshape(-1)
    b_slabs, b_per = bounds
    c_slabs, c_per = codes
    b = gather_pages(b_slabs, b_per, rows.to(b_slabs[0].device), torch.empty(
        (H * m, 2 * D), dtype=b_slabs[0].dtype, device=b_slabs[0].device)).to(q.device).view(H, m, 2 * D).float()
    code = gather_pages(c_slabs, c_per, rows.to(c_slabs[0].device), torch.empty(
        (H * m, page, -(-D // 4)), dtype=torch.uint8, device=c_slabs[0].device)).to(q.device).view(H, m, page, -1)
    nan = float("nan")
    lo = torch.where(valid[..., None], b[..., D:], nan)
    tiny = float.fromhex("0x1p-126")
    st = torch.where(valid[..., None], (b[..., :D] - lo) / torch.full_like(lo, 3.0), nan)
    st = torch.where(st < tiny, tiny, st)
    logits, base = code_logits(q, lo, st, code, scaling)                 # [H, m, R, page], [H, m, R]
    page_lse = logsumexp(logits) + base                                  # [H, m, R]
    total = logsumexp(page_lse.transpose(1, 2))                          # [H, R]
    if resident is not None:
        total = logsumexp(torch.stack([total, resident.float()], dim=-1))
    shares = _running_max(page_lse - total[:, None, :])                  # [H, m]
    order = torch.sort(shares, dim=1, descending=True, stable=True).indices
    ranked = cand.gather(1, order)
    return torch.sort(ranked[:, :keep], dim=1).values, ranked, shares


# -------------------------------------------------------------------------------------- attention merge
MERGE_MAX = 4   # parts per `kvtier_merge_parts` launch


def merge_parts(parts: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the union of up to `MERGE_MAX` disjoint key sets from each set's ``(out [heads, rows, dim],
    lse [heads, rows])`` (twin of ``kvtier_merge_parts``, whose header in ``native/merge_parts.cu`` states each
    step): ``(out, lse)`` of the union, float32."""
    first = parts[0][1]
    pad = [torch.full(first.shape, float("-inf"), device=first.device)] * (MERGE_MAX - len(parts))
    total = logsumexp(torch.stack([lse.float() for _, lse in parts] + pad, dim=-1))
    out = None
    for o, lse in parts:
        w = exp(lse.float() - total)
        w = torch.where(torch.isnan(w), torch.zeros_like(w), w)
        term = o.float() * w[..., None]
        out = term if out is None else out + term
    return out, total


# ------------------------------------------------------------------------------ attention over the pool
ATTEND_ROWS = 16   # query rows per KV head `kvtier_attend_chunks` holds (KV_ATTEND_ROWS)


def pool_entries(slabs: Sequence[torch.Tensor], count: int) -> torch.Tensor:
    """Entries ``[0, count)`` of a device pool's slabs (``[1, heads, slab_tokens, dim]`` or without the 1) as
    ``[heads, count, dim]``, in order."""
    per = slabs[0].shape[-2]
    views = [(s[0] if s.dim() == 4 else s)[:, :min(per, count - i * per)] for i, s in enumerate(slabs)
             if i * per < count]
    return views[0] if len(views) == 1 else torch.cat(views, dim=1)


def attend_chunks(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                  chunk: int, cap: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The first step of ``kvtier_attend_chunks`` (``native/attend_slabs.cu`` states each): per chunk of
    `chunk` entries, the sums ``a [heads, chunks, rows, dim]`` and the maxima and sums of e^(s - m)
    ``m, l [heads, chunks, rows]``, bit for bit. `q` ``[heads, rows, dim]``, `keys`, `values`
    ``[heads, n, dim]``; `cap` the logits' soft-cap (None: none)."""
    H, R, D = q.shape
    n = keys.shape[1]
    chunks = -(-n // chunk)
    pad = chunks * chunk - n   # padding entries: logit -inf, so e^(s - m) = +0, which adds nothing to the sums
    k = torch.nn.functional.pad(keys.float(), (0, 0, 0, pad)).reshape(H, chunks, chunk, D)
    v = torch.nn.functional.pad(values.float(), (0, 0, 0, pad)).reshape(H, chunks, chunk, D)
    qf = q.float()[:, None, :, None, :]                  # [H, 1, R, 1, D]
    s = torch.zeros(H, chunks, R, chunk, device=q.device)
    for d in range(D):
        s = s + qf[..., d] * k[:, :, None, :, d]
    s = softcap(s * scale, cap)
    if pad:
        s[:, -1, :, chunk - pad:] = float("-inf")
    m = _running_max(s)                                  # [H, chunks, R]
    p = exp(s - torch.where(m == float("-inf"), 0.0, m)[..., None])   # a chunk of -inf logits: p = +0, not NaN
    l_ = torch.zeros_like(m)
    a = torch.zeros(H, chunks, R, D, device=q.device)
    for t in range(chunk):
        l_ = l_ + p[..., t]
        a = a + p[..., t, None] * v[:, :, None, t, :]
    return a, m, l_


def paged_entries(buffer: torch.Tensor, pages: torch.Tensor, page_size: int) -> torch.Tensor:
    """The entries of a recall buffer ``[heads, slots * page_size, dim]`` in the order the page table
    ``pages`` ``[heads, n]`` (slots) lists their pages: ``[heads, n * page_size, dim]``."""
    H, _, D = buffer.shape
    rows = (pages.to(torch.int64)[..., None] * page_size + torch.arange(page_size, device=pages.device))
    return buffer.gather(1, rows.reshape(H, -1, 1).expand(H, -1, D))


def attend_combine(a: torch.Tensor, m: torch.Tensor, l_: torch.Tensor,
                   whole: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``kvtier_attend_combine``: the chunks' sums of `attend_chunks`, after a part given `whole`
    (``(out [heads, rows, dim], lse [heads, rows])``, if any), into ``(out, lse)``, bit for bit."""
    if whole is not None:   # first, as a chunk with m = lse, l = 1 and a = out
        a = torch.cat([whole[0].float()[:, None], a], dim=1)
        m = torch.cat([whole[1].float()[:, None], m], dim=1)
        l_ = torch.cat([torch.ones_like(m[:, :1]), l_], dim=1)
    big = _running_max(m.transpose(1, 2))               # [H, R]
    w = exp(m - big[:, None])                           # [H, chunks, R]
    total = torch.zeros_like(big)
    acc = torch.zeros(a.shape[0], a.shape[2], a.shape[3], device=a.device)
    for c in range(m.shape[1]):
        total = total + l_[:, c] * w[:, c]
        acc = acc + a[:, c] * w[:, c, :, None]
    return acc / total[..., None], big + log(total)


def attend_slabs(q: torch.Tensor, k_slabs: Sequence[torch.Tensor], v_slabs: Sequence[torch.Tensor], count: int,
                 scale: float, chunk: int, whole: tuple[torch.Tensor, torch.Tensor] | None = None,
                 counted: tuple[torch.Tensor, int] | None = None,
                 cap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of `q` ``[heads, rows, dim]`` over a device pool's first `count` entries (and a part given
    `whole`), as the two kernels of ``native/attend_slabs.cu`` compute it: ``(out [heads, rows, dim],
    lse [heads, rows])`` float32. With `counted` ``(at, base)`` the count is ``base + at[0]``, read where the
    kernels read it (a host read where `at` is on a GPU); `cap`: the logits' soft-cap."""
    if counted is not None:
        count = counted[1] + int(counted[0])
    return attend_combine(*attend_chunks(q, pool_entries(k_slabs, count), pool_entries(v_slabs, count), scale,
                                         chunk, cap), whole)


def attend_pages(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, pages: torch.Tensor,
                 page_size: int, scale: float, chunk: int, whole: tuple[torch.Tensor, torch.Tensor] | None = None,
                 cap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`attend_slabs` over the pages of a recall buffer that the page table `pages` ``[heads, n]`` lists."""
    return attend_combine(*attend_chunks(q, paged_entries(k_buffer, pages, page_size),
                                         paged_entries(v_buffer, pages, page_size), scale, chunk, cap), whole)


# ------------------------------------------------------------------------------------------- KVP scores
class MLPWeights(NamedTuple):
    """The weights of a stack of KVP networks (`kvtier.scoring.kvp.KVPAgents`), float32, agent first."""

    mean: torch.Tensor   # [agents, 1, d_in]
    std: torch.Tensor    # [agents, 1, d_in]
    w1: torch.Tensor     # [agents, d_in, hidden]
    b1: torch.Tensor     # [agents, 1, hidden]
    w2: torch.Tensor     # [agents, hidden, hidden]
    b2: torch.Tensor     # [agents, 1, hidden]
    w3: torch.Tensor     # [agents, hidden, 1]
    b3: torch.Tensor     # [agents, 1, 1]


def _dense(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``sum_i x[..., i] w[:, i, :]`` over i in order from +0, then ``+ b`` (x ``[agents, tokens, n]``)."""
    acc = torch.zeros(*x.shape[:-1], w.shape[-1], dtype=torch.float32, device=x.device)
    for i in range(x.shape[-1]):
        acc = acc + x[..., i, None] * w[:, None, i, :]
    return acc + b


def _silu(v: torch.Tensor) -> torch.Tensor:
    return v / (1.0 + exp(-v))


def kvp_score(keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, weights: MLPWeights,
              first: int) -> torch.Tensor:
    """KVP scores of entries ``keys, values`` ``[heads, tokens, dim]`` (any float dtype) at position features
    ``positions`` ``[tokens, f]``, head h scored by agent ``first + h`` (twin of ``kvtier_kvp_score_*``, whose
    header in ``native/kvp_score.cu`` states every step): ``[heads, tokens]`` float32."""
    H = keys.shape[0]
    a = slice(first, first + H)
    x = torch.cat([keys.float(), values.float(), positions.float().expand(H, -1, -1)], dim=-1)
    z = (x - weights.mean[a]) / weights.std[a]
    h1 = _silu(_dense(z, weights.w1[a], weights.b1[a]))
    h2 = _silu(_dense(h1, weights.w2[a], weights.b2[a]))
    return _dense(h2, weights.w3[a], weights.b3[a])[..., 0]


def recall_pages(slabs: Sequence[torch.Tensor], rows_per_slab: int, src_rows: torch.Tensor,
                 dst_rows: torch.Tensor, count: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """For each head ``h`` and ``j < count[h]``: ``out[dst_rows[h, j]] = row src_rows[h, j]`` of the storage
    (twin of ``kvtier_recall_pages``; rows outside the storage or `out` are skipped, as the kernel does)."""
    heads, r = src_rows.shape
    valid = torch.arange(r, device=count.device)[None, :] < count[:, None]
    total = len(slabs) * rows_per_slab
    valid &= (src_rows >= 0) & (src_rows < total) & (dst_rows >= 0) & (dst_rows < out.shape[0])
    src, dst = src_rows[valid], dst_rows[valid]
    if src.numel() == 0:
        return out
    pages = torch.empty((src.numel(), *out.shape[1:]), dtype=out.dtype, device=out.device)
    gather_pages(slabs, rows_per_slab, src.cpu() if slabs and slabs[0].device.type == "cpu" else src, pages)
    out[dst.to(out.device)] = pages
    return out


class RecallPlan(NamedTuple):
    """A recall step's plan (see `plan_recall`); every field on the device, ``[heads, w]`` unless said."""

    fetch: torch.Tensor        # the missing pages first, then the others
    slots: torch.Tensor        # the slot each of `fetch` goes to (real for the first `count`)
    count: torch.Tensor        # [heads]: pages missing
    held_after: torch.Tensor   # [heads, R]: the page each slot holds once they are in
    where: torch.Tensor        # the slot holding each wanted page afterwards, in the order wanted
    src_rows: torch.Tensor     # the host slot of each of `fetch` (or the page id, without host slots)
    dst_rows: torch.Tensor     # the buffer row of each of `slots`: head * R + slot


def plan_recall(want: torch.Tensor, held: torch.Tensor, pages: int, host_slots: torch.Tensor | None = None,
                ahead: torch.Tensor | None = None, counts: torch.Tensor | None = None,
                prefetch: bool = False, in_place: bool = False) -> RecallPlan:
    """A recall step's plan and bookkeeping (twin of ``kvtier_plan_recall``, whose header states the rule).

    `want` ``[heads, w]`` holds distinct page ids below `pages`, `held` ``[heads, R]`` the page in each slot
    or ``-1``; `host_slots` ``[heads, pages]`` the host slot of each page; `ahead` ``[heads, R]`` bool, the
    buffer's prefetch flags, and `counts` ``[4]`` int64, the recall counters, are updated in place, and `held`
    too with `in_place` (it is then ``held_after``). Bitmaps over the page ids stand for the kernel's
    comparisons.
    """
    heads, w = want.shape
    R = held.shape[1]
    if want.device.type == "cpu" and want.numel() and (int(want.min()) < 0 or int(want.max()) >= pages):
        # the kernel reads nothing for such an id (row -1); the bitmaps here would take another page's slot. The
        # engine never asks for one; on a GPU the check would be a read back
        raise IndexError(f"plan_recall: wanted page ids {int(want.min())}..{int(want.max())}; allowed: 0 to "
                         f"{pages - 1}")
    empty = pages                                                   # the column standing for an empty slot

    def column(ids: torch.Tensor) -> torch.Tensor:
        return torch.where(ids < 0, torch.full_like(ids, empty), ids)

    held_col = column(held)
    wanted = torch.zeros(heads, pages + 1, dtype=torch.bool, device=want.device).scatter_(1, want, True)
    holding = torch.zeros(heads, pages + 1, dtype=torch.bool, device=want.device).scatter_(1, held_col, True)
    holding[:, empty] = False
    missing = ~holding.gather(1, want)                              # [heads, w]
    if prefetch and host_slots is not None:   # a page without a host slot (on disk) is never fetched ahead
        missing &= host_slots.gather(1, want) >= 0
    free = ~wanted.gather(1, held_col)                              # [heads, R]
    # the real entries first, each in its original order (a stable sort of a 0/1 key); a head has at least
    # as many free slots as missing pages, since every held page it still wants is one of its `w`
    fetch = want.gather(1, torch.argsort((~missing).to(torch.uint8), dim=1, stable=True))
    slots = torch.argsort((~free).to(torch.uint8), dim=1, stable=True)[:, :w]
    count = missing.sum(dim=1)
    real = torch.arange(w, device=want.device)[None, :] < count[:, None]
    given = torch.where(real, fetch, held.gather(1, slots))
    held_after = held.scatter_(1, slots, given) if in_place else held.scatter(1, slots, given)
    slot_of = torch.zeros(heads, pages + 1, dtype=torch.int64, device=want.device)
    slot_of.scatter_(1, column(held_after), torch.arange(R, device=want.device).expand(heads, -1))
    where = slot_of.gather(1, want)
    src_rows = fetch if host_slots is None else host_slots.gather(1, fetch)
    dst_rows = slots + torch.arange(heads, device=want.device)[:, None] * R
    used = None
    if ahead is not None:
        kept = ahead.gather(1, slots)
        ahead.scatter_(1, slots, kept | real if prefetch else kept & ~real)
        if not prefetch:
            used = ahead.gather(1, where).sum()
            ahead.scatter_(1, where, False)
    if counts is not None:
        if prefetch:
            counts[2] += count.sum()
        else:
            moved = count.sum()
            counts.add_(torch.stack([moved, heads * w - moved, torch.zeros_like(moved),
                                     torch.zeros_like(moved) if used is None else used]))
    return RecallPlan(fetch, slots, count, held_after, where, src_rows, dst_rows)
