/* kernels/cpu_f16.py's product of many activation rows (a prefill chunk, a warm turn's new tokens) with 16-bit
 * weights kept as stored (fp16 from a GGUF llama.cpp wrote, bf16 from a Hugging Face checkpoint), on AMX bf16 tiles.
 * Built alone (cpu_f16.py: amx_tile + amx_bf16 + avx512_bf16); where it does not run, cpu_f16.py widens the weight
 * and calls oneDNN's fp32 product, which this replaces.
 *
 * Why: an extend of 650 tokens on the Qwen3.5 hybrid GGUF spent ~60 % of its time in those fp32 products and
 * the widening before them (oneDNN at ~90-100 GMAC/s on the two cores of this Xeon). One tile product
 * (TDPBF16PS: 16 x 16 outputs, 32 bf16 multiply-adds each, into fp32) does 8,192 multiply-adds.
 *
 * Precision: the operands are split x = hi + lo (hi = bf16(x), lo = bf16(x - hi), oneDNN's "bf16x3", as
 * cpu_attention_amx.c does). An fp16 weight is exactly hi + lo (11 significant bits in two of 8); a bf16 weight is
 * its own hi. An fp32 activation keeps ~16 significant bits. A product is taken as hi.hi + hi.lo + lo.hi: 3 tile
 * products for fp16 weights, 2 for bf16 (lo.lo, ~2^-18 of a product, is dropped). That is finer than llama.cpp's
 * rounding of the activations to the weights' type (fp16: 11 bits, bf16: 8) before its own products.
 *
 * Layout: the weights are the A tiles (16 weight rows x 32 columns), split per block of NB weight rows into a
 * thread's buffer; the activations are the B tiles (16 pairs of columns x 16 activation rows, TDPBF16PS's layout),
 * split and packed once a call. A block of NB weight rows x MB activation rows keeps its four 16 x 16 sums in tiles
 * 0-3 for the whole of k and writes them out transposed (weight rows are the output's columns). Activation rows are
 * walked in chunks of MC, every block of weights over one chunk before the next: the chunk's packed activations
 * stay in L2 while the weights are re-split per chunk (k NB conversions against NB MC k multiply-adds). */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx_tiles.h"

#define KS 32  /* columns a tile product takes: 16 pairs */
#define NB 32  /* weight rows a block: two A tiles */
#define MB 32  /* activation rows a block: two B tiles */
#define MC 256 /* activation rows a chunk */
#define TILE 512 /* bf16 elements of a 16 x 64-byte tile */

/* Calls that ran here (tests check the dispatch, not only the numbers). */
int64_t ab_half_amx_calls;

/* 0 when the OS granted the tile state (amx_tiles.h). */
int ab_half_amx_init(void) { return amx_request() ? 0 : 1; }

static void tiles_on(void) {
    static const uint8_t rows[8] = {16, 16, 16, 16, 16, 16, 16, 16};
    static const uint16_t colsb[8] = {64, 64, 64, 64, 64, 64, 64, 64};
    amx_configure(rows, colsb);
}

/* 16 bf16 to fp32: the top half of each. */
static inline __m512 widen16(__m256i bf) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf), 16));
}

/* 32 fp32 values (v0: columns 0-15, v1: 16-31) as hi and lo, 32 bf16 each in column order. */
static inline void split32(__m512 v0, __m512 v1, __m512i *hi, __m512i *lo) {
    const __m512i hb = (__m512i)_mm512_cvtne2ps_pbh(v1, v0);
    const __m512 h0 = widen16(_mm512_castsi512_si256(hb)), h1 = widen16(_mm512_extracti64x4_epi64(hb, 1));
    *hi = hb;
    *lo = (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(v1, h1), _mm512_sub_ps(v0, h0));
}

