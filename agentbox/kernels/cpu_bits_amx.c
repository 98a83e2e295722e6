/* cpu_bits.c's 8-bit product (GGUF Q8_0: int8 codes, a scale per 32 columns, no offsets) on AMX int8 tiles, for
 * many activation rows (prefill, and a prompt's tokens routed to one expert). Built only into the avx512-amx
 * variant (cpu_gemv.py); ab_bits_matmul sends it calls of ab_amx_min_rows rows or more.
 *
 * Same numbers, bit for bit, as the VNNI and AVX2 kernels: those sum each block's products as two exact int32
 * halves (elements 0..15 and 16..31), convert each, and FMA it with (weight scale x activation scale) into one of
 * two fp32 accumulators per output, block after block, and add the two at the end. Here a tile product of K 16 is
 * one such half for 16 weight rows x 16 activation rows (tdpbssd: signed codes times signed activations, exact
 * in int32), stored and then converted and FMA'd in the same order with the same scale products. Activations are
 * rounded by ab_round_block, as everywhere.
 *
 * Why not fewer, wider tile products: a product over a whole block (K 32) or a record would sum the halves (or
 * blocks) in int32 before the fp32 scale, which is other numbers than the one-row decode path gives; the per-half
 * store and FMA are the kernel's cost, not the tile products.
 *
 * Layout: the weights are the A tiles, read in place (16 rows of a block's 16 codes, row stride = the row's
 * bytes: cpu_bits_layout.h keeps a block's codes at the same offset in every row); the activations are the B
 * tiles, packed here per 16 rows and block half as tdpbssd reads them (4 rows of 64 bytes: 16 activation rows x 4
 * consecutive columns). The OS must grant the tile state (Linux 5.16+ arch_prctl); where it does not, the caller
 * keeps the VNNI kernel.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_bits_layout.h"
#include "cpu_gemv.h"

/* Fewest activation rows for the tiles (tests set it to compare the two paths on any shape). Below it a tile's
 * 16 activation rows are mostly padding: 1536 x 2048 at two threads, AMX / VNNI time 1.6 at 4 rows, 1.06 at 8,
 * 0.69 at 12. */
int ab_amx_min_rows = 9;

/* Calls that took the tiles (tests check that a shape ran here, not only that its numbers are right). */
int64_t ab_amx_calls;

#ifdef __AMX_INT8__
#include <omp.h>

#include "amx_tiles.h"

#define TM 16 /* activation rows of a tile product */
#define TN 16 /* weight rows of a tile product: 16 rows x 2 halves are 32 fp32 accumulators, more than the registers
               * hold beside the operands, so a few spill; 8 rows (none spill) took more tile loads and stores per
               * product and were slower (1536 x 2048, 128 rows, two threads: 258 GMAC/s against 293) */

int ab_bits_amx_ready(void) { return amx_request(); }

/* Tiles 0, 1 and 2, 3: the two halves' int32 sums (16 weight rows x 16 activation rows) of an even and an odd block
 * (so one block's products run while the previous one's are scaled); 4, 5: the weight halves (16 rows x 16 codes);
 * 6, 7: the activation halves (4 rows x 64 bytes). The configuration is per thread. */
static void tiles_on(void) {
    static const uint8_t rows[8] = {TN, TN, TN, TN, TN, TN, 4, 4};
    static const uint16_t colsb[8] = {64, 64, 64, 64, 16, 16, 64, 64};
    amx_configure(rows, colsb);
}

/* The activations as B tiles: q [tiles][nb][2][4][16][4] (tile of 16 rows, block, half, then tdpbssd's B layout:
 * row r holds columns 4r .. 4r + 3 of the half for each of the 16 activation rows), d [tiles][nb][16]; rows past m
 * are zero (their outputs are not written). */
