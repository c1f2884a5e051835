"""Every native kernel against its torch twin on a CUDA device, bit for bit.

Outputs are filled with NaN bytes first, so a byte the kernel failed to write shows up. The twin runs on the
CPU (the reference) and, for the float reductions, on the GPU as well: the twins' order is the same on any
device, which is what lets the engine fall back to them. Tests that launch kernels need cupy; the others
run on any CUDA machine.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtier import native
from kvtier.native import twins
from kvtier.recall.bounds import page_bounds, round_outward
from kvtier.recall.buffer import RecallBuffer
from kvtier.recall.codes import encode, step
from kvtier.recall.index import PageIndex
from kvtier.tiers.device import DevicePool
from kvtier.tiers.host import HostPool
from kvtier.tiers.slabs import SlabRows

pytestmark = pytest.mark.cuda

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.fixture
def kernels(cuda_device):
    """Skip unless the kernels can run here (cupy importable, not switched off)."""
    pytest.importorskip("cupy", reason="the kernels are compiled with cupy (pip install 'kvtier[cuda]', or "
                        "'kvtier[cuda12]' for a torch built with CUDA 12)")
    why = native.kernel_status()
    if why is not None:
        pytest.skip(f"kernels cannot run: {why}")
    return cuda_device


class _Launches:
    """Counts the kernel launches of one op, and fails with `backend()` when a twin ran instead."""

    def __init__(self, op: str) -> None:
        self.op = op
        self.before = self._count()

    def _count(self) -> int:
        return native.backend()["ops"].get(self.op, {}).get("kernel", 0)

    def check(self, n: int) -> None:
        got = self._count() - self.before
        assert got == n, f"{self.op}: {got} kernel launches, expected {n}; backend: {native.backend()}"


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().cpu().view(torch.uint8)


def _poison(shape, dtype, device) -> torch.Tensor:
    """A tensor whose every byte is 0xFF (NaN for every float dtype)."""
    t = torch.empty(shape, dtype=dtype, device=device)
    t.view(torch.uint8).fill_(0xFF)
    return t


def _storage(rows_per_slab, slabs, row_shape, dtype, device, pin=False, seed=0) -> SlabRows:
    g = torch.Generator().manual_seed(seed)
    s = SlabRows(row_shape, dtype, device, rows_per_slab, pin)
    s.ensure(rows_per_slab * slabs)
    for slab in s.slabs:
        if dtype.is_floating_point:
            slab.copy_(torch.randn(slab.shape, generator=g).to(dtype))
        else:
            slab.copy_(torch.randint(0, 255, slab.shape, generator=g).to(dtype))
    return s


# ------------------------------------------------------------------------------------------------ copies
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size,dim", [(16, 64), (32, 128)])
@pytest.mark.parametrize("pinned", [True, False], ids=["pinned-host", "device"])
def test_gather_pages_kernel_is_the_twin(kernels, dtype, page_size, dim, pinned):
    where = "cpu" if pinned else kernels
    s = _storage(5, 4, (page_size, dim), dtype, where, pin=pinned, seed=dim)
    if pinned:
        assert s.slabs[0].is_pinned()
    rows = np.random.default_rng(page_size).integers(0, s.capacity, size=33)   # repeats are fine to read
    out = _poison((len(rows), page_size, dim), dtype, kernels)
    launches = _Launches("gather_pages")
    native.gather_pages(s.slabs, 5, rows, out, s.addresses(kernels))
    torch.cuda.synchronize()
    launches.check(1)
    cpu_slabs = [t.cpu() for t in s.slabs]
    want = twins.gather_pages(cpu_slabs, 5, torch.from_numpy(rows), torch.empty(out.shape, dtype=dtype))
    assert torch.equal(_bits(out), _bits(want))
    s2 = _storage(5, 4, (page_size, dim), dtype, where, pin=pinned, seed=dim + 1)   # values beside keys
    out, out2 = _poison(out.shape, dtype, kernels), _poison(out.shape, dtype, kernels)
    launches = _Launches("gather_pages")
    native.gather_pages(s.slabs, 5, rows, out, s.addresses(kernels), pair=(s2.slabs, out2, s2.addresses(kernels)))
    torch.cuda.synchronize()
    launches.check(1)
    want2 = twins.gather_pages([t.cpu() for t in s2.slabs], 5, torch.from_numpy(rows),
                               torch.empty(out.shape, dtype=dtype))
    assert torch.equal(_bits(out), _bits(want)) and torch.equal(_bits(out2), _bits(want2))


@pytest.mark.parametrize("row_shape,dtype", [((3, 5), torch.uint8), ((3,), torch.int16), ((1, 16), torch.uint8)])
def test_gather_and_scatter_kernels_copy_rows_of_any_length(kernels, row_shape, dtype):
    """15- and 6-byte rows take the byte path, 16-byte rows the word path; both exact, nothing more written."""
    s = _storage(4, 3, row_shape, dtype, kernels, seed=1)
    rows = np.array([11, 0, 5, 5, 2, 9], dtype=np.int64)
    out = _poison((len(rows), *row_shape), dtype, kernels)
    native.gather_pages(s.slabs, 4, rows, out)
    assert torch.equal(_bits(out), _bits(torch.stack([s.slabs[r // 4][r % 4] for r in rows])))
    before = [t.clone() for t in s.slabs]
    targets = np.array([7, 1, 10], dtype=np.int64)
    launches = _Launches("scatter_pages")
    native.scatter_pages(s.slabs, 4, targets, out[:3].clone())
    launches.check(1)
    for r in range(s.capacity):
        hit = np.flatnonzero(targets == r)
        want = out[hit[0]] if len(hit) else before[r // 4][r % 4]
        assert torch.equal(_bits(s.slabs[r // 4][r % 4]), _bits(want)), f"row {r}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_scatter_pages_kernel_writes_only_its_rows(kernels, dtype):
    s = SlabRows((16, 64), dtype, kernels, 6)
    s.ensure(18)
    for slab in s.slabs:
        slab.view(torch.uint8).fill_(0xFF)
    ref = [t.cpu() for t in s.slabs]
    rows = np.random.default_rng(2).choice(18, size=11, replace=False)
    values = torch.randn(11, 16, 64, device=kernels).to(dtype)
    launches = _Launches("scatter_pages")
    native.scatter_pages(s.slabs, 6, rows, values, s.addresses(kernels))
    torch.cuda.synchronize()
    launches.check(1)
    twins.scatter_pages(ref, 6, torch.from_numpy(rows), values.cpu())
    for got, want in zip(s.slabs, ref):
        assert torch.equal(_bits(got), _bits(want))


def test_gather_kernel_runs_on_the_current_stream(kernels):
    s = _storage(8, 2, (16, 64), torch.bfloat16, "cpu", pin=True, seed=3)
    rows = np.arange(15, -1, -1)
    side = torch.cuda.Stream(kernels)
    with torch.cuda.stream(side):
        out = _poison((16, 16, 64), torch.bfloat16, kernels)
        native.gather_pages(s.slabs, 8, rows, out)
        seen = out.clone()   # queued after the kernel on the same stream: must see every byte it wrote
    side.synchronize()
    want = torch.stack([s.slabs[r // 8][r % 8] for r in rows])
    assert torch.equal(_bits(seen), _bits(want)) and torch.equal(_bits(out), _bits(want))


def test_a_device_named_without_its_index_is_the_current_one(kernels):
    """``torch.device("cuda")`` compares unequal to the ``cuda:N`` of the tensors made on it: a pool made for it
    still has its address tables (else every launch rebuilds them, and none can be captured), and a tensor
    named so has its address."""
    plain = torch.device("cuda")
    assert native.indexed_device(plain) == torch.device("cuda", torch.cuda.current_device()) == kernels
    pool = DevicePool(2, 64, torch.bfloat16, plain, 256)
    pool.ensure(300)
    assert pool.device == kernels and pool.addresses() is not None
    t = torch.zeros(4, device=plain)
    from kvtier.native.loader import device_address

    assert device_address(t, plain) == device_address(t, kernels) == t.data_ptr()
    host = torch.zeros(4).pin_memory()
    assert device_address(host, plain) == device_address(host, kernels) is not None


@pytest.mark.parametrize("dtype", DTYPES)
def test_host_pool_loads_pinned_pages_straight_into_device_memory(kernels, dtype):
    pool = HostPool(16, 64, dtype, pin=True, slab_bytes=4 * 16 * 64 * torch.empty((), dtype=dtype).element_size())
    k = torch.randn(13, 16, 64).to(dtype)
    slots = pool.store(k, -k)
    pick = slots[[12, 3, 7, 0, 8]]
    out = (_poison((5, 16, 64), dtype, kernels), _poison((5, 16, 64), dtype, kernels))
    launches = _Launches("gather_pages")
    pool.load(pick, out=out)
    launches.check(1)   # keys and values in one launch
    assert torch.equal(_bits(out[0]), _bits(k[[12, 3, 7, 0, 8]]))
    assert torch.equal(_bits(out[1]), _bits(-k[[12, 3, 7, 0, 8]]))
    pool.free(pick)
    again = pool.store(k[:5] * 3, k[:5])   # waits for the kernel's reads before overwriting the slots
    assert sorted(again.tolist()) == sorted(pick.tolist())
    assert torch.equal(pool.load(again)[0], k[:5] * 3)
    pool.close()


def test_recall_buffer_fill_runs_the_kernel_and_matches_indexing(kernels):
    H, pages, P, D = 4, 6, 16, 128
    buf = RecallBuffer(H, pages, P, D, torch.bfloat16, kernels)
    buf.k.view(torch.uint8).fill_(0xFF)
    buf.v.view(torch.uint8).fill_(0xFF)
    ref_k, ref_v = buf.k.clone(), buf.v.clone()
    heads = np.repeat(np.arange(H), 3).astype(np.int64)
    slots = np.tile(np.array([5, 0, 2]), H).astype(np.int64)
    k = torch.randn(len(heads), P, D, device=kernels).to(torch.bfloat16)
    launches = _Launches("scatter_pages")
    buf.fill(heads, np.arange(len(heads)), slots, k, k * 2)
    launches.check(2)
    h, s = torch.from_numpy(heads).to(kernels), torch.from_numpy(slots).to(kernels)
    ref_k.view(H, pages, P, D)[h, s] = k
    ref_v.view(H, pages, P, D)[h, s] = k * 2
    assert torch.equal(_bits(buf.k), _bits(ref_k)) and torch.equal(_bits(buf.v), _bits(ref_v))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("slab_tokens", [256, 40])
def test_pack_entries_kernel_is_the_entries_in_order(kernels, dtype, slab_tokens):
    heads, dim, n = 8, 128, 200
    pool = DevicePool(heads, dim, dtype, kernels, slab_tokens)
    k = torch.randn(1, heads, n, dim, device=kernels).to(dtype)
    pool.stage(k, -k, torch.arange(n, device=kernels).expand(heads, n))
    pool.commit(n, torch.zeros(heads, n, device=kernels))
    g = torch.Generator().manual_seed(slab_tokens)
    idx = torch.stack([torch.randperm(n, generator=g)[:64].sort().values for _ in range(heads)]).to(kernels)
    launches = _Launches("pack_entries")
    out = _poison((heads, 64, dim), dtype, kernels)
    native.pack_entries(pool.k, idx, out=out)
    got_v = native.pack_entries(pool.v, idx)
    launches.check(2)
    want_k = torch.stack([k[0, h, idx[h]] for h in range(heads)])
    assert torch.equal(_bits(out), _bits(want_k)) and torch.equal(_bits(got_v), _bits(-want_k))
    cpu = twins.pack_entries([t.cpu() for t in pool.k], idx.cpu())
    assert torch.equal(_bits(out), _bits(cpu))
    launches = _Launches("pack_entries")
    take_k, take_v = pool.take(idx)   # the pool's own take: the kernel, once a kind, nothing read back
    launches.check(2)
    assert torch.equal(_bits(take_k), _bits(want_k)) and torch.equal(_bits(take_v), _bits(-want_k))


@pytest.mark.parametrize("slab_tokens", [256, 40])
def test_move_entries_kernel_is_the_twin_on_every_kind_of_slab(kernels, slab_tokens):
    """A demotion's moves (`DevicePool.remove`) by the kernel, one launch a kind: the same bytes as the twin's
    on a copy of the pool on the CPU, for keys, values, positions and scores."""
    heads, dim, n = 8, 128, 200
    pools = [DevicePool(heads, dim, torch.bfloat16, d, slab_tokens) for d in (kernels, torch.device("cpu"))]
    g = torch.Generator().manual_seed(slab_tokens)
    k = torch.randn(1, heads, n, dim, generator=g).to(torch.bfloat16)
    score = torch.randn(heads, n, generator=g)
    for pool in pools:
        d = pool.device
        pool.stage(k.to(d), (-k).to(d), (torch.arange(n) * 5).expand(heads, n).to(d))
        pool.commit(n, score.to(d))
    idx = torch.stack([torch.randperm(n, generator=g)[:48] for _ in range(heads)])
    launches = _Launches("move_entries")
    pools[0].remove(idx.to(kernels))
    torch.cuda.synchronize()
    launches.check(4)
    pools[1].remove(idx)
    every = torch.arange(pools[0].count).expand(heads, -1)
    for a, b in zip((pools[0].k, pools[0].v, pools[0].pos, pools[0].score),
                    (pools[1].k, pools[1].v, pools[1].pos, pools[1].score)):
        got = twins.pack_entries([t.cpu() for t in a], every)
        assert torch.equal(_bits(got), _bits(twins.pack_entries(b, every)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim,page_size", [(128, 16), (40, 16), (6, 3)])
@pytest.mark.parametrize("nan", [False, True], ids=["finite", "with-nan"])
def test_index_pages_kernel_is_the_twin(kernels, dtype, dim, page_size, nan):
    """A demotion's recall index in one launch: the bounds rows written across two slabs of the index's storage
    and the codes, the same bytes as the twin's on the CPU (a NaN key: NaN bounds in both, of either payload)."""
    H, m, rows_per_slab, first = 8, 37, 64, 50
    g = torch.Generator().manual_seed(dim + page_size)
    keys = torch.randn(H, m, page_size, dim, generator=g) * 4
    keys = torch.where(torch.rand(keys.shape, generator=g) < 0.1, torch.round(keys), keys)   # ties, zeros
    if nan:
        keys[3, 5, 1, 2] = float("nan")
        keys[0, 0, 0, :] = float("inf")
    keys = keys.to(dtype)
    slabs = [_poison((rows_per_slab, 2 * dim), dtype, kernels) for _ in range(6)]
    ref = [s.cpu() for s in slabs]
    launches = _Launches("index_pages")
    codes = native.index_pages(keys.to(kernels), slabs, rows_per_slab, first)
    launches.check(1)
    want = twins.index_pages(keys, ref, rows_per_slab, first)
    assert torch.equal(codes.cpu(), want)
    got, ref_rows = torch.cat(slabs).cpu().float(), torch.cat(ref).float()
    assert torch.equal(torch.isnan(got), torch.isnan(ref_rows))
    assert torch.equal(got.nan_to_num(0.0).view(torch.int32), ref_rows.nan_to_num(0.0).view(torch.int32))
    if not nan:
        assert torch.equal(_bits(torch.cat(slabs)), _bits(torch.cat(ref)))


