/* k-bit (2, 3, 5, 6, 8) weight-only matmul and dequantisation for AVX2 + FMA CPUs, and the VNNI variants (built with cpu_gemv.c by
 * cpu_gemv.py; the Python side, layout packing and torch twins are in cpu_bits.py).
 *
 * The form: codes q in [0, 2^bits), per (row, group of 16 or 32 columns) a scale s and optionally an offset
 * o: w = q * s + o, or w = (q - 2^(bits-1)) * s without offsets (GGUF Q5_0, Q6_K, Q8_0).
 *
 * Layout: one byte stream per row, so a row is one sequential read (the decode loop's only cost is bytes).
 * A row is records of 8 blocks of 32 columns (the last may have fewer); a record is a header of its
 * G = 32 p / group scales (and offsets), then a body of its p blocks' codes:
 *   header F32: s[G] fp32, o[G] fp32 | F16: s[G] fp16, o[G] fp16 (where fp16 is exact: Q5_0, Q5_1, Q8_0)
 *          U4:  as I8 with 4-bit c and m, two a byte (byte i: element 2i low, 2i + 1 high): GGUF Q2_K's own
 *               4-bit scales and mins (s = d sc, o = -dmin m)
 *          I8:  d fp32, [dm fp32], c[G] int8, [m[G] int8]; s = d * c, o = dm * m (the K-quants' 6/8-bit
 *               sub-scales of one fp16 super-scale, exact in fp32; 8 blocks are GGUF's 256-column super-block)
 *   body 8-bit: p x 32 int8 codes q - 128 (GGUF Q8_0's own bytes)
 *        5-bit: a 32-byte plane of high bits (byte e: bit b = block b's element e), then the nibbles; a
 *               record of 4 blocks or fewer (a row's last) packs its plane in 16 bytes as the nibbles
 *        6-bit: a 32-byte plane per 4 blocks (byte e: bits 2j, 2j + 1 = block 4i + j's element e), nibbles
 *        nibbles: 32 bytes per pair of blocks, byte e = block 2i's element e | block 2i + 1's << 4
 *        2-bit: planes only, the 6-bit layout's (32 bytes per 4 blocks, bits 2j, 2j + 1 = block 4i + j)
 *        3-bit: those 2-bit planes of the low bits, then one 1-bit plane as the 5-bit layout's (bit b =
 *               block b's bit 2; 16 bytes for a record of 4 blocks or fewer)
 *   (GGUF Q2_K / Q3_K, groups of 16 only: a U4 header of 24 bytes per 256 columns and a 64-byte body are Q2_K's
 *   2.75 bits per weight (file 2.625: fp32 d and dmin where it has fp16), an I8 header of 20 bytes and a 96-byte
 *   body Q3_K's 3.625 (file 3.4375: its 6-bit scales take a byte each).)
 *   so a block's codes are one load, AND (and shift) for the nibbles and one shift, AND, OR for the high
 *   bits, where per-block bit fields (GGUF's own) cost twice that: the kernel was compute-bound, not
 *   byte-bound. Bits per weight: Q5_0 / Q5_1 / Q8_0 their file's (5.5 / 6 / 8.5; a row ending in a short
 *   record adds at most 12 bytes of plane: K 576 Q5_0 5.61), Q5_K 5.75 (file 5.5), Q6_K 6.625 (6.5625).
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

#include "cpu_gemv.h"

#define QB 32   /* elements per block */
#define NR 4    /* weight rows one pass over an activation row serves */
#define MR 8    /* activation rows one pass over a tile serves */
#define PB 8    /* blocks per record (256 columns: a GGUF K-quant super-block); a row's last may have fewer */
#define GM 16   /* most groups in a record (8 blocks of two groups of 16) */

enum { F32 = 0, F16 = 1, I8 = 2, U4 = 3 };

typedef struct {
    int bits, group, form, off;
    int64_t k, n;
} shape_t;