static int pack(const float *x, int64_t m, int64_t k, int8_t **q, float **d) {
    const int64_t nb = k / QB, tiles = (m + TM - 1) / TM;
    *q = aligned_alloc(64, (size_t)(tiles * nb * TM * QB));
    *d = aligned_alloc(64, sizeof(float) * (size_t)(tiles * nb * TM));
    if (!*q || !*d) return -1;
    memset(*q, 0, (size_t)(tiles * nb * TM * QB));
    memset(*d, 0, sizeof(float) * (size_t)(tiles * nb * TM));
    for (int64_t i = 0; i < m; i++)
        for (int64_t b = 0; b < nb; b++) {
            int8_t c[QB];
            int sums[2];
            const int64_t at = (i / TM) * nb + b, j = i % TM;
            (*d)[at * TM + j] = ab_round_block(x + i * k + b * QB, c, sums);
            int8_t *dst = *q + at * TM * QB;
            for (int g = 0; g < QB / 4; g++) /* half g / 4, tile row g % 4 */
                memcpy(dst + (g / 4) * 256 + (g % 4) * 64 + j * 4, c + 4 * g, 4);
        }
    return 0;
}

/* Weight rows n0 .. n0 + TN - 1's scales, [nb][TN]. */
static void scales(const uint8_t *w, int64_t n0, const shape_t *s, float *sc) {
    const int64_t nb = s->k / QB, rb = row_bytes(s), full = record_bytes(s, PB, QB);
    float one[GM], of[GM];
    for (int r = 0; r < TN; r++)
        for (int64_t rec = 0; rec * PB < nb; rec++) {
            const int p = rec_blocks(s, rec);
            header(w + (n0 + r) * rb + rec * full, s, p, one, of);
            for (int b = 0; b < p; b++) sc[(rec * PB + b) * TN + r] = one[b];
        }
}

/* Block b's two half products into tiles C0, C1 (literals: tile numbers are immediates). */
#define PRODUCT(C0, C1, b)                                                                                      \
    do {                                                                                                         \
        const int64_t rec_ = (b) / PB;                                                                           \
        const uint8_t *a_ = w + n0 * rb + rec_ * full + header_bytes(s, rec_blocks(s, rec_), QB) + ((b) % PB) * QB; \
        const int8_t *x_ = xq + (t * nb + (b)) * TM * QB;                                                        \
        _tile_zero(C0);                                                                                          \
        _tile_zero(C1);                                                                                          \
        _tile_loadd(4, a_, rb);                                                                                  \
        _tile_loadd(5, a_ + 16, rb);                                                                             \
        _tile_loadd(6, x_, 64);                                                                                  \
        _tile_loadd(7, x_ + 256, 64);                                                                            \
        _tile_dpbssd(C0, 4, 6);                                                                                  \
        _tile_dpbssd(C1, 5, 7);                                                                                  \
    } while (0)

/* Block b's sums (c0, c1: the halves, [weight row][activation row]) scaled into the accumulators, as cpu_bits.c:
 * (the weight row's scale x each activation row's) once, then convert and FMA each half. */
static inline __attribute__((always_inline)) void scale_block(const int32_t *c0, const int32_t *c1, const float *xd,
                                                              const float *sc, __m512 *lo, __m512 *hi) {
    const __m512 xv = _mm512_loadu_ps(xd);
#pragma GCC unroll 16
    for (int r = 0; r < TN; r++) {
        const __m512 sv = _mm512_mul_ps(_mm512_set1_ps(sc[r]), xv);
        lo[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c0 + r * TM)), sv, lo[r]);
        hi[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c1 + r * TM)), sv, hi[r]);
    }
}

/* Activation tile t against weight rows n0 .. n0 + TN - 1: out[i][n0 + r]. Blocks in pairs: the odd block's products
 * are issued before the even one's sums are stored and scaled, and the next even one's before the odd one's. */
