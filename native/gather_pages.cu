// Recall gather: pages (rows of a slab storage) into a contiguous device buffer, one block per page.
//
// The source slabs may be device memory or pinned host memory mapped into the device's address space
// (unified addressing: a pinned tensor's address is valid in kernels), so pages move from the host pool
// straight into the recall buffer with no staging copy and no DMA call per page. A page is 16 KiB or more
// of contiguous bytes, read with 16-byte loads: the access pattern that reached 90% of the PCIe copy peak.
//
// Exactness: a byte copy; the torch twin (index_select per slab) gives the same bytes.
#include "kvtier_native.cuh"

// out[i] = row rows[i] of the slab storage, for i < n; every row of `out` is written.
extern "C" __global__ void kvtier_gather_pages(const kv_u64* __restrict__ slabs, kv_i64 rows_per_slab,
                                               const kv_i64* __restrict__ rows, char* __restrict__ out,
                                               kv_i64 n, kv_i64 row_bytes) {
    for (kv_i64 i = blockIdx.x; i < n; i += gridDim.x) {
        const char* src = kv_row(slabs, rows_per_slab, rows[i], row_bytes);
        kv_copy(out + i * row_bytes, src, row_bytes, threadIdx.x, blockDim.x);
    }
}
