// Demotion: the chosen entries of a device pool, scattered over its slabs, packed into contiguous pages
// (the staging that then goes down to the host in one large copy), one warp per entry.
//
// The pool keeps slabs of [1, heads, slab_tokens, dim]; entry t of head h lives in slab t / slab_tokens,
// at row h * slab_tokens + t % slab_tokens. One launch covers every slab, where torch needs a gather per
// slab.
//
// Exactness: a byte copy; the torch twin (a gather per slab) gives the same bytes.
#include "kvtier_native.cuh"

// out[h, j] = entry idx[h, j] of head h, for h < heads and j < m; `idx` is [heads, m], `out` [heads, m, dim].
extern "C" __global__ void kvtier_pack_entries(const kv_u64* __restrict__ slabs, kv_i64 slab_tokens,
                                               kv_i64 heads, const kv_i64* __restrict__ idx, kv_i64 m,
                                               char* __restrict__ out, kv_i64 row_bytes) {
    const kv_i64 lane = threadIdx.x & 31;
    const kv_i64 warps = ((kv_i64)gridDim.x * blockDim.x) >> 5;
    const kv_i64 total = heads * m;
    for (kv_i64 e = ((kv_i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; e < total; e += warps) {
        const kv_i64 h = e / m;
        // the slab's row of entry idx[e] for head 0, then head h's block of slab_tokens rows further on
        const char* src = kv_row(slabs, slab_tokens, idx[e], row_bytes) + h * slab_tokens * row_bytes;
        kv_copy(out + e * row_bytes, src, row_bytes, lane, 32);
    }
}
