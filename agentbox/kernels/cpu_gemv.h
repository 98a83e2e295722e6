/* Shared between cpu_gemv.c (the 4-bit and Q8 matmuls), cpu_bits.c (the 2- to 8-bit ones), cpu_decode.c (a whole
 * decoder layer in one call) and cpu_moe.c (its linears in either form, and its routed experts). */
#pragma once
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

/* The build's instruction set (cpu_gemv.py compiles one library per variant and loads the one this CPU runs).
 * The variants differ only in how a block's int8 dot product is summed to int32: vpdpbusd (VNNI: u8 x s8
 * products, four to an int32 lane, accumulated) or AVX2's vpmaddubsw + vpmaddwd (pairs to int16, then to
 * int32). Both sum the same elements into the same lanes, and integer sums are exact, so every variant
 * gives the same bits; the fp32 work around them is the same operations in the same order (the avx512-vnni
 * build's Q4 kernel does each lane's in 512-bit vectors of two tiles: q4_pair in cpu_gemv.c). */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AMX_INT8__)
#define AB_ISA "avx512-amx" /* the avx512-vnni kernels, and AMX tiles for many-row 8- and 4-bit products */
#define AB_DPBUSD(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define AB_ISA "avx512-vnni"
#define AB_DPBUSD(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
#elif defined(__AVXVNNI__)
#define AB_ISA "avx-vnni"
#define AB_DPBUSD(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#else
#define AB_ISA "avx2"
#endif

/* A block's codes q[32] as four 32-byte operands out[j * step], j = 0..3: dwords (j j j j 4+j 4+j 4+j 4+j), each
 * byte + 128 (the u8 side of vpdpbusd against a tile's transposed signed codes: cpu_gemv.c's q8v_tile, q8z_tile,
 * cpu_bits_q8z.c). */
static inline void q8_expand(const int8_t *q, int8_t *out, int64_t step) {
    const __m256i x = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)q), _mm256_set1_epi8((char)0x80));
    for (int j = 0; j < 4; j++)
        _mm256_store_si256((__m256i *)(out + step * j), _mm256_permutevar8x32_epi32(x, _mm256_setr_epi32(j, j, j, j, 4 + j, 4 + j, 4 + j, 4 + j)));
}

#ifdef __AVX512VNNI__
/* One block of a Q8 tile against mp pairs of activation rows, two rows a 512-bit vector (cpu_gemv.c's q8z_tile,
 * cpu_bits_q8z.c): the tile's four rows' signed codes w0..w3 transposed so that int32 lane 4 h + r holds row r's
 * dword 4 h + q in vector q (both halves alike); pair i's expanded block (q8_expand, + 128) at xe + i * xstride, its
 * two rows' d (8 copies each) at xd + i * dstride. The + 128 comes back out as -128 x the codes' sums (`base`, once
 * for all pairs); a pair is then four vpdpbusd, one conversion, one multiply by s16 (the rows' scales) and an FMA. */
static inline __attribute__((always_inline)) void q8z_block(__m256i w0, __m256i w1, __m256i w2, __m256i w3, __m512 s16,
                                                            const int8_t *xe, int64_t xstride, const float *xd,
                                                            int64_t dstride, const int mp, __m512 *acc) {
    const __m256i bias = _mm256_set1_epi8((char)0x80), z = _mm256_setzero_si256();
    const __m256i t0 = _mm256_unpacklo_epi32(w0, w1), t1 = _mm256_unpackhi_epi32(w0, w1);
    const __m256i t2 = _mm256_unpacklo_epi32(w2, w3), t3 = _mm256_unpackhi_epi32(w2, w3);
    const __m256i v0 = _mm256_unpacklo_epi64(t0, t2), v1 = _mm256_unpackhi_epi64(t0, t2);
    const __m256i v2 = _mm256_unpacklo_epi64(t1, t3), v3 = _mm256_unpackhi_epi64(t1, t3);
    const __m256i base = _mm256_sub_epi32(z, AB_DPBUSD(AB_DPBUSD(AB_DPBUSD(AB_DPBUSD(z, bias, v0), bias, v1), bias, v2), bias, v3));
    const __m512i v[4] = {_mm512_inserti64x4(_mm512_castsi256_si512(v0), v0, 1), _mm512_inserti64x4(_mm512_castsi256_si512(v1), v1, 1),
                          _mm512_inserti64x4(_mm512_castsi256_si512(v2), v2, 1), _mm512_inserti64x4(_mm512_castsi256_si512(v3), v3, 1)};
    const __m512i base2 = _mm512_inserti64x4(_mm512_castsi256_si512(base), base, 1);
#pragma GCC unroll 8
    for (int i = 0; i < mp; i++) {
        const __m512i *x = (const __m512i *)(xe + i * xstride);
        const __m512i p = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_dpbusd_epi32(
            base2, _mm512_load_si512(x), v[0]), _mm512_load_si512(x + 1), v[1]), _mm512_load_si512(x + 2), v[2]),
            _mm512_load_si512(x + 3), v[3]);
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(s16, _mm512_load_ps(xd + i * dstride)), acc[i]);
    }
}
#endif

