/* cpu_decode.c's attention over the paged KV cache (a decode's row, a verify's rows, a short extend's), included by
 * cpu_decode.c after its layer_t, dims_t and exp8.
 *
 * Grouped: the rows of one sequence and the query heads of a GQA group read the same keys, so each key vector is
 * widened once (in a register) for up to NQ of them. Split: a row's keys run in spans of SPAN keys from key 0, each
 * span an item of its own (group, span: every kv head) with the span's maximum, sum of exponentials and unnormalised
 * weighted values; the spans then merge in order by their maxima (as flash-decoding does). One sequence's decode thus
 * spreads over every thread (a kv head a thread left one of two threads idle a third of the time with SmolLM2's
 * three; a step of fewer spans than two a thread runs a span's kv heads as items of their own), a span reads its pages
 * front to back, and its keys and values are sent to L2 ahead of use. On the Zen 4
 * EPYC, SmolLM2's shape (9 heads on 3 of 64), fp16 cache, 4,096 keys, 30 layers out of cache: one row at two threads
 * 16.1 -> 7.4-7.6 ms, four rows 49.8 -> 30.4-32.9 ms (the kernel before: a unit per kv head, keys widened through a
 * buffer in L1, scores of every key then one softmax pass).
 *
 * A row's numbers depend on its own keys only: its spans, their order and every sum in them are fixed by its
 * position, not by the rows beside it, the thread count or the ISA variant (256-bit code in every build), so a
 * verified row is bit for bit a one-row decode at that position. */
#ifndef CPU_DECODE_ATTENTION_H
#define CPU_DECODE_ATTENTION_H

#define GROUP_ROWS 32 /* rows of one group at most (the wrapper's MAX_QUERY): bounds the scores scratch */
#define SPAN 256      /* keys per span: its fp16 keys and values of a kv head are 64 KB at head size 64 (L2) */
#define PARTIALS (4 << 20) /* floats of span partials a batch of sequences holds at most (16 MB) */
static inline float hsum8(__m256 v) { /* a fixed order: lanes (0+4, 1+5, 2+6, 3+7), then pairs */
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* a span's n scores (padded to 8) into their exponentials from the span's maximum, zero past n; the sum into *sum */
static float span_softmax(float *s, int64_t n, float *sum) {
    __m256 top = _mm256_set1_ps(-INFINITY), acc = _mm256_setzero_ps();
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int64_t j = 0; j < n; j += 8) {
        const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n - j)), lane));
        top = _mm256_max_ps(top, _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), _mm256_loadu_ps(s + j), keep));
    }
    __m128 t = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
    t = _mm_max_ps(t, _mm_movehl_ps(t, t));
    const float mx = _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t)));
    for (int64_t j = 0; j < n; j += 8) {
        const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n - j)), lane));
        const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), _mm256_set1_ps(mx))), keep);
        _mm256_storeu_ps(s + j, e);
        acc = _mm256_add_ps(acc, e);
    }
    *sum = hsum8(acc);
    return mx;
}

typedef struct { /* a batch's spans: span s of query q (a head of row row0 + q / heads) at [s * queries + q] */
    float *top, *sum, *out; /* [spans][queries], [spans][queries], [spans][queries][hd] */
    int64_t queries, row0;
} partials_t;

#define AI static inline __attribute__((always_inline))
#define NQ 3 /* queries a pass holds in registers: a pass's 4 keys x 3 queries (or 4 x 32 channels) of accumulators */

AI __m256 kv_load(const void *row, int f16, int64_t c) { /* 8 channels from c of an fp16 or fp32 row, as fp32 */
    return f16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + c)))
               : _mm256_loadu_ps((const float *)row + c);
}

/* the scores of nr queries over 4 keys' rows: each query's lanes sum its products over the head, then one reduction
 * tree for the four keys (lanes 0+1, 2+3, then those, the halves last); out[r]: 4 scores */
AI void qk4(const int nr, const float *const *q, const void *const *k, int f16, int64_t hd, __m128 *out) {
    __m256 a[NQ][4];
    for (int r = 0; r < nr; r++)
        for (int j = 0; j < 4; j++) a[r][j] = _mm256_setzero_ps();
    for (int64_t c = 0; c < hd; c += 8) {
        __m256 kc[4];
        for (int j = 0; j < 4; j++) kc[j] = kv_load(k[j], f16, c);
        for (int r = 0; r < nr; r++) {
            const __m256 qc = _mm256_loadu_ps(q[r] + c);
            for (int j = 0; j < 4; j++) a[r][j] = _mm256_fmadd_ps(qc, kc[j], a[r][j]);
        }
    }
    for (int r = 0; r < nr; r++) {
        const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(a[r][0], a[r][1]), _mm256_hadd_ps(a[r][2], a[r][3]));
        out[r] = _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
    }
}

