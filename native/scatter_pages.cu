// Scatter: contiguous pages into rows of a slab storage on the device (the recall buffer's free slots, or
// a device-resident index), one block per page.
//
// Exactness: a byte copy; the torch twin (index_copy_ per slab) gives the same bytes. Destination rows
// must be distinct (the caller checks), so no two blocks write the same bytes.
#include "kvtier_native.cuh"

// Row rows[i] of the slab storage = values[i], for i < n.
extern "C" __global__ void kvtier_scatter_pages(const kv_u64* __restrict__ slabs, kv_i64 rows_per_slab,
                                                const kv_i64* __restrict__ rows,
                                                const char* __restrict__ values, kv_i64 n, kv_i64 row_bytes) {
    for (kv_i64 i = blockIdx.x; i < n; i += gridDim.x) {
        char* dst = kv_row(slabs, rows_per_slab, rows[i], row_bytes);
        kv_copy(dst, values + i * row_bytes, row_bytes, threadIdx.x, blockDim.x);
    }
}
