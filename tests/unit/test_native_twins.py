"""The torch twins of the native kernels, on the CPU: each against the computation it replaces, and the float
reductions against a scalar float32 replay of the kernel's order, so the CUDA tests that hold each kernel to
its twin hold it to a documented order."""

from __future__ import annotations

import ctypes
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from kvtier import native
from kvtier.native import loader, ops, twins
from kvtier.recall.bounds import page_bounds, round_outward, upper_bounds
from kvtier.recall.buffer import RecallBuffer
from kvtier.recall.codes import decode, encode, step, unpacked
from kvtier.recall.index import PageIndex
from kvtier.tiers.device import DevicePool
from kvtier.tiers.host import HostPool
from kvtier.tiers.slabs import SlabRows

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
_SUFFIX = ops.DTYPE_SUFFIX
_OF_SUFFIX = {suffix: dtype for dtype, suffix in _SUFFIX.items()}   # a templated kernel's dtype, by its name


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of `t` (compares NaNs and signed zeros exactly)."""
    return t.contiguous().view(torch.uint8)


def _storage(rows_per_slab: int, slabs: int, row_shape: tuple[int, ...], dtype: torch.dtype,
             seed: int) -> SlabRows:
    g = torch.Generator().manual_seed(seed)
    s = SlabRows(row_shape, dtype, "cpu", rows_per_slab)
    s.ensure(rows_per_slab * slabs)
    for slab in s.slabs:
        slab.copy_(torch.randn(slab.shape, generator=g).to(dtype))
    return s


def _row(s: SlabRows, r: int) -> torch.Tensor:
    return s.slabs[r // s.rows_per_slab][r % s.rows_per_slab]


# ------------------------------------------------------------------------------------------------ copies
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size,dim", [(16, 64), (32, 128), (16, 128)])
@pytest.mark.parametrize("slabs,order", [(1, "random"), (5, "sorted"), (5, "random"), (5, "empty")])
def test_gather_pages_copies_the_requested_rows(dtype, page_size, dim, slabs, order):
    s = _storage(7, slabs, (page_size, dim), dtype, seed=slabs + dim)
    rng = np.random.default_rng(page_size)
    n = {"empty": 0, "sorted": 20, "random": 30}[order]
    rows = rng.choice(s.capacity, size=min(n, s.capacity), replace=False)
    if order == "sorted":
        rows.sort()   # runs of rows in one slab: one copy per run
    out = torch.full((len(rows), page_size, dim), float("nan"), dtype=dtype)
    got = native.gather_pages(s.slabs, s.rows_per_slab, rows, out)
    assert got is out
    want = torch.stack([_row(s, int(r)) for r in rows]) if len(rows) else out.new_empty(0, page_size, dim)
    assert torch.equal(_bits(got), _bits(want))


def test_gather_pages_runs_both_ways_through_a_many_slab_storage():
    """A scattered request (more runs than slabs) takes the grouped path; same rows either way."""
    s = _storage(3, 6, (4, 8), torch.float32, seed=1)
    rows = np.array([17, 0, 5, 16, 1, 9, 2, 14, 3, 12, 4, 10, 6, 11, 7, 15, 8, 13], dtype=np.int64)
    out = twins.gather_pages(s.slabs, 3, torch.from_numpy(rows), torch.empty(len(rows), 4, 8))
    assert torch.equal(out, torch.stack([_row(s, int(r)) for r in rows]))
    again = torch.empty_like(out)
    for i in range(0, len(rows), 2):   # few runs: the run path
        twins.gather_pages(s.slabs, 3, torch.from_numpy(rows[i:i + 2]), again[i:i + 2])
    assert torch.equal(again, out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("slabs", [1, 4])
def test_scatter_pages_writes_only_the_given_rows(dtype, slabs):
    s = _storage(5, slabs, (16, 64), dtype, seed=2)
    before = [t.clone() for t in s.slabs]
    rows = np.random.default_rng(3).choice(s.capacity, size=min(9, s.capacity), replace=False)
    values = torch.randn(len(rows), 16, 64).to(dtype)
    native.scatter_pages(s.slabs, 5, rows, values)
    for r in range(s.capacity):
        where = np.flatnonzero(rows == r)
        want = values[where[0]] if len(where) else before[r // 5][r % 5]
        assert torch.equal(_bits(_row(s, r)), _bits(want)), f"row {r}"
    native.scatter_pages(s.slabs, 5, np.empty(0, dtype=np.int64), values[:0])   # nothing to write


def test_copies_refuse_bad_rows_naming_them():
    s = _storage(4, 2, (2, 3), torch.float32, seed=0)
    with pytest.raises(IndexError, match="row 8 is out of range; allowed: 0 to 7"):
        native.gather_pages(s.slabs, 4, np.array([1, 8]), torch.empty(2, 2, 3))
    with pytest.raises(IndexError, match="row -1 is out of range"):
        native.scatter_pages(s.slabs, 4, np.array([-1]), torch.zeros(1, 2, 3))
    with pytest.raises(ValueError, match="rows repeat"):
        native.scatter_pages(s.slabs, 4, np.array([3, 3]), torch.zeros(2, 2, 3))
    with pytest.raises(ValueError, match=r"pages of \[3, 2\] torch.float32 for rows of \[2, 3\]"):
        native.gather_pages(s.slabs, 4, np.array([1]), torch.empty(1, 3, 2))
    with pytest.raises(ValueError, match="out has 3 rows for 1 requested"):
        native.gather_pages(s.slabs, 4, np.array([1]), torch.empty(3, 2, 3))
    with pytest.raises(ValueError, match=r"a pair of 2 slabs into \[2, 2, 3\] torch.float32 on cpu; allowed: 2 "
                       r"slabs into \[1, 2, 3\]"):
        native.gather_pages(s.slabs, 4, np.array([1]), torch.empty(1, 2, 3), pair=(s.slabs, torch.empty(2, 2, 3), None))
    with pytest.raises(ValueError, match=r"index_pages: keys \[2, 3, 4\]; allowed: \[heads, pages, page_size, dim\]"):
        native.index_pages(torch.zeros(2, 3, 4), [torch.zeros(8, 8)], 8, 0)
    with pytest.raises(IndexError, match=r"index_pages: rows 6 to 9; allowed: 0 to 7"):
        native.index_pages(torch.zeros(2, 2, 4, 4), [torch.zeros(8, 8)], 8, 6)


@pytest.fixture(params=["grouped on the host", "read nothing back"])
def entry_twin_way(request, monkeypatch):
    """The entry twins both ways: on the CPU they group lanes by slab on the host (`_reads_free`); on a GPU
    without kernels they read nothing back. Forced here so both are checked on the CPU."""
    if request.param == "read nothing back":
        monkeypatch.setattr(twins, "_reads_free", lambda rows: False)
    return request.param


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("slab_tokens", [64, 16])
def test_pack_entries_equals_indexing_the_entries(dtype, slab_tokens, entry_twin_way):
    """One slab (a gather) and several (entries spread over slabs): the entries as written, in `idx`'s order."""
    heads, dim, n = 3, 64, 60
    pool = DevicePool(heads, dim, dtype, torch.device("cpu"), slab_tokens)
    g = torch.Generator().manual_seed(4)
    k = torch.randn(1, heads, n, dim, generator=g).to(dtype)
    pool.stage(k, k.neg(), torch.arange(n).expand(heads, n))
    pool.commit(n, torch.zeros(heads, n))
    idx = torch.stack([torch.randperm(n, generator=g)[:32] for _ in range(heads)])
    want_k = torch.stack([k[0, h, idx[h]] for h in range(heads)])
    assert torch.equal(_bits(native.pack_entries(pool.k, idx)), _bits(want_k))
    assert torch.equal(_bits(native.pack_entries(pool.v, idx, checked=False)), _bits(want_k.neg()))
    assert torch.equal(_bits(pool.take(idx)[0]), _bits(want_k))
    assert native.pack_entries(pool.k, idx[:, :0]).shape == (heads, 0, dim)
    with pytest.raises(IndexError, match=f"entry {pool.capacity} is out of range"):
        native.pack_entries(pool.k, torch.full((heads, 1), pool.capacity))


@pytest.mark.parametrize("slab_tokens", [64, 16, 7])
def test_move_entries_copies_each_source_onto_its_destination(slab_tokens, entry_twin_way):
    """Every kind of pool slab (keys and values ``[1, heads, S, dim]``, positions and scores ``[heads, S]``):
    the destinations get the sources' bytes as they were, lanes that copy an entry onto itself included, and
    nothing else changes."""
    heads, n = 3, 60
    pool = DevicePool(heads, 8, torch.bfloat16, torch.device("cpu"), slab_tokens)
    g = torch.Generator().manual_seed(5)
    k = torch.randn(1, heads, n, 8, generator=g).to(torch.bfloat16)
    pool.stage(k, k.neg(), torch.arange(n).expand(heads, n) * 3)
    pool.commit(n, torch.randn(heads, n, generator=g))
    src = torch.stack([torch.randperm(30, generator=g)[:10] + 30 for _ in range(heads)])   # from the upper half
    dst = torch.stack([torch.randperm(30, generator=g)[:10] for _ in range(heads)])        # into the lower
    dst[:, 7:] = src[:, 7:]                                                                # or onto themselves
    for kind in (pool.k, pool.v, pool.pos, pool.score):
        before = native.pack_entries(kind, torch.arange(n).expand(heads, n)) if kind[0].dim() == 4 else \
            twins.pack_entries(kind, torch.arange(n).expand(heads, n))
        want = before.clone()
        for h in range(heads):
            want[h, dst[h]] = before[h, src[h]]
        native.move_entries(kind, src, dst)
        assert torch.equal(_bits(twins.pack_entries(kind, torch.arange(n).expand(heads, n))), _bits(want))
    with pytest.raises(ValueError, match=r"src \[3, 2\] and dst \[3, 3\]"):
        native.move_entries(pool.k, src[:, :2], dst[:, :3])


def test_recall_buffer_fill_puts_pages_where_indexing_would():
    H, pages, P, D = 3, 5, 16, 64
    buf = RecallBuffer(H, pages, P, D, torch.bfloat16, torch.device("cpu"))
    buf.k.fill_(0)
    buf.v.fill_(0)
    ref_k, ref_v = buf.k.clone(), buf.v.clone()
    heads = np.array([0, 0, 1, 2, 2, 2], dtype=np.int64)
    slots = np.array([4, 1, 0, 3, 2, 4], dtype=np.int64)
    pids = np.arange(6, dtype=np.int64) + 10
    k = torch.randn(6, P, D).to(torch.bfloat16)
    buf.fill(heads, pids, slots, k, -k)
    ref_k.view(H, pages, P, D)[torch.from_numpy(heads), torch.from_numpy(slots)] = k
    ref_v.view(H, pages, P, D)[torch.from_numpy(heads), torch.from_numpy(slots)] = -k
    assert torch.equal(buf.k, ref_k) and torch.equal(buf.v, ref_v)
    assert buf.ids[2, 3] == 13 and buf.ids[0, 0] == -1


