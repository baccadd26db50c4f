/* What qmatmul.c and ops.c share: the instruction-set levels and conversions between float32,
 * bfloat16 and float16. */
#ifndef PDSERVE_KERNELS_COMMON_H
#define PDSERVE_KERNELS_COMMON_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { ISA_PORTABLE = 0, ISA_AVX2 = 1, ISA_AVX512VNNI = 2, ISA_AVXVNNI = 3 };

int pd_isa_supported(int isa);

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {  /* round to nearest even, as torch does */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffff) > 0x7f800000) return (uint16_t)((u >> 16) | 0x40);  /* NaN stays NaN */
    u += 0x7fff + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}

static inline float half_to_float(uint16_t h) {  /* IEEE binary16, subnormals included */
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, u;
    if (exp == 0x1f) {
        u = sign | 0x7f800000 | (man << 13);
    } else if (exp) {
        u = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man) {  /* subnormal: normalize */
        int e = -1;
        do { man <<= 1; e++; } while (!(man & 0x400));
        u = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ff) << 13);
    } else {
        u = sign;
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* e^x to about 1e-7 relative error, in plain arithmetic a vectorizing compiler turns into SIMD
 * (glibc's expf stays a scalar call): x = n ln2 + f ln2 with |f| <= 1/2, 2^f from its Taylor
 * series to the 6th power (remainder below (ln2 / 2)^7 / 7! ~ 1.2e-7), 2^n by the exponent bits. */
static inline float pd_expf(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    /* n = t rounded to nearest by adding and taking away 1.5 * 2^23 (exact for |t| < 2^22): unlike
     * floorf, plain arithmetic the vectorizer takes */
    const float t = x * 1.4426950408889634f, n = (t + 12582912.0f) - 12582912.0f;
    const float f = (t - n) * 0.6931471805599453f;
    float p = 1.0f / 720.0f;
    p = p * f + 1.0f / 120.0f;
    p = p * f + 1.0f / 24.0f;
    p = p * f + 1.0f / 6.0f;
    p = p * f + 0.5f;
    p = p * f + 1.0f;
    p = p * f + 1.0f;
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}

#endif
