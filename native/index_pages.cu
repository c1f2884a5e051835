// The recall index of a demotion's pages in one launch: each page's elementwise key bounds written into the
// index's bounds storage (through its slabs' address table) and its 2-bit key codes into a staging buffer
// (which then goes down to the host with the pages), in place of the thirty-odd tensor ops of page_bounds,
// round_outward and encode in kvtier/recall for every demotion of every layer.
//
// For KV head h, page j of the m indexed, channel d and entry p < page_size (every entry valid):
//   lo[d], hi[d] = the minimum and maximum of k[h, j, p, d] over p (a NaN wins; a zero is stored as +0)
//                  kept as the keys' own elements: each is one, so the outward rounding changes none
//   step[d]      = (hi[d] - lo[d]) / 3, at least FLT_MIN (NaN kept)                  recall/codes.py's step
//   code[p, d]   = (k[h, j, p, d] - lo[d]) / step[d] rounded half to even, clamped to 0 .. 3, 0 for NaN
// bounds row first + j * heads + h = [hi, lo]; codes row j * heads + h = page_size rows of ceil(dim / 4)
// bytes, channel 4b + i in bits 2i .. 2i + 1 of byte b (channels past dim: code 0). Each rounding is
// float32's own (the _rn intrinsics, no fused multiply-add); the twin (twins.index_pages) gives the same bits,
// a NaN bound's payload aside (the kernel keeps a NaN key's own; any NaN stands for any other).
// One thread per code byte: four channels of one page, read for the bounds, then again for the codes.
#include "kvtier_native.cuh"

template <typename T>
__host__ __device__ __forceinline__ T kv_zero_as_positive(T e, float x) {
    return x == 0.0f ? T() : e;
}

// Rounded half to even, for |x| <= 4: adding and taking away 1.5 2^23 leaves the nearest integer.
__host__ __device__ __forceinline__ float kv_rint_small(float x) {
    return kv_sub(kv_add(x, 0x1.8p+23f), 0x1.8p+23f);
}

// The 2-bit code of key x within a channel's lo and step.
__host__ __device__ __forceinline__ unsigned int kv_code(float x, float lo, float step) {
    float c = kv_div(kv_sub(x, lo), step);
    if (c != c) {
        return 0u;
    }
    c = kv_rint_small(c < -1.0f ? -1.0f : (c > 4.0f ? 4.0f : c));
    return c <= 0.0f ? 0u : (c >= 3.0f ? 3u : (unsigned int)c);
}

// Code byte b of cell (page j, head h) = cell j * heads + h: its four channels' bounds into the bounds row,
// then their codes into every entry's byte b.
template <typename T>
__host__ __device__ inline void kv_index_byte(const T* __restrict__ keys, kv_i64 k_head, kv_i64 k_page,
                                              kv_i64 k_entry, kv_i64 heads, int page_size, int dim,
                                              const kv_u64* __restrict__ bounds, kv_i64 rows_per_slab, kv_i64 first,
                                              unsigned char* __restrict__ codes, kv_i64 cell, int b) {
    const kv_i64 j = cell / heads, h = cell - j * heads;
    const int width = (dim + 3) / 4;
    const T* page = keys + h * k_head + j * k_page;
    T* row = reinterpret_cast<T*>(kv_row(bounds, rows_per_slab, first + cell, (kv_i64)(2 * dim) * sizeof(T)));
    float lo[4], step[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int d = 4 * b + i;
        lo[i] = 0.0f;
        step[i] = 1.0f;
        if (d >= dim) {
            continue;
        }
        T lo_e = page[d], hi_e = page[d];
        float lo_f = kv_float(lo_e), hi_f = lo_f;
        for (int p = 1; p < page_size; ++p) {
            const T e = page[p * k_entry + d];
            const float x = kv_float(e);
            if (x != x || x < lo_f) {
                lo_e = e;
                lo_f = x;
            }
            if (x != x || x > hi_f) {
                hi_e = e;
                hi_f = x;
            }
        }
        row[d] = kv_zero_as_positive(hi_e, hi_f);
        row[dim + d] = kv_zero_as_positive(lo_e, lo_f);
        float st = kv_div(kv_sub(hi_f, lo_f), 3.0f);
        if (st < 0x1p-126f) {   // false for NaN, which stays
            st = 0x1p-126f;
        }
        lo[i] = lo_f;
        step[i] = st;
    }
    for (int p = 0; p < page_size; ++p) {
        unsigned int byte = 0u;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int d = 4 * b + i;
            if (d < dim) {
                byte |= kv_code(kv_float(page[p * k_entry + d]), lo[i], step[i]) << (2 * i);
            }
        }
        codes[(cell * page_size + p) * width + b] = (unsigned char)byte;
    }
}

// Every code byte of `cells` = m * heads pages: keys [heads, m, page_size, dim] by strides (channels
// contiguous), bounds rows from `first` of a slab storage of 2 * dim elements a row, codes [cells, page_size,
// ceil(dim / 4)] contiguous.
#define KV_INDEX_PAGES(NAME, T)                                                                                    \
    extern "C" __global__ void NAME(const T* __restrict__ keys, kv_i64 k_head, kv_i64 k_page, kv_i64 k_entry,     \
                                    kv_i64 heads, kv_i64 cells, int page_size, int dim,                           \
                                    const kv_u64* __restrict__ bounds, kv_i64 rows_per_slab, kv_i64 first,        \
                                    unsigned char* __restrict__ codes) {                                          \
        const int width = (dim + 3) / 4;                                                                           \
        const kv_i64 total = cells * width, stride = (kv_i64)gridDim.x * blockDim.x;                              \
        for (kv_i64 g = (kv_i64)blockIdx.x * blockDim.x + threadIdx.x; g < total; g += stride) {                  \
            kv_index_byte<T>(keys, k_head, k_page, k_entry, heads, page_size, dim, bounds, rows_per_slab, first,  \
                             codes, g / width, (int)(g % width));                                                  \
        }                                                                                                          \
    }
KV_INDEX_PAGES(kvtier_index_pages_f32, float)
KV_INDEX_PAGES(kvtier_index_pages_f16, kv_half)
KV_INDEX_PAGES(kvtier_index_pages_bf16, kv_bf16)
