/* cpu_bits.c's 2-, 3-, 5- and 6-bit products (GGUF Q6_K, Q5_K, Q5_0 / Q5_1, Q3_K, Q2_K) on AMX int8 tiles, for many
 * activation rows: a prompt's tokens routed to one expert, a prefill chunk. Built only into the avx512-amx variant;
 * cpu_bits_amx.c's ab_bits_matmul_amx sends it those calls (the 8-bit ones it keeps).
 *
 * As cpu_q4_amx.c: the codes of 16 weight rows are unpacked to bytes once for every activation tile they meet (centred
 * q - 2^(bits-1), signed, without offsets: tdpbssd; plain q, unsigned, with them: tdpbusd), and each scale group's
 * product is one tile product for 16 weight rows x 16 activation rows, stored, converted and FMA'd with (the group's
 * weight scale x the block's activation scale); then the offsets' term (offset x the group's sum of the rounded
 * activations). Groups of 32 are one K 32 product a block, groups of 16 (the K-quants' sub-scales) two K 16 ones.
 * The integer sums are the VNNI kernel's (the same rounded activations, ab_round_block); the fp32 ones differ by
 * rounding: the VNNI kernel keeps a block's two halves in two accumulators and adds the centre as a term of the
 * activations' sums.
 *
 * Why: a Qwen3-30B-A3B-shaped Q4_K_M file's Q6_K ffn_down experts ran at ~104 GMAC/s on the VNNI kernel against the
 * Q4_K experts' ~400 on cpu_q4_amx.c's tiles (2-core Xeon, 128 rows), a fifth of a 2,048-token prefill (issue 44).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_bits_layout.h"
#include "cpu_gemv.h"

#ifdef __AMX_INT8__
#include <omp.h>

#include "amx_blocks.h"


extern int64_t ab_amx_calls; /* cpu_bits_amx.c */
int ab_bits_amx_ready(void);

/* Tiles as blocks_on, with the products K 16: the weights 16 rows x 16 codes, the activations 4 rows x 64 bytes. */
static void halves_on(void) {
    static const uint8_t rows[8] = {TN, TN, TN, TN, TN, TN, 4, 4};
    static const uint16_t colsb[8] = {64, 64, 64, 64, 16, 16, 64, 64};
    amx_configure(rows, colsb);
}

/* Activations as B tiles: q [tiles][nb][8][16][4] (cpu_bits_amx.c's), d [tiles][units][16] the scale of each
 * product (a block's, twice for groups of 16), gs [tiles][groups][16] the groups' sums of the rounded activations
 * (with offsets only); rows past m are zero and never stored. */
static int pack(const float *x, int64_t m, int64_t k, int64_t group, int off, int8_t **q, float **d, float **gs,
                int threads) {
    const int64_t nb = k / QB, per = QB / group, units = nb * per, tiles = (m + TM - 1) / TM;
    *q = aligned_alloc(64, (size_t)(tiles * nb * TM * QB));
    *d = aligned_alloc(64, sizeof(float) * (size_t)(tiles * units * TM));
    *gs = off ? aligned_alloc(64, sizeof(float) * (size_t)(tiles * units * TM)) : NULL;
    if (!*q || !*d || (off && !*gs)) return -1;
    memset(*q, 0, (size_t)(tiles * nb * TM * QB));
    memset(*d, 0, sizeof(float) * (size_t)(tiles * units * TM));
    if (off) memset(*gs, 0, sizeof(float) * (size_t)(tiles * units * TM));
#pragma omp parallel for schedule(static, TM) num_threads(threads) if (threads > 1 && m > TM) /* cpu_bits_amx.c's */
    for (int64_t i = 0; i < m; i++) {
        const int64_t t = i / TM, j = i % TM;
        for (int64_t b = 0; b < nb; b++) {
            int8_t c[QB];
            int sums[2];
            const float db = ab_round_block(x + i * k + b * QB, c, sums);
            for (int64_t h = 0; h < per; h++) {
                (*d)[(t * units + b * per + h) * TM + j] = db;
                if (off) (*gs)[(t * units + b * per + h) * TM + j] = db * (float)(per == 2 ? sums[h] : sums[0] + sums[1]);
            }
            int8_t *dst = *q + (t * nb + b) * TM * QB;
            for (int p = 0; p < QB / 4; p++) memcpy(dst + p * 64 + j * 4, c + 4 * p, 4);
        }
    }
    return 0;
}

