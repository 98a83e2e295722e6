/* k-bit (2, 3, 5, 6, 8) weight-only matmul for AVX2 + FMA CPUs, and the VNNI variants (built with cpu_gemv.c by
 * cpu_gemv.py; the layout is cpu_bits_layout.h's, the Python side, packing and torch twins are in cpu_bits.py).
 *
 * Offsets stay out of the block loop (see `record`); the next tile's rows are prefetched while this one
 * computes, and rows past N % 4 rerun the last row (one code path). Up to 8 activation rows share a pass over a
 * tile: a block's codes of the four rows are unpacked and transposed once (transpose4) so that each activation
 * row's products sum vertically (tile_dot), with no horizontal add per row.
 *
 * Activations are rounded to int8 per 32 exactly as cpu_gemv.c does (round_activations), so the kernel and
 * a many-row caller's dequantise + sgemm on the rounded x compute the same numbers.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_bits_layout.h"
#include "cpu_gemv.h"

extern int ab_amx_min_rows; /* cpu_bits_amx.c */
int64_t ab_bits_matmul_amx(const float *x, int64_t m, const uint8_t *w, const shape_t *s, float *out, int threads);
int ab_bits_q8z(const float *x, int64_t m, const uint8_t *w, const shape_t *s, float *out, int64_t first, int threads);

/* Activations with a block's rows side by side, so the kernel's loop over rows reads at constant offsets from one
 * pointer, and each block as the four operands of transpose4's vectors (x's 32-bit lane t of each half in all four
 * lanes of that half), so a product's operand is a memory operand, not a shuffle per activation row. */
typedef struct {
    int8_t *q;   /* [K/32][M][4][32]: block b of row i, operand t at ((b M + i) 4 + t) 32 */
    float *d;    /* [K/32][M] */
    float *gs;   /* [M][records][GM][4]: d * (sum of the rounded x) per scale group, 4 copies (the offsets' term
                  * takes two groups a 256-bit FMA); zero past the record's */
    int32_t *cs; /* codes centred without offsets (bits 2-6): [K/32][M][8], -2^(bits-1) (sum of the rounded x over
                  * elements 0..15) in lanes 0-3, over 16..31 in lanes 4-7: the centre's term of a block's sums */
    int64_t m;
} act_t;

static int quantize(const float *x, int64_t m, const shape_t *s, act_t *a) {
    const int64_t k = s->k, nb = k / QB, recs = nrecords(s), per = QB / s->group;
    a->q = (int8_t *)aligned_alloc(32, (size_t)(m * k * 4));
    a->d = (float *)malloc(sizeof(float) * (size_t)(m * nb));
    a->gs = (float *)aligned_alloc(32, sizeof(float) * (size_t)(m * recs * GM * 4));
    const int cent = !s->off && s->bits != 8;
    a->cs = cent ? (int32_t *)aligned_alloc(32, sizeof(int32_t) * (size_t)(m * nb * 8)) : NULL;
    a->m = m;
    if (!a->q || !a->d || !a->gs || (cent && !a->cs)) return -1;
    memset(a->gs, 0, sizeof(float) * (size_t)(m * recs * GM * 4));
    for (int64_t r = 0; r < m * nb; r++) {
        int sq[2];
        int8_t q[QB];
        const float d = ab_round_block(x + r * QB, q, sq);
        const int64_t row = r / nb, b = r % nb;
        const __m256i xv = _mm256_loadu_si256((const __m256i *)q);
        __m256i *spread = (__m256i *)(a->q + (b * m + row) * 4 * QB);
        _mm256_store_si256(spread, _mm256_shuffle_epi32(xv, 0x00));
        _mm256_store_si256(spread + 1, _mm256_shuffle_epi32(xv, 0x55));
        _mm256_store_si256(spread + 2, _mm256_shuffle_epi32(xv, 0xAA));
        _mm256_store_si256(spread + 3, _mm256_shuffle_epi32(xv, 0xFF));
        a->d[b * m + row] = d;
        if (cent) {
            const int c = -(1 << (s->bits - 1));
            _mm256_store_si256((__m256i *)(a->cs + (b * m + row) * 8),
                               _mm256_setr_epi32(c * sq[0], c * sq[0], c * sq[0], c * sq[0], c * sq[1], c * sq[1],
                                                 c * sq[1], c * sq[1]));
        }
        float *gs = a->gs + ((row * recs + b / PB) * GM + (b % PB) * per) * 4;
        const float g0 = per == 1 ? d * (float)(sq[0] + sq[1]) : d * (float)sq[0], g1 = d * (float)sq[1];
        for (int j = 0; j < 4; j++) {
            gs[j] = g0;
            if (per == 2) gs[4 + j] = g1;
        }
    }
    return 0;
}

