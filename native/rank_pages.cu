// The page choice after the bounds' short list, in one launch: each short-listed page's estimated share of
// attention from its 2-bit key codes, the largest over a KV head's query rows, and the pages ranked by it.
// It replaces the code logits, the gathers of the candidates' bounds and codes, two log-sum-exps, a
// log-add-exp, a maximum, two sorts and a gather (recall/selector.py). One block per KV head.
//
// For KV head h, candidate c (page cand[h, c]) and query row r, with the page's bounds hi, lo (row
// page * heads + h of the bounds storage: [hi | lo], the cache's dtype) and codes (the same row of the codes
// storage: `page` keys of ceil(dim / 4) bytes, channel d in bits 2 (d % 4) of byte d / 4):
//   step[d]        = (hi[d] - lo[d]) / 3, at least FLT_MIN (NaN kept)          recall/codes.py's step
//   logit[c, r, p] = scaling * sum_d (q[r, d] * step[d]) * code[p, d]          as kvtier_code_logits
//   base[c, r]     = scaling * sum_d q[r, d] * lo[d]
//   page_lse[c, r] = kv_logsumexp(logit[c, r, 0 .. page - 1]) + base[c, r]
//   total[r]       = kv_logsumexp(page_lse[0 .. m - 1, r]), then kv_logsumexp of (total[r], resident[r])
//                    when the keys attention reads anyway are given by their log-sum-exp
//   share[c]       = max over r = 0, 1, ... of page_lse[c, r] - total[r] (NaN wins)
// then ranked[h] = the candidates by share, largest first, NaN above all, ties in candidate order (as
// torch.sort(descending=True, stable=True)), and chosen[h] = the first `keep` of them in ascending id. A
// candidate outside the index (not 0 <= page < pages) reads no memory; its NaN bounds make its head's shares NaN.
//
// Exactness: every sum in the order given, every operation rounding on its own, e^x and log x by
// kvtier_native.cuh's kv_exp and kv_log (adds and multiplies only); the twin (twins.rank_pages) follows
// step by step. Shared memory holds page_lse, the totals, shares and ranks for every candidate, and one
// tile of candidates at a time (codes, lo, step, logits, base); ops.rank_pages sizes the tile to fit.
#include "kvtier_native.cuh"

// Where each part sits in the block's shared memory, from its size parameters (the host sizes it alike).
struct kv_rank_smem {
    unsigned char* codes;   // [tile, page, width]
    float* lo;              // [tile, dim]
    float* step;            // [tile, dim]
    float* logit;           // [tile, rows, page]
    float* base;            // [tile, rows]
    float* page_lse;        // [m, rows]
    float* total;           // [rows]
    float* share;           // [m]
    int* rank;              // [m]
};

__host__ __device__ inline kv_rank_smem kv_rank_layout(unsigned char* smem, kv_i64 m, int tile, int rows, int page,
                                                      int dim) {
    kv_rank_smem s;
    const kv_i64 code_bytes = (((kv_i64)tile * page * ((dim + 3) / 4)) + 15) & ~(kv_i64)15;
    s.codes = smem;
    s.lo = reinterpret_cast<float*>(smem + code_bytes);
    s.step = s.lo + (kv_i64)tile * dim;
    s.logit = s.step + (kv_i64)tile * dim;
    s.base = s.logit + (kv_i64)tile * rows * page;
    s.page_lse = s.base + (kv_i64)tile * rows;
    s.total = s.page_lse + m * rows;
    s.share = s.total + rows;
    s.rank = reinterpret_cast<int*>(s.share + m);
    return s;
}

// Step 1 of a tile (candidates c0 .. c0 + n - 1), shared by `width` threads of which this is `lane`: their
// lo and step as float32, their codes copied whole.
template <typename T>
__host__ __device__ inline void kv_rank_stage(const kv_i64* __restrict__ cand, kv_i64 c0, int n, int h, int heads,
                                              kv_i64 pages, int page, int dim, const kv_u64* __restrict__ bound_slabs,
                                              kv_i64 bound_rows_per_slab, const kv_u64* __restrict__ code_slabs,
                                              kv_i64 code_rows_per_slab, kv_rank_smem s, kv_i64 lane,
                                              kv_i64 width) {
    for (kv_i64 i = lane; i < (kv_i64)n * dim; i += width) {
        const kv_i64 id = cand[c0 + i / dim];
        const int d = (int)(i % dim);
        float lo = kv_bits_float(0x7fc00000u), st = lo;
        if (id >= 0 && id < pages) {
            const T* b = reinterpret_cast<const T*>(
                kv_row(bound_slabs, bound_rows_per_slab, id * heads + h, (kv_i64)2 * dim * (kv_i64)sizeof(T)));
            lo = kv_float(b[dim + d]);
            st = kv_div(kv_sub(kv_float(b[d]), lo), 3.0f);
            if (st < 0x1p-126f) {   // false for NaN, which stays
                st = 0x1p-126f;
            }
        }
        s.lo[i] = lo;
        s.step[i] = st;
    }
    // the tile's codes, every thread taking 16-byte words (or single bytes, for rows of another length) of
    // any candidate: the reads cross PCIe from pinned host memory, so all of them are in flight at once
    const kv_i64 bytes = (kv_i64)page * ((dim + 3) / 4);
    const kv_i64 unit = bytes % 16 == 0 ? 16 : 1, units = bytes / unit;
    for (kv_i64 i = lane; i < n * units; i += width) {
        const kv_i64 c = i / units, at = (i % units) * unit, id = cand[c0 + c];
        if (id < 0 || id >= pages) {
            continue;
        }
        kv_copy(reinterpret_cast<char*>(s.codes) + c * bytes + at,
                kv_row(code_slabs, code_rows_per_slab, id * heads + h, bytes) + at, unit, 0, 1);
    }
}

