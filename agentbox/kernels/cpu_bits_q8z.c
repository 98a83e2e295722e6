/* cpu_bits.c's 8-bit product without offsets (GGUF Q8_0: signed codes, an fp16 scale per 32) for several activation
 * rows, in 512-bit vectors (avx512-vnni and avx512-amx builds; the others compile nothing here).
 *
 * cpu_bits.c's record_block spends, per block and activation row, four sign flips (vpdpbusd multiplies u8 by s8,
 * so x takes w's sign against |w|) and four 256-bit vpdpbusd. Here, as cpu_gemv.c's q8z_tile does for its own Q8
 * tiles, the activations are stored + 128 (u8) once per call, paired two rows to a 512-bit vector, against the
 * tile's transposed signed codes; the + 128 comes back out as -128 x the codes' sums, once per block for every
 * row. A pair of rows is then four vpdpbusd, one conversion, one multiply and one FMA a block. The integer sums
 * are exact and the fp32 steps record_block's (the int32 half sums converted, times scale x the row's d, added
 * in block order; the halves added last), so the bits are those of cpu_bits.c's kernel and of the one-row path.
 *
 * On a 2-core KVM Xeon (Emerald Rapids, AMX not exposed; kernels avx512-vnni), against the record loop it replaces
 * (runs before and after, two threads, a noisy host): 1536 x 2048 and 2048 x 768 at 16-128 rows 114-177 GMAC/s
 * against 79-116, the same bits. On the AVX-512 EPYC (Zen 4), a two-rows-a-vector rewrite of the record loop
 * itself gained nothing (bench/results/cpu-rows/README.md); not remeasured there.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_bits_layout.h"
#include "cpu_gemv.h"

#ifdef __AVX512VNNI__
#define MP 8 /* row pairs one pass over a tile serves (32 vector registers) */

/* Row pairs p0 .. p0 + mp against the tile's NR weight rows at w (`valid` of them real: past N % 4 the last row
 * again, its results dropped). xe: [pair][block][4][2][32] u8, xd: [pair][block][2][8] (cpu_gemv.c's q8z form). */
static inline __attribute__((always_inline)) void pairs(const int8_t *xe, const float *xd, int64_t p0, const int mp,
                                                        int64_t m, const shape_t *s, const uint8_t *w, float *out,
                                                        const int valid) {
    const int64_t nb = s->k / QB, rb = row_bytes(s), full = record_bytes(s, PB, QB);
    __m512 acc[MP];
    for (int i = 0; i < mp; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t rec = 0; rec < nrecords(s); rec++) {
        const int p = rec_blocks(s, rec);
        const int64_t hb = header_bytes(s, p, QB);
        const uint8_t *h[NR];
        float sc[NR][GM], of[NR][GM], st[PB][NR];
        for (int r = 0; r < NR; r++) {
            h[r] = w + (r < valid ? r : valid - 1) * rb + rec * full;
            header(h[r], s, p, sc[r], of[r]);
            if (p0 == 0) /* the next tile's record, into L2 while this one computes (cpu_bits.c's rows says why) */
                for (int64_t o = 0; o < full; o += 64) _mm_prefetch((const char *)(h[r] + NR * rb + o), _MM_HINT_T1);
        }
        for (int b = 0; b < p; b++)
            for (int r = 0; r < NR; r++) st[b][r] = sc[r][b];
        for (int b = 0; b < p; b++) {
            const int64_t blk = rec * PB + b;
            q8z_block(_mm256_loadu_si256((const __m256i *)(h[0] + hb + 32 * b)),
                      _mm256_loadu_si256((const __m256i *)(h[1] + hb + 32 * b)),
                      _mm256_loadu_si256((const __m256i *)(h[2] + hb + 32 * b)),
                      _mm256_loadu_si256((const __m256i *)(h[3] + hb + 32 * b)), _mm512_broadcast_f32x4(_mm_loadu_ps(st[b])),
                      xe + (p0 * nb + blk) * 8 * QB, nb * 8 * QB, xd + (p0 * nb + blk) * 16, nb * 16, mp, acc);
        }
    }
    for (int i = 0; i < mp; i++) { /* each row's two half sums, as cpu_bits.c's rows */
        const int64_t r = 2 * (p0 + i);
        const __m256 a0 = _mm512_castps512_ps256(acc[i]), a1 = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[i]), 1));
        float o[2][NR];
        _mm_storeu_ps(o[0], _mm_add_ps(_mm256_castps256_ps128(a0), _mm256_extractf128_ps(a0, 1)));
        _mm_storeu_ps(o[1], _mm_add_ps(_mm256_castps256_ps128(a1), _mm256_extractf128_ps(a1, 1)));
        for (int q = 0; q < 2 && r + q < m; q++)
            for (int c = 0; c < valid; c++) out[(r + q) * s->n + c] = o[q][c];
    }
}

