/* One Llama-family decoder layer of a decode step in one call (CPU, fp32 activations, quantised weights):
 * Llama / SmolLM2 / Mistral, Qwen2 (a qkv bias) and Qwen3 (RMSNorm over each q and k head before rope), with a dense
 * SiLU MLP or Qwen3-MoE's routed experts (cpu_moe.c).
 *
 * Eager PyTorch spends about 60 op dispatches per layer on a decode step; on SmolLM2 (30 layers) that is
 * more time than its 4-bit matmuls take. This is the same layer as models/llama.py's (and the same matmul
 * kernels, with their int8-rounded activations: a linear is cpu_gemv.c's 4-bit form or cpu_bits.c's k-bit one, or
 * runs of both, ab_linear) with the small ops in plain C: the residual add,
 * RMSNorm, rotary embedding, the paged KV store, attention over the sequence's pages, SiLU-and-mul.
 * A row is a query token; a sequence's rows (a verify) share a page-table row and each attends up to its own
 * position; k/v go to the cache before attention, so a token sees itself and the rows before it. The runner checks that a model fits (models/cpu_decode.py) and otherwise runs the torch path.
 * The KV cache is fp32 or fp16 (kv_f16, the default CPU pool: a decode step at a few thousand tokens of history is
 * bound by the keys and values it reads, and fp16 halves them, as llama.cpp's default f16 cache does): the store
 * rounds to nearest even as torch's .half() does, and attention (cpu_decode_attention.h) widens each key and value
 * vector with F16C once for every query that shares it.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_gemv.h"

typedef struct {
    ab_linear_t qkv, o, gate_up, down; /* gate_up and down unused where moe is set */
    const ab_moe_t *moe;               /* routed experts in place of the dense MLP, or NULL */
    const float *ln1, *ln2; /* [H] */
    const float *qkv_bias;  /* [(Hq + 2 Hkv) D] or NULL (Qwen2) */
    const float *q_norm, *k_norm; /* [D] or NULL (Qwen3) */
    void *k_cache, *v_cache; /* [slots][Hkv][D], fp32 or (kv_f16) fp16 */
    int64_t kv_f16;
    double *moe_seconds; /* where the routed experts add their time (the engine's expert clock), or NULL */
} layer_t;

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, inter;
    const float *cos, *sin; /* [positions][D], HF's cat(freqs, freqs) layout */
    float eps, scale;
} dims_t;

void ab_silu_mul(const float *gu, int64_t in, float *a) {
    const float *g = gu, *up = gu + in;
    int64_t i = 0;
    for (; i + 8 <= in; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i);
        const __m256 den = _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv)));
        _mm256_storeu_ps(a + i, _mm256_mul_ps(_mm256_div_ps(gv, den), _mm256_loadu_ps(up + i)));
    }
    for (; i < in; i++) a[i] = g[i] / (1.0f + expf(-g[i])) * up[i];
}

/* ab_silu_mul over m rows of [gate | up] ([m][2 in]) into out [m][in], rows in parallel: the torch layers' MLP on the
 * CPU (models/llama.py), where F.silu over the strided gate half and the product took two passes and two
 * temporaries of [m][in]. */
void ab_silu_mul_rows(const float *gu, int64_t m, int64_t in, float *out, int threads) {
    _Pragma("omp parallel for schedule(static) num_threads(threads) if (threads > 1 && m > 1)")
    for (int64_t t = 0; t < m; t++) ab_silu_mul(gu + t * 2 * in, in, out + t * in);
}

/* n values (a multiple of 8) into the cache at element `at`: copied, or (f16) rounded to nearest even, as torch's
 * .half() rounds; the torch layers' store (index_copy_ of k.to(cache.dtype)) writes the same bits. */
