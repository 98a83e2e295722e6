/* The k-bit (2, 3, 5, 6, 8) weight layout of cpu_bits.c (the matmul) and cpu_bits_dequant.c (dense rows): its sizes,
 * its headers' scales and its bodies' codes (the Python side, layout packing and torch twins are in cpu_bits.py).
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
 */
#pragma once
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

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

static inline int check(const shape_t *s) {
    if ((s->bits != 5 && s->bits != 6 && s->bits != 8 && s->bits != 2 && s->bits != 3) ||
        (s->group != 16 && s->group != 32))
        return -3;
    if (s->bits <= 3 && s->group != 16) return -3; /* only GGUF Q2_K / Q3_K have them: groups of 16 */
    if (s->k % QB || s->k <= 0 || s->form < F32 || s->form > U4) return -2;
    return 0;
}
