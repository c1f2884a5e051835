// Recall without a host round-trip: the pages a step wants and the buffer slots they go to are decided on
// the device, so the kernel reads the indices there and a per-head count says how many of each head's
// entries are real (the rest of the fixed-size plan is padding and is skipped). Pages are read from the
// host slabs through their device mapping, straight into the recall buffer.
//
// Exactness: a byte copy; the torch twin (masked gather and scatter) gives the same bytes. Rows outside the
// storage are skipped (the plan never makes one; a skipped row leaves its slot as it was).
//
// A second storage of the same layout (`slabs2`, into `out2`: a layer's values beside its keys) may be given:
// the same rows are copied from it in the same launch.
#include "kvtier_native.cuh"

// For block b = h * r + j with j < count[h]: out row dst_rows[b] = storage row src_rows[b]; blocks
// heads * r + b do the same from slabs2 into out2, when given.
extern "C" __global__ void kvtier_recall_pages(const kv_u64* __restrict__ slabs, kv_i64 rows_per_slab,
                                               kv_i64 total_rows, const kv_i64* __restrict__ src_rows,
                                               const kv_i64* __restrict__ dst_rows,
                                               const kv_i64* __restrict__ count, kv_i64 heads, kv_i64 r,
                                               char* __restrict__ out, kv_i64 out_rows, kv_i64 row_bytes,
                                               const kv_u64* __restrict__ slabs2, char* __restrict__ out2) {
    const kv_i64 plan = heads * r;
    for (kv_i64 bb = blockIdx.x; bb < (slabs2 ? 2 * plan : plan); bb += gridDim.x) {
        const bool second = bb >= plan;
        const kv_i64 b = second ? bb - plan : bb;
        const kv_i64 h = b / r, j = b - h * r;
        if (j >= count[h]) {
            continue;
        }
        const kv_i64 src = src_rows[b], dst = dst_rows[b];
        if (src < 0 || src >= total_rows || dst < 0 || dst >= out_rows) {
            continue;
        }
        const char* row = kv_row(second ? slabs2 : slabs, rows_per_slab, src, row_bytes);
        kv_copy((second ? out2 : out) + dst * row_bytes, row, row_bytes, threadIdx.x, blockDim.x);
    }
}
