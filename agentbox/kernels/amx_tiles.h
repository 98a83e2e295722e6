/* What the AMX kernels (cpu_attention_amx.c; cpu_bits_amx.c and cpu_q4_amx.c; cpu_f16_amx.c) need from the OS and
 * the tile unit: the permission to use the tile state, a tile configuration, and the 16 x 16 register transpose
 * they use. They build into three shared libraries, so each library asks once for itself; the permission is per
 * process, so asking twice is harmless. */
#ifndef AB_AMX_TILES_H
#define AB_AMX_TILES_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Linux hands out the 8 KB tile state only on request (5.16+). 1: granted, -1: refused, 0: not asked yet; two
 * threads asking at once both get the same answer. */
static int amx_granted;

static int amx_request(void) {
    if (!amx_granted) amx_granted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
    return amx_granted > 0;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_cfg_t;

/* Loads palette 1 with tiles 0 .. 7 of rows[t] rows of colsb[t] bytes; the configuration is the calling thread's. */
static void amx_configure(const uint8_t rows[8], const uint16_t colsb[8]) {
    amx_cfg_t cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.rows[t] = rows[t], cfg.colsb[t] = colsb[t];
    _tile_loadconfig(&cfg);
}

/* r[i] lane j -> r[j] lane i: a 16 x 16 transpose of 32-bit lanes in four rounds of 16 shuffles. */
static inline void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2)
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]), t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]), r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]), r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88), t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 8; i++)
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88), r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
}

/* r[i] lane j (a tile's row i, column j) out to out + j * stride + i: the first `rows` columns become rows of out,
 * their first `cols` lanes stored. r is clobbered. */
static inline void store_transposed(__m512i r[16], int64_t rows, int64_t cols, float *out, int64_t stride) {
    const __mmask16 mask = cols >= 16 ? 0xffff : (__mmask16)((1u << cols) - 1);
    transpose16(r);
    for (int64_t i = 0; i < rows; i++) _mm512_mask_storeu_epi32(out + i * stride, mask, r[i]);
}

#endif