static inline int64_t nrecords(const shape_t *s) { return (s->k / QB + PB - 1) / PB; }
static inline int rec_blocks(const shape_t *s, int64_t rec) {
    const int64_t nb = s->k / QB;
    return (int)(nb - rec * PB < PB ? nb - rec * PB : PB);
}
/* Bytes of a record's planes of high bits (they precede its nibble pairs). */
static inline int64_t plane_bytes(int bits, int p) {
    const int64_t one = p > 4 ? 32 : 16, two = 32 * (int64_t)((p + 3) / 4);
    return bits == 5 ? one : bits == 6 || bits == 2 ? two : bits == 3 ? two + one : 0;
}
static inline int64_t body_bytes(int bits, int p) {
    if (bits <= 3) return plane_bytes(bits, p); /* no nibbles: every bit is in the planes */
    return bits == 8 ? 32 * (int64_t)p : plane_bytes(bits, p) + 32 * (int64_t)((p + 1) / 2);
}
static inline int64_t header_bytes(const shape_t *s, int p, int group) {
    const int64_t g = p * QB / group, parts = 1 + s->off;
    return s->form == F32 ? 4 * g * parts : s->form == F16 ? 2 * g * parts : s->form == I8 ? (4 + g) * parts
                                                                                         : (4 + (g + 1) / 2) * parts;
}
static inline int64_t record_bytes(const shape_t *s, int p, int group) {
    return header_bytes(s, p, group) + body_bytes(s->bits, p);
}
static inline int64_t row_bytes(const shape_t *s) {
    const int64_t nb = s->k / QB, tail = nb % PB;
    return nb / PB * record_bytes(s, PB, s->group) + (tail ? record_bytes(s, (int)tail, s->group) : 0);
}

/* Activations with a block's rows side by side, so the kernel's loop over rows reads at constant offsets from one
 * pointer, and each block as the four operands of transpose4's vectors (x's 32-bit lane t of each half in all four
 * lanes of that half), so a product's operand is a memory operand, not a shuffle per activation row. */
typedef struct {
    int8_t *q;   /* [K/32][M][4][32]: block b of row i, operand t at ((b M + i) 4 + t) 32 */
    float *d;    /* [K/32][M] */
    float *gs;   /* [M][records][GM][4]: d * (sum of the rounded x) per scale group, 4 copies (the offsets' term
                  * takes two groups a 256-bit FMA); zero past the record's */
    int64_t m;
} act_t;

static int quantize(const float *x, int64_t m, const shape_t *s, act_t *a) {
    const int64_t k = s->k, nb = k / QB, recs = nrecords(s), per = QB / s->group;
    a->q = (int8_t *)aligned_alloc(32, (size_t)(m * k * 4));
    a->d = (float *)malloc(sizeof(float) * (size_t)(m * nb));
    a->gs = (float *)aligned_alloc(32, sizeof(float) * (size_t)(m * recs * GM * 4));
    a->m = m;
    if (!a->q || !a->d || !a->gs) return -1;
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
}

/* U4's g nibbles (byte i: element 2i low, 2i + 1 high) as bytes: 8 or 16 (a full record of groups of 32 or 16)
 * in one unpack. The 8-byte load may read past g = 8's 4 bytes: a header is always followed by more of its
 * record (the mins or the body), and `out` holds GM. The scalar loop for g = 8 (a Q8_0 row whose scales share
 * one d) made the whole 8-bit product 1.3-1.5x slower than its F16 form. */
static inline __attribute__((always_inline)) void nibbles(const uint8_t *p, const int g, int8_t *out) {
    if (g == GM || g == GM / 2) {
        const __m128i raw = _mm_loadl_epi64((const __m128i *)p), low = _mm_set1_epi8(0x0F);
        const __m128i lo = _mm_and_si128(raw, low), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low);
        _mm_storeu_si128((__m128i *)out, _mm_unpacklo_epi8(lo, hi));
    } else
        for (int i = 0; i < g; i++) out[i] = (int8_t)((p[i / 2] >> (4 * (i & 1))) & 15);
}

