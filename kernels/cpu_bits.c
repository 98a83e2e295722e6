/* k-bit (5, 6, 8) weight-only matmul and dequantisation for AVX2 + FMA CPUs (built with cpu_gemv.c by
 * cpu_gemv.py; the Python side, layout packing and torch twins are in cpu_bits.py).
 *
 * The form: codes q in [0, 2^bits), per (row, group of 16 or 32 columns) a scale s and optionally an offset
 * o: w = q * s + o, or w = (q - 2^(bits-1)) * s without offsets (GGUF Q5_0, Q6_K, Q8_0).
 *
 * Layout: one byte stream per row, so a row is one sequential read (the decode loop's only cost is bytes).
 * A row is K / (32 P) records of P blocks of 32 columns; a record is a header of its G = 32 P / group
 * scales (and offsets), then its P blocks:
 *   header F32: s[G] fp32, o[G] fp32 | F16: s[G] fp16, o[G] fp16 (where fp16 is exact: Q5_0, Q5_1, Q8_0)
 *          I8:  d fp32, [dm fp32], c[G] int8, [m[G] int8]; s = d * c, o = dm * m (the K-quants' 6/8-bit
 *               sub-scales of one fp16 super-scale, exact in fp32; P = 8 is GGUF's 256-column super-block)
 *   block 5-bit: 16 bytes of low nibbles (byte j: element j, j + 16 high nibble: GGUF Q5_0's qs), 4 bytes
 *               of high bits (element e at bit e, GGUF's qh) = 20 bytes
 *         6-bit: 16 bytes of low nibbles, 8 bytes of 2 high bits (element e in byte e % 8 at bit 2 (e / 8))
 *         8-bit: 32 int8 codes q - 128 (GGUF Q8_0's own bytes)
 * Offsets are kept out of the inner loop: sum_g (o_g + base s_g) * (sum of x in group g), eight groups a
 * step, where base folds the symmetric centre and the 8-bit codes' signedness into one effective offset.
 *
 * Activations are rounded to int8 per 32 exactly as cpu_gemv.c does (round_activations), so the kernel and
 * a many-row caller's dequantise + sgemm on the rounded x compute the same numbers.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define QB 32   /* elements per block */
#define NR 4    /* weight rows one pass over an activation row serves */
#define GM 16   /* most groups in a record (8 blocks of two groups of 16) */

enum { F32 = 0, F16 = 1, I8 = 2 };

typedef struct {
    int bits, group, form, off, p; /* p: blocks per record */
    int64_t k, n;
} shape_t;

static inline int groups(const shape_t *s) { return s->p * QB / s->group; }
static inline int64_t block_bytes(int bits) { return bits == 8 ? 32 : bits == 6 ? 24 : 20; }
static inline int64_t header_bytes(const shape_t *s) {
    int64_t g = groups(s), parts = 1 + s->off;
    return s->form == F32 ? 4 * g * parts : s->form == F16 ? 2 * g * parts : (4 + g) * parts;
}
static inline int64_t record_bytes(const shape_t *s) { return header_bytes(s) + s->p * block_bytes(s->bits); }
static inline int64_t row_bytes(const shape_t *s) { return s->k / (QB * s->p) * record_bytes(s); }

typedef struct {
    int8_t *q;   /* [M][K] */
    float *d;    /* [M][K/32] */
    float *gs;   /* [M][records][GM]: d * (sum of the rounded x) per scale group, zero past G */
} act_t;

static int quantize(const float *x, int64_t m, const shape_t *s, act_t *a) {
    const int64_t k = s->k, nb = k / QB, recs = k / (QB * s->p), per = QB / s->group;
    a->q = (int8_t *)aligned_alloc(32, (size_t)((m * k + 31) / 32 * 32));
    a->d = (float *)malloc(sizeof(float) * (size_t)(m * nb));
    a->gs = (float *)calloc((size_t)(m * recs * GM), sizeof(float));
    if (!a->q || !a->d || !a->gs) return -1;
    for (int64_t r = 0; r < m * nb; r++) {
        const float *v = x + r * QB;
        float amax = 0.0f;
        for (int i = 0; i < QB; i++) {
            float f = fabsf(v[i]);
            amax = f > amax ? f : amax;
        }
        float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
        int sq[2] = {0, 0};
        for (int i = 0; i < QB; i++) {
            int8_t q = (int8_t)nearbyintf(v[i] * id);
            a->q[r * QB + i] = q;
            sq[i / 16] += q;
        }
        a->d[r] = d;
        const int64_t row = r / nb, b = r % nb, rec = b / s->p, g0 = (b % s->p) * per;
        float *gs = a->gs + (row * recs + rec) * GM + g0;
        if (per == 1)
            gs[0] = d * (float)(sq[0] + sq[1]);
        else {
            gs[0] = d * (float)sq[0];
            gs[1] = d * (float)sq[1];
        }
    }
    return 0;
}

