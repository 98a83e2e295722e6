/* cpu_bits.c's 8-bit product (GGUF Q8_0: int8 codes, a scale per 32 columns, no offsets) on AMX int8 tiles, for
 * many activation rows (prefill, and a prompt's tokens routed to one expert). Built only into the avx512-amx
 * variant (cpu_gemv.py); ab_bits_matmul sends it calls of ab_amx_min_rows rows or more that allow tiles.
 *
 * One tile product a block (tdpbssd, K 32: signed codes times signed activations, exact in int32) for 16 weight
 * rows x 16 activation rows, stored, converted and FMA'd with (weight scale x activation scale) into one fp32
 * accumulator per output, block after block. Activations are rounded by ab_round_block, as everywhere, so the
 * integer sums are the VNNI kernel's; its fp32 work is not: it keeps each block's two halves (elements 0..15,
 * 16..31) apart, two FMAs and two accumulators, which here took two K 16 products and two tile stores a block.
 * The stores and the scaling, not the products, bound this kernel (products alone 515-544 GMAC/s on 1536 x 2048 at
 * two threads, 329 with the halves' stores, 293 with their scaling); one store and one FMA a block is what
 * dropping that parity buys (bench/results/cpu-moe). The two differ by fp32 rounding (~1e-7 of a row's scale).
 * Where a row's numbers must not depend on its company, callers keep the VNNI kernel: the fused decode (tiles 0:
 * a step's numbers do not depend on how many sequences share it) and a speculative verify (below
 * ab_amx_min_rows).
 *
 * Layout: the weights are the A tiles, read in place (16 rows of a block's 32 codes, row stride = the row's
 * bytes: cpu_bits_layout.h keeps a block's codes at the same offset in every row); the activations are the B
 * tiles, packed here per 16 rows and block as tdpbssd reads them (8 rows of 64 bytes: 16 activation rows x 4
 * consecutive columns). The OS must grant the tile state (Linux 5.16+ arch_prctl); where it does not, the caller
 * keeps the VNNI kernel.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_bits_layout.h"
#include "cpu_gemv.h"

/* Fewest activation rows for the tiles, 8- and 4-bit (tests set it to compare the paths on any shape): a speculative
 * verify (at most spec_max_draft + 1 = 17 rows by default) stays on the VNNI kernel with the decode steps, so greedy
 * output with drafts keeps plain decoding's numbers, as cpu_attention.py's AMX_MIN_TOKENS does for attention. (Below
 * 12 rows a tile's 16 are mostly padding anyway: 1536 x 2048 at two threads, AMX / VNNI time 1.6 at 4 rows.) */
int ab_amx_min_rows = 18;

/* Calls that took the tiles (tests check that a shape ran here, not only that its numbers are right). */
int64_t ab_amx_calls;

#ifdef __AMX_INT8__
#include <omp.h>

#include "amx_blocks.h"

int ab_bits_amx_ready(void) { return amx_request(); }

int64_t ab_kbits_matmul_amx(const float *x, int64_t m, const uint8_t *w, const shape_t *s, float *out, int threads);

/* The activations as B tiles: q [tiles][nb][8][16][4] (tile of 16 rows, block, then tdpbssd's B layout: row r holds
 * columns 4r .. 4r + 3 for each of the 16 activation rows), d [tiles][nb][16]; rows past m are zero (their outputs
 * are not written). */
static int pack(const float *x, int64_t m, int64_t k, int8_t **q, float **d, int threads) {
    const int64_t nb = k / QB, tiles = (m + TM - 1) / TM;
    *q = aligned_alloc(64, (size_t)(tiles * nb * TM * QB));
    *d = aligned_alloc(64, sizeof(float) * (size_t)(tiles * nb * TM));
    if (!*q || !*d) return -1;
    memset(*q, 0, (size_t)(tiles * nb * TM * QB));
    memset(*d, 0, sizeof(float) * (size_t)(tiles * nb * TM));
    /* whole tiles a thread (their rows share lines); serial, this took ~9 % of a 650-row call's time */
#pragma omp parallel for schedule(static, TM) num_threads(threads) if (threads > 1 && m > TM)
    for (int64_t i = 0; i < m; i++)
        for (int64_t b = 0; b < nb; b++) {
            int8_t c[QB];
            int sums[2];
            const int64_t at = (i / TM) * nb + b, j = i % TM;
            (*d)[at * TM + j] = ab_round_block(x + i * k + b * QB, c, sums);
            int8_t *dst = *q + at * TM * QB;
            for (int g = 0; g < QB / 4; g++) memcpy(dst + g * 64 + j * 4, c + 4 * g, 4); /* B row g */
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

/* Block b's product into tile C, its weights through tile A and its activations through B (literals: tile numbers
 * are immediates). */
#define PRODUCT(C, A, B, b)                                                                                      \
    do {                                                                                                         \
        const int64_t rec_ = (b) / PB;                                                                           \
        const uint8_t *a_ = w + n0 * rb + rec_ * full + header_bytes(s, rec_blocks(s, rec_), QB) + ((b) % PB) * QB; \
        _tile_zero(C);                                                                                           \
        _tile_loadd(A, a_, rb);                                                                                  \
        _tile_loadd(B, xq + (t * nb + (b)) * TM * QB, 64);                                                       \
        _tile_dpbssd(C, A, B);                                                                                   \
    } while (0)

/* Activation tile t against weight rows n0 .. n0 + TN - 1: out[i][n0 + r]. */
static void tile_pair(const int8_t *xq, const float *xd, int64_t t, int64_t m, const uint8_t *w, int64_t n0,
                      const shape_t *s, const float *sc, float *out) {
    const int64_t nb = s->k / QB, rb = row_bytes(s), full = record_bytes(s, PB, QB);
    __m512 acc[TN];
    BLOCKS(PRODUCT, nb, xd + t * nb * TM, sc, acc);
    store_rows(acc, m - t * TM < TM ? m - t * TM : TM, out + t * TM * s->n + n0, s->n);
}

/* The weight rows done, the first N / 16 x 16 (the caller's VNNI kernel does the rest): 0 where the tiles do not
 * take the call (8 bits with offsets or groups of 16, no tile state); -1 out of memory. */
int64_t ab_bits_matmul_amx(const float *x, int64_t m, const uint8_t *w, const shape_t *s, float *out, int threads) {
    if (s->bits != 8) return ab_kbits_matmul_amx(x, m, w, s, out, threads); /* unpacked to bytes (cpu_kbits_amx.c) */
    if (s->group != QB || s->off || s->n < TN || m < 1 || !ab_bits_amx_ready()) return 0;
    threads = threads < 1 ? 1 : threads;
    const int64_t nb = s->k / QB, ntiles = s->n / TN, slice = slice_rows(s->k);
    float *sc = aligned_alloc(64, sizeof(float) * (size_t)(threads * nb * TN)); /* each thread's weight scales */
    if (!sc) return -1;
    int rc = 0;
#pragma omp atomic
    ab_amx_calls++;
    for (int64_t i0 = 0; i0 < m && !rc; i0 += slice) {
        const int64_t mc = m - i0 < slice ? m - i0 : slice, tiles = (mc + TM - 1) / TM;
        int8_t *xq = NULL;
        float *xd = NULL;
        if (pack(x + i0 * s->k, mc, s->k, &xq, &xd, threads)) {
            rc = -1;
        } else {
#pragma omp parallel num_threads(threads) if (threads > 1)
            {
                float *mine = sc + omp_get_thread_num() * nb * TN;
                blocks_on();
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
