/* Weight-only quantised matmuls for x86-64 CPUs with AVX2 + FMA, or AVX-VNNI / AVX-512 VNNI (one build per
 * variant, at first use, by cpu_gemv.py; cpu_gemv.h holds the dot products that differ between them, and some
 * passes have a form of their own here: the AVX-512 build's Q4 passes take two tiles at a time, q4_pair).
 *
 * Decode reads every weight once per token, so on a CPU its speed is memory bandwidth over bytes per
 * weight. torch's int4/int8 weight-only kernels are compute-bound on AVX2 (no AVX512-BF16), so they buy
 * memory but not speed; these keep the weights 4- or 8-bit and stream them at bandwidth.
 *
 * Activations are quantised per block of 32 to int8 with one fp32 scale (d = max|x| / 127), as llama.cpp
 * does, so one block's dot product is integer arithmetic (u8 x s8 products summed to int32: vpdpbusd, or
 * AVX2's pairs to int16, then int32) and one FMA. Offsets (asymmetric 4-bit) multiply the block sums of the
 * rounded x. Several rows of x (2-16: a batch, a speculative verify, a chunk's tail) share each tile's pass:
 * its codes are read and unpacked once for up to MR4 = 8 rows (Q8: MR = 4), so a row's extra cost is its dot
 * products.
 *
 * Rows come in tiles of NR = 4 (the last one padded with zero rows), each tile stored block by block:
 * Q4: codes [N/4][K/32][2][4][8] bytes: half h, row r, byte i holds elements e = 16 h + (i < 4 ? i : i + 4)
 *     and e + 4, e in the low nibble for even rows and in the high one for odd rows. So a block's 64 bytes
 *     unpack (AND, shift) into four vectors whose int32 lane j holds four codes of row j / 2, of its elements
 *     0..7 and 16..23 (j even) or 8..15 and 24..31 (j odd), against activations stored as four 16-byte
 *     operands (q4_expand): the products sum vertically into one vector of the tile's eight half-row sums
 *     (q4_dot in cpu_gemv.h), with no horizontal add per activation row.
 *     Scales and offsets [N/4][K/group][2][4] (a tile's four scales, then its four offsets), fp32 or fp16,
 *     group a multiple of 32: w = q * scale + offset.
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
#define MR 4    /* activation rows one pass over a Q8 tile serves */
#define MR4 8   /* activation rows one pass over a Q4 tile serves (its per-row loop holds fewer registers) */

#define MC 64   /* Q4: rows a slice of the activations holds (see ab_q4_matmul) */

/* One-row passes (decode) prefetch the weight stream this far ahead into L2 (prefetcht1), not into L1: on the
 * 2-core EPYC (Zen 4) a decode's Q4 linears ran at 9-12 GB/s from memory on one thread with the next pair's lines
 * fetched into L1 (farther L1 prefetches no better), and at 16-24 GB/s with these (SmolLM2's four linears over 30
 * layers, 66 MB, one thread, fastest of 40 passes: 5.2-5.4 -> 3.6-3.7 ms; 2 pairs ahead 3.8-4.6, 8 pairs 3.9-4.2,
 * 16 pairs 4.3-4.7, prefetchnta 6.2-6.4); the Q8 output table (30 MB, 8 tiles ahead) 1.9-2.0 -> 1.4-1.6 ms. */
#define Q4_AHEAD 8 /* tiles: four pairs of the AVX-512 pass (q4_pair) */
#define Q8_AHEAD 8

#ifdef __AVX512F__
#define Q4_UNIT 2 /* tiles a Q4 pass serves (q4_pair) */
#else
#define Q4_UNIT 1
#endif

typedef struct {
    int8_t *q;     /* [M][K], or for Q4 per slice [K/32][rows][4][16]: a block as q4_dot's operands (q4_expand) */
    float *d;      /* [M][K/32] (Q4: per slice [K/32][rows]) */
    float *gsum;   /* [M][K/group] (Q4: per slice [K/group][rows]): sums of the rounded x per scale group */
    int64_t m;     /* Q4: the slice's rows */
} act_t;
/* Q4 keeps a block's rows side by side, so the kernel's loop over rows reads at constant offsets from one
 * pointer (eight row pointers, the rows' own layout, did not fit in the registers), in slices of MC rows, so
 * a slice is one stretch of memory (all rows side by side put a block's rows M x 64 bytes apart: at 256 rows
 * the blocks of a tile's pass fell on a few cache sets, twice the time a row of 128). */

/* A block's activations q[32] as q4_dot's four operands out[4][16], in quadwords of elements 4j..4j + 3:
 * (0 2 1 3) (1 3 0 2) (4 6 5 7) (5 7 4 6). Lanes 0 and 1 of each half of the code vectors see quadwords
 * 0 1 4 5 (elements 0..7, 16..23) and 2 3 6 7, lanes 2 and 3 the same sets in another order (the odd rows'
 * swapped nibbles). 64 bytes a block, each operand one 16-byte broadcast in the kernel. */
static inline void q4_expand(const int8_t *q, int8_t *out) {
    const __m256i perm = _mm256_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15,
                                          0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15);
    const __m256i y = _mm256_shuffle_epi8(_mm256_loadu_si256((const __m256i *)q), perm);
    const __m256i z = _mm256_shuffle_epi32(y, _MM_SHUFFLE(1, 0, 3, 2)); /* the quadwords of each half swapped */
    _mm256_storeu_si256((__m256i *)out, _mm256_permute2x128_si256(y, z, 0x20));
    _mm256_storeu_si256((__m256i *)(out + 32), _mm256_permute2x128_si256(y, z, 0x31));
}

