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
 * table holds 2v + 12 (0..24: u8, the operand vpdpbusd / vpmaddubsw take unsigned); the 12 x (sum of the four x
 * a lane multiplies) that adds is taken off by starting the lane's sum at minus it (precomputed per activation
 * block), so the integer sums are exact and every variant gives the same bits.
 *
 * A block's 16 code bytes become one vector of [even columns 0, 2, .. 30 | odd columns 1, 3, .. 31] (low
 * nibbles, high nibbles); the activations are stored in that order, so int32 lanes 0 1 4 5 hold group 0
 * (columns 0..15) and 2 3 6 7 group 1 (16..31): one vector of scales [s0 s0 s1 s1 s0 s0 s1 s1] multiplies the
 * block's converted sums, and the row's 8 lanes are summed once at its end.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_gemv.h"

#define QB 32 /* columns per activation block */
#define MR 8  /* activation rows one pass over a weight row serves */

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

/* Activations by block, the rows of a block side by side: q [K/32][M][32] (even columns, then odd), c [K/32][M][8]
 * (-12 x the sum of each int32 lane's four codes), d [K/32][M]. */
typedef struct {
    int8_t *q;
    int32_t *c;
    float *d;
    int64_t m;
} act_t;

static int quantize(const float *x, int64_t m, int64_t k, act_t *a) {
    const int64_t nb = k / QB;
    a->q = (int8_t *)aligned_alloc(32, (size_t)(m * k));
    a->c = (int32_t *)aligned_alloc(32, sizeof(int32_t) * (size_t)(m * nb * 8));
    a->d = (float *)malloc(sizeof(float) * (size_t)(m * nb));
    a->m = m;
    if (!a->q || !a->c || !a->d) return -1;
    /* in each 128-bit half: its even bytes, then its odd ones; then 64-bit quarters 0 2 1 3 */
    const __m256i split = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                           0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    const __m256i twelve = _mm256_set1_epi8(12);
    for (int64_t r = 0; r < m * nb; r++) {
        const int64_t row = r / nb, b = r % nb;
        int8_t q[QB];
        int sums[2];
        const float d = ab_round_block(x + r * QB, q, sums);
        const __m256i v = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(_mm256_loadu_si256((const __m256i *)q), split),
                                                   0xD8);
        _mm256_store_si256((__m256i *)(a->q + (b * m + row) * QB), v);
        const __m256i c = u8_dot(twelve, v); /* 12 x each lane's four codes: |sum| <= 12 x 508, exact */
        _mm256_store_si256((__m256i *)(a->c + (b * m + row) * 8), _mm256_sub_epi32(_mm256_setzero_si256(), c));
        a->d[b * m + row] = d;
    }
    return 0;
}

static void release(act_t *a) {
    free(a->q);
    free(a->c);
    free(a->d);
}

/* One block's sums: u (2v + 12 per column, u8) against the activation block x, starting at c. */
static inline __attribute__((always_inline)) __m256i block_dot(__m256i c, __m256i u, __m256i x) {
#ifdef AB_DPBUSD
    return AB_DPBUSD(c, u, x);
#else /* pairs of 24 x 127 fit int16 */
    return _mm256_add_epi32(c, _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1)));
#endif
}

/* Activation rows m0 .. m0 + mr against weight row j (its codes w, block scales sv [K/32][4] decoded). */
static inline __attribute__((always_inline)) void rows(const act_t *a, int64_t m0, const int mr, int64_t nb,
                                                       const uint8_t *w, const float *sv, float g, float *out,
                                                       int64_t n) {
    const __m256i lut = _mm256_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0,
                                         12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0);
    const __m256i low = _mm256_set1_epi8(0x0F);
    const int64_t m = a->m;
    __m256 acc[MR];
    for (int i = 0; i < mr; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const __m128i raw = _mm_loadu_si128((const __m128i *)(w + b * (QB / 2)));
        const __m256i idx = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), low);
        const __m256i u = _mm256_shuffle_epi8(lut, idx);
        const __m256 s = _mm256_broadcast_ps((const __m128 *)(sv + 4 * b));
        const int8_t *xq = a->q + (b * m + m0) * QB;
        const int32_t *xc = a->c + (b * m + m0) * 8;
        const float *xd = a->d + b * m + m0;