static void tile_pair(const int8_t *xq, const float *xd, int64_t t, int64_t m, const uint8_t *w, int64_t n0,
                      const shape_t *s, const float *sc, float *out) {
    const int64_t nb = s->k / QB, rb = row_bytes(s), full = record_bytes(s, PB, QB);
    __m512 lo[TN], hi[TN];
#pragma GCC unroll 16
    for (int r = 0; r < TN; r++) lo[r] = hi[r] = _mm512_setzero_ps();
    int32_t c[4][TN * TM] __attribute__((aligned(64)));
    const float *xt = xd + t * nb * TM;
    PRODUCT(0, 1, 0);
    for (int64_t b = 0; b < nb; b += 2) {
        if (b + 1 < nb) PRODUCT(2, 3, b + 1);
        _tile_stored(0, c[0], 64);
        _tile_stored(1, c[1], 64);
        scale_block(c[0], c[1], xt + b * TM, sc + b * TN, lo, hi);
        if (b + 1 >= nb) break;
        if (b + 2 < nb) PRODUCT(0, 1, b + 2);
        _tile_stored(2, c[2], 64);
        _tile_stored(3, c[3], 64);
        scale_block(c[2], c[3], xt + (b + 1) * TM, sc + (b + 1) * TN, lo, hi);
    }
    float o[TN][TM];
#pragma GCC unroll 16
    for (int r = 0; r < TN; r++) /* + 0: the VNNI kernel's offset term, zero here, added as it does */
        _mm512_storeu_ps(o[r], _mm512_add_ps(_mm512_add_ps(lo[r], hi[r]), _mm512_setzero_ps()));
    const int64_t rows = m - t * TM < TM ? m - t * TM : TM;
    for (int64_t i = 0; i < rows; i++)
        for (int r = 0; r < TN; r++) out[(t * TM + i) * s->n + n0 + r] = o[r][i];
}

/* Activation rows a slice packs at a time: their tiles (K bytes a row) stay in the L2 cache while every weight tile
 * passes over them; each slice rereads the weights. */
#define SLICE_BYTES (1 << 20)

/* The weight rows done, the first N / 16 x 16 (the caller's VNNI kernel does the rest): 0 where the tiles do not
 * take the call (another format, no tile state); -1 out of memory. */
int64_t ab_bits_matmul_amx(const float *x, int64_t m, const uint8_t *w, const shape_t *s, float *out, int threads) {
    if (s->bits != 8 || s->group != QB || s->off || s->n < TN || m < 1 || !ab_bits_amx_ready()) return 0;
    threads = threads < 1 ? 1 : threads;
    const int64_t nb = s->k / QB, ntiles = s->n / TN, per = SLICE_BYTES / s->k / TM * TM;
    const int64_t slice = per < TM ? TM : per;
    float *sc = aligned_alloc(64, sizeof(float) * (size_t)(threads * nb * TN)); /* each thread's weight scales */
    if (!sc) return -1;
    int rc = 0;
#pragma omp atomic
    ab_amx_calls++;
    for (int64_t i0 = 0; i0 < m && !rc; i0 += slice) {
        const int64_t mc = m - i0 < slice ? m - i0 : slice, tiles = (mc + TM - 1) / TM;
        int8_t *xq = NULL;
        float *xd = NULL;
        if (pack(x + i0 * s->k, mc, s->k, &xq, &xd)) {
            rc = -1;
        } else {
#pragma omp parallel num_threads(threads) if (threads > 1)
            {
                float *mine = sc + omp_get_thread_num() * nb * TN;
                tiles_on();
#pragma omp for schedule(static)
                for (int64_t nt = 0; nt < ntiles; nt++) {
                    scales(w, nt * TN, s, mine);
                    for (int64_t t = 0; t < tiles; t++) tile_pair(xq, xd, t, mc, w, nt * TN, s, mine, out + i0 * s->n);
                }
                _tile_release();
            }
        }
        free(xq);
        free(xd);
    }
    free(sc);
    return rc ? -1 : ntiles * TN;
}
#endif