static void release(act_t *a) {
    free(a->q);
    free(a->d);
    free(a->gs);
    free(a->cs);
}

/* Four rows' 8 scales (or offset terms) c .. c + 7 (rows' arrays of GM) as st[c .. c + 7][NR]: a 4 x 8 transpose,
 * so a block's scales of all four rows are one load. */
static inline __attribute__((always_inline)) void transpose4x8(const float (*v)[GM], int c, float (*t)[NR]) {
    const __m256 r0 = _mm256_loadu_ps(v[0] + c), r1 = _mm256_loadu_ps(v[1] + c);
    const __m256 r2 = _mm256_loadu_ps(v[2] + c), r3 = _mm256_loadu_ps(v[3] + c);
    const __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
    const __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
    const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE); /* c, c + 4 | c + 1, c + 5 */
    const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE); /* c + 2, c + 6 | c + 3, c + 7 */
    _mm256_storeu_ps(t[c], _mm256_permute2f128_ps(u0, u1, 0x20));
    _mm256_storeu_ps(t[c + 2], _mm256_permute2f128_ps(u2, u3, 0x20));
    _mm256_storeu_ps(t[c + 4], _mm256_permute2f128_ps(u0, u1, 0x31));
    _mm256_storeu_ps(t[c + 6], _mm256_permute2f128_ps(u2, u3, 0x31));
}

/* A tile's four rows of a block's codes c[r] (lane e = element e) as v[t]: int32 lane j of v[t] holds four codes
 * of row j % 4, elements 16 (j / 4) + 4t .. + 3 (a 4 x 4 transpose of 32-bit lanes in each half: 8 in-lane
 * shuffles per tile and block, not per activation row). Against x[t] (x's 32-bit lane t of each half in all
 * four lanes of that half: `spread`) a row's products then sum vertically into one vector of the tile's sums,
 * rows 0 1 2 3 | 0 1 2 3 of elements 0..15 | 16..31, with no horizontal add per activation row. */
static inline __attribute__((always_inline)) void transpose4(const __m256i *c, __m256i *v) {
    const __m256i t0 = _mm256_unpacklo_epi32(c[0], c[1]), t1 = _mm256_unpackhi_epi32(c[0], c[1]);
    const __m256i t2 = _mm256_unpacklo_epi32(c[2], c[3]), t3 = _mm256_unpackhi_epi32(c[2], c[3]);
    v[0] = _mm256_unpacklo_epi64(t0, t2);
    v[1] = _mm256_unpackhi_epi64(t0, t2);
    v[2] = _mm256_unpacklo_epi64(t1, t3);
    v[3] = _mm256_unpackhi_epi64(t1, t3);
}

/* The tile's sums of one activation block (x: its four operands, see act_t) against v[t] (transpose4), int32
 * rows 0 1 2 3 | 0 1 2 3. Unsigned 5- and 6-bit codes: u8 x s8 products (AVX2: pairs to int16, then at most 8
 * products of 31 x 127 summed in int16 for 5 bits, 4 of 63 x 127 for 6). 8-bit codes are signed: |w| (av) against
 * x with w's sign moved on, and pairs of 128 x 127 leave no room in int16 for more. VNNI: vpdpbusd, the same
 * lanes. Integer sums are exact, so this is lane for lane the sums the previous kernel's horizontal adds (three
 * per block and activation row) gave. */