/* A tile's four weight rows of one block against one activation block, 4-bit codes in the layout of cpu_gemv.c:
 * v[t] holds, at int32 lane j, four codes of row j / 2 (j even: of elements 0..7 and 16..23, j odd: 8..15 and
 * 24..31) and x[t] the four activations each lane multiplies (q4_expand in cpu_gemv.c). Lane j of the result is that half-row's sum: four vertical sums, no horizontal
 * step per activation row. (AVX2: int16 sums of at most 8 products of 15 x 127, no overflow.) */
static inline __attribute__((always_inline)) __m256i q4_dot(const __m256i *v, const __m256i *x) {
#ifdef AB_DPBUSD
    const __m256i z = _mm256_setzero_si256();
    return _mm256_add_epi32(AB_DPBUSD(AB_DPBUSD(z, v[0], x[0]), v[1], x[1]), AB_DPBUSD(AB_DPBUSD(z, v[2], x[2]), v[3], x[3]));
#else
    const __m256i s = _mm256_add_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(v[0], x[0]), _mm256_maddubs_epi16(v[1], x[1])),
                                       _mm256_add_epi16(_mm256_maddubs_epi16(v[2], x[2]), _mm256_maddubs_epi16(v[3], x[3])));
    return _mm256_madd_epi16(s, _mm256_set1_epi16(1));
#endif
}

/* Four rows of unsigned codes u[r] (32 each, u8 lanes) against one activation block x: int32 lanes u of each
 * row sum elements 4u..4u+3 (the same lanes for VNNI and AVX2's pairs of pairs; AVX2 needs u <= 128). */
static inline __attribute__((always_inline)) __m256i u8_dot(__m256i u, __m256i x) {
#ifdef AB_DPBUSD
    return AB_DPBUSD(_mm256_setzero_si256(), u, x);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1));
#endif
}

/* Four rows of 32 int8 codes w[r] (aw[r] = |w[r]|) against x, as rows 0 1 2 3 | 0 1 2 3 (elements 0..15 |
 * 16..31): |w| unsigned and w's sign moved onto x, since u8 x s8 is the only byte product. */
static inline __attribute__((always_inline)) __m256i q8_dot(const __m256i *aw, const __m256i *w, __m256i x) {
    const __m256i p01 = _mm256_hadd_epi32(u8_dot(aw[0], _mm256_sign_epi8(x, w[0])), u8_dot(aw[1], _mm256_sign_epi8(x, w[1])));
    const __m256i p23 = _mm256_hadd_epi32(u8_dot(aw[2], _mm256_sign_epi8(x, w[2])), u8_dot(aw[3], _mm256_sign_epi8(x, w[3])));
    return _mm256_hadd_epi32(p01, p23);
}

/* One block of 32 activations rounded to int8 with d = max|x| / 127 (llama.cpp's q8 blocks; ties to even):
 * the codes into q, the sums of each half's codes (16 each) into sums. Every kernel rounds through this, so
 * they all see the same activations (and `round_activations` in cpu_gemv.py is its twin). Vectorised: the
 * scalar loop (a vroundss per element) was a third of an 8-row product's time at K 1536; a maximum is exact
 * and cvtps_epi32 rounds in the current mode as nearbyintf does, so the codes and d are the scalar loop's. */
static inline float ab_round_block(const float *v, int8_t *q, int sums[2]) {
    const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const __m256 x0 = _mm256_loadu_ps(v), x1 = _mm256_loadu_ps(v + 8), x2 = _mm256_loadu_ps(v + 16),
                 x3 = _mm256_loadu_ps(v + 24);
    const __m256 m8 = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(x0, abs), _mm256_and_ps(x1, abs)),
                                    _mm256_max_ps(_mm256_and_ps(x2, abs), _mm256_and_ps(x3, abs)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    const float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
    const __m256 iv = _mm256_set1_ps(id);
    const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(x0, iv)), i1 = _mm256_cvtps_epi32(_mm256_mul_ps(x1, iv));
    const __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(x2, iv)), i3 = _mm256_cvtps_epi32(_mm256_mul_ps(x3, iv));
    /* |codes| <= 127: the packs do not saturate; they interleave 128-bit halves, the permute restores order */
    const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
    _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    const __m256i lo = _mm256_add_epi32(i0, i1), hi = _mm256_add_epi32(i2, i3);
    const __m256i h = _mm256_hadd_epi32(lo, hi); /* lo 0+1 2+3 hi 0+1 2+3 | lo 4+5 6+7 hi 4+5 6+7 */
    const __m128i s = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
    sums[0] = _mm_extract_epi32(s, 0) + _mm_extract_epi32(s, 1);
    sums[1] = _mm_extract_epi32(s, 2) + _mm_extract_epi32(s, 3);
    return d;
}

