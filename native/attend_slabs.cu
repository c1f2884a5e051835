// Decode attention over a set of entries kept in pieces, in two launches at any length: the device pool's
// slabs (in place of an attention call per slab and the log-sum-exp of their log-sum-exps), or the recalled
// pages where the recall buffer holds them (read through a page table, in place of gathering them, an
// attention call and the merge with the rest of the step's attention). The entries are cut into chunks of
// `chunk`, one block per (chunk, KV head), so that a long set fills the GPU whatever the number of heads
// (split-KV decoding); a second kernel combines the chunks, and with them one more part given whole (its
// output and log-sum-exp: the attention over the device pool, when the recalled pages are attended).
//
// For KV head h, query row r (a query head's row, packed as attend_parts packs them) and entry t of chunk c:
//   s[r, t]    = (sum_d q[r, d] k[t, d] over d = 0 .. dim - 1 in order from +0) * scale, then with a soft-cap
//                cap > 0 (Gemma 2's) kv_softcap(s, cap) = kv_tanh(s / cap) * cap
//   m[c, r]    = max_t s[r, t] in order (NaN wins);  p[r, t] = kv_exp(s[r, t] - m[c, r]), taking m as 0 where
//                it is -inf (a chunk of -inf logits weighs nothing, where -inf - -inf would make the row NaN)
//   l[c, r]    = sum_t p[r, t] in order from +0
//   a[c, r, d] = sum_t p[r, t] v[t, d] in order from +0
// then, over the chunks c = 0 .. C - 1 of the head:
//   M = max_c m[c, r] in order (NaN wins);  w[c] = kv_exp(m[c, r] - M)
//   L = sum_c l[c, r] w[c],  A[d] = sum_c a[c, r, d] w[c], each in order from +0
//   out[r, d] = A[d] / L,  lse[r] = M + kv_log(L)
// A part given whole, (o, lse_x), comes first, as a chunk with m = lse_x, l = 1 and a = o. Every product and
// sum rounds on its own; the twin (twins.attend_chunks, twins.attend_combine) follows step by step. With a
// single chunk and no whole part the first kernel writes out and lse itself (`finish`): the combine would
// give the same bits (w = e^0 = 1, and +0 + x = x for the sums, which are never -0).
//
// The keys of a tile of entries are staged in shared memory as 32-bit words (rows padded by a word, so that
// threads reading one word of different rows meet no bank conflict), read from the slabs in coalesced words;
// the values are read where they are, a channel per thread (see kv_entry for the addressing). With `wide`
// (rows of whole 16-byte words at 16-byte aligned addresses) the tiles are read 16 bytes a load, several loads
// in flight a thread, and the values are staged the same way, tile by tile, each thread's sums kept in
// shared memory between tiles: the same products and sums in the same order, so the same bits, with the
// reads no longer one entry's latency after another. The two ways are separate entry points
// (`kvtier_attend_chunks_<dtype>` and `kvtier_attend_chunks_wide_<dtype>`), each compiled for its own reads,
// so the narrow one does not carry the wide one's registers.
#include "kvtier_native.cuh"

#define KV_ATTEND_ROWS 16   // query rows per KV head a block holds in registers
#define KV_ATTEND_LOADS 4   // 16-byte loads a thread has in flight when staging a tile (`wide`)
#define KV_COMBINE_LOADS 8  // the combine's loads a thread issues together before taking them in order

// The shared memory of a chunk's block, carved from one buffer (sizes in floats or words).
struct kv_attend_smem {
    float* q;             // [rows, dim]: the head's query rows as float
    float* s;             // [rows, chunk]: logits, then their e^(s - m)
    float* m;             // [rows]: the chunk's largest logit per row
    float* l;             // [rows]: the chunk's sum of e^(s - m) per row
    unsigned int* keys;   // [tile, row_words + 1]: a tile of keys as words (with `wide`, then of values)
    float* acc;           // [rows, dim]: with `wide`, the value sums between tiles (after the keys)
};

