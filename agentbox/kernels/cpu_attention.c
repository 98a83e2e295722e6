/* Causal attention over a paged KV cache for AVX2 + FMA (or AVX-512) CPUs: extends (a prefill chunk, a warm turn's new
 * tokens over a long cached prefix) and decode, every sequence of a step in one call (built and loaded by
 * cpu_attention.py; its torch twin is there too).
 *
 * Sequence s has q_lens[s] new tokens, the last of its kv_lens[s] positions; its keys sit in the cache
 * slots page_table[s][pos / page_size] * page_size + pos % page_size (k/v [slots, hkv, hd], written before this
 * call). Nothing of the prefix is gathered or copied: keys are read in place, page by page. The cache is fp32, or
 * fp16 (the default CPU pool: half the bytes a decode step reads, llama.cpp's default too): a tile's keys and values
 * are widened with F16C as they are loaded, once for every row of the item, and the arithmetic stays fp32.
 *
 * Work: an item is (sequence, kv head, a range of the keys). Its rows are the kv head's query group for
 * every new token (row i * g + j: token i, query head kvh * g + j), so a key tile loaded once serves all of
 * them (no GQA copy). The item walks its keys in tiles of TK positions: the tile's keys are transposed into
 * [hd][TK] (scores vectorise across keys), then each row does an online softmax step (running max m, sum l,
 * unnormalised accumulator acc[hd]) in base 2 (q . k * scale * log2 e, exp2). Rows whose position is before
 * the tile skip it; keys past a row's position are masked. A long sequence's keys are split into ranges
 * so the engine's threads share one sequence (a warm turn: ~25 tokens over 121k keys), and the ranges'
 * (m, l, acc) merge by their maxima afterwards, which is exactly the softmax over the union.
 */
#include "omp_spread.h"
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define SB 256         /* keys per span (a multiple of TK) */
#define RBLK 96        /* rows per block (a multiple of RB) */
#define TK 64          /* keys per tile (a multiple of 16) */
#define RB 6           /* rows per pass over a tile's keys (12 accumulators of the 16 vector registers) */
#define ROW_GROUP 192  /* rows per item of a many-row sequence (a multiple of RBLK) */
#define MIN_RANGE 1024 /* fewest keys worth a range of their own (the merge and the item's setup) */
#define LOG2E 1.4426950408889634f

/* One source, two widths: built with -mavx512f the vectors are __m512 (16 lanes: a tile's scores and a head of
 * 16 in one register, half the instructions of the AVX2 build on a warm turn); otherwise __m256. */
#if defined(__AVX512F__)
#define VL 16
typedef __m512 vf;
#define V_ZERO() _mm512_setzero_ps()
#define V_SET1(x) _mm512_set1_ps(x)
#define V_LOAD(p) _mm512_load_ps(p)
#define V_STORE(p, v) _mm512_store_ps(p, v)
#define V_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define V_MUL(a, b) _mm512_mul_ps(a, b)
#define V_ADD(a, b) _mm512_add_ps(a, b)
#define V_SUB(a, b) _mm512_sub_ps(a, b)
#define V_MAX(a, b) _mm512_max_ps(a, b)
#define V_BCAST(p) _mm512_set1_ps(*(p))
/* n of the vector's floats (a head of 8 or 24 ends on half a vector): masked, nothing read past a row */
#define V_LOADN(p, n) _mm512_maskz_loadu_ps((__mmask16)((1u << (n)) - 1), p)
#define V_STOREN(p, n, v) _mm512_mask_storeu_ps(p, (__mmask16)((1u << (n)) - 1), v)

static inline vf exp2_v(vf x) {
    /* as the AVX2 one below, lane for lane */
    const vf lo = V_SET1(-126.0f);
    const __mmask16 keep = _mm512_cmp_ps_mask(x, lo, _CMP_GE_OQ);
    x = V_MAX(x, lo);
    const vf n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const vf f = V_SUB(x, n);
    static const float c[8] = {1.0f, 0.69314718056f, 0.24022650695f, 0.05550410866f,
                               0.00961812911f, 0.00133335581f, 0.00015403530f, 0.00001525273f};
    vf p = V_SET1(c[7]);
    for (int i = 6; i >= 0; i--) p = V_FMA(p, f, V_SET1(c[i]));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mul_ps(keep, p, _mm512_castsi512_ps(e));
}

