/* cpu_gemv.c's 4-bit product (GGUF Q4_0 / Q4_1, and the Q4_K experts: unsigned codes, a scale and an offset per
 * group) on AMX int8 tiles, for many activation rows (a prefill chunk, a warm turn's new tokens, a prompt's tokens
 * routed to one expert). Built only into the avx512-amx variant (cpu_gemv.py); ab_q4_matmul sends it calls of
 * ab_amx_min_rows rows or more that allow tiles.
 *
 * As cpu_bits_amx.c (which says why, and where callers keep the VNNI kernel): one tile product a block (tdpbusd, K
 * 32: unsigned codes times signed activations, exact in int32) for 16 weight rows x 16 activation rows, stored,
 * converted and FMA'd with (the group's weight scale x the block's activation scale) into one accumulator, block
 * after block; then the offsets' term (offset x the group's sum of the rounded activations, a chain of FMAs over the
 * groups) added as the VNNI kernels add it. Those keep each block's two halves apart (q4_dot's lanes), so the two
 * differ by fp32 rounding.
 *
 * Layout: the codes are unpacked per 16 weight rows (four of cpu_gemv.c's tiles) into the A tiles, [block][16
 * rows][32 codes] in element order, once for every activation tile they meet; the activations are the B tiles as
 * cpu_bits_amx.c packs them (per 16 rows and block, 8 rows of 64 bytes: 16 activation rows x 4 consecutive columns).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_gemv.h"

#ifdef __AMX_INT8__
#include <omp.h>

#include "amx_blocks.h"

#define QB 32 /* elements per block */
#define NR 4  /* weight rows of one of cpu_gemv.c's Q4 tiles */

extern int64_t ab_amx_calls; /* cpu_bits_amx.c */
int ab_bits_amx_ready(void);

/* Activations as B tiles: q [tiles][nb][8][16][4], d [tiles][nb][16] (the block scales); and the groups' sums of the
 * rounded activations (summed as quantize_activations in cpu_gemv.c does) as the A tiles of the offsets' product, in
 * three bf16 parts: gs [tiles][3][steps][16 rows][16 groups]. Rows and groups past m and gk are zero. */
static int pack(const float *x, int64_t m, int64_t k, int64_t group, int8_t **q, float **d, uint16_t **gs,
                int threads) {
    const int64_t nb = k / QB, gk = k / group, per = group / QB, tiles = (m + TM - 1) / TM, steps = (gk + 15) / 16;
    *q = aligned_alloc(64, (size_t)(tiles * nb * TM * QB));
    *d = aligned_alloc(64, sizeof(float) * (size_t)(tiles * nb * TM));
    *gs = aligned_alloc(64, sizeof(uint16_t) * (size_t)(tiles * 3 * steps * 256));
    if (!*q || !*d || !*gs) return -1;
    memset(*q, 0, (size_t)(tiles * nb * TM * QB));
    memset(*d, 0, sizeof(float) * (size_t)(tiles * nb * TM));
    memset(*gs, 0, sizeof(uint16_t) * (size_t)(tiles * 3 * steps * 256));
#pragma omp parallel for schedule(static, TM) num_threads(threads) if (threads > 1 && m > TM) /* cpu_bits_amx.c's */
    for (int64_t i = 0; i < m; i++) {
        const int64_t t = i / TM, j = i % TM;
        float sums_g[steps * 16];
        memset(sums_g, 0, sizeof(sums_g));
        for (int64_t g = 0, b = 0; g < gk; g++) {
            float sum = 0.0f;
            for (int64_t e = 0; e < per; e++, b++) {
                int8_t c[QB];
                int sums[2];
                const float db = ab_round_block(x + i * k + b * QB, c, sums);
                (*d)[(t * nb + b) * TM + j] = db;
                sum += db * (float)(sums[0] + sums[1]);
                int8_t *dst = *q + (t * nb + b) * TM * QB;
                for (int p = 0; p < QB / 4; p++) memcpy(dst + p * 64 + j * 4, c + 4 * p, 4);
            }
            sums_g[g] = sum;
        }
        for (int64_t s = 0; s < steps; s++) {
            __m512 part[3];
            split3(_mm512_loadu_ps(sums_g + 16 * s), part);
            for (int p = 0; p < 3; p++)
                _mm256_store_si256((__m256i *)(*gs + ((t * 3 + p) * steps + s) * 256 + j * 16), bf16_bits(part[p]));
        }
    }
    return 0;
}