static int quantize_activations(const float *x, int64_t m, int64_t k, int64_t group, const int q4, act_t *a) {
    const int64_t nb = k / QB, per = group / QB, gk = k / group;
    a->q = (int8_t *)aligned_alloc(32, (size_t)((m * k * (q4 ? 2 : 1) + 31) / 32 * 32));
    a->d = (float *)malloc(sizeof(float) * (size_t)(m * nb));
    a->gsum = (float *)malloc(sizeof(float) * (size_t)(m * gk));
    if (!a->q || !a->d || !a->gsum) return -1;
    /* by row and scale group: no int64 division a block, as in one loop over the m * nb blocks */
    for (int64_t row = 0; row < m; row++) {
        const int64_t i0 = row / MC * MC, mc = m - i0 < MC ? m - i0 : MC, ri = row - i0;
        for (int64_t g = 0, b = 0; g < gk; g++) {
            float gs = 0.0f;
            for (int64_t j = 0; j < per; j++, b++) {
                int sums[2];
                int8_t q[QB];
                const int64_t r = row * nb + b;
                const float d = ab_round_block(x + r * QB, q4 ? q : a->q + r * QB, sums);
                if (q4) q4_expand(q, a->q + (i0 * nb + b * mc + ri) * 2 * QB);
                const int sq = sums[0] + sums[1];
                a->d[q4 ? i0 * nb + b * mc + ri : r] = d;
                /* The sum of the quantised block, so the result is exactly that of x rounded to d * q: a many-row
                 * caller can dequantise the weight and multiply the same rounded x (numbers independent of M). */
                gs += d * (float)sq;
            }
            a->gsum[q4 ? i0 * gk + g * mc + ri : row * gk + g] = gs;
        }
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
/* A tile's four results of one activation row: (rows 0 2 1 3 of the pair sums, summed) + the offsets' term. A
 * masked store for a padded tail tile (a plain loop of nr stores compiles to a call to memcpy per row). */
static inline __attribute__((always_inline)) void store4(float *dst, __m128 v, const int nr) {
    if (nr == NR)
        _mm_storeu_ps(dst, v);
    else
        _mm_maskstore_ps(dst, _mm_cmpgt_epi32(_mm_set1_epi32(nr), _mm_setr_epi32(0, 1, 2, 3)), v);
}

static inline __attribute__((always_inline)) void q4_tile(const act_t *a, int64_t m0, const int mr, int64_t k,
                                                          const uint8_t *codes, const void *so, int64_t group,
                                                          float *out, int64_t n, const int nr, const int half,
                                                          const int g32) {
    const int64_t nb = k / QB, per = group / QB, gk = k / group;
    const __m256i low = _mm256_set1_epi8(0x0F);
    const __m256i dup = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3); /* q4_dot's lanes: rows 0 0 1 1 2 2 3 3 */
    const int64_t m = a->m;
    const int8_t *xq = a->q + m0 * 2 * QB; /* block b, row i: xq + (b m + i) 2 QB */
    const float *xd = a->d + m0, *xs = a->gsum + m0;
    __m256 acc[MR4];
    __m128 oacc[MR4];
    for (int i = 0; i < mr; i++) {
        acc[i] = _mm256_setzero_ps();
        oacc[i] = _mm_setzero_ps();
    }
    __m256 s8 = _mm256_setzero_ps();
    for (int64_t b = 0, g = 0, left = 0; b < nb; b++) { /* left: blocks to the next scale group */
        if (left == 0) {
            s8 = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(ld4(so, g * 2 * NR, half)), dup);
            /* the offsets' term, offset * (sum of the rounded x over the group), four weight rows at once: for
             * a few rows here, not after the blocks, where one row waited on one chain of gk dependent FMAs */
            if (mr < 4) {
                const __m128 o4 = ld4(so, g * 2 * NR + NR, half);
                for (int i = 0; i < mr; i++) oacc[i] = _mm_fmadd_ps(o4, _mm_set1_ps(xs[g * m + i]), oacc[i]);
            }
            left = g32 ? 1 : per;
            g++;
        }
        left--;
        const uint8_t *c = codes + b * NR * 16;
        /* the next tile's line for this block: the prefetcher alone fell behind at a tile's start (prefetcht1
         * Q4_AHEAD tiles on, as q4_pair's, was no faster in the AVX2 build on the EPYC) */
        _mm_prefetch((const char *)(c + NR * k / 2), _MM_HINT_T0);
        const __m256i c0 = _mm256_loadu_si256((const __m256i *)c), c1 = _mm256_loadu_si256((const __m256i *)(c + 32));
        const __m256i v[4] = {_mm256_and_si256(c0, low), _mm256_and_si256(_mm256_srli_epi16(c0, 4), low),
                              _mm256_and_si256(c1, low), _mm256_and_si256(_mm256_srli_epi16(c1, 4), low)};
#pragma GCC unroll 8
        for (int i = 0; i < mr; i++) {
            const __m128i *xb = (const __m128i *)(xq + (b * m + i) * 2 * QB);
            const __m256i x[4] = {_mm256_broadcastsi128_si256(_mm_load_si128(xb)), _mm256_broadcastsi128_si256(_mm_load_si128(xb + 1)),
                                  _mm256_broadcastsi128_si256(_mm_load_si128(xb + 2)), _mm256_broadcastsi128_si256(_mm_load_si128(xb + 3))};
            const __m256i p = q4_dot(v, x);
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(s8, _mm256_broadcast_ss(xd + b * m + i)), acc[i]);
        }
    }
    if (mr >= 4) /* many rows: their chains side by side here, where the registers are free again */
        for (int64_t g = 0; g < gk; g++) {
            const __m128 o4 = ld4(so, g * 2 * NR + NR, half);
            for (int i = 0; i < mr; i++) oacc[i] = _mm_fmadd_ps(o4, _mm_set1_ps(xs[g * m + i]), oacc[i]);
        }
    for (int i = 0; i < mr; i++) { /* each row's two half sums, then its offsets' term */
        const __m128 r = _mm_hadd_ps(_mm256_castps256_ps128(acc[i]), _mm256_extractf128_ps(acc[i], 1));
        store4(out + (m0 + i) * n, _mm_add_ps(r, oacc[i]), nr);
    }
}