static inline __attribute__((always_inline)) __m256i tile_dot(const __m256i *v, const __m256i *av, const __m256i *x,
                                                            const int bits) {
    __m256i xs[4];
    for (int t = 0; t < 4; t++) xs[t] = bits == 8 ? _mm256_sign_epi8(_mm256_load_si256(x + t), v[t]) : _mm256_load_si256(x + t);
    const __m256i *u = bits == 8 ? av : v;
#ifdef AB_DPBUSD
    const __m256i z = _mm256_setzero_si256();
    return _mm256_add_epi32(AB_DPBUSD(AB_DPBUSD(z, u[0], xs[0]), u[1], xs[1]), AB_DPBUSD(AB_DPBUSD(z, u[2], xs[2]), u[3], xs[3]));
#else
    const __m256i one = _mm256_set1_epi16(1);
    const __m256i p0 = _mm256_maddubs_epi16(u[0], xs[0]), p1 = _mm256_maddubs_epi16(u[1], xs[1]);
    const __m256i p2 = _mm256_maddubs_epi16(u[2], xs[2]), p3 = _mm256_maddubs_epi16(u[3], xs[3]);
    if (bits <= 5) /* 2, 3 bits: pairs of 7 x 127 at most, four sums stay far inside int16 as well */
        return _mm256_madd_epi16(_mm256_add_epi16(_mm256_add_epi16(p0, p1), _mm256_add_epi16(p2, p3)), one);
    if (bits == 6)
        return _mm256_add_epi32(_mm256_madd_epi16(_mm256_add_epi16(p0, p1), one), _mm256_madd_epi16(_mm256_add_epi16(p2, p3), one));
    return _mm256_add_epi32(_mm256_add_epi32(_mm256_madd_epi16(p0, one), _mm256_madd_epi16(p1, one)),
                            _mm256_add_epi32(_mm256_madd_epi16(p2, one), _mm256_madd_epi16(p3, one)));
#endif
}

/* Block b of a record: the tile's four rows' codes unpacked and transposed once, then each activation row's
 * products (tile_dot) and one FMA. A helper so that `record` can run it with b a literal for one activation row:
 * codes() picks its shifts and plane by b, which in a rolled loop are run-time selects; unrolled, a one-row 6-bit
 * product (a decode step's Q6_K LM head and experts) ran 1.2-1.3x faster. */
static inline __attribute__((always_inline)) void record_block(const uint8_t *const *h, int64_t hb, int b, int64_t pairs,
                                                               int p, const float (*st)[NR], const int8_t *xq,
                                                               const float *xd, const int32_t *cs, int64_t m,
                                                               const int mr, __m256 *sum, const int bits,
                                                               const int group) {
    __m256i q[NR], v[NR], av[NR];
    for (int r = 0; r < NR; r++) q[r] = codes(h[r] + hb, b, pairs, p, bits);
    transpose4(q, v);
    if (bits == 8)
        for (int t = 0; t < NR; t++) av[t] = _mm256_sign_epi8(v[t], v[t]);
    const __m256 sv = group == 32 ? _mm256_broadcast_ps((const __m128 *)st[b]) : _mm256_loadu_ps(st[2 * b]);
#pragma GCC unroll 8
    for (int i = 0; i < mr; i++) {
        __m256i prod = tile_dot(v, av, (const __m256i *)(xq + (b * m + i) * 4 * QB), bits);
        if (cs) /* centred codes: the centre's term, exact in int32 (16 products of at most 63 x 127 a lane) */
            prod = _mm256_add_epi32(prod, _mm256_load_si256((const __m256i *)(cs + (b * m + i) * 8)));
        sum[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(prod), _mm256_mul_ps(sv, _mm256_broadcast_ss(xd + b * m + i)), sum[i]);
    }
}

/* The scales of a full record of four rows in the I8 form without offsets and groups of 16 (GGUF Q6_K: d fp32 and
 * 16 int8 sub-scales a row), straight into record's transposed st[c][r] = d_r c_r[c]: the rows' 16 bytes of
 * sub-scales transposed as bytes (4 unpacks), then 8 widen-convert-multiply steps. The same products as header +
 * transpose4x8, which took 2 x 4 header passes and 2 transposes through memory a record: a one-row Q6_K product
 * spent a sixth of its time there (the Q6_K LM head of a Q4_K_M Qwen3-30B-A3B, 151,936 x 2048, one thread on the
 * AVX-512 EPYC: 12.5 -> 11.3-11.4 ms, the same bits). */