static void release(act_t *a) {
    free(a->q);
    free(a->d);
    free(a->gs);
}

/* A record's scales and offsets as fp32 (zero past G); `eff` folds the centre and code base into o. */
static inline __attribute__((always_inline)) void header(const uint8_t *h, const shape_t *s, float *sc,
                                                          float *of, int eff) {
    const int g = groups(s);
    memset(sc, 0, sizeof(float) * GM);
    memset(of, 0, sizeof(float) * GM);
    if (s->form == F32) {
        memcpy(sc, h, 4 * (size_t)g);
        if (s->off) memcpy(of, h + 4 * g, 4 * (size_t)g);
    } else if (s->form == F16) {
        const uint16_t *p = (const uint16_t *)h;
        int i = 0;
        for (; i + 8 <= g; i += 8) {
            _mm256_storeu_ps(sc + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + i))));
            if (s->off) _mm256_storeu_ps(of + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + g + i))));
        }
        for (; i < g; i++) {
            sc[i] = _cvtsh_ss(p[i]);
            if (s->off) of[i] = _cvtsh_ss(p[g + i]);
        }
    } else {
        float d, dm = 0.0f;
        memcpy(&d, h, 4);
        if (s->off) memcpy(&dm, h + 4, 4);
        const int8_t *c = (const int8_t *)(h + 4 * (1 + s->off)), *mm = c + g;
        int i = 0;
        for (; i + 8 <= g; i += 8) {
            __m256 cv = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(c + i))));
            _mm256_storeu_ps(sc + i, _mm256_mul_ps(_mm256_set1_ps(d), cv));
            if (s->off) {
                __m256 mv = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(mm + i))));
                _mm256_storeu_ps(of + i, _mm256_mul_ps(_mm256_set1_ps(dm), mv));
            }
        }
        for (; i < g; i++) {
            sc[i] = d * (float)c[i];
            if (s->off) of[i] = dm * (float)mm[i];
        }
    }
    if (eff) {
        /* stored code u = q - base (base 128 for 8 bits, whose codes are signed); w = u s + (o + base s), and
         * without offsets o = -2^(bits-1) s */
        const float base = s->bits == 8 ? 128.0f : 0.0f, centre = s->off ? 0.0f : (float)(1 << (s->bits - 1));
        for (int i = 0; i < g; i++) of[i] += (base - centre) * sc[i];
    }
}

/* The 32 codes of a block as bytes in element order (lane e = element e); 8-bit codes are signed. */
static inline __attribute__((always_inline)) __m256i codes(const uint8_t *b, const int bits) {
    if (bits == 8) return _mm256_loadu_si256((const __m256i *)b);
    const __m128i raw = _mm_loadu_si128((const __m128i *)b);
    const __m256i lo = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0F));
    if (bits == 5) {
        uint32_t h;
        memcpy(&h, b + 16, 4);
        /* byte e gets source byte e / 8, then is all ones where bit e % 8 is set (llama.cpp's bytes_from_bits) */
        const __m256i spread = _mm256_shuffle_epi8(
            _mm256_set1_epi32((int)h),
            _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
        const __m256i set = _mm256_cmpeq_epi8(_mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)),
                                              _mm256_set1_epi64x(-1));
        return _mm256_or_si256(lo, _mm256_and_si256(set, _mm256_set1_epi8(0x10)));
    }
    /* 6 bits: element e's two high bits in byte e % 8 at bit 2 (e / 8); shifted to bits 4..5 of its lane */
    const __m128i h = _mm_loadl_epi64((const __m128i *)(b + 16));
    const __m128i h01 = _mm_unpacklo_epi64(_mm_slli_epi16(h, 4), _mm_slli_epi16(h, 2));
    const __m128i h23 = _mm_unpacklo_epi64(h, _mm_srli_epi16(h, 2));
    return _mm256_or_si256(lo, _mm256_and_si256(_mm256_set_m128i(h23, h01), _mm256_set1_epi8(0x30)));
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* One activation row against nr consecutive weight rows (independent FMA chains, x loaded once for all). */
static inline __attribute__((always_inline)) void rows(const act_t *a, int64_t m, const shape_t *s,
                                                       const uint8_t *w, float *out, const int nr,
                                                       const int bits, const int group) {
    const int64_t k = s->k, nb = k / QB, recs = k / (QB * s->p), rb = row_bytes(s), hb = header_bytes(s),
                  bb = block_bytes(bits);
    const int gp = (groups(s) + 7) / 8;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[NR], oacc[NR];
    for (int r = 0; r < nr; r++) acc[r] = oacc[r] = _mm256_setzero_ps();
    const int8_t *xq = a->q + m * k;
    const float *xd = a->d + m * nb;
    for (int64_t rec = 0; rec < recs; rec++) {
        float sc[NR][GM], of[NR][GM];
        const float *gs = a->gs + (m * recs + rec) * GM;
        const uint8_t *base[NR];
        for (int r = 0; r < nr; r++) {
            base[r] = w + r * rb + rec * record_bytes(s);
            header(base[r], s, sc[r], of[r], 1);
            for (int c = 0; c < gp; c++)
                oacc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(of[r] + 8 * c), _mm256_loadu_ps(gs + 8 * c), oacc[r]);
        }
        for (int b = 0; b < s->p; b++) {
            const int64_t blk = rec * s->p + b;
            const __m256i xv = _mm256_load_si256((const __m256i *)(xq + blk * QB));
            const float d = xd[blk];
            for (int r = 0; r < nr; r++) {
                const __m256i q = codes(base[r] + hb + b * bb, bits);
                __m256i p;
                if (bits == 8) /* |q| unsigned and the sign moved onto x: u8 x s8 is the only byte product */
                    p = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(xv, q)), ones);
                else
                    p = _mm256_madd_epi16(_mm256_maddubs_epi16(q, xv), ones);
                /* int32 lanes 0-3 hold elements 0-15, lanes 4-7 elements 16-31: a group of 16 each half */
                const __m256 sv = group == 32 ? _mm256_set1_ps(sc[r][b] * d)
                                              : _mm256_set_m128(_mm_set1_ps(sc[r][2 * b + 1] * d), _mm_set1_ps(sc[r][2 * b] * d));
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), sv, acc[r]);
            }
        }
    }
    for (int r = 0; r < nr; r++) out[r] = hsum(acc[r]) + hsum(oacc[r]);
}

