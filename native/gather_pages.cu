// Recall gather: pages (rows of a slab storage) into a contiguous device buffer, one block per page.
//
// The source slabs may be device memory or pinned host memory mapped into the device's address space
// (unified addressing: a pinned tensor's address is valid in kernels), so pages move from the host pool
// straight into the recall buffer with no staging copy and no DMA call per page. A page is kilobytes of
// contiguous bytes (4 KiB of keys at 16 entries of 128 bf16 channels), read with 16-byte loads.
//
// Exactness: a byte copy; the torch twin (index_select per slab) gives the same bytes.
#include "kvtier_native.cuh"

// out[i] = row rows[i] of the slab storage, for i < n; every row of `out` is written. A second storage of the
// same layout (`slabs2`, into `out2`: a layer's values beside its keys) may be given: the same rows are copied
// from it in the same launch, blocks n .. 2n - 1.
extern "C" __global__ void kvtier_gather_pages(const kv_u64* __restrict__ slabs, kv_i64 rows_per_slab,
                                               const kv_i64* __restrict__ rows, char* __restrict__ out,
                                               kv_i64 n, kv_i64 row_bytes, const kv_u64* __restrict__ slabs2,
                                               char* __restrict__ out2) {
    for (kv_i64 b = blockIdx.x; b < (slabs2 ? 2 * n : n); b += gridDim.x) {
        const bool second = b >= n;
        const kv_i64 i = second ? b - n : b;
        const char* src = kv_row(second ? slabs2 : slabs, rows_per_slab, rows[i], row_bytes);
        kv_copy((second ? out2 : out) + i * row_bytes, src, row_bytes, threadIdx.x, blockDim.x);
    }
}
