/* Quantized weights (the formats of qmatmul.c) expanded to float32 or bfloat16, for products of
 * many rows, which a dense matmul computes faster than byte dot products. A step expands each
 * weight into one buffer its model's layers share, so this runs once per weight and step: it is
 * written per vector width (16 and 8 lanes) with the plain loop as the reference they must match. */
#include "common.h"

#define GROUP 32

/* ---- portable ---- */

static void dequantize_row_portable(int bits, const void *qs, const uint16_t *wd, const uint16_t *wm,
                                    int64_t K, float *row) {
    for (int64_t g = 0; g < K / GROUP; g++) {
        const float d = half_to_float(wd[g]);
        float *o = row + g * GROUP;
        if (bits == 4) {
            const uint8_t *p = (const uint8_t *)qs + g * (GROUP / 2);
            const float m = half_to_float(wm[g]);
            for (int j = 0; j < GROUP / 2; j++) {
                o[j] = d * (float)(p[j] & 15) + m;
                o[j + GROUP / 2] = d * (float)(p[j] >> 4) + m;
            }
        } else {
            const int8_t *p = (const int8_t *)qs + g * GROUP;
            for (int j = 0; j < GROUP; j++) o[j] = d * (float)p[j];
        }
    }
}

static void store_portable(const float *row, int64_t K, void *out, int out_bf16) {
    if (!out_bf16) {
        memcpy(out, row, K * sizeof(float));
        return;
    }
    for (int64_t k = 0; k < K; k++) ((uint16_t *)out)[k] = f32_to_bf16(row[k]);
}

/* ---- 16 lanes (AVX-512F/BW) ---- */
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl")

static inline void store16(__m512 v, void *out, int64_t i, int out_bf16) {
    if (!out_bf16) {
        _mm512_storeu_ps((float *)out + i, v);
        return;
    }
    /* round to nearest even as f32_to_bf16 does; a NaN keeps a mantissa bit */
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    _mm256_storeu_si256((__m256i *)((uint16_t *)out + i), _mm512_cvtepi32_epi16(r));
}

static void dequantize_row_avx512(int bits, const void *qs, const uint16_t *wd, const uint16_t *wm,
                                  int64_t K, void *out, int out_bf16) {
    for (int64_t g = 0; g < K / GROUP; g++) {
        const __m512 d = _mm512_set1_ps(_cvtsh_ss(wd[g]));
        __m512 lo, hi;
        if (bits == 4) {
            const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)((const uint8_t *)qs + g * 16)));
            const __m512 m = _mm512_set1_ps(_cvtsh_ss(wm[g]));
            lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(15))), d, m);
            hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4)), d, m);
        } else {
            const int8_t *p = (const int8_t *)qs + g * GROUP;
            lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p))), d);
            hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 16)))), d);
        }
        store16(lo, out, g * GROUP, out_bf16);
        store16(hi, out, g * GROUP + 16, out_bf16);
    }
}
#pragma GCC pop_options

/* ---- 8 lanes (AVX2) ---- */
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

static inline void store8x2(__m256 a, __m256 b, void *out, int64_t i, int out_bf16) {
    if (!out_bf16) {
        _mm256_storeu_ps((float *)out + i, a);
        _mm256_storeu_ps((float *)out + i + 8, b);
        return;
    }
    __m256i r[2];
    const __m256 v[2] = {a, b};
    for (int h = 0; h < 2; h++) {
        const __m256i u = _mm256_castps_si256(v[h]);
        const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
        const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
        const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v[h], v[h], _CMP_UNORD_Q));
        const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
        r[h] = _mm256_blendv_epi8(rounded, quiet, nan);
    }
    /* packus works within 128-bit lanes: the qword permute puts the 16 values back in order */
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r[0], r[1]), 0xd8);
    _mm256_storeu_si256((__m256i *)((uint16_t *)out + i), packed);
}

static void dequantize_row_avx2(int bits, const void *qs, const uint16_t *wd, const uint16_t *wm,
                                int64_t K, void *out, int out_bf16) {
    for (int64_t g = 0; g < K / GROUP; g++) {
        const __m256 d = _mm256_set1_ps(_cvtsh_ss(wd[g]));
        __m256 v[4];
        if (bits == 4) {
            const uint8_t *p = (const uint8_t *)qs + g * 16;
            const __m256 m = _mm256_set1_ps(_cvtsh_ss(wm[g]));
            const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
            const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8)));
            const __m256i low4 = _mm256_set1_epi32(15);
            v[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(a, low4)), d, m);
            v[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b, low4)), d, m);
            v[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4)), d, m);
            v[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4)), d, m);
        } else {
            const int8_t *p = (const int8_t *)qs + g * GROUP;
            for (int j = 0; j < 4; j++)
                v[j] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8 * j)))), d);
        }
        store8x2(v[0], v[1], out, g * GROUP, out_bf16);
        store8x2(v[2], v[3], out, g * GROUP + 16, out_bf16);
    }
}
#pragma GCC pop_options

/* The weight [N, K] into `out` (float32 or bfloat16). Returns 0, or -1 for arguments it does not take. */
int pd_dequantize(int isa, int threads, int bits, const void *qs, const uint16_t *wd, const uint16_t *wm,
                  int64_t N, int64_t K, void *out, int out_bf16) {
    if ((bits != 4 && bits != 8) || K % GROUP || N < 0 || threads < 1 || (bits == 4 && !wm) ||
        !pd_isa_supported(isa))
        return -1;
    const int64_t G = K / GROUP, row_bytes = bits == 4 ? K / 2 : K, out_row = K * (out_bf16 ? 2 : 4);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const void *q = (const uint8_t *)qs + n * row_bytes;
        const uint16_t *d = wd + n * G, *m = bits == 4 ? wm + n * G : NULL;
        void *o = (uint8_t *)out + n * out_row;
        if (isa == ISA_AVX512VNNI) {
            dequantize_row_avx512(bits, q, d, m, K, o, out_bf16);
        } else if (isa == ISA_AVX2 || isa == ISA_AVXVNNI) {
            dequantize_row_avx2(bits, q, d, m, K, o, out_bf16);
        } else {
            float row[K];
            dequantize_row_portable(bits, q, d, m, K, row);
            store_portable(row, K, o, out_bf16);
        }
    }
    return 0;
}