/* A record's g scales (and offsets) as fp32, zero from g to the next multiple of 8. */
static inline __attribute__((always_inline)) void header(const uint8_t *h, const shape_t *s, const int g, float *sc,
                                                          float *of) {
    const int g8 = (g + 7) / 8 * 8, off = s->off;
    for (int i = g; i < g8; i++) sc[i] = of[i] = 0.0f;
    if (s->form == F32) {
        memcpy(sc, h, 4 * (size_t)g);
        if (off) memcpy(of, h + 4 * g, 4 * (size_t)g);
    } else if (s->form == F16) {
        const uint16_t *p = (const uint16_t *)h;
        int i = 0;
        for (; i + 8 <= g; i += 8) {
            _mm256_storeu_ps(sc + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + i))));
            if (off) _mm256_storeu_ps(of + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + g + i))));
        }
        for (; i < g; i++) {
            sc[i] = _cvtsh_ss(p[i]);
            if (off) of[i] = _cvtsh_ss(p[g + i]);
        }
    } else { /* I8, or U4 unpacked to I8's bytes: the same products */
        float d, dm = 0.0f;
        memcpy(&d, h, 4);
        if (off) memcpy(&dm, h + 4, 4);
        const int8_t *c = (const int8_t *)(h + 4 * (1 + off)), *mm = c + g;
        int8_t un[2 * GM];
        if (s->form == U4) {
            nibbles(h + 4 * (1 + off), g, un);
            if (off) nibbles(h + 4 * (1 + off) + (g + 1) / 2, g, un + GM);
            c = un;
            mm = un + GM;
        }
        int i = 0;
        for (; i + 8 <= g; i += 8) {
            __m256 cv = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(c + i))));
            _mm256_storeu_ps(sc + i, _mm256_mul_ps(_mm256_set1_ps(d), cv));
            if (off) {
                __m256 mv = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(mm + i))));
                _mm256_storeu_ps(of + i, _mm256_mul_ps(_mm256_set1_ps(dm), mv));
            }
        }
        for (; i < g; i++) {
            sc[i] = d * (float)c[i];
            if (off) of[i] = dm * (float)mm[i];
        }
    }
}

/* 2- and 3-bit codes (GGUF Q2_K / Q3_K): block b's two low bits from its plane (byte e: bits 2 (b % 4), + 1), and
 * for 3 bits its high bit from the 1-bit plane after the 2-bit planes (byte e: bit b; a short record's plane
 * in 16 bytes, element j + 16 in byte j's high nibble, as the 5-bit one). One load, shift and AND per plane. */
static inline __attribute__((always_inline)) __m256i codes_low(const uint8_t *body, int b, int p, const int bits) {
    const __m256i h2 = _mm256_loadu_si256((const __m256i *)(body + 32 * (b / 4)));
    const int j = b % 4;
    const __m256i t2 = j == 0 ? h2 : j == 1 ? _mm256_srli_epi16(h2, 2) : j == 2 ? _mm256_srli_epi16(h2, 4) : _mm256_srli_epi16(h2, 6);
    const __m256i lo = _mm256_and_si256(t2, _mm256_set1_epi8(0x03));
    if (bits == 2) return lo;
    const uint8_t *one = body + 32 * ((p + 3) / 4);
    __m256i h;
    if (p > 4)
        h = _mm256_loadu_si256((const __m256i *)one);
    else {
        const __m128i half = _mm_loadu_si128((const __m128i *)one);
        h = _mm256_set_m128i(_mm_srli_epi16(half, 4), half);
    }
    const __m256i t = b < 2 ? _mm256_slli_epi16(h, 2 - b) : b == 2 ? h : _mm256_srli_epi16(h, b - 2);
    return _mm256_or_si256(lo, _mm256_and_si256(t, _mm256_set1_epi8(0x04)));
}

/* Block b's 32 codes (lane e = element e; 8-bit codes signed) from a record's body. 5/6 bits: a pair of
 * blocks shares 32 bytes of nibbles (byte e: block 2i element e low, block 2i + 1 high); 5 bits: one
 * 32-byte plane per record, byte e holding element e's high bit of block b at bit b; 6 bits: a plane per
 * four blocks, byte e holding block b's two high bits at bit 2 (b % 4). Each is one shift, AND and OR. */