def test_host_pool_loads_into_an_out_exactly_across_slabs():
    pool = HostPool(16, 64, torch.float16, pin=False, slab_bytes=16 * 64 * 2 * 3)   # 3 pages a slab
    k = torch.randn(10, 16, 64).to(torch.float16)
    slots = pool.store(k, k * 2)
    assert len(pool.k.slabs) == 4
    pick = slots[[7, 2, 9, 0]]
    out = (torch.empty(4, 16, 64, dtype=torch.float16), torch.empty(4, 16, 64, dtype=torch.float16))
    got_k, got_v = pool.load(pick, out=out)
    assert got_k is out[0] and got_v is out[1]
    assert torch.equal(got_k, k[[7, 2, 9, 0]]) and torch.equal(got_v, k[[7, 2, 9, 0]] * 2)
    lk, lv = pool.load(pick)
    assert torch.equal(lk, got_k) and torch.equal(lv, got_v)


# ---------------------------------------------------------------------------------------- page selection
def _replay_upper_bounds(q: np.ndarray, hi: np.ndarray, lo: np.ndarray) -> np.ndarray:
    """The kernel's order with numpy float32 scalars: lanes over channels, a tree over lanes, max over rows."""
    H, R, D = q.shape
    pages = hi.shape[1]
    out = np.empty((H, pages), dtype=np.float32)
    for h in range(H):
        for p in range(pages):
            best = np.float32(-np.inf)
            for r in range(R):
                lanes = [np.float32(0)] * 32
                for d in range(D):
                    x = q[h, r, d]
                    lanes[d % 32] = np.float32(lanes[d % 32] + np.float32(x * (hi[h, p, d] if x >= 0 else lo[h, p, d])))
                off = 16
                while off:
                    lanes = [np.float32(lanes[i] + lanes[i + off]) for i in range(off)]
                    off //= 2
                if np.isnan(lanes[0]) or lanes[0] > best:
                    best = lanes[0]
            out[h, p] = best
    return out


