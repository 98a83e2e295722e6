/* One Llama-family decoder layer of a decode step in one call (CPU, fp32 activations, 4-bit weights):
 * Llama / SmolLM2 / Mistral, Qwen2 (a qkv bias) and Qwen3 (RMSNorm over each q and k head before rope).
 *
 * Eager PyTorch spends about 60 op dispatches per layer on a decode step; on SmolLM2 (30 layers) that is
 * more time than its 4-bit matmuls take. This is the same layer as models/llama.py's (and the same matmul
 * kernel, ab_q4_matmul, with its int8-rounded activations) with the small ops in plain C: the residual add,
 * RMSNorm, rotary embedding, the paged KV store, attention over the sequence's pages, SiLU-and-mul.
 * One query token per sequence (token m is sequence m); k/v go to the cache before attention, so a token
 * sees itself. The runner checks that a model fits (models/cpu_decode.py) and otherwise runs the torch path.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_gemv.h"

typedef struct {
    const uint8_t *codes;
    const void *so; /* scales and offsets, as cpu_gemv.c tiles them */
    int64_t n, k, group;
    int64_t half;
} q4w_t;

typedef struct {
    q4w_t qkv, o, gate_up, down;
    const float *ln1, *ln2; /* [H] */
    const float *qkv_bias;  /* [(Hq + 2 Hkv) D] or NULL (Qwen2) */
    const float *q_norm, *k_norm; /* [D] or NULL (Qwen3) */
    float *k_cache, *v_cache; /* [slots][Hkv][D] */
} layer_t;

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, inter;
    const float *cos, *sin; /* [positions][D], HF's cat(freqs, freqs) layout */
    float eps, scale;
} dims_t;

static int mm(const q4w_t *w, const float *x, int64_t m, float *out, int threads) {
    return ab_q4_matmul(x, m, w->k, w->codes, w->so, w->n, w->group, out, threads, (int)w->half);
}

static void rmsnorm(const float *x, const float *w, int64_t h, float eps, float *out) {
    float ss = 0.0f;
    for (int64_t i = 0; i < h; i++) ss += x[i] * x[i];
    float r = 1.0f / sqrtf(ss / (float)h + eps);
    for (int64_t i = 0; i < h; i++) out[i] = w[i] * (x[i] * r);
}

/* q . k over a head (8 lanes, two accumulators: a head of 64 is 8 FMAs instead of a 64-long scalar chain). */
static inline float dot(const float *a, const float *b, int64_t n) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
    }
    __m256 s = _mm256_add_ps(s0, s1);
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    float r = _mm_cvtss_f32(h);
    for (; i < n; i++) r += a[i] * b[i];
    return r;
}

/* out += p * v over a head */
static inline void axpy(float *out, float p, const float *v, int64_t n) {
    __m256 pv = _mm256_set1_ps(p);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + i), _mm256_loadu_ps(out + i)));
    for (; i < n; i++) out[i] += p * v[i];
}

/* e^x in 8 lanes: Cephes' expf (reduction by ln 2 in two parts, degree-5 polynomial, ~1 ulp), inputs clamped to
 * [-87.3, 88.3]. libm's scalar expf was a tenth of a decode step on SmolLM2 (softmax over each head's keys and the
 * SiLU over 1536 channels, per row and layer), and each verified row pays it again. */
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

