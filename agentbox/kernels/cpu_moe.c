/* What cpu_decode.c's layer takes beyond one 4-bit kernel: a linear in either CPU form (ab_linear: cpu_gemv.c's 4-bit
 * tiles or cpu_bits.c's k-bit rows, or runs of both, as GGUF's Q4_K_M qkv has them), and Qwen3-MoE's routed experts
 * (ab_moe) in place of the dense MLP.
 *
 * The experts are layers/experts/cpu.py's run_routed in one call: the router's logits (fp32), softmax over every
 * expert, the top k (renormalised where the model says), then each routed expert, in expert order, over the rows
 * routed to it: gate_up, SiLU-and-mul, down, and each row's output adds the expert's times its weight. A row's sums
 * are those of a one-row step (the kernels' rows do not depend on how many share a call, and each row adds its
 * experts in the same order), as the torch loop's are. In the torch layers a decode step spent ~60 us a routed
 * expert outside the kernels (Python, op dispatch, the router's softmax and top-k): with 8 experts a token and a
 * 2-layer Qwen3-30B-A3B file that was 1.4 ms of a 25 ms step.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cpu_gemv.h"

static int part_matmul(const ab_part_t *p, const float *x, int64_t m, float *out, int threads, int tiles) {
    if (p->bits == 4)
        return ab_q4_matmul(x, m, p->k, (const uint8_t *)p->w, p->so, p->n, p->group, out, threads, (int)p->half, tiles);
    return ab_bits_matmul(x, m, (const uint8_t *)p->w, (int)p->bits, (int)p->group, (int)p->form, (int)p->off, p->k,
                          p->n, out, threads, tiles);
}

int ab_linear(const ab_linear_t *l, const float *x, int64_t m, float *out, int threads) {
    if (l->parts == 1) return part_matmul(&l->part[0], x, m, out, threads, 0);
    if (l->parts < 1 || l->parts > AB_PARTS) return -2;
    int64_t n = 0, widest = 0;
    for (int64_t i = 0; i < l->parts; i++) {
        n += l->part[i].n;
        widest = l->part[i].n > widest ? l->part[i].n : widest;
    }
    float *tmp = m > 1 ? malloc(sizeof(float) * m * widest) : NULL;
    if (m > 1 && !tmp) return -1;
    int rc = 0;
    for (int64_t i = 0, col = 0; i < l->parts && !rc; col += l->part[i].n, i++) {
        const int64_t pn = l->part[i].n;
        if (m == 1) { /* one row: the run's columns are contiguous in it */
            rc = part_matmul(&l->part[i], x, 1, out + col, threads, 0);
            continue;
        }
        if ((rc = part_matmul(&l->part[i], x, m, tmp, threads, 0))) break;
        for (int64_t t = 0; t < m; t++) memcpy(out + t * n + col, tmp + t * pn, sizeof(float) * pn);
    }
    free(tmp);
    return rc;
}

static ab_part_t expert(const ab_part_t *p, int64_t e, int64_t stride, int64_t so_stride) {
    ab_part_t q = *p;
    q.w = (const uint8_t *)p->w + e * stride;
    if (p->so) q.so = (const uint8_t *)p->so + e * so_stride;
    return q;
}

/* x . w over h: eight lanes, then one horizontal sum */
static float dot(const float *x, const float *w, int64_t h) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0;
    int64_t i = 0;
    for (; i + 16 <= h; i += 16) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(w + i), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 8), _mm256_loadu_ps(w + i + 8), a1);
    }
    a0 = _mm256_add_ps(a0, a1);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a0), _mm256_extractf128_ps(a0, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    float r = _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
    for (; i < h; i++) r += x[i] * w[i];
    return r;
}

/* Row t's routing: its top k experts (ids ascending) and their weights, as layers/experts/routing.py's select_experts
 * (softmax in fp32, the k largest, first index first among equals; renormalised to sum to one). */
