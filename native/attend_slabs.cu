// Decode attention over the device pool's slabs: every KV head's query rows against every entry the pool
// holds, in place of one attention call per slab and the stack and log-sum-exp of their log-sum-exps
// (attend_parts over the pool in kvtier/engine/layer.py). A long pool is cut into chunks of `chunk` entries,
// one block per (chunk, KV head), so that it fills the GPU whatever the number of heads (split-KV decoding);
// a second kernel combines the chunks.
//
// For KV head h, query row r (a query head's row, packed as attend_parts packs them) and entry t of chunk c:
//   s[r, t]    = (sum_d q[r, d] k[t, d] over d = 0 .. dim - 1 in order from +0) * scale
//   m[c, r]    = max_t s[r, t] in order (NaN wins);  p[r, t] = kv_exp(s[r, t] - m[c, r])
//   l[c, r]    = sum_t p[r, t] in order from +0
//   a[c, r, d] = sum_t p[r, t] v[t, d] in order from +0
// then, over the chunks c = 0 .. C - 1 of the head:
//   M = max_c m[c, r] in order (NaN wins);  w[c] = kv_exp(m[c, r] - M)
//   L = sum_c l[c, r] w[c],  A[d] = sum_c a[c, r, d] w[c], each in order from +0
//   out[r, d] = A[d] / L,  lse[r] = M + kv_log(L)
// every product and sum rounding on its own; the twin (twins.attend_slabs) follows step by step. With a
// single chunk the first kernel writes out and lse itself: the combine would give the same bits (w = e^0 = 1,
// and +0 + x = x for the sums, which are never -0).
//
// The keys of a tile of entries are staged in shared memory as 32-bit words (rows padded by a word, so that
// threads reading one word of different rows meet no bank conflict), read from the slabs in coalesced words;
// the values are read from the slabs, a channel per thread. Entries are addressed through a table of slab
// addresses: entry t is row t % slab_tokens of slab t / slab_tokens, at head stride `slab_head` and token
// stride `slab_token` (elements).
#include "kvtier_native.cuh"

#define KV_ATTEND_ROWS 16   // query rows per KV head a block holds in registers

// The shared memory of a chunk's block, carved from one buffer (sizes in floats or words).
struct kv_attend_smem {
    float* q;             // [rows, dim]: the head's query rows as float
    float* s;             // [rows, chunk]: logits, then their e^(s - m)
    float* m;             // [rows]: the chunk's largest logit per row
    float* l;             // [rows]: the chunk's sum of e^(s - m) per row
    unsigned int* keys;   // [tile, row_words + 1]: a tile of keys as words
};

__host__ __device__ inline kv_attend_smem kv_attend_layout(unsigned char* smem, int rows, int dim, int chunk) {
    kv_attend_smem s;
    s.q = reinterpret_cast<float*>(smem);
    s.s = s.q + (kv_i64)rows * dim;
    s.m = s.s + (kv_i64)rows * chunk;
    s.l = s.m + rows;
    s.keys = reinterpret_cast<unsigned int*>(s.l + rows);
    return s;
}

// The address of entry t's first element in a slab storage (`slabs` the slabs' addresses).
template <typename T>
__host__ __device__ __forceinline__ const T* kv_entry(const kv_u64* __restrict__ slabs, kv_i64 slab_tokens,
                                                     kv_i64 slab_head, kv_i64 slab_token, int h, kv_i64 t) {
    const kv_i64 slab = t / slab_tokens;
    return reinterpret_cast<const T*>(slabs[slab]) + h * slab_head + (t - slab * slab_tokens) * slab_token;
}

// Element d of a row of T kept as 32-bit words, as float (exact).
__host__ __device__ __forceinline__ float kv_word_elem(const unsigned int* row, int d, float) {
    return kv_bits_float(row[d]);
}
__host__ __device__ __forceinline__ float kv_word_elem(const unsigned int* row, int d, kv_bf16) {
    return kv_bits_float((row[d >> 1] >> ((d & 1) * 16)) << 16);
}
__host__ __device__ __forceinline__ float kv_word_elem(const unsigned int* row, int d, kv_half) {
    kv_half x;
    x.bits = (unsigned short)(row[d >> 1] >> ((d & 1) * 16));
    return kv_float(x);
}

// Step 1: the head's query rows into shared memory as float.
template <typename T>
__host__ __device__ inline void kv_attend_stage_q(const T* __restrict__ q, kv_i64 q_r, int rows, int dim,
                                                  float* __restrict__ qs, int lane, int width) {
    for (int i = lane; i < rows * dim; i += width) {
        const int r = i / dim, d = i - r * dim;
        qs[i] = kv_float(q[r * q_r + d]);
    }
}

