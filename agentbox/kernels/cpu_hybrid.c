/* One decoder layer of a Qwen3.5 / Qwen3.6 hybrid's decode step in one call (CPU, fp32 activations, fp16 weights
 * read as fp16): a Gated DeltaNet layer or a gated attention layer, then the SiLU MLP. The torch layers
 * (models/qwen3_5.py, layers/gated_deltanet.py, layers/delta_rule.py) are the reference; engine/exec/cpu_hybrid.py
 * wires it and tests/test_cpu_hybrid.py compares the two.
 *
 * Eager PyTorch spends ~40 small ops on a delta-net layer's decode (the conv's concat and sum, two l2 norms, the
 * decay and beta, the state's decay / read / write / read, the gated norm): at hidden 512 their dispatch costs more
 * than the layer's matmuls. The weights stay fp16 as the GGUF stores them (half the bytes a decode step streams);
 * F16C widens 8 of them at a time inside the dot product.
 *
 * A row is a token; a sequence's rows (a decode's one, a verify's 1 + k, a short extend's few) run in order over its
 * state (hstep_t), and attend up to their own positions as in cpu_decode.c.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_gemv.h" /* exp8 */

/* cpu_decode.c's paged attention over a sequence's pages (q | k | v rows of (heads + 2 kv_heads) * head_dim), and its
 * KV store (fp32, or fp16 rounded to nearest even) */
void ab_store_kv(void *cache, int f16, int64_t at, const float *src, int64_t n);
int ab_attend(void *k_cache, void *v_cache, int kv_f16, int64_t heads, int64_t kv_heads, int64_t head_dim, float scale,
              const float *qkv, int64_t m, const int32_t *page_table, int64_t pt_stride, int64_t page_size,
              const int64_t *kv_lens, float *attn, int threads);

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* Eight 16-bit weights widened to fp32: fp16 by F16C; bf16 is fp32's top half, so a shift (both exact). */
static inline __m256 f16x8(const uint16_t *w) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)w)); }
static inline __m256 bf16x8(const uint16_t *w) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)w)), 16));
}

/* out[t][j] = x[t] . w[j] for m rows of x [m][k] (fp32) and one row j of w [n][k] (fp16, or bf16: a function each,
 * one macro); k a multiple of 16. A weight row a pass, read front to back, so a matrix whose rows run in order is one
 * sequential stream (four rows read side by side, four streams 1-3 KB apart, left the hardware prefetcher behind:
 * 6.5-7 GB/s of weights on one core against 9-13 this way, on the shared AMD EPYC); every activation row of the step
 * reads the row while it sits in L1, four at a time. */
#define HALF_ROW(NAME, WIDEN)                                                                                     \
static inline void NAME(const float *x, int64_t m, int64_t k, const uint16_t *wr, int64_t n, float *out,         \
                        int64_t j) {                                                                              \
    _mm_prefetch((const char *)(wr + 8 * k), _MM_HINT_T0); /* a few rows on: the stream's next pages */           \
    if (m == 1) { /* a decode step's one sequence: four chains over the row */                                    \
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;                                               \
        int64_t i = 0;                                                                                            \
        for (; i + 32 <= k; i += 32) {                                                                            \
            a0 = _mm256_fmadd_ps(WIDEN(wr + i), _mm256_loadu_ps(x + i), a0);                                      \
            a1 = _mm256_fmadd_ps(WIDEN(wr + i + 8), _mm256_loadu_ps(x + i + 8), a1);                              \
            a2 = _mm256_fmadd_ps(WIDEN(wr + i + 16), _mm256_loadu_ps(x + i + 16), a2);                            \
            a3 = _mm256_fmadd_ps(WIDEN(wr + i + 24), _mm256_loadu_ps(x + i + 24), a3);                            \
        }                                                                                                         \
        for (; i < k; i += 16) {                                                                                  \
            a0 = _mm256_fmadd_ps(WIDEN(wr + i), _mm256_loadu_ps(x + i), a0);                                      \
            a1 = _mm256_fmadd_ps(WIDEN(wr + i + 8), _mm256_loadu_ps(x + i + 8), a1);                              \
        }                                                                                                         \
        out[j] = hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));                              \
        return;                                                                                                   \
    }                                                                                                             \
    for (int64_t t = 0; t < m; t += 4) { /* four activation rows (the last repeated), two chains each */          \
        const float *xs[4];                                                                                       \
        for (int r = 0; r < 4; r++) xs[r] = x + (t + r < m ? t + r : t) * k;                                      \
        __m256 a[8];                                                                                              \
        for (int r = 0; r < 8; r++) a[r] = _mm256_setzero_ps();                                                   \
        for (int64_t i = 0; i < k; i += 16) {                                                                     \
            const __m256 u = WIDEN(wr + i), v = WIDEN(wr + i + 8);                                                \
            for (int r = 0; r < 4; r++) {                                                                         \
                a[r] = _mm256_fmadd_ps(u, _mm256_loadu_ps(xs[r] + i), a[r]);                                      \
                a[4 + r] = _mm256_fmadd_ps(v, _mm256_loadu_ps(xs[r] + i + 8), a[4 + r]);                          \
            }                                                                                                     \
        }                                                                                                         \
        for (int r = 0; r < 4 && t + r < m; r++) out[(t + r) * n + j] = hsum8(_mm256_add_ps(a[r], a[4 + r]));     \
    }                                                                                                             \
}

