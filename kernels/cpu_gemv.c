/* Weight-only quantised matmuls for x86-64 CPUs with AVX2 + FMA, or AVX-VNNI / AVX-512 VNNI (one build per
 * variant, at first use, by cpu_gemv.py; cpu_gemv.h holds the only code that differs between them).
 *
 * Decode reads every weight once per token, so on a CPU its speed is memory bandwidth over bytes per
 * weight. torch's int4/int8 weight-only kernels are compute-bound on AVX2 (no AVX512-BF16), so they buy
 * memory but not speed; these keep the weights 4- or 8-bit and stream them at bandwidth.
 *
 * Activations are quantised per block of 32 to int8 with one fp32 scale (d = max|x| / 127), as llama.cpp
 * does, so one block's dot product is integer arithmetic (u8 x s8 products summed to int32: vpdpbusd, or
 * AVX2's pairs to int16, then int32) and one FMA. Offsets (asymmetric 4-bit) multiply the block sums of the
 * rounded x. Several rows of x (2-16: a batch, a speculative verify, a chunk's tail) share each tile's pass:
 * its codes are read and unpacked once for up to MR = 4 rows, so a row's extra cost is its dot products.
 *
 * Rows come in tiles of NR = 4 (the last one padded with zero rows), each tile stored block by block:
 * Q4: codes [N/4][K/32][4][16] bytes, byte j of a row's block holding element j (low nibble) and j + 16
 *     (high nibble); scales and offsets [N/4][K/group][2][4] (a tile's four scales, then its four offsets),
 *     fp32 or fp16, group a multiple of 32: w = q * scale + offset.
 * Q8: codes [N/4][K/32][4][32] int8; scales [N/4][K/32][4] fp32 or fp16: w = q * scale (GGUF Q8_0).
 * Rows of the output are split over `threads` OpenMP threads (none are started for one).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_gemv.h"

#define QB 32   /* elements per activation block */
#define NR 4    /* weight rows one pass over an activation row serves */
#define MR 4    /* activation rows one pass over a tile serves */

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
        int sums[2];
        const float d = ab_round_block(x + r * QB, a->q + r * QB, sums);
        const int sq = sums[0] + sums[1];
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

/* Four scales (or offsets) of a tile's rows, fp16 or fp32. */
static inline __attribute__((always_inline)) __m128 ld4(const void *p, int64_t i, const int half) {
    return half ? _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)((const uint16_t *)p + i)))
                : _mm_loadu_ps((const float *)p + i);
}

/* MR activation rows (1..4: the caller chunks M) against one tile of NR = 4 weight rows. A tile's block is
 * one 64-byte line of codes, so the tile is one memory stream: with four separate row streams (the rows' own
 * layout) the hardware prefetcher fell behind and the 1536-column down projection ran at half the bandwidth.
 * The block's nibbles are unpacked once for all MR rows, and each row's product of the four weight rows is one
 * vector of int32 sums (q4_dot), so one conversion and one FMA per block and activation row: the per-row cost of
 * a batch (decode of several sequences, a speculative verify, a chunk tail) is the dot products alone. Each
 * activation row's sums and FMAs are the same for any MR, so a row's result does not depend on its batch. */
