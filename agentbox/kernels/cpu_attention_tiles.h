/* The register tiles of cpu_attention.c: a span of SB keys in tiles of TK, blocks of MR query rows, and the two
 * passes that run on them in registers: S = Q K^T (qk_pass) and O = O alpha + P V (pv_pass). cpu_attention.c's
 * opening comment says how a block walks a span. */
#ifndef CPU_ATTENTION_TILES_H
#define CPU_ATTENTION_TILES_H

#include "cpu_attention_vec.h"

#define SB 256         /* keys per span (a multiple of TK): its fp32 keys and values ~128 KB at head size 64 (L2) */
#define TK 64          /* keys per tile */
#define MR 6           /* query rows per block (two tokens of a group of 3) */

/* S pass: rows' scores over NV vectors of keys from column c0 of a tile kt [hd][TK], into p from column at + c0.
 * NR x NV chains. */
AI void qk_pass(const int NR, const int NV, const float *qs, int64_t hd, const float *kt, int c0,
                float p[MR][SB], int64_t at) {
    vf s[MR][NVK];
    for (int j = 0; j < NR; j++)
        for (int v = 0; v < NV; v++) s[j][v] = V_ZERO();
    for (int64_t d = 0; d < hd; d++) {
        vf k[NVK];
        for (int v = 0; v < NV; v++) k[v] = V_LOAD(kt + d * TK + c0 + v * VL);
        for (int j = 0; j < NR; j++) {
            const vf qd = V_BCAST(qs + j * hd + d);
            for (int v = 0; v < NV; v++) s[j][v] = V_FMA(qd, k[v], s[j][v]);
        }
    }
    for (int j = 0; j < NR; j++)
        for (int v = 0; v < NV; v++) V_STORE(p[j] + at + c0 + v * VL, s[j][v]);
}

/* P V pass over dims d0 .. d0 + VL (NV - 1) + n of the rows' accumulators (n <= VL floats of the last vector):
 * acc = acc * alpha + sum over keys o < nk of p[o] v[o]. NR x NV chains. */
AI void pv_pass(const int NR, const int NV, float *acc, int64_t hd, const float *alpha, float p[MR][SB],
                const float *vt, int64_t nk, int64_t d0, int n) {
    vf a[MR][NVD];
    for (int j = 0; j < NR; j++) {
        const vf al = V_SET1(alpha[j]);
        for (int v = 0; v < NV; v++)
            a[j][v] = V_MUL(v + 1 < NV || n == VL ? V_LOADU(acc + j * hd + d0 + v * VL)
                                                  : V_LOADN(acc + j * hd + d0 + v * VL, n), al);
    }
    for (int64_t o = 0; o < nk; o++) {
        vf x[NVD];
        for (int v = 0; v < NV; v++)
            x[v] = v + 1 < NV || n == VL ? V_LOADU(vt + o * hd + d0 + v * VL) : V_LOADN(vt + o * hd + d0 + v * VL, n);
        for (int j = 0; j < NR; j++) {
            const vf pj = V_BCAST(&p[j][o]);
            for (int v = 0; v < NV; v++) a[j][v] = V_FMA(pj, x[v], a[j][v]);
        }
    }
    for (int j = 0; j < NR; j++)
        for (int v = 0; v < NV; v++) {
            if (v + 1 < NV || n == VL) V_STOREU(acc + j * hd + d0 + v * VL, a[j][v]);
            else V_STOREN(acc + j * hd + d0 + v * VL, n, a[j][v]);
        }
}

#endif
