/* Weight-only quantised matmuls for x86-64 CPUs with AVX2 + FMA (built at first use by cpu_gemv.py).
 *
 * Decode reads every weight once per token, so on a CPU its speed is memory bandwidth over bytes per
 * weight. torch's int4/int8 weight-only kernels are compute-bound on AVX2 (no AVX512-BF16), so they buy
 * memory but not speed; these keep the weights 4- or 8-bit and stream them at bandwidth.
 *
 * Activations are quantised per block of 32 to int8 with one fp32 scale (d = max|x| / 127), as llama.cpp
 * does, so one block's dot product is integer arithmetic (u8 x s8 pairs summed to int16, then int32) and
 * one FMA. Offsets (asymmetric 4-bit) multiply the block sums of the rounded x.
 *
 * Q4: codes [N][K/32][16] bytes, byte j of a block holding element j (low nibble) and j + 16 (high
 *     nibble); scale and offset fp32 or fp16 [N][K/group], group a multiple of 32: w = q * scale + offset.
 * Q8: codes [N][K/32][32] int8; scale fp32 [N][K/32]: w = q * scale (GGUF Q8_0).
 * Rows of the output are split over `threads` OpenMP threads (none are started for one).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define QB 32   /* elements per activation block */
#define NR 4    /* weight rows one pass over an activation row serves */
#define GMAX 512 /* scale groups per row converted up front (K up to 16384 at groups of 32) */

typedef struct {
    int8_t *q;     /* [M][K] */
    float *d;      /* [M][K/32] */
    float *gsum;   /* [M][K/group]: sums of the rounded x per scale group (the offsets multiply them) */
} act_t;

static int quantize_activations(const float *x, int64_t m, int64_t k, int64_t group, act_t *a) {
    int64_t nb = k / QB, per = group / QB;
    a->q = (int8_t *)aligned_alloc(32, (size_t)((m * k + 31) / 32 * 32));
    a->d = (float *)malloc(sizeof(float) * (size_t)(m * nb));
    a->gsum = (float *)calloc((size_t)(m * (k / group)), sizeof(float));
    if (!a->q || !a->d || !a->gsum) return -1;
    for (int64_t r = 0; r < m * nb; r++) {
        const float *v = x + r * QB;
        float amax = 0.0f;
        for (int i = 0; i < QB; i++) {
            float f = fabsf(v[i]);
            amax = f > amax ? f : amax;
        }
        float d = amax / 127.0f;
        float id = d > 0.0f ? 1.0f / d : 0.0f;
        int sq = 0;
        for (int i = 0; i < QB; i++) {
            int8_t q = (int8_t)nearbyintf(v[i] * id);
            a->q[r * QB + i] = q;
            sq += q;
        }
        a->d[r] = d;
        /* The sum of the quantised block, so the result is exactly that of x rounded to d * q: a many-row
         * caller can dequantise the weight and multiply the same rounded x (numbers independent of M).
         * r / per = row * (K / group) + group index, since K / 32 = per * K / group. */
        a->gsum[r / per] += d * (float)sq;
    }
    return 0;
}

static void free_activations(act_t *a) {
    free(a->q);
    free(a->d);
    free(a->gsum);
}

/* Scales and offsets are fp32, or fp16 where that is exact (GGUF Q4_0 / Q4_1 store fp16): `half` picks. */
static inline __attribute__((always_inline)) float ld(const void *p, int64_t i, const int half) {
    return half ? _cvtsh_ss(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* One activation row against NR consecutive weight rows: NR independent FMA chains hide the FMA latency
 * that one row's chain would wait on, and each activation block is loaded once for all NR rows. */
static inline __attribute__((always_inline)) void q4_rows(const act_t *a, int64_t m, int64_t k, const uint8_t *codes,
                                                          const void *scale, const void *offset, int64_t group,
                                                          float *out, const int nr, const int half) {
    const int64_t nb = k / QB, per = group / QB, gk = k / group;
    const __m256i low = _mm256_set1_epi8(0x0F);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[NR];
    for (int r = 0; r < nr; r++) acc[r] = _mm256_setzero_ps();
    const int8_t *xq = a->q + m * k;
    const float *xd = a->d + m * nb;
    /* fp16 scales converted eight at a time up front: one scalar convert per row and block was a quarter
     * of the loop's instructions. */
    float sb[NR][GMAX];
    const int pre = half && gk <= GMAX;
    if (pre)
        for (int r = 0; r < nr; r++) {
            const uint16_t *src = (const uint16_t *)scale + r * gk;
            int64_t g = 0;
            for (; g + 8 <= gk; g += 8) _mm256_storeu_ps(sb[r] + g, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + g))));
            for (; g < gk; g++) sb[r][g] = _cvtsh_ss(src[g]);
        }
    for (int64_t g = 0; g < gk; g++) { /* groups outside, blocks inside: no division in the loop */
        float s[NR];
        for (int r = 0; r < nr; r++) s[r] = pre ? sb[r][g] : ld(scale, r * gk + g, half);
        for (int64_t b = g * per; b < (g + 1) * per; b++) {
            __m256i xv = _mm256_load_si256((const __m256i *)(xq + b * QB));
            __m256 d = _mm256_set1_ps(xd[b]);
            for (int r = 0; r < nr; r++) {
                __m128i raw = _mm_loadu_si128((const __m128i *)(codes + r * (k / 2) + b * 16));
                __m256i q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), low);
                __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(q, xv), ones);
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(_mm256_set1_ps(s[r]), d), acc[r]);
            }
        }
    }
    /* The offsets' term, sum over groups of offset * (sum of x in the group), eight groups a step: a scalar
     * chain here (an fp16 convert and an FMA per group, 18 groups a row for K = 576) cost more than the
     * row's whole block loop. */
    const float *xs = a->gsum + m * gk; /* sums of x per scale group */
    for (int r = 0; r < nr; r++) {
        __m256 o8 = acc[r];
        int64_t g = 0;
        for (; g + 8 <= gk; g += 8) {
            __m256 ov = half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)offset + r * gk + g)))
                             : _mm256_loadu_ps((const float *)offset + r * gk + g);
            o8 = _mm256_fmadd_ps(ov, _mm256_loadu_ps(xs + g), o8);
        }
        float off = 0.0f;
        for (; g < gk; g++) off += ld(offset, r * gk + g, half) * xs[g];
        out[r] = hsum(o8) + off;
    }
}