static void rope(float *x, const float *cos, const float *sin, int64_t d) {
    int64_t half = d / 2;
    for (int64_t i = 0; i < half; i++) {
        float a = x[i], b = x[i + half];
        x[i] = a * cos[i] - b * sin[i];
        x[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}

int ab_decode_layer(const layer_t *L, const dims_t *d, float *hidden, float *residual, int first, int64_t m,
                    const int64_t *positions, const int64_t *slots, const int32_t *page_table, int64_t pt_stride,
                    int64_t page_size, const int64_t *kv_lens, int threads) {
    const int64_t h = d->hidden, hq = d->heads, hkv = d->kv_heads, hd = d->head_dim, in = d->inter;
    const int64_t qkv_n = (hq + 2 * hkv) * hd, group = hq / hkv;
    int64_t max_kv = 1;
    for (int64_t t = 0; t < m; t++) max_kv = kv_lens[t] > max_kv ? kv_lens[t] : max_kv;
    float *normed = malloc(sizeof(float) * m * h), *qkv = malloc(sizeof(float) * m * qkv_n);
    float *attn = malloc(sizeof(float) * m * hq * hd), *gu = malloc(sizeof(float) * m * 2 * in);
    float *act = malloc(sizeof(float) * m * in), *o = malloc(sizeof(float) * m * h);
    float *scores_all = malloc(sizeof(float) * (threads > 1 ? threads : 1) * max_kv); /* one row per thread */
    int rc = -1;
    if (!normed || !qkv || !attn || !gu || !act || !o || !scores_all) goto done;

    for (int64_t t = 0; t < m; t++) {
        float *res = residual + t * h, *hid = hidden + t * h;
        for (int64_t i = 0; i < h; i++) res[i] = first ? hid[i] : hid[i] + res[i];
        rmsnorm(res, L->ln1, h, d->eps, normed + t * h);
    }
    if ((rc = mm(&L->qkv, normed, m, qkv, threads))) goto done;
    for (int64_t t = 0; t < m; t++) {
        float *row = qkv + t * qkv_n;
        const float *c = d->cos + positions[t] * hd, *s = d->sin + positions[t] * hd;
        if (L->qkv_bias)
            for (int64_t i = 0; i < qkv_n; i++) row[i] += L->qkv_bias[i];
        if (L->q_norm) /* in place: rmsnorm reads a head's sum of squares before it writes */
            for (int64_t head = 0; head < hq + hkv; head++)
                rmsnorm(row + head * hd, head < hq ? L->q_norm : L->k_norm, hd, d->eps, row + head * hd);
        for (int64_t head = 0; head < hq + hkv; head++) rope(row + head * hd, c, s, hd); /* q and k heads */
        if (slots[t] >= 0) {
            memcpy(L->k_cache + slots[t] * hkv * hd, row + hq * hd, sizeof(float) * hkv * hd);
            memcpy(L->v_cache + slots[t] * hkv * hd, row + (hq + hkv) * hd, sizeof(float) * hkv * hd);
        }
    }
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t th = 0; th < m * hq; th++) {
        const int64_t t = th / hq, head = th % hq, kvh = head / group, n = kv_lens[t];
        const float *q = qkv + t * qkv_n + head * hd;
        float *scores = scores_all + (threads > 1 ? omp_get_thread_num() : 0) * max_kv;
        float *out = attn + t * hq * hd + head * hd;
        const int32_t *pages = page_table + t * pt_stride;
        float top = -INFINITY;
        /* page by page: a key's slot is its page's base plus its offset, no division per key */
        for (int64_t j0 = 0, pg = 0; j0 < n; j0 += page_size, pg++) {
            const int64_t base = (int64_t)pages[pg] * page_size, len = n - j0 < page_size ? n - j0 : page_size;
            for (int64_t o = 0; o < len; o++) {
                float sc = dot(q, L->k_cache + ((base + o) * hkv + kvh) * hd, hd) * d->scale;
                scores[j0 + o] = sc;
                top = sc > top ? sc : top;
            }
        }
        float sum = 0.0f;
        int64_t j = 0;
        for (; j + 8 <= n; j += 8) /* a row's numbers depend on its own n only: a verify stays bit-exact */
            _mm256_storeu_ps(scores + j, exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + j), _mm256_set1_ps(top))));
        for (; j < n; j++) scores[j] = expf(scores[j] - top);
        for (j = 0; j < n; j++) sum += scores[j];
        const float inv = 1.0f / sum;
        for (int64_t i = 0; i < hd; i++) out[i] = 0.0f;
        for (int64_t j0 = 0, pg = 0; j0 < n; j0 += page_size, pg++) {
            const int64_t base = (int64_t)pages[pg] * page_size, len = n - j0 < page_size ? n - j0 : page_size;
            for (int64_t o = 0; o < len; o++)
                axpy(out, scores[j0 + o] * inv, L->v_cache + ((base + o) * hkv + kvh) * hd, hd);
        }
    }
    if ((rc = mm(&L->o, attn, m, o, threads))) goto done;
    for (int64_t t = 0; t < m; t++) {
        float *res = residual + t * h;
        for (int64_t i = 0; i < h; i++) res[i] += o[t * h + i];
        rmsnorm(res, L->ln2, h, d->eps, normed + t * h);
    }
    if ((rc = mm(&L->gate_up, normed, m, gu, threads))) goto done;
    for (int64_t t = 0; t < m; t++) {
        const float *g = gu + t * 2 * in, *up = g + in;
        float *a = act + t * in;
        int64_t i = 0;
        for (; i + 8 <= in; i += 8) {
            const __m256 gv = _mm256_loadu_ps(g + i);
            const __m256 den = _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv)));
            _mm256_storeu_ps(a + i, _mm256_mul_ps(_mm256_div_ps(gv, den), _mm256_loadu_ps(up + i)));
        }
        for (; i < in; i++) a[i] = g[i] / (1.0f + expf(-g[i])) * up[i];
    }
    rc = mm(&L->down, act, m, hidden, threads);
done:
    free(normed);
    free(qkv);
    free(attn);
    free(gu);
    free(act);
    free(o);
    free(scores_all);
    return rc;
}