#if Q4_UNIT == 2
/* The avx512-vnni build: two tiles (8 weight rows) side by side in 512-bit vectors, tile t in the low half and
 * t + 1 in the high one, each half exactly q4_tile's vector. A block's codes of both tiles are unpacked once
 * for all MR4 rows, and a row's 16-byte activation operands are broadcast to all four 128-bit lanes, so one
 * vpdpbusd / conversion / multiply / FMA serves 8 weight rows where q4_tile's serve 4: the 8-row pass is
 * half the instructions (at K 1536 the loop, not memory, set its time). Each lane sees the same integer sums
 * and the same fp32 operations in the same order as in q4_tile, so the bits are the AVX2 build's. */
static inline __attribute__((always_inline)) __m512i q4_dot512(const __m512i *v, const __m512i *x) {
    /* one chain (exact integer sums in any order): no add and one zero register fewer than q4_dot's two */
    const __m512i p = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), v[0], x[0]), v[1], x[1]);
    return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(p, v[2], x[2]), v[3], x[3]);
}

/* Two tiles' four scales (or offsets): tile t's, then t + 1's (`next`: bytes to it); fp16 in one conversion. */
static inline __attribute__((always_inline)) __m256 ld8(const char *p, int64_t next, int64_t i, const int half) {
    if (half) {
        const __m128d t = _mm_castsi128_pd(_mm_loadl_epi64((const __m128i *)((const uint16_t *)p + i)));
        return _mm256_cvtph_ps(_mm_castpd_si128(_mm_loadh_pd(t, (const double *)((const uint16_t *)(p + next) + i))));
    }
    return _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_loadu_ps((const float *)p + i)),
                                _mm_loadu_ps((const float *)(p + next) + i), 1);
}

static inline __attribute__((always_inline)) void q4_pair(const act_t *a, int64_t m0, const int mr, int64_t k,
                                                          const uint8_t *codes, const char *so, int64_t tile_so,
                                                          int64_t group, float *out, int64_t n, const int nr,
                                                          const int half, const int g32) {
    const int64_t nb = k / QB, per = group / QB, tile_codes = NR * k / 2;
    const __m512i low = _mm512_set1_epi8(0x0F);
    const __m512i dup = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    const int64_t m = a->m;
    const int8_t *xq = a->q + m0 * 2 * QB;
    const float *xd = a->d + m0, *xs = a->gsum + m0;
    __m512 acc[MR4];
    __m256 oacc[MR4]; /* row i's offsets' term of both tiles */
    for (int i = 0; i < mr; i++) {
        acc[i] = _mm512_setzero_ps();
        oacc[i] = _mm256_setzero_ps();
    }
    __m512 s16 = _mm512_setzero_ps();
    for (int64_t b = 0, g = 0, left = 0; b < nb; b++) {
        if (left == 0) {
            /* the next pair's scales and offsets of this group (at 8 rows a cold weight's pass ran 1.2x its warm time) */
            const char *sg = so + g * 2 * NR * (half ? 2 : 4);
            _mm_prefetch(sg + 2 * tile_so, _MM_HINT_T0);
            _mm_prefetch(sg + 3 * tile_so, _MM_HINT_T0);
            s16 = _mm512_permutexvar_ps(dup, _mm512_castps256_ps512(ld8(so, tile_so, g * 2 * NR, half)));
            /* the offsets' term here for any rows (32 registers hold them; measured 2-13 % faster at 8 rows than
             * after the blocks, or than two rows an FMA on sums stored 8 times, 12 KB more of L1 at K 1536) */
            const __m256 o8 = ld8(so, tile_so, g * 2 * NR + NR, half);
            for (int i = 0; i < mr; i++) oacc[i] = _mm256_fmadd_ps(o8, _mm256_set1_ps(xs[g * m + i]), oacc[i]);
            left = g32 ? 1 : per;
            g++;
        }
        left--;
        const uint8_t *c = codes + b * NR * 16;
        _mm_prefetch((const char *)(c + Q4_AHEAD * tile_codes), _MM_HINT_T1); /* this block's lines Q4_AHEAD tiles on */
        _mm_prefetch((const char *)(c + (Q4_AHEAD + 1) * tile_codes), _MM_HINT_T1);
        const __m512i c0 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)c)),
                                              _mm256_loadu_si256((const __m256i *)(c + tile_codes)), 1);
        const __m512i c1 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(c + 32))),
                                              _mm256_loadu_si256((const __m256i *)(c + tile_codes + 32)), 1);
        const __m512i v[4] = {_mm512_and_si512(c0, low), _mm512_and_si512(_mm512_srli_epi16(c0, 4), low),
                              _mm512_and_si512(c1, low), _mm512_and_si512(_mm512_srli_epi16(c1, 4), low)};