def test_recall_index_stages_pages_in_one_launch(kernels):
    """`PageIndex.stage` (a demotion's index update) launches the kernel once and keeps what the CPU's index
    keeps for the same pages."""
    H, P, D, m = 8, 16, 128, 40
    keys = torch.randn(H, m, P, D).to(torch.bfloat16)
    indexes = [PageIndex(H, P, D, torch.bfloat16, d, pin=d.type == "cuda", pages_per_slab=32)
               for d in (kernels, torch.device("cpu"))]
    launches = _Launches("index_pages")
    indexes[0].add(keys.to(kernels))
    launches.check(1)
    indexes[1].add(keys)
    a, b = indexes[0].state(), indexes[1].state()
    assert torch.equal(_bits(a["bounds"]), _bits(b["bounds"])) and torch.equal(a["codes"], b["codes"])
    for index in indexes:
        index.release()


# ---------------------------------------------------------------------------------------- page selection
def _bounds(H, pages, page_size, dim, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(H, pages, page_size, dim, generator=g)
    lo, hi = round_outward(*page_bounds(keys, torch.full((H, pages), page_size)), dtype)
    rows = torch.cat([hi, lo], dim=-1).transpose(0, 1).reshape(pages * H, 2 * dim)
    return rows.to(device), keys


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [64, 128, 40])
@pytest.mark.parametrize("rows,pages", [(1, 1), (7, 37), (24, 300)])
def test_page_upper_bounds_kernel_is_the_twin(kernels, dtype, dim, rows, pages):
    H = 4
    b, _ = _bounds(H, pages, 16, dim, dtype, kernels, seed=dim + rows)
    q = torch.randn(H, rows, dim, device=kernels)
    out = _poison((H, pages), torch.float32, kernels)
    launches = _Launches("page_upper_bounds")
    native.page_upper_bounds(q, [b], H, out=out)
    torch.cuda.synchronize()
    launches.check(1)
    want = twins.page_upper_bounds(q.cpu(), b.cpu(), H)
    assert torch.equal(_bits(out), _bits(want))
    on_gpu = twins.page_upper_bounds(q, b, H)          # the twin is device-independent
    assert torch.equal(_bits(on_gpu), _bits(want))