static inline __attribute__((always_inline)) void matmul(const act_t *a, int64_t m, const shape_t *s,
                                                         const uint8_t *w, float *out, int threads,
                                                         const int bits, const int group) {
    const int64_t n = s->n, tiles = (n + NR - 1) / NR, rb = row_bytes(s);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t j = t * NR;
        for (int64_t i = 0; i < m; i++) {
            if (j + NR <= n)
                rows(a, i, s, w + j * rb, out + i * n + j, NR, bits, group);
            else
                for (int64_t jj = j; jj < n; jj++) rows(a, i, s, w + jj * rb, out + i * n + jj, 1, bits, group);
        }
    }
}

static int check(const shape_t *s) {
    if ((s->bits != 5 && s->bits != 6 && s->bits != 8) || (s->group != 16 && s->group != 32)) return -3;
    if (s->p < 1 || s->p > 8 || s->k % (QB * s->p) || s->form < F32 || s->form > I8) return -2;
    return 0;
}

/* x [M][K] fp32 times the k-bit weight w ([N] rows of row_bytes) transposed: out [M][N]. */
int ab_bits_matmul(const float *x, int64_t m, const uint8_t *w, int bits, int group, int form, int off, int p,
                   int64_t k, int64_t n, float *out, int threads) {
    const shape_t s = {bits, group, form, off, p, k, n};
    int rc = check(&s);
    if (rc) return rc;
    act_t a;
    if (quantize(x, m, &s, &a)) return -1;
#define CASE(B, G) \
    if (bits == B && group == G) matmul(&a, m, &s, w, out, threads, B, G);
    CASE(5, 32) CASE(5, 16) CASE(6, 32) CASE(6, 16) CASE(8, 32) CASE(8, 16)
#undef CASE
    release(&a);
    return 0;
}

/* Dense fp32 [N][K] of the weight with the reference's roundings (q s + o, or (q - 2^(bits-1)) s; no fused
 * multiply-add), so dequantise + sgemm on the rounded x equals the kernel and GGUF's own dequantisation. */
__attribute__((optimize("fp-contract=off"))) int ab_bits_dequant(const uint8_t *w, int bits, int group, int form,
                                                                  int off, int p, int64_t k, int64_t n, float *out,
                                                                  int threads) {
    const shape_t s = {bits, group, form, off, p, k, n};
    int rc = check(&s);
    if (rc) return rc;
    const int64_t recs = k / (QB * p), rb = row_bytes(&s), hb = header_bytes(&s), bb = block_bytes(bits);
    const int per = QB / group;
    const float base = bits == 8 ? 128.0f : 0.0f, centre = off ? 0.0f : (float)(1 << (bits - 1));
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t j = 0; j < n; j++) {
        float sc[GM], of[GM];
        for (int64_t rec = 0; rec < recs; rec++) {
            const uint8_t *r = w + j * rb + rec * record_bytes(&s);
            header(r, &s, sc, of, 0);
            for (int b = 0; b < p; b++) {
                uint8_t q[QB];
                _mm256_storeu_si256((__m256i *)q, codes(r + hb + b * bb, bits));
                float *dst = out + j * k + (rec * p + b) * QB;
                for (int e = 0; e < QB; e++) {
                    const int g = b * per + (per == 2 ? e / 16 : 0);
                    const float v = (bits == 8 ? (float)(int8_t)q[e] + base : (float)q[e]);
                    dst[e] = off ? v * sc[g] + of[g] : (v - centre) * sc[g];
                }
            }
        }
    }
    return 0;
}