static inline __attribute__((always_inline)) void q4_tile(const act_t *a, int64_t m0, const int mr, int64_t k,
                                                          const uint8_t *codes, const void *so, int64_t group,
                                                          float *out, int64_t n, const int nr, const int half) {
    const int64_t nb = k / QB, per = group / QB, gk = k / group;
    const __m256i low = _mm256_set1_epi8(0x0F);
    const __m256i dup = _mm256_setr_epi32(0, 0, 2, 2, 1, 1, 3, 3); /* q4_dot's lanes: rows 0 0 2 2 | 1 1 3 3 */
    __m256 acc[MR];
    for (int i = 0; i < mr; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t g = 0; g < gk; g++) { /* groups outside, blocks inside: no division in the loop */
        const __m256 s8 = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(ld4(so, g * 2 * NR, half)), dup);
        for (int64_t b = g * per; b < (g + 1) * per; b++) {
            const uint8_t *c = codes + b * NR * 16;
            /* the next tile's line for this block: the prefetcher alone fell behind at a tile's start */
            _mm_prefetch((const char *)(c + NR * k / 2), _MM_HINT_T0);
            const __m256i r01 = _mm256_loadu_si256((const __m256i *)c), r23 = _mm256_loadu_si256((const __m256i *)(c + 32));
            /* rows 0 | 1 (and 2 | 3) of the tile: elements 0..15 (low nibbles), elements 16..31 (high ones) */
            const __m256i l01 = _mm256_and_si256(r01, low), h01 = _mm256_and_si256(_mm256_srli_epi16(r01, 4), low);
            const __m256i l23 = _mm256_and_si256(r23, low), h23 = _mm256_and_si256(_mm256_srli_epi16(r23, 4), low);
            for (int i = 0; i < mr; i++) {
                const int8_t *xq = a->q + (m0 + i) * k + b * QB;
                const __m256i xlo = _mm256_broadcastsi128_si256(_mm_load_si128((const __m128i *)xq));
                const __m256i xhi = _mm256_broadcastsi128_si256(_mm_load_si128((const __m128i *)(xq + 16)));
                const __m256i p = q4_dot(l01, h01, l23, h23, xlo, xhi);
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(s8, _mm256_broadcast_ss(a->d + (m0 + i) * nb + b)), acc[i]);
            }
        }
    }
    for (int i = 0; i < mr; i++) {
        /* the offsets' term: offset * (sum of the rounded x over the group), four weight rows at once */
        const float *xs = a->gsum + (m0 + i) * gk;
        __m128 oacc = _mm_setzero_ps();
        for (int64_t g = 0; g < gk; g++) oacc = _mm_fmadd_ps(ld4(so, g * 2 * NR + NR, half), _mm_set1_ps(xs[g]), oacc);
        const __m128 r = _mm_hadd_ps(_mm256_castps256_ps128(acc[i]), _mm256_extractf128_ps(acc[i], 1)); /* 0 2 1 3 */
        float o[NR];
        _mm_storeu_ps(o, _mm_add_ps(_mm_shuffle_ps(r, r, _MM_SHUFFLE(3, 1, 2, 0)), oacc));
        for (int j = 0; j < nr; j++) out[(m0 + i) * n + j] = o[j]; /* a padded tail tile stores its real rows */
    }
}

static inline __attribute__((always_inline)) void q8_tile(const act_t *a, int64_t m0, const int mr, int64_t k,
                                                          const int8_t *codes, const void *scale, float *out,
                                                          int64_t n, const int nr, const int half) {
    const int64_t nb = k / QB;
    __m256 acc[MR];
    for (int i = 0; i < mr; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const __m128 s4 = ld4(scale, b * NR, half);
        const __m256 s8 = _mm256_set_m128(s4, s4); /* q8_dot's lanes: rows 0 1 2 3 | 0 1 2 3 */
        _mm_prefetch((const char *)(codes + NR * k + b * NR * QB), _MM_HINT_T0); /* the next tile's block */
        _mm_prefetch((const char *)(codes + NR * k + b * NR * QB + 64), _MM_HINT_T0);
        __m256i w[NR], aw[NR];
        for (int r = 0; r < NR; r++) {
            w[r] = _mm256_loadu_si256((const __m256i *)(codes + (b * NR + r) * QB));
            aw[r] = _mm256_sign_epi8(w[r], w[r]); /* |w| as unsigned, its sign moved onto x: u8 x s8 products */
        }
        for (int i = 0; i < mr; i++) {
            const __m256i xv = _mm256_load_si256((const __m256i *)(a->q + (m0 + i) * k + b * QB));
            const __m256i p = q8_dot(aw, w, xv);
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(s8, _mm256_broadcast_ss(a->d + (m0 + i) * nb + b)), acc[i]);
        }
    }
    for (int i = 0; i < mr; i++) {
        float o[NR];
        _mm_storeu_ps(o, _mm_add_ps(_mm256_castps256_ps128(acc[i]), _mm256_extractf128_ps(acc[i], 1)));
        for (int j = 0; j < nr; j++) out[(m0 + i) * n + j] = o[j];
    }
}