/* o[r] (+)= sum over keys j < len of p[r][j] v_j, channels c0 .. c0 + 8 nv, for nr queries: each value vector is
 * widened once for all of them and the sums stay in registers over the span */
AI void pv(const int nr, const int nv, float *const *o, const float *const *p, const void *const *v, int f16,
           int64_t len, int64_t c0, int fresh) {
    __m256 a[NQ][4];
    for (int r = 0; r < nr; r++)
        for (int w = 0; w < nv; w++) a[r][w] = fresh ? _mm256_setzero_ps() : _mm256_loadu_ps(o[r] + c0 + 8 * w);
    for (int64_t j = 0; j < len; j++) {
        __m256 x[4];
        for (int w = 0; w < nv; w++) x[w] = kv_load(v[j], f16, c0 + 8 * w);
        for (int r = 0; r < nr; r++) {
            const __m256 pj = _mm256_broadcast_ss(p[r] + j);
            for (int w = 0; w < nv; w++) a[r][w] = _mm256_fmadd_ps(pj, x[w], a[r][w]);
        }
    }
    for (int r = 0; r < nr; r++)
        for (int w = 0; w < nv; w++) _mm256_storeu_ps(o[r] + c0 + 8 * w, a[r][w]);
}

/* The nr queries' scores over keys 0 .. len of rows k (4 at a time; past len a block repeats a key), then after
 * their softmax, their weighted values; dispatched so that nr is a constant in each copy. */
AI void qk_rows(const int nr, const float *const *q, const void *const *k, int f16, int64_t hd, int64_t len,
                float scale, float *const *sc) {
    for (int64_t j0 = 0; j0 < len; j0 += 4) {
        const void *kb[4];
        for (int j = 0; j < 4; j++) kb[j] = k[j0 + j < len ? j0 + j : j0];
        __m128 out[NQ];
        qk4(nr, q, kb, f16, hd, out);
        for (int r = 0; r < nr; r++) _mm_storeu_ps(sc[r] + j0, _mm_mul_ps(out[r], _mm_set1_ps(scale)));
    }
}

AI void pv_rows(const int nr, float *const *o, const float *const *p, const void *const *v, int f16, int64_t hd,
                int64_t len) {
    int64_t c0 = 0;
    for (; c0 + 32 <= hd; c0 += 32) pv(nr, 4, o, p, v, f16, len, c0, 1);
    for (; c0 < hd; c0 += 8) pv(nr, 1, o, p, v, f16, len, c0, 1);
}

static void qk_any(int nr, const float *const *q, const void *const *k, int f16, int64_t hd, int64_t len, float scale,
                   float *const *sc) {
    if (nr == 3) qk_rows(3, q, k, f16, hd, len, scale, sc);
    else if (nr == 2) qk_rows(2, q, k, f16, hd, len, scale, sc);
    else qk_rows(1, q, k, f16, hd, len, scale, sc);
}

static void pv_any(int nr, float *const *o, const float *const *p, const void *const *v, int f16, int64_t hd,
                   int64_t len) {
    if (nr == 3) pv_rows(3, o, p, v, f16, hd, len);
    else if (nr == 2) pv_rows(2, o, p, v, f16, hd, len);
    else pv_rows(1, o, p, v, f16, hd, len);
}

typedef struct { /* a span's keys: from key a, len of them, on these pages (group g's) */
    const int32_t *pages;
    int64_t a, len, g;
} span_t;

/* A span's keys or values, every kv head's (a key's row of `row` elements), on their way to L2: a sequence's pages lie
 * anywhere in the pool, so the hardware prefetcher loses the stream at every page. Into L2 (prefetcht2), a span ahead:
 * on the Zen 4 EPYC, SmolLM2's attention at 4k keys out of cache took 102 ms for four rows at one thread without it,
 * 52-56 with it, and prefetcht0 of the same lines (into L1, whose misses it then waits on) no better than none. */