static inline float hmax(vf v) { return _mm512_reduce_max_ps(v); }
static inline float hsum(vf v) { return _mm512_reduce_add_ps(v); }
#else
#define VL 8
typedef __m256 vf;
#define V_ZERO() _mm256_setzero_ps()
#define V_SET1(x) _mm256_set1_ps(x)
#define V_LOAD(p) _mm256_load_ps(p)
#define V_STORE(p, v) _mm256_store_ps(p, v)
#define V_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define V_MUL(a, b) _mm256_mul_ps(a, b)
#define V_ADD(a, b) _mm256_add_ps(a, b)
#define V_SUB(a, b) _mm256_sub_ps(a, b)
#define V_MAX(a, b) _mm256_max_ps(a, b)
#define V_BCAST(p) _mm256_broadcast_ss(p)
#define V_LOADN(p, n) _mm256_loadu_ps(p) /* n is always 8: head sizes are multiples of 8 */
#define V_STOREN(p, n, v) _mm256_storeu_ps(p, v)

static inline vf exp2_v(vf x) {
    /* 2^x = 2^n * 2^f, n = round(x), |f| <= 0.5; 2^f by its Taylor series to degree 7 (error < 1e-8). Keys
     * masked with -inf (x < -126) give exactly 0. */
    const __m256 lo = _mm256_set1_ps(-126.0f);
    const __m256 keep = _mm256_cmp_ps(x, lo, _CMP_GE_OQ);
    x = _mm256_max_ps(x, lo);
    const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_sub_ps(x, n);
    static const float c[8] = {1.0f, 0.69314718056f, 0.24022650695f, 0.05550410866f,
                               0.00961812911f, 0.00133335581f, 0.00015403530f, 0.00001525273f};
    __m256 p = _mm256_set1_ps(c[7]);
    for (int i = 6; i >= 0; i--) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(c[i]));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), keep);
}

static inline float hmax(vf v) {
    __m128 a = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_max_ps(a, _mm_movehl_ps(a, a));
    a = _mm_max_ss(a, _mm_shuffle_ps(a, a, 1));
    return _mm_cvtss_f32(a);
}

static inline float hsum(vf v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    a = _mm_add_ss(a, _mm_shuffle_ps(a, a, 1));
    return _mm_cvtss_f32(a);
}
#endif
#define SC (2 * VL) /* keys per scores() call: two vectors a row */

typedef struct {
    const float *q;
    const char *k, *v; /* the cache's [slots][hkv][hd] elements of `esize` bytes: fp32 (4) or fp16 (2) */
    int64_t esize;
    const int32_t *pages; /* the sequence's row of the page table */
    int64_t page_size, hq, hkv, hd, g;
    int64_t q_start, n_q, kv_len, kvh;
    int64_t r_lo, r_hi; /* the item's rows: state[0] is row r_lo's */
    float scale2; /* scale * log2 e */
} item_t;

/* Scores of RB rows over SC keys of a tile ([hd][TK] from column c0): 2 RB independent FMA chains. */
static inline void scores(const float *const *qr, const float *kt, int64_t hd, int64_t c0, vf *s) {
    for (int j = 0; j < 2 * RB; j++) s[j] = V_ZERO();
    for (int64_t d = 0; d < hd; d++) {
        const vf k0 = V_LOAD(kt + d * TK + c0), k1 = V_LOAD(kt + d * TK + c0 + VL);
        for (int j = 0; j < RB; j++) {
            const vf qd = V_BCAST(qr[j] + d);
            s[2 * j] = V_FMA(qd, k0, s[2 * j]);
            s[2 * j + 1] = V_FMA(qd, k1, s[2 * j + 1]);
        }
    }
}

/* acc[j][d0 .. d0 + VL (w - 1) + n) = acc * alpha[j] + sum over keys o < nk of p[j][o] v[o]: RB x w chains;
 * n (<= VL) floats of the last vector. */
static inline void values(float *const *acc, const float *alpha, float p[RB][TK], const float *const *vrow,
                          int64_t nk, int64_t d0, int w, int n) {
    vf a[RB][2];
    const int n0 = w > 1 ? VL : n;
    for (int j = 0; j < RB; j++) {
        a[j][0] = V_MUL(V_LOADN(acc[j] + d0, n0), V_SET1(alpha[j]));
        if (w > 1) a[j][1] = V_MUL(V_LOADN(acc[j] + d0 + VL, n), V_SET1(alpha[j]));
    }
    for (int64_t o = 0; o < nk; o++) {
        const vf v0 = V_LOADN(vrow[o] + d0, n0), v1 = w > 1 ? V_LOADN(vrow[o] + d0 + VL, n) : v0;
        for (int j = 0; j < RB; j++) {
            const vf pj = V_BCAST(&p[j][o]);
            a[j][0] = V_FMA(pj, v0, a[j][0]);
            if (w > 1) a[j][1] = V_FMA(pj, v1, a[j][1]);
        }
    }
    for (int j = 0; j < RB; j++) {
        V_STOREN(acc[j] + d0, n0, a[j][0]);
        if (w > 1) V_STOREN(acc[j] + d0 + VL, n, a[j][1]);
    }
}

