// Helpers shared by kvtier's kernels. No system header is included, so NVRTC compiles every source as it
// is; the loader inlines this file where a source includes it (the on-disk kernel cache then keys on the
// whole text). The helpers are __host__ __device__: the unit tests compile them for the host with nvcc and
// hold them to the twins without a GPU.
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
__host__ __device__ __forceinline__ void kv_copy(char* __restrict__ dst, const char* __restrict__ src, kv_i64 bytes,
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
__host__ __device__ __forceinline__ char* kv_row(const kv_u64* __restrict__ slabs, kv_i64 rows_per_slab, kv_i64 row,
                                        kv_i64 row_bytes) {
    return reinterpret_cast<char*>(slabs[row / rows_per_slab]) + (row % rows_per_slab) * row_bytes;
}

// ------------------------------------------------------------------------------------ float arithmetic
// One rounding to nearest per operation, never contracted into a fused multiply-add: on the device by the
// _rn intrinsics, on the host (the tests' harnesses) by plain float operations built without contraction.
__host__ __device__ __forceinline__ float kv_add(float a, float b) {
#ifdef __CUDA_ARCH__
    return __fadd_rn(a, b);
#else
    return a + b;
#endif
}
__host__ __device__ __forceinline__ float kv_sub(float a, float b) {
#ifdef __CUDA_ARCH__
    return __fsub_rn(a, b);
#else
    return a - b;
#endif
}
__host__ __device__ __forceinline__ float kv_mul(float a, float b) {
#ifdef __CUDA_ARCH__
    return __fmul_rn(a, b);
#else
    return a * b;
#endif
}
__host__ __device__ __forceinline__ float kv_div(float a, float b) {
#ifdef __CUDA_ARCH__
    return __fdiv_rn(a, b);
#else
    return a / b;
#endif
}
__host__ __device__ __forceinline__ float kv_bits_float(unsigned int b) {
#ifdef __CUDA_ARCH__
    return __uint_as_float(b);
#else
    float f;
    __builtin_memcpy(&f, &b, sizeof f);
    return f;
#endif
}
__host__ __device__ __forceinline__ unsigned int kv_float_bits(float f) {
#ifdef __CUDA_ARCH__
    return __float_as_uint(f);
#else
    unsigned int b;
    __builtin_memcpy(&b, &f, sizeof b);
    return b;
#endif
}

// Cache-dtype elements read as float32 (exact for all three).
struct kv_half {
    unsigned short bits;
};
struct kv_bf16 {
    unsigned short bits;
};
__host__ __device__ __forceinline__ float kv_float(float x) { return x; }
__host__ __device__ __forceinline__ float kv_float(kv_bf16 x) { return kv_bits_float(((unsigned int)x.bits) << 16); }
__host__ __device__ __forceinline__ float kv_float(kv_half x) {
#ifdef __CUDA_ARCH__
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
    return f;
#else
    const unsigned int sign = ((unsigned int)x.bits & 0x8000u) << 16, e = (x.bits >> 10) & 0x1fu, m = x.bits & 0x3ffu;
    if (e == 0x1fu) {
        return kv_bits_float(sign | 0x7f800000u | (m << 13));
    }
    if (e != 0u) {
        return kv_bits_float(sign | ((e + 112u) << 23) | (m << 13));
    }
    const float tiny = (float)m * 0x1p-24f;   // a subnormal half: m 2^-24, exact in float32
    return sign ? -tiny : tiny;
#endif
}

// e^x from rounded adds and multiplies only, so that its twin (twins.exp) gives the same bits on any device
// (the library's expf differs between CUDA and a CPU). x = k ln2 + r with k = rint(x log2 e) (adding and
// taking away 1.5 2^23 rounds to an integer) and r from a two-part ln2; e^r by its Taylor series to r^7 in
// Horner's order; then times 2^k as two exact powers of two. Within 2 ulp of e^x. +inf above log(FLT_MAX),
// 0 below log(FLT_MIN) (no subnormal results), NaN stays NaN.
__host__ __device__ inline float kv_exp(float x) {
    if (x != x) {
        return x;
    }
    if (x > 0x1.62e430p+6f) {
        return kv_bits_float(0x7f800000u);
    }
    if (x < -0x1.5d589ep+6f) {
        return 0.0f;
    }
    const float k = kv_sub(kv_add(kv_mul(x, 0x1.715476p+0f), 0x1.8p+23f), 0x1.8p+23f);
    const float r = kv_sub(kv_sub(x, kv_mul(k, 0x1.62e400p-1f)), kv_mul(k, 0x1.7f7d1cp-20f));
    float p = 0x1.a01a02p-13f;                   // 1/7!
    p = kv_add(kv_mul(p, r), 0x1.6c16c2p-10f);   // 1/6!
    p = kv_add(kv_mul(p, r), 0x1.111112p-7f);    // 1/5!
    p = kv_add(kv_mul(p, r), 0x1.555556p-5f);    // 1/4!
    p = kv_add(kv_mul(p, r), 0x1.555556p-3f);    // 1/3!
    p = kv_add(kv_mul(p, r), 0.5f);
    p = kv_add(kv_mul(p, r), 1.0f);
    p = kv_add(kv_mul(p, r), 1.0f);
    const int ki = (int)k, k1 = ki >> 1, k2 = ki - k1;   // -126 <= k <= 128: each half a normal power of two
    return kv_mul(kv_mul(p, kv_bits_float((unsigned int)(k1 + 127) << 23)),
                  kv_bits_float((unsigned int)(k2 + 127) << 23));
}

// log x from rounded adds, multiplies and one divide (all exact to the twin, twins.log): x = m 2^e with
// m in [sqrt(1/2), sqrt(2)], log m = 2 atanh(f), f = (m - 1) / (m + 1), by its series to f^13 in Horner's
// order, plus e ln2 in two parts. Within 2 ulp of log x. -inf at 0, NaN below it, +inf at +inf.
__host__ __device__ inline float kv_log(float x) {
    if (x != x || x < 0.0f) {
        return kv_bits_float(0x7fc00000u);
    }
    if (x == 0.0f) {
        return kv_bits_float(0xff800000u);
    }
    if (x == kv_bits_float(0x7f800000u)) {
        return x;
    }
    int e = 0;
    if (x < 0x1p-126f) {   // subnormal: scaled into the normals, exactly
        x = kv_mul(x, 0x1p+23f);
        e = -23;
    }
    const unsigned int b = kv_float_bits(x);
    e += (int)(b >> 23) - 127;
    float m = kv_bits_float((b & 0x7fffffu) | 0x3f800000u);   // x = m 2^e, 1 <= m < 2
    if (m > 0x1.6a09e6p+0f) {
        m = kv_mul(m, 0.5f);
        e += 1;
    }
    const float f = kv_div(kv_sub(m, 1.0f), kv_add(m, 1.0f));
    const float f2 = kv_mul(f, f);
    float p = 0x1.3b13b2p-4f;                    // 1/13
    p = kv_add(kv_mul(p, f2), 0x1.745d18p-4f);   // 1/11
    p = kv_add(kv_mul(p, f2), 0x1.c71c72p-4f);   // 1/9
    p = kv_add(kv_mul(p, f2), 0x1.24924ap-3f);   // 1/7
    p = kv_add(kv_mul(p, f2), 0x1.99999ap-3f);   // 1/5
    p = kv_add(kv_mul(p, f2), 0x1.555556p-2f);   // 1/3
    p = kv_mul(p, f2);
    const float t = kv_add(f, f);
    const float ef = (float)e;
    return kv_add(kv_mul(ef, 0x1.62e400p-1f), kv_add(kv_mul(ef, 0x1.7f7d1cp-20f), kv_add(t, kv_mul(t, p))));
}

// tanh y from rounded adds, multiplies, one divide and kv_exp (its twin: twins.tanh): below |y| = 1/8 by its
// series y (1 - y^2/3 + 2 y^4/15 - 17 y^6/315) in Horner's order (the next term is under 2^-24 of it there);
// above, with t = e^(-2|y|), (1 - t) / (1 + t) with the sign of y. Within 5 ulp of tanh y; +-1 from
// |y| = 9 or so, NaN stays NaN.
__host__ __device__ inline float kv_tanh(float y) {
    if (y != y) {
        return y;
    }
    const float a = y < 0.0f ? -y : y;
    if (a < 0.125f) {
        const float y2 = kv_mul(y, y);
        float p = -0x1.ba1ba2p-5f;                   // -17/315
        p = kv_add(kv_mul(p, y2), 0x1.111112p-3f);   // 2/15
        p = kv_add(kv_mul(p, y2), -0x1.555556p-2f);  // -1/3
        p = kv_add(kv_mul(p, y2), 1.0f);
        return kv_mul(y, p);
    }
    const float t = kv_exp(kv_mul(a, -2.0f));
    const float r = kv_div(kv_sub(1.0f, t), kv_add(1.0f, t));
    return y < 0.0f ? -r : r;
}

// A logit soft-capped as Gemma 2 caps its scores: cap tanh(x / cap); cap 0 leaves x as it is.
__host__ __device__ __forceinline__ float kv_softcap(float x, float cap) {
    return cap > 0.0f ? kv_mul(kv_tanh(kv_div(x, cap)), cap) : x;
}

// log(sum_i e^v[i * stride]) over i = 0 .. n - 1 (n >= 1) in a fixed order: the largest value m (NaN wins),
// then the sum of e^(v - m) from +0 in order, then m + log(sum). -inf when every value is, +inf when one
// is (and none is NaN). The twin is twins.logsumexp.
__host__ __device__ inline float kv_logsumexp(const float* v, kv_i64 n, kv_i64 stride) {
    float m = v[0];
    for (kv_i64 i = 1; i < n; ++i) {
        const float x = v[i * stride];
        if (x != x || x > m) {
            m = x;
        }
    }
    if (m != m || m == kv_bits_float(0x7f800000u) || m == kv_bits_float(0xff800000u)) {
        return m;
    }
    float s = 0.0f;
    for (kv_i64 i = 0; i < n; ++i) {
        s = kv_add(s, kv_exp(kv_sub(v[i * stride], m)));
    }
    return kv_add(m, kv_log(s));
}

#endif  // KVTIER_NATIVE_CUH
