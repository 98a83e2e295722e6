/* NVFP4 weight-only matmul for AVX2 + FMA CPUs, and the VNNI variants (built by cpu_nvfp4.py, one library per
 * cpu_gemv.Isa; the Python side and the torch twin are in cpu_nvfp4.py).
 *
 * The weight is read in the checkpoint's own layout, so experts loaded from a ModelOpt or compressed-tensors
 * release run as loaded (4.5 bits a weight, nothing repacked): codes uint8 [N][K/2] (two e2m1 codes a byte,
 * column 2j in the low nibble), scales e4m3 [N][K/16], a global fp32 multiplier per row.
 *
 * Why integers: twice an e2m1 value is one of 0, 1, 2, 3, 4, 6, 8, 12 with a sign, so a 16-entry byte table
 * (vpshufb) turns a code into an int8 and a block of 32 is one int8 dot product against the activations rounded
 * to int8 per 32 (ab_round_block: the rounding every CPU kernel here shares, round_activations its twin). The
 * table holds 2v + 12 (0..24: u8, the operand vpdpbusd / vpmaddubsw take unsigned); the 12 x (sum of the x a
 * lane multiplies) that adds is taken off by starting the lane's sum at minus it (precomputed per activation
 * block), so the integer sums are exact and every variant gives the same bits.
 *
 * Rows go in tiles of four (the last tile repeats its last row, results dropped). A block's 16 code bytes of a row
 * become one vector whose low half holds columns 0..15 (bytes 0..7's low nibbles, then their high ones) and whose
 * high half holds columns 16..31, so a half is one scale group. The tile's four vectors are transposed
 * (transpose4) so that int32 lane j holds four codes of row j % 4; against the activation block spread into four
 * operands (x's 32-bit lane t of each half in all four lanes of that half, stored so when x is rounded) four dot
 * products sum vertically into one vector of the tile's sums, rows 0 1 2 3 | 0 1 2 3 of group 0 | group 1: one
 * conversion, one multiply (the tile's scales times the block's d) and one FMA per block and activation row serve
 * four rows, with no horizontal step until the end (cpu_bits.c's scheme; NVFP4's group of 16 is a half). One
 * row at a time took 3.9 ms for 8 activation rows of a 4096 x 4096 weight, 3x cpu_gemv's Q4 kernel.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_gemv.h"

#define QB 32 /* columns per activation block */
#define NR 4  /* weight rows a tile */
#define MR 8  /* activation rows one pass over a tile serves */

/* e4m3 (fn: no infinities, 0x7F / 0xFF NaN) -> float, exact: filled when the library loads. */
static float e4m3[256];

__attribute__((constructor)) static void fill_e4m3(void) {
    for (int b = 0; b < 256; b++) {
        const int e = (b >> 3) & 15, m = b & 7;
        float v = e == 0 ? ldexpf((float)m, -9) : ldexpf((float)(8 + m), e - 10);
        if (e == 15 && m == 7) v = NAN;
        e4m3[b] = b & 0x80 ? -v : v;
    }
}

const char *ab_nvfp4_isa(void) { return AB_ISA; }

/* Activations by block, the rows of a block side by side: q [K/32][M][4][32] (the four spread operands; in each
 * half the columns in the codes' order: even, then odd), c [K/32][M][8] (-12 x the sum of each half's codes, in
 * that half's four lanes: the table's offset), d [K/32][M]. */
typedef struct {
    int8_t *q;
    int32_t *c;
    float *d;
    int64_t m;
} act_t;

static int quantize(const float *x, int64_t m, int64_t k, act_t *a) {
    const int64_t nb = k / QB;
    a->q = (int8_t *)aligned_alloc(32, (size_t)(m * k * 4));
    a->c = (int32_t *)aligned_alloc(32, sizeof(int32_t) * (size_t)(m * nb * 8));
    a->d = (float *)malloc(sizeof(float) * (size_t)(m * nb));
    a->m = m;
    if (!a->q || !a->c || !a->d) return -1;
    /* in each half: its even columns, then its odd ones (a code byte holds columns 2j, 2j + 1: see `codes`) */
    const __m256i split = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                           0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    for (int64_t r = 0; r < m * nb; r++) {
        const int64_t row = r / nb, b = r % nb;
        int8_t q[QB];
        int sums[2];
        const float d = ab_round_block(x + r * QB, q, sums);
        const __m256i v = _mm256_shuffle_epi8(_mm256_loadu_si256((const __m256i *)q), split);
        __m256i *spread = (__m256i *)(a->q + (b * m + row) * 4 * QB);
        _mm256_store_si256(spread, _mm256_shuffle_epi32(v, 0x00));
        _mm256_store_si256(spread + 1, _mm256_shuffle_epi32(v, 0x55));
        _mm256_store_si256(spread + 2, _mm256_shuffle_epi32(v, 0xAA));
        _mm256_store_si256(spread + 3, _mm256_shuffle_epi32(v, 0xFF));
        const int c0 = -12 * sums[0], c1 = -12 * sums[1]; /* |12 x 16 x 127|: exact */
        _mm256_store_si256((__m256i *)(a->c + (b * m + row) * 8), _mm256_setr_epi32(c0, c0, c0, c0, c1, c1, c1, c1));
        a->d[b * m + row] = d;
    }
    return 0;
}