static void route(const ab_moe_t *e, const float *x, int64_t h, int64_t *ids, float *weights, float *probs) {
    const int64_t n = e->experts, k = e->top_k;
    float top = -INFINITY, sum = 0.0f;
    for (int64_t j = 0; j < n; j++) {
        probs[j] = dot(x, e->router + j * h, h);
        top = probs[j] > top ? probs[j] : top;
    }
    for (int64_t j = 0; j < n; j++) sum += (probs[j] = expf(probs[j] - top));
    for (int64_t j = 0; j < n; j++) probs[j] /= sum;
    float chosen = 0.0f;
    for (int64_t c = 0; c < k; c++) {
        int64_t best = -1;
        for (int64_t j = 0; j < n; j++)
            if (probs[j] >= 0.0f && (best < 0 || probs[j] > probs[best])) best = j;
        ids[c] = best;
        weights[c] = probs[best];
        chosen += probs[best];
        probs[best] = -1.0f; /* taken */
    }
    if (e->renorm)
        for (int64_t c = 0; c < k; c++) weights[c] /= chosen;
    for (int64_t a = 1; a < k; a++) /* ascending ids: the order run_routed adds the experts in */
        for (int64_t b = a; b > 0 && ids[b] < ids[b - 1]; b--) {
            const int64_t i = ids[b];
            const float w = weights[b];
            ids[b] = ids[b - 1], weights[b] = weights[b - 1];
            ids[b - 1] = i, weights[b - 1] = w;
        }
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Each routed expert, in expert order, over its rows (ids [m][k], weights [m][k]): gate_up, SiLU-and-mul, down, and
 * each row's output adds the expert's times its weight. Many rows gather, activate and add in parallel (a row is routed
 * to an expert once, so an expert's rows are distinct outputs); tiles: the products may take AMX tiles (prefill). */
static int run_experts(const ab_moe_t *e, const float *x, int64_t m, int64_t h, const int64_t *ids,
                       const float *weights, float *out, int threads, int tiles) {
    const int64_t k = e->top_k, in = e->inter, n = e->experts;
    int64_t *start = calloc((size_t)(n + 1), sizeof(int64_t)), *rows = malloc(sizeof(int64_t) * m * k);
    float *ws = malloc(sizeof(float) * m * k), *xs = m > 1 ? malloc(sizeof(float) * m * h) : NULL;
    float *gu = malloc(sizeof(float) * m * 2 * in), *act = malloc(sizeof(float) * m * in);
    float *y = malloc(sizeof(float) * m * h);
    int rc = -1;
    if (!start || !rows || !ws || (m > 1 && !xs) || !gu || !act || !y) goto done;
    rc = -2;
    for (int64_t i = 0; i < m * k; i++) {
        if (ids[i] < 0 || ids[i] >= n) goto done;
        start[ids[i] + 1]++;
    }
    for (int64_t ex = 0; ex < n; ex++) start[ex + 1] += start[ex];
    for (int64_t i = 0; i < m * k; i++) { /* each expert's rows in token order: a counting sort */
        const int64_t at = start[ids[i]]++;
        rows[at] = i / k, ws[at] = weights[i];
    }
    for (int64_t ex = n; ex > 0; ex--) start[ex] = start[ex - 1];
    start[0] = 0;
    memset(out, 0, sizeof(float) * m * h);
    rc = 0;
    for (int64_t ex = 0; ex < n && !rc; ex++) {
        const int64_t r = start[ex + 1] - start[ex], *rw = rows + start[ex];
        const float *wr = ws + start[ex];
        if (!r) continue;
        const int par = threads > 1 && r >= 16;
        const float *xe = x;
        if (m > 1) { /* the rows routed here, gathered (a one-row step reads x in place) */
#pragma omp parallel for schedule(static) num_threads(threads) if (par)
            for (int64_t i = 0; i < r; i++) memcpy(xs + i * h, x + rw[i] * h, sizeof(float) * h);
            xe = xs;
        }
        const ab_part_t w13 = expert(&e->w13, ex, e->w13_stride, e->w13_so_stride);
        const ab_part_t w2 = expert(&e->w2, ex, e->w2_stride, e->w2_so_stride);
        if ((rc = part_matmul(&w13, xe, r, gu, threads, tiles))) break;
#pragma omp parallel for schedule(static) num_threads(threads) if (par)
        for (int64_t i = 0; i < r; i++) ab_silu_mul(gu + i * 2 * in, in, act + i * in);
        if ((rc = part_matmul(&w2, act, r, y, threads, tiles))) break;
#pragma omp parallel for schedule(static) num_threads(threads) if (par)
        for (int64_t i = 0; i < r; i++) { /* y * w, then the add: the torch loop's two roundings */
            float *o = out + rw[i] * h;
            const float *yi = y + i * h, w = wr[i];
            for (int64_t j = 0; j < h; j++) o[j] += yi[j] * w;
        }
    }
done:
    free(start);
    free(rows);
    free(ws);
    free(xs);
    free(gu);
    free(act);
    free(y);
    return rc;
}

int ab_moe(const ab_moe_t *e, const float *x, int64_t m, int64_t h, float *out, double *seconds, int threads) {
    const double t0 = now();
    const int64_t k = e->top_k;
    int64_t *ids = malloc(sizeof(int64_t) * m * k);
    float *weights = malloc(sizeof(float) * m * k), *probs = malloc(sizeof(float) * e->experts);
    int rc = -1;
    if (ids && weights && probs) {
        for (int64_t t = 0; t < m; t++) route(e, x + t * h, h, ids + t * k, weights + t * k, probs);
        rc = run_experts(e, x, m, h, ids, weights, out, threads, 0);
    }
    free(ids);
    free(weights);
    free(probs);
    if (seconds) *seconds += now() - t0;
    return rc;
}

/* The torch layers' routed experts of many rows (a prefill; layers/experts/cpu.py): routed by the caller (ids, its
 * weights), the products on AMX tiles where the CPU has them. -2: an id out of range. */
int ab_moe_routed(const ab_moe_t *e, const float *x, int64_t m, int64_t h, const int64_t *ids, const float *weights,
                  float *out, int threads) {
    return run_experts(e, x, m, h, ids, weights, out, threads, 1);
}
