// Entries of a device pool, scattered over its slabs, one warp per entry: packed into contiguous pages (a
// demotion's staging, which then goes down to the host in one large copy), or moved within the pool (the
// entries that fill the holes a demotion leaves).
//
// The pool keeps slabs of [1, heads, slab_tokens, dim] (keys, values) or [heads, slab_tokens] (positions,
// scores): entry t of head h lives in slab t / slab_tokens, at row h * slab_tokens + t % slab_tokens, of
// row_bytes bytes. One launch covers every slab, where torch needs a gather (and a scatter) per slab.
//
// Exactness: byte copies; the torch twins (a gather, and a scatter, per slab) give the same bytes. The
// per-entry code is __host__ __device__, so the unit tests run it on the host against the twins.
#include "kvtier_native.cuh"

// The address of entry t of head h, for a pool of slabs of [.., heads, slab_tokens, ..] rows of row_bytes.
__host__ __device__ __forceinline__ char* kv_entry(const kv_u64* __restrict__ slabs, kv_i64 slab_tokens, kv_i64 h,
                                                  kv_i64 t, kv_i64 row_bytes) {
    // the slab's row of entry t for head 0, then head h's block of slab_tokens rows further on
    return kv_row(slabs, slab_tokens, t, row_bytes) + h * slab_tokens * row_bytes;
}

// Lane `lane` of `width` copying entry e (head e / m) of a pack: out[e] = entry idx[e] of its head.
__host__ __device__ __forceinline__ void kv_pack_entry(const kv_u64* __restrict__ slabs, kv_i64 slab_tokens,
                                                       const kv_i64* __restrict__ idx, kv_i64 m, char* __restrict__ out,
                                                       kv_i64 row_bytes, kv_i64 e, kv_i64 lane, kv_i64 width) {
    kv_copy(out + e * row_bytes, kv_entry(slabs, slab_tokens, e / m, idx[e], row_bytes), row_bytes, lane, width);
}

// Lane `lane` of `width` copying entry e (head e / m) of a move: entry src[e] of its head onto entry dst[e].
// No entry is written that another lane reads: every dst[e] of a head is either no src of that head at all
// or src[e] itself (then nothing is copied), as `DevicePool.remove` makes them, so the lanes need no order.
__host__ __device__ __forceinline__ void kv_move_entry(const kv_u64* __restrict__ slabs, kv_i64 slab_tokens,
                                                       const kv_i64* __restrict__ src, const kv_i64* __restrict__ dst,
                                                       kv_i64 m, kv_i64 row_bytes, kv_i64 e, kv_i64 lane,
                                                       kv_i64 width) {
    if (src[e] == dst[e]) {
        return;
    }
    const kv_i64 h = e / m;
    kv_copy(kv_entry(slabs, slab_tokens, h, dst[e], row_bytes), kv_entry(slabs, slab_tokens, h, src[e], row_bytes),
            row_bytes, lane, width);
}

// out[h, j] = entry idx[h, j] of head h, for h < heads and j < m; `idx` is [heads, m], `out` [heads, m, dim].
extern "C" __global__ void kvtier_pack_entries(const kv_u64* __restrict__ slabs, kv_i64 slab_tokens,
                                               kv_i64 heads, const kv_i64* __restrict__ idx, kv_i64 m,
                                               char* __restrict__ out, kv_i64 row_bytes) {
    const kv_i64 warps = ((kv_i64)gridDim.x * blockDim.x) >> 5;
    for (kv_i64 e = ((kv_i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; e < heads * m; e += warps) {
        kv_pack_entry(slabs, slab_tokens, idx, m, out, row_bytes, e, threadIdx.x & 31, 32);
    }
}

// Entry src[h, j] of head h copied onto entry dst[h, j] of head h, for h < heads and j < m, within one slab
// storage (`kv_move_entry`).
extern "C" __global__ void kvtier_move_entries(const kv_u64* __restrict__ slabs, kv_i64 slab_tokens, kv_i64 heads,
                                               const kv_i64* __restrict__ src, const kv_i64* __restrict__ dst,
                                               kv_i64 m, kv_i64 row_bytes) {
    const kv_i64 warps = ((kv_i64)gridDim.x * blockDim.x) >> 5;
    for (kv_i64 e = ((kv_i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; e < heads * m; e += warps) {
        kv_move_entry(slabs, slab_tokens, src, dst, m, row_bytes, e, threadIdx.x & 31, 32);
    }
}