// Step 2 of a tile: the logits of its keys and its bases, a thread per (c, r, p) and per (c, r).
__host__ __device__ inline void kv_rank_logits(const float* __restrict__ q, int n, int rows, int page, int dim,
                                               float scaling, kv_rank_smem s, kv_i64 lane, kv_i64 width) {
    const int width_bytes = (dim + 3) / 4;
    const kv_i64 keys = (kv_i64)n * rows * page;
    for (kv_i64 t = lane; t < keys + (kv_i64)n * rows; t += width) {
        float acc = 0.0f;
        if (t < keys) {
            const kv_i64 c = t / ((kv_i64)rows * page);
            const int r = (int)((t / page) % rows), p = (int)(t % page);
            const float* qr = q + (kv_i64)r * dim;
            const float* st = s.step + c * dim;
            const unsigned char* key = s.codes + (c * page + p) * width_bytes;
            for (int d = 0; d < dim; ++d) {
                const float code = (float)((key[d >> 2] >> (2 * (d & 3))) & 3);
                acc = kv_add(acc, kv_mul(kv_mul(qr[d], st[d]), code));
            }
            s.logit[t] = kv_mul(acc, scaling);
        } else {
            const kv_i64 u = t - keys, c = u / rows;
            const float* qr = q + (u % rows) * dim;
            const float* lo = s.lo + c * dim;
            for (int d = 0; d < dim; ++d) {
                acc = kv_add(acc, kv_mul(qr[d], lo[d]));
            }
            s.base[u] = kv_mul(acc, scaling);
        }
    }
}

// Step 3 of a tile: each (c, r)'s log-sum-exp over its page's keys, plus its base.
__host__ __device__ inline void kv_rank_page_lse(kv_i64 c0, int n, int rows, int page, kv_rank_smem s, kv_i64 lane,
                                                 kv_i64 width) {
    for (kv_i64 u = lane; u < (kv_i64)n * rows; u += width) {
        s.page_lse[c0 * rows + u] = kv_add(kv_logsumexp(s.logit + u * page, page, 1), s.base[u]);
    }
}

// Step 4, once every tile is done: each row's total over the candidates (and the resident keys).
__host__ __device__ inline void kv_rank_totals(kv_i64 m, int rows, const float* __restrict__ resident,
                                               kv_rank_smem s, kv_i64 lane, kv_i64 width) {
    for (kv_i64 r = lane; r < rows; r += width) {
        float t = kv_logsumexp(s.page_lse + r, m, rows);
        if (resident) {
            const float both[2] = {t, resident[r]};
            t = kv_logsumexp(both, 2, 1);
        }
        s.total[r] = t;
    }
}

// Step 5: each candidate's share, the largest over the rows.
__host__ __device__ inline void kv_rank_shares(kv_i64 m, int rows, kv_rank_smem s, float* __restrict__ shares,
                                               kv_i64 lane, kv_i64 width) {
    for (kv_i64 c = lane; c < m; c += width) {
        float best = kv_sub(s.page_lse[c * rows], s.total[0]);
        for (int r = 1; r < rows; ++r) {
            const float x = kv_sub(s.page_lse[c * rows + r], s.total[r]);
            if (x != x || x > best) {
                best = x;
            }
        }
        s.share[c] = best;
        shares[c] = best;
    }
}

// Whether share a of candidate i ranks before share b of candidate j: larger first, NaN above all, ties
// (NaN with NaN too) in candidate order.
__host__ __device__ __forceinline__ bool kv_ranks_before(float a, kv_i64 i, float b, kv_i64 j) {
    if (a != a) {
        return b == b || i < j;
    }
    return b == b && (a > b || (a == b && i < j));
}

