/* Causal attention over the paged KV cache with AMX tiles (amx_tile + amx_bf16) for prefill chunks and warm turns:
 * the sequences of a step with many query rows. Same arguments and result as cpu_attention.c's ab_paged_attention
 * (its header says how sequences, rows and pages are laid out); cpu_attention.py sends here only sequences of
 * AMX_MIN_ROWS rows a kv head or more on CPUs whose OS granted the tile state, everything else stays on that
 * kernel (its AMX_MIN_ROWS says where the two cross).
 *
 * Why: a 1024-token chunk at 32k context is ~75 GFLOP of attention per SmolLM2 layer; the fp32 FMA kernel
 * reaches ~110-130 GFLOP/s on one core of this Xeon, which held cold prefill at 32k to ~0.2 of 2k's tok/s.
 * One tile product (TDPBF16PS, 16 x 16 x 32 bf16 multiply-adds into fp32) takes ~4.5 ns here: ~3.5 TFLOP/s.
 *
 * Precision: the queries are fp32 and the cache fp32 or fp16 (the default CPU pool, widened as it is read); one
 * bf16 rounding (8 bits) would be coarser than either. Each operand is split x = hi + lo, hi = bf16(x), lo = bf16(x - hi), and x.y is taken as
 * hi.hi + hi.lo + lo.hi (oneDNN's "bf16x3"): ~16 significant bits a product for 3 tile products. Scores come
 * out of the tiles in fp32; the online softmax is fp32 AVX-512 (base 2, as cpu_attention.c's); probabilities
 * are split the same way for P V. Against an fp64 twin: ~1.5e-5 of the output's largest value (the fp32
 * kernel: ~2e-6).
 *
 * Head sizes: a multiple of 16 up to 256. The tiles take dims in 32s; a head of 16, 48, 80 ... is padded to the
 * next 32 inside (zero query and key dims, accumulators of the padded size, only hd dims written out), and its
 * last 16 dims take 2 products a row tile instead of 3 (repack says how) and a half P V unit.
 *
 * Work: an item is (sequence, kv head, a group of rows, a range of keys); rows are as there (row r: token r / g,
 * query head kvh * g + r % g). When threads share a call, a chunk's rows split into groups; a warm turn's few rows
 * (one group) split its keys into ranges instead, merged afterwards by their maxima as cpu_attention.c's are.
 * The item splits its rows' queries (times scale * log2 e) into hi and lo once, then walks the keys in spans of
 * ASB: a span's keys and values are read in place from the pages and repacked into the
 * tiles' pair-interleaved ("VNNI") bf16 layout in a scratch buffer (the only copy: each key once per item),
 * then each block of 32 rows that sees the span computes S = Q K^T, its online softmax step (running max m,
 * sum l per row) and P V into fp32 tiles added to its accumulator. The blocks run as a pipeline so the tile
 * unit and the vector units work at once (see run_item). Keys past a row's position (the chunk's own
 * diagonal) or past the sequence are masked.
 */
#include "omp_spread.h"
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx_tiles.h"


#define ASB 512        /* keys per span (a multiple of 32; 512 measured 4 % faster than 256, 1024 and 128 slower) */
#define AR 32          /* rows per block: two tiles of 16 */
/* Floats a row of a block's scores: not ASB, whose 2 KB put a tile's 16 rows in 2 of L1's 64 sets (and the three
 * score buffers' rows in the same 2), so the tiles' stores and loads of scores missed L1; one line more spreads
 * them. */
#define SST (ASB + 16)
#define AROW_GROUP 384 /* fewest rows per item when threads share a sequence by rows (a multiple of AR) */
/* Fewest keys a range of a sequence split by keys (its queries' split, buffers and merge): 64 rows of head 16 on 2
 * threads took 0.88 / 0.86 / 0.51 ms over 8k keys with 8192 / 4096 / 2048 here (fp32 kernel: 0.58), 1.70 / 1.08 /
 * 0.84 ms over 16k (fp32: 1.13). */
#define AMX_MIN_RANGE 2048
#define LOG2E_A 1.4426950408889634f
/* 0 when the OS granted the tile state (amx_tiles.h). */
int ab_amx_init(void) { return amx_request() ? 0 : 1; }

static void tiles_on(void) {
    static const uint8_t rows[8] = {16, 16, 16, 16, 16, 16, 16, 16};
    static const uint16_t colsb[8] = {64, 64, 64, 64, 64, 64, 64, 64}; /* 16 x 16 fp32, or 16 x 32 bf16 */
    amx_configure(rows, colsb);
}

/* x rounded to bf16 (nearest even), as an fp32 whose low 16 bits are zero. */
static inline __m512 bf16_round(__m512 x) {
    const __m512i b = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u)));
}

/* Two 16-float vectors' bf16 halves in one pair-interleaved vector: lane i = (b[i] << 16) | a[i]. */
static inline __m512i pair(__m512 a, __m512 b) {
    return _mm512_or_si512(_mm512_castps_si512(b), _mm512_srli_epi32(_mm512_castps_si512(a), 16));
}