/* Weight rows n0 .. n0 + 15 as A tiles a [nb][16][32], their scales sc [nb][16] (each block its group's, so the
 * block loop indexes without a division) and offsets of [gk][16]. A Q4 tile's block is 64 bytes [half h][row r][8]:
 * byte i holds elements e = 16 h + (i < 4 ? i : i + 4) and e + 4, e in the low nibble for even rows and in the high
 * one for odd rows (cpu_gemv.c). So int32 lane (h, r, s) of the low nibbles holds quadword 4 h + 2 s of an even row
 * (elements 16 h + 8 s ..+ 3) and of the high nibbles quadword 4 h + 2 s + 1; odd rows the other way round. */
static void unpack(const uint8_t *codes, const char *so, int64_t k, int64_t group, int64_t n0, int half, uint8_t *a,
                   float *sc, float *of, uint16_t *ob) {
    const int64_t nb = k / QB, gk = k / group, per = group / QB, es = half ? 2 : 4;
    const __m512i low = _mm512_set1_epi8(0x0F);
    /* output lane 8 rr + u of vector z (row r = 2 z + rr, quadword u: elements 4 u .. 4 u + 3) <- lane of (lo | hi) */
    __m512i idx[2];
    for (int z = 0; z < 2; z++) {
        int32_t v[16];
        for (int rr = 0; rr < 2; rr++)
            for (int u = 0; u < 8; u++) {
                const int r = 2 * z + rr, h = u / 4, s = u % 4 / 2, nib = (u % 2) ^ (r % 2); /* nib 1: high nibbles */
                v[8 * rr + u] = nib * 16 + h * 8 + r * 2 + s;
            }
        idx[z] = _mm512_loadu_si512(v);
    }
    for (int64_t tt = 0; tt < TN / NR; tt++) {
        const int64_t t = n0 / NR + tt;
        const uint8_t *c = codes + t * NR * k / 2;
        for (int64_t b = 0; b < nb; b++) {
            const __m512i w = _mm512_loadu_si512(c + b * 64);
            const __m512i lo = _mm512_and_si512(w, low), hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), low);
            for (int z = 0; z < 2; z++)
                _mm512_store_si512(a + (b * TN + tt * NR + 2 * z) * QB, _mm512_permutex2var_epi32(lo, idx[z], hi));
        }
        const char *st = so + t * gk * 2 * NR * es;
        for (int64_t g = 0; g < gk; g++) { /* a group's 4 scales, then its 4 offsets: one vector each */
            const char *at = st + g * 2 * NR * es;
            const __m128 scale = half ? _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)at)) : _mm_loadu_ps((const float *)at);
            for (int64_t b = g * per; b < (g + 1) * per; b++) _mm_storeu_ps(sc + b * TN + tt * NR, scale);
            _mm_storeu_ps(of + g * TN + tt * NR, half ? _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(at + NR * es)))
                                                       : _mm_loadu_ps((const float *)(at + NR * es)));
        }
    }
    /* the offsets as the B tiles of their product, in three bf16 parts: ob [3][steps][8][16 rows][2] (B row e:
     * groups 2e, 2e + 1 of each weight row), past gk zero */
    const int64_t steps = (gk + 15) / 16;
    for (int64_t s = 0; s < steps; s++)
        for (int64_t e = 0; e < 8; e++) {
            const int64_t g = 16 * s + 2 * e;
            __m512 lo[3], hi[3];
            split3(g < gk ? _mm512_load_ps(of + g * TN) : _mm512_setzero_ps(), lo);
            split3(g + 1 < gk ? _mm512_load_ps(of + (g + 1) * TN) : _mm512_setzero_ps(), hi);
            for (int p = 0; p < 3; p++) _mm512_store_si512(ob + ((p * steps + s) * 8 + e) * 32, bf16_pairs(lo[p], hi[p]));
        }
}

#define PRODUCT(C, A, B, b) UNPACKED_PRODUCT(C, A, B, b, _tile_dpbusd) /* unsigned codes */

/* Activation tile t against the unpacked weight rows (TN: four Q4 tiles): out[i][n0 + r]. The offsets' term (the
 * sum over the groups of offset x the group's activation sum) is a bf16 tile product of their three-part splits
 * into tile 2, [activation row][weight row] (h h, h m, m h, m m, h l, l h: the parts left out are below 2^-24 of a
 * term), 16 groups a product, added after the sums' transpose. The FMA chains it replaces (one a group, weight row
 * and activation tile) were 15 % of the kernel at K 768-2048: the FP ports, not the tiles, bound it. */