HALF_ROW(f16_row, f16x8)
HALF_ROW(bf16_row, bf16x8)

#define HALF_MATMUL(NAME, ROW)                                                                                    \
int NAME(const float *x, int64_t m, int64_t k, const uint16_t *w, int64_t n, float *out, int threads) {           \
    if (k % 16) return -2;                                                                                        \
    _Pragma("omp parallel for schedule(static) num_threads(threads) if (threads > 1)")                            \
    for (int64_t j = 0; j < n; j++) ROW(x, m, k, w + j * k, n, out, j);                                           \
    return 0;                                                                                                     \
}

HALF_MATMUL(ab_f16_matmul, f16_row)
HALF_MATMUL(ab_bf16_matmul, bf16_row)

typedef struct {
    const uint16_t *w; /* [n][k] fp16, or bf16 when bf16 is set */
    int64_t n, k, bf16;
} f16w_t;

/* The layer's weights; norms are the zero-centred checkpoints' 1 + w, widened at plan time. */
typedef struct {
    f16w_t in_qkv, in_z, in_b, in_a, out;  /* delta net (in_qkv: [q | k | v] of every head) */
    f16w_t qkv, o;                          /* gated attention (qkv: [q | gate] per head, then k, then v) */
    f16w_t gate_up, down;
    const float *ln1, *ln2;                 /* [H], 1 + w */
    const float *conv_w;                    /* [C][K] */
    const float *a_log, *dt_bias;           /* [Hv] */
    const float *gdn_norm;                  /* [Dv]: the gated norm's weight as stored (not zero-centred) */
    float *conv_state, *matrix;             /* [slots][C][K-1], [slots][Hv][Dk][Dv] */
    const float *q_norm, *k_norm;           /* [D], 1 + w */
    void *k_cache, *v_cache;                /* [slots][Hkv][D]: fp32, or fp16 (kv_f16) */
    int64_t linear;                         /* 1: a delta-net layer; 0: gated attention */
    int64_t kv_f16;
} hlayer_t;

typedef struct {
    int64_t hidden, inter;
    int64_t hk, hv, dk, dv, kernel;         /* delta net */
    int64_t heads, kv_heads, head_dim, rotary_dim;
    const float *cos, *sin;                 /* [positions][rotary_dim], cat(freqs, freqs) */
    float eps, scale;
} hdims_t;

/* The step's rows: a sequence's rows are consecutive (a decode's one, a verify's 1 + k, a short extend's few) and run
 * in order. A row reads and writes its sequence's state slot in place, or (work >= 0: a verify, whose slot must wait
 * for the sampler) working copies this call's caller allocated, seeded from the slot at the sequence's first row; the
 * verify's per-position inputs go to the stash buffers (NULL when no sequence of the step is a verify). */