/* The first `left` of 16 lanes (none when left <= 0, all when >= 16). */
static inline __mmask16 first_lanes(int64_t left) {
    const int64_t n = left < 0 ? 0 : left > 16 ? 16 : left;
    return (__mmask16)((1u << n) - 1);
}

typedef struct {
    const float *q;
    const char *k, *v; /* the cache's bytes: fp32, or fp16 where f16 (each read widened by kv_load) */
    const int32_t *pages;
    /* hd: the cache's head size (its strides); hp: hd padded to the tiles' 32 dims, the size of every buffer here */
    int64_t page_size, hq, hkv, hd, hp, g, q_start, n_q, kv_len, kvh, r_lo, r_hi;
    float scale2;
    int f16;
} aitem_t;

/* 16 of a key's or value's dims from d on, widened to fp32 where the cache is fp16. An fp16 value has 11
 * significant bits, so its split below (hi = bf16(x), lo = x - hi) is exact: the tiles see the cache's own numbers. */
static inline __m512 kv_load(const char *row, int64_t d, int f16) {
    return f16 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(row + 2 * d)))
               : _mm512_loadu_ps((const float *)row + d);
}

/* A line into L2. Not _mm_prefetch: GCC takes a function whose only effect is __builtin_prefetch for one without
 * effects and drops its calls (prefetch_span's never ran: no prefetcht1 in the build). */
static inline void prefetch_l2(const char *p) { __asm__ __volatile__("prefetcht1 %0" : : "m"(*(const char *)p)); }

/* Keys t0 .. t0 + n of the item into L2 while the span before them runs (run_item spreads the calls): a sequence's pages lie anywhere in the
 * pool, so the hardware prefetcher loses the stream at every page (cpu_attention.c's load_tile does the same). */
static void prefetch_span(const aitem_t *it, int64_t t0, int64_t n) {
    const int64_t es = it->f16 ? 2 : 4, hd = it->hd, kv_stride = it->hkv * hd * es, head = it->kvh * hd * es;
    const int64_t ps = it->page_size;
    int64_t pg = t0 / ps, off = t0 % ps;
    for (int64_t o = 0; o < n; o++) {
        const int64_t slot = (int64_t)it->pages[pg] * ps + off;
        if (++off == ps) pg++, off = 0;
        for (int64_t b = 0; b < hd * es; b += 64) {
            prefetch_l2(it->k + slot * kv_stride + head + b);
            prefetch_l2(it->v + slot * kv_stride + head + b);
        }
    }
}

/* Keys t0 .. t0 + n of the item (n <= ASB; the rest of the span zero) into the tiles' layouts:
 * K as B operands of Q K^T: tile (key block kb of 16, dim block dh of 32) row p = the 16 keys' dims 2p, 2p+1;
 * V as B operands of P V: tile (key block of 32, dim block of 16) row p = keys 2p, 2p + 1 at the 16 dims. */