static void release(act_t *a) {
    free(a->q);
    free(a->c);
    free(a->d);
}

/* Block b's 32 codes of a row as table values (2v + 12, u8): low half columns 0..15, high half 16..31. */
static inline __attribute__((always_inline)) __m256i codes(const uint8_t *w, int64_t b) {
    const __m256i lut = _mm256_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0,
                                         12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0);
    const __m128i raw = _mm_loadu_si128((const __m128i *)(w + b * (QB / 2)));
    const __m256i nib = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0F));
    /* [low nibbles of bytes 0..15 | high nibbles] -> quarters 0 2 1 3: bytes 0..7's columns, then bytes 8..15's */
    return _mm256_shuffle_epi8(lut, _mm256_permute4x64_epi64(nib, 0xD8));
}

static inline __attribute__((always_inline)) void transpose4(const __m256i *c, __m256i *v) {
    const __m256i t0 = _mm256_unpacklo_epi32(c[0], c[1]), t1 = _mm256_unpackhi_epi32(c[0], c[1]);
    const __m256i t2 = _mm256_unpacklo_epi32(c[2], c[3]), t3 = _mm256_unpackhi_epi32(c[2], c[3]);
    v[0] = _mm256_unpacklo_epi64(t0, t2);
    v[1] = _mm256_unpackhi_epi64(t0, t2);
    v[2] = _mm256_unpacklo_epi64(t1, t3);
    v[3] = _mm256_unpackhi_epi64(t1, t3);
}

/* The tile's sums of one activation block (x: its four spread operands), starting at c (the table's offset). */
static inline __attribute__((always_inline)) __m256i tile_dot(const __m256i *v, const __m256i *x, __m256i c) {
#ifdef AB_DPBUSD
    return AB_DPBUSD(AB_DPBUSD(AB_DPBUSD(AB_DPBUSD(c, v[0], x[0]), v[1], x[1]), v[2], x[2]), v[3], x[3]);
#else /* pairs of 24 x 127, four pairs summed in int16: at most 24,384 */
    const __m256i s = _mm256_add_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(v[0], x[0]), _mm256_maddubs_epi16(v[1], x[1])),
                                       _mm256_add_epi16(_mm256_maddubs_epi16(v[2], x[2]), _mm256_maddubs_epi16(v[3], x[3])));
    return _mm256_add_epi32(c, _mm256_madd_epi16(s, _mm256_set1_epi16(1)));
#endif
}

/* Activation rows m0 .. m0 + mr against the tile's rows w[r] (st [K/32][8]: the tile's scales a block, rows 0 1 2 3
 * of group 0, then of group 1; g: the rows' globals, halved). */
static inline __attribute__((always_inline)) void rows(const act_t *a, int64_t m0, const int mr, int64_t nb,
                                                       const uint8_t *const *w, const float *st, __m128 g,
                                                       float *out, int64_t n, int valid) {
    const int64_t m = a->m;
    __m256 acc[MR];
    for (int i = 0; i < mr; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256i u[NR], v[NR];
        for (int r = 0; r < NR; r++) u[r] = codes(w[r], b);
        transpose4(u, v);
        const __m256 s = _mm256_load_ps(st + 8 * b);
        const __m256i *xq = (const __m256i *)(a->q + (b * m + m0) * 4 * QB);
        const int32_t *xc = a->c + (b * m + m0) * 8;
        const float *xd = a->d + b * m + m0;
#pragma GCC unroll 8
        for (int i = 0; i < mr; i++) {
            const __m256i p = tile_dot(v, xq + 4 * i, _mm256_load_si256((const __m256i *)(xc + 8 * i)));
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(s, _mm256_set1_ps(xd[i])), acc[i]);
        }
    }
    for (int i = 0; i < mr; i++) { /* group 0's half plus group 1's, times the globals */
        float o[NR];
        _mm_storeu_ps(o, _mm_mul_ps(_mm_add_ps(_mm256_castps256_ps128(acc[i]), _mm256_extractf128_ps(acc[i], 1)), g));
        for (int r = 0; r < valid; r++) out[(m0 + i) * n + r] = o[r];
    }
}

/* Sixteen e4m3 bytes -> floats, exactly: through fp16 bits (sign, then the 7 exponent and mantissa bits shifted
 * into fp16's places: fp16's exponent bias is 8 more, so the value is 2^-8 of e4m3's, subnormals included, which
 * vcvtph2ps converts exactly), times 256; 0x7F / 0xFF (e4m3's NaN) made fp16 NaNs. */