void ab_store_kv(void *cache, int f16, int64_t at, const float *src, int64_t n) {
    if (!f16) {
        memcpy((float *)cache + at, src, sizeof(float) * n);
        return;
    }
    uint16_t *dst = (uint16_t *)cache + at;
    for (int64_t i = 0; i < n; i += 8)
        _mm_storeu_si128((__m128i *)(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
}

#include "cpu_decode_attention.h"

/* The attention above for another layer's struct (cpu_hybrid.c's gated attention): q | k | v rows in, o rows out;
 * kv_f16: the cache is fp16 (else fp32). */
int ab_attend(void *k_cache, void *v_cache, int kv_f16, int64_t heads, int64_t kv_heads, int64_t head_dim, float scale,
              const float *qkv, int64_t m, const int32_t *page_table, int64_t pt_stride, int64_t page_size,
              const int64_t *kv_lens, float *attn, int threads) {
    layer_t L = {0};
    dims_t d = {0};
    L.k_cache = k_cache, L.v_cache = v_cache, L.kv_f16 = kv_f16;
    d.heads = heads, d.kv_heads = kv_heads, d.head_dim = head_dim, d.scale = scale;
    return attention(&L, &d, qkv, m, page_table, pt_stride, page_size, kv_lens, attn, threads);
}

/* Each row's argmax, the first index of its maximum as torch's max(dim) gives it (the greedy sampler: torch took 170 us
 * for a row of 151,936 logits, this ~20); -1 for a row holding a NaN, where the caller asks torch. */
void ab_argmax(const float *x, int64_t rows, int64_t n, int64_t *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *v = x + r * n;
        __m256 best = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
        __m256i at = _mm256_setzero_si256(), idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        int64_t i = 0;
        for (; i + 8 <= n && n < (1LL << 31); i += 8) { /* per lane: its first maximum (a strict >) */
            const __m256 xv = _mm256_loadu_ps(v + i), gt = _mm256_cmp_ps(xv, best, _CMP_GT_OQ);
            best = _mm256_blendv_ps(best, xv, gt);
            at = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(at), _mm256_castsi256_ps(idx), gt));
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(xv, xv, _CMP_UNORD_Q));
            idx = _mm256_add_epi32(idx, _mm256_set1_epi32(8));
        }
        float lane[8];
        int32_t lane_at[8];
        _mm256_storeu_ps(lane, best);
        _mm256_storeu_si256((__m256i *)lane_at, at);
        float top = -INFINITY;
        int64_t top_at = 0, bad = _mm256_movemask_ps(nan) != 0;
        for (int l = 0; l < 8 && i > 0; l++) /* the lanes' maxima: the largest, the first index among equals */
            if (lane[l] > top || (lane[l] == top && lane_at[l] < top_at)) top = lane[l], top_at = lane_at[l];
        for (; i < n; i++) {
            if (v[i] > top) top = v[i], top_at = i;
            bad |= v[i] != v[i];
        }
        out[r] = bad ? -1 : top_at;
    }
}

int ab_decode_layer(const layer_t *L, const dims_t *d, float *hidden, float *residual, int first, int64_t m,
                    const int64_t *positions, const int64_t *slots, const int32_t *page_table, int64_t pt_stride,
                    int64_t page_size, const int64_t *kv_lens, int threads) {
    const int64_t h = d->hidden, hq = d->heads, hkv = d->kv_heads, hd = d->head_dim, in = d->inter;
    const int64_t qkv_n = (hq + 2 * hkv) * hd;
    float *normed = malloc(sizeof(float) * m * h), *qkv = malloc(sizeof(float) * m * qkv_n);
    float *attn = malloc(sizeof(float) * m * hq * hd), *gu = malloc(sizeof(float) * m * 2 * in);
    float *act = malloc(sizeof(float) * m * in), *o = malloc(sizeof(float) * m * h);
    int rc = -1;
    if (!normed || !qkv || !attn || !gu || !act || !o) goto done;

    for (int64_t t = 0; t < m; t++) {
        float *res = residual + t * h, *hid = hidden + t * h;
        for (int64_t i = 0; i < h; i++) res[i] = first ? hid[i] : hid[i] + res[i];
        ab_rmsnorm(res, L->ln1, h, d->eps, normed + t * h);
    }
    if ((rc = ab_linear(&L->qkv, normed, m, qkv, threads))) goto done;
    for (int64_t t = 0; t < m; t++) {
        float *row = qkv + t * qkv_n;
        const float *c = d->cos + positions[t] * hd, *s = d->sin + positions[t] * hd;
        if (L->qkv_bias)
            for (int64_t i = 0; i < qkv_n; i++) row[i] += L->qkv_bias[i];
        if (L->q_norm) /* in place: rmsnorm reads a head's sum of squares before it writes */
            for (int64_t head = 0; head < hq + hkv; head++)
                ab_rmsnorm(row + head * hd, head < hq ? L->q_norm : L->k_norm, hd, d->eps, row + head * hd);
        for (int64_t head = 0; head < hq + hkv; head++) ab_rope(row + head * hd, c, s, hd, row + head * hd); /* q and k heads */
        if (slots[t] >= 0) {
            ab_store_kv(L->k_cache, (int)L->kv_f16, slots[t] * hkv * hd, row + hq * hd, hkv * hd);
            ab_store_kv(L->v_cache, (int)L->kv_f16, slots[t] * hkv * hd, row + (hq + hkv) * hd, hkv * hd);
        }
    }
    if ((rc = attention(L, d, qkv, m, page_table, pt_stride, page_size, kv_lens, attn, threads))) goto done;
    if ((rc = ab_linear(&L->o, attn, m, o, threads))) goto done;
    for (int64_t t = 0; t < m; t++) {
        float *res = residual + t * h;
        for (int64_t i = 0; i < h; i++) res[i] += o[t * h + i];
        ab_rmsnorm(res, L->ln2, h, d->eps, normed + t * h);
    }
    if (L->moe) {
        double seconds = 0.0;
        rc = ab_moe(L->moe, normed, m, h, hidden, &seconds, threads);
        if (L->moe_seconds) *L->moe_seconds += seconds;
        goto done;
    }
    if ((rc = ab_linear(&L->gate_up, normed, m, gu, threads))) goto done;
    for (int64_t t = 0; t < m; t++) ab_silu_mul(gu + t * 2 * in, in, act + t * in);
    rc = ab_linear(&L->down, act, m, hidden, threads);
done:
    free(normed);
    free(qkv);
    free(attn);
    free(gu);
    free(act);
    free(o);
    return rc;
}
