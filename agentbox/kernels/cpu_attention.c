/* Causal attention over a paged KV cache for AVX2 + FMA (or AVX-512) CPUs: extends (a prefill chunk, a warm turn's new
 * tokens over a long cached prefix) and decode, every sequence of a step in one call (built and loaded by
 * cpu_attention.py; its torch twin is there too).
 *
 * Sequence s has q_lens[s] new tokens, the last of its kv_lens[s] positions; its keys sit in the cache
 * slots page_table[s][pos / page_size] * page_size + pos % page_size (k/v [slots, hkv, hd], written before this
 * call). Nothing of the prefix is gathered: keys are read in place, page by page. The cache is fp32, or fp16 (the
 * default CPU pool: half the bytes a decode step reads, llama.cpp's default too); the arithmetic is fp32.
 *
 * Work: an item is (sequence, kv head, a group of rows, a range of the keys). Its rows are the kv head's query
 * group for every new token (row i * g + j: token i, query head kvh * g + j), so a key loaded once serves all of
 * them (GQA: the g query heads of a kv head share every load, no copy). The item scales its rows' queries by
 * scale * log2 e once, then walks its keys in spans of SB: the span's keys are widened (F16C) and transposed into
 * [hd][TK] tiles (8 x 8 blocks in registers) and its values widened into [key][hd] rows, once per item (not per
 * row), and every block of MR rows that sees the span runs (issue 52; cpu_attention.py has the numbers):
 *   S = Q K^T   tile by tile, MR rows x TK keys in registers (AVX-512: 6 x 64, 24 accumulators: each key vector
 *               loaded once per dim for the MR rows, each query element broadcast once for the 4 key vectors);
 *   softmax     one online step per row over the span in base 2 (running max m, sum l): the span's max, exp2 by a
 *               degree-6 polynomial (~1 ulp) on whole vectors, the block's rescale factors in one vector exp2;
 *               masking only where a row's position (the diagonal) or the sequence's end falls inside the span;
 *   O += P V    MR rows x 64 dims in registers (AVX-512: 24 accumulators; each value row loaded once for the MR
 *               rows), over the keys some row of the block sees; the accumulators are rescaled once a span.
 * Blocks of fewer rows (a decode's g rows, a group's tail) run kernels built for their count, not padded to MR.
 * A chunk's rows are split into groups across the threads (items (kv head, query block), longest first); a sequence
 * of few rows (decode, a warm turn: ~25 tokens over 121k keys) is split by keys into ranges instead, and the
 * ranges' (m, l, acc) merge by their maxima afterwards, which is exactly the softmax over the union.
 *
 * The vectors of either width are cpu_attention_vec.h's; the tiles' geometry (SB, TK, MR) and the S and P V passes
 * cpu_attention_tiles.h's. This file walks an item's spans (load_tile, block_span, run_item) and splits and merges
 * the call's work (ab_paged_attention).
 */
#include "omp_spread.h"
#include "cpu_attention_tiles.h"
#include "cpu_attention_vec.h"
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define FEW_ROWS 192   /* a sequence of at most this many rows a kv head is split by keys (when threads share it) */
/* Rows per item of a sequence split by rows: the largest of these giving the call 4 items a thread or more (each item
 * widens every key its rows see, so fewer, larger groups widen less; enough of them keep the threads even). */
static const int64_t ROW_GROUPS[] = {768, 384, 192, 96};
#define MIN_RANGE 1024 /* fewest keys worth a range of their own (the merge and the item's setup) */
#define LOG2E 1.4426950408889634f

typedef struct {
    const float *q;
    const char *k, *v; /* the cache's [slots][hkv][hd] elements of `esize` bytes: fp32 (4) or fp16 (2) */
    int64_t esize;
    const int32_t *pages; /* the sequence's row of the page table */
    int64_t page_size, hq, hkv, hd, g;
    int64_t q_start, n_q, kv_len, kvh;
    int64_t r_lo, r_hi; /* the item's rows */
    float scale2;       /* scale * log2 e */
    float *out;         /* the call's output: written here when the item holds all its rows' keys */
    float *state;       /* else its rows' (m, l, acc[hd]) for the merge, hd + 2 floats a row */
} item_t;

/* Per item scratch: its rows' scaled queries, running (m, l) and accumulators, and a span's widened keys and values. */
typedef struct {
    float *qs, *acc, *m, *l; /* [rows][hd], [rows][hd], [rows], [rows] */
    float *kts, *vts;        /* [SB / TK][hd][TK], [SB][hd] */
} scratch_t;

