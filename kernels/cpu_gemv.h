/* Shared between cpu_gemv.c (the weight-only matmuls) and cpu_decode.c (a whole decoder layer in one call). */
#pragma once
#include <stdint.h>

int ab_q4_matmul(const float *x, int64_t m, int64_t k, const uint8_t *codes, const void *so, int64_t n,
                 int64_t group, float *out, int threads, int half);