#pragma GCC unroll 8
        for (int i = 0; i < mr; i++) {
            const __m128i *xb = (const __m128i *)(xq + (b * m + i) * 2 * QB);
            const __m512i x[4] = {_mm512_broadcast_i32x4(_mm_load_si128(xb)), _mm512_broadcast_i32x4(_mm_load_si128(xb + 1)),
                                  _mm512_broadcast_i32x4(_mm_load_si128(xb + 2)), _mm512_broadcast_i32x4(_mm_load_si128(xb + 3))};
            const __m512i p = q4_dot512(v, x);
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(s16, _mm512_set1_ps(xd[b * m + i])), acc[i]);
        }
    }
    for (int i = 0; i < mr; i++) {
        const __m256 lo = _mm512_castps512_ps256(acc[i]), hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[i]), 1));
        const __m128 r0 = _mm_hadd_ps(_mm256_castps256_ps128(lo), _mm256_extractf128_ps(lo, 1));
        const __m128 r1 = _mm_hadd_ps(_mm256_castps256_ps128(hi), _mm256_extractf128_ps(hi, 1));
        store4(out + (m0 + i) * n, _mm_add_ps(r0, _mm256_castps256_ps128(oacc[i])), NR);
        store4(out + (m0 + i) * n + NR, _mm_add_ps(r1, _mm256_extractf128_ps(oacc[i], 1)), nr);
    }
}
#endif