/* Row `slot` of the item's kv head in the cache `base` as fp32: in place, or an fp16 row widened into buf. */
static inline const float *cache_row(const item_t *it, const char *base, int64_t slot, float *buf) {
    const int64_t at = (slot * it->hkv + it->kvh) * it->hd;
    if (it->esize == 4) return (const float *)base + at;
    const uint16_t *h = (const uint16_t *)base + at;
    for (int64_t d = 0; d < it->hd; d += 8) /* hd is a multiple of 8 */
        _mm256_storeu_ps(buf + d, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + d))));
    return buf;
}

/* Tile t0 .. t0 + nk of the item's keys: transposed into kt [hd][TK] (zeros past nk), values' rows in vrow (an fp16
 * cache's widened into vt [TK][hd]). The keys and values SB positions further on (up to `end`) are prefetched: a sequence's pages lie anywhere
 * in the pool, so the hardware prefetcher loses the stream at every page; a warm 128k turn's step waited on
 * those misses for ~a fifth of its time. */
static void load_tile(const item_t *it, int64_t t0, int64_t nk, int64_t end, float *kt, float *vt, const float **vrow) {
    const int64_t hd = it->hd, row_bytes = it->hkv * hd * it->esize, head = it->kvh * hd * it->esize;
    const int64_t ps = it->page_size;
    float key_buf[256];
    int64_t pg = t0 / ps, off = t0 % ps; /* walk the pages: no division per key */
    const int64_t ahead = t0 + SB, n_ahead = end - ahead < TK ? end - ahead : TK;
    int64_t apg = ahead / ps, aoff = ahead % ps;
    for (int64_t o = 0; o < n_ahead; o++) {
        const int64_t slot = (int64_t)it->pages[apg] * ps + aoff;
        if (++aoff == ps) apg++, aoff = 0;
        for (int64_t b = 0; b < hd * it->esize; b += 64) { /* a 64-byte line at a time */
            _mm_prefetch(it->k + slot * row_bytes + head + b, _MM_HINT_T0);
            _mm_prefetch(it->v + slot * row_bytes + head + b, _MM_HINT_T0);
        }
    }
    for (int64_t o = 0; o < TK; o++) {
        if (o >= nk) {
            for (int64_t d = 0; d < hd; d++) kt[d * TK + o] = 0.0f;
            vrow[o] = NULL;
            continue;
        }
        const int64_t slot = (int64_t)it->pages[pg] * ps + off;
        if (++off == ps) pg++, off = 0;
        const float *key = cache_row(it, it->k, slot, key_buf);
        for (int64_t d = 0; d < hd; d++) kt[d * TK + o] = key[d];
        vrow[o] = cache_row(it, it->v, slot, vt + o * hd);
    }
}

/* One item: keys [a, b) of its sequence for its kv head's rows; state[r] = (m, l, acc[hd]) per row. Keys go
 * in spans of SB (transposed once, ~64 KB at head size 64: L2), rows in blocks of RBLK whose states stay
 * in L1 while they walk the span's tiles (a prefill chunk's 3k rows of state would not fit L2). */