/* `tiles`: whether a call of ab_amx_min_rows rows or more may take the avx512-amx build's tiles (cpu_*_amx.c), whose
 * fp32 sums are not the VNNI kernels' bits; the fused decode passes 0, so a sequence's step does not depend on how
 * many others share it. */
int ab_q4_matmul(const float *x, int64_t m, int64_t k, const uint8_t *codes, const void *so, int64_t n,
                 int64_t group, float *out, int threads, int half, int tiles);
int ab_bits_matmul(const float *x, int64_t m, const uint8_t *w, int bits, int group, int form, int off, int64_t k,
                   int64_t n, float *out, int threads, int tiles);

/* One run of a linear layer's output rows as a CPU kernel holds it: bits 4, cpu_gemv.c's tiles (w: codes, so: their
 * scales and offsets, fp16 where `half`); 2, 3, 5, 6, 8, cpu_bits.c's rows (w; `form` its ScaleForm, `off` whether
 * it has offsets). */
typedef struct {
    const void *w, *so;
    int64_t n, k, group, bits, half, form, off;
} ab_part_t;

#define AB_PARTS 3 /* runs of rows a linear may have (GGUF's mixed qkv: q and k in one type, v in another) */

/* A linear layer: its runs' outputs side by side ([m][sum of n]). */
typedef struct {
    ab_part_t part[AB_PARTS];
    int64_t parts;
} ab_linear_t;

int ab_linear(const ab_linear_t *l, const float *x, int64_t m, float *out, int threads);

/* Routed experts (Qwen3-MoE's MLP): a router [E][H] fp32, softmax over the E experts, the top k kept (renormalised
 * to sum to one when `renorm`); each expert a gate_up [2I][H] and a down [H][I] in the CPU forms, expert e's at e
 * strides (bytes) past expert 0's w and so. */
typedef struct {
    const float *router;
    int64_t experts, top_k, renorm, inter;
    ab_part_t w13, w2;
    int64_t w13_stride, w13_so_stride, w2_stride, w2_so_stride;
} ab_moe_t;

int ab_moe(const ab_moe_t *e, const float *x, int64_t m, int64_t h, float *out, double *seconds, int threads);
int ab_moe_routed(const ab_moe_t *e, const float *x, int64_t m, int64_t h, const int64_t *ids, const float *weights,
                  float *out, int threads);

/* a[i] = silu(gu[i]) * gu[in + i] for i < in: SiLU-and-mul of one row of [gate | up] (cpu_decode.c). */
void ab_silu_mul(const float *gu, int64_t in, float *a);

/* The variant this library was built as (AB_ISA). */
const char *ab_isa(void);

/* e^x in 8 lanes: Cephes' expf (reduction by ln 2 in two parts, degree-5 polynomial, ~1 ulp), inputs clamped to
 * [-87.3, 88.3]. libm's scalar expf was a tenth of a decode step on SmolLM2 (softmax over each head's keys and the
 * SiLU over 1536 channels, per row and layer), and each verified row pays it again (cpu_decode.c; cpu_hybrid.c's
 * prefill conv too). */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
    const __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

/* RMSNorm of one row, w * (x * r) with r = 1 / sqrt(mean(x^2) + eps): the fused decode's norm (cpu_decode.c,
 * cpu_hybrid.c), and cpu_rows.c's many-row pass sums each row the same way, so a row's numbers do not depend on how
 * many rows came with it. The squares are exact in fp64 and summed there, so the fp32 sum is the correctly rounded
 * one (F.rms_norm's cascade sum nearly always gives it too; an fp32 sum in order drifted far enough from it to move a
 * tiny Q4_K_M model's logits by 3e-4). out may be x (the sum is read before the writes). */
static inline void ab_rmsnorm(const float *x, const float *w, int64_t h, float eps, float *out) {
    double ss = 0.0;
    for (int64_t i = 0; i < h; i++) ss += (double)x[i] * (double)x[i];
    const float r = 1.0f / sqrtf((float)ss / (float)h + eps);
    for (int64_t i = 0; i < h; i++) out[i] = w[i] * (x[i] * r);
}

/* The rotary embedding of one head's first d channels (HF's rotate_half form: cos / sin [d] = cat(freqs, freqs)),
 * from x into out (may be x): torch's x * cos + rotate_half(x) * sin, the same products and sums in the same order. */
static inline void ab_rope(const float *x, const float *cos, const float *sin, int64_t d, float *out) {
    const int64_t half = d / 2;
    for (int64_t i = 0; i < half; i++) {
        const float a = x[i], b = x[i + half];
        out[i] = a * cos[i] - b * sin[i];
        out[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}
