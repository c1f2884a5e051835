"""The pool-attention kernels' own code, compiled for the host with `nvcc`, gives the twins' bits.

`native/attend_slabs.cu` keeps its steps in ``__host__ __device__`` functions; a small host program runs them
as the two kernels order them (a block's threads as lanes in turn, the key tiles in order, every chunk and
head, then the combine) and every result must equal the twin's bit for bit: each chunk's sums, the
attention and its log-sum-exp, including a pool of one chunk, which the first kernel finishes itself. What
only a GPU shows (shared memory, barriers, the launch) is `tests/cuda`'s. Skipped without nvcc.
"""

from __future__ import annotations

import subprocess

import pytest
import torch

from kvtier.native import ops, twins

from native_host import DTYPE_CODES, floats, harness_fixture, hex_words, same_bits
from test_native_compile import needs_nvcc

HARNESS = r"""
#include "attend_slabs.cu"
#include <cstdio>
#include <vector>
// stdin, until its end, one case a line (floats and cache elements as the hex of their bits):
//   T H R D count S chunk tile width scale q[H R D] k[slabs H S D] v[slabs H S D]
// with T the elements' type (0 float, 1 half, 2 bf16) and slabs = ceil(count / S); prints
//   a | m | l | out | lse
// (the chunks' sums empty for a single chunk, whose block writes out and lse itself).
static unsigned read_u() {
    unsigned v;
    if (scanf("%x", &v) != 1) throw 1;
    return v;
}
static long long read_i() {
    long long v;
    if (scanf("%lld", &v) != 1) throw 1;
    return v;
}
template <typename T>
static std::vector<T> read_elems(size_t n) {
    std::vector<T> out(n);
    for (auto& x : out) {
        unsigned v = read_u();
        __builtin_memcpy(&x, &v, sizeof(T));
    }
    return out;
}
static void print(const std::vector<float>& v) {
    for (auto x : v) printf("%x ", kv_float_bits(x));
}
template <typename T>
static void attend(int H, int R, int D, long long count, long long S, int chunk, int tile, int width, float scale) {
    const long long slabs = (count + S - 1) / S;
    std::vector<T> q = read_elems<T>((size_t)H * R * D);
    std::vector<std::vector<T>> ks, vs;
    for (long long i = 0; i < slabs; ++i) ks.push_back(read_elems<T>((size_t)H * S * D));
    for (long long i = 0; i < slabs; ++i) vs.push_back(read_elems<T>((size_t)H * S * D));
    std::vector<kv_u64> k_addr, v_addr;
    for (auto& s : ks) k_addr.push_back((kv_u64)s.data());
    for (auto& s : vs) v_addr.push_back((kv_u64)s.data());
    const long long chunks = (count + chunk - 1) / chunk;
    const int row_words = D * (int)sizeof(T) / 4;
    std::vector<float> smem((size_t)R * D + (size_t)R * chunk + 2 * R + (size_t)tile * (row_words + 1));
    std::vector<float> a((size_t)H * chunks * R * D), m((size_t)H * chunks * R), l((size_t)H * chunks * R);
    std::vector<float> out((size_t)H * R * D), lse((size_t)H * R);
    const bool single = chunks == 1;
    for (int h = 0; h < H; ++h) {
        for (long long c = 0; c < chunks; ++c) {   // block (c, h): its threads' share of each step as lanes
            kv_attend_smem s = kv_attend_layout(reinterpret_cast<unsigned char*>(smem.data()), R, D, chunk);
            const kv_i64 c0 = c * chunk;
            const int n = (int)(count - c0 < chunk ? count - c0 : chunk);
            for (int x = 0; x < width; ++x) kv_attend_stage_q<T>(&q[(size_t)h * R * D], D, R, D, s.q, x, width);
            for (int at = 0; at < n; at += tile) {
                const int mm = n - at < tile ? n - at : tile;
                for (int x = 0; x < width; ++x)
                    kv_attend_stage_keys<T>(k_addr.data(), S, S * D, D, h, c0 + at, mm, row_words, s.keys, x, width);
                for (int x = 0; x < width; ++x)
                    kv_attend_logits<T>(s.keys, row_words, mm, tile, at, R, D, chunk, scale, s, x, width);
            }
            for (int x = 0; x < width; ++x) kv_attend_max(n, R, chunk, s, x, width);
            for (int x = 0; x < width; ++x) kv_attend_exp(n, R, chunk, s, x, width);
            for (int x = 0; x < width; ++x) kv_attend_sum(n, R, chunk, s, x, width);
            const size_t part = ((size_t)h * chunks + c) * R;
            for (int x = 0; x < width; ++x)
                kv_attend_values<T>(v_addr.data(), S, S * D, D, h, c0, n, R, D, chunk, s, single,
                                    single ? &out[(size_t)h * R * D] : &a[part * D],
                                    single ? &lse[(size_t)h * R] : &m[part], &l[part], x, width);
        }
    }
    if (!single) {
        std::vector<float> shared((size_t)chunks + 2);
        const int threads = 64;
        for (int h = 0; h < H; ++h) {
            for (int r = 0; r < R; ++r) {   // block (r, h)
                const size_t first = (size_t)h * chunks * R + r;
                for (int x = 0; x < threads; ++x) kv_combine_max(&m[first], R, chunks, shared.data(), x);
                for (int x = 0; x < threads; ++x) kv_combine_weights(&m[first], R, chunks, shared.data(), x, threads);
                for (int x = 0; x < threads; ++x)
                    kv_combine_total(&l[first], R, chunks, shared.data(), &lse[(size_t)h * R + r], x);
                for (int x = 0; x < threads; ++x)
                    kv_combine_out(&a[first * D], (kv_i64)R * D, chunks, D, shared.data(),
                                   &out[((size_t)h * R + r) * D], x, threads);
            }
        }
        print(a);
        printf("| ");
        print(m);
        printf("| ");
        print(l);
    } else {
        printf("| | ");
    }
    printf("| ");
    print(out);
    printf("| ");
    print(lse);
    printf("\n");
}
int main() {
    try {
        int T;
        while (scanf("%d", &T) == 1) {
            const int H = (int)read_i(), R = (int)read_i(), D = (int)read_i();
            const long long count = read_i(), S = read_i();
            const int chunk = (int)read_i(), tile = (int)read_i(), width = (int)read_i();
            const float scale = kv_bits_float(read_u());
            if (T == 0) attend<float>(H, R, D, count, S, chunk, tile, width, scale);
            if (T == 1) attend<kv_half>(H, R, D, count, S, chunk, tile, width, scale);
            if (T == 2) attend<kv_bf16>(H, R, D, count, S, chunk, tile, width, scale);
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
    g = torch.Generator().manual_seed(5)
    cases, lines = [], []
    for i in range(48):
        dtype = list(DTYPE_CODES)[i % 3]
        H, R, D = 1 + i % 3, [1, 4, 7, 16][i % 4], [8, 64, 12, 128, 30][i % 5]
        S = [16, 64, 100][i % 3]
        count = 1 + int(torch.randint(0, 3 * S, (1,), generator=g))
        chunk = [32, 64, 256, 7, 1, 256][i % 6]          # some pools of one chunk, some of hundreds
        width = [128, 64, 256][i % 3]
        tiles = [t for t in (128, 64, 32, 16, 8) if width % t == 0]
        tile = tiles[i % len(tiles)]
        spread = [1.0, 4.0, 0.05][i % 3]                  # flat and sharp softmaxes, e^x underflowing to 0
        scale = D ** -0.5
        q, ks, vs = _case(g, dtype, H, R, D, count, S, spread)
        cases.append((q, ks, vs, count, scale, chunk))
        lines.append(" ".join([f"{DTYPE_CODES[dtype]} {H} {R} {D} {count} {S} {chunk} {tile} {width}",
                               hex_words(torch.tensor([scale]).float()), hex_words(q),
                               " ".join(hex_words(k) for k in ks), " ".join(hex_words(v) for v in vs)]))
    done = subprocess.run([str(harness)], input="\n".join(lines) + "\n", capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    out = done.stdout.strip().split("\n")
    assert len(out) == len(lines)
    singles = 0
    for (q, ks, vs, count, scale, chunk), line in zip(cases, out):
        a_w, m_w, l_w, o_w, lse_w = (part.split() for part in line.split("|"))
        keys, values = twins.pool_entries(ks, count), twins.pool_entries(vs, count)
        a, m, l_ = twins.attend_chunks(q, keys, values, scale, chunk)
        if m.shape[1] > 1:
            assert same_bits(floats(a_w), a) and same_bits(floats(m_w), m) and same_bits(floats(l_w), l_)
        else:
            singles += 1
            assert not a_w and not m_w
        want_out, want_lse = twins.attend_slabs(q, ks, vs, count, scale, chunk)
        assert same_bits(floats(o_w), want_out), (q.dtype, q.shape, count, chunk)
        assert same_bits(floats(lse_w), want_lse), (q.dtype, q.shape, count, chunk)
    assert 0 < singles < len(cases)


@pytest.mark.parametrize("dtype", list(DTYPE_CODES))
def test_the_twin_is_attention_over_the_pool_to_float_rounding(dtype):
    g = torch.Generator().manual_seed(6)
    H, R, D, S = 2, 4, 64, 96
    q, ks, vs = _case(g, dtype, H, R, D, 3 * S - 5, S, 1.0)
    count = 3 * S - 5
    keys, values = twins.pool_entries(ks, count).float(), twins.pool_entries(vs, count).float()
    logits = q.float() @ keys.transpose(1, 2) * D ** -0.5
    want_lse = torch.logsumexp(logits, dim=-1)
    want = torch.softmax(logits, dim=-1) @ values
    for chunk in (1, 32, 256):
        out, lse = ops.attend_slabs(q, ks, vs, count, D ** -0.5, chunk=chunk)
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