static inline __attribute__((always_inline)) void scales_q6(const uint8_t *const *h, float (*st)[NR]) {
    float d[NR];
    for (int r = 0; r < NR; r++) memcpy(d + r, h[r], 4);
    const __m128i c0 = _mm_loadu_si128((const __m128i *)(h[0] + 4)), c1 = _mm_loadu_si128((const __m128i *)(h[1] + 4));
    const __m128i c2 = _mm_loadu_si128((const __m128i *)(h[2] + 4)), c3 = _mm_loadu_si128((const __m128i *)(h[3] + 4));
    const __m128i t0 = _mm_unpacklo_epi8(c0, c1), t1 = _mm_unpackhi_epi8(c0, c1);
    const __m128i t2 = _mm_unpacklo_epi8(c2, c3), t3 = _mm_unpackhi_epi8(c2, c3);
    const __m128i u[4] = {_mm_unpacklo_epi16(t0, t2), _mm_unpackhi_epi16(t0, t2), _mm_unpacklo_epi16(t1, t3),
                          _mm_unpackhi_epi16(t1, t3)}; /* u[i]: sub-scales 4i .. 4i + 3, rows 0 1 2 3 each */
    const __m128 d4 = _mm_loadu_ps(d);
    const __m256 dv = _mm256_set_m128(d4, d4);
    for (int i = 0; i < 4; i++) {
        _mm256_storeu_ps(st[4 * i], _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(u[i]))));
        _mm256_storeu_ps(st[4 * i + 2], _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(u[i], 8)))));
    }
}

/* One record (p blocks, g groups) of a tile's NR weight rows against activation rows m0 .. m0 + mr. The rows'
 * headers are decoded and their codes unpacked (and transposed, transpose4) once for all mr activation rows; a
 * block's product of the four rows is one vector of int32 sums (rows 0 1 2 3 | 0 1 2 3: elements 0..15 | 16..31,
 * so a group of 16 is a half), so one conversion and FMA per block and activation row. Offsets stay out of the
 * block loop: w = u s + o + k0 s for stored codes u (k0 = 128 for 8-bit codes, which are stored signed), so the
 * record adds sum_g (o_g + k0 s_g) * (sum of x in group g). Codes centred without offsets (Q6_K, Q5_0, Q3_K: w =
 * (u - 2^(bits-1)) s) take the centre inside a block's integer sums instead (act_t's cs, one add), with no term
 * here: that term's header work (fp32 offsets, their transposes, an FMA per two groups) was half a one-row Q6_K
 * product's time (a warm 256 x 2048: 12 GB/s with it, 22 without). */
static inline __attribute__((always_inline)) void record(const act_t *a, int64_t m0, const int mr, const shape_t *s,
                                                         const uint8_t *const *h, int64_t rec, const int p,
                                                         const int g, __m256 *acc, __m256 *eacc, const int bits,
                                                         const int group) {
    const int64_t hb = header_bytes(s, p, group), pairs = plane_bytes(bits, p), recs = nrecords(s);
    const int plain = !s->off; /* no offsets: 8-bit codes stored signed, others centred in the integer sums */
    const float k0 = bits == 8 ? 128.0f : 0.0f;
    float sc[NR][GM], of[NR][GM], st[GM][NR], et[GM][NR];
    if (plain && s->form == I8 && g == GM) {
        scales_q6(h, st);
    } else {
#pragma GCC unroll 4
        for (int r = 0; r < NR; r++) {
            header(h[r], s, g, sc[r], of[r]);
            if (!plain)
                for (int c = 0; c < g; c++) of[r][c] += k0 * sc[r][c];
        }
        for (int c = 0; c < g; c += 8) {
            transpose4x8(sc, c, st);
            if (!plain) transpose4x8(of, c, et);
        }
    }
    if (!plain)
        for (int i = 0; i < mr; i++) { /* two chains (halves: even, odd groups), not one of g latencies; past g zeros */
            const float *gs = a->gs + ((m0 + i) * recs + rec) * GM * 4;
            for (int c = 0; c < g; c += 2)
                eacc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(et[c]), _mm256_load_ps(gs + 4 * c), eacc[i]);
        }
    const int64_t m = a->m;
    const int8_t *xq = a->q + ((rec * PB) * m + m0) * 4 * QB; /* block b, row i: xq + (b m + i) 4 QB */
    const float *xd = a->d + rec * PB * m + m0;
    const int32_t *cs = a->cs ? a->cs + (rec * PB * m + m0) * 8 : NULL;
    __m256 sum[MR]; /* the record's own accumulators: through `acc` GCC stored each one back every block */
    for (int i = 0; i < mr; i++) sum[i] = acc[i];
    if (mr == 1 && p == PB) { /* one row (decode): b a literal per block, see record_block */
#pragma GCC unroll 8
        for (int b = 0; b < PB; b++) record_block(h, hb, b, pairs, p, st, xq, xd, cs, m, mr, sum, bits, group);
    } else {
#pragma GCC unroll 1 /* the record is inlined 48 times (bits x group x rows chunk x full / last) */
        for (int b = 0; b < p; b++) record_block(h, hb, b, pairs, p, st, xq, xd, cs, m, mr, sum, bits, group);
    }
    for (int i = 0; i < mr; i++) acc[i] = sum[i];
}

