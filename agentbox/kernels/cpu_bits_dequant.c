/* Dense rows of a k-bit weight (cpu_bits_layout.h's layout): dequantise + sgemm for many activation rows, and an
 * embedding's lookup (cpu_bits.py's bits_dequant, bits_rows). */
#include <immintrin.h>
#include <stdint.h>

#include "cpu_bits_layout.h"
#include "cpu_gemv.h"

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
