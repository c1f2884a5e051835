"""The pool-attention kernels' own code, compiled for the host with `nvcc`, gives the twins' bits.

`native/attend_slabs.cu` keeps its steps in ``__host__ __device__`` functions; a small host program runs them
as the two kernels order them (a block's threads as lanes in turn, the key tiles in order, every chunk and
head, then the combine) and every result must equal the twin's bit for bit: each chunk's sums, the
attention and its log-sum-exp, including a pool of one chunk, which the first kernel finishes itself, and
with `wide` (16-byte loads, the values staged a tile at a time) as without. What
only a GPU shows (shared memory, barriers, the launch) is `tests/cuda`'s. Skipped without nvcc.
"""

from __future__ import annotations

import subprocess

import pytest
import torch

from kvtier.native import ops, twins

from native_host import DTYPE_CODES, HOST_IO, floats, harness_fixture, hex_words, same_bits
from test_native_compile import needs_nvcc

HARNESS = '#include "attend_slabs.cu"\n' + HOST_IO + r"""
// stdin, until its end, one case a line (floats and cache elements as the hex of their bits):
//   T H R D count S chunk tile width wide scale softcap paged page n_pages whole q[H R D] k[...] v[...]
//     pages[H n_pages] x_out[H R D] x_lse[H R]
// T the elements' type (0 float, 1 half, 2 bf16). Slab mode (paged 0): ceil(count / S) slabs of [H S D] each
// for k and for v; paged mode: one buffer of [H S D] each, count = n_pages * page, and the page table. The
// whole part only with whole 1. Prints a | m | l | out | lse (the chunks' sums empty when the first kernel
// finishes: one chunk, no whole part).
template <typename T>
static void attend(int H, int R, int D, long long count, long long S, int chunk, int tile, int width, bool wide,
                   float scale, float softcap, bool paged, int page, long long n_pages, bool whole) {
    const long long slabs = paged ? 1 : (count + S - 1) / S;
    std::vector<T> q = read_elems<T>((size_t)H * R * D);
    std::vector<std::vector<T>> ks, vs;
    for (long long i = 0; i < slabs; ++i) ks.push_back(read_elems<T>((size_t)H * S * D));
    for (long long i = 0; i < slabs; ++i) vs.push_back(read_elems<T>((size_t)H * S * D));
    std::vector<kv_i64> pages((size_t)(paged ? H * n_pages : 0));
    for (auto& x : pages) x = read_i();
    std::vector<float> x_out = whole ? read_floats((size_t)H * R * D) : std::vector<float>();
    std::vector<float> x_lse = whole ? read_floats((size_t)H * R) : std::vector<float>();
    std::vector<kv_u64> k_addr, v_addr;
    for (auto& s : ks) k_addr.push_back((kv_u64)s.data());
    for (auto& s : vs) v_addr.push_back((kv_u64)s.data());
    kv_attend_src k_src = {k_addr.data(), nullptr, S, S * D, D, nullptr, 0, 0};
    kv_attend_src v_src = {v_addr.data(), nullptr, S, S * D, D, nullptr, 0, 0};
    if (paged) {
        k_src = {nullptr, (const char*)ks[0].data(), S, S * D, D, pages.data(), n_pages, page};
        v_src = {nullptr, (const char*)vs[0].data(), S, S * D, D, pages.data(), n_pages, page};
    }
    const long long chunks = (count + chunk - 1) / chunk;
    const int row_words = D * (int)sizeof(T) / 4;
    std::vector<float> smem((size_t)R * D + (size_t)R * chunk + 2 * R + (size_t)tile * (row_words + 1) +
                            (size_t)R * D);
    std::vector<float> a((size_t)H * chunks * R * D), m((size_t)H * chunks * R), l((size_t)H * chunks * R);
    std::vector<float> out((size_t)H * R * D), lse((size_t)H * R);
    const bool single = chunks == 1 && !whole;
    for (int h = 0; h < H; ++h) {
        for (long long c = 0; c < chunks; ++c) {   // block (c, h): its threads' share of each step as lanes
            kv_attend_smem s = kv_attend_layout(reinterpret_cast<unsigned char*>(smem.data()), R, D, chunk, tile,
                                                row_words);
            const kv_i64 c0 = c * chunk;
            const int n = (int)(count - c0 < chunk ? count - c0 : chunk);
            for (int x = 0; x < width; ++x) kv_attend_stage_q<T>(&q[(size_t)h * R * D], D, R, D, s.q, x, width);
            for (int at = 0; at < n; at += tile) {
                const int mm = n - at < tile ? n - at : tile;
                for (int x = 0; x < width; ++x) {
                    if (wide) kv_attend_stage_wide<T>(k_src, h, c0 + at, mm, row_words, s.keys, x, width);
                    else kv_attend_stage_keys<T>(k_src, h, c0 + at, mm, row_words, s.keys, x, width);
                }
                for (int x = 0; x < width; ++x)
                    kv_attend_logits<T>(s.keys, row_words, mm, tile, at, R, D, chunk, scale, softcap, s, x,
                                        width);
            }
            for (int x = 0; x < width; ++x) kv_attend_max(n, R, chunk, s, x, width);
            for (int x = 0; x < width; ++x) kv_attend_exp(n, R, chunk, s, x, width);
            for (int x = 0; x < width; ++x) kv_attend_sum(n, R, chunk, s, x, width);
            const size_t part = ((size_t)h * chunks + c) * R;
            float* a_out = single ? &out[(size_t)h * R * D] : &a[part * D];
            float* m_out = single ? &lse[(size_t)h * R] : &m[part];
            float* l_out = single ? nullptr : &l[part];
            if (!wide) {
                for (int x = 0; x < width; ++x)
                    kv_attend_values<T>(v_src, h, c0, n, R, D, chunk, s, single, a_out, m_out, l_out, x, width);
                continue;
            }
            for (int at = 0; at < n; at += tile) {   // the values a tile at a time through the keys' buffer
                const int mm = n - at < tile ? n - at : tile;
                for (int x = 0; x < width; ++x)
                    kv_attend_stage_wide<T>(v_src, h, c0 + at, mm, row_words, s.keys, x, width);
                for (int x = 0; x < width; ++x)
                    kv_attend_values_tile<T>(s.keys, row_words, mm, at, R, D, chunk, s, x, width);
            }
            for (int x = 0; x < width; ++x) kv_attend_values_out(R, D, s, single, a_out, m_out, l_out, x, width);
        }
    }
    if (!single) {
        std::vector<float> shared((size_t)chunks + 3);
        const int threads = 64;
        for (int h = 0; h < H; ++h) {
            for (int r = 0; r < R; ++r) {   // block (r, h)
                const size_t first = (size_t)h * chunks * R + r;
                const float* xl = whole ? &x_lse[(size_t)h * R + r] : nullptr;
                const float* xo = whole ? &x_out[((size_t)h * R + r) * D] : nullptr;
                for (int x = 0; x < threads; ++x) kv_combine_max(&m[first], R, chunks, xl, shared.data(), x);
                for (int x = 0; x < threads; ++x)
                    kv_combine_weights(&m[first], R, chunks, xl, shared.data(), x, threads);
                for (int x = 0; x < threads; ++x)
                    kv_combine_total(&l[first], R, chunks, whole, shared.data(), &lse[(size_t)h * R + r], x);
                for (int x = 0; x < threads; ++x)
                    kv_combine_out(&a[first * D], (kv_i64)R * D, chunks, D, xo, shared.data(),
                                   &out[((size_t)h * R + r) * D], x, threads);
            }
        }
        print_bits(a);
        printf("| ");
        print_bits(m);
        printf("| ");
        print_bits(l);
    } else {
        printf("| | ");
    }
    printf("| ");
    print_bits(out);
    printf("| ");
    print_bits(lse);
    printf("\n");
}
int main() {
    try {
        int T;
        while (scanf("%d", &T) == 1) {
            const int H = (int)read_i(), R = (int)read_i(), D = (int)read_i();
            const long long count = read_i(), S = read_i();
            const int chunk = (int)read_i(), tile = (int)read_i(), width = (int)read_i();
            const bool wide = read_i() != 0;
            const float scale = kv_bits_float(read_u()), softcap = kv_bits_float(read_u());
            const bool paged = read_i() != 0;
            const int page = (int)read_i();
            const long long n_pages = read_i();
            const bool whole = read_i() != 0;
            if (T == 0) attend<float>(H, R, D, count, S, chunk, tile, width, wide, scale, softcap, paged, page,
                                      n_pages, whole);
            if (T == 1) attend<kv_half>(H, R, D, count, S, chunk, tile, width, wide, scale, softcap, paged, page,
                                        n_pages, whole);
            if (T == 2) attend<kv_bf16>(H, R, D, count, S, chunk, tile, width, wide, scale, softcap, paged, page,
                                        n_pages, whole);
        }
    } catch (int) {
        return 2;
    }
    return 0;
}
"""
harness = harness_fixture(HARNESS, "attend")