#define L1_BYTES 32768 /* the L1 data cache the next tile's prefetch may fill (32 KiB on Zen 2-4, 48 on recent Intel) */

static inline __attribute__((always_inline)) void prefetch(const uint8_t *p, int near) {
    if (near)
        _mm_prefetch((const char *)p, _MM_HINT_T0);
    else
        _mm_prefetch((const char *)p, _MM_HINT_T1);
}

/* Activation rows m0 .. m0 + mr against the NR consecutive weight rows at w. */
static inline __attribute__((always_inline)) void rows(const act_t *a, int64_t m0, const int mr, const shape_t *s,
                                                       const uint8_t *w, float *out, int valid, const int bits,
                                                       const int group) {
    /* past the last row (N % 4), the last row again: one code path, results dropped */
    const int64_t nb = s->k / QB, rb = row_bytes(s), full = record_bytes(s, PB, group), tail = nb % PB;
    __m256 acc[MR];
    __m256 eacc[MR];
    for (int i = 0; i < mr; i++) {
        acc[i] = _mm256_setzero_ps();
        eacc[i] = _mm256_setzero_ps();
    }
    const uint8_t *h[NR];
    /* The next tile's rows, fetched a slice per record while this tile computes: the four streams of a tile
     * are too short for the hardware prefetcher to ramp up on (cold K 1536 read at 6 GB/s of 20 without). Into
     * L1 while two tiles and the activation rows' blocks fit there, else into L2: at K 4096 (attention's o_proj)
     * the next tile in L1 evicted the activations, and one row read 2048 x 4096 Q8_0 at 12.5 GB/s against 19.6
     * into L2; at K 768 (an expert's down) L2 was the slower, 10 against 19. */
    const uint8_t *next = w + NR * rb;
    const int64_t slice = (NR * rb / (nb / PB + 1) + 63) / 64 * 64;
    const int near = 2 * NR * rb + 4 * QB * nb * mr <= L1_BYTES; /* act_t: 4 x 32 bytes a block and row */
    int64_t rec = 0;
    for (; rec < nb / PB; rec++) { /* full records: p and g constants */
        if (m0 == 0)
            for (int64_t o = rec * slice; o < (rec + 1) * slice; o += 64) prefetch(next + o, near);
        for (int r = 0; r < NR; r++) h[r] = w + (r < valid ? r : valid - 1) * rb + rec * full;
        record(a, m0, mr, s, h, rec, PB, PB * QB / group, acc, eacc, bits, group);
    }
    if (m0 == 0)
        for (int64_t o = rec * slice; o < NR * rb; o += 64) prefetch(next + o, near);
    for (int r = 0; r < NR; r++) h[r] = w + (r < valid ? r : valid - 1) * rb + rec * full;
    if (tail) /* the last, shorter record (K 576 = 2 x 8 + 2 blocks): p a run-time value, one more copy, not four */
        record(a, m0, mr, s, h, rec, (int)tail, (int)tail * QB / group, acc, eacc, bits, group);
    for (int i = 0; i < mr; i++) {
        const __m128 e = _mm_add_ps(_mm256_castps256_ps128(eacc[i]), _mm256_extractf128_ps(eacc[i], 1));
        float o[NR];
        _mm_storeu_ps(o, _mm_add_ps(_mm_add_ps(_mm256_castps256_ps128(acc[i]), _mm256_extractf128_ps(acc[i], 1)), e));
        for (int r = 0; r < valid; r++) out[(m0 + i) * s->n + r] = o[r];
    }
}

/* Weight rows j .. j + NR (fewer at the end) against every activation row, MR at a time (a literal per chunk
 * size, so the accumulators stay in registers; a row's numbers do not depend on its chunk). */