static inline __attribute__((always_inline)) void q8_tile(const act_t *a, int64_t m0, const int mr, int64_t k,
                                                          const int8_t *codes, const void *scale, float *out,
                                                          int64_t n, const int nr, const int half) {
    const int64_t nb = k / QB;
    __m256 acc[MR];
    for (int i = 0; i < mr; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const __m128 s4 = ld4(scale, b * NR, half);
        const __m256 s8 = _mm256_set_m128(s4, s4); /* q8_dot's lanes: rows 0 1 2 3 | 0 1 2 3 */
        _mm_prefetch((const char *)(codes + Q8_AHEAD * NR * k + b * NR * QB), _MM_HINT_T1); /* Q8_AHEAD tiles on */
        _mm_prefetch((const char *)(codes + Q8_AHEAD * NR * k + b * NR * QB + 64), _MM_HINT_T1);
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

/* One unit of the output (Q4_UNIT tiles: columns j .. j + 4 or j + 8 of every row of x), the rows in chunks of
 * MR4: a literal per chunk size, so the accumulators stay in registers. A lone last tile takes q4_tile. */
static inline __attribute__((always_inline)) void q4_tile_rows(const act_t *a, int64_t i, int64_t m, int64_t k,
                                                               const uint8_t *codes, const char *so, int64_t n,
                                                               int64_t group, float *out, int64_t u, const int half,
                                                               const int g32) {
    const int64_t j = u * Q4_UNIT * NR, tile_codes = NR * k / 2, tile_so = k / group * 2 * NR * (half ? 2 : 4);
    const int nr = n - j < NR ? (int)(n - j) : NR;
    const uint8_t *c = codes + u * Q4_UNIT * tile_codes;
    const char *s = so + u * Q4_UNIT * tile_so;
#if Q4_UNIT == 2
    if (n - j > NR) { /* a pair of tiles; the second holds nr2 rows */
        const int nr2 = n - j - NR < NR ? (int)(n - j - NR) : NR;
        while (i < m) {
            const int64_t left = m - i;
            const int mr = left >= MR4 ? MR4 : left >= 4 ? 4 : (int)left;
            switch (mr) {
                case 1: q4_pair(a, i, 1, k, c, s, tile_so, group, out + j, n, nr2, half, g32); break;
                case 2: q4_pair(a, i, 2, k, c, s, tile_so, group, out + j, n, nr2, half, g32); break;
                case 3: q4_pair(a, i, 3, k, c, s, tile_so, group, out + j, n, nr2, half, g32); break;
                case 4: q4_pair(a, i, 4, k, c, s, tile_so, group, out + j, n, nr2, half, g32); break;
                default: q4_pair(a, i, MR4, k, c, s, tile_so, group, out + j, n, nr2, half, g32);
            }
            i += mr;
        }
        return;
    }
#endif
    while (i < m) { /* rows i .. m in chunks of 8, then 4, 3, 2, 1: five copies of the loop, not eight */
        const int64_t left = m - i;
        const int mr = left >= MR4 ? MR4 : left >= 4 ? 4 : (int)left;
        switch (mr) {
            case 1: q4_tile(a, i, 1, k, c, s, group, out + j, n, nr, half, g32); break;
            case 2: q4_tile(a, i, 2, k, c, s, group, out + j, n, nr, half, g32); break;
            case 3: q4_tile(a, i, 3, k, c, s, group, out + j, n, nr, half, g32); break;
            case 4: q4_tile(a, i, 4, k, c, s, group, out + j, n, nr, half, g32); break;
            default: q4_tile(a, i, MR4, k, c, s, group, out + j, n, nr, half, g32);
        }
        i += mr;
    }
}

#ifdef __AVX512VNNI__
/* One activation row over one Q8 tile (a decode; a Q8_0 file's LM head is 330 MB a token): the tile's four rows
 * of a block in two 512-bit registers against the row's block in both halves, the sign moved onto x (|w| as
 * unsigned, x negated where w < 0: one vpdpbusd a register, where q8_tile spends two signs and a 256-bit product a
 * row and three hadds), then two permute-and-add levels take the 4-lane sums to q8_tile's lanes (rows 0-3 over
 * bytes 0-15, then over bytes 16-31). The integer sums are exact and the float steps q8_tile's, so are the bits.
 * The LM head of a Q8_0 Qwen3-30B-A3B (151,936 x 2048, fp16 scales, 2 MiB pages, one thread on the EPYC):
 * 12.5-14.8 ms with q8_tile, 10.5-12.9 with this (fastest of 20 calls, alternating builds, load 1-2). */
static inline __attribute__((always_inline)) void q8_row(const act_t *a, int64_t k, const int8_t *codes,
                                                         const void *scale, float *out, const int nr, const int half) {
    const int64_t nb = k / QB;
    const __m512i zero = _mm512_setzero_si512();
    /* concat(p0, p1)'s 32 lanes, row r's bytes 0-15 in lanes 8r .. 8r+3 and 16-31 in 8r+4 .. 8r+7: adjacent pairs */
    const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odd = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    /* then row r's halves: lanes 4r, 4r+1 (bytes 0-15) and 4r+2, 4r+3 (16-31) of the pairs, in q8_tile's order */
    const __m512i lo = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 14, 10, 6, 2, 12, 8, 4, 0);
    const __m512i hi = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 15, 11, 7, 3, 13, 9, 5, 1);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const __m128 s4 = ld4(scale, b * NR, half);
        const __m256 s8 = _mm256_set_m128(s4, s4);
        _mm_prefetch((const char *)(codes + Q8_AHEAD * NR * k + b * NR * QB), _MM_HINT_T1);
        _mm_prefetch((const char *)(codes + Q8_AHEAD * NR * k + b * NR * QB + 64), _MM_HINT_T1);
        const __m512i w0 = _mm512_loadu_si512((const void *)(codes + b * NR * QB));
        const __m512i w1 = _mm512_loadu_si512((const void *)(codes + b * NR * QB + 64));
        const __m512i x = _mm512_broadcast_i64x4(_mm256_load_si256((const __m256i *)(a->q + b * QB)));
        const __m512i p0 = _mm512_dpbusd_epi32(zero, _mm512_abs_epi8(w0), _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w0), zero, x));
        const __m512i p1 = _mm512_dpbusd_epi32(zero, _mm512_abs_epi8(w1), _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w1), zero, x));
        const __m512i u = _mm512_add_epi32(_mm512_permutex2var_epi32(p0, even, p1), _mm512_permutex2var_epi32(p0, odd, p1));
        const __m256i p = _mm512_castsi512_si256(_mm512_add_epi32(_mm512_permutexvar_epi32(lo, u), _mm512_permutexvar_epi32(hi, u)));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(s8, _mm256_broadcast_ss(a->d + b)), acc);
    }
    float o[NR];
    _mm_storeu_ps(o, _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1)));
    for (int j = 0; j < nr; j++) out[j] = o[j];
}
#endif

static inline __attribute__((always_inline)) void q8_tile_rows(const act_t *a, int64_t m, int64_t k, const int8_t *codes,
                                                               const char *scale, int64_t n, float *out, int64_t t,
                                                               const int half) {
    const int64_t j = t * NR, tile_scale = k / QB * NR * (half ? 2 : 4);
    const int nr = n - j < NR ? (int)(n - j) : NR;
    const int8_t *c = codes + t * NR * k;
    const char *s = scale + t * tile_scale;
#ifdef __AVX512VNNI__
    if (m == 1) {
        q8_row(a, k, c, s, out + j, nr, half);
        return;
    }
#endif
    for (int64_t i = 0; i < m; i += MR) {
        switch (m - i < MR ? m - i : MR) {
            case 1: q8_tile(a, i, 1, k, c, s, out + j, n, nr, half); break;
            case 2: q8_tile(a, i, 2, k, c, s, out + j, n, nr, half); break;
            case 3: q8_tile(a, i, 3, k, c, s, out + j, n, nr, half); break;
            default: q8_tile(a, i, MR, k, c, s, out + j, n, nr, half);
        }
    }
}

#ifdef AB_DPBUSD
/* Q8 with VNNI, for several rows: q8_tile's products for an activation row are four sign flips, four vpdpbusd
 * and three horizontal adds (six shuffles), all per row, so an extra row cost 0.4 of a row alone at 8 rows. Here
 * the per-row work is four vpdpbusd, and what needs shuffles is done once per block for all the rows: the
 * tile's four weight rows are transposed (8 unpacks) so vector q holds, at int32 lane 4 h + r, row r's dword
 * 4 h + q (its elements 16 h + 4 q .. + 3); against the row's block expanded once per call (q8_expand: dword q
 * of each half, in lanes 0..3 and 4..7) four vpdpbusd sum each half-row in its own lane, the lanes q8_dot
 * gives (rows 0 1 2 3 | 0 1 2 3). vpdpbusd multiplies u8 by s8, so the activations are stored + 128 (x ^ 0x80)
 * and the sums start from -128 x the weights' sums (once per block): integer sums, exact, so the same int32 as
 * q8_dot and the same fp32 work after it, the AVX2 bits. AVX2's maddubs would saturate on x + 128: it keeps
 * q8_tile. */