/* Columns c .. c + 31 of an fp32 row (zero past k). */
static inline void load32(const float *row, int64_t c, int64_t k, __m512 *v0, __m512 *v1) {
    const __mmask16 m0 = c + 16 <= k ? 0xffff : c < k ? (__mmask16)((1u << (k - c)) - 1) : 0;
    const __mmask16 m1 = c + 32 <= k ? 0xffff : c + 16 < k ? (__mmask16)((1u << (k - c - 16)) - 1) : 0;
    *v0 = _mm512_maskz_loadu_ps(m0, row + c);
    *v1 = _mm512_maskz_loadu_ps(m1, row + c + 16);
}

/* The activations as B tiles: xp [tiles of 16 rows][nks][hi, lo][16 pair rows][16 activation rows][2]. Row i's
 * 16 pairs of a block are one vector; 16 rows' vectors transposed are the tile. Rows past m are zero (the last
 * block's second tile may hold none of them). */
static void pack_x(const float *x, int64_t m, int64_t k, int64_t nks, int64_t tiles, uint16_t *xp, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && tiles > 1)
    for (int64_t t = 0; t < tiles; t++)
        for (int64_t s = 0; s < nks; s++) {
            __m512i hi[16], lo[16];
            for (int i = 0; i < 16; i++) {
                __m512 v0 = _mm512_setzero_ps(), v1 = v0;
                if (t * 16 + i < m) load32(x + (t * 16 + i) * k, s * KS, k, &v0, &v1);
                split32(v0, v1, &hi[i], &lo[i]);
            }
            transpose16(hi);
            transpose16(lo);
            uint16_t *dst = xp + (t * nks + s) * 2 * TILE;
            for (int r = 0; r < 16; r++) {
                _mm512_store_si512(dst + r * 32, hi[r]);
                _mm512_store_si512(dst + TILE + r * 32, lo[r]);
            }
        }
}

/* Weight rows n0 .. n0 + NB - 1 as A tiles: wp [nks][parts][NB rows][32] (hi, then lo for fp16); rows past n and
 * columns past k are zero. */
static void pack_w(const uint16_t *w, int64_t n0, int64_t n, int64_t k, int64_t nks, int bf16, uint16_t *wp) {
    const int parts = bf16 ? 1 : 2;
    for (int64_t r = 0; r < NB; r++)
        for (int64_t s = 0; s < nks; s++) {
            uint16_t *hi = wp + ((s * parts) * NB + r) * KS;
            if (n0 + r >= n) {
                memset(hi, 0, KS * 2);
                if (!bf16) memset(hi + NB * KS, 0, KS * 2);
                continue;
            }
            const uint16_t *src = w + (n0 + r) * k + s * KS;
            const int64_t valid = k - s * KS < KS ? k - s * KS : KS;
            const __mmask32 mask = valid == KS ? 0xffffffffu : (__mmask32)((1u << valid) - 1);
            const __m512i raw = _mm512_maskz_loadu_epi16(mask, src);
            if (bf16) { /* exact already */
                _mm512_store_si512(hi, raw);
                continue;
            }
            __m512i h, l;
            split32(_mm512_cvtph_ps(_mm512_castsi512_si256(raw)), _mm512_cvtph_ps(_mm512_extracti64x4_epi64(raw, 1)),
                    &h, &l);
            _mm512_store_si512(hi, h);
            _mm512_store_si512(hi + NB * KS, l);
        }
}

/* Tiles 4, 5 (two weight tiles) times 6, 7 (two activation tiles) into the sums 0-3: tile numbers are immediates. */
#define PRODUCTS()                                                                                                  \
    do {                                                                                                            \
        _tile_dpbf16ps(0, 4, 6);                                                                                    \
        _tile_dpbf16ps(1, 4, 7);                                                                                    \
        _tile_dpbf16ps(2, 5, 6);                                                                                    \
        _tile_dpbf16ps(3, 5, 7);                                                                                    \
    } while (0)