static inline __attribute__((always_inline)) void e4m3x16(__m128i raw, float *dst) {
    const __m256i x = _mm256_cvtepu8_epi16(raw), mag = _mm256_and_si256(x, _mm256_set1_epi16(0x7F));
    __m256i h = _mm256_or_si256(_mm256_slli_epi16(mag, 7), _mm256_slli_epi16(_mm256_and_si256(x, _mm256_set1_epi16(0x80)), 8));
    h = _mm256_or_si256(h, _mm256_and_si256(_mm256_cmpeq_epi16(mag, _mm256_set1_epi16(0x7F)), _mm256_set1_epi16(0x7E00)));
    const __m256 k = _mm256_set1_ps(256.0f);
    _mm256_store_ps(dst, _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), k));
    _mm256_store_ps(dst + 8, _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), k));
}

/* A tile's block scales as st [K/32][8]: rows 0 1 2 3 of a block's group 0, then of its group 1. Eight blocks (16
 * bytes a row) at a time: the four rows' bytes interleaved (rows of a group side by side) and converted 16 at a
 * time; a lookup a scale was half the time of a one-row product of a 4096 x 4096 weight. */
static inline __attribute__((always_inline)) void tile_scales(const uint8_t *const *s, int64_t nb, float *st) {
    int64_t b = 0;
    for (; b + 8 <= nb; b += 8) {
        __m128i r[NR];
        for (int i = 0; i < NR; i++) r[i] = _mm_loadu_si128((const __m128i *)(s[i] + 2 * b));
        const __m128i a0 = _mm_unpacklo_epi8(r[0], r[1]), a1 = _mm_unpackhi_epi8(r[0], r[1]); /* groups 0..7 | 8..15 */
        const __m128i b0 = _mm_unpacklo_epi8(r[2], r[3]), b1 = _mm_unpackhi_epi8(r[2], r[3]);
        float *d = st + 8 * b;
        e4m3x16(_mm_unpacklo_epi16(a0, b0), d);      /* groups 0..3: blocks b, b + 1 */
        e4m3x16(_mm_unpackhi_epi16(a0, b0), d + 16); /* groups 4..7 */
        e4m3x16(_mm_unpacklo_epi16(a1, b1), d + 32);
        e4m3x16(_mm_unpackhi_epi16(a1, b1), d + 48);
    }
    for (; b < nb; b++) /* a row's last blocks (K not a multiple of 256) */
        for (int r = 0; r < NR; r++) {
            st[8 * b + r] = e4m3[s[r][2 * b]];
            st[8 * b + 4 + r] = e4m3[s[r][2 * b + 1]];
        }
}

/* x [M][K] fp32 times the NVFP4 weight (codes [N][K/2], e4m3 scales [N][K/16], global [N]) transposed: out [M][N].
 * K a multiple of 32. */
int ab_nvfp4_matmul(const float *x, int64_t m, int64_t k, const uint8_t *codes_, const uint8_t *scales,
                    const float *global, int64_t n, float *out, int threads) {
    if (k % QB || k <= 0 || m <= 0 || n <= 0) return -2;
    act_t a;
    if (quantize(x, m, k, &a)) {
        release(&a);
        return -1;
    }
    const int64_t nb = k / QB, tiles = (n + NR - 1) / NR;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        float *st = (float *)aligned_alloc(32, sizeof(float) * (size_t)(8 * nb));
        if (!st) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            if (!st) continue;
            const int64_t j = NR * t;
            const int valid = n - j < NR ? (int)(n - j) : NR;
            const uint8_t *w[NR], *s[NR];
            float gs[NR];
            for (int r = 0; r < NR; r++) { /* past the last row: the last row again, its results dropped */
                const int64_t row = j + (r < valid ? r : valid - 1);
                w[r] = codes_ + row * (k / 2);
                s[r] = scales + row * (k / 16);
                gs[r] = 0.5f * global[row]; /* the table holds twice each value */
            }
            tile_scales(s, nb, st);
            const __m128 g = _mm_loadu_ps(gs);
            int64_t i = 0; /* chunks of 8, then 4, 2, 1: a literal each, so the accumulators stay in registers */
            for (; i + MR <= m; i += MR) rows(&a, i, MR, nb, w, st, g, out + j, n, valid);
            if (i + 4 <= m) {
                rows(&a, i, 4, nb, w, st, g, out + j, n, valid);
                i += 4;
            }
            if (i + 2 <= m) {
                rows(&a, i, 2, nb, w, st, g, out + j, n, valid);
                i += 2;
            }
            if (i < m) rows(&a, i, 1, nb, w, st, g, out + j, n, valid);
        }
        free(st);
    }
    release(&a);
    return failed ? -1 : 0;
}