__host__ __device__ inline kv_attend_smem kv_attend_layout(unsigned char* smem, int rows, int dim, int chunk,
                                                           int tile = 0, int row_words = 0) {
    kv_attend_smem s;
    s.q = reinterpret_cast<float*>(smem);
    s.s = s.q + (kv_i64)rows * dim;
    s.m = s.s + (kv_i64)rows * chunk;
    s.l = s.m + rows;
    s.keys = reinterpret_cast<unsigned int*>(s.l + rows);
    s.acc = reinterpret_cast<float*>(s.keys + (kv_i64)tile * (row_words + 1));
    return s;
}

// Where a set's entries are. Slab mode (`pages` null): entry t of head h is row t % slab_tokens of slab
// t / slab_tokens, the slabs' addresses in `slabs`. Paged mode: entry t is row
// pages[h * n_pages + t / page] * page + t % page of the one storage at `base` (the recall buffer, a page per
// slot, `pages` the slots in the order attention reads them). Head stride `slab_head`, token stride
// `slab_token`, in elements.
struct kv_attend_src {
    const kv_u64* slabs;
    const char* base;
    kv_i64 slab_tokens, slab_head, slab_token;
    const kv_i64* pages;
    kv_i64 n_pages;
    int page;
};

// The address of entry t of head h, and in `run` how many entries from t lie at consecutive token strides.
template <typename T>
__host__ __device__ __forceinline__ const T* kv_entry(const kv_attend_src& src, int h, kv_i64 t, kv_i64* run) {
    kv_i64 row = t, left = -1;
    if (src.pages) {
        const kv_i64 p = t / src.page, in = t - p * src.page;
        row = src.pages[h * src.n_pages + p] * src.page + in;
        left = src.page - in;
    }
    const kv_i64 slab = row / src.slab_tokens, at = row - slab * src.slab_tokens;
    const kv_i64 in_slab = src.slab_tokens - at;
    if (run) {
        *run = left >= 0 && left < in_slab ? left : in_slab;
    }
    const T* start = src.slabs ? reinterpret_cast<const T*>(src.slabs[slab]) : reinterpret_cast<const T*>(src.base);
    return start + h * src.slab_head + at * src.slab_token;
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
// A warp per entry (its address worked out once), its lanes reading consecutive words.
__host__ __device__ inline void kv_attend_stage_keys(const kv_attend_src& k, int h, kv_i64 t0, int n,
                                                     int row_words, unsigned int* __restrict__ keys, int lane,
                                                     int width) {
    const int lanes = width < 32 ? width : 32, warps = width / lanes, warp = lane / lanes, sub = lane % lanes;
    for (int j = warp; j < n; j += warps) {
        const unsigned int* row = reinterpret_cast<const unsigned int*>(kv_entry<T>(k, h, t0 + j, nullptr));
        for (int w = sub; w < row_words; w += lanes) {
            keys[j * (row_words + 1) + w] = row[w];
        }
    }
}

// Step 2 with `wide`: the same words, 16 bytes a load (a row is row_words / 4 of them), consecutive threads
// reading consecutive 16 bytes of a row, and KV_ATTEND_LOADS loads issued before their words are stored, so
// that their latencies overlap. Rows must be whole 16-byte words at 16-byte aligned addresses.
template <typename T>
__host__ __device__ inline void kv_attend_stage_wide(const kv_attend_src& src, int h, kv_i64 t0, int n,
                                                     int row_words, unsigned int* __restrict__ words, int lane,
                                                     int width) {
    const int per_row = row_words / 4, total = n * per_row;
    for (int base = lane; base < total; base += width * KV_ATTEND_LOADS) {
        kv_vec16 got[KV_ATTEND_LOADS];
#pragma unroll
        for (int u = 0; u < KV_ATTEND_LOADS; ++u) {
            const int i = base + u * width;
            if (i < total) {
                const int j = i / per_row;
                got[u] = reinterpret_cast<const kv_vec16*>(kv_entry<T>(src, h, t0 + j, nullptr))[i - j * per_row];
            }
        }
#pragma unroll
        for (int u = 0; u < KV_ATTEND_LOADS; ++u) {
            const int i = base + u * width;
            if (i < total) {
                const int j = i / per_row, w = 4 * (i - j * per_row);
                unsigned int* row = words + j * (row_words + 1) + w;
                row[0] = got[u].x;
                row[1] = got[u].y;
                row[2] = got[u].z;
                row[3] = got[u].w;
            }
        }
    }
}

// Step 3: the logits of the staged tile's n entries (the chunk's entries `at` .. at + n - 1). Thread i takes
// entry i % n and the rows g, g + groups, ... with g = i / n, groups = width / tile (`tile` divides `width`).
template <typename T>
__host__ __device__ inline void kv_attend_logits(const unsigned int* __restrict__ keys, int row_words, int n,
                                                 int tile, int at, int rows, int dim, int chunk, float scale,
                                                 float softcap, kv_attend_smem s, int lane, int width) {
    const int groups = width / tile;
    for (int i = lane; i < n * groups; i += width) {
        const int j = i % n, g = i / n;
        const unsigned int* key = keys + j * (row_words + 1);
        float acc[KV_ATTEND_ROWS];
#pragma unroll
        for (int x = 0; x < KV_ATTEND_ROWS; ++x) {
            acc[x] = 0.0f;
        }
        const int per_word = 4 / (int)sizeof(T);   // channels a word holds, taken in order from one read
        for (int w = 0; w < row_words; ++w) {
            const unsigned int word = key[w];
            for (int e = 0; e < per_word; ++e) {
                const int d = w * per_word + e;
                const float k = kv_word_elem(&word, e, T());
#pragma unroll
                for (int x = 0; x < KV_ATTEND_ROWS; ++x) {
                    const int r = g + x * groups;
                    if (r < rows) {
                        acc[x] = kv_add(acc[x], kv_mul(s.q[r * dim + d], k));
                    }
                }
            }
        }
#pragma unroll
        for (int x = 0; x < KV_ATTEND_ROWS; ++x) {
            const int r = g + x * groups;
            if (r < rows) {
                s.s[r * chunk + at + j] = kv_softcap(kv_mul(acc[x], scale), softcap);
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

// Step 5: p = e^(s - m) in place (m taken as 0 where it is -inf: every logit of the chunk is -inf, and p = +0).
__host__ __device__ inline void kv_attend_exp(int n, int rows, int chunk, kv_attend_smem s, int lane, int width) {
    for (int i = lane; i < rows * n; i += width) {
        const int r = i / n, t = i - r * n;
        const float m = s.m[r] == kv_bits_float(0xff800000u) ? 0.0f : s.m[r];
        s.s[r * chunk + t] = kv_exp(kv_sub(s.s[r * chunk + t], m));
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

// Step 7's last writes, a thread per row: the log-sum-exp (`single`), else the chunk's maximum and sum.
__host__ __device__ inline void kv_attend_row_out(int rows, kv_attend_smem s, bool single, float* __restrict__ m_out,
                                                  float* __restrict__ l_out, int lane, int width) {
    for (int r = lane; r < rows; r += width) {
        if (single) {
            m_out[r] = kv_add(s.m[r], kv_log(s.l[r]));
        } else {
            m_out[r] = s.m[r];
            l_out[r] = s.l[r];
        }
    }
}

// Step 7: the p-weighted values of the chunk's n entries from c0. Thread i takes channel i % dim for the rows
// g, g + groups, ... with g = i / dim, groups = max(1, width / dim). With `single` (`finish`: the head's only
// chunk, no whole part) it writes out = a / l and lse = m + log l; else its sums a, m and l for the combine.
template <typename T>
__host__ __device__ inline void kv_attend_values(const kv_attend_src& v, int h, kv_i64 c0, int n,
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
        while (t < n) {   // the chunk a run of consecutive entries at a time: no address worked out per entry
            kv_i64 run;
            const T* at = kv_entry<T>(v, h, c0 + t, &run) + d;
            if (run > n - t) {
                run = n - t;
            }
            for (kv_i64 u = 0; u < run; ++u, ++t) {
                const float x = kv_float(at[u * v.slab_token]);
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
    kv_attend_row_out(rows, s, single, m_out, l_out, lane, width);
}

// Step 7 with `wide`, per staged tile of values (the chunk's entries `at` .. at + n - 1): each thread's sums
// of step 7 (same threads, channels and rows) carried in `s.acc` from one tile to the next, from +0 at the
// first, so each sum takes its terms in the same order as there.
template <typename T>
__host__ __device__ inline void kv_attend_values_tile(const unsigned int* __restrict__ vals, int row_words, int n,
                                                      int at, int rows, int dim, int chunk, kv_attend_smem s,
                                                      int lane, int width) {
    const int groups = width >= dim ? width / dim : 1;
    for (int i = lane; i < dim * groups; i += width) {
        const int d = i % dim, g = i / dim;
        float acc[KV_ATTEND_ROWS];
#pragma unroll
        for (int y = 0; y < KV_ATTEND_ROWS; ++y) {
            const int r = g + y * groups;
            acc[y] = r < rows && at > 0 ? s.acc[r * dim + d] : 0.0f;
        }
        for (int j = 0; j < n; ++j) {
            const float x = kv_word_elem(vals + j * (row_words + 1), d, T());
#pragma unroll
            for (int y = 0; y < KV_ATTEND_ROWS; ++y) {
                const int r = g + y * groups;
                if (r < rows) {
                    acc[y] = kv_add(acc[y], kv_mul(s.s[r * chunk + at + j], x));
                }
            }
        }
#pragma unroll
        for (int y = 0; y < KV_ATTEND_ROWS; ++y) {
            const int r = g + y * groups;
            if (r < rows) {
                s.acc[r * dim + d] = acc[y];
            }
        }
    }
}

// Step 7's writes with `wide`: the sums `s.acc` holds once every tile is in, as step 7 writes its own.
__host__ __device__ inline void kv_attend_values_out(int rows, int dim, kv_attend_smem s, bool single,
                                                     float* __restrict__ a_out, float* __restrict__ m_out,
                                                     float* __restrict__ l_out, int lane, int width) {
    for (int i = lane; i < rows * dim; i += width) {
        const int r = i / dim;
        a_out[i] = single ? kv_div(s.acc[i], s.l[r]) : s.acc[i];
    }
    kv_attend_row_out(rows, s, single, m_out, l_out, lane, width);
}

// The combine's steps share [chunks + 3] floats: the chunks' weights, then M, L and the whole part's weight.
// `x_lse` and `x_out` are the whole part's (null when there is none); it comes before the chunks.
// Step C1, one thread: M, the largest of the whole part's lse and the chunks' maxima, in order (NaN wins).
__host__ __device__ inline void kv_combine_max(const float* __restrict__ m, kv_i64 m_c, kv_i64 chunks,
                                               const float* __restrict__ x_lse, float* __restrict__ shared,
                                               int lane) {
    if (lane == 0) {
        float big = x_lse ? *x_lse : m[0];
        for (kv_i64 c = x_lse ? 0 : 1; c < chunks; c += KV_COMBINE_LOADS) {
            float x[KV_COMBINE_LOADS];   // loaded together, then taken in order
#pragma unroll
            for (int u = 0; u < KV_COMBINE_LOADS; ++u) {
                x[u] = c + u < chunks ? m[(c + u) * m_c] : 0.0f;
            }
#pragma unroll
            for (int u = 0; u < KV_COMBINE_LOADS; ++u) {
                if (c + u < chunks && (x[u] != x[u] || x[u] > big)) {
                    big = x[u];
                }
            }
        }
        shared[chunks] = big;
    }
}

// Step C2: each chunk's weight e^(m - M), and the whole part's e^(lse_x - M).
__host__ __device__ inline void kv_combine_weights(const float* __restrict__ m, kv_i64 m_c, kv_i64 chunks,
                                                   const float* __restrict__ x_lse, float* __restrict__ shared,
                                                   int lane, int width) {
    for (kv_i64 c = lane; c < chunks; c += width) {
        shared[c] = kv_exp(kv_sub(m[c * m_c], shared[chunks]));
    }
    if (lane == 0 && x_lse) {
        shared[chunks + 2] = kv_exp(kv_sub(*x_lse, shared[chunks]));
    }
}

// Step C3, one thread: L (the whole part's sum of 1 first) and the log-sum-exp.
__host__ __device__ inline void kv_combine_total(const float* __restrict__ l, kv_i64 l_c, kv_i64 chunks,
                                                 bool whole, float* __restrict__ shared, float* __restrict__ lse,
                                                 int lane) {
    if (lane == 0) {
        float total = whole ? kv_add(0.0f, kv_mul(1.0f, shared[chunks + 2])) : 0.0f;
        for (kv_i64 c = 0; c < chunks; c += KV_COMBINE_LOADS) {
            float x[KV_COMBINE_LOADS];   // loaded together, then summed in order
#pragma unroll
            for (int u = 0; u < KV_COMBINE_LOADS; ++u) {
                x[u] = c + u < chunks ? l[(c + u) * l_c] : 0.0f;
            }
#pragma unroll
            for (int u = 0; u < KV_COMBINE_LOADS; ++u) {
                if (c + u < chunks) {
                    total = kv_add(total, kv_mul(x[u], shared[c + u]));
                }
            }
        }
        shared[chunks + 1] = total;
        *lse = kv_add(shared[chunks], kv_log(total));
    }
}

// Step C4: out[d] = A[d] / L for d = lane, lane + width, ... (the whole part's output first).
__host__ __device__ inline void kv_combine_out(const float* __restrict__ a, kv_i64 a_c, kv_i64 chunks, int dim,
                                               const float* __restrict__ x_out, const float* __restrict__ shared,
                                               float* __restrict__ out, int lane, int width) {
    for (int d = lane; d < dim; d += width) {
        float acc = x_out ? kv_add(0.0f, kv_mul(x_out[d], shared[chunks + 2])) : 0.0f;
        for (kv_i64 c = 0; c < chunks; c += KV_COMBINE_LOADS) {
            float x[KV_COMBINE_LOADS];   // loaded together, then summed in order
#pragma unroll
            for (int u = 0; u < KV_COMBINE_LOADS; ++u) {
                x[u] = c + u < chunks ? a[(c + u) * a_c + d] : 0.0f;
            }
#pragma unroll
            for (int u = 0; u < KV_COMBINE_LOADS; ++u) {
                if (c + u < chunks) {
                    acc = kv_add(acc, kv_mul(x[u], shared[c + u]));
                }
            }
        }
        out[d] = kv_div(acc, shared[chunks + 1]);
    }
}

// Block (c, h): chunk c of head h. Sums go to part_a [heads, chunks, rows, dim], part_m and part_l
// [heads, chunks, rows]; with `finish` (one chunk, no whole part) out [heads, rows, dim] and lse [heads, rows].
template <typename T, bool WIDE>
__device__ __forceinline__ void kv_attend_chunks(const T* __restrict__ q, kv_i64 q_h, kv_i64 q_r,
                                                 const kv_attend_src& k, const kv_attend_src& v, kv_i64 count,
                                                 int rows, int dim, int chunk, int tile, int finish, float scale,
                                                 float softcap, float* __restrict__ part_a,
                                                 float* __restrict__ part_m, float* __restrict__ part_l,
                                                 float* __restrict__ out, float* __restrict__ lse) {
    extern __shared__ __align__(16) unsigned char kv_attend_shared[];
    const kv_i64 c = blockIdx.x, chunks = gridDim.x;
    const int h = blockIdx.y, lane = threadIdx.x, width = blockDim.x;
    const int row_words = dim * (int)sizeof(T) / 4;
    const kv_i64 c0 = c * chunk;
    const int n = (int)(count - c0 < chunk ? count - c0 : chunk);
    const kv_attend_smem s = kv_attend_layout(kv_attend_shared, rows, dim, chunk, tile, row_words);
    kv_attend_stage_q<T>(q + h * q_h, q_r, rows, dim, s.q, lane, width);
    for (int at = 0; at < n; at += tile) {
        const int m = n - at < tile ? n - at : tile;
        if (WIDE) {
            kv_attend_stage_wide<T>(k, h, c0 + at, m, row_words, s.keys, lane, width);
        } else {
            kv_attend_stage_keys<T>(k, h, c0 + at, m, row_words, s.keys, lane, width);
        }
        __syncthreads();
        kv_attend_logits<T>(s.keys, row_words, m, tile, at, rows, dim, chunk, scale, softcap, s, lane, width);
        __syncthreads();   // the next tile's keys overwrite these
    }
    kv_attend_max(n, rows, chunk, s, lane, width);
    __syncthreads();
    kv_attend_exp(n, rows, chunk, s, lane, width);
    __syncthreads();
    kv_attend_sum(n, rows, chunk, s, lane, width);
    __syncthreads();
    const bool single = finish != 0;
    const kv_i64 part = ((kv_i64)h * chunks + c) * rows;
    float* a_out = single ? out + (kv_i64)h * rows * dim : part_a + part * dim;
    float* m_out = single ? lse + (kv_i64)h * rows : part_m + part;
    float* l_out = single ? nullptr : part_l + part;
    if (WIDE) {
        for (int at = 0; at < n; at += tile) {   // the keys' buffer is free: the values through it, a tile at a time
            const int m = n - at < tile ? n - at : tile;
            kv_attend_stage_wide<T>(v, h, c0 + at, m, row_words, s.keys, lane, width);
            __syncthreads();
            kv_attend_values_tile<T>(s.keys, row_words, m, at, rows, dim, chunk, s, lane, width);
            __syncthreads();
        }
        kv_attend_values_out(rows, dim, s, single, a_out, m_out, l_out, lane, width);
    } else {
        kv_attend_values<T>(v, h, c0, n, rows, dim, chunk, s, single, a_out, m_out, l_out, lane, width);
    }
}

// The entries attended: `count`, plus `*count_at` when given (a count the device keeps, so the launch is the
// same whatever it is: the grid then covers every chunk the slabs could hold, and the blocks past the
// entries return at once).
__host__ __device__ inline kv_i64 kv_attend_count(kv_i64 count, const kv_i64* count_at) {
    return count_at ? count + *count_at : count;
}

// k_slabs, v_slabs (slab mode) or k_base, v_base with pages (paged mode): see kv_attend_src. WIDE: the reads.
#define KV_ATTEND_CHUNKS(NAME, T, WIDE)                                                                           \
    extern "C" __global__ void NAME(const T* __restrict__ q, kv_i64 q_h, kv_i64 q_r,                              \
                                    const kv_u64* __restrict__ k_slabs, const kv_u64* __restrict__ v_slabs,       \
                                    const char* __restrict__ k_base, const char* __restrict__ v_base,             \
                                    kv_i64 slab_tokens, kv_i64 slab_head, kv_i64 slab_token,                      \
                                    const kv_i64* __restrict__ pages, kv_i64 n_pages, int page, kv_i64 count,     \
                                    const kv_i64* __restrict__ count_at, int rows, int dim, int chunk, int tile,  \
                                    int finish, float scale, float softcap, float* __restrict__ part_a,           \
                                    float* __restrict__ part_m, float* __restrict__ part_l,                       \
                                    float* __restrict__ out, float* __restrict__ lse) {                           \
        const kv_i64 total = kv_attend_count(count, count_at);                                                    \
        if ((kv_i64)blockIdx.x * chunk >= total) {                                                                \
            return;                                                                                               \
        }                                                                                                         \
        const kv_attend_src k = {k_slabs, k_base, slab_tokens, slab_head, slab_token, pages, n_pages, page};      \
        const kv_attend_src v = {v_slabs, v_base, slab_tokens, slab_head, slab_token, pages, n_pages, page};      \
        kv_attend_chunks<T, WIDE>(q, q_h, q_r, k, v, total, rows, dim, chunk, tile, finish, scale, softcap,       \
                                  part_a, part_m, part_l, out, lse);                                              \
    }
KV_ATTEND_CHUNKS(kvtier_attend_chunks_f32, float, false)
KV_ATTEND_CHUNKS(kvtier_attend_chunks_f16, kv_half, false)
KV_ATTEND_CHUNKS(kvtier_attend_chunks_bf16, kv_bf16, false)
KV_ATTEND_CHUNKS(kvtier_attend_chunks_wide_f32, float, true)
KV_ATTEND_CHUNKS(kvtier_attend_chunks_wide_f16, kv_half, true)
KV_ATTEND_CHUNKS(kvtier_attend_chunks_wide_bf16, kv_bf16, true)

// Block (r, h): query row r of head h over the whole part (x_out [heads, rows, dim] and x_lse [heads, rows]
// through their strides, when given) and the head's chunks, a thread per channel. The parts hold `chunks`
// chunks a head; with `count_at`, only those the entries fill (`kv_attend_count`, in chunks of `chunk`) are
// merged, the rest were never written.
extern "C" __global__ void kvtier_attend_combine(const float* __restrict__ part_a, const float* __restrict__ part_m,
                                                 const float* __restrict__ part_l, kv_i64 chunks, kv_i64 count,
                                                 const kv_i64* __restrict__ count_at, int chunk, int rows,
                                                 int dim, const float* __restrict__ x_out, kv_i64 x_out_h,
                                                 kv_i64 x_out_r, const float* __restrict__ x_lse, kv_i64 x_lse_h,
                                                 kv_i64 x_lse_r, float* __restrict__ out, float* __restrict__ lse) {
    extern __shared__ __align__(16) float kv_combine_shared[];   // [chunks + 3]
    const int r = blockIdx.x, h = blockIdx.y, lane = threadIdx.x, width = blockDim.x;
    const kv_i64 first = (kv_i64)h * chunks * rows + r;   // chunk c of (h, r) at first + c * rows
    kv_i64 used = count_at ? (kv_attend_count(count, count_at) + chunk - 1) / chunk : chunks;
    used = used < chunks ? used : chunks;   // never past the parts made (a count beyond the slabs' capacity)
    const float* xl = x_lse ? x_lse + h * x_lse_h + r * x_lse_r : nullptr;
    const float* xo = x_out ? x_out + h * x_out_h + r * x_out_r : nullptr;
    kv_combine_max(part_m + first, rows, used, xl, kv_combine_shared, lane);
    __syncthreads();
    kv_combine_weights(part_m + first, rows, used, xl, kv_combine_shared, lane, width);
    __syncthreads();
    kv_combine_total(part_l + first, rows, used, xl != nullptr, kv_combine_shared, lse + (kv_i64)h * rows + r,
                     lane);
    __syncthreads();
    kv_combine_out(part_a + first * dim, (kv_i64)rows * dim, used, dim, xo, kv_combine_shared,
                   out + ((kv_i64)h * rows + r) * dim, lane, width);
}