static inline __attribute__((always_inline)) __m256i codes(const uint8_t *body, int b, int64_t pairs, int p,
                                                           const int bits) {
    if (bits == 8) return _mm256_loadu_si256((const __m256i *)(body + 32 * b));
    if (bits <= 3) return codes_low(body, b, p, bits);
    const __m256i v = _mm256_loadu_si256((const __m256i *)(body + pairs + 32 * (b / 2)));
    const __m256i lo = _mm256_and_si256(b & 1 ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(0x0F));
    /* 16-bit shifts by under 8: a byte's target bit only ever comes from that same byte */
    if (bits == 5) {
        __m256i h;
        if (p > 4)
            h = _mm256_loadu_si256((const __m256i *)body);
        else { /* a short record's 16-byte plane: byte j bits 0-3 for element j, bits 4-7 for j + 16 */
            const __m128i half = _mm_loadu_si128((const __m128i *)body);
            h = _mm256_set_m128i(_mm_srli_epi16(half, 4), half);
        }
        const __m256i t = b < 4 ? _mm256_slli_epi16(h, 4 - b) : b == 4 ? h : _mm256_srli_epi16(h, b - 4);
        return _mm256_or_si256(lo, _mm256_and_si256(t, _mm256_set1_epi8(0x10)));
    }
    const __m256i h = _mm256_loadu_si256((const __m256i *)(body + 32 * (b / 4)));
    const int j = b % 4;
    const __m256i t = j == 0 ? _mm256_slli_epi16(h, 4) : j == 1 ? _mm256_slli_epi16(h, 2) : j == 2 ? h : _mm256_srli_epi16(h, 2);
    return _mm256_or_si256(lo, _mm256_and_si256(t, _mm256_set1_epi8(0x30)));
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
                                                               const float *xd, int64_t m, const int mr, __m256 *sum,
                                                               const int bits, const int group) {
    __m256i q[NR], v[NR], av[NR];
    for (int r = 0; r < NR; r++) q[r] = codes(h[r] + hb, b, pairs, p, bits);
    transpose4(q, v);
    if (bits == 8)
        for (int t = 0; t < NR; t++) av[t] = _mm256_sign_epi8(v[t], v[t]);
    const __m256 sv = group == 32 ? _mm256_broadcast_ps((const __m128 *)st[b]) : _mm256_loadu_ps(st[2 * b]);
#pragma GCC unroll 8
    for (int i = 0; i < mr; i++) {
        const __m256i prod = tile_dot(v, av, (const __m256i *)(xq + (b * m + i) * 4 * QB), bits);
        sum[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(prod), _mm256_mul_ps(sv, _mm256_broadcast_ss(xd + b * m + i)), sum[i]);
    }
}

/* One record (p blocks, g groups) of a tile's NR weight rows against activation rows m0 .. m0 + mr. The rows'
 * headers are decoded and their codes unpacked (and transposed, transpose4) once for all mr activation rows; a
 * block's product of the four rows is one vector of int32 sums (rows 0 1 2 3 | 0 1 2 3: elements 0..15 | 16..31,
 * so a group of 16 is a half), so one conversion and FMA per block and activation row. Offsets stay out of the
 * block loop: w = u s + o + k0 s for stored codes u (k0 = 128 for 8-bit codes, which are stored signed, minus the
 * centre 2^(bits-1) without offsets), so the record adds sum_g (o_g + k0 s_g) * (sum of x in group g). */