/* One block: weights wp (pack_w), activation tiles xp0 and xp1 (pack_x's, nks blocks each); its four sums out to c. */
static void block(const uint16_t *wp, const uint16_t *xp0, const uint16_t *xp1, int64_t nks, int bf16, float *c) {
    const int parts = bf16 ? 1 : 2;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t s = 0; s < nks; s++) {
        const uint16_t *wh = wp + s * parts * NB * KS, *x0 = xp0 + s * 2 * TILE, *x1 = xp1 + s * 2 * TILE;
        _tile_loadd(4, wh, 64); /* hi . hi */
        _tile_loadd(5, wh + 16 * KS, 64);
        _tile_loadd(6, x0, 64);
        _tile_loadd(7, x1, 64);
        PRODUCTS();
        _tile_loadd(6, x0 + TILE, 64); /* hi . lo */
        _tile_loadd(7, x1 + TILE, 64);
        PRODUCTS();
        if (bf16) continue;
        _tile_loadd(4, wh + NB * KS, 64); /* lo . hi */
        _tile_loadd(5, wh + NB * KS + 16 * KS, 64);
        _tile_loadd(6, x0, 64);
        _tile_loadd(7, x1, 64);
        PRODUCTS();
    }
    _tile_stored(0, c, 64);
    _tile_stored(1, c + 256, 64);
    _tile_stored(2, c + 512, 64);
    _tile_stored(3, c + 768, 64);
}

/* out [m][n] = x [m][k] (fp32) . w [n][k]^T (fp16, or bf16 when bf16 is set); k a multiple of 16. 0, or -1 when
 * memory ran out, -2 for a k the kernel does not take. */
int ab_half_amx_matmul(const float *x, int64_t m, int64_t k, const uint16_t *w, int64_t n, int bf16, float *out,
                       int threads) {
    if (k % 16 || k <= 0 || m <= 0 || n <= 0) return -2;
    const int64_t nks = (k + KS - 1) / KS, xtiles = (m + MB - 1) / MB * 2, nblocks = (n + NB - 1) / NB;
    const int parts = bf16 ? 1 : 2;
    uint16_t *xp = aligned_alloc(64, (size_t)(xtiles * nks * 2 * TILE * 2));
    if (!xp) return -1;
    pack_x(x, m, k, nks, xtiles, xp, threads);
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        uint16_t *wp = aligned_alloc(64, (size_t)(nks * parts * NB * KS * 2));
        float *c = aligned_alloc(64, 4 * 256 * sizeof(float));
        if (!wp || !c) {
#pragma omp atomic write
            failed = 1;
        }
        tiles_on();
        for (int64_t m0 = 0; m0 < m; m0 += MC) {
#pragma omp for schedule(static)
            for (int64_t b = 0; b < nblocks; b++) {
                if (!wp || !c) continue;
                const int64_t n0 = b * NB;
                pack_w(w, n0, n, k, nks, bf16, wp);
                for (int64_t i0 = m0; i0 < m && i0 < m0 + MC; i0 += MB) {
                    const uint16_t *x0 = xp + (i0 / 16) * nks * 2 * TILE;
                    block(wp, x0, x0 + nks * 2 * TILE, nks, bf16, c);
                    for (int q = 0; q < 4; q++) { /* tile q [weight row][activation row]: weights q / 2, rows q % 2 */
                        const int64_t i = i0 + (q % 2) * 16, j = n0 + (q / 2) * 16;
                        __m512i r[16];
                        if (i >= m || j >= n) continue;
                        for (int t = 0; t < 16; t++) r[t] = _mm512_load_si512(c + q * 256 + t * 16);
                        store_transposed(r, m - i < 16 ? m - i : 16, n - j, out + i * n + j, n);
                    }
                }
            }
        }
        _tile_release();
        free(wp);
        free(c);
    }
    free(xp);
    if (failed) return -1;
    ab_half_amx_calls++;
    return 0;
}
