// A recall step's plan and bookkeeping, made on the device in one launch: which of the pages a step wants
// are not in the recall buffer yet, which slots they go to, the rows the copy reads and writes, where each
// wanted page sits afterwards, the buffer's prefetch flags and the recall counters. One block per KV head.
// It replaces some forty tensor ops, each a launch of its own.
//
// The rule, the twin's (`plan_recall` in twins.py): pages already held keep their slots; the missing pages,
// in the order they are wanted, take the free slots (those holding no wanted page, or none), in slot order.
// `fetch` lists the missing pages first, then the others in their order; `slots` the free slots first,
// then the others, in slot order; `count` says how many entries of both are real. Then:
//   src_rows[j] = host_slots[fetch[j]] (or fetch[j] without host slots), dst_rows[j] = h * R + slots[j];
//   where[j] = the slot holding want[j] once the missing pages are in;
//   a step's choice clears the prefetch flag of each slot it fetched into, counts the chosen pages that a
//   prefetch brought (flag set) and clears their flags; a prefetch sets the flags of the slots it filled;
//   counts[0] += fetched, counts[1] += found in the buffer, counts[3] += found thanks to a prefetch (a
//   step's choice); counts[2] += fetched (a prefetch).
// A prefetch never fetches a page without a host slot (host_slots < 0: on disk, which only the host reads): such
// a page counts as not missing, takes no slot and is left for the step that chooses it.
//
// `held_after` may be `held` itself (the plan made in place, so the buffer keeps one page table): step 1
// reads `held` and writes each slot's own value back, and only after the barrier are slots given new pages
// (neither pointer is __restrict__, so no load of `held` goes through the read-only cache).
//
// Exactness: integers only; the same rule gives the same ids and counts. Marking compares every wanted page
// with every slot (w * R per head, R a few hundred at most in practice); the caller runs the twin past a
// limit. The counters are shared by the heads' blocks, so they are added atomically.
#include "kvtier_native.cuh"