static void repack(const aitem_t *it, int64_t t0, int64_t n, uint32_t *kh, uint32_t *kl, uint32_t *vh, uint32_t *vl) {
    const int64_t hd = it->hd, hp = it->hp, ndh = hp / 32, nd16 = hd / 16;
    const int64_t es = it->f16 ? 2 : 4, kv_stride = it->hkv * hd * es, head = it->kvh * hd * es;
    const int64_t ps = it->page_size;
    const int f16 = it->f16;
    const char *rows_k[ASB], *rows_v[ASB];
    int64_t pg = t0 / ps, off = t0 % ps;
    for (int64_t o = 0; o < ASB; o++) {
        if (o >= n) {
            rows_k[o] = rows_v[o] = NULL;
            continue;
        }
        const int64_t slot = (int64_t)it->pages[pg] * ps + off;
        if (++off == ps) pg++, off = 0;
        rows_k[o] = it->k + slot * kv_stride + head;
        rows_v[o] = it->v + slot * kv_stride + head;
    }
    /* Per 16 keys and 32 dims: each key's dims split into 16 (hi, lo) bf16 pairs in one vector apiece, then the
     * 16 x 16 pairs transposed in registers into the tile's rows. The transpose was a scalar loop through a
     * [dim][key] buffer before: 40 % of a warm turn's time in the tiles (60 rows of head 16 over 121k keys). */
    for (int64_t kb = 0; kb < ASB / 16; kb++)
        for (int64_t dh = 0; dh < ndh; dh++) {
            const int64_t d = dh * 32;
            uint32_t *th = kh + (kb * ndh + dh) * 256, *tl = kl + (kb * ndh + dh) * 256;
            if (d + 16 >= hd) {
                /* 16 dims (a head of 16, 48, 80 ...: its padding block): a key's 8 hi pairs and 8 lo pairs share
                 * one vector, so one transpose gives both tiles' rows 0-7. The hi tile repeats its rows as 8-15 and
                 * the lo tile's stay the zeros run_item wrote: against queries split as [Qh | Ql] and [Qh | 0]
                 * (run_item) the block takes 2 products a row tile (Qh Kh + Ql Kh, Qh Kl), not 3 over zero dims. */
                __m512i x[16];
                for (int64_t j = 0; j < 16; j++) {
                    const char *key = rows_k[kb * 16 + j];
                    const __m512 a = key ? kv_load(key, d, f16) : _mm512_setzero_ps(), ah = bf16_round(a);
                    x[j] = (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(a, ah), ah);
                }
                transpose16(x);
                for (int64_t p = 0; p < 8; p++) {
                    _mm512_store_si512(th + p * 16, x[p]), _mm512_store_si512(th + (p + 8) * 16, x[p]);
                    _mm512_store_si512(tl + p * 16, x[p + 8]);
                }
                continue;
            }
            __m512i h[16], l[16];
            for (int64_t j = 0; j < 16; j++) {
                const char *key = rows_k[kb * 16 + j];
                const __m512 a = key ? kv_load(key, d, f16) : _mm512_setzero_ps();
                const __m512 b = key ? kv_load(key, d + 16, f16) : _mm512_setzero_ps();
                const __m512 ah = bf16_round(a), bh = bf16_round(b);
                h[j] = (__m512i)_mm512_cvtne2ps_pbh(bh, ah);
                l[j] = (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(b, bh), _mm512_sub_ps(a, ah));
            }
            transpose16(h), transpose16(l);
            for (int64_t p = 0; p < 16; p++)
                _mm512_store_si512(th + p * 16, h[p]), _mm512_store_si512(tl + p * 16, l[p]);
        }
    for (int64_t kb = 0; kb < ASB / 32; kb++)
        for (int64_t db = 0; db < nd16; db++) {
            uint32_t *th = vh + (kb * nd16 + db) * 256, *tl = vl + (kb * nd16 + db) * 256;
            for (int64_t p = 0; p < 16; p++) {
                const char *ra = rows_v[kb * 32 + 2 * p], *rb = rows_v[kb * 32 + 2 * p + 1];
                const __m512 a = ra ? kv_load(ra, db * 16, f16) : _mm512_setzero_ps();
                const __m512 b = rb ? kv_load(rb, db * 16, f16) : _mm512_setzero_ps();
                const __m512 ah = bf16_round(a), bh = bf16_round(b);
                _mm512_store_si512(th + p * 16, pair(ah, bh));
                _mm512_store_si512(tl + p * 16, pair(bf16_round(_mm512_sub_ps(a, ah)), bf16_round(_mm512_sub_ps(b, bh))));
            }
        }
}

/* Keys 16 u .. 16 u + 15 of S [AR][SST] = Q K^T (12 tile products) into tile set u % 2 (tiles 0-1 or 2-3: rows 0-15
 * and 16-31), 4-5 the queries' row tiles, 6-7 the keys'. A set is stored one unit late, after the next unit's
 * products are issued: storing a tile waits for its chain of products, and that wait then overlaps them.
 * A dim block loads the keys' hi and lo tiles first, so the queries' hi tiles serve both: 6 tile loads for its 6
 * products, not 8. The loads, not the products, bound this kernel here: a 1024-token chunk over 32k keys (head 64,
 * one thread) took 109 ms with neither products nor softmax, 149 ms with the products and 178 ms with the softmax
 * alone, against ~200 ms whole; 6 loads took 2.3 % off it. */
#define QK_SET(c0, c1)                                                                                              \
    _tile_zero(c0); _tile_zero(c1);                                                                                 \
    for (int64_t dh = 0; dh < ndh; dh++) {                                                                          \
        if (half && dh + 1 == ndh) { /* [Qh | Ql] . [Kh ; Kh] + [Qh | 0] . [Kl ; 0]: 4 products (see repack) */      \
            _tile_loadd(6, kh + (u * ndh + dh) * 256, 64);                                                           \
            _tile_loadd(4, h + dh * 64, qs); _tile_dpbf16ps(c0, 4, 6);                                              \
            _tile_loadd(5, h + 16 * qs + dh * 64, qs); _tile_dpbf16ps(c1, 5, 6);                                    \
            _tile_loadd(7, kl + (u * ndh + dh) * 256, 64);                                                           \
            _tile_loadd(4, w + dh * 64, qs); _tile_dpbf16ps(c0, 4, 7);                                              \
            _tile_loadd(5, w + 16 * qs + dh * 64, qs); _tile_dpbf16ps(c1, 5, 7);                                    \
            break;                                                                                                  \
        }                                                                                                           \
        _tile_loadd(6, kh + (u * ndh + dh) * 256, 64);                                                               \
        _tile_loadd(7, kl + (u * ndh + dh) * 256, 64);                                                               \
        _tile_loadd(4, h + dh * 64, qs); _tile_dpbf16ps(c0, 4, 6);                                                  \
        _tile_loadd(5, h + 16 * qs + dh * 64, qs); _tile_dpbf16ps(c1, 5, 6);                                        \
        _tile_dpbf16ps(c0, 4, 7); _tile_dpbf16ps(c1, 5, 7);                                                         \
        _tile_loadd(4, w + dh * 64, qs); _tile_dpbf16ps(c0, 4, 6);                                                  \
        _tile_loadd(5, w + 16 * qs + dh * 64, qs); _tile_dpbf16ps(c1, 5, 6);                                        \
    }