#define MR8 8 /* activation rows one pass over a Q8 tile serves here (AVX-512VL: 32 vector registers) */

static inline __attribute__((always_inline)) void q8v_tile(const int8_t *xe, const float *xd, int64_t m0, const int mr,
                                                           int64_t k, const int8_t *codes, const void *scale, float *out,
                                                           int64_t n, const int nr, const int half) {
    const int64_t nb = k / QB;
    const __m256i bias = _mm256_set1_epi8((char)0x80); /* 128 as u8: dpbusd(0, bias, w) = 128 x the sums */
    __m256 acc[MR8];
    for (int i = 0; i < mr; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const __m128 s4 = ld4(scale, b * NR, half);
        const __m256 s8 = _mm256_set_m128(s4, s4);
        _mm_prefetch((const char *)(codes + NR * k + b * NR * QB), _MM_HINT_T0); /* the next tile's block */
        _mm_prefetch((const char *)(codes + NR * k + b * NR * QB + 64), _MM_HINT_T0);
        const int8_t *c = codes + b * NR * QB;
        const __m256i w0 = _mm256_loadu_si256((const __m256i *)c), w1 = _mm256_loadu_si256((const __m256i *)(c + 32));
        const __m256i w2 = _mm256_loadu_si256((const __m256i *)(c + 64)), w3 = _mm256_loadu_si256((const __m256i *)(c + 96));
        const __m256i t0 = _mm256_unpacklo_epi32(w0, w1), t1 = _mm256_unpackhi_epi32(w0, w1);
        const __m256i t2 = _mm256_unpacklo_epi32(w2, w3), t3 = _mm256_unpackhi_epi32(w2, w3);
        const __m256i v[4] = {_mm256_unpacklo_epi64(t0, t2), _mm256_unpackhi_epi64(t0, t2),
                              _mm256_unpacklo_epi64(t1, t3), _mm256_unpackhi_epi64(t1, t3)};
        const __m256i z = _mm256_setzero_si256();
        const __m256i base = _mm256_sub_epi32(z, AB_DPBUSD(AB_DPBUSD(AB_DPBUSD(AB_DPBUSD(z, bias, v[0]), bias, v[1]), bias, v[2]), bias, v[3]));
#pragma GCC unroll 8
        for (int i = 0; i < mr; i++) {
            const __m256i *x = (const __m256i *)(xe + ((m0 + i) * nb + b) * 4 * QB);
            const __m256i p = AB_DPBUSD(AB_DPBUSD(AB_DPBUSD(AB_DPBUSD(base, _mm256_load_si256(x), v[0]), _mm256_load_si256(x + 1), v[1]),
                                                  _mm256_load_si256(x + 2), v[2]), _mm256_load_si256(x + 3), v[3]);
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(s8, _mm256_broadcast_ss(xd + (m0 + i) * nb + b)), acc[i]);
        }
    }
    for (int i = 0; i < mr; i++) /* each row's two half sums, as q8_tile */
        store4(out + (m0 + i) * n, _mm_add_ps(_mm256_castps256_ps128(acc[i]), _mm256_extractf128_ps(acc[i], 1)), nr);
}

#ifdef __AVX512VNNI__
/* AVX-512: two activation rows per 512-bit vector (the tile's transposed block in both halves), so a pair of rows
 * is four vpdpbusd, one conversion, one multiply and one FMA. Each lane's arithmetic is q8v_tile's. The rows'
 * expanded blocks are stored in pairs ([pair][block][q][2][32], a zero row after an odd last one) and their
 * scales as [pair][block][2][8]. */
#define MP 8 /* row pairs one pass serves */
static inline __attribute__((always_inline)) void q8z_tile(const int8_t *xe, const float *xd, int64_t p0, const int mp,
                                                           int64_t m, int64_t k, const int8_t *codes, const void *scale,
                                                           float *out, int64_t n, const int nr, const int half) {
    const int64_t nb = k / QB;
    __m512 acc[MP];
    for (int i = 0; i < mp; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const __m128 s4 = ld4(scale, b * NR, half);
        const __m512 s16 = _mm512_broadcast_f32x4(s4);
        _mm_prefetch((const char *)(codes + NR * k + b * NR * QB), _MM_HINT_T0);
        _mm_prefetch((const char *)(codes + NR * k + b * NR * QB + 64), _MM_HINT_T0);
        const int8_t *c = codes + b * NR * QB;
        q8z_block(_mm256_loadu_si256((const __m256i *)c), _mm256_loadu_si256((const __m256i *)(c + 32)),
                  _mm256_loadu_si256((const __m256i *)(c + 64)), _mm256_loadu_si256((const __m256i *)(c + 96)), s16,
                  xe + (p0 * nb + b) * 8 * QB, nb * 8 * QB, xd + (p0 * nb + b) * 16, nb * 16, mp, acc);
    }
    for (int i = 0; i < mp; i++) {
        const int64_t r = 2 * (p0 + i);
        const __m256 a0 = _mm512_castps512_ps256(acc[i]), a1 = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[i]), 1));
        store4(out + r * n, _mm_add_ps(_mm256_castps256_ps128(a0), _mm256_extractf128_ps(a0, 1)), nr);
        if (r + 1 < m) store4(out + (r + 1) * n, _mm_add_ps(_mm256_castps256_ps128(a1), _mm256_extractf128_ps(a1, 1)), nr);
    }
}