static int run_item(const item_t *it, int64_t a, int64_t b, float *state) {
    const int64_t hd = it->hd, g = it->g, rows = it->r_hi, first_pos = it->kv_len - it->n_q;
    const int64_t stride = hd + 2;
    float *kts = aligned_alloc(64, sizeof(float) * SB * hd); /* [SB / TK][hd][TK] */
    float *vts = it->esize == 4 ? NULL : malloc(sizeof(float) * SB * hd); /* an fp16 span's values, widened */
    const float *vrows[SB];
    float p[RB][TK] __attribute__((aligned(64)));
    float scratch[RB][258]; /* the state of padding rows of a short last block */
    const vf sc2 = V_SET1(it->scale2);
    if (!kts || (it->esize != 4 && !vts)) {
        free(kts), free(vts);
        return 2;
    }
    for (int64_t r = 0; r < it->r_hi - it->r_lo; r++) {
        state[r * stride] = -INFINITY;
        state[r * stride + 1] = 0.0f;
        memset(state + r * stride + 2, 0, sizeof(float) * hd);
    }
    for (int64_t s0 = a; s0 < b; s0 += SB) {
        const int64_t s1 = b - s0 < SB ? b : s0 + SB, ntiles = (s1 - s0 + TK - 1) / TK;
        for (int64_t t = 0; t < ntiles; t++) {
            const int64_t t0 = s0 + t * TK;
            load_tile(it, t0, s1 - t0 < TK ? s1 - t0 : TK, b, kts + t * hd * TK, vts ? vts + t * TK * hd : NULL,
                      vrows + t * TK);
        }
        /* rows before a tile's first key see none of it (rows ascend in position, g rows per token) */
        int64_t b0 = s0 > first_pos ? (s0 - first_pos) * g : 0;
        for (b0 = b0 > it->r_lo ? b0 : it->r_lo; b0 < rows; b0 += RBLK) {
            const int64_t b1 = rows - b0 < RBLK ? rows : b0 + RBLK;
            for (int64_t t = 0; t < ntiles; t++) {
                const int64_t t0 = s0 + t * TK, nk = s1 - t0 < TK ? s1 - t0 : TK;
                const float *kt = kts + t * hd * TK, *const *vrow = vrows + t * TK;
                int64_t r0 = t0 > first_pos ? (t0 - first_pos) * g : 0;
                for (r0 = r0 > b0 ? r0 : b0; r0 < b1; r0 += RB) {
                    const int64_t nr = b1 - r0 < RB ? b1 - r0 : RB;
                    const float *qr[RB];
                    float *st[RB], *acc[RB], alpha[RB];
                    int64_t seen = 0; /* keys of the tile any row of the block sees */
                    for (int64_t j = 0; j < RB; j++) {
                        const int64_t r = r0 + (j < nr ? j : 0);
                        qr[j] = it->q + (it->q_start + r / g) * it->hq * hd + (it->kvh * g + r % g) * hd;
                        st[j] = j < nr ? state + (r - it->r_lo) * stride : scratch[j];
                        acc[j] = st[j] + 2;
                    }
                    for (int64_t c0 = 0; c0 < TK; c0 += SC) {
                        vf s[2 * RB];
                        scores(qr, kt, hd, c0, s);
                        for (int j = 0; j < RB; j++) {
                            V_STORE(p[j] + c0, V_MUL(s[2 * j], sc2));
                            V_STORE(p[j] + c0 + VL, V_MUL(s[2 * j + 1], sc2));
                        }
                    }
                    for (int64_t j = 0; j < RB; j++) {
                        if (j >= nr) { /* padding rows: no weight */
                            memset(p[j], 0, sizeof(p[j]));
                            alpha[j] = 0.0f;
                            continue;
                        }
                        const int64_t pos = first_pos + (r0 + j) / g;
                        const int64_t visible = pos - t0 + 1 < nk ? pos - t0 + 1 : nk; /* keys t0 .. pos */
                        seen = visible > seen ? visible : seen;
                        for (int64_t o = visible; o < TK; o++) p[j][o] = -INFINITY;
                        vf top = V_LOAD(p[j]);
                        for (int64_t o = VL; o < TK; o += VL) top = V_MAX(top, V_LOAD(p[j] + o));
                        const float m_old = st[j][0], t = hmax(top), m_new = t > m_old ? t : m_old;
                        const vf mv = V_SET1(m_new);
                        vf sum = V_ZERO();
                        for (int64_t o = 0; o < TK; o += VL) {
                            const vf e = exp2_v(V_SUB(V_LOAD(p[j] + o), mv));
                            V_STORE(p[j] + o, e);
                            sum = V_ADD(sum, e);
                        }
                        alpha[j] = m_old == -INFINITY ? 0.0f : exp2f(m_old - m_new);
                        st[j][0] = m_new;
                        st[j][1] = st[j][1] * alpha[j] + hsum(sum);
                    }
                    int64_t d0 = 0;
                    for (; d0 + 2 * VL <= hd; d0 += 2 * VL) values(acc, alpha, p, vrow, seen, d0, 2, VL);
                    if (hd - d0 > VL) values(acc, alpha, p, vrow, seen, d0, 2, (int)(hd - d0 - VL));
                    else if (d0 < hd) values(acc, alpha, p, vrow, seen, d0, 1, (int)(hd - d0));
                }
            }
        }
    }
    free(kts), free(vts);
    return 0;
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
    /* A sequence of many rows (a prefill chunk) is split by rows, into groups of ROW_GROUP: no merge, state for
     * its rows once. One of few rows (decode, a warm turn) is split by keys, into ranges merged afterwards. */
    int64_t *n_ranges = malloc(sizeof(int64_t) * n_seqs), *n_groups = malloc(sizeof(int64_t) * n_seqs);
    int64_t *first_item = malloc(sizeof(int64_t) * (n_seqs + 1)), *state_at = NULL;
    int64_t n_items = 0;
    for (int64_t s = 0; s < n_seqs && n_ranges && n_groups && first_item; s++) {
        const int64_t rows = q_lens[s] * g;
        int64_t by_len = (kv_lens[s] + MIN_RANGE - 1) / MIN_RANGE, by_threads = (want + n_seqs * hkv - 1) / (n_seqs * hkv);
        n_ranges[s] = rows > ROW_GROUP || by_len < 1 ? 1 : by_len < by_threads ? by_len : by_threads;
        n_groups[s] = threads > 1 ? (rows + ROW_GROUP - 1) / ROW_GROUP : 1;
        first_item[s] = n_items;
        n_items += hkv * n_ranges[s] * n_groups[s];
    }
    if (first_item) first_item[n_seqs] = n_items;
    state_at = malloc(sizeof(int64_t) * (n_items + 1));
    int64_t total = 0;
    for (int64_t s = 0; s < n_seqs && state_at; s++)
        for (int64_t i = first_item[s]; i < first_item[s + 1]; i++) {
            state_at[i] = total;
            const int64_t gq = (i - first_item[s]) % n_groups[s], per = (q_lens[s] * g + n_groups[s] - 1) / n_groups[s];
            const int64_t lo = gq * per, hi = (gq + 1) * per < q_lens[s] * g ? (gq + 1) * per : q_lens[s] * g;
            total += (hi > lo ? hi - lo : 0) * stride;
        }
    float *state = malloc(sizeof(float) * (total ? total : 1));
    if (!n_ranges || !n_groups || !first_item || !state_at || !state) {
        free(n_ranges), free(n_groups), free(first_item), free(state_at), free(state);
        return 2;
    }
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1)
    for (int64_t i = 0; i < n_items; i++) {
        int64_t s = 0;
        while (first_item[s + 1] <= i) s++;
        const int64_t local = i - first_item[s], gq = local % n_groups[s];
        const int64_t kvh = local / n_groups[s] / n_ranges[s], rg = local / n_groups[s] % n_ranges[s];
        const int64_t rows = q_lens[s] * g, per_g = (rows + n_groups[s] - 1) / n_groups[s];
        const int64_t r_lo = gq * per_g < rows ? gq * per_g : rows, r_hi = r_lo + per_g < rows ? r_lo + per_g : rows;
        /* ranges in whole tiles so only a sequence's last tile is short */
        const int64_t tiles = (kv_lens[s] + TK - 1) / TK, per = (tiles + n_ranges[s] - 1) / n_ranges[s];
        int64_t a = rg * per * TK, b = (rg + 1) * per * TK;
        b = b < kv_lens[s] ? b : kv_lens[s];
        a = a < b ? a : b;
        const item_t it = {q, k_cache, v_cache, kv_f16 ? 2 : 4, page_table + s * pt_stride, page_size, hq, hkv, hd,
                           g, q_starts[s], q_lens[s], kv_lens[s], kvh, r_lo, r_hi, scale * LOG2E};
        if (run_item(&it, a, b, state + state_at[i])) failed = 1;
    }
    if (failed) {
        free(n_ranges), free(n_groups), free(first_item), free(state_at), free(state);
        return 2;
    }
    /* merge each row's ranges: m = max m_r, l = sum l_r 2^(m_r - m), acc likewise; out = acc / l */
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t s = 0; s < n_seqs; s++) {
        const int64_t rows = q_lens[s] * g, per_g = (rows + n_groups[s] - 1) / n_groups[s];
        for (int64_t kvh = 0; kvh < hkv; kvh++)
            for (int64_t r = 0; r < rows; r++) {
                float m = -INFINITY, l = 0.0f, acc[256];
                const int64_t gq = r / per_g, at = first_item[s] + kvh * n_ranges[s] * n_groups[s] + gq;
                for (int64_t rg = 0; rg < n_ranges[s]; rg++) {
                    const float *st = state + state_at[at + rg * n_groups[s]] + (r - gq * per_g) * stride;
                    m = st[0] > m ? st[0] : m;
                }
                for (int64_t d = 0; d < hd; d++) acc[d] = 0.0f;
                for (int64_t rg = 0; rg < n_ranges[s]; rg++) {
                    const float *st = state + state_at[at + rg * n_groups[s]] + (r - gq * per_g) * stride;
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
    free(n_ranges), free(n_groups), free(first_item), free(state_at), free(state);
    return 0;
}