static inline void qk_unit(const uint16_t *qh, const uint16_t *ql, int64_t hd, int half, const uint32_t *kh,
                           const uint32_t *kl, int64_t u, int last, float *s) {
    const int64_t ndh = hd / 32, qs = hd * 2;
    const char *h = (const char *)qh, *w = (const char *)ql;
    if (u % 2 == 0) {
        QK_SET(0, 1);
        if (u > 0) {
            _tile_stored(2, s + (u - 1) * 16, SST * 4); _tile_stored(3, s + 16 * SST + (u - 1) * 16, SST * 4);
        }
        if (last) {
            _tile_stored(0, s + u * 16, SST * 4); _tile_stored(1, s + 16 * SST + u * 16, SST * 4);
        }
    } else {
        QK_SET(2, 3);
        _tile_stored(0, s + (u - 1) * 16, SST * 4); _tile_stored(1, s + 16 * SST + (u - 1) * 16, SST * 4);
        if (last) {
            _tile_stored(2, s + u * 16, SST * 4); _tile_stored(3, s + 16 * SST + u * 16, SST * 4);
        }
    }
}

/* Keys c .. c + 31 of ob [AR][hp] = P V at dims d0 .. d0 + 31 (12 tile products): tiles 0-3 = (rows 0-15 | 16-31)
 * x (dims +0 | +16), zeroed at the first keys and stored at the last (nk, a multiple of 32); 4-5 the
 * probabilities' row tiles (hi and lo of 32 keys side by side where the scores were), 6-7 the values'. The
 * values' tiles are laid out by hd / 16 blocks of 16 dims: a head of 16, 48, 80 ... ends on a half unit (dims
 * d0 .. d0 + 15 only, 6 products), not on 16 padding dims of zeros. */
static inline void pv_unit(const float *p, int64_t hd, int64_t hp, const uint32_t *vh, const uint32_t *vl, int64_t d0,
                           int64_t c, int64_t nk, float *ob) {
    const int64_t nd16 = hd / 16, os = hp * 4;
    if (c == 0) {
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    }
    const uint32_t *v0 = vh + ((c / 32) * nd16 + d0 / 16) * 256, *v1 = v0 + 256;
    const uint32_t *u0 = vl + ((c / 32) * nd16 + d0 / 16) * 256, *u1 = u0 + 256;
    const float *h0 = p + c, *h1 = p + 16 * SST + c, *w0 = h0 + 16, *w1 = h1 + 16;
    if (d0 + 16 >= hd) {
        _tile_loadd(6, v0, 64);
        _tile_loadd(4, h0, SST * 4); _tile_loadd(5, h1, SST * 4);
        _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(2, 5, 6);
        _tile_loadd(4, w0, SST * 4); _tile_loadd(5, w1, SST * 4);
        _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(2, 5, 6);
        _tile_loadd(7, u0, 64);
        _tile_loadd(4, h0, SST * 4); _tile_loadd(5, h1, SST * 4);
        _tile_dpbf16ps(0, 4, 7); _tile_dpbf16ps(2, 5, 7);
        if (c + 32 == nk) {
            _tile_stored(0, ob + d0, os); _tile_stored(2, ob + 16 * hp + d0, os);
        }
        return;
    }
    _tile_loadd(6, v0, 64); _tile_loadd(7, v1, 64);
    _tile_loadd(4, h0, SST * 4); _tile_loadd(5, h1, SST * 4);
    _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
    _tile_loadd(4, w0, SST * 4); _tile_loadd(5, w1, SST * 4);
    _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
    _tile_loadd(6, u0, 64); _tile_loadd(7, u1, 64);
    _tile_loadd(4, h0, SST * 4); _tile_loadd(5, h1, SST * 4);
    _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
    if (c + 32 == nk) {
        _tile_stored(0, ob + d0, os); _tile_stored(1, ob + d0 + 16, os);
        _tile_stored(2, ob + 16 * hp + d0, os); _tile_stored(3, ob + 16 * hp + d0 + 16, os);
    }
}

/* 2^x for x <= 0 on the `keep` lanes, exactly 0 on the others: x = n + f, |f| <= 1/2, 2^f by a degree-5 minimax
 * polynomial (relative error 2.4e-7 in fp32, far under the tiles' bf16x3 products), 2^n by vscalefps. Below
 * 2^-126 it stays 2^-126 (no denormals): a weight no fp32 sum notices. */
