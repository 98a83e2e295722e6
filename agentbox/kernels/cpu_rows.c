/* The torch layers' many-row passes on the CPU (a prefill chunk, a warm turn's new tokens): RMSNorm and the rotary
 * embedding, rows split over the threads. torch's own ran far under the memory's speed here: F.rms_norm over 2,048
 * rows of 2,048 took 10 ms at two threads (an add of the same tensors 1.2), over 2,048 x 32 heads of 128 37 ms, and
 * the rotary embedding's five ops over those heads 52 ms; a Qwen3-30B-A3B-shaped prefill of 2,048 tokens spent 14 %
 * of its time in them (issue 44).
 *
 * Numbers: a row's norm is cpu_gemv.h's ab_rmsnorm, the fused decode's, whatever rows come with it: eight rows at
 * a time each keep their own in-order fp64 sum of squares in a lane (the squares gathered down the rows), the same
 * operations in the same order. The rotary embedding is ab_rope, torch's arithmetic (tests/test_cpu_rows.py).
 */
#include <omp.h>

#include "cpu_gemv.h"

/* Fewest values a call splits over its threads (torch's own grain for elementwise work): a small model's or a short
 * chunk's rows run on the calling thread, where a team's barrier per call cost more than the pass (two engines on
 * two cores, as the test suite runs them, waited on each other's descheduled workers at every norm). */
#define PAR_GRAIN 32768

/* w * (x * r) of one row for a given r: ab_rmsnorm's second loop, eight lanes at a time. */
static inline void scale_row(const float *x, const float *w, int64_t h, float r, float *out) {
    const __m256 rv = _mm256_set1_ps(r);
    int64_t i = 0;
    for (; i + 8 <= h; i += 8)
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_loadu_ps(w + i), _mm256_mul_ps(_mm256_loadu_ps(x + i), rv)));
    for (; i < h; i++) out[i] = w[i] * (x[i] * r);
}

/* Rows r0 .. r0 + 7: lane j sums row r0 + j's squares in fp64 in order, as ab_rmsnorm's scalar loop. */
static void rms8(const float *x, int64_t stride, const float *w, int64_t h, float eps, float *out) {
    const __m256i idx = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32((int)stride));
    __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
    for (int64_t i = 0; i < h; i++) {
        const __m256 v = _mm256_i32gather_ps(x + i, idx, 4);
        const __m256d a = _mm256_cvtps_pd(_mm256_castps256_ps128(v)), b = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
        lo = _mm256_add_pd(lo, _mm256_mul_pd(a, a));
        hi = _mm256_add_pd(hi, _mm256_mul_pd(b, b));
    }
    const __m256 ss = _mm256_set_m128(_mm256_cvtpd_ps(hi), _mm256_cvtpd_ps(lo));
    const __m256 mean = _mm256_add_ps(_mm256_div_ps(ss, _mm256_set1_ps((float)h)), _mm256_set1_ps(eps));
    float r[8];
    _mm256_storeu_ps(r, _mm256_div_ps(_mm256_set1_ps(1.0f), _mm256_sqrt_ps(mean)));
    for (int j = 0; j < 8; j++) scale_row(x + j * stride, w, h, r[j], out + j * h);
}

/* x [t][heads] rows of h (row (i, j) at x + i * s_tok + j * s_head: a token's q or k heads inside its qkv row, or
 * one row a token) -> out [t][heads][h] contiguous. Eight rows a fixed stride apart take rms8, others one at a
 * time (the same numbers). 0, or -2 for strides the gather's int32 offsets do not reach. */
int ab_rmsnorm_rows(const float *x, int64_t t, int64_t heads, int64_t h, int64_t s_tok, int64_t s_head,
                    const float *w, float eps, float *out, int threads) {
    if (7 * (s_tok > s_head ? s_tok : s_head) >= (int64_t)1 << 31) return -2;
    const int64_t m = t * heads, blocks = (m + 7) / 8;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && m > 8 && m * h >= PAR_GRAIN)
    for (int64_t b = 0; b < blocks; b++) {
        int64_t at[8];
        const int n = m - b * 8 < 8 ? (int)(m - b * 8) : 8;
        for (int j = 0; j < n; j++) at[j] = (b * 8 + j) / heads * s_tok + (b * 8 + j) % heads * s_head;
        int even = n == 8;
        for (int j = 2; j < n && even; j++) even = at[j] - at[j - 1] == at[1] - at[0];
        if (even)
            rms8(x + at[0], at[1] - at[0], w, h, eps, out + b * 8 * h);
        else
            for (int j = 0; j < n; j++) ab_rmsnorm(x + at[j], w, h, eps, out + (b * 8 + j) * h);
    }
    return 0;
}

/* x [t][heads][d] (strides s_tok, s_head; channels contiguous) rotated by cos / sin [t][d] (each token's rows) into
 * out [t][heads][d] contiguous. */
void ab_rope_rows(const float *x, int64_t t, int64_t heads, int64_t d, int64_t s_tok, int64_t s_head,
                  const float *cos, const float *sin, float *out, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && t > 1 && t * heads * d >= PAR_GRAIN)
    for (int64_t i = 0; i < t; i++)
        for (int64_t h = 0; h < heads; h++)
            ab_rope(x + i * s_tok + h * s_head, cos + i * d, sin + i * d, d, out + (i * heads + h) * d);
}