static inline __attribute__((always_inline)) void q8z_tile_rows(const int8_t *xe, const float *xd, int64_t m, int64_t k,
                                                                const int8_t *codes, const char *scale, int64_t n,
                                                                float *out, int64_t t, const int half) {
    const int64_t j = t * NR, tile_scale = k / QB * NR * (half ? 2 : 4), pairs = (m + 1) / 2;
    const int nr = n - j < NR ? (int)(n - j) : NR;
    const int8_t *c = codes + t * NR * k;
    const char *s = scale + t * tile_scale;
    for (int64_t i = 0; i < pairs;) { /* chunks of 8 pairs, then 4, 3, 2, 1 */
        const int64_t left = pairs - i;
        const int mp = left >= MP ? MP : left >= 4 ? 4 : (int)left;
        switch (mp) {
            case 1: q8z_tile(xe, xd, i, 1, m, k, c, s, out + j, n, nr, half); break;
            case 2: q8z_tile(xe, xd, i, 2, m, k, c, s, out + j, n, nr, half); break;
            case 3: q8z_tile(xe, xd, i, 3, m, k, c, s, out + j, n, nr, half); break;
            case 4: q8z_tile(xe, xd, i, 4, m, k, c, s, out + j, n, nr, half); break;
            default: q8z_tile(xe, xd, i, MP, m, k, c, s, out + j, n, nr, half);
        }
        i += mp;
    }
}
#endif

static inline __attribute__((always_inline)) void q8v_tile_rows(const int8_t *xe, const float *xd, int64_t m, int64_t k,
                                                                const int8_t *codes, const char *scale, int64_t n,
                                                                float *out, int64_t t, const int half) {
    const int64_t j = t * NR, tile_scale = k / QB * NR * (half ? 2 : 4);
    const int nr = n - j < NR ? (int)(n - j) : NR;
    const int8_t *c = codes + t * NR * k;
    const char *s = scale + t * tile_scale;
    for (int64_t i = 0; i < m;) { /* chunks of 8, then 4, 3, 2, 1 */
        const int64_t left = m - i;
        const int mr = left >= MR8 ? MR8 : left >= 4 ? 4 : (int)left;
        switch (mr) {
            case 1: q8v_tile(xe, xd, i, 1, k, c, s, out + j, n, nr, half); break;
            case 2: q8v_tile(xe, xd, i, 2, k, c, s, out + j, n, nr, half); break;
            case 3: q8v_tile(xe, xd, i, 3, k, c, s, out + j, n, nr, half); break;
            case 4: q8v_tile(xe, xd, i, 4, k, c, s, out + j, n, nr, half); break;
            default: q8v_tile(xe, xd, i, MR8, k, c, s, out + j, n, nr, half);
        }
        i += mr;
    }
}
#endif

const char *ab_isa(void) { return AB_ISA; }

/* Tiles are split over threads. Each (half, group of 32 or not) has its own parallel loop: GCC outlines an
 * OpenMP region before inlining, so one region shared by all would take them as run-time values (measured 2x
 * slower in cpu_bits.c), not the literals each variant is compiled for. */
/* Rows in slices of MC (prefill): a slice's activations (MC x K x 2 bytes) stay in the L2 cache while every
 * tile passes over them; all of M at once fell out of it. */
#define Q4_REGION(HALF, G32)                                                                                   \
    for (int64_t i0 = 0; i0 < m; i0 += MC) {                                                                  \
        const int64_t mc = m - i0 < MC ? m - i0 : MC;                                                          \
        const act_t v = {a.q + i0 * k * 2, a.d + i0 * (k / QB), a.gsum + i0 * (k / group), mc};               \
        _Pragma("omp parallel for schedule(static) num_threads(threads) if (threads > 1)")                   \
        for (int64_t u = u0; u < units; u++) q4_tile_rows(&v, 0, mc, k, codes, s, n, group, out + i0 * n, u, HALF, G32); \
    }

#ifdef __AMX_INT8__
extern int ab_amx_min_rows; /* cpu_bits_amx.c */
int64_t ab_q4_matmul_amx(const float *x, int64_t m, int64_t k, const uint8_t *codes, const void *so, int64_t n,
                         int64_t group, float *out, int threads, int half);
#endif