static inline __attribute__((always_inline)) void tile(const act_t *a, int64_t m, const shape_t *s, const uint8_t *w,
                                                       float *out, int64_t j, const int bits, const int group) {
    const int64_t n = s->n, rb = row_bytes(s);
    const int valid = n - j < NR ? (int)(n - j) : NR;
    int64_t i = 0; /* chunks of 8, then 4, 2, 1: four copies of the record code, not eight */
    for (; i + MR <= m; i += MR) rows(a, i, MR, s, w + j * rb, out + j, valid, bits, group);
    if (i + 4 <= m) {
        rows(a, i, 4, s, w + j * rb, out + j, valid, bits, group);
        i += 4;
    }
    if (i + 2 <= m) {
        rows(a, i, 2, s, w + j * rb, out + j, valid, bits, group);
        i += 2;
    }
    if (i < m) rows(a, i, 1, s, w + j * rb, out + j, valid, bits, group);
}

/* Weight rows `first` (a multiple of NR) onwards. One function and OpenMP region per (bits, group): GCC outlines a
 * region before inlining, so a region in an inlined helper is one function for all six pairs, with bits and group
 * as run-time values (2x slower). */
#define SPECIALISE(B, G)                                                                                        \
    static void matmul_##B##_##G(const act_t *a, int64_t m, const shape_t *s, const uint8_t *w, float *out,  \
                                 int64_t first, int threads) {                                                 \
        const int64_t tiles = (s->n + NR - 1) / NR;                                                            \
        _Pragma("omp parallel for schedule(static) num_threads(threads) if (threads > 1)")                    \
        for (int64_t t = first / NR; t < tiles; t++) tile(a, m, s, w, out, t * NR, B, G);                      \
    }
SPECIALISE(5, 32) SPECIALISE(5, 16) SPECIALISE(6, 32) SPECIALISE(6, 16) SPECIALISE(8, 32) SPECIALISE(8, 16)
SPECIALISE(2, 16) SPECIALISE(3, 16)
#undef SPECIALISE

/* x [M][K] fp32 times the k-bit weight w ([N] rows of row_bytes) transposed: out [M][N]. */
int ab_bits_matmul(const float *x, int64_t m, const uint8_t *w, int bits, int group, int form, int off, int64_t k,
                   int64_t n, float *out, int threads, int tiles) {
    const shape_t s = {bits, group, form, off, k, n};
    int rc = check(&s);
    if (rc) return rc;
    void (*const f[3][2])(const act_t *, int64_t, const shape_t *, const uint8_t *, float *, int64_t, int) = {
        {matmul_5_16, matmul_5_32}, {matmul_6_16, matmul_6_32}, {matmul_8_16, matmul_8_32}};
    int64_t first = 0; /* weight rows done on AMX tiles: the kernel below takes the rest */
#ifdef __AMX_INT8__
    if (tiles && m >= ab_amx_min_rows && (first = ab_bits_matmul_amx(x, m, w, &s, out, threads)) < 0) return -1;
#endif
    if (first == n) return 0;
#ifdef __AVX512VNNI__
    if (bits == 8 && group == QB && !off && m > 1) /* Q8_0: two rows a 512-bit vector, the same bits (cpu_bits_q8z.c) */
        return ab_bits_q8z(x, m, w, &s, out, first, threads) ? -1 : 0;
#endif
    /* Many rows (prefill, a prompt's tokens routed to one expert) in slices whose quantised activations (4 bytes a
     * column a row, act_t) stay in the L2 cache while every tile passes over them: at K 2048 one row cost 50 us of
     * 1536 output columns up to 32 rows, and 115 us at 64 (their 512 KB out of the cache), so the kernel lost to
     * dequantise + sgemm from 128 rows on. Each slice rereads the weights, once per 32 rows at K 2048: a row's
     * numbers do not depend on its slice. */
    const int64_t slice = k >= 65536 / MR ? MR : 65536 / k / MR * MR;
    for (int64_t i0 = 0; i0 < m; i0 += slice) {
        const int64_t mc = m - i0 < slice ? m - i0 : slice;
        act_t a;
        if (quantize(x + i0 * k, mc, &s, &a)) return -1;
        if (bits <= 3)
            (bits == 2 ? matmul_2_16 : matmul_3_16)(&a, mc, &s, w, out + i0 * n, first, threads);
        else
            f[bits == 5 ? 0 : bits == 6 ? 1 : 2][group == 32](&a, mc, &s, w, out + i0 * n, first, threads);
        release(&a);
    }
    return 0;
}

/* Row bytes of the layout (the Python packer checks its own against this). */
int64_t ab_bits_row_bytes(int bits, int group, int form, int off, int64_t k) {
    const shape_t s = {bits, group, form, off, k, 0};
    return check(&s) ? -1 : row_bytes(&s);
}