static void prefetch_span(const void *cache, int64_t esize, const int32_t *pages, int64_t page_size, int64_t a,
                          int64_t len, int64_t row) {
    int64_t pg = a / page_size, off = a % page_size;
    for (int64_t c = 0; c < len; c++) {
        const char *at = (const char *)cache + ((int64_t)pages[pg] * page_size + off) * row * esize;
        for (int64_t b = 0; b < row * esize; b += 64) /* asm: GCC 12 drops _mm_prefetch in such loops as dead code */
            __asm__ volatile("prefetcht2 %0" : : "m"(at[b]));
        if (++off == page_size) off = 0, pg++;
    }
}

/* the rows of kv head kvh for keys a .. a + len of a sequence's pages (its kv heads side by side in a key's row) */
static void span_rows(const void *cache, int64_t esize, const int32_t *pages, int64_t page_size, int64_t a,
                      int64_t len, int64_t hkv, int64_t kvh, int64_t hd, const void **out) {
    int64_t pg = a / page_size, off = a % page_size;
    for (int64_t c = 0; c < len; c++) {
        out[c] = (const char *)cache + (((int64_t)pages[pg] * page_size + off) * hkv + kvh) * hd * esize;
        if (++off == page_size) off = 0, pg++;
    }
}

/* Span s (keys a .. a + SPAN) of the rows t0 .. t0 + rows of one sequence, kv heads kv0 .. kv1: each query's scores over
 * its keys in the span (up to its own position), their exponentials from the span's maximum and the weighted values
 * into the partials, NQ queries of a kv head at a time. scores: [rows * hq][SPAN]. */
static void attend_span(const layer_t *L, const dims_t *d, const float *qkv, int64_t t0, int64_t rows, int64_t s,
                        int64_t kv0, int64_t kv1, const int32_t *pages, int64_t page_size, const int64_t *kv_lens,
                        float *scores, const partials_t *P, const span_t *next) {
    const int64_t hq = d->heads, hkv = d->kv_heads, hd = d->head_dim, group = hq / hkv;
    const int64_t qkv_n = (hq + 2 * hkv) * hd, a = s * SPAN, esize = L->kv_f16 ? 2 : 4, f16 = L->kv_f16;
    int64_t end = a;
    for (int64_t t = t0; t < t0 + rows; t++) end = kv_lens[t] > end ? kv_lens[t] : end;
    end = end < a + SPAN ? end : a + SPAN;
    const int64_t len = end - a;
    prefetch_span(L->v_cache, esize, pages, page_size, a, len, hkv * hd); /* needed after the scores */
    const void *rows_of[SPAN];
    for (int64_t kvh = kv0; kvh < kv1; kvh++) {
        span_rows(L->k_cache, esize, pages, page_size, a, len, hkv, kvh, hd, rows_of);
        for (int64_t i = 0; i < rows * group; i += NQ) {
            const int nr = rows * group - i < NQ ? (int)(rows * group - i) : NQ;
            const float *q[NQ];
            float *sc[NQ];
            for (int r = 0; r < nr; r++) {
                const int64_t t = t0 + (i + r) / group, h = kvh * group + (i + r) % group;
                q[r] = qkv + t * qkv_n + h * hd, sc[r] = scores + ((t - t0) * hq + h) * SPAN;
            }
            qk_any(nr, q, rows_of, (int)f16, hd, len, d->scale, sc);
        }
    }
    if (next->len) prefetch_span(L->k_cache, esize, next->pages, page_size, next->a, next->len, hkv * hd);
    for (int64_t i = 0; i < rows * hq; i++) { /* zero past its own keys: a longer row's keys add nothing to it */
        const int64_t t = t0 + i / hq, n = kv_lens[t] - a, q = (t - P->row0) * hq + i % hq;
        if (n <= 0 || i % hq < kv0 * group || i % hq >= kv1 * group) continue;
        P->top[s * P->queries + q] = span_softmax(scores + i * SPAN, n < len ? n : len, &P->sum[s * P->queries + q]);
        for (int64_t j = (n + 7) / 8 * 8; j < len; j++) scores[i * SPAN + j] = 0.0f;
    }
    for (int64_t kvh = kv0; kvh < kv1; kvh++) {
        span_rows(L->v_cache, esize, pages, page_size, a, len, hkv, kvh, hd, rows_of);
        for (int64_t i = 0; i < rows * group; i += NQ) {
            int nr = 0;
            float *o[NQ];
            const float *p[NQ];
            for (int64_t k = i; k < i + NQ && k < rows * group; k++) {
                const int64_t t = t0 + k / group, h = kvh * group + k % group;
                if (kv_lens[t] <= a) continue; /* no keys in this span */
                o[nr] = P->out + (s * P->queries + (t - P->row0) * hq + h) * hd;
                p[nr++] = scores + ((t - t0) * hq + h) * SPAN;
            }
            if (nr) pv_any(nr, o, p, rows_of, (int)f16, hd, len);
        }
    }
}

