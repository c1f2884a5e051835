// KVP's scores of new cache entries in one launch: every KV head's network (kvtier/scoring/kvp.py's
// KVPAgents) over every new token, in place of the features' concatenation, the standardisation, three
// batched matrix products and two SiLUs. One block per (token, head), a thread per hidden unit.
//
// Agent a = first + h scores the entry of head h at token t from x = [key | value | position features]:
//   z[i]  = (x[i] - mean[a, i]) / std[a, i]
//   h1[j] = silu(sum_i z[i] w1[a, i, j] + b1[a, j])
//   h2[j] = silu(sum_i h1[i] w2[a, i, j] + b2[a, j])
//   score = sum_j h2[j] w3[a, j] + b3[a]
// each sum over i (or j) = 0, 1, ... in order from +0, then the bias added; silu(v) = v / (1 + e^-v) with
// kvtier_native.cuh's kv_exp. Every operation rounds on its own; the twin (twins.kvp_score) follows step by
// step. The keys and values are read in the cache's dtype, each through its own head and token strides.
#include "kvtier_native.cuh"

__host__ __device__ __forceinline__ float kv_silu(float v) {
    return kv_div(v, kv_add(1.0f, kv_exp(-v)));
}

// Step 1, shared by `width` threads of which this is `lane`: the standardised features z.
template <typename T>
__host__ __device__ inline void kv_kvp_features(const T* __restrict__ key, const T* __restrict__ value,
                                                const float* __restrict__ pos, int dim, int pos_features,
                                                const float* __restrict__ mean, const float* __restrict__ std,
                                                float* __restrict__ z, int lane, int width) {
    const int d_in = 2 * dim + pos_features;
    for (int i = lane; i < d_in; i += width) {
        const float x = i < dim ? kv_float(key[i]) : i < 2 * dim ? kv_float(value[i - dim]) : pos[i - 2 * dim];
        z[i] = kv_div(kv_sub(x, mean[i]), std[i]);
    }
}

// Steps 2 and 3: a hidden layer, out[j] = silu(sum_i in[i] w[i, j] + b[j]) for j = lane, lane + width, ...
__host__ __device__ inline void kv_kvp_hidden(const float* __restrict__ in, int n_in, const float* __restrict__ w,
                                              const float* __restrict__ b, int n_out, float* __restrict__ out,
                                              int lane, int width) {
    for (int j = lane; j < n_out; j += width) {
        float acc = 0.0f;
        for (int i = 0; i < n_in; ++i) {
            acc = kv_add(acc, kv_mul(in[i], w[(kv_i64)i * n_out + j]));
        }
        out[j] = kv_silu(kv_add(acc, b[j]));
    }
}

// Step 4, by one thread: the score.
__host__ __device__ inline float kv_kvp_out(const float* __restrict__ h2, int hidden, const float* __restrict__ w3,
                                            float b3) {
    float acc = 0.0f;
    for (int j = 0; j < hidden; ++j) {
        acc = kv_add(acc, kv_mul(h2[j], w3[j]));
    }
    return kv_add(acc, b3);
}

template <typename T>
__device__ __forceinline__ void kv_kvp_score(const T* __restrict__ keys, kv_i64 k_head, kv_i64 k_token,
                                             const T* __restrict__ values, kv_i64 v_head, kv_i64 v_token,
                                             const float* __restrict__ pos,
                                             int dim, int pos_features, int hidden, kv_i64 first,
                                             const float* __restrict__ mean, const float* __restrict__ std,
                                             const float* __restrict__ w1, const float* __restrict__ b1,
                                             const float* __restrict__ w2, const float* __restrict__ b2,
                                             const float* __restrict__ w3, const float* __restrict__ b3,
                                             float* __restrict__ scores) {
    extern __shared__ float kv_kvp_shared[];
    const kv_i64 t = blockIdx.x, tokens = gridDim.x;
    const int h = blockIdx.y, lane = threadIdx.x, width = blockDim.x;
    const int d_in = 2 * dim + pos_features;
    const kv_i64 a = first + h;
    float* z = kv_kvp_shared;
    float* h1 = z + d_in;
    float* h2 = h1 + hidden;
    kv_kvp_features<T>(keys + h * k_head + t * k_token, values + h * v_head + t * v_token, pos + t * pos_features,
                       dim, pos_features, mean + a * d_in, std + a * d_in, z, lane, width);
    __syncthreads();
    kv_kvp_hidden(z, d_in, w1 + a * d_in * hidden, b1 + a * hidden, hidden, h1, lane, width);
    __syncthreads();
    kv_kvp_hidden(h1, hidden, w2 + a * hidden * hidden, b2 + a * hidden, hidden, h2, lane, width);
    __syncthreads();
    if (lane == 0) {
        scores[h * tokens + t] = kv_kvp_out(h2, hidden, w3 + a * hidden, b3[a]);
    }
}

#define KV_KVP_SCORE(NAME, T)                                                                                     \
    extern "C" __global__ void NAME(const T* __restrict__ keys, kv_i64 k_head, kv_i64 k_token,                     \
                                    const T* __restrict__ values, kv_i64 v_head, kv_i64 v_token,                   \
                                    const float* __restrict__ pos, int dim, int pos_features, int hidden,          \
                                    kv_i64 first, const float* __restrict__ mean, const float* __restrict__ std,   \
                                    const float* __restrict__ w1, const float* __restrict__ b1,                   \
                                    const float* __restrict__ w2, const float* __restrict__ b2,                   \
                                    const float* __restrict__ w3, const float* __restrict__ b3,                   \
                                    float* __restrict__ scores) {                                                 \
        kv_kvp_score<T>(keys, k_head, k_token, values, v_head, v_token, pos, dim, pos_features, hidden, first,   \
                        mean, std, w1, b1, w2, b2, w3, b3, scores);                                               \
    }
KV_KVP_SCORE(kvtier_kvp_score_f32, float)
KV_KVP_SCORE(kvtier_kvp_score_f16, kv_half)
KV_KVP_SCORE(kvtier_kvp_score_bf16, kv_bf16)