static void tile_pair(const int8_t *xq, const float *xd, const uint16_t *gs, int64_t t, int64_t m, int64_t k,
                      int64_t group, const uint8_t *a, const float *sc, const uint16_t *ob, int64_t n0, int64_t n,
                      float *out) {
    const int64_t nb = k / QB, steps = (k / group + 15) / 16;
    __m512 acc[TN];
    BLOCKS(PRODUCT, nb, xd + t * nb * TM, sc, acc);
    const uint16_t *ga = gs + t * 3 * steps * 256;
    _tile_zero(2);
    for (int64_t s = 0; s < steps; s++) {
        _tile_loadd(4, ga + s * 256, 32);                       /* sums h */
        _tile_loadd(6, ob + s * 256, 64);                       /* offsets h */
        _tile_dpbf16ps(2, 4, 6);
        _tile_loadd(7, ob + (steps + s) * 256, 64);             /* offsets m */
        _tile_dpbf16ps(2, 4, 7);
        _tile_loadd(5, ga + (steps + s) * 256, 32);             /* sums m */
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(2, 5, 7);
        _tile_loadd(7, ob + (2 * steps + s) * 256, 64);         /* offsets l */
        _tile_dpbf16ps(2, 4, 7);
        _tile_loadd(5, ga + (2 * steps + s) * 256, 32);         /* sums l */
        _tile_dpbf16ps(2, 5, 6);
    }
    float c[TM * TN] __attribute__((aligned(64)));
    _tile_stored(2, c, 64);
    const int64_t rows = m - t * TM < TM ? m - t * TM : TM;
    __m512i r[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_castps_si512(acc[i]);
    transpose16(r);
    for (int64_t i = 0; i < rows; i++)
        _mm512_storeu_ps(out + (t * TM + i) * n + n0, _mm512_add_ps(_mm512_castsi512_ps(r[i]), _mm512_load_ps(c + i * TN)));
}

/* The weight rows done, the first N / 16 x 16 (ab_q4_matmul's VNNI kernel does the rest): 0 where the tiles do not
 * take the call (no tile state); -1 out of memory. */
int64_t ab_q4_matmul_amx(const float *x, int64_t m, int64_t k, const uint8_t *codes, const void *so, int64_t n,
                         int64_t group, float *out, int threads, int half) {
    if (n < TN || m < 1 || !ab_bits_amx_ready()) return 0;
    threads = threads < 1 ? 1 : threads;
    const int64_t nb = k / QB, gk = k / group, ntiles = n / TN, slice = slice_rows(k), steps = (gk + 15) / 16;
    /* each thread's unpacked weights, their scales and offsets, and the offsets' bf16 parts */
    const int64_t own = nb * TN * QB + (nb + gk) * TN * (int64_t)sizeof(float) + 3 * steps * 256 * 2;
    uint8_t *scratch = aligned_alloc(64, (size_t)(threads * own));
    if (!scratch) return -1;
    int rc = 0;
#pragma omp atomic
    ab_amx_calls++;
    for (int64_t i0 = 0; i0 < m && !rc; i0 += slice) {
        const int64_t mc = m - i0 < slice ? m - i0 : slice, tiles = (mc + TM - 1) / TM;
        int8_t *xq = NULL;
        float *xd = NULL;
        uint16_t *gs = NULL;
        if (pack(x + i0 * k, mc, k, group, &xq, &xd, &gs, threads)) {
            rc = -1;
        } else {
#pragma omp parallel num_threads(threads) if (threads > 1)
            {
                uint8_t *a = scratch + omp_get_thread_num() * own;
                float *sc = (float *)(a + nb * TN * QB), *of = sc + nb * TN;
                uint16_t *ob = (uint16_t *)(of + gk * TN);
                blocks_on();
#pragma omp for schedule(static)
                for (int64_t nt = 0; nt < ntiles; nt++) {
                    unpack(codes, so, k, group, nt * TN, half, a, sc, of, ob);
                    for (int64_t t = 0; t < tiles; t++)
                        tile_pair(xq, xd, gs, t, mc, k, group, a, sc, ob, nt * TN, n, out + i0 * n);
                }
                _tile_release();
            }
        }
        free(xq);
        free(xd);
        free(gs);
    }
    free(scratch);
    return rc ? -1 : ntiles * TN;
}
#endif