// Step 1, shared by `width` threads of which this is `lane`: missing[j] = want[j] is in no slot (and, for a
// prefetch with host slots, has one); free_slot[i] = slot i holds no wanted page; held_after = held (a no-op
// in place).
__host__ __device__ inline void kv_plan_marks(const kv_i64* __restrict__ want, kv_i64 w, const kv_i64* held,
                                              kv_i64 R, const kv_i64* __restrict__ host_slots, kv_i64 pages,
                                              int prefetch, unsigned char* __restrict__ missing,
                                              unsigned char* __restrict__ free_slot, kv_i64* held_after,
                                              kv_i64 lane, kv_i64 width) {
    for (kv_i64 j = lane; j < w; j += width) {
        const kv_i64 page = want[j];   // an id outside the table has no host slot either
        unsigned char m = !(prefetch && host_slots && (page < 0 || page >= pages || host_slots[page] < 0));
        for (kv_i64 i = 0; i < R && m; ++i) {
            if (held[i] == want[j]) {
                m = 0;
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

// Step 3, shared like step 1, once step 2 is done: the copy's rows, and each wanted page's slot.
// (`fetch`, `slots` and `held_after` were written earlier in the launch: no __restrict__ on them, so no
// load of them goes through the read-only cache.)
__host__ __device__ inline void kv_plan_rows(const kv_i64* __restrict__ want, kv_i64 w, kv_i64 R, kv_i64 h,
                                             const kv_i64* __restrict__ host_slots, kv_i64 pages,
                                             const kv_i64* fetch, const kv_i64* slots, const kv_i64* held_after,
                                             kv_i64* __restrict__ where, kv_i64* __restrict__ src_rows,
                                             kv_i64* __restrict__ dst_rows, kv_i64 lane, kv_i64 width) {
    for (kv_i64 j = lane; j < w; j += width) {
        const kv_i64 page = fetch[j];
        // a page id outside the table (never made by the engine) reads nothing: row -1, which the copy skips
        src_rows[j] = !host_slots ? page : (page >= 0 && page < pages ? host_slots[page] : -1);
        dst_rows[j] = h * R + slots[j];
        kv_i64 at = 0;
        for (kv_i64 i = 0; i < R; ++i) {
            if (held_after[i] == want[j]) {
                at = i;
                break;
            }
        }
        where[j] = at;
    }
}

__host__ __device__ inline void kv_add(kv_i64* counter, kv_i64 value) {
#ifdef __CUDA_ARCH__
    atomicAdd(reinterpret_cast<unsigned long long*>(counter), static_cast<unsigned long long>(value));
#else
    *counter += value;
#endif
}

// Step 4, by one thread once step 3 is done: the prefetch flags (if the buffer keeps them) and the counters.
__host__ __device__ inline void kv_plan_flags(kv_i64 w, const kv_i64* slots, const kv_i64* count, const kv_i64* where,
                                              unsigned char* __restrict__ ahead, kv_i64* __restrict__ counts,
                                              int prefetch) {
    const kv_i64 n = *count;
    kv_i64 used = 0;
    if (ahead) {
        for (kv_i64 j = 0; j < n; ++j) {
            ahead[slots[j]] = prefetch ? 1 : 0;
        }
        if (!prefetch) {
            for (kv_i64 j = 0; j < w; ++j) {
                used += ahead[where[j]];
                ahead[where[j]] = 0;
            }
        }
    }
    if (counts) {
        if (prefetch) {
            kv_add(counts + 2, n);
        } else {
            kv_add(counts + 0, n);
            kv_add(counts + 1, w - n);
            kv_add(counts + 3, used);
        }
    }
}

// Block h plans head h. want [heads, w], rows want_stride apart (a short list's first w columns are read
// where they are); held and held_after [heads, R] (the same memory for a plan in place); host_slots
// [heads, pages] or null;
// fetch, slots, where, src_rows, dst_rows [heads, w]; count [heads]; ahead [heads, R] bytes or null;
// counts [4] or null. Dynamic shared memory: w + R bytes of marks.
extern "C" __global__ void kvtier_plan_recall(const kv_i64* __restrict__ want, kv_i64 want_stride,
                                              const kv_i64* held, const kv_i64* __restrict__ host_slots,
                                              kv_i64 pages, kv_i64 w, kv_i64 R, kv_i64* __restrict__ fetch, kv_i64* __restrict__ slots,
                                              kv_i64* __restrict__ count, kv_i64* held_after,
                                              kv_i64* __restrict__ where, kv_i64* __restrict__ src_rows,
                                              kv_i64* __restrict__ dst_rows, unsigned char* __restrict__ ahead,
                                              kv_i64* __restrict__ counts, int prefetch) {
    extern __shared__ unsigned char marks[];
    const kv_i64 h = blockIdx.x;
    kv_i64* after = held_after + h * R;
    kv_plan_marks(want + h * want_stride, w, held + h * R, R, host_slots ? host_slots + h * pages : nullptr, pages,
                  prefetch, marks, marks + w, after, threadIdx.x, blockDim.x);
    __syncthreads();
    if (threadIdx.x == 0) {
        kv_plan_assign(want + h * want_stride, w, R, marks, marks + w, fetch + h * w, slots + h * w, count + h, after);
    }
    __syncthreads();
    kv_plan_rows(want + h * want_stride, w, R, h, host_slots ? host_slots + h * pages : nullptr, pages, fetch + h * w,
                 slots + h * w, after, where + h * w, src_rows + h * w, dst_rows + h * w, threadIdx.x, blockDim.x);
    __syncthreads();
    if (threadIdx.x == 0) {
        kv_plan_flags(w, slots + h * w, count + h, where + h * w, ahead ? ahead + h * R : nullptr, counts,
                      prefetch);
    }
}