def _bounds_rows(hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """``[heads, pages, dim]`` bounds as the index keeps them: rows ``page * heads + head`` of ``[hi | lo]``."""
    H, pages, D = hi.shape
    return torch.cat([hi, lo], dim=-1).transpose(0, 1).reshape(pages * H, 2 * D)


@pytest.mark.parametrize("dim", [64, 40, 128])
def test_upper_bound_twin_replays_the_kernel_order_bit_for_bit(dim):
    g = torch.Generator().manual_seed(dim)
    H, R, pages = 2, 3, 4
    q = torch.randn(H, R, dim, generator=g)
    q[0, 1, :7] = 0.0
    q[1, 2, 3] = -0.0
    a, b = torch.randn(2, H, pages, dim, generator=g)
    lo, hi = torch.minimum(a, b), torch.maximum(a, b)
    got = twins.page_upper_bounds(q, _bounds_rows(hi, lo), H)
    want = _replay_upper_bounds(q.numpy(), hi.numpy(), lo.numpy())
    assert torch.equal(_bits(got), _bits(torch.from_numpy(want)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim,page_size", [(64, 16), (128, 32)])
def test_upper_bounds_match_the_matrix_product_bounds_and_bound_every_key(dtype, dim, page_size):
    g = torch.Generator().manual_seed(5)
    H, R, pages = 3, 6, 40
    keys = torch.randn(H, pages, page_size, dim, generator=g)
    lo, hi = round_outward(*page_bounds(keys, torch.full((H, pages), page_size)), dtype)
    q = torch.randn(H, R, dim, generator=g)
    got = native.page_upper_bounds(q, [_bounds_rows(hi, lo)], H)
    ref = upper_bounds(q, lo, hi)          # what the selector computes with two matrix products
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4)
    best = torch.einsum("hrd,hpkd->hrpk", q.double(), keys.to(dtype).double()).amax(dim=(1, 3))
    assert (got.double() >= best - 1e-4).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_upper_bounds_over_index_slabs_match_the_index(dtype):
    """Across several slabs of the recall index: one call, spans in order, the index's own result."""
    H, P, D = 2, 16, 64
    index = PageIndex(H, P, D, dtype, torch.device("cpu"), pages_per_slab=8)
    g = torch.Generator().manual_seed(6)
    index.add(torch.randn(H, 21, P, D, generator=g))
    q = torch.randn(H, 5, D, generator=g)
    spans = [b for _, b in index.bounds.spans(index.n * H)]
    assert len(spans) == 3
    got = native.page_upper_bounds(q, spans, H)
    torch.testing.assert_close(got, index.upper_bounds(q), rtol=1e-5, atol=1e-4)
    whole = twins.page_upper_bounds(q, torch.cat(spans), H)
    assert torch.equal(got, whole)   # elementwise per page: the split into slabs changes nothing


def test_upper_bounds_of_nothing():
    H, D = 2, 64
    q = torch.randn(H, 3, D)
    assert native.page_upper_bounds(q, [], H).shape == (H, 0)
    assert native.page_upper_bounds(q, [torch.zeros(0, 2 * D)], H).shape == (H, 0)
    empty_rows = native.page_upper_bounds(q[:, :0], [torch.zeros(4 * H, 2 * D)], H)
    assert empty_rows.shape == (H, 4) and (empty_rows == float("-inf")).all()
    q[1, 2, 5] = float("nan")   # a NaN query row poisons its head's bounds, as torch.amax would
    got = native.page_upper_bounds(q, [torch.randn(4 * H, 2 * D).sort(dim=1, descending=True).values], H)
    assert got[1].isnan().all() and not got[0].isnan().any()
    with pytest.raises(ValueError, match=r"span 0 is \[5, 128\].*allowed: \[pages \* 2, 128\]"):
        native.page_upper_bounds(q, [torch.zeros(5, 2 * D)], H)


def _replay_code_logits(q, lo, st, codes, scaling):
    H, R, D = q.shape
    c, P = codes.shape[1], codes.shape[2]
    s = np.float32(scaling)
    logits = np.empty((H, c, R, P), dtype=np.float32)
    base = np.empty((H, c, R), dtype=np.float32)
    for h in range(H):
        for j in range(c):
            for r in range(R):
                acc_b = np.float32(0)
                for d in range(D):
                    acc_b = np.float32(acc_b + np.float32(q[h, r, d] * lo[h, j, d]))
                base[h, j, r] = np.float32(acc_b * s)
                for p in range(P):
                    acc = np.float32(0)
                    for d in range(D):
                        code = np.float32((int(codes[h, j, p, d // 4]) >> (2 * (d % 4))) & 3)
                        acc = np.float32(acc + np.float32(np.float32(q[h, r, d] * st[h, j, d]) * code))
                    logits[h, j, r, p] = np.float32(acc * s)
    return logits, base


@pytest.mark.parametrize("dim", [16, 20])
def test_code_logits_twin_replays_the_kernel_order_bit_for_bit(dim):
    g = torch.Generator().manual_seed(7)
    H, R, c, P = 2, 2, 3, 4
    keys = torch.randn(H, c, P, dim, generator=g)
    lo, hi = page_bounds(keys, torch.full((H, c), P))
    codes = encode(keys, lo, hi)
    q = torch.randn(H, R, dim, generator=g)
    scaling = dim ** -0.5
    got = twins.code_logits(q, lo, step(lo, hi), codes, float(np.float32(scaling)))
    want = _replay_code_logits(q.numpy(), lo.numpy(), step(lo, hi).numpy(), codes.numpy(), scaling)
    assert torch.equal(_bits(got[0]), _bits(torch.from_numpy(want[0])))
    assert torch.equal(_bits(got[1]), _bits(torch.from_numpy(want[1])))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim,page_size", [(64, 16), (128, 32), (64, 32)])
def test_code_logits_match_the_selectors_estimate(dtype, dim, page_size):
    """`page_shares`' logits (codes unpacked, then matrix products) and the decoded keys' logits."""
    g = torch.Generator().manual_seed(8)
    H, R, c = 3, 5, 11
    keys = torch.randn(H, c, page_size, dim, generator=g).to(dtype)
    lo, hi = round_outward(*page_bounds(keys, torch.full((H, c), page_size)), dtype)
    codes = encode(keys, lo, hi)
    q = torch.randn(H, R, dim, generator=g)
    scaling = dim ** -0.5
    logits, base = native.code_logits(q, lo, step(lo, hi), codes, scaling)
    assert logits.shape == (H, c, R, page_size) and base.shape == (H, c, R)
    cu, order = unpacked(codes, dim)                       # the selector's way
    st, qo = step(lo, hi), q
    if order is not None:
        st, qo = st.index_select(2, order), q.index_select(2, order)
    ref = torch.matmul(qo[:, None] * st[:, :, None, :], cu.transpose(-1, -2)) * scaling
    torch.testing.assert_close(logits, ref, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(base, torch.bmm(q, lo.float().transpose(1, 2)).transpose(1, 2) * scaling,
                               rtol=1e-5, atol=1e-4)
    decoded = torch.einsum("hrd,hcpd->hcrp", q.double(), decode(codes, lo, hi).double()) * scaling
    torch.testing.assert_close((base[..., None] + logits).double(), decoded, rtol=1e-4, atol=1e-3)


def test_code_logits_of_nothing_and_bad_shapes():
    H, D, P = 2, 64, 16
    q = torch.randn(H, 3, D)
    lo = torch.zeros(H, 0, D)
    logits, base = native.code_logits(q, lo, lo, torch.zeros(H, 0, P, D // 4, dtype=torch.uint8), 0.125)
    assert logits.shape == (H, 0, 3, P) and base.shape == (H, 0, 3)
    with pytest.raises(ValueError, match=r"allowed: \[2, 1, page_size, 16\] uint8"):
        native.code_logits(q, torch.zeros(H, 1, D), torch.ones(H, 1, D),
                           torch.zeros(H, 1, P, 8, dtype=torch.uint8), 1.0)
    with pytest.raises(ValueError, match=r"out is \[1\]"):
        native.page_upper_bounds(q, [torch.zeros(H, 2 * D)], H, out=torch.empty(1))


def test_unpack_codes_is_encode_reversed():
    g = torch.Generator().manual_seed(9)
    keys = torch.randn(2, 3, 16, 24, generator=g)
    lo, hi = page_bounds(keys, torch.full((2, 3), 16))
    codes = encode(keys, lo, hi)
    c = twins.unpack_codes(codes, 24)
    want = ((keys - lo[..., None, :]) / step(lo, hi)[..., None, :]).round().clamp(0, 3)
    assert torch.equal(c, want)


# ------------------------------------------------------------------------------------------------ dispatch
def test_without_cuda_every_op_runs_its_twin_and_says_why(monkeypatch):
    loader.reset_stats()
    s = _storage(4, 2, (2, 8), torch.float32, seed=0)
    native.gather_pages(s.slabs, 4, np.array([1, 5]), torch.empty(2, 2, 8))
    monkeypatch.setenv("KVTIER_NATIVE", "0")
    native.page_upper_bounds(torch.randn(1, 2, 8), [torch.randn(3, 16)], 1)
    ops = native.backend()["ops"]
    assert ops["gather_pages"]["twin"] == 1 and ops["gather_pages"]["kernel"] == 0
    assert ops["page_upper_bounds"]["why"] == "switched off by KVTIER_NATIVE"
    assert native.backend()["kernels"] == "switched off by KVTIER_NATIVE"
    if not torch.cuda.is_available():
        assert ops["gather_pages"]["why"] == "no CUDA device"


def test_host_rows_are_not_copied_inside_a_graph_capture(monkeypatch):
    """A kernel's host rows go up through a pinned temporary, which a captured graph would outlive: refused."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="during a CUDA graph capture"):
        ops._rows_on(torch.arange(3), torch.device("cuda"))


def test_every_kernel_the_ops_launch_is_in_the_shipped_sources():
    names = {p.stem for p in native.sources()}
    assert names == {"gather_pages", "scatter_pages", "recall_pages", "plan_recall", "pack_entries", "page_select",
                     "rank_pages", "kvp_score", "merge_parts", "attend_slabs", "index_pages"}
    ops_text = (loader.SOURCE_DIR.parent / "ops.py").read_text()
    for src, kernel in [("gather_pages", "kvtier_gather_pages"), ("scatter_pages", "kvtier_scatter_pages"),
                        ("recall_pages", "kvtier_recall_pages"), ("plan_recall", "kvtier_plan_recall"),
                        ("pack_entries", "kvtier_pack_entries"), ("pack_entries", "kvtier_move_entries"),
                        ("page_select", "kvtier_code_logits"),
                        ("page_select", "kvtier_page_upper_bounds_f32"),
                        ("page_select", "kvtier_page_upper_bounds_f16"),
                        ("page_select", "kvtier_page_upper_bounds_bf16"), ("rank_pages", "kvtier_rank_pages_f32"),
                        ("rank_pages", "kvtier_rank_pages_f16"), ("rank_pages", "kvtier_rank_pages_bf16"),
                        ("kvp_score", "kvtier_kvp_score_f32"), ("kvp_score", "kvtier_kvp_score_f16"),
                        ("kvp_score", "kvtier_kvp_score_bf16"), ("merge_parts", "kvtier_merge_parts"),
                        ("attend_slabs", "kvtier_attend_chunks_f32"), ("attend_slabs", "kvtier_attend_chunks_bf16"),
                        ("attend_slabs", "kvtier_attend_chunks_f16"), ("attend_slabs", "kvtier_attend_chunks_wide_f32"),
                        ("attend_slabs", "kvtier_attend_chunks_wide_bf16"),
                        ("attend_slabs", "kvtier_attend_chunks_wide_f16"), ("attend_slabs", "kvtier_attend_combine"),
                        ("index_pages", "kvtier_index_pages_f32"), ("index_pages", "kvtier_index_pages_f16"),
                        ("index_pages", "kvtier_index_pages_bf16")]:
        text = loader.source(src)
        assert (f'extern "C" __global__ void {kernel}(' in text or f"KV_UPPER_BOUNDS({kernel}," in text
                or f"KV_RANK_PAGES({kernel}," in text or f"KV_KVP_SCORE({kernel}," in text
                or f"KV_ATTEND_CHUNKS({kernel}," in text or f"KV_INDEX_PAGES({kernel}," in text)
        assert kernel in ops_text or kernel.rsplit("_", 1)[0] + "_{suffix}" in ops_text
        assert "#include" not in text   # headers inlined: NVRTC sees one self-contained text
    with pytest.raises(FileNotFoundError, match="shipped: attend_slabs, gather_pages, index_pages"):
        loader.source("nope")


def test_importing_kvtier_and_running_ops_never_imports_cupy(tmp_path):
    """A `cupy` that explodes on import sits first on the path: kvtier must never touch it on the CPU."""
    fake = tmp_path / "cupy"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise RuntimeError('cupy was imported')\n")
    code = textwrap.dedent("""
        import numpy as np, torch, kvtier, kvtier.native as n
        from kvtier.tiers.host import HostPool
        pool = HostPool(4, 8, torch.float32, pin=False)
        pool.load(pool.store(torch.randn(3, 4, 8), torch.randn(3, 4, 8)))
        n.page_upper_bounds(torch.randn(1, 2, 8), [torch.randn(3, 16)], 1)
        print(n.backend()["kernels"])
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), *sys.path]))
    env["CUDA_VISIBLE_DEVICES"] = ""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "no CUDA device"


# ------------------------------------------------------------------------------------- launch arguments
_SCALARS = {"kv_i64": np.int64, "int": np.int32, "float": np.float32}


def _signatures() -> dict[str, list[type]]:
    """Each kernel's parameters as the numpy scalar types a launch must pass (addresses as uint64)."""
    sigs = {}
    for src in native.sources():
        text = loader.source(src.stem).replace("\\\n", "\n")
        macro = re.search(r"#define (\w+)\(NAME, T(?:, \w+)?\)\s*extern \"C\" __global__ void NAME\(([^)]*)\)", text)
        found = re.findall(r'extern "C" __global__ void (\w+)\(([^)]*)\)', text)
        if macro:   # the entry points a macro makes: `MACRO(name, type)`, or `MACRO(name, type, flag)`
            found += [(name, macro.group(2))
                      for name in re.findall(rf"^{macro.group(1)}\((\w+), \w+(?:, \w+)?\)", text, re.M)]
        for name, params in found:
            if name == "NAME":
                continue
            kinds = []
            for p in params.split(","):
                words = p.replace("*", " * ").split()
                kinds.append(np.uint64 if "*" in words else _SCALARS[words[-2]])
            sigs[name] = kinds
    return sigs


def _mem(addr: int, nbytes: int) -> np.ndarray:
    """`nbytes` bytes at `addr` (host memory of a live CPU tensor) as a writable uint8 array."""
    return np.ctypeslib.as_array(ctypes.cast(int(addr), ctypes.POINTER(ctypes.c_uint8)), shape=(int(nbytes),))


def _tensor(addr: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    n = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(_mem(addr, n)).view(dtype).view(shape)


def _u64(addr: int, i: int) -> int:
    return int(_mem(int(addr) + 8 * i, 8).view(np.uint64)[0])


def _i64(addr: int, i: int) -> int:
    return int(_mem(int(addr) + 8 * i, 8).view(np.int64)[0])


def _run_as_the_kernel(name: str, grid: tuple, args: tuple, block: tuple = (128,)) -> None:
    """What kernel `name` does with `args`, replayed on host memory with the twins' arithmetic."""
    if name in ("kvtier_gather_pages", "kvtier_scatter_pages"):
        slabs, per, rows, flat, n, row_bytes, *pair = args   # a gather's second storage (0: none)
        for storage, into in ((slabs, flat), *([tuple(pair)] if pair and int(pair[0]) else [])):
            for i in range(int(n)):
                r = _i64(rows, i)
                row = _mem(_u64(storage, r // int(per)) + (r % int(per)) * int(row_bytes), row_bytes)
                page = _mem(int(into) + i * int(row_bytes), row_bytes)
                (page if name == "kvtier_gather_pages" else row)[:] = row if name == "kvtier_gather_pages" else page
    elif name == "kvtier_recall_pages":
        slabs, per, total, src, dst, count, heads, r, out, out_rows, row_bytes, slabs2, out2 = (int(a) for a in args)
        for storage, into in ((slabs, out), (slabs2, out2)) if slabs2 else ((slabs, out),):
            for b in range(heads * r):
                h, j = divmod(b, r)
                s_row, d_row = _i64(src, b), _i64(dst, b)
                if j >= _i64(count, h) or not (0 <= s_row < total and 0 <= d_row < out_rows):
                    continue
                row = _mem(_u64(storage, s_row // per) + (s_row % per) * row_bytes, row_bytes)
                _mem(into + d_row * row_bytes, row_bytes)[:] = row
    elif name == "kvtier_plan_recall":   # the kernel's four steps, as written in plan_recall.cu
        (want_p, want_stride, held_p, hs_p, pages, w, R, fetch_p, slots_p, count_p, after_p, where_p, src_p, dst_p,
         ahead_p, counts_p, prefetch) = (int(a) for a in args)

        def put(ptr, values):
            if values:
                _mem(ptr, 8 * len(values))[:] = np.array(values, dtype=np.int64).view(np.uint8)

        for h in range(int(grid[0])):
            want = [_i64(want_p, h * want_stride + j) for j in range(w)]
            held = [_i64(held_p, h * R + i) for i in range(R)]
            # a prefetch skips pages without a host slot (on disk)
            missing = [x not in held and not (prefetch and hs_p and _i64(hs_p, h * pages + x) < 0) for x in want]
            free = [x < 0 or x not in want for x in held]
            fetch = [x for x, m in zip(want, missing) if m] + [x for x, m in zip(want, missing) if not m]
            slots = ([i for i in range(R) if free[i]] + [i for i in range(R) if not free[i]])[:w]
            n = sum(missing)
            for j in range(n):
                held[slots[j]] = fetch[j]
            where = [held.index(x) if x in held else 0 for x in want]
            src = [_i64(hs_p, h * pages + x) for x in fetch] if hs_p else fetch
            for ptr, values in ((fetch_p + 8 * h * w, fetch), (slots_p + 8 * h * w, slots), (count_p + 8 * h, [n]),
                                (after_p + 8 * h * R, held), (where_p + 8 * h * w, where), (src_p + 8 * h * w, src),
                                (dst_p + 8 * h * w, [h * R + x for x in slots])):
                put(ptr, values)
            used = 0
            if ahead_p:
                flags = _mem(ahead_p + h * R, R)
                for j in range(n):
                    flags[slots[j]] = 1 if prefetch else 0
                if not prefetch:
                    used = int(sum(flags[x] for x in where))
                    for x in where:
                        flags[x] = 0
            if counts_p:
                c = _mem(counts_p, 32).view(np.int64)
                if prefetch:
                    c[2] += n
                else:
                    c[0] += n
                    c[1] += w - n
                    c[3] += used
    elif name == "kvtier_pack_entries":
        slabs, S, heads, idx, m, out, row_bytes = (int(a) for a in args)
        for e in range(heads * m):
            t = _i64(idx, e)
            src = _u64(slabs, t // S) + ((e // m) * S + t % S) * row_bytes
            _mem(out + e * row_bytes, row_bytes)[:] = _mem(src, row_bytes)
    elif name == "kvtier_move_entries":
        slabs, S, heads, src, dst, m, row_bytes = (int(a) for a in args)
        for e in range(heads * m):   # the lanes in any order: reversed, so an order the kernel relied on shows
            e = heads * m - 1 - e
            h = e // m
            t_from, t_to = _i64(src, e), _i64(dst, e)
            at_from = _u64(slabs, t_from // S) + (h * S + t_from % S) * row_bytes
            at_to = _u64(slabs, t_to // S) + (h * S + t_to % S) * row_bytes
            _mem(at_to, row_bytes)[:] = _mem(at_from, row_bytes).copy()
    elif name.startswith("kvtier_page_upper_bounds_"):
        q, b, slabs, per_slab, pages, heads, rows, dim, out, stride, col0 = (int(a) for a in args)
        dtype = _OF_SUFFIX[name.rsplit("_", 1)[1]]
        if slabs:   # the rows of each page through the slab address table
            bounds = torch.cat([_tensor(_u64(slabs, p // per_slab) + (p % per_slab) * heads * 2 * dim *
                                        torch.empty((), dtype=dtype).element_size(), (heads, 2 * dim), dtype)
                                for p in range(pages)])
        else:
            bounds = _tensor(b, (pages * heads, 2 * dim), dtype)
        got = twins.page_upper_bounds(_tensor(q, (heads, rows, dim), torch.float32), bounds, heads)
        _tensor(out, (heads, stride), torch.float32)[:, col0:col0 + pages] = got
    elif name == "kvtier_code_logits":
        q, lo, st, codes, logits, base, c, rows, page, dim, scaling = args
        H, c, rows, page, dim = int(grid[1]), int(c), int(rows), int(page), int(dim)
        got = twins.code_logits(_tensor(q, (H, rows, dim), torch.float32), _tensor(lo, (H, c, dim), torch.float32),
                                _tensor(st, (H, c, dim), torch.float32),
                                _tensor(codes, (H, c, page, -(-dim // 4)), torch.uint8), float(scaling))
        _tensor(logits, (H, c, rows, page), torch.float32).copy_(got[0])
        _tensor(base, (H, c, rows), torch.float32).copy_(got[1])
    elif name.startswith("kvtier_rank_pages_"):
        (q, cand, m, pages, b_addr, b_per, c_addr, c_per, res, res_stride, heads, rows, page, dim, tile, scaling,
         keep, shares, ranked, chosen) = args
        H, R, D, P, m, keep = int(grid[0]), int(rows), int(dim), int(page), int(m), int(keep)
        assert H == int(heads) and 1 <= int(tile) <= m
        dtype = _OF_SUFFIX[name.rsplit("_", 1)[1]]

        def storage(addr, per, row_shape, dt):   # the slabs holding the index's rows, through their addresses
            n = -(-int(pages) * H // int(per))
            return [_tensor(_u64(addr, i), (int(per), *row_shape), dt) for i in range(n)], int(per)

        resident = None if not int(res) else _tensor(int(res), (H, int(res_stride)), torch.float32)[:, :R]
        got = twins.rank_pages(_tensor(int(q), (H, R, D), torch.float32), _tensor(int(cand), (H, m), torch.int64),
                               int(pages), storage(b_addr, b_per, (2 * D,), dtype),
                               storage(c_addr, c_per, (P, -(-D // 4)), torch.uint8), P, float(scaling), keep, resident)
        for ptr, value in ((chosen, got[0]), (ranked, got[1]), (shares, got[2])):
            _tensor(int(ptr), tuple(value.shape), value.dtype).copy_(value)
    elif name.startswith("kvtier_kvp_score_"):
        (keys, k_head, k_token, values, v_head, v_token, pos, dim, f, hidden, first, *weights,
         scores) = (int(a) for a in args)
        T, H = int(grid[0]), int(grid[1])
        dtype = _OF_SUFFIX[name.rsplit("_", 1)[1]]

        def strided(addr, head, token):
            span = (H - 1) * head + (T - 1) * token + dim
            return _tensor(addr, (span,), dtype).as_strided((H, T, dim), (head, token, 1))

        d_in = 2 * dim + f
        agents = first + H   # the agents read: those up to the last head's
        shapes = [(agents, 1, d_in), (agents, 1, d_in), (agents, d_in, hidden), (agents, 1, hidden),
                  (agents, hidden, hidden), (agents, 1, hidden), (agents, hidden, 1), (agents, 1, 1)]
        w = twins.MLPWeights(*(_tensor(a, s, torch.float32) for a, s in zip(weights, shapes)))
        got = twins.kvp_score(strided(keys, k_head, k_token), strided(values, v_head, v_token),
                              _tensor(pos, (T, f), torch.float32), w, first)
        _tensor(scores, (H, T), torch.float32).copy_(got)
        assert block[0] >= hidden or block[0] == 1024
    elif name == "kvtier_merge_parts":
        *slots, count, H, R, D, out, lse = (int(a) for a in args)
        parts = []
        for i in range(count):
            o, o_h, o_r, lp, l_h, l_r = slots[6 * i:6 * i + 6]
            o_span, l_span = (H - 1) * o_h + (R - 1) * o_r + D, (H - 1) * l_h + (R - 1) * l_r + 1
            parts.append((_tensor(o, (o_span,), torch.float32).as_strided((H, R, D), (o_h, o_r, 1)),
                          _tensor(lp, (l_span,), torch.float32).as_strided((H, R), (l_h, l_r))))
        got = twins.merge_parts(parts)
        _tensor(out, (H, R, D), torch.float32).copy_(got[0])
        _tensor(lse, (H, R), torch.float32).copy_(got[1])
    elif name.startswith("kvtier_attend_chunks_"):
        (q, q_h, q_r, k_addr, v_addr, k_base, v_base, per, slab_head, slab_token, pages, n_pages, page, count,
         count_at, rows, dim, chunk, tile, finish, scale, softcap, part_a, part_m, part_l, out, lse) = args
        wide = name.startswith("kvtier_attend_chunks_wide_")   # an entry point of its own
        chunks, H = int(grid[0]), int(grid[1])
        R, D, count, chunk, per, page, n_pages = (int(x) for x in (rows, dim, count, chunk, per, page, n_pages))
        count += _i64(int(count_at), 0) if int(count_at) else 0   # the count the device keeps, when given
        used = -(-count // chunk)   # the blocks past the entries return at once
        assert (chunks >= used if int(count_at) else chunks == used) and 1 <= int(tile) <= block[0]
        assert block[0] % int(tile) == 0
        dtype = _OF_SUFFIX[name.rsplit("_", 1)[1]]
        if wide:   # 16-byte loads: every row whole aligned 16-byte words (the kernel does not check)
            for addr, base in ((k_addr, k_base), (v_addr, v_base)):
                starts = _tensor(int(addr), (1,), torch.int64) if int(addr) else [int(base)]
                assert all(int(a) % 16 == 0 for a in starts)
            assert all(int(x) * dtype.itemsize % 16 == 0 for x in (slab_head, slab_token, dim))

        def strided(addr, stride_h, stride_r, n):
            span = (H - 1) * int(stride_h) + (n - 1) * int(stride_r) + D
            return _tensor(int(addr), (span,), dtype).as_strided((H, n, D), (int(stride_h), int(stride_r), 1))

        if int(pages):   # paged: one buffer, read through the page table
            assert not int(k_addr) and not int(v_addr) and count == n_pages * page
            table = _tensor(int(pages), (H, n_pages), torch.int64)
            keys = twins.paged_entries(strided(k_base, slab_head, slab_token, per), table, page)
            values = twins.paged_entries(strided(v_base, slab_head, slab_token, per), table, page)
        else:
            assert not int(k_base) and not int(v_base)
            slabs = -(-count // per)
            keys = twins.pool_entries([strided(_u64(k_addr, i), slab_head, slab_token, per) for i in range(slabs)],
                                      count)
            values = twins.pool_entries([strided(_u64(v_addr, i), slab_head, slab_token, per)
                                         for i in range(slabs)], count)
        a, m, l_ = twins.attend_chunks(strided(q, q_h, q_r, R), keys, values, float(scale), chunk,
                                       float(softcap) or None)
        if int(finish):   # the block finishes a single chunk itself
            assert chunks == 1
            o, lse_ = twins.attend_combine(a, m, l_)
            _tensor(int(out), (H, R, D), torch.float32).copy_(o)
            _tensor(int(lse), (H, R), torch.float32).copy_(lse_)
        else:
            _tensor(int(part_a), (H, chunks, R, D), torch.float32)[:, :used].copy_(a)
            _tensor(int(part_m), (H, chunks, R), torch.float32)[:, :used].copy_(m)
            _tensor(int(part_l), (H, chunks, R), torch.float32)[:, :used].copy_(l_)
    elif name.startswith("kvtier_index_pages_"):
        keys, k_head, k_page, k_entry, heads, cells, page, dim, table, per, first, codes = (int(a) for a in args)
        H, m, dtype = heads, cells // heads, _OF_SUFFIX[name.rsplit("_", 1)[1]]
        assert m * H == cells and int(grid[0]) * block[0] >= cells * -(-dim // 4)
        span = (H - 1) * k_head + (m - 1) * k_page + (page - 1) * k_entry + dim
        k = _tensor(keys, (span,), dtype).as_strided((H, m, page, dim), (k_head, k_page, k_entry, 1))
        slabs = [_tensor(_u64(table, i), (per, 2 * dim), dtype) for i in range(-(-(first + cells) // per))]
        got = twins.index_pages(k, slabs, per, first)
        _tensor(codes, (cells, page, -(-dim // 4)), torch.uint8).copy_(got)
    elif name == "kvtier_attend_combine":
        (part_a, part_m, part_l, chunks, count, count_at, chunk, rows, dim, xo, xo_h, xo_r, xl, xl_h, xl_r, out,
         lse) = (int(a) for a in args)
        H = int(grid[1])
        assert int(grid[0]) == rows
        used = -(-(count + _i64(count_at, 0)) // chunk) if count_at else chunks
        whole = None
        if xo:
            o_span, l_span = (H - 1) * xo_h + (rows - 1) * xo_r + dim, (H - 1) * xl_h + (rows - 1) * xl_r + 1
            whole = (_tensor(xo, (o_span,), torch.float32).as_strided((H, rows, dim), (xo_h, xo_r, 1)),
                     _tensor(xl, (l_span,), torch.float32).as_strided((H, rows), (xl_h, xl_r)))
        o, lse_ = twins.attend_combine(_tensor(part_a, (H, chunks, rows, dim), torch.float32)[:, :used],
                                       _tensor(part_m, (H, chunks, rows), torch.float32)[:, :used],
                                       _tensor(part_l, (H, chunks, rows), torch.float32)[:, :used], whole)
        _tensor(out, (H, rows, dim), torch.float32).copy_(o)
        _tensor(lse, (H, rows), torch.float32).copy_(lse_)
    else:
        raise AssertionError(f"no replay for kernel {name}")


@pytest.fixture
def replayed_kernels(monkeypatch):
    """Send the ops down their kernel path on the CPU: each launch is checked against the kernel's signature
    and replayed on host memory; yields the launches as ``(kernel, grid, block)``."""

    sigs = _signatures()
    launches = []

    def launch(k, device, grid, block, args, shared_mem=0):
        kinds = sigs[k]
        if k == "kvtier_plan_recall":   # a byte of marks per wanted page and per slot
            assert shared_mem == int(args[5]) + int(args[6])
        if k.startswith("kvtier_kvp_score_"):   # the features and both hidden layers
            assert shared_mem == 4 * (2 * int(args[7]) + int(args[8]) + 2 * int(args[9]))
        if k.startswith("kvtier_rank_pages_"):   # the layout the kernel makes, within a block's default share
            m, rows, page, dim, tile = (int(args[i]) for i in (2, 11, 12, 13, 14))
            assert shared_mem == ops._rank_shared(m, tile, rows, page, dim) <= ops.SHARED_MAX
        if k.startswith("kvtier_attend_chunks_"):   # the query, the logits, the row sums and a tile of keys
            rows, dim, chunk, tile = (int(args[i]) for i in (15, 16, 17, 18))
            words = dim * _OF_SUFFIX[k.rsplit("_", 1)[1]].itemsize // 4
            wide = k.startswith("kvtier_attend_chunks_wide_")
            assert shared_mem == ops._attend_shared(rows, dim, chunk, tile, words, wide) <= ops.SHARED_MAX
        if k == "kvtier_attend_combine":   # a weight per chunk, M, L and the whole part's weight
            assert shared_mem == 4 * (int(args[3]) + 3) <= ops.SHARED_MAX
        assert [type(a) for a in args] == kinds, f"{k}: launched with {[type(a).__name__ for a in args]}"
        assert all(g >= 1 for g in grid) and len(grid) <= 3 and block[0] % 32 == 0
        assert grid[0] < 2 ** 31 and all(g <= ops._GRID_Y_MAX for g in grid[1:]), (k, grid)   # CUDA's limits
        assert 1 <= block[0] <= 1024 and shared_mem <= ops.SHARED_MAX, (k, block, shared_mem)
        launches.append((k, grid, block))
        _run_as_the_kernel(k, grid, args, block)

    monkeypatch.setattr(ops, "_why_not", lambda device, tensors: None)
    monkeypatch.setattr(ops, "slab_addresses",
                        lambda slabs, device: torch.tensor([s.data_ptr() for s in slabs], dtype=torch.int64))
    monkeypatch.setattr(loader, "kernel", lambda src, name, device: name)
    monkeypatch.setattr(loader, "launch", launch)
    return launches


def test_every_kernel_has_a_signature_to_check_launches_against():
    sigs = _signatures()
    assert set(sigs) == {"kvtier_gather_pages", "kvtier_scatter_pages", "kvtier_recall_pages", "kvtier_pack_entries",
                         "kvtier_move_entries",
                         "kvtier_plan_recall",
                         "kvtier_code_logits",
                         "kvtier_page_upper_bounds_f32", "kvtier_page_upper_bounds_f16",
                         "kvtier_page_upper_bounds_bf16", "kvtier_rank_pages_f32", "kvtier_rank_pages_f16",
                         "kvtier_rank_pages_bf16", "kvtier_kvp_score_f32", "kvtier_kvp_score_f16",
                         "kvtier_kvp_score_bf16", "kvtier_merge_parts", "kvtier_attend_chunks_f32",
                         "kvtier_attend_chunks_f16", "kvtier_attend_chunks_bf16", "kvtier_attend_chunks_wide_f32",
                         "kvtier_attend_chunks_wide_f16", "kvtier_attend_chunks_wide_bf16", "kvtier_attend_combine",
                         "kvtier_index_pages_f32", "kvtier_index_pages_f16", "kvtier_index_pages_bf16"}
    assert sigs["kvtier_gather_pages"] == [np.uint64, np.int64, np.uint64, np.uint64, np.int64, np.int64, np.uint64,
                                           np.uint64]


@pytest.mark.parametrize("dtype", DTYPES)
def test_ops_launch_each_kernel_with_arguments_that_give_the_twins_result(replayed_kernels, monkeypatch, dtype):
    s = _storage(5, 3, (16, 64), dtype, seed=10)
    rows = np.array([14, 2, 7, 7, 0, 11], dtype=np.int64)
    out = torch.full((6, 16, 64), float("nan"), dtype=dtype)
    native.gather_pages(s.slabs, 5, rows, out)
    assert torch.equal(_bits(out), _bits(torch.stack([_row(s, int(r)) for r in rows])))
    s2 = _storage(5, 3, (16, 64), dtype, seed=13)   # a second storage (values beside keys) in the same launch
    out, out2 = torch.full_like(out, float("nan")), torch.full_like(out, float("nan"))
    native.gather_pages(s.slabs, 5, rows, out, pair=(s2.slabs, out2, None))
    assert torch.equal(_bits(out), _bits(torch.stack([_row(s, int(r)) for r in rows])))
    assert torch.equal(_bits(out2), _bits(torch.stack([_row(s2, int(r)) for r in rows])))
    values = torch.randn(3, 16, 64).to(dtype)
    native.scatter_pages(s.slabs, 5, np.array([9, 1, 13]), values)
    assert all(torch.equal(_row(s, r), values[i]) for i, r in enumerate([9, 1, 13]))

    pool = DevicePool(2, 64, dtype, torch.device("cpu"), 16)
    k = torch.randn(1, 2, 40, 64).to(dtype)
    pool.stage(k, k, torch.arange(40).expand(2, 40))
    pool.commit(40, torch.zeros(2, 40))
    idx = torch.tensor([[0, 17, 33, 39], [5, 16, 20, 38]])
    assert torch.equal(_bits(native.pack_entries(pool.k, idx)), _bits(twins.pack_entries(pool.k, idx)))
    twin = DevicePool(2, 64, dtype, torch.device("cpu"), 16)
    twin.stage(k, k, torch.arange(40).expand(2, 40))
    twin.commit(40, torch.zeros(2, 40))
    pool.remove(idx)                                   # the moves replayed as the kernel makes them
    with monkeypatch.context() as m:
        m.setattr(ops, "_why_not", lambda device, tensors: "twin")
        twin.remove(idx)
    every = torch.arange(pool.count).expand(2, -1)   # the entries left (the slabs past them hold nothing)
    for a, b in zip((pool.k, pool.v, pool.pos, pool.score), (twin.k, twin.v, twin.pos, twin.score)):
        assert torch.equal(_bits(twins.pack_entries(a, every)), _bits(twins.pack_entries(b, every)))

    H, D = 2, 64
    index = PageIndex(H, 16, D, dtype, torch.device("cpu"), pages_per_slab=4)
    keys = torch.randn(H, 10, 16, D).to(dtype)
    index.add(keys)                                    # bounds and codes replayed as the kernel makes them
    twin = PageIndex(H, 16, D, dtype, torch.device("cpu"), pages_per_slab=4)
    with monkeypatch.context() as m:
        m.setattr(ops, "_why_not", lambda device, tensors: "twin")
        twin.add(keys)
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(index.state().values(), twin.state().values()))
    spans = [b for _, b in index.bounds.spans(index.n * H)]
    q = torch.randn(H, 3, D)
    got = native.page_upper_bounds(q, spans, H)
    assert torch.equal(_bits(got), _bits(twins.page_upper_bounds(q, torch.cat(spans), H)))

    lo, hi = index.pick(torch.tensor([[3, 1], [0, 9]]))[:2]
    codes = index.pick(torch.tensor([[3, 1], [0, 9]]))[2]
    logits, base = native.code_logits(q, lo, step(lo, hi), codes, 0.125)
    want = twins.code_logits(q, lo.float(), step(lo, hi), codes, 0.125)
    assert torch.equal(_bits(logits), _bits(want[0])) and torch.equal(_bits(base), _bits(want[1]))
    # the slab storages under the pool and the index took the kernel path too (their writes were replayed)
    suffix = _SUFFIX[dtype]
    ran = [name for name, _, _ in replayed_kernels]
    assert set(ran) == {"kvtier_gather_pages", "kvtier_scatter_pages", "kvtier_pack_entries", "kvtier_move_entries",
                        f"kvtier_page_upper_bounds_{suffix}", "kvtier_code_logits", f"kvtier_index_pages_{suffix}"}
    assert ran.count(f"kvtier_page_upper_bounds_{suffix}") == len(spans) == 3


@pytest.mark.parametrize("dtype", DTYPES)
def test_recall_pages_launch_gives_the_twins_result(replayed_kernels, dtype):
    s = _storage(5, 3, (16, 64), dtype, seed=11)
    src = torch.tensor([[14, 2, 7], [0, 11, 3]])
    dst = torch.tensor([[2, 0, 1], [5, 3, 4]])
    count = torch.tensor([2, 3])
    out = torch.full((6, 16, 64), float("nan"), dtype=dtype)
    native.recall_pages(s.slabs, 5, src, dst, count, out)
    want = twins.recall_pages(s.slabs, 5, src, dst, count, torch.full_like(out, float("nan")))
    assert torch.equal(_bits(out), _bits(want))
    s2 = _storage(5, 3, (16, 64), dtype, seed=12)   # a second storage (values beside keys) in the same launch
    out, out2 = torch.full_like(out, float("nan")), torch.full_like(out, float("nan"))
    native.recall_pages(s.slabs, 5, src, dst, count, out, pair=(s2.slabs, out2, None))
    assert torch.equal(_bits(out), _bits(want))
    assert torch.equal(_bits(out2), _bits(twins.recall_pages(s2.slabs, 5, src, dst, count,
                                                             torch.full_like(out, float("nan")))))
    assert [name for name, _, _ in replayed_kernels] == ["kvtier_recall_pages"] * 2


def test_plan_recall_launch_gives_the_twins_plan(replayed_kernels):
    g = torch.Generator().manual_seed(12)
    for heads, w, R, pages in ((3, 5, 8, 20), (1, 4, 4, 6), (2, 0, 3, 5)):
        want = torch.stack([torch.randperm(pages, generator=g)[:w] for _ in range(heads)])
        held = torch.stack([torch.randperm(pages, generator=g)[:R] for _ in range(heads)])
        held[torch.rand(heads, R, generator=g) < 0.3] = -1
        host_slots = torch.randperm(heads * pages, generator=g).view(heads, pages)
        host_slots[torch.rand(heads, pages, generator=g) < 0.3] = -1   # pages on disk: a prefetch skips them
        for prefetch in (False, True):
            ahead = torch.rand(heads, R, generator=g) < 0.5
            counts = torch.arange(4, dtype=torch.int64)
            twin_ahead, twin_counts = ahead.clone(), counts.clone()
            got = native.plan_recall(want, held, pages, host_slots, ahead, counts, prefetch)
            expect = twins.plan_recall(want, held, pages, host_slots, twin_ahead, twin_counts, prefetch)
            for a, b in zip(got, expect):
                assert torch.equal(a, b)
            assert torch.equal(ahead, twin_ahead) and torch.equal(counts, twin_counts)
        got = native.plan_recall(want, held, pages)          # no host slots, flags or counters
        for a, b in zip(got, twins.plan_recall(want, held, pages)):
            assert torch.equal(a, b)
        # in place: the table the plan makes is written into `held` itself, by the kernel and by the twin
        expect = twins.plan_recall(want, held, pages, host_slots)
        for plan in (native.plan_recall, twins.plan_recall):
            table = held.clone()
            got = plan(want, table, pages, host_slots, in_place=True)
            assert got.held_after is table
            for a, b in zip(got, expect):
                assert torch.equal(a, b)
    # the first columns of a wider short list, read where they are (no copy made of them)
    wide = torch.stack([torch.randperm(20, generator=g)[:9] for _ in range(3)])
    slots = torch.stack([torch.randperm(20, generator=g)[:8] for _ in range(3)])
    copied = []
    with pytest.MonkeyPatch.context() as m:
        m.setattr(ops, "_as", lambda t, dtype, _as=ops._as: copied.append(t.data_ptr()) or _as(t, dtype))
        got = native.plan_recall(wide[:, :5], slots, 20)
    assert wide.data_ptr() not in copied
    for a, b in zip(got, twins.plan_recall(wide[:, :5].contiguous(), slots, 20)):
        assert torch.equal(a, b)
    # four launches a shape (the second to last, w = 0, has nothing to launch), and the wide one
    assert [name for name, _, _ in replayed_kernels] == ["kvtier_plan_recall"] * 9
    with pytest.raises(ValueError, match="contiguous int64 held"):
        native.plan_recall(want, held.int(), pages, in_place=True)


def test_plan_recall_refuses_a_buffer_smaller_than_the_want():
    with pytest.raises(ValueError, match="at least as many slots"):
        native.plan_recall(torch.zeros(2, 4, dtype=torch.int64), torch.zeros(2, 3, dtype=torch.int64), 10)


@pytest.mark.parametrize("dtype", DTYPES)
def test_page_upper_bounds_over_every_index_slab_is_one_launch(replayed_kernels, dtype):
    """Given the index storage's slab addresses, the bounds of all its slabs come from one launch, equal to the
    span by span twin."""
    H, D = 2, 64
    index = PageIndex(H, 16, D, dtype, torch.device("cpu"), pages_per_slab=4)
    index.add(torch.randn(H, 10, 16, D, generator=torch.Generator().manual_seed(13)))
    spans = [b for _, b in index.bounds.spans(index.n * H)]
    addresses = torch.tensor([t.data_ptr() for t in index.bounds.slabs], dtype=torch.int64)
    q = torch.randn(H, 3, D, generator=torch.Generator().manual_seed(14))
    got = native.page_upper_bounds(q, spans, H, addresses=addresses, rows_per_slab=index.bounds.rows_per_slab)
    assert torch.equal(_bits(got), _bits(twins.page_upper_bounds(q, torch.cat(spans), H)))
    suffix = _SUFFIX[dtype]
    bounds = [name for name, _, _ in replayed_kernels if name.startswith("kvtier_page_upper_bounds")]
    assert bounds == [f"kvtier_page_upper_bounds_{suffix}"] and len(spans) == 3
    # a storage may hold a slab more than the pages need (grown by a demotion that then failed)
    spare = torch.cat([addresses, addresses[-1:]])
    again = native.page_upper_bounds(q, spans, H, addresses=spare, rows_per_slab=index.bounds.rows_per_slab)
    assert torch.equal(_bits(again), _bits(got))
    with pytest.raises(ValueError, match="rows_per_slab"):
        native.page_upper_bounds(q, spans, H, addresses=addresses, rows_per_slab=3)
    with pytest.raises(ValueError, match="at least every span"):
        native.page_upper_bounds(q, spans, H, addresses=addresses[:2], rows_per_slab=index.bounds.rows_per_slab)
    strided = torch.stack([addresses, addresses], dim=1).reshape(-1)[::2]   # the same values, every other word
    with pytest.raises(ValueError, match="contiguous int64 addresses"):
        native.page_upper_bounds(q, spans, H, addresses=strided, rows_per_slab=index.bounds.rows_per_slab)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rank_pages_launch_gives_the_twins_ranking(replayed_kernels, dtype):
    H, D = 2, 64
    index = PageIndex(H, 16, D, dtype, torch.device("cpu"), pages_per_slab=4)
    g = torch.Generator().manual_seed(13)
    index.add(torch.randn(H, 10, 16, D, generator=g))
    q = torch.randn(H, 3, D, generator=g)
    cand = torch.stack([torch.randperm(10, generator=g)[:7] for _ in range(H)])
    bounds, codes = (index.bounds.slabs, index.bounds.rows_per_slab), (index.codes.slabs, index.codes.rows_per_slab)
    resident = torch.randn(H, 8, generator=g)[:, :3]   # rows of a wider tensor: a stride the kernel takes
    got = native.rank_pages(q, cand, index.n, bounds, codes, 16, 0.125, 4, resident)
    want = twins.rank_pages(q, cand, index.n, bounds, codes, 16, 0.125, 4, resident)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    ran = [name for name, _, _ in replayed_kernels]
    assert ran[-1] == f"kvtier_rank_pages_{_SUFFIX[dtype]}" and ran.count(ran[-1]) == 1   # after the index's writes


def test_grids_no_device_takes_go_to_the_twins(replayed_kernels):
    """Zero query rows, heads or channels (a grid or block dimension of 0) and more heads than a grid's second
    dimension takes never launch: the twin answers, with the shape asked for (a ranking of pages for no query is
    refused)."""
    g = torch.Generator().manual_seed(2)
    D, P = 16, 4
    for H, R in ((2, 0), (0, 3)):
        q = torch.randn(H, R, D, generator=g)
        pool = DevicePool(H, D, torch.float32, torch.device("cpu"), 64)
        pool.ensure(8)
        out, lse = native.attend_slabs(q, pool.k, pool.v, 8, 0.25)
        assert out.shape == (H, R, D) and lse.shape == (H, R)
        kb = torch.randn(H, 3 * P, D, generator=g)
        pages = torch.zeros(H, 2, dtype=torch.int64)
        if H:   # pages of no head cannot be asked for ([0, n] is refused first)
            out, lse = native.attend_pages(q, kb, kb.clone(), pages, P, 0.25)
            assert out.shape == (H, R, D) and lse.shape == (H, R)
        index = PageIndex(max(H, 1), P, D, torch.float32, torch.device("cpu"))
        index.add(torch.randn(max(H, 1), 5, P, D, generator=g))
        if H:
            cand = torch.stack([torch.randperm(5, generator=g)[:3] for _ in range(H)])
            stores = (index.bounds.slabs, index.bounds.rows_per_slab), (index.codes.slabs, index.codes.rows_per_slab)
            with pytest.raises(ValueError, match=r"q \[2, 0, 16\]; allowed: at least one head and one query row"):
                native.rank_pages(q, cand, index.n, *stores, P, 0.25, 2)
        logits, base = native.code_logits(q, torch.zeros(H, 2, D), torch.ones(H, 2, D),
                                          torch.zeros(H, 2, P, D // 4, dtype=torch.uint8), 0.25)
        assert logits.shape == (H, 2, R, P) and base.shape == (H, 2, R)
    assert not any(k.startswith(("kvtier_attend", "kvtier_code")) for k, _, _ in replayed_kernels), replayed_kernels
    for chunk in (32, 64):   # keys of no channel: one launch, or two (a combine of 0 threads a block)
        slab = torch.zeros(1, 2, 64, 0)
        out, lse = native.attend_slabs(torch.zeros(2, 3, 0), [slab], [slab], 40, 1.0, chunk=chunk)
        assert out.shape == (2, 3, 0) and lse.shape == (2, 3)
    H = ops._GRID_Y_MAX + 1
    q = torch.randn(H, 1, D, generator=g)
    slab = torch.randn(1, H, 2, D, generator=g)
    got = native.attend_slabs(q, [slab], [slab.clone()], 2, 0.25, chunk=32)
    assert not any(k.startswith("kvtier_attend") for k, _, _ in replayed_kernels)
    want = twins.attend_slabs(q, [slab], [slab.clone()], 2, 0.25, 32)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_rank_pages_refuses_bad_arguments_naming_them():
    index = PageIndex(2, 4, 8, torch.float32, torch.device("cpu"))
    index.add(torch.randn(2, 5, 4, 8))
    args = (5, (index.bounds.slabs, index.bounds.rows_per_slab), (index.codes.slabs, index.codes.rows_per_slab), 4, 0.5)
    q, cand = torch.randn(2, 1, 8), torch.tensor([[0, 3], [4, 1]])
    with pytest.raises(ValueError, match="keep=3; allowed: 1 to 2"):
        native.rank_pages(q, cand, *args, 3)
    with pytest.raises(ValueError, match=r"cand \[2, 2\] torch.int32"):
        native.rank_pages(q, cand.int(), *args, 1)
    with pytest.raises(ValueError, match=r"resident \[2, 3\]"):
        native.rank_pages(q, cand, *args, 1, torch.zeros(2, 3))


@pytest.mark.parametrize("dtype", DTYPES)
def test_kvp_score_launch_gives_the_twins_scores(replayed_kernels, dtype):
    from kvtier.scoring.features import position_features
    from kvtier.scoring.kvp import KVPScorer

    scorer = KVPScorer()
    layers, H, D = scorer.shape
    g = torch.Generator().manual_seed(14)
    k = torch.randn(4, H, D, generator=g).to(dtype).transpose(0, 1)    # head-major view of token-major memory
    v = torch.randn(H, 4, D, generator=g).to(dtype)                    # and contiguous values: other strides
    pos = position_features(torch.arange(9, 13))
    w = scorer.agents.weights()
    got = native.kvp_score(k, v, pos, w, 2 * H)
    assert torch.equal(got, twins.kvp_score(k, v, pos, w, 2 * H))
    assert [name for name, _, _ in replayed_kernels] == [f"kvtier_kvp_score_{_SUFFIX[dtype]}"]
    none = native.kvp_score(k[:0], v[:0], pos, w, 0)   # no heads: no launch (a grid dimension of 0)
    assert none.shape == (0, 4) and len(replayed_kernels) == 1


def test_merge_parts_launches_give_the_twins_merge(replayed_kernels):
    g = torch.Generator().manual_seed(15)
    parts = [(torch.randn(2, 3, 20, generator=g)[..., :16], torch.randn(2, 5, generator=g)[:, 1:4]) for _ in range(6)]
    got = native.merge_parts(parts)
    first = twins.merge_parts(parts[:4])
    want = twins.merge_parts([first, *parts[4:]])
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert [name for name, _, _ in replayed_kernels] == ["kvtier_merge_parts"] * 2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("count,chunk", [(150, 32), (150, 256), (40, 64)])
def test_attend_slabs_launches_give_the_twins_attention(replayed_kernels, dtype, count, chunk):
    """Slabs of 64 entries, the last one partly used: two launches (the chunks, their combine) for a pool of
    several chunks, one for a pool of one."""
    from kvtier.tiers.device import DevicePool

    g = torch.Generator().manual_seed(count + chunk)
    pool = DevicePool(3, 16, dtype, torch.device("cpu"), 64)
    pool.ensure(count)
    pool._write(0, torch.randn(1, 3, count, 16, generator=g).to(dtype),
                torch.randn(1, 3, count, 16, generator=g).to(dtype), torch.zeros(3, count, dtype=torch.int64))
    q = torch.randn(12, 16, generator=g).to(dtype).reshape(3, 4, 16)
    got = native.attend_slabs(q, pool.k, pool.v, count, 0.25, chunk=chunk)
    want = twins.attend_slabs(q, pool.k, pool.v, count, 0.25, chunk)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    chunks = -(-count // chunk)
    assert [name for name, _, _ in replayed_kernels] == \
        [f"kvtier_attend_chunks_{_SUFFIX[dtype]}"] + ["kvtier_attend_combine"] * (chunks > 1)
    assert native.backend()["ops"]["attend_slabs"]["last"] == "kernel"


@pytest.mark.parametrize("dtype", DTYPES)
def test_attend_slabs_reading_the_count_on_the_device_launches_alike_for_every_count(replayed_kernels, dtype,
                                                                                     monkeypatch):
    """With the count the pool keeps on the device (`DevicePool.at`), the grid covers the slabs' capacity: the
    launches are the same for every count in a slab (blocks past the entries return), and the result is the
    twin's over the count, in the chunks the capacity gives."""
    from kvtier.tiers.device import DevicePool

    g = torch.Generator().manual_seed(21)
    pool = DevicePool(3, 16, dtype, torch.device("cpu"), 64)
    pool.ensure(150)   # three slabs
    pool._write(0, torch.randn(1, 3, 150, 16, generator=g).to(dtype),
                torch.randn(1, 3, 150, 16, generator=g).to(dtype), torch.zeros(3, 150, dtype=torch.int64))
    q = torch.randn(3, 4, 16, generator=g).to(dtype)
    chunk = native.attend_chunk(192, 3)
    launches, counts = [], []
    replay = loader.launch
    monkeypatch.setattr(loader, "launch", lambda k, device, grid, block, args, shared_mem=0: (
        counts.append((k, int(args[13]), int(args[14]))), replay(k, device, grid, block, args, shared_mem)))
    for count in (129, 140, 150):
        pool.count = count - 1      # the committed entries; the step's own is the next
        assert pool.counted(1) == (pool.at(), 128 + 1)
        got = native.attend_slabs(q, pool.k, pool.v, count, 0.25, counted=pool.counted(1))
        want = twins.attend_slabs(q, pool.k, pool.v, count, 0.25, chunk)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        launches.append([(name, grid) for name, grid, _ in replayed_kernels])
        replayed_kernels.clear()
    assert launches[0] == launches[1] == launches[2] and len(launches[0]) == 2
    # the chunks' count arguments: the same base and the same address for every count
    chunk_counts = {c[1:] for c in counts if c[0].startswith("kvtier_attend_chunks_")}
    assert chunk_counts == {(129, pool.at().data_ptr())}
    assert launches[0][0][1][0] == -(-192 // chunk)   # the grid: the capacity's chunks
    with pytest.raises(ValueError, match="counted at"):
        native.attend_slabs(q, pool.k, pool.v, 150, 0.25, counted=(pool.at().int(), 129))
    monkeypatch.undo()   # the twin reads the count where the kernel does, not the host's word for it
    assert torch.equal(native.attend_slabs(q, pool.k, pool.v, 140, 0.25, counted=(pool.at(), 129))[0], want[0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("chunk,whole", [(8, True), (64, False), (64, True)])
def test_attend_pages_launches_give_the_twins_attention(replayed_kernels, dtype, chunk, whole):
    """The recall buffer read through a page table, merged with a part given whole: always two launches
    then; a single chunk and nothing to merge, one."""
    g = torch.Generator().manual_seed(chunk + whole)
    H, R, D, P, slots = 2, 4, 16, 4, 6
    kb = torch.randn(H, slots * P, D, generator=g).to(dtype)
    vb = torch.randn(H, slots * P, D, generator=g).to(dtype)
    pages = torch.stack([torch.randperm(slots, generator=g)[:5] for _ in range(H)])
    q = torch.randn(H, R, D, generator=g).to(dtype)
    part = (torch.randn(H, R, 20, generator=g)[..., :D], torch.randn(H, R, generator=g)) if whole else None
    got = native.attend_pages(q, kb, vb, pages, P, 0.25, chunk=chunk, whole=part)
    want = twins.attend_pages(q, kb, vb, pages, P, 0.25, chunk, part)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    two = whole or chunk < 5 * P
    assert [name for name, _, _ in replayed_kernels] == \
        [f"kvtier_attend_chunks_{_SUFFIX[dtype]}"] + ["kvtier_attend_combine"] * two


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_keys_and_values_between_4_byte_words_are_never_launched(replayed_kernels, dtype):
    """The attention kernels read rows as 4-byte words: buffers or slabs that are contiguous views starting at
    an odd 2-byte element (which would fault on a device) go to the twin, with its attention; aligned, the
    same views launch."""
    g = torch.Generator().manual_seed(5)
    H, R, D, P, slots = 2, 3, 16, 4, 6
    q = torch.randn(H, R, D, generator=g).to(dtype)
    pages = torch.stack([torch.randperm(slots, generator=g)[:5] for _ in range(H)])
    for offset in (1, 2):   # 2 bytes past a word, then a whole word
        flat = [torch.randn(H * slots * P * D + 2, generator=g).to(dtype) for _ in range(2)]
        kb, vb = (f[offset:offset + H * slots * P * D].view(H, slots * P, D) for f in flat)
        assert kb.is_contiguous() and (kb.data_ptr() % 4 != 0) == (offset == 1)
        replayed_kernels.clear()
        got = native.attend_pages(q, kb, vb, pages, P, 0.25, chunk=64, wide=False)
        want = twins.attend_pages(q, kb, vb, pages, P, 0.25, 64)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert bool(replayed_kernels) == (offset == 2), replayed_kernels
        slabs = [kb.unsqueeze(0)], [vb.unsqueeze(0)]
        replayed_kernels.clear()
        got = native.attend_slabs(q, *slabs, 20, 0.25, chunk=64, wide=False)
        want = twins.attend_slabs(q, *slabs, 20, 0.25, 64)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert bool(replayed_kernels) == (offset == 2), replayed_kernels


@pytest.mark.parametrize("dtype", DTYPES)
def test_wide_reads_are_asked_for_only_where_rows_are_aligned_16_byte_words(replayed_kernels, dtype, monkeypatch):
    """`wide` (16-byte loads, the values staged) reaches the kernel where asked and every row is whole aligned
    16-byte words, and never elsewhere: the same attention either way, and its value sums' room in the launch's
    shared memory (the fixture checks the size)."""
    from kvtier.tiers.device import DevicePool

    asked = []
    replay = loader.launch
    monkeypatch.setattr(loader, "launch", lambda k, device, grid, block, args, shared_mem=0: (
        asked.append(int(k.startswith("kvtier_attend_chunks_wide_"))) if k.startswith("kvtier_attend_chunks_") else None,
        replay(k, device, grid, block, args, shared_mem)))
    g = torch.Generator().manual_seed(3)
    for D in (16, 12):   # rows of 32 or 64 bytes, and of 24 or 48: whole 16-byte words for float32 only
        pool = DevicePool(2, D, dtype, torch.device("cpu"), 64)
        pool.ensure(100)
        pool._write(0, torch.randn(1, 2, 100, D, generator=g).to(dtype),
                    torch.randn(1, 2, 100, D, generator=g).to(dtype), torch.zeros(2, 100, dtype=torch.int64))
        q = torch.randn(2, 4, D, generator=g).to(dtype)
        want = twins.attend_slabs(q, pool.k, pool.v, 100, 0.25, 32)
        for wide in (None, False, True):
            got = native.attend_slabs(q, pool.k, pool.v, 100, 0.25, chunk=32, wide=wide)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        whole_words = D * dtype.itemsize % 16 == 0
        assert asked == [int(ops.ATTEND_WIDE and whole_words), 0, int(whole_words)], (D, asked)
        asked.clear()
    kb, vb = (torch.randn(2, 6 * 4, 16, generator=g).to(dtype) for _ in range(2))
    pages = torch.stack([torch.randperm(6, generator=g)[:5] for _ in range(2)])
    q = torch.randn(2, 4, 16, generator=g).to(dtype)
    got = native.attend_pages(q, kb, vb, pages, 4, 0.25, chunk=8, wide=True)
    want = twins.attend_pages(q, kb, vb, pages, 4, 0.25, 8)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and asked == [1]


def test_a_source_that_failed_to_build_is_reported_to_the_callers_gates(monkeypatch):
    """A caller with a torch path of its own (page choice, KVP) takes it when a kernel source failed to build,
    rather than the twin, a long run of small ops on a GPU."""
    gpu = torch.device("cuda", 0)
    monkeypatch.setitem(loader._ready, ("rank_pages", 0), "rank_pages.cu did not build on cuda:0: (injected)")
    monkeypatch.setattr(loader, "_failed", {("rank_pages", 0)})   # as `kernel` notes a failure
    assert native.build_failed(gpu, "page_select", "rank_pages")
    assert not native.build_failed(gpu, "page_select", "kvp_score")
    assert not native.build_failed(torch.device("cpu"), "rank_pages")


def test_recall_pages_refuses_a_pair_of_another_dtype():
    s = _storage(5, 3, (16, 64), torch.float32, seed=16)
    out = torch.zeros(6, 16, 64)
    with pytest.raises(ValueError, match="torch.float16 on cpu; allowed: 3 slabs into .* torch.float32"):
        native.recall_pages(s.slabs, 5, torch.zeros(1, 2, dtype=torch.int64), torch.zeros(1, 2, dtype=torch.int64),
                            torch.ones(1, dtype=torch.int64), out, pair=(s.slabs, out.half(), None))


def test_callers_gates_follow_build_failures(monkeypatch):
    """Where kernels run, page choice and KVP take the kernels; once one of their sources failed to build, their
    own torch paths (not the twins)."""
    from kvtier.scoring.kvp import KVPScorer

    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(native, "kernel_status", lambda: None)
    scorer = KVPScorer()
    index = PageIndex(2, 4, 8, torch.float32, torch.device("cpu"))
    index.device = gpu   # the gate reads only the device: the storages stay on the CPU
    assert scorer._kernel_scores(gpu) and index.uses_kernels
    monkeypatch.setitem(loader._ready, ("kvp_score", 0), "kvp_score.cu did not build (injected)")
    monkeypatch.setitem(loader._ready, ("merge_parts", 0), "merge_parts.cu did not build (injected)")
    monkeypatch.setattr(loader, "_failed", {("kvp_score", 0), ("merge_parts", 0)})   # as `kernel` notes them
    assert not scorer._kernel_scores(gpu) and not index.uses_kernels


def test_inputs_of_the_wrong_shape_or_device_are_refused_naming_them():
    """What no caller of the engine passes, but a direct call may: a ValueError naming the argument and what is
    allowed, where torch's own error (or a kernel reading the wrong memory) came before."""
    st = [torch.zeros(3, 4), torch.zeros(3, 4)]
    meta = torch.zeros(1, 1, 4, device="meta")
    cases = [
        (lambda: native.gather_pages(st, 3, np.array([[5], [0]]), torch.empty(2, 4)), r"rows of shape \[2, 1\]"),
        (lambda: native.scatter_pages(st, 3, torch.tensor([[1, 2]]), torch.zeros(1, 4)), r"rows of shape \[1, 2\]"),
        (lambda: native.recall_pages(st, 3, torch.tensor([1]), torch.tensor([0]), torch.tensor([1]), torch.zeros(2, 4)),
         r"src_rows \[1\]; allowed: \[heads, r\]"),
        (lambda: native.plan_recall(torch.tensor([[1]]), torch.tensor([1, -1]), 4), r"held \[2\]; allowed"),
        (lambda: native.plan_recall(torch.tensor([[1]]), torch.tensor([[1, -1]]), 4,
                                    counts=torch.zeros(4, dtype=torch.int64, device="meta")), "counts on meta"),
        (lambda: native.index_pages(torch.zeros(1, 1, 0, 4), [torch.zeros(4, 8)], 4, 0),
         "pages of at least one entry"),
        (lambda: native.page_upper_bounds(torch.zeros(0, 1, 8), [torch.zeros(0, 16)], 0), "at least one"),
        (lambda: native.page_upper_bounds(torch.zeros(1, 8), [torch.zeros(1, 16)], 1), r"q is \[1, 8\]"),
        (lambda: native.code_logits(torch.zeros(1, 1, 4), meta, torch.zeros(1, 1, 4),
                                    torch.zeros(1, 1, 2, 1, dtype=torch.uint8), 1.0), "lo on meta"),
        (lambda: native.code_logits(torch.zeros(1, 4), torch.zeros(1, 1, 4), torch.zeros(1, 1, 4),
                                    torch.zeros(1, 1, 2, 1, dtype=torch.uint8), 1.0), r"q is \[1, 4\]"),
        (lambda: native.merge_parts([(torch.zeros(2, 4), torch.zeros(2))]), r"an out of \[2, 4\]"),
        (lambda: native.attend_pages(torch.zeros(1, 1, 4), torch.zeros(1, 0, 4), torch.zeros(1, 0, 4),
                                     torch.zeros(1, 1, dtype=torch.long), 4, 1.0), "at least one slot"),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()
    out = torch.ones(0, 4)   # an out of no row: every row of the plan is skipped, as the rows outside it are
    assert native.recall_pages(st, 3, torch.tensor([[1]]), torch.tensor([[0]]), torch.tensor([1]), out) is out
    slabs = [torch.zeros(1, 2, 4, 0), torch.zeros(1, 2, 4, 0)]   # entries of no channel, in two slabs
    assert native.pack_entries(slabs, torch.tensor([[0, 5], [1, 6]])).shape == (2, 2, 0)
    native.move_entries(slabs, torch.tensor([[0, 5], [1, 6]]), torch.tensor([[1, 4], [2, 7]]))


def test_float64_keys_are_indexed_by_bounds_that_hold_them():
    """float64 has no kernel: its twin had rounded the extremes to float32's nearest, which may not bound them."""
    keys = torch.zeros(1, 1, 4, 4, dtype=torch.float64)
    keys[..., 0, :], keys[..., 1, :] = 1.0 + 2 ** -30, -(1.0 + 2 ** -30)   # no float32 value
    bounds = [torch.zeros(4, 8, dtype=torch.float64)]
    native.index_pages(keys, bounds, 4, 0)
    assert torch.equal(bounds[0][0, :4], keys.amax(2).flatten())
    assert torch.equal(bounds[0][0, 4:], keys.amin(2).flatten())
    lo, hi = page_bounds(keys[0], torch.full((1,), 4))
    assert torch.equal(hi[0], keys[0, 0].amax(0)) and torch.equal(lo[0], keys[0, 0].amin(0))


@pytest.mark.parametrize("what", ["rank_pages pages", "counted", "rows", "kvp weights"])
def test_inputs_the_twins_had_taken_are_refused_by_name(what):
    """Each had given an answer with no error: shares read from no storage; attention over the capacity for a
    count past it; rows 2 for 2.9 and rows 1, 0 for a mask; a float64 score for float64 weights."""
    g = torch.Generator().manual_seed(0)
    if what == "rank_pages pages":   # the storages hold 4 pages
        slabs = [torch.randn(2, 16, generator=g) for _ in range(2)], 2
        codes = [torch.zeros(2, 4, 2, dtype=torch.uint8) for _ in range(2)], 2
        with pytest.raises(ValueError, match="rank_pages: pages=64; allowed: at most 4"):
            native.rank_pages(torch.randn(1, 2, 8, generator=g), torch.tensor([[0, 40]]), 64, slabs, codes, 4, 0.3, 1)
    elif what == "counted":
        k = [torch.randn(1, 1, 4, 4, generator=g) for _ in range(2)]
        for at in (20, -3):
            with pytest.raises(ValueError, match=f"a count of {at} .*allowed: 1 to 8"):
                native.attend_slabs(torch.randn(1, 1, 4, generator=g), k, k, 3, 0.5, counted=(torch.tensor([at]), 0))
    elif what == "rows":
        slabs = [torch.arange(8.).reshape(4, 2)]
        for rows in (torch.tensor([True, False]), torch.tensor([2.9, 0.5]), np.array([2.9, 0.5])):
            with pytest.raises(ValueError, match="rows of .*allowed: integer row numbers"):
                native.gather_pages(slabs, 4, rows, torch.zeros(2, 2))
            with pytest.raises(ValueError, match="rows of .*allowed: integer row numbers"):
                native.scatter_pages([slabs[0].clone()], 4, rows, torch.zeros(2, 2))
    else:
        from kvtier.native.twins import MLPWeights

        d = 10
        weights = MLPWeights(*(torch.randn(*shape, generator=g).double() for shape in (
            (2, 1, d), (2, 1, d), (2, d, 8), (2, 1, 8), (2, 8, 8), (2, 1, 8), (2, 8, 1), (2, 1, 1))))
        with pytest.raises(ValueError, match=r"kvp_score: weights of \['torch.float64'\]; allowed: torch.float32"):
            native.kvp_score(torch.randn(1, 3, 4), torch.randn(1, 3, 4), torch.randn(3, 2), weights, 0)


def test_plan_recall_refuses_a_wanted_page_outside_the_table():
    """Its bitmaps took such an id for an empty slot's column: the slot of a page still wanted was given away,
    where the kernel reads nothing for it; the engine never asks for one, so it is refused by name."""
    want, held = torch.tensor([[1, 4]]), torch.tensor([[1, -1]])
    with pytest.raises(IndexError, match="wanted page ids 1..4; allowed: 0 to 3"):
        twins.plan_recall(want, held, 4)
    assert twins.plan_recall(torch.tensor([[1, 3]]), held, 4).held_after.tolist() == [[1, 3]]


def test_the_page_index_bounds_no_query_rows_as_the_kernel_does():
    """The torch path returned None (its loop over the rows never ran) where the kernel's gives -inf."""
    index = PageIndex(2, 4, 8, torch.float32, torch.device("cpu"))
    index.add(torch.randn(2, 5, 4, 8))
    for native_select in (True, False):
        index.native_select = native_select
        assert torch.equal(index.upper_bounds(torch.randn(2, 0, 8)), torch.full((2, 5), float("-inf")))