/* query q's spans (a row of n keys has ceil(n / SPAN)) merged in order by their maxima, normalised into out */
static void merge_spans(const partials_t *P, int64_t q, int64_t n, int64_t hd, float *out) {
    const int64_t spans = (n + SPAN - 1) / SPAN;
    float top = -INFINITY, total = 0.0f;
    if (spans <= 0) { /* a row that sees no key (none is sent: a token sees itself) */
        memset(out, 0, sizeof(float) * hd);
        return;
    }
    for (int64_t s = 0; s < spans; s++) top = P->top[s * P->queries + q] > top ? P->top[s * P->queries + q] : top;
    for (int64_t s = 0; s < spans; s++) {
        const float w = spans == 1 ? 1.0f : expf(P->top[s * P->queries + q] - top);
        const float *o = P->out + (s * P->queries + q) * hd;
        total += w * P->sum[s * P->queries + q];
        for (int64_t c = 0; c < hd; c += 8) {
            const __m256 x = _mm256_mul_ps(_mm256_set1_ps(w), _mm256_loadu_ps(o + c));
            _mm256_storeu_ps(out + c, s == 0 ? x : _mm256_add_ps(_mm256_loadu_ps(out + c), x));
        }
    }
    const __m256 inv = _mm256_set1_ps(1.0f / total);
    for (int64_t c = 0; c < hd; c += 8) _mm256_storeu_ps(out + c, _mm256_mul_ps(_mm256_loadu_ps(out + c), inv));
}

/* the rows from t that read the same pages (a sequence's rows: the wrapper repeats its page-table row) */
static int64_t group_end(const int32_t *pt, int64_t stride, int64_t page_size, const int64_t *kv_lens, int64_t m,
                         int64_t t) {
    int64_t e = t + 1;
    for (; e < m && e - t < GROUP_ROWS; e++) {
        const int64_t n = kv_lens[e] > kv_lens[t] ? kv_lens[e] : kv_lens[t], used = (n + page_size - 1) / page_size;
        if (used > stride || memcmp(pt + e * stride, pt + t * stride, sizeof(int32_t) * used)) break;
    }
    return e;
}

/* items: (group, span), a group's spans from its longest row; starts[g] its first row, first[g] its first
 * item, first[ng] the item count */
static void span_items(const int32_t *page_table, int64_t pt_stride, int64_t page_size, const int64_t *kv_lens,
                       int64_t m, int64_t *starts, int64_t *first, int64_t *ng, int64_t *max_rows) {
    int64_t items = 0;
    *ng = 0, *max_rows = 1;
    for (int64_t t = 0; t < m; (*ng)++) {
        const int64_t e = group_end(page_table, pt_stride, page_size, kv_lens, m, t);
        int64_t n = 0;
        for (int64_t r = t; r < e; r++) n = kv_lens[r] > n ? kv_lens[r] : n;
        const int64_t spans = (n + SPAN - 1) / SPAN;
        *max_rows = e - t > *max_rows ? e - t : *max_rows;
        starts[*ng] = t, first[*ng] = items, items += spans, t = e;
    }
    starts[*ng] = m, first[*ng] = items;
}

/* item u's span: its group's pages, its first key and its key count (up to the group's longest row) */
static span_t item_span(int64_t u, const int64_t *first, const int64_t *starts, const int32_t *page_table,
                        int64_t pt_stride, const int64_t *kv_lens) {
    int64_t g = 0, n = 0;
    while (first[g + 1] <= u) g++;
    for (int64_t t = starts[g]; t < starts[g + 1]; t++) n = kv_lens[t] > n ? kv_lens[t] : n;
    const int64_t a = (u - first[g]) * SPAN;
    return (span_t){page_table + starts[g] * pt_stride, a, n - a < SPAN ? n - a : SPAN, g};
}

/* items u0 .. u1, round robin over the threads, so that each knows its next span and sends its keys to L2 while it
 * adds this one's values (its first span's keys go first) */