/* One block of NR rows (local rows r0 ..) over one span (keys s0 .. s0 + nk of the sequence, widened into the
 * scratch's tiles): S tile by tile up to the block's last position, then one online softmax step per row over the
 * whole span (its max, exp2, the block's rescale factors), then P V over the keys some row of the block sees.
 * Keys past a row's position (the diagonal) or the sequence's end are masked, on those spans only. */
AI void block_span(const int NR, const item_t *it, scratch_t *sc, int64_t r0, int64_t s0, int64_t nk) {
    const int64_t hd = it->hd, g = it->g, first_pos = it->kv_len - it->n_q;
    const int64_t pos_hi = first_pos + (it->r_lo + r0 + NR - 1) / g; /* the block's last position */
    const int64_t seen = pos_hi - s0 + 1 < nk ? pos_hi - s0 + 1 : nk; /* keys of the span some row sees */
    if (seen <= 0) return;
    const int64_t cols = (seen + TK - 1) / TK * TK; /* scores computed: whole tiles */
    float p[MR][SB] __attribute__((aligned(64)));
    float dm[VL] __attribute__((aligned(64)));
    float alpha[MR], span_sum[MR];
    const float *qs = sc->qs + r0 * hd;
    for (int64_t t = 0; t * TK < cols; t++)
        for (int c0 = 0; c0 < TK; c0 += NVK * VL) qk_pass(NR, NVK, qs, hd, sc->kts + t * hd * TK, c0, p, t * TK);
    for (int j = 0; j < VL; j++) dm[j] = 0.0f;
    for (int j = 0; j < NR; j++) {
        const int64_t pos = first_pos + (it->r_lo + r0 + j) / g;
        int64_t vis = pos - s0 + 1; /* keys s0 .. pos */
        vis = vis < nk ? vis : nk;
        float *pj = p[j];
        if (vis <= 0) { /* a row whose token is before the span (the block's first token, on its second's diagonal) */
            for (int64_t o = 0; o < cols; o += VL) V_STORE(pj + o, V_ZERO());
            span_sum[j] = 0.0f; /* dm 0: alpha 1 */
            continue;
        }
        if (vis < cols) /* the diagonal, or the sequence's last span: keys past the row's position masked */
            for (int64_t o = vis / VL * VL; o < cols; o += VL) V_STORE(pj + o, keep_first(V_LOAD(pj + o), vis - o));
        vf top = V_LOAD(pj);
        for (int64_t o = VL; o < cols; o += VL) top = V_MAX(top, V_LOAD(pj + o));
        float *mj = sc->m + r0 + j;
        const float m_old = *mj, t = hmax(top), m_new = t > m_old ? t : m_old;
        const vf mv = V_SET1(m_new);
        vf sum = V_ZERO();
        for (int64_t o = 0; o < cols; o += VL) {
            const vf e = exp2_v(V_SUB(V_LOAD(pj + o), mv));
            V_STORE(pj + o, e);
            sum = V_ADD(sum, e);
        }
        dm[j] = m_old - m_new; /* -inf for a row's first keys: alpha 0 */
        *mj = m_new;
        span_sum[j] = hsum(sum);
    }
    V_STORE(dm, exp2_v(V_LOAD(dm))); /* the block's rescale factors 2^(m_old - m_new), one vector exp2 */
    for (int j = 0; j < NR; j++) {
        alpha[j] = dm[j];
        sc->l[r0 + j] = sc->l[r0 + j] * alpha[j] + span_sum[j];
    }
    float *acc = sc->acc + r0 * hd;
    const float *vt = sc->vts;
    int64_t d0 = 0;
    for (; d0 + NVD * VL <= hd; d0 += NVD * VL) pv_pass(NR, NVD, acc, hd, alpha, p, vt, seen, d0, VL);
    for (; d0 + VL <= hd; d0 += VL) pv_pass(NR, 1, acc, hd, alpha, p, vt, seen, d0, VL);
    if (d0 < hd) pv_pass(NR, 1, acc, hd, alpha, p, vt, seen, d0, (int)(hd - d0));
}

/* Tile t0 .. t0 + nk of the item's keys: transposed into kt [hd][TK] (zeros past nk), values widened into vt
 * [TK][hd]. The keys and values SB positions further on (up to `end`) are prefetched: a sequence's pages lie
 * anywhere in the pool, so the hardware prefetcher loses the stream at every page; a warm 128k turn's step waited
 * on those misses for ~a fifth of its time. */