typedef struct {
    const int64_t *positions, *state_slots, *work, *kv_slots, *kv_lens; /* [m] */
    const int32_t *page_table;                                          /* [m][pt_stride]: each row its sequence's */
    int64_t pt_stride, page_size;
    float *conv_work, *matrix_work;            /* [verifies][C][K-1], [verifies][Hv][Dk][Dv] */
    float *stash_x, *stash_k, *stash_v, *stash_g, *stash_b; /* [m][C], [m][Hk Dk], [m][Hv Dv], [m][Hv], [m][Hv] */
} hstep_t;

static int mm(const f16w_t *w, const float *x, int64_t m, float *out, int threads) {
    return (w->bf16 ? ab_bf16_matmul : ab_f16_matmul)(x, m, w->k, w->w, w->n, out, threads);
}

/* Several weights that read the same x [m][k], in one parallel pass over all their rows (a delta-net layer's four
 * in-projections, two of them 8 rows: alone each would cost a fork and a barrier of the threads); each output
 * element is computed as mm computes it, so the bits are the same. */
#define MM_MANY 4
static int mm_many(const f16w_t *const *ws, float *const *outs, int count, const float *x, int64_t m, int threads) {
    int64_t start[MM_MANY + 1] = {0};
    if (count > MM_MANY) return -2;
    for (int c = 0; c < count; c++) {
        if (ws[c]->k % 16 || ws[c]->k != ws[0]->k) return -2;
        start[c + 1] = start[c] + ws[c]->n;
    }
    _Pragma("omp parallel for schedule(static) num_threads(threads) if (threads > 1)")
    for (int64_t r = 0; r < start[count]; r++) {
        int c = 0;
        while (r >= start[c + 1]) c++;
        const f16w_t *w = ws[c];
        const int64_t j = r - start[c];
        (w->bf16 ? bf16_row : f16_row)(x, m, w->k, w->w + j * w->k, w->n, outs[c], j);
    }
    return 0;
}

static inline float silu(float x) { return x / (1.0f + expf(-x)); }
static inline float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
static inline float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); } /* torch's threshold */

/* x * rsqrt(sum x^2 + 1e-6) (delta_rule.l2norm), times `mul` */
static void l2norm(float *x, int64_t d, float mul) {
    float ss = 0.0f;
    for (int64_t i = 0; i < d; i++) ss += x[i] * x[i];
    const float r = mul / sqrtf(ss + 1e-6f);
    for (int64_t i = 0; i < d; i++) x[i] *= r;
}

/* One token of one value head: S = exp(g) S; S += k (beta (v - S^T k))^T; o = S^T q. S [dk][dv] in place. Columns
 * are independent (column j's prediction and write touch only column j), so 32 of them at a time run both passes
 * while their [dk][32] block sits in L1, the prediction and output held in registers; each element takes the same
 * operations in the same order as the scalar tail (multiply, then add: the build does not contract them), so the
 * bits do not depend on how many columns a pass holds or on the ISA build. */
static void delta_step(float *restrict S, const float *restrict q, const float *restrict k, const float *restrict v,
                       float g, float beta, int64_t dk, int64_t dv, float *restrict pred, float *restrict o) {
    const float decay = expf(g);
    const __m256 dec = _mm256_set1_ps(decay), bt = _mm256_set1_ps(beta);
    int64_t j0 = 0;
    for (; j0 + 32 <= dv; j0 += 32) {
        __m256 p[4], acc[4];
        for (int u = 0; u < 4; u++) p[u] = _mm256_setzero_ps(), acc[u] = _mm256_setzero_ps();
        for (int64_t i = 0; i < dk; i++) {
            float *row = S + i * dv + j0;
            const __m256 ki = _mm256_set1_ps(k[i]);
            for (int u = 0; u < 4; u++) {
                const __m256 r = _mm256_mul_ps(_mm256_loadu_ps(row + 8 * u), dec);
                _mm256_storeu_ps(row + 8 * u, r);
                p[u] = _mm256_add_ps(p[u], _mm256_mul_ps(r, ki));
            }
        }
        for (int u = 0; u < 4; u++) p[u] = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(v + j0 + 8 * u), p[u]), bt);
        for (int64_t i = 0; i < dk; i++) {
            float *row = S + i * dv + j0;
            const __m256 ki = _mm256_set1_ps(k[i]), qi = _mm256_set1_ps(q[i]);
            for (int u = 0; u < 4; u++) {
                const __m256 r = _mm256_add_ps(_mm256_loadu_ps(row + 8 * u), _mm256_mul_ps(ki, p[u]));
                _mm256_storeu_ps(row + 8 * u, r);
                acc[u] = _mm256_add_ps(acc[u], _mm256_mul_ps(r, qi));
            }
        }
        for (int u = 0; u < 4; u++) _mm256_storeu_ps(o + j0 + 8 * u, acc[u]);
    }
    if (j0 == dv) return;
    for (int64_t j = j0; j < dv; j++) pred[j] = 0.0f, o[j] = 0.0f;
    for (int64_t i = 0; i < dk; i++) {
        float *row = S + i * dv;
        for (int64_t j = j0; j < dv; j++) {
            row[j] *= decay;
            pred[j] += row[j] * k[i];
        }
    }
    for (int64_t j = j0; j < dv; j++) pred[j] = (v[j] - pred[j]) * beta;
    for (int64_t i = 0; i < dk; i++) {
        float *row = S + i * dv;
        for (int64_t j = j0; j < dv; j++) {
            row[j] += k[i] * pred[j];
            o[j] += row[j] * q[i];
        }
    }
}

