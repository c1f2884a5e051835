// The recall buffer's plan, made on the device in one launch: which of the pages a step wants are not in
// the buffer yet, and which slots they go to. One block per KV head. It replaces some twenty tensor ops
// (bitmaps over every page id, two stable sorts, gathers and scatters), each a launch of its own.
//
// The rule, the twin's (`plan_recall` in twins.py): pages already held keep their slots; the missing pages,
// in the order they are wanted, take the free slots (those holding no wanted page, or none), in slot order.
// `fetch` lists the missing pages first, then the others in their order; `slots` the free slots first,
// then the others, in slot order; `count` says how many entries of both are real.
//
// Exactness: integers only; the same rule gives the same ids. Marking compares every wanted page with every
// slot (w * R per head, R a few hundred at most in practice); the caller runs the twin past a limit.
#include "kvtier_native.cuh"

// Step 1, shared by `width` threads of which this is `lane`: missing[j] = want[j] is in no slot;
// free_slot[i] = slot i holds no wanted page; held_after = held.
__host__ __device__ inline void kv_plan_marks(const kv_i64* __restrict__ want, kv_i64 w,
                                              const kv_i64* __restrict__ held, kv_i64 R,
                                              unsigned char* __restrict__ missing,
                                              unsigned char* __restrict__ free_slot,
                                              kv_i64* __restrict__ held_after, kv_i64 lane, kv_i64 width) {
    for (kv_i64 j = lane; j < w; j += width) {
        unsigned char m = 1;
        for (kv_i64 i = 0; i < R; ++i) {
            if (held[i] == want[j]) {
                m = 0;
                break;
            }
        }
        missing[j] = m;
    }
    for (kv_i64 i = lane; i < R; i += width) {
        unsigned char f = 1;
        if (held[i] >= 0) {
            for (kv_i64 j = 0; j < w; ++j) {
                if (want[j] == held[i]) {
                    f = 0;
                    break;
                }
            }
        }
        free_slot[i] = f;
        held_after[i] = held[i];
    }
}

// Step 2, by one thread once step 1 is done: the missing pages take the free slots in order.
__host__ __device__ inline void kv_plan_assign(const kv_i64* __restrict__ want, kv_i64 w, kv_i64 R,
                                               const unsigned char* __restrict__ missing,
                                               const unsigned char* __restrict__ free_slot,
                                               kv_i64* __restrict__ fetch, kv_i64* __restrict__ slots,
                                               kv_i64* __restrict__ count, kv_i64* __restrict__ held_after) {
    kv_i64 k = 0;
    for (kv_i64 j = 0; j < w; ++j) {
        if (missing[j]) {
            fetch[k++] = want[j];
        }
    }
    const kv_i64 n = k;
    for (kv_i64 j = 0; j < w; ++j) {
        if (!missing[j]) {
            fetch[k++] = want[j];
        }
    }
    kv_i64 s = 0;
    for (kv_i64 i = 0; i < R && s < w; ++i) {
        if (free_slot[i]) {
            slots[s++] = i;
        }
    }
    for (kv_i64 i = 0; i < R && s < w; ++i) {
        if (!free_slot[i]) {
            slots[s++] = i;
        }
    }
    for (kv_i64 j = 0; j < n; ++j) {
        held_after[slots[j]] = fetch[j];
    }
    *count = n;
}

// Block h plans head h: want [heads, w], held and held_after [heads, R], fetch and slots [heads, w],
// count [heads]. Dynamic shared memory: w + R bytes of marks.
extern "C" __global__ void kvtier_plan_recall(const kv_i64* __restrict__ want, const kv_i64* __restrict__ held,
                                              kv_i64 w, kv_i64 R, kv_i64* __restrict__ fetch,
                                              kv_i64* __restrict__ slots, kv_i64* __restrict__ count,
                                              kv_i64* __restrict__ held_after) {
    extern __shared__ unsigned char marks[];
    const kv_i64 h = blockIdx.x;
    kv_plan_marks(want + h * w, w, held + h * R, R, marks, marks + w, held_after + h * R, threadIdx.x, blockDim.x);
    __syncthreads();
    if (threadIdx.x == 0) {
        kv_plan_assign(want + h * w, w, R, marks, marks + w, fetch + h * w, slots + h * w, count + h,
                       held_after + h * R);
    }
}