// Step 2: entries t0 .. t0 + n - 1's keys into shared memory, word by word (`row_words` words a key).
template <typename T>
__host__ __device__ inline void kv_attend_stage_keys(const kv_u64* __restrict__ k_slabs, kv_i64 slab_tokens,
                                                     kv_i64 slab_head, kv_i64 slab_token, int h, kv_i64 t0, int n,
                                                     int row_words, unsigned int* __restrict__ keys, int lane,
                                                     int width) {
    for (int i = lane; i < n * row_words; i += width) {
        const int j = i / row_words, w = i - j * row_words;
        const T* row = kv_entry<T>(k_slabs, slab_tokens, slab_head, slab_token, h, t0 + j);
        keys[j * (row_words + 1) + w] = reinterpret_cast<const unsigned int*>(row)[w];
    }
}

// Step 3: the logits of the staged tile's n entries (the chunk's entries `at` .. at + n - 1). Thread i takes
// entry i % n and the rows g, g + groups, ... with g = i / n, groups = width / tile (`tile` divides `width`).
template <typename T>
__host__ __device__ inline void kv_attend_logits(const unsigned int* __restrict__ keys, int row_words, int n,
                                                 int tile, int at, int rows, int dim, int chunk, float scale,
                                                 kv_attend_smem s, int lane, int width) {
    const int groups = width / tile;
    for (int i = lane; i < n * groups; i += width) {
        const int j = i % n, g = i / n;
        const unsigned int* key = keys + j * (row_words + 1);
        float acc[KV_ATTEND_ROWS];
#pragma unroll
        for (int x = 0; x < KV_ATTEND_ROWS; ++x) {
            acc[x] = 0.0f;
        }
        for (int d = 0; d < dim; ++d) {
            const float k = kv_word_elem(key, d, T());
#pragma unroll
            for (int x = 0; x < KV_ATTEND_ROWS; ++x) {
                const int r = g + x * groups;
                if (r < rows) {
                    acc[x] = kv_add(acc[x], kv_mul(s.q[r * dim + d], k));
                }
            }
        }
#pragma unroll
        for (int x = 0; x < KV_ATTEND_ROWS; ++x) {
            const int r = g + x * groups;
            if (r < rows) {
                s.s[r * chunk + at + j] = kv_mul(acc[x], scale);
            }
        }
    }
}

// Step 4, a thread per row: the chunk's largest logit (NaN wins, as torch's amax).
__host__ __device__ inline void kv_attend_max(int n, int rows, int chunk, kv_attend_smem s, int lane, int width) {
    for (int r = lane; r < rows; r += width) {
        const float* row = s.s + r * chunk;
        float m = row[0];
        for (int t = 1; t < n; ++t) {
            if (row[t] != row[t] || row[t] > m) {
                m = row[t];
            }
        }
        s.m[r] = m;
    }
}

// Step 5: p = e^(s - m) in place.
__host__ __device__ inline void kv_attend_exp(int n, int rows, int chunk, kv_attend_smem s, int lane, int width) {
    for (int i = lane; i < rows * n; i += width) {
        const int r = i / n, t = i - r * n;
        s.s[r * chunk + t] = kv_exp(kv_sub(s.s[r * chunk + t], s.m[r]));
    }
}

// Step 6, a thread per row: the chunk's sum of p.
__host__ __device__ inline void kv_attend_sum(int n, int rows, int chunk, kv_attend_smem s, int lane, int width) {
    for (int r = lane; r < rows; r += width) {
        float l = 0.0f;
        for (int t = 0; t < n; ++t) {
            l = kv_add(l, s.s[r * chunk + t]);
        }
        s.l[r] = l;
    }
}