#pragma GCC unroll 8
        for (int i = 0; i < mr; i++) {
            const __m256i p = block_dot(_mm256_load_si256((const __m256i *)(xc + 8 * i)), u,
                                        _mm256_load_si256((const __m256i *)(xq + QB * i)));
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(s, _mm256_set1_ps(xd[i])), acc[i]);
        }
    }
    for (int i = 0; i < mr; i++) { /* the row's 8 lanes: halves, then pairs, then the two left */
        __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc[i]), _mm256_extractf128_ps(acc[i], 1));
        h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        h = _mm_add_ss(h, _mm_movehdup_ps(h));
        out[(m0 + i) * n] = _mm_cvtss_f32(h) * g;
    }
}

/* A row's block scales as sv [K/32][4] = [s0 s0 s1 s1] (the lanes of a block's two groups, see the top), 8 blocks
 * (16 e4m3 bytes) at a time through two table gathers: a scalar loop of two lookups and four stores a block was
 * most of the time of a one-row product once the row was cached. */
static inline void block_scales(const uint8_t *s, int64_t nb, float *sv) {
    int64_t b = 0;
    for (; b + 8 <= nb; b += 8) {
        const __m128i raw = _mm_loadu_si128((const __m128i *)(s + 2 * b));
        const __m256 lo = _mm256_i32gather_ps(e4m3, _mm256_cvtepu8_epi32(raw), 4);  /* groups 0..7 */
        const __m256 hi = _mm256_i32gather_ps(e4m3, _mm256_cvtepu8_epi32(_mm_srli_si128(raw, 8)), 4);
        const __m256 l0 = _mm256_unpacklo_ps(lo, lo), l1 = _mm256_unpackhi_ps(lo, lo); /* 0 0 1 1 4 4 5 5 | 2 2 3 3 6 6 7 7 */
        const __m256 h0 = _mm256_unpacklo_ps(hi, hi), h1 = _mm256_unpackhi_ps(hi, hi);
        float *d = sv + 4 * b;
        _mm256_storeu_ps(d, _mm256_permute2f128_ps(l0, l1, 0x20));
        _mm256_storeu_ps(d + 8, _mm256_permute2f128_ps(l0, l1, 0x31));
        _mm256_storeu_ps(d + 16, _mm256_permute2f128_ps(h0, h1, 0x20));
        _mm256_storeu_ps(d + 24, _mm256_permute2f128_ps(h0, h1, 0x31));
    }
    for (; b < nb; b++) {
        const float s0 = e4m3[s[2 * b]], s1 = e4m3[s[2 * b + 1]];
        sv[4 * b] = sv[4 * b + 1] = s0;
        sv[4 * b + 2] = sv[4 * b + 3] = s1;
    }
}

/* x [M][K] fp32 times the NVFP4 weight (codes [N][K/2], e4m3 scales [N][K/16], global [N]) transposed: out [M][N].
 * K a multiple of 32. */
int ab_nvfp4_matmul(const float *x, int64_t m, int64_t k, const uint8_t *codes, const uint8_t *scales,
                    const float *global, int64_t n, float *out, int threads) {
    if (k % QB || k <= 0 || m <= 0 || n <= 0) return -2;
    act_t a;
    if (quantize(x, m, k, &a)) {
        release(&a);
        return -1;
    }
    const int64_t nb = k / QB;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        float *sv = (float *)aligned_alloc(16, sizeof(float) * (size_t)(4 * nb));
        if (!sv) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t j = 0; j < n; j++) {
            if (!sv) continue;
            block_scales(scales + j * (k / 16), nb, sv);
            const uint8_t *w = codes + j * (k / 2);
            const float g = 0.5f * global[j]; /* the table holds twice each value */
            int64_t i = 0; /* chunks of 8, then 4, 2, 1: a literal each, so the accumulators stay in registers */
            for (; i + MR <= m; i += MR) rows(&a, i, MR, nb, w, sv, g, out + j, n);
            if (i + 4 <= m) {
                rows(&a, i, 4, nb, w, sv, g, out + j, n);
                i += 4;
            }
            if (i + 2 <= m) {
                rows(&a, i, 2, nb, w, sv, g, out + j, n);
                i += 2;
            }
            if (i < m) rows(&a, i, 1, nb, w, sv, g, out + j, n);
        }
        free(sv);
    }
    release(&a);
    return failed ? -1 : 0;
}