/* Weight rows n0 .. n0 + 15 as A tiles a [nb][16][32] (bytes; centred without offsets), their scales sc [units][16]
 * and offsets of [units][16] (a unit: a group, one tile product). */
static inline __attribute__((always_inline)) void unpack(const uint8_t *w, int64_t n0, const shape_t *s, int8_t *a,
                                                          float *sc, float *of, const int bits) {
    const int64_t rb = row_bytes(s), full = record_bytes(s, PB, s->group), recs = nrecords(s);
    const int per = QB / s->group;
    const __m256i centre = _mm256_set1_epi8(s->off ? 0 : (int8_t)(1 << (bits - 1)));
    for (int r = 0; r < TN; r++) {
        const uint8_t *row = w + (n0 + r) * rb;
        for (int64_t rec = 0; rec < recs; rec++) {
            const int p = rec_blocks(s, rec), g = p * per;
            const uint8_t *h = row + rec * full, *body = h + header_bytes(s, p, s->group);
            const int64_t pairs = plane_bytes(bits, p);
            float one[GM], ofs[GM];
            header(h, s, g, one, ofs);
            for (int u = 0; u < g; u++) {
                sc[(rec * PB * per + u) * TN + r] = one[u];
                if (s->off) of[(rec * PB * per + u) * TN + r] = ofs[u];
            }
            for (int b = 0; b < p; b++)
                _mm256_store_si256((__m256i *)(a + ((rec * PB + b) * TN + r) * QB),
                                   _mm256_sub_epi8(codes(body, b, pairs, p, bits), centre));
        }
    }
}

/* Unit u's product into tile C (weights through tile A, activations through B; literals: tile numbers are
 * immediates): a block's whole 32 codes, or half h = u % 2 of them (K 16: 16 codes of each weight row, 4 of the
 * activations' B rows). */
#define WHOLE(C, A, B, u, DP) UNPACKED_PRODUCT(C, A, B, u, DP)
#define HALF(C, A, B, u, DP)                                                                                     \
    do {                                                                                                         \
        _tile_zero(C);                                                                                           \
        _tile_loadd(A, a + ((u) / 2) * TN * QB + ((u) % 2) * 16, QB);                                            \
        _tile_loadd(B, xq + (t * nb + (u) / 2) * TM * QB + ((u) % 2) * 256, 64);                                 \
        DP(C, A, B);                                                                                             \
    } while (0)
#define WHOLE_S(C, A, B, u) WHOLE(C, A, B, u, _tile_dpbssd)
#define WHOLE_U(C, A, B, u) WHOLE(C, A, B, u, _tile_dpbusd)
#define HALF_S(C, A, B, u) HALF(C, A, B, u, _tile_dpbssd)
#define HALF_U(C, A, B, u) HALF(C, A, B, u, _tile_dpbusd)