@pytest.mark.parametrize("dtype", DTYPES)
def test_page_upper_bounds_kernel_over_index_slabs_and_nan(kernels, dtype):
    H, P, D = 2, 16, 64
    index = PageIndex(H, P, D, dtype, kernels, pages_per_slab=32)
    index.add(torch.randn(H, 75, P, D, device=kernels))
    spans = [b for _, b in index.bounds.spans(index.n * H)]
    assert len(spans) == 3
    q = torch.randn(H, 9, D, device=kernels)
    q[1, 4, 17] = float("nan")
    launches = _Launches("page_upper_bounds")
    got = native.page_upper_bounds(q, spans, H)
    launches.check(3)
    want = twins.page_upper_bounds(q.cpu(), torch.cat([b.cpu() for b in spans]), H)
    assert got[1].isnan().all().item() and not got[0].isnan().any().item()
    assert torch.equal(got[0].cpu(), want[0]) and want[1].isnan().all()
    index.native_select = False                       # the matrix products
    torch.testing.assert_close(got[0], index.upper_bounds(q)[0], rtol=1e-5, atol=1e-4)
    launches = _Launches("page_upper_bounds")        # every slab in one launch, through the address table
    once = native.page_upper_bounds(q, spans, H, addresses=index.bounds.addresses(kernels),
                                    rows_per_slab=index.bounds.rows_per_slab)
    launches.check(1)
    assert torch.equal(_bits(once), _bits(got))
    index.native_select = True                        # what page choice runs on CUDA
    assert torch.equal(_bits(index.upper_bounds(q)), _bits(got))


