// Helpers shared by kvtier's kernels. No system header is included, so NVRTC compiles every source as it
// is; the loader inlines this file where a source includes it (the on-disk kernel cache then keys on the
// whole text).
#ifndef KVTIER_NATIVE_CUH
#define KVTIER_NATIVE_CUH

typedef long long kv_i64;
typedef unsigned long long kv_u64;

// 16 bytes moved by one load and one store (LDG.128/STG.128) when the addresses allow it.
struct alignas(16) kv_vec16 {
    unsigned int x, y, z, w;
};

// Copy `bytes` bytes from `src` to `dst` with `width` threads, this one being `lane`. Whole 16-byte words
// when both addresses and the length are multiples of 16 (slabs, pages and rows always are in kvtier),
// single bytes otherwise, so any layout is copied exactly.
__device__ __forceinline__ void kv_copy(char* __restrict__ dst, const char* __restrict__ src, kv_i64 bytes,
                                        kv_i64 lane, kv_i64 width) {
    if ((((kv_u64)dst | (kv_u64)src | (kv_u64)bytes) & 15ull) == 0ull) {
        const kv_vec16* s = reinterpret_cast<const kv_vec16*>(src);
        kv_vec16* d = reinterpret_cast<kv_vec16*>(dst);
        const kv_i64 words = bytes >> 4;
        for (kv_i64 i = lane; i < words; i += width) {
            d[i] = s[i];
        }
    } else {
        for (kv_i64 i = lane; i < bytes; i += width) {
            dst[i] = src[i];
        }
    }
}

// The address of row `row` of a storage kept in slabs of `rows_per_slab` rows of `row_bytes` bytes each,
// `slabs` holding each slab's (device-visible) address.
__device__ __forceinline__ char* kv_row(const kv_u64* __restrict__ slabs, kv_i64 rows_per_slab, kv_i64 row,
                                        kv_i64 row_bytes) {
    return reinterpret_cast<char*>(slabs[row / rows_per_slab]) + (row % rows_per_slab) * row_bytes;
}

#endif  // KVTIER_NATIVE_CUH