static inline __m512 exp2_neg(__m512 x, __mmask16 keep) {
    static const float c[6] = {1.0000001192092896f, 0.6931469440460205f, 0.24022120237350464f,
                               0.05550713092088699f, 0.009675510227680206f, 0.0013276379322633147f};
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(c[5]);
    for (int i = 4; i >= 0; i--) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c[i]));
    return _mm512_maskz_scalef_ps(keep, p, n);
}

/* One row's softmax step over its scores s[0 .. nk) of which the first `vis` are its keys: p = 2^(s - m_new)
 * split into hi + lo bf16 (zero past vis) written over the scores they came from (per 32 keys: 32 hi, then 32 lo,
 * where P V's A tiles read them), (m, l) updated; returns the factor its accumulator is scaled by. P's hi is
 * truncated, not rounded (one AND): its lo then keeps 16 bits, and the dropped lo.lo term stays under 2^-16 of
 * P V since V's split rounds. */
static inline float softmax_row(float *s, int64_t vis, int64_t nk, float *m, float *l) {
    if (vis <= 0) {
        memset(s, 0, sizeof(float) * nk);
        return 1.0f;
    }
    /* a row that sees every key of the block (all but the chunk's diagonal) takes no masks */
    const int full = vis >= nk;
    __m512 top[4]; /* four chains: the max's latency, not its throughput, bounds one chain */
    for (int i = 0; i < 4; i++) top[i] = _mm512_set1_ps(-INFINITY);
    if (full) {
        int64_t o = 0;
        for (; o + 64 <= nk; o += 64)
            for (int i = 0; i < 4; i++) top[i] = _mm512_max_ps(top[i], _mm512_load_ps(s + o + 16 * i));
        for (; o < nk; o += 16) top[0] = _mm512_max_ps(top[0], _mm512_load_ps(s + o));
    } else {
        for (int64_t o = 0; o < nk; o += 16)
            top[0] = _mm512_mask_max_ps(top[0], first_lanes(vis - o), top[0], _mm512_load_ps(s + o));
    }
    const float t = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(top[0], top[1]), _mm512_max_ps(top[2], top[3])));
    const float m_old = *m, m_new = t > m_old ? t : m_old;
    const __m512 mv = _mm512_set1_ps(m_new);
    const __m512i upper = _mm512_set1_epi32((int)0xffff0000u);
    __m512 sum[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t o = 0; o < nk; o += 32) {
        const __mmask16 k0 = full ? 0xffff : first_lanes(vis - o), k1 = full ? 0xffff : first_lanes(vis - o - 16);
        const __m512 e0 = exp2_neg(_mm512_sub_ps(_mm512_load_ps(s + o), mv), k0);
        const __m512 e1 = exp2_neg(_mm512_sub_ps(_mm512_load_ps(s + o + 16), mv), k1);
        sum[0] = _mm512_add_ps(sum[0], e0), sum[1] = _mm512_add_ps(sum[1], e1);
        const __m512 h0 = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(e0), upper));
        const __m512 h1 = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(e1), upper));
        _mm512_store_si512(s + o, (__m512i)_mm512_cvtne2ps_pbh(h1, h0));
        _mm512_store_si512(s + o + 16, (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(e1, h1), _mm512_sub_ps(e0, h0)));
    }
    const float alpha = m_old == -INFINITY ? 0.0f : exp2f(m_old - m_new);
    *m = m_new;
    *l = *l * alpha + _mm512_reduce_add_ps(_mm512_add_ps(sum[0], sum[1]));
    return alpha;
}

typedef struct {
    int64_t b0, nk; /* the block's first row (of the item), keys of the span any of its rows sees (32s) */
    float *s;       /* its scores, then its probabilities */
} blk_t;

static inline blk_t block(const aitem_t *it, int64_t b0, int64_t s0, int64_t n, float *s) {
    const int64_t nr = it->r_hi - it->r_lo, end = b0 + AR < nr ? b0 + AR : nr;
    const int64_t last = (it->r_lo + end - 1) / it->g + it->kv_len - it->n_q; /* the block's last position */
    const int64_t seen = last - s0 + 1 < n ? last - s0 + 1 : n;
    return (blk_t){b0, (seen + 31) / 32 * 32, s};
}

/* acc = acc * alpha + ob, row by row of a block: the head's hd dims of rows hp apart (ob's padding dims unset) */
static inline void update(float *acc, const float *alpha, const float *ob, int64_t hd, int64_t hp) {
    for (int64_t j = 0; j < AR; j++) {
        const __m512 al = _mm512_set1_ps(alpha[j]);
        for (int64_t d = 0; d < hd; d += 16)
            _mm512_store_ps(acc + j * hp + d, _mm512_fmadd_ps(_mm512_load_ps(acc + j * hp + d), al, _mm512_load_ps(ob + j * hp + d)));
    }
}

/* One item: keys a .. b of its sequence for rows r_lo .. r_hi, normalised into out; or, when state is set (one
 * range of a sequence split by keys), each row's (m, l, acc[hd]) at state + row * (2 + hd) for the merge. */