@pytest.mark.parametrize("dim,page_size", [(64, 16), (128, 32), (64, 32)])
@pytest.mark.parametrize("rows,cands", [(1, 1), (9, 150), (3, 7)])
def test_code_logits_kernel_is_the_twin(kernels, dim, page_size, rows, cands):
    H = 3
    g = torch.Generator().manual_seed(dim + rows)
    keys = torch.randn(H, cands, page_size, dim, generator=g).to(torch.bfloat16)
    lo, hi = round_outward(*page_bounds(keys, torch.full((H, cands), page_size)), torch.bfloat16)
    codes, st = encode(keys, lo, hi), step(lo, hi)
    q = torch.randn(H, rows, dim, generator=g)
    scaling = dim ** -0.5
    out = (_poison((H, cands, rows, page_size), torch.float32, kernels),
           _poison((H, cands, rows), torch.float32, kernels))
    launches = _Launches("code_logits")
    native.code_logits(q.to(kernels), lo.to(kernels), st.to(kernels), codes.to(kernels), scaling, out=out)
    torch.cuda.synchronize()
    launches.check(1)
    want = twins.code_logits(q, lo.float(), st, codes, float(np.float32(scaling)))
    assert torch.equal(_bits(out[0]), _bits(want[0])) and torch.equal(_bits(out[1]), _bits(want[1]))


def test_switched_off_kernels_give_the_same_bits_through_the_twins(kernels, monkeypatch):
    H, D = 2, 128
    b, _ = _bounds(H, 50, 16, D, torch.bfloat16, kernels, seed=9)
    q = torch.randn(H, 5, D, device=kernels)
    with_kernel = native.page_upper_bounds(q, [b], H)
    monkeypatch.setenv("KVTIER_NATIVE", "0")
    twin = native.page_upper_bounds(q, [b], H)
    assert native.backend()["ops"]["page_upper_bounds"]["last"] == "twin"
    assert torch.equal(_bits(with_kernel), _bits(twin))


# ------------------------------------------------------------------------------ twins on the GPU, no cupy
@pytest.mark.parametrize("dtype", DTYPES)
def test_twins_give_the_same_bits_on_the_gpu_and_the_cpu(cuda_device, monkeypatch, dtype):
    """What the engine runs on a CUDA machine without cupy: the same bits as the CPU reference."""
    monkeypatch.setenv("KVTIER_NATIVE", "0")
    H, D, P = 3, 128, 16
    b, keys = _bounds(H, 60, P, D, dtype, cuda_device, seed=11)
    q = torch.randn(H, 6, D, device=cuda_device)
    assert torch.equal(_bits(native.page_upper_bounds(q, [b], H)), _bits(twins.page_upper_bounds(q.cpu(), b.cpu(), H)))
    lo, hi = round_outward(*page_bounds(keys[:, :20], torch.full((H, 20), P)), dtype)
    codes, st = encode(keys[:, :20], lo, hi), step(lo, hi)
    got = native.code_logits(q, lo.to(cuda_device), st.to(cuda_device), codes.to(cuda_device), 0.125)
    want = twins.code_logits(q.cpu(), lo.float(), st, codes, 0.125)
    assert torch.equal(_bits(got[0]), _bits(want[0])) and torch.equal(_bits(got[1]), _bits(want[1]))
    pool = HostPool(P, D, dtype, pin=True)
    k = torch.randn(7, P, D).to(dtype)
    slots = pool.store(k, k)
    out = (_poison((7, P, D), dtype, cuda_device), _poison((7, P, D), dtype, cuda_device))
    pool.load(slots[::-1].copy(), out=out)
    assert torch.equal(_bits(out[0]), _bits(k.flip(0)))
    pool.close()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pinned", [True, False], ids=["pinned-host", "device"])
def test_recall_pages_kernel_is_the_twin(kernels, dtype, pinned):
    """The device-planned recall copy: indices and counts on the device, pages from pinned host slabs."""
    where = "cpu" if pinned else kernels
    s = _storage(5, 4, (16, 64), dtype, where, pin=pinned, seed=3)
    g = torch.Generator().manual_seed(4)
    heads, r = 3, 6
    src = torch.randint(0, s.capacity, (heads, r), generator=g)
    dst = torch.stack([torch.randperm(r, generator=g) + h * r for h in range(heads)])
    count = torch.tensor([6, 0, 4])
    out = _poison((heads * r, 16, 64), dtype, kernels)
    before = out.clone()
    launches = _Launches("recall_pages")
    native.recall_pages(s.slabs, 5, src.to(kernels), dst.to(kernels), count.to(kernels), out, s.addresses(kernels))
    torch.cuda.synchronize()
    launches.check(1)
    want = twins.recall_pages([t.cpu() for t in s.slabs], 5, src, dst, count, before.cpu())
    assert torch.equal(_bits(out.cpu()), _bits(want))
    # keys and values in one launch: a second storage of the same layout, the same plan
    s2 = _storage(5, 4, (16, 64), dtype, where, pin=pinned, seed=5)
    out, out2 = before.clone(), before.clone()
    launches = _Launches("recall_pages")
    native.recall_pages(s.slabs, 5, src.to(kernels), dst.to(kernels), count.to(kernels), out, s.addresses(kernels),
                        pair=(s2.slabs, out2, s2.addresses(kernels)))
    torch.cuda.synchronize()
    launches.check(1)
    assert torch.equal(_bits(out.cpu()), _bits(want))
    want2 = twins.recall_pages([t.cpu() for t in s2.slabs], 5, src, dst, count, before.cpu())
    assert torch.equal(_bits(out2.cpu()), _bits(want2))