static inline __attribute__((always_inline)) void q8_rows(const act_t *a, int64_t m, int64_t k, const int8_t *codes,
                                                          const float *scale, float *out, const int nr) {
    const int64_t nb = k / QB;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[NR];
    for (int r = 0; r < nr; r++) acc[r] = _mm256_setzero_ps();
    const int8_t *xq = a->q + m * k;
    const float *xd = a->d + m * nb;
    for (int64_t b = 0; b < nb; b++) {
        __m256i xv = _mm256_load_si256((const __m256i *)(xq + b * QB));
        float d = xd[b];
        for (int r = 0; r < nr; r++) {
            __m256i w = _mm256_loadu_si256((const __m256i *)(codes + r * k + b * QB));
            /* |w| as unsigned and the sign moved onto x: u8 x s8 is the only byte product AVX2 has */
            __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xv, w)), ones);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(scale[r * nb + b] * d), acc[r]);
        }
    }
    for (int r = 0; r < nr; r++) out[r] = hsum(acc[r]);
}

static inline __attribute__((always_inline)) void q4_matmul(const act_t *a, int64_t m, int64_t k,
                                                            const uint8_t *codes, const void *scale,
                                                            const void *offset, int64_t n, int64_t group, float *out,
                                                            int threads, const int half) {
    const int64_t gk = k / group, tiles = (n + NR - 1) / NR, es = half ? 2 : 4;
    const char *sc = (const char *)scale, *of = (const char *)offset;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t t = 0; t < tiles; t++) {
        int64_t j = t * NR;
        for (int64_t i = 0; i < m; i++) {
            if (j + NR <= n)
                q4_rows(a, i, k, codes + j * (k / 2), sc + j * gk * es, of + j * gk * es, group, out + i * n + j, NR,
                        half);
            else
                for (int64_t jj = j; jj < n; jj++)
                    q4_rows(a, i, k, codes + jj * (k / 2), sc + jj * gk * es, of + jj * gk * es, group,
                            out + i * n + jj, 1, half);
        }
    }
}

int ab_q4_matmul(const float *x, int64_t m, int64_t k, const uint8_t *codes, const void *scale,
                 const void *offset, int64_t n, int64_t group, float *out, int threads, int half) {
    if (k % QB || group % QB || k % group) return -2;
    act_t a;
    if (quantize_activations(x, m, k, group, &a)) return -1;
    if (half)
        q4_matmul(&a, m, k, codes, scale, offset, n, group, out, threads, 1);
    else
        q4_matmul(&a, m, k, codes, scale, offset, n, group, out, threads, 0);
    free_activations(&a);
    return 0;
}

int ab_q8_matmul(const float *x, int64_t m, int64_t k, const int8_t *codes, const float *scale, int64_t n,
                 float *out, int threads) {
    if (k % QB) return -2;
    act_t a;
    if (quantize_activations(x, m, k, QB, &a)) return -1;
    const int64_t nb = k / QB, tiles = (n + NR - 1) / NR;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t t = 0; t < tiles; t++) {
        int64_t j = t * NR;
        for (int64_t i = 0; i < m; i++) {
            if (j + NR <= n)
                q8_rows(&a, i, k, codes + j * k, scale + j * nb, out + i * n + j, NR);
            else
                for (int64_t jj = j; jj < n; jj++)
                    q8_rows(&a, i, k, codes + jj * k, scale + jj * nb, out + i * n + jj, 1);
        }
    }
    free_activations(&a);
    return 0;
}

/* Dense fp32 rows of a Q4 weight (prefill multiplies many rows: dequantise once, then one sgemm). */
void ab_q4_dequant(const uint8_t *codes, const void *scale, const void *offset, int64_t n, int64_t k,
                   int64_t group, float *out, int threads, int half) {
    const int64_t nb = k / QB, per = group / QB, gk = k / group;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t j = 0; j < n; j++) {
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *c = codes + j * (k / 2) + b * 16;
            const int64_t g = per == 1 ? b : b / per;
            float s = ld(scale, j * gk + g, half), o = ld(offset, j * gk + g, half);
            float *dst = out + j * k + b * QB;
            for (int i = 0; i < 16; i++) {
                dst[i] = (float)(c[i] & 0x0F) * s + o;
                dst[i + 16] = (float)(c[i] >> 4) * s + o;
            }
        }
    }
}

/* Dense fp32 rows `rows[0 .. r)` of a Q8 weight (an embedding lookup). */
void ab_q8_rows(const int8_t *codes, const float *scale, int64_t k, const int64_t *rows, int64_t r, float *out) {
    const int64_t nb = k / QB;
    for (int64_t i = 0; i < r; i++) {
        const int8_t *c = codes + rows[i] * k;
        const float *s = scale + rows[i] * nb;
        for (int64_t e = 0; e < k; e++) out[i * k + e] = (float)c[e] * s[e / QB];
    }
}