static int run_item(const aitem_t *it, int64_t a, int64_t b, float *out, float *state) {
    const int64_t hd = it->hd, hp = it->hp, g = it->g, nr = it->r_hi - it->r_lo, nrp = (nr + AR - 1) / AR * AR;
    const int64_t first_pos = it->kv_len - it->n_q;
    uint16_t *qh = aligned_alloc(64, sizeof(uint16_t) * nrp * hp), *ql = aligned_alloc(64, sizeof(uint16_t) * nrp * hp);
    float *acc = aligned_alloc(64, sizeof(float) * nrp * hp), *ml = malloc(sizeof(float) * nrp * 2);
    uint32_t *kv = aligned_alloc(64, sizeof(uint32_t) * ASB * hp * 2); /* K hi, K lo, V hi, V lo: ASB x hp / 2 each */
    float *s = aligned_alloc(64, sizeof(float) * AR * SST * 3), *ob = aligned_alloc(64, sizeof(float) * AR * hp);
    int rc = 0;
    if (!qh || !ql || !acc || !ml || !kv || !s || !ob) {
        rc = 2;
        goto done;
    }
    /* the rows' queries times scale * log2 e, split; padding rows zero */
    const __m512 sc = _mm512_set1_ps(it->scale2);
    for (int64_t r = 0; r < nrp; r++) {
        const int64_t rr = it->r_lo + r;
        const float *qr = it->q + (it->q_start + rr / g) * it->hq * hd + (it->kvh * g + rr % g) * hd;
        for (int64_t d = 0; d < hp; d += 32) {
            if (d + 16 >= hd) { /* a 16-dim block: [Qh | Ql] and [Qh | 0] (repack says why) */
                const __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(r < nr ? 0xffff : 0, qr + d), sc);
                const __m512 hi = bf16_round(x);
                _mm512_storeu_si512(qh + r * hp + d, (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(x, hi), hi));
                _mm512_storeu_si512(ql + r * hp + d, (__m512i)_mm512_cvtne2ps_pbh(_mm512_setzero_ps(), hi));
                continue;
            }
            __m512 x[2], hi[2];
            for (int h = 0; h < 2; h++) {
                x[h] = _mm512_mul_ps(_mm512_maskz_loadu_ps(r < nr ? 0xffff : 0, qr + d + 16 * h), sc);
                hi[h] = bf16_round(x[h]);
            }
            _mm512_storeu_si512(qh + r * hp + d, (__m512i)_mm512_cvtne2ps_pbh(hi[1], hi[0]));
            _mm512_storeu_si512(ql + r * hp + d, (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(x[1], hi[1]), _mm512_sub_ps(x[0], hi[0])));
        }
        ml[2 * r] = -INFINITY, ml[2 * r + 1] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * nrp * hp);
    float *sbuf[3] = {s, s + AR * SST, s + 2 * AR * SST};
    uint32_t *kh = kv, *kl = kv + ASB * hp / 2, *vh = kv + ASB * hp, *vl = kv + ASB * hp * 3 / 2;
    memset(kv, 0, sizeof(uint32_t) * ASB * hp); /* K's tiles: the rows of padding dims repack leaves */
    tiles_on();
    for (int64_t s0 = a; s0 < b; s0 += ASB) {
        const int64_t n = b - s0 < ASB ? b - s0 : ASB;
        /* rows before the span's first key see none of it (rows ascend in position, g rows a token) */
        int64_t b0 = s0 > first_pos ? (s0 - first_pos) * g - it->r_lo : 0;
        b0 = b0 < 0 ? 0 : b0 / AR * AR;
        if (b0 >= nr) continue;
        repack(it, s0, n, kh, kl, vh, vl);
        /* The next span's keys go to L2 a few rows at a time, after each row's softmax, not all at once here: ~1k
         * prefetches back to back outrun the core's outstanding misses, and a warm turn reads each key once (60
         * rows of head 16 over 121k keys on one core: 5.0 -> 4.65 ms; 2 threads: 2.56 -> 2.47). */
        const int64_t ahead = s0 + ASB < b ? (b - s0 - ASB < ASB ? b - s0 - ASB : ASB) : 0;
        int64_t fetched = 0;
        /* Blocks of AR rows in a pipeline: while block i's softmax runs on the vector units, the tile unit does
         * block i - 1's P V and block i + 1's Q K^T, a few tile products after each row (the three share no
         * buffer: S / P rotate through three), so neither unit waits for the other's phase (1024 rows over 32k
         * keys, one thread: 0.28 s in phases, 0.22 s so). */
        const int64_t nb = (nr - b0 + AR - 1) / AR;
        blk_t prev = {0, 0, NULL}, cur = block(it, b0, s0, n, sbuf[0]), next = {0, 0, NULL};
        for (int64_t u = 0; u < cur.nk / 16; u++)
            qk_unit(qh + cur.b0 * hp, ql + cur.b0 * hp, hp, hd != hp, kh, kl, u, u + 1 == cur.nk / 16, cur.s);
        float alpha[2][AR];
        for (int64_t i = 0; i < nb; i++) {
            if (i + 1 < nb) next = block(it, cur.b0 + AR, s0, n, sbuf[(i + 1) % 3]);
            const int64_t n_pv = i > 0 ? hp / 32 * (prev.nk / 32) : 0, n_qk = i + 1 < nb ? next.nk / 16 : 0;
            const int64_t total = n_pv + n_qk;
            int64_t done = 0;
            for (int64_t j = 0; j < AR; j++) {
                const int64_t r = cur.b0 + j, pos = first_pos + (it->r_lo + r) / g;
                const int64_t vis = r >= nr ? 0 : pos - s0 + 1 < n ? pos - s0 + 1 : n;
                alpha[i % 2][j] = softmax_row(cur.s + j * SST, vis, cur.nk, ml + 2 * r, ml + 2 * r + 1);
                const int64_t due = ahead * (i * AR + j + 1) / (nb * AR);
                if (due > fetched) prefetch_span(it, s0 + ASB + fetched, due - fetched), fetched = due;
                for (const int64_t to = (j + 1) * total / AR; done < to; done++) {
                    if (done < n_pv) {
                        const int64_t per = prev.nk / 32;
                        pv_unit(prev.s, hd, hp, vh, vl, done / per * 32, done % per * 32, prev.nk, ob);
                    } else {
                        qk_unit(qh + next.b0 * hp, ql + next.b0 * hp, hp, hd != hp, kh, kl, done - n_pv,
                                done + 1 == total, next.s);
                    }
                }
            }
            if (i > 0) update(acc + prev.b0 * hp, alpha[(i - 1) % 2], ob, hd, hp);
            prev = cur, cur = next;
        }
        for (int64_t d0 = 0; d0 < hp; d0 += 32)
            for (int64_t c = 0; c < prev.nk; c += 32) pv_unit(prev.s, hd, hp, vh, vl, d0, c, prev.nk, ob);
        update(acc + prev.b0 * hp, alpha[(nb - 1) % 2], ob, hd, hp);
    }
    _tile_release();
    for (int64_t r = 0; r < nr && state; r++) {
        float *st = state + r * (2 + hd);
        st[0] = ml[2 * r], st[1] = ml[2 * r + 1];
        memcpy(st + 2, acc + r * hp, sizeof(float) * hd);
    }
    for (int64_t r = 0; r < nr && !state; r++) {
        const int64_t rr = it->r_lo + r;
        float *o = out + (it->q_start + rr / g) * it->hq * hd + (it->kvh * g + rr % g) * hd;
        const float l = ml[2 * r + 1], inv = l > 0.0f ? 1.0f / l : 0.0f;
        for (int64_t d = 0; d < hd; d++) o[d] = acc[r * hp + d] * inv; /* the head's own dims only */
    }