static inline __attribute__((always_inline)) void record(const act_t *a, int64_t m0, const int mr, const shape_t *s,
                                                         const uint8_t *const *h, int64_t rec, const int p,
                                                         const int g, __m256 *acc, __m256 *eacc, const int bits,
                                                         const int group) {
    const int64_t hb = header_bytes(s, p, group), pairs = plane_bytes(bits, p), recs = nrecords(s);
    const int sym8 = bits == 8 && !s->off; /* k0 = 0 and no offsets: nothing to add */
    const float k0 = (bits == 8 ? 128.0f : 0.0f) - (s->off ? 0.0f : (float)(1 << (bits - 1)));
    float sc[NR][GM], of[NR][GM], st[GM][NR], et[GM][NR];
#pragma GCC unroll 4
    for (int r = 0; r < NR; r++) {
        header(h[r], s, g, sc[r], of[r]);
        if (!sym8)
            for (int c = 0; c < g; c++) of[r][c] = (s->off ? of[r][c] : 0.0f) + k0 * sc[r][c];
    }
    for (int c = 0; c < g; c += 8) {
        transpose4x8(sc, c, st);
        if (!sym8) transpose4x8(of, c, et);
    }
    if (!sym8)
        for (int i = 0; i < mr; i++) { /* two chains (halves: even, odd groups), not one of g latencies; past g zeros */
            const float *gs = a->gs + ((m0 + i) * recs + rec) * GM * 4;
            for (int c = 0; c < g; c += 2)
                eacc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(et[c]), _mm256_load_ps(gs + 4 * c), eacc[i]);
        }
    const int64_t m = a->m;
    const int8_t *xq = a->q + ((rec * PB) * m + m0) * 4 * QB; /* block b, row i: xq + (b m + i) 4 QB */
    const float *xd = a->d + rec * PB * m + m0;
    __m256 sum[MR]; /* the record's own accumulators: through `acc` GCC stored each one back every block */
    for (int i = 0; i < mr; i++) sum[i] = acc[i];
    if (mr == 1 && p == PB) { /* one row (decode): b a literal per block, see record_block */
#pragma GCC unroll 8
        for (int b = 0; b < PB; b++) record_block(h, hb, b, pairs, p, st, xq, xd, m, mr, sum, bits, group);
    } else {
#pragma GCC unroll 1 /* the record is inlined 48 times (bits x group x rows chunk x full / last) */
        for (int b = 0; b < p; b++) record_block(h, hb, b, pairs, p, st, xq, xd, m, mr, sum, bits, group);
    }
    for (int i = 0; i < mr; i++) acc[i] = sum[i];
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
     * are too short for the hardware prefetcher to ramp up on (cold K 1536 read at 6 GB/s of 20 without). */
    const uint8_t *next = w + NR * rb;
    const int64_t slice = (NR * rb / (nb / PB + 1) + 63) / 64 * 64;
    int64_t rec = 0;
    for (; rec < nb / PB; rec++) { /* full records: p and g constants */
        if (m0 == 0)
            for (int64_t o = rec * slice; o < (rec + 1) * slice; o += 64) _mm_prefetch((const char *)(next + o), _MM_HINT_T0);
        for (int r = 0; r < NR; r++) h[r] = w + (r < valid ? r : valid - 1) * rb + rec * full;
        record(a, m0, mr, s, h, rec, PB, PB * QB / group, acc, eacc, bits, group);
    }
    if (m0 == 0)
        for (int64_t o = rec * slice; o < NR * rb; o += 64) _mm_prefetch((const char *)(next + o), _MM_HINT_T0);
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

static int check(const shape_t *s) {
    if ((s->bits != 5 && s->bits != 6 && s->bits != 8 && s->bits != 2 && s->bits != 3) ||
        (s->group != 16 && s->group != 32))
        return -3;
    if (s->bits <= 3 && s->group != 16) return -3; /* only GGUF Q2_K / Q3_K have them: groups of 16 */
    if (s->k % QB || s->k <= 0 || s->form < F32 || s->form > U4) return -2;
    return 0;
}

/* One function and OpenMP region per (bits, group): GCC outlines a region before inlining, so a region in an
 * inlined helper is one function for all six pairs, with bits and group as run-time values (2x slower). */
#define SPECIALISE(B, G)                                                                                        \
    static void matmul_##B##_##G(const act_t *a, int64_t m, const shape_t *s, const uint8_t *w, float *out,  \
                                 int threads) {                                                                \
        const int64_t tiles = (s->n + NR - 1) / NR;                                                            \
        _Pragma("omp parallel for schedule(static) num_threads(threads) if (threads > 1)")                    \
        for (int64_t t = 0; t < tiles; t++) tile(a, m, s, w, out, t * NR, B, G);                               \
    }
SPECIALISE(5, 32) SPECIALISE(5, 16) SPECIALISE(6, 32) SPECIALISE(6, 16) SPECIALISE(8, 32) SPECIALISE(8, 16)
SPECIALISE(2, 16) SPECIALISE(3, 16)
#undef SPECIALISE

