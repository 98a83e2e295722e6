/* The vectors of cpu_attention.c (and of cpu_attention_tiles.h's passes), one source at two widths: built with
 * -mavx512f they are __m512 (16 lanes, 32 registers: a tile's 64 keys x 6 rows of scores, or 64 dims x 6 rows of
 * output, in 24 accumulators); otherwise __m256 (16 registers: 16 keys or dims x 6 rows, 12 accumulators). vf and
 * the V_ macros are the width's; keep_first masks a span's tail, exp2_v is the softmax's exp2, hmax / hsum reduce a
 * vector. transpose8 and load8 are AVX at 8 lanes in both builds: they read the cache (fp32 or fp16, widened) and
 * transpose its keys into tiles. */
#ifndef CPU_ATTENTION_VEC_H
#define CPU_ATTENTION_VEC_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#define AI static inline __attribute__((always_inline))

#if defined(__AVX512F__)
#define VL 16
#define NVK 4 /* key vectors of an S pass: the whole tile */
#define NVD 4 /* head vectors of a P V pass */
typedef __m512 vf;
#define V_ZERO() _mm512_setzero_ps()
#define V_SET1(x) _mm512_set1_ps(x)
#define V_LOAD(p) _mm512_load_ps(p)
#define V_LOADU(p) _mm512_loadu_ps(p)
#define V_STORE(p, v) _mm512_store_ps(p, v)
#define V_STOREU(p, v) _mm512_storeu_ps(p, v)
#define V_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define V_MUL(a, b) _mm512_mul_ps(a, b)
#define V_ADD(a, b) _mm512_add_ps(a, b)
#define V_SUB(a, b) _mm512_sub_ps(a, b)
#define V_MAX(a, b) _mm512_max_ps(a, b)
#define V_BCAST(p) _mm512_set1_ps(*(p))
/* n of the vector's floats (a head of 8 or 24 ends on half a vector): masked, nothing read past a row */
#define V_LOADN(p, n) _mm512_maskz_loadu_ps((__mmask16)((1u << (n)) - 1), p)
#define V_STOREN(p, n, v) _mm512_mask_storeu_ps(p, (__mmask16)((1u << (n)) - 1), v)

/* v with lanes n .. VL - 1 set to -inf (n in 0 .. VL) */
AI vf keep_first(vf v, int64_t n) {
    const __mmask16 m = n >= VL ? (__mmask16)0xffff : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1);
    return _mm512_mask_blend_ps(m, V_SET1(-INFINITY), v);
}

/* 2^x = 2^n * 2^f, n = round(x), |f| <= 0.5, 2^f by a degree-6 polynomial fitted to its relative error
 * (< 1e-7, about an ulp), 2^n applied by vscalefps. x below -126 (keys masked with -inf) gives exactly 0. */
AI vf exp2_v(vf x) {
    const __mmask16 keep = _mm512_cmp_ps_mask(x, V_SET1(-126.0f), _CMP_GE_OQ);
    const vf n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const vf f = V_SUB(x, n);
    vf p = V_SET1(1.5345812e-4f);
    p = V_FMA(p, f, V_SET1(1.3399931e-3f));
    p = V_FMA(p, f, V_SET1(9.6184891e-3f));
    p = V_FMA(p, f, V_SET1(5.5503286e-2f));
    p = V_FMA(p, f, V_SET1(2.4022646e-1f));
    p = V_FMA(p, f, V_SET1(6.9314718e-1f));
    p = V_FMA(p, f, V_SET1(1.0f));
    return _mm512_maskz_scalef_ps(keep, p, n);
}

AI float hmax(vf v) { return _mm512_reduce_max_ps(v); }
AI float hsum(vf v) { return _mm512_reduce_add_ps(v); }
#else
#define VL 8
#define NVK 2
#define NVD 2
typedef __m256 vf;
#define V_ZERO() _mm256_setzero_ps()
#define V_SET1(x) _mm256_set1_ps(x)
#define V_LOAD(p) _mm256_load_ps(p)
#define V_LOADU(p) _mm256_loadu_ps(p)
#define V_STORE(p, v) _mm256_store_ps(p, v)
#define V_STOREU(p, v) _mm256_storeu_ps(p, v)
#define V_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define V_MUL(a, b) _mm256_mul_ps(a, b)
#define V_ADD(a, b) _mm256_add_ps(a, b)
#define V_SUB(a, b) _mm256_sub_ps(a, b)
#define V_MAX(a, b) _mm256_max_ps(a, b)
#define V_BCAST(p) _mm256_broadcast_ss(p)
#define V_LOADN(p, n) _mm256_loadu_ps(p) /* n is always 8: head sizes are multiples of 8 */
#define V_STOREN(p, n, v) _mm256_storeu_ps(p, v)

AI vf keep_first(vf v, int64_t n) {
    const __m256 idx = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 in = _mm256_cmp_ps(idx, _mm256_set1_ps((float)n), _CMP_LT_OQ);
    return _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), v, in);
}

AI vf exp2_v(vf x) {
    /* as the AVX-512 one above, lane for lane */
    const __m256 lo = _mm256_set1_ps(-126.0f);
    const __m256 keep = _mm256_cmp_ps(x, lo, _CMP_GE_OQ);
    x = _mm256_max_ps(x, lo);
    const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_sub_ps(x, n);
    __m256 p = V_SET1(1.5345812e-4f);
    p = V_FMA(p, f, V_SET1(1.3399931e-3f));
    p = V_FMA(p, f, V_SET1(9.6184891e-3f));
    p = V_FMA(p, f, V_SET1(5.5503286e-2f));
    p = V_FMA(p, f, V_SET1(2.4022646e-1f));
    p = V_FMA(p, f, V_SET1(6.9314718e-1f));
    p = V_FMA(p, f, V_SET1(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), keep);
}

AI float hmax(vf v) {
    __m128 a = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_max_ps(a, _mm_movehl_ps(a, a));
    a = _mm_max_ss(a, _mm_shuffle_ps(a, a, 1));
    return _mm_cvtss_f32(a);
}

AI float hsum(vf v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    a = _mm_add_ss(a, _mm_shuffle_ps(a, a, 1));
    return _mm_cvtss_f32(a);
}
#endif

/* 8 x 8 transpose of r[0..8) (AVX, both builds) */
static inline void transpose8(__m256 r[8]) {
    __m256 t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
        r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
    }
}

/* 8 elements of a cache row from element d, widened */
static inline __m256 load8(const char *row, int64_t esize, int64_t d) {
    if (esize == 4) return _mm256_loadu_ps((const float *)row + d);
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + d)));
}

#endif