done:
    free(qh), free(ql), free(acc), free(ml), free(kv), free(s), free(ob);
    return rc;
}

/* As ab_paged_attention, for head sizes a multiple of 16 up to 256 (one not a multiple of 32 is padded to one
 * inside: zero dims in the queries' and keys' splits and the values' tiles; only hd dims are written out).
 * Returns 0, 1 for shapes it does not take, 2 when out of memory. ab_amx_init must have returned 0 in this process. */
int ab_paged_attention_amx(const float *q, int64_t n_seqs, const int64_t *q_starts, const int64_t *q_lens,
                           const int64_t *kv_lens, const int32_t *page_table, int64_t pt_stride, int64_t page_size,
                           const void *k_cache, const void *v_cache, int64_t hq, int64_t hkv, int64_t hd, float scale,
                           float *out, int threads, int kv_f16) {
    if (hd % 16 || hd < 16 || hd > 256 || hkv < 1 || hq % hkv || page_size < 1) return 1;
    const int64_t g = hq / hkv;
    threads = threads < 1 ? 1 : threads;
    spread_workers(threads); /* omp_spread.h says why */
    int64_t *first = malloc(sizeof(int64_t) * (n_seqs + 1)), *groups = malloc(sizeof(int64_t) * (n_seqs + 1));
    int64_t *ranges = malloc(sizeof(int64_t) * (n_seqs + 1)), *state_at = malloc(sizeof(int64_t) * (n_seqs + 1));
    if (!first || !groups || !ranges || !state_at) {
        free(first), free(groups), free(ranges), free(state_at);
        return 2;
    }
    /* One item per kv head on one thread (each key repacked once). When threads share: a sequence of many rows
     * (a prefill chunk) splits by rows, into groups of at least AROW_GROUP, as few as give two items a thread
     * (every group repacks all of its keys: 8 groups of 384 rows a kv head took a 1024-token chunk at 32k context
     * on 2 threads to 107 ms, 2 groups to 94; 18 % off at head 128 with 8 kv heads); one of few rows (a warm turn:
     * one block of rows on one kv head, else one thread) splits by keys, into ranges of whole spans merged
     * afterwards as cpu_attention.c's are (two ranges a thread: kv heads that do not divide among the threads
     * still balance). */
    int64_t n_items = 0, n_state = 0;
    for (int64_t s = 0; s < n_seqs; s++) {
        const int64_t rows = q_lens[s] * g, two_a_thread = (2 * threads + n_seqs * hkv - 1) / (n_seqs * hkv);
        const int64_t most = (rows + AROW_GROUP - 1) / AROW_GROUP;
        groups[s] = threads > 1 ? most < two_a_thread ? most : two_a_thread : 1;
        groups[s] = groups[s] < 1 ? 1 : groups[s];
        const int64_t by_len = kv_lens[s] / AMX_MIN_RANGE;
        const int64_t by_threads = (2 * threads + n_seqs * hkv - 1) / (n_seqs * hkv);
        ranges[s] = threads > 1 && groups[s] == 1 ? by_len < by_threads ? by_len : by_threads : 1;
        ranges[s] = ranges[s] < 1 ? 1 : ranges[s];
        first[s] = n_items, state_at[s] = n_state;
        n_items += hkv * groups[s] * ranges[s];
        n_state += ranges[s] > 1 ? hkv * ranges[s] * rows * (2 + hd) : 0;
    }
    first[n_seqs] = n_items;
    float *state = n_state ? malloc(sizeof(float) * n_state) : NULL;
    if (n_state && !state) {
        free(first), free(groups), free(ranges), free(state_at);
        return 2;
    }
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1)
    for (int64_t i = 0; i < n_items; i++) {
        int64_t s = 0;
        while (first[s + 1] <= i) s++;
        const int64_t local = i - first[s], rows = q_lens[s] * g, kvh = local / (groups[s] * ranges[s]);
        const int64_t gq = local % groups[s], rg = local / groups[s] % ranges[s];
        const int64_t per = (rows + groups[s] * AR - 1) / (groups[s] * AR) * AR;
        const int64_t r_lo = gq * per < rows ? gq * per : rows, r_hi = r_lo + per < rows ? r_lo + per : rows;
        if (r_lo >= r_hi) continue;
        /* ranges in whole spans, so only a sequence's last span is short */
        const int64_t spans = (kv_lens[s] + ASB - 1) / ASB, per_rg = (spans + ranges[s] - 1) / ranges[s];
        const int64_t b = (rg + 1) * per_rg * ASB < kv_lens[s] ? (rg + 1) * per_rg * ASB : kv_lens[s];
        const int64_t a = rg * per_rg * ASB < b ? rg * per_rg * ASB : b;
        float *st = ranges[s] > 1 ? state + state_at[s] + (kvh * ranges[s] + rg) * rows * (2 + hd) : NULL;
        const aitem_t it = {q, k_cache, v_cache, page_table + s * pt_stride, page_size, hq, hkv, hd,
                            (hd + 31) / 32 * 32, g, q_starts[s], q_lens[s], kv_lens[s], kvh, r_lo, r_hi,
                            scale * LOG2E_A, kv_f16 != 0};
        if (st && a == b) { /* a range past the keys (rounding): no weight */
            for (int64_t r = 0; r < rows; r++) st[r * (2 + hd)] = -INFINITY;
            continue;
        }
        if (run_item(&it, a, b, out, st)) failed = 1;
    }
    /* each split row: m = max m_r, l = sum l_r 2^(m_r - m), acc likewise; out = acc / l */
    for (int64_t s = 0; s < n_seqs && !failed; s++) {
        if (ranges[s] < 2) continue;
        const int64_t rows = q_lens[s] * g;
        for (int64_t kvh = 0; kvh < hkv; kvh++)
            for (int64_t r = 0; r < rows; r++) {
                const float *st0 = state + state_at[s] + kvh * ranges[s] * rows * (2 + hd) + r * (2 + hd);
                float m = -INFINITY, l = 0.0f, acc[256] = {0};
                for (int64_t rg = 0; rg < ranges[s]; rg++) {
                    const float mr = st0[rg * rows * (2 + hd)];
                    m = mr > m ? mr : m;
                }
                for (int64_t rg = 0; rg < ranges[s]; rg++) {
                    const float *st = st0 + rg * rows * (2 + hd);
                    if (st[0] == -INFINITY) continue;
                    const float w = exp2f(st[0] - m);
                    l += st[1] * w;
                    for (int64_t d = 0; d < hd; d++) acc[d] += st[2 + d] * w;
                }
                float *o = out + (q_starts[s] + r / g) * hq * hd + (kvh * g + r % g) * hd;
                const float inv = l > 0.0f ? 1.0f / l : 0.0f;
                for (int64_t d = 0; d < hd; d++) o[d] = acc[d] * inv;
            }
    }
    free(first), free(groups), free(ranges), free(state_at), free(state);
    return failed ? 2 : 0;
}