/* x [M][K] fp32 times the k-bit weight w ([N] rows of row_bytes) transposed: out [M][N]. */
int ab_bits_matmul(const float *x, int64_t m, const uint8_t *w, int bits, int group, int form, int off, int64_t k,
                   int64_t n, float *out, int threads) {
    const shape_t s = {bits, group, form, off, k, n};
    int rc = check(&s);
    if (rc) return rc;
    void (*const f[3][2])(const act_t *, int64_t, const shape_t *, const uint8_t *, float *, int) = {
        {matmul_5_16, matmul_5_32}, {matmul_6_16, matmul_6_32}, {matmul_8_16, matmul_8_32}};
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
            (bits == 2 ? matmul_2_16 : matmul_3_16)(&a, mc, &s, w, out + i0 * n, threads);
        else
            f[bits == 5 ? 0 : bits == 6 ? 1 : 2][group == 32](&a, mc, &s, w, out + i0 * n, threads);
        release(&a);
    }
    return 0;
}

/* Row bytes of the layout (the Python packer checks its own against this). */
int64_t ab_bits_row_bytes(int bits, int group, int form, int off, int64_t k) {
    const shape_t s = {bits, group, form, off, k, 0};
    return check(&s) ? -1 : row_bytes(&s);
}

/* Dense fp32 [N][K] of the weight with the reference's roundings (q s + o, or (q - 2^(bits-1)) s; no fused
 * multiply-add), so dequantise + sgemm on the rounded x equals the kernel and GGUF's own dequantisation. */
static inline __attribute__((always_inline)) void dequant_row(const uint8_t *w, const shape_t *s, float *out,
                                                              const int bits) {
    const int64_t recs = nrecords(s), full = record_bytes(s, PB, s->group);
    const int per = QB / s->group, off = s->off;
    const float base = bits == 8 ? 128.0f : 0.0f, centre = off ? 0.0f : (float)(1 << (bits - 1));
    float sc[GM], of[GM];
    for (int64_t rec = 0; rec < recs; rec++) {
        const int p = rec_blocks(s, rec);
        const uint8_t *h = w + rec * full;
        header(h, s, p * QB / s->group, sc, of);
        const uint8_t *body = h + header_bytes(s, p, s->group);
        const int64_t pairs = plane_bytes(bits, p);
        for (int b = 0; b < p; b++) {
            int8_t q[QB];
            _mm256_storeu_si256((__m256i *)q, codes(body, b, pairs, p, bits));
            float *dst = out + (rec * PB + b) * QB;
            for (int e = 0; e < QB; e += 8) {
                const __m128i raw = _mm_loadl_epi64((const __m128i *)(q + e));
                __m256 v = _mm256_cvtepi32_ps(bits == 8 ? _mm256_cvtepi8_epi32(raw) : _mm256_cvtepu8_epi32(raw));
                const int gi = b * per + (per == 2 ? e / 16 : 0);
                const __m256 sv = _mm256_set1_ps(sc[gi]);
                if (off)
                    v = _mm256_add_ps(_mm256_mul_ps(_mm256_add_ps(v, _mm256_set1_ps(base)), sv), _mm256_set1_ps(of[gi]));
                else
                    v = _mm256_mul_ps(_mm256_sub_ps(v, _mm256_set1_ps(centre - base)), sv);
                _mm256_storeu_ps(dst + e, v);
            }
        }
    }
}

#define SPECIALISE(B)                                                                                            \
    __attribute__((optimize("fp-contract=off"))) static void dequant_##B(const uint8_t *w, const shape_t *s,    \
                                                                         float *out, int threads) {             \
        const int64_t rb = row_bytes(s);                                                                         \
        _Pragma("omp parallel for schedule(static) num_threads(threads) if (threads > 1)")                      \
        for (int64_t j = 0; j < s->n; j++) dequant_row(w + j * rb, s, out + j * s->k, B);                        \
    }
SPECIALISE(5) SPECIALISE(6) SPECIALISE(8) SPECIALISE(2) SPECIALISE(3)
#undef SPECIALISE

int ab_bits_dequant(const uint8_t *w, int bits, int group, int form, int off, int64_t k, int64_t n, float *out,
                    int threads) {
    const shape_t s = {bits, group, form, off, k, n};
    int rc = check(&s);
    if (rc) return rc;
    (bits == 5 ? dequant_5 : bits == 6 ? dequant_6 : bits == 8 ? dequant_8 : bits == 3 ? dequant_3 : dequant_2)(w, &s, out, threads);
    return 0;
}
