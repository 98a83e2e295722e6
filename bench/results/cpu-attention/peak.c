/* fp32 FMA peak of one core: 12 independent 512-bit (or 256-bit) FMA chains, n iterations. */
#include <immintrin.h>
#include <stdint.h>
double ab_peak512(int64_t n) {
    __m512 a[12]; const __m512 x = _mm512_set1_ps(0.999999f), y = _mm512_set1_ps(1e-7f);
    for (int j = 0; j < 12; j++) a[j] = _mm512_set1_ps((float)j);
    for (int64_t i = 0; i < n; i++) {
#pragma GCC unroll 12
        for (int j = 0; j < 12; j++) a[j] = _mm512_fmadd_ps(a[j], x, y);
    }
    __m512 s = a[0]; for (int j = 1; j < 12; j++) s = _mm512_add_ps(s, a[j]);
    return _mm512_reduce_add_ps(s);
}
double ab_peak256(int64_t n) {
    __m256 a[12]; const __m256 x = _mm256_set1_ps(0.999999f), y = _mm256_set1_ps(1e-7f);
    for (int j = 0; j < 12; j++) a[j] = _mm256_set1_ps((float)j);
    for (int64_t i = 0; i < n; i++) {
#pragma GCC unroll 12
        for (int j = 0; j < 12; j++) a[j] = _mm256_fmadd_ps(a[j], x, y);
    }
    __m256 s = a[0]; for (int j = 1; j < 12; j++) s = _mm256_add_ps(s, a[j]);
    float f[8]; _mm256_storeu_ps(f, s); return f[0];
}