/* One tile of the output (columns j .. j + 4 of every row of x), the rows in chunks of MR: a literal per
 * chunk size, so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void q4_tile_rows(const act_t *a, int64_t m, int64_t k, const uint8_t *codes,
                                                               const char *so, int64_t n, int64_t group, float *out,
                                                               int64_t t, const int half) {
    const int64_t j = t * NR, tile_codes = NR * k / 2, tile_so = k / group * 2 * NR * (half ? 2 : 4);
    const int nr = n - j < NR ? (int)(n - j) : NR;
    const uint8_t *c = codes + t * tile_codes;
    const char *s = so + t * tile_so;
    for (int64_t i = 0; i < m; i += MR) {
        switch (m - i < MR ? m - i : MR) {
            case 1: q4_tile(a, i, 1, k, c, s, group, out + j, n, nr, half); break;
            case 2: q4_tile(a, i, 2, k, c, s, group, out + j, n, nr, half); break;
            case 3: q4_tile(a, i, 3, k, c, s, group, out + j, n, nr, half); break;
            default: q4_tile(a, i, MR, k, c, s, group, out + j, n, nr, half);
        }
    }
}

static inline __attribute__((always_inline)) void q8_tile_rows(const act_t *a, int64_t m, int64_t k, const int8_t *codes,
                                                               const char *scale, int64_t n, float *out, int64_t t,
                                                               const int half) {
    const int64_t j = t * NR, tile_scale = k / QB * NR * (half ? 2 : 4);
    const int nr = n - j < NR ? (int)(n - j) : NR;
    const int8_t *c = codes + t * NR * k;
    const char *s = scale + t * tile_scale;
    for (int64_t i = 0; i < m; i += MR) {
        switch (m - i < MR ? m - i : MR) {
            case 1: q8_tile(a, i, 1, k, c, s, out + j, n, nr, half); break;
            case 2: q8_tile(a, i, 2, k, c, s, out + j, n, nr, half); break;
            case 3: q8_tile(a, i, 3, k, c, s, out + j, n, nr, half); break;
            default: q8_tile(a, i, MR, k, c, s, out + j, n, nr, half);
        }
    }
}

const char *ab_isa(void) { return AB_ISA; }

/* Tiles are split over threads. Each `half` has its own parallel loop: GCC outlines an OpenMP region before
 * inlining, so one region shared by both would take `half` as a run-time value (measured 2x slower in
 * cpu_bits.c), not the literal each variant is compiled for. */
int ab_q4_matmul(const float *x, int64_t m, int64_t k, const uint8_t *codes, const void *so, int64_t n,
                 int64_t group, float *out, int threads, int half) {
    if (k % QB || group % QB || k % group) return -2;
    act_t a;
    if (quantize_activations(x, m, k, group, &a)) return -1;
    const int64_t tiles = (n + NR - 1) / NR;
    const char *s = (const char *)so;
    if (half) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
        for (int64_t t = 0; t < tiles; t++) q4_tile_rows(&a, m, k, codes, s, n, group, out, t, 1);
    } else {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
        for (int64_t t = 0; t < tiles; t++) q4_tile_rows(&a, m, k, codes, s, n, group, out, t, 0);
    }
    free_activations(&a);
    return 0;
}

int ab_q8_matmul(const float *x, int64_t m, int64_t k, const int8_t *codes, const void *scale, int64_t n,
                 float *out, int threads, int half) {
    if (k % QB) return -2;
    act_t a;
    if (quantize_activations(x, m, k, QB, &a)) return -1;
    const int64_t tiles = (n + NR - 1) / NR;
    const char *s = (const char *)scale;
    if (half) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
        for (int64_t t = 0; t < tiles; t++) q8_tile_rows(&a, m, k, codes, s, n, out, t, 1);
    } else {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
        for (int64_t t = 0; t < tiles; t++) q8_tile_rows(&a, m, k, codes, s, n, out, t, 0);
    }
    free_activations(&a);
    return 0;
}

/* Dense fp32 rows of a Q4 weight (prefill multiplies many rows: dequantise once, then one sgemm). */
void ab_q4_dequant(const uint8_t *codes, const void *so, int64_t n, int64_t k, int64_t group, float *out,
                   int threads, int half) {
    const int64_t nb = k / QB, per = group / QB, gk = k / group;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t j = 0; j < n; j++) {
        const int64_t t = j / NR, r = j % NR;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *c = codes + ((t * nb + b) * NR + r) * 16;
            const int64_t sg = (t * gk + b / per) * 2 * NR + r;
            const float s = ld(so, sg, half), o = ld(so, sg + NR, half);
            float *dst = out + j * k + b * QB;
            for (int i = 0; i < 16; i++) {
                dst[i] = (float)(c[i] & 0x0F) * s + o;
                dst[i + 16] = (float)(c[i] >> 4) * s + o;
            }
        }
    }
}

/* Dense fp32 rows `rows[0 .. r)` of a Q8 weight (an embedding lookup). */
void ab_q8_rows(const int8_t *codes, const void *scale, int64_t k, const int64_t *rows, int64_t r, float *out,
                int half) {
    const int64_t nb = k / QB;
    for (int64_t i = 0; i < r; i++) {
        const int64_t t = rows[i] / NR, lane = rows[i] % NR;
        for (int64_t b = 0; b < nb; b++) {
            const int8_t *c = codes + ((t * nb + b) * NR + lane) * QB;
            const float s = ld(scale, (t * nb + b) * NR + lane, half);
            for (int e = 0; e < QB; e++) out[i * k + b * QB + e] = (float)c[e] * s;
        }
    }
}