/* Activation tile t against the unpacked weight rows: out[i][n0 + r]. */
static void tile_pair(const int8_t *xq, const float *xd, const float *xs, int64_t t, int64_t m, const shape_t *s,
                      const int8_t *a, const float *sc, const float *of, int64_t n0, float *out) {
    const int64_t nb = s->k / QB, per = QB / s->group, units = nb * per;
    const float *xt = xd + t * units * TM;
    __m512 acc[TN];
    if (per == 2 && s->off)
        BLOCKS(HALF_U, units, xt, sc, acc);
    else if (per == 2)
        BLOCKS(HALF_S, units, xt, sc, acc);
    else if (s->off)
        BLOCKS(WHOLE_U, units, xt, sc, acc);
    else
        BLOCKS(WHOLE_S, units, xt, sc, acc);
    if (s->off) { /* the offsets' chains over the groups, eight rows side by side (cpu_q4_amx.c's reason) */
        const float *st = xs + t * units * TM;
        for (int r0 = 0; r0 < TN; r0 += 8) {
            __m512 o[8];
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) o[j] = _mm512_setzero_ps();
            for (int64_t u = 0; u < units; u++) {
                const __m512 xs_u = _mm512_load_ps(st + u * TM);
#pragma GCC unroll 8
                for (int j = 0; j < 8; j++) o[j] = _mm512_fmadd_ps(_mm512_set1_ps(of[u * TN + r0 + j]), xs_u, o[j]);
            }
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) acc[r0 + j] = _mm512_add_ps(acc[r0 + j], o[j]);
        }
    }
    store_rows(acc, m - t * TM < TM ? m - t * TM : TM, out + t * TM * s->n + n0, s->n);
}

/* One function per width: unpack's code extraction has the width as a literal. */
#define SPECIALISE(B)                                                                                            \
    static void weight_tiles_##B(const int8_t *xq, const float *xd, const float *xs, int64_t mc, const uint8_t *w, \
                                 const shape_t *s, float *out, uint8_t *scratch, int64_t own, int threads) {   \
        const int64_t nb = s->k / QB, units = nb * (QB / s->group), tiles = (mc + TM - 1) / TM;              \
        _Pragma("omp parallel num_threads(threads) if (threads > 1)") {                                         \
            int8_t *a = (int8_t *)(scratch + omp_get_thread_num() * own);                                       \
            float *sc = (float *)(a + nb * TN * QB), *of = sc + units * TN;                                      \
            if (s->group == QB) blocks_on();                                                                     \
            else halves_on();                                                                                    \
            _Pragma("omp for schedule(static)") for (int64_t nt = 0; nt < s->n / TN; nt++) {                     \
                unpack(w, nt * TN, s, a, sc, of, B);                                                             \
                for (int64_t t = 0; t < tiles; t++) tile_pair(xq, xd, xs, t, mc, s, a, sc, of, nt * TN, out);   \
            }                                                                                                    \
            _tile_release();                                                                                     \
        }                                                                                                        \
    }
SPECIALISE(2) SPECIALISE(3) SPECIALISE(5) SPECIALISE(6)
#undef SPECIALISE

/* The weight rows done, the first N / 16 x 16 (the caller's VNNI kernel does the rest): 0 where the tiles do not
 * take the call (8 bits, no tile state); -1 out of memory. */
int64_t ab_kbits_matmul_amx(const float *x, int64_t m, const uint8_t *w, const shape_t *s, float *out, int threads) {
    if (s->bits == 8 || s->n < TN || m < 1 || !ab_bits_amx_ready()) return 0;
    threads = threads < 1 ? 1 : threads;
    const int64_t nb = s->k / QB, units = nb * (QB / s->group), slice = slice_rows(s->k);
    const int64_t own = nb * TN * QB + 2 * units * TN * (int64_t)sizeof(float); /* a thread's weights and scales */
    uint8_t *scratch = aligned_alloc(64, (size_t)(threads * own));
    if (!scratch) return -1;
    int rc = 0;
#pragma omp atomic
    ab_amx_calls++;
    for (int64_t i0 = 0; i0 < m && !rc; i0 += slice) {
        const int64_t mc = m - i0 < slice ? m - i0 : slice;
        int8_t *xq = NULL;
        float *xd = NULL, *xs = NULL;
        if (pack(x + i0 * s->k, mc, s->k, s->group, s->off, &xq, &xd, &xs, threads))
            rc = -1;
        else
            (s->bits == 6   ? weight_tiles_6
             : s->bits == 5 ? weight_tiles_5
             : s->bits == 3 ? weight_tiles_3
                            : weight_tiles_2)(xq, xd, xs, mc, w, s, out + i0 * s->n, scratch, own, threads);
        free(xq);
        free(xd);
        free(xs);
    }
    free(scratch);
    return rc ? -1 : s->n / TN * TN;
}
#endif