@pytest.mark.parametrize("heads,w,R,pages", [(8, 64, 96, 6000), (3, 5, 8, 20), (1, 96, 96, 200), (8, 1, 400, 900)])
def test_plan_recall_kernel_is_the_twin(kernels, heads, w, R, pages):
    """A recall step's plan in one launch: the same fetch list, slots, counts, buffer ids, slots of the wanted
    pages and copy rows as the twin, and the same prefetch flags and counters (added atomically by the heads'
    blocks), step after step, a step's choice then a prefetch (which skips the pages without a host slot)."""
    g = torch.Generator().manual_seed(heads * 1000 + w)
    held = torch.full((heads, R), -1, dtype=torch.int64)
    host = torch.randperm(heads * pages, generator=g).view(heads, pages)
    host[torch.rand(heads, pages, generator=g) < 0.3] = -1   # pages on disk
    ahead, counts = torch.zeros(heads, R, dtype=torch.bool), torch.zeros(4, dtype=torch.int64)
    dev_ahead, dev_counts, dev_host = ahead.to(kernels), counts.to(kernels), host.to(kernels)
    launches = _Launches("plan_recall")
    for turn in range(8):
        want = torch.stack([torch.randperm(pages, generator=g)[:w] for _ in range(heads)])
        if held.max() >= 0:   # keep some of what the buffer holds wanted, as consecutive steps do
            for h in range(heads):
                kept = held[h][held[h] >= 0][: w // 2]
                rest = want[h][~torch.isin(want[h], kept)][: w - len(kept)]
                want[h] = torch.cat([kept, rest])
        prefetch = turn % 2 == 1
        table = held.to(kernels)
        in_place = turn % 4 >= 2   # the buffer's own table written in place, as the engine plans
        got = native.plan_recall(want.to(kernels), table, pages, dev_host, dev_ahead, dev_counts, prefetch,
                                 in_place=in_place)
        expect = twins.plan_recall(want, held, pages, host, ahead, counts, prefetch)
        for a, b in zip(got, expect):
            assert torch.equal(a.cpu(), b)
        assert (got.held_after is table) == in_place
        assert torch.equal(dev_ahead.cpu(), ahead) and torch.equal(dev_counts.cpu(), counts)
        held = expect.held_after
    torch.cuda.synchronize()
    launches.check(8)


# ------------------------------------------------------------------------------------------- page ranking
def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit, any NaN standing for any other (a NaN's payload is the hardware's choice)."""
    a, b = a.detach().float().cpu(), b.detach().float().cpu()
    return bool(torch.equal(a.isnan(), b.isnan())
                and torch.equal(a.nan_to_num(0.0).view(torch.int32), b.nan_to_num(0.0).view(torch.int32)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,cands,keep", [(1, 96, 64), (4, 96, 64), (4, 300, 200), (12, 40, 7)])
def test_rank_pages_kernel_is_the_twin(kernels, dtype, rows, cands, keep):
    """Over an index of several slabs with its codes in pinned host memory (read through the mapping): the
    kernel's shares, ranking and choice are the twin's, bit for bit, in one launch."""
    H, D, P = 4, 128, 16
    g = torch.Generator().manual_seed(rows + cands)
    index = PageIndex(H, P, D, dtype, kernels, pin=True, pages_per_slab=128)
    centres = torch.randn(H, 400, 1, D, generator=g) * 2
    index.add((centres + torch.randn(H, 400, P, D, generator=g)).to(kernels))
    q = torch.randn(H, rows, D, generator=g)
    cand = torch.stack([torch.randperm(400, generator=g)[:cands] for _ in range(H)])
    resident = torch.randn(H, rows, generator=g) + 3
    bounds, codes = (index.bounds.slabs, index.bounds.rows_per_slab), (index.codes.slabs, index.codes.rows_per_slab)
    launches = _Launches("rank_pages")
    got = native.rank_pages(q.to(kernels), cand.to(kernels), index.n, bounds, codes, P, D ** -0.5, keep,
                            resident.to(kernels))
    torch.cuda.synchronize()
    launches.check(1)
    cpu_bounds = ([s.cpu() for s in bounds[0]], bounds[1])
    want = twins.rank_pages(q, cand, index.n, cpu_bounds, codes, P, float(np.float32(D ** -0.5)), keep, resident)
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])
    assert _same_bits(got[2], want[2])
    index.release()


def test_exp_and_log_twins_give_the_same_bits_on_the_gpu_and_the_cpu(cuda_device):
    g = torch.Generator().manual_seed(5)
    x = torch.cat([torch.randn(100000, generator=g) * 40, torch.tensor([0.0, float("inf"), float("-inf"), 1e-40])])
    assert _same_bits(twins.exp(x.to(cuda_device)), twins.exp(x))
    y = x.abs()
    assert _same_bits(twins.log(y.to(cuda_device)), twins.log(y))
    v = torch.randn(64, 37, generator=g) * 10
    assert _same_bits(twins.logsumexp(v.to(cuda_device)), twins.logsumexp(v))


# --------------------------------------------------------------------------------------------- KVP scores
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 5, 300])
def test_kvp_score_kernel_is_the_twin(kernels, dtype, tokens):
    """Keys and values laid out as a model hands them over (keys made new by RoPE, values a head-major view of
    token-major memory, so their strides differ): the kernel reads each through its own strides and scores
    every head in one launch, bit for bit the twin."""
    from kvtier.scoring.features import position_features
    from kvtier.scoring.kvp import KVPScorer

    scorer = KVPScorer()
    layers, H, D = scorer.shape
    g = torch.Generator().manual_seed(tokens)
    k = torch.randn(H, tokens, D, generator=g).to(dtype).to(kernels)     # made new (as RoPE makes the keys)
    v = torch.randn(tokens, H, D, generator=g).to(dtype).to(kernels).transpose(0, 1)   # a view, other strides
    pos = position_features(torch.arange(40, 40 + tokens)).to(kernels)
    layer = layers - 1
    launches = _Launches("kvp_score")
    got = native.kvp_score(k, v, pos, scorer._copy(kernels)[1], layer * H)
    torch.cuda.synchronize()
    launches.check(1)
    want = twins.kvp_score(k.cpu(), v.cpu(), pos.cpu(), scorer.agents.weights(), layer * H)
    assert _same_bits(got, want)
    plain = scorer.agents(torch.cat([k.cpu().float(), v.cpu().float(), pos.cpu().expand(H, -1, -1)], dim=-1),
                          slice(layer * H, (layer + 1) * H))
    torch.testing.assert_close(got.cpu(), plain, rtol=1e-5, atol=1e-4)


# -------------------------------------------------------------------------------------- attention merge
@pytest.mark.parametrize("parts", [2, 5])
def test_merge_parts_kernel_is_the_twin(kernels, parts):
    """Parts as attention hands them over on CUDA (an output of the model's dtype made float32, a log-sum-exp
    row padded past the rows): one launch per four parts, bit for bit the twin's merge."""
    from kvtier.engine.attention import attend_with_lse

    g = torch.Generator().manual_seed(parts)
    q = torch.randn(1, 8, 4, 128, generator=g).to(torch.bfloat16).to(kernels)
    made = []
    for i in range(parts):
        k = torch.randn(1, 8, 64 + 16 * i, 128, generator=g).to(torch.bfloat16).to(kernels)
        out, lse = attend_with_lse(q, k, k.flip(-1), 128 ** -0.5)
        made.append((out[0], lse[0]))
    launches = _Launches("merge_parts")
    got = native.merge_parts(made)
    torch.cuda.synchronize()
    launches.check(1 if parts <= 4 else 2)
    cpu = [(o.cpu(), lse.cpu()) for o, lse in made]
    want = twins.merge_parts(cpu[:4])
    if parts > 4:
        want = twins.merge_parts([want, *cpu[4:]])
    assert _same_bits(got[0], want[0]) and _same_bits(got[1], want[1])


@pytest.mark.parametrize("launcher", ["driver", "cupy"])
def test_each_launcher_runs_the_kernels_the_same(kernels, launcher, monkeypatch):
    """`KVTIER_LAUNCH` picks how a kernel is launched (its arguments packed into one buffer for the driver, or
    converted one by one by cupy): the same kernel, bit for bit the twin's result either way, graphs too."""
    monkeypatch.setenv("KVTIER_LAUNCH", launcher)
    assert native.backend()["launcher"] == launcher
    g = torch.Generator().manual_seed(7)
    made = [(torch.randn(8, 4, 128, generator=g).to(kernels), torch.randn(8, 4, generator=g).to(kernels))
            for _ in range(3)]
    want = twins.merge_parts([(o.cpu(), lse.cpu()) for o, lse in made])
    launches = _Launches("merge_parts")
    got = native.merge_parts(made)
    stream = torch.cuda.Stream(kernels)
    stream.wait_stream(torch.cuda.current_stream(kernels))
    with torch.cuda.stream(stream):   # warm on the side stream, then capture there
        native.merge_parts(made)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            captured = native.merge_parts(made)
    graph.replay()
    torch.cuda.synchronize()
    launches.check(3)
    for o in (got, captured):
        assert _same_bits(o[0], want[0]) and _same_bits(o[1], want[1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,rows,dim,count,chunk", [(8, 4, 128, 13_000, None), (8, 4, 128, 900, 256),
                                                        (2, 7, 64, 300, 32), (3, 16, 40, 5000, 1),
                                                        (8, 1, 256, 9000, None)])
@pytest.mark.parametrize("wide", [False, True], ids=["narrow", "wide"])
def test_attend_slabs_kernel_is_the_twin(kernels, dtype, heads, rows, dim, count, chunk, wide):
    """The pool as the engine keeps it (slabs of 4096 entries, the last one partly filled, poison past
    `count`): bit for bit the twin's attention (on the CPU and on the GPU), and within float rounding of an
    attention call over the same entries; read 16 bytes a load with the values staged (`wide`) or not."""
    g = torch.Generator().manual_seed(count)
    pool = DevicePool(heads, dim, dtype, kernels, 4096)
    k = torch.randn(1, heads, count, dim, generator=g).to(dtype).to(kernels)
    v = torch.randn(1, heads, count, dim, generator=g).to(dtype).to(kernels)
    pool.ensure(count + 4096)   # a slab past the entries, never read
    for s in (*pool.k, *pool.v):
        s.view(torch.uint8).fill_(0xFF)
    pool._write(0, k, v, torch.zeros(heads, count, dtype=torch.int64, device=kernels))
    q = (torch.randn(1, heads * rows, 1, dim, generator=g) * 2).to(dtype).to(kernels)
    packed = q.reshape(heads, rows, dim)
    used = chunk or native.attend_chunk(count, heads, device=kernels)
    launches = _Launches("attend_slabs")
    out, lse = native.attend_slabs(packed, pool.k, pool.v, count, dim ** -0.5, chunk=chunk,
                                   addresses=pool.addresses(), wide=wide)
    torch.cuda.synchronize()
    launches.check(1 if count <= used else 2)
    want = twins.attend_slabs(packed.cpu(), [s.cpu() for s in pool.k], [s.cpu() for s in pool.v], count,
                              dim ** -0.5, used)
    assert _same_bits(out, want[0]) and _same_bits(lse, want[1])
    on_gpu = twins.attend_slabs(packed, pool.k, pool.v, count, dim ** -0.5, used)   # the twin on the GPU too
    assert _same_bits(out, on_gpu[0]) and _same_bits(lse, on_gpu[1])
    from kvtier.engine.attention import attend_with_lse
    ref_out, ref_lse = attend_with_lse(packed[None].float(), k.float(), v.float(), dim ** -0.5)
    torch.testing.assert_close(out, ref_out[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse[0], rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cap", [50.0, 1.0])
@pytest.mark.parametrize("wide", [False, True], ids=["narrow", "wide"])
def test_soft_capped_attention_kernels_are_the_twin(kernels, dtype, cap, wide):
    """Gemma 2's soft-capped logits (`softcap`): the pool's slabs and a recall buffer's pages, bit for bit the
    twin's attention on the CPU and on the GPU (its tanh is the kernels' own, and rounds alike on either), within
    rounding of torch's tanh-capped one."""
    g = torch.Generator().manual_seed(11)
    H, R, D, count = 4, 4, 128, 5000
    pool = DevicePool(H, D, dtype, kernels, 4096)
    k = (torch.randn(1, H, count, D, generator=g) * 2).to(dtype).to(kernels)
    v = torch.randn(1, H, count, D, generator=g).to(dtype).to(kernels)
    pool.ensure(count)
    pool._write(0, k, v, torch.zeros(H, count, dtype=torch.int64, device=kernels))
    q = (torch.randn(H, R, D, generator=g) * 2).to(dtype).to(kernels)
    used = native.attend_chunk(count, H, device=kernels)
    out, lse = native.attend_slabs(q, pool.k, pool.v, count, D ** -0.5, addresses=pool.addresses(), wide=wide,
                                   softcap=cap)
    pages = torch.stack([torch.randperm(count // 16, generator=g)[:40] for _ in range(H)]).to(kernels)
    buf_k, buf_v = k[0, :, :count // 16 * 16].contiguous(), v[0, :, :count // 16 * 16].contiguous()
    p_out, p_lse = native.attend_pages(q, buf_k, buf_v, pages, 16, D ** -0.5, whole=(out, lse), wide=wide,
                                       softcap=cap)
    torch.cuda.synchronize()
    want = twins.attend_slabs(q.cpu(), [s.cpu() for s in pool.k], [s.cpu() for s in pool.v], count, D ** -0.5,
                              used, cap=cap)
    assert _same_bits(out, want[0]) and _same_bits(lse, want[1])
    p_want = twins.attend_pages(q.cpu(), buf_k.cpu(), buf_v.cpu(), pages.cpu(), 16, D ** -0.5,
                                native.attend_chunk(40 * 16, H, device=kernels), (out.cpu(), lse.cpu()), cap)
    assert _same_bits(p_out, p_want[0]) and _same_bits(p_lse, p_want[1])
    on_gpu = twins.attend_slabs(q, pool.k, pool.v, count, D ** -0.5, used, cap=cap)   # the twin on the GPU too
    assert _same_bits(out, on_gpu[0]) and _same_bits(lse, on_gpu[1])
    x = torch.randn(100_000, generator=g) * 3 * cap
    assert _same_bits(twins.softcap(x.to(kernels), cap), twins.softcap(x, cap))
    logits = torch.tanh(q.float() @ k[0].float().transpose(1, 2) * D ** -0.5 / cap) * cap
    torch.testing.assert_close(lse, torch.logsumexp(logits, dim=-1), rtol=0, atol=2e-5)
    torch.testing.assert_close(out, torch.softmax(logits, dim=-1) @ v[0].float(), rtol=0, atol=2e-5)


TINY = torch.finfo(torch.float32).tiny   # the smallest normal float32


@pytest.mark.parametrize("wide", [False, True], ids=["narrow", "wide"])
def test_attend_slabs_keeps_subnormals_as_the_twin_does(kernels, wide):
    """Values so small that most of their products with the attention weights are subnormal: the kernel keeps
    them, as the twin does, bit for bit (built with `-ftz=true`, as cupy's own build does, every such product
    would be flushed to zero and the sums would part)."""
    g = torch.Generator().manual_seed(11)
    heads, rows, dim, count = 2, 4, 64, 700
    pool = DevicePool(heads, dim, torch.float32, kernels, 4096)
    k = torch.randn(1, heads, count, dim, generator=g).to(kernels)
    v = (torch.randn(1, heads, count, dim, generator=g) * 1e-37).to(kernels)
    pool.ensure(count)
    pool._write(0, k, v, torch.zeros(heads, count, dtype=torch.int64, device=kernels))
    packed = (torch.randn(heads, rows, dim, generator=g) * 3).to(kernels)
    scale = dim ** -0.5
    weights = torch.softmax((packed.cpu().double() @ k[0].cpu().double().transpose(1, 2)) * scale, dim=-1)
    products = (weights[..., None] * v[0].cpu().double()[:, None]).abs()
    assert ((products > 0) & (products < TINY)).double().mean() > 0.5   # the case is what it claims to be
    used = native.attend_chunk(count, heads, device=kernels)
    launches = _Launches("attend_slabs")
    out, lse = native.attend_slabs(packed, pool.k, pool.v, count, scale, addresses=pool.addresses(), wide=wide)
    torch.cuda.synchronize()
    launches.check(1 if count <= used else 2)   # the kernel ran, not its twin
    want = twins.attend_slabs(packed.cpu(), [s.cpu() for s in pool.k], [s.cpu() for s in pool.v], count, scale,
                              used)
    assert _same_bits(out, want[0]) and _same_bits(lse, want[1])


def test_merge_parts_keeps_subnormals_as_the_twin_does(kernels):
    """Parts whose outputs are subnormal, scaled by weights below one: kept, bit for bit the twin's merge."""
    g = torch.Generator().manual_seed(12)
    made = [((torch.randn(8, 4, 128, generator=g) * 1e-38).to(kernels),
             (torch.randn(8, 4, generator=g) * 3).to(kernels)) for _ in range(3)]
    assert ((made[0][0].abs() < TINY) & (made[0][0] != 0)).any()
    launches = _Launches("merge_parts")
    got = native.merge_parts(made)
    torch.cuda.synchronize()
    launches.check(1)   # the kernel ran, not its twin
    want = twins.merge_parts([(o.cpu(), lse.cpu()) for o, lse in made])
    assert _same_bits(got[0], want[0]) and _same_bits(got[1], want[1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("wide", [False, True], ids=["narrow", "wide"])
def test_attend_slabs_reading_its_count_on_the_device_is_the_twin(kernels, dtype, wide):
    """The count the pool keeps on the device (`DevicePool.at`), the grid over the slabs' capacity: the same
    launch for every count in a slab, each time bit for bit the twin's over that count (poison past it)."""
    g = torch.Generator().manual_seed(5)
    H, R, D = 8, 4, 128
    pool = DevicePool(H, D, dtype, kernels, 4096)
    pool.ensure(3 * 4096)
    for s in (*pool.k, *pool.v):
        s.view(torch.uint8).fill_(0xFF)
    k = torch.randn(1, H, 9000, D, generator=g).to(dtype).to(kernels)
    pool._write(0, k, -k, torch.zeros(H, 9000, dtype=torch.int64, device=kernels))
    q = torch.randn(H, R, D, generator=g).to(dtype).to(kernels)
    chunk = native.attend_chunk(3 * 4096, H, device=kernels)
    for count in (8193, 8700, 9000):
        pool.count = count - 1
        out, lse = native.attend_slabs(q, pool.k, pool.v, count, D ** -0.5, addresses=pool.addresses(),
                                       counted=(pool.at(), 8192 + 1), wide=wide)
        torch.cuda.synchronize()
        want = twins.attend_slabs(q.cpu(), [s.cpu() for s in pool.k], [s.cpu() for s in pool.v], count, D ** -0.5,
                                  chunk)
        assert _same_bits(out, want[0]) and _same_bits(lse, want[1])


@pytest.mark.parametrize("wide", [False, True], ids=["narrow", "wide"])
def test_attend_slabs_waits_for_the_writes_before_it_on_its_stream(kernels, wide):
    """A pool written on a side stream, then attended on it after a long op: the kernel sees the new entries."""
    pool = DevicePool(8, 128, torch.bfloat16, kernels, 4096)
    pool.ensure(8192)
    side = torch.cuda.Stream(kernels)
    k = torch.randn(1, 8, 8000, 128, device=kernels).to(torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(8, 4, 128, device=kernels).to(torch.bfloat16)
    addresses = pool.addresses()
    side.wait_stream(torch.cuda.current_stream(kernels))
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)   # the writes land well after the launch was queued
        pool._write(0, k, v, torch.zeros(8, 8000, dtype=torch.int64, device=kernels))
        out, lse = native.attend_slabs(q, pool.k, pool.v, 8000, 128 ** -0.5, addresses=addresses, wide=wide)
    torch.cuda.synchronize()
    want = twins.attend_slabs(q.cpu(), [s.cpu() for s in pool.k], [s.cpu() for s in pool.v], 8000, 128 ** -0.5,
                              native.attend_chunk(8000, 8, device=kernels))
    assert _same_bits(out, want[0]) and _same_bits(lse, want[1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("whole", [True, False])
@pytest.mark.parametrize("wide", [False, True], ids=["narrow", "wide"])
def test_attend_pages_kernel_is_the_twin(kernels, dtype, whole, wide):
    """A recall buffer of 96 slots of 16 entries, 64 of them read through a slot table (poison in the rest),
    merged with a part given whole: bit for bit the twin's, within rounding of attention over the pages."""
    g = torch.Generator().manual_seed(7 + whole)
    H, R, D, P, slots, n = 8, 4, 128, 16, 96, 64
    kb = _poison((H, slots * P, D), dtype, kernels)
    vb = _poison((H, slots * P, D), dtype, kernels)
    pages = torch.stack([torch.randperm(slots, generator=g)[:n] for _ in range(H)]).to(kernels)
    rows = (pages[..., None] * P + torch.arange(P, device=kernels)).reshape(H, -1)
    for buf in (kb, vb):
        buf.scatter_(1, rows[..., None].expand(H, n * P, D),
                     torch.randn(H, n * P, D, generator=g).to(dtype).to(kernels))
    q = torch.randn(H, R, D, generator=g).to(dtype).to(kernels)
    part = (torch.randn(H, R, D, generator=g).to(kernels), torch.randn(H, R, generator=g).to(kernels) + 4) \
        if whole else None
    launches = _Launches("attend_pages")
    out, lse = native.attend_pages(q, kb, vb, pages, P, D ** -0.5, whole=part, wide=wide)
    torch.cuda.synchronize()
    chunk = native.attend_chunk(n * P, H, device=kernels)
    launches.check(1 if (n * P <= chunk and not whole) else 2)
    cpu_part = None if part is None else (part[0].cpu(), part[1].cpu())
    want = twins.attend_pages(q.cpu(), kb.cpu(), vb.cpu(), pages.cpu(), P, D ** -0.5, chunk, cpu_part)
    assert _same_bits(out, want[0]) and _same_bits(lse, want[1])
    from kvtier.engine.attention import attend_with_lse, merge_with_lse
    ref = attend_with_lse(q[None].float(), twins.paged_entries(kb, pages, P)[None].float(),
                          twins.paged_entries(vb, pages, P)[None].float(), D ** -0.5)
    if part is not None:
        ref = merge_with_lse([(part[0][None], part[1][None]), ref])
    torch.testing.assert_close(out, ref[0][0], rtol=0, atol=1e-5)
    torch.testing.assert_close(lse, ref[1][0], rtol=0, atol=1e-5)