def _case(g: torch.Generator, dtype: torch.dtype, H: int, R: int, D: int, count: int, S: int, spread: float):
    slabs = -(-count // S)
    q = (torch.randn(H, R, D, generator=g) * spread).to(dtype)
    ks = [(torch.randn(1, H, S, D, generator=g) * spread).to(dtype) for _ in range(slabs)]
    vs = [torch.randn(1, H, S, D, generator=g).to(dtype) for _ in range(slabs)]
    return q, ks, vs


@needs_nvcc
def test_the_pool_attention_kernels_code_gives_the_twins_bits(harness):
    """The device pool (slabs) and the recall buffer (a page table), with and without a part given whole, with
    and without a soft-cap of the logits."""
    g = torch.Generator().manual_seed(5)
    cases, lines, widened = [], [], 0
    for i in range(60):
        dtype = list(DTYPE_CODES)[i % 3]
        H, R, D = 1 + i % 3, [1, 4, 7, 16][i % 4], [8, 64, 12, 128, 30][i % 5]
        paged, whole = i % 4 == 1, i % 5 in (2, 3)
        chunk = [32, 64, 256, 7, 1, 256][i % 6]          # some pools of one chunk, some of hundreds
        width = [128, 64, 256][i % 3]
        tiles = [t for t in (128, 64, 32, 16, 8) if width % t == 0]
        tile = tiles[i % len(tiles)]
        spread = [1.0, 4.0, 0.05][i % 3]                  # flat and sharp softmaxes, e^x underflowing to 0
        scale = D ** -0.5
        cap = [None, 1.0, 50.0, None, 0.3][i % 5]        # Gemma 2's 50, and caps that most logits reach
        q = (torch.randn(H, R, D, generator=g) * spread).to(dtype)
        if paged:
            page, slots = [1, 4, 16][i % 3], 3 + i % 7
            n_pages = 1 + int(torch.randint(0, slots, (1,), generator=g))
            S, count = slots * page, n_pages * page
            pages = torch.stack([torch.randperm(slots, generator=g)[:n_pages] for _ in range(H)])
            ks = [(torch.randn(1, H, S, D, generator=g) * spread).to(dtype)]
            vs = [torch.randn(1, H, S, D, generator=g).to(dtype)]
        else:
            page, n_pages, pages = 0, 0, None
            S = [16, 64, 100][i % 3]
            count = 1 + int(torch.randint(0, 3 * S, (1,), generator=g))
            _, ks, vs = _case(g, dtype, H, R, D, count, S, spread)
        part = (torch.randn(H, R, D, generator=g), torch.randn(H, R, generator=g) * 3) if whole else None
        # wide (16-byte loads, values staged) wherever rows are whole 16-byte words, on every other case
        wide = int(D * dtype.itemsize % 16 == 0 and i % 2 == 0)
        widened += wide
        cases.append((q, ks, vs, count, scale, chunk, pages, page, part, cap))
        lines.append(" ".join([f"{DTYPE_CODES[dtype]} {H} {R} {D} {count} {S} {chunk} {tile} {width} {wide}",
                               hex_words(torch.tensor([scale, cap or 0.0]).float()),
                               f"{int(paged)} {page} {n_pages} {int(whole)}", hex_words(q),
                               " ".join(hex_words(k) for k in ks), " ".join(hex_words(v) for v in vs),
                               " ".join(map(str, pages.flatten().tolist())) if paged else "",
                               hex_words(part[0]) + " " + hex_words(part[1]) if whole else ""]))
    done = subprocess.run([str(harness)], input="\n".join(lines) + "\n", capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    out = done.stdout.strip().split("\n")
    assert len(out) == len(lines)
    finished = 0
    for (q, ks, vs, count, scale, chunk, pages, page, part, cap), line in zip(cases, out):
        a_w, m_w, l_w, o_w, lse_w = (words.split() for words in line.split("|"))
        if pages is None:
            keys, values = twins.pool_entries(ks, count), twins.pool_entries(vs, count)
            want_out, want_lse = twins.attend_slabs(q, ks, vs, count, scale, chunk, part, cap=cap)
        else:
            keys, values = twins.paged_entries(ks[0][0], pages, page), twins.paged_entries(vs[0][0], pages, page)
            want_out, want_lse = twins.attend_pages(q, ks[0][0], vs[0][0], pages, page, scale, chunk, part, cap)
        a, m, l_ = twins.attend_chunks(q, keys, values, scale, chunk, cap)
        if m.shape[1] > 1 or part is not None:
            assert same_bits(floats(a_w), a) and same_bits(floats(m_w), m) and same_bits(floats(l_w), l_)
        else:
            finished += 1
            assert not a_w and not m_w
        assert same_bits(floats(o_w), want_out), (q.dtype, q.shape, count, chunk, pages is not None)
        assert same_bits(floats(lse_w), want_lse), (q.dtype, q.shape, count, chunk, pages is not None)
    assert 0 < finished < len(cases) and 0 < widened < len(cases)


@pytest.mark.parametrize("cap", [None, 50.0, 1.5])
@pytest.mark.parametrize("dtype", list(DTYPE_CODES))
def test_the_twin_is_attention_over_the_pool_to_float_rounding(dtype, cap):
    g = torch.Generator().manual_seed(6)
    H, R, D, S = 2, 4, 64, 96
    q, ks, vs = _case(g, dtype, H, R, D, 3 * S - 5, S, 1.0)
    count = 3 * S - 5
    keys, values = twins.pool_entries(ks, count).float(), twins.pool_entries(vs, count).float()
    logits = q.float() @ keys.transpose(1, 2) * D ** -0.5
    if cap is not None:   # as transformers soft-caps Gemma 2's scores
        logits = torch.tanh(logits / cap) * cap
    want_lse = torch.logsumexp(logits, dim=-1)
    want = torch.softmax(logits, dim=-1) @ values
    for chunk in (1, 32, 256):
        out, lse = ops.attend_slabs(q, ks, vs, count, D ** -0.5, chunk=chunk, softcap=cap)
        torch.testing.assert_close(out, want, rtol=0, atol=2e-6)
        torch.testing.assert_close(lse, want_lse, rtol=0, atol=2e-6)


def test_chunks_are_sized_to_fill_the_device():
    assert ops.attend_chunk(100_000, 8, 528) == 256       # a long pool: the longest chunks
    assert ops.attend_chunk(800, 8, 528) == 32            # a short one: as many blocks as can be
    assert ops.attend_chunk(10_000, 8, 528) == 128        # 79 chunks of 128 (632 blocks); 256 would give 320
    assert all(ops.attend_chunk(n, h) in (32, 64, 128, 256) for n in (1, 5, 10**6) for h in (1, 8))


def test_bad_arguments_are_refused_with_what_is_allowed():
    q = torch.randn(2, 4, 8)
    ks, vs = [torch.randn(1, 2, 16, 8)], [torch.randn(1, 2, 16, 8)]
    with pytest.raises(ValueError, match="count=17; allowed: 1 to 16"):
        ops.attend_slabs(q, ks, vs, 17, 1.0)
    with pytest.raises(ValueError, match="count=0"):
        ops.attend_slabs(q, ks, vs, 0, 1.0)
    with pytest.raises(ValueError, match="chunk=300; allowed: 1 to 256"):
        ops.attend_slabs(q, ks, vs, 4, 1.0, chunk=300)
    with pytest.raises(ValueError, match=r"allowed: \[1, 2, 16, 8\]"):
        ops.attend_slabs(q, ks, [torch.randn(1, 3, 16, 8)], 4, 1.0)
    with pytest.raises(ValueError, match="same number"):
        ops.attend_slabs(q, ks, [], 4, 1.0)
    with pytest.raises(ValueError, match=r"allowed: \[heads, rows, dim\]"):
        ops.attend_slabs(q[None], ks, vs, 4, 1.0)


def test_attend_pages_refuses_bad_tables_buffers_and_parts():
    q = torch.randn(2, 4, 8)
    kb, vb = torch.randn(2, 12, 8), torch.randn(2, 12, 8)
    pages = torch.tensor([[0, 2], [1, 0]])
    with pytest.raises(ValueError, match=r"pages \[2\] torch.int64 on cpu; allowed: \[2, n >= 1\]"):
        ops.attend_pages(q, kb, vb, pages[0], 4, 1.0)
    with pytest.raises(ValueError, match="torch.int32"):
        ops.attend_pages(q, kb, vb, pages.int(), 4, 1.0)
    with pytest.raises(ValueError, match="page_size=5; allowed"):
        ops.attend_pages(q, kb, vb, pages, 5, 1.0)
    with pytest.raises(ValueError, match=r"allowed: \[2, 4, 8\] \(channels contiguous\)"):
        ops.attend_pages(q, kb, vb, pages, 4, 1.0, whole=(torch.zeros(2, 4, 7), torch.zeros(2, 4)))
    with pytest.raises(ValueError, match="chunk=0"):
        ops.attend_pages(q, kb, vb, pages, 4, 1.0, chunk=0)
    out, lse = ops.attend_pages(q, kb, vb, pages, 4, 1.0)
    keys = twins.paged_entries(kb, pages, 4)
    torch.testing.assert_close(lse, torch.logsumexp(q @ keys.transpose(1, 2), dim=-1), rtol=0, atol=2e-6)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan"), "50", True, 1e39, 1e-50])
def test_a_soft_cap_that_is_not_a_positive_number_is_refused(bad):
    g = torch.Generator().manual_seed(8)
    q, ks, vs = _case(g, torch.float32, 2, 4, 16, 40, 64, 1.0)
    with pytest.raises(ValueError, match=r"attend_slabs: softcap=.*allowed: None or a number > 0 and finite in "
                                         r"float32"):
        ops.attend_slabs(q, ks, vs, 40, 0.25, softcap=bad)
    import numpy as np

    out = ops.attend_slabs(q, ks, vs, 40, 0.25, softcap=np.float32(50.0))   # any real number works
    assert torch.equal(out[0], ops.attend_slabs(q, ks, vs, 40, 0.25, softcap=50.0)[0])


@needs_nvcc
def test_a_chunk_of_minus_infinite_logits_weighs_nothing(harness):
    """Keys of -inf give a chunk whose logits are all -inf: its e^(s - m) had been e^(-inf - -inf), NaN, which
    made the whole row NaN (or not, by the chunk size). The kernel's code and the twin give attention over the
    other entries, bit for bit alike, with and without a part given whole."""
    g = torch.Generator().manual_seed(7)
    H, R, D, S, count, chunk = 1, 2, 8, 16, 12, 4
    q = torch.rand(H, R, D, generator=g) + 0.1   # positive channels: q . (-inf, ...) = -inf, never NaN
    k = torch.randn(1, H, S, D, generator=g)
    k[0, :, :chunk] = float("-inf")
    v = torch.randn(1, H, S, D, generator=g)
    scores = (q.double() @ k[0, :, :count].double().transpose(-1, -2)) * D ** -0.5
    ref = torch.softmax(scores, dim=-1) @ v[0, :, :count].double()
    for whole in (False, True):
        part = (torch.zeros(H, R, D), torch.full((H, R), float("-inf"))) if whole else None
        out, lse = twins.attend_slabs(q, [k], [v], count, D ** -0.5, chunk, part)
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)
        line = " ".join([f"0 {H} {R} {D} {count} {S} {chunk} 16 64 0", hex_words(torch.tensor([D ** -0.5, 0.0])),
                         f"0 0 0 {int(whole)}", hex_words(q), hex_words(k), hex_words(v),
                         hex_words(part[0]) + " " + hex_words(part[1]) if whole else ""])
        done = subprocess.run([str(harness)], input=line + "\n", capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        o_w, lse_w = done.stdout.strip().split("|")[3:]
        assert same_bits(floats(o_w.split()), out) and same_bits(floats(lse_w.split()), lse)