// Step 6: each candidate's rank, and the candidates in rank order.
__host__ __device__ inline void kv_rank_order(const kv_i64* __restrict__ cand, kv_i64 m, kv_rank_smem s,
                                              kv_i64* __restrict__ ranked, kv_i64 lane, kv_i64 width) {
    for (kv_i64 i = lane; i < m; i += width) {
        int rank = 0;
        for (kv_i64 j = 0; j < m; ++j) {
            rank += kv_ranks_before(s.share[j], j, s.share[i], i);
        }
        s.rank[i] = rank;
        ranked[rank] = cand[i];
    }
}

// Step 7: the first `keep` ranked candidates in ascending id (candidates are distinct).
__host__ __device__ inline void kv_rank_chosen(const kv_i64* __restrict__ cand, kv_i64 m, kv_i64 keep,
                                               kv_rank_smem s, kv_i64* __restrict__ chosen, kv_i64 lane,
                                               kv_i64 width) {
    for (kv_i64 i = lane; i < m; i += width) {
        if (s.rank[i] >= keep) {
            continue;
        }
        kv_i64 pos = 0;
        for (kv_i64 j = 0; j < m; ++j) {
            pos += s.rank[j] < keep && cand[j] < cand[i];
        }
        chosen[pos] = cand[i];
    }
}

template <typename T>
__device__ __forceinline__ void kv_rank_pages(const float* __restrict__ q, const kv_i64* __restrict__ cand, kv_i64 m,
                                              kv_i64 pages, const kv_u64* __restrict__ bound_slabs,
                                              kv_i64 bound_rows_per_slab, const kv_u64* __restrict__ code_slabs,
                                              kv_i64 code_rows_per_slab, const float* __restrict__ resident,
                                              kv_i64 resident_stride, int heads, int rows, int page, int dim,
                                              int tile, float scaling, kv_i64 keep, float* __restrict__ shares,
                                              kv_i64* __restrict__ ranked, kv_i64* __restrict__ chosen) {
    extern __shared__ __align__(16) unsigned char kv_rank_shared[];
    const int h = blockIdx.x;
    const kv_i64 lane = threadIdx.x, width = blockDim.x;
    const kv_rank_smem s = kv_rank_layout(kv_rank_shared, m, tile, rows, page, dim);
    const float* qh = q + (kv_i64)h * rows * dim;
    const kv_i64* ch = cand + (kv_i64)h * m;
    for (kv_i64 c0 = 0; c0 < m; c0 += tile) {
        const int n = (int)(m - c0 < tile ? m - c0 : tile);
        kv_rank_stage<T>(ch, c0, n, h, heads, pages, page, dim, bound_slabs, bound_rows_per_slab, code_slabs,
                         code_rows_per_slab, s, lane, width);
        __syncthreads();
        kv_rank_logits(qh, n, rows, page, dim, scaling, s, lane, width);
        __syncthreads();
        kv_rank_page_lse(c0, n, rows, page, s, lane, width);
        __syncthreads();   // the next tile's stage overwrites the logits
    }
    kv_rank_totals(m, rows, resident ? resident + (kv_i64)h * resident_stride : nullptr, s, lane, width);
    __syncthreads();
    kv_rank_shares(m, rows, s, shares + (kv_i64)h * m, lane, width);
    __syncthreads();
    kv_rank_order(ch, m, s, ranked + (kv_i64)h * m, lane, width);
    __syncthreads();
    kv_rank_chosen(ch, m, keep, s, chosen + (kv_i64)h * keep, lane, width);
}

#define KV_RANK_PAGES(NAME, T)                                                                                  \
    extern "C" __global__ void NAME(const float* __restrict__ q, const kv_i64* __restrict__ cand, kv_i64 m,      \
                                    kv_i64 pages, const kv_u64* __restrict__ bound_slabs,                        \
                                    kv_i64 bound_rows_per_slab, const kv_u64* __restrict__ code_slabs,           \
                                    kv_i64 code_rows_per_slab, const float* __restrict__ resident,               \
                                    kv_i64 resident_stride, int heads, int rows, int page, int dim, int tile,    \
                                    float scaling, kv_i64 keep, float* __restrict__ shares,                      \
                                    kv_i64* __restrict__ ranked, kv_i64* __restrict__ chosen) {                  \
        kv_rank_pages<T>(q, cand, m, pages, bound_slabs, bound_rows_per_slab, code_slabs, code_rows_per_slab,   \
                         resident, resident_stride, heads, rows, page, dim, tile, scaling, keep, shares, ranked,  \
                         chosen);                                                                                 \
    }
KV_RANK_PAGES(kvtier_rank_pages_f32, float)
KV_RANK_PAGES(kvtier_rank_pages_f16, kv_half)
KV_RANK_PAGES(kvtier_rank_pages_bf16, kv_bf16)
