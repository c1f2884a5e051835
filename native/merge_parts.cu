// Exact attention over the union of disjoint key sets, from each set's attention output and log-sum-exp, in
// one launch: in place of the stack, log-sum-exp, exp, NaN guard and weighted sum of merge_with_lse in
// kvtier/engine/attention.py. Up to 4 parts a launch (ops.merge_parts chains launches for more).
//
// For KV head h, packed query row r and channel d, with parts i = 0 .. K - 1:
//   total[h, r]  = kv_logsumexp of (lse_0[h, r], ..., lse_{K-1}[h, r]) in part order
//   w_i          = kv_exp(lse_i[h, r] - total[h, r]), 0 where that is NaN (a part with no keys: -inf - -inf)
//   out[h, r, d] = o_0[h, r, d] w_0, then + o_i[h, r, d] w_i for i = 1 .. K - 1
// every product and sum rounding on its own; the twin (twins.merge_parts) follows step by step. The
// log-sum-exp runs over 4 values, the missing parts' as -inf: adding their e^-inf = +0 changes no bit, and
// the fixed length keeps the values in registers. Each part is read through its head and row strides.
#include "kvtier_native.cuh"

#define KV_MERGE_MAX 4

struct kv_part {
    const float* out;   // [heads, rows, dim]: out[h * out_h + r * out_r + d]
    kv_i64 out_h, out_r;
    const float* lse;   // [heads, rows]: lse[h * lse_h + r * lse_r]
    kv_i64 lse_h, lse_r;
};

// Element e = (h * rows + r) * dim + d of the merge of `count` parts.
__host__ __device__ inline void kv_merge_element(const kv_part* parts, int count, kv_i64 e, int rows, int dim,
                                                 float* __restrict__ out, float* __restrict__ lse_out) {
    const kv_i64 d = e % dim, hr = e / dim, r = hr % rows, h = hr / rows;
    float l[KV_MERGE_MAX];
#pragma unroll
    for (int i = 0; i < KV_MERGE_MAX; ++i) {
        l[i] = i < count ? parts[i].lse[h * parts[i].lse_h + r * parts[i].lse_r] : kv_bits_float(0xff800000u);
    }
    const float total = kv_logsumexp(l, KV_MERGE_MAX, 1);
    float acc = 0.0f;
#pragma unroll
    for (int i = 0; i < KV_MERGE_MAX; ++i) {
        if (i < count) {
            float w = kv_exp(kv_sub(l[i], total));
            if (w != w) {
                w = 0.0f;
            }
            const float term = kv_mul(parts[i].out[h * parts[i].out_h + r * parts[i].out_r + d], w);
            acc = i == 0 ? term : kv_add(acc, term);
        }
    }
    out[e] = acc;
    if (d == 0 && lse_out) {
        lse_out[hr] = total;
    }
}

extern "C" __global__ void kvtier_merge_parts(const float* __restrict__ o0, kv_i64 o0_h, kv_i64 o0_r,
                                              const float* __restrict__ l0, kv_i64 l0_h, kv_i64 l0_r,
                                              const float* __restrict__ o1, kv_i64 o1_h, kv_i64 o1_r,
                                              const float* __restrict__ l1, kv_i64 l1_h, kv_i64 l1_r,
                                              const float* __restrict__ o2, kv_i64 o2_h, kv_i64 o2_r,
                                              const float* __restrict__ l2, kv_i64 l2_h, kv_i64 l2_r,
                                              const float* __restrict__ o3, kv_i64 o3_h, kv_i64 o3_r,
                                              const float* __restrict__ l3, kv_i64 l3_h, kv_i64 l3_r, int count,
                                              int heads, int rows, int dim, float* __restrict__ out,
                                              float* __restrict__ lse_out) {
    const kv_part parts[KV_MERGE_MAX] = {{o0, o0_h, o0_r, l0, l0_h, l0_r}, {o1, o1_h, o1_r, l1, l1_h, l1_r},
                                         {o2, o2_h, o2_r, l2, l2_h, l2_r}, {o3, o3_h, o3_r, l3, l3_h, l3_r}};
    const kv_i64 n = (kv_i64)heads * rows * dim, stride = (kv_i64)gridDim.x * blockDim.x;
    for (kv_i64 e = (kv_i64)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += stride) {
        kv_merge_element(parts, count, e, rows, dim, out, lse_out);
    }
}