static void load_tile(const item_t *it, int64_t t0, int64_t nk, int64_t end, float *kt, float *vt) {
    const int64_t hd = it->hd, es = it->esize, row_bytes = it->hkv * hd * es, head = it->kvh * hd * es;
    const int64_t ps = it->page_size;
    const int64_t ahead = t0 + SB, n_ahead = end - ahead < TK ? end - ahead : TK;
    int64_t apg = ahead / ps, aoff = ahead % ps;
    for (int64_t o = 0; o < n_ahead; o++) {
        const int64_t slot = (int64_t)it->pages[apg] * ps + aoff;
        if (++aoff == ps) apg++, aoff = 0;
        for (int64_t b = 0; b < hd * es; b += 64) { /* a 64-byte line at a time */
            _mm_prefetch(it->k + slot * row_bytes + head + b, _MM_HINT_T0);
            _mm_prefetch(it->v + slot * row_bytes + head + b, _MM_HINT_T0);
        }
    }
    int64_t pg = t0 / ps, off = t0 % ps; /* walk the pages: no division per key */
    for (int64_t o0 = 0; o0 < TK; o0 += 8) {
        const char *krow[8];
        for (int i = 0; i < 8; i++) {
            if (o0 + i >= nk) {
                krow[i] = NULL;
                continue;
            }
            const int64_t slot = (int64_t)it->pages[pg] * ps + off;
            if (++off == ps) pg++, off = 0;
            krow[i] = it->k + slot * row_bytes + head;
            const char *vrow = it->v + slot * row_bytes + head;
            for (int64_t d = 0; d < hd; d += 8) _mm256_storeu_ps(vt + (o0 + i) * hd + d, load8(vrow, es, d));
        }
        for (int64_t d = 0; d < hd; d += 8) {
            __m256 r[8];
            for (int i = 0; i < 8; i++) r[i] = krow[i] ? load8(krow[i], es, d) : _mm256_setzero_ps();
            transpose8(r);
            for (int i = 0; i < 8; i++) _mm256_store_ps(kt + (d + i) * TK + o0, r[i]);
        }
    }
}