// Step 7: the p-weighted values of the chunk's n entries from c0. Thread i takes channel i % dim for the rows
// g, g + groups, ... with g = i / dim, groups = max(1, width / dim). With `single` (the head's only chunk) it
// writes out = a / l and lse = m + log l; else its sums a, m and l for the combine.
template <typename T>
__host__ __device__ inline void kv_attend_values(const kv_u64* __restrict__ v_slabs, kv_i64 slab_tokens,
                                                 kv_i64 slab_head, kv_i64 slab_token, int h, kv_i64 c0, int n,
                                                 int rows, int dim, int chunk, kv_attend_smem s, bool single,
                                                 float* __restrict__ a_out, float* __restrict__ m_out,
                                                 float* __restrict__ l_out, int lane, int width) {
    const int groups = width >= dim ? width / dim : 1;
    for (int i = lane; i < dim * groups; i += width) {
        const int d = i % dim, g = i / dim;
        float acc[KV_ATTEND_ROWS];
#pragma unroll
        for (int x = 0; x < KV_ATTEND_ROWS; ++x) {
            acc[x] = 0.0f;
        }
        kv_i64 t = 0;
        while (t < n) {   // the chunk slab by slab, so that an entry's address needs no division
            const kv_i64 e = c0 + t, slab = e / slab_tokens, first = e - slab * slab_tokens;
            const kv_i64 run = slab_tokens - first < n - t ? slab_tokens - first : n - t;
            const T* v = reinterpret_cast<const T*>(v_slabs[slab]) + h * slab_head + first * slab_token + d;
            for (kv_i64 u = 0; u < run; ++u, ++t) {
                const float x = kv_float(v[u * slab_token]);
#pragma unroll
                for (int y = 0; y < KV_ATTEND_ROWS; ++y) {
                    const int r = g + y * groups;
                    if (r < rows) {
                        acc[y] = kv_add(acc[y], kv_mul(s.s[r * chunk + t], x));
                    }
                }
            }
        }
#pragma unroll
        for (int y = 0; y < KV_ATTEND_ROWS; ++y) {
            const int r = g + y * groups;
            if (r < rows) {
                a_out[r * dim + d] = single ? kv_div(acc[y], s.l[r]) : acc[y];
            }
        }
    }
    for (int r = lane; r < rows; r += width) {
        if (single) {
            m_out[r] = kv_add(s.m[r], kv_log(s.l[r]));
        } else {
            m_out[r] = s.m[r];
            l_out[r] = s.l[r];
        }
    }
}

// The combine's steps share [chunks + 2] floats: the chunks' weights, then M and L.
// Step C1, one thread: M, the largest of the chunks' maxima (NaN wins).
__host__ __device__ inline void kv_combine_max(const float* __restrict__ m, kv_i64 m_c, kv_i64 chunks,
                                               float* __restrict__ shared, int lane) {
    if (lane == 0) {
        float big = m[0];
        for (kv_i64 c = 1; c < chunks; ++c) {
            const float x = m[c * m_c];
            if (x != x || x > big) {
                big = x;
            }
        }
        shared[chunks] = big;
    }
}

// Step C2: each chunk's weight e^(m - M).
__host__ __device__ inline void kv_combine_weights(const float* __restrict__ m, kv_i64 m_c, kv_i64 chunks,
                                                   float* __restrict__ shared, int lane, int width) {
    for (kv_i64 c = lane; c < chunks; c += width) {
        shared[c] = kv_exp(kv_sub(m[c * m_c], shared[chunks]));
    }
}

// Step C3, one thread: L and the log-sum-exp.
__host__ __device__ inline void kv_combine_total(const float* __restrict__ l, kv_i64 l_c, kv_i64 chunks,
                                                 float* __restrict__ shared, float* __restrict__ lse, int lane) {
    if (lane == 0) {
        float total = 0.0f;
        for (kv_i64 c = 0; c < chunks; ++c) {
            total = kv_add(total, kv_mul(l[c * l_c], shared[c]));
        }
        shared[chunks + 1] = total;
        *lse = kv_add(shared[chunks], kv_log(total));
    }
}

// Step C4: out[d] = A[d] / L for d = lane, lane + width, ...
__host__ __device__ inline void kv_combine_out(const float* __restrict__ a, kv_i64 a_c, kv_i64 chunks, int dim,
                                               const float* __restrict__ shared, float* __restrict__ out, int lane,
                                               int width) {
    for (int d = lane; d < dim; d += width) {
        float acc = 0.0f;
        for (kv_i64 c = 0; c < chunks; ++c) {
            acc = kv_add(acc, kv_mul(a[c * a_c + d], shared[c]));
        }
        out[d] = kv_div(acc, shared[chunks + 1]);
    }
}