int ab_q4_matmul(const float *x, int64_t m, int64_t k, const uint8_t *codes, const void *so, int64_t n,
                 int64_t group, float *out, int threads, int half, int tiles) {
    if (k % QB || group % QB || k % group) return -2;
    int64_t first = 0; /* weight rows done on AMX tiles (cpu_q4_amx.c): the passes below take the rest */
#ifdef __AMX_INT8__
    if (tiles && m >= ab_amx_min_rows && (first = ab_q4_matmul_amx(x, m, k, codes, so, n, group, out, threads, half)) < 0)
        return -1;
#endif
    if (first == n) return 0;
    const int64_t u0 = first / (Q4_UNIT * NR);
    act_t a;
    if (quantize_activations(x, m, k, group, 1, &a)) return -1;
    const int64_t units = (n + Q4_UNIT * NR - 1) / (Q4_UNIT * NR);
    const char *s = (const char *)so;
    if (group == QB) { /* GGUF's Q4_0 / Q4_1: a scale per block */
        if (half) { Q4_REGION(1, 1) } else { Q4_REGION(0, 1) }
    } else {
        if (half) { Q4_REGION(1, 0) } else { Q4_REGION(0, 0) }
    }
    free_activations(&a);
    return 0;
}
#undef Q4_REGION

int ab_q8_matmul(const float *x, int64_t m, int64_t k, const int8_t *codes, const void *scale, int64_t n,
                 float *out, int threads, int half) {
    if (k % QB) return -2;
    act_t a;
    if (quantize_activations(x, m, k, QB, 0, &a)) return -1;
    const int64_t tiles = (n + NR - 1) / NR;
    const char *s = (const char *)scale;
#ifdef AB_DPBUSD
    if (m > 1) { /* several rows: q8v_tile (one row keeps q8_tile: no expansion, nothing to share) */
        const int64_t nb = k / QB;
#ifdef __AVX512VNNI__
        const int64_t pairs = (m + 1) / 2;
        int8_t *xe = (int8_t *)aligned_alloc(64, (size_t)(pairs * nb * 8 * QB));
        float *xd = (float *)aligned_alloc(64, sizeof(float) * (size_t)(pairs * nb * 16));
        if (!xe || !xd) {
            free(xe);
            free(xd);
            free_activations(&a);
            return -1;
        }
        if (m % 2) { /* the odd last row's partner: zero codes (+ 128) and scale 0, never stored */
            memset(xe + (pairs - 1) * nb * 8 * QB, 0x80, (size_t)(nb * 8 * QB));
            memset(xd + (pairs - 1) * nb * 16, 0, sizeof(float) * (size_t)(nb * 16));
        }
        for (int64_t r = 0; r < m * nb; r++) {
            const int64_t row = r / nb, b = r % nb, at = (row / 2 * nb + b) * 8 * QB + row % 2 * QB;
            q8_expand(a.q + r * QB, xe + at, 2 * QB);
            for (int l = 0; l < 8; l++) xd[(row / 2 * nb + b) * 16 + row % 2 * 8 + l] = a.d[r];
        }
        if (half) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
            for (int64_t t = 0; t < tiles; t++) q8z_tile_rows(xe, xd, m, k, codes, s, n, out, t, 1);
        } else {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
            for (int64_t t = 0; t < tiles; t++) q8z_tile_rows(xe, xd, m, k, codes, s, n, out, t, 0);
        }
        free(xd);
#else
        int8_t *xe = (int8_t *)aligned_alloc(32, (size_t)(m * nb * 4 * QB));
        if (!xe) {
            free_activations(&a);
            return -1;
        }
        for (int64_t r = 0; r < m * nb; r++) q8_expand(a.q + r * QB, xe + r * 4 * QB, QB);
        if (half) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
            for (int64_t t = 0; t < tiles; t++) q8v_tile_rows(xe, a.d, m, k, codes, s, n, out, t, 1);
        } else {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
            for (int64_t t = 0; t < tiles; t++) q8v_tile_rows(xe, a.d, m, k, codes, s, n, out, t, 0);
        }
#endif
        free(xe);
        free_activations(&a);
        return 0;
    }
#endif
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

/* Row j of a Q4 weight, dense fp32. */
static void q4_row(const uint8_t *codes, const void *so, int64_t k, int64_t group, int64_t j, float *dst, int half) {
    const int64_t nb = k / QB, per = group / QB, gk = k / group, t = j / NR, r = j % NR;
    for (int64_t b = 0; b < nb; b++, dst += QB) {
        const int64_t sg = (t * gk + b / per) * 2 * NR + r;
        const float s = ld(so, sg, half), o = ld(so, sg + NR, half);
        for (int h = 0; h < 2; h++) {
            const uint8_t *c = codes + (t * nb + b) * NR * 16 + h * 32 + r * 8; /* see the layout above */
            const int lo = r % 2 ? 4 : 0;
            for (int i = 0; i < 8; i++) {
                const int e = 16 * h + (i < 4 ? i : i + 4);
                dst[e + lo] = (float)(c[i] & 0x0F) * s + o;
                dst[e + 4 - lo] = (float)(c[i] >> 4) * s + o;
            }
        }
    }
}

/* Dense fp32 rows of a Q4 weight (prefill multiplies many rows: dequantise once, then one sgemm). */
void ab_q4_dequant(const uint8_t *codes, const void *so, int64_t n, int64_t k, int64_t group, float *out,
                   int threads, int half) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t j = 0; j < n; j++) q4_row(codes, so, k, group, j, out + j * k, half);
}

/* Dense fp32 rows `rows[0 .. r)` of a Q4 weight (an embedding lookup: only those rows). */
void ab_q4_rows(const uint8_t *codes, const void *so, int64_t k, int64_t group, const int64_t *rows, int64_t r,
                float *out, int half) {
    for (int64_t i = 0; i < r; i++) q4_row(codes, so, k, group, rows[i], out + i * k, half);
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