/* One item: keys [a, b) of its sequence for its kv head's rows r_lo .. r_hi. */
static int run_item(const item_t *it, int64_t a, int64_t b) {
    const int64_t hd = it->hd, g = it->g, rows = it->r_hi - it->r_lo, first_pos = it->kv_len - it->n_q;
    scratch_t sc;
    sc.qs = aligned_alloc(64, sizeof(float) * (rows * hd + 16));
    sc.acc = aligned_alloc(64, sizeof(float) * (rows * hd + 16));
    sc.m = malloc(sizeof(float) * (rows + 1));
    sc.l = malloc(sizeof(float) * (rows + 1));
    sc.kts = aligned_alloc(64, sizeof(float) * SB * hd);
    sc.vts = aligned_alloc(64, sizeof(float) * SB * hd);
    int rc = 0;
    if (!sc.qs || !sc.acc || !sc.m || !sc.l || !sc.kts || !sc.vts) {
        rc = 2;
        goto done;
    }
    for (int64_t r = 0; r < rows; r++) {
        const int64_t row = it->r_lo + r;
        const float *src = it->q + (it->q_start + row / g) * it->hq * hd + (it->kvh * g + row % g) * hd;
        for (int64_t d = 0; d < hd; d++) sc.qs[r * hd + d] = src[d] * it->scale2;
        sc.m[r] = -INFINITY;
        sc.l[r] = 0.0f;
    }
    memset(sc.acc, 0, sizeof(float) * rows * hd);
    for (int64_t s0 = a; s0 < b; s0 += SB) {
        const int64_t s1 = b - s0 < SB ? b : s0 + SB;
        for (int64_t t0 = s0, t = 0; t0 < s1; t0 += TK, t++)
            load_tile(it, t0, s1 - t0 < TK ? s1 - t0 : TK, b, sc.kts + t * hd * TK, sc.vts + t * TK * hd);
        /* blocks whose rows are all before the span see none of it (rows ascend in position, g rows per token) */
        int64_t r0 = s0 > first_pos ? (s0 - first_pos) * g - it->r_lo : 0;
        r0 = r0 > 0 ? r0 / MR * MR : 0;
        for (; r0 + MR <= rows; r0 += MR) block_span(MR, it, &sc, r0, s0, s1 - s0);
        switch (rows - r0) {
        case 5: block_span(5, it, &sc, r0, s0, s1 - s0); break;
        case 4: block_span(4, it, &sc, r0, s0, s1 - s0); break;
        case 3: block_span(3, it, &sc, r0, s0, s1 - s0); break;
        case 2: block_span(2, it, &sc, r0, s0, s1 - s0); break;
        case 1: block_span(1, it, &sc, r0, s0, s1 - s0); break;
        default: break;
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        const int64_t row = it->r_lo + r;
        if (it->out) {
            float *o = it->out + (it->q_start + row / g) * it->hq * hd + (it->kvh * g + row % g) * hd;
            const float inv = sc.l[r] > 0.0f ? 1.0f / sc.l[r] : 0.0f;
            for (int64_t d = 0; d < hd; d++) o[d] = sc.acc[r * hd + d] * inv;
        } else {
            float *st = it->state + r * (hd + 2);
            st[0] = sc.m[r];
            st[1] = sc.l[r];
            memcpy(st + 2, sc.acc + r * hd, sizeof(float) * hd);
        }
    }
done:
    free(sc.qs), free(sc.acc), free(sc.m), free(sc.l), free(sc.kts), free(sc.vts);
    return rc;
}

/* q [T, hq, hd] -> out [T, hq, hd]; sequence s's queries are rows q_starts[s] .. + q_lens[s] of q; kv_f16: the
 * cache's elements are fp16 (else fp32). Returns 0, or 1 for shapes it does not take (hd a multiple of 8 up to
 * 256, hq a multiple of hkv). */
int ab_paged_attention(const float *q, int64_t n_seqs, const int64_t *q_starts, const int64_t *q_lens,
                       const int64_t *kv_lens, const int32_t *page_table, int64_t pt_stride, int64_t page_size,
                       const void *k_cache, const void *v_cache, int64_t hq, int64_t hkv, int64_t hd, float scale,
                       float *out, int threads, int kv_f16) {
    if (hd % 8 || hd > 256 || hkv < 1 || hq % hkv || page_size < 1) return 1;
    const int64_t g = hq / hkv, stride = hd + 2;
    threads = threads < 1 ? 1 : threads;
    spread_workers(threads); /* omp_spread.h says why */
    /* ranges per sequence: enough items for the threads, none shorter than MIN_RANGE keys */
    const int64_t want = threads > 1 ? 4 * threads : 1;
    /* A sequence of many rows (a prefill chunk, a long extend) is split by rows into groups: no merge. One of few
     * rows (decode, a warm turn) is split by keys, into ranges merged afterwards. */
    int64_t *n_ranges = malloc(sizeof(int64_t) * n_seqs), *n_groups = malloc(sizeof(int64_t) * n_seqs);
    int64_t *per_group = malloc(sizeof(int64_t) * n_seqs), *first_item = malloc(sizeof(int64_t) * (n_seqs + 1));
    int64_t *state_at = NULL, *order = NULL, *cost = NULL;
    if (!n_ranges || !n_groups || !per_group || !first_item) {
        free(n_ranges), free(n_groups), free(per_group), free(first_item);
        return 2;
    }
    int64_t group = ROW_GROUPS[0];
    for (size_t k = 0; threads > 1 && k < sizeof ROW_GROUPS / sizeof ROW_GROUPS[0]; k++) {
        group = ROW_GROUPS[k];
        int64_t items = 0;
        for (int64_t s = 0; s < n_seqs; s++) {
            const int64_t rows = q_lens[s] * g;
            items += hkv * (rows > FEW_ROWS ? (rows + group - 1) / group : 1);
        }
        if (items >= 4 * threads) break;
    }
    int64_t n_items = 0;
    for (int64_t s = 0; s < n_seqs; s++) {
        const int64_t rows = q_lens[s] * g;
        int64_t by_len = (kv_lens[s] + MIN_RANGE - 1) / MIN_RANGE, by_threads = (want + n_seqs * hkv - 1) / (n_seqs * hkv);
        n_ranges[s] = rows > FEW_ROWS || by_len < 1 ? 1 : by_len < by_threads ? by_len : by_threads;
        n_groups[s] = threads > 1 && rows > FEW_ROWS ? (rows + group - 1) / group : 1;
        /* rows per group in whole blocks of MR (the last group takes what is left) */
        per_group[s] = ((rows + n_groups[s] - 1) / n_groups[s] + MR - 1) / MR * MR;
        per_group[s] = per_group[s] < 1 ? 1 : per_group[s];
        n_groups[s] = rows > 0 ? (rows + per_group[s] - 1) / per_group[s] : 1;
        first_item[s] = n_items;
        n_items += hkv * n_ranges[s] * n_groups[s];
    }
    first_item[n_seqs] = n_items;
    state_at = malloc(sizeof(int64_t) * (n_items + 1));
    order = malloc(sizeof(int64_t) * (n_items + 1));
    cost = malloc(sizeof(int64_t) * (n_items + 1));
    int64_t total = 0;
    for (int64_t s = 0; s < n_seqs && state_at && order && cost; s++)
        for (int64_t i = first_item[s]; i < first_item[s + 1]; i++) {
            state_at[i] = total;
            const int64_t rows = q_lens[s] * g, gq = (i - first_item[s]) % n_groups[s];
            const int64_t lo = gq * per_group[s], hi = lo + per_group[s] < rows ? lo + per_group[s] : rows;
            if (n_ranges[s] > 1) total += (hi > lo ? hi - lo : 0) * stride;
            /* rows x the keys the group's last row sees: the longest items first (dynamic schedule) */
            const int64_t last = hi > lo ? kv_lens[s] - q_lens[s] + (hi - 1) / g + 1 : 0;
            cost[i] = (hi > lo ? hi - lo : 0) * (last / n_ranges[s] + 1);
            order[i] = i;
        }
    float *state = malloc(sizeof(float) * (total ? total : 1));
    if (!state_at || !order || !cost || !state) {
        free(n_ranges), free(n_groups), free(per_group), free(first_item), free(state_at), free(order), free(cost);
        free(state);
        return 2;
    }
    if (threads > 1) /* insertion sort by descending cost: a step holds at most a few hundred items */
        for (int64_t i = 1; i < n_items; i++) {
            const int64_t x = order[i];
            int64_t j = i;
            for (; j > 0 && cost[order[j - 1]] < cost[x]; j--) order[j] = order[j - 1];
            order[j] = x;
        }
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1)
    for (int64_t n = 0; n < n_items; n++) {
        const int64_t i = order[n];
        int64_t s = 0;
        while (first_item[s + 1] <= i) s++;
        const int64_t local = i - first_item[s], gq = local % n_groups[s];
        const int64_t kvh = local / n_groups[s] / n_ranges[s], rg = local / n_groups[s] % n_ranges[s];
        const int64_t rows = q_lens[s] * g;
        const int64_t r_lo = gq * per_group[s] < rows ? gq * per_group[s] : rows;
        const int64_t r_hi = r_lo + per_group[s] < rows ? r_lo + per_group[s] : rows;
        if (r_hi <= r_lo) continue;
        /* ranges in whole tiles so only a sequence's last tile is short */
        const int64_t tiles = (kv_lens[s] + TK - 1) / TK, per = (tiles + n_ranges[s] - 1) / n_ranges[s];
        int64_t a = rg * per * TK, b = (rg + 1) * per * TK;
        b = b < kv_lens[s] ? b : kv_lens[s];
        a = a < b ? a : b;
        const item_t it = {q, k_cache, v_cache, kv_f16 ? 2 : 4, page_table + s * pt_stride, page_size, hq, hkv, hd,
                           g, q_starts[s], q_lens[s], kv_lens[s], kvh, r_lo, r_hi, scale * LOG2E,
                           n_ranges[s] > 1 ? NULL : out, state + state_at[i]};
        if (run_item(&it, a, b)) failed = 1;
    }
    /* merge the rows' ranges of sequences split by keys (one group each): m = max m_r, l = sum l_r 2^(m_r - m),
     * acc likewise; out = acc / l */
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t s = 0; s < n_seqs; s++) {
        if (failed || n_ranges[s] == 1) continue;
        const int64_t rows = q_lens[s] * g;
        for (int64_t kvh = 0; kvh < hkv; kvh++)
            for (int64_t r = 0; r < rows; r++) {
                float m = -INFINITY, l = 0.0f, acc[256];
                const int64_t at = first_item[s] + kvh * n_ranges[s];
                for (int64_t rg = 0; rg < n_ranges[s]; rg++) {
                    const float *st = state + state_at[at + rg] + r * stride;
                    m = st[0] > m ? st[0] : m;
                }
                for (int64_t d = 0; d < hd; d++) acc[d] = 0.0f;
                for (int64_t rg = 0; rg < n_ranges[s]; rg++) {
                    const float *st = state + state_at[at + rg] + r * stride;
                    if (st[0] == -INFINITY) continue;
                    const float w = exp2f(st[0] - m);
                    l += st[1] * w;
                    for (int64_t d = 0; d < hd; d++) acc[d] += st[2 + d] * w;
                }
                const int64_t i = r / g, head = kvh * g + r % g;
                float *o = out + (q_starts[s] + i) * hq * hd + head * hd;
                const float inv = l > 0.0f ? 1.0f / l : 0.0f;
                for (int64_t d = 0; d < hd; d++) o[d] = acc[d] * inv;
            }
    }
    free(n_ranges), free(n_groups), free(per_group), free(first_item), free(state_at), free(order), free(cost);
    free(state);
    return failed ? 2 : 0;
}