/* One tile (weight rows j ..) against every pair: chunks of MP, then 4, 3, 2, 1 pairs (literals: the accumulators
 * stay in registers). */
static void tile(const int8_t *xe, const float *xd, int64_t m, const shape_t *s, const uint8_t *w, float *out,
                 int64_t j) {
    const int valid = s->n - j < NR ? (int)(s->n - j) : NR;
    const uint8_t *wt = w + j * row_bytes(s);
    for (int64_t i = 0, np = (m + 1) / 2; i < np;) {
        const int64_t left = np - i;
        const int mp = left >= MP ? MP : left >= 4 ? 4 : (int)left;
        switch (mp) {
            case 1: pairs(xe, xd, i, 1, m, s, wt, out + j, valid); break;
            case 2: pairs(xe, xd, i, 2, m, s, wt, out + j, valid); break;
            case 3: pairs(xe, xd, i, 3, m, s, wt, out + j, valid); break;
            case 4: pairs(xe, xd, i, 4, m, s, wt, out + j, valid); break;
            default: pairs(xe, xd, i, MP, m, s, wt, out + j, valid);
        }
        i += mp;
    }
}

/* x [M][K] fp32 times the 8-bit, offset-free, group-32 weight w transposed, weight rows `first` (a multiple of NR)
 * onwards: 0, or -1 when memory ran out. Rows in slices whose activations (4 bytes a column a row, as cpu_bits.c's)
 * stay in the L2 cache while every tile passes over them. */
int ab_bits_q8z(const float *x, int64_t m, const uint8_t *w, const shape_t *s, float *out, int64_t first,
                int threads) {
    const int64_t k = s->k, nb = k / QB, slice = k >= 131072 / (2 * MP) ? 2 * MP : 131072 / k / (2 * MP) * (2 * MP);
    const int64_t most = m < slice ? m : slice, np = (most + 1) / 2, tiles = (s->n + NR - 1) / NR;
    int8_t *xe = (int8_t *)aligned_alloc(64, (size_t)(np * nb * 8 * QB));
    float *xd = (float *)aligned_alloc(64, sizeof(float) * (size_t)(np * nb * 16));
    if (!xe || !xd) {
        free(xe);
        free(xd);
        return -1;
    }
    for (int64_t i0 = 0; i0 < m; i0 += slice) {
        const int64_t mc = m - i0 < slice ? m - i0 : slice;
        if (mc % 2) { /* the odd last row's partner: codes 0 (+ 128) and scale 0, never stored */
            memset(xe + mc / 2 * nb * 8 * QB, 0x80, (size_t)(nb * 8 * QB));
            memset(xd + mc / 2 * nb * 16, 0, sizeof(float) * (size_t)(nb * 16));
        }
        for (int64_t r = 0; r < mc * nb; r++) {
            const int64_t row = r / nb, b = r % nb, at = (row / 2 * nb + b) * 8 * QB + row % 2 * QB;
            int sums[2];
            int8_t q[QB];
            const float d = ab_round_block(x + (i0 * nb + r) * QB, q, sums);
            q8_expand(q, xe + at, 2 * QB);
            for (int l = 0; l < 8; l++) xd[(row / 2 * nb + b) * 16 + row % 2 * 8 + l] = d;
        }
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
        for (int64_t t = first / NR; t < tiles; t++) tile(xe, xd, mc, s, w, out + i0 * s->n, t * NR);
    }
    free(xe);
    free(xd);
    return 0;
}
#endif