/* The gated delta rule over `len` tokens of each of `bh` (sequence, value head) pairs, token by token as a decode
 * step runs it (delta_step): q, k [bh][len][dk] (l2-normalised, q scaled), v [bh][len][dv], g, beta [bh][len],
 * state [bh][dk][dv] (read, and left holding the final state), out [bh][len][dv]. delta_rule_backends.py's CPU
 * backend runs prefill chunks through it: on the CPU the chunked form's matmuls are small and its temporaries large
 * (a 2,048-token prompt of 8 heads of 64 x 64: ~90 ms a layer in torch), while the recurrent form keeps each head's
 * 16 KB state in L1 and costs the same per token at any length. Pairs run in parallel; each pair's bits depend on
 * nothing else, and a prompt split anywhere gives the same bits as whole. */
int ab_delta_rule(const float *q, const float *k, const float *v, const float *g, const float *beta, float *state,
                  float *out, int64_t bh, int64_t len, int64_t dk, int64_t dv, int threads) {
    if (dv > 512) return -2;
    _Pragma("omp parallel for schedule(static) num_threads(threads) if (threads > 1 && bh > 1)")
    for (int64_t p = 0; p < bh; p++) {
        float pred[512];
        for (int64_t t = 0; t < len; t++) {
            const int64_t at = p * len + t;
            delta_step(state + p * dk * dv, q + at * dk, k + at * dk, v + at * dv, g[at], beta[at], dk, dv, pred,
                       out + at * dv);
        }
    }
    return 0;
}

/* One sequence's prefill chunk through a delta-net layer's mixer, between its in-projections and its gated norm (the
 * torch layer's causal_conv, _heads, prepare_qk, beta / decay and the delta rule, whose temporaries and small ops
 * cost more than the arithmetic on the CPU): the short causal conv over [conv_state | x] (each output summed in the
 * decode step's order, 8 channels a vector) and its SiLU (cpu_gemv.h's exp8), the l2 norms of q (times Dk^-1/2) and
 * k, sigmoid(b) and -exp(A_log) softplus(a + dt_bias), then each value head's delta rule over its state, token by
 * token (delta_step). mixed [len][C] (q | k | v of every head), b, a [len][Hv]; conv_w [C][K]; conv_state [C][K-1]
 * and S [Hv][Dk][Dv] are read and left holding the chunk's end; out [len][Hv][Dv]. Rows, then heads, run in
 * parallel. */
