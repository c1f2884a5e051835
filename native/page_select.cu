// Page selection: the key-bound upper bound of every demoted page, and the code-score logits of the
// short-listed ones.
//
// Exactness: float sums are only bit-reproducible in a fixed order, so each kernel fixes one and its torch
// twin (kvtier/native/twins.py) follows it step by step. Products and sums round to nearest in float32 with
// __fmul_rn/__fadd_rn, which the compiler never contracts into fused multiply-adds; the twins use separate
// torch multiplies and adds, which round the same way on any device. The orders are given below.
#include "kvtier_native.cuh"

// Upper bound of page p for KV head h: max over query rows r of sum_d (q[h,r,d] >= 0 ? q*hi : q*lo)
// (bounds.py's q+ . hi + q- . lo, one product per channel). A warp per (page, head):
//   lane l sums d = l, l + 32, l + 64, ... in that order, starting from +0;
//   lanes combine as a tree: for off = 16, 8, 4, 2, 1, lane l adds lane l + off (l < off);
//   the rows' maximum propagates NaN, as torch.amax does.
// `bounds` holds rows page * heads + head of [hi (dim) | lo (dim)]; or, where `slabs` is given, the rows lie
// in slabs of `pages_per_slab` pages each (the recall index's storage), `slabs` holding their addresses, so
// one launch covers every slab. out[h * out_stride + col0 + p].
template <typename T>
__device__ __forceinline__ void kv_upper_bounds(const float* __restrict__ q, const T* __restrict__ bounds,
                                                const kv_u64* __restrict__ slabs, kv_i64 pages_per_slab,
                                                kv_i64 pages, int heads, int rows, int dim,
                                                float* __restrict__ out, kv_i64 out_stride, kv_i64 col0) {
    const int lane = threadIdx.x & 31;
    const kv_i64 warps = ((kv_i64)gridDim.x * blockDim.x) >> 5;
    const kv_i64 total = pages * heads;
    // the loop bound is the same for every lane of a warp, so the shuffles below see all 32 lanes
    for (kv_i64 row = ((kv_i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; row < total; row += warps) {
        const kv_i64 page = row / heads;
        const int h = (int)(row % heads);
        const T* hi = slabs ? reinterpret_cast<const T*>(slabs[page / pages_per_slab]) +
                                  ((page % pages_per_slab) * heads + h) * 2 * dim
                            : bounds + row * 2 * dim;
        const T* lo = hi + dim;
        const float* qh = q + (kv_i64)h * rows * dim;
        float best = __int_as_float(0xff800000);   // -inf
        for (int r = 0; r < rows; ++r) {
            const float* qr = qh + (kv_i64)r * dim;
            float acc = 0.0f;
            for (int d = lane; d < dim; d += 32) {
                const float x = qr[d];
                const float b = x >= 0.0f ? kv_float(hi[d]) : kv_float(lo[d]);
                acc = __fadd_rn(acc, __fmul_rn(x, b));
            }
            for (int off = 16; off > 0; off >>= 1) {
                acc = __fadd_rn(acc, __shfl_down_sync(0xffffffffu, acc, off));
            }
            if (acc != acc || acc > best) {
                best = acc;
            }
        }
        if (lane == 0) {
            out[h * out_stride + col0 + page] = best;
        }
    }
}

#define KV_UPPER_BOUNDS(NAME, T)                                                                        \
    extern "C" __global__ void NAME(const float* __restrict__ q, const T* __restrict__ bounds,           \
                                    const kv_u64* __restrict__ slabs, kv_i64 pages_per_slab,             \
                                    kv_i64 pages, int heads, int rows, int dim, float* __restrict__ out, \
                                    kv_i64 out_stride, kv_i64 col0) {                                    \
        kv_upper_bounds<T>(q, bounds, slabs, pages_per_slab, pages, heads, rows, dim, out, out_stride, col0); \
    }
KV_UPPER_BOUNDS(kvtier_page_upper_bounds_f32, float)
KV_UPPER_BOUNDS(kvtier_page_upper_bounds_f16, kv_half)
KV_UPPER_BOUNDS(kvtier_page_upper_bounds_bf16, kv_bf16)

// Code-score logits of candidate pages, straight from their packed 2-bit codes (never unpacked to floats
// in memory). A key is decoded as lo + code * step, so
//   logits[h, c, r, p] = scaling * sum_d ((q[h,r,d] * step[h,c,d]) * code[h,c,p,d])
//   base[h, c, r]      = scaling * sum_d (q[h,r,d] * lo[h,c,d])
// each sum taken over d = 0, 1, ..., dim - 1 in order from +0, one thread per (r, p) or r, a block per
// (candidate, head). Channel d's code is bits 2 (d % 4) .. 2 (d % 4) + 1 of byte d / 4 of the key's codes.
extern "C" __global__ void kvtier_code_logits(const float* __restrict__ q, const float* __restrict__ lo,
                                              const float* __restrict__ step,
                                              const unsigned char* __restrict__ codes,
                                              float* __restrict__ logits, float* __restrict__ base, kv_i64 cands,
                                              int rows, int page, int dim, float scaling) {
    const kv_i64 c = blockIdx.x;
    const int h = blockIdx.y;
    const kv_i64 hc = (kv_i64)h * cands + c;
    const int width = (dim + 3) / 4;
    const float* qh = q + (kv_i64)h * rows * dim;
    const float* st = step + hc * dim;
    const float* lw = lo + hc * dim;
    const unsigned char* cd = codes + hc * page * width;
    const int keys = rows * page;
    for (int t = threadIdx.x; t < keys + rows; t += blockDim.x) {
        float acc = 0.0f;
        if (t < keys) {
            const int r = t / page, p = t % page;
            const float* qr = qh + (kv_i64)r * dim;
            const unsigned char* key = cd + (kv_i64)p * width;
            for (int d = 0; d < dim; ++d) {
                const float code = (float)((key[d >> 2] >> (2 * (d & 3))) & 3);
                acc = __fadd_rn(acc, __fmul_rn(__fmul_rn(qr[d], st[d]), code));
            }
            logits[(hc * rows + r) * page + p] = __fmul_rn(acc, scaling);
        } else {
            const int r = t - keys;
            const float* qr = qh + (kv_i64)r * dim;
            for (int d = 0; d < dim; ++d) {
                acc = __fadd_rn(acc, __fmul_rn(qr[d], lw[d]));
            }
            base[hc * rows + r] = __fmul_rn(acc, scaling);
        }
    }
}