// Block (c, h): chunk c of head h. Sums go to part_a [heads, chunks, rows, dim], part_m and part_l
// [heads, chunks, rows]; a head with one chunk writes out [heads, rows, dim] and lse [heads, rows] instead.
template <typename T>
__device__ __forceinline__ void kv_attend_chunks(const T* __restrict__ q, kv_i64 q_h, kv_i64 q_r,
                                                 const kv_u64* __restrict__ k_slabs,
                                                 const kv_u64* __restrict__ v_slabs, kv_i64 slab_tokens,
                                                 kv_i64 slab_head, kv_i64 slab_token, kv_i64 count, int rows,
                                                 int dim, int chunk, int tile, float scale,
                                                 float* __restrict__ part_a, float* __restrict__ part_m,
                                                 float* __restrict__ part_l, float* __restrict__ out,
                                                 float* __restrict__ lse) {
    extern __shared__ __align__(16) unsigned char kv_attend_shared[];
    const kv_i64 c = blockIdx.x, chunks = gridDim.x;
    const int h = blockIdx.y, lane = threadIdx.x, width = blockDim.x;
    const int row_words = dim * (int)sizeof(T) / 4;
    const kv_i64 c0 = c * chunk;
    const int n = (int)(count - c0 < chunk ? count - c0 : chunk);
    const kv_attend_smem s = kv_attend_layout(kv_attend_shared, rows, dim, chunk);
    kv_attend_stage_q<T>(q + h * q_h, q_r, rows, dim, s.q, lane, width);
    for (int at = 0; at < n; at += tile) {
        const int m = n - at < tile ? n - at : tile;
        kv_attend_stage_keys<T>(k_slabs, slab_tokens, slab_head, slab_token, h, c0 + at, m, row_words, s.keys,
                                lane, width);
        __syncthreads();
        kv_attend_logits<T>(s.keys, row_words, m, tile, at, rows, dim, chunk, scale, s, lane, width);
        __syncthreads();   // the next tile's keys overwrite these
    }
    kv_attend_max(n, rows, chunk, s, lane, width);
    __syncthreads();
    kv_attend_exp(n, rows, chunk, s, lane, width);
    __syncthreads();
    kv_attend_sum(n, rows, chunk, s, lane, width);
    __syncthreads();
    const bool single = chunks == 1;
    const kv_i64 part = ((kv_i64)h * chunks + c) * rows;
    kv_attend_values<T>(v_slabs, slab_tokens, slab_head, slab_token, h, c0, n, rows, dim, chunk, s, single,
                        single ? out + (kv_i64)h * rows * dim : part_a + part * dim,
                        single ? lse + (kv_i64)h * rows : part_m + part, part_l + part, lane, width);
}

#define KV_ATTEND_CHUNKS(NAME, T)                                                                                 \
    extern "C" __global__ void NAME(const T* __restrict__ q, kv_i64 q_h, kv_i64 q_r,                               \
                                    const kv_u64* __restrict__ k_slabs, const kv_u64* __restrict__ v_slabs,       \
                                    kv_i64 slab_tokens, kv_i64 slab_head, kv_i64 slab_token, kv_i64 count,        \
                                    int rows, int dim, int chunk, int tile, float scale,                          \
                                    float* __restrict__ part_a, float* __restrict__ part_m,                       \
                                    float* __restrict__ part_l, float* __restrict__ out,                          \
                                    float* __restrict__ lse) {                                                    \
        kv_attend_chunks<T>(q, q_h, q_r, k_slabs, v_slabs, slab_tokens, slab_head, slab_token, count, rows, dim,  \
                            chunk, tile, scale, part_a, part_m, part_l, out, lse);                                \
    }
KV_ATTEND_CHUNKS(kvtier_attend_chunks_f32, float)
KV_ATTEND_CHUNKS(kvtier_attend_chunks_f16, kv_half)
KV_ATTEND_CHUNKS(kvtier_attend_chunks_bf16, kv_bf16)

// Block (r, h): query row r of head h over the head's chunks, a thread per channel.
extern "C" __global__ void kvtier_attend_combine(const float* __restrict__ part_a, const float* __restrict__ part_m,
                                                 const float* __restrict__ part_l, kv_i64 chunks, int rows,
                                                 int dim, float* __restrict__ out, float* __restrict__ lse) {
    extern __shared__ __align__(16) float kv_combine_shared[];   // [chunks + 2]
    const int r = blockIdx.x, h = blockIdx.y, lane = threadIdx.x, width = blockDim.x;
    const kv_i64 first = (kv_i64)h * chunks * rows + r;   // chunk c of (h, r) at first + c * rows
    kv_combine_max(part_m + first, rows, chunks, kv_combine_shared, lane);
    __syncthreads();
    kv_combine_weights(part_m + first, rows, chunks, kv_combine_shared, lane, width);
    __syncthreads();
    kv_combine_total(part_l + first, rows, chunks, kv_combine_shared, lse + (kv_i64)h * rows + r, lane);
    __syncthreads();
    kv_combine_out(part_a + first * dim, (kv_i64)rows * dim, chunks, dim, kv_combine_shared,
                   out + ((kv_i64)h * rows + r) * dim, lane, width);
}
