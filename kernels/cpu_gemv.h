/* Shared between cpu_gemv.c (the 4-bit and Q8 matmuls), cpu_bits.c (the 5-, 6- and 8-bit ones) and
 * cpu_decode.c (a whole decoder layer in one call). */
#pragma once
#include <math.h>
#include <stdint.h>

/* One block of 32 activations rounded to int8 with d = max|x| / 127 (llama.cpp's q8 blocks; ties to even):
 * the codes into q, the sums of each half's codes (16 each) into sums. Every kernel rounds through this, so
 * they all see the same activations (and `round_activations` in cpu_gemv.py is its twin). */
static inline float ab_round_block(const float *v, int8_t *q, int sums[2]) {
    float amax = 0.0f;
    for (int i = 0; i < 32; i++) {
        float f = fabsf(v[i]);
        amax = f > amax ? f : amax;
    }
    const float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
    sums[0] = sums[1] = 0;
    for (int i = 0; i < 32; i++) {
        q[i] = (int8_t)nearbyintf(v[i] * id);
        sums[i / 16] += q[i];
    }
    return d;
}

int ab_q4_matmul(const float *x, int64_t m, int64_t k, const uint8_t *codes, const void *so, int64_t n,
                 int64_t group, float *out, int threads, int half);