int ab_delta_net_chunk(const float *mixed, const float *b, const float *a, int64_t len, int64_t c, const float *conv_w,
                       int64_t kk, float *conv_state, const float *a_log, const float *dt_bias, int64_t hk, int64_t hv,
                       int64_t dk, int64_t dv, float *S, float *out, int threads) {
    const int64_t kd = hk * dk, r = hv / hk;
    if (kk < 2 || kk > 8 || dv > 512 || c % 8 || c != 2 * kd + hv * dv || hv % hk) return -2;
    /* the conv's taps and the state transposed ([K][C], [K-1][C]): each tap a contiguous row the channels vectorise over */
    float *y = malloc(sizeof(float) * len * c), *g = malloc(sizeof(float) * len * hv);
    float *beta = malloc(sizeof(float) * len * hv), *wt = malloc(sizeof(float) * kk * c);
    float *hist = malloc(sizeof(float) * (kk - 1) * c);
    if (!y || !g || !beta || !wt || !hist) {
        free(y), free(g), free(beta), free(wt), free(hist);
        return -1;
    }
    for (int64_t ch = 0; ch < c; ch++) {
        for (int64_t j = 0; j < kk; j++) wt[j * c + ch] = conv_w[ch * kk + j];
        for (int64_t j = 0; j + 1 < kk; j++) hist[j * c + ch] = conv_state[ch * (kk - 1) + j];
    }
    _Pragma("omp parallel num_threads(threads) if (threads > 1)")
    {
        _Pragma("omp for schedule(static)")
        for (int64_t t = 0; t < len; t++) {
            float *yt = y + t * c;
            const float *in[8]; /* input t - (K-1) + j: the state's row for a tap before the chunk, else x's */
            for (int64_t j = 0; j < kk; j++) {
                const int64_t at = t - (kk - 1) + j;
                in[j] = at < 0 ? hist + (kk - 1 + at) * c : mixed + at * c;
            }
            for (int64_t ch = 0; ch < c; ch += 8) { /* summed in the decode step's order, then SiLU */
                __m256 acc = _mm256_setzero_ps();
                for (int64_t j = 0; j < kk; j++)
                    acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_loadu_ps(in[j] + ch), _mm256_loadu_ps(wt + j * c + ch)));
                const __m256 den = _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), acc)));
                _mm256_storeu_ps(yt + ch, _mm256_div_ps(acc, den));
            }
            for (int64_t h = 0; h < hk; h++) {
                l2norm(yt + h * dk, dk, 1.0f / sqrtf((float)dk));
                l2norm(yt + kd + h * dk, dk, 1.0f);
            }
            for (int64_t h = 0; h < hv; h++) {
                beta[t * hv + h] = sigmoid(b[t * hv + h]);
                g[t * hv + h] = -expf(a_log[h]) * softplus(a[t * hv + h] + dt_bias[h]);
            }
        }
        _Pragma("omp for schedule(static)")
        for (int64_t h = 0; h < hv; h++) {
            float pred[512];
            for (int64_t t = 0; t < len; t++) {
                const float *yt = y + t * c;
                delta_step(S + h * dk * dv, yt + (h / r) * dk, yt + kd + (h / r) * dk, yt + 2 * kd + h * dv,
                           g[t * hv + h], beta[t * hv + h], dk, dv, pred, out + (t * hv + h) * dv);
            }
        }
    }
    for (int64_t ch = 0; ch < c; ch++) /* the state: the last K-1 inputs, older ones from the state itself */
        for (int64_t j = 0; j + 1 < kk; j++) {
            const int64_t at = len - (kk - 1) + j;
            conv_state[ch * (kk - 1) + j] = at < 0 ? hist[(kk - 1 + at) * c + ch] : mixed[at * c + ch];
        }
    free(y), free(g), free(beta), free(wt), free(hist);
    return 0;
}