static void attend_batch(const layer_t *L, const dims_t *d, const float *qkv, const int32_t *page_table,
                         int64_t pt_stride, int64_t page_size, const int64_t *kv_lens, const int64_t *starts,
                         const int64_t *first, int64_t u0, int64_t u1, float *scratch, int64_t per,
                         const partials_t *P, int threads) {
    const int64_t hkv = d->kv_heads, row = hkv * d->head_dim, esize = L->kv_f16 ? 2 : 4;
    /* fewer spans than two a thread (a short decode: one span): a span's kv heads are items of their own, as many
     * as there are kv heads (the same numbers: a query's work does not depend on the item it runs in) */
    const int64_t split = u1 - u0 < 2 * threads ? hkv : 1, items = (u1 - u0) * split;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        const int64_t me = threads > 1 ? omp_get_thread_num() : 0, step = threads > 1 ? omp_get_num_threads() : 1;
        float *scores = scratch + me * per;
        for (int64_t i = me; i < items; i += step) {
            const int64_t u = u0 + i / split, part = i % split, un = u0 + (i + step) / split;
            const span_t at = item_span(u, first, starts, page_table, pt_stride, kv_lens),
                         next = i + step < items && un != u
                                    ? item_span(un, first, starts, page_table, pt_stride, kv_lens) : (span_t){0};
            if (i < step) prefetch_span(L->k_cache, esize, at.pages, page_size, at.a, at.len, row);
            const int64_t g = at.g;
            attend_span(L, d, qkv, starts[g], starts[g + 1] - starts[g], u - first[g], part * hkv / split,
                        (part + 1) * hkv / split, at.pages, page_size, kv_lens, scores, P, &next);
        }
    }
}

/* the groups from g0 whose spans' partials fit PARTIALS floats together (one group at least), and their size */
static int64_t batch_end(const int64_t *starts, const int64_t *first, int64_t ng, int64_t g0, int64_t hq, int64_t hd,
                         int64_t *floats) {
    int64_t g1 = g0, spans = 0;
    *floats = 0;
    for (; g1 < ng; g1++) {
        const int64_t s = first[g1 + 1] - first[g1] > spans ? first[g1 + 1] - first[g1] : spans;
        const int64_t need = (starts[g1 + 1] - starts[g0]) * hq * s * (hd + 2);
        if (g1 > g0 && need > PARTIALS) break;
        spans = s, *floats = need;
    }
    return g1;
}

static int attention(const layer_t *L, const dims_t *d, const float *qkv, int64_t m, const int32_t *page_table,
                     int64_t pt_stride, int64_t page_size, const int64_t *kv_lens, float *attn, int threads) {
    const int64_t hq = d->heads, hkv = d->kv_heads, hd = d->head_dim;
    if (hd % 8) return -3; /* the wrapper's eligible() keeps such models on the torch layers */
    int64_t *starts = malloc(sizeof(int64_t) * 2 * (m + 1)), *first = starts + m + 1, ng, max_rows, most = 0;
    if (!starts) return -1;
    span_items(page_table, pt_stride, page_size, kv_lens, m, starts, first, &ng, &max_rows);
    for (int64_t g0 = 0, floats, g1; g0 < ng; g0 = g1) { /* the largest batch's partials */
        g1 = batch_end(starts, first, ng, g0, hq, hd, &floats);
        most = floats > most ? floats : most;
    }
    const int64_t nth = threads > 1 ? threads : 1, per = max_rows * hq * SPAN;
    float *scratch = malloc(sizeof(float) * (per * nth + most));
    if (!scratch) {
        free(starts);
        return -1;
    }
    for (int64_t g0 = 0, g1, floats; g0 < ng; g0 = g1) { /* batches of groups: bounded partials, any batch size */
        g1 = batch_end(starts, first, ng, g0, hq, hd, &floats);
        const int64_t rows = starts[g1] - starts[g0], spans = floats / (rows * hq * (hd + 2));
        partials_t P = {.queries = rows * hq, .row0 = starts[g0], .top = scratch + per * nth};
        P.sum = P.top + spans * P.queries, P.out = P.sum + spans * P.queries;
        attend_batch(L, d, qkv, page_table, pt_stride, page_size, kv_lens, starts, first, first[g0], first[g1], scratch,
                     per, &P, threads);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
        for (int64_t q = 0; q < P.queries; q++)
            merge_spans(&P, q, kv_lens[P.row0 + q / hq], hd, attn + (P.row0 * hq + q) * hd);
    }
    free(starts);
    free(scratch);
    return 0;
}

#endif
