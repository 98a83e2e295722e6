/* What the int8 tile products (cpu_bits_amx.c's 8-bit, cpu_q4_amx.c's 4-bit) share: one tile product a block (K 32)
 * for TN weight rows x TM activation rows, their tile configuration, and the loop that stores each block's int32
 * sums and scales them into one fp32 accumulator per output. Each file brings its PRODUCT(C, A, B, b): block b's
 * weights into tile A, activations into B, and their product into C (literals: tile numbers are immediates). */
#ifndef AB_AMX_BLOCKS_H
#define AB_AMX_BLOCKS_H

#include "amx_tiles.h"

#define TM 16 /* activation rows of a tile product */
#define TN 16 /* weight rows of a tile product: TN fp32 accumulators of TM lanes */

/* Tiles 0, 1: the sums of an even and an odd block (one block's product runs while the other's sums are scaled);
 * 4, 5: their weights (16 rows x 32 codes); 6, 7: their activations (8 rows x 64 bytes: 16 activation rows x 4
 * consecutive columns, tdpbssd's and tdpbusd's B layout). The configuration is per thread. */
static void blocks_on(void) {
    static const uint8_t rows[8] = {TN, TN, TN, TN, TN, TN, 8, 8};
    static const uint16_t colsb[8] = {64, 64, 64, 64, 32, 32, 64, 64};
    amx_configure(rows, colsb);
}

/* Block sums c [weight row][activation row] scaled into the accumulators: (the weight row's scale x each activation
 * row's), then one convert and FMA. */
static inline __attribute__((always_inline)) void scale_block(const int32_t *c, const float *xd, const float *sc,
                                                              __m512 *acc) {
    const __m512 xv = _mm512_loadu_ps(xd);
#pragma GCC unroll 16
    for (int r = 0; r < TN; r++) {
        const __m512 sv = _mm512_mul_ps(_mm512_set1_ps(sc[r]), xv);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c + r * TM)), sv, acc[r]);
    }
}

/* x as three bf16 parts in fp32 lanes (low 16 bits zero), each rounded to nearest even from what the ones before
 * left: h + m + l holds x's 24 significant bits (each residual is exact in fp32). */
static inline void split3(__m512 x, __m512 p[3]) {
    for (int i = 0; i < 3; i++) {
        const __m512i b = _mm512_castps_si512(x);
        const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
        const __m512i r = _mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
        p[i] = _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u)));
        x = _mm512_sub_ps(x, p[i]);
    }
}

/* 16 bf16 parts (split3's lanes) as 16 consecutive bf16. */
static inline __m256i bf16_bits(__m512 p) { return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(p), 16)); }

/* Two vectors of bf16 parts interleaved lane by lane: lane i = (hi[i] << 16) | lo[i], a bf16 B tile's row. */
static inline __m512i bf16_pairs(__m512 lo, __m512 hi) {
    return _mm512_or_si512(_mm512_castps_si512(hi), _mm512_srli_epi32(_mm512_castps_si512(lo), 16));
}

/* v[r] lane i (weight row r, activation row i) out to out + i * stride + r for the first `rows` activation rows: a
 * 16 x 16 transpose in registers (amx_tiles.h), then one store a row. The compiler's element-wise
 * scatter through a buffer was ~10 % of tile_pair's samples. */
static inline void store_rows(__m512 *v, int64_t rows, float *out, int64_t stride) {
    __m512i r[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_castps_si512(v[i]);
    store_transposed(r, rows, 16, out, stride);
}

/* Activation rows a call packs at a time (a whole number of tiles, at least one): their tiles (K bytes a row, 1 MB in
 * all) stay in the L2 cache while every weight tile passes over them; each slice rereads the weights. */
static inline int64_t slice_rows(int64_t k) {
    const int64_t per = (1 << 20) / k / TM * TM;
    return per < TM ? TM : per;
}

/* Block b's product into tile C for kernels that unpack their weights to bytes (cpu_q4_amx.c, cpu_kbits_amx.c): the
 * weights a [nb][TN][32] through tile A, the activations xq (activation tile t's blocks) through B, DP the product
 * (tdpbusd for unsigned codes, tdpbssd for signed); tile numbers are immediates, so literals. */
#define UNPACKED_PRODUCT(C, A, B, b, DP)                                                                         \
    do {                                                                                                         \
        _tile_zero(C);                                                                                           \
        _tile_loadd(A, a + (b) * TN * QB, QB);                                                                   \
        _tile_loadd(B, xq + (t * nb + (b)) * TM * QB, 64);                                                       \
        DP(C, A, B);                                                                                             \
    } while (0)

/* nb blocks into acc (zeroed here): xt [nb][TM] the activation scales, sc [nb][TN] the weight scales. In pairs: the
 * odd block's product is issued before the even one's sums are stored, the next even one's before the odd one's
 * (storing a tile waits for its product; the wait then overlaps the other's). A block's sums are scaled one store
 * later, not at once: loads right after a tile store to the same lines waited for the store to reach L1 (the
 * stores and the loads after them took ~35 % of tile_pair's samples). The blocks are still scaled in order. */
#define BLOCKS(PRODUCT, nb, xt, sc, acc)                                                                       \
    do {                                                                                                       \
        int32_t c_[2][TN * TM] __attribute__((aligned(64)));                                                   \
        for (int r_ = 0; r_ < TN; r_++) (acc)[r_] = _mm512_setzero_ps();                                       \
        PRODUCT(0, 4, 6, 0);                                                                                   \
        for (int64_t b_ = 0; b_ < (nb); b_ += 2) {                                                             \
            if (b_ + 1 < (nb)) PRODUCT(1, 5, 7, b_ + 1);                                                       \
            _tile_stored(0, c_[0], 64);                                                                        \
            if (b_ > 0) scale_block(c_[1], (xt) + (b_ - 1) * TM, (sc) + (b_ - 1) * TN, acc);                   \
            if (b_ + 1 >= (nb)) {                                                                              \
                scale_block(c_[0], (xt) + b_ * TM, (sc) + b_ * TN, acc);                                       \
                break;                                                                                         \
            }                                                                                                  \
            if (b_ + 2 < (nb)) PRODUCT(0, 4, 6, b_ + 2);                                                       \
            _tile_stored(1, c_[1], 64);                                                                        \
            scale_block(c_[0], (xt) + b_ * TM, (sc) + b_ * TN, acc);                                           \
            if (b_ + 2 >= (nb)) scale_block(c_[1], (xt) + (b_ + 1) * TM, (sc) + (b_ + 1) * TN, acc);           \
        }                                                                                                      \
    } while (0)

#endif