/* the delta-net mixer for m rows (normed [m][H]) into out [m][Hv * Dv] (before out_proj) */
static int delta_net(const hlayer_t *L, const hdims_t *d, const hstep_t *st, const float *normed, int64_t m,
                     float *out, int threads) {
    const int64_t kd = d->hk * d->dk, vd = d->hv * d->dv, c = 2 * kd + vd, kk = d->kernel, r = d->hv / d->hk;
    const int64_t conv_n = c * (kk - 1), mat_n = d->hv * d->dk * d->dv;
    float *mixed = malloc(sizeof(float) * m * c), *z = malloc(sizeof(float) * m * vd);
    float *b = malloc(sizeof(float) * m * d->hv), *a = malloc(sizeof(float) * m * d->hv);
    float *scratch = malloc(sizeof(float) * 2 * d->dv);
    int rc = -1;
    if (!mixed || !z || !b || !a || !scratch) goto done;
    const f16w_t *ins[MM_MANY] = {&L->in_qkv, &L->in_z, &L->in_b, &L->in_a};
    float *const in_outs[MM_MANY] = {mixed, z, b, a};
    if ((rc = mm_many(ins, in_outs, MM_MANY, normed, m, threads))) goto done;
    for (int64_t t = 0; t < m; t++) { /* in order: a sequence's rows each read the state the row before left */
        float *x = mixed + t * c, *conv = L->conv_state + st->state_slots[t] * conv_n;
        float *S = L->matrix + st->state_slots[t] * mat_n;
        const int64_t w = st->work[t];
        if (w >= 0) {
            float *cw = st->conv_work + w * conv_n, *mw = st->matrix_work + w * mat_n;
            if (t == 0 || st->work[t - 1] != w) { /* the verify's first row: its working state from the slot */
                memcpy(cw, conv, sizeof(float) * conv_n);
                memcpy(mw, S, sizeof(float) * mat_n);
            }
            conv = cw, S = mw;
        }
        if (st->stash_x) memcpy(st->stash_x + t * c, x, sizeof(float) * c); /* the conv's inputs, for the commit */
        for (int64_t ch = 0; ch < c; ch++) { /* causal_conv_step: sum over [state | x] in order, then SiLU */
            const float *wc = L->conv_w + ch * kk;
            float *cs = conv + ch * (kk - 1), acc = 0.0f;
            for (int64_t j = 0; j < kk - 1; j++) acc += cs[j] * wc[j];
            acc += x[ch] * wc[kk - 1];
            for (int64_t j = 0; j + 1 < kk - 1; j++) cs[j] = cs[j + 1];
            cs[kk - 2] = x[ch];
            x[ch] = silu(acc);
        }
        for (int64_t h = 0; h < d->hk; h++) {
            l2norm(x + h * d->dk, d->dk, 1.0f / sqrtf((float)d->dk));
            l2norm(x + kd + h * d->dk, d->dk, 1.0f);
        }
        if (st->stash_k) {
            memcpy(st->stash_k + t * kd, x + kd, sizeof(float) * kd);
            memcpy(st->stash_v + t * vd, x + 2 * kd, sizeof(float) * vd);
        }
        for (int64_t h = 0; h < d->hv; h++) { /* value head h reads key head h / r */
            const float beta = sigmoid(b[t * d->hv + h]);
            const float g = -expf(L->a_log[h]) * softplus(a[t * d->hv + h] + L->dt_bias[h]);
            if (st->stash_g) st->stash_g[t * d->hv + h] = g, st->stash_b[t * d->hv + h] = beta;
            float *o = out + t * vd + h * d->dv;
            delta_step(S + h * d->dk * d->dv, x + (h / r) * d->dk, x + kd + (h / r) * d->dk, x + 2 * kd + h * d->dv,
                       g, beta, d->dk, d->dv, scratch, o);
            const float *zh = z + t * vd + h * d->dv; /* GatedRMSNorm: w * rmsnorm(o) * silu(z) */
            float ss = 0.0f;
            for (int64_t j = 0; j < d->dv; j++) ss += o[j] * o[j];
            const float rs = 1.0f / sqrtf(ss / (float)d->dv + d->eps);
            for (int64_t j = 0; j < d->dv; j++) o[j] = L->gdn_norm[j] * (o[j] * rs) * silu(zh[j]);
        }
    }
done:
    free(mixed), free(z), free(b), free(a), free(scratch);
    return rc;
}

/* the gated attention mixer: out [m][Hq * D] (attention times sigmoid of its gate, before o_proj) */
static int gated_attention(const hlayer_t *L, const hdims_t *d, const hstep_t *st, const float *normed, int64_t m,
                           float *out, int threads) {
    const int64_t *positions = st->positions, *kv_slots = st->kv_slots;
    const int64_t hq = d->heads, hkv = d->kv_heads, hd = d->head_dim, rd = d->rotary_dim;
    const int64_t raw_n = (2 * hq + 2 * hkv) * hd, qkv_n = (hq + 2 * hkv) * hd;
    float *raw = malloc(sizeof(float) * m * raw_n), *qkv = malloc(sizeof(float) * m * qkv_n);
    int rc = -1;
    if (!raw || !qkv) goto done;
    if ((rc = mm(&L->qkv, normed, m, raw, threads))) goto done;
    for (int64_t t = 0; t < m; t++) {
        const float *src = raw + t * raw_n;
        float *row = qkv + t * qkv_n;
        const float *c = d->cos + positions[t] * rd, *s = d->sin + positions[t] * rd;
        for (int64_t h = 0; h < hq; h++) ab_rmsnorm(src + 2 * h * hd, L->q_norm, hd, d->eps, row + h * hd);
        for (int64_t h = 0; h < hkv; h++)
            ab_rmsnorm(src + 2 * hq * hd + h * hd, L->k_norm, hd, d->eps, row + (hq + h) * hd);
        memcpy(row + (hq + hkv) * hd, src + (2 * hq + hkv) * hd, sizeof(float) * hkv * hd);
        for (int64_t h = 0; h < hq + hkv; h++) ab_rope(row + h * hd, c, s, rd, row + h * hd); /* the first rd channels of a head */
        if (kv_slots[t] >= 0) {
            ab_store_kv(L->k_cache, (int)L->kv_f16, kv_slots[t] * hkv * hd, row + hq * hd, hkv * hd);
            ab_store_kv(L->v_cache, (int)L->kv_f16, kv_slots[t] * hkv * hd, row + (hq + hkv) * hd, hkv * hd);
        }
    }
    rc = ab_attend(L->k_cache, L->v_cache, (int)L->kv_f16, hq, hkv, hd, d->scale, qkv, m, st->page_table, st->pt_stride, st->page_size,
                   st->kv_lens, out, threads);
    if (rc) goto done;
    for (int64_t t = 0; t < m; t++)
        for (int64_t h = 0; h < hq; h++) {
            const float *gate = raw + t * raw_n + (2 * h + 1) * hd;
            float *o = out + t * hq * hd + h * hd;
            for (int64_t j = 0; j < hd; j++) o[j] *= sigmoid(gate[j]);
        }
done:
    free(raw), free(qkv);
    return rc;
}

/* hidden / residual as models/qwen3_5.py's HybridDecoderLayer leaves them (first: residual = hidden) */
int ab_hybrid_layer(const hlayer_t *L, const hdims_t *d, const hstep_t *st, float *hidden, float *residual, int first,
                    int64_t m, int threads) {
    const int64_t h = d->hidden, in = d->inter;
    const int64_t mix = L->linear ? d->hv * d->dv : d->heads * d->head_dim;
    float *normed = malloc(sizeof(float) * m * h), *mixed = malloc(sizeof(float) * m * mix);
    float *o = malloc(sizeof(float) * m * h), *gu = malloc(sizeof(float) * m * 2 * in);
    int rc = -1;
    if (!normed || !mixed || !o || !gu) goto done;
    for (int64_t t = 0; t < m; t++) {
        float *res = residual + t * h, *hid = hidden + t * h;
        for (int64_t i = 0; i < h; i++) res[i] = first ? hid[i] : hid[i] + res[i];
        ab_rmsnorm(res, L->ln1, h, d->eps, normed + t * h);
    }
    rc = L->linear ? delta_net(L, d, st, normed, m, mixed, threads) : gated_attention(L, d, st, normed, m, mixed, threads);
    if (rc || (rc = mm(L->linear ? &L->out : &L->o, mixed, m, o, threads))) goto done;
    for (int64_t t = 0; t < m; t++) {
        float *res = residual + t * h;
        for (int64_t i = 0; i < h; i++) res[i] += o[t * h + i];
        ab_rmsnorm(res, L->ln2, h, d->eps, normed + t * h);
    }
    if ((rc = mm(&L->gate_up, normed, m, gu, threads))) goto done;
    for (int64_t t = 0; t < m; t++) { /* SiLU(gate) * up, into the gate half (down reads [m][in] rows of it) */
        float *g = gu + t * 2 * in;
        for (int64_t i = 0; i < in; i++) gu[t * in + i] = silu(g[i]) * g[in + i];
    }
    rc = mm(&L->down, gu, m, hidden, threads);
done:
    free(normed), free(mixed), free(o), free(gu);
    return rc;
}
